"""A profile's wall time with rank processes started per run or kept for the whole profile.

Run: python benchmarks/profile_pool.py [--models mlp,alexnet,resnet,gpt] [--times 2]
       [--passes 0]

A profile on CPU ranks makes about ten short runs (each share of the batch twice, then the
contention pair twice). Each used to start its own rank processes, seconds apiece; now the runs
of one profile share ranks started once (:class:`explorer.runtime.pool.RankPool`,
``explorer.profiling.profiler.REUSE_RANKS``). For every model this profiles afresh ``--times``
times each way, in turn (so a slow spell of the host lands on both), and predicts three plans
from every profile. The table gives, per model and plan, each way's mean profile time, its
predictions' mean and spread (max / min - 1 over the profiles), and how far the pooled
predictions' mean lies from the fresh ones' (to compare with the spreads: the same
measurements, so no farther than the profile's own run-to-run spread); with ``--passes``, the
plans run for real (processes started per run, as ``ex.run`` makes them) and each way's error
against the measured step. A last row times the host's message probe (measured once per host)
each way.

Prints its table and records it under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time

from _common import add_results_option, builtin_plans, load_average, write_result
from profile_repeat import PLANS

import explorer as ex
from explorer.core.units import table
from explorer.runtime.pool import RankPool

WAYS = {"fresh": False, "pool": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="default")
    ap.add_argument("--models", default="mlp,alexnet,resnet,gpt")
    ap.add_argument("--times", type=int, default=2, help="profiles per model and way")
    ap.add_argument("--passes", type=int, default=0,
                    help="real runs of each plan (as ex.run makes them) for a reference")
    ap.add_argument("--steps", type=int, default=5)
    add_results_option(ap)
    args = ap.parse_args()
    profiler = importlib.import_module("explorer.profiling.profiler")
    host = importlib.import_module("explorer.profiling.host")
    cluster = ex.Cluster.cpu(2)
    rows = []
    t_all = time.perf_counter()
    for name in args.models.split(","):
        graph, plans = builtin_plans(name, args.size, cluster, PLANS)
        walls: dict[str, list[float]] = {w: [] for w in WAYS}
        preds: dict[str, list[list[float]]] = {w: [] for w in WAYS}
        for _ in range(args.times):
            for way, reuse in WAYS.items():  # in turn
                profiler.REUSE_RANKS = reuse
                t0 = time.perf_counter()
                costs = ex.profile(graph, cluster, progress=False, cache=False)
                walls[way].append(time.perf_counter() - t0)
                preds[way].append([ex.simulate(graph, p, costs).step_s for _, p in plans])
        measured: list[list[float]] = [[] for _ in plans]
        for _ in range(args.passes):
            for i, (_, p) in enumerate(plans):
                measured[i] += ex.run(graph, plan=p, steps=args.steps, warmup=3,
                                      progress=False).step_samples_s
        for i, (label, _) in enumerate(plans):
            got = {w: [p[i] for p in preds[w]] for w in WAYS}
            mean = {w: statistics.fmean(v) for w, v in got.items()}
            meas = statistics.median(measured[i]) if measured[i] else None
            rows.append((name, label, *(f"{statistics.fmean(walls[w]):.1f}" for w in WAYS),
                         *(f"{mean[w] * 1e3:.2f}" for w in WAYS),
                         *(f"{(max(v) / min(v) - 1) * 100:.1f}%" for v in got.values()),
                         f"{(mean['pool'] / mean['fresh'] - 1) * 100:+.1f}%",
                         f"{meas * 1e3:.2f}" if meas else "-",
                         *(f"{(mean[w] / meas - 1) * 100:+.1f}%" if meas else "-"
                           for w in WAYS)))
            print(*rows[-1], sep="  ", flush=True)  # as it goes: a long run shows progress
    probe: dict[str, tuple[float, float]] = {}
    for way, reuse in WAYS.items():
        # an empty profile cache: the probe profiles its own model each way
        with tempfile.TemporaryDirectory() as empty, RankPool(2) as pool:
            os.environ["XDG_CACHE_HOME"] = empty
            t0 = time.perf_counter()
            value = host.measure_message_s(pool=pool if reuse else None)
            probe[way] = (time.perf_counter() - t0, value)
    rows.append(("(host message probe)", "us per message", *(f"{probe[w][0]:.1f}" for w in WAYS),
                 *(f"{probe[w][1] * 1e6:.1f}" for w in WAYS), "-", "-",
                 f"{(probe['pool'][1] / probe['fresh'][1] - 1) * 100:+.1f}%"
                 if probe["fresh"][1] > 0 else "-", "-", "-", "-"))
    title = (f"Profile wall time on {cluster.name}, rank processes started per run (fresh) or "
             f"once per profile (pool); {args.times} profiles each way, in turn, and the "
             "predictions of three plans from them")
    head = ("model", "plan", "fresh profile s", "pool profile s", "fresh pred ms",
            "pool pred ms", "fresh spread", "pool spread", "pool vs fresh", "meas ms",
            "fresh err", "pool err")
    print(title)
    print(table(head, rows))
    load = load_average()
    wall = f"wall {time.perf_counter() - t_all:.0f} s; {load}"
    print("\n" + wall)
    write_result("profile_pool", rows, columns=head, title=title, notes=wall + ".",
                 folder=args.results)


if __name__ == "__main__":
    main()
