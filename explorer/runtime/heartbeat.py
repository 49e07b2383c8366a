"""Signs of life between the ranks of a real run and their launcher.

Each rank started by ``ex.run`` rewrites ``beat-RANK.json`` in the job folder every
:data:`PERIOD_S` seconds from a thread of its own: the step it is at and the rank it is blocked
on (a receive), if any. A stopped process (SIGSTOP, a frozen machine) stops writing, whatever
its main thread was doing, so the launcher names it within :data:`SILENT_S` seconds instead of
waiting for the run's whole time limit. A rank that hangs while alive (a deadlock or an endless
loop in its own computation) keeps beating but stops advancing: :class:`StallWatch` names it
once every other rank has waited on it far longer than any step took. When the time limit does
end a run, the beats say which ranks were computing and which were waiting for another.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
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
#: the environment variable that holds the launcher's process id (set by the launcher): a rank
#: whose parent is another process has lost its launcher
PARENT_ENV = "EXPLORER_PARENT_PID"
#: ``waiting_for`` of a rank blocked in a collective (barrier, all-reduce)
EVERYONE = -1
#: a rank computing while all others wait on it is taken as hung after this many times the
#: longest step any rank took so far ...
STALL_STEPS = 20
#: ... and never before this many seconds (before any step has finished: :data:`STARTUP_S`,
#: since nothing is known yet of how long a step takes)
STALL_MIN_S = 30.0


def beat_path(folder: Path, rank: int) -> Path:
    return folder / f"beat-{rank}.json"


def done_path(folder: Path, rank: int) -> Path:
    """The mark a rank that serves many runs (:class:`explorer.runtime.pool.RankPool`) leaves
    in a run's folder once its part of the run is over, process group closed."""
    return folder / f"done-{rank}"


class Heartbeat:
    """One rank's beating thread. The rank sets :attr:`step`; :attr:`messenger` (set once the
    rank has one) says through its ``waiting_for`` which rank it is blocked on."""

    def __init__(self, folder: Path, rank: int, period_s: float = PERIOD_S) -> None:
        self.path = beat_path(folder, rank)
        self.rank = rank
        self.period_s = period_s
        self._lock = threading.Lock()
        self.messenger: Any = None
        #: the rank it waits for while it has no messenger (:data:`EVERYONE` while it joins
        #: the process group, which waits for every rank)
        self.waiting_for: int | None = None
        self.longest_step_s = 0.0  # of the steps this rank finished
        self._step = 0
        self._step_began: float | None = None

    @property
    def step(self) -> int:
        """The step the rank is at (0-based); setting a new one times the one before."""
        return self._step

    @step.setter
    def step(self, k: int) -> None:
        now = time.monotonic()
        if k != self._step and self._step_began is not None:
            self.longest_step_s = max(self.longest_step_s, now - self._step_began)
        self._step, self._step_began = k, now

    def follow(self, folder: Path) -> None:
        """Beat into ``folder`` from now on (a rank that serves many runs: the folder of the
        run it is in), at step 0; no beat is being written to the folder before when this
        returns, so it can be removed."""
        with self._lock:
            self.path = beat_path(folder, self.rank)
            self.longest_step_s, self._step, self._step_began = 0.0, 0, None
            self.messenger = None
            self.waiting_for = None

    def start(self) -> Heartbeat:
        threading.Thread(target=self._loop, daemon=True, name="heartbeat").start()
        return self

    def _loop(self) -> None:
        while True:
            with self._lock:
                try:
                    peer = getattr(self.messenger, "waiting_for", self.waiting_for)
                    tmp = self.path.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"step": self.step, "waiting_for": peer,
                                               "longest_step_s": self.longest_step_s,
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


def silent_ranks(folder: Path, running: list[int], started: float, now: float,
                 stopped_since: Mapping[int, float] | None = None) -> list[int]:
    """Of the ``running`` ranks (processes alive, started at ``started``, wall clock), those
    whose beat stopped: none for :data:`SILENT_S`, or none at all :data:`STARTUP_S` after
    the start, or none yet from a process seen stopped (``stopped_since``: rank -> when its
    process was first seen stopped, SIGSTOP or a debugger, and ever since) for
    :data:`SILENT_S`, as long as a rank that beat and stopped is given."""
    stopped_since = stopped_since or {}
    out = []
    for r in running:
        when, _ = last_beat(folder, r)
        if when is None:
            held = stopped_since.get(r)
            if now - started > STARTUP_S or (held is not None and now - held > SILENT_S):
                out.append(r)
        elif now - when > SILENT_S:
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


class StallWatch:
    """Finds a rank that stopped making progress while alive, from the beats the launcher reads
    once a second: it is computing (waiting on no one) at the same step, and every other rank
    has been waiting on it (directly, through others, or in a collective), both for longer
    than ``max(STALL_MIN_S, STALL_STEPS x the longest step so far)``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        #: rank -> ((step, waiting_for) last seen, wall time it was first seen)
        self.since: dict[int, tuple[tuple[Any, Any], float]] = {}

    def limit_s(self, said: dict[int, dict[str, Any]]) -> float:
        """How long a rank may hold up all others before it is taken as hung."""
        if not any(isinstance(s.get("step"), int) and s["step"] > 0 for s in said.values()):
            return STARTUP_S
        longest = max(float(s.get("longest_step_s") or 0.0) for s in said.values())
        return max(STALL_MIN_S, STALL_STEPS * longest)

    def stalled(self, running: list[int], now: float) -> tuple[int, int, float] | None:
        """(rank, its 0-based step, seconds the others have waited on it) of a rank that stopped
        making progress; None while every rank moves (or some have not beaten yet)."""
        said: dict[int, dict[str, Any]] = {}
        for r in running:
            when, s = last_beat(self.folder, r)
            if when is None:
                return None
            state = (s.get("step"), s.get("waiting_for"))
            if self.since.get(r, (None,))[0] != state:
                self.since[r] = (state, now)
            said[r] = s
        if len(running) < 2:
            return None
        limit = self.limit_s(said)
        for r in running:
            others = [q for q in running if q != r]
            if said[r].get("waiting_for") is not None or now - self.since[r][1] <= limit:
                continue
            if all(_waits_on(q, r, said) and now - self.since[q][1] > limit for q in others):
                step = said[r].get("step")
                waited = now - max(self.since[q][1] for q in others)
                return r, step if isinstance(step, int) else -1, waited
        return None


def _waits_on(rank: int, target: int, said: dict[int, dict[str, Any]]) -> bool:
    """Whether ``rank`` is blocked on ``target``: directly, through a chain of waiting ranks,
    or in a collective (which waits on every rank)."""
    seen = set()
    while rank not in seen:
        seen.add(rank)
        peer = said.get(rank, {}).get("waiting_for")
        if peer in (EVERYONE, target):
            return True
        if not isinstance(peer, int) or peer not in said:
            return False
        rank = peer
    return False
