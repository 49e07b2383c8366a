"""Baechi's m-TOPO, m-ETF and m-SCT: brute force on tiny graphs, memory, pins, LP, scale."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import statistics
import time
from functools import cache

import numpy as np
import pytest
from brute import brute_force, tiny_case
from builders import cluster, costs, graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from explorer.core.errors import MemoryExceededError
from explorer.costs.memory import node_memory_bytes
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition import algorithm, partition
from explorer.partition.baechi import (
    coarse_groups,
    etf_placement,
    favourite_children,
    m_etf,
    m_sct,
    m_topo,
    topo_placement,
)
from explorer.partition.baselines import data_parallel, single
from explorer.partition.search.op_problem import op_problem
from explorer.simulate.simulator import simulate

ALGORITHMS = {"m-topo": m_topo, "m-etf": m_etf, "m-sct": m_sct}
NAMES = list(ALGORITHMS)
TINY = [(seed, 5, "2xT4") for seed in range(6)] + [(seed, 4, "3xT4") for seed in range(6)] \
    + [(seed, 6, "2xT4") for seed in range(2)]
CASE_ID = "{0[2]}-{0[1]}ops-seed{0[0]}".format


@cache
def optimum(seed: int, n_ops: int, devices: str) -> float:
    g, cl, c = tiny_case(seed, n_ops, devices)
    return brute_force(g, cl, c)[1].step_s


def check_valid(plan, g, cl, c):
    """Every node placed on a device of the cluster, and the simulator says it fits."""
    plan.validate(g, cl)
    assert set(plan.placement) == {n.name for n in g.nodes}
    pred = simulate(g, plan, c)
    assert pred.fits, pred.memory_report()
    return pred


class TestAgainstBruteForce:
    @pytest.mark.parametrize("name", NAMES)
    @pytest.mark.parametrize("case", TINY, ids=CASE_ID)
    def test_valid_and_never_worse_than_the_baselines(self, name, case):
        g, cl, c = tiny_case(*case)
        plan = ALGORITHMS[name](g, cl, c)
        assert plan.algorithm == name
        step = check_valid(plan, g, cl, c).step_s
        for base in (single(g, cl, c), data_parallel(g, cl, c)):
            pred = simulate(g, base, c)
            if pred.fits:
                assert step <= pred.step_s + 1e-9

    @pytest.mark.parametrize("name", NAMES)
    def test_own_placement_against_the_optimum(self, name):
        # without baselines the plan is an op placement: brute force bounds it from below.
        # measured mean gaps: m-ETF and m-SCT about 3 % (worst 7 %), m-TOPO about 21 % (63 %):
        # m-TOPO balances memory, not time
        gaps = []
        for case in TINY:
            g, cl, c = tiny_case(*case)
            plan = ALGORITHMS[name](g, cl, c, baselines=False)
            assert all(len(s) == 1 for s in plan.stages)
            step = check_valid(plan, g, cl, c).step_s
            assert step >= optimum(*case) - 1e-9
            gaps.append(step / optimum(*case) - 1)
        bound = {"m-topo": 0.5, "m-etf": 0.1, "m-sct": 0.1}[name]
        assert statistics.mean(gaps) < bound


def fork_join():
    g = graph([("x", "input", [], 10), ("s", "op", ["x"], 10), ("l", "op", ["s"], 10),
               ("r", "op", ["s"], 10), ("j", "op", ["l", "r"], 4)])
    times = {"s": 1.0, "l": 4.0, "r": 4.0, "j": 1.0}
    return g, times


class TestHandBuilt:
    @pytest.mark.parametrize("name", ["m-etf", "m-sct"])
    def test_parallel_branches_go_to_different_devices(self, name):
        g, t = fork_join()
        cl = cluster(2)
        c = costs(g, cl, t, t)
        plan = ALGORITHMS[name](g, cl, c, baselines=False)
        assert plan.devices_of("l") != plan.devices_of("r")
        assert simulate(g, plan, c).step_s == pytest.approx(12.0)

    def test_etf_keeps_a_branch_home_when_links_are_slow(self):
        g, t = fork_join()
        cl = cluster(2, latency_s=100.0)
        c = costs(g, cl, t, t)
        plan = m_etf(g, cl, c, baselines=False)
        assert len(plan.stages) == 1

    def test_topo_fills_the_first_device_to_its_share(self):
        # four equal ops of 100 saved bytes each, two devices: two ops each, in order
        g = graph([("x", "input", [], 0), ("a", "op", ["x"], 100), ("b", "op", ["a"], 100),
                   ("c", "op", ["b"], 100), ("d", "op", ["c"], 100, 0, ["a", "b", "c", "d"])])
        cl = cluster(2)
        c = costs(g, cl, dict.fromkeys("abcd", 1.0), dict.fromkeys("abcd", 1.0))
        p = op_problem(g, cl, c, cl.ids)
        dev, _ = topo_placement(p)
        names = [p.unit_names[u] for u in range(p.n)]
        assert dict(zip(names, dev.tolist(), strict=True)) == {"a": 0, "b": 0, "c": 1, "d": 1}

    def test_favourite_children_are_unique_both_ways(self):
        g = layered_dag(300, width=5, seed=4)
        cl = Cluster.preset("4xH100")
        p = op_problem(g, cl, roofline_costs(g, cl), cl.ids)
        parent, note = favourite_children(p)
        assert "LP over" in note
        chosen = [a for a in parent if a >= 0]
        assert len(chosen) == len(set(chosen)) > 0  # no op has two favourite children
        edges = set(zip(p.src.tolist(), p.dst.tolist(), strict=True))
        assert all((a, b) in edges for b, a in enumerate(parent) if a >= 0)

    def test_a_chain_is_all_favourites(self):
        g = graph([("x", "input", [], 100), ("a", "op", ["x"], 100), ("b", "op", ["a"], 100),
                   ("c", "op", ["b"], 4)])
        cl = cluster(3, latency_s=0.5, bandwidth=100.0)
        c = costs(g, cl, {"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 2.0, "b": 4.0, "c": 6.0})
        parent, _ = favourite_children(op_problem(g, cl, c, cl.ids))
        assert parent == [-1, 0, 1]

    def test_large_graphs_are_coarsened_into_acyclic_groups(self):
        g = layered_dag(3000, width=6, seed=1)
        cl = Cluster.preset("4xH100")
        p = op_problem(g, cl, roofline_costs(g, cl), cl.ids)
        group = coarse_groups(p, 50)
        assert group.max() + 1 <= 50
        assert np.all(group[p.src] <= group[p.dst])
        parent, note = favourite_children(p, lp_max_nodes=50)
        assert "coarse" in note or "groups" in note
        assert any(a >= 0 for a in parent)

    def test_etf_honours_favourite_parents(self):
        g = layered_dag(200, width=4, seed=7)
        cl = Cluster.preset("4xH100")
        p = op_problem(g, cl, roofline_costs(g, cl), cl.ids)
        parent, _ = favourite_children(p)
        dev, _ = etf_placement(p, parent, "m-sct")
        assert all(dev[b] == dev[a] for b, a in enumerate(parent) if a >= 0)


def _tight(g, n: int, fraction: float) -> Cluster:
    total = sum(node_memory_bytes(g))
    return cluster(n, latency_s=1e-5, bandwidth=1e10, memory=int(fraction * total))


class TestMemory:
    @pytest.mark.parametrize("name", NAMES)
    def test_fits_on_several_devices_when_one_cannot_hold_it(self, name):
        g = layered_dag(60, width=4, seed=1)
        cl = _tight(g, 3, 0.5)
        c = roofline_costs(g, cl)
        assert not simulate(g, single(g, cl, c), c).fits
        plan = ALGORITHMS[name](g, cl, c)
        check_valid(plan, g, cl, c)
        assert len(plan.stages) >= 2

    @pytest.mark.parametrize("name", NAMES)
    def test_fits_on_a_preset_with_less_memory(self, name):
        g = layered_dag(60, width=4, seed=3)
        total = sum(node_memory_bytes(g))
        t4 = Cluster.preset("4xT4")
        cl = dataclasses.replace(t4, devices=tuple(
            dataclasses.replace(d, memory_bytes=int(0.4 * total)) for d in t4.devices))
        c = roofline_costs(g, cl)
        check_valid(ALGORITHMS[name](g, cl, c), g, cl, c)

    @pytest.mark.parametrize("name", NAMES)
    def test_nothing_fits_names_the_devices(self, name):
        g = layered_dag(60, width=4, seed=1)
        cl = _tight(g, 3, 0.3)
        with pytest.raises(MemoryExceededError, match=r"d:0 .* MiB"):
            ALGORITHMS[name](g, cl, roofline_costs(g, cl))

    @pytest.mark.parametrize("name", NAMES)
    def test_pins_that_overfill_a_device_name_it(self, name):
        g = layered_dag(60, width=4, seed=1)
        cl = _tight(g, 3, 0.5)
        pins = {n.name: "d:1" for n in g.nodes if n.kind == "op"}
        with pytest.raises(MemoryExceededError, match=r"device d:1 .*over by"):
            ALGORITHMS[name](g, cl, roofline_costs(g, cl), pins=pins)

    @pytest.mark.parametrize("name", ["m-etf", "m-topo"])
    def test_an_op_too_big_for_any_device_is_named(self, name):
        g = graph([("x", "input", [], 10), ("w", "param", [], 1000), ("a", "op", ["x", "w"], 10),
                   ("b", "op", ["a"], 10)])
        cl = cluster(2, memory=3000)  # w needs 4000 bytes with gradient and Adam state
        c = costs(g, cl, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0})
        with pytest.raises(MemoryExceededError, match=r"node 'a'.*device d:0"):
            ALGORITHMS[name](g, cl, c)


@st.composite
def cases(draw):
    n = draw(st.integers(2, 40))
    g = layered_dag(n, width=draw(st.integers(1, 5)), fan_in=draw(st.integers(1, 3)),
                    seed=draw(st.integers(0, 10_000)))
    cl = Cluster.preset(draw(st.sampled_from(["2xT4", "3xT4", "4xH100"])))
    ops = [m.name for m in g.nodes if m.kind != "input"]
    pinned = draw(st.lists(st.sampled_from(ops), max_size=4, unique=True))
    pins = {nm: draw(st.sampled_from(cl.ids)) for nm in pinned}
    return g, cl, roofline_costs(g, cl), pins


class TestProperties:
    @pytest.mark.parametrize("name", NAMES)
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def test_valid_pinned_and_deterministic(self, name, case):
        g, cl, c, pins = case
        fn = ALGORITHMS[name]
        plan = fn(g, cl, c, pins=pins)
        check_valid(plan, g, cl, c)
        for nm, dev in pins.items():
            assert plan.devices_of(nm) == (dev,)
        again = fn(g, cl, c, pins=dict(pins))
        assert again.placement == plan.placement and again.stages == plan.stages

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases(), lp_max=st.integers(2, 30))
    def test_coarsened_lp_still_gives_valid_plans(self, case, lp_max):
        g, cl, c, pins = case
        plan = m_sct(g, cl, c, pins=pins, lp_max_nodes=lp_max, baselines=False)
        check_valid(plan, g, cl, c)
        assert all(plan.devices_of(nm) == (dev,) for nm, dev in pins.items())


class TestRegistry:
    @pytest.mark.parametrize("name", NAMES)
    def test_registered_with_options(self, name):
        alg = algorithm(name)
        assert alg.options["optimizer"] == "adam"
        assert "Baechi" in alg.summary
        if name == "m-sct":
            assert alg.options["lp_max_nodes"] == 2000

    @pytest.mark.parametrize("name", NAMES)
    def test_partition_honours_pins(self, name):
        g, cl, c = tiny_case(3, 5, "3xT4")
        plan = partition(g, cl, c, name, pins={"op1": cl.ids[2]})
        assert plan.devices_of("op1") == (cl.ids[2],)
        assert plan.options["simulate_max_nodes"] == 5000

    def test_docstring_examples_run(self):
        module = importlib.import_module("explorer.partition.baechi")
        assert doctest.testmod(module).failed == 0


class TestScale:
    def test_20k_nodes_in_seconds(self):
        g = layered_dag(20_000)
        cl = Cluster.preset("8xH100")
        c = roofline_costs(g, cl)
        for name, fn in ALGORITHMS.items():
            t0 = time.perf_counter()
            plan = fn(g, cl, c)
            elapsed = time.perf_counter() - t0
            plan.validate(g, cl)
            assert plan.algorithm == name
            assert elapsed < 30  # a generous bound, for loaded CI machines
