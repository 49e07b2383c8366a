"""PaSE: the dependent-set DP against brute force, its cost model, references, plans and limits."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from builders import cluster, costs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import explorer as ex
from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph, OpNode
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import roofline_costs
from explorer.partition import partition
from explorer.partition.pase import (
    TIE_S,
    Config,
    PaseProblem,
    dependent_order,
    layer_configs,
    missing_fraction,
    pase_problem,
    pase_search,
    solve,
    split_factors,
)
from explorer.simulate.simulator import simulate

MiB = 2**20
SHAPES = ("chain", "fork-join", "diamond", "random")


# -- layer graphs built by hand: one module (and one layer) per op --------------------------
def layer_graph(shape: str, n: int, seed: int = 0, batch: int = 8) -> OpGraph:
    """``n`` layers joined as a chain, a fork-join, diamonds or at random, with weights."""
    rng = random.Random(seed)
    preds: list[list[int]] = [[]]
    for k in range(1, n):
        if shape == "chain":
            preds.append([k - 1])
        elif shape == "fork-join":
            preds.append([0] if k < n - 1 else list(range(1, n - 1)) or [0])
        elif shape == "diamond":  # 0 -> (1, 2) -> 3 -> (4, 5) -> ...
            preds.append([k - 1 - (k - 1) % 2] if k % 3 else [k - 2, k - 1])
        else:
            preds.append(sorted(rng.sample(range(k), min(k, rng.randint(1, 3)))))
    nodes = [OpNode("x", "input", "input", shapes=((batch, 16),), out_bytes=batch * 64)]
    for k in range(n):
        inputs = [f"op{p}" for p in preds[k]] or ["x"]
        kind = rng.choice(["Linear", "Conv2d", "ReLU"])
        if kind != "ReLU":
            feat = rng.choice([2, 8, 64])
            pb = feat * rng.choice([16, 1024, 65536])
            nodes.append(OpNode(f"w{k}", "param", "param", f"l{k}", "", (),
                                ((feat, pb // feat // 4),), "float32", pb, pb, True))
            inputs.append(f"w{k}")
        flops = rng.choice([1, 100, 10_000]) * 10**6
        out = rng.choice([1, 16, 256]) * 4096
        op = "aten.linear.default" if kind == "Linear" else f"aten.{kind.lower()}.default"
        nodes.append(OpNode(f"op{k}", "op", op, f"l{k}", kind, tuple(inputs), ((out // 4,),),
                            "float32", out, 0, True, flops, 2 * flops,
                            (inputs[0],) if inputs[0] != "x" else ()))
    return OpGraph(f"{shape}{n}-{seed}", nodes, batch, "synthetic", f"op{n - 1}")


def layer_case(shape: str, n: int, seed: int, devices: str = "4xT4"):
    g = layer_graph(shape, n, seed)
    cl = Cluster.preset(devices)
    return g, cl, roofline_costs(g, cl)


def brute(problem: PaseProblem) -> tuple[float, tuple[int, ...]]:
    """The cheapest strategy that fits, over every configuration assignment."""
    best = (math.inf, ())
    for choice in itertools.product(*(range(k) for k in problem.sizes)):
        if problem.memory(choice) <= problem.capacity_bytes:
            best = min(best, (problem.cost_s(choice), choice))
    return best


def random_problem(seed: int, capacity: float = math.inf) -> PaseProblem:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    configs = tuple(tuple(Config(b, 1) for b in range(1, rng.randint(1, 4) + 1))
                    for _ in range(n))
    pairs = [(a, b) for b in range(n) for a in range(b) if rng.random() < 0.5]
    edges = tuple((a, b, np.array([[rng.choice([0.0, rng.random(), math.inf]) if
                                     rng.random() < 0.1 else rng.random()
                                     for _ in configs[b]] for _ in configs[a]]))
                  for a, b in pairs)
    return PaseProblem(configs, tuple(np.array([rng.random() for _ in c]) for c in configs),
                       tuple(np.array([float(rng.randint(0, 10)) for _ in c]) for c in configs),
                       edges, capacity)


# -- the DP -------------------------------------------------------------------------------
class TestSolve:
    @pytest.mark.parametrize("seed", range(60))
    def test_random_tables_match_brute_force(self, seed):
        problem = random_problem(seed)
        want, _ = brute(problem)
        if not math.isfinite(want):
            with pytest.raises(ExplorerError, match="no strategy"):
                solve(problem)
            return
        sol = solve(problem)
        assert sol.exact and sol.fits
        assert sol.cost_s == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert problem.cost_s(sol.choice) == pytest.approx(sol.cost_s)

    @pytest.mark.parametrize("seed", range(10))
    def test_any_order_gives_the_optimum(self, seed):
        problem = random_problem(seed + 100)
        want, _ = brute(problem)
        if not math.isfinite(want):
            return
        order = list(range(problem.n_layers))
        random.Random(seed).shuffle(order)
        assert solve(problem, order=order).cost_s == pytest.approx(want)

    @pytest.mark.parametrize("seed", range(30))
    def test_memory_bound_strategies_fit_and_are_never_better_than_brute_force(self, seed):
        problem = random_problem(seed + 200, capacity=random.Random(seed).uniform(5, 40))
        want, _ = brute(problem)
        if not math.isfinite(want):  # nothing fits, or nothing meets the constraints
            try:
                assert not solve(problem).fits
            except ExplorerError as exc:
                assert "no strategy" in str(exc)
            return
        sol = solve(problem)
        assert sol.fits and sol.memory_bytes <= problem.capacity_bytes
        assert sol.cost_s >= want - 1e-12
        if sol.exact:
            assert sol.cost_s == pytest.approx(want)

    def test_nothing_fits_returns_the_least_memory_strategy(self):
        p = PaseProblem(((Config(1, 1), Config(2, 1)),), (np.array([1.0, 2.0]),),
                        (np.array([10.0, 6.0]),), (), capacity_bytes=5.0)
        sol = solve(p)
        assert not sol.fits and sol.choice == (1,) and sol.memory_bytes == 6.0

    def test_hand_example(self):
        # a chain of three layers; switching configuration costs 5
        c = (Config(1, 1), Config(2, 1))
        switch = np.array([[0.0, 5.0], [5.0, 0.0]])
        p = PaseProblem((c, c, c), (np.array([4.0, 1.0]), np.array([1.0, 3.0]),
                                    np.array([4.0, 1.0])), (np.zeros(2),) * 3,
                        ((0, 1, switch), (1, 2, switch)))
        sol = solve(p)
        assert sol.choice == (1, 1, 1) and sol.cost_s == 5.0
        assert sol.dependent_set == 1

    def test_malformed_problems(self):
        with pytest.raises(ExplorerError, match="wrong shape"):
            PaseProblem(((Config(1, 1),), (Config(1, 1),)), (np.zeros(1),) * 2,
                        (np.zeros(1),) * 2, ((0, 1, np.zeros((2, 2))),))
        with pytest.raises(ExplorerError, match="no configuration"):
            PaseProblem(((),), (np.zeros(0),), (np.zeros(0),), ())


class TestDependentOrder:
    def _problem(self, n: int, pairs, k: int = 2) -> PaseProblem:
        c = tuple(Config(b, 1) for b in range(1, k + 1))
        return PaseProblem((c,) * n, (np.zeros(k),) * n, (np.zeros(k),) * n,
                           tuple((a, b, np.zeros((k, k))) for a, b in pairs))

    def test_chain_has_dependent_set_one(self):
        order, m, entries = dependent_order(self._problem(6, [(i, i + 1) for i in range(5)]))
        assert sorted(order) == list(range(6)) and m == 1 and entries == 4

    def test_fork_join_keeps_the_hub(self):
        # 0 -> 1..4 -> 5: visiting the hub 0, then each branch, needs {0, 5}-sized sets
        pairs = [(0, i) for i in range(1, 5)] + [(i, 5) for i in range(1, 5)]
        _, m, _ = dependent_order(self._problem(6, pairs))
        assert m == 2

    def test_clique_needs_everything(self):
        _, m, entries = dependent_order(self._problem(5, list(itertools.combinations(range(5),
                                                                                    2))))
        assert m == 4 and entries == 2**5

    def test_deterministic(self):
        p = self._problem(6, [(0, 2), (1, 2), (2, 5), (3, 4), (4, 5)])
        assert dependent_order(p) == dependent_order(p)


# -- the cost model on graphs ---------------------------------------------------------------
class TestCostModel:
    def test_split_factors_and_configs(self):
        assert split_factors(4) == (1, 2, 4)
        assert split_factors(3) == (1, 2, 3)
        assert layer_configs(4, 8, 1, 8) == (Config(4, 1), Config(1, 1), Config(2, 1))
        assert layer_configs(4, 6, 64, 8)[0] == Config(2, 1)  # 4 does not divide 6
        assert layer_configs(8, 8, 64, 3) == (Config(8, 1), Config(1, 8), Config(1, 1))
        assert all(c.devices <= 8 for c in layer_configs(8, 8, 64, 100))

    @pytest.mark.parametrize(("src", "dst", "frac"), [
        ((2, 1), (2, 1), 0.0), ((1, 1), (2, 1), 0.5), ((2, 1), (4, 1), 0.25),
        ((4, 1), (2, 1), 0.5), ((2, 2), (4, 1), 0.0), ((4, 1), (1, 4), 0.75),
        ((1, 4), (1, 1), 0.0), ((1, 1), (1, 4), 1.0)])
    def test_missing_fraction(self, src, dst, frac):
        assert missing_fraction(Config(*src), Config(*dst)) == pytest.approx(frac)

    def test_hand_computed_costs(self):
        # x -> linear (w: 10 x 100 floats) -> relu, on 4 devices over 1 GB/s links
        nodes = [OpNode("x", "input", "input", out_bytes=800),
                 OpNode("w", "param", "param", "fc", "", (), ((10, 100),), "float32", 4000,
                        4000, True),
                 OpNode("fc", "op", "aten.linear.default", "fc", "Linear", ("x", "w"),
                        out_bytes=800, requires_grad=True),
                 OpNode("act", "op", "aten.relu.default", "act", "ReLU", ("fc",),
                        out_bytes=800, requires_grad=True)]
        g = OpGraph("hand", nodes, 8)
        cl = cluster(4, latency_s=0.0, bandwidth=1e9)
        c = costs(g, cl, {"fc": 1.0, "act": 0.1}, {"fc": 2.0, "act": 0.2})
        p = pase_problem(g, c)
        assert p.configs[0] == (Config(4, 1), Config(1, 4), Config(1, 1), Config(2, 2),
                                Config(2, 1), Config(1, 2))
        assert p.configs[1] == (Config(4, 1), Config(1, 1), Config(2, 1))
        u = p.unary_s[0]
        ring4 = 2 * 3 / 4 / 1e9  # ring all-reduce seconds per byte on 4 devices
        # data parallel: compute / 4 + all-reduce of 4000 gradient bytes
        assert u[0] == pytest.approx(0.75 + ring4 * 4000 + 3 * TIE_S)
        # feature split: compute / 4 + all-gather of 800 output bytes (half a ring)
        assert u[1] == pytest.approx(0.75 + ring4 * 800 / 2 + 3 * TIE_S)
        assert u[2] == pytest.approx(3.0)
        # (2, 2): compute / 4, all-reduce 2000 B over 2, all-gather 400 B over 2
        ring2 = 2 * 1 / 2 / 1e9
        assert u[3] == pytest.approx(0.75 + ring2 * 2000 + ring2 * 400 / 2 + 3 * TIE_S)
        ((a, b, e),) = p.edges
        assert (a, b) == (0, 1)
        # (1, 4) -> (4, 1): outputs already everywhere; gradients gathered back: 3/4 of 800 B
        assert e[1, 0] == pytest.approx(0.75 * 800 / 1e9)
        # (4, 1) -> (1, 1): 3/4 gathered forward, the gradient scattered back (1/4 each)
        assert e[0, 1] == pytest.approx(0.75 * 800 / 1e9 + 0.25 * 800 / 1e9)
        assert e[0, 0] == 0.0 and e[2, 1] == 0.0
        # memory: params, grads and two Adam states over f, activations over b
        assert p.memory_bytes[0][1] == pytest.approx(4000 * 4 / 4 + 800 / 1)

    @pytest.mark.parametrize(("shape", "n", "seed"),
                             [(s, n, seed) for s in SHAPES for n in (2, 4, 6)
                              for seed in range(2)])
    def test_dp_matches_brute_force_on_layer_graphs(self, shape, n, seed):
        g, _, c = layer_case(shape, n, seed)
        problem = pase_problem(g, c, max_configs=4)
        assert max(problem.sizes) <= 4 and problem.n_layers == n
        want, _ = brute(problem)
        sol = solve(problem)
        assert sol.cost_s == pytest.approx(want, rel=1e-12)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(shape=st.sampled_from(SHAPES), n=st.integers(1, 6), seed=st.integers(0, 10**6),
           k=st.integers(1, 4), devices=st.sampled_from(["4xT4", "2xH100", "3xV100"]))
    def test_dp_matches_brute_force_hypothesis(self, shape, n, seed, k, devices):
        g, _, c = layer_case(shape, n, seed, devices)
        problem = pase_problem(g, c, max_configs=k)
        want, _ = brute(problem)
        assert solve(problem).cost_s == pytest.approx(want, rel=1e-12)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(shape=st.sampled_from(SHAPES), n=st.integers(1, 8), seed=st.integers(0, 10**6),
           k=st.integers(1, 8))
    def test_never_worse_than_data_parallel_or_one_weird_trick(self, shape, n, seed, k):
        g, _, c = layer_case(shape, n, seed)
        r = pase_search(g, c, max_configs=k)
        assert r.cost_s <= r.data_parallel_s * (1 + 1e-12)
        assert r.cost_s <= r.one_weird_trick_s * (1 + 1e-12)


# -- strategies and plans on graphs ---------------------------------------------------------
def wide_fc(n_fc: int = 2, weight_bytes: int = 64 * MiB, batch: int = 8,
            conv_first: bool = True, features: int = 1024) -> OpGraph:
    """A convolution with little weight, then fully connected layers with big weights."""
    nodes = [OpNode("x", "input", "input", out_bytes=batch * 4096)]
    prev = "x"
    if conv_first:
        nodes += [OpNode("wc", "param", "param", "conv", "", (), ((16, 27),), "float32", 1728,
                         1728, True),
                  OpNode("conv", "op", "aten.conv2d.default", "conv", "Conv2d", ("x", "wc"),
                         out_bytes=batch * 4096, requires_grad=True)]
        prev = "conv"
    for k in range(n_fc):
        nodes += [OpNode(f"w{k}", "param", "param", f"fc{k}", "", (),
                         ((features, weight_bytes // 4 // features),), "float32", weight_bytes,
                         weight_bytes, True),
                  OpNode(f"fc{k}", "op", "aten.linear.default", f"fc{k}", "Linear",
                         (prev, f"w{k}"), out_bytes=batch * 4096, requires_grad=True,
                         saves=(prev,))]
        prev = f"fc{k}"
    return OpGraph("wide-fc", nodes, batch, "synthetic", prev)


def fc_costs(g: OpGraph, cl: Cluster):
    ops = [n.name for n in g.nodes if n.kind == "op"]
    return costs(g, cl, dict.fromkeys(ops, 0.1), dict.fromkeys(ops, 0.2))


class TestStrategies:
    def test_feature_splits_win_for_big_fully_connected_layers(self):
        g = wide_fc()
        cl = cluster(4, latency_s=1e-5, bandwidth=1e9, memory=64 * 2**30)
        r = pase_search(g, fc_costs(g, cl))
        assert all(c == Config(1, 4) for c in r.configs[1:])  # split the big weights
        assert r.feature_split
        assert r.cost_s <= r.one_weird_trick_s < r.data_parallel_s - 0.15  # no 64 MiB rings
        d = r.to_dict()
        assert d["configs"][1:] == [[1, 4], [1, 4]]
        assert d["layers"] == ["conv", "fc0", "fc1"]

    def test_plan_when_feature_splits_win(self):
        g = wide_fc()
        cl = cluster(4, latency_s=1e-5, bandwidth=1e9, memory=64 * 2**30)
        c = fc_costs(g, cl)
        plan = partition(g, cl, c, "pase", compare_baselines=False)
        strat = plan.options["pase_strategy"]
        assert strat["configs"][1:] == [[1, 4], [1, 4]]
        assert strat["cost_s"] == pytest.approx(pase_search(g, c).cost_s)
        # a plan holds one tensor degree for a stage: the convolution cannot keep its batch
        # split beside the split linears, so the batch-only strategy simulates faster
        assert not plan.uses_tensor_parallel
        assert any("not expressed: 1 layers at another batch split than 1 (conv)" in n
                   and "best batch-only strategy" in n for n in plan.notes)
        assert plan.options["pase_cost_s"] >= strat["cost_s"]
        plan.validate(g, cl)
        assert ex.Plan.from_dict(plan.to_dict(), g, cl).options == plan.options

    def test_feature_splits_run_as_a_tensor_parallel_stage(self):
        g = wide_fc(conv_first=False)  # two big linears: column- then row-parallel
        cl = cluster(4, latency_s=1e-5, bandwidth=1e9, memory=64 * 2**30)
        c = fc_costs(g, cl)
        plan = partition(g, cl, c, "pase", compare_baselines=False)
        strat = plan.options["pase_strategy"]
        assert strat["configs"] == [[1, 4], [1, 4]]
        assert plan.stages == (("d:0", "d:1", "d:2", "d:3"),) and plan.tensor_of(0) == 4
        assert plan.options["degrees"] == "1x4x1"
        assert plan.options["pase_cost_s"] == strat["cost_s"]  # the whole strategy, as it is
        assert any("runs it as one stage of 1 replicas x tensor 4" in n
                   and "not expressed: nothing" in n for n in plan.notes)
        pred = ex.simulate(g, plan, c)
        assert pred.step_s == pytest.approx(strat["cost_s"], rel=0.01)
        batch_only = partition(g, cl, c, "data-parallel")
        assert pred.step_s < ex.simulate(g, batch_only, c).step_s
        assert ex.Plan.from_dict(plan.to_dict(), g, cl) == plan

    def test_feature_split_the_layout_cannot_express(self):
        # a lone linear has no row-parallel partner: the Megatron layout keeps it whole
        g = wide_fc(n_fc=1, conv_first=False)
        cl = cluster(4, latency_s=1e-5, bandwidth=1e9, memory=64 * 2**30)
        plan = partition(g, cl, fc_costs(g, cl), "pase", compare_baselines=False)
        assert plan.options["pase_strategy"]["configs"] == [[1, 4]]
        assert not plan.uses_tensor_parallel
        assert any("cannot be run as a tensor-parallel stage" in n for n in plan.notes)

    def test_batch_splits_map_onto_replicated_stages(self):
        g = wide_fc(n_fc=1, weight_bytes=4096)  # small weights: data parallelism wins
        cl = cluster(4, latency_s=0.0, bandwidth=1e12)
        plan = partition(g, cl, fc_costs(g, cl), "pase", compare_baselines=False)
        assert plan.stages == (("d:0", "d:1", "d:2", "d:3"),)
        assert "pase_strategy" not in plan.options
        assert plan.options["replicas"] == [4]

    def test_strategy_that_needs_too_many_devices_is_searched_again(self):
        # the convolution wants 4 replicas; the fully connected layer (one output feature, so
        # no feature split, and 256 MiB of weights to all-reduce) wants one device: 5 > 4
        g = wide_fc(n_fc=1, weight_bytes=256 * MiB, features=1)
        cl = cluster(4, latency_s=0.0, bandwidth=1e9, memory=64 * 2**30)
        c = fc_costs(g, cl)
        r = pase_search(g, c)
        assert r.configs == (Config(4, 1), Config(1, 1))
        plan = partition(g, cl, c, "pase", compare_baselines=False)
        assert any("searched again among the strategies a plan can express" in n
                   for n in plan.notes)
        assert plan.stages == (("d:0", "d:1"), ("d:2",))
        assert plan.options["replicas"] == [2, 1]
        assert plan.options["pase_cost_s"] > r.cost_s

    @pytest.mark.parametrize(("shape", "n", "seed"),
                             [(s, n, seed) for s in SHAPES for n in (3, 5) for seed in (0, 1)])
    def test_plan_is_the_best_strategy_a_plan_can_express(self, shape, n, seed):
        """Brute force over batch-only strategies whose runs of equal configurations, as
        stages on consecutive devices, need at most p devices."""
        g, cl, c = layer_case(shape, n, seed)
        problem = pase_problem(g, c, max_configs=100)
        batch = [[i for i, cf in enumerate(cs) if cf.feature == 1] for cs in problem.configs]
        want = math.inf
        for choice in itertools.product(*batch):
            cfg = [problem.configs[v][i] for v, i in enumerate(choice)]
            used = sum(cf.batch for j, cf in enumerate(cfg) if not j or cf != cfg[j - 1])
            if used <= len(cl):
                want = min(want, problem.cost_s(choice))
        plan = partition(g, cl, c, "pase", max_configs=100, compare_baselines=False)
        assert plan.options["pase_cost_s"] == pytest.approx(want, rel=1e-9, abs=1e-7)
        assert sum(len(s) for s in plan.stages) <= len(cl)

    def test_memory_bound_strategy_fits(self):
        g = wide_fc(n_fc=1, weight_bytes=64 * MiB, conv_first=False)
        # Adam: 4 x 64 MiB on one device; split 4 ways it fits in 100 MiB
        cl = cluster(4, latency_s=0.0, bandwidth=1e12, memory=100 * MiB)
        r = pase_search(g, fc_costs(g, cl))
        assert r.memory_bytes <= r.capacity_bytes
        assert r.configs[0].feature == 4
        # ... but no batch-only strategy (nor single, nor data-parallel) fits
        with pytest.raises(MemoryExceededError, match="batch-only strategy"):
            partition(g, cl, fc_costs(g, cl), "pase")

    def test_k_devices(self):
        g = wide_fc(n_fc=1, weight_bytes=4096)
        cl = cluster(4, latency_s=0.0, bandwidth=1e12)
        r = pase_search(g, fc_costs(g, cl), k=2)
        assert r.devices == ("d:0", "d:1") and all(c.devices <= 2 for c in r.configs)
        plan = partition(g, cl, fc_costs(g, cl), "pase", k=2)
        assert set(plan.devices) <= {"d:0", "d:1"}

    def test_nothing_fits_names_the_device(self):
        g = wide_fc(n_fc=1, weight_bytes=64 * MiB, conv_first=False)
        cl = cluster(2, memory=64 * MiB)
        with pytest.raises(MemoryExceededError, match=r"pase: device d:0 cannot hold"):
            pase_search(g, fc_costs(g, cl))
        with pytest.raises(MemoryExceededError, match="d:0"):
            partition(g, cl, fc_costs(g, cl), "pase")

    @staticmethod
    def dense(prefix: str) -> OpGraph:
        """Ten layers, each reading every earlier one: dependent sets of 9 layers."""
        nodes, ops = [], []
        for n in layer_graph("random", 10, seed=1).nodes:
            if n.kind == "op":
                n = OpNode(n.name, n.kind, n.op, prefix + n.module_path, n.module_type,
                           n.inputs + tuple(o for o in ops if o not in n.inputs), n.shapes,
                           n.dtype, n.out_bytes, n.param_bytes, n.requires_grad, n.fwd_flops,
                           n.bwd_flops, n.saves)
                ops.append(n.name)
            nodes.append(n)
        return OpGraph("dense", nodes, 8, "synthetic", ops[-1])

    def test_too_dense(self):
        cl = Cluster.preset("4xT4")
        flat = self.dense("")
        c = roofline_costs(flat, cl)
        with pytest.raises(ExplorerError, match=r"graph too dense for PaSE: dependent set of "
                                                r"9 layers needs [\d,]+ table entries"):
            pase_search(flat, c, max_table=1000)
        with pytest.raises(ExplorerError, match="graph too dense"):
            partition(flat, cl, c, "pase", max_table=1000)
        assert pase_search(flat, c, max_table=1000, max_configs=1).dependent_set == 9

    def test_too_dense_suggests_a_coarser_depth(self):
        cl = Cluster.preset("4xT4")
        nested = self.dense("blk.")
        c = roofline_costs(nested, cl)
        with pytest.raises(ExplorerError, match=r"use depth=1 .* or max_configs=1"):
            partition(nested, cl, c, "pase", depth=2, max_table=1000)
        # depth=None takes the finest depth that fits: here one module, one layer
        r = pase_search(nested, c, max_table=1000)
        assert r.depth == 1 and r.dependent_set == 0 and len(r.configs) == 1

    def test_one_device(self):
        g = wide_fc()
        cl = cluster(1)
        r = pase_search(g, fc_costs(g, cl))
        assert set(r.configs) == {Config(1, 1)} and r.cost_s == pytest.approx(0.9)
        assert partition(g, cl, fc_costs(g, cl), "pase").stages == (("d:0",),)

    def test_options_are_checked(self):
        g = wide_fc()
        cl = cluster(2)
        with pytest.raises(ExplorerError, match="max_configs"):
            pase_search(g, fc_costs(g, cl), max_configs=0)
        with pytest.raises(ExplorerError, match="k=3"):
            partition(g, cl, fc_costs(g, cl), "pase", k=3)
        with pytest.raises(ExplorerError, match="no option 'micro_batches'"):
            partition(g, cl, fc_costs(g, cl), "pase", micro_batches=2)


class TestPins:
    def test_pinned_layers_split_the_batch_only_and_hold_their_device(self):
        g = wide_fc()
        cl = cluster(4, latency_s=1e-5, bandwidth=1e9, memory=64 * 2**30)
        c = fc_costs(g, cl)
        r = pase_search(g, c, pins={"fc1": "d:2"})
        assert r.configs[2].feature == 1
        plan = partition(g, cl, c, "pase", pins={"fc1": "d:2"}, compare_baselines=False)
        assert "d:2" in plan.devices_of("fc1")
        assert plan.pinned == frozenset({"fc1"})
        assert plan.options.get("stage_layers")  # pase's own layout, not a patched one

    @pytest.mark.parametrize("dev", ["d:0", "d:3"])
    def test_pins_on_a_chain(self, dev):
        g, _, _ = layer_case("chain", 5, 3)
        cl = cluster(4, latency_s=1e-6, bandwidth=1e10)
        c = roofline_costs(g, cl)
        plan = partition(g, cl, c, "pase", pins={"op4": dev, "op0": "d:1"},
                         compare_baselines=False)
        assert dev in plan.devices_of("op4") and "d:1" in plan.devices_of("op0")
        assert len(plan.devices) == len(set(plan.devices))

    def test_unknown_pin_device(self):
        g = wide_fc()
        cl = cluster(4)
        with pytest.raises(ExplorerError, match="not among the devices"):
            partition(g, cl, fc_costs(g, cl), "pase", k=2, pins={"fc0": "d:3"})


# -- built-in models ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> dict[str, OpGraph]:
    out = {}
    for name in ex.model_names():
        bm = ex.builtin_model(name, "tiny")
        out[name] = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    return out


CLUSTERS = {"4xH100": lambda: Cluster.preset("4xH100"),
            "cpu2": lambda: Cluster.cpu(2, measure=False)}


class TestBuiltinModels:
    @pytest.mark.parametrize("where", list(CLUSTERS))
    def test_valid_plans_never_slower_than_baselines(self, tiny, where):
        cl = CLUSTERS[where]()
        for name, g in tiny.items():
            c = roofline_costs(g, cl)
            r = pase_search(g, c)
            assert r.cost_s <= min(r.data_parallel_s, r.one_weird_trick_s) * (1 + 1e-12), name
            assert r.dependent_set <= 4, name
            plan = partition(g, cl, c, "pase")
            plan.validate(g, cl)
            plan.check_batch(g.batch_size)
            assert plan.algorithm == "pase"
            pred = simulate(g, plan, c)
            assert pred.fits
            for base in ("single", "data-parallel"):
                other = simulate(g, partition(g, cl, c, base), c)
                assert pred.step_s <= other.step_s * (1 + 1e-9), (name, base)

    def test_deterministic(self, tiny):
        cl = Cluster.preset("4xH100")
        for name in ("gpt", "inception"):
            g = tiny[name]
            c = roofline_costs(g, cl)
            assert pase_search(g, c) == pase_search(g, c)
            a = partition(g, cl, c, "pase", compare_baselines=False)
            b = partition(g, cl, c, "pase", compare_baselines=False)
            assert a.to_dict() == b.to_dict()

    def test_registered(self):
        alg = ex.algorithm("pase")
        assert alg.exact
        assert alg.options["max_configs"] == 8 and alg.options["depth"] is None
