"""A GPU's two timelines: its host issues each op in order without waiting, its stream runs the
kernels in that order, each no earlier than issued; hand-computed chains."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from builders import cluster, costs, device, graph
from test_memory_settings import chain, chain4

from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster, Link
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.profiling.profile_cache import costs_problem
from explorer.simulate.schedule import run
from explorer.simulate.simulator import simulate
from explorer.simulate.tasks import build_tasks

OPS = ("mm1", "relu1", "mm2", "loss")
#: the order one device's host issues a step of ``chain``: forwards, then backwards reversed
ISSUE_ORDER = [("fwd", o) for o in OPS] + [("bwd", o) for o in reversed(OPS)]


def gpus(n: int) -> Cluster:
    return Cluster(name=f"gpus:{n}", devices=tuple(device(i, 2**40, kind="cuda")
                                                   for i in range(n)),
                   default_link=Link(0.0, float("inf"), "test"))


def two_timelines(g, cl: Cluster, fwd: dict, bwd: dict, host_fwd: dict, host_bwd: dict
                  ) -> CostModel:
    """``costs`` with the device's kernel times ``fwd``/``bwd`` and its host's issue times."""
    cm = costs(g, cl, fwd, bwd)
    host = [[host_fwd.get(n.name, 0.0) for n in g.nodes],
            [host_bwd.get(n.name, 0.0) for n in g.nodes]]
    return replace(cm, per_type={k: replace(dc, host_s=host) for k, dc in cm.per_type.items()})


def one_gpu(fwd, bwd, host_fwd, host_bwd):
    g = chain()
    plan = Plan.from_assignment(g, [("d:0",)], {i: 0 for i in range(len(g))})
    return simulate(g, plan, two_timelines(g, gpus(1), fwd, bwd, host_fwd, host_bwd))


def same(x: float) -> dict[str, float]:
    return dict.fromkeys(OPS, x)


def compute(pred, device: str = "d:0") -> list[tuple[str, str, float, float]]:
    return [(iv.kind, iv.label, iv.start_s, iv.end_s) for iv in pred.timeline
            if iv.device == device and iv.lane == "compute" and iv.kind in ("fwd", "bwd")]


def test_a_host_bound_chain_waits_for_each_issue():
    # the host takes 10 s per op, the kernels 1 s: each kernel starts when it is issued
    pred = one_gpu(same(1.0), same(1.0), same(10.0), same(10.0))
    assert compute(pred) == [(k, o, 10.0 * (i + 1), 10.0 * (i + 1) + 1.0)
                             for i, (k, o) in enumerate(ISSUE_ORDER)]
    assert pred.step_s == 81.0
    assert pred.host_busy_s == {"d:0": 80.0} and pred.busy_s["d:0"] == 8.0
    # the critical path runs along the host: every issue, then the last kernel
    assert pred.critical_path == (*(f"issue {k} {o}" for k, o in ISSUE_ORDER), "bwd mm1")


def test_a_device_bound_chain_runs_back_to_back_after_the_first_issue():
    pred = one_gpu(same(10.0), same(10.0), same(1.0), same(1.0))
    assert compute(pred) == [(k, o, 1.0 + 10.0 * i, 11.0 + 10.0 * i)
                             for i, (k, o) in enumerate(ISSUE_ORDER)]
    assert pred.step_s == 81.0
    assert pred.critical_path == ("issue fwd mm1", *(f"{k} {o}" for k, o in ISSUE_ORDER))


def test_a_mixed_chain_takes_the_later_of_issue_and_inputs_for_each_kernel():
    pred = one_gpu({"mm1": 10, "relu1": 1, "mm2": 10, "loss": 1},
                   {"mm1": 1, "relu1": 10, "mm2": 1, "loss": 10},
                   {"mm1": 1, "relu1": 10, "mm2": 1, "loss": 1},
                   {"mm1": 10, "relu1": 1, "mm2": 1, "loss": 1})
    # issued (host ends): fwd 1, 11, 12, 13; bwd loss 14, mm2 15, relu1 16, mm1 26
    assert compute(pred) == [("fwd", "mm1", 1, 11), ("fwd", "relu1", 11, 12),
                             ("fwd", "mm2", 12, 22), ("fwd", "loss", 22, 23),
                             ("bwd", "loss", 23, 33), ("bwd", "mm2", 33, 34),
                             ("bwd", "relu1", 34, 44), ("bwd", "mm1", 44, 45)]
    assert pred.step_s == 45.0
    host = [(iv.label, iv.start_s, iv.end_s) for iv in pred.timeline if iv.lane == "host"]
    assert host == [("fwd mm1", 0, 1), ("fwd relu1", 1, 11), ("fwd mm2", 11, 12),
                    ("fwd loss", 12, 13), ("bwd loss", 13, 14), ("bwd mm2", 14, 15),
                    ("bwd relu1", 15, 16), ("bwd mm1", 16, 26)]


def test_the_optimizer_step_is_issued_after_the_last_backward():
    g = chain(40, 40)
    plan = Plan.from_assignment(g, [("d:0",)], {i: 0 for i in range(len(g))})
    cm = two_timelines(g, gpus(1), same(1.0), same(1.0), same(10.0), same(10.0))
    cm = replace(cm, per_type={k: replace(dc, optimizer_s_per_byte={"adam": 0.1})
                               for k, dc in cm.per_type.items()})
    pred = simulate(g, plan, cm)
    step = next(iv for iv in pred.timeline if iv.kind == "optimizer")
    # the last backward kernel ends at 81; adam on 80 bytes of weights at 0.1 s per byte
    assert (step.start_s, step.end_s) == (81.0, 89.0)


def test_cpu_ranks_keep_one_timeline():
    g = chain()
    plan = Plan.from_assignment(g, [("d:0",)], {i: 0 for i in range(len(g))})
    cm = costs(g, cluster(1), same(1.0), same(2.0))
    tasks = build_tasks(g, plan, cm)
    assert tasks.release is None and tasks.issue_s is None
    pred = simulate(g, plan, cm)
    assert pred.step_s == 12.0 and pred.host_busy_s == {}
    assert not any(iv.lane == "host" for iv in pred.timeline)


def test_each_stage_s_host_issues_its_own_ops_from_the_step_s_start():
    g = chain()
    plan = Plan.from_assignment(g, [("d:0",), ("d:1",)],
                                {"mm1": 0, "relu1": 0, "mm2": 1, "loss": 1})
    pred = simulate(g, plan, two_timelines(g, gpus(2), same(1.0), same(1.0), same(10.0),
                                           same(10.0)))
    # d:1's host issues mm2 at 10 and loss at 20 without waiting for d:0's activations
    # (ready at 21): its kernels run when those arrive; d:0's backwards wait for its host
    assert compute(pred, "d:1") == [("fwd", "mm2", 21, 22), ("fwd", "loss", 22, 23),
                                    ("bwd", "loss", 30, 31), ("bwd", "mm2", 40, 41)]
    assert compute(pred, "d:0") == [("fwd", "mm1", 10, 11), ("fwd", "relu1", 20, 21),
                                    ("bwd", "relu1", 41, 42), ("bwd", "mm1", 42, 43)]
    assert pred.step_s == 43.0
    assert pred.host_busy_s == {"d:0": 40.0, "d:1": 40.0}


def test_recomputation_issues_the_dropped_forwards_again():
    g = chain4()  # full recomputation of layers.0 makes mm1 and relu1 again in mm2's backward
    plan = Plan.from_assignment(g, [("d:0",)], {i: 0 for i in range(len(g))})
    ops = [n.name for n in g.nodes if n.kind == "op"]
    cm = two_timelines(g, gpus(1), dict.fromkeys(ops, 1.0), dict.fromkeys(ops, 1.0),
                       dict.fromkeys(ops, 10.0), dict.fromkeys(ops, 10.0))
    kept = build_tasks(g, plan, cm)
    again = build_tasks(g, plan.with_memory(recompute="full"), cm)
    mm2_bwd = int(again.fb.bwd[g.index["mm2"]])
    assert again.issue_s[mm2_bwd] == 30.0 and kept.issue_s[mm2_bwd] == 10.0
    assert again.dur[mm2_bwd] == 3.0 and kept.dur[mm2_bwd] == 1.0
    assert again.issue_s.sum() - kept.issue_s.sum() == 20.0


def test_a_profile_s_host_times_are_checked_when_read_from_the_cache():
    g = graph([("x", "input", [], 8), ("a", "op", ["x"], 8)])
    cm = two_timelines(g, gpus(1), {"a": 1.0}, {"a": 1.0}, {"a": 2.0}, {"a": 2.0})
    good = {k: v for k, v in vars(cm.per_type["cuda:test dev"]).items()
            if not k.startswith("_")}
    assert costs_problem(good, len(g)) is None
    for bad in ([[0.0, 1.0]], [[0.0, 1.0], [0.0]], [[0.0, -1.0], [0.0, 1.0]]):
        assert costs_problem({**good, "host_s": bad}, len(g)) == (
            "host_s is not two lists (forward, backward) of a time per node")


@pytest.mark.parametrize("seed", range(6))
def test_one_gpu_s_stream_follows_the_recurrence_of_its_two_timelines(seed):
    """On one device every task waits only for earlier tasks of its queue, so each starts at
    the later of the previous task's end and its own issue: the schedule must give exactly
    that, on random graphs with random host and kernel times (host-bound, device-bound and
    mixed by turns)."""
    rng = np.random.default_rng(seed)
    g = layered_dag(40, width=4, seed=seed)
    cl = gpus(1)
    cm = roofline_costs(g, cl)
    n = len(g)
    scale = [0.1, 1.0, 10.0][seed % 3]  # the host's times against the kernels'
    dc = next(iter(cm.per_type.values()))
    ops = np.array([nd.kind == "op" for nd in g.nodes])
    dc = replace(dc, fwd_s=(rng.uniform(1, 5, n) * ops).tolist(),
                 bwd_s=(rng.uniform(1, 5, n) * ops).tolist(),
                 host_s=[(scale * rng.uniform(1, 5, n) * ops).tolist(),
                         (scale * rng.uniform(1, 5, n) * ops).tolist()])
    cm = replace(cm, per_type={dc.type_key: dc})
    plan = Plan.from_assignment(g, [("d:0",)], {i: 0 for i in range(n)})
    tasks = build_tasks(g, plan, cm)
    timing = run(tasks)
    start, end = timing.arrays
    prev_end = 0.0
    for t in tasks.fb.queue[0].tolist():
        assert start[t] == max(prev_end, tasks.release[t])
        prev_end = end[t]
    # the host issued everything before the last kernel could start
    assert tasks.release[tasks.fb.queue[0]].max() <= start[tasks.fb.queue[0][-1]]
    assert simulate(g, plan, cm).step_s == pytest.approx(max(end))
