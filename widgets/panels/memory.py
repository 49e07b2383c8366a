"""Per-device memory at the simulated peak, by category, against each device's capacity.

The scale follows what is used, so bars stay readable at any capacity: in GiB when devices
are large, zoomed to the usage (the capacity said in words) when a plan uses a small part of
it, and as wide as the notebook. The title says the unit and, on a line of its own, where the
capacity is; the legend takes two rows; the toolbar has a row of its own (zoom along the
axis, reset, hover): all stay inside the chart in a narrow column.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from bokeh.models import (
    ColumnDataSource,
    FactorRange,
    HoverTool,
    LabelSet,
    Legend,
    LegendItem,
    Range1d,
    Title,
)
from bokeh.plotting import figure
from bokeh.transform import dodge

import explorer as ex
from explorer.core.plan import Plan
from explorer.core.units import GiB, KiB, MiB, format_bytes
from widgets.device_groups import device_groups, device_span, grouped, worst_device
from widgets.panels.base import Panel, bokeh_widget
from widgets.session import Session

#: what fills a device, as the prediction's memory breakdown names it (``<category>_bytes``);
#: "gathered" is the buffers ZeRO-3 gathers weights into, "workspace" what a GPU's math
#: libraries hold for the whole run (0 where a breakdown has none)
CATEGORIES = ("params", "grads", "optimizer", "buffers", "activations", "gathered", "workspace")
CATEGORY_COLORS = ("#4c72b0", "#dd8452", "#8172b3", "#937860", "#55a868", "#da8bc3", "#8c8c8c")


def bars_height(n_rows: int) -> int:
    """Pixels of a memory chart with ``n_rows`` bars (closer together from five on, so that
    the chart of 8 devices or groups stays beside the graph)."""
    return 150 + (44 if n_rows <= 4 else 30) * n_rows


#: below this share of the largest capacity, the scale zooms to the memory used
ZOOM_BELOW = 0.1


def memory_unit(axis_end_bytes: float) -> tuple[str, int]:
    """The unit of a memory axis that ends at ``axis_end_bytes``: GiB from 4 GiB on, then
    MiB, then KiB (so its ticks read 20, 40, 60, not 2.000e-4)."""
    for unit, k in (("GiB", GiB), ("MiB", MiB)):
        if axis_end_bytes >= 4 * k:
            return unit, k
    return "KiB", KiB


def scale_end(totals: list[float], capacities: list[float]) -> tuple[float, bool]:
    """Where the memory axis ends (in the units of the arguments), and whether that is short
    of the capacities (zoomed to the usage)."""
    used, cap = max(totals, default=0.0), max(capacities, default=0.0)
    if used <= 0 or used >= ZOOM_BELOW * cap:
        return max(used, cap) * 1.05 or 1.0, False
    return used * 1.35, True


def settings_text(plan: Plan, device: str) -> str:
    """The memory settings of the stage ``device`` runs in, in words."""
    if device not in plan.devices:
        return "unused"
    return plan.settings_of(plan.stage_of_device(device)).describe() or "defaults"


def recompute_text(session: Session) -> dict[str, str]:
    """Per device of a stage that recomputes, what recomputation saved at its peak and what
    it costs per step, in words: against the same plan with recomputation off on those
    stages (one more simulation, only when some stage recomputes)."""
    plan, pred = session.plan, session.prediction
    stages = [k for k in range(len(plan.stages)) if plan.settings_of(k).recompute != "none"]
    if not stages:
        return {}
    base = ex.simulate(session.graph, plan.with_memory(recompute="none", stages=stages),
                       session.costs)
    added_ms = (pred.step_s - base.step_s) * 1e3
    return {d: f"{format_bytes(base.peak_bytes.get(d, 0) - pred.peak_bytes.get(d, 0))} saved "
               f"at the peak, {added_ms:+.2f} ms per step"
            for k in stages for d in plan.stages[k]}


class MemoryPanel(Panel):
    """Stacked bars per device with the capacity as a dashed box (red when over) and the
    numbers in words above each bar; ``source`` holds the columns drawn (one row per device,
    in ``unit``), ``figure.x_range`` follows :func:`scale_end`. Above ``GROUPED_ABOVE``
    devices a row is a group of devices (a stage, :func:`widgets.device_groups.device_groups`)
    drawn as its device with the highest peak, named with the group's median in words."""

    topics = frozenset({"plan", "costs"})

    def __init__(self, session: Session, backend: str = "canvas") -> None:
        super().__init__(session)
        self.unit, self.unit_bytes = "GiB", GiB
        self.source = ColumnDataSource(self.columns())
        rows = list(self.source.data["row"])
        p = figure(height=bars_height(len(rows)), sizing_mode="stretch_width",
                   y_range=FactorRange(*rows[::-1]), x_range=Range1d(0, 1),
                   tools="xpan,xwheel_zoom,reset", toolbar_location="above",
                   toolbar_sticky=False, output_backend=backend, min_border_right=12)
        p.name = "pe-memory-plot"  # (browser tests find the plot by this name)
        bar_y = dodge("row", -0.12, range=p.y_range)
        stack = p.hbar_stack(list(CATEGORIES), y=bar_y, height=0.45, source=self.source,
                             color=list(CATEGORY_COLORS))
        p.hbar(y=bar_y, right="capacity", height=0.55, source=self.source, fill_alpha=0,
               line_color="cap_color", line_width="cap_width", line_dash="dashed")
        # the numbers in words, on their own row above each bar (bars may be short)
        p.add_layout(LabelSet(x=0, y=dodge("row", 0.3, range=p.y_range), text="summary",
                              source=self.source, x_offset=2, text_font_size="8pt",
                              text_baseline="middle", text_color="cap_color"))
        legend = Legend(items=[LegendItem(label=c, renderers=[r])
                               for c, r in zip(CATEGORIES, stack, strict=True)],
                        orientation="horizontal", nrows=2, label_text_font_size="8pt",
                        glyph_width=10, spacing=6, padding=2, margin=2)
        p.add_layout(legend, "below")
        #: the second line of the title: where the capacity is
        self.capacity_note = Title(text="", text_font_size="8pt", text_font_style="normal")
        p.add_layout(self.capacity_note, "above")
        p.add_tools(HoverTool(tooltips=[("device", "@device"), ("total", "@total_text"),
                                        ("capacity", "@capacity_text"),
                                        ("params/grads/opt", "@detail"),
                                        ("memory settings", "@settings"),
                                        ("recomputation", "@recompute")]))
        self.figure = p
        self.update("all")
        self.widget = bokeh_widget(p, "pe-memory")

    def update(self, what: str) -> None:
        """New bars, in the unit that suits the new axis (see :func:`memory_unit`)."""
        self.unit, self.unit_bytes = "B", 1
        d = self.columns()
        totals = [sum(d[c][k] for c in CATEGORIES) for k in range(len(d["device"]))]
        end, zoomed = scale_end(totals, d["capacity"])
        self.unit, self.unit_bytes = memory_unit(end)
        self.source.data = self.columns()
        rows = list(self.source.data["row"])[::-1]
        if list(self.figure.y_range.factors) != rows:  # (the groups follow the stages)
            self.figure.y_range.factors = rows
            self.figure.height = bars_height(len(rows))
        xr = self.figure.x_range
        xr.start, xr.end = xr.reset_start, xr.reset_end = 0, end / self.unit_bytes
        self.figure.xaxis.axis_label = self.unit
        self.figure.title.text = f"memory at the peak, {self.unit}"
        self.capacity_note.text = ("capacity beyond the right edge (said in words)" if zoomed
                                   else "capacity: dashed box")

    def columns(self) -> dict[str, list]:
        """The bars' columns from the session's prediction (in ``unit``, and in words)."""
        pred, plan = self.session.prediction, self.session.plan
        unit = self.unit_bytes
        cols = defaultdict(list)
        recomputed = recompute_text(self.session)
        ids = self.session.cluster.ids
        rows = [(d, d, ()) for d in ids]
        if grouped(len(ids)):  # a bar per group: its device with the highest peak
            totals = {d: self.total_bytes(d) for d in ids}
            rows = [(grp.label, worst_device(totals, grp.devices), grp.devices)
                    for grp in device_groups(plan, ids)]
        for row, d, group in rows:
            m = pred.memory.get(d)
            vals = tuple(getattr(m, f"{c}_bytes", 0) if m else 0 for c in CATEGORIES)
            for c, v in zip(CATEGORIES, vals, strict=True):
                cols[c].append(v / unit)
            total = sum(vals)
            cap = pred.capacity_bytes.get(d, self.session.cluster.device(d).memory_bytes)
            over = total > cap
            cols["row"].append(row)
            cols["device"].append(d)
            cols["capacity"].append(cap / unit)
            cols["total_text"].append(format_bytes(total) + (" (unused)" if not m else ""))
            cols["capacity_text"].append(format_bytes(cap) + (" OVER" if over else ""))
            cols["cap_color"].append("#d62728" if over else "#333333")
            cols["cap_width"].append(3.0 if over else 1.0)
            cols["detail"].append(" / ".join(format_bytes(v) for v in vals[:3]))
            cols["settings"].append(settings_text(plan, d))
            cols["recompute"].append(recomputed.get(d, "none"))
            share = f" ({total / cap:.1%})" if cap > 0 else ""
            text = (f"{d}: {format_bytes(total)} of {format_bytes(cap)}{share}"
                    + (" OVER" if over else "") if m else f"{d}: unused")
            if group:
                text = (f"{row} ({device_span(group)}): highest {text}"
                        + (f"; median {format_bytes(self.median_bytes(group))}"
                           if len(group) > 1 and m else ""))
            cols["summary"].append(text)
        return dict(cols)

    def total_bytes(self, device: str) -> int:
        """What ``device`` holds at its peak, all categories (0: unused)."""
        m = self.session.prediction.memory.get(device)
        return sum(getattr(m, f"{c}_bytes", 0) for c in CATEGORIES) if m else 0

    def median_bytes(self, devices: tuple[str, ...]) -> float:
        """The median of what ``devices`` hold at their peaks."""
        return statistics.median(self.total_bytes(d) for d in devices)
