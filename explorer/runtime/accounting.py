"""Memory accounting of a CPU rank: the bytes of the tensor storages it holds or autograd saved.

A GPU rank reads its allocator's peak instead; on CPU there is no allocator to ask, so the rank
counts every storage it creates, receives or has autograd save, once per storage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor


class MemTracker:
    """Tensor accounting on CPU: bytes of the storages the rank holds or autograd saved.

    While :meth:`deferred` is active, frees wait until it ends: autograd computes a node's input
    gradients before it releases what the node saved, so an op's backward is accounted as all its
    allocations first, then its frees (the order the memory is really held in).
    """

    def __init__(self) -> None:
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0
        self._held: list[torch.Tensor] | None = None

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

    def add(self, t: torch.Tensor) -> None:
        st = _storage(t)
        key = st.data_ptr()
        if key == 0:
            return
        ref = self.refs.get(key)
        if ref is None:
            self.refs[key] = [1, st.nbytes()]
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1

    def drop(self, t: torch.Tensor) -> None:
        if self._held is not None:
            self._held.append(t)  # (keeps the storage, so its address is not reused meanwhile)
            return
        key = _storage(t).data_ptr()
        ref = self.refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]

    def reset_peak(self) -> None:
        self.peak = self.live

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context in which every tensor autograd saves is counted while it is held."""
        return torch.autograd.graph.saved_tensors_hooks(lambda t: SavedTensor(t, self),
                                                        lambda s: s.t)


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

    def __del__(self) -> None:
        self.tracker.drop(self.t)
