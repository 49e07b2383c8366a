"""Tensor-parallel layouts derived from the graph, Megatron-style: which weights a stage's tensor
devices split, along which dimension, which ops then run on a share of the work, and what each
split block all-reduces.

Linears are grouped within their parent module, in graph order: a linear that reads earlier
ones through element-wise ops only is row-parallel (weight split along the input features,
``Shard(1)``; bias whole) and those it reads are column-parallel (weight and bias split along
the output features, ``Shard(0)``): an MLP's up projection, or a SwiGLU's gate and up, so the
activations between them stay split and the block all-reduces its output once in the forward
and its input's gradient once in the backward (Megatron-LM's MLP block). Attention splits by whole
heads: the query, key and value projections are column-parallel, the output projection
row-parallel, and the ops between them (the views into heads, rotary embedding, grouped keys
and values, the attention itself, written as one op or as matmuls, a mask and a softmax) run on
each device's own heads as plain tensors (``local_ops``: the runtime divides their shape
arguments' head or feature count by the degree), which needs every head count to divide by the
degree. A fused query-key-value projection (a GPT's, its output split into three equal parts)
is split by heads within each part: each device holds its heads' rows of the query, of the key
and of the value (DTensor's ``_StridedShard(dim=0, sf=3)``), and the split's sizes are divided
by the degree. A linear whose weight is stored transposed, ``(in, out)`` (Hugging Face's
``Conv1D`` in GPT-2: ``addmm(bias, x, weight)`` on its input's rows), pairs the same way, its
weight split along dim 1 when column-parallel and dim 0 when row-parallel; the views that
flatten its input to rows and its output back run on the split features (``local_ops``).
Linears with anything else between them stay replicated. An embedding of the
batch's token ids is vocabulary-parallel (``Shard(0)``: each device looks up its rows, the
output is all-reduced).
A linear whose output reaches a cross-entropy loss only through shape ops that keep the classes
last (a reshape to ``(N, classes)``, a slice along the sequence), its weight not split by another
rule, is vocabulary-parallel too, Megatron-LM's ``vocab_parallel_cross_entropy``: the linear is
column-parallel (each device holds its share of the logits, the biggest activation of a language
model), the shape ops and the loss are split ops run on that share (:data:`VOCAB_OPS`,
:data:`LOSS_OPS`: the runtime tells them by their op, they are not ``local_ops``), and the loss
all-reduces three numbers per row (the maximum logit, the target's logit, the sum of
exponentials); its output is the whole loss. Only a loss with class-index targets and no class
weights splits: one with label smoothing (which the graph does not record) runs whole in the
runtime, on gathered logits. And only a classifier with at least as many classes as input
features splits (a language model's vocabulary, not ten classes of an image): then its logits,
which the split divides, weigh at least as much as its input's gradient, which the split
all-reduces.

Convolutions pair the same way, on channels: a convolution that another one of the same parent
module reads through element-wise ops only (a ReLU) is column-parallel (weight ``(out, in,
*kernel)`` and bias split along the output channels, ``Shard(0)``), the reader row-parallel
(weight split along the input channels, ``Shard(1)``; bias added once after the all-reduce);
the activations between are split along their channel dimension (1 of NCHW, :func:`split_dim`
counts it from the end). Only ungrouped convolutions pair, and only with element-wise ops and
no random op between: a pool, a batch norm or a dropout between two convolutions keeps them
whole.
Everything else is replicated; a stage whose degree splits none of its ops is named, with
the reason, by :func:`unsplit_notes`. Placements are DTensor's, written as text (``"Shard(0)"``,
``"Replicate()"``) so plans and simulators need no torch.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

from explorer.core.graph import OpGraph

REPLICATE = "Replicate()"
#: ops that act element by element (activations, dropout, scaling, gating): between a
#: column- and a row-parallel linear they run on the split features as they are. Anything
#: else between two linears (a split into heads, a reshape) would need the whole features, so
#: such a pair stays whole (DTensor would gather the features back, which is no saving)
POINTWISE = frozenset(f"aten.{op}" for op in (
    "relu.default", "gelu.default", "silu.default", "tanh.default", "sigmoid.default",
    "dropout.default", "mul.Tensor", "mul.Scalar", "add.Tensor", "sub.Tensor", "div.Tensor",
    "div.Scalar", "neg.default", "pow.Tensor_Scalar", "erf.default", "exp.default",
    "clone.default", "alias.default", "native_dropout.default", "hardtanh.default",
    "leaky_relu.default", "elu.default", "mish.default"))
#: random ops: the runtime runs them on whole values (every rank draws the mask one device
#: would), so inside a split block their input is gathered first and they are not split
RANDOM_OPS = frozenset(("aten.dropout.default", "aten.native_dropout.default",
                        "aten.bernoulli.default", "aten.bernoulli.p", "aten.rand_like.default"))
#: ops of an attention core that run on a device's own heads unchanged but for the head or
#: feature count in a view's or reshape's shape (the runtime divides it)
HEAD_OPS = POINTWISE | frozenset(f"aten.{op}" for op in (
    "view.default", "reshape.default", "_unsafe_view.default", "transpose.int",
    "slice.Tensor", "cat.default", "repeat_interleave.self_int", "unsqueeze.default",
    "scaled_dot_product_attention.default", "expand.default", "contiguous.default",
    "split.Tensor", "split_with_sizes.default", "matmul.default", "bmm.default",
    "masked_fill.Scalar", "softmax.int", "_softmax.default")) | {"getitem"}
#: splits of a fused projection's output into its parts (a GPT's query, key and value): the
#: runtime divides their sizes
SPLIT_OPS = frozenset(("aten.split.Tensor", "aten.split_with_sizes.default"))
#: the shape ops of :data:`HEAD_OPS`, whose head count the runtime divides
RESHAPE_OPS = frozenset(("aten.view.default", "aten.reshape.default",
                         "aten._unsafe_view.default"))
#: ops that act on each token (position) alone: between the split blocks they run on a
#: sequence shard as they are (Megatron-LM's sequence parallelism): element-wise ops, norms
#: over the features, a mean over them (an RMS norm written out), casts
TOKENWISE = (POINTWISE - RANDOM_OPS) | frozenset(f"aten.{op}" for op in (
    "layer_norm.default", "native_layer_norm.default", "rms_norm.default", "mean.dim",
    "rsqrt.default", "sqrt.default", "to.dtype", "_to_copy.default", "type_as.default"))
#: random ops that run on a sequence shard too: each device draws the whole mask, as one
#: device would, and applies its positions' part
SEQUENCE_RANDOM = frozenset(("aten.dropout.default", "aten.native_dropout.default"))
LINEAR_OPS = ("aten.linear.default",)
#: linears whose weight is stored transposed, ``(in, out)``: Hugging Face's ``Conv1D`` (GPT-2)
#: computes ``addmm(bias, x, weight)`` on its input flattened to rows ``(batch * seq, in)``;
#: column-parallel it splits its weight's dim 1 and its bias, row-parallel its weight's dim 0
TRANSPOSED_OPS = ("aten.addmm.default",)
#: convolutions that pair like linears, on channels, by their weight's number of dimensions
CONV_OPS = {"aten.conv1d.default": 3, "aten.conv2d.default": 4, "aten.conv3d.default": 5}
EMBEDDING_OPS = ("aten.embedding.default",)
#: cross-entropy losses whose logits a column-parallel linear may split along the classes
LOSS_OPS = ("aten.cross_entropy_loss.default",)
#: ops that may lie between such a linear and its loss: they keep the classes last, and run on
#: a device's share of them unchanged but for a view's or reshape's class count
VOCAB_OPS = RESHAPE_OPS | frozenset(("aten.slice.Tensor", "aten.contiguous.default",
                                     "aten.clone.default", "aten.alias.default",
                                     "aten.flatten.using_ints"))
#: bytes per row a vocabulary-parallel loss all-reduces: three fp32 numbers
VOCAB_LOSS_ROW_BYTES = 3 * 4


def shard(dim: int) -> str:
    return f"Shard({dim})"


def strided_shard(dim: int, parts: int) -> str:
    """The placement of a fused projection's weight of ``parts`` equal parts (a GPT's query,
    key and value rows) split by heads: each device holds its share of every part, as DTensor's
    ``_StridedShard`` lays it out (written as its ``repr``)."""
    return f"_StridedShard(dim={dim}, sf={parts})"


_STRIDED = re.compile(r"_StridedShard\(dim=(\d+), sf=(\d+)\)")


def shard_dim(placement: str) -> int | None:
    """The dimension a ``"Shard(d)"`` (or strided) placement splits; None for
    ``"Replicate()"``."""
    if placement.startswith("Shard(") and placement.endswith(")"):
        return int(placement[len("Shard("):-1])
    strided = _STRIDED.fullmatch(placement)
    return int(strided.group(1)) if strided else None


def shard_parts(placement: str) -> int:
    """How many equal parts a strided placement splits each of (1 for any other)."""
    strided = _STRIDED.fullmatch(placement)
    return int(strided.group(2)) if strided else 1


def out_dim(op: str) -> int:
    """The dimension of an op's weight that holds its output features (or channels): 1 for a
    transposed linear's ``(in, out)``, else 0 (``(out, in, *kernel)``); the input's are the
    other of the first two."""
    return 1 if op in TRANSPOSED_OPS else 0


def split_dim(weight_ndim: int) -> int:
    """The dimension, counted from the end, along which a column-parallel op with a weight of
    ``weight_ndim`` dimensions splits its output (and a row-parallel one its input): the
    features of a linear (-1), the channels of a convolution's ``(batch, channels, *space)``
    (-3 for a 2-D one), which counts the same for an unbatched input."""
    return 1 - weight_ndim


@dataclass(frozen=True)
class TensorLayout:
    """What a ``degree``-way tensor split of a graph does, by node name.

    ``placements``: each split parameter's placement (absent: replicated). ``split_ops``: ops
    whose work is shared by the tensor devices (1/degree each). ``reduce_forward`` /
    ``reduce_backward``: bytes all-reduced over the tensor devices after an op's forward, or in
    its backward (the gradient of its input). ``gather_forward``: bytes all-gathered before a
    random op's forward (or, under sequence parallelism, before an op that reads a sequence
    shard whole).

    Under sequence parallelism (:func:`megatron_layout` with ``sequence``): ``sequence_ops``,
    the ops between the split blocks that run on sequence shards (also in ``split_ops``);
    ``scatter_forward``: bytes of partial sums reduce-scattered along the sequence after an
    op's forward (a row-parallel block's output, a vocabulary-parallel embedding's), instead of
    all-reduced; ``gather_backward``: bytes all-gathered in an op's backward (the gradient of
    such an output; a column-parallel linear's sequence-split input, gathered again);
    ``scatter_backward``: bytes reduce-scattered in an op's backward (that input's gradient);
    ``sequence_params``: the weights those ops read whole, whose gradients (partial sums) are
    all-reduced over the tensor devices once a step. ``partial_rows``: row-parallel transposed
    linears (``addmm`` on rows) whose partial sums are reduce-scattered at the view back to
    ``(batch, seq, features)`` after them (in ``scatter_forward``), each device adding its
    share of the bias (bias / degree) first.
    """

    degree: int
    placements: dict[str, str] = field(default_factory=dict)
    split_ops: frozenset[str] = frozenset()
    reduce_forward: dict[str, int] = field(default_factory=dict)
    reduce_backward: dict[str, int] = field(default_factory=dict)
    #: random ops inside a split block: bytes of their input all-gathered before them
    gather_forward: dict[str, int] = field(default_factory=dict)
    #: split ops of head-split attention, run on each device's own heads as plain tensors
    local_ops: frozenset[str] = frozenset()
    sequence_ops: frozenset[str] = frozenset()
    scatter_forward: dict[str, int] = field(default_factory=dict)
    gather_backward: dict[str, int] = field(default_factory=dict)
    scatter_backward: dict[str, int] = field(default_factory=dict)
    sequence_params: frozenset[str] = frozenset()
    partial_rows: frozenset[str] = frozenset()

    def placement(self, param: str) -> str:
        return self.placements.get(param, REPLICATE)

    def is_sharded(self, param: str) -> bool:
        return param in self.placements

    def collectives(self) -> tuple[tuple[bool, str, dict[str, int]], ...]:
        """Every collective the layout implies, as (in the backward?, kind, bytes by op);
        kinds ``"allreduce"``, ``"allgather"`` and ``"reduce_scatter"`` (which move half
        an all-reduce's bytes)."""
        return ((False, "allreduce", self.reduce_forward),
                (True, "allreduce", self.reduce_backward),
                (False, "allgather", self.gather_forward),
                (False, "reduce_scatter", self.scatter_forward),
                (True, "allgather", self.gather_backward),
                (True, "reduce_scatter", self.scatter_backward))

    def collective_ops(self) -> tuple[frozenset[str], frozenset[str]]:
        """The ops that run collectives in their forward, and in their backward."""
        ops = [(backward, op) for backward, _, by_op in self.collectives() for op in by_op]
        return (frozenset(op for backward, op in ops if not backward),
                frozenset(op for backward, op in ops if backward))


def _weight(graph: OpGraph, op: int) -> tuple[int, int | None] | None:
    """(weight, bias) node indices of a linear or embedding op whose weight is a 2-D parameter,
    of a transposed linear (``addmm(bias, x, weight)``, both parameters), or of an ungrouped
    convolution whose weight is a parameter."""
    node = graph.nodes[op]
    if node.op in TRANSPOSED_OPS:
        ins = [graph.index[p] for p in node.inputs]
        kinds = [graph.nodes[k].kind for k in ins]
        if len(ins) != 3 or kinds[0] != "param" or kinds[2] != "param" \
                or kinds[1] not in ("op", "input"):
            return None
        w_shape, b_shape = graph.nodes[ins[2]].shapes[0], graph.nodes[ins[0]].shapes[0]
        return (ins[2], ins[0]) if len(w_shape) == 2 and b_shape == w_shape[1:] else None
    params = [graph.index[p] for p in node.inputs if graph.nodes[graph.index[p]].kind == "param"]
    ndim = CONV_OPS.get(node.op, 2)
    if not params or len(graph.nodes[params[0]].shapes[0]) != ndim:
        return None
    if node.op in CONV_OPS:  # ungrouped: the weight's input channels are all the input's
        x = _activation_in(graph, op)
        shape = graph.nodes[x].shapes[0] if x is not None and graph.nodes[x].shapes else ()
        if len(shape) < ndim - 1 or shape[split_dim(ndim)] != graph.nodes[params[0]].shapes[0][1]:
            return None
    return params[0], params[1] if len(params) > 1 else None


def _divides(graph: OpGraph, param: int, dim: int, degree: int) -> bool:
    return graph.nodes[param].shapes[0][dim] % degree == 0


def _activation_in(graph: OpGraph, op: int) -> int | None:
    """The op's first input that is not a weight (its activation)."""
    for p in graph.nodes[op].inputs:
        if graph.nodes[graph.index[p]].kind in ("op", "input"):
            return graph.index[p]
    return None


def _reach(edges: list[list[int]], start: int, lo: int, hi: int) -> set[int]:
    """Nodes reachable from ``start`` along ``edges`` (``start`` excluded) among the nodes
    ``lo`` to ``hi``: the nodes are in topological order, so a walk between two nodes never
    leaves their range, and bounding it keeps a layout of a deep graph linear in its size."""
    seen: set[int] = set()
    todo = [k for k in edges[start] if lo <= k <= hi]
    while todo:
        k = todo.pop()
        if k not in seen and lo <= k <= hi:
            seen.add(k)
            todo.extend(j for j in edges[k] if lo <= j <= hi)
    return seen


def _block(graph: OpGraph, cols: list[int], row: int, degree: int
           ) -> tuple[list[int], set[int], bool] | None:
    """The column-parallel linears (or convolutions) among ``cols`` that ``row`` reads through
    element-wise ops only (or through an attention core split by whole heads: then True), and
    the ops between them, when ``row`` can be their row-parallel end; else None."""
    nodes = graph.nodes
    if not cols:
        return None
    before = _reach(graph.preds, row, min(cols), row)
    reach = [c for c in cols if c in before]
    if not reach:
        return None
    between = set().union(*(_reach(graph.succs, c, c, row) & before for c in reach))
    rows = {k for k in between if _row_view(graph, k, degree)}
    heads = any(nodes[k].op not in POINTWISE for k in between - rows)
    if nodes[row].op in CONV_OPS and (heads or any(nodes[k].op in RANDOM_OPS for k in between)):
        return None  # (a random op runs whole: what follows it could not find the channels)
    if heads and not _head_aligned(graph, reach, between - rows, degree):
        return None
    if not _divides(graph, _weight(graph, row)[0], 1 - out_dim(nodes[row].op),  # type: ignore[index]
                    degree) or not all(_divides(graph, _weight(graph, c)[0],  # type: ignore[index]
                                                out_dim(nodes[c].op), degree) for c in reach):
        return None
    return reach, between, heads


def _row_view(graph: OpGraph, k: int, degree: int) -> bool:
    """Whether op ``k`` is a view or reshape that only flattens or unflattens the leading
    dimensions of its input (``(batch, seq, features)`` to ``(batch * seq, features)``, as a
    transposed linear reads and writes): it runs on a split of the features as it is, but for
    its feature count, divided by the degree (which must divide it)."""
    node = graph.nodes[k]
    x = _activation_in(graph, k)
    if node.op not in RESHAPE_OPS or x is None or not node.shapes or not graph.nodes[x].shapes:
        return False
    out, inp = node.shapes[0], graph.nodes[x].shapes[0]
    return 2 <= len(out) != len(inp) >= 2 and out[-1] == inp[-1] and out[-1] % degree == 0


def _head_aligned(graph: OpGraph, cols: list[int], between: set[int], degree: int) -> bool:
    """Whether the ops between some projections and an output projection are an attention
    core that splits by whole heads ``degree`` ways: head ops only, no random op, and every
    view into heads (``(batch, seq, heads, head_dim)``) or back (``(batch, seq, features)``)
    with a head or feature count ``degree`` divides; a split only of a projection's output
    into equal parts of its features."""
    nodes = graph.nodes
    if any(nodes[k].op not in HEAD_OPS or nodes[k].op in RANDOM_OPS for k in between):
        return False
    if any(nodes[k].op in SPLIT_OPS and not any(_equal_parts(graph, src, k) > 1 for c in cols
                                                for src in _outputs(graph, c))
           for k in between):
        return False
    views = [nodes[k].shapes[0] for k in between if nodes[k].op in RESHAPE_OPS]
    return any(len(v) == 4 for v in views) and all(
        len(v) in (3, 4) and v[2 if len(v) == 4 else -1] % degree == 0 for v in views)


def _fused_parts(graph: OpGraph, col: int) -> int:
    """Into how many equal parts a split of a head-split projection's output divides its
    features (3 for a fused query-key-value projection), or 1 where nothing splits it."""
    return max((_equal_parts(graph, src, k) for src in _outputs(graph, col)
                for k in graph.succs[src]), default=1)


def _outputs(graph: OpGraph, col: int) -> list[int]:
    """A projection's output, and its views back to ``(batch, seq, features)`` (a transposed
    linear's rows) that read nothing else."""
    return [col, *(k for k in graph.succs[col] if graph.nodes[k].op in RESHAPE_OPS
                   and [p for p in graph.preds[k] if graph.nodes[p].shapes] == [col])]


def _equal_parts(graph: OpGraph, col: int, op: int) -> int:
    """How many equal parts of its features ``op`` splits projection ``col``'s output into,
    where it is a split of that output alone; else 1."""
    out = graph.nodes[col].shapes[0] if graph.nodes[col].shapes else ()
    parts = graph.nodes[op].shapes
    if graph.nodes[op].op not in SPLIT_OPS or graph.preds[op] != [col] or len(parts) < 2 \
            or not out or out[-1] % len(parts):
        return 1
    return len(parts) if all(p == (*out[:-1], out[-1] // len(parts)) for p in parts) else 1


def megatron_layout(graph: OpGraph, degree: int, sequence: bool = False) -> TensorLayout:
    """The Megatron-style layout of ``graph`` split ``degree`` ways (see the module's text);
    ``sequence``: with sequence parallelism (:func:`sequence_split`).

    Kept for the last few graphs, per degree (the simulator asks for it on every simulation
    of a tensor-parallel plan), while their nodes are the same."""
    if degree <= 1:
        return TensorLayout(degree)
    key = (id(graph), degree, sequence)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0]() is graph and hit[1] == tuple(graph.nodes):
        return hit[2]
    layout = (sequence_split(graph, megatron_layout(graph, degree)) if sequence
              else _layout(graph, degree))
    try:
        _LAYOUTS[key] = (weakref.ref(graph), tuple(graph.nodes), layout)
    except TypeError:  # a graph that cannot be referred to weakly: not kept
        return layout
    while len(_LAYOUTS) > _KEPT:
        del _LAYOUTS[next(iter(_LAYOUTS))]
    return layout


#: the layouts of the last graphs asked for:
#: (graph id, degree, sequence) -> (graph, its nodes, layout)
_LAYOUTS: dict[tuple[int, int, bool], tuple[Any, tuple, TensorLayout]] = {}
_KEPT = 8


def _layout(graph: OpGraph, degree: int) -> TensorLayout:
    nodes = graph.nodes
    placements: dict[str, str] = {}
    split: set[str] = set()
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    gather: dict[str, int] = {}
    local: set[str] = set()
    by_parent: dict[tuple[str, bool], list[int]] = {}  # (parent, convolutions?) -> ops
    for i, n in enumerate(nodes):
        if n.kind == "op" and (n.op in LINEAR_OPS or n.op in TRANSPOSED_OPS
                               or n.op in CONV_OPS) and _weight(graph, i) is not None:
            by_parent.setdefault((n.module_path.rpartition(".")[0], n.op in CONV_OPS),
                                 []).append(i)
        if n.kind == "op" and n.op in EMBEDDING_OPS:
            w = _weight(graph, i)
            ids = [p for p in (_viewed_input(graph, graph.index[q]) for q in n.inputs)
                   if p is not None]
            if w is not None and ids and _divides(graph, w[0], 0, degree):
                placements[nodes[w[0]].name] = shard(0)
                split.add(n.name)
                fwd[n.name] = n.out_bytes
    for (_, conv), ops in by_parent.items():
        cols: list[int] = []  # column candidates waiting for the linear that reads them
        for lin in ops:
            block = _block(graph, cols, lin, degree)
            if block is None:
                if conv:  # what this one reads through a pool pairs with none after it
                    before = _reach(graph.preds, lin, min(cols, default=lin), lin)
                    cols = [c for c in cols if c not in before]
                cols.append(lin)
                continue
            cols = []
            reach, between, heads = block
            local.update(nodes[k].name for k in between
                         if heads or _row_view(graph, k, degree))
            for col in reach:
                w, b = _weight(graph, col)  # type: ignore[misc]
                parts = _fused_parts(graph, col) if heads else 1
                dim = out_dim(nodes[col].op)
                placements[nodes[w].name] = shard(dim) if parts == 1 else strided_shard(dim, parts)
                if b is not None:
                    placements[nodes[b].name] = shard(0) if parts == 1 else strided_shard(0, parts)
            placements[nodes[_weight(graph, lin)[0]].name] = shard(  # type: ignore[index]
                1 - out_dim(nodes[lin].op))
            random = {k for k in between if nodes[k].op in RANDOM_OPS}
            split.update(nodes[k].name for k in {*reach, lin, *between} - random)
            for k in random:
                x = _activation_in(graph, k)
                gather[nodes[k].name] = nodes[x].out_bytes if x is not None else 0
            fwd[nodes[lin].name] = nodes[lin].out_bytes
            seen: set[int] = set()  # one all-reduce per input the columns share
            for col in reach:
                x = _activation_in(graph, col)
                if x is not None and x not in seen and nodes[x].requires_grad:
                    seen.add(x)
                    bwd[nodes[col].name] = nodes[x].out_bytes
    for lin, path, loss in _vocab_losses(graph, degree, placements):
        w, b = _weight(graph, lin)  # type: ignore[misc]
        placements.update({nodes[k].name: shard(0) for k in (w, b) if k is not None})
        split.update(nodes[k].name for k in (lin, *path, loss))
        fwd[nodes[loss].name] = VOCAB_LOSS_ROW_BYTES * nodes[graph.preds[loss][0]].shapes[0][0]
        x = _activation_in(graph, lin)
        if x is not None and nodes[x].requires_grad:
            bwd[nodes[lin].name] = nodes[x].out_bytes
    return TensorLayout(degree, placements, frozenset(split), fwd, bwd, gather,
                        frozenset(local))


def _viewed_input(graph: OpGraph, k: int) -> int | None:
    """The input node that node ``k`` is, or is a view or reshape of (token ids viewed to
    ``(batch, seq)`` first, as Hugging Face's models do); None where it is none."""
    while graph.nodes[k].op in RESHAPE_OPS and len(graph.preds[k]) == 1:
        k = graph.preds[k][0]
    return k if graph.nodes[k].kind == "input" else None


def _vocab_losses(graph: OpGraph, degree: int, placed: dict[str, str]
                  ) -> list[tuple[int, list[int], int]]:
    """(linear, the shape ops between, loss) of every cross-entropy loss that reads a linear's
    output through :data:`VOCAB_OPS` only, each read by nothing else and keeping the classes
    last, as ``(N, classes)`` logits and ``(N,)`` class indices (no class weights: a third
    input), where the linear's weight (read by it alone) is not in ``placed``, has at least
    as many classes as input features, and ``degree`` divides the classes."""
    nodes, out = graph.nodes, []
    for loss, n in enumerate(nodes):
        if n.kind != "op" or n.op not in LOSS_OPS or len(graph.preds[loss]) != 2:
            continue
        logits, target = graph.preds[loss]
        shape = nodes[logits].shapes[0] if nodes[logits].shapes else ()
        if len(shape) != 2 or nodes[target].shapes[:1] != ((shape[0],),) or shape[1] % degree:
            continue
        path, k = [], logits
        while nodes[k].op in VOCAB_OPS and len(graph.preds[k]) == 1:
            path.append(k)
            k = graph.preds[k][0]
        w = _weight(graph, k) if nodes[k].op in LINEAR_OPS else None
        if w is None or nodes[w[0]].name in placed or len(graph.succs[w[0]]) != 1 \
                or nodes[w[0]].shapes[0][0] < nodes[w[0]].shapes[0][1] \
                or nodes[w[0]].shapes[0][0] != shape[1] \
                or any(len(graph.succs[j]) != 1 or not nodes[j].shapes
                       or nodes[j].shapes[0][-1:] != shape[1:] for j in (k, *path)):
            continue
        out.append((k, path[::-1], loss))
    return out


def sequence_split(graph: OpGraph, base: TensorLayout) -> TensorLayout:
    """``base`` with sequence parallelism (Megatron-LM's): the output of a row-parallel linear
    or a vocabulary-parallel embedding that is ``(batch, seq, features)`` is reduce-scattered
    along the sequence instead of all-reduced, and the token-wise ops (:data:`TOKENWISE`)
    that read such shards run on them (norms, residual adds); a column-parallel linear that
    reads one all-gathers it in its forward and again in its backward, and reduce-scatters
    its gradient (no all-reduce); any other op that reads one gathers it first. A token-wise
    op's whole inputs (a position embedding) are narrowed to the device's positions, their
    gradients all-reduced; the weights those ops read (a norm's scale) and the row-parallel
    linears' biases get partial gradients, all-reduced once a step. Only what fits this is
    split; the rest keeps ``base``'s layout."""
    nodes, idx, k = graph.nodes, graph.index, base.degree
    split = {idx[n] for n in base.split_ops}

    def rows_of(i: int) -> tuple[int, ...] | None:  # (batch, seq) of a 3-D output
        shape = nodes[i].shapes[0] if nodes[i].shapes else ()
        return tuple(shape[:2]) if len(shape) == 3 else None

    def column(c: int) -> bool:
        w = _weight(graph, c) if nodes[c].op in LINEAR_OPS and c in split else None
        return w is not None and shard_dim(base.placement(nodes[w[0]].name)) == 0

    def seq_rows(i: int) -> bool:  # (batch, seq, features), the degree dividing seq
        return rows_of(i) is not None and rows_of(i)[1] % k == 0  # type: ignore[index]

    # a transposed linear's rows viewed back to (batch, seq, features): scattered there
    partial = {graph.succs[i][0]: i for i in (idx[n] for n in base.reduce_forward)
               if nodes[i].op in TRANSPOSED_OPS and len(graph.succs[i]) == 1
               and nodes[graph.succs[i][0]].op in RESHAPE_OPS and seq_rows(graph.succs[i][0])}
    seeds = sorted([*partial, *(idx[n] for n in base.reduce_forward if seq_rows(idx[n])
                                and nodes[idx[n]].op in (*LINEAR_OPS, *EMBEDDING_OPS))])
    if not seeds:
        return base
    bt = rows_of(seeds[0])

    def tokenwise_op(j: int) -> bool:
        return nodes[j].op in TOKENWISE | SEQUENCE_RANDOM and rows_of(j) == bt

    def tokenwise(j: int) -> bool:  # ... and not split yet, its weights read by such ops only
        return (nodes[j].kind == "op" and j not in split and tokenwise_op(j)
                and all(all(tokenwise_op(c) for c in graph.succs[p]) for p in graph.preds[j]
                        if nodes[p].kind == "param"))

    def readers_fit(j: int) -> bool:  # each reader runs on the shard, gathers it, or is column
        return all(tokenwise(c) or c not in split or (column(c) and _activation_in(graph, c) == j)
                   for c in graph.succs[j])

    seeds = [i for i in seeds if rows_of(i) == bt and readers_fit(i)]
    shards, seq = set(seeds), []
    for j in range(min(seeds, default=len(nodes)), len(nodes)):
        if tokenwise(j) and any(p in shards for p in graph.preds[j]) and readers_fit(j):
            shards.add(j)
            seq.append(j)
    params = {p for j in seq for p in graph.preds[j] if nodes[p].kind == "param"}
    mixed = {p for p in params if any(c not in shards for c in graph.succs[p])}
    if mixed:  # a weight also read whole: its readers stay whole too
        seq = [j for j in seq if not mixed & set(graph.preds[j])]
        shards, params = {*seeds, *seq}, params - mixed
    for i in seeds:  # a row-parallel linear's bias, added to its positions only
        w = (_weight(graph, partial.get(i, i))
             if nodes[partial.get(i, i)].op in (*LINEAR_OPS, *TRANSPOSED_OPS) else None)
        if w is not None and w[1] is not None:
            params.add(w[1])
    fwd, bwd = dict(base.reduce_forward), dict(base.reduce_backward)
    gather, scatter_f, gather_b, scatter_b = dict(base.gather_forward), {}, {}, {}

    def add(into: dict[str, int], name: str, nbytes: int) -> None:
        into[name] = into.get(name, 0) + nbytes

    for i in seeds:
        scatter_f[nodes[i].name] = gather_b[nodes[i].name] = fwd.pop(nodes[partial.get(i, i)].name)
    for p in sorted(shards):
        for c in graph.succs[p]:
            if c in shards:
                continue
            name, nbytes = nodes[c].name, nodes[p].out_bytes
            add(gather, name, nbytes)
            if column(c) and _activation_in(graph, c) == p:
                bwd.pop(name, None)
                add(gather_b, name, nbytes)
                add(scatter_b, name, nbytes)
    narrowed: set[int] = set()  # whole activations read by sequence ops: gradients all-reduced
    for j in seq:
        for p in graph.preds[j]:
            if p not in shards and p not in narrowed and nodes[p].kind in ("op", "input") \
                    and nodes[p].requires_grad and len(nodes[p].shapes[0] if nodes[p].shapes
                                                        else ()) >= 2:
                narrowed.add(p)
                add(bwd, nodes[j].name, nodes[p].out_bytes)
    names = frozenset(nodes[j].name for j in seq)
    views = frozenset(nodes[v].name for v in partial if v in shards)
    return replace(base, split_ops=base.split_ops | names | views, reduce_forward=fwd,
                   reduce_backward=bwd, gather_forward=gather, sequence_ops=names,
                   scatter_forward=scatter_f, gather_backward=gather_b,
                   scatter_backward=scatter_b,
                   sequence_params=frozenset(nodes[p].name for p in sorted(params)),
                   partial_rows=frozenset(nodes[partial[v]].name for v in partial
                                          if v in shards))
