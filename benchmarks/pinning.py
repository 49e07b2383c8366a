"""CPU ranks pinned to a core each against ranks the OS moves between cores, side by side.

Run: python benchmarks/pinning.py [--models gpt,mlp,resnet] [--passes 5] [--steps 5]

The runtime pins every CPU rank to a core of its own (:func:`explorer.cluster.pin_cpu_rank`);
``EXPLORER_PIN=0`` leaves them to the OS. For every model, four plans on 2 CPU ranks (one
rank; two data-parallel replicas; even layers in four micro-batches, GPipe and 1F1B) run
``--passes`` times each way, pinned and unpinned alternating, so a slow spell of the host
lands on both. The table gives each way's median step over the passes, how far its passes
were apart (largest over smallest pass median), and pinned / unpinned.
"""

from __future__ import annotations

import argparse
import os
import statistics

import explorer as ex
from explorer.cli import _table

PLANS = [
    ("single", "single", {}),
    ("data-parallel", "data-parallel", {}),
    ("gpipe x4", "even-layers", {"micro_batches": 4, "schedule": "gpipe"}),
    ("1f1b x4", "even-layers", {"micro_batches": 4, "schedule": "1f1b"}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="default")
    ap.add_argument("--models", default="gpt,mlp,resnet")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    cluster = ex.Cluster.cpu(2)
    rows = []
    before = os.environ.get("EXPLORER_PIN")
    try:
        for name in args.models.split(","):
            bm = ex.builtin_model(name, args.size)
            graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
            costs = ex.profile(graph, cluster, progress=False)  # only to make the plans
            plans = [(label, ex.partition(graph, cluster, costs, alg, **opts))
                     for label, alg, opts in PLANS]
            got: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.passes):
                for pin in ("0", "1"):  # alternating
                    os.environ["EXPLORER_PIN"] = pin
                    for label, plan in plans:
                        m = ex.run(graph, plan=plan, steps=args.steps, warmup=3,
                                   progress=False)
                        got.setdefault((label, pin), []).append(m.step_s)
            for label, _ in plans:
                off, on = got[(label, "0")], got[(label, "1")]
                rows.append((name, label,
                             f"{statistics.median(off) * 1e3:.2f}",
                             f"{(max(off) / min(off) - 1) * 100:.0f}%",
                             f"{statistics.median(on) * 1e3:.2f}",
                             f"{(max(on) / min(on) - 1) * 100:.0f}%",
                             f"{statistics.median(on) / statistics.median(off):.2f}"))
    finally:
        if before is None:
            os.environ.pop("EXPLORER_PIN", None)
        else:
            os.environ["EXPLORER_PIN"] = before
    print(f"Pinned vs unpinned CPU ranks on {cluster.name} ({args.passes} alternating passes "
          f"of {args.steps} steps each way; median step of each pass)")
    print(_table(("model", "plan", "unpinned ms", "unpinned pass spread", "pinned ms",
                  "pinned pass spread", "pinned / unpinned"), rows))


if __name__ == "__main__":
    main()
