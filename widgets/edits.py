"""Hand edits of a plan as pure functions: which nodes an edit moves, and the plan it makes.

Plans are immutable; each function returns a new :class:`explorer.Plan` (or a list of names)
and raises :class:`explorer.ExplorerError` for an edit that cannot be made.
"""

from __future__ import annotations

from collections.abc import Iterable

import explorer as ex
from explorer.capture.tracing import batch_splits
from explorer.core.errors import ExplorerError
from explorer.core.plan import DEFAULT_SETTINGS


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
    settings); stages left with nothing on them are dropped.
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
            stages.append((target,))
            settings.append(settings[where])  # it keeps the stage's memory settings
            where = len(stages) - 1
    for n in names:
        placement[n] = where
    # drop stages left with nothing on them, renumbering the rest
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
