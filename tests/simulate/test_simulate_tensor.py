"""Tensor-parallel stages in the simulator, against hand-computed times and bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import explorer as ex
from explorer.core.graph import OpGraph, OpNode
from explorer.core.tensor_layout import megatron_layout
from explorer.simulate.tensor import activations_per_device, saved_extra_per_device
from tests.builders import cluster, costs, tiny_builtin_graph

LINEAR = "aten.linear.default"
LAT_S, BW = 1e-3, 1e6  # the link: an all-reduce of 1000 B on 2 devices is 2 x 1 ms + 1 ms


def _param(name: str, shape: tuple[int, ...], nbytes: int) -> OpNode:
    return OpNode(name, "param", "param", module_path=name.rpartition(".")[0],
                  shapes=(shape,), param_bytes=nbytes, out_bytes=nbytes, requires_grad=True)


def _op(name: str, op: str, module: str, inputs: tuple[str, ...], out: int) -> OpNode:
    return OpNode(name, "op", op, module_path=module, inputs=inputs, out_bytes=out,
                  requires_grad=True)


@pytest.fixture(scope="module")
def block() -> OpGraph:
    """pre -> fc1 (column) -> act -> fc2 (row) -> loss: one Megatron MLP block."""
    return OpGraph("block", [
        OpNode("x", "input", "input", out_bytes=1000),
        _param("mlp.fc1.weight", (8, 4), 128), _param("mlp.fc1.bias", (8,), 32),
        _param("mlp.fc2.weight", (4, 8), 128),
        _op("pre", "aten.relu.default", "pre", ("x",), 1000),
        _op("fc1", LINEAR, "mlp.fc1", ("pre", "mlp.fc1.weight", "mlp.fc1.bias"), 2000),
        _op("act", "aten.relu.default", "mlp.act", ("fc1",), 2000),
        _op("fc2", LINEAR, "mlp.fc2", ("act", "mlp.fc2.weight"), 1000),
        _op("loss", "aten.sum.default", "", ("fc2",), 4),
    ], batch_size=8, loss="loss")


FWD = {"pre": 1.0, "fc1": 2.0, "act": 1.0, "fc2": 2.0, "loss": 0.5}
BWD = {"pre": 1.0, "fc1": 4.0, "act": 2.0, "fc2": 4.0, "loss": 0.5}


def test_layout_of_one_block(block):
    lay = megatron_layout(block, 2)
    assert lay.placements == {"mlp.fc1.weight": "Shard(0)", "mlp.fc1.bias": "Shard(0)",
                              "mlp.fc2.weight": "Shard(1)"}
    assert lay.split_ops == {"fc1", "act", "fc2"}
    assert lay.reduce_forward == {"fc2": 1000} and lay.reduce_backward == {"fc1": 1000}
    assert megatron_layout(block, 3).placements == {}  # 3 divides no split dimension


def test_split_block_times_bytes_and_memory_by_hand(block):
    cl = cluster(2, LAT_S, BW)
    cm = costs(block, cl, FWD, BWD, overhead_s=0.2, opt_per_byte=0.0)
    ops = {n.name: 0 for n in block.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(block, [("d:0", "d:1")], ops).with_tensor(2)
    pred = ex.simulate(block, plan, cm)
    half = lambda t: 0.2 + (t - 0.2) / 2  # noqa: E731  (the overhead does not shrink)
    allreduce_s = 2 * LAT_S + 1000 / BW
    fwd = 1.0 + half(2.0) + half(1.0) + half(2.0) + allreduce_s + 0.5
    bwd = 1.0 + half(4.0) + allreduce_s + half(2.0) + half(4.0) + 0.5
    assert pred.step_s == pytest.approx(fwd + bwd, rel=1e-12)
    assert pred.allreduce_bytes == 2 * (2 * 1 * 1000)  # one forward, one backward
    mem = pred.memory["d:0"]
    assert mem.params_bytes == 128 // 2 + 32 // 2 + 128 // 2
    assert mem.optimizer_bytes == 2 * mem.params_bytes  # adam
    # one device: every op whole, no all-reduce
    one = ex.simulate(block, ex.Plan.from_assignment(block, [("d:0",)], ops), cm)
    assert one.step_s == pytest.approx(sum(FWD.values()) + sum(BWD.values()), rel=1e-12)
    assert one.memory["d:0"].params_bytes == 288
    # the split activations (fc1's and act's outputs, 2000 B each) are halved; the peaks the
    # simulator finds: one device in fc2's backward (its weight gradient, 128 B, and 4000 B of
    # activations), the split stage at the end of the backward (every weight gradient's share)
    one_mem = one.memory["d:0"]
    assert (one_mem.grads_bytes, one_mem.activations_bytes) == (128, 4000)
    assert (mem.grads_bytes, mem.activations_bytes) == (144, 2000)


def test_tensor_and_data_parallel_in_one_stage(block):
    """4 devices = 2 replicas x 2: each replica takes half the batch, then splits its ops."""
    cl = cluster(4, LAT_S, BW)
    cm = costs(block, cl, FWD, BWD, overhead_s=0.2)
    ops = {n.name: 0 for n in block.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(block, [("d:0", "d:1", "d:2", "d:3")], ops).with_tensor(2)
    assert plan.replicas_of(0) == 2 and plan.data_parallel == 2
    pred = ex.simulate(block, plan, cm)
    at = lambda t, f: 0.2 + (t - 0.2) * f  # noqa: E731
    allreduce_s = 2 * LAT_S + 500 / BW  # half the batch's activations
    fwd = at(1.0, .5) + at(2.0, .25) + at(1.0, .25) + at(2.0, .25) + allreduce_s + at(0.5, .5)
    bwd = (at(1.0, .5) + at(4.0, .25) + allreduce_s + at(2.0, .25) + at(4.0, .25)
           + at(0.5, .5))
    # the replicas all-reduce their weight shards (144 B) behind pre's backward
    assert 2 * LAT_S + 144 / BW < at(1.0, .5)
    assert pred.step_s == pytest.approx(fwd + bwd, rel=1e-9)
    tensor_bytes = 2 * (2 * 1 * 500)  # two tensor groups, one forward and one backward each
    assert pred.allreduce_bytes == 2 * tensor_bytes + 2 * 1 * 144


def test_split_ops_take_their_share_at_the_micro_batch_not_a_smaller_batch(block):
    """With batch fractions measured, a split op runs 1/k of its time at its micro-batch's
    fraction (beyond the per-op overhead): fc1 and fc2 read their whole weights at any batch,
    which is most of their time at half of it (2.0 s at 1, 1.6 s at 0.5), and the split
    halves that read; the same op on a quarter of the batch would still read it all."""
    cm = costs(block, cluster(2, LAT_S, BW), FWD, BWD, overhead_s=0.2)
    at_half = {"pre": 0.6, "fc1": 1.6, "act": 0.6, "fc2": 1.6, "loss": 0.35}
    bwd_half = {"pre": 0.6, "fc1": 3.0, "act": 1.1, "fc2": 3.0, "loss": 0.35}
    for dc in cm.per_type.values():
        dc.fractions = [0.5]
        dc.fwd_at = [[at_half.get(n.name, 0.0) for n in block.nodes]]
        dc.bwd_at = [[bwd_half.get(n.name, 0.0) for n in block.nodes]]
    ops = {n.name: 0 for n in block.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(block, [("d:0", "d:1")], ops, micro_batches=2,
                                   schedule="gpipe").with_tensor(2)
    share = lambda t: 0.2 + (t - 0.2) / 2  # noqa: E731  (of the time at fraction 0.5)
    allreduce_s = 2 * LAT_S + 500 / BW
    fwd = 0.6 + share(1.6) + share(0.6) + share(1.6) + allreduce_s + 0.35
    bwd = 0.6 + share(3.0) + allreduce_s + share(1.1) + share(3.0) + 0.35
    pred = ex.simulate(block, plan, cm)
    assert pred.step_s == pytest.approx(2 * (fwd + bwd), rel=1e-12)
    # (fc1 at a quarter of the batch, the old reading, extrapolates to 1.4 s, not 0.9 s)
    dc = next(iter(cm.per_type.values()))
    assert dc.at(dc.fwd_s, dc.fwd_at, block.index["fc1"], 0.25) == pytest.approx(1.4)
    assert share(1.6) == pytest.approx(0.9)


def test_gpt_layout_splits_every_block_the_token_embedding_and_the_lm_head():
    """The attention's fused qkv is split by heads within each of its three parts (each device
    holds its heads' query, key and value rows); the split into q, k, v, the views, the
    matmuls, the mask and the softmax run on each device's own heads. The LM head splits by
    vocabulary, its cross-entropy too."""
    bm = ex.builtin_model("gpt", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    lay = megatron_layout(graph, 2)
    for b in range(2):
        assert lay.placement(f"blocks.{b}.mlp.fc.weight") == "Shard(0)"
        assert lay.placement(f"blocks.{b}.mlp.fc.bias") == "Shard(0)"
        assert lay.placement(f"blocks.{b}.mlp.proj.weight") == "Shard(1)"
        assert lay.placement(f"blocks.{b}.mlp.proj.bias") == "Replicate()"
        for w in ("weight", "bias"):
            assert lay.placement(f"blocks.{b}.attn.qkv.{w}") == "_StridedShard(dim=0, sf=3)"
        assert lay.placement(f"blocks.{b}.attn.proj.weight") == "Shard(1)"
    assert lay.placement("tok_emb.weight") == "Shard(0)"
    assert not lay.is_sharded("pos_emb.weight") and lay.placement("lm_head.weight") == "Shard(0)"
    assert {"linear_8", "reshape_2", "cross_entropy_loss"} <= lay.split_ops
    ops = {graph.nodes[graph.index[n]].op for n in lay.local_ops}
    assert {"aten.split.Tensor", "getitem", "aten.matmul.default", "aten.masked_fill.Scalar",
            "aten.softmax.int"} <= ops
    # the tiny GPT's 2 heads split 2 ways, not 4: its attention stays whole then
    assert not megatron_layout(graph, 4).is_sharded("blocks.0.attn.qkv.weight")
    assert megatron_layout(graph, 4).is_sharded("blocks.0.mlp.fc.weight")
    # forward: the embedding, each block's two outputs and the loss's 3 numbers per row of
    # (8 x 16); backward: each block's two input gradients and the LM head's (8, 16, 32) fp32
    # input's
    assert len(lay.reduce_forward) == 1 + 2 * 2 + 1 and len(lay.reduce_backward) == 2 * 2 + 1
    assert lay.reduce_forward["cross_entropy_loss"] == 3 * 8 * 16 * 4
    assert lay.reduce_backward["linear_8"] == 8 * 16 * 32 * 4


def test_llama_splits_swiglu_and_attention_by_heads():
    bm = ex.builtin_model("llama", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="llama")
    lay = megatron_layout(graph, 2)
    for b in range(2):
        mlp, attn = f"layers.{b}.mlp", f"layers.{b}.attn"
        assert [lay.placement(f"{mlp}.{w}_proj.weight") for w in ("gate", "up", "down")] == [
            "Shard(0)", "Shard(0)", "Shard(1)"]
        assert [lay.placement(f"{attn}.{w}_proj.weight") for w in "qkvo"] == [
            "Shard(0)", "Shard(0)", "Shard(0)", "Shard(1)"]
    assert lay.placement("lm_head.weight") == "Shard(0)"  # (by vocabulary)
    # per block: the attention's and the SwiGLU's shared inputs' gradients, their outputs;
    # the embedding's output, the loss's statistics and the LM head's input gradient
    assert len(lay.reduce_backward) == 2 * 2 + 1 and len(lay.reduce_forward) == 1 + 2 * 2 + 1
    ops = {graph.nodes[graph.index[n]].op for n in lay.local_ops}
    assert "aten.scaled_dot_product_attention.default" in ops and lay.local_ops < lay.split_ops
    assert megatron_layout(graph, 8).local_ops == frozenset()  # 4 heads: not 8 ways


@pytest.fixture(scope="module")
def attention() -> OpGraph:
    """pre -> q, k, v (column) -> views into 2 heads -> attention -> reshape -> o (row)."""
    heads = (2, 4, 2, 4)
    return OpGraph("attention", [
        OpNode("x", "input", "input", out_bytes=1000),
        *(_param(f"attn.{w}.weight", (8, 8), 256) for w in "qkvo"),
        _op("pre", "aten.relu.default", "pre", ("x",), 1000),
        *(_op(w, LINEAR, f"attn.{w}", ("pre", f"attn.{w}.weight"), 1000) for w in "qkv"),
        *(OpNode(f"view_{w}", "op", "aten.view.default", module_path="attn", inputs=(w,),
                 out_bytes=1000, shapes=(heads,), requires_grad=True) for w in "qkv"),
        _op("att", "aten.scaled_dot_product_attention.default", "attn",
            ("view_q", "view_k", "view_v"), 1000),
        OpNode("back", "op", "aten.reshape.default", module_path="attn", inputs=("att",),
               out_bytes=1000, shapes=((2, 4, 8),), requires_grad=True),
        _op("o", LINEAR, "attn.o", ("back", "attn.o.weight"), 1000),
        _op("loss", "aten.sum.default", "", ("o",), 4),
    ], batch_size=2, loss="loss")


def test_attention_split_by_heads_by_hand(attention):
    lay = megatron_layout(attention, 2)
    assert lay.placements == {"attn.q.weight": "Shard(0)", "attn.k.weight": "Shard(0)",
                              "attn.v.weight": "Shard(0)", "attn.o.weight": "Shard(1)"}
    assert lay.local_ops == {"view_q", "view_k", "view_v", "att", "back"}
    assert lay.split_ops == lay.local_ops | {"q", "k", "v", "o"}
    assert lay.reduce_forward == {"o": 1000} and lay.reduce_backward == {"q": 1000}
    assert megatron_layout(attention, 4).placements == {}  # 2 heads: not 4 ways
    fwd = {"pre": 1.0, "q": 2.0, "k": 2.0, "v": 2.0, "view_q": 0.5, "view_k": 0.5,
           "view_v": 0.5, "att": 3.0, "back": 0.5, "o": 2.0, "loss": 0.5}
    bwd = {k: 2 * v for k, v in fwd.items()}
    cm = costs(attention, cluster(2, LAT_S, BW), fwd, bwd, overhead_s=0.2)
    for dc in cm.per_type.values():  # DTensor's per-op cost: not on the heads' own ops
        dc.dtensor = {"op_fwd_s": 0.01, "op_bwd_s": 0.02}
    ops = {n.name: 0 for n in attention.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(attention, [("d:0", "d:1")], ops).with_tensor(2)
    pred = ex.simulate(attention, plan, cm)
    half = lambda t: 0.2 + (t - 0.2) / 2  # noqa: E731
    allreduce_s = 2 * LAT_S + 1000 / BW
    f = (1.0 + 3 * half(2.0) + 3 * half(0.5) + half(3.0) + half(0.5) + half(2.0)
         + 4 * 0.01 + allreduce_s + 0.5)
    b = (2.0 + 3 * half(4.0) + 3 * half(1.0) + half(6.0) + half(1.0) + half(4.0)
         + 4 * 0.02 + allreduce_s + 1.0)
    assert pred.step_s == pytest.approx(f + b, rel=1e-12)
    assert pred.allreduce_bytes == 2 * (2 * 1 * 1000)
    assert pred.memory["d:0"].params_bytes == 4 * 256 // 2


def test_dropout_in_a_split_block_runs_whole_after_an_all_gather():
    """The runtime draws a random op's mask on whole values: its split input is gathered
    (half a ring all-reduce) and it runs at full size."""
    g = OpGraph("drop", [
        OpNode("x", "input", "input", out_bytes=1000),
        _param("mlp.fc1.weight", (8, 4), 128), _param("mlp.fc2.weight", (4, 8), 128),
        _op("pre", "aten.relu.default", "pre", ("x",), 1000),
        _op("fc1", LINEAR, "mlp.fc1", ("pre", "mlp.fc1.weight"), 2000),
        _op("drop", "aten.dropout.default", "mlp.drop", ("fc1",), 2000),
        _op("fc2", LINEAR, "mlp.fc2", ("drop", "mlp.fc2.weight"), 1000),
        _op("loss", "aten.sum.default", "", ("fc2",), 4),
    ], batch_size=8, loss="loss")
    lay = megatron_layout(g, 2)
    assert lay.split_ops == {"fc1", "fc2"} and lay.gather_forward == {"drop": 2000}
    fwd = {"pre": 1.0, "fc1": 2.0, "drop": 1.0, "fc2": 2.0, "loss": 0.5}
    cm = costs(g, cluster(2, LAT_S, BW), fwd, {k: 2 * v for k, v in fwd.items()},
               overhead_s=0.2)
    ops = {n.name: 0 for n in g.nodes if n.kind == "op"}
    pred = ex.simulate(g, ex.Plan.from_assignment(g, [("d:0", "d:1")], ops).with_tensor(2), cm)
    half = lambda t: 0.2 + (t - 0.2) / 2  # noqa: E731
    reduce_1000 = 2 * LAT_S + 1000 / BW
    gather_2000 = (2 * LAT_S + 2000 / BW) / 2
    f = 1.0 + half(2.0) + 1.0 + gather_2000 + half(2.0) + reduce_1000 + 0.5
    b = 2.0 + half(4.0) + reduce_1000 + 2.0 + half(4.0) + 1.0
    assert pred.step_s == pytest.approx(f + b, rel=1e-12)
    assert pred.allreduce_bytes == 2 * 1000 * 2 + 1 * 2000


def test_dtensor_costs_from_the_profile_by_hand(block):
    """What the runtime adds to the plain ops (``DeviceCosts.dtensor``): per split op that
    reads a split weight (fc1 and fc2; not act, which runs on its local shard), per
    collective, per split weight an unsplit op reads (norm reads fc2's weight, tied; its
    replicated weight and fc2's output are plain), per parameter tensor the optimizer
    steps, and once a step."""
    g = OpGraph("normed", [*(n for n in block.nodes if n.name != "loss"),
                           _param("norm.weight", (4,), 16),
                           _op("norm", "aten.mul.Tensor", "norm",
                               ("fc2", "norm.weight", "mlp.fc2.weight"), 1000),
                           _op("loss", "aten.sum.default", "", ("norm",), 4)],
                batch_size=8, loss="loss")
    fwd, bwd = {**FWD, "norm": 0.5}, {**BWD, "norm": 1.0}
    cm = costs(g, cluster(2, LAT_S, BW), fwd, bwd, overhead_s=0.2)
    a, b, c, w_f, w_b, opt, step = 0.01, 0.02, 0.3, 0.04, 0.05, 0.06, 0.07
    for dc in cm.per_type.values():
        dc.dtensor = {"op_fwd_s": a, "op_bwd_s": b, "collective_s": c, "read_fwd_s": w_f,
                      "read_bwd_s": w_b, "optimizer_tensor_s": opt, "step_s": step}
    ops = {n.name: 0 for n in g.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(g, [("d:0", "d:1")], ops).with_tensor(2)
    pred = ex.simulate(g, plan, cm)
    half = lambda t: 0.2 + (t - 0.2) / 2  # noqa: E731
    allreduce_s = 2 * LAT_S + 1000 / BW
    f = (1.0 + half(2.0) + half(1.0) + half(2.0) + 2 * a + allreduce_s + c + 0.5 + w_f
         + 0.5)
    bk = (1.0 + half(4.0) + half(2.0) + half(4.0) + 2 * b + allreduce_s + c + 1.0 + w_b
          + 0.5)
    assert pred.step_s == pytest.approx(f + bk + 4 * opt + step, rel=1e-12)
    # one device: none of it
    one = ex.simulate(g, ex.Plan.from_assignment(g, [("d:0",)], ops), cm)
    assert one.step_s == pytest.approx(sum(fwd.values()) + sum(bwd.values()), rel=1e-12)


CONV = "aten.conv2d.default"


def _shaped(name: str, op: str, inputs: tuple[str, ...], shape: tuple[int, ...]) -> OpNode:
    """An op of NCHW output ``shape`` in fp32, in module ``name`` of a Sequential ``net``."""
    return OpNode(name, "op", op, module_path=f"net.{name}", inputs=inputs, shapes=(shape,),
                  out_bytes=4 * shape[0] * shape[1] * shape[2] * shape[3], requires_grad=True)


@pytest.fixture(scope="module")
def convs() -> OpGraph:
    """pre -> conv1 (column: 3 -> 8 channels) -> act -> conv2 (row: 8 -> 4) -> loss, on
    (2, C, 6, 6) fp32 activations."""
    return OpGraph("convs", [
        OpNode("x", "input", "input", shapes=((2, 3, 6, 6),), out_bytes=864),
        _param("net.conv1.weight", (8, 3, 3, 3), 864), _param("net.conv1.bias", (8,), 32),
        _param("net.conv2.weight", (4, 8, 3, 3), 1152), _param("net.conv2.bias", (4,), 16),
        _shaped("pre", "aten.relu.default", ("x",), (2, 3, 6, 6)),
        _shaped("conv1", CONV, ("pre", "net.conv1.weight", "net.conv1.bias"), (2, 8, 6, 6)),
        _shaped("act", "aten.relu.default", ("conv1",), (2, 8, 6, 6)),
        _shaped("conv2", CONV, ("act", "net.conv2.weight", "net.conv2.bias"), (2, 4, 6, 6)),
        _op("loss", "aten.sum.default", "", ("conv2",), 4),
    ], batch_size=2, loss="loss")


def test_convolutions_split_by_channels_by_hand(convs):
    """The weights split along output (conv1, and its bias) and input channels (conv2; its
    bias whole); conv2's (2, 4, 6, 6) output (1152 B) all-reduced in the forward, pre's (864
    B) gradient in the backward; conv1's and act's (2, 8, 6, 6) outputs (2304 B) halved."""
    lay = megatron_layout(convs, 2)
    assert lay.placements == {"net.conv1.weight": "Shard(0)", "net.conv1.bias": "Shard(0)",
                              "net.conv2.weight": "Shard(1)"}
    assert lay.split_ops == {"conv1", "act", "conv2"}
    assert lay.reduce_forward == {"conv2": 1152} and lay.reduce_backward == {"conv1": 864}
    assert megatron_layout(convs, 3).placements == {}  # 3 divides neither 8 nor 4
    fwd = {"pre": 1.0, "conv1": 2.0, "act": 1.0, "conv2": 2.0, "loss": 0.5}
    bwd = {k: 2 * v for k, v in fwd.items()}
    cm = costs(convs, cluster(2, LAT_S, BW), fwd, bwd, overhead_s=0.2, opt_per_byte=0.0)
    ops = {n.name: 0 for n in convs.nodes if n.kind == "op"}
    pred = ex.simulate(convs, ex.Plan.from_assignment(convs, [("d:0", "d:1")], ops)
                       .with_tensor(2), cm)
    half = lambda t: 0.2 + (t - 0.2) / 2  # noqa: E731
    f = 1.0 + half(2.0) + half(1.0) + half(2.0) + (2 * LAT_S + 1152 / BW) + 0.5
    b = 2.0 + half(4.0) + (2 * LAT_S + 864 / BW) + half(2.0) + half(4.0) + 1.0
    assert pred.step_s == pytest.approx(f + b, rel=1e-12)
    assert pred.allreduce_bytes == 2 * 1 * 1152 + 2 * 1 * 864  # a ring of 2, both ways
    mem = pred.memory["d:0"]
    assert mem.params_bytes == 864 // 2 + 32 // 2 + 1152 // 2 + 16
    plan = ex.Plan.from_assignment(convs, [("d:0", "d:1")], ops).with_tensor(2)
    out = activations_per_device(convs, plan, np.array([n.out_bytes for n in convs.nodes]))
    assert {n.name: int(out[i]) for i, n in enumerate(convs.nodes) if n.kind == "op"} == {
        "pre": 864, "conv1": 1152, "act": 1152, "conv2": 1152, "loss": 4}
    # the peaks the simulator finds: one device in conv2's backward (its weight and bias
    # gradients, 1168 B, and conv1's and act's outputs, 4608 B), the split stage at the end of
    # the backward (every weight gradient's share), as for the linears' block above
    one = ex.simulate(convs, ex.Plan.from_assignment(convs, [("d:0",)], ops), cm)
    assert (one.memory["d:0"].grads_bytes, one.memory["d:0"].activations_bytes) == (1168, 4608)
    assert (mem.grads_bytes, mem.activations_bytes) == (1040, 2016)


def test_vocabulary_parallel_loss_by_hand():
    """pre -> head (column: 6 classes, 3 each) -> reshape (8, 6) -> cross-entropy: the head,
    the reshape and the loss at half their work; the loss all-reduces 3 fp32 numbers per row
    (96 B) in the forward, pre's (8, 4) gradient (128 B) in the backward; the logits halved,
    the loss's saved softmax too, its output (the whole loss) not."""
    def sized(node: OpNode, shape: tuple[int, ...], **more) -> OpNode:
        return dataclasses.replace(node, shapes=(shape,), **more)

    g = OpGraph("vocab", [
        OpNode("x", "input", "input", shapes=((2, 4, 4),), out_bytes=128),
        OpNode("y", "input", "input", shapes=((8,),), dtype="int64", out_bytes=64),
        _param("head.weight", (6, 4), 96),
        sized(_op("pre", "aten.relu.default", "pre", ("x",), 128), (2, 4, 4)),
        sized(_op("head", LINEAR, "head", ("pre", "head.weight"), 192), (2, 4, 6)),
        sized(_op("flat", "aten.reshape.default", "", ("head",), 192), (8, 6)),
        sized(_op("loss", "aten.cross_entropy_loss.default", "", ("flat", "y"), 4), (),
              saved_extra_bytes=196),  # (the softmax, and the count)
    ], batch_size=2, loss="loss")
    lay = megatron_layout(g, 2)
    assert lay.placements == {"head.weight": "Shard(0)"}
    assert lay.split_ops == {"head", "flat", "loss"}
    assert lay.reduce_forward == {"loss": 3 * 8 * 4} and lay.reduce_backward == {"head": 128}
    assert megatron_layout(g, 4).placements == {}  # 4 does not divide 6 classes
    fwd = {"pre": 1.0, "head": 2.0, "flat": 0.4, "loss": 1.0}
    bwd = {k: 2 * v for k, v in fwd.items()}
    cm = costs(g, cluster(2, LAT_S, BW), fwd, bwd, overhead_s=0.2, opt_per_byte=0.0)
    ops = {n.name: 0 for n in g.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(g, [("d:0", "d:1")], ops).with_tensor(2)
    pred = ex.simulate(g, plan, cm)
    half = lambda t: 0.2 + (t - 0.2) / 2  # noqa: E731
    f = 1.0 + half(2.0) + half(0.4) + half(1.0) + (2 * LAT_S + 96 / BW)
    b = half(2.0) + half(0.8) + half(4.0) + (2 * LAT_S + 128 / BW) + 2.0
    assert pred.step_s == pytest.approx(f + b, rel=1e-12)
    assert pred.allreduce_bytes == 2 * 1 * 96 + 2 * 1 * 128  # a ring of 2, both ways
    assert pred.memory["d:0"].params_bytes == 96 // 2
    out = activations_per_device(g, plan, np.array([n.out_bytes for n in g.nodes]))
    assert out.tolist() == [128, 64, 96, 128, 96, 96, 4]
    extra = saved_extra_per_device(g, plan, np.array([n.saved_extra_bytes for n in g.nodes]))
    assert extra.tolist() == [0, 0, 0, 0, 0, 0, 98]


# ---- the tensor split with ZeRO, recomputation and bf16


def test_zero_shards_each_devices_share_of_a_split_weight_over_the_replicas(block):
    """tensor 2 x 2 replicas: a device holds half of each split weight (144 B of 288), and
    ZeRO shards that half over the 2 replicas."""
    cl = cluster(4, LAT_S, BW)
    cm = costs(block, cl, FWD, BWD, overhead_s=0.2)
    ops = {n.name: 0 for n in block.nodes if n.kind == "op"}
    split = ex.Plan.from_assignment(block, [("d:0", "d:1", "d:2", "d:3")], ops).with_tensor(2)
    base = ex.simulate(block, split, cm).memory["d:0"]
    assert (base.params_bytes, base.optimizer_bytes) == (144, 288)
    for zero in (1, 2, 3):
        mem = ex.simulate(block, split.with_memory(zero=zero), cm).memory["d:0"]
        assert mem.optimizer_bytes == 288 // 2  # adam's two moments of a 72 B shard
        assert mem.params_bytes == (72 if zero == 3 else 144)


def test_zero_3_gathers_a_devices_share_within_its_tensor_rank_replicas(block):
    cl = cluster(4, LAT_S, BW)
    cm = costs(block, cl, FWD, BWD, overhead_s=0.2)
    ops = {n.name: 0 for n in block.nodes if n.kind == "op"}
    split = ex.Plan.from_assignment(block, [("d:0", "d:1", "d:2", "d:3")], ops).with_tensor(2)
    pred = ex.simulate(block, split.with_memory(zero=3), cm)
    gathers = [iv for iv in pred.timeline if iv.device == "d:0" and iv.kind == "all-gather"]
    assert gathers  # each priced as a ring of the 2 replicas over the device's 144 B share
    assert {round(iv.end_s - iv.start_s, 12) for iv in gathers} == {
        round(LAT_S + 144 / 2 / BW, 12)}


def test_bf16_halves_what_the_tensor_splits_collectives_carry(block):
    cl = cluster(2, LAT_S, BW)
    cm = costs(block, cl, FWD, BWD, overhead_s=0.2)
    ops = {n.name: 0 for n in block.nodes if n.kind == "op"}
    split = ex.Plan.from_assignment(block, [("d:0", "d:1")], ops).with_tensor(2)
    fp32, bf16 = (ex.simulate(block, split.with_memory(precision=p), cm)
                  for p in ("fp32", "bf16"))
    assert fp32.allreduce_bytes == 2 * (2 * 1 * 1000)
    assert bf16.allreduce_bytes == 2 * (2 * 1 * 500)


@pytest.mark.parametrize("memory", [{"precision": "bf16"}, {"recompute": "full"},
                                    {"zero": 3}])
def test_a_gpts_split_and_memory_settings_each_lower_its_memory(memory):
    """tensor 2 with bf16, recomputation or ZeRO 3 (over the 2 replicas) holds less than the
    split alone (and than bf16 or recomputation alone), and a recomputing split stage takes
    longer than the split alone."""
    graph = tiny_builtin_graph("gpt")
    cl = ex.Cluster.preset("4xH100")
    cm = ex.profile(graph, cl)
    dp = ex.partition(graph, cl, cm, "data-parallel")
    peaks = {}
    for name, plan in {"none": dp, "split": dp.with_tensor(2), "memory": dp.with_memory(**memory),
                       "both": dp.with_tensor(2).with_memory(**memory)}.items():
        pred = ex.simulate(graph, plan, cm)
        peaks[name] = pred.peak_bytes["H100:0"]
        if name == "both" and "recompute" in memory:
            assert pred.step_s > ex.simulate(graph, dp.with_tensor(2), cm).step_s
    assert peaks["both"] < peaks["split"] < peaks["none"] and peaks["memory"] < peaks["none"]
    if "zero" not in memory:  # (ZeRO 3 over 4 replicas shards more than over 2)
        assert peaks["both"] < peaks["memory"]
