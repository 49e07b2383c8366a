"""The degrees search's space and its exact enumeration under the estimate: every mesh
``dp x cp x tp x pp <= N`` (tensor splits with and without sequence parallelism, context
degrees where asked), micro-batch count and schedule, each with its best stage cuts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import SCHEDULES, StageSettings
from explorer.core.plan_schema import MAX_MICRO_BATCHES
from explorer.core.tensor_layout import megatron_layout
from explorer.costs.model import CostModel
from explorer.partition.degrees.estimate import (
    LayerCosts,
    MeshCosts,
    best_cuts,
    layer_costs,
    with_context,
)
from explorer.partition.pipeline_dp import linear_fit, stage_cost_table
from explorer.simulate.context import is_fused_attention


@dataclass(frozen=True)
class Candidate:
    """One point of the space with its stage cuts: ``pp`` stages of ``dp x cp x tp``
    devices, stage ``k`` holding layers ``bounds[k]..bounds[k+1]-1``; ``estimate_s`` its
    score."""

    dp: int
    tp: int
    pp: int
    micro_batches: int
    schedule: str
    estimate_s: float
    bounds: tuple[int, ...]
    #: the tensor split with sequence parallelism
    sequence: bool = False
    #: the context-parallel degree: each sample's sequence split that many ways
    cp: int = 1

    @property
    def degrees(self) -> str:
        return f"{self.dp}x{self.tp}x{self.pp}" + (f" cp {self.cp}" if self.cp > 1 else "")

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp


@dataclass(frozen=True)
class Space:
    """What the search enumerates, and the estimate's inputs for every tensor degree."""

    ids: tuple[str, ...]
    layers: tuple[tuple[int, ...], ...]
    by_tensor: Mapping[int, LayerCosts]
    micro_batches: tuple[int, ...] | None
    schedules: tuple[str, ...]
    capacity_bytes: float
    pin_positions: Mapping[int, tuple[int, ...]]  # layer -> positions of its pinned devices
    #: per tensor degree, the estimate's inputs with sequence parallelism (where it splits
    #: something more)
    by_sequence: Mapping[int, LayerCosts] = field(default_factory=dict)
    #: per (tensor degree, sequence parallelism, context degree above 1), the estimate's
    #: inputs with each sample's sequence split too
    by_context: Mapping[tuple[int, bool, int], LayerCosts] = field(default_factory=dict)

    def splits(self, tp: int, cp: int = 1) -> list[tuple[bool, LayerCosts]]:
        """The tensor splits of degree ``tp`` to try (under context degree ``cp``):
        (sequence parallelism?, costs)."""
        plain = [(False, self.by_tensor[tp]),
                 *([(True, self.by_sequence[tp])] if tp in self.by_sequence else [])]
        return plain if cp == 1 else [(seq, self.by_context[(tp, seq, cp)])
                                      for seq, _ in plain if (tp, seq, cp) in self.by_context]

    def layer_costs(self, tp: int, sequence: bool, cp: int = 1) -> LayerCosts:
        if cp > 1:
            return self.by_context[(tp, sequence, cp)]
        return self.by_sequence[tp] if sequence else self.by_tensor[tp]

    def meshes(self, batch_size: int) -> list[tuple[int, int, int]]:
        """Every ``(dp, tp, cp)`` with ``dp x cp x tp <= N`` whose ``dp`` divides the batch
        (``cp`` 1, or a context degree the space holds for ``tp``)."""
        n = len(self.ids)
        contexts = {tp: sorted({1} | {c for t, _, c in self.by_context if t == tp})
                    for tp in self.by_tensor}
        return [(dp, tp, cp) for tp in sorted(self.by_tensor) for cp in contexts[tp]
                for dp in range(1, n // (tp * cp) + 1)
                if batch_size <= 0 or batch_size % dp == 0]

    def micro_batch_choices(self, batch_size: int, dp: int) -> tuple[int, ...]:
        """The micro-batch counts that divide each replica's share of the batch."""
        if self.micro_batches is not None:
            return tuple(m for m in self.micro_batches
                         if batch_size <= 0 or batch_size % (dp * m) == 0)
        if batch_size <= 0:
            return (1,)
        share = batch_size // dp
        return tuple(m for m in range(1, min(share, MAX_MICRO_BATCHES) + 1) if share % m == 0)

    def pin_stages(self, group: int) -> list[int] | None:
        """Per layer, the index of the stage of ``group`` devices its pins put it in (-1:
        none); None when one layer is pinned to devices of two stages."""
        out = [-1] * len(self.layers)
        for j, positions in self.pin_positions.items():
            stages = {p // group for p in positions}
            if len(stages) > 1:
                return None
            out[j] = stages.pop()
        return out


def build_space(graph: OpGraph, costs: CostModel, ids: Sequence[str],
                layers: Sequence[Sequence[int]], optimizer: str,
                tensor_degrees: Sequence[int] | None, micro_batches: Sequence[int] | None,
                schedules: Sequence[str], pins: Mapping[str, str], headroom: float,
                settings: StageSettings | None = None, async_tensor: bool = False,
                context_degrees: Sequence[int] = (1,)) -> Space:
    """The space on devices ``ids``: tensor degrees (default: the divisors of the device
    count up to :func:`fast_group`, at which the Megatron layout splits some weight), each
    with and without sequence parallelism (where it splits something more), micro-batch
    counts (default: every divisor of a replica's share of the batch) and schedules; the
    memory estimated under the memory ``settings`` every stage gets (ZeRO over each mesh's
    replicas); ``async_tensor``: the sequence-parallel splits pipeline their collectives;
    ``context_degrees``: each split also with every sample's sequence split that many ways
    (the graph needs fused attention, which the ring serves)."""
    for s in schedules:
        if s not in SCHEDULES:
            raise ExplorerError(f"unknown schedule {s!r}; choose among {', '.join(SCHEDULES)}")
    n = len(ids)
    cluster = costs.cluster
    type_ids: list[str] = []
    seen: set[str] = set()
    for dev in ids:
        key = cluster.device(dev).type_key
        if key not in seen:
            seen.add(key)
            type_ids.append(dev)
    base = stage_cost_table(graph, costs, type_ids, layers, 1, "1f1b", optimizer, False,
                            settings=settings)
    fast = fast_group(costs, ids)
    degrees = sorted({1, *(tensor_degrees if tensor_degrees is not None
                           else (t for t in range(2, fast + 1) if n % t == 0))})
    by_tensor: dict[int, LayerCosts] = {}
    by_sequence: dict[int, LayerCosts] = {}
    for tp in degrees:
        if not 1 <= tp <= n:
            raise ExplorerError(f"tensor degree {tp} is not between 1 and the {n} devices")
        lc = layer_costs(graph, costs, base, layers, tp, ids[:tp], optimizer, type_ids,
                         settings=settings)
        if lc is not None:
            by_tensor[tp] = lc
        if lc is not None and tp > 1 and megatron_layout(graph, tp, True).sequence_ops:
            seq = layer_costs(graph, costs, base, layers, tp, ids[:tp], optimizer, type_ids,
                              sequence=True, settings=settings, async_tensor=async_tensor)
            if seq is not None:
                by_sequence[tp] = seq
    by_context: dict[tuple[int, bool, int], LayerCosts] = {}
    if set(context_degrees) - {1} and not any(map(is_fused_attention, graph.nodes)):
        raise ExplorerError("context parallelism rings the keys and values of fused attention "
                            "(F.scaled_dot_product_attention), and this graph has none: search "
                            "without context degrees")
    for c in sorted(set(context_degrees) - {1}):
        if not 1 < c <= n:
            raise ExplorerError(f"context degree {c} is not between 2 and the {n} devices")
        splits = [(tp, False, lc) for tp, lc in by_tensor.items()] + [
            (tp, True, lc) for tp, lc in by_sequence.items()]
        for tp, sequence, lc in splits:
            if tp * c <= n:
                by_context[(tp, sequence, c)] = with_context(
                    lc, graph, costs, layers, c, ids[:tp * c:tp], sequence, settings)
    layer_of = {i: j for j, layer in enumerate(layers) for i in layer}
    positions: dict[int, set[int]] = {}
    for name, dev in pins.items():
        if dev not in ids:
            raise ExplorerError(f"node {name!r} is pinned to {dev}, which is not among the "
                                f"devices this search may use ({', '.join(ids)})")
        positions.setdefault(layer_of[graph.index[name]], set()).add(ids.index(dev))
    return Space(tuple(ids), tuple(tuple(x) for x in layers), by_tensor,
                 None if micro_batches is None else tuple(micro_batches), tuple(schedules),
                 min(cluster.device(d).memory_bytes for d in ids) * headroom,
                 {j: tuple(sorted(p)) for j, p in positions.items()}, by_sequence,
                 by_context)


def fast_group(costs: CostModel, ids: Sequence[str]) -> int:
    """How many devices from the first on are reached over the first device's fastest link,
    in a row (a node's GPUs on NVLink in an 8-per-node preset; every device when all links
    are alike): how far tensor parallelism goes by default, as Megatron-LM advises."""
    cluster = costs.cluster
    speeds = [cluster.link(ids[0], d).bandwidth_bytes_per_s for d in ids[1:]]
    best = max(speeds, default=0.0)
    count = 1
    for bw in speeds:
        if bw < best:
            break
        count += 1
    return count


def mesh_costs(space: Space, costs: CostModel, dp: int, tp: int, micro_batches: int,
               schedule: str, cp: int = 1) -> MeshCosts:
    """The links of ``dp x cp x tp`` stages on the space's devices, in order: the slowest
    link between consecutive stages, the gradient all-reduce over the first stage's ``dp x
    cp`` replicas of the tokens (the mesh's replicas)."""
    dp *= cp
    ids, g = space.ids, dp * tp
    cluster = costs.cluster
    bounds = [cluster.link(ids[k * g - 1], ids[k * g]) for k in range(1, len(ids) // g)]
    lat = max((lk.latency_s for lk in bounds), default=0.0)
    spb = max((costs.link_scale / lk.bandwidth_bytes_per_s for lk in bounds), default=0.0)
    ar = (0.0, 0.0) if dp == 1 else linear_fit(
        lambda x: costs.allreduce_s(ids[0:g:tp], int(x)))
    return MeshCosts(dp, micro_batches, schedule, lat, spb, ar[0], ar[1], space.capacity_bytes)


def enumerate_candidates(space: Space, costs: CostModel, batch_size: int) -> list[Candidate]:
    """Every mesh, micro-batch count, schedule and stage count with a split that fits the
    estimate's memory, each with its best cuts; fastest estimate first (fewer devices, then
    fewer stages, on ties)."""
    out: list[Candidate] = []
    for dp, tp, cp in space.meshes(batch_size):
        pin_stage = space.pin_stages(dp * cp * tp)
        if pin_stage is None:
            continue
        most = len(space.ids) // (dp * cp * tp)
        for m in space.micro_batch_choices(batch_size, dp):
            for sched in space.schedules:
                mesh = mesh_costs(space, costs, dp, tp, m, sched, cp)
                for seq, lc in space.splits(tp, cp):
                    cuts = best_cuts(lc, mesh, most, pin_stage)
                    for s, bounds in enumerate(cuts.bounds, start=1):
                        if bounds and (sched == space.schedules[0] or m > 1):  # (M=1: alike)
                            out.append(Candidate(dp, tp, s, m, sched, cuts.score_s(s, m),
                                                 bounds, seq, cp))
    out.sort(key=lambda c: (c.estimate_s, c.devices, c.pp, c.tp, c.micro_batches, c.sequence,
                            c.cp))
    return [c for c in out if math.isfinite(c.estimate_s)]


__all__ = ["Candidate", "Space", "build_space", "enumerate_candidates", "fast_group",
           "mesh_costs"]
