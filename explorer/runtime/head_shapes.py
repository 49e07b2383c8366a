"""Where a rank's own heads lie in the tensors of a head-split attention core, op by op.

Inside the core each rank holds its heads' part of every tensor as a plain local shard, split
along one dimension: the features after a column-parallel projection, ``(batch, seq, heads *
head_dim)``; the heads once viewed as ``(batch, seq, heads, head_dim)``; then wherever the
core's shape ops move them (a transpose to ``(batch, heads, seq, head_dim)``, an unsqueeze and
expand that repeat grouped key-value heads, a reshape that merges them back). These rules
follow that dimension through the shape ops and give each shape op's sizes for the local
shard. Dimensions are counted from the end (negative), as broadcasting aligns them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def whole_shape(local: Sequence[int], dim: int, degree: int) -> list[int]:
    """The whole tensor's shape of a local shard split ``degree`` ways along ``dim``."""
    whole = list(local)
    whole[dim] *= degree
    return whole


def view_of_heads(local: Sequence[int], dim: int, target: Sequence[int], degree: int
                  ) -> tuple[list[int], int] | None:
    """A view or reshape of a local shard (shape ``local``, split along ``dim``) to the whole
    shape ``target``: the shape to view the shard to, and the dimension it is then split
    along. The split carries over to the target dimension that starts where the split one
    starts in memory (the same product of sizes before it) and that ``degree`` divides; None
    where there is none (the view mixes the heads with other dimensions)."""
    whole = whole_shape(local, dim, degree)
    total = math.prod(whole)
    if -1 in target:
        known = math.prod(n for n in target if n != -1)
        if known == 0 or total % known:
            return None
        target = [total // known if n == -1 else n for n in target]
    if math.prod(target) != total:
        return None
    before = math.prod(whole[:len(whole) + dim])
    acc = 1
    for d, size in enumerate(target):
        if acc == before and size > 1 and size % degree == 0:
            shard = list(target)
            shard[d] //= degree
            return shard, d - len(target)
        acc *= size
        if acc > before:
            break
    return None


def transposed_dim(ndim: int, dim: int, a: int, b: int) -> int:
    """The split dimension after ``transpose(a, b)`` of a tensor of ``ndim`` dimensions."""
    p, a, b = ndim + dim, a % ndim, b % ndim
    p = b if p == a else a if p == b else p
    return p - ndim


def unsqueezed_dim(ndim: int, dim: int, at: int) -> int:
    """The split dimension after ``unsqueeze(at)`` of a tensor of ``ndim`` dimensions."""
    p, at = ndim + dim, at % (ndim + 1)
    return (p + 1 if at <= p else p) - (ndim + 1)


def expanded_sizes(local: Sequence[int], dim: int, sizes: Sequence[int]) -> list[int]:
    """``expand``'s whole ``sizes`` for a local shard: the split dimension keeps the shard's
    size (its whole is the heads, not a dimension of size 1 broadcast)."""
    out = list(sizes)
    out[len(out) + dim] = local[dim]
    return out
