"""The degrees partitioner: the estimate's best meshes made into plans, chosen by the
simulator, never slower than pipeline-dp's plan and the baselines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import INTERLEAVED, Plan, StageSettings
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.degrees.interleave import (
    NOT_INTERLEAVED,
    VIRTUAL_STAGES,
    best_interleaved,
    check_virtual_stages,
)
from explorer.partition.degrees.search import (
    Candidate,
    Space,
    build_space,
    enumerate_candidates,
)
from explorer.partition.options import Options, check_micro_batches, whole_numbers
from explorer.partition.pipeline_dp import choose_layers, dp_cells
from explorer.partition.registry import algorithm as lookup_algorithm
from explorer.partition.registry import register
from explorer.partition.search.fallback import settle
from explorer.simulate.simulator import Prediction, simulate

#: pipeline-dp is run for comparison only when its DP has at most this many table cells
#: (it grows as layers^2 x devices^3: a 70B shape on 64 devices takes a minute)
PIPELINE_DP_CELLS = 5e7
#: layers the degrees search cuts at most (its DP grows as layers^2 x devices)
MAX_LAYERS = 400

#: the memory settings the ``memory`` option takes (``Plan.with_memory``'s keywords)
MEMORY_KEYWORDS = ("zero", "recompute", "precision", "async_tensor")


def candidate_plan(graph: OpGraph, space: Space, cand: Candidate, optimizer: str,
                   pins: Mapping[str, str], options: Mapping, notes: Sequence[str] = ()
                   ) -> Plan:
    """``cand`` as a plan: stage ``k`` on devices ``k x g .. (k+1) x g - 1`` of the space
    (``g = dp x cp x tp``), split ``tp`` ways by tensor parallelism (with sequence
    parallelism where the candidate says so) and ``cp`` ways by context parallelism."""
    g = cand.dp * cand.cp * cand.tp
    stages = [space.ids[k * g:(k + 1) * g] for k in range(cand.pp)]
    assign = {i: k for k in range(cand.pp) for j in range(cand.bounds[k], cand.bounds[k + 1])
              for i in space.layers[j]}
    opts = {**options, "dp": cand.dp, "tp": cand.tp, "pp": cand.pp,
            "degrees": cand.degrees, "micro_batches": cand.micro_batches,
            "schedule": cand.schedule, "estimate_s": cand.estimate_s,
            "sequence": cand.sequence, "cp": cand.cp,
            "stage_layers": [[cand.bounds[k], cand.bounds[k + 1]] for k in range(cand.pp)]}
    split = (StageSettings(tensor=cand.tp, sequence=cand.sequence, context=cand.cp),) * cand.pp
    return Plan.from_assignment(graph, stages, assign, micro_batches=cand.micro_batches,
                                schedule=cand.schedule, optimizer=optimizer,
                                algorithm="degrees", options=opts, pinned=frozenset(pins),
                                notes=tuple(notes),
                                stage_settings=split if cand.tp > 1 or cand.cp > 1 else ())


def _describe(cand: Candidate, n: int) -> str:
    context = f"context {cand.cp} x " if cand.cp > 1 else ""
    return (f"data {cand.dp} x {context}tensor {cand.tp}"
            f"{' (and sequence)' if cand.sequence else ''} x "
            f"pipeline {cand.pp} on {cand.devices} of {n} devices, {cand.micro_batches} "
            f"micro-batches, {cand.schedule}")


@register("degrees", exact=True)
def degrees(graph: OpGraph, cluster: Cluster, costs: CostModel,
            pins: Mapping[str, str] | None = None, k: int | None = None,
            tensor_degrees: Sequence[int] | None = None,
            micro_batches: int | Sequence[int] | None = None,
            schedules: Sequence[str] = ("1f1b", "gpipe"), depth: int | None = None,
            max_layers: int = MAX_LAYERS, simulate_top: int = 4, optimizer: str = "adam",
            compare_pipeline_dp: bool = True, compare_baselines: bool = True,
            memory: Mapping[str, Any] | None = None,
            virtual_stages: Sequence[int] | None = None,
            context_degrees: Sequence[int] = (1,)) -> Plan:
    """Data x tensor x pipeline degrees, micro-batches and schedule, by exhaustive search.

    The space of Alpa's and Galvatron's searches on the layer graph: every mesh of ``pp``
    stages of ``dp x tp`` devices with ``dp x tp x pp <= N`` (``tp`` a tensor degree at which
    the Megatron layout splits some weight, with and without sequence parallelism where that
    splits more, ``dp`` dividing the batch), every micro-batch
    count dividing a replica's share of the batch, GPipe and 1F1B; the stages cut the layers
    (``graph.layers(depth)``) contiguously. For each mesh, micro-batch count and schedule an
    exact DP finds the cuts with the smallest slowest stage for every ``pp`` at once, under the
    estimate of :mod:`explorer.partition.degrees.estimate` (pipeline-dp's per-layer costs with
    the tensor split's shares and all-reduces), rejecting stages over the devices' memory; a
    split scores ``slowest stage x (M + pp - 1) / M``. The ``simulate_top`` best by estimate
    that fit are simulated and the fastest by the simulator is kept; it is then compared, by
    the simulator, with pipeline-dp's plan (no tensor split; when its DP is small enough, see
    :data:`PIPELINE_DP_CELLS`) and the baselines, and the fastest is returned (a note says
    which).

    Parameters
    ----------
    tensor_degrees : list of int, optional
        Tensor degrees to try (default: the divisors of the device count up to the devices
        the first one reaches over its fastest link, a node's GPUs on NVLink: tensor within a
        node, as Megatron-LM advises; those at which the layout splits nothing are left
        out). 1 is always tried.
    micro_batches : int or list of int, optional
        Micro-batch counts to try (default: every divisor of a replica's share of the batch).
    schedules : list of str
        Pipeline schedules to try (default GPipe and 1F1B; ``"interleaved-1f1b"``: the best
        1F1B pipeline re-cut with ``virtual_stages``, and nothing else).
    virtual_stages : list of int
        Chunks of layers per stage to re-cut each simulated 1F1B pipeline into, each taken
        in turn around the stages under interleaved 1F1B (default 1, 2, 4 and one layer a
        chunk; 1 keeps it as it is): the simulator keeps the fastest that fits.
    context_degrees : list of int
        Context-parallel degrees to try on every mesh (default 1: none): each sample's
        sequence split that many ways over the mesh's replicas, ring attention for its fused
        attention (the plans are predicted; real steps do not run them yet).
    depth, max_layers
        Module depth of the layers (``None``: the finest depth with at most ``max_layers``
        layers).
    simulate_top : int
        How many of the best candidates by estimate the simulator scores (default 4; more
        are simulated when those do not fit its memory accounting).
    compare_pipeline_dp : bool
        Also run pipeline-dp (stages with any replica counts, no tensor split) when its DP is
        small enough, and return its plan when the simulator finds it faster.
    memory : dict, optional
        Memory settings (``Plan.with_memory``'s keywords: ``zero``, ``recompute``,
        ``precision``, and ``async_tensor`` for the sequence-parallel splits) every
        simulated candidate, and pipeline-dp's plan, is scored with and the plan returned
        carries, so that the simulator ranks the plans as they will run; the estimate that
        picks the candidates to simulate holds them too.
    k, optimizer, compare_baselines
        As in :class:`explorer.partition.options.Options`.

    Returns
    -------
    Plan
        ``options``: ``dp``, ``tp``, ``pp``, ``degrees`` (``"dpxtpxpp"``), ``sequence``
        (sequence parallelism on the tensor split), ``micro_batches``,
        ``schedule``, ``stage_layers``, ``estimate_s`` and the size of the search
        (``candidates``, ``simulated``); ``notes`` the chosen degrees and how it compares.

    Limits
    ------
    Work: one DP of ``(L+1)^2 x N / (dp x tp)`` cells per mesh, micro-batch count and
    schedule (pins make it ``N^2 / 2`` per mesh); a 70B shape (85 layers) on 64 devices
    enumerates its space in about a second, and the simulator prices ``simulate_top`` plans.
    Every stage has the same mesh; the estimate takes the slowest link between stages for
    every boundary and assumes the tensor groups are the stage's consecutive devices.
    """
    opts = Options(k=k, optimizer=optimizer, compare_baselines=compare_baselines)
    ids = opts.devices(cluster)
    pins = dict(pins or {})
    micro_batches = _checked_options(micro_batches, simulate_top, memory)
    deepest = virtual_stages is None  # (the default: also one layer a chunk)
    virtual_stages = check_virtual_stages(VIRTUAL_STAGES if deepest else virtual_stages)
    only_interleaved = list(schedules) == [INTERLEAVED]
    schedules = list(dict.fromkeys("1f1b" if s == INTERLEAVED else s for s in schedules))
    layers, used_depth, whole = _layers(graph, depth, max_layers)
    stage_memory = {k: v for k, v in (memory or {}).items() if k != "async_tensor"}
    space = build_space(graph, costs, ids, layers, optimizer, tensor_degrees, micro_batches,
                        schedules, pins, 1.0,
                        StageSettings(**stage_memory) if stage_memory else None,
                        async_tensor=bool((memory or {}).get("async_tensor")),
                        context_degrees=whole_numbers(
                            context_degrees, "context_degrees are whole numbers, 1 or more "
                            "(1: no context parallelism)"))
    cands = enumerate_candidates(space, costs, graph.batch_size)
    base_opts = {"k": len(ids), "depth": used_depth, "layers": len(layers),
                 "candidates": len(cands)}
    fitting, tried = _best_simulated(graph, costs, space, cands, optimizer, pins, base_opts,
                                     simulate_top, memory)
    failure = "" if fitting else (
        f"degrees: none of {tried} candidates the estimate found fitting fits the simulator's "
        "memory accounting" if cands else "degrees: no mesh, micro-batch count and split fits "
        "the devices' memory by the estimate")
    noted = [_noted(found, len(ids), tried, len(cands), whole) for found in fitting]
    best = noted[0] if noted else None
    if noted and not pins:  # (a re-cut would move pinned nodes)
        best = _fastest_recut(graph, costs, space.layers, noted, virtual_stages,
                              only_interleaved, deepest)
        failure = "" if best is not None else NOT_INTERLEAVED
    if compare_pipeline_dp and not only_interleaved:
        best = _against_pipeline_dp(graph, cluster, costs, best, pins, k, optimizer,
                                    len(layers), len(ids), memory)
    plan, pred = best if best is not None else (None, None)
    return settle(graph, cluster, costs, "degrees", plan, pred, failure, pins, opts)


def _checked_options(micro_batches: int | Sequence[int] | None, simulate_top: int,
                     memory: Mapping[str, Any] | None) -> Sequence[int] | None:
    """The micro-batch counts to try (a count alone as a tuple), every option checked:
    :class:`ExplorerError` saying what is wrong."""
    if isinstance(micro_batches, int):
        micro_batches = (micro_batches,)
    for m in micro_batches or ():
        check_micro_batches(m)
    if simulate_top < 1:
        raise ExplorerError(f"simulate_top must be >= 1, not {simulate_top}")
    unknown = sorted(set(memory or {}) - set(MEMORY_KEYWORDS))
    if unknown:
        raise ExplorerError(f"degrees: memory has no setting {unknown[0]!r}; its settings are "
                            f"{', '.join(MEMORY_KEYWORDS)}")
    return micro_batches


def _best_simulated(graph: OpGraph, costs: CostModel, space: Space, cands: Sequence[Candidate],
                    optimizer: str, pins: Mapping[str, str], base_opts: Mapping,
                    simulate_top: int, memory: Mapping[str, Any] | None
                    ) -> tuple[list[tuple[Plan, Prediction]], int]:
    """Simulate the candidates in the estimate's order (with the ``memory`` settings) until
    ``simulate_top`` of them fit, or three times as many were tried; those that fit, fastest
    first (the estimate's order among equals), and how many were simulated."""
    fitting: list[tuple[Plan, Prediction]] = []
    tried = 0
    for cand in cands:
        if len(fitting) >= simulate_top or tried >= 3 * simulate_top:
            break
        plan = candidate_plan(graph, space, cand, optimizer, pins, base_opts)
        plan = with_memory_settings(plan, memory)
        pred = simulate(graph, plan, costs)
        tried += 1
        if pred.fits:
            fitting.append((plan, pred))
    fastest = min((pred.step_s for _, pred in fitting), default=0.0)

    def order(found: tuple[Plan, Prediction]) -> float:
        # (a step within a relative 1e-9 of the fastest is as fast: the estimate's order)
        step = found[1].step_s
        return 0.0 if step <= fastest * (1 + 1e-9) else step

    return sorted(fitting, key=order), tried


def _layers(graph: OpGraph, depth: int | None, max_layers: int
            ) -> tuple[list[list[int]], int, str]:
    """The layers to cut into stages, their module depth, and a note when there are none:
    where no module depth has few enough layers, one layer of everything (one stage, split
    by data and tensor degrees only)."""
    try:
        layers, used_depth = choose_layers(graph, depth, max_layers, 1, False)
    except ExplorerError as exc:
        if depth is not None:
            raise
        return [list(range(len(graph.nodes)))], 0, f"degrees: one pipeline stage only ({exc})"
    return layers, used_depth, ""


def _fastest_recut(graph: OpGraph, costs: CostModel, layers: Sequence[Sequence[int]],
                   simulated: Sequence[tuple[Plan, Prediction]], virtual_stages: Sequence[int],
                   only_interleaved: bool, deepest: bool) -> tuple[Plan, Prediction] | None:
    """The fastest of the ``simulated`` candidates and their interleaved re-cuts
    (:func:`best_interleaved`): each is re-cut, as a deeper pipeline the estimate ranks below
    another may pass it once interleaved."""
    recut = [best_interleaved(graph, costs, layers, found, virtual_stages, only_interleaved,
                              deepest) for found in simulated]
    return min((r for r in recut if r is not None), key=lambda r: r[1].step_s, default=None)


def _noted(found: tuple[Plan, Prediction], devices: int, tried: int, candidates: int,
           whole: str) -> tuple[Plan, Prediction]:
    """A simulated candidate with the note that says what it is and how it was found."""
    plan, pred = found
    note = (f"degrees: {_describe(_chosen(plan), devices)}: simulated {pred.step_s:.4g} s "
            f"per step (estimate {plan.options['estimate_s']:.4g} s); one of {tried} "
            f"simulated of {candidates} candidates")
    return (plan.with_settings(notes=(note, *([whole] if whole else [])),
                               options={**plan.options, "simulated": tried}), pred)


def with_memory_settings(plan: Plan, memory: Mapping[str, Any] | None) -> Plan:
    """``plan`` with the search's ``memory`` settings on every stage (async tensor
    parallelism where a stage splits by sequence)."""
    if not memory:
        return plan
    sequence = any(plan.sequence_of(s) for s in range(len(plan.stages)))
    return plan.with_memory(**{k: v for k, v in memory.items()
                               if k != "async_tensor" or sequence})


def _chosen(plan: Plan) -> Candidate:
    o = plan.options
    return Candidate(o["dp"], o["tp"], o["pp"], o["micro_batches"], o["schedule"],
                     o["estimate_s"], (), bool(o.get("sequence")), o.get("cp", 1))


def _against_pipeline_dp(graph: OpGraph, cluster: Cluster, costs: CostModel,
                         best: tuple[Plan, Prediction] | None, pins: Mapping[str, str],
                         k: int | None, optimizer: str, n_layers: int, n_dev: int,
                         memory: Mapping[str, Any] | None = None
                         ) -> tuple[Plan, Prediction] | None:
    """``best``, or pipeline-dp's plan (relabelled, with a note) when the simulator finds it
    faster; a note on ``best`` when pipeline-dp's DP would take too long to run."""
    if dp_cells(n_layers, n_dev, True) > PIPELINE_DP_CELLS:
        if best is None:
            return None
        plan, pred = best
        note = (f"pipeline-dp not compared: its DP over {n_layers} layers on {n_dev} devices "
                "would take long (the search covers its plans with equal replicas per stage)")
        return plan.with_settings(notes=(*plan.notes, note)), pred
    try:
        other = lookup_algorithm("pipeline-dp").fn(graph, cluster, costs, pins=pins, k=k,
                                                    optimizer=optimizer,
                                                    compare_baselines=False)
    except MemoryExceededError:
        return best
    other = with_memory_settings(other, memory)
    pred = simulate(graph, other, costs)
    if not pred.fits or (best is not None and best[1].step_s <= pred.step_s * (1 + 1e-9)):
        return best
    own = f"{best[1].step_s:.4g} s" if best is not None else "nothing that fits"
    reps = sorted({other.replicas_of(s) for s in range(len(other.stages))})
    note = (f"degrees: pipeline-dp's plan without tensor splits ({len(other.stages)} stages, "
            f"replicas {'/'.join(map(str, reps))}, {other.micro_batches} micro-batches) is "
            f"faster than the best mesh ({pred.step_s:.4g} s per step against {own}), so "
            "this is that plan")
    opts = {**other.options, "dp": other.data_parallel, "tp": 1, "pp": len(other.stages),
            "degrees": f"{other.data_parallel}x1x{len(other.stages)}",
            "fallback": "pipeline-dp"}
    return other.with_settings(algorithm="degrees", notes=(*other.notes, note),
                               options=opts), pred


__all__ = ["MAX_LAYERS", "MEMORY_KEYWORDS", "PIPELINE_DP_CELLS", "candidate_plan", "degrees"]
