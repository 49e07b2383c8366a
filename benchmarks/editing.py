"""Widget benchmark: time to the first picture of a model, and from a hand edit to the updated one.

Run: python benchmarks/editing.py [--sizes 500,2000,10000|none] [--edits 20] [--devices 4xH100]
     [--models mlp,alexnet,...|none] [--model-size default] [--shapes llama-70b|none]
     [--shape-devices 64xH100] [--cpu-models mlp,alexnet,...|none] [--cpu-ranks 2]
     [--cpu-gpt2] [--device-counts 8,64,256|none] [--counts-shape llama-70b] [--no-page]

First picture: for each built-in model (and Hugging Face's GPT-2 small built from its config,
no download, when ``transformers`` is importable), the time from ``Explorer(model, inputs,
cluster=...)`` to a drawn figure: the capture without running the model (fake tensors), roofline
costs, the opening plan (the fastest quick baseline) and the widget: what a user waits for
before the first picture. Target: 5 s. Then the time until the capture with real weights,
running in the background meanwhile, is done (no profile: the preset's devices are not here).

Measured numbers on CPU ranks (``--cpu-models``, on ``Cluster.cpu(--cpu-ranks)``): the same
first picture, then the time until the profile's preliminary numbers (from its first op timing
run) have replaced the estimates (first measured numbers), and until the background measuring
(capture with real weights, the profile's op timing runs, the contention runs, the per-message
probe) is done and the final measured numbers are in. Target: first measured numbers in 60 s.
Everything is measured afresh in an empty cache folder (``XDG_CACHE_HOME``, nothing of the
user's cache is read or written):
first the host measurements a new machine makes once (``Cluster.cpu``'s compute and link
probes, the per-message probe), timed apart, then each model's profile. GPT-2 small joins with
``--cpu-gpt2`` (minutes of profiling on two CPU ranks).

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

Many devices (``--device-counts``, on ``N``xH100 presets): the shape ``--counts-shape`` (a
published shape, or ``name:size`` of a built-in model) captured once, then at each device
count the first picture (``Explorer(graph, costs)`` to the drawn widget, folded, the opening
plan), the same edits, and the page: how tall the explorer is drawn in JupyterLab in a
1,400 x 900 Chromium window and whether its assign button is beside the graph (no page
without Chromium and playwright, or with ``--no-page``). Target: the page under 1,400 px
(one screen, scrolled once at most) at every count.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_results_option, load_average, write_result
from _page import browser_missing, page_measures

import explorer as ex
from explorer.core.units import table
from explorer.models.builtin import model_names
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from explorer.profiling import host, profile_cache
from explorer.runtime.pool import RankPool
from widgets.app import Explorer
from widgets.session import Session

#: the first picture should take at most this long, capture included (seconds)
FIRST_PICTURE_S = 5.0
#: the measured numbers should replace the estimates within this long (seconds)
MEASURED_S = 60.0
#: the explorer's page should be at most this tall at any device count (pixels)
PAGE_PX = 1400
#: phases of the background measuring, by the words of its progress reports
PHASES = (("profile", "profiling "), ("contention", "contention of"),
          ("message", "message between"))


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


@contextlib.contextmanager
def empty_cache() -> Iterator[None]:
    """Profiles and host measurements in a new empty folder (``XDG_CACHE_HOME``, which rank
    processes inherit) until the block ends; the user's cache is left alone."""
    old = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory(prefix="pe-bench-cache-") as folder:
        os.environ["XDG_CACHE_HOME"] = folder
        host.forget_message_s()
        try:
            yield
        finally:
            if old is None:
                del os.environ["XDG_CACHE_HOME"]
            else:
                os.environ["XDG_CACHE_HOME"] = old
            host.forget_message_s()


def measured_picture(name: str, make, cluster: ex.Cluster) -> dict:
    """Seconds from ``Explorer(model, ..., cluster=cluster)`` (CPU ranks) to the drawn figure,
    then until the first (preliminary) and the final measured numbers are in, with when each
    phase of the background measuring began (seconds from the start; None where its report
    came before the observer)."""
    module, inputs, loss_fn, targets = make()
    shutil.rmtree(profile_cache.cache_dir(), ignore_errors=True)  # this model's profile afresh
    began: dict[str, float] = {}

    def seen(session: Session, what: str) -> None:
        if what == "measure":
            if session.preliminary:
                began.setdefault("first", time.perf_counter() - t0)
            for phase, words in PHASES:
                if words in session.measure_status:
                    began.setdefault(phase, time.perf_counter() - t0)

    t0 = time.perf_counter()
    w = Explorer(module, inputs, cluster=cluster, loss_fn=loss_fn, targets=targets,
                 progress=False)
    open_s = time.perf_counter() - t0
    w.session.observe(seen)
    w.session.wait_measured()
    measured_s = time.perf_counter() - t0
    return {"model": name, "ops": len(w.session.graph.ops), "open_s": open_s,
            "first_s": began.get("first", measured_s), "measured_s": measured_s,
            **{p: began.get(p) for p, _ in PHASES}}


def _span(start: float | None, *ends: float | None) -> str:
    """Seconds from ``start`` to the first of ``ends`` that is known ("-": no start)."""
    end = next((e for e in ends if e is not None), None)
    return "-" if start is None or end is None else f"{end - start:.1f}"


def measured_pictures(models: list[str], size: str, ranks: int, gpt2: bool,
                      folder: str) -> None:
    """The first picture on CPU ranks and the time until measured numbers replace the
    estimates, for each model, in an empty cache (:func:`empty_cache`)."""
    makes = [(f"{name} ({size})", builtin(name, size)) for name in models]
    if gpt2 and hf_gpt2() is not None:
        makes.append(("Hugging Face GPT-2 small", hf_gpt2))
    rows = []
    with empty_cache():
        t0 = time.perf_counter()
        cluster = ex.Cluster.cpu(ranks)
        probes_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with RankPool(2) as pool:  # as a profile makes it, on the profile's ranks
            host.cpu_message_s(cluster, pool=pool)
        message_s = time.perf_counter() - t0
        for name, make in makes:
            rows.append(measured_picture(name, make, cluster))
            print(f"  measured numbers {name}: done", file=sys.stderr)
    title = (f"Time to the first picture and to measured numbers in the explorer widget "
             f"(Explorer(model, ...) on Cluster.cpu({ranks}), every profile afresh: the "
             "widget opens on roofline estimates, then captures with real weights, profiles "
             "(op timing runs, contention runs) in the background and swaps the numbers in: "
             "the preliminary ones of the first op timing run at once (first measured "
             "numbers), the final ones when the profile ends (measured numbers in); seconds)")
    load = load_average()
    notes = (f"{load}. Once per machine before these (cached afterwards, not in the rows): "
             f"Cluster.cpu({ranks})'s host probes {probes_s:.1f} s, the per-message probe "
             f"{message_s:.1f} s.")
    print(f"{title}; {notes}")
    head = ("model", "ops", "first picture (s)", "capture with real weights (s)",
            "op timing runs (s)", "contention runs (s)", "first measured numbers (s)",
            "measured numbers in (s)", f"<= {FIRST_PICTURE_S:g} s; <= {MEASURED_S:g} s")
    out = [(r["model"], f"{r['ops']:,}", f"{r['open_s']:.2f}",
            _span(r["open_s"], r["profile"]),
            _span(r["profile"], r["contention"], r["message"], r["measured_s"]),
            _span(r["contention"], r["message"], r["measured_s"]), f"{r['first_s']:.1f}",
            f"{r['measured_s']:.1f}",
            f"{_yes(r['open_s'] <= FIRST_PICTURE_S)}; {_yes(r['first_s'] <= MEASURED_S)}")
           for r in rows]
    print(table(head, out))
    write_result("first_picture_cpu", out, columns=head, title=title, notes=notes,
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


def load_shape(spec: str) -> tuple[ex.OpGraph, float]:
    """A published shape ("llama-70b") or built-in model at a size ("gpt:tiny") captured
    (published shapes on fake tensors), and the seconds the capture took."""
    name, _, size = spec.partition(":")
    bm = ex.builtin_model(name, size) if size else ex.builtin_model(name)
    t0 = time.perf_counter()
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    return graph, time.perf_counter() - t0


def page_cells(spec: str, counts: list[int]) -> list[str]:
    """Notebook cells that capture ``spec`` (as :func:`load_shape`) and show an explorer on
    it at each device count (``N``xH100 presets, roofline costs)."""
    name, _, size = spec.partition(":")
    args = repr(name) + (f", {size!r}" if size else "")
    setup = ("import explorer as ex\nfrom explorer.models.synthetic import roofline_costs\n"
             f"from widgets import Explorer\nbm = ex.builtin_model({args})\n"
             "g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, "
             f"name={name!r})")
    return [setup, *(f"cl = ex.Cluster.preset('{n}xH100')\n"
                     f"w{n} = Explorer(g, roofline_costs(g, cl))\nw{n}" for n in counts)]


def device_counts(spec: str, counts: list[int], edits: int, page: bool,
                  folder: str) -> list[tuple]:
    """The first picture, the edits and the page of the explorer on ``spec`` at each device
    count; prints the table, records it as ``editing_devices`` and returns its rows."""
    graph, capture_s = load_shape(spec)
    measured = []
    for n in counts:
        measured.append((n, bench(graph, f"{n}xH100", edits, expand=False)))
        print(f"  {n} devices: done", file=sys.stderr)
    why = browser_missing() if page else "not asked (--no-page)"
    pages = page_measures(page_cells(spec, counts), len(counts)) if not why else []
    title = (f"The explorer widget at many devices ({spec}, captured once in "
             f"{capture_s:.1f} s; NxH100 presets, roofline costs, folded; first picture: "
             f"Explorer(graph, costs) to the drawn widget; edits: ms, median / slowest of "
             f"{edits}; page: the explorer's height in JupyterLab, 1,400 x 900 Chromium)")
    load = load_average()
    notes = load + "." + (f" No page: {why}." if why else "")
    print(f"{title}; {notes}")
    head = ("devices", "ops", "items shown", "opening plan", "first picture (s)", "engine ms",
            "widget ms", "widget max", "page height (px)", "assign beside the graph",
            f"page <= {PAGE_PX:,} px")
    out = []
    for k, (n, r) in enumerate(measured):
        height, beside = pages[k] if k < len(pages) else (None, None)
        out.append((n, f"{r['ops']:,}", f"{r['items']:,}", r["plan"], f"{r['open_s']:.2f}",
                    f"{r['engine_ms']:.1f}", f"{r['widget_ms']:.1f}",
                    f"{r['widget_max_ms']:.1f}", "-" if height is None else f"{height:,.0f}",
                    "-" if beside is None else _yes(beside),
                    "-" if height is None else _yes(height <= PAGE_PX)))
    print(table(head, out))
    write_result("editing_devices", out, columns=head, title=title, notes=notes,
                 folder=folder)
    return out


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
    ap.add_argument("--cpu-models", default=",".join(model_names()),
                    help="built-in models opened on CPU ranks, timed until the measured "
                         "numbers are in ('none': skip them)")
    ap.add_argument("--cpu-ranks", type=int, default=2)
    ap.add_argument("--cpu-gpt2", action="store_true",
                    help="also GPT-2 small on CPU ranks (minutes)")
    ap.add_argument("--device-counts", default="8,64,256",
                    help="device counts (NxH100) to open --counts-shape on ('none': skip)")
    ap.add_argument("--counts-shape", default="llama-70b",
                    help="published shape, or built-in model as name:size, for the counts")
    ap.add_argument("--no-page", action="store_true",
                    help="leave out the page heights (JupyterLab in Chromium)")
    add_results_option(ap)
    args = ap.parse_args()
    if args.device_counts != "none":
        device_counts(args.counts_shape, [int(n) for n in args.device_counts.split(",")],
                      args.edits, not args.no_page, args.results)
    if args.shapes != "none":
        large_shapes(args.shapes.split(","), args.shape_devices, args.edits, args.results)
    if args.models != "none":
        first_pictures(args.models.split(","), args.model_size, args.devices, args.results)
    if args.cpu_models != "none":
        measured_pictures(args.cpu_models.split(","), args.model_size, args.cpu_ranks,
                          args.cpu_gpt2, args.results)
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
