"""The pipeline schedule's part of the task builder: which chunk of its stage each op is in,
the slot each stage's forwards and backwards take (GPipe, 1F1B, interleaved 1F1B), the gates
that hold a stage to that order, and the order of each stage's queue.

:class:`PipelineOrder` is the part of the task builder (:mod:`explorer.simulate.tasks`) that
makes them.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from explorer.core.errors import PlanError
from explorer.simulate.interleave import INTERLEAVED, virtual_stages
from explorer.simulate.taskgraph import GATE

if TYPE_CHECKING:
    from explorer.simulate.tasks import TaskBuilder


class PipelineOrder:
    """Steps of the task builder: chunks, slots and gates of the pipeline schedule."""

    def place_chunks(self: TaskBuilder) -> None:
        """Each op's chunk on its stage: 0 everywhere, but under interleaved 1F1B
        (:mod:`~explorer.simulate.interleave`), whose ``warm`` counts replace 1F1B's."""
        self.virtual = None
        self.chunk = np.zeros(self.A.n, dtype=np.int64)
        if self.plan.schedule != INTERLEAVED:
            return
        if any(self.plan.settings_of(s).zero == 3 for s in self.active):
            raise PlanError("interleaved 1F1B with ZeRO 3 is not modelled: each chunk would "
                            "gather its weights apart; use zero=1 or 2 (Megatron-LM's "
                            "distributed optimizer), or schedule='1f1b'")
        self.virtual = virtual_stages(self.st, self.ops, self.active, self.S, self.M)
        self.warm, self.chunk = self.virtual.warm, self.virtual.chunk

    def schedule_slots(self: TaskBuilder) -> None:
        """Per stage, chunk and micro-batch, the schedule's slot of its forward and its
        backward (GPipe: every forward, then every backward; 1F1B: ``warm`` forwards, then
        one backward and one forward in turn; interleaved 1F1B: the same over each stage's
        chunks, :mod:`~explorer.simulate.interleave`). ``slots_f``/``slots_b``: the first
        chunk's, per stage and micro-batch."""
        S, M = self.S, self.M
        if self.virtual is not None:
            chunk_f, chunk_b = self.virtual.slot_f, self.virtual.slot_b
        elif self.plan.schedule == "gpipe":
            chunk_f = np.tile(np.arange(M), (S, 1, 1))
            chunk_b = chunk_f + M
        else:
            w = np.array([self.warm.get(s, 1) for s in range(S)])[:, None, None]
            m = np.arange(M)[None, None, :]
            chunk_f = np.where(m < w, m, w + 2 * (m - w) + 1)
            chunk_b = w + 2 * m
        self.chunk_slots_f = np.asarray(chunk_f, dtype=np.int64)
        self.chunk_slots_b = np.asarray(chunk_b, dtype=np.int64)
        self.slots_f = self.chunk_slots_f[:, 0, :]
        self.slots_b = self.chunk_slots_b[:, 0, :]

    def one_f_one_b_gates(self: TaskBuilder) -> None:
        """1F1B: at most ``warm`` micro-batches in flight on a stage (a gate task between a
        micro-batch's backward and the forward ``warm`` micro-batches later); interleaved
        1F1B: each stage runs its chunks' forwards and backwards one after another in
        Megatron-LM's order (a gate between each and the next)."""
        if self.plan.schedule == "gpipe" or self.M <= 1:
            return
        if self.virtual is not None:
            self._interleaved_gates()
            return
        has_b = self.A.has_b
        for s in self.active:
            w = self.warm[s]
            ops = self.ops_by_stage[s]
            fo = self.off_f[ops]
            bo = self.off_b[ops[has_b[ops]]]
            if not len(bo):
                continue
            for m in range(w, self.M):
                gate = self.task(GATE, self.resource(("gate", s, m - w)), 0.0, self.prio(0),
                                 "", m - w)
                self.edges.add(bo, np.full(len(bo), gate), m - w)
                self.edges.add(np.full(len(fo), gate), fo, 0, m)

    def _interleaved_gates(self: TaskBuilder) -> None:
        """Per stage, its (chunk, micro-batch) forwards and backwards chained in slot order:
        a block starts once the one before it is done, as Megatron-LM and torch's
        ``ScheduleInterleaved1F1B`` run them (a stage waits for a chunk's input rather than
        run ahead)."""
        vs, has_b = self.virtual, self.A.has_b
        for s in self.active:
            ops = self.ops_by_stage[s]
            blocks = []
            for c in range(vs.chunks):
                mine = ops[self.chunk[ops] == c]
                fo, bo = self.off_f[mine], self.off_b[mine[has_b[mine]]]
                for m in range(self.M):
                    blocks.append((int(vs.slot_f[s, c, m]), fo, m))
                    if len(bo):
                        blocks.append((int(vs.slot_b[s, c, m]), bo, m))
            blocks.sort(key=lambda b: b[0])
            for k, ((_, before, m0), (_, after, m1)) in enumerate(pairwise(blocks)):
                gate = self.task(GATE, self.resource(("gate", s, k)), 0.0, self.prio(0), "",
                                 m0)
                self.edges.add(before, np.full(len(before), gate), m0)
                self.edges.add(np.full(len(after), gate), after, 0, m1)


def queue_order(tpl_stage: np.ndarray, tpl_chunk: np.ndarray, tpl_isb: np.ndarray,
                 slot_f: np.ndarray, slot_b: np.ndarray, per_m: int
                 ) -> tuple[np.ndarray, ...]:
    """Per stage, its forward and backward task ids in the order of their queue keys
    ((slot, x) with x the node for a forward, minus the node for a backward): block by block
    in slot order, a block being one micro-batch's forwards of one chunk in node order or its
    backwards in reverse node order (the template lays ops out in node order);
    ``slot_f``/``slot_b`` are [stage][chunk][micro-batch]."""
    out = []
    for s in range(len(slot_f)):
        blocks = []
        for c in range(slot_f.shape[1]):
            here = (tpl_stage == s) & (tpl_chunk == c)
            fwd = np.flatnonzero(here & ~tpl_isb)
            bwd = np.flatnonzero(here & tpl_isb)[::-1]
            if len(fwd) or len(bwd) or c == 0:
                blocks += [(int(slot), m, fwd) for m, slot in enumerate(slot_f[s, c])]
                blocks += [(int(slot), m, bwd) for m, slot in enumerate(slot_b[s, c])]
        blocks.sort(key=lambda b: b[0])
        out.append(np.concatenate([tpl + m * per_m for _, m, tpl in blocks]) if blocks else
                   np.zeros(0, dtype=np.int64))
    return tuple(out)
