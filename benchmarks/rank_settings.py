"""A CPU rank process setting on against off, side by side.

Run: python benchmarks/rank_settings.py [--setting pin|malloc] [--models gpt,mlp,resnet]
       [--passes 5] [--steps 5]

The runtime sets up every CPU rank process in two ways, each with a switch to turn it off:

* ``pin``: pinned to a core of its own (:func:`explorer.platforms.cpu.pin_cpu_rank`);
  ``EXPLORER_PIN=0`` leaves the ranks to the OS;
* ``malloc``: glibc's allocator keeps the memory the rank frees for its next step
  (:func:`explorer.platforms.cpu.hold_freed_memory`); ``EXPLORER_MALLOC=0`` leaves the defaults.

For every model, four plans on 2 CPU ranks (one rank; two data-parallel replicas; even layers
in four micro-batches, GPipe and 1F1B) run ``--passes`` times each way, on and off
alternating, so a slow spell of the host lands on both. The table gives each way's median
step over the passes, how far its passes were apart (largest over smallest pass median), the
median busy time of each way's busiest rank, and on / off.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import os
import statistics

from _common import add_results_option, builtin_plans, write_result

import explorer as ex
from explorer.core.units import table

#: setting -> (the environment variable that turns it off with 0, what "on" means)
SETTINGS = {"pin": ("EXPLORER_PIN", "pinned"), "malloc": ("EXPLORER_MALLOC", "freed memory held")}

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
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="pin")
    add_results_option(ap)
    args = ap.parse_args()
    var, what = SETTINGS[args.setting]
    cluster = ex.Cluster.cpu(2)
    rows = []
    before = os.environ.get(var)
    try:
        for name in args.models.split(","):
            graph, plans = builtin_plans(name, args.size, cluster, PLANS)
            got: dict[tuple[str, str], list[float]] = {}
            busy: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.passes):
                for on in ("0", "1"):  # alternating
                    os.environ[var] = on
                    for label, plan in plans:
                        m = ex.run(graph, plan=plan, steps=args.steps, warmup=3,
                                   progress=False)
                        got.setdefault((label, on), []).append(m.step_s)
                        busy.setdefault((label, on), []).append(max(m.busy_s.values()))
            for label, _ in plans:
                off, on = got[(label, "0")], got[(label, "1")]
                rows.append((name, label,
                             f"{statistics.median(off) * 1e3:.2f}",
                             f"{(max(off) / min(off) - 1) * 100:.0f}%",
                             f"{statistics.median(busy[(label, '0')]) * 1e3:.2f}",
                             f"{statistics.median(on) * 1e3:.2f}",
                             f"{(max(on) / min(on) - 1) * 100:.0f}%",
                             f"{statistics.median(busy[(label, '1')]) * 1e3:.2f}",
                             f"{statistics.median(on) / statistics.median(off):.2f}"))
    finally:
        if before is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = before
    title = (f"CPU ranks {what} (on) vs not (off, {var}=0) on {cluster.name} ({args.passes} "
             f"alternating passes of {args.steps} steps each way; median step of each pass)")
    head = ("model", "plan", "off ms", "off pass spread", "off busy ms", "on ms",
            "on pass spread", "on busy ms", "on / off")
    print(title)
    print(table(head, rows))
    write_result(f"rank-settings-{args.setting}", rows, columns=head, title=title,
                 folder=args.results)


if __name__ == "__main__":
    main()
