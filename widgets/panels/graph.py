"""The graph picture: items colored by device, edges across devices in red, selection tools.

Nodes are the session's view items (modules, blocks or ops, see :mod:`widgets.graphview`),
placed in rows top-down by dependency, with edges routed between the items of the rows they
skip and expanded modules framed (:mod:`widgets.layout`). Clicking, box- or lasso-selecting
items selects them in the session, by the keys of the items the view clicked in draws (not
their positions, which are another item's once the kernel's items changed); the
expand/collapse buttons, the depth box and the find box change which items are shown, and
each change re-fits the view (the reset tool comes back to it; "zoom to selection" goes
close). The wheel over the graph zooms it (not the
page), and its toolbar has a row of its own, so zoom, reset and hover stay in view when the
graph is narrow (bokeh moves the buttons that do not fit behind a menu). Only nodes have a
hover text (edges are summed up in it): a hover over a node never opens the texts of the
edges that end at it. Beside the graph, an overview of the whole layout shows the view as a
box to drag. Labels are drawn only where neighbouring ones fit on screen: the ``MAX_LABELS``
largest items', and zoomed in on at most ``MAX_LABELS`` items, every item's in view
(:mod:`widgets.panels.overview`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ipywidgets as W
import numpy as np
from bokeh import events
from bokeh.layouts import row
from bokeh.models import (
    BoxSelectTool,
    ColumnDataSource,
    CustomJS,
    HoverTool,
    LabelSet,
    LassoSelectTool,
    PanTool,
    Range1d,
    ResetTool,
    TapTool,
    WheelZoomTool,
)
from bokeh.plotting import figure

from explorer.core.errors import ExplorerError
from explorer.core.units import format_bytes, format_flops, format_seconds
from widgets.device_groups import (
    UNUSED_COLOR,
    device_groups,
    device_span,
    grouped,
    mix_text,
    stage_colors,
    stage_hue,
)
from widgets.graphview import Item, name_in_key
from widgets.layout import ITEM_H, ITEM_W
from widgets.panels.base import Panel, PlotBox, bokeh_widget, button, swatch
from widgets.panels.overview import Overview, add_labels
from widgets.session import Session
from widgets.splits import SplitView

MIXED = "#b0b0b0"
CROSS = "#d62728"
#: device colors up to ``GROUPED_ABOVE`` devices, one per device: the first eight (Okabe-Ito's
#: colour-blind safe set without its red and black, then Tol's indigo and wine) stay apart for
#: red-green colour blindness too; the next eight (Tol's and IBM's) are chosen to be as far
#: from those as possible. None is the cross-device edge red or the "mixed" grey. Larger
#: clusters are coloured by stage: a hue per stage, a shade per device
#: (:func:`widgets.device_groups.stage_colors`).
DEVICE_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#F0E442", "#332288",
                 "#882255", "#DDCC77", "#1A85FF", "#117733", "#99DDFF", "#004488", "#EE8866",
                 "#BBCC33", "#AA4499")
#: columns of the graph's items that depend on the placement
DYNAMIC = ("device", "color", "hatch", "time", "pinned", "line", "lw", "cross", "split",
           "short")
#: most names the find box suggests (modules first, then ops)
FIND_OPTIONS = 5000
#: most items with a label drawn on the graph: the ones with the most ops (hover shows all);
#: zoomed in on at most this many, every item in view has its label
MAX_LABELS = 150
#: characters of a label drawn on the graph
LABEL_CHARS = 18
#: edges going down more rows than this are drawn faint (masks, views read far below)
LONG_SPAN = 4
#: most frames labelled when they are many (the outer ones are always labelled)
MAX_FRAME_LABELS = 150
#: rows shown when the view is fitted (deeper graphs: the top rows, pan or zoom out for more)
FIT_ROWS = 30
#: what a click, box or lasso selection in a view of the graph sends the kernel: the keys of
#: the items it selected, as that view draws them (positions can be another item's in the
#: kernel's items), and a count that makes each gesture a change (one row)
PICK_JS = """
if (!cb_obj.final) return;
const keys = Array.from(source.selected.indices, (i) => source.data.key[i]);
const count = picked.data.gesture.length ? Number(picked.data.gesture[0]) + 1 : 1;
picked.data = {keys: [keys], gesture: [count]};
"""


def short_label(label: str, width: int = LABEL_CHARS) -> str:
    """The distinguishing end of an item's name: as many of its last path parts as fit
    ("transformer.h.0.attn", not "m.transformer.h..."); "56 ops" for a run of loose ops."""
    name = label.split(" (")[0]
    if " ops: " in name:
        return name.split(":")[0]
    parts = name.split(".")
    out = parts[-1]
    for k in range(2, len(parts) + 1):
        more = ".".join(parts[-k:])
        if len(more) > width:
            break
        out = more
    return out if len(out) <= width else ".." + out[-(width - 2):]


def labelled(items: list[Item], limit: int = MAX_LABELS) -> set[int]:
    """Positions of the items that get a label: all of them, or the ``limit`` largest."""
    if len(items) <= limit:
        return set(range(len(items)))
    return set(sorted(range(len(items)), key=lambda k: -len(items[k].ops))[:limit])


def text_on(fill: str) -> str:
    """Black or white, whichever reads better on a ``#rrggbb`` fill."""
    r, g, b = (int(fill[k:k + 2], 16) for k in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"


def crosses(device_a: str, device_b: str, nbytes: int) -> bool:
    """Whether an edge between items on these devices (labels) carries bytes across devices."""
    return (device_a != device_b and nbytes > 0 and not device_a.startswith("mixed")
            and not device_b.startswith("mixed"))


def patch(source: ColumnDataSource, new: dict[str, list]) -> None:
    """Send only the entries that changed (an edit usually touches a few items)."""
    patches: dict[str, list] | None = {}
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


class GraphPanel(Panel):
    """The bokeh graph (``figure``; item columns in ``nodes``, edge columns in ``edges``,
    frames in ``frames``), its ``overview`` and ``zoom_labels``, its legend (``widget`` holds
    them) and the view controls (``controls``: ``expand_button``, ``collapse_button``,
    ``find``)."""

    topics = frozenset({"plan", "costs", "view", "selection"})

    def __init__(self, session: Session, backend: str = "canvas", height: int = 560) -> None:
        super().__init__(session)
        #: each device's colour (:meth:`device_colors`)
        self.colors = self.device_colors()
        #: each node's part in its stage's tensor-parallel split (hover text and mark)
        self.splits = SplitView(session.graph)
        self._relayout()
        self.nodes = ColumnDataSource(self.node_columns())
        self.edges = ColumnDataSource(self.edge_columns(self.nodes.data["device"]))
        self.frames = ColumnDataSource(self.frame_columns())
        self.figure = self._draw(backend, height)
        #: the items labelled always (where labels fit) and on zoom
        #: (:func:`widgets.panels.overview.add_labels`)
        self.labels, self.zoom_labels = add_labels(self.figure, self.nodes, MAX_LABELS)
        self.overview = Overview(self.figure, self.nodes, self.edges, self.frames, backend)
        # fit before the plot goes to the browser: changes sent before it is shown can be lost
        self._fit_ranges()
        #: what the colors, edges and outlines mean (and the overview, while it is shown)
        self.legend = W.HTML(self.legend_text())
        plots = row(self.figure, self.overview.figure, sizing_mode="stretch_width")
        self.widget = PlotBox([self.legend, bokeh_widget(plots, "pe-graph")],
                              layout=W.Layout(min_width="0"))

        s = session
        self.expand_button = button(s, "expand", "show the selected modules' parts",
                                    lambda *_: s.expand(), "pe-expand", where="side")
        self.collapse_button = button(s, "collapse", "fold the selection back into its module",
                                      lambda *_: s.collapse(), "pe-collapse", where="side")
        self.expand_all_button = button(s, "expand all", "show every op",
                                        lambda *_: s.expand_all(), "pe-expand-all",
                                        where="side")
        self.collapse_all_button = button(s, "collapse all", "show the top-level modules only",
                                          lambda *_: s.collapse_all(), "pe-collapse-all",
                                          where="side")
        self.zoom_button = button(s, "zoom to selection", "show the selected items close up "
                                  "(the reset tool goes back to the whole view)",
                                  lambda *_: self.zoom_to_selection(), "pe-zoom",
                                  where="side")
        self.depth = W.BoundedIntText(value=2, min=1, max=64, description="depth",
                                      style={"description_width": "initial"},
                                      layout=W.Layout(width="110px"))
        self.depth_button = button(s, "expand to depth", "show modules down to this depth "
                                   "(1: top level, 2: blocks.0, ...)",
                                   lambda *_: s.expand_to(self.depth.value), "pe-expand-to",
                                   where="side")
        self.find = W.Combobox(placeholder="find: a name or part of one (h.3, attention)",
                               options=s.view.names_to_find()[:FIND_OPTIONS],
                               ensure_option=False, continuous_update=False,
                               layout=W.Layout(width="280px", max_width="100%"))
        self.find.add_class("pe-find")
        self.find.observe(self._on_find, "value")
        wrap = W.Layout(flex_flow="row wrap")
        self.controls = W.VBox([
            W.HBox([self.expand_button, self.collapse_button, self.expand_all_button,
                    self.collapse_all_button, self.zoom_button], layout=wrap),
            W.HBox([self.depth, self.depth_button, self.find], layout=wrap)])

    def device_colors(self) -> dict[str, str]:
        """Each device's colour: one of ``DEVICE_COLORS`` per device up to
        ``GROUPED_ABOVE`` devices, else a hue per stage of the plan and a shade per device
        (:func:`widgets.device_groups.stage_colors`)."""
        s = self.session
        ids = s.cluster.ids
        if grouped(len(ids)):
            return stage_colors(s.plan, ids)
        return {d: DEVICE_COLORS[k % len(DEVICE_COLORS)] for k, d in enumerate(ids)}

    def legend_text(self) -> str:
        """The legend above the graph, in HTML: it mentions the overview only while the
        overview is shown (from ``OVERVIEW_FROM`` items on); a swatch per device, or per
        stage (or run of stages) with its devices in a large cluster."""
        overview = ("the overview on the right shows where the view is (drag its box, or "
                    "click). " if self.overview.figure.visible else "")
        ids = self.session.cluster.ids
        if grouped(len(ids)):
            what = "nodes are colored by stage (a hue per stage, a shade per device; "
            keys = []
            for grp in device_groups(self.session.plan, ids):
                color = stage_hue(grp.stages[0]) if grp.stages else UNUSED_COLOR
                keys.append(swatch(f"{grp.label}: {device_span(grp.devices)}", color,
                                   fg=text_on(color)))
        else:
            what = "nodes are colored by device ("
            keys = [swatch(d, self.colors[d], fg=text_on(self.colors[d])) for d in ids]
        # compact lines (a widget's text has a line as tall as a button otherwise)
        return ("<div style='line-height:1.5;font-size:12px'>" + what
                + "striped: replicated, data-parallel; upright "
                "stripes and a mark after the name: split by tensor parallelism, col/row/vocab "
                "for column-, row- and vocab-parallel, the hover says over which devices); "
                f"<span style='color:{CROSS}'><b>red dashed edges</b></span> cross devices; "
                "a black outline marks pins; grey: the item's ops are on several stages (the "
                "hover says its mix); the wheel over the graph zooms it. " + overview
                + "<br>" + " ".join(keys) + " " + swatch("mixed", MIXED, fg="black") + "</div>")

    def _draw(self, backend: str, height: int) -> Any:
        wheel = WheelZoomTool()
        p = figure(height=height, sizing_mode="stretch_width",
                   tools=[PanTool(), wheel, ResetTool()], toolbar_location="above",
                   toolbar_sticky=False, output_backend=backend,
                   x_range=Range1d(-5, 5), y_range=Range1d(-5, 1), min_border=4)
        p.toolbar.active_scroll = wheel  # the wheel zooms the graph, not the notebook
        p.axis.visible = False
        p.grid.visible = False
        p.name = "pe-graph-plot"  # (browser tests find the plot by this name)
        p.multi_polygons("xs", "ys", source=self.frames, fill_color="#4c6a92", fill_alpha=0.05,
                         line_color="#8da0b8", line_width=1)
        p.add_layout(LabelSet(x="lx", y="ly", text="label", source=self.frames,
                              text_font_size="size", text_font_style="bold",
                              text_color="#3b5070", text_baseline={"field": "anchor"}, x_offset=2))
        p.multi_line("xs", "ys", source=self.edges, line_color="color", line_width="width",
                     line_dash="dash", line_alpha="alpha")
        r = p.rect("x", "y", width=1.6, height=0.6, source=self.nodes, fill_color="color",
                   line_color="line", line_width="lw", hatch_pattern="hatch",
                   hatch_color="white", hatch_alpha=0.6)
        r.nonselection_glyph.fill_alpha = 0.45
        r.selection_glyph = None
        p.add_tools(
            HoverTool(renderers=[r], tooltips=[
                ("", "@label"), ("device", "@device"), ("op", "@op"), ("output", "@shapes"),
                ("FLOPs fwd / bwd", "@flops"), ("time fwd / bwd", "@time"),
                ("split", "@split"),
                ("memory", "@memory"), ("edges", "@links"), ("across devices", "@cross"),
                ("pinned", "@pinned")]),
            TapTool(renderers=[r]), BoxSelectTool(renderers=[r]),
            LassoSelectTool(renderers=[r]))
        #: the item keys the last selecting gesture in a browser picked (:data:`PICK_JS`)
        self.picked = ColumnDataSource({"keys": [], "gesture": []})
        p.js_on_event(events.SelectionGeometry,
                      CustomJS(args={"source": self.nodes, "picked": self.picked}, code=PICK_JS))
        self.picked.on_change("data", self._on_pick)
        self.nodes.selected.on_change("indices", self._on_select)
        return p

    # -- redrawing -----------------------------------------------------------------------
    def update(self, what: str) -> None:
        if what == "costs":
            self._time_cache.clear()  # calibration changed the op times
        self.colors = self.device_colors()
        if what in ("view", "all"):
            self._relayout()
            data = self.node_columns()
            self.nodes.selected.indices = []
            self.zoom_labels.indices = []  # (positions in the items shown before)
            self.labels.indices = [k for k, t in enumerate(data["short"]) if t]
            self.nodes.data = data  # (the browser then says which labels fit)
            self.edges.data = self.edge_columns(data["device"])
            self.frames.data = self.frame_columns()
            self._fit_ranges()
            text = self.legend_text()
            if self.legend.value != text:
                self.legend.value = text
        elif what in ("plan", "costs"):
            text = self.legend_text()  # (a large cluster's colours follow the stages)
            if self.legend.value != text:
                self.legend.value = text
            dynamic = self.dynamic_columns()
            patch(self.nodes, dynamic)
            patch(self.edges, self.edge_dynamic_columns(dynamic["device"]))
        if list(self.nodes.selected.indices) != self.session.selected:
            self.nodes.selected.indices = list(self.session.selected)

    def _relayout(self) -> None:
        """Recompute what depends on the items shown only: edges, positions, edge sizes."""
        v = self.session.view
        self._item_edges = v.edges()
        self._frames = v.frames()
        self._layout = v.layout(self._item_edges, self._frames)
        self._xy = self._layout.xy
        self._edge_text = [format_bytes(b) for b in self._item_edges.values()]
        self._time_cache: dict[tuple[int, str], str] = {}

    def _fit_ranges(self) -> None:
        """Fit the view to the items shown (the top ``FIT_ROWS`` rows of a deep graph); the
        reset tool comes back to this view."""
        xs = np.asarray(self.nodes.data["x"], dtype=float)
        ys = np.asarray(self.nodes.data["y"], dtype=float)
        if len(xs):
            w = max(float(xs.max() - xs.min()), 4.0) + 3  # narrow graphs: centred, readable
            mid = (float(xs.max()) + float(xs.min())) / 2
            tops = self.frames.data["top"]  # room for the outermost frame's label
            top = max([float(ys.max()) + 0.8, *(t + 0.6 for t in tops)])
            self._set_ranges(mid - w / 2, mid + w / 2, top - min(top - float(ys.min()) + 1,
                                                               FIT_ROWS), top, reset=True)
            bottom = min([float(ys.min()) - 0.8, *self.frames.data["bottom"]])
            self.overview.fit(mid - w / 2, mid + w / 2, bottom, top, len(xs))

    def _set_ranges(self, x0: float, x1: float, y0: float, y1: float, reset: bool) -> None:
        xr, yr = self.figure.x_range, self.figure.y_range
        xr.start, xr.end, yr.start, yr.end = x0, x1, y0, y1
        if reset:
            xr.reset_start, xr.reset_end, yr.reset_start, yr.reset_end = x0, x1, y0, y1

    def zoom_to_selection(self) -> None:
        """Show the selected items close up; the reset tool returns to the fitted view."""
        sel = self.session.selected
        if not sel:
            raise ExplorerError("select the items to zoom to first (click, box or lasso)")
        xs = [self._xy[k][0] for k in sel]
        ys = [self._xy[k][1] for k in sel]
        w = max(max(xs) - min(xs) + ITEM_W + 2, 6.0)
        h = max(max(ys) - min(ys) + ITEM_H + 1.5, 4.0)
        cx, cy = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
        self._set_ranges(cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2, reset=False)

    # -- events --------------------------------------------------------------------------
    def _on_select(self, attr, old, new) -> None:
        # a selection cleared in the browser (the Escape key); the gestures that select send
        # the keys of what they selected (_on_pick)
        if not len(new) and self.session.selected:
            self.session.select_items([])

    def _on_pick(self, attr, old, new) -> None:
        """Select the items a click, box or lasso picked in a view, by the keys that view
        draws them with; an item no longer shown (the view was drawn before the items
        changed) by the op or module it shows."""
        self.pick([str(k) for k in (new.get("keys") or [[]])[0]])

    def pick(self, keys: list[str]) -> list[int]:
        """Select the items with these keys, as a selecting gesture in a view of the graph
        does; an item not shown now by the op or module its key names (expanding what it is
        in; blocks and runs of loose ops no longer shown are left out). Every view is then
        shown the selection. Returns the selected positions."""
        s = self.session
        shown = {it.key for it in s.view.items}
        if sorted(keys) != sorted(s.view.items[k].key for k in s.selected):
            wanted = [k if k in shown else name_in_key(k) for k in keys]
            try:
                s.select([w for w in wanted if w])
            except ExplorerError as e:  # (names come from the same graph: not expected)
                s.say(str(e), error=True)
        # the view the gesture came from has the selection already, the others not: send it
        # to all of them
        sel = self.nodes.selected
        sel.trigger("indices", list(sel.indices), list(sel.indices))
        return s.selected

    def _on_find(self, change) -> None:
        if change["new"]:
            self.session.guarded(self.session.find, "side")(change["new"])

    # -- columns -------------------------------------------------------------------------
    def node_columns(self) -> dict[str, Any]:
        """All columns of the shown items: the static ones (layout, names, FLOPs) and the
        placement-dependent ones (:meth:`dynamic_columns`)."""
        g = self.session.graph
        items = self.session.view.items
        cols: dict[str, list] = defaultdict(list)
        ins, outs = self._edge_totals()
        for k, it in enumerate(items):
            ff = sum(g.nodes[i].fwd_flops for i in it.ops)
            bf = sum(g.nodes[i].bwd_flops for i in it.ops)
            params = sum(g.nodes[i].param_bytes for i in it.nodes)
            outb = sum(g.nodes[i].out_bytes for i in it.ops)
            node = g.nodes[it.ops[0]]
            cols["key"].append(it.key)
            cols["label"].append(it.label + (" (select, then expand)" if it.expandable else ""))
            cols["tag"].append(short_label(it.label))
            cols["n_ops"].append(len(it.ops))
            cols["op"].append(node.op if len(it.ops) == 1 else f"{len(it.ops)} ops")
            cols["shapes"].append(" ".join(str(list(sh)) for sh in node.shapes[:3])
                                  + f" {node.dtype}" if len(it.ops) == 1 else
                                  f"{format_bytes(outb)} of outputs")
            cols["flops"].append(f"{format_flops(ff)} / {format_flops(bf)}")
            cols["memory"].append(f"params {format_bytes(params)}, outputs {format_bytes(outb)}")
            (n_in, b_in), (n_out, b_out) = ins.get(k, (0, 0)), outs.get(k, (0, 0))
            cols["links"].append(f"{n_in} in ({format_bytes(b_in)}), "
                                 f"{n_out} out ({format_bytes(b_out)})")
        out: dict[str, Any] = dict(cols)
        out["x"] = np.array([p[0] for p in self._xy], dtype=float)
        out["y"] = np.array([p[1] for p in self._xy], dtype=float)
        out.update(self.dynamic_columns())
        return out

    def _edge_totals(self) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
        """(count, bytes) of the edges into and out of each shown item."""
        ins: dict[int, tuple[int, int]] = {}
        outs: dict[int, tuple[int, int]] = {}
        for (a, z), b in self._item_edges.items():
            n, t = outs.get(a, (0, 0))
            outs[a] = (n + 1, t + b)
            n, t = ins.get(z, (0, 0))
            ins[z] = (n + 1, t + b)
        return ins, outs

    def dynamic_columns(self) -> dict[str, list]:
        """The item columns that change with the placement and the pins."""
        s = self.session
        g = s.graph
        pins = s.pins
        cols: dict[str, list] = {k: [] for k in DYNAMIC}
        shown = labelled(s.view.items)
        for k, it in enumerate(s.view.items):
            dev, color, rep = self._item_device(it)
            split = self.splits.of(s.plan, it.ops)
            tag = short_label(it.label)
            mark = split.mark or (dev.split(",")[0][len("mixed: "):]
                                  if dev.startswith("mixed") else "")
            cols["short"].append((f"{tag} [{mark}]" if mark else tag) if k in shown else "")
            cols["split"].append(split.text or "none")
            first = dev.split("+")[0] if not dev.startswith("mixed") else s.cluster.ids[0]
            n_pinned = sum(1 for i in it.nodes if g.nodes[i].name in pins) if pins else 0
            cols["device"].append(dev)
            cols["color"].append(color)
            cols["hatch"].append("|" if split.mark and split.mark != "rep"
                                 else "/" if rep else " ")
            cols["time"].append(self._item_time(k, first))
            cols["pinned"].append(f"{n_pinned} node(s)" if n_pinned else "no")
            cols["line"].append("black" if n_pinned else "white")
            cols["lw"].append(3.0 if n_pinned else 1.0)
        cross = defaultdict(int)
        for (a, z), b in self._item_edges.items():
            if crosses(cols["device"][a], cols["device"][z], b):
                cross[a] += b
                cross[z] += b
        cols["cross"] = [format_bytes(cross[k]) if cross[k] else "none"
                         for k in range(len(s.view.items))]
        return cols

    def edge_columns(self, devices: list[str]) -> dict[str, Any]:
        """One polyline per pair of connected items, routed between the rows' items
        (:mod:`widgets.layout`); edges across devices are red and wide, long ones faint."""
        routes = self._layout.routes
        return {"xs": [routes[e][0] for e in self._item_edges],
                "ys": [routes[e][1] for e in self._item_edges],
                **self.edge_dynamic_columns(devices)}

    def frame_columns(self) -> dict[str, list]:
        """An outline around the items of each expanded module, row by row (it covers no
        other item, :func:`widgets.layout.frame_outline`), labelled with its name (the
        outermost always; all of them when there are at most ``MAX_FRAME_LABELS``) over its
        top or under its bottom left corner; ``left`` ... ``bottom`` are its bounds."""
        frames = self._frames
        cols: dict[str, list] = {k: [] for k in ("xs", "ys", "left", "right", "top", "bottom",
                                                 "label", "size", "lx", "ly", "anchor")}
        for f, outline in zip(frames, self._layout.outlines, strict=True):
            cols["xs"].append([[xs] for xs, _ in outline])
            cols["ys"].append([[ys] for _, ys in outline])
            every_x = [x for xs, _ in outline for x in xs]
            every_y = [y for _, ys in outline for y in ys]
            cols["left"].append(min(every_x))
            cols["right"].append(max(every_x))
            cols["top"].append(max(every_y))
            cols["bottom"].append(min(every_y))
            shown = f.nest == 0 or len(frames) <= MAX_FRAME_LABELS
            cols["label"].append(f.label if shown else "")
            cols["size"].append("10pt" if f.nest == 0 else "8pt")
            # a frame and the first frame in it start at the same corner: their labels go
            # over the top and under the bottom in turn
            top = f.nest % 2 == 0
            if top:  # the top left corner ends the first polygon
                xs, ys = outline[0]
                cols["lx"].append(xs[-1])
                cols["ly"].append(ys[-1])
            else:  # the bottom left corner starts the last polygon's left side
                xs, ys = outline[-1]
                cols["lx"].append(xs[len(xs) // 2])
                cols["ly"].append(ys[len(ys) // 2])
            cols["anchor"].append("bottom" if top else "top")
        return cols

    def edge_dynamic_columns(self, devices: list[str]) -> dict[str, list]:
        """Color, width and hover text of the edges, given each item's device label."""
        costs = self.session.costs
        span = self._layout.span
        color, width, dash, alpha, label = [], [], [], [], []
        for ((a, z), b), txt in zip(self._item_edges.items(), self._edge_text, strict=True):
            da, dz = devices[a], devices[z]
            if crosses(da, dz, b):
                t = costs.transfer_s(da.split("+")[0], dz.split("+")[0], b)
                color.append(CROSS)
                width.append(2.5)
                dash.append("dashed")
                alpha.append(0.9)
                label.append(f"{txt} across devices, {da} -> {dz}: {format_seconds(t)}")
            else:
                color.append("#888888")
                width.append(1.0)
                dash.append("solid")
                alpha.append(0.25 if span[a, z] > LONG_SPAN else 0.7)
                label.append(f"{txt} on {da}")
        return {"color": color, "width": width, "dash": dash, "alpha": alpha, "label": label}

    def _item_device(self, it: Item) -> tuple[str, str, bool]:
        """(label, color, replicated) of an item from the plan's placement of its ops."""
        plan = self.session.plan
        stages = {plan.placement[self.session.graph.nodes[i].name] for i in it.ops}
        if len(stages) > 1:
            return (mix_text(plan, [plan.placement[self.session.graph.nodes[i].name]
                                    for i in it.ops]), MIXED, False)
        devs = plan.stages[next(iter(stages))] if stages else plan.stages[0]
        return "+".join(devs), self.colors.get(devs[0], MIXED), len(devs) > 1

    def _item_time(self, k: int, dev: str) -> str:
        costs = self.session.costs
        key = (k, costs.cluster.device(dev).type_key)
        t = self._time_cache.get(key)
        if t is None:
            ops = self.session.view.items[k].ops
            fwd = sum(costs.fwd_s(i, dev) for i in ops)
            bwd = sum(costs.bwd_s(i, dev) for i in ops)
            srcs = sorted({costs.source(i, dev) for i in ops})
            t = self._time_cache[key] = (f"{format_seconds(fwd)} / {format_seconds(bwd)} on "
                                         f"{key[1]} ({', '.join(srcs)})")
        return t
