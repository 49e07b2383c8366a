"""The rank side of real training steps: the entry point of one process per device.

Every rank reads the job folder (:mod:`explorer.runtime.jobfiles`), joins the process group
(gloo on CPU, NCCL on GPU) and runs its stage's actions step after step
(:class:`explorer.runtime.stage.StageRunner`), then writes what it measured (or why it failed)
back to the folder for the launcher. Started by ``ex.run``, it also beats
(:mod:`explorer.runtime.heartbeat`), so the launcher sees it is alive. Started by a
:class:`explorer.runtime.pool.RankPool` (``--serve``), it runs one job after another in the same
process (:func:`serve`), set up once (cores, allocator) as a one-run rank is.

The same function is what an exported training script runs under ``torchrun``: launch it with
``python -m explorer.runtime.rank JOB_DIR`` and the usual RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT environment, or call :func:`main` with a ``batches`` function.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from explorer.platforms import platform_of
from explorer.runtime import heartbeat
from explorer.runtime.folders import FULL_EXIT, no_space
from explorer.runtime.heartbeat import Heartbeat
from explorer.runtime.jobfiles import RUNTIMES, Job, JobError, job_problem, read_job
from explorer.runtime.stage import StageRunner


def _watch_parent() -> None:
    """Exit when the launching process dies, so no rank outlives it: the parent is the one
    the launcher named (:data:`explorer.runtime.heartbeat.PARENT_ENV`), where it did, so a
    launcher gone before this runs is seen too; else (under torchrun) the parent now."""
    named = os.environ.get(heartbeat.PARENT_ENV, "")
    parent = int(named) if named.isdigit() else os.getppid()
    if os.getppid() != parent:
        os._exit(3)

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=loop, daemon=True).start()


def main(argv: list[str] | None = None, batches: Any = None, verbose: bool = False,
         on_fail: Callable[[int, BaseException], None] | None = None) -> int:
    """Rank entry point: ``JOB_DIR [--steps N] [--warmup N] [--lr X] [--runtime R]
    [--compile | --no-compile]`` (each in place of the job's own), or ``--serve POOL_DIR``:
    run the jobs a :class:`explorer.runtime.pool.RankPool` sends (:func:`serve`).

    ``batches(step)`` (optional) returns (inputs, targets) for each step, or None to reuse the
    job's example batch. With ``verbose``, the rank holding the loss prints each step.
    ``on_fail(rank, exc)`` is told a failure before it is reported in ``error-RANK.txt``.
    """
    ap = argparse.ArgumentParser(prog="explorer.runtime.rank")
    ap.add_argument("job")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--runtime", choices=RUNTIMES)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction)
    ap.add_argument("--serve", action="store_true")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    folder = Path(args.job)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    out = Path(os.environ.get("EXPLORER_OUT", folder))
    _watch_parent()
    fault = _fault(rank)
    if fault and fault[1] == START:
        _inject(fault[0])
    pulse = Heartbeat(out, rank).start() if heartbeat.wanted() else None
    if args.serve:
        serve(folder, rank, local_rank, pulse)
    try:
        job = read_job(folder)
        for k in ("steps", "warmup", "lr", "runtime", "compile"):
            if getattr(args, k) is not None:
                setattr(job, k, getattr(args, k))
        problem = job_problem(job)  # the command line's values too (--lr nan)
        if problem:
            raise JobError(f"{problem}; give the option a value in range")
        run_job(job, rank, world, local_rank, out, batches, verbose, pulse)
        sys.stdout.flush()
        os._exit(0)  # results are on disk: skip the interpreter's slow teardown
    except BaseException as exc:
        if on_fail is not None:
            with contextlib.suppress(Exception):  # the report in error-RANK.txt comes first
                on_fail(rank, exc)
        _fail(out, rank, exc)


def serve(pool_folder: Path, rank: int, local_rank: int, pulse: Heartbeat | None) -> None:
    """Run job after job as rank ``rank``: each line on standard input names a job folder and
    the run's number of ranks (JSON); the rank runs its part, marks it done
    (:func:`explorer.runtime.heartbeat.done_path`) and waits for the next. Ends the process
    when the input closes (the pool is closed, or its process is gone), and on the first
    failure, reported as a one-run rank reports it."""
    while line := sys.stdin.readline():
        request = json.loads(line)
        out, world = Path(request["job"]), int(request["world"])
        if pulse is not None:
            pulse.follow(out)
        try:
            job = read_job(out)
            if pulse is not None:
                pulse.waiting_for = heartbeat.EVERYONE  # the rendezvous waits for every rank
            store = _store(out, rank, world, job.timeout_s)
            run_job(job, rank, world, local_rank, out, None, False, pulse, store)
        except BaseException as exc:
            _fail(out, rank, exc)
        if pulse is not None:
            pulse.follow(pool_folder)  # before the done mark: the job folder may then go
        heartbeat.done_path(out, rank).touch()
    sys.stdout.flush()
    os._exit(0)


def _store(out: Path, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """The run's rendezvous: rank 0 listens on a port the system picks and writes it to
    ``out``; the others read it there (no port chosen ahead that another process could take
    in the meantime)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    path = out / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        path.with_suffix(".tmp").write_text(str(store.port))
        path.with_suffix(".tmp").replace(path)
        return store
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 gave no rendezvous port within {timeout_s:.0f} s")
        time.sleep(0.005)
    return dist.TCPStore("127.0.0.1", int(path.read_text()), world, is_master=False,
                         timeout=timeout)


def _fail(out: Path, rank: int, exc: BaseException) -> NoReturn:
    """Report ``exc`` in ``out`` for the launcher and end the process. A failure for want of
    space in the folder (or a report that cannot be written for it) ends it with
    :data:`explorer.runtime.folders.FULL_EXIT`, which reaches the launcher where no file can."""
    kind = "out of memory" if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) \
        else type(exc).__name__
    full = no_space(exc)
    try:
        (out / f"error-{rank}.txt").write_text(
            f"{kind}: {exc}\n\n{''.join(traceback.format_exception(exc)[-6:])}")
    except OSError as unwritten:
        full = full or no_space(unwritten)
    os._exit(FULL_EXIT if full else 1)


#: the cores this process was pinned to and whether it holds freed memory, once set up
_SET_UP: dict[str, Any] = {}


def run_job(job: Job, rank: int, world: int, local_rank: int, out: Path, batches: Any,
            verbose: bool, pulse: Heartbeat | None, store: dist.Store | None = None) -> None:
    """Run ``job`` as rank ``rank`` of ``world``: join the process group (through ``store``,
    else the environment's MASTER_ADDR and MASTER_PORT), run the steps, write what they
    measured to ``out`` and leave the process group."""
    cuda = any(v.startswith("cuda") for v in job.device_map.values())
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank)
    if not _SET_UP:
        # the host's rank set-up, before the process group starts its threads (they inherit
        # it): a CPU rank gets a core of its own per compute thread; freed memory is kept for
        # the next step rather than faulted in again (GPU ranks' host tensors too)
        threads = int(os.environ.get("EXPLORER_THREADS", "1"))
        torch.set_num_threads(threads)
        platform = platform_of("cuda" if cuda else "cpu")
        _SET_UP.update(cores=platform.pin_rank(local_rank, threads),
                       held=platform.hold_freed_memory())
    if pulse is not None:
        pulse.waiting_for = heartbeat.EVERYONE  # joining waits for every rank
    dist.init_process_group(backend, rank=rank, world_size=world, store=store,
                            timeout=datetime.timedelta(seconds=job.timeout_s))
    if pulse is not None:
        pulse.waiting_for = None
    r = StageRunner(job, rank, world, local_rank)
    if pulse is not None:
        pulse.messenger = r.messenger
    results, task_s = _run_steps(r, job, rank, out, batches, verbose, pulse)
    record = {"rank": rank, "device": r.layout.device_id, "cores": _SET_UP["cores"],
              "held": _SET_UP["held"], "steps": results, "task_s": task_s,
              "memory_source": "cuda allocator (max_memory_allocated)"
              if r.layout.tdev.type == "cuda" else "tensor accounting"}
    if job.record and r.weights.first_grads is not None:
        torch.save(r.weights.first_grads, out / f"grads-{rank}.pt")
    (out / f"result-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _run_steps(r: StageRunner, job: Job, rank: int, out: Path, batches: Any, verbose: bool,
               pulse: Heartbeat | None = None
               ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Run the job's steps: what each step measured, and each task's median seconds over the
    measured steps (keyed "kind:node")."""
    all_times: dict[tuple[str, int], list[float]] = defaultdict(list)
    energy = _Energy(r.layout.tdev)
    results = []
    fault = _fault(rank)
    total = job.warmup + job.steps
    told = -math.inf  # (when rank 0 last wrote how many steps are done)
    for k in range(total):
        if pulse is not None:
            pulse.step = k
        if fault and k == fault[1]:
            _inject(fault[0])
        fed = batches(k) if batches is not None else None
        if fed is not None:
            r.feed(*fed)
        e0 = energy.read()
        res = r.step()
        e1 = energy.read()
        for key, v in r.task_times.items():
            all_times[key].extend(v)
        res["energy_counter_j"] = (e0, e1)  # the run's energy: over all its measured steps
        res["measured"] = k >= job.warmup
        results.append(res)
        if verbose and res["loss"] is not None and r.layout.j == 0:
            print(f"step {k + 1}/{total}: loss {res['loss']:.6f}, "
                  f"{res['step_s'] * 1e3:.1f} ms", flush=True)
        if rank == 0 and (k + 1 == total or time.monotonic() >= told + PROGRESS_PERIOD_S):
            (out / "progress").write_text(str(k + 1))
            told = time.monotonic()
    task_s = {f"{kind}:{i}": statistics.median(v[job.warmup * len(v) // total:])
              for (kind, i), v in all_times.items()}
    return results, task_s


#: the least seconds between two writes of rank 0's step count (the launcher reads it for its
#: progress bar every 50 ms; a file written every step of a short one costs step time)
PROGRESS_PERIOD_S = 0.05

#: the step of :func:`_fault` that means "at the start, before the first heartbeat"
START = -1


def _fault(rank: int) -> tuple[str, int] | None:
    """Test hook: EXPLORER_FAULT="RANK:KIND[:STEP]" makes that rank fail (raise, oom, hang,
    spin: an endless compute loop, kill, stop: SIGSTOP) at that step (STEP ``start``: once
    started, before its first heartbeat), so the launcher's clean-up can be tested for real."""
    spec = os.environ.get("EXPLORER_FAULT", "")
    if not spec:
        return None
    parts = spec.split(":")
    if int(parts[0]) != rank:
        return None
    if len(parts) > 2 and parts[2] == "start":
        return parts[1], START
    return parts[1], int(parts[2]) if len(parts) > 2 else 0


def _inject(kind: str) -> None:
    if kind == "raise":
        raise RuntimeError("injected failure (EXPLORER_FAULT)")
    if kind == "oom":
        raise MemoryError("injected out-of-memory (EXPLORER_FAULT)")
    if kind == "hang":
        time.sleep(3600)
    if kind == "spin":
        while True:  # busy, never waiting: its heartbeat thread still beats
            pass
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


class _Energy:
    """NVML energy counter of a CUDA device, in joules (None where unsupported)."""

    def __init__(self, dev: torch.device) -> None:
        self.handle = None
        if dev.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:
            self.handle = None

    def read(self) -> float | None:
        if self.handle is None:
            return None
        torch.cuda.synchronize()
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0


if __name__ == "__main__":
    sys.exit(main())
