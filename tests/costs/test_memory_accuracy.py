"""Predicted peak memory per device against what real steps measure on CPU ranks.

On CPU the runtime measures memory by tensor accounting (the storages a rank holds or autograd
saved, counted in the order autograd holds them), so the simulator's liveness should give the
same peak per device: a few representative plans run for real and must agree within
``TOLERANCE``. A hand-built graph pins the gradient rule behind the GPT residual stream.

The runs take the op path (``runtime="ops"``), whose accounting sees every value and gradient
between ops as the simulator's liveness does; the segments' accounting does not see the
gradients flowing between a segment's own ops (:mod:`explorer.runtime.stage`), so it measures
less than a GPU's allocator would.
"""

from __future__ import annotations

import dataclasses

import pytest
from builders import cluster, costs

import explorer as ex
from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import Plan
from explorer.costs.memory import node_memory_bytes
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool
from explorer.simulate.simulator import simulate

TOLERANCE = 0.02


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's real runs."""
    with RankPool() as ranks:
        yield ranks


def _interleaved(graph: OpGraph) -> Plan:
    """Every other op on the other rank: an op-level placement with many stage crossings."""
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    return Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)],
                                {nm: k % 2 for k, nm in enumerate(ops)},
                                algorithm="interleaved")


CASES = {
    # the stage boundary that was over-predicted by 20 % (the backward's transient gradients)
    "gpt-even-layers": ("gpt", "small", "even-layers", {}),
    "gpt-1f1b": ("gpt", "tiny", "even-layers", {"micro_batches": 4, "schedule": "1f1b"}),
    # each replica holds its own rows of the batch, not the whole batch
    "alexnet-data-parallel": ("alexnet", "tiny", "data-parallel", {}),
    "resnet-op-level": ("resnet", "tiny", "interleaved", {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_predicted_peak_memory_matches_the_measured(case, pool):
    name, size, algorithm, options = CASES[case]
    bm = ex.builtin_model(name, size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    cl = ex.Cluster.cpu(2, measure=False)
    costs_ = roofline_costs(graph, cl)  # memory depends on the schedule's order, not on times
    if algorithm == "interleaved":
        plan = _interleaved(graph)
    else:
        plan = ex.partition(graph, cl, costs_, algorithm, **options)
    pred = simulate(graph, plan, costs_)
    meas = ex.run(graph, plan=plan, costs=costs_, steps=1, warmup=1, progress=False,
                  timeout_s=120, runtime="ops", pool=pool)
    assert meas.memory_source == "tensor accounting"
    for d in plan.devices:
        err = pred.peak_bytes[d] / meas.peak_bytes[d] - 1
        assert abs(err) <= TOLERANCE, (
            f"{case} {d}: predicted {pred.peak_bytes[d]} B ({pred.memory[d]}), measured "
            f"{meas.peak_bytes[d]} B: {err:+.1%}")


#: memory settings on the CNNs: (model, size, algorithm, settings). ResNet's full recomputation
#: on data-parallel was over-predicted by 10 % (a unit's values made again in its first
#: backward, not in the first that needs them), its bf16 by 70 % (batch norm's output taken as
#: fp32), Inception's recomputation under-predicted by 5 % (values a unit recomputes from,
#: dropped by their own unit)
STRATEGY_CASES = {
    "resnet-data-parallel-recompute-full": ("resnet", "small", "data-parallel",
                                            {"recompute": "full"}),
    "resnet-data-parallel-recompute-selective": ("resnet", "small", "data-parallel",
                                                 {"recompute": "selective"}),
    "resnet-even-layers-bf16": ("resnet", "small", "even-layers", {"precision": "bf16"}),
    "inception-single-recompute-full": ("inception", "small", "single", {"recompute": "full"}),
    "alexnet-data-parallel-recompute-full": ("alexnet", "small", "data-parallel",
                                             {"recompute": "full"}),
    "vgg16-even-layers-recompute-selective": ("vgg16", "small", "even-layers",
                                              {"recompute": "selective"}),
    # ZeRO under bf16: 2-byte weights (ZeRO 1-2 a working copy beside the fp32 master shard,
    # ZeRO 3 gathered from it); recomputation casts again what it recomputes
    "gpt-data-parallel-zero1-bf16": ("gpt", "small", "data-parallel",
                                     {"zero": 1, "precision": "bf16"}),
    "llama-data-parallel-zero2-bf16": ("llama", "small", "data-parallel",
                                       {"zero": 2, "precision": "bf16"}),
    "gpt-data-parallel-zero3-bf16": ("gpt", "small", "data-parallel",
                                     {"zero": 3, "precision": "bf16"}),
    "llama-data-parallel-zero3-bf16-recompute-full": ("llama", "small", "data-parallel",
                                                      {"zero": 3, "precision": "bf16",
                                                       "recompute": "full"}),
    "llama-even-layers-bf16-recompute-full": ("llama", "small", "even-layers",
                                              {"precision": "bf16", "recompute": "full"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STRATEGY_CASES))
def test_memory_settings_predict_the_measured_peak(case, pool):
    name, size, algorithm, settings = STRATEGY_CASES[case]
    bm = ex.builtin_model(name, size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    cl = ex.Cluster.cpu(2, measure=False)
    costs_ = roofline_costs(graph, cl)
    plan = ex.partition(graph, cl, costs_, algorithm).with_memory(**settings)
    pred = simulate(graph, plan, costs_)
    meas = ex.run(graph, plan=plan, costs=costs_, steps=1, warmup=1, progress=False,
                  timeout_s=120, runtime="ops", pool=pool)
    for d in plan.devices:
        err = pred.peak_bytes[d] / meas.peak_bytes[d] - 1
        assert abs(err) <= TOLERANCE, (
            f"{case} {d}: predicted {pred.peak_bytes[d]} B ({pred.memory[d]}), measured "
            f"{meas.peak_bytes[d]} B ({meas.peak_by_category[d]}): {err:+.1%}")


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [{"schedule": "1f1b"}, {"virtual_stages": 2}],
                         ids=["1f1b", "interleaved"])
def test_a_bf16_pipeline_casts_each_weight_once_a_step(pipeline, pool):
    """Eight micro-batches through a bf16 pipeline: one 2-byte copy of each weight a step,
    shared by the micro-batches in flight (a copy per micro-batch would put the first
    stage's peak 7-9 % higher). The last stage's bf16 logits are over-predicted by up to
    3 %, so every device is held to 3.5 % and the first stage to ``TOLERANCE``."""
    bm = ex.builtin_model("gpt", "small")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    cl = ex.Cluster.cpu(2, measure=False)
    costs_ = roofline_costs(graph, cl)
    plan = ex.partition(graph, cl, costs_, "even-layers", micro_batches=8,
                        **pipeline).with_memory(precision="bf16")
    pred = simulate(graph, plan, costs_)
    meas = ex.run(graph, plan=plan, costs=costs_, steps=1, warmup=1, progress=False,
                  timeout_s=120, runtime="ops", pool=pool)
    err = {d: pred.peak_bytes[d] / meas.peak_bytes[d] - 1 for d in plan.devices}
    assert abs(err["cpu:0"]) <= TOLERANCE and all(abs(e) <= 0.035 for e in err.values()), err


def _segment_costs(graph: OpGraph, cl: ex.Cluster):
    """Roofline costs as profiled for the segment runtime (memory depends on the order of a
    step's work, which the runtime sets, not on its times)."""
    ops_costs = roofline_costs(graph, cl)
    return dataclasses.replace(ops_costs, per_type={
        k: dataclasses.replace(v, runtime="segments") for k, v in ops_costs.per_type.items()})


@pytest.mark.slow
def test_a_segment_holds_the_gradients_it_receives_until_its_backward_ends(pool):
    """ResNet's even-layers cut falls inside a residual block: two values cross to the next
    stage. On the segment runtime the first stage receives both their gradients before its
    segment's one backward call and holds them until the call ends (the op path receives each
    just before its op's backward); predicted with costs of that runtime, its peak is what
    the run measures."""
    bm = ex.builtin_model("resnet", "small")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="resnet")
    cl = ex.Cluster.cpu(2, measure=False)
    ops_costs = roofline_costs(graph, cl)
    seg_costs = _segment_costs(graph, cl)
    plan = ex.partition(graph, cl, seg_costs, "even-layers")
    crossing = {p for n in graph.nodes if n.kind == "op" for p in n.inputs
                if graph.nodes[graph.index[p]].kind == "op"
                and plan.placement[p] == 0 and plan.placement[n.name] == 1}
    assert len(crossing) == 2
    pred = simulate(graph, plan, seg_costs)
    meas = ex.run(graph, plan=plan, costs=seg_costs, steps=1, warmup=1, progress=False,
                  timeout_s=120, runtime="segments", pool=pool)
    # (within the accuracy target: with this schedule's timing the gradients passed between
    # the segment's own ops overlap a little differently than the run's)
    for d in plan.devices:
        err = pred.peak_bytes[d] / meas.peak_bytes[d] - 1
        assert abs(err) <= 0.05, f"{d}: predicted {pred.memory[d]}, measured " \
            f"{meas.peak_by_category[d]}: {err:+.1%}"
    # the op path's rule (one received gradient at a time) misses more of the first stage
    first = plan.stages[0][0]
    op_rule = simulate(graph, plan, ops_costs).peak_bytes[first]
    assert op_rule < pred.peak_bytes[first] <= meas.peak_bytes[first]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_fake_capture_predicts_what_a_real_step_measures(name, pool):
    """Captured on fake tensors (meta build, nothing run), the small model's predicted peak on
    one device is the peak one real step measures; parameters, gradients and Adam state are
    16 bytes per fp32 parameter."""
    meta = ex.builtin_model(name, "small", weights=False)
    fake = ex.capture(meta.module, meta.example_inputs, meta.loss_fn, meta.targets)
    assert not meta.weights and fake.runtime is None
    plan = Plan.single(fake, "cpu:0")
    pred = simulate(fake, plan, roofline_costs(fake, ex.Cluster.cpu(1, measure=False)))
    state = sum(b for b, n in zip(node_memory_bytes(fake, "adam"), fake.nodes, strict=True)
                if n.kind == "param")
    assert state == 16 * meta.n_params
    m = pred.memory["cpu:0"]
    assert (m.params_bytes, m.optimizer_bytes) == (4 * meta.n_params, 8 * meta.n_params)
    bm = ex.builtin_model(name, "small")
    real = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
    assert real.fingerprint == fake.fingerprint
    meas = ex.run(real, plan=plan, steps=1, warmup=1, progress=False, timeout_s=120,
                  runtime="ops", pool=pool)
    measured_act = meas.peak_bytes["cpu:0"] - (m.total_bytes - m.activations_bytes)
    assert m.activations_bytes == pytest.approx(measured_act, rel=0.05)


def test_a_same_size_add_hands_its_gradient_on():
    """c = a + b: the gradient c's backward gives a and b is c's own (no new tensors), kept
    until the last of their backwards, as autograd does."""
    nodes = [OpNode("x", "input", "input", out_bytes=10),
             OpNode("a", "op", "test.op", inputs=("x",), out_bytes=100, requires_grad=True,
                    saves=("a",)),
             OpNode("b", "op", "test.op", inputs=("x",), out_bytes=100, requires_grad=True,
                    saves=("b",)),
             OpNode("c", "op", "aten.add.Tensor", inputs=("a", "b"), out_bytes=100,
                    requires_grad=True),
             OpNode("loss", "op", "test.op", inputs=("c",), out_bytes=4, requires_grad=True,
                    saves=("c",))]
    g = OpGraph("add", nodes, 8)
    cl = cluster(1)
    unit = {n: 1.0 for n in ("a", "b", "c", "loss")}
    pred = simulate(g, Plan.single(g, "d:0", optimizer="sgd"), costs(g, cl, unit, unit))
    # forward a [0,1] b [1,2] c [2,3] loss [3,4]; backward loss [4,5] c [5,6] b [6,7] a [7,8].
    # Live: a [0,8] and b [1,7] (saved by themselves), c [2,5] (saved by loss), loss [3,5],
    # grad c [4,6] (made by loss's backward), then that same buffer for a and b [6,8].
    # Peak in [4,5): a + b + c + loss + grad c; separate gradients for a and b made by c's
    # backward would have made [5,6) 500
    assert pred.memory["d:0"].activations_bytes == 404


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_checkpointed_span_counts_what_it_made_again_until_its_op_is_done(name, pool):
    """On the segment runtime, checkpoint makes a block's saved values again in its first
    backward, and each op's backward unpacks its own and lets go of them when it is done, after
    it has made its gradients (which a device allocates while it still holds them). The rank
    counts them so, and one device's full recomputation measures what the simulator
    predicts (counted only up to the node's gradients, the runs measured 8-11 % less)."""
    _assert_one_device_recomputation_predicted(name, "full", pool)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vgg16", "gpt"])
def test_a_selective_span_runs_again_whole_and_its_cache_lets_go_as_it_does(name, pool):
    """Selective recomputation on the segment runtime: the outputs the policy keeps are held
    by its cache until the span runs again, at the start of its first backward, and the span
    makes all it drops again there (checkpoint runs a span whole, not each op in the first
    backward that needs it, as the op path does). VGG16's feature stack is one span: counted
    the op path's way (each kept output held until the unit's last backward) the prediction
    was 15 % over the run, GPT's 5 % under (counting frees in a node as the rank now does)."""
    _assert_one_device_recomputation_predicted(name, "selective", pool)


_SMALL: dict = {}


def _assert_one_device_recomputation_predicted(name: str, recompute: str,
                                                pool: RankPool) -> None:
    """The built-in model at size small on one CPU rank with ``recompute``, run on the segment
    runtime: its measured peak is the one predicted with costs of that runtime."""
    if name not in _SMALL:
        bm = ex.builtin_model(name, "small")
        _SMALL[name] = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                                  name=name)
    graph = _SMALL[name]
    seg_costs = _segment_costs(graph, ex.Cluster.cpu(1, measure=False))
    plan = ex.Plan.single(graph, "cpu:0").with_memory(recompute=recompute)
    pred = simulate(graph, plan, seg_costs)
    meas = ex.run(graph, plan=plan, costs=seg_costs, steps=1, warmup=1, progress=False,
                  timeout_s=120, runtime="segments", pool=pool)
    err = pred.peak_bytes["cpu:0"] / meas.peak_bytes["cpu:0"] - 1
    assert abs(err) <= TOLERANCE, f"predicted {pred.memory['cpu:0']}, measured " \
        f"{meas.peak_by_category['cpu:0']}: {err:+.1%}"
