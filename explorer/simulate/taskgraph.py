"""The task graph of one step as data: its tasks, their resources and dependencies.

:func:`explorer.simulate.tasks.build_tasks` makes a :class:`TaskGraph`,
:func:`explorer.simulate.schedule.run` schedules it. Tasks are numbered from 0; a task's
attributes are flat lists indexed by task id (``# [task]`` below), which the event loop reads
quickly, rather than one object per task. Task ids are laid out as: the forwards and backwards
of micro-batch 0, of micro-batch 1, ... (one block per micro-batch, made from a per-op
template: :class:`FwdBwdLayout`), then transfers, 1F1B gates, all-reduces and optimizer steps
in the order they were made.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from explorer.core.plan import Plan
from explorer.simulate.arrays import GraphArrays
from explorer.simulate.effects import StageEffects

#: task kinds (``TaskGraph.kind``); a "gate" is a zero-time task that holds a 1F1B stage's
#: forward of a micro-batch until the backward ``warm`` micro-batches earlier is done
FWD, BWD, SEND, ALLREDUCE, OPTIMIZER, GATE = "fwd", "bwd", "send", "allreduce", "optimizer", \
    "gate"

#: a resource: ("stage", s, -1) a stage's devices (resources 0 .. S-1 are the stages, in
#: order); ("link", a, b) the link from stage a to stage b; ("allreduce", s, -1) stage s's
#: gradient all-reduce channel; ("gate", s, m) the gate of stage s's micro-batch m
Resource = tuple[str, int, int]


class Column(Sequence):
    """A per-task attribute kept as the chunks it was made of (lists, or arrays whose items
    are Python values once read), read as one sequence.

    The event loop reads none of these (labels, kinds, micro-batches ...), and a prediction
    reads few of them: one item is found in its chunk, and the whole list is made once, on
    the first read of a slice or an iteration.
    """

    def __init__(self, *chunks: Sequence[Any]) -> None:
        self._chunks: list[Any] = []
        self._ends: list[int] = []
        self._list: list[Any] | None = None
        for c in chunks:
            self.extend(c)

    def extend(self, chunk: Sequence[Any]) -> None:
        """Add ``chunk``'s items (a list or array the column may keep: not changed after)."""
        if len(chunk):
            self._chunks.append(chunk)
            self._ends.append(len(self) + len(chunk))
            self._list = None

    def append(self, item: Any) -> None:
        last = self._chunks[-1] if self._chunks else None
        if type(last) is _Own:
            last.append(item)
            self._ends[-1] += 1
            self._list = None
        else:
            self.extend(_Own([item]))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: Any) -> Any:
        if self._list is None and type(i) is int:
            n = len(self)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError("task index out of range")
            k = bisect_right(self._ends, i)
            c = self._chunks[k]
            i -= self._ends[k] - len(c)
            return c.item(i) if isinstance(c, np.ndarray) else c[i]
        return self.list()[i]

    def __iter__(self) -> Any:
        return iter(self.list())

    def array(self, dtype: Any) -> np.ndarray:
        """The items as one numpy array of ``dtype``."""
        if not self._chunks:
            return np.zeros(0, dtype=dtype)
        return np.concatenate([np.asarray(c, dtype=dtype) for c in self._chunks])

    def list(self) -> list[Any]:
        """The items as one list (made once)."""
        if self._list is None:
            self._list = list(chain.from_iterable(
                c.tolist() if isinstance(c, np.ndarray) else c for c in self._chunks))
        return self._list


class _Own(list):
    """A chunk a :class:`Column` made itself, which it appends to."""


class Repeated(Sequence):
    """A :class:`Column` chunk: one item ``count`` times."""

    def __init__(self, item: Any, count: int) -> None:
        self.item_, self.count = item, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: Any) -> Any:
        return [self.item_] * self.count if isinstance(i, slice) else self.item_

    def __iter__(self) -> Any:
        return iter([self.item_] * self.count)


class Prefixed(Sequence):
    """A :class:`Column` chunk: ``prefix`` before each of ``names`` (an object array), the
    strings made when read."""

    def __init__(self, prefix: str, names: np.ndarray) -> None:
        self.prefix, self.names = prefix, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.prefix + n for n in self.names[i].tolist()]
        return self.prefix + self.names[i]

    def __iter__(self) -> Any:
        return iter([self.prefix + n for n in self.names.tolist()])


@dataclass(frozen=True)
class FwdBwdLayout:
    """Where the forwards and backwards sit among the task ids.

    Each micro-batch has one block of ``per_mb`` tasks, laid out alike: every op's forward,
    each followed by its backward where it has one (a template slot per task). Micro-batch
    ``m``'s task of slot ``k`` is task ``k + m * per_mb``.
    """

    per_mb: int  # tasks per micro-batch block
    fwd: np.ndarray  # [node] int64: slot of the node's forward, -1 for inputs and weights
    bwd: np.ndarray  # [node] int64: slot of the node's backward, -1 where it has none
    stage: np.ndarray  # [slot] int64: the stage that runs it
    dur_s: np.ndarray  # [slot] float64: seconds it takes (the same for every micro-batch)
    # [stage] int64: the stage's forward and backward task ids in the order of their queue
    # keys (the order its device would run them were each ready in time)
    queue: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class Receives:
    """The activations and activation gradients transfers carry to other stages, one entry
    per transfer and micro-batch (weights sent once are not among them)."""

    task: np.ndarray  # [k] int64: the transfer task
    stage: np.ndarray  # [k] int64: the receiving stage
    node: np.ndarray  # [k] int64: the op whose output (or output's gradient) it carries
    mb: np.ndarray  # [k] int64: the micro-batch
    # [k] bool: kept for the backwards that saved it, as activations are (an activation of
    # an op named "grad ..." is not, as the simulator always counted it)
    activation: np.ndarray
    nbytes: np.ndarray  # [k] int64: bytes of the whole tensor per micro-batch


@dataclass(frozen=True)
class TaskGraph:
    """The tasks of one step, their resources, durations, schedule priorities and
    dependencies, and what memory accounting needs to find them again."""

    # per task
    kind: Column  # [task] FWD, BWD, SEND, ALLREDUCE, OPTIMIZER or GATE
    res: list[int]  # [task] index into ``resources``: where it runs, one task at a time
    dur: list[float]  # [task] seconds (may be negative where calibration fits so)
    label: Column  # [task] the op's name, or what the transfer / all-reduce / step is
    mb: Column  # [task] micro-batch, -1 for tasks of the whole step
    nbytes: Column  # [task] bytes moved (transfers, all-reduces), else 0
    node: Column  # [task] the op of a forward or backward, the producer of a transfer, -1
    # [task] the ready queues' order: priority * len(kind) + task id, smallest first (the
    # priority is the schedule slot: GPipe all forwards then all backwards, 1F1B warm-up
    # forwards then one backward per forward, transfers with their consumers)
    key: list[int]
    resources: list[Resource]  # [resource]
    # dependencies: task t's successors are succ_flat[succ_ptr[t]:succ_ptr[t + 1]]
    succ_flat: list[int]  # [edge] task ids, grouped by predecessor
    succ_ptr: list[int]  # [task + 1] offsets into succ_flat
    succ_flat_a: np.ndarray  # succ_flat as int64
    succ_ptr_a: np.ndarray  # succ_ptr as int64
    ndeps: list[int]  # [task] how many tasks it waits for
    first: list[int]  # tasks ready at the start (no dependencies), in id order
    # forward/backward task -> the transfers it receives whose receive may be posted late:
    # [(transfer task, wait seconds, sending stage)] (Link.late_receive_s, as the sender's
    # platform says); empty where no link has such a wait
    late_in: dict[int, list[tuple[int, float, int]]]
    negative_times: bool  # whether some task takes negative time
    # the step
    plan: Plan
    arrays: GraphArrays  # the graph as arrays
    stage: list[int]  # [node] the stage that runs it (the plan's placement)
    stage_a: np.ndarray  # stage as int64
    batch_fraction: list[float]  # [stage] of the batch each of its devices computes per task
    fb: FwdBwdLayout
    receives: Receives
    transfer_bytes: int  # bytes sent between stages in the step
    # bytes the gradient all-reduces move (ring: 2 (k - 1) x size), and with ZeRO the
    # reduce-scatters and all-gathers ((k - 1) x size each)
    allreduce_bytes: int
    # what the plan's memory settings change (None for a plan without them)
    effects: StageEffects | None = None
    # where a stage's devices run kernels apart from the host issuing them (two timelines):
    # [task] when its host has issued it, the earliest it may start, and [task] the host's
    # seconds to issue it (0 for tasks of stages with one timeline, and for transfers and
    # collectives); None where every stage has one timeline
    release: np.ndarray | None = None
    issue_s: np.ndarray | None = None
    # [stage] whether its devices' costs are the segment runtime's (its ranks run segments)
    segment_stages: list[bool] = field(default_factory=list)
