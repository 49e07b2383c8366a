"""How busy the host was while something was timed: the processor share a timing loop got and
the load average, recorded with each measured profile.

Any host has both: a loop that computes without pause should get all of a processor, and gets
less only when more processes want to run than there are cores; the load average counts the
processes that wanted to run over the last minute. Whether that made a host too busy for its
devices' measurements is its platform's call (:meth:`explorer.platforms.Platform.busy_host`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostLoad:
    """The host's load while a profile was measured."""

    #: the processor time the profile's timing loops in this process got, as a fraction of
    #: their wall time (1.0: never kept waiting; 0.5: as if another process shared the core)
    cpu_share: float
    #: the host's one-minute load average when the profile started, per usable core (0.0
    #: where the host has none)
    load_per_core: float
    #: the cores this process may use
    cores: int

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_share": self.cpu_share, "load_per_core": self.load_per_core,
                "cores": self.cores}

    def describe(self) -> str:
        """In words, e.g. "its timing loops got 48 % of a core; load average 3.9 per core"."""
        return (f"its timing loops got {self.cpu_share:.0%} of a core; load average "
                f"{self.load_per_core:.1f} per core of {self.cores}")


def usable_cores() -> int:
    """How many cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def load_per_core() -> float:
    """The one-minute load average per usable core (0.0 where the host has none)."""
    try:
        return os.getloadavg()[0] / usable_cores()
    except (AttributeError, OSError):
        return 0.0


class ShareMeter:
    """Adds up the wall time and this thread's processor time of the blocks run ``with`` it:
    :attr:`share` is the second over the first (1.0 before anything is measured)."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0

    def __enter__(self) -> ShareMeter:
        self._wall0, self._cpu0 = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s += time.thread_time() - self._cpu0
        self.wall_s += time.perf_counter() - self._wall0

    def sample(self, seconds: float) -> None:
        """Compute without pause for ``seconds`` (a plain loop), measured."""
        with self:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                sum(range(1000))

    @property
    def share(self) -> float:
        return min(1.0, self.cpu_s / self.wall_s) if self.wall_s > 0.0 else 1.0
