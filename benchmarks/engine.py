"""Engine benchmark: capture and profile time of the built-in models, and the baselines' plans.

Run: python benchmarks/engine.py [--size default] [--models gpt,mlp] [--devices 2,4,8]
Prints one table of capture/profile times and one table of simulated plans per device count,
on CPU ranks (profiled here, one thread each) and on an H100 preset (roofline).

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import time

from _common import add_results_option, write_result

import explorer as ex
from explorer.cli.commands import plan_rows
from explorer.core.units import table

BASELINES = ["single", "data-parallel", "even-layers", "balanced-params"]
MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="default")
    ap.add_argument("--models", default=",".join(ex.model_names()))
    ap.add_argument("--devices", default="2,4,8")
    add_results_option(ap)
    args = ap.parse_args()
    counts = [int(k) for k in args.devices.split(",")]
    timing, plans = [], []
    for name in args.models.split(","):
        bm = ex.builtin_model(name, args.size)
        t0 = time.perf_counter()
        graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
        t_cap = time.perf_counter() - t0
        t0 = time.perf_counter()
        costs_cpu = ex.profile(graph, ex.Cluster.cpu(max(counts)), cache=False, progress=False)
        t_prof = time.perf_counter() - t0
        s = graph.summary()
        timing.append((name, s["ops"], f"{s['params_bytes'] / MiB:.1f}",
                       f"{s['gflops_per_step']:.2f}", f"{t_cap:.2f}", f"{t_prof:.2f}"))
        for k in counts:
            for label, cl in ((f"cpu:{k}", ex.Cluster.cpu(k).without_late_receive()),
                              (f"{k}xH100", ex.Cluster.preset(f"{k}xH100"))):
                costs = ex.profile(graph, cl, progress=False) if label.startswith("cpu") \
                    else ex.profile(graph, cl)
                if label.startswith("cpu"):  # one rank's op times for k ranks, without the
                    # contention and the late-receive wait measured between two ranks of
                    # this host (see quality.py)
                    costs = ex.CostModel(graph.fingerprint, cl,
                                         costs_cpu.without_contention().per_type)
                t0 = time.perf_counter()
                for alg, plan, r in plan_rows(graph, cl, costs, BASELINES, {}):
                    if plan is None:
                        plans.append((name, label, alg, "-", "-", "-", "-", r[:60]))
                        continue
                    plans.append((name, label, alg, f"{r.step_s * 1e3:.2f}",
                                  f"{r.gap * 100:.0f}%",
                                  f"{max(r.peak_bytes.values()) / MiB:.1f}",
                                  f"{r.cross_device_bytes / MiB:.2f}",
                                  "yes" if r.fits else "no"))
    title = f"Capture and profile time of the built-in models ({args.size} size)"
    head = ("model", "ops", "params MiB", "GFLOP/step", "capture s", "profile s")
    print(f"{title}; profile = CPU rank, 1 thread")
    print(table(head, timing))
    write_result("engine", timing, columns=head, title=title, folder=args.results)
    title = f"Simulated baselines on {args.devices} devices"
    head = ("model", "devices", "plan", "step ms", "gap to bound", "max peak MiB", "MiB across",
            "fits")
    print(f"\n{title}")
    print(table(head, plans))
    write_result("engine-plans", plans, columns=head, title=title, folder=args.results)


if __name__ == "__main__":
    main()
