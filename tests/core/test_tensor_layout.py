"""Tensor-parallel layouts of convolutions: which pairs split by channels, which stay whole."""

from __future__ import annotations

import pytest
import torch
from builders import tiny_builtin_graph
from torch import nn

import explorer as ex
from explorer.core.tensor_layout import megatron_layout, split_dim


def _layout(*layers: nn.Module, degree: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(10))
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
    model(x)  # (sizes the lazy linear)
    graph = ex.capture(model, (x,), nn.functional.cross_entropy, (y,), name="convs")
    return megatron_layout(graph, degree)


def test_conv_relu_conv_splits_by_channels():
    lay = _layout(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
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
    convolution, nothing."""
    alexnet = megatron_layout(tiny_builtin_graph("alexnet"), 2).placements
    assert {k: v for k, v in alexnet.items() if k.startswith("features")} == {
        "features.6.weight": "Shard(0)", "features.6.bias": "Shard(0)",
        "features.8.weight": "Shard(1)"}
    vgg = megatron_layout(tiny_builtin_graph("vgg16"), 2).placements
    for b in range(1, 6):
        assert [vgg.get(f"features.block{b}.conv{c}.weight") for c in (1, 2, 3)] == [
            "Shard(0)", "Shard(1)", None]
    assert megatron_layout(tiny_builtin_graph("resnet"), 2).placements == {}
