"""Check the whole flow on one lent GPU: the test suite's gpu tests, then every built-in model
captured, profiled on the GPU, predicted on one device and run for real, prediction vs measured.

Run:  python benchmarks/gpu_check.py [--sizes default,large] [--dtypes fp32,bf16]
          [--models mlp,gpt,...] [--steps 20] [--budget-s 480] [--fresh] [--out PATH]
      python benchmarks/gpu_check.py --dry-run [--out PATH]   # CPU, tiny, few steps

Results go to benchmarks/results/gpu_check.json after every case; a later command skips the
cases already there (so a run cut at the per-command limit resumes), ``--fresh`` starts over.
Per model, size and dtype it records:

* the prediction of the single-device plan (``ex.simulate``): step time, peak memory, energy;
* the real run (``ex.run``, ``--steps`` steps): step time, peak memory the ranks measured
  (torch.cuda.max_memory_allocated; the Measurement does not record reserved memory), energy
  per step from NVML's counter where the GPU has one, and ``ex.compare``'s report;
* an eager reference in this process (plain PyTorch + Adam, the same steps): step time,
  torch.cuda.max_memory_allocated and max_memory_reserved, and NVML energy over all steps;
* one more eager step under ``torch.profiler`` (kineto), read by
  :mod:`explorer.profiling.kineto` and matched to the graph's ops: the host time and the
  device (kernel) time of the graph's ops, forward and backward, how many kernels, and how many
  ops the host takes longer to issue than the device to run (on CPU there are no kernels),
  and the step simulated from those times on two timelines (host issuing, device running:
  ``explorer.profiling.kineto.timeline_costs``), set beside the eager step it was traced from;
  the trace itself is kept beside ``--out`` (``<out>.traces/``) for size default, the fixtures
  a GPU-profile parser is tested on.

The API has no dtype argument: bf16 cases cast the module and the float inputs with
``.to(torch.bfloat16)`` before ``ex.capture``; a case the API refuses is recorded with the error.
"""

from __future__ import annotations

import argparse
import copy
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _common import dry_run_ranks
from _gpu import (
    NOT_AVAILABLE,
    EnergyCounter,
    Results,
    common_args,
    device_info,
    device_line,
    failure,
    fmt_error,
    fmt_mib,
    fmt_ms,
    not_run_notes,
    parse,
    summarize,
)
from torch.profiler import ProfilerActivity, profile

import explorer as ex
from explorer.core.units import table
from explorer.profiling.kineto import (
    OpTiming,
    TraceError,
    match_graph,
    op_timings,
    timeline_costs,
)
from explorer.runtime import RankPool

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the project's pytest options (notebooks, doctests) are left out: a GPU machine may lack nbmake
PYTEST_GPU = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
              "-o", "addopts="]
PYTEST_TIMEOUT_S = 300.0
MULTI_GPU_NOTE = (
    "Two ranks on one GPU are not a multi-GPU run: NCCL refuses two ranks on one device, so "
    "plans split across devices (data-parallel, pipelines) are not measured here; only the "
    "single-device plan is run. Multi-GPU predictions stay unchecked until several GPUs are lent.")
DTYPE_NOTE = ("ex.capture/ex.run take no dtype argument: bf16 cases cast the module and the "
              "floating-point inputs with .to(torch.bfloat16) before capture; the cost model's "
              "roofline uses the bf16 peak for such ops")
#: how close a prediction should come to the measured figure (relative error)
TARGETS = {"step time": 0.10, "step time from the traced eager step": 0.10, "peak memory": 0.05,
           "energy": 0.15}
RESERVED_NOTE = ("ex.Measurement records peak allocated bytes per rank "
                 "(torch.cuda.max_memory_allocated in the rank); reserved bytes come from the "
                 "eager reference in this process")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, default_budget_s=480.0)
    ap.add_argument("--models", default=None, help="comma-separated (default: all built-in; "
                    "dry run: mlp)")
    ap.add_argument("--sizes", default=None, help="default: default,large (dry run: tiny)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=None, help="default 20 (dry run: 3)")
    args, out = parse(ap, "gpu_check", summarize_check, report)
    dry = args.dry_run
    models = (args.models or ("mlp" if dry else ",".join(ex.model_names()))).split(",")
    sizes = (args.sizes or ("tiny" if dry else "default,large")).split(",")
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in DTYPES:
            sys.exit(f"unknown dtype {d!r}: use {', '.join(DTYPES)}")
    steps = args.steps or (3 if dry else 20)
    cluster = one_device(dry)
    res = Results(out, args.fresh, {
        "what": "gpu_check: the flow on one device, predicted vs measured",
        "dry_run": dry, "device": device_info(), "cluster": cluster.describe(),
        "steps": steps, "notes": [MULTI_GPU_NOTE, DTYPE_NOTE, RESERVED_NOTE]})
    energy = EnergyCounter()
    res.data["energy_counter"] = energy.status
    pytest_paths = ["tests/project/test_gpu_scripts.py"] if dry else ["tests/gpu"]
    cases: list[tuple[str, Any]] = [("pytest -m gpu", lambda: pytest_gpu(pytest_paths))]
    # cheapest and most telling first: the first size in both dtypes, then the next size
    for size in sizes:
        for dt in dtypes:
            for name in models:
                cases.append((f"{name}/{size}/{dt}",
                              lambda n=name, s=size, d=dt: model_case(
                                  n, s, d, cluster, steps, energy, dry,
                                  traces(out, n, s, d), pool)))
    with dry_run_ranks(dry) as pool:
        finished = res.work(cases, args.budget_s)
    summarize_check(res.data)
    res.save()
    report(res.data)
    print(f"results: {out}" + ("" if finished else " (not finished: run again to resume)"))


def traces(out: Path, name: str, size: str, dtype: str) -> Path | None:
    """Where a case's trace is kept: beside the results, for the sizes small enough to keep
    (tiny and default); None for the others."""
    if size not in ("tiny", "default"):
        return None
    return Path(f"{out}.traces") / f"{name}-{size}-{dtype}.json"


def one_device(dry: bool) -> ex.Cluster:
    """The one device the cases run on: GPU 0 as ``Cluster.discover`` sees it, or in a dry
    run one nominal CPU rank."""
    if dry:
        return ex.Cluster.cpu(1, measure=False)
    cluster = ex.Cluster.discover()
    gpus = [d.id for d in cluster.devices if d.kind == "cuda" and d.present]
    if not gpus:
        sys.exit(f"Cluster.discover() found no usable GPU: {cluster.name}")
    return cluster.subset([gpus[0]])


def pytest_gpu(paths: list[str]) -> dict[str, Any]:
    """The test suite's ``gpu`` tests: counts per outcome from pytest's summary line."""
    cmd = [*PYTEST_GPU, *paths]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                           timeout=PYTEST_TIMEOUT_S)
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = None, f"timed out after {PYTEST_TIMEOUT_S:.0f} s: {exc}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else ""
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", summary)}
    return {"figure_command": " ".join(["python", *cmd[1:]]),
            "returncode": code, "summary": summary, "counts": counts,
            "seconds": round(time.perf_counter() - t0, 2), "tail": "\n".join(lines[-15:])}


def model_case(name: str, size: str, dt: str, cluster: ex.Cluster, steps: int,
               energy: EnergyCounter, dry: bool, traces: Path | None = None,
               pool: RankPool | None = None) -> dict[str, Any]:
    """Capture, profile, predict, run and compare one built-in model on the cluster's device."""
    dtype = DTYPES[dt]
    bm = ex.builtin_model(name, size)
    module = bm.module.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in bm.example_inputs)
    out: dict[str, Any] = {"model": name, "size": size, "dtype": dt, "batch": bm.batch_size,
                           "params": bm.n_params}
    t0 = time.perf_counter()
    graph = ex.capture(module, inputs, bm.loss_fn, bm.targets, name=f"{name}-{size}-{dt}")
    out["capture_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # a dry run reuses cached CPU profiles (it checks code paths); on the GPU, profile afresh
    costs = ex.profile(graph, cluster, repeats=3 if dry else 15, cache=dry, progress=False)
    out["profile_s"] = time.perf_counter() - t0
    plan = ex.partition(graph, cluster, costs, "single")
    pred = ex.simulate(graph, plan, costs)
    dev = cluster.ids[0]
    out["predicted"] = {"step_s": pred.step_s, "peak_bytes": pred.peak_bytes[dev],
                        "energy_j": pred.energy_j, "fits": pred.fits}
    t0 = time.perf_counter()
    meas = ex.run(graph, plan=plan, steps=steps, warmup=2, costs=costs, cluster=cluster,
                  progress=False, timeout_s=400.0, pool=pool)
    out["run_s"] = time.perf_counter() - t0
    out["measured"] = {"step_s": meas.step_s, "peak_allocated_bytes": meas.peak_bytes[dev],
                       "peak_reserved_bytes": NOT_AVAILABLE + " (not in ex.Measurement)",
                       "memory_source": meas.memory_source,
                       "energy_j": meas.energy_j if meas.energy_j is not None
                       else unmeasured_energy(energy, cluster.devices[0].kind == "cuda"),
                       "losses_first_last": [meas.losses[0], meas.losses[-1]]}
    out["compare"] = ex.compare(pred, meas).to_dict()
    out["eager"] = eager_reference(
        bm, module, inputs, steps, energy, cluster.devices[0].torch_device or "cpu", graph,
        traces, predict=lambda matched: trace_prediction(graph, plan, costs, matched))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the reference's copy is gone: give its memory back
    return out


def eager_reference(bm: Any, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                    steps: int, energy: EnergyCounter, device: str, graph: Any = None,
                    traces: Path | None = None,
                    predict: Callable[[dict[str, OpTiming]], float] | None = None
                    ) -> dict[str, Any]:
    """Plain PyTorch training steps (Adam) of a copy of the module on ``device``, in this
    process: median step time, peak allocated and reserved memory, NVML energy per step, and
    (given the ``graph``) one step traced, its ops' host and device times, and what
    ``predict`` makes of them."""
    tdev = torch.device(device)
    cuda = tdev.type == "cuda"
    mod = copy.deepcopy(module).to(tdev).train()
    xs = [x.to(tdev) for x in inputs]
    ys = [y.to(tdev) for y in bm.targets]
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        bm.loss_fn(mod(*xs), *ys).backward()
        opt.step()

    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(tdev)
    e0 = energy.read_mj() if cuda else None
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    e1 = energy.read_mj() if cuda else None
    out: dict[str, Any] = {"step_s": sorted(times)[len(times) // 2]}
    if cuda:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(tdev)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(tdev)
    else:
        out["peak_allocated_bytes"] = out["peak_reserved_bytes"] = f"{NOT_AVAILABLE} (CPU)"
    out["energy_j_per_step"] = ((e1 - e0) / 1e3 / steps if e0 is not None and e1 is not None
                                else unmeasured_energy(energy, cuda))
    if graph is not None:
        out["trace"] = traced_step(step, graph, cuda, traces, predict)
    return out


def trace_prediction(graph: ex.OpGraph, plan: ex.Plan, costs: ex.CostModel,
                     matched: dict[str, OpTiming]) -> float:
    """The plan's step simulated from a traced eager step: each op's kernels on the device's
    timeline and its host interval on the host's (two timelines), the optimizer step as the
    profile has it."""
    key = costs.cluster.devices[0].type_key
    traced = timeline_costs(graph, matched, key, base=costs.per_type[key])
    return ex.simulate(graph, plan, replace(costs, per_type={**costs.per_type, key: traced})
                       ).step_s


def traced_step(step: Any, graph: Any, cuda: bool, keep: Path | None,
                predict: Callable[[dict[str, OpTiming]], float] | None = None
                ) -> dict[str, Any]:
    """One ``step()`` under torch.profiler, its trace read into the graph's ops' host and
    device times (summed over forward and backward), and the step ``predict`` makes of
    them; the trace is written to ``keep`` when given."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = keep or Path(folder) / "trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        timings = op_timings(path)
    try:
        matched = match_graph(timings, graph)
    except TraceError as exc:
        return {"error": str(exc), "trace_ops": len(timings)}
    ops = list(matched.values())
    return {"ops_matched": len(ops), "trace_ops": len(timings),
            "host_s": sum(t.host_s + t.backward_host_s for t in ops),
            "device_s": sum(t.device_s + t.backward_device_s for t in ops),
            "kernels": sum(t.kernels for t in ops),
            "host_bound_ops": sum(t.kernels > 0 and t.host_s > t.device_s for t in ops),
            "predicted_step_s": predict(matched) if predict is not None else None,
            "kept": str(keep) if keep else None}


def unmeasured_energy(energy: EnergyCounter, cuda: bool) -> str:
    """Why there is no energy figure: NVML's counter measures GPUs only, and may be absent."""
    return f"{NOT_AVAILABLE} ({energy.status if cuda else 'CPU rank: NVML measures GPUs'})"


def _j(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else "-"


def _per_figure(c: dict[str, Any]) -> list[tuple[str, Any, Any, Any, str]]:
    """(figure, predicted, measured, eager, unit) of one model case."""
    p, m, e = c["predicted"], c["measured"], c["eager"]
    traced = e.get("trace", {}).get("predicted_step_s")
    return [("step time", p["step_s"], m["step_s"], e["step_s"], "ms"),
            *([("step time from the traced eager step", traced, e["step_s"], e["step_s"], "ms")]
              if traced is not None else []),
            ("peak memory", p["peak_bytes"], m["peak_allocated_bytes"],
             e["peak_allocated_bytes"], "MiB"),
            ("energy", p["energy_j"], m["energy_j"], e["energy_j_per_step"], "J")]


def summary_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model case and figure: predicted vs measured, the error, its target and
    whether it is met; the eager PyTorch figure beside them."""
    show = {"ms": fmt_ms, "MiB": fmt_mib, "J": _j}
    rows: list[dict[str, Any]] = []
    for key, c in data["cases"].items():
        if key == "pytest -m gpu":
            continue
        if failure(c):
            rows.append({"case": key, "figure": "-", "predicted": "-", "measured": "-",
                         "error": "error: " + failure(c)[:80]})
            continue
        for what, p, m, e, unit in _per_figure(c):
            ok = isinstance(p, (int, float)) and isinstance(m, (int, float)) and m
            err = (p - m) / m if ok else None
            rows.append({
                "case": key, "figure": f"{what} ({unit}{' per step' if unit == 'J' else ''})",
                "predicted": show[unit](p), "measured": show[unit](m),
                "error": f"{err * 100:+.0f} %" if err is not None else "-",
                "target": f"within {TARGETS[what] * 100:.0f} %",
                "met": "-" if err is None else "met" if abs(err) <= TARGETS[what] else "not met",
                "eager PyTorch": show[unit](e)})
    return rows


def summarize_check(data: dict[str, Any]) -> None:
    """The record fields benchmarks/report.py renders (see ``summarize``)."""
    py = data["cases"].get("pytest -m gpu", {})
    notes = [f"`pytest -m gpu`: {py.get('summary') or py.get('error') or 'not run'}.",
             *not_run_notes(data)]
    notes.append("Measured: `ex.run` of the single-device plan, median of "
                 f"{data['steps']} steps; memory: torch.cuda.max_memory_allocated; energy: "
                 "NVML's counter over all measured steps, per step. Eager PyTorch: the same "
                 "model and Adam in plain PyTorch on the same GPU.")
    if any(c.get("dtype") == "bf16" for c in data["cases"].values()):
        notes.append(DTYPE_NOTE)
    summarize(data, "One GPU: predicted vs measured per built-in model", summary_rows(data),
              [*notes, MULTI_GPU_NOTE, RESERVED_NOTE])


def report(data: dict[str, Any]) -> None:
    """Print the pytest summary and one table of every model case in the results file."""
    print("\n" + device_line(data["device"]))
    py = data["cases"].get("pytest -m gpu")
    if py:
        print(f"{py.get('figure_command', 'pytest -m gpu')}: "
              f"{py.get('summary') or py.get('error')} {py.get('counts', {})}")
    rows = []
    for key, c in data["cases"].items():
        if key == "pytest -m gpu":
            continue
        if failure(c):
            rows.append((key, "error: " + failure(c)[:70], *["-"] * 10))
            continue
        p, m, e = c["predicted"], c["measured"], c["eager"]
        rows.append((key, fmt_ms(p["step_s"]), fmt_ms(m["step_s"]),
                     fmt_error(p["step_s"], m["step_s"]), fmt_ms(e["step_s"]),
                     fmt_mib(p["peak_bytes"]), fmt_mib(m["peak_allocated_bytes"]),
                     fmt_error(p["peak_bytes"], m["peak_allocated_bytes"]),
                     fmt_mib(e["peak_reserved_bytes"]), _j(p["energy_j"]), _j(m["energy_j"]),
                     _j(e["energy_j_per_step"])))
    if rows:
        print(table(("case", "pred ms", "run ms", "err", "eager ms", "pred MiB", "run MiB",
                     "err", "eager rsv MiB", "pred J", "run J", "eager J"), rows))
    for note in data["notes"]:
        print("note:", note)


if __name__ == "__main__":
    main()
