"""Finding one's way in a large graph: an overview of the whole layout, and labels on zoom.

The overview is a narrow second plot beside the graph (graphs read top to bottom, so the
strip is as tall as the graph) that draws every item, edge and frame from the graph's own
data sources, with the graph's current view as a box on it (bokeh's ``RangeTool``): drag the
box to move the view, click elsewhere to centre the view there.

Labels are drawn only where neighbouring labels do not run into each other (``LABEL_PX``
pixels from one item's centre to the next on screen): zoomed out, none. Above ``limit`` items
the graph labels only the largest ones (the rest would be unreadable); :func:`add_labels`
draws the labels of the other items in view too once the user has zoomed in far enough that
at most ``limit`` are in view. The browser decides both whenever the view, the plot's width
or the items change (a ``CustomJS`` callback sets the indices of two ``IndexFilter``), so
zooming and panning need no round trip to the kernel.
"""

from __future__ import annotations

from typing import Any

from bokeh import events
from bokeh.models import (
    CDSView,
    ColumnDataSource,
    CustomJS,
    IndexFilter,
    Range1d,
    RangeTool,
)
from bokeh.plotting import figure

from widgets.layout import GAP, ITEM_H, ITEM_W

#: width of the overview in pixels
OVERVIEW_WIDTH = 110
#: pixels a label needs (a short label of up to 18 characters at 8pt): labels appear once
#: neighbouring items are at least this far apart on screen
LABEL_PX = 100
#: the overview is shown from this many items on (a small graph fits in the view anyway)
OVERVIEW_FROM = 40

#: which items get a label, when items ``pitch`` apart (in data units) are ``label_px`` apart
#: on screen (otherwise none): those with a short label always (filter ``always``), the others
#: in view on zoom (filter ``filter``), when at most ``limit`` are in view
LABELS_IN_VIEW_JS = """
const d = nodes.data, xs = d.x, ys = d.y, shown = d.short;
const x0 = Math.min(xr.start, xr.end), x1 = Math.max(xr.start, xr.end);
const y0 = Math.min(yr.start, yr.end), y1 = Math.max(yr.start, yr.end);
const width_px = plot.inner_width || plot.width || 600;
let want = [], keep = [];
if (pitch * width_px / (x1 - x0) >= label_px) {
  for (let i = 0; i < shown.length; i++) if (shown[i]) keep.push(i);
  const inside = [];
  for (let i = 0; i < xs.length && inside.length <= limit; i++)
    if (xs[i] >= x0 && xs[i] <= x1 && ys[i] >= y0 && ys[i] <= y1) inside.push(i);
  if (inside.length <= limit) want = inside.filter(i => !shown[i]);
}
for (const [f, v] of [[filter, want], [always, keep]]) {
  const old = f.indices || [];
  if (v.length !== old.length || v.some((x, k) => x !== old[k])) f.indices = v;
}
"""

#: a click on the overview centres the graph's view there
CENTRE_JS = """
const w = xr.end - xr.start, h = yr.end - yr.start;
xr.setv({start: cb_obj.x - w / 2, end: cb_obj.x + w / 2});
yr.setv({start: cb_obj.y - h / 2, end: cb_obj.y + h / 2});
"""


def label_renderer(p: Any, nodes: ColumnDataSource, text: str, name: str) -> IndexFilter:
    """Column ``text`` of ``nodes`` drawn on the items an ``IndexFilter`` (returned) picks:
    black on a white box, legible on every device color and on the stripes."""
    shown = IndexFilter(indices=[])
    r = p.text(x="x", y="y", text=text, source=nodes, view=CDSView(filter=shown),
               text_font_size="8pt", text_align="center", text_baseline="middle",
               text_color="black", background_fill_color="white", background_fill_alpha=0.8)
    r.selection_glyph = r.nonselection_glyph = None  # as legible when something is selected
    r.name = name
    return shown


def add_labels(p: Any, nodes: ColumnDataSource, limit: int) -> tuple[IndexFilter, IndexFilter]:
    """Draw the labels of ``nodes``: column ``short`` (the largest items) where labels fit
    on screen, and column ``tag`` on the other items in view once at most ``limit`` are in
    view and labels fit (``LABEL_PX``). Returns the filters that say which: (always, on
    zoom); until the browser decides, the items with a short label have it."""
    always = label_renderer(p, nodes, "short", "pe-labels")
    always.indices = [k for k, t in enumerate(nodes.data["short"]) if t]
    shown = label_renderer(p, nodes, "tag", "pe-zoom-labels")
    cb = CustomJS(args={"nodes": nodes, "xr": p.x_range, "yr": p.y_range, "plot": p,
                        "filter": shown, "always": always, "limit": limit,
                        "pitch": ITEM_W + GAP, "label_px": LABEL_PX}, code=LABELS_IN_VIEW_JS)
    for rng in (p.x_range, p.y_range):
        rng.js_on_change("start", cb)
        rng.js_on_change("end", cb)
    p.js_on_change("inner_width", cb)
    nodes.js_on_change("data", cb)
    return always, shown


class Overview:
    """The whole layout in small beside the graph ``main`` (same ``nodes``, ``edges`` and
    ``frames`` sources), with the graph's view as a box that follows its ranges and moves
    them when dragged; a click centres the view. ``figure`` is the small plot."""

    def __init__(self, main: Any, nodes: ColumnDataSource, edges: ColumnDataSource,
                 frames: ColumnDataSource, backend: str = "canvas") -> None:
        p = figure(width=OVERVIEW_WIDTH, height=main.height, tools="", toolbar_location=None,
                   output_backend=backend, x_range=Range1d(-5, 5), y_range=Range1d(-5, 1),
                   min_border=2, min_border_top=main.min_border_top or 30)
        p.axis.visible = False
        p.grid.visible = False
        p.name = "pe-overview"
        p.title.text = "overview"
        p.title.text_font_size = "8pt"
        p.title.text_font_style = "normal"
        p.multi_polygons("xs", "ys", source=frames, fill_color="#4c6a92", fill_alpha=0.05,
                         line_color="#8da0b8", line_width=0.5)
        p.multi_line("xs", "ys", source=edges, line_color="color", line_alpha=0.3,
                     line_width=0.5)
        r = p.rect("x", "y", width=ITEM_W, height=ITEM_H, source=nodes, fill_color="color",
                   line_color=None)
        r.selection_glyph = r.nonselection_glyph = None
        tool = RangeTool(x_range=main.x_range, y_range=main.y_range, start_gesture="none")
        # a view far smaller than the layout is a few pixels: a thick outline keeps it seen
        tool.overlay.fill_color = "#1f77b4"
        tool.overlay.fill_alpha = 0.25
        tool.overlay.line_color = "#08306b"
        tool.overlay.line_width = 2
        tool.overlay.line_dash = "solid"
        p.add_tools(tool)
        p.js_on_event(events.Tap, CustomJS(args={"xr": main.x_range, "yr": main.y_range},
                                           code=CENTRE_JS))
        self.figure, self.tool = p, tool

    def fit(self, x0: float, x1: float, y0: float, y1: float, items: int) -> None:
        """Show the whole layout (bounds in data units); hidden below ``OVERVIEW_FROM``
        items."""
        pad_x, pad_y = 0.03 * (x1 - x0) + 0.5, 0.05 * (y1 - y0) + 0.5
        xr, yr = self.figure.x_range, self.figure.y_range
        xr.start, xr.end, yr.start, yr.end = x0 - pad_x, x1 + pad_x, y0 - pad_y, y1 + pad_y
        self.figure.visible = items >= OVERVIEW_FROM
