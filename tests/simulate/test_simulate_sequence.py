"""Sequence parallelism in the layout and the simulator, against hand-computed cases."""

from __future__ import annotations

import pytest
from builders import tiny_builtin_graph

import explorer as ex
from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import StageSettings
from explorer.core.tensor_layout import megatron_layout
from explorer.devices.cluster import Cluster, Link
from explorer.simulate.tensor import pipelined_s
from tests.builders import cluster, costs, device

LINEAR = "aten.linear.default"
LAT_S, BW = 1e-3, 1e6
ACT = (2, 4, 8)  # (batch, seq, features)
WIDE = (2, 4, 16)


def _param(name: str, shape: tuple[int, ...], nbytes: int) -> OpNode:
    return OpNode(name, "param", "param", module_path=name.rpartition(".")[0],
                  shapes=(shape,), param_bytes=nbytes, out_bytes=nbytes, requires_grad=True)


def _op(name: str, op: str, module: str, inputs: tuple[str, ...], shape: tuple[int, ...],
        out: int) -> OpNode:
    """An op that saves its first input for its backward (a sum and an add save nothing)."""
    saves = () if op in ("aten.add.Tensor", "aten.sum.default") else inputs[:1]
    return OpNode(name, "op", op, module_path=module, inputs=inputs, shapes=(shape,),
                  out_bytes=out, requires_grad=True, saves=saves)


@pytest.fixture(scope="module")
def blocks() -> OpGraph:
    """x -> [fc1 (column) -> act1 -> fc2 (row, bias)] -> res = fc2 + x -> norm ->
    [fc3 (column) -> act2 -> fc4 (row)] -> loss: two Megatron MLP blocks with a residual add
    and a layer norm between."""
    return OpGraph("seq", [
        OpNode("x", "input", "input", shapes=(ACT,), out_bytes=1000),
        _param("mlp1.fc1.weight", (16, 8), 512), _param("mlp1.fc2.weight", (8, 16), 512),
        _param("mlp1.fc2.bias", (8,), 32), _param("norm.weight", (8,), 32),
        _param("mlp2.fc3.weight", (16, 8), 512), _param("mlp2.fc4.weight", (8, 16), 512),
        _op("fc1", LINEAR, "mlp1.fc1", ("x", "mlp1.fc1.weight"), WIDE, 2000),
        _op("act1", "aten.relu.default", "mlp1.act", ("fc1",), WIDE, 2000),
        _op("fc2", LINEAR, "mlp1.fc2", ("act1", "mlp1.fc2.weight", "mlp1.fc2.bias"), ACT, 1000),
        _op("res", "aten.add.Tensor", "", ("fc2", "x"), ACT, 1000),
        _op("norm", "aten.layer_norm.default", "norm", ("res", "norm.weight"), ACT, 1000),
        _op("fc3", LINEAR, "mlp2.fc3", ("norm", "mlp2.fc3.weight"), WIDE, 2000),
        _op("act2", "aten.relu.default", "mlp2.act", ("fc3",), WIDE, 2000),
        _op("fc4", LINEAR, "mlp2.fc4", ("act2", "mlp2.fc4.weight"), ACT, 1000),
        _op("loss", "aten.sum.default", "", ("fc4",), (), 4),
    ], batch_size=2, loss="loss")


def test_layout_of_two_blocks_with_a_norm_between(blocks):
    base, lay = megatron_layout(blocks, 2), megatron_layout(blocks, 2, sequence=True)
    assert base.reduce_forward == {"fc2": 1000, "fc4": 1000}
    assert base.reduce_backward == {"fc3": 1000}  # (x needs no gradient)
    assert lay.placements == base.placements
    assert lay.sequence_ops == {"res", "norm"} and lay.split_ops == base.split_ops | {"res",
                                                                                      "norm"}
    assert lay.reduce_forward == {} and lay.reduce_backward == {}
    assert lay.scatter_forward == {"fc2": 1000, "fc4": 1000}
    assert lay.gather_forward == {"fc3": 1000, "loss": 1000}  # (the loss reads fc4 whole)
    assert lay.gather_backward == {"fc2": 1000, "fc4": 1000, "fc3": 1000}
    assert lay.scatter_backward == {"fc3": 1000}
    assert lay.sequence_params == {"norm.weight", "mlp1.fc2.bias"}
    # 8 devices: 4 positions do not split, the blocks do
    assert megatron_layout(blocks, 8, sequence=True) == megatron_layout(blocks, 8)


def test_two_blocks_by_hand(blocks):
    fwd = {n.name: 1.0 for n in blocks.nodes if n.kind == "op"} | {"loss": 0.5}
    bwd = {n.name: 2.0 for n in blocks.nodes if n.kind == "op"} | {"loss": 0.5}
    cm = costs(blocks, cluster(2, LAT_S, BW), fwd, bwd)
    ops = {n.name: 0 for n in blocks.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(blocks, [("d:0", "d:1")], ops)
    pred = ex.simulate(blocks, plan.with_tensor(2, sequence=True), cm)
    half_s = LAT_S + 500 / BW  # an all-gather or a reduce-scatter of 1000 B over 2
    f = 8 * 0.5 + 0.5 + 4 * half_s  # every op split but the loss, which gathers fc4
    b = 8 * 1.0 + 0.5 + 4 * half_s  # fc4, fc2: gather; fc3: gather and reduce-scatter
    grads_s = 2 * LAT_S + 64 / BW  # the norm's weight and fc2's bias, in one, once a step
    assert pred.step_s == pytest.approx(f + b + grads_s, rel=1e-12)
    assert pred.allreduce_bytes == 8 * 1000 + 2 * 64
    plain = ex.simulate(blocks, plan.with_tensor(2), cm)
    allreduce_s = 2 * LAT_S + 1000 / BW
    assert plain.step_s == pytest.approx(
        (6 * 0.5 + 2 * 1.0 + 0.5 + 2 * allreduce_s) + (6 * 1.0 + 2 * 2.0 + 0.5 + allreduce_s),
        rel=1e-12)
    # the sequence-split activations (res, norm, and fc2's and fc4's outputs) are halved
    assert pred.memory["d:0"].activations_bytes < plain.memory["d:0"].activations_bytes


def test_builtin_transformers_split_norms_and_residuals_along_the_sequence():
    gpt = megatron_layout(tiny_builtin_graph("gpt"), 2, sequence=True)
    ops = {tiny_builtin_graph("gpt").nodes[tiny_builtin_graph("gpt").index[n]].op
           for n in gpt.sequence_ops}
    assert ops == {"aten.add.Tensor", "aten.layer_norm.default"}
    assert "tok_emb.weight" in gpt.placements and "embedding" in gpt.scatter_forward
    assert "ln_f.weight" in gpt.sequence_params
    assert not gpt.reduce_backward.keys() - {"add"}  # (the position embedding's gradient)
    llama = megatron_layout(tiny_builtin_graph("llama"), 2, sequence=True)
    assert "norm.weight" in llama.sequence_params and len(llama.scatter_forward) == 1 + 2 * 2
    mlp = megatron_layout(tiny_builtin_graph("mlp"), 2, sequence=True)
    assert mlp == megatron_layout(tiny_builtin_graph("mlp"), 2)  # (batch, features): no sequence


def test_sequence_is_a_plan_setting_that_needs_a_tensor_split():
    g = tiny_builtin_graph("gpt")
    ops = {n.name: 0 for n in g.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(g, [("cpu:0", "cpu:1")], ops).with_tensor(2, sequence=True)
    assert plan.sequence_of(0) and plan.settings_of(0).describe() == "tensor 2, sequence"
    d = plan.to_dict()
    assert d["version"] == 3 and d["stage_settings"][0]["sequence"] is True
    assert ex.Plan.from_dict(d, g) == plan
    assert not plan.with_tensor(2).sequence_of(0) and plan.with_tensor(1).stage_settings == ()
    with pytest.raises(PlanError, match="tensor degree above 1"):
        StageSettings(sequence=True)
    d["stage_settings"][0]["sequence"] = "yes"
    with pytest.raises(PlanError, match="true or false"):
        ex.Plan.from_dict(d, g)


def _two_device_cluster(kind: str) -> Cluster:
    return Cluster(name=f"test:{kind}", devices=tuple(device(i, kind=kind) for i in range(2)),
                   default_link=Link(LAT_S, BW, "test"))


def test_async_tensor_pipelines_the_collectives_with_the_matmuls_on_gpus(blocks):
    """Each all-gather or reduce-scatter a linear waits for runs in 2 pieces beside the
    linear's own (async tensor parallelism): of a linear of 1 s and its 1.5 ms transfer only
    half the transfer stays; the loss (a sum) still waits for its gather. CPU ranks cannot:
    their prediction is plain sequence parallelism's."""
    fwd = {n.name: 1.0 for n in blocks.nodes if n.kind == "op"} | {"loss": 0.5}
    bwd = {n.name: 2.0 for n in blocks.nodes if n.kind == "op"} | {"loss": 0.5}
    ops = {n.name: 0 for n in blocks.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(blocks, [("d:0", "d:1")], ops).with_tensor(2, sequence=True)
    overlapped = plan.with_memory(async_tensor=True)
    half_s = LAT_S + 500 / BW
    # forward: fc2's, fc4's scatter and fc3's gather; backward: fc2's and fc4's gather, fc3's
    # gather and scatter (two transfers beside its one product)
    hidden_s = (3 * half_s + 2 * half_s + 2 * half_s) / 2
    gpu = costs(blocks, _two_device_cluster("cuda"), fwd, bwd)
    assert (ex.simulate(blocks, plan, gpu).step_s - ex.simulate(blocks, overlapped, gpu).step_s
            == pytest.approx(hidden_s, rel=1e-9))
    cpu = costs(blocks, _two_device_cluster("cpu"), fwd, bwd)
    assert ex.simulate(blocks, overlapped, cpu).step_s == ex.simulate(blocks, plan, cpu).step_s


def test_a_pipelined_transfer_leaves_one_piece_of_the_shorter_side():
    assert pipelined_s(4.0, 1.0, 4) == 4.0 + 1.0 / 4  # the last transfer
    assert pipelined_s(1.0, 4.0, 4) == 4.0 + 1.0 / 4  # the first product
    assert pipelined_s(2.0, 0.0, 8) == 2.0


def test_async_tensor_is_a_setting_of_sequence_parallel_stages():
    g = tiny_builtin_graph("gpt")
    ops = {n.name: 0 for n in g.nodes if n.kind == "op"}
    two = ex.Plan.from_assignment(g, [("cpu:0", "cpu:1"), ("cpu:2",)],
                                  {n: i % 2 for i, n in enumerate(ops)})
    plan = two.with_tensor(2, stages=[0], sequence=True).with_memory(async_tensor=True)
    assert [plan.settings_of(s).async_tensor for s in (0, 1)] == [True, False]
    assert plan.settings_of(0).describe() == "tensor 2, sequence, async tensor"
    d = plan.to_dict()
    assert d["version"] == 5 and d["stage_settings"][0]["async_tensor"] is True
    assert ex.Plan.from_dict(d, g) == plan
    # it ends with the sequence split, and goes nowhere without one
    assert not plan.with_memory(sequence=False).settings_of(0).async_tensor
    assert not plan.with_tensor(1, stages=[0]).uses_memory_settings
    with pytest.raises(PlanError, match="split a stage by tensor and sequence first"):
        two.with_tensor(2, stages=[0]).with_memory(async_tensor=True)
    with pytest.raises(PlanError, match="turn sequence parallelism on"):
        StageSettings(tensor=2, async_tensor=True)
    d["stage_settings"][0]["async_tensor"] = 1
    with pytest.raises(PlanError, match="true or false"):
        ex.Plan.from_dict(d, g)
