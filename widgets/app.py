"""The notebook explorer: one widget with the graph colored by device, editing and estimates.

Built on ipywidgets for the controls and bokeh (through jupyter_bokeh's ``BokehModel``) for the
graph, the memory bars and the timeline. Every number shown comes from ``explorer`` through a
:class:`widgets.session.Session`; this module only draws and forwards clicks.
"""

from __future__ import annotations

import functools
import html
import json
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import ipywidgets as W
import numpy as np
from bokeh.models import (
    BoxSelectTool,
    ColumnDataSource,
    FactorRange,
    HoverTool,
    LabelSet,
    LassoSelectTool,
    Legend,
    LegendItem,
    Range1d,
    TapTool,
)
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE
from explorer.models.builtin import BuiltinModel
from explorer.partition import algorithm as get_algorithm
from widgets.graphview import GraphView
from widgets.session import Session

MiB = 2**20
MIXED = "#b0b0b0"
CATEGORIES = ("params", "grads", "optimizer", "buffers", "activations")
CATEGORY_COLORS = ("#4c72b0", "#dd8452", "#8172b3", "#937860", "#55a868")
KIND_COLORS = {"fwd": "#4c72b0", "bwd": "#dd8452", "send": "#c44e52", "recv": "#c44e52",
               "allreduce": "#8172b3", "optimizer": "#55a868"}
#: most timeline bars drawn; longer timelines merge neighbouring bars of the same kind
MAX_BARS = 1000
#: columns of the graph's items that depend on the placement
DYNAMIC = ("device", "color", "text_color", "hatch", "time", "pinned", "line", "lw")
#: items with labels drawn on the graph (beyond this, hover shows them)
MAX_LABELS = 150

_bokeh_loaded = False


def _load_bokehjs() -> None:
    """BokehJS must be in the page before the first bokeh widget; load it offline, once."""
    global _bokeh_loaded
    if _bokeh_loaded:
        return
    try:
        from bokeh.io import output_notebook
        from bokeh.resources import INLINE

        output_notebook(resources=INLINE, hide_banner=True)
    except Exception:  # not in a notebook: nothing to load
        pass
    _bokeh_loaded = True


def _bokeh(model: Any) -> W.Widget:
    from jupyter_bokeh.widgets import BokehModel

    return BokehModel(model)


def _text_on(fill: str) -> str:
    """Black or white, whichever reads better on a ``#rrggbb`` fill."""
    r, g, b = (int(fill[k:k + 2], 16) for k in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 90 else "white"


def _fmt_bytes(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= k:
            return f"{b / k:,.1f} {unit}"
    return f"{b:,.0f} B"


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    return f"{s * 1e6:,.1f} µs"


class Explorer(W.VBox):
    """The explorer widget.

    ``Explorer(model, example_inputs, cluster=..., loss_fn=..., targets=...)`` captures and
    profiles the model; ``Explorer(graph, costs, plan=None)`` opens an already captured graph;
    ``Explorer.builtin("gpt", size="small", devices="cpu:2")`` opens a built-in model.
    """

    def __init__(self, model: Any, example_inputs: Any = None, cluster: ex.Cluster | None = None,
                 loss_fn: Any = None, targets: Any = None, costs: ex.CostModel | None = None,
                 plan: ex.Plan | None = None, backend: str = "canvas", height: int = 560,
                 progress: bool = True) -> None:
        graph, costs = self._open(model, example_inputs, cluster, loss_fn, targets, costs,
                                  progress)
        _load_bokehjs()
        self.session = Session(graph, costs.cluster, costs, plan)
        self.view = GraphView(graph)
        self._backend = backend
        self._height = height
        self._selected: list[int] = []
        self._colors = self._device_colors()
        self._build()
        super().__init__([self._header, self._message, W.HBox([self._graph_box, self._side]),
                          self._tabs], layout=W.Layout(width="100%"))
        self.add_class("pe-explorer")
        self.session.observe(self._on_session)
        self._redraw_graph()
        self._refresh_estimates()

    # -- construction --------------------------------------------------------------------
    @classmethod
    def builtin(cls, name: str = "gpt", size: str = "small", devices: str = "cpu:2",
                **kw: Any) -> Explorer:
        """An explorer on a built-in model (see ``explorer models``) and devices ("cpu:2",
        "gpu", "4xH100", ...)."""
        from explorer.devices.cluster import parse_devices

        return cls(ex.builtin_model(name, size), cluster=parse_devices(devices), **kw)

    @staticmethod
    def _open(model, example_inputs, cluster, loss_fn, targets, costs, progress):
        if isinstance(model, OpGraph):
            if isinstance(example_inputs, ex.CostModel) and costs is None:
                costs = example_inputs
            if costs is None:
                costs = ex.profile(model, cluster or ex.Cluster.discover(), progress=progress)
            return model, costs
        if isinstance(model, BuiltinModel):
            graph = ex.capture(model.module, model.example_inputs, model.loss_fn, model.targets,
                               name=model.name)
        else:
            if example_inputs is None:
                raise ExplorerError("give the model's example batch: Explorer(model, "
                                    "example_inputs), or Explorer(graph, costs)")
            graph = ex.capture(model, example_inputs, loss_fn, targets)
        if costs is None:
            costs = ex.profile(graph, cluster or ex.Cluster.discover(), progress=progress)
        return graph, costs

    def _device_colors(self) -> dict[str, str]:
        ids = self.session.cluster.ids
        return {d: Category10_10[k % 10] for k, d in enumerate(ids)}

    def _build(self) -> None:
        s = self.session
        g = s.graph
        self._header = W.HTML(
            f"<b>{html.escape(g.name)}</b>: {len(g.ops):,} ops, "
            f"{g.param_bytes / MiB:,.1f} MiB of parameters, batch {g.batch_size}, on "
            f"{html.escape(s.cluster.name)} ({', '.join(s.cluster.ids)})"
            + (f" <i>({html.escape('; '.join(g.notes))})</i>" if g.notes else ""))
        self._message = W.HTML("")
        self._message.add_class("pe-message")
        self._build_graph()
        self._build_side()
        self._build_tabs()

    def _build_graph(self) -> None:
        self._nodes = ColumnDataSource(self._node_data())
        self._links = ColumnDataSource(self._edge_data())
        p = figure(height=self._height, sizing_mode="stretch_width", tools="pan,wheel_zoom,reset",
                   toolbar_location="above", output_backend=self._backend,
                   x_range=Range1d(-5, 5), y_range=Range1d(-5, 1), min_border=4)
        p.axis.visible = False
        p.grid.visible = False
        p.name = "pe-graph-plot"  # (browser tests find the plot by this name)
        links = p.segment("x0", "y0", "x1", "y1", source=self._links, line_color="color",
                          line_width="width", line_alpha=0.7)
        r = p.rect("x", "y", width=1.6, height=0.6, source=self._nodes, fill_color="color",
                   line_color="line", line_width="lw", hatch_pattern="hatch",
                   hatch_color="white", hatch_alpha=0.6)
        r.nonselection_glyph.fill_alpha = 0.45
        r.selection_glyph = None
        labels = LabelSet(x="x", y="y", text="short", source=self._nodes, text_font_size="8pt",
                          text_align="center", text_baseline="middle", text_color="text_color")
        p.add_layout(labels)
        self._labels = labels
        p.add_tools(
            HoverTool(renderers=[r], tooltips=[
                ("", "@label"), ("device", "@device"), ("ops", "@n_ops"), ("op", "@op"),
                ("output", "@shapes"), ("FLOPs fwd/bwd", "@flops"), ("time fwd/bwd", "@time"),
                ("memory", "@memory"), ("pinned", "@pinned")]),
            HoverTool(renderers=[links], tooltips=[("edge", "@label")], line_policy="interp"),
            TapTool(renderers=[r]), BoxSelectTool(renderers=[r]),
            LassoSelectTool(renderers=[r]))
        self._nodes.selected.on_change("indices", self._on_select)
        self._figure = p
        # fit before the plot goes to the browser: changes sent before it is shown can be lost
        self._fit_ranges(self._nodes.data)
        self._graph_widget = _bokeh(p)
        self._graph_widget.add_class("pe-graph")
        self._legend = W.HTML("")
        self._graph_box = W.VBox([self._legend, self._graph_widget],
                                 layout=W.Layout(flex="3 1 0%", min_width="420px"))

    def _build_side(self) -> None:
        self._estimate = W.HTML("")
        self._estimate.add_class("pe-estimate")
        self._mem_src = ColumnDataSource(self._memory_data())
        devices = list(self.session.cluster.ids)
        p = figure(height=100 + 34 * len(devices), width=380,
                   y_range=FactorRange(*devices[::-1]),
                   title="memory at the peak vs capacity (dashed box), MiB",
                   toolbar_location=None, output_backend=self._backend)
        stack = p.hbar_stack(list(CATEGORIES), y="device", height=0.6, source=self._mem_src,
                             color=list(CATEGORY_COLORS))
        p.hbar(y="device", right="capacity", height=0.8, source=self._mem_src, fill_alpha=0,
               line_color="cap_color", line_width="cap_width", line_dash="dashed")
        # bars far below capacity are invisible: say the numbers in words on each bar
        p.add_layout(LabelSet(x=0, y="device", text="summary", source=self._mem_src,
                              x_offset=4, y_offset=-6, text_font_size="8pt",
                              text_color="cap_color"))
        legend = Legend(items=[LegendItem(label=c, renderers=[r])
                               for c, r in zip(CATEGORIES, stack, strict=True)],
                        orientation="horizontal", label_text_font_size="7pt",
                        glyph_width=10, spacing=4, padding=2, margin=2)
        p.add_layout(legend, "below")
        p.add_tools(HoverTool(tooltips=[("device", "@device"), ("total", "@total_text"),
                                        ("capacity", "@capacity_text"),
                                        ("params/grads/opt", "@detail")]))
        self._mem_fig = p
        self._mem_widget = _bokeh(p)
        self._mem_widget.add_class("pe-memory")

        self._selection = W.HTML("<i>click, box- or lasso-select nodes in the graph</i>")
        self._selection.add_class("pe-selection")
        self._target = W.Dropdown(options=self.session.targets(), description="device",
                                  layout=W.Layout(width="220px"))
        self._target.add_class("pe-target")
        self._assign_btn = self._button("assign", "move the selection to this device",
                                        self._do_assign, "pe-assign", "primary")
        self._pin_btn = self._button("pin", "fix the selection to its device",
                                     self._do_pin, "pe-pin")
        self._unpin_btn = self._button("unpin", "release the selection's pins",
                                       self._do_unpin, "pe-unpin")
        self._undo_btn = self._button("undo", "take back the last edit", self._do_undo,
                                      "pe-undo")
        self._redo_btn = self._button("redo", "redo the edit taken back", self._do_redo,
                                      "pe-redo")
        self._expand_btn = self._button("expand", "show the selected modules' parts",
                                        self._do_expand, "pe-expand")
        self._collapse_btn = self._button("collapse", "fold the selection back into its module",
                                          self._do_collapse, "pe-collapse")
        self._find = W.Combobox(placeholder="find a node or module by name",
                                options=[], ensure_option=False, layout=W.Layout(width="260px"))
        self._find.add_class("pe-find")
        self._find.observe(self._on_find, "value")
        self._side = W.VBox([
            self._estimate, self._mem_widget, self._selection,
            W.HBox([self._target, self._assign_btn]),
            W.HBox([self._pin_btn, self._unpin_btn, self._undo_btn, self._redo_btn]),
            W.HBox([self._expand_btn, self._collapse_btn]), self._find,
        ], layout=W.Layout(flex="2 1 0%", min_width="380px"))

    def _build_tabs(self) -> None:
        s = self.session
        # timeline
        self._gantt_src = ColumnDataSource(self._timeline_data())
        lanes = [f"{d} {lane}" for d in s.cluster.ids for lane in ("compute", "comm")][::-1]
        p = figure(height=80 + 26 * len(lanes), sizing_mode="stretch_width",
                   y_range=FactorRange(*lanes), x_axis_label="ms into the step",
                   title="simulated step per device", tools="xpan,xwheel_zoom,reset",
                   output_backend=self._backend)
        p.hbar(y="lane", left="start", right="end", height=0.8, color="color",
               source=self._gantt_src)
        p.add_tools(HoverTool(tooltips=[("", "@label"), ("from", "@start{0.000} ms"),
                                        ("to", "@end{0.000} ms")]))
        p.name = "pe-timeline-plot"
        self._gantt_fig = p
        self._gantt_lanes = lanes
        timeline = W.VBox([W.HTML(" ".join(
            f"<span style='background:{c};color:white;padding:0 4px'>{k}</span>"
            for k, c in KIND_COLORS.items() if k != "recv")), _bokeh(p)])

        # partitioners
        names = ex.algorithms()
        self._algo = W.Dropdown(options=names, value="pardnn" if "pardnn" in names else names[0],
                                description="algorithm")
        self._algo.add_class("pe-algorithm")
        self._algo_help = W.HTML("")
        self._algo_opts = W.Textarea(layout=W.Layout(width="100%", height="60px"))
        self._algo.observe(lambda _: self._show_algorithm(), "value")
        self._around = W.Checkbox(value=True, description="re-solve around my pins")
        self._solve_btn = self._button("solve", "run the partitioner", self._do_solve,
                                       "pe-solve", "primary")
        self._keep_btn = self._button("keep current", "add the plan under edit to the table",
                                      self._do_keep, "pe-keep")
        self._plans_html = W.HTML("<i>no plans yet: solve, or keep the current plan</i>")
        self._plans_html.add_class("pe-plans")
        self._plan_pick = W.Dropdown(options=[], description="plan")
        self._load_btn = self._button("load into editor", "edit this plan", self._do_load_entry,
                                      "pe-load-entry")
        self._show_algorithm()
        solvers = W.VBox([W.HBox([self._algo, self._around, self._solve_btn, self._keep_btn]),
                          self._algo_help, self._algo_opts, self._plans_html,
                          W.HBox([self._plan_pick, self._load_btn])])

        # plan settings
        self._mb = W.BoundedIntText(value=s.plan.micro_batches, min=1, max=4096,
                                    description="micro-batches")
        self._sched = W.Dropdown(options=["gpipe", "1f1b"], value=s.plan.schedule,
                                 description="schedule")
        self._opt = W.Dropdown(options=sorted(OPTIMIZER_STATE), value=s.plan.optimizer,
                               description="optimizer")
        settings = W.VBox([W.HBox([self._mb, self._sched, self._opt]),
                           self._button("apply", "change the plan's settings",
                                        self._do_settings, "pe-settings")])

        # real run
        self._steps = W.BoundedIntText(value=5, min=1, max=1000, description="steps")
        self._force = W.Checkbox(value=False, description="run even if predicted not to fit")
        self._run_btn = self._button("run for real", "train a few steps under the plan",
                                     self._do_run, "pe-run", "warning")
        self._calib_btn = self._button("calibrate", "fit the cost model to the run and "
                                       "estimate again", self._do_calibrate, "pe-calibrate")
        self._run_out = W.Output()
        self._report = W.HTML("")
        self._report.add_class("pe-report")
        running = W.VBox([W.HBox([self._steps, self._force, self._run_btn, self._calib_btn]),
                          self._run_out, self._report])

        # export
        stem = s.graph.name or "model"
        self._plan_path = W.Text(value=f"{stem}_plan.json", description="plan file")
        self._script_path = W.Text(value=f"train_{stem}.py", description="script")
        export = W.VBox([
            W.HBox([self._plan_path,
                    self._button("save plan", "write the plan JSON", self._do_save, "pe-save"),
                    self._button("load plan", "read a plan JSON", self._do_load_file,
                                 "pe-load")]),
            W.HBox([self._script_path,
                    self._button("export script", "write a torchrun training script",
                                 self._do_export, "pe-export")])])

        self._tabs = W.Tab([timeline, solvers, settings, running, export])
        for k, t in enumerate(["timeline", "partitioners", "plan settings", "run for real",
                               "export"]):
            self._tabs.set_title(k, t)

    def _button(self, text, tip, fn, cls, style="") -> W.Button:
        b = W.Button(description=text, tooltip=tip, button_style=style,
                     layout=W.Layout(width="auto"))
        b.add_class(cls)
        b.on_click(self._guard(fn))
        return b

    # -- error handling ------------------------------------------------------------------
    def _guard(self, fn):
        @functools.wraps(fn)
        def call(*a):
            self._say("")
            try:
                fn(*a)
            except ExplorerError as e:
                self._say(str(e), error=True)
            except Exception as e:  # keep the kernel and the widget alive, say what happened
                self._say(f"{type(e).__name__}: {e}", error=True,
                          detail=traceback.format_exc(limit=6))
        return call

    def _say(self, text: str, error: bool = False, detail: str = "") -> None:
        if not text:
            self._message.value = ""
            return
        color = "#b00020" if error else "#1a5e20"
        extra = (f"<details><summary>details</summary><pre>{html.escape(detail)}</pre>"
                 "</details>" if detail else "")
        self._message.value = (f"<div style='color:{color};padding:4px;border:1px solid {color};"
                               f"border-radius:4px'>{html.escape(text)}{extra}</div>")

    @property
    def message(self) -> str:
        """The message line's text (errors and notices), without markup."""
        import re

        return html.unescape(re.sub(r"<details>.*?</details>|<[^>]+>", "",
                                    self._message.value, flags=re.S))

    # -- actions (also callable from code) -----------------------------------------------
    def select(self, names_or_keys: list[str]) -> None:
        """Select items by node name, module path or item key (as clicking does); a node or
        module inside a folded module is shown by expanding what it is in."""
        want = list(dict.fromkeys(names_or_keys))
        start = [it.key for it in self.view.items]
        for _ in range(16):  # until a pass over every name opens nothing more
            before = [it.key for it in self.view.items]
            idx: set[int] = set()
            unknown = []
            for w in want:
                hits = self.view.matching(w) or self.view.reveal(w)
                if not hits:
                    unknown.append(w)
                idx.update(hits)
            if [it.key for it in self.view.items] == before:
                break
        if [it.key for it in self.view.items] != start:
            self._redraw_graph()
        if unknown:
            raise ExplorerError(f"no node or module named {', '.join(map(repr, unknown))} "
                                "in this graph (names as in the hover text, e.g. "
                                "'blocks.0' or 'linear_1')")
        idx_l = sorted(idx)
        self._nodes.selected.indices = idx_l
        self._on_select("indices", None, idx_l)

    def assign(self, target: str) -> None:
        """Move the selection to ``target`` (a device, or ``"dev+dev"`` for a replicated
        stage), as the assign button does; the session says what is wrong with a target."""
        if target in self._target.options:
            self._target.value = target
        self.session.assign(self._selected_names(), target)

    def _selected_names(self) -> list[str]:
        return self.view.names(self._selected)

    def _do_assign(self, *_):
        self.session.assign(self._selected_names(), self._target.value)

    def _do_pin(self, *_):
        self.session.pin(self._selected_names())

    def _do_unpin(self, *_):
        names = self._selected_names()
        self.session.unpin(names or None)

    def _do_undo(self, *_):
        self.session.undo()

    def _do_redo(self, *_):
        self.session.redo()

    def _do_expand(self, *_):
        keys = [self.view.items[k].key for k in self._selected]
        if not keys:
            raise ExplorerError("select a module to expand")
        self.view.expand(keys)
        self._set_selection([])
        self._redraw_graph()

    def _do_collapse(self, *_):
        keys = [self.view.items[k].key for k in self._selected]
        if keys:
            self.view.collapse(keys)
        else:
            self.view.collapse_all()
        self._set_selection([])
        self._redraw_graph()

    def _show_algorithm(self) -> None:
        alg = get_algorithm(self._algo.value)
        self._algo_help.value = f"<i>{html.escape(alg.summary)}</i>"
        self._algo_opts.value = json.dumps(dict(alg.options), default=str)

    def _do_solve(self, *_):
        try:
            opts = json.loads(self._algo_opts.value or "{}")
        except json.JSONDecodeError as e:
            raise ExplorerError(f"the options must be JSON, e.g. {{\"micro_batches\": 4}}: "
                                f"{e}") from None
        if not isinstance(opts, dict):
            raise ExplorerError("the options must be a JSON object, e.g. {\"micro_batches\": 4}")
        self._say(f"solving with {self._algo.value} ...")
        self._solve_btn.disabled = True
        try:
            e = self.session.solve(self._algo.value, around_pins=self._around.value, **opts)
        finally:
            self._solve_btn.disabled = False
        self._say(f"{e.name}: {_fmt_s(e.prediction.step_s)} per step, solved in "
                  f"{e.solve_s:.2f} s; loaded into the editor")

    def _do_keep(self, *_):
        e = self.session.keep()
        self._say(f"kept the current plan as {e.name!r}")

    def _do_load_entry(self, *_):
        if not self._plan_pick.value:
            raise ExplorerError("no plan to load yet: solve or keep one first")
        e = self.session.entry(self._plan_pick.value)
        self.session.load(e.plan, e.name)

    def _do_settings(self, *_):
        self.session.set_schedule(self._mb.value, self._sched.value, self._opt.value)

    def _do_run(self, *_):
        self._run_out.clear_output()
        self._run_btn.disabled = True
        try:
            with self._run_out:
                report = self.session.run(self._steps.value, force=self._force.value)
        finally:
            self._run_btn.disabled = False
        self._say(f"ran {self._steps.value} steps: step time error {report.step_error:+.1%}")

    def _do_calibrate(self, *_):
        pred = self.session.calibrate()
        self._say(f"calibrated: the plan now predicts {_fmt_s(pred.step_s)} per step")

    def _do_save(self, *_):
        p = self.session.save(self._plan_path.value)
        self._say(f"saved {p}")

    def _do_load_file(self, *_):
        path = Path(self._plan_path.value)
        self.session.load(path, path.name)
        self._say(f"loaded {path}")

    def _do_export(self, *_):
        p = self.session.export(self._script_path.value)
        self._say(f"wrote {p}: run it with torchrun --nproc_per_node "
                  f"{len(self.session.plan.devices)} {p.name}")

    # -- events --------------------------------------------------------------------------
    def _on_select(self, attr, old, new) -> None:
        new = sorted(int(i) for i in new)
        if new == self._selected:  # the browser reports a selection twice
            return
        self._set_selection(new, push=False)

    def _set_selection(self, idx: list[int], push: bool = True) -> None:
        self._selected = list(idx)
        if push and list(self._nodes.selected.indices) != idx:
            self._nodes.selected.indices = idx
        items = [self.view.items[k] for k in idx if k < len(self.view.items)]
        if not items:
            self._selection.value = "<i>click, box- or lasso-select nodes in the graph</i>"
            return
        n_ops = sum(len(it.ops) for it in items)
        names = ", ".join(html.escape(it.label) for it in items[:4])
        more = f" and {len(items) - 4} more" if len(items) > 4 else ""
        self._selection.value = (f"selected <b>{len(items)}</b> item(s), {n_ops} ops: "
                                 f"{names}{more}")

    def _on_find(self, change) -> None:
        v = change["new"]
        if v:
            self._guard(lambda: self.select([v]))()

    def _on_session(self, session: Session, what: str) -> None:
        if what in ("plan", "costs"):
            self._recolor()
            self._refresh_estimates()
        if what in ("plans", "costs"):
            self._refresh_plans()
        if what == "run":
            self._refresh_report()

    # -- drawing -------------------------------------------------------------------------
    def _item_device(self, it) -> tuple[str, str, bool]:
        """(label, color, replicated) of an item from the plan's placement of its ops."""
        plan = self.session.plan
        stages = {plan.placement[self.session.graph.nodes[i].name] for i in it.ops}
        if len(stages) > 1:
            return "mixed: " + ", ".join("+".join(plan.stages[s]) for s in sorted(stages)), \
                MIXED, False
        devs = plan.stages[next(iter(stages))] if stages else plan.stages[0]
        return "+".join(devs), self._colors.get(devs[0], MIXED), len(devs) > 1

    def _node_data(self) -> dict[str, Any]:
        """All columns of the shown items: the static ones (layout, names, FLOPs) are computed
        when the view changes, the placement-dependent ones by :meth:`_dynamic`."""
        s = self.session
        g = s.graph
        v = self.view
        self._edges = v.edges()
        xy = v.layout(self._edges)
        self._xy = xy
        self._time_cache: dict[tuple[int, str], str] = {}
        cols: dict[str, list] = defaultdict(list)
        few = len(v.items) <= MAX_LABELS
        for it in v.items:
            ff = sum(g.nodes[i].fwd_flops for i in it.ops)
            bf = sum(g.nodes[i].bwd_flops for i in it.ops)
            params = sum(g.nodes[i].param_bytes for i in it.nodes)
            outb = sum(g.nodes[i].out_bytes for i in it.ops)
            node = g.nodes[it.ops[0]]
            cols["key"].append(it.key)
            cols["label"].append(it.label + (" (select, then expand)" if it.expandable else ""))
            cols["short"].append((it.label if len(it.label) <= 18 else it.label[:16] + "..")
                                 if few else "")
            cols["n_ops"].append(len(it.ops))
            cols["op"].append(node.op if len(it.ops) == 1 else f"{len(it.ops)} ops")
            cols["shapes"].append(" ".join(str(list(sh)) for sh in node.shapes[:3])
                                  + f" {node.dtype}" if len(it.ops) == 1 else
                                  f"{_fmt_bytes(outb)} of outputs")
            cols["flops"].append(f"{ff:,.3g} / {bf:,.3g}")
            cols["memory"].append(f"params {_fmt_bytes(params)}, outputs {_fmt_bytes(outb)}")
        out: dict[str, Any] = dict(cols)
        out["x"] = np.array([p[0] for p in xy], dtype=float)
        out["y"] = np.array([p[1] for p in xy], dtype=float)
        out.update(self._dynamic())
        return out

    def _item_time(self, k: int, dev: str) -> str:
        key = (k, self.session.costs.cluster.device(dev).type_key)
        t = self._time_cache.get(key)
        if t is None:
            costs = self.session.costs
            ops = self.view.items[k].ops
            fwd = sum(costs.fwd_s(i, dev) for i in ops)
            bwd = sum(costs.bwd_s(i, dev) for i in ops)
            srcs = sorted({costs.source(i, dev) for i in ops})
            t = self._time_cache[key] = (f"{_fmt_s(fwd)} / {_fmt_s(bwd)} on {key[1]} "
                                         f"({', '.join(srcs)})")
        return t

    def _dynamic(self) -> dict[str, list]:
        """The columns that change with the placement and the pins."""
        s = self.session
        g = s.graph
        pins = s.pins
        cols: dict[str, list] = {k: [] for k in DYNAMIC}
        for k, it in enumerate(self.view.items):
            dev, color, rep = self._item_device(it)
            first = dev.split("+")[0] if not dev.startswith("mixed") else s.cluster.ids[0]
            n_pinned = sum(1 for i in it.nodes if g.nodes[i].name in pins) if pins else 0
            cols["device"].append(dev)
            cols["color"].append(color)
            cols["text_color"].append(_text_on(color))
            cols["hatch"].append("/" if rep else " ")
            cols["time"].append(self._item_time(k, first))
            cols["pinned"].append(f"{n_pinned} node(s)" if n_pinned else "no")
            cols["line"].append("black" if n_pinned else "white")
            cols["lw"].append(3.0 if n_pinned else 1.0)
        return cols

    def _edge_data(self) -> dict[str, Any]:
        """One segment per pair of connected items; edges across devices are red and wide."""
        pairs = list(self._edges.items())
        xy = self._xy
        x0 = np.array([xy[a][0] for (a, _), _ in pairs], dtype=float)
        y0 = np.array([xy[a][1] - 0.3 for (a, _), _ in pairs], dtype=float)
        x1 = np.array([xy[z][0] for (_, z), _ in pairs], dtype=float)
        y1 = np.array([xy[z][1] + 0.3 for (_, z), _ in pairs], dtype=float)
        return {"x0": x0, "y0": y0, "x1": x1, "y1": y1, **self._edge_dynamic()}

    def _edge_dynamic(self) -> dict[str, list]:
        s = self.session
        devs = self._nodes.data["device"] if hasattr(self, "_nodes") else \
            self._dynamic()["device"]
        color, width, label = [], [], []
        if getattr(self, "_edge_txt_for", None) is not self._edges:
            self._edge_txt = [_fmt_bytes(b) for b in self._edges.values()]
            self._edge_txt_for = self._edges
        for ((a, z), b), txt in zip(self._edges.items(), self._edge_txt, strict=True):
            da, dz = devs[a], devs[z]
            if (da != dz and b > 0 and not da.startswith("mixed")
                    and not dz.startswith("mixed")):
                t = s.costs.transfer_s(da.split("+")[0], dz.split("+")[0], b)
                color.append("#d62728")
                width.append(3.0)
                label.append(f"{txt} across devices, {da} -> {dz}: {_fmt_s(t)}")
            else:
                color.append("#999999")
                width.append(1.0)
                label.append(f"{txt} on {da}")
        return {"color": color, "width": width, "label": label}

    def _redraw_graph(self) -> None:
        data = self._node_data()
        self._nodes.selected.indices = []
        self._nodes.data = data
        self._links.data = self._edge_data()
        self._fit_ranges(data)
        self._refresh_legend()

    def _fit_ranges(self, data) -> None:
        xs, ys = np.asarray(data["x"], dtype=float), np.asarray(data["y"], dtype=float)
        if len(xs):
            w = max(float(xs.max() - xs.min()), 4.0) + 3  # narrow graphs: centred, readable
            mid = (float(xs.max()) + float(xs.min())) / 2
            self._figure.x_range.start, self._figure.x_range.end = mid - w / 2, mid + w / 2
            shown = min(-float(ys.min()) + 1, 30)  # deep graphs: the top, pan down for more
            self._figure.y_range.start, self._figure.y_range.end = -shown, 0.8

    @staticmethod
    def _patch(source: ColumnDataSource, new: dict[str, list]) -> None:
        """Send only the entries that changed (an edit usually touches a few items)."""
        patches = {}
        for col, vals in new.items():
            old = source.data[col]
            changed = [(i, v) for i, (o, v) in enumerate(zip(old, vals, strict=True)) if o != v]
            if len(changed) > len(vals) // 2:
                patches = None
                break
            if changed:
                patches[col] = changed
        if patches is None:
            source.data.update(new)
        elif patches:
            source.patch(patches)

    def _recolor(self) -> None:
        self._patch(self._nodes, self._dynamic())
        self._patch(self._links, self._edge_dynamic())
        self._refresh_legend()
        targets = self.session.targets()
        if list(self._target.options) != targets:
            keep = self._target.value
            self._target.options = targets
            if keep in targets:
                self._target.value = keep

    def _refresh_legend(self) -> None:
        s = self.session
        swatches = []
        for d in s.cluster.ids:
            swatches.append(f"<span style='background:{self._colors[d]};color:white;"
                            f"padding:1px 6px;border-radius:3px'>{html.escape(d)}</span>")
        swatches.append(f"<span style='background:{MIXED};padding:1px 6px;border-radius:3px'>"
                        "mixed</span>")
        self._legend.value = (
            "nodes are colored by device (striped: replicated, data-parallel); "
            "<span style='color:#d62728'><b>red edges</b></span> cross devices; "
            "a black outline marks pins. " + " ".join(swatches))

    def _memory_data(self) -> dict[str, list]:
        pred = self.session.prediction
        cols = defaultdict(list)
        for d in self.session.cluster.ids:
            m = pred.memory.get(d)
            vals = (m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.buffers_bytes,
                    m.activations_bytes) if m else (0,) * 5
            for c, v in zip(CATEGORIES, vals, strict=True):
                cols[c].append(v / MiB)
            total = sum(vals)
            cap = pred.capacity_bytes.get(d, self.session.cluster.device(d).memory_bytes)
            over = total > cap
            cols["device"].append(d)
            cols["capacity"].append(cap / MiB)
            cols["total_text"].append(_fmt_bytes(total) + (" (unused)" if not m else ""))
            cols["capacity_text"].append(_fmt_bytes(cap) + (" OVER" if over else ""))
            cols["cap_color"].append("#d62728" if over else "#333333")
            cols["cap_width"].append(3.0 if over else 1.0)
            cols["detail"].append(" / ".join(_fmt_bytes(v) for v in vals[:3]))
            share = f" ({total / cap:.0%})" if cap > 0 else ""
            cols["summary"].append(f"{_fmt_bytes(total)} of {_fmt_bytes(cap)}{share}"
                                   + (" OVER" if over else "") if m else "unused")
        return dict(cols)

    def _refresh_estimates(self) -> None:
        s = self.session
        p = s.prediction
        used = set(s.plan.devices)
        over = p.memory_report()
        busy = " ".join(f"{d} {_fmt_s(b)}" for d, b in p.busy_s.items() if d in used)
        rows = [
            ("step time", f"<span class='pe-step' data-value='{p.step_s!r}'>"
                          f"{_fmt_s(p.step_s)}</span>"),
            ("lower bound", f"{_fmt_s(p.lower_bound_s)} (gap {p.gap:+.0%})"),
            ("bottleneck", html.escape(p.bottleneck)),
            ("busy", busy),
            ("across devices", f"<span class='pe-cross' data-value='{p.cross_device_bytes}'>"
                               f"{_fmt_bytes(p.cross_device_bytes)}</span>"),
            ("energy", f"{p.energy_j:,.3g} J per step"),
            ("plan", html.escape(f"{s.plan.algorithm}; {len(s.plan.stages)} stage(s), "
                                 f"{s.plan.micro_batches} micro-batch(es), {s.plan.schedule}, "
                                 f"{s.plan.optimizer}; {len(s.pins)} pin(s)")),
        ]
        peak = " ".join(f"<span class='pe-mem' data-device='{d}' data-value='{b}'>"
                        f"{d} {_fmt_bytes(b)}</span>" for d, b in p.peak_bytes.items())
        rows.append(("peak memory", peak))
        if over:
            rows.append(("does not fit", f"<span style='color:#d62728'>{html.escape(over)}"
                                         "</span>"))
        self._estimate.value = (
            "<table style='font-size:13px'>" + "".join(
                f"<tr><td style='padding-right:8px;color:#555'>{k}</td><td>{v}</td></tr>"
                for k, v in rows) + "</table>"
            f"<div style='color:#888;font-size:11px'>estimated in {s.estimate_s * 1e3:.0f} ms"
            "</div>")
        self._mem_src.data = self._memory_data()
        self._gantt_src.data = self._timeline_data()
        self._undo_btn.disabled = not s.can_undo
        self._redo_btn.disabled = not s.can_redo
        self._mb.value, self._sched.value, self._opt.value = (
            s.plan.micro_batches, s.plan.schedule, s.plan.optimizer)

    def _timeline_data(self) -> dict[str, list]:
        bars = sorted(self.session.prediction.timeline,
                      key=lambda iv: (iv.device, iv.lane, iv.start_s))
        tol = 0.0
        if len(bars) > MAX_BARS:  # merge neighbours of the same kind on a lane
            tol = self.session.prediction.step_s / MAX_BARS
        cols: dict[str, list] = {k: [] for k in ("lane", "start", "end", "color", "label")}
        last, count, first_label = None, 0, ""
        for iv in bars:
            lane = f"{iv.device} {iv.lane}"
            kind = iv.kind
            if (last == kind and tol and cols["lane"][-1] == lane
                    and iv.start_s * 1e3 - cols["end"][-1] <= tol * 1e3):
                count += 1
                cols["end"][-1] = iv.end_s * 1e3
                cols["label"][-1] = f"{kind} x{count}: {first_label} .. {iv.label}"
                continue
            count, first_label = 1, iv.label
            cols["lane"].append(lane)
            cols["start"].append(iv.start_s * 1e3)
            cols["end"].append(iv.end_s * 1e3)
            cols["color"].append(KIND_COLORS.get(kind, "#777777"))
            mb = f" mb {iv.micro_batch}" if iv.micro_batch >= 0 else ""
            cols["label"].append(f"{kind}{mb}: {iv.label}")
            last = kind
        out: dict[str, Any] = dict(cols)
        out["start"] = np.array(cols["start"], dtype=float)
        out["end"] = np.array(cols["end"], dtype=float)
        return out

    def _refresh_plans(self) -> None:
        entries = self.session.plans
        if not entries:
            return
        best = min(e.prediction.step_s for e in entries if e.prediction.fits) \
            if any(e.prediction.fits for e in entries) else None
        head = ("<tr><th>plan</th><th>step</th><th>max memory</th><th>fits</th>"
                "<th>across devices</th><th>gap to bound</th><th>solved in</th></tr>")
        rows = []
        for e in entries:
            r = e.row()
            mark = " *" if best is not None and e.prediction.step_s == best else ""
            rows.append(
                f"<tr><td>{html.escape(e.name)}{mark}</td><td>{r['step_ms']:,.2f} ms</td>"
                f"<td>{r['max_memory_mib']:,.1f} MiB</td><td>{'yes' if r['fits'] else 'NO'}</td>"
                f"<td>{r['cross_mib']:,.2f} MiB</td><td>{r['gap_pct']:+.0f} %</td>"
                f"<td>{r['solve_s']:.2f} s</td></tr>")
        self._plans_html.value = ("<table style='font-size:12px' border=1 cellpadding=3>"
                                  + head + "".join(rows) + "</table><i>* fastest that fits</i>")
        self._plan_pick.options = [e.name for e in entries]
        self._plan_pick.value = entries[-1].name

    def _refresh_report(self) -> None:
        rep = self.session.report
        if rep is None:
            return
        head = "<tr><th></th><th>device</th><th>predicted</th><th>measured</th><th>error</th></tr>"
        rows = []
        for r in rep.rows:
            fmt = _fmt_s if r.unit == "s" else _fmt_bytes
            rows.append(f"<tr><td>{html.escape(r.what)}</td><td>{html.escape(r.device)}</td>"
                        f"<td>{fmt(r.predicted)}</td><td>{fmt(r.measured)}</td>"
                        f"<td>{r.error:+.1%}</td></tr>")
        self._report.value = ("<table style='font-size:12px' border=1 cellpadding=3>" + head
                              + "".join(rows) + "</table>"
                              f"<i>memory measured by {html.escape(rep.memory_source)}</i>")
