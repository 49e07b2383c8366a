"""Repeated blocks: capture a few of a model's identical layers and grow the graph to all of them.

Transformer layers repeat. When a model holds a ``ModuleList`` or ``Sequential`` of at least
:data:`MIN_BLOCKS` structurally identical blocks (same module types, parameter and buffer shapes
and dtypes, same plain attributes apart from the layer's own index, no hooks, nothing shared),
capture traces the model with the list cut to two blocks and to three, then builds the graph of
all of them by cloning the last block: its nodes renamed (``layers.2`` -> ``layers.3`` ...,
``linear_14`` -> ``linear_21`` as torch.export would number them), reading the previous block
where the template read its predecessor and the nodes computed before the blocks (masks, rotary
tables) where the template read those. What follows the blocks is renumbered the same way.

Nothing is assumed that the two cut captures do not show: growing the two-block graph by one
block must give the three-block graph exactly (every node, name, edge, FLOP count and saved
tensor), otherwise :class:`NotRepeating` says why and capture traces the whole model instead.
Attributes holding a block's own index (Hugging Face's ``layer_idx``) are watched while the cut
model is traced: a block that computes with its index is traced in full.

Before that, the whole model runs once on fake tensors with only its first block computed (every
later block returns that block's output, so the run costs little at any depth): every block
must be called once, in turn, with arguments of the same kinds (a loop over ``layers[:n]``, or
a loop index handed to each block, makes the blocks be traced in full).
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from explorer.core.graph import OpGraph, OpNode

#: the fewest identical blocks worth reusing (the cut captures hold three)
MIN_BLOCKS = 4
#: blocks in the two cut captures: the larger one's last block is the template
CUT_BLOCKS = (2, 3)

_SUFFIX = re.compile(r"^(.*)_(\d+)$")
#: the name torch.export gives a tensor constant it lifts out of the forward (numbered)
LIFTED = "lifted_tensor"
_HEAD, _TAIL = -1, -2  # labels of the nodes before the blocks and of the ops after them


class NotRepeating(Exception):
    """The blocks cannot be reused safely; the message says why."""


@dataclass
class BlockList:
    """A list of identical blocks inside a model: where it is and how to cut it."""

    parent: nn.Module
    attr: str
    path: str  # module path of the list in the user's model ("layers", "model.layers")
    keys: list[str]  # child names, in order
    #: (submodule path inside a block, attribute) holding the block's own index (HF layer_idx)
    index_attrs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def container(self) -> nn.Module:
        return self.parent._modules[self.attr]

    def prefix(self, i: int) -> str:
        return f"{self.path}.{self.keys[i]}"

    @contextlib.contextmanager
    def cut(self, k: int) -> Iterator[None]:
        """Inside, the list holds its first ``k`` blocks only (same names)."""
        full = self.container
        first = OrderedDict(list(full._modules.items())[:k])
        self.parent._modules[self.attr] = (nn.Sequential(first) if type(full) is nn.Sequential
                                           else nn.ModuleList(first.values()))
        try:
            yield
        finally:
            self.parent._modules[self.attr] = full

    @contextlib.contextmanager
    def watched(self) -> Iterator[list[str]]:
        """Inside, the blocks' index attributes note every use of their value in the list
        yielded: a block that computes with its index may differ from the blocks traced."""
        reads: list[str] = []
        undo = []
        for i, block in enumerate(self.container._modules.values()):
            for sub, attr in self.index_attrs:
                m = block.get_submodule(sub)
                undo.append((m, attr, getattr(m, attr)))
                setattr(m, attr, _IndexProbe(i, reads, f"{sub}.{attr}".lstrip(".")))
        try:
            yield reads
        finally:
            for m, attr, v in reversed(undo):
                setattr(m, attr, v)

    @contextlib.contextmanager
    def stubbed(self) -> Iterator[list[tuple[int, Any]]]:
        """Inside, the first block called runs and every later call returns its output: a
        cheap run of the whole model that yields each block call (index, argument kinds)."""
        calls: list[tuple[int, Any]] = []
        first: list[Any] = []
        blocks = list(self.container._modules.values())
        own = [block.__dict__.get("forward") for block in blocks]  # a forward set on the object
        for i, block in enumerate(blocks):
            def forward(*args: Any, _i: int = i, _real: Any = block.forward, **kwargs: Any) -> Any:
                calls.append((_i, _kinds((args, kwargs))))
                if not first:
                    first.append(_real(*args, **kwargs))
                return first[0]
            block.__dict__["forward"] = forward
        try:
            yield calls
        finally:
            for block, mine in zip(blocks, own, strict=True):
                if mine is None:
                    del block.__dict__["forward"]
                else:
                    block.__dict__["forward"] = mine

    def check_calls(self, calls: list[tuple[int, Any]]) -> None:
        """Raise :class:`NotRepeating` unless a run called every block once, in order, with
        arguments of the same kinds (tensor shapes and dtypes, equal plain values)."""
        order = [i for i, _ in calls]
        if order != list(range(len(self.keys))):
            raise NotRepeating(f"the model called the blocks of {self.path} in the order "
                               f"{order[:8]}{'...' if len(order) > 8 else ''}, not each once "
                               "in turn")
        if any(kinds != calls[0][1] for _, kinds in calls):
            raise NotRepeating(f"the blocks of {self.path} are called with different "
                               "arguments (a loop index?)")


def _kinds(v: Any) -> Any:
    """A call's arguments with tensors as (shape, dtype) and other values as themselves."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if isinstance(v, (tuple, list)):
        return tuple(_kinds(x) for x in v)
    if isinstance(v, dict):
        return tuple((k, _kinds(x)) for k, x in v.items())
    return v if _plain(v) else ("object", id(v))


class _IndexProbe(int):
    """An int that notes in ``reads`` each time its value is used."""

    def __new__(cls, value: int, reads: list[str], name: str) -> _IndexProbe:
        probe = super().__new__(cls, value)
        probe.reads, probe.name = reads, name
        return probe


def _noting(method: str) -> Any:
    def use(self: _IndexProbe, *args: Any) -> Any:
        self.reads.append(self.name)
        return getattr(int, method)(self, *args)
    return use


for _method in ("eq ne lt le gt ge hash index int float bool add radd sub rsub mul rmul "
                "truediv rtruediv floordiv rfloordiv mod rmod pow rpow neg abs and rand or "
                "ror xor rxor lshift rshift format repr str").split():
    setattr(_IndexProbe, f"__{_method}__", _noting(f"__{_method}__"))


def _plain(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype))


def _attribute(v: Any) -> Any:
    """What of an attribute's value is compared across blocks."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if _plain(v):
        return v
    if callable(v) and hasattr(v, "__qualname__"):  # a function or a class
        return ("callable", getattr(v, "__module__", ""), v.__qualname__)
    fields = sorted((k, x) for k, x in getattr(v, "__dict__", {}).items() if _plain(x))
    return ("object", type(v).__qualname__, tuple(fields))


def _structure(block: nn.Module) -> tuple[tuple, dict[tuple[str, str], Any]]:
    """A block's structural fingerprint, and its plain attributes (compared across blocks)."""
    mods, attrs = [], {}
    for path, m in block.named_modules(remove_duplicate=False):
        hooks = (len(m._forward_hooks) + len(m._forward_pre_hooks)
                 + len(m._backward_hooks) + len(getattr(m, "_backward_pre_hooks", {})))
        mods.append((path, type(m).__module__, type(m).__qualname__, m.training, hooks))
        for key, v in vars(m).items():
            if key.startswith("_") or key == "training":
                continue
            attrs[(path, key)] = _attribute(v)
    params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad)
                   for k, p in block.named_parameters(remove_duplicate=False))
    buffers = tuple((k, tuple(b.shape), b.dtype)
                    for k, b in block.named_buffers(remove_duplicate=False))
    return (tuple(mods), params, buffers), attrs


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for path, m in model.named_modules():
        kids = list(m._modules.values())
        if (path and type(m) in (nn.ModuleList, nn.Sequential) and len(kids) >= MIN_BLOCKS
                and len({type(c) for c in kids}) == 1):
            out.append((path, m))
    return out


def find_blocks(model: nn.Module) -> BlockList | None:
    """The model's largest list of repeated blocks; None when it has none.

    Raises :class:`NotRepeating` when the list's blocks look alike but differ in structure,
    in a plain attribute (other than the block's own index) or share state.
    """
    found = _candidates(model)
    if not found:
        return None
    path, lst = max(found, key=lambda c: sum(p.numel() for p in c[1].parameters()))
    blocks = list(lst._modules.values())
    if len({id(b) for b in blocks}) != len(blocks):
        raise NotRepeating(f"{path} holds the same module more than once")
    shapes = [_structure(b) for b in blocks]
    for i, (fp, _) in enumerate(shapes):
        if fp != shapes[0][0]:
            raise NotRepeating(f"{path}.{i} differs in structure from {path}.0")
    index_attrs = []
    for key in sorted(set().union(*(a.keys() for _, a in shapes)), key=str):
        values = [a.get(key) for _, a in shapes]
        if all(v == values[0] for v in values):
            continue
        if values != list(range(len(values))):
            raise NotRepeating(f"attribute {key[1]!r} of {path}.<i>.{key[0]} differs "
                               "between blocks")
        index_attrs.append(key)
    owned: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for t in (*b.parameters(), *b.buffers()):
            if owned.setdefault(id(t), i) != i:
                raise NotRepeating(f"blocks of {path} share a parameter or buffer")
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        if id(t) in owned and not name.startswith(path + "."):
            raise NotRepeating(f"{name} is shared between {path} and the rest of the model")
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    return BlockList(parent, attr, path, list(lst._modules), index_attrs)


def _split(name: str) -> tuple[str, int]:
    m = _SUFFIX.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _join(base: str, num: int) -> str:
    return f"{base}_{num}" if num else base


class _Layout:
    """One cut graph's nodes labelled: block index, head (before the blocks) or tail."""

    def __init__(self, graph: OpGraph, blocks: BlockList, k: int) -> None:
        self.graph, self.k = graph, k
        prefixes = [blocks.prefix(i) + "." for i in range(k)]

        def block_of(n: OpNode) -> int | None:
            where = n.name if n.kind != "op" else n.module_path + "."
            return next((i for i, p in enumerate(prefixes) if where.startswith(p)), None)

        found = [block_of(n) for n in graph.nodes]
        ops = [i for i, n in enumerate(graph.nodes) if n.kind == "op"]
        in_blocks = [i for i in ops if found[i] is not None]
        if not in_blocks:
            raise NotRepeating("no op runs inside the blocks")
        first, last = in_blocks[0], in_blocks[-1]
        order = [found[i] for i in ops if first <= i <= last]
        if None in order:
            raise NotRepeating("an op outside the blocks runs between them")
        if order != sorted(order) or set(order) != set(range(k)):
            raise NotRepeating("the blocks do not run one after the other")
        self.label = {n.name: (_TAIL if n.kind == "op" and i > last else _HEAD)
                      if found[i] is None else found[i] for i, n in enumerate(graph.nodes)}
        self.members = [[n for n in graph.nodes if self.label[n.name] == i] for i in range(k)]
        if len({len(m) for m in self.members}) != 1:
            raise NotRepeating("the blocks have different numbers of nodes")

    def tail_ops(self) -> list[OpNode]:
        return [n for n in self.graph.nodes if self.label[n.name] == _TAIL]


def _lifted(name: str) -> str | None:
    """The last part of a lifted constant's name (``lifted_tensor_4`` in
    ``h.2.attn.lifted_tensor_4``: a tensor the forward made, numbered across the whole model
    as ops are), None for any other parameter, buffer or input."""
    last = name.rsplit(".", 1)[-1]
    return last if _split(last)[0] == LIFTED else None


def _count_steps(pairs: list[tuple[OpNode, OpNode]], steps: dict[str, int]) -> None:
    """How far each op (and lifted constant) name's number moves per block, from (earlier,
    later) node pairs."""
    for a, b in pairs:
        name_a, name_b = a.name, b.name
        if a.kind != "op":
            name_a, name_b = _lifted(a.name), _lifted(b.name)
            if name_a is None or name_b is None:
                continue
        (base_a, num_a), (base_b, num_b) = _split(name_a), _split(name_b)
        if base_a != base_b or a.op != b.op:
            raise NotRepeating(f"{a.name} and {b.name} do not correspond")
        if steps.setdefault(base_a, num_b - num_a) != num_b - num_a:
            raise NotRepeating(f"ops named {base_a} are not numbered block by block")


class _Grower:
    """Grows a cut graph of ``k`` blocks into one of ``m`` blocks."""

    def __init__(self, layout: _Layout, blocks: BlockList, steps: dict[str, int]) -> None:
        self.layout, self.blocks, self.steps = layout, blocks, steps
        k = layout.k
        self.last = k - 1
        self.template = {n.name: p for p, n in enumerate(layout.members[k - 1])}
        self.before = {n.name: p for p, n in enumerate(layout.members[k - 2])}
        self.names: dict[int, list[str]] = {}

    def _shift(self, name: str, n_steps: int) -> str:
        base, num = _split(name)
        if base not in self.steps:
            raise NotRepeating(f"cannot tell how {name} is numbered in a deeper model")
        return _join(base, num + n_steps * self.steps[base])

    def _path(self, path: str, i: int) -> str:
        old, new = self.blocks.prefix(self.last), self.blocks.prefix(i)
        if path == old:
            return new
        if not path.startswith(old + "."):
            raise NotRepeating(f"{path} is not inside {old}")
        return new + path[len(old):]

    def block_names(self, i: int) -> list[str]:
        """Node names of block ``i`` (``i`` >= the template's index), by position."""
        if i not in self.names:
            tpl = self.layout.members[self.last]
            self.names[i] = [
                n.name if i == self.last else
                self._shift(n.name, i - self.last) if n.kind == "op" else
                self._constant(n.name, i) for n in tpl]
        return self.names[i]

    def _constant(self, name: str, i: int) -> str:
        """A parameter, buffer or constant of the template as block ``i``'s: its path moved,
        a lifted constant's number shifted too."""
        moved = self._path(name, i)
        last = _lifted(name)
        if last is None:
            return moved
        return f"{moved[:-len(last)]}{self._shift(last, i - self.last)}"

    def grow(self, m: int) -> tuple[list[OpNode], dict[str, str]]:
        """The nodes of the graph with ``m`` blocks; tail op names old -> new."""
        nodes = self.layout.graph.nodes
        label = self.layout.label
        extra = m - 1 - self.last
        tail = {n.name: self._shift(n.name, extra) for n in self.layout.tail_ops()}
        out: list[OpNode] = []
        run: list[OpNode] = []
        for idx, n in enumerate(nodes):
            lab = label[n.name]
            if lab == _TAIL:
                out.append(replace(n, name=tail[n.name],
                                   inputs=tuple(self._tail_ref(r, m, tail) for r in n.inputs),
                                   saves=tuple(self._tail_ref(r, m, tail) for r in n.saves)))
                continue
            out.append(n)
            if lab != self.last:
                continue
            run.append(n)
            if idx + 1 == len(nodes) or label[nodes[idx + 1].name] != self.last:
                for i in range(self.last + 1, m):
                    out.extend(self._clone(r, i) for r in run)
                run = []
        return out, tail

    def _clone(self, n: OpNode, i: int) -> OpNode:
        """Template node ``n`` as the node at its place in block ``i``."""
        def ref(r: str) -> str:
            lab = self.layout.label[r]
            if lab == self.last:
                return self.block_names(i)[self.template[r]]
            if lab == self.last - 1:
                return self.block_names(i - 1)[self.before[r]]
            if lab == _HEAD:
                return r
            raise NotRepeating(f"{n.name} reads {r}, which is neither its own block, the one "
                               "before it nor computed before the blocks")

        return replace(n, name=self.block_names(i)[self.template[n.name]],
                       module_path=self._path(n.module_path, i) if n.module_path else "",
                       inputs=tuple(ref(r) for r in n.inputs),
                       saves=tuple(ref(r) for r in n.saves))

    def _tail_ref(self, r: str, m: int, tail: dict[str, str]) -> str:
        lab = self.layout.label[r]
        if lab == _HEAD:
            return r
        if lab == _TAIL:
            return tail[r]
        if lab == self.last:
            return self.block_names(m - 1)[self.template[r]]
        raise NotRepeating(f"{r} of an earlier block is read after the blocks")


def grow_graph(small: OpGraph, large: OpGraph, blocks: BlockList, n_blocks: int) -> OpGraph:
    """The graph of all ``n_blocks`` blocks from captures cut to ``CUT_BLOCKS`` blocks.

    Raises :class:`NotRepeating` unless growing ``small`` by one block gives ``large`` exactly.
    """
    k_small, k_large = CUT_BLOCKS
    lay_s, lay_l = _Layout(small, blocks, k_small), _Layout(large, blocks, k_large)
    steps: dict[str, int] = {}
    _count_steps(list(zip(lay_l.members[k_large - 2], lay_l.members[k_large - 1],
                          strict=True)), steps)
    tail_s, tail_l = lay_s.tail_ops(), lay_l.tail_ops()
    if len(tail_s) != len(tail_l):
        raise NotRepeating("what follows the blocks changes with their number")
    _count_steps(list(zip(tail_s, tail_l, strict=True)), steps)
    grown, _ = _Grower(lay_s, blocks, steps).grow(k_large)
    if grown != large.nodes:
        diff = next((a.name for a, b in zip(grown, large.nodes, strict=False) if a != b),
                    "the node count")
        raise NotRepeating(f"growing {k_small} blocks by one does not give the captured "
                           f"{k_large} (first difference at {diff})")
    nodes, tail = _Grower(lay_l, blocks, steps).grow(n_blocks)
    return OpGraph(large.name, nodes, large.batch_size, large.source,
                   tail.get(large.loss, large.loss), large.notes)
