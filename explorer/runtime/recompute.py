"""Activation recomputation in the op-by-op backward: what an op saves for its backward is
replaced by a reference, and the value recomputed from the unit's kept inputs when the backward
needs it.

A unit is a node's module path cut to its repeated block
(:func:`~explorer.costs.strategies.unit_of`). With "full", only a unit's inputs (values made
outside it) are kept through the forward; whatever its ops save that one of its own ops made is
recomputed, but for outputs an op of another unit saves too, which are kept
(:func:`~explorer.costs.strategies.saved_across_units`). With "selective", outputs of
matmul-like ops (:func:`~explorer.costs.strategies.op_is_matmul_like`) are kept too, and only
the other ops (norms, activations, softmax, dropout, views) are run again. Under autocast, the
2-byte copy a matmul-like op saves of a value its unit recomputes (a norm's fp32 output) is not
kept either: the backward casts the recomputed value again. The simulator reads the same rules.

Why not ``torch.utils.checkpoint``: it recomputes one Python callable's whole forward on the
first unpack, with its own saved-tensor hooks innermost, so it needs the unit's forward as one
call. Here each op's forward is an action of the schedule of its own (receives, sends and other
micro-batches' ops come between them) and each op's backward runs on its own; and the rank's
memory record counts what autograd saves through hooks that checkpoint's would hide. So the
runtime does what non-reentrant checkpointing does, per op: saved-tensor hooks that keep a
reference in the forward, and a forward run again (under ``no_grad``, with the same random seed
and autocast) in the backward; a recomputed value lives until the last backward that needs it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from explorer.costs.strategies import op_is_matmul_like
from explorer.runtime.accounting import MemTracker
from explorer.runtime.layout import RankLayout

# (micro-batch, shard, unit): one unit's forward on one block of the batch
UnitKey = tuple[int, int, str]


class SavedRef:
    """What autograd keeps of a tensor an op saved: the tensor (counted while held), or, once
    the op is done and the tensor found recomputable, where to find it again (and, for the
    2-byte copy autocast made of a recomputable fp32 value, the dtype to cast it to again)."""

    __slots__ = ("cast", "key", "offset", "rec", "size", "stride", "t")

    def __init__(self, rec: Recomputer, t: torch.Tensor) -> None:
        self.rec, self.t, self.key, self.cast = rec, t, None, None
        rec.tracker.add(t)

    def to_reference(self, key: tuple[int, int, int, int],
                     source: torch.Tensor | None = None) -> None:
        """Keep where the tensor is found again: ``key`` (micro-batch, shard, op, output),
        its view's geometry; for a copy, the value it was cast from (``source``) and that
        value's geometry in the op's output."""
        t = self.t
        self.key, self.size, self.stride, self.offset = (key, t.size(), t.stride(),
                                                         t.storage_offset())
        self.cast = None if source is None else (
            t.dtype, source.size(), source.stride(), source.storage_offset())
        self.t = None
        self.rec.tracker.drop(t)

    def unpack(self) -> torch.Tensor:
        return self.t if self.t is not None else self.rec.unpack(self)

    def __del__(self) -> None:
        if self.t is not None:
            self.rec.tracker.drop(self.t)


class Recomputer:
    """Recomputation for one rank's stage.

    ``units[i]`` is node ``i``'s unit key; ``fwd_ops[unit]`` and ``bwd_ops[unit]`` how many
    forward and backward actions of the stage's schedule a micro-batch runs in that unit;
    ``call(m, u, i, lookup)`` runs op ``i`` as the forward did (seed, autocast) on the values
    ``lookup`` gives by node name;
    ``weight(p)`` is parameter or buffer ``p`` for the backward running now;
    ``kept_outputs[i]``: node ``i``'s output is kept, not recomputed, as an op of another unit
    saves it too.
    """

    def __init__(self, layout: RankLayout, mode: str, units: list[str],
                 fwd_ops: dict[str, int], bwd_ops: dict[str, int], tracker: MemTracker,
                 call: Callable[[int, int, int, dict[str, Any]], Any],
                 weight: Callable[[int], torch.Tensor], kept_outputs: list[bool]) -> None:
        self.L, self.mode, self.units = layout, mode, units
        self.kept_outputs = kept_outputs
        self.fwd_ops, self.bwd_ops = fwd_ops, bwd_ops
        self.tracker, self.call, self.weight = tracker, call, weight
        # storage address of an op output alive in the forward: [m, u, node, flat index,
        # the tensor (so the address is not reused meanwhile), how many outputs alias it]
        self.made: dict[int, list] = {}
        self.registered: dict[tuple[int, int, int], list[int]] = {}
        self.kept: dict[UnitKey, dict[int, Any]] = defaultdict(dict)
        self.cache: dict[tuple[int, int, int], list] = {}
        self.pending: dict[tuple[int, int, int], int] = defaultdict(int)
        self.fwd_left: dict[UnitKey, int] = {}
        self.bwd_left: dict[UnitKey, int] = {}
        self.referenced: dict[UnitKey, set[int]] = defaultdict(set)  # ops to run again
        self.fresh: list[SavedRef] = []
        #: the values (by node) the op running now reads
        self.reading: dict[int, Any] = {}

    # -- forward ---------------------------------------------------------------------------
    def before_op(self, m: int, u: int, i: int, values: dict[int, Any]) -> None:
        """Keep what op ``i``'s unit needs to recompute from: ``values`` (by node) made
        outside the unit, and with "selective" matmul-like outputs too."""
        L, unit = self.L, self.units[i]
        kept = self.kept[(m, u, unit)]
        self.reading = values
        for p, val in values.items():
            if p in kept or L.kind[p] in ("param", "buffer"):
                continue
            inside = L.kind[p] == "op" and L.stage[p] == L.s and self.units[p] == unit
            if not inside or (self.mode == "selective" and self._kept_op(p)):
                kept[p] = val
                for t in tree_flatten(val)[0]:
                    if isinstance(t, torch.Tensor):
                        self.tracker.add(t)

    def _kept_op(self, p: int) -> bool:
        return op_is_matmul_like(self.L.calls[p].target)

    def stand_in(self, t: torch.Tensor) -> SavedRef:
        """What autograd keeps of ``t`` while an op's forward runs; settled after the op."""
        ref = SavedRef(self, t)
        self.fresh.append(ref)
        return ref

    def after_op(self, m: int, u: int, i: int, out: Any) -> None:
        """Op ``i`` made ``out``: note its tensors, then turn what the op saved that its unit
        can recompute into references."""
        ptrs = []
        for k, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr == 0:
                continue
            entry = self.made.get(ptr)
            if entry is None:
                self.made[ptr] = [m, u, i, k, t, 1]
            else:  # a view of an output already noted
                entry[5] += 1
            ptrs.append(ptr)
        self.registered[(m, u, i)] = ptrs
        unit = self.units[i]
        kept = self.kept[(m, u, unit)]
        for ref in self.fresh:
            entry = self.made.get(ref.t.untyped_storage().data_ptr())
            source = None
            if entry is None:  # autocast's copy of a value the op read?
                entry, source = self._cast_from(m, u, ref.t)
            if entry is None or (entry[0], entry[1]) != (m, u):
                continue
            h = entry[2]
            if self.units[h] == unit and h not in kept and not self.kept_outputs[h]:
                ref.to_reference((m, u, h, entry[3]), source)
                self.pending[(m, u, h)] += 1
                self.referenced[(m, u, unit)].add(h)
        self.fresh.clear()
        self.reading = {}
        key = (m, u, unit)
        left = self.fwd_left.get(key, self.fwd_ops.get(unit, 0)) - 1
        self.fwd_left[key] = left
        if left <= 0:
            del self.fwd_left[key]
            self._keep_only_needed(key)

    def _cast_from(self, m: int, u: int, t: torch.Tensor
                   ) -> tuple[list | None, torch.Tensor | None]:
        """Where a saved 2-byte tensor no op made comes from, when it is (a view of)
        autocast's copy of an fp32 value of this micro-batch the op reads: that value's
        ``made`` entry and the value; else (None, None). The copy is found by its size and
        checked by value (a weight's copy may have as many elements). Recomputing the value
        and casting it again gives the same copy, as ``torch.utils.checkpoint`` recomputes
        the casts inside a checkpointed forward."""
        if t.dtype not in (torch.bfloat16, torch.float16):
            return None, None
        size = t.untyped_storage().nbytes() // t.element_size()
        for val in self.reading.values():
            for x in tree_flatten(val)[0]:
                if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32
                        and x.numel() == size):
                    continue
                entry = self.made.get(x.untyped_storage().data_ptr())
                if entry is None or (entry[0], entry[1]) != (m, u):
                    continue
                again = x.to(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
                if torch.equal(again, t):
                    return entry, x
        return None, None

    def _keep_only_needed(self, key: UnitKey) -> None:
        """The unit's forward is done: let go of kept values no recomputation starts from."""
        L, kept = self.L, self.kept[key]
        needed: set[int] = set()
        todo, seen = list(self.referenced.pop(key, ())), set()
        while todo:
            h = todo.pop()
            if h in seen:
                continue
            seen.add(h)
            for p in L.preds[h]:
                if p in kept:
                    needed.add(p)
                elif L.kind[p] == "op":
                    todo.append(p)
        for p in [p for p in kept if p not in needed]:
            self._drop(kept.pop(p))

    def released(self, m: int, u: int, i: int) -> None:
        """The forward is done with op ``i``'s output."""
        for ptr in self.registered.pop((m, u, i), []):
            entry = self.made[ptr]
            entry[5] -= 1
            if entry[5] == 0:
                del self.made[ptr]

    # -- backward --------------------------------------------------------------------------
    def unpack(self, ref: SavedRef) -> torch.Tensor:
        m, u, h, k = ref.key
        key = (m, u, h)
        out = self.cache.get(key)
        if out is None:
            out = self._recompute(m, u, h, {})
            self._cache(key, out)
        if ref.cast is None:
            t = out[k].as_strided(ref.size, ref.stride, ref.offset)
        else:  # cast the value again, and take the saved view of the copy
            dtype, size, stride, offset = ref.cast
            copy = out[k].as_strided(size, stride, offset).to(dtype)
            t = copy.as_strided(ref.size, ref.stride, ref.offset)
        self.pending[key] -= 1
        if self.pending[key] == 0:
            self._evict(key)
        return t

    def _recompute(self, m: int, u: int, h: int, memo: dict[int, list]) -> list:
        """Op ``h``'s output on micro-batch ``m``, shard ``u``, as a flat list, run again from
        the kept values (and recomputing the unit's ops between)."""
        L = self.L
        kept = self.kept[(m, u, self.units[h])]
        lookup: dict[str, Any] = {}
        for p in L.preds[h]:
            if L.kind[p] in ("param", "buffer"):
                lookup[L.names[p]] = self.weight(p)
            elif p in kept:
                lookup[L.names[p]] = kept[p]
            else:
                if p not in memo:
                    cached = self.cache.get((m, u, p))
                    if cached is None:
                        cached = self._recompute(m, u, p, memo)
                        if self.pending.get((m, u, p)):  # a later backward unpacks it
                            self._cache((m, u, p), cached)
                    memo[p] = cached
                flat = memo[p]
                lookup[L.names[p]] = (flat[0] if L.spec[p] is None
                                      else tree_unflatten(flat, L.spec[p]))
        with torch.no_grad():
            out = self.call(m, u, h, lookup)
        return tree_flatten(out)[0]

    def _cache(self, key: tuple[int, int, int], out: list) -> None:
        """Keep a recomputed output until the last backward that saved it has unpacked it:
        each recomputed value is made once per micro-batch, as the unit's forward run again
        makes it."""
        self.cache[key] = out
        for t in out:
            if isinstance(t, torch.Tensor):
                self.tracker.add(t)

    def _drop(self, val: Any) -> None:
        for t in tree_flatten(val)[0]:
            if isinstance(t, torch.Tensor):
                self.tracker.drop(t)

    def _evict(self, key: tuple[int, int, int]) -> None:
        self.pending.pop(key, None)
        for t in self.cache.pop(key, []):
            if isinstance(t, torch.Tensor):
                self.tracker.drop(t)

    def backward_done(self, m: int, u: int, i: int) -> None:
        """Op ``i``'s backward on ``m``, ``u`` is done: after its unit's last, let go of what
        the unit kept."""
        unit = self.units[i]
        key = (m, u, unit)
        left = self.bwd_left.get(key, self.bwd_ops.get(unit, 0)) - 1
        self.bwd_left[key] = left
        if left > 0:
            return
        del self.bwd_left[key]
        for val in self.kept.pop(key, {}).values():
            self._drop(val)
        for c in [c for c in self.cache if c[:2] == (m, u) and self.units[c[2]] == unit]:
            self._evict(c)
