"""Megatron-LM's collectives for a tensor-parallel stage's plain local tensors, as autograd
functions: partial sums all-reduced (``g``), a whole value whose gradient is all-reduced
(``f``), and local shards gathered whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AllReduced(torch.autograd.Function):
    """Partial sums all-reduced (in place) over a tensor group; the gradient of every rank's
    part is the (replicated) gradient of the sum, as it is (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, t, group):  # type: ignore[override]
        ctx.mark_dirty(t)
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


class PartialGrad(torch.autograd.Function):
    """A whole tensor as it is; its gradient (every rank's partial sum) all-reduced
    (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, t, group):  # type: ignore[override]
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class Gathered(torch.autograd.Function):
    """Local shards all-gathered along their dimension ``dim`` (from the end); the gradient
    of a rank's shard is its part of the (replicated) gradient of the whole."""

    @staticmethod
    def forward(ctx, t, group, index, degree, dim):  # type: ignore[override]
        ctx.index, ctx.width, ctx.dim = index, t.shape[dim], dim
        parts = [torch.empty_like(t) for _ in range(degree)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.narrow(ctx.dim, ctx.index * ctx.width, ctx.width), None, None, None, None
