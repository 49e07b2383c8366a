"""Signs of life between the ranks of a real run and their launcher.

Each rank started by ``ex.run`` rewrites ``beat-RANK.json`` in the job folder every
:data:`PERIOD_S` seconds from a thread of its own: the step it is at and the rank it is blocked
on (a receive), if any. A stopped process (SIGSTOP, a frozen machine) stops writing, whatever
its main thread was doing, so the launcher names it within :data:`SILENT_S` seconds instead of
waiting for the run's whole time limit; when the time limit does end a run, the beats say which
ranks were computing and which were waiting for another.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

#: seconds between two beats of a rank
PERIOD_S = 1.0
#: a rank whose last beat is older than this is taken as stopped
SILENT_S = 20.0
#: a rank that has not beaten once this long after its start is taken as stopped (importing
#: torch and joining the process group come first)
STARTUP_S = 120.0
#: the environment variable that asks a rank to beat (set by the launcher)
ENV = "EXPLORER_HEARTBEAT"
#: ``waiting_for`` of a rank blocked in a collective (barrier, all-reduce)
EVERYONE = -1


def beat_path(folder: Path, rank: int) -> Path:
    return folder / f"beat-{rank}.json"


class Heartbeat:
    """One rank's beating thread. The rank sets :attr:`step`; :attr:`messenger` (set once the
    rank has one) says through its ``waiting_for`` which rank it is blocked on."""

    def __init__(self, folder: Path, rank: int, period_s: float = PERIOD_S) -> None:
        self.path = beat_path(folder, rank)
        self.period_s = period_s
        self.step = 0
        self.messenger: Any = None

    def start(self) -> Heartbeat:
        threading.Thread(target=self._loop, daemon=True, name="heartbeat").start()
        return self

    def _loop(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        while True:
            try:
                peer = getattr(self.messenger, "waiting_for", None)
                tmp.write_text(json.dumps({"step": self.step, "waiting_for": peer,
                                           "pid": os.getpid()}))
                tmp.replace(self.path)
            except OSError:
                pass  # the folder is gone: the launcher is ending the run
            time.sleep(self.period_s)


def wanted() -> bool:
    """Whether this rank was asked to beat (ranks under torchrun, of an exported script, not)."""
    return os.environ.get(ENV) == "1"


def last_beat(folder: Path, rank: int) -> tuple[float | None, dict[str, Any]]:
    """When rank ``rank`` last beat (None: never) and what it said then."""
    path = beat_path(folder, rank)
    try:
        when = path.stat().st_mtime
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, {}
    return when, said if isinstance(said, dict) else {}


def silent_ranks(folder: Path, running: list[int], started: float, now: float) -> list[int]:
    """Of the ``running`` ranks (processes alive, started at ``started``, wall clock), those
    whose beat stopped: none for :data:`SILENT_S`, or none at all :data:`STARTUP_S` after
    the start."""
    out = []
    for r in running:
        when, _ = last_beat(folder, r)
        if (when is None and now - started > STARTUP_S) or \
                (when is not None and now - when > SILENT_S):
            out.append(r)
    return out


def describe(folder: Path, rank: int) -> str:
    """Where a running rank was, from its last beat: "at step 2, waiting for rank 0"."""
    when, said = last_beat(folder, rank)
    if when is None:
        return "not started"
    step = said.get("step")
    where = f"at step {step + 1}" if isinstance(step, int) else "at an unknown step"
    peer = said.get("waiting_for")
    if peer == EVERYONE:
        return f"{where}, waiting for all ranks"
    if isinstance(peer, int):
        return f"{where}, waiting for rank {peer}"
    return f"{where}, computing"
