"""How far a prediction moves when the same model is profiled again, for profiling settings.

Run: python benchmarks/profile_repeat.py [--models mlp,gpt] [--times 4]
       [--settings 2/2/5,2/2/15] [--passes 3]

A prediction is only as steady as the profile under it: where the host's speed wanders, a
profile taken a minute later predicts another step.
For every model and every setting (``ROUNDS`` runs of each share of the batch /
``CONTENTION_ROUNDS`` runs of the contention pair / ``repeats`` steps per run), it profiles
afresh ``--times`` times, the settings in turn so a slow spell of the host lands on all of
them, and predicts three plans from each profile: one rank, two data-parallel replicas, and
even layers over two ranks in four micro-batches (1F1B). Then it runs those plans for real
(``--passes`` times, in turn) for a reference. The table
gives, per setting and plan, the predictions' mean, their spread (max / min - 1) and their
coefficient of variation, the mean error against the measured step, and the profile's wall
time. Settings compare side by side in one run, since the host is noisy.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

from _common import add_results_option, builtin_plans, write_result

import explorer as ex
from explorer.core.units import table

PLANS = [
    ("single", "single", {}),
    ("data-parallel", "data-parallel", {}),
    ("even-layers 1f1b x4", "even-layers", {"micro_batches": 4, "schedule": "1f1b"}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="default")
    ap.add_argument("--models", default="mlp,alexnet,resnet,gpt")
    ap.add_argument("--times", type=int, default=4, help="profiles per model and setting")
    ap.add_argument("--settings", default="2/2/5,2/2/15",
                    help="settings to compare, each ROUNDS/CONTENTION_ROUNDS/repeats")
    ap.add_argument("--passes", type=int, default=3, help="real runs of each plan (0: none)")
    ap.add_argument("--steps", type=int, default=5)
    add_results_option(ap)
    args = ap.parse_args()
    try:
        settings = [tuple(int(x) for x in s.split("/")) for s in args.settings.split(",")]
    except ValueError:
        settings = []
    if not settings or any(len(s) != 3 or min(s) < 1 for s in settings):
        ap.error("--settings: comma-separated ROUNDS/CONTENTION_ROUNDS/repeats, e.g. 2/2/5")
    ops = importlib.import_module("explorer.profiling.ops")
    host = importlib.import_module("explorer.profiling.host")
    cluster = ex.Cluster.cpu(2)
    rows = []
    t_all = time.perf_counter()
    for name in args.models.split(","):
        graph, plans = builtin_plans(name, args.size, cluster, PLANS)
        got: dict[tuple[int, ...], list] = {s: [] for s in settings}
        walls: dict[tuple[int, ...], list[float]] = {s: [] for s in settings}
        for _ in range(args.times):
            for st in settings:  # in turn
                ops.ROUNDS, host.CONTENTION_ROUNDS = st[0], st[1]
                t0 = time.perf_counter()
                costs = ex.profile(graph, cluster, repeats=st[2], progress=False, cache=False)
                walls[st].append(time.perf_counter() - t0)
                dc = next(v for k, v in costs.per_type.items() if k.startswith("cpu"))
                got[st].append(([ex.simulate(graph, p, costs).step_s for _, p in plans],
                                statistics.fmean(dc.contention) if dc.contention else 1.0,
                                dc.replica_spread))
        measured = [[] for _ in plans]
        for _ in range(args.passes):
            for i, (_, p) in enumerate(plans):
                measured[i].append(ex.run(graph, plan=p, steps=args.steps, warmup=3,
                                          progress=False))
        for st, profs in got.items():
            for i, (label, _) in enumerate(plans):
                preds = [x[0][i] for x in profs]
                mean = statistics.fmean(preds)
                cv = statistics.stdev(preds) / mean if len(preds) > 1 else 0.0
                if measured[i]:
                    meas = statistics.median(s for m in measured[i] for s in m.step_samples_s)
                    err = statistics.fmean(abs(p / meas - 1) for p in preds)
                else:
                    meas, err = None, None
                rows.append((name, "/".join(map(str, st)), label, f"{mean * 1e3:.2f}",
                             f"{(max(preds) / min(preds) - 1) * 100:.1f}%", f"{cv * 100:.1f}%",
                             f"{meas * 1e3:.2f}" if meas else "-",
                             f"{err * 100:.1f}%" if err is not None else "-",
                             f"{statistics.fmean(x[1] for x in profs):.2f} "
                             f"({min(x[1] for x in profs):.2f}-{max(x[1] for x in profs):.2f})",
                             f"{statistics.fmean(x[2] for x in profs) * 100:.1f}%",
                             f"{statistics.fmean(walls[st]):.1f}"))
    title = f"Profiled {args.times} times per setting on {cluster.name}; predictions of each plan"
    head = ("model", "rounds/contention/repeats", "plan", "pred ms (mean)", "spread", "cv",
            "meas ms", "mean |err|", "contention mean (range)", "replica spread", "profile s")
    print(title)
    print(table(head, rows))
    wall = f"wall {time.perf_counter() - t_all:.0f} s"
    print("\n" + wall)
    write_result("profile-repeat", rows, columns=head, title=title, notes=wall + ".",
                 folder=args.results)


if __name__ == "__main__":
    main()
