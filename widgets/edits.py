"""Hand edits of a plan as pure functions: which nodes an edit moves, and the plan it makes.

Plans are immutable; each function returns a new :class:`explorer.Plan` (or a list of names)
and raises :class:`explorer.ExplorerError` for an edit that cannot be made.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import explorer as ex
from explorer.capture.tracing import batch_splits
from explorer.core.errors import ExplorerError
from explorer.core.plan import DEFAULT_SETTINGS, StageSettings


def targets(plan: ex.Plan, cluster: ex.Cluster) -> list[str]:
    """Where nodes can be assigned: every device, and each replicated stage as a whole
    (named by its devices joined with "+")."""
    return list(cluster.ids) + ["+".join(s) for s in plan.stages if len(s) > 1]


def with_owned(graph: ex.OpGraph, names: Iterable[str], owned: bool = True) -> list[str]:
    """Check names; with ``owned``, add the parameters, buffers and inputs the given ops own
    (see :meth:`explorer.OpGraph.owner`)."""
    names = list(dict.fromkeys(names))
    bad = [n for n in names if n not in graph]
    if bad:
        raise ExplorerError(f"no node named {bad[0]!r} in graph {graph.name}")
    if not owned:
        return names
    idx = graph.index
    chosen = {idx[n] for n in names}
    extra = [n.name for i, n in enumerate(graph.nodes)
             if n.kind != "op" and i not in chosen and graph.owner(i) in chosen]
    return names + extra


def placed_on(plan: ex.Plan, graph: ex.OpGraph, cluster: ex.Cluster, names: list[str],
              target: str) -> ex.Plan:
    """``plan`` with ``names`` on ``target``: a device, or a replicated stage ``"dev+dev"``.

    A device not used by the plan becomes a new stage (default memory settings); a device
    taken out of a replicated stage becomes a stage of its own (with that stage's memory
    settings; a tensor-parallel degree that no longer divides either stage's devices falls
    back to 1, :func:`fitted`); stages left with nothing on them are dropped.
    """
    stages = [tuple(s) for s in plan.stages]
    settings = [plan.settings_of(k) for k in range(len(stages))]
    placement = dict(plan.placement)
    if "+" in target:
        devs = tuple(target.split("+"))
        if devs not in stages:
            raise ExplorerError(f"{target!r} is not a replicated stage of this plan; "
                                f"choose one of {', '.join(targets(plan, cluster))}")
        where = stages.index(devs)
    else:
        cluster.device(target)  # unknown devices raise, listing the known ones
        where = next((k for k, s in enumerate(stages) if target in s), None)
        if where is None:
            stages.append((target,))
            settings.append(DEFAULT_SETTINGS)
            where = len(stages) - 1
        elif len(stages[where]) > 1:  # take the device out of its replicated stage
            stages[where] = tuple(d for d in stages[where] if d != target)
            settings[where] = fitted(settings[where], len(stages[where]))
            stages.append((target,))
            settings.append(fitted(settings[where], 1))
            where = len(stages) - 1
    for n in names:
        placement[n] = where
    return rebuilt(plan, graph, cluster, stages, settings, placement)


def leaving_replicas(plan: ex.Plan, graph: ex.OpGraph, names: Iterable[str],
                     target: str) -> str:
    """What placing ``names`` on device ``target`` (:func:`placed_on`) does to the ops left
    on the replicated stage ``target`` serves in ``plan``, in words ("" when it serves none,
    or nothing else is on it). A device serves one stage only, so ``target`` leaves that
    stage: the ops left there keep the stage's other devices, and on one device they are no
    longer replicated."""
    if "+" in target:
        return ""
    where = next((k for k, s in enumerate(plan.stages) if target in s), None)
    if where is None or len(plan.stages[where]) < 2:
        return ""
    moved = set(names)
    left = sum(1 for n in graph.ops if plan.placement[n.name] == where and n.name not in moved)
    if not left:
        return ""
    stage = "+".join(plan.stages[where])
    rest = [d for d in plan.stages[where] if d != target]
    said = (f"{target} left the replicated stage {stage} for what you assigned (a device "
            f"serves one stage): the other {left:,} op(s) of that stage ")
    if len(rest) > 1:
        return said + f"stay replicated on {'+'.join(rest)}"
    return said + (f"now run on {rest[0]} alone, not replicated; undo to put them back, or "
                   f"assign the selection to {stage} to keep it replicated with them")


def fitted(settings: StageSettings, n_devices: int) -> StageSettings:
    """A stage's settings once it has ``n_devices``: a tensor-parallel degree that no longer
    divides them falls back to 1 (each device holds whole layers again), and so does a
    context-parallel degree that no longer divides them with it."""
    if n_devices % settings.tensor:
        settings = replace(settings, tensor=1, sequence=False, async_tensor=False)
    return (settings if n_devices % (settings.tensor * settings.context) == 0
            else replace(settings, context=1))


def split_targets(plan: ex.Plan, cluster: ex.Cluster) -> list[str]:
    """Groups of devices a selection can be split over ("dev+dev"): the plan's stages of
    several devices, then runs of 2, 4, 8 ... consecutive devices of the cluster."""
    out = ["+".join(s) for s in plan.stages if len(s) > 1]
    ids = list(cluster.ids)
    size = 2
    while size <= len(ids):
        out += ["+".join(ids[k:k + size]) for k in range(0, len(ids) - size + 1, size)]
        size *= 2
    return list(dict.fromkeys(out))


def split_over(plan: ex.Plan, graph: ex.OpGraph, cluster: ex.Cluster, names: list[str],
               devices: Sequence[str], degree: int | None = None) -> ex.Plan:
    """``plan`` with ``names`` on a stage of ``devices`` that splits its layers ``degree``
    ways (default: over all of them) by tensor parallelism.

    When ``devices`` are a stage of the plan, the nodes join it and it takes the degree;
    otherwise the devices leave the stages they serve for a new stage (the nodes of a stage
    left without devices come along). Stages left with nothing on them are dropped.
    """
    devices = tuple(devices)
    degree = len(devices) if degree is None else degree
    for d in devices:
        cluster.device(d)  # unknown devices raise, listing the known ones
    if len(set(devices)) != len(devices):
        raise ExplorerError(f"{'+'.join(devices)} names a device twice; name each once")
    if degree < 2:
        raise ExplorerError("a split needs a tensor-parallel degree of 2 or more; to place "
                            "nodes whole, assign them")
    if len(devices) % degree:
        raise ExplorerError(f"a tensor-parallel degree of {degree} does not divide the "
                            f"{len(devices)} devices of {'+'.join(devices)}; choose a degree "
                            "that divides them")
    stages = [tuple(s) for s in plan.stages]
    settings = [plan.settings_of(k) for k in range(len(stages))]
    placement = dict(plan.placement)
    if devices in stages:
        where = stages.index(devices)
    else:
        for k, s in enumerate(stages):
            stages[k] = tuple(d for d in s if d not in devices)
            settings[k] = fitted(settings[k], max(len(stages[k]), 1))
        stages.append(devices)
        settings.append(DEFAULT_SETTINGS)
        where = len(stages) - 1
        placement = {n: where if not stages[s] else s for n, s in placement.items()}
    settings[where] = replace(settings[where], tensor=degree)
    for n in names:
        placement[n] = where
    return rebuilt(plan, graph, cluster, stages, settings, placement)


def rebuilt(plan: ex.Plan, graph: ex.OpGraph, cluster: ex.Cluster,
            stages: list[tuple[str, ...]], settings: list[StageSettings],
            placement: dict[str, int]) -> ex.Plan:
    """The edited plan from its stages, their settings and the placement: stages left with
    nothing on them are dropped (the rest renumbered), and the plan is checked."""
    used = sorted(set(placement.values()))
    renum = {old: new for new, old in enumerate(used)}
    placement = {n: renum[s] for n, s in placement.items()}
    stages = [stages[s] for s in used]
    settings = [settings[s] for s in used]
    edited = plan.algorithm == "manual" or plan.algorithm.endswith("+edits")
    out = plan.with_settings(
        stages=tuple(stages), placement=placement,
        algorithm=plan.algorithm if edited else f"{plan.algorithm}+edits",
        stage_settings=(tuple(settings) if any(not st.is_default for st in settings) else ()))
    out.validate(graph, cluster)
    return out


def first_device(plan: ex.Plan, name: str) -> str:
    """The device a node is on (the first of its stage's devices when replicated)."""
    return plan.devices_of(name)[0]


def count_label(graph: ex.OpGraph, names: Iterable[str]) -> str:
    """How an edit names what it touched in the history: the op, or "N ops"."""
    names = list(names)
    ops = [n for n in names if graph[n].kind == "op"] or names
    return ops[0] if len(ops) == 1 else f"{len(ops)} ops"


def run_problem(graph: ex.OpGraph, plan: ex.Plan) -> str:
    """Why real steps of ``plan`` cannot run ("" when they can): the batch must split evenly
    over replicas x micro-batches, and only into parts when the graph's batch is dynamic."""
    exported = graph.runtime is not None and graph.runtime.program is not None
    try:
        plan.check_runnable(graph.batch_size, batch_splits(graph) if exported else None)
    except ExplorerError as e:
        return str(e)
    return ""


def memory_label(plan: ex.Plan, stages: list[int]) -> str:
    """The memory settings of ``stages`` in words, for the history ("zero 3, bf16 on stage 1")."""
    said = {plan.settings_of(k).describe() or "defaults" for k in stages}
    where = ("all stages" if len(stages) == len(plan.stages) and len(stages) > 1
             else "stage " + ", ".join(str(k) for k in stages))
    return f"{' / '.join(sorted(said))} on {where}"
