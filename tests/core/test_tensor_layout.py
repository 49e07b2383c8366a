"""Tensor-parallel layouts: which convolutions split by channels, which fused projections by
heads, which classifiers (with their cross-entropy) by classes, and which stay whole."""

from __future__ import annotations

import pytest
import torch
from builders import tiny_builtin_graph
from torch import nn

import explorer as ex
from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan_layout import unsplit_notes
from explorer.core.tensor_layout import (
    megatron_layout,
    shard_dim,
    shard_parts,
    split_dim,
)

LINEAR = "aten.linear.default"


def _par(name: str, shape: tuple[int, ...]) -> OpNode:
    return OpNode(name, "param", "param", module_path=name.rpartition(".")[0], shapes=(shape,),
                  requires_grad=True)


def _layout(*layers: nn.Module, degree: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(10))
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
    model(x)  # (sizes the lazy linear)
    graph = ex.capture(model, (x,), nn.functional.cross_entropy, (y,), name="convs")
    return megatron_layout(graph, degree)


def test_conv_relu_conv_splits_by_channels():
    lay = _layout(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    # (the classifier, 10 classes of 256 features, stays whole)
    assert lay.placements == {"0.weight": "Shard(0)", "0.bias": "Shard(0)",
                              "2.weight": "Shard(1)"}
    assert lay.split_ops == {"conv2d", "relu", "conv2d_1"}
    # the row's (2, 4, 8, 8) fp32 output; the input needs no gradient: nothing backward
    assert lay.reduce_forward == {"conv2d_1": 2 * 4 * 8 * 8 * 4} and lay.reduce_backward == {}
    assert split_dim(4) == -3 and split_dim(2) == -1  # NCHW's channels, a linear's features


@pytest.mark.parametrize("between", [
    [nn.MaxPool2d(2)], [nn.BatchNorm2d(8), nn.ReLU()], [nn.ReLU(), nn.Dropout(0.5)]],
    ids=["pool", "batch_norm", "dropout"])
def test_convolutions_with_anything_but_element_wise_ops_between_stay_whole(between):
    lay = _layout(nn.Conv2d(3, 8, 3, padding=1), *between, nn.Conv2d(8, 4, 3, padding=1))
    assert not any(k.startswith(("0.", "1.", "2.", "3.")) for k in lay.placements)


def test_grouped_convolutions_and_undivided_channels_stay_whole():
    grouped = _layout(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(8, 4, 3, padding=1, groups=2))
    assert not any(k.startswith(("0.", "2.")) for k in grouped.placements)
    odd = _layout(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3, padding=1),
                  degree=4)  # 4 divides neither 6 output nor 6 input channels
    assert not any(k.startswith(("0.", "2.")) for k in odd.placements)


def test_a_pool_between_leaves_the_next_pair_free():
    """conv -> pool -> conv -> relu -> conv: the first stays whole, the others pair."""
    lay = _layout(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1),
                  nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1))
    assert {k: v for k, v in lay.placements.items() if k[0] in "01234"} == {
        "2.weight": "Shard(0)", "2.bias": "Shard(0)", "4.weight": "Shard(1)"}
    assert set(lay.reduce_backward) == {"conv2d_1"}  # the pooled input's gradient


def test_builtin_conv_nets():
    """AlexNet: its third and fourth convolutions (a ReLU between; the others have a pool
    after). VGG-16: each block's first and second. ResNet: a batch norm after every
    convolution, nothing (its classifier has fewer classes than features)."""
    alexnet = megatron_layout(tiny_builtin_graph("alexnet"), 2).placements
    assert {k: v for k, v in alexnet.items() if k.startswith("features")} == {
        "features.6.weight": "Shard(0)", "features.6.bias": "Shard(0)",
        "features.8.weight": "Shard(1)"}
    vgg = megatron_layout(tiny_builtin_graph("vgg16"), 2).placements
    for b in range(1, 6):
        assert [vgg.get(f"features.block{b}.conv{c}.weight") for c in (1, 2, 3)] == [
            "Shard(0)", "Shard(1)", None]
    assert megatron_layout(tiny_builtin_graph("resnet"), 2).placements == {}


def _fused_attention(parts: tuple[int, ...]) -> OpGraph:
    """pre -> qkv (one linear of 3 x 8 features) -> split into ``parts`` widths -> views into
    2 heads -> attention -> reshape -> o."""
    width = sum(parts)
    nodes = [OpNode("x", "input", "input", out_bytes=1000, shapes=((2, 4, 8),)),
             _par("attn.qkv.weight", (width, 8)), _par("attn.o.weight", (8, 8)),
             OpNode("pre", "op", "aten.relu.default", "pre", inputs=("x",), shapes=((2, 4, 8),),
                    requires_grad=True),
             OpNode("qkv", "op", LINEAR, "attn.qkv", inputs=("pre", "attn.qkv.weight"),
                    shapes=((2, 4, width),), requires_grad=True),
             OpNode("split", "op", "aten.split.Tensor", "attn", inputs=("qkv",),
                    shapes=tuple((2, 4, p) for p in parts), requires_grad=True)]
    for i, w in enumerate("qkv"):
        nodes += [OpNode(f"get_{w}", "op", "getitem", "attn", inputs=("split",),
                         shapes=((2, 4, parts[i]),), requires_grad=True),
                  OpNode(f"view_{w}", "op", "aten.view.default", "attn", inputs=(f"get_{w}",),
                         shapes=((2, 4, 2, parts[i] // 2),), requires_grad=True)]
    nodes += [OpNode("att", "op", "aten.scaled_dot_product_attention.default", "attn",
                     inputs=("view_q", "view_k", "view_v"), shapes=((2, 4, 2, 4),),
                     requires_grad=True),
              OpNode("back", "op", "aten.reshape.default", "attn", inputs=("att",),
                     shapes=((2, 4, 8),), requires_grad=True),
              OpNode("o", "op", LINEAR, "attn.o", inputs=("back", "attn.o.weight"),
                     shapes=((2, 4, 8),), requires_grad=True),
              OpNode("loss", "op", "aten.sum.default", "", inputs=("o",), shapes=((),),
                     requires_grad=True)]
    return OpGraph("fused", nodes, batch_size=2, loss="loss")


def test_a_fused_projection_split_into_equal_parts_splits_by_heads_within_each():
    lay = megatron_layout(_fused_attention((8, 8, 8)), 2)
    assert lay.placements == {"attn.qkv.weight": "_StridedShard(dim=0, sf=3)",
                              "attn.o.weight": "Shard(1)"}
    assert {"split", "get_q", "view_v", "att", "back"} <= lay.local_ops
    assert shard_dim(lay.placement("attn.qkv.weight")) == 0
    assert shard_parts(lay.placement("attn.qkv.weight")) == 3
    assert shard_parts("Shard(0)") == 1 and shard_dim("Replicate()") is None


def test_a_fused_projection_split_into_unequal_parts_stays_whole():
    """(Grouped keys and values fused with the query: no one stride lays their heads out.)"""
    assert megatron_layout(_fused_attention((8, 4, 4)), 2).placements == {}


CLASSES = 24


def _classifier(loss_fn, classes: int = CLASSES, norm: bool = True):
    """linear -> layer norm (or tanh) -> linear of ``classes`` on (4, 5, 8) inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16) if norm else nn.Tanh(),
                          nn.Linear(16, classes))
    x, y = torch.randn(4, 5, 8), torch.randint(0, classes, (4, 5))
    return ex.capture(model, (x,), loss_fn, (y,), name="classifier")


def _shifted(logits, target):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       target[:, 1:].reshape(-1))


def test_a_classifier_read_by_cross_entropy_splits_by_classes():
    """The shifted, reshaped (16, 24) logits: the linear column-parallel, the slices and the
    reshape on each device's 12 classes, the loss all-reduces 3 fp32 numbers per row."""
    lay = megatron_layout(_classifier(_shifted), 2)
    assert lay.placements == {"2.weight": "Shard(0)", "2.bias": "Shard(0)"}
    assert lay.split_ops == {"linear_1", "slice_1", "slice_2", "reshape", "cross_entropy_loss"}
    assert lay.local_ops == frozenset()
    assert lay.reduce_forward == {"cross_entropy_loss": 3 * 16 * 4}
    assert lay.reduce_backward == {"linear_1": 4 * 5 * 16 * 4}  # the layer norm's output


@pytest.mark.parametrize("case", ["undivided", "few_classes", "paired", "class_weights",
                                  "logits_read_twice", "soft_targets"])
def test_classifiers_that_do_not_split_by_classes(case):
    """Classes the degree does not divide; fewer classes than input features (12 of 16: the
    split would all-reduce more than it saves); a linear already row-parallel (a tanh between
    it and the one before: they pair as an MLP); class weights (a third input of the loss);
    logits something else reads too; probabilities as targets (not class indices)."""
    weights = torch.rand(CLASSES)
    loss_fn = {
        "class_weights": lambda out, y: nn.functional.cross_entropy(
            out.reshape(-1, CLASSES), y.reshape(-1), weight=weights),
        "logits_read_twice": lambda out, y: _shifted(out, y) + out.mean(),
        "soft_targets": lambda out, y: nn.functional.cross_entropy(
            out.reshape(-1, CLASSES),
            nn.functional.one_hot(y.reshape(-1), CLASSES).float()),
    }.get(case, _shifted)
    graph = _classifier(loss_fn, classes={"undivided": 18, "few_classes": 12}.get(case, CLASSES),
                        norm=case != "paired")
    lay = megatron_layout(graph, 4 if case == "undivided" else 2)
    assert "cross_entropy_loss" not in lay.split_ops
    assert lay.placement("2.weight") == ("Shard(1)" if case == "paired" else "Replicate()")


def _hf_gpt2():
    """Hugging Face's GPT-2 (tiny): ``Conv1D`` layers, ``addmm(bias, x, weight)`` with an
    ``(in, out)`` weight on the rows of their input."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, use_cache=False,
        bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 128, (4, 16))
    return ex.capture(model, ids, fake=True)


def test_hf_gpt2_conv1d_layers_split_as_transposed_linears():
    lay = megatron_layout(_hf_gpt2(), 2)
    for i in range(2):
        h = f"transformer.h.{i}"
        assert {k: v for k, v in lay.placements.items() if k.startswith(h)} == {
            f"{h}.attn.c_attn.weight": "_StridedShard(dim=1, sf=3)",  # (in, 3 x out)
            f"{h}.attn.c_attn.bias": "_StridedShard(dim=0, sf=3)",
            f"{h}.attn.c_proj.weight": "Shard(0)",  # row-parallel: its bias added once
            f"{h}.mlp.c_fc.weight": "Shard(1)", f"{h}.mlp.c_fc.bias": "Shard(0)",
            f"{h}.mlp.c_proj.weight": "Shard(0)"}
    # one all-reduce per attention and per MLP, and the token embedding's (its ids viewed
    # to (batch, seq) first): split by rows of the vocabulary
    assert len(lay.reduce_forward) == 5
    assert lay.placements["lm_head.weight"] == "Shard(0)"  # (tied: the embedding's weight)
    # the attention's heads can split 2 ways, not 4: the MLPs (and the embedding) still do
    assert all(".mlp." in k or k == "lm_head.weight"
               for k in megatron_layout(_hf_gpt2(), 4).placements)


def _whole_stage(graph):
    """Every op on one stage of two devices, split two ways by tensor parallelism."""
    return ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1")],
                                   {n.name: 0 for n in graph.ops}).with_tensor(2)


def test_a_tensor_degree_that_splits_nothing_says_why():
    torch.manual_seed(0)  # (a norm between the linears, and 4 classes of 8 features)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    graph = ex.capture(model, torch.randn(4, 8), nn.functional.cross_entropy,
                       torch.randint(0, 4, (4,)))
    assert unsplit_notes(graph, _whole_stage(graph)) == (
        "tensor 2 on stage 0 splits nothing: none of its 2 linears, convolutions or embeddings "
        "has a layout it knows (a column- and a row-parallel pair with element-wise ops or "
        "whole heads between, sizes 2 divides, an embedding of token ids); its ops run whole "
        "on each of its 2 tensor devices",)
    mlp = tiny_builtin_graph("mlp")
    assert unsplit_notes(mlp, _whole_stage(mlp)) == ()


def test_sequence_parallelism_that_splits_nothing_says_so():
    """An MLP's linears read (batch, features) rows: nothing runs on sequence shards. A
    Llama's norms do."""
    graph = tiny_builtin_graph("mlp")
    plan = _whole_stage(graph).with_memory(sequence=True)
    assert unsplit_notes(graph, plan) == (
        "sequence parallelism on stage 0 splits nothing along the sequence: no norm or "
        "residual add between its split blocks reads a row-parallel linear's or an "
        "embedding's (batch, seq, features) output; the stage runs as tensor parallelism "
        "alone",)
    llama = tiny_builtin_graph("llama")
    assert unsplit_notes(llama, _whole_stage(llama).with_memory(sequence=True)) == ()
