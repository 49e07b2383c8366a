"""Memory accounting of a CPU rank: the bytes of the tensor storages it holds or autograd saved.

A GPU rank reads its allocator's peak instead; on CPU there is no allocator to ask, so the rank
counts every storage it creates, receives or has autograd save, once per storage, under the
category of memory it is (:data:`CATEGORIES`, the simulator's names), so a peak can be told
apart as the simulator predicts it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

#: what a counted storage holds; a storage keeps the category of its first count
PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, GATHERED, BUFFERS = (
    "parameters", "gradients", "optimizer state", "activations", "gathered", "buffers")
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, GATHERED, BUFFERS)


class MemTracker:
    """Tensor accounting on CPU: bytes of the storages the rank holds or autograd saved.

    While :meth:`deferred` is active, frees wait until it ends: autograd computes a node's input
    gradients before it releases what the node saved, so an op's backward is accounted as all its
    allocations first, then its frees (the order the memory is really held in).
    """

    def __init__(self) -> None:
        self.refs: dict[int, list] = {}  # storage address: [count, bytes, category]
        self.live = 0
        self.peak = 0
        self.live_by: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        #: bytes of each category at the moment of :attr:`peak`
        self.peak_by: dict[str, int] = dict(self.live_by)
        self._held: list[torch.Tensor] | None = None
        #: while an autograd node runs (:meth:`node_running`): (bytes, category) of the
        #: storages freed meanwhile, still counted
        self._freed_in_node: list[tuple[int, str]] | None = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Frees (``drop``) inside the block take effect when it ends."""
        outer, self._held = self._held, []
        try:
            yield
        finally:
            held, self._held = self._held, outer
            for t in held:
                self.drop(t)

    def add(self, t: torch.Tensor, category: str = ACTIVATIONS) -> None:
        st = _storage(t)
        key = st.data_ptr()
        if key == 0:
            return
        ref = self.refs.get(key)
        if ref is None:
            self.refs[key] = [1, st.nbytes(), category]
            self.live += st.nbytes()
            self.live_by[category] += st.nbytes()
            if self.live > self.peak:
                self.peak = self.live
                self.peak_by = dict(self.live_by)
        else:
            ref[0] += 1

    def drop(self, t: torch.Tensor) -> None:
        if self._held is not None:
            self._held.append(t)  # (keeps the storage, so its address is not reused meanwhile)
            return
        self.forget(storage_key(t))

    def forget(self, key: int) -> None:
        """Drop one count of the storage at address ``key`` (:func:`storage_key`), at once."""
        ref = self.refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self.refs[key]
            if self._freed_in_node is not None:
                self._freed_in_node.append((ref[1], ref[2]))
                return
            self.live -= ref[1]
            self.live_by[ref[2]] -= ref[1]

    def hand_over(self, t: torch.Tensor) -> None:
        """Drop one count of ``t``'s storage at once, also while a node runs: what another
        count of the same storage takes over (not a free)."""
        running, self._freed_in_node = self._freed_in_node, None
        try:
            self.drop(t)
        finally:
            self._freed_in_node = running

    def node_running(self) -> None:
        """An autograd node's backward starts: what is freed while it runs (a value it
        unpacked, which checkpoint made again for it alone) stays counted until
        :meth:`node_done`, as a device holds it while the node makes its gradients."""
        self.node_done()
        self._freed_in_node = []

    def node_done(self) -> None:
        """The node's backward has made its gradients (counted): what it freed goes."""
        freed, self._freed_in_node = self._freed_in_node, None
        for nbytes, category in freed or ():
            self.live -= nbytes
            self.live_by[category] -= nbytes

    def move(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Count ``new``'s storage in place of ``old``'s, at once (a copy that replaces the
        tensor it is made from: its references and category carry over, also inside
        :meth:`deferred`)."""
        ref = self.refs.pop(_storage(old).data_ptr(), None)
        if ref is None:
            return
        nbytes = _storage(new).nbytes()
        self.refs[_storage(new).data_ptr()] = [ref[0], nbytes, ref[2]]
        self.live += nbytes - ref[1]
        self.live_by[ref[2]] += nbytes - ref[1]

    @contextlib.contextmanager
    def transient(self, nbytes: int, category: str = GRADIENTS) -> Iterator[None]:
        """``nbytes`` more held for the length of the block (a tensor autograd makes and
        frees inside it, out of the rank's sight)."""
        self.live += nbytes
        self.live_by[category] += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by = dict(self.live_by)
        try:
            yield
        finally:
            self.live -= nbytes
            self.live_by[category] -= nbytes

    def reset_peak(self) -> None:
        self.node_done()
        self.peak = self.live
        self.peak_by = dict(self.live_by)

    def saving(self, stand_in: Callable[[torch.Tensor], Any] | None = None
               ) -> torch.autograd.graph.saved_tensors_hooks:
        """A context in which every tensor autograd saves is counted while it is held.

        ``stand_in(t)`` may give what autograd keeps instead of ``t`` (an object whose
        ``unpack()`` gives the tensor back in the backward), or None to keep ``t`` itself.
        """
        def pack(t: torch.Tensor) -> Any:
            kept = stand_in(t) if stand_in is not None else None
            return kept if kept is not None else SavedTensor(t, self)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.unpack())


def count_gradients_made(tracker: MemTracker, roots: Iterable[Any], hooked: set,
                         boundary: Callable[[Any], bool]) -> None:
    """Count in ``tracker`` every gradient a backward makes at the autograd nodes reachable
    from ``roots`` (output tensors) before a ``boundary`` node, from when the node makes it
    until it is freed (a post-hook on each node not in ``hooked``, which it joins).

    Autograd frees a node's incoming gradient and what it saved only after the node has made
    its gradients, as the op path counts them; gradients flowing between ops of one piece of
    code, or between the autograd nodes of one op, are otherwise seen by no hook of the
    rank's. What is freed while a node runs (a value checkpoint made again for it, which it
    unpacked and let go of) stays counted until the node has made its gradients
    (:meth:`MemTracker.node_running`): a device allocates those while it still holds it."""
    def hook(node: Any) -> Callable[[Sequence[Any], Sequence[Any]], None]:
        # (a gradient handed to a weight's accumulation is the weight's gradient)
        kinds = [GRADIENTS if type(n).__name__ == "AccumulateGrad" else ACTIVATIONS
                 for n, _ in node.next_functions]

        def made(grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> None:
            for g, kind in zip(grad_inputs, kinds, strict=False):
                if isinstance(g, torch.Tensor):
                    tracker.add(g, kind)
                    weakref.finalize(g, tracker.forget, storage_key(g))
            tracker.node_done()

        return made

    def running(grad_outputs: Sequence[Any]) -> None:
        tracker.node_running()

    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in hooked or boundary(node):
            continue
        hooked.add(node)
        node.register_prehook(running)
        node.register_hook(hook(node))
        todo.extend(n for n, _ in node.next_functions)


def storage_key(t: torch.Tensor) -> int:
    """The address of the storage ``t`` uses on this rank (what the tracker counts by)."""
    return _storage(t).data_ptr()


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage a tensor uses on this rank (a DTensor's: its local shard's)."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


class SavedTensor:
    """What autograd keeps for a saved tensor: the tensor, counted while it is held."""

    __slots__ = ("t", "tracker")

    def __init__(self, t: torch.Tensor, tracker: MemTracker) -> None:
        self.t, self.tracker = t, tracker
        tracker.add(t)

    def unpack(self) -> torch.Tensor:
        return self.t

    def __del__(self) -> None:
        self.tracker.drop(self.t)
