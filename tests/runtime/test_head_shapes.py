"""The rules that follow a rank's heads through an attention core's shape ops."""

from __future__ import annotations

import pytest
import torch

from explorer.runtime.head_shapes import (
    expanded_sizes,
    transposed_dim,
    unsqueezed_dim,
    view_of_heads,
)


def _shard(whole: torch.Tensor, dim: int, degree: int, rank: int) -> torch.Tensor:
    return whole.chunk(degree, dim)[rank]


@pytest.mark.parametrize("whole_shape, dim, target", [
    ((2, 5, 12), -1, [2, 5, 4, 3]),          # features into (heads, head_dim)
    ((2, 5, 12), -1, [2, 5, -1, 3]),         # ... with the head count inferred
    ((10, 12), -1, [2, 5, 12]),              # a transposed linear's rows back to (b, s, f)
    ((2, 5, 4, 3), -2, [2, 5, 12]),          # heads merged back to features
    ((2, 5, 4, 3), -2, [-1, 12]),            # ... and flattened to rows
    ((2, 2, 3, 5, 3), -4, [2, 6, 5, 3]),     # grouped key-value heads repeated, merged
    ((2, 1, 4, 3), -2, [2, 1, 12]),          # a sequence of one
])
def test_a_view_of_a_shard_is_the_shard_of_the_view(whole_shape, dim, target):
    """Every rank's view of its shard is its shard of the whole view."""
    whole = torch.arange(torch.Size(whole_shape).numel()).reshape(whole_shape)
    viewed = whole.reshape(target)
    for rank in range(2):
        view = view_of_heads(_shard(whole, dim, 2, rank).shape, dim, target, 2)
        assert view is not None
        shape, split = view
        torch.testing.assert_close(_shard(whole, dim, 2, rank).reshape(shape),
                                   _shard(viewed, split, 2, rank))


@pytest.mark.parametrize("whole_shape, dim, target", [
    ((2, 4, 3), -2, [8, 3]),                 # heads merged with the batch before them
    ((2, 4, 3), -2, [24]),
    ((4, 6), -1, [4, 3, 2]),                 # 3 features a rank across 2 of 3 groups
])
def test_a_view_that_mixes_the_heads_with_other_dimensions_has_no_split(whole_shape, dim,
                                                                         target):
    local = list(whole_shape)
    local[dim] //= 2
    assert view_of_heads(local, dim, target, 2) is None


def test_transpose_unsqueeze_and_expand_follow_the_heads():
    whole = torch.randn(2, 2, 5, 3)  # (batch, kv heads, seq, head_dim), heads at -3
    moved = whole.transpose(1, 2)
    assert transposed_dim(4, -3, 1, 2) == -2
    torch.testing.assert_close(_shard(whole, -3, 2, 1).transpose(1, 2), _shard(moved, -2, 2, 1))
    assert transposed_dim(4, -1, 1, 2) == -1  # (a dimension the transpose leaves)
    assert unsqueezed_dim(4, -3, 2) == -4
    assert unsqueezed_dim(4, -3, 0) == -3
    grown = whole.unsqueeze(2).expand(2, 2, 3, 5, 3)  # each key-value head for 3 query heads
    local = _shard(whole, -3, 2, 0).unsqueeze(2)
    sizes = expanded_sizes(local.shape, -4, [2, 2, 3, 5, 3])
    assert sizes == [2, 1, 3, 5, 3]
    torch.testing.assert_close(local.expand(sizes), _shard(grown, -4, 2, 0))
