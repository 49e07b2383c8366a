"""The merged stand-in graph WAP sweeps on large graphs, and WAP's use of it."""

from __future__ import annotations

import pytest

import explorer as ex
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition.coarse import coarsen, groups_of
from explorer.partition.wap import wap_sweep


@pytest.fixture(scope="module")
def case():
    g = layered_dag(1200, width=6, seed=3)
    cl = ex.Cluster.preset("4xH100")
    return g, cl, roofline_costs(g, cl)


def test_groups_cover_every_node_once_in_order(case):
    g, _, _ = case
    groups = groups_of(g, target=50)
    assert sorted(i for grp in groups for i in grp) == list(range(len(g.nodes)))
    assert len(groups) <= 4 * 50
    ops = [[i for i in grp if g.nodes[i].kind == "op"] for grp in groups]
    flat = [i for grp in ops for i in grp]
    assert flat == sorted(flat)  # consecutive runs of the topological order


def test_merged_graph_keeps_work_bytes_and_seconds(case):
    g, _, costs = case
    co = coarsen(g, costs, target=50)
    small = co.graph
    assert sum(n.fwd_flops for n in small.nodes) == sum(n.fwd_flops for n in g.nodes)
    assert sum(n.bwd_flops for n in small.nodes) == sum(n.bwd_flops for n in g.nodes)
    assert small.param_bytes == g.param_bytes
    ops, s_ops = [i for i, n in enumerate(g.nodes) if n.kind == "op"], \
        [i for i, n in enumerate(small.nodes) if n.kind == "op"]
    for f in (1.0, 0.5, 0.25, 0.125):
        for fn in ("fwd_s", "bwd_s"):
            full = sum(getattr(costs, fn)(i, "H100:0", f) for i in ops)
            merged = sum(getattr(co.costs, fn)(i, "H100:0", f) for i in s_ops)
            assert merged == pytest.approx(full, rel=1e-9)


def test_the_same_plan_predicts_about_the_same_on_both(case):
    g, cl, costs = case
    co = coarsen(g, costs, target=50)
    for alg in ("single", "data-parallel", "even-layers"):
        small_plan = ex.partition(co.graph, cl, co.costs, alg)
        plan = co.expand(small_plan, g)
        plan.validate(g, cl)
        for name, m in co.of.items():
            assert plan.placement[name] == small_plan.placement[m]
        a = ex.simulate(g, plan, costs)
        b = ex.simulate(co.graph, small_plan, co.costs)
        # merging hides overlap inside a run (slower), counts one optimizer tensor per run's
        # parameters (a little faster): close for these plans
        assert b.step_s >= a.step_s * 0.97
        assert b.step_s == pytest.approx(a.step_s, rel=0.25)
        assert b.transfer_bytes == a.transfer_bytes if alg != "even-layers" else True
        assert max(b.peak_bytes.values()) == pytest.approx(max(a.peak_bytes.values()),
                                                           rel=0.1)


def test_pins_map_to_groups_and_conflicts_are_refused(case):
    g, _, costs = case
    co = coarsen(g, costs, target=50)
    ops = [n.name for n in g.nodes if n.kind == "op"]
    a, b = ops[0], ops[1]
    assert co.of[a] == co.of[b]
    assert co.pins({a: "H100:1"}) == {co.of[a]: "H100:1"}
    assert co.pins({a: "H100:1", b: "H100:2"}) is None


def test_wap_sweeps_a_large_graph_on_the_stand_in(case):
    g, cl, costs = case
    res = wap_sweep(g, cl, costs, algorithms=("data-parallel", "even-layers"),
                    coarse_above=100)
    chosen = res.chosen
    assert chosen.simulated_on == "ops" and chosen.plan is not None
    chosen.plan.validate(g, cl)
    assert ex.simulate(g, chosen.plan, costs).step_s == chosen.step_s
    others = [p for p in res.points if p.k != res.chosen_k]
    assert others and all(p.simulated_on.endswith("groups") and p.plan is None
                          for p in others)
    assert all(p.fits for p in res.points)
    assert "stand-in" in res.why
    # the registered partitioner returns a plan for the real graph, pins honoured
    pin = next(n.name for n in g.nodes if n.kind == "op")
    plan = ex.partition(g, cl, costs, "wap", algorithms=["data-parallel", "even-layers"],
                        coarse_above=100, pins={pin: cl.ids[-1]}, objective="throughput")
    plan.validate(g, cl)
    assert cl.ids[-1] in plan.stages[plan.placement[pin]]


def test_small_graphs_and_coarse_above_none_sweep_the_real_graph(case):
    g, cl, costs = case
    res = wap_sweep(g, cl, costs, algorithms=("data-parallel",), coarse_above=None)
    assert all(p.simulated_on == "ops" and p.plan is not None for p in res.points)
