"""What a stage's memory settings (ZeRO, recomputation, precision) do to an op's bytes and time.

Shared by the simulator and the quick additive estimate (:mod:`explorer.costs.memory`), so both
read the same rules (the runtime follows them too):

- ZeRO shards each parameter (and its gradient and optimizer state) in ``R`` equal pieces,
  padded to a multiple of ``R`` elements (:func:`shard_bytes`).
- Recomputation: "selective" drops the saved outputs of ops that are not matmul-like
  (:func:`is_matmul_like`); "full" keeps only a unit's inputs, a unit being the op's module
  path cut after its repeated-block index (:func:`recompute_units`). When and for how long
  each value lives again, as the runtime recomputes on demand: :func:`recomputation`.
- Precision bf16/fp16 runs ops under ``torch.autocast``: matmul-like ops make 2-byte outputs,
  the ops autocast keeps in fp32 make 4-byte ones, the others follow the widest floating input
  (:func:`half_outputs`). Where the profile timed the device in that precision, those times
  price it (``DeviceCosts.precision_s``); otherwise on GPUs matmul-like ops run at the
  half-precision peak and other ops move half the bytes (:func:`precision_time_factors`), and on
  CPUs the fp32 times stand.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import Plan

#: an op is matmul-like (its output is kept by selective recomputation, made in half precision
#: under autocast) when its name contains one of these
MATMUL_MARKERS = ("mm", "matmul", "conv", "linear", "addmm", "bmm", "baddbmm",
                  "scaled_dot_product")
#: ops CUDA autocast runs in fp32 (torch's "CUDA Ops that can autocast to float32" list)
CUDA_FP32_OPS = frozenset((
    "pow", "rdiv", "rpow", "rtruediv", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cross_entropy_loss",
    "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss",
    "kl_div", "l1_loss", "layer_norm", "log", "log_softmax", "log10", "log1p", "log2",
    "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "nll_loss_forward", "nll_loss2d", "norm", "normalize", "pdist",
    "poisson_nll_loss", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss", "huber_loss", "logsumexp", "frobenius_norm", "nuclear_norm",
    "layernorm", "crossentropyloss", "mseloss", "groupnorm"))
#: ops CPU autocast runs in fp32: the losses (measured with ``torch.autocast("cpu",
#: torch.bfloat16)``: layer_norm, softmax, sum, exp stay bf16 there, cross_entropy and
#: mse_loss come out fp32)
CPU_FP32_OPS = frozenset((
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "cross_entropy",
    "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "kl_div", "margin_ranking_loss", "soft_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss", "poisson_nll_loss", "hinge_embedding_loss",
    "cosine_embedding_loss", "triplet_margin_loss", "crossentropyloss", "mseloss"))
#: normalizations whose output takes the dtype of their data (first) input, whatever their
#: fp32 weights and statistics (torch's mixed-dtype norms: a bf16 batch of activations gives
#: a bf16 output); where autocast runs one in fp32 (:data:`CUDA_FP32_OPS`) that comes first
NORM_OPS = frozenset(("batch_norm", "layer_norm", "group_norm", "rms_norm", "instance_norm",
                      "batchnorm2d", "batchnorm1d", "layernorm", "groupnorm", "rmsnorm"))
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")
#: the element size parameters are sharded in (fp32 master weights)
PARAM_ELEMENT_BYTES = 4
#: ZeRO's collectives of gradients and updated shards move the tensors of several parameters
#: together, up to about this many bytes at a time (DDP's default gradient bucket)
BUCKET_BYTES = 25 * 1024 * 1024


def buckets(sizes: list[int], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Positions in ``sizes`` (bytes of tensors, in the order they are ready) cut into runs
    of consecutive ones, each closed as soon as it holds ``limit`` bytes or more: the
    tensors one bucketed collective moves together."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for k, b in enumerate(sizes):
        cur.append(k)
        size += b
        if size >= limit:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def gather_groups(first_reader: dict[int, int],
                  unit: Callable[[int], str] | None = None) -> list[list[int]]:
    """ZeRO 3's weights (keys of ``first_reader``: weight node -> the first op of its stage
    that reads it) cut into the groups one all-gather moves together, as FSDP2's
    ``fully_shard`` gathers a wrapped module's parameters at once: the weights whose first
    readers are in the same recomputation unit (``unit``: an op's unit, :func:`unit_of` of its
    module path: a repeated block, or a top-level module), or without ``unit`` read first by
    the same op (a layer's weight and bias). Groups in the order of their first reader,
    members by their first reader, then node."""
    groups: dict[object, list[int]] = {}
    for w in sorted(first_reader, key=lambda w: (first_reader[w], w)):
        o = first_reader[w]
        groups.setdefault(unit(o) if unit is not None else o, []).append(w)
    return list(groups.values())


def shard_bytes(nbytes: int, replicas: int) -> int:
    """Bytes of one rank's shard of a tensor of ``nbytes`` split over ``replicas`` ranks
    (flattened, padded to a multiple of ``replicas`` elements)."""
    if replicas <= 1:
        return nbytes
    elems = -(-nbytes // PARAM_ELEMENT_BYTES)
    return -(-elems // replicas) * PARAM_ELEMENT_BYTES


def op_base_name(op: str) -> str:
    """``"aten.native_layer_norm.default"`` -> ``"layer_norm"``; a module type lowercased."""
    parts = op.split(".")
    base = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[-1]
    base = base.lower().lstrip("_")
    return base[len("native_"):] if base.startswith("native_") else base


def is_matmul_like(node: OpNode) -> bool:
    return op_is_matmul_like(node.op)


def op_is_matmul_like(op: str) -> bool:
    """Whether an op, by its ATen name, is matmul-like (:data:`MATMUL_MARKERS`)."""
    name = op.lower()
    return any(m in name for m in MATMUL_MARKERS)


def half_outputs(graph: OpGraph, device_kind: str,
                 half_weights: np.ndarray | None = None) -> np.ndarray:
    """[node] bool: whether the op's output is 2 bytes per element under autocast on a device
    of ``device_kind`` (the graph captured in fp32); ``half_weights`` ([node] bool): the
    weights the ops read in 2 bytes (ZeRO 3 gathers them so under bf16/fp16,
    :func:`gathered_half`)."""
    fp32 = CUDA_FP32_OPS if device_kind == "cuda" else CPU_FP32_OPS
    half = np.zeros(len(graph), dtype=bool)
    if half_weights is not None:
        half |= half_weights
    for i, n in enumerate(graph.nodes):
        if n.kind != "op" or n.dtype not in FLOAT_DTYPES:
            half[i] |= n.dtype in HALF_DTYPES
        elif is_matmul_like(n):
            half[i] = True
        elif op_base_name(n.op) in fp32:
            half[i] = False
        elif op_base_name(n.op) in NORM_OPS and n.inputs:  # its data input's dtype
            half[i] = bool(half[graph.index[n.inputs[0]]])
        else:  # the widest floating input
            ins = [graph.index[p] for p in n.inputs]
            floats = [j for j in ins if graph.nodes[j].dtype in FLOAT_DTYPES]
            half[i] = bool(floats) and all(half[j] for j in floats)
    return half


def activation_bytes(graph: OpGraph, precision: str, device_kind: str,
                     half_weights: np.ndarray | None = None) -> np.ndarray:
    """[node] bytes of each node's output under ``precision`` (outputs of ops autocast makes
    2-byte are halved; weights, buffers and inputs keep theirs); ``half_weights`` as for
    :func:`half_outputs`."""
    out = np.asarray([n.out_bytes for n in graph.nodes], dtype=np.int64)
    if precision == "fp32":
        return out
    half = half_outputs(graph, device_kind, half_weights)
    already = np.array([n.dtype in HALF_DTYPES or n.kind != "op" for n in graph.nodes],
                       dtype=bool)
    return np.where(half & ~already, out // 2, out)


def gathered_half(graph: OpGraph, zero: int, precision: str) -> np.ndarray:
    """[node] the weights a stage of ZeRO ``zero`` under ``precision`` gathers in 2 bytes:
    under bf16/fp16 the fp32 shards are cast before they are gathered, ZeRO 3's for each use
    as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does, ZeRO 1-2's updated shards
    into a 2-byte working copy of the weights (the fp32 master copy sharded with the
    optimizer state, as Megatron's distributed optimizer and DeepSpeed keep it); so the ops
    read 2-byte weights (no autocast copy of them) and what a weight makes directly (an
    embedding's lookup, a norm's scale) comes out in 2 bytes; the gradients the replicas
    reduce stay fp32."""
    if not zero or precision == "fp32":
        return np.zeros(len(graph), dtype=bool)
    return np.array([n.kind == "param" and n.dtype == "float32" for n in graph.nodes],
                    dtype=bool)


def precision_time_factors(graph: OpGraph, precision: str, device_kind: str,
                           flops_per_s: float, half_flops_per_s: float) -> np.ndarray:
    """[node] factor on each op's fp32 time under ``precision`` on a device: on GPUs,
    matmul-like ops at the half-precision peak and other ops making 2-byte outputs at half
    the bytes; 1 elsewhere (a CPU's times come from its profile)."""
    f = np.ones(len(graph))
    if precision == "fp32" or device_kind != "cuda" or half_flops_per_s <= 0:
        return f
    half = half_outputs(graph, device_kind)
    peak = min(flops_per_s / half_flops_per_s, 1.0)
    for i, n in enumerate(graph.nodes):
        if n.kind != "op" or n.dtype in HALF_DTYPES:
            continue
        if is_matmul_like(n):
            f[i] = peak
        elif half[i]:
            f[i] = 0.5
    return f


_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def unit_of(module_path: str) -> str:
    """The recomputation unit of a module path: cut after its first numeric component (the
    repeated block, ``model.layers.3``), else its top-level module."""
    m = _BLOCK.match(module_path)
    return m.group(1) if m else module_path.split(".", 1)[0]


def recompute_units(graph: OpGraph) -> list[str]:
    """[node] the full-recomputation unit of every node."""
    return [unit_of(n.module_path) for n in graph.nodes]


def saved_across_units(graph: OpGraph,
                       saved: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[node] whether an op of another recomputation unit saves the node's output for its
    backward: recomputation keeps such an output (a unit recomputes only what its own ops
    save), under "selective" and "full" alike, as the runtime does. ``saved``: (producer,
    saver) pairs, by default from the nodes' ``saves``."""
    if saved is None:
        pairs = [(graph.index[p], v) for v, n in enumerate(graph.nodes) for p in n.saves]
        saved = (np.array([p for p, _ in pairs], dtype=np.int64),
                 np.array([v for _, v in pairs], dtype=np.int64))
    _, code = np.unique(np.array(recompute_units(graph), dtype=object).astype(str),
                        return_inverse=True)
    p, v = saved
    kept = np.zeros(len(graph), dtype=bool)
    kept[p[code[p] != code[v]]] = True
    return kept


def recomputed_outputs(graph: OpGraph, recompute: str,
                       saved: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[node] whether an op's output, where backwards save it, is not kept but recomputed:
    "selective" for ops that are not matmul-like, "full" for every op, in both cases but
    those an op of another unit saves (:func:`saved_across_units`; a unit's inputs are
    kept). ``saved``: (producer, saver) pairs, by default from the nodes' ``saves``."""
    is_op = np.array([n.kind == "op" for n in graph.nodes], dtype=bool)
    if recompute == "none":
        return np.zeros(len(graph), dtype=bool)
    kept = saved_across_units(graph, saved)
    if recompute == "selective":
        kept |= np.array([is_matmul_like(n) for n in graph.nodes], dtype=bool)
    return is_op & ~kept


@dataclass(frozen=True)
class Recomputation:
    """What recomputation does to each node of a graph: which saved outputs are dropped, in
    which backward each op runs again, and which kept values the recomputations start from.
    """

    #: [node] a saved output that is not kept but made again in the backward
    dropped: np.ndarray
    #: [node] the op whose backward first runs the node's op again (-1: it does not run again)
    first_use: np.ndarray
    #: (kept value's memory root, op) pairs: the values recomputations start from, held until
    #: that op's backward (the last of their unit to run)
    sources: tuple[np.ndarray, np.ndarray]


def recomputation(graph: OpGraph, mode: str | Sequence[str],
                  stage: Sequence[int] | np.ndarray | None = None,
                  has_backward: Sequence[bool] | np.ndarray | None = None) -> Recomputation:
    """Recomputation as the runtime does it (:mod:`explorer.runtime.recompute`), per node
    under ``mode`` ("none", "selective" or "full"; one for all, or the mode of each node's
    stage), ``stage`` (per node; default all on one) and ``has_backward`` (per node: the ops
    whose backward runs; default the ops that need a gradient).

    A unit (:func:`unit_of`) on a stage keeps the values its ops read from outside it (other
    units, stages, the batch), with "selective" also its matmul-like outputs. What one of its
    ops saves that the unit made and does not keep is dropped, unless an op of another unit
    saves it too (:func:`saved_across_units`). In the backward a dropped value is made again
    on demand, when the first backward that unpacks it runs (in running order, the saver
    latest in the forward), from the kept values, running again the unit's ops between
    (which are made then, once, and kept only while a later backward still unpacks them);
    the kept values a recomputation starts from stay until the unit's last backward. What an
    op saves besides its inputs and outputs (statistics, masks, indices) is not recomputed:
    it is kept from the forward.
    """
    nodes, index, n = graph.nodes, graph.index, len(graph)
    modes = [mode] * n if isinstance(mode, str) else list(mode)
    st = [0] * n if stage is None else [int(x) for x in stage]
    hb = ([x.kind == "op" and x.requires_grad for x in nodes] if has_backward is None
          else [bool(x) for x in has_backward])
    units = recompute_units(graph)
    root = list(range(n))
    for i, x in enumerate(nodes):
        if x.is_view and x.inputs:
            root[i] = root[index[x.inputs[0]]]
    across = saved_across_units(graph).tolist()
    matmul = [x.kind == "op" and is_matmul_like(x) for x in nodes]

    def again(p: int, v: int) -> bool:
        """Whether op ``v``'s unit makes value ``p`` again rather than keeping it."""
        return (nodes[p].kind == "op" and st[p] == st[v] and units[p] == units[v]
                and not (modes[v] == "selective" and matmul[p]))

    dropped = np.zeros(n, dtype=bool)
    first = np.full(n, -1, dtype=np.int64)
    last_b: dict[tuple[str, int], int] = {}  # (unit, stage) -> its op whose backward runs last
    for v in range(n - 1, -1, -1):
        if hb[v]:
            last_b[(units[v], st[v])] = v
    sources: set[tuple[int, int]] = set()
    for v in range(n):  # v: an op whose backward unpacks what it saved
        if not hb[v] or modes[v] == "none":
            continue
        todo = list({h for h in (root[index[name]] for name in nodes[v].saves)
                     if again(h, v) and not across[h]})
        dropped[todo] = True
        seen = set(todo)
        while todo:  # what it is made from, back to kept values
            q = todo.pop()
            first[q] = max(first[q], v)
            for name in nodes[q].inputs:
                p = index[name]
                if nodes[p].kind in ("param", "buffer") or p in seen:
                    continue
                if again(p, v):
                    seen.add(p)
                    todo.append(p)
                else:
                    sources.add((root[p], last_b[(units[v], st[v])]))
    pairs = np.array(sorted(sources), dtype=np.int64).reshape(-1, 2)
    return Recomputation(dropped, first, (pairs[:, 0], pairs[:, 1]))


def rerun_ops(graph: OpGraph, plan: Plan) -> list[bool]:
    """[node] whether ``plan``'s recomputation runs the op again in a backward
    (:func:`recomputation`, each node under its stage's mode). A unit with none keeps all it
    saves (each value an op of another unit saves too): checkpointing it would only cost."""
    stage = plan.assignment(graph)
    modes = [plan.settings_of(s).recompute for s in stage]
    return (recomputation(graph, modes, stage).first_use >= 0).tolist()


@dataclass(frozen=True)
class CheckpointSpan:
    """A run of consecutive ops of one unit that runs an op again, which the segment runtime
    checkpoints as one call (``torch.utils.checkpoint``, as a user checkpoints a block), on
    one stage, per micro-batch (:func:`checkpoint_spans`)."""

    stage: int
    #: its ops, in node order
    ops: tuple[int, ...]
    #: whether a policy sees each of its ops (torch's selective checkpointing: "selective",
    #: or an op of it updates state), which costs a call per op in the forward and again in
    #: the recomputation
    policy: bool
    #: the ops checkpoint runs again in the backward: from the first up to the last that
    #: saves a value for its backward (checkpoint stops early there), but those the policy
    #: keeps
    rerun: tuple[int, ...]
    #: the op whose backward runs first (the recomputation runs there, when autograd first
    #: unpacks a value the span saved)
    backward_at: int
    #: the tensors its ops save for their backward, each of which checkpoint's hooks pack in
    #: the forward, pack again in the recomputation and unpack in the backward
    saves: int = 0
    #: whether an op of it updates state (kept by the policy: a batch norm's running
    #: statistics move once)
    keeps_state: bool = False


def op_updates_state(op: str) -> bool:
    """Whether an op, by its ATen name, writes into an argument: an in-place op
    (``add_``) or a batch norm (its running statistics), which checkpointing keeps rather
    than runs again (``explorer.runtime.checkpointing.updates_state`` reads the op's schema)."""
    base = op_base_name(op)
    return "batch_norm" in base or base.endswith("_")


def checkpoint_spans(graph: OpGraph, mode: Sequence[str], stage: Sequence[int],
                     has_backward: Sequence[bool], again: Sequence[bool]
                     ) -> list[CheckpointSpan]:
    """The spans the segment runtime checkpoints (:class:`CheckpointSpan`): on each stage, the
    maximal runs of consecutive ops (in node order, its ops alone) of one unit that runs an op
    again (``again``, per node: :func:`recomputation`'s ``first_use >= 0``) with an op whose
    backward runs (``has_backward``), under each node's stage's ``mode``."""
    nodes = graph.nodes
    units = recompute_units(graph)
    rerunning = {(units[i], stage[i]) for i in range(len(nodes)) if again[i]}
    runs: list[list[int]] = []
    last: dict[int, tuple[str, int]] = {}  # per stage: (unit, op) of its latest op
    for i, n in enumerate(nodes):
        if n.kind != "op":
            continue
        s, unit = stage[i], units[i]
        before = last.get(s)
        last[s] = (unit, i)
        if (unit, s) not in rerunning:
            continue
        if before is not None and before[0] == unit and runs and runs[-1][-1] == before[1]:
            runs[-1].append(i)
        else:
            runs.append([i])
    spans = []
    for ops in runs:
        back = [i for i in ops if has_backward[i]]
        if not back:
            continue
        s = stage[ops[0]]
        state = [op_updates_state(nodes[i].op) for i in ops]
        selective = mode[ops[0]] == "selective"
        saving = [i for i in back if nodes[i].saves]
        end = ops.index(saving[-1]) + 1 if saving else 0
        kept = {i for i, st in zip(ops, state, strict=True)
                if st or (selective and is_matmul_like(nodes[i]))} if (selective or any(state)) \
            else set()
        spans.append(CheckpointSpan(stage=s, ops=tuple(ops), policy=selective or any(state),
                                    rerun=tuple(i for i in ops[:end] if i not in kept),
                                    backward_at=back[-1],
                                    saves=sum(len(nodes[i].saves) for i in back),
                                    keeps_state=any(state)))
    return spans
