"""The real-run path against eager PyTorch on one device: ops one at a time, segments, compiled
segments, eager and ``torch.compile``.

Run: python benchmarks/native.py [--quick] [--models mlp,gpt] [--sizes small,default]
       [--rounds 2] [--steps 10] [--compile]
     python benchmarks/native.py --gpu [--models gpt,llama,resnet] [--sizes large]
     python benchmarks/native.py --dry-run [--results DIR]

On CPU (the default), for every built-in model at each size, the single-device plan runs on
one CPU rank with ``runtime="ops"`` (each op replayed from Python with its own backward) and
with ``runtime="segments"`` (each micro-batch's ops as one generated ``torch.fx`` module with
one backward, :mod:`explorer.runtime.segments`), and the same model trains in eager PyTorch in
a process set up as a rank is (one thread, pinned to the first core, the allocator keeping
what it frees), with the runtime's optimizer (the plan's, Adam) at the same learning rate and
the same step (zero the gradients, forward and loss, backward, optimizer). ``--compile`` adds
``ex.run(..., runtime="segments", compile=True)`` (each segment through ``torch.compile``,
:mod:`explorer.runtime.segment_compile`) against the eager step with ``torch.compile`` of the
model and its loss (the backward and the optimizer eager on both sides).

``--gpu`` (a machine with CUDA): gpt, llama and resnet at size ``large`` on ``cuda:0``, in
fp32 and in bf16 autocast (``precision="bf16"`` plans; the eager step under
``torch.autocast``, weights fp32 on both sides): ex.run's segments against eager, compiled
segments against ``torch.compile``, and each one's peak memory
(``torch.cuda.max_memory_allocated`` over the measured steps, in the rank and in the eager
process) against its eager counterpart's. Recorded as ``native_gpu``.
``--dry-run``: the ``--gpu`` code path on CPU with the tiny size, 1 round of 2 steps, gpt
only unless ``--models`` says otherwise (each model compiles afresh: minutes on a small host),
written to a new temporary folder (or ``--results``): it proves the GPU script runs (CPU ranks
count their own memory and an eager CPU process has no allocator to ask, so the memory columns
are empty).

Every way runs in turn, ``--rounds`` times, ``--steps`` measured steps each after a warm-up
(the compiled ways compile in it), so a slow spell of a shared host lands on all of them;
each column is the median over all the measured steps (``--rounds x --steps``, at least 20 by
default) and the ratios are of those medians. ``--quick``: the small size only.

Prints its table and records it as ``benchmarks/results/native.json`` (``--results``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
from _common import RESULTS, add_results_option, dry_run_ranks, load_average, write_result

import explorer as ex
from explorer.capture.step import TrainStep
from explorer.core.units import table
from explorer.platforms import platform_of
from explorer.runtime import RankPool
from explorer.runtime.params import make_optimizer

LR = 1e-3  # ex.run's default learning rate
WARMUP = 3
#: how ex.run runs each of its ways
EX_RUNS = {"ops": {"runtime": "ops"}, "segments": {"runtime": "segments"},
           "compiled": {"runtime": "segments", "compile": True}}
#: each ex.run way's eager counterpart (the ratios' denominators)
COUNTERPART = {"ops": "eager", "segments": "eager", "compiled": "torch.compile"}
GPU_MODELS = ("gpt", "llama", "resnet")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Eager:
    """One eager run of a built-in model, in a process of its own (:func:`eager_steps`)."""

    name: str
    size: str
    optimizer: str
    steps: int
    device: str = "cpu"
    precision: str = "fp32"
    compile: bool = False


def eager_steps(run: Eager) -> dict[str, object]:
    """Seconds of each of ``run.steps`` training steps of the built-in model in eager PyTorch
    (``torch.compile`` of the model and loss with ``run.compile``) after :data:`WARMUP`, in
    this process set up as a rank of ``run.device`` is, and the peak memory allocated over
    them (None on CPU)."""
    cuda = run.device == "cuda"
    platform = platform_of(run.device)
    torch.set_num_threads(1)
    platform.pin_rank(0, 1)
    platform.hold_freed_memory()
    bm = ex.builtin_model(run.name, run.size)
    module = bm.module.to(run.device)
    batch = [t.to(run.device) for t in (*bm.example_inputs, *bm.targets)]
    step = TrainStep(module, bm.loss_fn, len(bm.example_inputs)).train()
    forward = torch.compile(step) if run.compile else step
    opt = make_optimizer(run.optimizer, list(module.parameters()), LR)
    times = []
    for k in range(WARMUP + run.steps):
        if cuda and k == WARMUP:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(run.device, dtype=torch.bfloat16) if run.precision == "bf16"
              else contextlib.nullcontext()):
            loss = forward(*batch)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if k >= WARMUP:
            times.append(time.perf_counter() - t0)
    return {"times": times, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def eager_in_process(run: Eager) -> dict[str, object]:
    """:func:`eager_steps` in a fresh process (as a rank is one)."""
    out = subprocess.run([sys.executable, __file__, "--eager", json.dumps(asdict(run))],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the eager run {run} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


@dataclass(frozen=True)
class Setup:
    """How the rows are measured: on which device, in which precision, which ways."""

    device: str
    precision: str
    #: the ways of ex.run (:data:`EX_RUNS`) and of eager PyTorch ("eager", "torch.compile")
    runs: tuple[str, ...]
    eager: tuple[str, ...]
    #: whether the rows say their precision and compare peak memory (the GPU table)
    memory: bool = False


def measure(name: str, size: str, setup: Setup, rounds: int, steps: int,
            pool: RankPool | None = None) -> dict[str, object]:
    """One row: the model's median step each way, the ratios of ex.run's ways to eager's
    (and the segments' to the op path's), and with ``setup.memory`` the peaks; ``pool``: the
    ranks ex.run's runs share (a dry run's), else each starts its own."""
    bm = ex.builtin_model(name, size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    plan = ex.Plan.single(graph, f"{setup.device}:0")
    if setup.precision != "fp32":
        plan = plan.with_memory(precision=setup.precision)
    times: dict[str, list[float]] = {k: [] for k in (*setup.runs, *setup.eager)}
    peaks: dict[str, list[int | None]] = {k: [] for k in times}
    for _ in range(rounds):
        for way in setup.runs:
            m = ex.run(graph, plan=plan, steps=steps, warmup=WARMUP, progress=False,
                       timeout_s=3600, pool=pool, **EX_RUNS[way])
            times[way] += m.step_samples_s
            peaks[way].append(max(m.peak_bytes.values()) if setup.device == "cuda" else None)
        for way in setup.eager:
            got = eager_in_process(Eager(name, size, plan.optimizer, steps, setup.device,
                                         setup.precision, way == "torch.compile"))
            times[way] += got["times"]
            peaks[way].append(got["peak_bytes"])
    med = {k: statistics.median(v) for k, v in times.items()}
    row: dict[str, object] = {"model": name, "size": size}
    if setup.memory:
        row["precision"] = setup.precision
    row["steps each"] = len(next(iter(times.values())))
    row.update({f"{k} ms": round(v * 1e3, 2) for k, v in med.items()})
    for way in setup.runs:
        if COUNTERPART[way] in med:
            row[f"{way} / {COUNTERPART[way]}"] = round(med[way] / med[COUNTERPART[way]], 2)
    if "ops" in med and "segments" in med:
        row["segments / ops"] = round(med["segments"] / med["ops"], 2)
    if setup.memory:
        peak = {k: max(v) if None not in v else None for k, v in peaks.items()}
        row.update({f"{k} MiB": None if p is None else round(p / 2**20, 1)
                    for k, p in peak.items()})
        for way in setup.runs:
            base = peak.get(COUNTERPART[way])
            row[f"{way} / {COUNTERPART[way]} memory"] = (
                round(peak[way] / base, 3) if peak[way] is not None and base else None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=None,
                    help="built-in models (default: all on CPU; gpt,llama,resnet with --gpu)")
    ap.add_argument("--sizes", default=None,
                    help="sizes (default: small,default on CPU; large with --gpu)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the small size only")
    ap.add_argument("--compile", action="store_true",
                    help="also compiled segments against torch.compile (on CPU)")
    ap.add_argument("--gpu", action="store_true",
                    help="on cuda:0: gpt, llama and resnet (large), fp32 and bf16, eager and "
                         "compiled, with peak memory")
    ap.add_argument("--dry-run", action="store_true",
                    help="the --gpu code path on CPU: tiny size, 1 round of 2 steps, gpt "
                         "unless --models says otherwise, written to a temporary folder "
                         "unless --results names one")
    ap.add_argument("--eager", help=argparse.SUPPRESS)  # (one eager run, in its own process)
    add_results_option(ap)
    ap.set_defaults(results=None)
    args = ap.parse_args()
    if args.eager:
        print(json.dumps(eager_steps(Eager(**json.loads(args.eager)))))
        return
    name, title, cases = gpu_cases(args) if args.gpu or args.dry_run else cpu_cases(args)
    rows = []
    with dry_run_ranks(args.dry_run) as pool:
        for model, size, setup in cases:
            rows.append(measure(model, size, setup, args.rounds, args.steps, pool))
            # (after every row: a run stopped part-way keeps what it measured)
            write_result(name, rows, title=title, folder=args.results,
                         notes=f"{load_average()} at the end; one thread each way")
    print(title)
    print(table(list(rows[0]), [list(r.values()) for r in rows]))


def cpu_cases(args: argparse.Namespace) -> tuple[str, str, list[tuple[str, str, Setup]]]:
    """The CPU table's record name, title and rows: every model and size, the op path,
    segments and eager (and with ``--compile`` compiled segments and torch.compile)."""
    setup = Setup("cpu", "fp32", ("ops", "segments", *(("compiled",) if args.compile else ())),
                  ("eager", *(("torch.compile",) if args.compile else ())))
    sizes = ["small"] if args.quick else (args.sizes or "small,default").split(",")
    models = (args.models or ",".join(ex.model_names())).split(",")
    args.results = args.results or str(RESULTS)
    title = ("One CPU rank, single-device plan: ex.run op by op and in segments"
             + (", and compiled segments against torch.compile," if args.compile else "")
             + f" against eager PyTorch ({args.rounds} interleaved rounds of {args.steps} "
             "steps each way; median step)")
    return "native", title, [(m, s, setup) for s in sizes for m in models]


def gpu_cases(args: argparse.Namespace) -> tuple[str, str, list[tuple[str, str, Setup]]]:
    """The GPU table's (or its dry run's, on CPU) record name, title and rows: each model,
    size and precision, segments and compiled segments against eager and torch.compile,
    with peak memory."""
    if args.dry_run:
        device, sizes, args.rounds, args.steps = "cpu", ["tiny"], 1, 2
        args.models = args.models or GPU_MODELS[0]
        args.results = args.results or tempfile.mkdtemp(prefix="native-dry-")
    else:
        if not torch.cuda.is_available():
            sys.exit("--gpu needs a CUDA GPU (torch.cuda.is_available() is False); "
                     "--dry-run runs the same code path on CPU")
        device, sizes = "cuda", (args.sizes or "large").split(",")
        args.results = args.results or str(RESULTS)
    models = (args.models or ",".join(GPU_MODELS)).split(",")
    title = (f"One {'GPU' if device == 'cuda' else 'CPU rank (dry run)'}, single-device "
             "plan: ex.run's segments against eager PyTorch and compiled segments against "
             f"torch.compile, fp32 and bf16 autocast ({args.rounds} interleaved rounds of "
             f"{args.steps} steps each way; median step; peak memory allocated)")
    return "native_gpu", title, [
        (m, s, Setup(device, precision, ("segments", "compiled"), ("eager", "torch.compile"),
                     memory=True))
        for s in sizes for m in models for precision in PRECISIONS]


if __name__ == "__main__":
    main()
