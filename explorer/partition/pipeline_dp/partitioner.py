"""The pipeline-dp partitioner: a stage DP split made into a plan, checked by the simulator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from explorer.core.errors import MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan, StageSettings
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.bounds import FULL_SEARCH_DEVICES
from explorer.partition.options import Options, check_micro_batches, check_schedule
from explorer.partition.pipeline_dp.build import (
    MAX_LAYERS,
    allowed_replicas,
    choose_layers,
    dp_positions,
    stage_cost_table,
)
from explorer.partition.pipeline_dp.solver import solve_stages
from explorer.partition.pipeline_dp.table import StageCostTable, StageSolution
from explorer.partition.registry import register
from explorer.partition.search.fallback import (
    cheapest_memory_settings,
    default_micro_batches,
    fit_headrooms,
    memory_error,
    settle,
    splits_under_settings,
)


@register("pipeline-dp", exact=True)
def pipeline_dp(graph: OpGraph, cluster: Cluster, costs: CostModel,
                pins: Mapping[str, str] | None = None, k: int | None = None,
                micro_batches: int | None = None, schedule: str = "1f1b",
                depth: int | None = None, replicate: bool = True,
                optimizer: str = "adam", max_layers: int = MAX_LAYERS,
                compare_baselines: bool = True) -> Plan:
    """Contiguous pipeline stages with replicas, chosen by an exact dynamic program.

    Cuts ``graph.layers(depth)`` (in topological order) into ``S <= k`` contiguous stages,
    each on a group of consecutive devices that replicate it, minimising the slowest stage's
    time: compute at batch fraction ``1 / (replicas x micro_batches)``, transfers across its
    boundaries and the all-reduce of a replicated stage's gradients, subject to every stage's
    memory including the activations of the micro-batches in flight (GPipe keeps all ``M``,
    1F1B at most ``S - stage index``). Among stage counts it picks the smallest
    ``bottleneck x (M + S - 1) / M`` (the pipeline bubble). Exact for that cost model (see
    :class:`StageCostTable`; the simulator then scores the plan). Follows PipeDream
    (Narayanan et al., SOSP 2019) and Alpa's stage construction (Zheng et al., OSDI 2022).
    When no split fits as it is, the DP splits again under each memory setting (ZeRO over
    replicas, recomputation, bf16: :data:`~explorer.partition.search.fallback.MEMORY_CHOICES`)
    and keeps the plan that fits with the shortest simulated step, noting what its settings
    cost.

    Parameters
    ----------
    micro_batches : int, optional
        Micro-batches per step. Default: 4 when the batch divides into 4, else 1; when 4 is
        possible the DP also solves for 1 (which allows more replicas per stage) and keeps
        the better estimate. A replica count is allowed only when ``replicas x
        micro_batches`` divides the batch.
    schedule : {"1f1b", "gpipe"}
        Pipeline schedule; sets the micro-batches whose activations a stage keeps.
    depth : int, optional
        Module depth of the layers (``None``: the finest depth with at most ``max_layers``
        layers).
    replicate : bool
        Allow stages on several devices (data parallelism inside a stage). Default True.
    max_layers : int
        Refuse more layers than this (default 1500; fewer on many devices, see Limits).
    k, optimizer, compare_baselines
        As in :class:`explorer.partition.options.Options`.

    Returns
    -------
    Plan
        Stages in pipeline order; ``options["stage_layers"]`` and ``options["replicas"]``
        describe the split, ``notes`` the DP's bottleneck and estimated step.

    Raises
    ------
    MemoryExceededError
        When no split fits, naming the device and layers of the split closest to fitting.
    ExplorerError
        When the graph has too many layers for the DP, or the pins cannot be honoured.

    Limits
    ------
    On a cluster of more than 64 devices (:data:`explorer.partition.bounds.FULL_SEARCH_DEVICES`)
    replica counts are powers of two, and the DP runs over only the device positions its
    stages can reach (``min(layers, devices)`` stages of the largest replica count each), which
    gives the same plans as over all of them; its work is then kept under
    :data:`~explorer.partition.pipeline_dp.build.WIDE_DP_CELLS` by coarser layers.
    Work grows as ``layers^2 x devices^2 x stages`` (``layers^2 x devices^2`` without
    replicas) and memory as ``10 x layers^2`` floats: 1,000 layers on 8 devices take a few
    seconds. With ``depth=None`` the DP coarsens to the finest module depth under the limit;
    when every depth has too many layers, or an explicit ``depth`` does, it raises
    :class:`ExplorerError` saying so. Pins (node name -> device id) are honoured: a pinned
    node's layer goes to a stage holding its device; with identical devices the devices are
    assigned to stages after the DP, otherwise a stage's devices are positions in the
    cluster's order. Pins that no contiguous split can honour raise :class:`ExplorerError`.
    """
    check_schedule(schedule)
    opts = Options(k=k, optimizer=optimizer, compare_baselines=compare_baselines)
    ids = opts.devices(cluster)
    n_dev = len(ids)
    check_micro_batches(micro_batches)
    if micro_batches is None:
        m_choices = tuple(dict.fromkeys((default_micro_batches(graph), 1)))
    else:
        m_choices = (int(micro_batches),)
    pins = dict(pins or {})
    layers, used_depth = choose_layers(graph, depth, max_layers, n_dev, replicate)
    # a large cluster: replica counts powers of two, and the DP over the device positions
    # its stages can reach (the same plans as over all of them: see Limits)
    wide = n_dev > FULL_SEARCH_DEVICES
    dp_ids = ids
    if wide:
        reach = dp_positions(len(layers), n_dev,
                             allowed_replicas(graph.batch_size, n_dev, 1, replicate, True))
        far = [dev for dev in dict.fromkeys(pins.values()) if dev in ids[reach:]]
        dp_ids = ids[:reach] if not far else ids[:max(reach, ids.index(far[-1]) + 1)]
    base = stage_cost_table(graph, costs, dp_ids, layers, m_choices[0], schedule, optimizer,
                            replicate, pins, wide=wide)

    def make(headroom: float, settings: StageSettings | None = None) -> Plan:
        best: tuple[StageCostTable, StageSolution] | None = None
        table = first = base if settings is None else stage_cost_table(
            graph, costs, dp_ids, layers, m_choices[0], schedule, optimizer, replicate, pins,
            settings=settings, wide=wide)
        for m in m_choices:
            table = replace(first, micro_batches=m,
                            replicas=allowed_replicas(graph.batch_size, len(dp_ids), m,
                                                      replicate, wide),
                            capacity_bytes=tuple(x * headroom for x in base.capacity_bytes))
            sol = solve_stages(table)
            if sol.feasible and (best is None or sol.score_s < best[1].score_s):
                best = (table, sol)
        if best is None:
            raise MemoryExceededError(_explain_infeasible(table, layers, graph, dp_ids, pins))
        options = {"k": n_dev, "micro_batches": best[0].micro_batches, "schedule": schedule,
                   "depth": used_depth, "replicate": replicate, "layers": len(layers)}
        plan = _plan_from_solution(graph, best[0], best[1], layers, dp_ids, pins, optimizer,
                                   options)
        if len(dp_ids) < n_dev:
            plan = plan.with_settings(notes=(*plan.notes, (
                f"pipeline-dp: on {n_dev:,} devices, replica counts that are powers of two; "
                f"its {len(layers)} layers in at most {min(len(layers), n_dev)} stages reach "
                f"only the first {len(dp_ids):,} devices")))
        return plan

    plan, pred, failures = fit_headrooms(graph, costs, make, "pipeline-dp: its best split",
                                         compare_baselines)
    if plan is None or (pred is not None and not pred.fits):
        # does not fit as it is: the splits the DP makes under each memory setting, each
        # with every setting; the fastest that fits by the simulator
        fitted = cheapest_memory_settings(graph, costs, "pipeline-dp", splits_under_settings(
            graph, lambda st: make(1.0, st)))
        if fitted is not None:
            plan, pred, failures = fitted, None, []
    return settle(graph, cluster, costs, "pipeline-dp", plan, pred,
                  failures[-1] if failures else "", pins, opts)


def _plan_from_solution(graph: OpGraph, table: StageCostTable, sol: StageSolution,
                        layers: Sequence[Sequence[int]], ids: Sequence[str],
                        pins: Mapping[str, str], optimizer: str, options: dict) -> Plan:
    stage_devs: list[tuple[str, ...]] = []
    if table.pins_by_position or not pins:
        stage_devs = [tuple(ids[st.first_device:st.first_device + st.replicas])
                      for st in sol.stages]
    else:  # identical devices: each stage takes its pinned devices, then the next free ones
        layer_of = {i: j for j, layer in enumerate(layers) for i in layer}
        pin_layer = {nm: layer_of[graph.index[nm]] for nm in pins}
        pinned_of = [sorted({pins[nm] for nm in pins
                             if st.first_layer <= pin_layer[nm] < st.end_layer})
                     for st in sol.stages]
        taken = {dev for devs in pinned_of for dev in devs}
        free = [dev for dev in ids if dev not in taken]
        for st, own in zip(sol.stages, pinned_of, strict=True):
            extra = st.replicas - len(own)
            stage_devs.append(tuple(sorted(own + free[:extra], key=ids.index)))
            free = free[extra:]
    assign: dict[int, int] = {}
    for s, st in enumerate(sol.stages):
        for j in range(st.first_layer, st.end_layer):
            for i in layers[j]:
                assign[i] = s
    notes = (f"{len(sol.stages)} stages over {len(layers)} layers; DP bottleneck "
             f"{sol.bottleneck_s:.4g} s per step, estimated step {sol.score_s:.4g} s",)
    opts = {**options, "stage_layers": [[st.first_layer, st.end_layer] for st in sol.stages],
            "replicas": [st.replicas for st in sol.stages]}
    return Plan.from_assignment(graph, stage_devs, assign, micro_batches=table.micro_batches,
                                schedule=table.schedule, optimizer=optimizer,
                                algorithm="pipeline-dp", options=opts,
                                pinned=frozenset(pins), notes=notes)


def _explain_infeasible(table: StageCostTable, layers: Sequence[Sequence[int]],
                        graph: OpGraph, ids: Sequence[str], pins: Mapping[str, str]) -> str:
    """Why no split exists: the closest one to fitting, by memory, or the pins."""
    mem = solve_stages(table, objective="memory")
    if not mem.feasible:
        return (f"pipeline-dp: no contiguous split honours the pins "
                f"({', '.join(f'{k} -> {v}' for k, v in list(pins.items())[:4])}); pinned "
                "layers must go to stages in device order; change the pins or use min-comm")
    worst = max(mem.stages, key=lambda st: st.memory_bytes - st.capacity_bytes)
    devs = ids[worst.first_device:worst.first_device + worst.replicas]
    first = graph.nodes[layers[worst.first_layer][-1]].module_path or "?"
    last = graph.nodes[layers[worst.end_layer - 1][-1]].module_path or "?"
    err = memory_error(
        "pipeline-dp", f"layers {worst.first_layer}..{worst.end_layer - 1} ({first} .. {last}) "
        f"of the split that comes closest to fitting ({len(mem.stages)} stages)",
        ", ".join(devs), worst.memory_bytes, worst.capacity_bytes,
        "use more or larger devices, more micro-batches, or a smaller batch")
    return str(err)


__all__ = ["pipeline_dp"]
