"""The search driver ParDNN and Baechi's placers share: candidates, baselines, scoring.

:func:`search` runs a placement function on an
:class:`~explorer.partition.search.op_problem.OpProblem`, compares its plan with the
``single`` and ``data-parallel`` baselines (by the shared simulator on graphs up to
``simulate_max_nodes`` nodes, by :func:`~explorer.partition.search.list_schedule.schedule_s`
beyond), and returns the best as a Plan. The registry's final check
(:mod:`explorer.partition.guard`) then simulates that plan against the baselines at any size.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from explorer.core.errors import ExplorerError, MemoryExceededError, unknown_name
from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE, Plan, StageSettings
from explorer.core.units import MiB
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.bounds import op_devices
from explorer.partition.guard import fits_within, most_replicas, replicated
from explorer.partition.options import SEARCH_OPTIONS, Options
from explorer.partition.search.fallback import (
    cheapest_memory_settings,
    memory_keywords,
    splits_under_settings,
)
from explorer.partition.search.list_schedule import schedule_s
from explorer.partition.search.op_problem import OpProblem, node_seconds, op_problem
from explorer.simulate.simulator import simulate

#: how many times a plan is re-placed with tighter memory when the simulator finds a device over
SIMULATED_MEMORY_RETRIES = 5

#: a placement function: device index per unit, and notes for the plan
Placement = Callable[[OpProblem], tuple[np.ndarray, tuple[str, ...]]]


@dataclass(frozen=True)
class _Candidate:
    """A plan the search may return: how to build it, whether it fits, and its step time."""

    label: str
    make: Callable[[], Plan]  # builds the plan (only the chosen one is built for large graphs)
    fits: bool
    score_s: float


def search(graph: OpGraph, cluster: Cluster, costs: CostModel, name: str, place: Placement,
           pins: Mapping[str, str] | None, opts: Options,
           extra_options: Mapping[str, Any] | None = None) -> Plan:
    """Run ``place`` and return the best plan among it and the baselines (see module docs).

    ``opts`` holds the options of :data:`~explorer.partition.options.SEARCH_OPTIONS`; they
    and ``extra_options`` (the algorithm's own) go to ``plan.options``.

    Graphs with at most ``simulate_max_nodes`` nodes: every candidate goes through
    :func:`explorer.simulate`; a placement the simulator finds over memory is placed
    again with that device's capacity reduced by the excess (up to
    ``SIMULATED_MEMORY_RETRIES`` times); with ``sweep_devices`` the algorithm also runs on the
    fastest 2, 4, ... devices. Larger graphs: the algorithm runs once on all devices and
    candidates are compared by :func:`schedule_s` and additive memory.
    """
    options = {**opts.pick(SEARCH_OPTIONS), **(extra_options or {})}
    with paused_gc():
        try:
            return _search(graph, cluster, costs, name, place, pins, opts, options)
        except MemoryExceededError:
            # nothing fits as it is: search again under each memory setting, then try each
            # plan found with every setting; the fastest that fits by the simulator
            fitted = cheapest_memory_settings(graph, costs, name, splits_under_settings(
                graph, lambda st: _search(graph, cluster, costs, name, place, pins, opts,
                                          options, st)))
            if fitted is None:
                raise
            return fitted


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a search builds its many small lists.

    The search makes no reference cycles, yet on a 100,000-node graph the collector's full
    passes over the graph's objects triggered by those allocations cost as much as the search.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _search(graph: OpGraph, cluster: Cluster, costs: CostModel, name: str, place: Placement,
            pins: Mapping[str, str] | None, opts: Options, options: dict[str, Any],
            memory: StageSettings | None = None) -> Plan:
    optimizer, memory_fraction = opts.optimizer, opts.memory_fraction
    costs.check(graph)
    if optimizer not in OPTIMIZER_STATE:
        raise unknown_name("optimizer", optimizer, OPTIMIZER_STATE)
    if not 0 < memory_fraction <= 1:
        raise ExplorerError(f"memory_fraction must be in (0, 1], not {memory_fraction!r}")
    pins = dict(pins or {})
    for nm, dv in pins.items():
        if nm not in graph:
            raise ExplorerError(f"pinned node {nm!r} is not in the graph")
        cluster.device(dv)
    asked = list(opts.devices(cluster))
    # on a large cluster: the devices worth placing ops on (see explorer.partition.bounds)
    devs, bound_note = op_devices(name, graph, costs, asked, pins, optimizer, memory_fraction,
                                  memory)
    devs += [d for d in dict.fromkeys(pins.values()) if d not in devs]
    base = op_problem(graph, cluster, costs, devs, pins, optimizer, memory_fraction, memory)
    total, room = int(base.mem.sum()), int(base.cap.sum())
    if total > room:
        raise MemoryExceededError(
            f"{name}: {graph.name} needs {total / MiB:,.1f} MiB (parameters, gradients, "
            f"optimizer state, saved activations) but devices {', '.join(devs)} may hold "
            f"{room / MiB:,.1f} MiB together (" + ", ".join(
                f"{d} {int(c) / MiB:,.1f} MiB" for d, c in zip(devs, base.cap, strict=True))
            + f"): short by {(total - room) / MiB:,.1f} MiB wherever the nodes go. Use more "
            "devices or devices with more memory, a lighter optimizer, or a smaller batch")
    by_sim = len(graph) <= opts.simulate_max_nodes
    settings = {"algorithm": name, "optimizer": optimizer, "options": options,
                "pinned": frozenset(pins), "memory": memory}

    # device subsets: all devices; with sweep, the fastest 2, 4, ... plus pinned devices
    must = sorted({int(j) for j in base.pinned if j >= 0})
    subsets = [list(range(base.k))]
    if by_sim and opts.sweep_devices:
        size = 2
        while size < base.k:
            sub = sorted(set(base.speed_order[:size]) | set(must))
            if len(sub) < base.k and sub not in subsets:
                subsets.append(sub)
            size *= 2

    cands: list[_Candidate] = []
    first_error: MemoryExceededError | None = None
    for sub in subsets:
        prob = base.restrict(sub) if len(sub) < base.k else base
        try:
            cand = _own_candidate(graph, costs, prob, place, settings, by_sim, name,
                                  "all devices" if len(sub) == base.k else f"{len(sub)} devices",
                                  memory_fraction)
        except MemoryExceededError as exc:
            first_error = first_error or exc
            continue
        cands.append(cand)
    if opts.baselines:
        cands += _baseline_candidates(graph, cluster, costs, base, pins, devs, settings,
                                      by_sim, opts.sweep_devices, memory_fraction,
                                      len(asked) if devs == asked[:len(devs)] else len(devs))
    fitting = [c for c in cands if c.fits]
    if not fitting:
        if first_error is not None:
            raise first_error
        raise MemoryExceededError(f"{name}: no placement of {graph.name} fits the devices' "
                                  "memory; use more devices or devices with more memory")
    best = fitting[0]
    for c in fitting[1:]:
        if c.score_s < best.score_s - 1e-12:
            best = c
    how = "simulated" if by_sim else "estimated by list scheduling"
    notes = [f"{name}: chose {best.label} ({how} step {best.score_s * 1e3:.4g} ms)"]
    if bound_note:
        notes.append(bound_note)
    others = [c for c in fitting if c is not best]
    if others:
        notes.append("other candidates: " + ", ".join(
            f"{c.label} {c.score_s * 1e3:.4g} ms" for c in others))
    plan = best.make()
    notes.extend(plan.notes)
    return plan.with_settings(notes=tuple(notes), **_plan_fields(settings))


def _plan_fields(settings: dict[str, Any]) -> dict[str, Any]:
    """The search's settings that are Plan fields (its memory settings are applied apart)."""
    return {k: v for k, v in settings.items() if k != "memory"}


def _dressed(plan: Plan, settings: dict[str, Any]) -> Plan:
    """``plan`` with the search's memory settings on every stage."""
    memory = settings.get("memory")
    return plan if memory is None else plan.with_memory(**memory_keywords(memory))


def _own_candidate(graph: OpGraph, costs: CostModel, prob: OpProblem, place: Placement,
                   settings: dict[str, Any], by_sim: bool, name: str, where: str,
                   memory_fraction: float) -> _Candidate:
    """The algorithm's plan on ``prob``'s devices, placed again with less memory should the
    simulator find a device over (the additive estimate misses short-lived tensors)."""
    cap = prob.cap.copy()
    label = f"{name} on {where}"
    attempt = 0
    while True:
        p = prob.with_cap(cap)
        dev, notes = place(p)
        if not by_sim:
            return _Candidate(label, _maker(graph, p, dev, notes, settings), True,
                              schedule_s(p, dev))
        plan = _dressed(plan_from_placement(graph, p, dev, notes=notes,
                                            **_plan_fields(settings)), settings)
        pred = simulate(graph, plan, costs)
        if fits_within(pred, memory_fraction):
            return _Candidate(label, lambda plan=plan: plan, True, pred.step_s)
        over = {d: b - int(c * memory_fraction) for d, c in pred.capacity_bytes.items()
                if (b := pred.peak_bytes[d]) > int(c * memory_fraction)}
        if attempt == SIMULATED_MEMORY_RETRIES:
            raise MemoryExceededError(
                f"{name}: its plan on {where} stays over memory in the simulator after "
                f"{attempt} tries with tighter limits: " + "; ".join(
                    f"{d} over by {b / MiB:,.1f} MiB" for d, b in over.items()))
        attempt += 1
        for dv, b in over.items():  # the excess, plus a growing margin
            j = p.device_ids.index(dv)
            cap[j] = max(int(cap[j] - b - prob.cap[j] * 0.01 * attempt), 0)


def _maker(graph: OpGraph, p: OpProblem, dev: np.ndarray, notes: Sequence[str],
           settings: dict[str, Any]) -> Callable[[], Plan]:
    return lambda: _dressed(plan_from_placement(graph, p, dev, notes=notes,
                                                **_plan_fields(settings)), settings)


def _baseline_candidates(graph: OpGraph, cluster: Cluster, costs: CostModel, base: OpProblem,
                         pins: Mapping[str, str], devs: list[str], settings: dict[str, Any],
                         by_sim: bool, sweep_devices: bool, memory_fraction: float,
                         replica_devices: int | None = None) -> list[_Candidate]:
    """``single`` (on the fastest device; pinned nodes stay put) and ``data-parallel`` (on
    up to ``replica_devices`` of the cluster's first devices, default ``len(devs)``)."""
    out: list[_Candidate] = []
    optimizer = settings["optimizer"]
    fastest = base.speed_order[0]
    dev = np.where(base.pinned >= 0, base.pinned, fastest)
    if pins:
        make = _maker(graph, base, dev, (), settings)
    else:
        def make() -> Plan:
            dev_id = base.device_ids[fastest]
            return _dressed(Plan.single(graph, dev_id, algorithm="single", optimizer=optimizer,
                                        options={"device": dev_id}), settings)
    if by_sim:
        plan = make()
        pred = simulate(graph, plan, costs)
        out.append(_Candidate("single", lambda plan=plan: plan,
                              fits_within(pred, memory_fraction), pred.step_s))
    else:
        fits = bool(np.all(base.used_bytes(dev) <= base.cap))
        if pins:
            score = schedule_s(base, dev)
        else:  # one device runs everything back to back, then its optimizer step
            score = float(base.w_comb[base.dev_type[fastest]].sum()) + float(
                base.param_bytes.sum() * base.opt_s_per_byte[fastest]
                + base.param_tensors.sum() * base.opt_s_per_tensor[fastest])
        out.append(_Candidate("single", make, fits, score))
    # data parallel over a prefix of the cluster (not with pins: replicas cannot honour them),
    # at most one replica per sample of the batch
    widest = most_replicas(graph, replica_devices or len(devs))
    if pins or devs != list(cluster.ids[: len(devs)]) or widest < 2:
        return out
    sizes = [widest]
    if by_sim and sweep_devices:
        sizes += [s for s in (2, 4, 8, 16, 32, 64) if s < widest]
    for kk in sizes:
        def make_dp(kk: int = kk) -> Plan:
            return _dressed(replicated(graph, cluster.ids[:kk], algorithm="data-parallel",
                                       optimizer=optimizer, options={"k": kk}), settings)
        label = f"data-parallel on {kk}"
        if by_sim:
            plan = make_dp()
            pred = simulate(graph, plan, costs)
            out.append(_Candidate(label, lambda plan=plan: plan,
                                  fits_within(pred, memory_fraction), pred.step_s))
        else:
            mem = node_memory_bytes(graph, optimizer, batch_fraction=1.0 / kk,
                                    settings=settings["memory"], replicas=kk,
                                    device_kind=cluster.device(cluster.ids[0]).kind)
            fits = sum(mem) <= int(base.cap[:kk].min())
            out.append(_Candidate(label, make_dp, fits,
                                  _data_parallel_s(graph, costs, cluster.ids[:kk], optimizer)))
    return out


def _data_parallel_s(graph: OpGraph, costs: CostModel, devs: Sequence[str],
                     optimizer: str) -> float:
    """Data parallel without overlap: compute on 1/k of the batch, all-reduce, optimizer."""
    kk = len(devs)
    d = devs[0]
    f, b = node_seconds(costs, d, 1.0 / kk)
    trainable = [n.param_bytes for n in graph.nodes if n.param_bytes and n.kind != "buffer"]
    grads = sum(n.param_bytes for n in graph.nodes if n.kind == "param" and n.requires_grad)
    return (float(f.sum() + b.sum()) + costs.allreduce_s(tuple(devs), grads)
            + costs.optimizer_s(d, optimizer, sum(trainable), len(trainable)))


def plan_from_placement(graph: OpGraph, p: OpProblem, dev: np.ndarray,
                        notes: Sequence[str] = (), **settings: Any) -> Plan:
    """A Plan with one stage per used device (cluster order) from a device per unit."""
    used = sorted(set(dev.tolist()))
    stage_of_dev = np.full(p.k, -1, dtype=np.int64)
    stage_of_dev[used] = np.arange(len(used))
    stage = stage_of_dev[dev[p.unit_of_node]].tolist()
    return Plan.from_assignment(graph, [(p.device_ids[d],) for d in used],
                                dict(enumerate(stage)), notes=tuple(notes), **settings)


__all__ = ["SIMULATED_MEMORY_RETRIES", "Placement", "paused_gc", "plan_from_placement",
           "search"]
