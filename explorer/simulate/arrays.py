"""A graph as flat lists and numpy arrays: node attributes, edges, memory roots, saved tensors."""

from __future__ import annotations

import weakref
from functools import cached_property
from itertools import chain, repeat
from typing import Any, ClassVar

import numpy as np

from explorer.core.graph import OpGraph

#: node kinds as small integers (``GraphArrays.kcode``)
KIND_INPUT, KIND_PARAM, KIND_BUFFER, KIND_OP = 0, 1, 2, 3
_KIND_CODE = {"input": KIND_INPUT, "param": KIND_PARAM, "buffer": KIND_BUFFER, "op": KIND_OP}
# ops whose backward hands an input the incoming gradient itself (or a view of it): see
# GraphArrays.hands_on
_HAND_FIRST, _HAND_ALL, _GETITEM = 1, 2, 3
_HANDS_FIRST = frozenset({"aten.sub.Tensor", "aten.clone.default", "aten.alias.default",
                          "aten.contiguous.default"})
_SLICES_GRAD = frozenset({"aten.cat.default", "aten.concat.default", "aten.stack.default"})
_HANDS_ALL = frozenset({"aten.add.Tensor", "aten.add.Scalar"}) | _SLICES_GRAD
# an op's code by its name alone (the first that applies: getitem, all inputs, the first)
_OP_CODE = {**dict.fromkeys(_HANDS_FIRST, _HAND_FIRST), **dict.fromkeys(_HANDS_ALL, _HAND_ALL),
            "getitem": _GETITEM}


class GraphArrays:
    """Per-node attributes, the edge list, memory roots and saved tensors of a graph, as lists
    and numpy arrays.

    They depend on the graph alone, so they are kept for the last few graphs simulated (the
    partitioners simulate one graph many times). An entry serves only the same graph object
    while its nodes are equal to those it was made from, so editing a graph's nodes is noticed
    (its edges come from the graph's own cached ``preds``).
    """

    _cache: ClassVar[dict[int, tuple[Any, tuple, GraphArrays]]] = {}
    _CACHED = 4

    @classmethod
    def of(cls, g: OpGraph) -> GraphArrays:
        nodes = g.nodes
        hit = cls._cache.get(id(g))
        if hit is not None:
            ref, snapshot, arrays = hit
            if ref() is g and snapshot == tuple(nodes):  # (identical nodes compare quickly)
                return arrays
        arrays = cls(g)
        cache = cls._cache

        def forget(r: Any, k: int = id(g)) -> None:
            if cache.get(k, (None,))[0] is r:
                del cache[k]

        try:
            ref = weakref.ref(g, forget)
        except TypeError:
            return arrays
        cache.pop(id(g), None)
        cache[id(g)] = (ref, tuple(nodes), arrays)
        while len(cache) > cls._CACHED:
            del cache[next(iter(cache))]
        return arrays

    @classmethod
    def clear_cache(cls) -> None:
        """Forget the arrays kept for the graphs simulated last."""
        cls._cache.clear()

    def __init__(self, g: OpGraph) -> None:
        nodes = g.nodes
        self.n = N = len(nodes)
        self._preds, self._index = g.preds, g.index
        # one pass over the nodes (much faster than one pass per attribute on large graphs)
        cols: list[list] = [[] for _ in range(11)]
        name, kind, rg, out_bytes, param_bytes, view, extra, saves, op, outs, scratch = (
            c.append for c in cols)
        for n in nodes:
            name(n.name)
            kind(n.kind)
            rg(n.requires_grad)
            out_bytes(n.out_bytes)
            param_bytes(n.param_bytes)
            view(n.is_view)
            extra(n.saved_extra_bytes)
            saves(n.saves)
            op(n.op)
            outs(len(n.shapes))
            scratch(n.backward_scratch_bytes)
        (self.names, self.kinds, rg_l, self.out_bytes, self.param_bytes, self._views,
         self._extra, self._saves, self._ops, self._outputs, self._scratch) = cols
        self.kcode = np.fromiter(map(_KIND_CODE.__getitem__, self.kinds), dtype=np.int8,
                                 count=N)
        self.is_op = self.kcode == KIND_OP
        self.rg = np.array(rg_l, dtype=bool)
        self.has_b = self.is_op & self.rg
        self.pbytes = np.array(self.param_bytes, dtype=np.int64)
        preds = g.preds
        lens = np.fromiter(map(len, preds), dtype=np.int64, count=N)
        self.e_p = np.fromiter(chain.from_iterable(preds), dtype=np.int64, count=int(lens.sum()))
        self.e_c = np.repeat(np.arange(N, dtype=np.int64), lens)  # by consumer, inputs in order
        self.trainable = np.flatnonzero((self.kcode != KIND_BUFFER) & (self.pbytes != 0)).tolist()
        self.pg = np.flatnonzero((self.kcode == KIND_PARAM) & self.rg)  # trainable weights

    @cached_property
    def grad_named(self) -> np.ndarray:
        """Whether a node's name starts with "grad " (as the labels of gradient sends do)."""
        return np.fromiter(map(str.startswith, self.names, repeat("grad ", self.n)), dtype=bool,
                           count=self.n)

    @cached_property
    def names_obj(self) -> np.ndarray:
        return np.array(self.names, dtype=object)

    @cached_property
    def out_b(self) -> np.ndarray:
        return np.asarray(self.out_bytes, dtype=np.int64)

    @cached_property
    def extra(self) -> np.ndarray:
        return np.array(self._extra, dtype=np.int64)

    @cached_property
    def scratch(self) -> np.ndarray:
        """Per node, what its backward holds beyond its inputs' gradients while it runs
        (``OpNode.backward_scratch_bytes``)."""
        return np.array(self._scratch, dtype=np.int64)

    @cached_property
    def root(self) -> list[int]:
        """For views and in-place ops, the node whose memory they share: a view's root is its
        first input's root."""
        root = list(range(self.n))
        preds = self._preds
        for i in np.flatnonzero(np.array(self._views, dtype=bool)).tolist():
            if preds[i]:
                root[i] = root[preds[i][0]]
        return root

    @cached_property
    def root_a(self) -> np.ndarray:
        return np.asarray(self.root, dtype=np.int64)

    @cached_property
    def hands_on(self) -> tuple[np.ndarray, np.ndarray]:
        """Per edge (``e_p``, ``e_c``): whether the consumer's backward hands the producer its
        own incoming gradient (or views of it) instead of making a new tensor, and whether that
        is a getitem taking one piece of a multi-output producer's gradient.

        Autograd does so for views of the same size (their backward views the gradient back),
        getitem, same-size add (and the first input of sub), clone and alias, and cat (each
        input gets a slice of the gradient)."""
        N = self.n
        outputs = np.fromiter(self._outputs, dtype=np.int64, count=N)
        multi = self.is_op & (outputs > 1)
        code = np.fromiter(map(_OP_CODE.get, self._ops, repeat(0, N)), dtype=np.int8, count=N)
        first = (code == 0) & np.array(self._views, dtype=bool) & (outputs == 1)
        code[first] = _HAND_FIRST
        code[~self.is_op] = 0
        e_p, e_c = self.e_p, self.e_c
        cc = code[e_c]
        first_in = np.ones(len(e_c), dtype=bool)  # the edge is its consumer's first input
        first_in[1:] = e_c[1:] != e_c[:-1]
        same = self.out_b[e_p] == self.out_b[e_c]
        piece = (cc == _GETITEM) & multi[e_p]
        hand = (piece | (cc == _HAND_ALL) & (same | self._cat[e_c])
                | ((cc == _HAND_FIRST) | (cc == _GETITEM)) & first_in & same)
        return hand, piece

    @cached_property
    def _cat(self) -> np.ndarray:
        return np.fromiter(map(_SLICES_GRAD.__contains__, self._ops), dtype=bool, count=self.n)

    @cached_property
    def saved(self) -> tuple[np.ndarray, np.ndarray]:
        """(producer root, node whose backward keeps it) for every saved op or input output."""
        p, v = self.saved_any
        keep = (self.kcode[p] == KIND_OP) | (self.kcode[p] == KIND_INPUT)
        return p[keep], v[keep]

    @cached_property
    def saved_any(self) -> tuple[np.ndarray, np.ndarray]:
        """(saved node's root, node whose backward keeps it) for every saved tensor, views of
        weights and buffers too (a stage that receives one holds its own copy)."""
        saves = self._saves
        lens = np.fromiter(map(len, saves), dtype=np.int64, count=self.n)
        idx = np.fromiter(map(self._index.__getitem__, chain.from_iterable(saves)),
                          dtype=np.int64, count=int(lens.sum()))
        return self.root_a[idx], np.repeat(np.arange(self.n, dtype=np.int64), lens)


def ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges ``lo[k]:hi[k]``, every (k, index) pair, as two arrays."""
    counts = hi - lo
    k = np.repeat(np.arange(len(lo)), counts)
    idx = np.arange(len(k)) - np.repeat(np.cumsum(counts) - counts, counts) + lo[k]
    return k, idx


def sums_by_stage(S: int, stage: np.ndarray, nbytes: np.ndarray) -> list[int]:
    """``nbytes`` summed by ``stage`` (0 .. S - 1), as Python ints (int64 sums: exact in any
    order)."""
    out = np.zeros(S, dtype=np.int64)
    np.add.at(out, stage, np.asarray(nbytes, dtype=np.int64))
    return out.tolist()
