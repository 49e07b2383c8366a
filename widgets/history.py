"""Undo and redo of plan edits: snapshots of the plan and its pins, newest last."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import explorer as ex
from explorer.core.errors import ExplorerError

#: how many edits undo remembers
HISTORY = 200


@dataclass(frozen=True)
class Snapshot:
    """What undo brings back: the plan and the pins (node name -> device id)."""

    plan: ex.Plan
    pins: Mapping[str, str]
    label: str


@dataclass
class History:
    """The edits undo would take back and the ones redo would make again."""

    limit: int = HISTORY
    undone: list[Snapshot] = field(default_factory=list)
    done: list[Snapshot] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        """Labels of the edits undo would take back, oldest first."""
        return [s.label for s in self.done]

    def push(self, before: Snapshot) -> None:
        """Remember the state before a new edit (labelled with the edit); redo is lost."""
        self.done.append(before)
        del self.done[:-self.limit]
        self.undone.clear()

    def undo(self, now: Snapshot) -> Snapshot:
        """The state to go back to; ``now`` (the current state) becomes redoable."""
        return self._step(self.done, self.undone, now, "undo")

    def redo(self, now: Snapshot) -> Snapshot:
        """The state to go forward to; ``now`` becomes undoable again."""
        return self._step(self.undone, self.done, now, "redo")

    @staticmethod
    def _step(take: list[Snapshot], give: list[Snapshot], now: Snapshot,
              what: str) -> Snapshot:
        if not take:
            raise ExplorerError(f"nothing to {what}")
        snap = take.pop()
        give.append(Snapshot(now.plan, now.pins, snap.label))
        return snap
