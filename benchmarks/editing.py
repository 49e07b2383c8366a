"""Widget benchmark: time from a hand edit to updated numbers, at a few graph sizes.

Run: python benchmarks/editing.py [--sizes 500,2000,10000] [--edits 20] [--devices 4xH100]

For each graph (random layered DAGs and tiled GPT blocks, ``explorer.models.synthetic``; roofline
costs on a GPU preset, no profiling) it opens the explorer widget without a browser, shows every
op as its own item where there are at most 2,000 (blocks beyond), and times ``--edits``
assignments of one shown item to another device: the engine's estimate alone
(``Session.assign``: plan edit + simulation) and the whole widget update (estimate + recolored
graph, cross-device edges, memory bars, timeline and numbers: what the user waits for before
the screen can change). The browser's own drawing is not included. Target: under 100 ms at
2,000 ops. Times are medians (and the slowest) over the edits, in milliseconds.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_results_option, write_result

import explorer as ex
from explorer.core.units import table
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from widgets.app import Explorer
from widgets.session import Session


def gpt_graph(n: int) -> ex.OpGraph:
    bm = ex.builtin_model("gpt", "tiny")
    block = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    return replicated(block, n)


def bench(graph: ex.OpGraph, devices: str, edits: int) -> dict:
    cluster = ex.Cluster.preset(devices)
    costs = roofline_costs(graph, cluster)
    t0 = time.perf_counter()
    w = Explorer(graph, costs)
    open_s = time.perf_counter() - t0
    if len(graph.ops) <= 2000:
        w.session.expand_all()
    view = w.session.view
    items = len(view.items)
    bare = Session(graph, cluster, costs)  # the same edits with no widget listening
    ids = cluster.ids
    engine, whole = [], []
    for k in range(edits):
        it = view.items[(k * 7919) % items]
        target = ids[(k % (len(ids) - 1)) + 1] if k % 2 == 0 else ids[0]
        names = view.names([it.key])
        t0 = time.perf_counter()
        w.session.assign(names, target)  # the widget redraws through its observer
        whole.append(time.perf_counter() - t0)
        w.session.undo()
        t0 = time.perf_counter()  # the engine alone
        bare.assign(names, target)
        engine.append(time.perf_counter() - t0)
        bare.undo()
    return {"ops": len(graph.ops), "items": items, "open_s": open_s,
            "engine_ms": statistics.median(engine) * 1e3, "engine_max_ms": max(engine) * 1e3,
            "widget_ms": statistics.median(whole) * 1e3, "widget_max_ms": max(whole) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="500,2000,10000")
    ap.add_argument("--edits", type=int, default=20)
    ap.add_argument("--devices", default="4xH100")
    add_results_option(ap)
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for kind, make in (("layered", lambda n: layered_dag(n, seed=0)), ("gpt", gpt_graph)):
            r = bench(make(n), args.devices, args.edits)
            rows.append((kind, r))
            print(f"  {kind} {n}: done", file=sys.stderr)
    title = (f"Edit to updated numbers in the explorer widget ({args.devices} preset, roofline "
             f"costs; ms, median / slowest of {args.edits} edits)")
    load = f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    print(f"{title}; {load}")
    head = ("graph", "ops", "items shown", "open (s)", "engine ms", "engine max",
            "widget ms", "widget max", "< 100 ms")
    out = [(kind, f"{r['ops']:,}", f"{r['items']:,}", f"{r['open_s']:.2f}",
            f"{r['engine_ms']:.1f}", f"{r['engine_max_ms']:.1f}",
            f"{r['widget_ms']:.1f}", f"{r['widget_max_ms']:.1f}",
            "yes" if r["widget_ms"] < 100 else "NO") for kind, r in rows]
    print(table(head, out))
    write_result("editing", out, columns=head, title=title, notes=load + ".",
                 folder=args.results)


if __name__ == "__main__":
    main()
