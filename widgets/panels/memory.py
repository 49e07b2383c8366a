"""Per-device memory at the simulated peak, by category, against each device's capacity."""

from __future__ import annotations

from collections import defaultdict

from bokeh.models import ColumnDataSource, FactorRange, HoverTool, LabelSet, Legend, LegendItem
from bokeh.plotting import figure

from explorer.core.units import MiB, format_bytes
from widgets.panels.base import Panel, bokeh_widget
from widgets.session import Session

CATEGORIES = ("params", "grads", "optimizer", "buffers", "activations")
CATEGORY_COLORS = ("#4c72b0", "#dd8452", "#8172b3", "#937860", "#55a868")


class MemoryPanel(Panel):
    """Stacked bars per device (MiB) with the capacity as a dashed box, red when over;
    ``source`` holds the columns drawn (one row per device)."""

    topics = frozenset({"plan", "costs"})

    def __init__(self, session: Session, backend: str = "canvas") -> None:
        super().__init__(session)
        self.source = ColumnDataSource(self.columns())
        devices = list(session.cluster.ids)
        p = figure(height=100 + 34 * len(devices), width=380,
                   y_range=FactorRange(*devices[::-1]),
                   title="memory at the peak vs capacity (dashed box), MiB",
                   toolbar_location=None, output_backend=backend)
        stack = p.hbar_stack(list(CATEGORIES), y="device", height=0.6, source=self.source,
                             color=list(CATEGORY_COLORS))
        p.hbar(y="device", right="capacity", height=0.8, source=self.source, fill_alpha=0,
               line_color="cap_color", line_width="cap_width", line_dash="dashed")
        # bars far below capacity are invisible: say the numbers in words on each bar
        p.add_layout(LabelSet(x=0, y="device", text="summary", source=self.source,
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
        self.figure = p
        self.widget = bokeh_widget(p, "pe-memory")

    def update(self, what: str) -> None:
        self.source.data = self.columns()

    def columns(self) -> dict[str, list]:
        """The bars' columns from the session's prediction (MiB, and the numbers in words)."""
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
            cols["total_text"].append(format_bytes(total) + (" (unused)" if not m else ""))
            cols["capacity_text"].append(format_bytes(cap) + (" OVER" if over else ""))
            cols["cap_color"].append("#d62728" if over else "#333333")
            cols["cap_width"].append(3.0 if over else 1.0)
            cols["detail"].append(" / ".join(format_bytes(v) for v in vals[:3]))
            share = f" ({total / cap:.0%})" if cap > 0 else ""
            cols["summary"].append(f"{format_bytes(total)} of {format_bytes(cap)}{share}"
                                   + (" OVER" if over else "") if m else "unused")
        return dict(cols)
