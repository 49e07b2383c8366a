"""pipeline-dp: the stage DP against brute force on random cost tables, and plans on graphs."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
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
from explorer.partition.pipeline_dp import (
    StageCostTable,
    StageNet,
    StageTables,
    solve_stages,
    stage_matrices,
)
from explorer.simulate.simulator import simulate


# -- random cost tables and an exhaustive search over them ---------------------------------
def random_table(seed: int) -> StageCostTable:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    n_dev = rng.randint(1, 4)
    n_types = rng.randint(1, 2)
    nets = []
    for a in range(n - 1):
        for _ in range(rng.randint(0, 2)):
            cons = sorted(rng.sample(range(a + 1, n), rng.randint(1, min(3, n - a - 1))))
            nets.append(StageNet(a, tuple(cons), rng.randint(1, 1000), rng.random() < 0.7,
                                 rng.random() < 0.8))
    pins: tuple[frozenset[int], ...] = ()
    if rng.random() < 0.4:
        pins = tuple(frozenset({rng.randrange(n_dev)}) if rng.random() < 0.3 else frozenset()
                     for _ in range(n))
    replicas = (tuple(sorted(rng.sample(range(1, n_dev + 1), rng.randint(1, n_dev))))
                if rng.random() < 0.7 else (1,))
    return StageCostTable(
        fixed_s=np.array([[rng.random() * 0.1 for _ in range(n)] for _ in range(n_types)]),
        var_s=np.array([[rng.random() for _ in range(n)] for _ in range(n_types)]),
        optimizer_s=np.array([[rng.random() * 0.1 for _ in range(n)] for _ in range(n_types)]),
        param_bytes=np.array([rng.randint(0, 100) for _ in range(n)], dtype=float),
        act_bytes=np.array([rng.randint(0, 100) for _ in range(n)], dtype=float),
        grad_bytes=np.array([rng.choice([0, rng.randint(1, 1000)]) for _ in range(n)],
                            dtype=float),
        nets=tuple(nets), device_type=tuple(rng.randrange(n_types) for _ in range(n_dev)),
        capacity_bytes=tuple(rng.uniform(50, 400) for _ in range(n_dev)),
        link_latency_s=tuple(rng.random() * 0.01 for _ in range(n_dev - 1)),
        link_s_per_byte=tuple(rng.random() * 1e-3 for _ in range(n_dev - 1)),
        allreduce_latency_s=np.array([[rng.random() * 0.1 for _ in range(n_dev + 1)]
                                      for _ in range(n_dev)]),
        allreduce_s_per_byte=np.array([[rng.random() * 1e-3 for _ in range(n_dev + 1)]
                                       for _ in range(n_dev)]),
        micro_batches=rng.choice([1, 2, 4]), schedule=rng.choice(["gpipe", "1f1b"]),
        replicas=replicas, layer_pins=pins, pins_by_position=rng.random() < 0.5)


def brute_force(table: StageCostTable) -> float:
    """The best score over every cut of the layers and every replica count per stage."""
    n, n_dev = table.n_layers, table.n_devices
    best = math.inf
    for s_count in range(1, min(n, n_dev) + 1):
        for cuts in itertools.combinations(range(1, n), s_count - 1):
            bounds = (0, *cuts, n)
            for reps in itertools.product(range(1, n_dev + 1), repeat=s_count):
                if sum(reps) > n_dev:
                    continue
                stages, d = [], 0
                for s in range(s_count):
                    stages.append((bounds[s], bounds[s + 1], d, reps[s]))
                    d += reps[s]
                best = min(best, table.score(stages))
    return best


def uniform_table(var: list[float], n_dev: int, **kw) -> StageCostTable:
    n = len(var)
    base = dict(
        fixed_s=np.zeros((1, n)), var_s=np.array([var], dtype=float),
        optimizer_s=np.zeros((1, n)), param_bytes=np.zeros(n), act_bytes=np.zeros(n),
        grad_bytes=np.zeros(n), nets=(), device_type=(0,) * n_dev,
        capacity_bytes=(1e18,) * n_dev, link_latency_s=(0.0,) * (n_dev - 1),
        link_s_per_byte=(0.0,) * (n_dev - 1),
        allreduce_latency_s=np.zeros((n_dev, n_dev + 1)),
        allreduce_s_per_byte=np.zeros((n_dev, n_dev + 1)))
    base.update(kw)
    return StageCostTable(**base)


class TestSolveStages:
    def test_equals_brute_force_on_random_tables(self):
        feasible = 0
        for seed in range(300):
            table = random_table(seed)
            sol = solve_stages(table)
            expected = brute_force(table)
            if math.isinf(expected):
                assert not sol.feasible, seed
                continue
            feasible += 1
            assert sol.score_s == pytest.approx(expected, rel=1e-9), seed
            # and the stages it returns score what it says
            stages = [(s.first_layer, s.end_layer, s.first_device, s.replicas)
                      for s in sol.stages]
            assert table.score(stages) == pytest.approx(sol.score_s, rel=1e-9), seed
        assert feasible > 100  # the random tables exercise feasible cases, not just refusals

    def test_dense_tables_match_the_reference_cost_function(self):
        for seed in range(40):
            table = random_table(seed)
            tb = StageTables(table)
            n, n_dev = table.n_layers, table.n_devices
            for d in range(n_dev):
                for r in range(1, n_dev - d + 1):
                    time, _, _, _ = stage_matrices(table, tb, d, r)
                    for j0 in range(n):
                        for j1 in range(j0 + 1, n + 1):
                            want = table.stage_time_s(j0, j1, d, r)
                            assert time[j0, j1] == pytest.approx(want, rel=1e-9), (seed, d, r)

    def test_pipelining_pays_only_with_micro_batches(self):
        # four layers of 3 s: one stage takes 12 s; two stages 6 s each but the bubble costs
        # (M + 1) / M: 12 s with M = 1, 7.5 s with M = 4
        assert len(solve_stages(uniform_table([3] * 4, 2, micro_batches=1)).stages) == 1
        sol = solve_stages(uniform_table([3] * 4, 2, micro_batches=4))
        assert [(s.first_layer, s.end_layer) for s in sol.stages] == [(0, 2), (2, 4)]
        assert sol.bottleneck_s == pytest.approx(6.0)
        assert sol.score_s == pytest.approx(7.5)
        assert sol.best_by_stages_s == pytest.approx((12.0, 6.0))

    def test_replicas_split_the_batch(self):
        sol = solve_stages(uniform_table([3] * 4, 2, micro_batches=4, replicas=(1, 2)))
        assert [(s.first_layer, s.end_layer, s.replicas) for s in sol.stages] == [(0, 4, 2)]
        assert sol.score_s == pytest.approx(6.0)

    def test_allreduce_makes_replicas_pay(self):
        ar = np.zeros((2, 3))
        ar[0, 2] = 10.0  # a 10 s all-reduce when both devices replicate
        sol = solve_stages(uniform_table([3] * 4, 2, micro_batches=4, replicas=(1, 2),
                                         grad_bytes=np.ones(4), allreduce_latency_s=ar))
        assert [s.replicas for s in sol.stages] == [1, 1]

    def test_the_slowest_layer_bounds_the_bottleneck(self):
        # three stages: [1] [9] [1 1 1], bottleneck 9; two: [1 9] [1 1 1], bottleneck 10
        sol = solve_stages(uniform_table([1, 9, 1, 1, 1], 3, micro_batches=16))
        assert sol.best_by_stages_s == pytest.approx((13.0, 10.0, 9.0))
        assert len(sol.stages) == 3 and sol.bottleneck_s == pytest.approx(9.0)
        # with fewer micro-batches the bubble of the third stage is not worth it:
        # 9 x (8 + 2) / 8 = 11.25 ties 10 x (8 + 1) / 8, and fewer stages win ties
        assert len(solve_stages(uniform_table([1, 9, 1, 1, 1], 3, micro_batches=8)).stages) == 2

    def test_1f1b_keeps_fewer_micro_batches_than_gpipe(self):
        kw = dict(micro_batches=4, act_bytes=np.array([100.0, 100.0]),
                  capacity_bytes=(90.0, 90.0))
        assert not solve_stages(uniform_table([1, 1], 2, schedule="gpipe", **kw)).feasible
        sol = solve_stages(uniform_table([1, 1], 2, schedule="1f1b", **kw))
        # one stage keeps one micro-batch of four in flight: 200 B / 4
        assert sol.feasible and sol.stages[0].memory_bytes == pytest.approx(50.0)

    def test_memory_forces_more_stages(self):
        table = uniform_table([1] * 4, 4, micro_batches=1, param_bytes=np.full(4, 40.0),
                              capacity_bytes=(100.0,) * 4)
        sol = solve_stages(table)
        assert len(sol.stages) == 2
        assert all(s.memory_bytes <= s.capacity_bytes for s in sol.stages)

    def test_pins_by_position(self):
        pins = (frozenset(), frozenset(), frozenset({0}), frozenset())
        sol = solve_stages(uniform_table([3] * 4, 2, micro_batches=4, layer_pins=pins))
        stage_of_layer2 = next(s for s in sol.stages if s.first_layer <= 2 < s.end_layer)
        assert stage_of_layer2.first_device == 0

    def test_memory_objective_reports_the_closest_split(self):
        table = uniform_table([1] * 4, 2, micro_batches=1, param_bytes=np.full(4, 40.0),
                              capacity_bytes=(50.0, 50.0))
        assert not solve_stages(table).feasible
        closest = solve_stages(table, objective="memory")
        assert closest.score_s == pytest.approx(30.0)  # 80 B on a 50 B device


# -- plans on graphs ---------------------------------------------------------------------
def chain(n_ops: int, param_bytes: int = 0, out_bytes: int = 64, batch: int = 8) -> OpGraph:
    """x -> op0 -> ... with one module per op (so each op is a layer)."""
    nodes = [OpNode("x", "input", "input", out_bytes=8)]
    prev = "x"
    for i in range(n_ops):
        inputs = [prev]
        if param_bytes:
            nodes.append(OpNode(f"w{i}", "param", "param", f"m{i}", out_bytes=param_bytes,
                                param_bytes=param_bytes, requires_grad=True))
            inputs.append(f"w{i}")
        nodes.append(OpNode(f"op{i}", "op", "test.op", f"m{i}", inputs=tuple(inputs),
                            out_bytes=out_bytes, requires_grad=True))
        prev = f"op{i}"
    return OpGraph("chain", nodes, batch)


class TestPipelineDp:
    def test_two_stages_of_a_chain(self):
        g = chain(4)
        cl = cluster(2)
        c = costs(g, cl, {f"op{i}": 1.0 for i in range(4)}, {f"op{i}": 2.0 for i in range(4)})
        plan = partition(g, cl, c, "pipeline-dp", micro_batches=4, replicate=False,
                         compare_baselines=False)
        assert plan.stages == (("d:0",), ("d:1",))
        assert plan.options["stage_layers"] == [[0, 2], [2, 4]]
        assert [plan.stage_of(f"op{i}") for i in range(4)] == [0, 0, 1, 1]
        assert plan.micro_batches == 4 and plan.schedule == "1f1b"

    def test_replicated_when_that_is_faster(self):
        g = chain(4)
        cl = cluster(2)
        c = costs(g, cl, {f"op{i}": 1.0 for i in range(4)}, {f"op{i}": 2.0 for i in range(4)})
        plan = partition(g, cl, c, "pipeline-dp", compare_baselines=False)
        assert plan.stages == (("d:0", "d:1"),)

    def test_memory_forces_a_split(self):
        g = chain(4, param_bytes=100)
        # 4 x 100 B with Adam state (and a gradient accumulation makes anew): two ops per
        # device at most
        cl = cluster(2, memory=1100)
        c = costs(g, cl, {f"op{i}": 1.0 for i in range(4)}, {f"op{i}": 2.0 for i in range(4)})
        plan = partition(g, cl, c, "pipeline-dp", replicate=False)
        assert len(plan.stages) == 2
        pred = simulate(g, plan, c)
        assert pred.fits, pred.memory_report()

    def test_says_which_device_cannot_fit(self):
        g = chain(4, param_bytes=1000)
        cl = cluster(2, memory=1000)
        c = costs(g, cl, {f"op{i}": 1.0 for i in range(4)}, {})
        with pytest.raises(MemoryExceededError, match=r"device d:\d.*over by"):
            partition(g, cl, c, "pipeline-dp")

    def test_contiguous_stages_on_consecutive_devices(self):
        g = layered_dag(400, seed=1)
        cl = Cluster.preset("4xH100")
        c = roofline_costs(g, cl)
        plan = partition(g, cl, c, "pipeline-dp", micro_batches=4, compare_baselines=False)
        flat = [d for s in plan.stages for d in s]
        assert flat == list(cl.ids[:len(flat)])
        stage_seq = [plan.stage_of(g.nodes[layer[-1]].name)
                     for layer in g.layers(plan.options["depth"])]
        assert stage_seq == sorted(stage_seq)
        assert len(plan.options["stage_layers"]) == len(plan.stages)

    def test_coarsens_by_module_depth_when_there_are_too_many_layers(self):
        g = layered_dag(300)
        cl = Cluster.preset("4xH100")
        c = roofline_costs(g, cl)
        plan = partition(g, cl, c, "pipeline-dp", max_layers=5, compare_baselines=False)
        assert plan.options["depth"] == 1 and plan.options["layers"] == 3

    def test_refuses_too_many_layers(self):
        g = layered_dag(300)
        cl = Cluster.preset("4xH100")
        c = roofline_costs(g, cl)
        with pytest.raises(ExplorerError, match="too many for the stage DP"):
            partition(g, cl, c, "pipeline-dp", depth=2, max_layers=50)
        with pytest.raises(ExplorerError, match="every module depth"):
            partition(g, cl, c, "pipeline-dp", max_layers=2)

    @pytest.mark.parametrize("seed", range(12))
    def test_tiny_graphs(self, seed):
        g, cl, c = tiny_case(seed, n_ops=random.Random(seed).randint(2, 7))
        plan = partition(g, cl, c, "pipeline-dp")
        plan.validate(g, cl)
        pred = simulate(g, plan, c)
        assert pred.fits
        single = simulate(g, partition(g, cl, c, "single"), c).step_s
        dp = simulate(g, partition(g, cl, c, "data-parallel"), c).step_s
        assert pred.step_s <= min(single, dp) * (1 + 1e-9)
        assert partition(g, cl, c, "pipeline-dp") == plan

    def test_pins_on_different_devices(self):
        g = layered_dag(200, seed=4)
        cl = Cluster.preset("2xH100+2xT4")  # not identical devices: pins are positions
        c = roofline_costs(g, cl)
        pins = {"op10": "T4:0", "op150": "T4:1"}
        plan = partition(g, cl, c, "pipeline-dp", pins=pins, compare_baselines=False)
        for nm, dev in pins.items():
            assert dev in plan.devices_of(nm)

    def test_pins_no_split_can_honour(self):
        g = chain(3)
        cl = cluster(2)
        c = costs(g, cl, {"op0": 1, "op1": 1, "op2": 1}, {})
        # op0 and op2 on d:0 but op1 on d:1: contiguous stages cannot do that
        pins = {"op0": "d:0", "op1": "d:1", "op2": "d:0"}
        with pytest.raises(ExplorerError, match="pins"):
            partition(g, cl, c, "pipeline-dp", pins=pins, replicate=False,
                      compare_baselines=False)
        # with replicas one stage on both devices honours them
        plan = partition(g, cl, c, "pipeline-dp", pins=pins, compare_baselines=False)
        assert plan.stages == (("d:0", "d:1"),)
        # and the guard falls back to a baseline that honours them, saying so
        plan = partition(g, cl, c, "pipeline-dp", pins=pins, replicate=False)
        assert plan.options["fallback"] == "data-parallel"
        assert any("found no split" in note for note in plan.notes)


@st.composite
def pinned_dags(draw):
    n = draw(st.integers(20, 250))
    g = layered_dag(n, width=draw(st.integers(2, 10)), seed=draw(st.integers(0, 10**6)))
    layers = g.layers(None)
    layer_of = {i: j for j, layer in enumerate(layers) for i in layer}
    names = draw(st.lists(st.sampled_from([nd.name for nd in g.nodes if nd.kind != "input"]),
                          max_size=3, unique=True))
    devs = sorted(draw(st.lists(st.integers(0, 3), min_size=len(names), max_size=len(names))))
    # pins in layer order on non-decreasing devices: a contiguous split can honour them
    names.sort(key=lambda nm: layer_of[g.index[nm]])
    return g, {nm: f"H100:{d}" for nm, d in zip(names, devs, strict=True)}


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(pinned_dags())
def test_random_dags_valid_pinned_deterministic(case):
    g, pins = case
    cl = Cluster.preset("4xH100")
    c = roofline_costs(g, cl)
    plan = partition(g, cl, c, "pipeline-dp", pins=pins, compare_baselines=False)
    plan.validate(g, cl)
    for nm, dev in pins.items():
        assert dev in plan.devices_of(nm)
    assert partition(g, cl, c, "pipeline-dp", pins=pins, compare_baselines=False) == plan
