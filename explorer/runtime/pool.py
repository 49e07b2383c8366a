"""Rank processes started once and reused for many short runs, such as a profile's.

Starting a rank process (Python, torch, the platform's set-up) takes seconds, while one of the
profiler's runs of a small model computes for well under a second. A :class:`RankPool` starts
rank ``r`` (``python -m explorer.runtime.rank --serve``, :func:`explorer.runtime.worker.serve`)
when a run first needs ``r + 1`` ranks, and sends each run's job folder
(:mod:`explorer.runtime.jobfiles`) to its ranks 0..n-1 on their standard input; each runs its
part exactly as a rank started for that run would (same pinning through the platform's
``pin_rank`` for its local rank, same process group set-up, steps and results), marks it done
and waits for the next. Runs are watched as the launcher's own (:func:`explorer.runtime.watch.
watch`: failures, heartbeats, stalls, the time limit); whatever goes wrong, or an interrupt,
ends every rank of the pool, and the next run starts fresh ones. Ranks also end when the pool's
process does, at any moment from their start (:data:`explorer.runtime.watch.RANK_ENTRY`; their
input closes too), so none outlives it. On Linux they also end with the thread that started them
(the kernel's parent-death signal follows that thread): use a pool from the thread that runs it
first, or it only starts its ranks afresh.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO

import torch

from explorer.core.plan import Plan
from explorer.runtime.folders import temporary_folder
from explorer.runtime.watch import rank_env, read_results, start_rank, stop, watch


class RankPool:
    """Rank processes kept between runs: pass it to :func:`explorer.runtime.launch.run`
    (``pool=``) for every run, and close it (or use it as a context manager) when done.
    Ranks start on first use, as many as the widest run needs and at least ``size`` (those a
    caller knows it will need start side by side)."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self.procs: list[subprocess.Popen] = []
        self.starts = 0  # rank processes started so far (a fresh set after a failure)
        self._logs: list[IO[str]] = []
        self._folder: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def folder(self) -> Path | None:
        """Where the ranks write their output (None before they start)."""
        return Path(self._folder.name) if self._folder is not None else None

    def run(self, folder: Path, world: int, total_steps: int, timeout_s: float,
            progress: bool, plan: Plan) -> tuple[list[dict], dict[str, torch.Tensor] | None]:
        """Run the job written in ``folder`` on ranks 0..``world``-1 and return what each
        wrote; any failure or interrupt ends the pool's ranks (and is raised)."""
        procs = self._ranks(world)
        try:
            line = json.dumps({"job": str(folder), "world": world})
            for p in procs:
                p.stdin.write(line.encode() + b"\n")
                p.stdin.flush()
            watch(folder, procs, plan, total_steps, timeout_s, progress, self.folder,
                  stays=True)
        except BaseException:
            self.close()
            raise
        return read_results(folder, world)

    def _ranks(self, world: int) -> list[subprocess.Popen]:
        """Ranks 0..``world``-1, alive, started where they are not (all of them afresh when one
        of the pool's ranks has ended)."""
        if any(p.poll() is not None for p in self.procs):
            self.close()
        if self._folder is None:
            self._folder = temporary_folder("pool-")
        while len(self.procs) < max(world, self.size):
            r = len(self.procs)
            log = open(self.folder / f"log-{r}.txt", "w")  # closed in close()
            self._logs.append(log)
            self.procs.append(start_rank(["--serve", str(self.folder)], r,
                                         rank_env(world, 0), log, stdin=subprocess.PIPE))
            # (MASTER_PORT 0: each run's rank 0 picks its rendezvous port, see worker.serve)
            self.starts += 1
        return self.procs[:world]

    def close(self) -> None:
        """End every rank of the pool (they finish no run) and remove its folder."""
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        stop(self.procs)
        self.procs = []
        for log in self._logs:
            log.close()
        self._logs = []
        if self._folder is not None:
            with contextlib.suppress(OSError):
                self._folder.cleanup()
            self._folder = None
