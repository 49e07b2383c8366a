"""min-comm: balanced parts, acyclic stage graph, less communication than even layers."""

from __future__ import annotations

import random

import networkx as nx
import pytest
from brute import tiny_case
from builders import cluster, costs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph, OpNode
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition import partition
from explorer.partition.mincomm import (
    cut_seconds,
    min_comm_parts,
    net_weights_s,
    node_weights_s,
)
from explorer.simulate.simulator import simulate


def stage_graph(g: OpGraph, stage_of) -> nx.DiGraph:
    """Stages as nodes, an edge wherever a tensor goes from one stage to another (inputs
    are loaded by every rank, so they link nothing)."""
    q = nx.DiGraph()
    q.add_nodes_from(set(stage_of))
    for p, c, _ in g.edges:
        if g.nodes[p].kind != "input" and stage_of[p] != stage_of[c]:
            q.add_edge(stage_of[p], stage_of[c])
    return q


class TestCutSeconds:
    def test_counts_each_tensor_once_per_other_part(self):
        g = OpGraph("fan", [
            OpNode("x", "input", "input", out_bytes=8),
            OpNode("a", "op", "t", inputs=("x",), out_bytes=100, requires_grad=False),
            OpNode("b", "op", "t", inputs=("a",), out_bytes=4),
            OpNode("c", "op", "t", inputs=("a",), out_bytes=4),
            OpNode("d", "op", "t", inputs=("a", "b", "c"), out_bytes=4)], 8)
        w = [0.0, 1.0, 0.0, 0.0, 0.0]
        assert cut_seconds(g, [0, 0, 0, 0, 0], w) == 0.0
        assert cut_seconds(g, [0, 0, 1, 1, 1], w) == 1.0  # a goes to part 1 once
        assert cut_seconds(g, [0, 0, 1, 2, 2], w) == 2.0
        assert cut_seconds(g, [1, 0, 0, 0, 0], w) == 0.0  # inputs are not sent

    def test_net_weights_are_transfer_seconds(self):
        g = OpGraph("pair", [
            OpNode("x", "input", "input", out_bytes=8),
            OpNode("a", "op", "t", inputs=("x",), out_bytes=100, requires_grad=True),
            OpNode("b", "op", "t", inputs=("a",), out_bytes=4, requires_grad=True)], 8)
        cl = cluster(2, latency_s=0.5, bandwidth=100.0)
        c = costs(g, cl, {"a": 1.0, "b": 1.0}, {})
        # per micro-batch: 0.5 s + 100 B / 100 B/s, there and (the gradient) back, M = 2
        assert net_weights_s(g, c, cl.ids, micro_batches=2)[1] == pytest.approx(
            2 * (2 * 0.5 + 1.0))
        assert net_weights_s(g, c, cl.ids)[0] == 0.0


class TestMinCommParts:
    @pytest.mark.parametrize(("n", "seed", "preset"), [
        (300, 0, "4xH100"), (1000, 1, "8xH100"), (2500, 2, "4xH100"), (6000, 3, "8xH100")])
    def test_balanced_acyclic_and_cheaper_than_even_layers(self, n, seed, preset):
        g = layered_dag(n, seed=seed)
        cl = Cluster.preset(preset)
        c = roofline_costs(g, cl)
        res = min_comm_parts(g, cl, c, micro_batches=4, tolerance=0.1)
        # balance, checked from scratch
        w = node_weights_s(g, c, cl.ids[0])
        load = [0.0] * len(cl)
        for i, p in enumerate(res.part):
            load[p] += w[i]
        share = sum(w) / len(cl)
        assert res.balanced
        assert all(0.9 * share * (1 - 1e-9) <= x <= 1.1 * share * (1 + 1e-9) for x in load)
        assert load == pytest.approx(list(res.compute_s))
        # the stage graph is acyclic, and parts are numbered in execution order
        q = stage_graph(g, res.part)
        assert nx.is_directed_acyclic_graph(q)
        assert all(a < b for a, b in q.edges)
        # communication: what it reports, and no more than even layers'
        nw = net_weights_s(g, c, cl.ids, 4)
        assert cut_seconds(g, res.part, nw) == pytest.approx(res.cut_s)
        even = partition(g, cl, c, "even-layers")
        assert res.cut_s <= cut_seconds(g, even.assignment(g), nw) * (1 + 1e-9)

    def test_tolerance_is_relaxed_when_an_op_is_too_big(self):
        g = OpGraph("lopsided", [OpNode("x", "input", "input", out_bytes=8)] + [
            OpNode(f"op{i}", "op", "t", f"m{i}", inputs=(f"op{i - 1}" if i else "x",),
                   out_bytes=64, requires_grad=True) for i in range(4)], 8)
        cl = cluster(2)
        c = costs(g, cl, {"op0": 10.0, "op1": 1.0, "op2": 1.0, "op3": 1.0}, {})
        res = min_comm_parts(g, cl, c, tolerance=0.1)
        assert not res.balanced
        assert sorted(res.compute_s) == pytest.approx([3.0, 10.0])
        plan = partition(g, cl, c, "min-comm", compare_baselines=False)
        assert any("tolerance" in note for note in plan.notes)

    def test_memory_splits_and_stays_within_capacity(self):
        g = layered_dag(300, seed=3)
        cl0 = cluster(4)
        peak = simulate(g, partition(g, cl0, roofline_costs(g, cl0), "single"),
                        roofline_costs(g, cl0)).peak_bytes["d:0"]
        cl = cluster(4, memory=int(0.35 * peak))
        c = roofline_costs(g, cl)
        plan = partition(g, cl, c, "min-comm")
        pred = simulate(g, plan, c)
        assert pred.fits, pred.memory_report()
        assert len(plan.stages) > 1

    def test_says_which_device_cannot_fit(self):
        g = layered_dag(200, seed=3)
        cl = cluster(2, memory=2**20)
        c = roofline_costs(g, cl)
        with pytest.raises(MemoryExceededError, match=r"device d:\d .*over by"):
            partition(g, cl, c, "min-comm")

    def test_pins_that_force_a_cycle_are_refused(self):
        g = OpGraph("chain", [OpNode("x", "input", "input", out_bytes=8)] + [
            OpNode(f"op{i}", "op", "t", f"m{i}", inputs=(f"op{i - 1}" if i else "x",),
                   out_bytes=64, requires_grad=True) for i in range(3)], 8)
        cl = cluster(2)
        c = costs(g, cl, {"op0": 1.0, "op1": 1.0, "op2": 1.0}, {})
        with pytest.raises(ExplorerError, match="cycle between devices d:0, d:1"):
            partition(g, cl, c, "min-comm", pins={"op0": "d:0", "op1": "d:1", "op2": "d:0"})
        # pins in execution order decide the order of the parts
        plan = partition(g, cl, c, "min-comm", pins={"op0": "d:1", "op2": "d:0"},
                         compare_baselines=False)
        assert plan.devices_of("op0") == ("d:1",) and plan.devices_of("op2") == ("d:0",)
        assert nx.is_directed_acyclic_graph(stage_graph(g, plan.assignment(g)))


class TestPlans:
    @pytest.mark.parametrize("seed", range(12))
    def test_tiny_graphs(self, seed):
        g, cl, c = tiny_case(seed, n_ops=random.Random(seed).randint(2, 7))
        plan = partition(g, cl, c, "min-comm")
        plan.validate(g, cl)
        pred = simulate(g, plan, c)
        assert pred.fits
        single = simulate(g, partition(g, cl, c, "single"), c).step_s
        dp = simulate(g, partition(g, cl, c, "data-parallel"), c).step_s
        assert pred.step_s <= min(single, dp) * (1 + 1e-9)

    def test_returns_the_fastest_candidate_and_says_when_it_is_a_baseline(self):
        # a chain without weights on a slow link: splitting it only adds transfers, while
        # replicas halve the work for free, so data-parallel wins
        g = OpGraph("chain", [OpNode("x", "input", "input", out_bytes=8)] + [
            OpNode(f"op{i}", "op", "t", f"m{i}", inputs=(f"op{i - 1}" if i else "x",),
                   out_bytes=64, requires_grad=True) for i in range(4)], 8)
        cl = cluster(2, latency_s=1.0)
        c = costs(g, cl, {f"op{i}": 1.0 for i in range(4)}, {f"op{i}": 2.0 for i in range(4)})
        steps = {name: simulate(g, partition(g, cl, c, name), c).step_s
                 for name in ("single", "data-parallel")}
        for m in (1, 4):
            own = partition(g, cl, c, "min-comm", micro_batches=m, compare_baselines=False)
            steps[f"own{m}"] = simulate(g, own, c).step_s
        plan = partition(g, cl, c, "min-comm")
        assert simulate(g, plan, c).step_s == pytest.approx(min(steps.values()))
        assert plan.algorithm == "min-comm"
        assert plan.options["fallback"] == "data-parallel"
        assert "data-parallel is faster" in plan.notes[-1]


@st.composite
def pinned_dags(draw):
    n = draw(st.integers(20, 300))
    g = layered_dag(n, width=draw(st.integers(2, 12)), fan_in=draw(st.integers(1, 3)),
                    seed=draw(st.integers(0, 10**6)))
    names = draw(st.lists(st.sampled_from([nd.name for nd in g.nodes if nd.kind != "input"]),
                          max_size=4, unique=True))
    devs = draw(st.lists(st.integers(0, 3), min_size=len(names), max_size=len(names)))
    return g, {nm: f"H100:{d}" for nm, d in zip(names, devs, strict=True)}


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pinned_dags())
def test_random_dags_valid_pinned_acyclic_deterministic(case):
    g, pins = case
    cl = Cluster.preset("4xH100")
    c = roofline_costs(g, cl)
    try:
        plan = partition(g, cl, c, "min-comm", pins=pins, compare_baselines=False)
    except ExplorerError as exc:  # only when the pins themselves chain devices in a cycle
        assert "cycle" in str(exc)
        return
    plan.validate(g, cl)
    for nm, dev in pins.items():
        assert plan.devices_of(nm) == (dev,)
    assert nx.is_directed_acyclic_graph(stage_graph(g, plan.assignment(g)))
    assert partition(g, cl, c, "min-comm", pins=pins, compare_baselines=False) == plan
