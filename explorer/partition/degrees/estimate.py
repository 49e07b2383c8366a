"""The degrees search's cost model: per-layer costs of a ``dp x tp`` stage mesh, and the exact
DP that cuts the layers into ``pp`` such stages.

Per layer, the costs are pipeline-dp's (:func:`~explorer.partition.pipeline_dp.stage_cost_table`:
fixed per-op seconds per micro-batch, the seconds that shrink with the batch, the optimizer
step, parameter and activation bytes, the gradient bytes all-reduced, the tensors crossing
layers), changed by the Megatron layout of a ``tp``-way split
(:func:`explorer.core.tensor_layout.megatron_layout`, kept per graph and degree), as the
simulator prices it: a split op's time beyond its per-op overhead at ``1 / tp`` (its
fixed part too, which for a small batch is mostly reading the weights), split weights'
bytes, gradients, optimizer state and optimizer step at ``1 / tp``, split activations at
``1 / tp``, and the block all-reduces (and the all-gathers before random ops) on one tensor
group, linear in bytes (latency per micro-batch, bytes at the batch fraction).

A stage ``[j0, j1)`` on a ``dp x tp`` mesh then takes, per step (:meth:`MeshCosts.stage_time_s`)

    M x fixed + var / dp + optimizer + boundary transfers (latency per tensor and micro-batch,
    bytes / dp over the slowest link between consecutive stages) + the all-reduce of its
    gradients over the ``dp`` replicas (when ``dp > 1``),

and holds (:meth:`MeshCosts.stage_memory_bytes`) its parameters, gradients and optimizer state,
weights it receives, plus the activations of the micro-batches in flight at batch fraction
``1 / (dp x M)``: all ``M`` with GPipe, ``min(S - index, M)`` with 1F1B; under the memory
settings the search was given, as :func:`explorer.costs.memory.node_memory_bytes` counts
them (recomputation's and the precision's activations), what ZeRO shards divided over the
``dp`` replicas. A split into ``S``
stages scores ``slowest stage x (M + S - 1) / M``, the pipeline bubble, as pipeline-dp's does.
Every stage has the same mesh and device type mix, so a stage's cost depends on its position
only through pins; :func:`best_cuts` solves every ``S`` at once, exactly for this model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import StageSettings
from explorer.core.tensor_layout import megatron_layout
from explorer.costs.memory import node_memory_bytes, zero_sharded_bytes, zero_working_bytes
from explorer.costs.model import CostModel
from explorer.costs.strategies import is_matmul_like
from explorer.partition.pipeline_dp import (
    StageCostTable,
    StageTables,
    linear_fit,
    replicated_bytes,
)
from explorer.simulate.context import is_fused_attention, ring_bytes


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of the graph split ``tp`` ways (rows of ``fixed_s``, ``var_s`` and
    ``optimizer_s``: device types), the table behind them and its crossing tables."""

    tp: int
    table: StageCostTable
    tables: StageTables
    #: per micro-batch, the latency of the tensor all-reduces of the layer (seconds)
    tensor_lat_count: np.ndarray
    #: per step at the whole batch, the bytes the layer's tensor all-reduces move
    tensor_bytes: np.ndarray
    #: (lat, s per byte) of one all-reduce over a tensor group
    tensor_ar: tuple[float, float]


def layer_costs(graph: OpGraph, costs: CostModel, base: StageCostTable,
                layers: Sequence[Sequence[int]], tp: int, tensor_group: Sequence[str],
                optimizer: str, type_ids: Sequence[str], sequence: bool = False,
                settings: StageSettings | None = None,
                async_tensor: bool = False) -> LayerCosts | None:
    """The per-layer costs of ``base`` (pipeline-dp's table of ``layers`` on the device types
    ``type_ids``, its memory under the memory ``settings``) with the graph split ``tp`` ways
    on ``tensor_group`` (``sequence``: with sequence parallelism; its once-a-step all-reduce
    of the norms' weights is left to the simulator); None when the layout splits no weight
    at that degree. ``async_tensor`` (with ``sequence``, on devices that pipeline them): a
    matrix product's all-gathers and reduce-scatters count one piece in ``tp``, the part
    that a product longer than its transfer leaves exposed (the simulator prices both
    sides)."""
    if tp == 1:
        return LayerCosts(1, base, StageTables(base), np.zeros(len(layers)),
                          np.zeros(len(layers)), (0.0, 0.0))
    layout = megatron_layout(graph, tp, sequence)
    if not layout.placements:
        return None
    n = len(layers)
    layer_of = np.zeros(len(graph), dtype=np.int64)
    for j, layer in enumerate(layers):
        layer_of[list(layer)] = j
    keep = 1.0 - 1.0 / tp
    idx = graph.index
    kind = costs.cluster.device(type_ids[0]).kind
    fixed_mem = np.asarray(node_memory_bytes(graph, optimizer, 1, 0.0, settings, 1, kind),
                           dtype=float)
    full_mem = np.asarray(node_memory_bytes(graph, optimizer, 1, 1.0, settings, 1, kind),
                          dtype=float)
    zero = base.sharded_bytes is not None and settings is not None
    sharded = (np.asarray(zero_sharded_bytes(graph, optimizer, settings.zero,
                                             settings.precision), dtype=float)
               if zero else None)
    working = (np.asarray(zero_working_bytes(graph, settings.zero, settings.precision),
                          dtype=float) if zero and base.working_bytes is not None else None)
    param_cut, grad_cut, opt_bytes_cut, act_cut, sharded_cut, working_cut = (
        np.zeros(n) for _ in range(6))
    def in_order(names) -> list[int]:  # graph order: sums that do not depend on hashing
        return sorted(idx[name] for name in names)

    for i in in_order(layout.placements):
        param_cut[layer_of[i]] += fixed_mem[i] * keep
        if sharded is not None:
            sharded_cut[layer_of[i]] += sharded[i] * keep
        if working is not None:
            working_cut[layer_of[i]] += working[i] * keep
        nd = graph.nodes[i]
        if nd.kind == "param" and nd.requires_grad:
            grad_cut[layer_of[i]] += nd.out_bytes * keep
        opt_bytes_cut[layer_of[i]] += nd.param_bytes * keep
    var_cut, fixed_cut = np.zeros((len(type_ids), n)), np.zeros((len(type_ids), n))
    # the split op's part: 1 / tp of its work at any batch fraction, the per-op overhead
    # whole (as the simulator's Seconds.on with a share)
    overhead = [costs.device_costs(dev).overhead_s * costs.compute_scale + costs.extra_op_s
                for dev in type_ids]
    for i in in_order(layout.split_ops):
        nd = graph.nodes[i]
        if nd.name not in layout.reduce_forward:
            act_cut[layer_of[i]] += (full_mem[i] - fixed_mem[i]) * keep
        passes = [costs.fwd_s] + ([costs.bwd_s] if nd.requires_grad else [])
        for k, (dev, ovh) in enumerate(zip(type_ids, overhead, strict=True)):
            for fn in passes:
                t0 = fn(i, dev, 0.0)
                var_cut[k, layer_of[i]] += (fn(i, dev, 1.0) - t0) * keep
                fixed_cut[k, layer_of[i]] += max(0.0, t0 - ovh) * keep
    lat, spb = linear_fit(lambda x: costs.allreduce_s(tuple(tensor_group), int(x)))
    count, nbytes = np.zeros(n), np.zeros(n)
    pipelined = sequence and async_tensor and all(
        costs.platform(dev).pipelines_tensor_collectives for dev in tensor_group)
    for _, kind, reduce in layout.collectives():
        share = 1.0 if kind == "allreduce" else 0.5  # (an all-gather or a reduce-scatter)
        for i in in_order(reduce):
            j = layer_of[i]
            exposed = (1.0 / tp if pipelined and kind != "allreduce"
                       and is_matmul_like(graph.nodes[i]) else 1.0)
            count[j] += share * exposed
            nbytes[j] += share * exposed * reduce[graph.nodes[i].name]
    per_byte = np.array([costs.optimizer_s(dev, optimizer, 1, 0) for dev in type_ids])
    table = replace(base, fixed_s=base.fixed_s - fixed_cut + count * lat,
                    var_s=base.var_s - var_cut + nbytes * spb,
                    optimizer_s=base.optimizer_s - per_byte[:, None] * opt_bytes_cut,
                    param_bytes=base.param_bytes - param_cut,
                    act_bytes=base.act_bytes - act_cut, grad_bytes=base.grad_bytes - grad_cut,
                    sharded_bytes=None if base.sharded_bytes is None
                    else base.sharded_bytes - sharded_cut,
                    working_bytes=None if base.working_bytes is None
                    else base.working_bytes - working_cut)
    return LayerCosts(tp, table, StageTables(table), count, nbytes, (lat, spb))


def with_context(lc: LayerCosts, graph: OpGraph, costs: CostModel,
                 layers: Sequence[Sequence[int]], context: int, context_group: Sequence[str],
                 sequence: bool, settings: StageSettings | None = None) -> LayerCosts:
    """``lc`` (a split ``lc.tp`` ways, ``sequence`` as its layout) with each layer's sequence
    also split ``context`` ways over ``context_group``: the mesh counts ``dp x context``
    replicas of the tokens, and each fused attention adds the part of its ring that the
    attention beside it does not hide (:mod:`explorer.simulate.context`: the keys and values
    once round in the forward and twice in the backward, one ring step in ``context``
    exposed)."""
    if context == 1:
        return lc
    precision = settings.precision if settings else "fp32"
    split = (megatron_layout(graph, lc.tp, sequence).split_ops if lc.tp > 1 else set())
    lat, spb = linear_fit(lambda x: costs.allgather_s(tuple(context_group), int(x)))
    count, ring = np.zeros(len(layers)), np.zeros(len(layers))
    for j, layer in enumerate(layers):
        for i in layer:
            node = graph.nodes[i]
            if not is_fused_attention(node):
                continue
            share = lc.tp if node.name in split else 1
            passes = 3 if node.requires_grad else 1
            count[j] += passes / context
            # (x context bytes in the ring / context pieces)
            ring[j] += passes * ring_bytes(graph, i, precision) / share
    table = replace(lc.table, fixed_s=lc.table.fixed_s + count * lat,
                    var_s=lc.table.var_s + ring * spb)
    return replace(lc, table=table, tables=StageTables(table))


@dataclass(frozen=True)
class MeshCosts:
    """The links a ``dp x tp`` mesh's stages use: the slowest link between consecutive
    stages, the gradient all-reduce over ``dp`` replicas (linear in bytes), and the smallest
    device memory."""

    dp: int
    micro_batches: int
    schedule: str
    link_latency_s: float
    link_s_per_byte: float
    ar_latency_s: float
    ar_s_per_byte: float
    capacity_bytes: float

    def in_flight(self, remaining: int) -> int:
        m = self.micro_batches
        return m if self.schedule == "gpipe" else min(remaining, m)

    # -- reference implementation, stage by stage (the DP uses matrices of the same sums) --
    def stage_time_s(self, lc: LayerCosts, j0: int, j1: int) -> float:
        t, m, dp = lc.table, self.micro_batches, self.dp
        comp = max(m * float(t.fixed_s[k, j0:j1].sum()) + float(t.var_s[k, j0:j1].sum()) / dp
                   + float(t.optimizer_s[k, j0:j1].sum()) for k in range(t.fixed_s.shape[0]))
        tb = lc.tables
        xfer = (self.link_latency_s * (tb.recv_cnt[j0, j1] + tb.grad_cnt[j0, j1])
                + self.link_s_per_byte * (tb.recv_b[j0, j1] + tb.grad_b[j0, j1]) / dp)
        gb = float(t.grad_bytes[j0:j1].sum())
        ar = self.ar_latency_s + self.ar_s_per_byte * gb if dp > 1 and gb > 0 else 0.0
        return comp + float(xfer) + ar

    def stage_memory_bytes(self, lc: LayerCosts, j0: int, j1: int, remaining: int) -> float:
        t, tb = lc.table, lc.tables
        frac = self.in_flight(remaining) / (self.dp * self.micro_batches)
        fixed = replicated_bytes(
            float(t.param_bytes[j0:j1].sum()),
            None if t.sharded_bytes is None else float(t.sharded_bytes[j0:j1].sum()),
            None if t.working_bytes is None else float(t.working_bytes[j0:j1].sum()), self.dp)
        return (fixed + float(tb.recv_par[j0, j1])
                + (float(t.act_bytes[j0:j1].sum()) + float(tb.recv_act[j0, j1])) * frac)

    def score_s(self, lc: LayerCosts, bounds: Sequence[int],
                pin_stage: Sequence[int] | None = None) -> float:
        """``slowest stage x (M + S - 1) / M`` of the split at ``bounds`` (``0 = b0 < b1 <
        ... < bS = L``); inf when a stage does not fit or breaks a pin (``pin_stage[j]``: the
        stage index layer ``j`` must be in, -1 for none)."""
        s_count = len(bounds) - 1
        worst = 0.0
        for k in range(s_count):
            j0, j1 = bounds[k], bounds[k + 1]
            if pin_stage is not None and any(p not in (-1, k) for p in pin_stage[j0:j1]):
                return math.inf
            if self.stage_memory_bytes(lc, j0, j1, s_count - k) > self.capacity_bytes:
                return math.inf
            worst = max(worst, self.stage_time_s(lc, j0, j1))
        m = self.micro_batches
        return worst * (m + s_count - 1) / m


def _matrices(lc: LayerCosts, mesh: MeshCosts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Time, fixed memory and activation memory (of one micro-batch at the whole batch) of
    every stage ``[j0, j1)``, as [j0, j1] matrices (inf time where j1 <= j0)."""
    tb, m, dp = lc.tables, mesh.micro_batches, mesh.dp
    comp = None
    for k in range(len(tb.fixed)):
        c = m * tb.diff(tb.fixed[k]) + tb.diff(tb.var[k]) / dp + tb.diff(tb.opt[k])
        comp = c if comp is None else np.maximum(comp, c)
    time = comp + mesh.link_latency_s * (tb.recv_cnt + tb.grad_cnt) + mesh.link_s_per_byte * (
        tb.recv_b + tb.grad_b) / dp
    if dp > 1:
        gb = tb.diff(tb.grad)
        time = time + np.where(gb > 0, mesh.ar_latency_s + mesh.ar_s_per_byte * gb, 0.0)
    time = np.where(tb.empty, np.inf, time)
    fixed = replicated_bytes(tb.diff(tb.param), tb.span(tb.sharded), tb.span(tb.working),
                             dp) + tb.recv_par
    return time, fixed, tb.diff(tb.act) + tb.recv_act


@dataclass(frozen=True)
class Cuts:
    """:func:`best_cuts`' answer: per stage count ``S`` (index ``S - 1``), the smallest
    slowest-stage time and the layer bounds of a split that reaches it (empty when none)."""

    bottleneck_s: tuple[float, ...]
    bounds: tuple[tuple[int, ...], ...]

    def score_s(self, s_count: int, micro_batches: int) -> float:
        return self.bottleneck_s[s_count - 1] * (micro_batches + s_count - 1) / micro_batches


def best_cuts(lc: LayerCosts, mesh: MeshCosts, max_stages: int,
              pin_stage: Sequence[int] | None = None) -> Cuts:
    """For every stage count ``S <= max_stages``, the split of the layers into ``S``
    contiguous stages with the smallest slowest-stage time among those that fit.

    ``f[t, j]``: the best bottleneck of layers ``j..L-1`` in ``t`` stages, the first of
    which keeps ``in_flight(t)`` micro-batches; one pass over ``t`` solves every ``S``. With
    pins (``pin_stage[j]``: the index a layer's stage must have) a stage's index matters, so
    each ``S`` is solved on its own."""
    n = lc.table.n_layers
    max_stages = min(max_stages, n)
    time, fixed_mem, act_mem = _matrices(lc, mesh)
    frac = 1.0 / (mesh.dp * mesh.micro_batches)
    by_flight: dict[int, np.ndarray] = {}

    def cost(flight: int) -> np.ndarray:
        if flight not in by_flight:
            fits = fixed_mem + act_mem * (flight * frac) <= mesh.capacity_bytes
            by_flight[flight] = np.where(fits, time, np.inf)
        return by_flight[flight]

    if pin_stage is None or all(p < 0 for p in pin_stage):
        f, choice = _solve(cost, mesh, n, max_stages, None)
        return Cuts(tuple(float(f[s, 0]) for s in range(1, max_stages + 1)),
                    tuple(_bounds(choice, s, n) if math.isfinite(f[s, 0]) else ()
                          for s in range(1, max_stages + 1)))
    pins = np.asarray(pin_stage)
    out_s, out_b = [], []
    for s in range(1, max_stages + 1):
        f, choice = _solve(cost, mesh, n, s, (pins, s))
        out_s.append(float(f[s, 0]))
        out_b.append(_bounds(choice, s, n) if math.isfinite(f[s, 0]) else ())
    return Cuts(tuple(out_s), tuple(out_b))


def _solve(cost, mesh: MeshCosts, n: int, max_stages: int, pinned: tuple[np.ndarray, int] | None
           ) -> tuple[np.ndarray, np.ndarray]:
    f = np.full((max_stages + 1, n + 1), np.inf)
    f[0, n] = 0.0
    choice = np.zeros((max_stages + 1, n + 1), dtype=np.int64)
    for t in range(1, max_stages + 1):
        c = cost_t = cost(mesh.in_flight(t))
        if pinned is not None:
            pins, s_count = pinned
            k = s_count - t  # this stage's index
            bad = np.concatenate([[0], np.cumsum((pins >= 0) & (pins != k))])
            c = np.where(bad[None, :] - bad[:, None] > 0, np.inf, cost_t)
        cand = np.maximum(c, f[t - 1][None, :])
        best = cand.argmin(axis=1)
        f[t] = cand[np.arange(n + 1), best]
        choice[t] = best
    return f, choice


def _bounds(choice: np.ndarray, s_count: int, n: int) -> tuple[int, ...]:
    out, j = [0], 0
    for t in range(s_count, 0, -1):
        j = int(choice[t, j])
        out.append(j)
    return tuple(out) if out[-1] == n else ()


__all__ = ["Cuts", "LayerCosts", "MeshCosts", "best_cuts", "layer_costs"]
