"""Recomputation in a segment: ``torch.utils.checkpoint`` (non-reentrant) around each run of a
unit's ops, with a policy from ``create_selective_checkpoint_contexts``, and what it holds
counted on a CPU rank.

The rule is the simulator's and the op path's (:mod:`explorer.runtime.recompute`): a unit keeps
its inputs through the forward, with "selective" its matmul-like ops' outputs too
(:func:`~explorer.costs.strategies.op_is_matmul_like`); everything else (with "selective":
norms, activations, softmax, dropout, views) runs again in the backward. An op that writes
into its input (a batch norm's step count) is never run again: its result is kept, so the
buffers it updates move once per step, as without recomputation (its kept result, the
buffer, may move again later in the step: nothing differentiates it).

On CPU there is no allocator to ask (:mod:`explorer.runtime.accounting`), and checkpoint's own
saved-tensor hooks hide what the ops save from the rank's. The inputs checkpoint keeps pass
through the rank's hooks and are counted there; the outputs the policy keeps are counted from
the forward until the backward's second run, and what that run saves (seen on its way to
checkpoint's hooks) while autograd holds it (:class:`Held`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from explorer.costs.strategies import op_is_matmul_like
from explorer.runtime.accounting import MemTracker, storage_key

RecomputeMode = Literal["full", "selective"]
#: how a segment is checkpointed: "full" as ``checkpoint`` alone does it (every op runs again),
#: "full-keeping-state" the same but an op that updates state (a batch norm's running
#: statistics) is kept, "selective" keeps matmul-like ops' outputs too; the last two through
#: a policy that sees every op (torch's selective checkpointing), which costs per op
Checkpointing = Literal["full", "full-keeping-state", "selective"]

#: argument names of ops that update what they are given (a normalization's running statistics)
_STATE_ARGUMENTS = frozenset({"running_mean", "running_var"})


def updates_state(target: Any) -> bool:
    """Whether an op (an ATen op overload; other callables never) writes into an argument:
    its schema says so, or it takes running statistics (``batch_norm``'s schema does not say
    it updates them; the op it dispatches to does)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return schema.is_mutable or any(a.name in _STATE_ARGUMENTS for a in schema.arguments)


def checkpointing(mode: RecomputeMode, targets: list[Any]) -> Checkpointing:
    """How to checkpoint a segment of ops ``targets`` under ``mode`` (:data:`Checkpointing`):
    "full" runs every op again unless one updates state, which must run once."""
    if mode == "selective":
        return "selective"
    return "full-keeping-state" if any(updates_state(t) for t in targets) else "full"


def policy(mode: RecomputeMode) -> Callable[..., CheckpointPolicy]:
    """What ``mode`` keeps of an op (``func``, an ATen op): a mutating op's result always,
    a matmul-like op's with "selective"; every other op runs again."""
    def keep(ctx: SelectiveCheckpointContext, func: Any, *args: Any,
             **kwargs: Any) -> CheckpointPolicy:
        if func._schema.is_mutable or (mode == "selective" and op_is_matmul_like(str(func))):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return keep


class Held:
    """What one segment's recomputation holds on one block of the batch, counted: the
    outputs its forward keeps (until the backward's second run starts, which takes
    them over), and what that run saves (each until autograd lets go of it, the rest when the
    segment's backward ends: :meth:`release`)."""

    def __init__(self, tracker: MemTracker) -> None:
        self.tracker = tracker
        self.kept: list[torch.Tensor] = []
        self.saved: list[weakref.finalize] = []

    def keep(self, value: Any) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                self.tracker.add(t)
                self.kept.append(t)

    def let_go_of_kept(self) -> None:
        for t in self.kept:  # (the second run, which starts, saves them: it takes them over)
            self.tracker.hand_over(t)
        self.kept.clear()

    def save(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t``, saved by the second run, while the alias of it returned is alive."""
        alias = t.detach()
        self.tracker.add(alias)
        self.saved.append(weakref.finalize(alias, self.tracker.forget, storage_key(alias)))
        return alias

    def release(self) -> None:
        self.let_go_of_kept()
        for done in self.saved:
            done()
        self.saved.clear()


@contextlib.contextmanager
def _counting_saves(held: Held) -> Iterator[None]:
    """Inside checkpoint's second run: count each value handed to its saved-tensor hooks
    (what the backward saves) while it is held, and hand it on to them. (Only the innermost
    saved-tensor hooks see a tensor: torch has no public way to stack a pair over another, so
    checkpoint's are read from the top of autograd's stack.)"""
    pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
    held.let_go_of_kept()

    def counted(t: torch.Tensor) -> Any:
        return pack(held.save(t))

    with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
        yield


def recompute_contexts(how: Checkpointing, held: Held | None
                       ) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for ``torch.utils.checkpoint``: none for "full", else torch's
    selective checkpointing under :func:`policy`; with ``held`` (a CPU rank's memory step),
    the kept outputs and the second run's saved values are counted in it as well."""
    if how == "full":
        if held is None:
            return noop_context_fn
        return lambda: (contextlib.nullcontext(), _counting_saves(held))
    keep = policy("selective" if how == "selective" else "full")
    if held is None:
        return partial(create_selective_checkpoint_contexts, keep,
                       allow_cache_entry_mutation=True)

    def counting_policy(ctx: SelectiveCheckpointContext, func: Any, *args: Any,
                        **kwargs: Any) -> CheckpointPolicy:
        chosen = keep(ctx, func, *args, **kwargs)
        if chosen == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            held.keep(ctx.op_output)
        return chosen

    def contexts() -> tuple[Any, Any]:
        forward, again = create_selective_checkpoint_contexts(
            counting_policy, allow_cache_entry_mutation=True)

        @contextlib.contextmanager
        def counted_again() -> Iterator[None]:
            with again, _counting_saves(held):
                yield

        return forward, counted_again()

    return contexts
