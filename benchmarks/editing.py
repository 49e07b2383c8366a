"""Widget benchmark: time to the first picture of a model, and from a hand edit to the updated one.

Run: python benchmarks/editing.py [--sizes 500,2000,10000|none] [--edits 20] [--devices 4xH100]
     [--models mlp,alexnet,...|none] [--model-size default] [--shapes llama-70b|none]
     [--shape-devices 64xH100]

First picture: for each built-in model (and Hugging Face's GPT-2 small built from its config,
no download, when ``transformers`` is importable), the time from ``Explorer(model, inputs,
cluster=...)`` to a drawn figure: the capture without running the model (fake tensors), roofline
costs, the opening plan (the fastest quick baseline) and the widget: what a user waits for
before the first picture. Target: 5 s. Then the time until the capture with real weights,
running in the background meanwhile, is done (no profile: the preset's devices are not here).

Edits:

For each graph (random layered DAGs and tiled GPT blocks, ``explorer.models.synthetic``; roofline
costs on a GPU preset, no profiling) it opens the explorer widget without a browser, shows every
op as its own item where there are at most 2,000 (blocks beyond), and times ``--edits``
assignments of one shown item to another device: the engine's estimate alone
(``Session.assign``: plan edit + simulation) and the whole widget update (estimate + recolored
graph, cross-device edges, memory bars, timeline and numbers: what the user waits for before
the screen can change). The browser's own drawing is not included. Target: under 100 ms at
2,000 ops, 150 ms at 500 shown items. Times are medians (and the slowest) over the edits, in
milliseconds; the layout column is the time to lay out the shown items (rows, routed edges).

Published large shapes (``--shapes llama-70b``, on ``--shape-devices 64xH100``): the shape is
captured on fake tensors (not timed here: ``capture_scale.py`` times it), then the time from
``Explorer(graph, costs)`` to the drawn widget, folded (one item per top-level module, the
opening plan the fastest quick baseline), and the same edits as above on its items. Target:
open under 3 s, an edit under 100 ms. Wall seconds, with the process's CPU seconds beside them
(the machine is shared: CPU time is what the widget itself spends).

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_results_option, load_average, write_result

import explorer as ex
from explorer.core.units import table
from explorer.models.builtin import model_names
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from widgets.app import Explorer
from widgets.session import Session

#: the first picture should take at most this long, capture included (seconds)
FIRST_PICTURE_S = 5.0


def gpt_graph(n: int) -> ex.OpGraph:
    bm = ex.builtin_model("gpt", "tiny")
    block = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    return replicated(block, n)


def bench(graph: ex.OpGraph, devices: str, edits: int, expand: bool = True) -> dict:
    cluster = ex.Cluster.preset(devices)
    costs = roofline_costs(graph, cluster)
    t0, c0 = time.perf_counter(), time.process_time()
    w = Explorer(graph, costs)
    open_s, open_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if expand and len(graph.ops) <= 2000:
        w.session.expand_all()
    view = w.session.view
    items = len(view.items)
    t0 = time.perf_counter()
    view.layout()
    layout_s = time.perf_counter() - t0
    bare = Session(graph, cluster, costs)  # the same edits with no widget listening
    ids = cluster.ids
    engine, whole, whole_cpu = [], [], []
    for k in range(edits):
        it = view.items[(k * 7919) % items]
        target = ids[(k % (len(ids) - 1)) + 1] if k % 2 == 0 else ids[0]
        names = view.names([it.key])
        t0, c0 = time.perf_counter(), time.process_time()
        w.session.assign(names, target)  # the widget redraws through its observer
        whole.append(time.perf_counter() - t0)
        whole_cpu.append(time.process_time() - c0)
        w.session.undo()
        t0 = time.perf_counter()  # the engine alone
        bare.assign(names, target)
        engine.append(time.perf_counter() - t0)
        bare.undo()
    return {"ops": len(graph.ops), "items": items, "open_s": open_s, "open_cpu_s": open_cpu_s,
            "plan": w.session.plan.algorithm, "widget_cpu_ms": statistics.median(whole_cpu) * 1e3,
            "layout_s": layout_s,
            "engine_ms": statistics.median(engine) * 1e3, "engine_max_ms": max(engine) * 1e3,
            "widget_ms": statistics.median(whole) * 1e3, "widget_max_ms": max(whole) * 1e3}


def hf_gpt2() -> tuple[object, tuple, object, tuple] | None:
    """Hugging Face's GPT-2 small (124M parameters) built from its config, random weights, on
    a batch of 2 x 64 tokens: (module, inputs, loss_fn, targets); None without transformers."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(GPT2Config())

        def forward(self, ids):
            return self.gpt2(ids, use_cache=False).logits

    def loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (2, 64), generator=gen)
    return Logits(), (ids,), loss, (torch.roll(ids, -1, 1),)


def first_picture(name: str, make, devices: str) -> dict:
    """Seconds from the model to the explorer drawn on it (``Explorer(model, ...)``: a capture
    that runs nothing, roofline estimates, the opening plan, the figure), and then until the
    background capture with real weights is done (see :mod:`widgets.measure`)."""
    module, inputs, loss_fn, targets = make()
    cluster = ex.Cluster.preset(devices)
    t0 = time.perf_counter()
    w = Explorer(module, inputs, cluster=cluster, loss_fn=loss_fn, targets=targets)
    open_s = time.perf_counter() - t0
    w.session.wait_measured()
    measured_s = time.perf_counter() - t0
    graph = w.session.graph
    return {"model": name, "ops": len(graph.ops), "items": len(w.session.view.items),
            "plan": w.session.plan.algorithm, "open_s": open_s, "measured_s": measured_s}


def builtin(name: str, size: str):
    def make():
        bm = ex.builtin_model(name, size)
        return bm.module, bm.example_inputs, bm.loss_fn, bm.targets
    return make


def first_pictures(models: list[str], size: str, devices: str, folder: str) -> None:
    rows = []
    for name in models:
        rows.append(first_picture(f"{name} ({size})", builtin(name, size), devices))
        print(f"  first picture {name}: done", file=sys.stderr)
    if hf_gpt2() is not None:
        rows.append(first_picture("Hugging Face GPT-2 small", hf_gpt2, devices))
    else:
        print("  transformers is not importable: no Hugging Face GPT-2", file=sys.stderr)
    title = (f"Time to the first picture in the explorer widget (Explorer(model, ...) on the "
             f"{devices} preset: a capture that runs nothing, roofline costs, opening plan the "
             "fastest quick baseline; then the capture with real weights in the background; "
             "seconds)")
    load = load_average()
    print(f"{title}; {load}")
    head = ("model", "ops", "items shown", "opening plan", "first picture (s)",
            "real capture done (s)", f"<= {FIRST_PICTURE_S:g} s")
    out = [(r["model"], f"{r['ops']:,}", f"{r['items']:,}", r["plan"], f"{r['open_s']:.2f}",
            f"{r['measured_s']:.2f}", "yes" if r["open_s"] <= FIRST_PICTURE_S else "NO")
           for r in rows]
    print(table(head, out))
    write_result("first_picture", out, columns=head, title=title, notes=load + ".",
                 folder=folder)


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def large_shapes(shapes: list[str], devices: str, edits: int, folder: str) -> None:
    """Open the widget on each published shape's fake capture, folded, and time edits."""
    rows = []
    for name in shapes:
        bm = ex.builtin_model(name)
        t0 = time.perf_counter()
        graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
        capture_s = time.perf_counter() - t0
        rows.append((name, capture_s, bench(graph, devices, edits, expand=False)))
        print(f"  {name}: done", file=sys.stderr)
    title = (f"The explorer widget on published large shapes ({devices} preset, fake capture, "
             f"roofline costs, folded; edits: ms, median / slowest of {edits})")
    load = load_average()
    print(f"{title}; {load}")
    head = ("shape", "ops", "items shown", "opening plan", "capture (s)", "open (s)",
            "open CPU (s)", "engine ms", "widget ms", "widget max", "widget CPU ms",
            "open < 3 s, edit < 100 ms (wall; CPU)")
    out = [(name, f"{r['ops']:,}", f"{r['items']:,}", r["plan"], f"{cap:.1f}",
            f"{r['open_s']:.2f}", f"{r['open_cpu_s']:.2f}", f"{r['engine_ms']:.1f}",
            f"{r['widget_ms']:.1f}", f"{r['widget_max_ms']:.1f}", f"{r['widget_cpu_ms']:.1f}",
            f"{_yes(r['open_s'] < 3 and r['widget_ms'] < 100)}; "
            f"{_yes(r['open_cpu_s'] < 3 and r['widget_cpu_ms'] < 100)}")
           for name, cap, r in rows]
    print(table(head, out))
    write_result("editing_large", out, columns=head, title=title, notes=load + ".",
                 folder=folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="500,2000,10000",
                    help="graph sizes for the edit timings ('none': skip them)")
    ap.add_argument("--edits", type=int, default=20)
    ap.add_argument("--devices", default="4xH100")
    ap.add_argument("--models", default=",".join(model_names()),
                    help="built-in models for the first picture ('none': skip it)")
    ap.add_argument("--model-size", default="default")
    ap.add_argument("--shapes", default="llama-70b",
                    help="published large shapes to open folded ('none': skip them)")
    ap.add_argument("--shape-devices", default="64xH100")
    add_results_option(ap)
    args = ap.parse_args()
    if args.shapes != "none":
        large_shapes(args.shapes.split(","), args.shape_devices, args.edits, args.results)
    if args.models != "none":
        first_pictures(args.models.split(","), args.model_size, args.devices, args.results)
    if args.sizes == "none":
        return
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for kind, make in (("layered", lambda n: layered_dag(n, seed=0)), ("gpt", gpt_graph)):
            r = bench(make(n), args.devices, args.edits)
            rows.append((kind, r))
            print(f"  {kind} {n}: done", file=sys.stderr)
    title = (f"Edit to updated numbers in the explorer widget ({args.devices} preset, roofline "
             f"costs; ms, median / slowest of {args.edits} edits)")
    load = load_average()
    print(f"{title}; {load}")
    head = ("graph", "ops", "items shown", "open (s)", "layout ms", "engine ms", "engine max",
            "widget ms", "widget max", "< 100 ms")
    out = [(kind, f"{r['ops']:,}", f"{r['items']:,}", f"{r['open_s']:.2f}",
            f"{r['layout_s'] * 1e3:.1f}",
            f"{r['engine_ms']:.1f}", f"{r['engine_max_ms']:.1f}",
            f"{r['widget_ms']:.1f}", f"{r['widget_max_ms']:.1f}",
            "yes" if r["widget_ms"] < 100 else "NO") for kind, r in rows]
    print(table(head, out))
    write_result("editing", out, columns=head, title=title, notes=load + ".",
                 folder=args.results)


if __name__ == "__main__":
    main()
