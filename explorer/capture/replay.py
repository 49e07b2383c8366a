"""Replay one exported node on its input values: FLOPs forward and backward, what autograd
saves for the backward, and whether the output is a view of an input.

The values may be real tensors or fake ones (``FakeTensorMode``): FLOP counting, autograd and
saved-tensor hooks work the same on both. :class:`ReplayCache` reuses a replay for every node
with the same structural signature (op, argument shapes, strides, dtypes and which arguments
need gradients), so the repeated layers of a deep model are replayed once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.node import map_aggregate

from explorer.capture.flops import flop_counter
from explorer.capture.step import CaptureRuntime, tensors_of

#: a saved tensor's owner: the index of an argument tensor, or ``OUTPUT`` for the node itself
OUTPUT = -1


@dataclass(frozen=True)
class Replay:
    """What one node's replay found; ``saves`` name argument slots, not nodes (see OUTPUT)."""

    fwd_flops: int
    bwd_flops: int
    requires_grad: bool
    saves: tuple[int, ...]
    saved_extra_bytes: int
    is_view: bool
    #: the most bytes of gradients passed between the autograd nodes the op is made of
    #: (a cross-entropy's log-softmax gradient) held at once in its backward
    backward_scratch_bytes: int = 0

    def saved_names(self, slot_names: list[str], me: str) -> tuple[str, ...]:
        """The node names behind ``saves``, first occurrence first."""
        out: list[str] = []
        for s in self.saves:
            nm = me if s == OUTPUT else slot_names[s]
            if nm not in out:
                out.append(nm)
        return tuple(out)


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by views), for real and fake tensors alike."""
    return t.untyped_storage()._cdata


def _arguments(fx: Any, runtime: CaptureRuntime, values: dict, grad_of: dict):
    """Fresh copies of a node's arguments; the tensors needing gradients; slot owner names."""
    names = runtime.names
    leaves: list[torch.Tensor] = []
    slot_names: list[str] = []
    slot_of: dict[int, int] = {}

    def fresh(a: Any) -> Any:
        if not isinstance(a, torch.fx.Node):
            return a
        nm = names[a]

        def make(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            t = v.detach().clone()  # clone: in-place ops must not touch the recorded values
            if grad_of.get(nm) and t.is_floating_point():
                t.requires_grad_(True)
                leaves.append(t)
            slot_of[storage_key(t)] = len(slot_names)
            slot_names.append(nm)
            return t

        return map_aggregate(values[nm], make)

    args = map_aggregate(fx.args, fresh)
    kwargs = map_aggregate(fx.kwargs, fresh)
    return args, kwargs, leaves, slot_names, slot_of


def replay(fx: Any, runtime: CaptureRuntime, values: dict, grad_of: dict) -> tuple[Replay,
                                                                                    list[str]]:
    """Run one node on copies of its inputs; the result and the owner name of each slot."""
    args, kwargs, leaves, slot_names, slot_of = _arguments(fx, runtime, values, grad_of)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with flop_counter() as fwd_counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fx.target(*args, **kwargs)
    outs = tensors_of(out)
    out_keys = {storage_key(t) for t in outs}
    is_view = bool(outs) and all(k in slot_of for k in out_keys)
    grads_needed = [t for t in outs if t.requires_grad]
    bwd_flops = scratch = 0
    if grads_needed and leaves:
        passed = _GradientsPassed(grads_needed)
        with flop_counter() as bwd_counter:
            seeds = [torch.ones_like(t) for t in grads_needed]
            made = torch.autograd.grad(grads_needed, leaves, grad_outputs=seeds,
                                       allow_unused=True)
        bwd_flops = bwd_counter.get_total_flops()
        scratch = passed.peak_bytes([*made, *seeds])
    saves: list[int] = []
    extra, seen = 0, set()
    for t in saved:
        k = storage_key(t)
        if k in seen:
            continue
        seen.add(k)
        if k in slot_of:
            saves.append(slot_of[k])
        elif k in out_keys:
            saves.append(OUTPUT)
        else:
            extra += t.untyped_storage().nbytes()
    return (Replay(fwd_counter.get_total_flops(), bwd_flops, bool(grads_needed), tuple(saves),
                   extra, is_view, scratch), slot_names)


class _GradientsPassed:
    """The gradients one op's backward passes between the autograd nodes it is made of, from
    when a node makes each until autograd frees it (a post-hook on every node of the op,
    each gradient's end seen through ``weakref.finalize``): a composite op (a cross-entropy:
    a log-softmax, then a negative log-likelihood) holds its inner gradient while its first
    node computes the gradient of its input."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        self.events: list[tuple[int, int]] = []  # (storage, +bytes made or -bytes freed)
        own: set = set()
        todo = [t.grad_fn for t in outputs]
        while todo:
            node = todo.pop()
            if node is None or node in own or type(node).__name__ == "AccumulateGrad":
                continue
            own.add(node)
            todo.extend(n for n, _ in node.next_functions)
        for node in own:
            inner = [n in own for n, _ in node.next_functions]
            node.register_hook(self._made(inner))

    def _made(self, inner: list[bool]) -> Callable[[Any, Any], None]:
        def hook(grad_inputs: Any, _grad_outputs: Any) -> None:
            for g, passed in zip(grad_inputs, inner, strict=False):
                if passed and isinstance(g, torch.Tensor):
                    key, size = storage_key(g), g.untyped_storage().nbytes()
                    self.events.append((key, size))
                    weakref.finalize(g, self.events.append, (key, -size))
        return hook

    def peak_bytes(self, counted: list[torch.Tensor | None]) -> int:
        """The most bytes of passed gradients held at once, each storage once (a view of a
        gradient is not memory of its own), those that are the memory of a gradient counted
        apart (``counted``: the output's gradient, or one the op returns, as a transpose's)
        left out."""
        apart = {storage_key(g) for g in counted if g is not None}
        views: dict[int, int] = {}  # storage -> gradients held on it
        held = peak = 0
        for key, size in self.events:
            if key in apart:
                continue
            before = views.get(key, 0)
            views[key] = before + (1 if size > 0 else -1)
            if before == 0 or views[key] == 0:
                held += size
                peak = max(peak, held)
        return peak


def _describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device))
    return ("V", repr(v))


class ReplayCache:
    """Replays keyed by structural signature: equal signatures, equal replays."""

    def __init__(self) -> None:
        self.found: dict[Any, Replay] = {}
        self.hits = 0

    def replay(self, fx: Any, runtime: CaptureRuntime, values: dict,
               grad_of: dict) -> tuple[Replay, list[str]]:
        names = runtime.names
        slot_names: list[str] = []

        def sig(a: Any) -> Any:
            if not isinstance(a, torch.fx.Node):
                return ("C", repr(a))
            nm = names[a]

            def one(v: Any) -> Any:
                if isinstance(v, torch.Tensor):
                    slot_names.append(nm)
                    return (*_describe(v), bool(grad_of.get(nm)) and v.is_floating_point())
                return _describe(v)

            return map_aggregate(values[nm], one)

        key = (str(fx.target), repr(map_aggregate(fx.args, sig)),
               repr(map_aggregate(fx.kwargs, sig)))
        hit = self.found.get(key)
        if hit is not None:
            self.hits += 1
            return hit, slot_names
        result, slots = replay(fx, runtime, values, grad_of)
        self.found[key] = result
        return result, slots
