"""The real-run path against eager PyTorch on one CPU rank: ops one at a time, segments, eager.

Run: python benchmarks/native.py [--quick] [--models mlp,gpt] [--sizes small,default]
       [--rounds 2] [--steps 10]

For every built-in model at each size, the single-device plan runs on one CPU rank with
``runtime="ops"`` (each op replayed from Python with its own backward) and with
``runtime="segments"`` (each micro-batch's ops as one generated ``torch.fx`` module with one
backward, :mod:`explorer.runtime.segments`), and the same model trains in eager PyTorch in a
process set up as a rank is (one thread, pinned to the first core, the allocator keeping what
it frees), with the runtime's optimizer (the plan's, Adam) at the same learning rate and the
same step (zero the gradients, forward and loss, backward, optimizer). The three run in turn,
``--rounds`` times, ``--steps`` measured steps each after a warm-up, so a slow spell of a
shared host lands on all three; each column is the median over all the measured steps
(``--rounds x --steps``, at least 20 by default) and the ratios are to eager's median.
``--quick``: the small size only.

Prints its table and records it as ``benchmarks/results/native.json`` (``--results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from _common import add_results_option, load_average, write_result

import explorer as ex
from explorer.capture.step import TrainStep
from explorer.core.units import table
from explorer.platforms import platform_of
from explorer.runtime.params import make_optimizer

LR = 1e-3  # ex.run's default learning rate
WARMUP = 3


def eager_steps(name: str, size: str, optimizer: str, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps of built-in model ``name`` in eager
    PyTorch after :data:`WARMUP`, in this process set up as a CPU rank (run in a process of
    its own: :func:`eager_in_process`)."""
    platform = platform_of("cpu")
    torch.set_num_threads(1)
    platform.pin_rank(0, 1)
    platform.hold_freed_memory()
    bm = ex.builtin_model(name, size)
    step = TrainStep(bm.module, bm.loss_fn, len(bm.example_inputs)).train()
    opt = make_optimizer(optimizer, list(bm.module.parameters()), LR)
    batch = (*bm.example_inputs, *bm.targets)
    times = []
    for k in range(WARMUP + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        step(*batch).backward()
        opt.step()
        if k >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def eager_in_process(name: str, size: str, optimizer: str, steps: int) -> list[float]:
    """:func:`eager_steps` in a fresh process (as a rank is one)."""
    out = subprocess.run([sys.executable, __file__, "--eager", name, size, optimizer,
                          str(steps)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def measure(name: str, size: str, rounds: int, steps: int) -> dict[str, object]:
    """One row: the model's median step each way, and the ratios to eager."""
    bm = ex.builtin_model(name, size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    plan = ex.Plan.single(graph, "cpu:0")
    got: dict[str, list[float]] = {"ops": [], "segments": [], "eager": []}
    for _ in range(rounds):
        for runtime in ("ops", "segments"):
            m = ex.run(graph, plan=plan, steps=steps, warmup=WARMUP, progress=False,
                       runtime=runtime, timeout_s=3600)
            got[runtime] += m.step_samples_s
        got["eager"] += eager_in_process(name, size, plan.optimizer, steps)
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"model": name, "size": size, "steps each": len(got["eager"]),
            "eager ms": round(med["eager"] * 1e3, 2),
            "ops ms": round(med["ops"] * 1e3, 2),
            "segments ms": round(med["segments"] * 1e3, 2),
            "ops / eager": round(med["ops"] / med["eager"], 2),
            "segments / eager": round(med["segments"] / med["eager"], 2),
            "segments / ops": round(med["segments"] / med["ops"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(ex.model_names()))
    ap.add_argument("--sizes", default="small,default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the small size only")
    ap.add_argument("--eager", nargs=4, metavar=("MODEL", "SIZE", "OPTIMIZER", "STEPS"),
                    help=argparse.SUPPRESS)  # (one eager run, in a process of its own)
    add_results_option(ap)
    args = ap.parse_args()
    if args.eager:
        name, size, optimizer, steps = args.eager
        print(json.dumps(eager_steps(name, size, optimizer, int(steps))))
        return
    sizes = ["small"] if args.quick else args.sizes.split(",")
    rows = [measure(name, size, args.rounds, args.steps)
            for size in sizes for name in args.models.split(",")]
    title = (f"One CPU rank, single-device plan: ex.run op by op and in segments against eager "
             f"PyTorch ({args.rounds} interleaved rounds of {args.steps} steps each way; "
             "median step)")
    print(title)
    print(table(list(rows[0]), [list(r.values()) for r in rows]))
    write_result("native", rows, title=title, folder=args.results,
                 notes=f"{load_average()} at the end; one thread each way")


if __name__ == "__main__":
    main()
