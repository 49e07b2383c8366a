"""What the GPU scripts share (gpu_check.py, gpu_presets.py): the device's identity, the NVML
energy counter, kernel timing, and a results file that a later command resumes.

A lent GPU runs at most a few minutes per command, so each script works through named cases,
writes the results file after every case, skips cases already in it, and stops before its time
budget runs out; the next command carries on where it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NOT_AVAILABLE = "not available"
#: what a case is assumed to take before any case has been timed in this command
FIRST_CASE_ESTIMATE_S = 60.0
#: when this command started (near enough: after importing torch); budgets count from here
STARTED_S = time.perf_counter()


def command_line() -> str:
    """This process's command line, as a shell would take it."""
    return " ".join(shlex.quote(a) for a in ["python", *sys.argv])


def common_args(ap: argparse.ArgumentParser, default_budget_s: float) -> None:
    """The options both scripts take: --dry-run, --out, --fresh, --budget-s."""
    ap.add_argument("--dry-run", action="store_true",
                    help="the same code paths on CPU with tiny sizes, written to --out "
                         "(default: a new temporary file)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default: benchmarks/results/<script>.json)")
    ap.add_argument("--fresh", action="store_true",
                    help="start over: forget the cases already in the results file")
    ap.add_argument("--budget-s", type=float, default=default_budget_s,
                    help="stop before starting a case that would end past this many seconds")
    ap.add_argument("--report", action="store_true",
                    help="run no case (no GPU needed): print the tables of the results file "
                         "and rewrite its summary (the rows benchmarks/report.py renders)")


def parse(ap: argparse.ArgumentParser, name: str, summarize_fn: Callable[[dict], None],
          report_fn: Callable[[dict], None]) -> tuple[argparse.Namespace, Path]:
    """The command line and the results file of script ``name``. With --report: print the
    file's tables, rewrite its summary (``summarize_fn``) and exit; without a GPU (and not a
    dry run): exit saying so."""
    args = ap.parse_args()
    out = out_path(args, name)
    if args.report:
        data = load(out)
        summarize_fn(data)
        save(out, data)
        report_fn(data)
        sys.exit(0)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(f"{name} needs a CUDA GPU (torch.cuda.is_available() is False); use "
                 "--dry-run to try the same code paths on CPU")
    return args, out


def out_path(args: argparse.Namespace, name: str) -> Path:
    """Where the results go: --out, else a temporary file for a dry run (never the real
    results), else benchmarks/results/<name>.json."""
    if args.out is not None:
        return args.out
    if args.dry_run:
        fd, path = tempfile.mkstemp(prefix=f"{name}-dry-", suffix=".json")
        os.close(fd)
        os.unlink(path)
        return Path(path)
    return RESULTS_DIR / f"{name}.json"


# -- the device -------------------------------------------------------------------------------
def _nvml() -> Any:
    """The initialised pynvml module, or the reason there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:  # no library, no driver, no GPU
        return f"{NOT_AVAILABLE} ({type(exc).__name__}: {exc})"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def device_info() -> dict[str, Any]:
    """GPU 0 as NVML names it, driver and CUDA versions, torch's view; "not available" where
    there is no NVML or no GPU."""
    info: dict[str, Any] = {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda or NOT_AVAILABLE,
        "cudnn": (torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
                  else None) or NOT_AVAILABLE,
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
        "torch_device_name": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                              else NOT_AVAILABLE),
    }
    nv = _nvml()
    if isinstance(nv, str):
        info.update(nvml_device_name=nv, driver=nv, cuda_driver=nv)
        return info
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        cuda = nv.nvmlSystemGetCudaDriverVersion()
        info.update(nvml_device_name=_text(nv.nvmlDeviceGetName(h)),
                    driver=_text(nv.nvmlSystemGetDriverVersion()),
                    cuda_driver=f"{cuda // 1000}.{cuda % 1000 // 10}",
                    memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(h).total),
                    power_limit_w=nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
    except Exception as exc:
        reason = f"{NOT_AVAILABLE} ({type(exc).__name__}: {exc})"
        info.update(nvml_device_name=reason, driver=reason, cuda_driver=reason)
    return info


def device_line(info: dict[str, Any]) -> str:
    """One line naming the device and the software versions (from :func:`device_info`)."""
    return (f"device: {info['nvml_device_name']}; driver {info['driver']}, CUDA "
            f"{info['cuda_driver']}; torch {info['torch']} (CUDA {info['torch_cuda']})")


class EnergyCounter:
    """NVML's total energy counter of GPU 0 (nvmlDeviceGetTotalEnergyConsumption, mJ since the
    driver loaded). ``status`` says why there is none: no NVML, or the GPU does not support it."""

    def __init__(self) -> None:
        self.handle = None
        nv = _nvml()
        if isinstance(nv, str):
            self.status = nv
            return
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(0)
            nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        except Exception as exc:  # NVMLError_NotSupported on GPUs before Volta, no GPU
            self.status = f"{NOT_AVAILABLE} ({type(exc).__name__}: {exc})"
            return
        self.nv, self.handle, self.status = nv, handle, "nvmlDeviceGetTotalEnergyConsumption"

    def read_mj(self) -> int | None:
        """The counter now (after the GPU's queued work), or None."""
        if self.handle is None:
            return None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return int(self.nv.nvmlDeviceGetTotalEnergyConsumption(self.handle))


# -- timing ------------------------------------------------------------------------------------
def median_time_s(fn: Callable[[], Any], cuda: bool, repeats: int, warmup: int) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` after ``warmup`` calls: CUDA events
    around each call on a GPU (the kernels' time on the device), a synchronised wall clock
    on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(repeats)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in pairs]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_time_s(fn: Callable[[], Any], repeats: int, warmup: int) -> float | None:
    """Mean seconds the device spends in kernels per ``fn()`` call over ``repeats`` calls, from
    a torch.profiler (kineto) trace: the device's own time, without the gap a host slower
    than a small kernel leaves between CUDA events around one call (in training the host
    issues ahead, and the cost model keeps its time on a lane of its own). None where the
    trace holds no kernel time (no GPU)."""
    if not torch.cuda.is_available():
        return None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e6 / repeats if total_us > 0 else None


# -- the results file --------------------------------------------------------------------------
class Results:
    """A JSON results file with one entry per finished case, written after each case (through
    a temporary file, so an interrupted command leaves the last complete version)."""

    def __init__(self, path: Path, fresh: bool, header: dict[str, Any]) -> None:
        self.path = path
        old = {} if fresh or not path.exists() else json.loads(path.read_text())
        same_device = old.get("device", {}).get("nvml_device_name") == \
            header["device"]["nvml_device_name"] and old.get("dry_run") == header["dry_run"]
        if old and not same_device:
            print(f"{path} holds results of another device or mode: starting over")
            old = {}
        self.data: dict[str, Any] = {**old, **header, "cases": old.get("cases", {}),
                                     "runs": old.get("runs", [])}
        self.run = {"command": command_line(), "started": _now(), "done": [], "skipped": [],
                    "not_reached": []}
        self.data["runs"].append(self.run)

    @property
    def cases(self) -> dict[str, Any]:
        return self.data["cases"]

    def save(self) -> None:
        save(self.path, self.data)

    def work(self, cases: Iterable[tuple[str, Callable[[], dict[str, Any]]]],
             budget_s: float, kind: Callable[[str], str] = lambda key: "") -> bool:
        """Run every case not already done, in order, saving after each; stop before one that
        the budget (seconds since this command started) may not cover. True when all are done.

        A case that raises, or whose command was killed inside it, is recorded with an error
        and not retried on resume (--fresh does). The estimate for the next case is the
        longest case so far in this command of the same ``kind(key)`` (all one kind unless
        told: a script whose cases differ in length, a profile and the short runs using it,
        names their kinds)."""
        t_start = STARTED_S
        longest_s: dict[str, float] = {}
        for key, fn in cases:
            if self.cases.get(key, {}).get("unfinished"):
                self.cases[key] = {**self.cases[key], "unfinished": False, "error":
                                   "did not finish in an earlier command (killed at its time "
                                   "limit?); --fresh tries it again"}
            if key in self.cases:
                self.run["skipped"].append(key)
                continue
            elapsed = time.perf_counter() - t_start
            if elapsed + longest_s.get(kind(key), FIRST_CASE_ESTIMATE_S) > budget_s:
                self.run["not_reached"].append(key)
                continue
            print(f"[{elapsed:6.0f} s] {key}", flush=True)
            # marked before it runs: a command killed inside a case does not retry it forever
            self.cases[key] = {"unfinished": True, "command": command_line(),
                               "measured_at": _now()}
            self.save()
            t0 = time.perf_counter()
            try:
                entry = fn()
            except Exception as exc:  # one case failing must not lose the others
                entry = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"    failed: {entry['error']}", flush=True)
            took = time.perf_counter() - t0
            longest_s[kind(key)] = max(longest_s.get(kind(key), 0.0), took)
            self.cases[key] = {**entry, "wall_s": round(took, 3), "command": command_line(),
                               "measured_at": _now()}
            self.run["done"].append(key)
            self.save()
        self.run["ended"] = _now()
        self.save()
        if self.run["not_reached"]:
            print(f"budget of {budget_s:.0f} s reached: {len(self.run['not_reached'])} case(s) "
                  f"left; run the same command again to resume ({self.path})")
        return not self.run["not_reached"]


def summarize(data: dict[str, Any], title: str, rows: list[dict[str, Any]],
              notes: list[str]) -> None:
    """Give the results file the fields every record in benchmarks/results/ has, so that
    ``python benchmarks/report.py`` renders it: title, date (of the latest case), machine
    (the device and software versions), command (the first command that ran cases, without
    ``--out``; a note counts the later ones, which resumed it and are listed under ``runs``),
    rows and notes."""
    dates = [c["measured_at"][:10] for c in data["cases"].values()
             if str(c.get("measured_at", ""))[:2] == "20"]
    info = data["device"]
    machine = (f"{info['nvml_device_name']} (driver {info['driver']}, CUDA "
               f"{info['cuda_driver']}), torch {info['torch']}")
    if data.get("dry_run"):
        machine = f"dry run on CPU, not GPU figures; {machine}"
    commands = []
    for run in data.get("runs", []):
        cmd = re.sub(r" --out \S+", "", run["command"])
        if run.get("done") and cmd not in commands:
            commands.append(cmd)
    if len(commands) > 1:
        notes = [f"Resumed by {len(commands) - 1} more command(s), listed under `runs` in "
                 "the results file.", *notes]
    data.update(title=title, date=max(dates) if dates else today(), machine=machine,
                command=commands[0] if commands else command_line(), rows=rows, notes=notes)


def not_run_notes(data: dict[str, Any]) -> list[str]:
    """A note naming the cases some command left out for time and none has done since."""
    done = set(data["cases"])
    left = sorted({k for r in data.get("runs", []) for k in r.get("not_reached", [])} - done)
    return [f"Not run (device time ran out): {', '.join(left)}."] if left else []


def load(path: Path) -> dict[str, Any]:
    """A results file, or exit saying that there is none."""
    if not path.is_file():
        sys.exit(f"no results file {path}: run the script without --report first")
    return json.loads(path.read_text())


def save(path: Path, data: dict[str, Any]) -> None:
    """Write a results file through a temporary file (a killed command leaves the last
    complete version)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def fmt_ms(v: Any) -> str:
    """Seconds as milliseconds, or "-" where there is no number."""
    return f"{v * 1e3:.2f}" if isinstance(v, (int, float)) else "-"


def fmt_mib(v: Any) -> str:
    """Bytes as MiB, or "-" where there is no number."""
    return f"{v / 2**20:.1f}" if isinstance(v, (int, float)) else "-"


def fmt_error(p: Any, m: Any) -> str:
    """(predicted - measured) / measured in percent, or "-" where either is missing."""
    ok = isinstance(p, (int, float)) and isinstance(m, (int, float)) and m
    return f"{(p - m) / m * 100:+.0f}%" if ok else "-"


def failure(case: dict[str, Any]) -> str | None:
    """Why a recorded case has no figures (its error, or that it is still running), or None."""
    if case.get("unfinished"):
        return "unfinished"
    return case.get("error")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def today() -> str:
    return datetime.date.today().isoformat()
