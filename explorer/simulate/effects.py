"""What a plan's per-stage memory settings change in the simulated step: op times, recomputed
forwards, ZeRO's collectives and which bytes each device holds.

A plan without settings never reaches this module (its predictions are those of the plain
simulator). With settings, :func:`stage_effects` derives per node and stage what changes;
:meth:`StageEffects.scale_by_precision` scales the op times and
:meth:`StageEffects.add_recomputation` adds the recomputed
forwards to the backwards that run them; :func:`add_weight_gathers` makes ZeRO-3's per
micro-batch all-gathers of the weights, a unit's (block's) in one, one op ahead of their use
(prefetch depth 1), in 2 bytes per element under bf16/fp16;
:mod:`explorer.simulate.tasks` makes the reduce-scatters and ZeRO 1-2's all-gathers, and
:mod:`explorer.simulate.memory` reads the rest (shards, dropped activations, gathered copies).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan, StageSettings
from explorer.costs.model import CHECKPOINT_KEYS, CostModel
from explorer.costs.strategies import (
    CheckpointSpan,
    activation_bytes,
    checkpoint_spans,
    gather_groups,
    gathered_half,
    is_matmul_like,
    recomputation,
    recompute_units,
    shard_bytes,
)
from explorer.devices.cluster import Cluster
from explorer.simulate.arrays import KIND_BUFFER, KIND_PARAM, GraphArrays
from explorer.simulate.tensor import (
    activations_per_device,
    per_device,
    replica_group,
    saved_extra_per_device,
)

#: task kinds of the ZeRO collectives (on a stage's replica channel, like the all-reduces)
REDUCE_SCATTER, ALLGATHER = "reduce-scatter", "all-gather"


@dataclass(frozen=True)
class Gather:
    """A ZeRO-3 all-gather of a group of weights (:func:`gather_groups`) for one
    micro-batch's forward or backward uses."""

    task: int
    weights: tuple[int, ...]  # the parameter nodes
    stage: int
    mb: int
    readers: np.ndarray  # template slots of the forwards (or backwards) that use it


@dataclass
class StageEffects:
    """Per stage and node, what the plan's memory settings change."""

    settings: list[StageSettings]  # [stage]
    zero: list[int]  # [stage] ZeRO stage in effect (0 where the stage has one replica)
    #: [node] output bytes on its device under its stage's precision (a tensor-parallel
    #: stage's share of what its layout keeps split)
    act_bytes: np.ndarray
    dropped: np.ndarray  # [node] bool: its saved output is recomputed, not kept
    rc_op: np.ndarray  # [node] the op whose backward first runs it again, -1
    #: [node] bytes of one rank's shard of its weight (of the device's share of a split
    #: weight; its bytes on the device without ZeRO)
    shard: np.ndarray
    #: [node] bytes saved besides outputs, on its device under its stage's precision
    extra_bytes: np.ndarray
    recompute_s: list[float] = field(default_factory=list)  # [stage] per micro-batch
    #: filled while the tasks are made: param -> the reduce-scatters that free its full
    #: gradient (one per micro-batch where the stage reduces each apart, else one)
    grad_done: dict[int, list[int]] = field(default_factory=dict)
    gathers: list[Gather] = field(default_factory=list)
    #: [node] its recomputation unit (:func:`recompute_units`; where a stage has ZeRO 3: its
    #: weights are gathered a unit at a time)
    units: list[str] = field(default_factory=list)
    #: (value, op) pairs: values kept for a recomputation, until the backward of that op (the
    #: last of their unit to run; :func:`~explorer.costs.strategies.recomputation`)
    sources: tuple[np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.zeros(0, dtype=np.int64),) * 2)
    #: what the segment runtime checkpoints on a recomputing stage (:func:`checkpoint_spans`)
    spans: list[CheckpointSpan] = field(default_factory=list)
    #: [stage] whether its ranks run segments (checkpointing spans; set by
    #: ``add_recomputation``)
    spans_run: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    #: [node] where what an op saves besides its output (statistics, masks, indices) starts
    #: to be held: -1 from its forward; else the op in whose backward checkpoint makes it
    #: again (an op its span runs again: checkpoint keeps none of what the span saves)
    extra_from: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: [node] the op whose backward runs first in the checkpointed span of the node's op, on a
    #: stage that runs segments (where checkpoint runs the span again), else -1
    span_first: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: [node] the op in whose backward checkpoint makes the node's output again, where its
    #: span keeps no state (then it runs again whole there), else -1
    rerun_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: (op, value) pairs under bf16/fp16: autocast casts each fp32 tensor a matmul-like op
    #: reads (weights, and activations made in fp32) to 2 bytes per element, and the op saves
    #: that copy for its backward instead of the tensor itself (not a copy of a value the
    #: op's unit recomputes: that is cast again when the backward unpacks it)
    casts: tuple[np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.zeros(0, dtype=np.int64),) * 2)
    #: per pair of ``casts``: the value is a weight the op reads itself (not a view of it),
    #: held whole on its stage (not a ZeRO 3 gather) that recomputes nothing: autocast's
    #: cache then makes one copy a step, which every micro-batch shares (the runtime runs a
    #: step's forwards under one autocast context, :func:`explorer.runtime.params.cast_once`)
    cast_once: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    #: [node] a weight ZeRO 3 gathers in 2 bytes (its stage runs bf16/fp16:
    #: :func:`~explorer.costs.strategies.gathered_half`); autocast makes no copy of it
    half_weights: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def scale_by_precision(self, graph: OpGraph, costs: CostModel, plan: Plan,
                           A: GraphArrays, st: np.ndarray, fwd_d: np.ndarray,
                           bwd_d: np.ndarray) -> None:
        """Scale ``fwd_d`` and ``bwd_d`` (seconds per node, in place) by each stage's
        precision on its slowest device type (:meth:`CostModel.precision_factors`: measured
        where the profile timed that precision)."""
        for s, sett in enumerate(self.settings):
            if sett.precision == "fp32":
                continue
            one_of_each = {costs.cluster.device(d).type_key: d for d in plan.stages[s]}
            factors = [costs.precision_factors(graph, d, sett.precision)
                       for d in one_of_each.values()]
            on = (st == s) & A.is_op
            fwd_d[on] *= np.max([f for f, _ in factors], axis=0)[on]
            bwd_d[on] *= np.max([b for _, b in factors], axis=0)[on]

    def add_recomputation(self, graph: OpGraph, costs: CostModel, plan: Plan,
                          A: GraphArrays, st: np.ndarray, fwd_d: np.ndarray,
                          bwd_d: np.ndarray) -> None:
        """Add every recomputed forward (its collectives included, where ``fwd_d`` has them)
        to the backward that runs it (:meth:`_recomputed`), and what ZeRO 3's gathers cost
        the ranks' processors (``scale_by_precision`` has run)."""
        is_op, has_b = A.is_op, A.has_b
        extra = self._recomputed(costs, plan, A, st, fwd_d)
        self.recompute_s = np.bincount(st, weights=extra, minlength=len(self.settings)).tolist()
        bwd_d += np.where(has_b, extra, 0.0)
        # ZeRO 3: what each gather costs the rank's processor beyond the link (measured on
        # CPU ranks, DeviceCosts.collective_s), in the op that waits for it: the group's
        # first reader in the forward, the first to run backward in the backward
        for s, z in enumerate(self.zero):
            cost = max(costs.device_costs(d).collective_s for d in plan.stages[s]) \
                if z == 3 else 0.0
            if cost <= 0.0:
                continue
            stage_ops = set(np.flatnonzero((st == s) & is_op).tolist())
            for _, readers in weight_groups(A, st, s, graph.succs, stage_ops, self.units):
                fwd_d[readers[0]] += cost
                if back := [c for c in readers if has_b[c]]:
                    bwd_d[back[-1]] += cost

    def run_again(self, A: GraphArrays, st: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """[node] what running the recomputed forwards again adds to each op's backward, an
        op's forward taking ``seconds`` (its device time, or its host's time to issue it:
        recomputation issues the ops again): on the op path in the first backward that needs
        its value, in a span's first backward where the stage runs segments
        (``add_recomputation`` has run)."""
        extra = np.zeros(A.n)
        rc = np.flatnonzero(A.is_op & (self.rc_op >= 0) & ~self.spans_run[st])
        np.add.at(extra, self.rc_op[rc], seconds[rc])
        for span in self.spans:
            if self.spans_run[span.stage]:
                extra[span.backward_at] += seconds[list(span.rerun)].sum()
        return extra

    def _recomputed(self, costs: CostModel, plan: Plan, A: GraphArrays, st: np.ndarray,
                    fwd_d: np.ndarray) -> np.ndarray:
        """[node] the seconds recomputation adds to each op's backward (and checkpointing's
        own cost to ``fwd_d``, in place). A stage profiled for the segment runtime
        checkpoints spans (:func:`checkpoint_spans`): in each span's first backward, torch's
        checkpoint runs the span's forward again from its start up to the last op that saves
        a value, but the ops a policy keeps, and costs what the host probe measured per span,
        per tensor its ops save and per op under a policy (``DeviceCosts.checkpoint``); on
        the op path each op that makes a dropped value runs again in the first backward that
        needs it. Sets ``extra_from``, ``span_first`` and ``rerun_at``."""
        self.spans_run = np.array([any(costs.device_costs(d).runtime == "segments"
                                       for d in plan.stages[s])
                                   for s in range(len(plan.stages))], dtype=bool)
        extra = self.run_again(A, st, fwd_d)
        spans = [x for x in self.spans if self.spans_run[x.stage]]
        self.extra_from = np.full(A.n, -1, dtype=np.int64)
        self.span_first = np.full(A.n, -1, dtype=np.int64)
        self.rerun_at = np.full(A.n, -1, dtype=np.int64)
        for span in spans:
            if not span.keeps_state:
                self.rerun_at[list(span.rerun)] = span.backward_at
            self.extra_from[list(span.rerun)] = span.backward_at
            self.span_first[list(span.ops)] = span.backward_at
        per_stage = {s: {k: max(costs.device_costs(d).checkpoint.get(k, 0.0)
                                for d in plan.stages[s]) for k in CHECKPOINT_KEYS}
                     for s in {x.stage for x in spans}}
        for span in spans:
            ck, policy_ops = per_stage[span.stage], len(span.ops) * span.policy
            fwd_d[span.ops[0]] += (ck["span_fwd_s"] + span.saves * ck["saved_fwd_s"]
                                   + policy_ops * ck["policy_op_fwd_s"])
            extra[span.backward_at] += (ck["span_bwd_s"] + span.saves * ck["saved_bwd_s"]
                                        + policy_ops * ck["policy_op_bwd_s"])
        return extra


def stage_effects(graph: OpGraph, plan: Plan, A: GraphArrays, st: np.ndarray,
                  cluster: Cluster) -> StageEffects:
    """What ``plan``'s settings change, per node (on the stage that runs it)."""
    S = len(plan.stages)
    settings = [plan.settings_of(s) for s in range(S)]
    zero = [x.zero if plan.replicas_of(s) > 1 else 0 for s, x in enumerate(settings)]
    # ZeRO 3 under bf16/fp16 gathers 2-byte weights
    half_weights = np.zeros(A.n, dtype=bool)
    for s in range(S):
        half_weights |= (st == s) & gathered_half(graph, zero[s], settings[s].precision)
    act = A.out_b.copy()
    for prec in {x.precision for x in settings} - {"fp32"}:
        for kind in {cluster.device(plan.stages[s][0]).kind for s in range(S)
                     if settings[s].precision == prec}:
            on = np.array([settings[s].precision == prec
                           and cluster.device(plan.stages[s][0]).kind == kind
                           for s in range(S)], dtype=bool)[st]
            act = np.where(on, activation_bytes(graph, prec, kind, half_weights), act)
    # recomputation as the runtime does it: dropped outputs made again in the first backward
    # that needs them, the kept values they start from held until their unit's last backward
    mode = np.array([x.recompute for x in settings], dtype=object)[st]
    rec = recomputation(graph, mode.tolist(), st, A.has_b)
    dropped, rc_op, sources = rec.dropped, rec.first_use, rec.sources
    half = np.array([x.precision != "fp32" for x in settings], dtype=bool)[st]
    casts, once = [], []
    units = recompute_units(graph)
    for v in np.flatnonzero(half & A.is_op & A.has_b).tolist():
        if not is_matmul_like(graph.nodes[v]):
            continue
        for name in graph.nodes[v].saves:
            q = int(A.root_a[graph.index[name]])
            # (the copy of a value its unit recomputes is recomputed with it)
            recast = dropped[q] and st[q] == st[v] and units[q] == units[v]
            if graph.nodes[q].dtype == "float32" and not half_weights[q] and not recast and (
                    A.kcode[q] == KIND_PARAM
                    or (act[q] == A.out_b[q] and A.kcode[q] != KIND_BUFFER)):
                casts.append((v, q))
                once.append(A.kcode[q] == KIND_PARAM and graph.index[name] == q
                            and zero[st[v]] != 3 and mode[v] == "none")
    cv = np.array(casts, dtype=np.int64).reshape(-1, 2)
    # what a matmul-like op saves besides its inputs (the contiguous copies it makes of
    # them) is made in its 2-byte compute dtype too
    mm = np.array([is_matmul_like(n) for n in graph.nodes], dtype=bool)
    extra = np.where(mm & (act < A.out_b), A.extra // 2, A.extra)
    # a tensor-parallel stage's device holds its share of what the layout splits, and ZeRO
    # shards each device's share of a weight over the stage's replicas
    act = activations_per_device(graph, plan, act)
    extra = saved_extra_per_device(graph, plan, extra)
    held = np.asarray(per_device(graph, plan, A.pbytes), dtype=np.int64)
    shard = held.copy()
    for s in range(S):
        if zero[s]:
            on = np.flatnonzero((st == s) & (A.pbytes != 0) & (A.kcode != KIND_BUFFER))
            shard[on] = [shard_bytes(int(b), plan.replicas_of(s)) for b in held[on]]
    spans = checkpoint_spans(graph, mode.tolist(), st.tolist(), A.has_b.tolist(),
                             (rc_op >= 0).tolist())
    return StageEffects(settings, zero, act, dropped, rc_op, shard, extra, sources=sources,
                        casts=(cv[:, 0], cv[:, 1]), cast_once=np.array(once, dtype=bool),
                        half_weights=half_weights,
                        spans=spans, units=units if 3 in zero else [])


def weight_groups(A: GraphArrays, st: np.ndarray, s: int, succs: list[list[int]],
                  stage_ops: Container[int], units: list[str]
                  ) -> list[tuple[list[int], list[int]]]:
    """ZeRO 3's gather groups of stage ``s`` (:func:`gather_groups` over ``units``), each with
    the ops of the stage (``stage_ops``) that read one of its weights, in node order."""
    weights = np.flatnonzero((st == s) & (A.pbytes != 0) & (A.kcode != KIND_BUFFER))
    read_by = {w: [w] if A.is_op[w] else [c for c in succs[w] if c in stage_ops]
               for w in weights.tolist()}
    return [(group, sorted({c for w in group for c in read_by[w]}))
            for group in gather_groups({w: min(r) for w, r in read_by.items() if r},
                                       units.__getitem__)]


def add_weight_gathers(b: Any) -> int:
    """ZeRO 3: per micro-batch, one all-gather of each group of weights (those first read in
    the same recomputation unit, :func:`gather_groups`, as the runtime gathers them) before the
    forward of the first op that reads one and another before the backward of the last one
    (the first to run backward), on the stage's replica channel; the group's gathered copy
    lives until its last reader is done. Prefetch depth 1: each may start once the op
    two places before its first user (in running order) is done, so it overlaps the op
    between (the two weights used first in a micro-batch's backward, once the backward
    before it is done, or for the first, the forward that runs last before it). ``b`` is the
    task builder (:mod:`explorer.simulate.tasks`), its stage effects and forward/backward
    block made; returns the bytes the gathers move."""
    moved = 0
    eff, A, st, M = b.eff, b.A, b.st, b.M
    off_f, off_b, per_m = b.fb.fwd, b.fb.bwd, b.fb.per_mb
    sf, sb = b.slots_f, b.slots_b
    py_src, py_dst = b.edges.src, b.edges.dst
    N = A.n
    for s, z in enumerate(eff.zero):
        ops = b.ops_by_stage[s]
        if z != 3 or not len(ops):
            continue
        devs = replica_group(b.plan, s)
        held = b.held  # (a device's share of a split weight)
        chan = b.resource(("allreduce", s, -1))
        pos = {int(o): k for k, o in enumerate(ops.tolist())}
        bops = ops[A.has_b[ops]].tolist()
        bpos = {o: k for k, o in enumerate(bops)}
        lead = int(np.flatnonzero(sf[s] < sb[s, 0]).max()) if (sf[s] < sb[s, 0]).any() else 0
        for group, readers in weight_groups(A, st, s, b.g.succs, pos, eff.units):
            nbytes = int(sum(held[w] // 2 if eff.half_weights[w] else held[w]
                             for w in group))
            label = "all-gather " + ", ".join(A.names[w] for w in group)
            dur = b.costs.allgather_s(devs, nbytes)
            first = min(pos[c] for c in readers)
            breaders = [c for c in readers if c in bpos]
            last = max((bpos[c] for c in breaders), default=-1)
            f_slots = off_f[readers]
            b_slots = off_b[breaders]
            for m in range(M):
                mo = m * per_m
                t = b.task(ALLGATHER, chan, dur, sf[s, m] * b.W + min(readers) + N + 1,
                           label, m, nbytes)
                k = first - 2
                if k >= 0:
                    py_src.append(int(off_f[ops[k]]) + mo)
                    py_dst.append(t)
                elif m and len(ops) + k >= 0:
                    py_src.append(int(off_f[ops[len(ops) + k]]) + mo - per_m)
                    py_dst.append(t)
                py_src.extend([t] * len(f_slots))
                py_dst.extend((f_slots + mo).tolist())
                eff.gathers.append(Gather(t, tuple(group), s, m, f_slots))
                moved += (len(devs) - 1) * nbytes
                if last < 0:
                    continue
                t = b.task(ALLGATHER, chan, dur, sb[s, m] * b.W - bops[last] + N + 1,
                           f"{label} (backward)", m, nbytes)
                if last + 2 < len(bops):
                    after = int(off_b[bops[last + 2]]) + mo
                elif m:  # the stage's backward of the micro-batch before
                    after = int(off_b[bops[0]]) + mo - per_m
                else:  # the forward the schedule runs last before its first backward
                    after = int(off_f[ops[-1]]) + lead * per_m
                py_src.append(after)
                py_dst.append(t)
                py_src.extend([t] * len(b_slots))
                py_dst.extend((b_slots + mo).tolist())
                eff.gathers.append(Gather(t, tuple(group), s, m, b_slots))
                moved += (len(devs) - 1) * nbytes
    return moved
