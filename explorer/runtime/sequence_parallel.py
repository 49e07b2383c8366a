"""Sequence parallelism on a tensor-parallel stage (Megatron-LM's): the collectives that move
values between whole-sequence and sequence-split form, as autograd functions on plain local
tensors (DTensor's placements cannot say "this rank's positions" of a value that is not a
DTensor).

A row-parallel linear's partial sums are reduce-scattered along the sequence
(:class:`ScatteredSequence`: its gradient all-gathered back); a column-parallel linear that
reads a sequence shard gathers it in its forward, keeps only the shard for its backward, gathers
it again there for the weight's gradient, and reduce-scatters its input's gradient
(:class:`SequenceColumnLinear`), so no rank ever keeps the whole input. The layout that says
where they run is :func:`~explorer.core.tensor_layout.sequence_split`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: the sequence dimension of a ``(batch, seq, features)`` value, counted from the end
SEQ_DIM = -2


def gather_along(t: torch.Tensor, dim: int, group: Any, degree: int) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim``, in rank order."""
    src = t.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] * degree, *src.shape[1:]))
    dist.all_gather_into_tensor(out, src, group=group)
    return out.movedim(0, dim)


def scatter_along(t: torch.Tensor, dim: int, group: Any, degree: int) -> torch.Tensor:
    """The sum over ranks of ``t``, this rank's part of it along ``dim``."""
    src = t.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // degree, *src.shape[1:]))
    dist.reduce_scatter_tensor(out, src, group=group)
    return out.movedim(0, dim)


class ScatteredSequence(torch.autograd.Function):
    """Partial sums reduce-scattered along the sequence: each rank gets the sum of its
    positions; the gradient of every rank's partial sums is the whole gradient (gathered)."""

    @staticmethod
    def forward(ctx, t, group, degree):  # type: ignore[override]
        ctx.group, ctx.degree = group, degree
        return scatter_along(t, SEQ_DIM, group, degree)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return gather_along(g, SEQ_DIM, ctx.group, ctx.degree), None, None


class SequenceColumnLinear(torch.autograd.Function):
    """``linear(gather(x), weight, bias)`` for a column-parallel linear's local ``weight`` and
    ``bias`` shards and this rank's positions ``x`` of its input: the input gathered in the
    forward and again in the backward (only the shard is kept), its gradient (every rank's
    partial sum) reduce-scattered back to the positions."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, degree):  # type: ignore[override]
        ctx.group, ctx.degree, ctx.has_bias = group, degree, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(gather_along(x, SEQ_DIM, group, degree), weight, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        whole = gather_along(x, SEQ_DIM, ctx.group, ctx.degree)
        grad_x = scatter_along(g @ weight, SEQ_DIM, ctx.group, ctx.degree)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ whole.reshape(-1, whole.shape[-1])
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def reduce_partial_grads(params: list[torch.Tensor], group: Any, local: Any) -> None:
    """All-reduce, over a tensor group, the gradients of the weights that sequence-parallel
    ops read whole (each rank's is the partial sum of its positions), once a step and in one
    collective per dtype (a norm's weights are small: one all-reduce each would be mostly its
    fixed cost); ``local`` gives the tensor a rank holds of a gradient."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
