"""A quick additive memory estimate per node, for partitioners checking that a placement fits.

The simulator computes memory by liveness along the timeline; partitioners need something they
can add up while they move nodes. Each node is charged what it brings to the device it is on:
a parameter its weight, gradient and optimizer state; a buffer its bytes; an op the tensors
kept for its backward (its output when some backward saves it, plus extra saved tensors),
times the micro-batches in flight.

A stage's memory settings (:class:`~explorer.core.plan.StageSettings`) change the charges as
the simulator does: ZeRO over ``replicas`` divides the optimizer state (1), the gradients (2)
and the weights (3) by the replica count; recomputation does not charge the outputs it drops
but charges the values a recomputation starts from (both as the runtime does them:
:func:`explorer.costs.strategies.recomputation`), and the extra tensors ops save (statistics,
masks, indices), which it keeps from the forward; bf16/fp16 charge the 2-byte outputs of
autocast at their size, and a matmul-like op the 2-byte copies autocast makes of the fp32
tensors it saves (weights, fp32 activations) and its extra tensors in 2 bytes. The transient
copies (ZeRO 3's gathered weights, the recomputed activations in the backward) are not charged:
they depend on the schedule, which the simulator has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import DEFAULT_SETTINGS, OPTIMIZER_STATE, StageSettings
from explorer.costs.strategies import (
    FLOAT_DTYPES,
    activation_bytes,
    gathered_half,
    is_matmul_like,
    recomputation,
    shard_bytes,
)


def view_roots(graph: OpGraph) -> list[int]:
    """[node] the node whose memory a view shares (its first input's root; itself else)."""
    root = list(range(len(graph)))
    for i, n in enumerate(graph.nodes):
        if n.is_view and n.inputs:
            root[i] = root[graph.index[n.inputs[0]]]
    return root


@dataclass(frozen=True)
class CastCopies:
    """The 2-byte copies matmul-like ops save under autocast (:func:`cast_copies`)."""

    #: [node] bytes of the copies each op saves
    nbytes: list[int]
    #: (op, saved name) pairs whose value the op keeps as a copy, not as it is
    replaced: frozenset[tuple[int, str]]


def cast_copies(graph: OpGraph, act: list[int], root: list[int],
                half_weights: Sequence[bool] | None = None,
                dropped: Sequence[bool] | None = None) -> CastCopies:
    """The 2-byte copies a matmul-like op saves, under autocast, of the fp32 tensors it reads
    and saves (weights, activations kept in fp32; not the weights ZeRO 3 gathers in 2 bytes,
    ``half_weights``, nor the values recomputation drops, ``dropped``, whose copies are made
    again with them): what they take per op, and which saved values they stand in for."""
    out = [0] * len(graph)
    replaced = set()
    for v, n in enumerate(graph.nodes):
        if n.kind != "op" or not is_matmul_like(n):
            continue
        for name in n.saves:
            r = root[graph.index[name]]
            q = graph.nodes[r]
            if q.dtype != "float32" or q.kind == "buffer" or (
                    half_weights is not None and half_weights[r]) or (
                    dropped is not None and dropped[r]):
                continue
            if q.kind == "param":
                out[v] += q.param_bytes // 2 or q.out_bytes // 2
            elif act[r] == q.out_bytes and q.dtype in FLOAT_DTYPES:
                out[v] += q.out_bytes // 2
                replaced.add((v, name))
    return CastCopies(out, frozenset(replaced))


def node_memory_bytes(graph: OpGraph, optimizer: str = "adam", in_flight: int = 1,
                      batch_fraction: float = 1.0, settings: StageSettings | None = None,
                      replicas: int = 1, device_kind: str = "cuda") -> list[int]:
    """Bytes each node adds to its device (see the module docstring), under ``settings``
    (default: none) on a stage of ``replicas`` devices of ``device_kind``."""
    settings = settings or DEFAULT_SETTINGS
    state = OPTIMIZER_STATE[optimizer]
    plain = settings.is_default
    zero = settings.zero if replicas > 1 else 0
    if not plain:
        half_weights = gathered_half(graph, zero, settings.precision)
        act = activation_bytes(graph, settings.precision, device_kind, half_weights).tolist()
        rec = recomputation(graph, settings.recompute)
        dropped = rec.dropped.tolist()
        root = view_roots(graph)
        half = settings.precision != "fp32"
        cast = (cast_copies(graph, act, root, half_weights.tolist(), dropped) if half
                else CastCopies([0] * len(graph), frozenset()))
        copies = cast.nbytes
        sources = set(rec.sources[0].tolist())
    # (a value an op keeps as autocast's 2-byte copy is not kept as it is for that op)
    saved = {s for v, n in enumerate(graph.nodes) for s in n.saves
             if plain or (v, s) not in cast.replaced}

    def shard(nbytes: int, stage: int) -> int:
        return shard_bytes(nbytes, replicas) if zero >= stage else nbytes

    # (ZeRO 1-2 under bf16/fp16: a 2-byte working copy beside the fp32 master shard)
    working = (half_weights.tolist() if not plain and zero in (1, 2)
               else [False] * len(graph))
    out = []
    for i, n in enumerate(graph.nodes):
        if n.kind == "buffer":
            out.append(n.param_bytes)
        elif n.kind == "param" or n.param_bytes:
            weight = (n.param_bytes // 2 + shard(n.param_bytes, 1) if working[i]
                      else shard(n.param_bytes, 3))
            if n.requires_grad or n.kind == "op":
                out.append(weight + shard(n.param_bytes, 2)
                           + shard(n.param_bytes, 1) * state)
            else:
                out.append(shard(n.param_bytes, 3))
        elif n.kind == "op":
            if plain:
                kept = (0 if n.is_view or n.name not in saved else n.out_bytes) \
                    + n.saved_extra_bytes
            else:
                extra = n.saved_extra_bytes
                if half and is_matmul_like(n) and act[i] < n.out_bytes:
                    extra //= 2  # (made in its 2-byte compute dtype, as its output)
                charged = not n.is_view and n.name in saved and not dropped[i]
                kept = (act[i] if charged or (i in sources and not n.is_view) else 0) \
                    + extra + copies[i]
            out.append(int(kept * batch_fraction * in_flight))
        else:  # inputs: the batch itself
            out.append(int(n.out_bytes * batch_fraction * in_flight))
    return out


def zero_sharded_bytes(graph: OpGraph, optimizer: str, zero: int,
                       precision: str = "fp32") -> list[int]:
    """Bytes of each node's charge on one device (:func:`node_memory_bytes` with one replica)
    that ZeRO stage ``zero`` divides by the replica count: the optimizer state (1), the
    gradient too (2), the weight too (3); under ZeRO 1-2 in bf16/fp16 the fp32 weight too,
    as the master copy sharded with the optimizer state (the replicas hold a 2-byte working
    copy besides: :func:`zero_working_bytes`)."""
    state = OPTIMIZER_STATE[optimizer]
    working = zero_working_bytes(graph, zero, precision)
    out = []
    for n, half in zip(graph.nodes, working, strict=True):
        pb = n.param_bytes if n.kind != "buffer" and (n.kind == "param" or n.param_bytes) else 0
        trains = n.requires_grad or n.kind == "op"
        out.append(pb * ((state if zero >= 1 and trains else 0)
                         + (1 if zero >= 2 and trains else 0) + (1 if zero >= 3 or half else 0)))
    return out


def zero_working_bytes(graph: OpGraph, zero: int, precision: str) -> list[int]:
    """Bytes each trained weight adds to its charge on a stage with replicas under ZeRO 1-2
    in bf16/fp16 (:func:`node_memory_bytes`): its 2-byte working copy, beside the master
    copy's shard (:func:`zero_sharded_bytes`)."""
    half = gathered_half(graph, zero, precision) if zero in (1, 2) else None
    return [n.param_bytes // 2 if half is not None and half[i] and n.requires_grad else 0
            for i, n in enumerate(graph.nodes)]


def stage_memory_bytes(graph: OpGraph, stage_of: Sequence[int], n_stages: int,
                       optimizer: str = "adam", in_flight: int = 1,
                       batch_fraction: float = 1.0,
                       settings: Sequence[StageSettings] | None = None,
                       replicas: Sequence[int] | None = None,
                       device_kind: str = "cuda") -> list[int]:
    """Sum of :func:`node_memory_bytes` per stage for a placement (stage index per node),
    each stage under its ``settings`` with its ``replicas``."""
    stage_a = np.asarray(stage_of, dtype=np.int64)
    out = [0] * n_stages
    groups: dict[tuple[StageSettings, int], list[int]] = {}
    for s in range(n_stages):
        key = (settings[s] if settings else DEFAULT_SETTINGS, replicas[s] if replicas else 1)
        groups.setdefault(key, []).append(s)
    for (sett, reps), stages in groups.items():
        per = node_memory_bytes(graph, optimizer, in_flight, batch_fraction, sett, reps,
                                device_kind)
        for s in stages:
            out[s] = int(sum(b for b, on in zip(per, (stage_a == s).tolist(), strict=True)
                             if on))
    return out
