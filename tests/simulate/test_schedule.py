"""The task graph as data and the one event loop that schedules it: what they promise."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from builders import cluster, costs, graph
from test_simulate_speed import cases, make_case

from explorer.core.plan import Plan
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.simulate import clear_caches
from explorer.simulate.runs import Runs
from explorer.simulate.schedule import run
from explorer.simulate.simulator import simulate
from explorer.simulate.taskgraph import BWD, FWD
from explorer.simulate.tasks import build_tasks


def _pipeline(extra_op_s: float = 0.0, late_receive_s: float = 0.2):
    """A chain on three CPU stages, 1F1B with three micro-batches, links that make a receive
    posted late wait; a negative ``extra_op_s`` makes the cheap ops take negative time."""
    g = graph([("x", "input", [], 80), ("a", "op", ["x"], 80, 0, ["x"]),
               ("b", "op", ["a"], 80, 0, ["a"]), ("c", "op", ["b"], 80, 0, ["b"]),
               ("d", "op", ["c"], 80), ("loss", "op", ["d"], 4, 0, ["d"])])
    cl = cluster(3)
    cl = replace(cl, default_link=replace(cl.default_link, late_receive_s=late_receive_s))
    plan = Plan.from_assignment(g, [("d:0",), ("d:1",), ("d:2",)],
                                {"a": 0, "b": 1, "c": 1, "d": 2, "loss": 2},
                                micro_batches=3, schedule="1f1b")
    cm = costs(g, cl, {"a": 0.3, "b": 0.02, "c": 0.5, "d": 0.01, "loss": 0.1},
               {"a": 0.6, "b": 0.04, "c": 1.0, "d": 0.02, "loss": 0.2})
    return g, plan, replace(cm, extra_op_s=extra_op_s)


def test_the_forward_backward_layout_finds_every_op_s_tasks():
    g, plan, cm = _pipeline()
    tasks = build_tasks(g, plan, cm)
    fb = tasks.fb
    for i, node in enumerate(g.nodes):
        for m in range(plan.micro_batches):
            if node.kind != "op":
                assert fb.fwd[i] == fb.bwd[i] == -1
                continue
            for kind, slot in ((FWD, fb.fwd[i]), (BWD, fb.bwd[i])):
                t = int(slot) + m * fb.per_mb
                assert (tasks.kind[t], tasks.node[t], tasks.mb[t]) == (kind, i, m)
                assert tasks.res[t] == tasks.stage[i] == fb.stage[slot]
                assert tasks.dur[t] == fb.dur_s[slot]


@pytest.mark.parametrize("extra_op_s", [0.0, -0.05])
def test_every_task_waits_for_its_dependencies_and_its_resource(extra_op_s):
    g, plan, cm = _pipeline(extra_op_s)
    tasks = build_tasks(g, plan, cm)
    assert tasks.late_in and tasks.negative_times == (extra_op_s < 0)
    timing = run(tasks)
    T = len(tasks.kind)
    assert sorted(timing.order) == list(range(T))
    place = {t: k for k, t in enumerate(timing.order)}
    preds: dict[int, set[int]] = {u: set() for u in range(T)}
    for t in range(T):
        for u in tasks.succ_flat[tasks.succ_ptr[t]:tasks.succ_ptr[t + 1]]:
            preds[u].add(t)
            assert place[t] < place[u]  # the start order is a topological order
            assert timing.start[u] >= timing.end[t]
        assert timing.end[t] == timing.start[t] + tasks.dur[t]
    last_on: dict[int, int] = {}
    for u in timing.order:  # one task at a time on each resource
        r = tasks.res[u]
        if r in last_on:
            assert timing.start[u] >= timing.end[last_on[r]]
        c = timing.cause[u]
        # what let it start: a dependency, its resource's previous task, or a late receive
        assert c == -1 or c in preds[u] or c == last_on.get(r)
        last_on[r] = u


def test_a_late_receive_waits_and_is_the_cause():
    g, plan, cm = _pipeline()
    on_time = simulate(g, plan, replace(cm, cluster=cm.cluster.without_late_receive()))
    late = simulate(g, plan, cm)
    assert late.step_s > on_time.step_s
    assert any(step.startswith("send ") for step in late.critical_path)


def test_clear_caches_gives_the_same_prediction_cold():
    g, plan, cm = _pipeline(-0.05)
    warm = simulate(g, plan, cm)
    clear_caches()
    assert simulate(g, plan, cm) == warm


def test_start_and_end_arrays_are_the_times_read_only():
    g, plan, cm = _pipeline()
    timing = run(build_tasks(g, plan, cm))
    start_a, end_a = timing.arrays
    assert start_a.tolist() == list(timing.start) and end_a.tolist() == list(timing.end)
    with pytest.raises(ValueError):
        end_a[0] = 1.0  # (memory accounting may not change the schedule it reads)


def _schedule(tasks) -> tuple:
    """Everything a schedule says: times, causes and each resource's order of tasks."""
    timing = run(tasks)
    per_resource: dict[int, list[int]] = {}
    for t in timing.order:
        per_resource.setdefault(tasks.res[t], []).append(t)
    return list(timing.start), list(timing.end), list(timing.cause), per_resource


def _with_runs(monkeypatch, on: bool, shortest: int = 1) -> list[int]:
    """Runs on (taken however short) or off; returns a list that counts the runs made."""
    made: list[int] = []
    schedule = Runs.schedule_run

    def counted(self, *args):
        made.append(1)
        return schedule(self, *args)

    monkeypatch.setattr(Runs, "worth", staticmethod(lambda tasks: on))
    monkeypatch.setattr(Runs, "MIN_RUN", shortest)
    monkeypatch.setattr(Runs, "schedule_run", counted)
    return made


@pytest.mark.parametrize("k", range(len(cases())))
def test_runs_give_the_schedule_of_the_event_loop(k, monkeypatch):
    g, plan, cm = make_case(cases()[k])
    tasks = build_tasks(g, plan, cm)
    for s, queue in enumerate(tasks.fb.queue):  # a stage's tasks in the order of their keys
        assert sorted(queue.tolist()) == [t for t in range(len(tasks.fb.stage) *
                                                         plan.micro_batches)
                                          if tasks.res[t] == s]
        keys = [tasks.key[t] for t in queue.tolist()]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
    _with_runs(monkeypatch, False)
    want = _schedule(tasks)
    _with_runs(monkeypatch, True)
    assert _schedule(tasks) == want


def test_runs_are_made_and_change_nothing_on_a_pipeline(monkeypatch):
    g = layered_dag(1500, seed=3)
    cl = Cluster.preset("4xH100")
    costs = roofline_costs(g, cl)
    ops = [i for i, n in enumerate(g.nodes) if n.kind == "op"]
    for stages, micro_batches, schedule in (([("d:0",)], 1, "gpipe"),
                                            ([(d,) for d in cl.ids], 4, "1f1b"),
                                            ([(d,) for d in cl.ids], 3, "gpipe"),
                                            ([tuple(cl.ids[:2]), tuple(cl.ids[2:])], 2, "1f1b")):
        stages = [tuple(cl.ids[0] if d == "d:0" else d for d in st) for st in stages]
        part = {i: min(k * len(stages) // len(ops), len(stages) - 1) for k, i in enumerate(ops)}
        plan = Plan.from_assignment(g, stages, part, micro_batches=micro_batches,
                                    schedule=schedule)
        tasks = build_tasks(g, plan, costs)
        _with_runs(monkeypatch, False)
        want = _schedule(tasks)
        for shortest in (1, Runs.MIN_RUN):
            made = _with_runs(monkeypatch, True, shortest)
            assert _schedule(tasks) == want
            assert made  # (the runs did happen)


@pytest.mark.parametrize("settings", [{"zero": 1}, {"zero": 2}, {"zero": 3},
                                      {"recompute": "selective"}, {"recompute": "full"},
                                      {"precision": "bf16"},
                                      {"zero": 3, "recompute": "full", "precision": "bf16"}],
                         ids=str)
def test_runs_change_nothing_under_memory_settings(settings, monkeypatch):
    """ZeRO's collectives and recomputed forwards are tasks like the others: runs schedule
    them exactly as the event loop does."""
    g = layered_dag(600, seed=5)
    cl = Cluster.preset("4xH100")
    costs = roofline_costs(g, cl)
    ops = [i for i, n in enumerate(g.nodes) if n.kind == "op"]
    stages = [tuple(cl.ids[:2]), tuple(cl.ids[2:])]
    part = {i: min(k * 2 // len(ops), 1) for k, i in enumerate(ops)}
    plan = Plan.from_assignment(g, stages, part, micro_batches=2,
                                schedule="1f1b").with_memory(**settings)
    tasks = build_tasks(g, plan, costs)
    _with_runs(monkeypatch, False)
    want = _schedule(tasks)
    made = _with_runs(monkeypatch, True)
    assert _schedule(tasks) == want
    assert made


@pytest.mark.parametrize("stages, micro_batches, schedule",
                         [(4, 4, "1f1b"), (2, 3, "1f1b"), (2, 2, "gpipe")])
def test_runs_keep_one_event_per_task_waiting_elsewhere(stages, micro_batches, schedule,
                                                        monkeypatch):
    """A 1F1B gate or an all-reduce bucket waits for many backwards of a run: only the last
    of them keeps an event for it, the others are counted when the run is made; the schedule
    is the event loop's."""
    g = layered_dag(1200, seed=11)
    cl = Cluster.preset("4xH100")
    costs = roofline_costs(g, cl)
    ops = [i for i, n in enumerate(g.nodes) if n.kind == "op"]
    groups = [tuple(cl.ids[k::stages]) for k in range(stages)]  # (replicated when < 4)
    part = {i: min(k * stages // len(ops), stages - 1) for k, i in enumerate(ops)}
    plan = Plan.from_assignment(g, groups, part, micro_batches=micro_batches,
                                schedule=schedule)
    tasks = build_tasks(g, plan, costs)
    _with_runs(monkeypatch, False)
    want = _schedule(tasks)
    made: list[Runs] = []
    init = Runs.__init__

    def kept(self, *args):
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(Runs, "__init__", kept)
    for shortest in (1, Runs.MIN_RUN):
        made.clear()
        n_runs = _with_runs(monkeypatch, True, shortest)
        assert _schedule(tasks) == want
        (runs,) = made
        n_fb = tasks.fb.per_mb * micro_batches
        src = np.repeat(np.arange(len(tasks.kind)), np.diff(tasks.succ_ptr_a))
        dst = tasks.succ_flat_a
        off = (src < n_fb) & (dst >= n_fb)  # forwards and backwards -> tasks off stages
        assert np.bincount(dst[off]).max() > 1  # (gates, all-reduces wait for many)
        assert runs.far_succ  # (detached events were made), one per run and task at most
        assert max(Counter(runs.far_succ).values()) <= len(n_runs)


def test_task_columns_read_alike_item_by_item_and_whole():
    """Labels, kinds, micro-batches, bytes and nodes are kept as the chunks they were made of
    (arrays, repeated items, prefixed names): one item reads as the whole list has it."""
    g, plan, cm = _pipeline()
    whole = build_tasks(g, plan, cm)
    T = len(whole.kind)
    for name in ("kind", "label", "mb", "nbytes", "node"):
        want = list(getattr(whole, name))
        one = getattr(build_tasks(g, plan, cm), name)  # (nothing read whole yet)
        got = [one[t] for t in range(T)]
        assert got == want and [type(x) for x in got] == [type(x) for x in want]
        assert one[-1] == want[-1] and one[1:4] == want[1:4] and len(one) == T
        with pytest.raises(IndexError):
            one[T]
    assert any(x.startswith("grad ") for x in whole.label)  # (prefixed names)
    assert whole.kind.count("send") > 0  # (repeated items)
