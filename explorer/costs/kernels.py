"""What kernels a graph's ops run as: the kind each op was measured as, and which ops a
compiler fuses into one kernel.

Eager PyTorch runs every op as its own kernel, each reading its inputs from memory and writing
its output back. ``torch.compile`` (inductor) and the fused kernels of training frameworks
(Megatron-Core's and NeMo's Transformer Engine: fused RMSNorm, SwiGLU, rotary embeddings, bias
and activation) run a connected run of pointwise, normalisation and reduction ops as one
kernel, which reads what comes from outside the run and writes only what is read outside it;
views cost no kernel at all. Matrix products, convolutions and fused attention stay library
kernels in both (inductor calls cuBLAS, cuDNN and flash attention for them).
Reference: Ansel et al., "PyTorch 2", ASPLOS 2024 (inductor's fusion of pointwise and
reduction ops).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import networkx as nx

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph, OpNode
from explorer.costs.memory import view_roots
from explorer.costs.strategies import activation_bytes

#: how a device runs a graph's ops (``ex.profile(..., kernels=)``): "eager", one kernel per op
#: as eager PyTorch and the explorer's runtime run them; "compiled", pointwise and
#: normalisation runs fused as ``torch.compile`` and frameworks' fused kernels run them
Kernels = Literal["eager", "compiled"]
KERNELS: tuple[Kernels, ...] = ("eager", "compiled")


def check_kernels_name(kernels: str) -> None:
    """Refuse a ``kernels`` that is not one of :data:`KERNELS`, saying which are."""
    if kernels not in KERNELS:
        raise ExplorerError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, not "
                            f"{kernels!r}")

#: op names (without ``aten.`` and overload) by the kind of op they were measured as
_OP_KINDS = {
    "matmul": ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "addbmm", "einsum"),
    "conv2d": ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
               "conv_transpose2d", "conv_transpose3d"),
    "attention": ("scaled_dot_product_attention", "scaled_dot_product_flash_attention",
                  "scaled_dot_product_efficient_attention", "scaled_dot_product_cudnn_attention",
                  "flash_attention", "efficient_attention"),
    "layernorm": ("layer_norm", "native_layer_norm", "rms_norm", "batch_norm",
                  "native_batch_norm", "group_norm", "native_group_norm", "instance_norm"),
    "sum": ("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "norm",
            "logsumexp", "softmax", "log_softmax", "cross_entropy_loss", "nll_loss",
            "argmax", "argmin"),
    "gelu": ("gelu", "relu", "silu", "sigmoid", "tanh", "elu", "leaky_relu", "hardtanh",
             "mish", "softplus"),
}
_KIND_OF = {name: kind for kind, names in _OP_KINDS.items() for name in names}


def op_kind(op: str) -> str:
    """The kind of op a captured op's name (``aten.linear.default``) was measured as: matmul,
    conv2d, attention, layernorm (norms), sum (reductions), gelu (activations) or add (every
    other elementwise op)."""
    name = op.removeprefix("aten.").split(".")[0].lstrip("_")
    return _KIND_OF.get(name, "add")


#: the kinds of op a compiler fuses with their neighbours of these kinds into one kernel
FUSIBLE_KINDS = frozenset({"add", "gelu", "sum", "layernorm"})


def launches_no_kernel(node: OpNode) -> bool:
    """Whether an op makes no new tensor on the device: a view (its output shares an input's
    memory) or a size query (``aten.sym_size``)."""
    return node.is_view or node.out_bytes == 0


@dataclass(frozen=True)
class FusedKernels:
    """One connected run of fusible ops (views inside it included), as a compiler runs it."""

    #: the run's ops, in graph order
    nodes: tuple[int, ...]
    #: bytes its kernels read from outside the run and write for readers outside it
    bytes_moved: int
    #: kernels it launches: one per tensor written for readers outside the run (at least one)
    launches: int


def _is_fusible(node: OpNode) -> bool:
    """A view, a size query or an ATen op of a fusible kind (not a whole module, as a graph
    captured with hooks has: its ops are modules of unknown kernels)."""
    return node.kind == "op" and (
        launches_no_kernel(node)
        or (node.op.startswith("aten.") and op_kind(node.op) in FUSIBLE_KINDS))


def _runs(graph: OpGraph) -> list[list[int]]:
    """The runs of fusible ops a compiler can make one kernel of: union-find over the edges
    between two of them at the same barrier depth (how many library kernels, a matmul or an
    attention, the longest path from the inputs passes). Two ops of a run can then never
    depend on each other through an op outside it (the residual stream's adds, which join
    every layer's norms, are cut at each matmul they wait for), as a kernel cannot wait for
    another kernel it feeds."""
    parent = list(range(len(graph.nodes)))
    fusible = [_is_fusible(n) for n in graph.nodes]
    depth = [0] * len(graph.nodes)
    for i, preds in enumerate(graph.preds):  # (nodes are in topological order)
        depth[i] = max((depth[p] + (graph.nodes[p].kind == "op" and not fusible[p])
                        for p in preds), default=0)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, preds in enumerate(graph.preds):
        if fusible[i]:
            for p in preds:
                if fusible[p] and depth[p] == depth[i]:
                    parent[root(p)] = root(i)
    runs: dict[int, list[int]] = {}
    for i, f in enumerate(fusible):
        if f:
            runs.setdefault(root(i), []).append(i)
    return list(runs.values())


def _written(graph: OpGraph, run: set[int], i: int) -> int | None:
    """The op of ``run`` whose memory node ``i``'s output is (``i`` itself, or the op a view
    of the run looks into); None where a view looks into a tensor from outside the run."""
    while launches_no_kernel(graph.nodes[i]):
        preds = graph.preds[i]
        if not preds or preds[0] not in run:
            return None
        i = preds[0]
    return i


def fused_kernels(graph: OpGraph) -> list[FusedKernels]:
    """The graph's fusible ops as a compiler runs them: each connected run of pointwise,
    normalisation and reduction ops (:data:`FUSIBLE_KINDS`) and views is one kernel per tensor
    it writes for readers outside it (the loss included), reading each tensor from outside the
    run once."""
    out = []
    for nodes in _runs(graph):
        run = set(nodes)
        read = {p for i in nodes for p in graph.preds[i] if p not in run}
        written = {w for i in nodes
                   if not graph.succs[i] or any(s not in run for s in graph.succs[i])
                   if (w := _written(graph, run, i)) is not None}
        moved = sum(graph.nodes[p].out_bytes for p in read) + sum(
            graph.nodes[w].out_bytes for w in written)
        makes = any(not launches_no_kernel(graph.nodes[i]) for i in nodes)
        out.append(FusedKernels(tuple(nodes), moved if makes else 0,
                                max(len(written), 1) if makes else 0))
    return out


def compiled_saves(graph: OpGraph, half: bool = False) -> OpGraph:
    """``graph`` with what a compiled backward keeps: ``torch.compile``'s partitioner (and a
    fused kernel's own backward) recomputes a fused run's pointwise values from the fewest
    bytes it can keep (:func:`_kept_values`: the minimum cut AOTAutograd's
    ``min_cut_rematerialization_partition`` takes, per run), the values sized as autocast
    makes them where ``half`` (a bf16/fp16 plan). An op of a run keeps what it saves from
    outside the run; a value of its own run it saved (or a buffer of its own it saved, such
    as a cross-entropy's log-softmax), it keeps where the cut keeps that value, else the
    kept values it is recomputed from. A fused run's backward is fused too: the gradients
    between the pieces of one op (``backward_scratch_bytes``) are never written. The same
    fingerprint: only what the ops keep differs."""
    member: dict[int, int] = {}
    root = view_roots(graph)
    runs = fused_kernels(graph)
    for k, run in enumerate(runs):
        member.update(dict.fromkeys(run.nodes, k))

    def own(v: int, name: str) -> bool:  # a value of the saver's own run
        return v in member and member.get(root[graph.index[name]]) == member[v]

    kept_anyway = {root[graph.index[name]] for v, n in enumerate(graph.nodes)
                   for name in n.saves if not own(v, name)}
    sizes = (activation_bytes(graph, "bf16", "cuda").tolist() if half
             else [n.out_bytes for n in graph.nodes])
    nodes = list(graph.nodes)
    for k, run in enumerate(runs):
        needed = {graph.index[name] for v in run.nodes for name in graph.nodes[v].saves
                  if own(v, name)}
        needed |= {_buffer_of(v) for v in run.nodes if graph.nodes[v].saved_extra_bytes}
        kept = (_kept_values(graph, run.nodes, needed, kept_anyway, root, sizes) if needed
                else set())
        for v in run.nodes:
            node = graph.nodes[v]
            saves: list[str] = []
            for name in node.saves:
                s = graph.index[name]
                if not own(v, name) or s in kept or root[s] in kept_anyway:
                    saves.append(name)
                else:
                    saves += [graph.nodes[p].name for p in _kept_sources(graph, s, kept,
                                                                          member, k)]
            extra = node.saved_extra_bytes
            if extra and _buffer_of(v) not in kept:  # recomputed from the op's inputs
                saves += [graph.nodes[p].name for p in _kept_sources(graph, v, kept,
                                                                      member, k)]
                extra = 0
            changed = replace(node, saves=tuple(dict.fromkeys(saves)), saved_extra_bytes=extra,
                              backward_scratch_bytes=0)
            if changed != node:
                nodes[v] = changed
    return replace(graph, nodes=nodes)


def _buffer_of(v: int) -> int:
    """The key the minimum cut gives what op ``v`` saves beyond its inputs and output (and,
    given that key, the op)."""
    return -1 - v


def _kept_values(graph: OpGraph, run: tuple[int, ...], needed: set[int],
                 kept_anyway: set[int], root: list[int], sizes: list[int]) -> set[int]:
    """The values of a fused run and of the tensors it reads that a compiled backward keeps so
    that every ``needed`` value (a node, or an op's own saved buffer: :func:`_buffer_of`)
    can be recomputed from them: a minimum cut between the tensors the run reads (made
    before it: a backward cannot remake them) and the needed values, each value's capacity
    its ``sizes`` bytes (those ``kept_anyway`` for other ops cost nothing; weights and
    buffers are there anyway). Of equal cuts, the one keeping needed values themselves
    (nothing to recompute)."""
    members = set(run)
    outside = {p for i in run for p in graph.preds[i]
               if p not in members and graph.nodes[p].kind not in ("param", "buffer")}
    buffers = [u for u in needed if u < 0]
    values = sorted(members | outside) + buffers
    scale = len(values) + 1  # (ties broken below one byte)
    flow = nx.DiGraph()
    for u in values:
        # (an op's saved buffer is made with the op, from its inputs; the key maps both ways)
        made = _buffer_of(u) if u < 0 else u
        nbytes = (graph.nodes[made].saved_extra_bytes if u < 0
                  else 0 if root[u] in kept_anyway else sizes[root[u]])
        flow.add_edge(("made", u), ("kept", u), capacity=nbytes * scale + (u not in needed))
        if u in outside:
            flow.add_edge("forward", ("made", u))  # (no capacity: unbounded)
            continue
        for p in graph.preds[made]:
            if p in members or p in outside:
                flow.add_edge(("kept", p), ("made", u))
    for u in needed:
        flow.add_edge(("kept", u), "backward")
    if "forward" not in flow:  # nothing it reads comes from before it: all recomputed
        return set()
    _, (reached, _) = nx.minimum_cut(flow, "forward", "backward")
    return {u for u in values if ("made", u) in reached and ("kept", u) not in reached}


def _kept_sources(graph: OpGraph, i: int, kept: set[int], member: dict[int, int],
                  run: int) -> list[int]:
    """The ``kept`` values node ``i`` of run ``run`` is recomputed from (walking back through
    the run's other values; weights and buffers are kept whatever happens)."""
    out, seen, todo = [], {i}, [i]
    while todo:
        for p in graph.preds[todo.pop()]:
            if p in seen:
                continue
            seen.add(p)
            if p in kept or (member.get(p) != run
                             and graph.nodes[p].kind not in ("param", "buffer")):
                out.append(p)
            elif member.get(p) == run:
                todo.append(p)
    return sorted(out)


@dataclass(frozen=True)
class _Compiled:
    """A graph's :func:`compiled_saves`, kept while the graph lives."""

    original: weakref.ref[OpGraph]
    #: the graph's nodes when it was rewritten (an edit in place makes it stale)
    nodes: tuple[OpNode, ...]
    #: whether the values were sized as a bf16/fp16 plan makes them
    half: bool
    compiled: OpGraph
    #: the nodes whose saves the rewrite changed
    changed: tuple[int, ...]


#: the graphs :func:`compiled_graph` rewrote, by ``id`` of the graph and the sizing, and by
#: ``id`` of the rewrite (each dropped when its graph is collected): a simulation per
#: candidate plan reuses them
_COMPILED: dict[tuple[int, bool], _Compiled] = {}
_MADE: dict[int, _Compiled] = {}
_LOCK = threading.Lock()


def _entry(graph: OpGraph, half: bool) -> _Compiled:
    """The cached rewrite of ``graph`` (or of the graph ``graph`` is the rewrite of)."""
    with _LOCK:
        made = _MADE.get(id(graph))
        if made is not None and made.compiled is graph:
            original = made.original()
            if made.half == half or original is None:
                return made
            graph = original
        got = _COMPILED.get((id(graph), half))
        if (got is not None and got.original() is graph and len(got.nodes) == len(graph.nodes)
                and all(a is b for a, b in zip(got.nodes, graph.nodes, strict=True))):
            return got
        compiled = compiled_saves(graph, half)
        changed = tuple(v for v, (a, b) in enumerate(zip(compiled.nodes, graph.nodes,
                                                         strict=True)) if a is not b)
        got = _Compiled(weakref.ref(graph), tuple(graph.nodes), half, compiled, changed)
        key, made_key = (id(graph), half), id(compiled)
        _COMPILED[key] = _MADE[made_key] = got
        weakref.finalize(graph, _forget, key, made_key)
        return got


def _forget(key: tuple[int, bool], made_key: int) -> None:
    with _LOCK:
        _COMPILED.pop(key, None)
        _MADE.pop(made_key, None)


def compiled_graph(graph: OpGraph, stage_of: Mapping[str, int] | None = None,
                   half: bool = False) -> OpGraph:
    """:func:`compiled_saves` of ``graph`` (its values sized as a bf16/fp16 plan makes them
    where ``half``), the same object for the same graph (the simulator caches its arrays per
    graph object); a graph it made stays itself, or becomes its original's rewrite of the
    other sizing. With ``stage_of`` (a plan's stage per node name): an op whose compiled
    saves would reach another stage's tensors (a stage cut inside a fused run) keeps what
    eager autograd keeps, what its own stage holds."""
    entry = _entry(graph, half)
    if stage_of is None:
        return entry.compiled
    original = entry.original()
    nodes = entry.compiled.nodes
    back = [v for v in entry.changed
            if any(stage_of[s] != stage_of[nodes[v].name] for s in nodes[v].saves)]
    if not back or original is None:
        return entry.compiled
    kept = list(nodes)
    for v in back:
        kept[v] = original.nodes[v]
    return replace(entry.compiled, nodes=kept)
