"""Baseline partitioners and the registry: one device, data parallel, contiguous stages, pins."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from builders import cluster, costs, graph
from torch import nn

import explorer as ex
from explorer.core.errors import ExplorerError, PlanError, UnknownNameError
from explorer.partition import algorithm, algorithms, partition
from explorer.partition.search.layers import contiguous

BASELINES = ["single", "data-parallel", "even-layers", "balanced-params"]
STAGED = ["even-layers", "balanced-params"]


@pytest.fixture(scope="module")
def tiny() -> dict[str, ex.OpGraph]:
    out = {}
    for name in ("mlp", "gpt", "resnet", "inception"):
        bm = ex.builtin_model(name, "tiny")
        out[name] = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    return out


def _run(g: ex.OpGraph, n: int, name: str, **kw) -> ex.Plan:
    cl = cluster(n)
    return partition(g, cl, costs(g, cl, {}, {}), name, **kw)


def _stage_params(g: ex.OpGraph, plan: ex.Plan) -> list[int]:
    out = [0] * len(plan.stages)
    for n in g.nodes:
        if n.kind == "param":
            out[plan.stage_of(n.name)] += n.param_bytes
    return out


class TestSingle:
    def test_first_device_by_default(self, tiny):
        g = tiny["mlp"]
        plan = _run(g, 3, "single")
        assert plan.stages == (("d:0",),)
        assert set(plan.assignment(g)) == {0}
        assert (plan.algorithm, plan.options) == ("single", {"device": "d:0"})

    def test_chosen_device_and_optimizer(self, tiny):
        plan = _run(tiny["mlp"], 3, "single", device="d:2", optimizer="sgd")
        assert plan.stages == (("d:2",),)
        assert plan.optimizer == "sgd"

    def test_unknown_device(self, tiny):
        with pytest.raises(UnknownNameError, match="unknown device 'd:9'; choose one of: d:0"):
            _run(tiny["mlp"], 2, "single", device="d:9")


class TestDataParallel:
    def test_one_stage_with_every_device(self, tiny):
        g = tiny["mlp"]
        plan = _run(g, 3, "data-parallel")
        assert plan.stages == (("d:0", "d:1", "d:2"),)
        assert set(plan.assignment(g)) == {0}
        assert plan.data_parallel == 3

    def test_k_devices(self, tiny):
        plan = _run(tiny["mlp"], 3, "data-parallel", k=2)
        assert plan.stages == (("d:0", "d:1"),)
        assert plan.options == {"k": 2}

    def test_gradient_accumulation_runs_micro_batches_one_after_another(self, tiny):
        g = tiny["gpt"]
        cl = ex.Cluster.preset("2xH100")
        cm = ex.profile(g, cl)
        plain = partition(g, cl, cm, "data-parallel")
        accumulating = partition(g, cl, cm, "data-parallel", micro_batches=2)
        assert (plain.micro_batches, plain.schedule) == (1, "gpipe")
        assert (accumulating.micro_batches, accumulating.schedule) == (2, "1f1b")
        assert partition(g, cl, cm, "data-parallel", micro_batches=2,
                         schedule="gpipe").schedule == "gpipe"
        held = [ex.simulate(g, p, cm).memory["H100:0"].activations_bytes
                for p in (plain, accumulating)]
        assert held[1] < held[0]  # one micro-batch's activations at a time

    @pytest.mark.parametrize("k", [0, 4])
    def test_bad_k(self, tiny, k):
        with pytest.raises(ExplorerError, match=rf"k={k} devices asked for, but the cluster "
                                                r"has 3"):
            _run(tiny["mlp"], 3, "data-parallel", k=k)


class TestContiguous:
    @pytest.mark.parametrize(("weights", "k", "expected"), [
        ([1, 1, 1, 1], 2, [0, 0, 1, 1]),
        ([3, 1, 1, 1], 2, [0, 1, 1, 1]),
        ([1, 1, 1, 1, 1, 1, 10], 2, [0, 0, 0, 0, 0, 0, 1]),
        ([100, 1, 1, 1], 4, [0, 1, 2, 3]),  # later stages must not stay empty
        ([1, 1, 1, 100], 4, [0, 1, 2, 3]),
        ([1, 1], 4, [0, 1]),  # fewer layers than stages
        ([0, 0, 0, 0], 2, [0, 0, 1, 1]),  # no weight at all: count layers
        ([1, 2, 3], 1, [0, 0, 0]),
        ([], 3, []),
    ])
    def test_by_hand(self, weights, k, expected):
        assert contiguous(weights, k) == expected


class TestStaged:
    @pytest.mark.parametrize("name", STAGED)
    @pytest.mark.parametrize("model", ["mlp", "gpt", "resnet", "inception"])
    @pytest.mark.parametrize("k", [2, 3, 4])
    def test_contiguous_acyclic_and_non_empty(self, tiny, name, model, k):
        g = tiny[model]
        plan = _run(g, k, name)
        stage = plan.assignment(g)
        assert len(g.layers()) >= k
        assert len(plan.stages) == k
        assert plan.stages == tuple((f"d:{s}",) for s in range(k))
        ops = [stage[i] for i, n in enumerate(g.nodes) if n.kind == "op"]
        assert ops == sorted(ops)  # contiguous runs of ops in topological order
        assert set(ops) == set(range(k))  # every stage runs something
        q = nx.DiGraph()
        q.add_nodes_from(range(k))
        q.add_edges_from((stage[p], stage[c]) for p, c, _ in g.edges if stage[p] != stage[c])
        assert nx.is_directed_acyclic_graph(q)
        assert all(layer_stages == 1 for layer_stages in
                   (len({stage[i] for i in layer}) for layer in g.layers()))

    @pytest.mark.parametrize("name", STAGED)
    def test_depth_keeps_modules_whole(self, tiny, name):
        g = tiny["gpt"]
        plan = _run(g, 2, name, depth=2)
        stage = plan.assignment(g)
        for layer in g.layers(depth=2):
            assert len({stage[i] for i in layer}) == 1
        blocks = {stage[i] for i, n in enumerate(g.nodes)
                  if n.kind == "op" and n.module_path.startswith("blocks.1")}
        assert len(blocks) == 1
        assert plan.options == {"k": 2, "depth": 2}

    @pytest.mark.parametrize("name", STAGED)
    def test_settings_pass_through(self, tiny, name):
        plan = _run(tiny["mlp"], 2, name, micro_batches=4, schedule="1f1b", optimizer="sgd")
        assert (plan.micro_batches, plan.schedule, plan.optimizer) == (4, "1f1b", "sgd")
        assert plan.algorithm == name

    @pytest.mark.parametrize("name", STAGED)
    def test_fewer_layers_than_devices(self, chain3, name):
        plan = _run(chain3, 3, name)  # every op of chain3 is in the root module: one layer
        assert plan.stages == (("d:0",),)

    def test_balanced_params_balances_a_huge_layer(self):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU())],
                              nn.Linear(64, 4096))
        g = ex.capture(model, torch.randn(8, 64))
        huge = (64 * 4096 + 4096) * 4
        small = (64 * 64 + 64) * 4
        even = _stage_params(g, _run(g, 2, "even-layers"))
        balanced = _stage_params(g, _run(g, 2, "balanced-params"))
        # ten layers (nine modules and the loss), five per stage: linears 0-2 | 3, 4, loss
        assert even == [3 * small, small + huge]
        assert balanced == [4 * small, huge]  # the huge layer alone
        assert max(balanced) < max(even)


class TestPins:
    def test_pinned_node_moves(self, tiny):
        g = tiny["mlp"]
        plan = _run(g, 2, "even-layers", pins={"linear": "d:1"})
        assert plan.stage_of("linear") == 1
        assert plan.pinned == {"linear"}
        assert plan.stage_of("linear_1") == 0  # the rest as even-layers put it

    def test_pin_to_a_device_the_plan_lacks_adds_a_stage(self, tiny):
        g = tiny["mlp"]
        plan = _run(g, 2, "single", pins={"linear_2": "d:1"})
        assert plan.stages == (("d:0",), ("d:1",))
        assert plan.stage_of("linear_2") == 1
        assert plan.stage_of("linear") == 0

    def test_unknown_node(self, tiny):
        with pytest.raises(ExplorerError, match="pinned node 'nope' is not in the graph"):
            _run(tiny["mlp"], 2, "single", pins={"nope": "d:1"})

    def test_unknown_device(self, tiny):
        with pytest.raises(UnknownNameError,
                           match="unknown device 'x:9'; choose one of: d:0, d:1"):
            _run(tiny["mlp"], 2, "single", pins={"linear": "x:9"})


class TestRegistry:
    def test_baselines_registered(self):
        assert set(BASELINES) <= set(algorithms())
        assert algorithms() == sorted(algorithms())
        assert all(algorithm(n).summary for n in BASELINES)

    def test_options_with_defaults(self):
        assert algorithm("even-layers").options == {
            "k": None, "depth": None, "micro_batches": 1, "schedule": None,
            "optimizer": "adam", "virtual_stages": 1}
        assert algorithm("single").options == {"device": None, "optimizer": "adam"}

    def test_unknown_algorithm_lists_the_names(self, chain3):
        with pytest.raises(UnknownNameError, match="unknown algorithm 'nope'; choose one of: ") \
                as err:
            _run(chain3, 1, "nope")
        assert all(n in str(err.value) for n in algorithms())

    def test_unknown_option_lists_the_options(self, chain3):
        with pytest.raises(ExplorerError, match="even-layers has no option 'bogus'; its options "
                                                "are k, depth, micro_batches, schedule, "
                                                "optimizer"):
            _run(chain3, 1, "even-layers", bogus=1)

    def test_bad_option_value(self, chain3):
        with pytest.raises(PlanError, match="micro_batches must be a whole number >= 1"):
            _run(chain3, 2, "even-layers", micro_batches=0)

    def test_costs_of_another_graph(self, chain3):
        other = graph([("x", "input", [], 100), ("a", "op", ["x"], 100)], name="other")
        cl = cluster(1)
        with pytest.raises(PlanError, match="profiled for graph"):
            partition(chain3, cl, costs(other, cl, {}, {}), "single")
