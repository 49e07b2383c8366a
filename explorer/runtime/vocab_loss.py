"""Vocabulary-parallel cross-entropy on a tensor-parallel stage (Megatron-LM's
``vocab_parallel_cross_entropy``): each rank holds the logits of its share of the classes, from
a column-parallel linear (:mod:`explorer.core.tensor_layout`), and the loss never gathers them.

The shape ops between the linear and the loss run on the rank's share (a view's or reshape's
class count divided by the degree); the loss all-reduces each row's largest logit (MAX), then
the target's logit (on the rank that holds it) and the sum of exponentials (SUM, together), and
is whole on every rank; its backward needs no communication (the softmax of the rank's classes
less the one-hot of the targets among them). A loss with class weights or label smoothing runs
whole, on gathered logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from explorer.core.errors import ExplorerError
from explorer.core.tensor_layout import LOSS_OPS, POINTWISE, RESHAPE_OPS, VOCAB_OPS

#: the split ops :func:`on_vocab` runs (those of :data:`VOCAB_OPS` that are not element-wise
#: run on local shards as any split op does)
VOCAB_CALLS = frozenset(LOSS_OPS) | (VOCAB_OPS - POINTWISE)
#: ``reduction`` of ATen's losses: none, mean, sum
_NONE, _MEAN, _SUM = 0, 1, 2


def on_vocab(mesh: Any, fn: Any, args: Any, kwargs: Any) -> Any:
    """``fn`` (of :data:`VOCAB_CALLS`) on ``mesh``'s rank's share of the classes of its first
    argument (the last dimension; this rank's part of it where that is whole): a view's or
    reshape's class count divided by the degree, a slice as it is (it keeps the classes), a
    loss vocabulary-parallel (:class:`VocabCrossEntropy`)."""
    x = args[0] if mesh.is_shard(args[0]) else mesh.narrowed(args[0], -1)
    if str(fn) in LOSS_OPS:
        return _loss(mesh, fn, x, args, kwargs)
    rest = list(args[1:])
    if str(fn) in RESHAPE_OPS:
        rest[0] = vocab_shape(list(rest[0]), mesh.degree)
    return mesh.marked(fn(x, *rest, **kwargs), -1)


def vocab_shape(shape: list[int], degree: int) -> list[int]:
    """A view's or reshape's ``shape`` (of the whole logits) for a rank's share of the classes
    (the last dimension; -1 stays, it is inferred)."""
    if shape and shape[-1] != -1:
        if shape[-1] % degree:
            raise ExplorerError(f"cannot split a view to {shape} by classes {degree} ways; run "
                                "the loss whole (tensor degree 1 on its stage)")
        shape[-1] //= degree
    return shape


def _loss(mesh: Any, fn: Any, x: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
    """The cross-entropy ``fn(*args, **kwargs)`` of this rank's share ``x`` of the logits."""
    bound = dict(zip((a.name for a in fn._schema.arguments), args, strict=False)) | kwargs
    target, weight = bound["target"], bound.get("weight")
    reduction = int(bound.get("reduction", _MEAN))
    if weight is not None or float(bound.get("label_smoothing", 0.0)):
        return fn(mesh.gathered(mesh.marked(x, -1)), *args[1:], **kwargs)
    return VocabCrossEntropy.apply(x, target, mesh.group, mesh.index * x.shape[-1], reduction,
                                   int(bound.get("ignore_index", -100)))


class VocabCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits ``(N, classes / degree)`` (this rank's classes, from ``start``)
    against whole class indices ``(N,)``, as one device computes it of the whole logits
    (``reduction`` and ``ignore_index`` as ATen's): all-reduces of three numbers per row in the
    forward (the maximum, then the target's logit and the sum of exponentials together), none
    in the backward."""

    @staticmethod
    def forward(ctx, logits, target, group, start, reduction, ignore_index):  # type: ignore[override]
        x = logits.detach().float()
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        at = target - start
        valid = target != ignore_index
        mine = valid & (at >= 0) & (at < x.shape[-1])
        at = torch.where(mine, at, torch.zeros_like(at))
        picked = torch.where(mine, x.gather(-1, at.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = x.exp_()  # (of the logits less the row's maximum, in place)
        sums = torch.stack([exp.sum(dim=-1), picked])
        dist.all_reduce(sums, group=group)
        loss = torch.where(valid, sums[0].log() - sums[1], 0.0)
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, at, mine, valid)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        ctx.count = valid.sum()
        if reduction == _MEAN:
            loss = loss.sum() / ctx.count
        elif reduction == _SUM:
            loss = loss.sum()
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        softmax, at, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, at.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        scale = valid * (g.float() / ctx.count if ctx.reduction == _MEAN else g.float())
        return grad.mul_(scale.unsqueeze(-1)).to(ctx.dtype), None, None, None, None, None
