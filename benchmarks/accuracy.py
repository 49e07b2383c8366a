"""Prediction accuracy: run plans for real on CPU ranks and compare with the simulator.

Run: python benchmarks/accuracy.py [--size small] [--models mlp,gpt,...] [--steps 5]
       [--algorithms single,data-parallel,...] [--devices 2]
For every model x plan it profiles once (through the runtime, one thread per rank), predicts,
runs real steps with ``ex.run`` and prints predicted vs measured step time and peak memory with
the error per plan, their mean and max, and Kendall's tau between predicted and measured step
times across all plans. Run it on a quiet machine: the ranks share its cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scipy.stats import kendalltau

import explorer as ex
from explorer.cli import _table

PLANS = [
    ("single", {}),
    ("data-parallel", {}),
    ("even-layers", {}),
    ("balanced-params", {}),
    ("even-layers", {"micro_batches": 4, "schedule": "gpipe"}),
    ("even-layers", {"micro_batches": 4, "schedule": "1f1b"}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--models", default="mlp,alexnet,resnet,gpt")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--extra", default="", help="more registered algorithms to include")
    args = ap.parse_args()
    plans = list(PLANS) + [(a, {}) for a in args.extra.split(",") if a]
    cluster = ex.Cluster.cpu(args.devices)
    rows, pairs, step_err, mem_err = [], [], [], []
    t_all = time.perf_counter()
    for name in args.models.split(","):
        bm = ex.builtin_model(name, args.size)
        graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
        costs = ex.profile(graph, cluster, progress=False)
        for alg, opts in plans:
            try:
                plan = ex.partition(graph, cluster, costs, alg, **opts)
            except ex.ExplorerError as exc:
                rows.append((name, alg, "-", "-", "-", "-", "-", "-", f"skipped: {exc}"[:50]))
                continue
            pred = ex.simulate(graph, plan, costs)
            meas = ex.run(graph, plan=plan, costs=costs, steps=args.steps, warmup=args.warmup,
                          progress=False)
            rep = ex.compare(pred, meas)
            e_step = rep.step_error
            e_mem = max(rep.memory_errors.values(), key=abs)
            step_err.append(abs(e_step))
            mem_err.append(abs(e_mem))
            pairs.append((pred.step_s, meas.step_s))
            label = alg + "".join(f" {k}={v}" for k, v in opts.items())
            rows.append((name, label, f"{pred.step_s * 1e3:.2f}", f"{meas.step_s * 1e3:.2f}",
                         f"{e_step * 100:+.1f}%",
                         f"{max(pred.peak_bytes.values()) / 2**20:.2f}",
                         f"{max(meas.peak_bytes.values()) / 2**20:.2f}",
                         f"{e_mem * 100:+.1f}%", ""))
    print(f"Predicted vs measured on {cluster.name} ({args.size} models, {args.steps} steps "
          f"after {args.warmup} warm-up, median of the slowest rank)")
    print(_table(("model", "plan", "pred ms", "meas ms", "step err", "pred MiB", "meas MiB",
                  "mem err (worst device)", "note"), rows))
    if pairs:
        tau = kendalltau([p for p, _ in pairs], [m for _, m in pairs]).statistic
        print(f"\nplans: {len(pairs)}; step-time error mean {statistics.mean(step_err) * 100:.1f}%"
              f", max {max(step_err) * 100:.1f}%; memory error mean "
              f"{statistics.mean(mem_err) * 100:.1f}%, max {max(mem_err) * 100:.1f}%; "
              f"Kendall tau {tau:.2f}; wall {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
