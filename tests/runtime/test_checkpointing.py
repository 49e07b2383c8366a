"""Recomputation of a segment under torch.utils.checkpoint (explorer.runtime.checkpointing): what
each mode keeps, buffers updated once, gradients as without it, and what a CPU rank counts."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from explorer.runtime.accounting import MemTracker
from explorer.runtime.checkpointing import (
    Held,
    checkpointing,
    policy,
    recompute_contexts,
    updates_state,
)

aten = torch.ops.aten


def _code(x, w1, w2, steps):
    """A unit's code as a segment runs it: ATen ops, a step count updated in place."""
    aten.add_.Tensor(steps, 1)
    h = aten.relu.default(aten.mm.default(x, w1))
    return (aten.sum.default(aten.mm.default(h, w2)),)


def _inputs():
    torch.manual_seed(0)
    return (torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True),
            torch.randn(32, 4, requires_grad=True), torch.zeros((), dtype=torch.long))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_policy_keeps_what_the_mode_says(mode):
    keep = policy(mode)
    assert keep(None, aten.add_.Tensor) == CheckpointPolicy.MUST_SAVE  # (mutates: never again)
    assert keep(None, aten.relu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert keep(None, aten.mm.default) == (CheckpointPolicy.MUST_SAVE if mode == "selective"
                                           else CheckpointPolicy.PREFER_RECOMPUTE)


def test_a_full_segment_uses_a_policy_only_where_an_op_updates_state():
    assert updates_state(aten.add_.Tensor) and updates_state(aten.batch_norm.default)
    assert not updates_state(aten.mm.default) and not updates_state(operator.getitem)
    assert checkpointing("full", [aten.mm.default, aten.relu.default, operator.getitem]) \
        == "full"  # (checkpoint alone: no per-op policy to pay for)
    assert checkpointing("full", [aten.batch_norm.default, aten.relu.default]) \
        == "full-keeping-state"
    assert checkpointing("selective", [aten.mm.default]) == "selective"


@pytest.mark.parametrize("counting", [False, True])
def test_full_recomputation_without_a_policy_gives_the_gradients(counting):
    x, w1, w2, _ = _inputs()
    (loss,) = _stateless(x, w1, w2)
    loss.backward()
    plain = [t.grad.clone() for t in (x, w1, w2)]
    x, w1, w2, _ = _inputs()
    tracker = MemTracker()
    held = Held(tracker) if counting else None
    (loss,) = checkpoint(_stateless, x, w1, w2, use_reentrant=False, preserve_rng_state=False,
                         context_fn=recompute_contexts("full", held))
    if counting:
        assert tracker.live == 0  # (nothing kept but the inputs, which the rank counts)
    loss.backward()
    for got, want in zip((x.grad, w1.grad, w2.grad), plain, strict=True):
        assert torch.equal(got, want)
    if counting:
        assert tracker.peak >= 8 * 32 * 4  # (the relu's input, saved by the second run)
        held.release()
        assert tracker.live == 0


def _stateless(x, w1, w2):
    return (aten.sum.default(aten.mm.default(aten.relu.default(aten.mm.default(x, w1)), w2)),)


@pytest.mark.parametrize("mode", ["full-keeping-state", "selective"])
@pytest.mark.parametrize("counting", [False, True])
def test_recomputation_gives_the_gradients_and_updates_a_buffer_once(mode, counting):
    x, w1, w2, steps = _inputs()
    (loss,) = _code(x, w1, w2, steps)
    loss.backward()
    plain = [t.grad.clone() for t in (x, w1, w2)]
    x, w1, w2, steps = _inputs()
    tracker = MemTracker()
    held = Held(tracker) if counting else None
    (loss,) = checkpoint(lambda *a: _code(*a, steps), x, w1, w2, use_reentrant=False,
                         preserve_rng_state=False, context_fn=recompute_contexts(mode, held))
    if counting:  # (the step count kept; with selective both matmul outputs too)
        assert tracker.live == 8 + (8 * 32 + 8 * 4) * 4 * (mode == "selective")
    loss.backward()
    assert int(steps) == 1
    for got, want in zip((x.grad, w1.grad, w2.grad), plain, strict=True):
        assert torch.equal(got, want)
    if counting:
        assert tracker.peak >= 8 * 32 * 4  # (the relu's input, saved by the second run)
        held.release()
        assert tracker.live == 0


def test_what_a_node_lets_go_of_is_counted_until_it_has_made_its_gradients():
    """A value freed while an autograd node runs stays counted until the node is done (a
    device allocates the node's gradients while it still holds it); a count handed over to
    another of the same storage is not a free and goes at once."""
    tracker = MemTracker()
    held, grad = torch.zeros(256), torch.zeros(128)
    tracker.add(held)
    tracker.node_running()
    tracker.drop(held)  # (the node unpacked it and let go of it)
    assert tracker.live == held.nbytes
    tracker.add(grad, "gradients")  # the gradient it makes meanwhile
    assert tracker.peak == held.nbytes + grad.nbytes
    tracker.node_done()
    assert tracker.live == grad.nbytes and tracker.live_by["activations"] == 0
    kept = torch.zeros(64)
    tracker.add(kept)
    tracker.node_running()
    tracker.hand_over(kept)  # (the second run saves it again: counted once throughout)
    tracker.add(kept)
    assert tracker.live == grad.nbytes + kept.nbytes
    tracker.node_done()
    assert tracker.live == grad.nbytes + kept.nbytes
