"""Watching the rank processes of one real run: progress, failures, hangs, the time limit.

Both ways of running ranks use it: the launcher's processes started for one run
(:func:`explorer.runtime.launch.launch`), which exit when their part is done, and the rank
processes a :class:`explorer.runtime.pool.RankPool` keeps between runs, which mark each run done
(:func:`explorer.runtime.heartbeat.done_path`) and wait for the next. Whatever goes wrong (a
rank that fails, dies, stops beating or holds up the others; the time limit) becomes a
:class:`RunFailed` naming the rank, its device and the cause; the caller ends the processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import torch
from tqdm.auto import tqdm

from explorer.core.errors import ExplorerError
from explorer.core.plan import Plan
from explorer.runtime import folders, heartbeat


class RunFailed(ExplorerError):
    """A rank of a real run failed, hung or was killed."""


def watch(folder: Path, procs: list[subprocess.Popen], plan: Plan, total_steps: int,
          timeout_s: float, progress: bool, logs: Path | None = None, stays: bool = False
          ) -> None:
    """Wait until rank ``r`` of ``procs`` (one per rank of the run in ``folder``) is done with
    the run: exited with 0, or (``stays``: the process serves further runs) marked done.
    Raises :class:`RunFailed` when a rank fails, dies, stops beating or holds up the others, or
    after ``timeout_s``; ``logs`` is the folder of the ranks' output (default ``folder``)."""
    bar = tqdm(total=total_steps, desc="running steps", unit="step", disable=not progress,
               leave=False)
    deadline = time.monotonic() + timeout_s
    logs = folder if logs is None else logs
    try:
        started = next_check = time.time()
        stalls = heartbeat.StallWatch(folder)
        stopped: dict[int, float] = {}  # ranks not beaten yet, stopped since (wall clock)
        shown = 0
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) or (stays and c == 0) for c in codes):
                time.sleep(1.0)  # let the others report: the first error is the cause
                codes = [p.poll() for p in procs]
                raise RunFailed(failure(folder, first_failure(folder, codes), codes, plan,
                                        logs))
            done = [c == 0 if not stays else heartbeat.done_path(folder, r).exists()
                    for r, c in enumerate(codes)]
            if all(done):
                break
            running = [r for r, c in enumerate(codes) if c is None and not done[r]]
            if time.time() >= next_check:  # (beats come each second: look as often)
                next_check = time.time() + heartbeat.PERIOD_S
                stopped = stopped_unbeaten(folder, procs, running, stopped, time.time())
                silent = heartbeat.silent_ranks(folder, running, started, time.time(), stopped)
                if silent:
                    raise RunFailed(silent_message(folder, silent, procs, plan))
                stuck = stalls.stalled(running, time.time())
                if stuck is not None:
                    raise RunFailed(stuck_message(*stuck, plan))
            if time.monotonic() > deadline:
                where = "; ".join(f"rank {r} ({plan.devices[r]}) "
                                  f"{heartbeat.describe(folder, r)}" for r in running)
                raise RunFailed(
                    f"the run did not finish within {timeout_s:.0f} s ({where}); all ranks "
                    "have been stopped. A rank computing while the others wait for it is "
                    "where it hung; otherwise give more time with timeout_s=..., or fewer "
                    "steps")
            now = steps_done(folder)
            if now > shown:
                bar.update(now - shown)
                shown = now
            time.sleep(0.05)  # (a rank computing shares the host with this loop)
        bar.update(total_steps - shown)
    finally:
        bar.close()


def read_results(folder: Path, world: int
                 ) -> tuple[list[dict], dict[str, torch.Tensor] | None]:
    """What each of the ``world`` ranks wrote to ``folder``: its record, and the gradients of
    the first step where the run recorded them."""
    results = []
    grads: dict[str, torch.Tensor] = {}
    for r in range(world):
        results.append(json.loads((folder / f"result-{r}.json").read_text()))
        gpath = folder / f"grads-{r}.pt"
        if gpath.exists():
            grads.update(torch.load(gpath))
    return results, grads or None


def steps_done(folder: Path) -> int:
    """How many steps rank 0 has finished (its ``progress`` file)."""
    try:
        return int((folder / "progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


#: the most bytes of a rank's error report or log read for a message (a rank that filled its
#: report with garbage, or a report that is a link to an endless file, cannot stall the launcher)
REPORT_READ_BYTES = 64 * 1024


def read_report(path: Path, tail: bool = False) -> str:
    """The first (or with ``tail``, the last) :data:`REPORT_READ_BYTES` of a rank's report or
    log, decoded leniently; empty when it cannot be read."""
    try:
        with path.open("rb") as f:
            if tail:
                f.seek(max(0, f.seek(0, 2) - REPORT_READ_BYTES))
            return f.read(REPORT_READ_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


def first_failure(folder: Path, codes: list[int | None]) -> int:
    """The rank that failed first: the oldest error report, else the first non-zero exit."""
    reports = sorted((f.stat().st_mtime, int(f.stem.split("-")[1]))
                     for f in folder.glob("error-*.txt"))
    peer = ("Connection closed by peer", "Connection reset by peer")
    own = [r for _, r in reports
           if not any(p in read_report(folder / f"error-{r}.txt") for p in peer)]
    if own:
        return own[0]
    reported = {r for _, r in reports}
    silent = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in reported]
    if silent:  # died without a word (killed): the others only saw it go
        return silent[0]
    if reports:
        return reports[0][1]
    return next(r for r, c in enumerate(codes) if c is not None)


def failure(folder: Path, rank: int, codes: list[int | None], plan: Plan,
            logs: Path | None = None) -> str:
    """The message for rank ``rank`` that failed: its error report, the signal that killed
    it, or the end of its output (in ``logs``, default ``folder``)."""
    dev = plan.devices[rank]
    code = codes[rank] if codes[rank] is not None else -9
    if code == folders.FULL_EXIT:
        return f"rank {rank} ({dev}) failed: {folders.full_message(folder)}; all ranks have " \
            "been stopped"
    err = folder / f"error-{rank}.txt"
    if err.exists():
        text = read_report(err).strip().splitlines()
        return (f"rank {rank} ({dev}) failed: {text[0] if text else 'no message'}; all ranks "
                "have been stopped")
    if code < 0:
        sig = signal.Signals(-code).name
        why = " (the system may have run out of memory)" if sig == "SIGKILL" else ""
        return f"rank {rank} ({dev}) was killed by {sig}{why}; all ranks have been stopped"
    log = (logs if logs is not None else folder) / f"log-{rank}.txt"
    tail = read_report(log, tail=True).strip().splitlines()[-3:] if log.exists() else []
    return (f"rank {rank} ({dev}) exited with code {code}: {' | '.join(tail) or 'no output'}; "
            "all ranks have been stopped")


def silent_message(folder: Path, ranks: list[int], procs: list[subprocess.Popen], plan: Plan
                   ) -> str:
    """The message for ranks whose heartbeat stopped while their process lives."""
    parts = []
    for r in ranks:
        state = process_state(procs[r].pid)
        how = " (its process is stopped: SIGSTOP or a debugger)" if state in STOPPED else ""
        last = f"last {heartbeat.describe(folder, r)}" \
            if heartbeat.last_beat(folder, r)[0] is not None \
            else "while starting, before its first sign of life"
        parts.append(f"rank {r} ({plan.devices[r]}) stopped responding{how}, {last}")
    return (f"{'; '.join(parts)}: no sign of life for {heartbeat.SILENT_S:.0f} s; all ranks "
            "have been stopped. A stopped, frozen or swapped-out process does this; check "
            "the machine's load and memory")


def stuck_message(rank: int, step: int, waited_s: float, plan: Plan) -> str:
    """The message for a rank alive and beating that holds up every other rank."""
    at = f"at step {step + 1}" if step >= 0 else "at an unknown step"
    return (f"rank {rank} ({plan.devices[rank]}) stopped making progress {at} (its process is "
            "alive: a hang or an endless loop in its computation); the other ranks waited for "
            f"it {waited_s:.0f} s; all ranks have been stopped. Run that stage's code on its "
            "own to find where it loops or blocks")


#: the states of a stopped process in :func:`process_state` (by a signal, by a debugger)
STOPPED = ("T", "t")


def stopped_unbeaten(folder: Path, procs: list[subprocess.Popen], running: list[int],
                     since: dict[int, float], now: float) -> dict[int, float]:
    """Of the ``running`` ranks, those that have not beaten yet and whose process is stopped,
    each with when it was first seen stopped (from ``since``, the answer a moment before;
    else ``now``): a rank stopped before its first beat is named as soon as one stopped
    after it (:func:`explorer.runtime.heartbeat.silent_ranks`), not after the start-up
    grace, while the ranks waiting for it beat on."""
    return {r: since.get(r, now) for r in running
            if heartbeat.last_beat(folder, r)[0] is None
            and process_state(procs[r].pid) in STOPPED}


def process_state(pid: int) -> str:
    """The state letter of a process (Linux: R, S, T, ...; "" where unknown)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill every rank's whole process group and reap it."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def rank_env(world: int, port: int) -> dict[str, str]:
    """The environment of a rank process of a run of ``world`` ranks (what torchrun gives,
    one compute thread, beats asked for), without its RANK and LOCAL_RANK."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", heartbeat.ENV: "1"}


#: what a rank process runs first, before any import that takes time (``explorer`` and torch
#: take seconds): it ends the process when its launcher (the process id in
#: :data:`explorer.runtime.heartbeat.PARENT_ENV`) is gone, whether that happened already or
#: happens at any later moment, then runs ``python -m explorer.runtime.rank``. On Linux the
#: kernel kills it with its launcher (``PR_SET_PDEATHSIG``: with the launcher's thread that
#: started it, in fact); everywhere a thread also polls the parent's id, comparing it with the
#: one the launcher wrote (not one read after the imports, when the launcher may be gone).
RANK_ENTRY = """\
import os, sys, threading, time
parent = int(os.environ["EXPLORER_PARENT_PID"])
if sys.platform.startswith("linux"):
    try:
        import ctypes, signal
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
def orphaned():
    return os.getppid() != parent
if orphaned():
    os._exit(3)
def watch():
    while not orphaned():
        time.sleep(0.2)
    os._exit(3)
threading.Thread(target=watch, daemon=True, name="parent-watch").start()
import runpy
runpy.run_module("explorer.runtime.rank", run_name="__main__", alter_sys=True)
"""


def start_rank(args: list[str], rank: int, env: dict[str, str], log: IO[str],
               stdin: int | None = None) -> subprocess.Popen:
    """Start ``python -m explorer.runtime.rank ARGS`` (through :data:`RANK_ENTRY`, so it ends
    with this process at any moment of its start) as rank ``rank`` (its LOCAL_RANK too), its
    output to ``log``, in a process group of its own (so :func:`stop` ends all it started)."""
    return subprocess.Popen(
        [sys.executable, "-c", RANK_ENTRY, *args],
        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
             heartbeat.PARENT_ENV: str(os.getpid())},
        stdin=stdin, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
