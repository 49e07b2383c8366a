"""The simulated step as a timeline: a compute lane per device the plan uses, and a
communication lane for each that communicates; in a large cluster, for the busiest device of
each group of stages only (:mod:`widgets.device_groups`)."""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import numpy as np
from bokeh.models import ColumnDataSource, FactorRange, HoverTool
from bokeh.plotting import figure

from widgets.device_groups import device_groups, grouped, worst_device
from widgets.panels.base import Panel, PlotBox, bokeh_widget, swatch
from widgets.session import Session

KIND_COLORS = {"fwd": "#4c72b0", "bwd": "#dd8452", "send": "#c44e52", "recv": "#c44e52",
               "allreduce": "#8172b3", "optimizer": "#55a868", "issue": "#937860"}
#: most timeline bars drawn; longer timelines merge neighbouring bars of the same kind
MAX_BARS = 1000


def lanes_height(n_lanes: int) -> int:
    """Pixels of a timeline with ``n_lanes`` lanes (closer together beyond eight, so that
    the timeline of 8 devices or groups stays within a screen)."""
    return 90 + (26 if n_lanes <= 8 else 12) * n_lanes


class TimelinePanel(Panel):
    """Bars of the session's predicted timeline, in ms into the step; ``source`` holds them."""

    topics = frozenset({"plan", "costs"})

    def __init__(self, session: Session, backend: str = "canvas") -> None:
        super().__init__(session)
        self.source = ColumnDataSource(self.columns())
        lanes = self.lanes()
        title = ("simulated step, the busiest device of each stage"
                 if grouped(len(session.cluster.ids)) else "simulated step per device")
        p = figure(height=lanes_height(len(lanes)), sizing_mode="stretch_width",
                   y_range=FactorRange(*lanes), x_axis_label="ms into the step",
                   title=title, tools="xpan,xwheel_zoom,reset",
                   output_backend=backend)
        p.hbar(y="lane", left="start", right="end", height=0.8, color="color",
               source=self.source)
        p.add_tools(HoverTool(tooltips=[("", "@label"), ("from", "@start{0.000} ms"),
                                        ("to", "@end{0.000} ms")]))
        p.name = "pe-timeline-plot"
        self.figure = p
        self.legend = W.HTML(self.legend_html())
        self.widget = PlotBox([self.legend, bokeh_widget(p)])

    def legend_html(self) -> str:
        """A swatch per kind of bar; "issue" (a GPU's host issuing an op) where shown."""
        hosts = any(iv.lane == "host" for iv in self.session.prediction.timeline)
        return " ".join(swatch(k, c) for k, c in KIND_COLORS.items()
                        if k != "recv" and (k != "issue" or hosts))

    def update(self, what: str) -> None:
        self.source.data = self.columns()
        legend = self.legend_html()
        if self.legend.value != legend:
            self.legend.value = legend
        lanes = self.lanes()
        if list(self.figure.y_range.factors) != lanes:
            self.figure.y_range.factors = lanes
            self.figure.height = lanes_height(len(lanes))

    def lanes(self) -> list[str]:
        """The lanes drawn, top first: each used device's host lane when it has two
        timelines (a GPU), its compute lane, and its comm lane when it communicates."""
        used = self.shown_devices()
        has = {(iv.device, iv.lane) for iv in self.session.prediction.timeline
               if iv.lane != "compute"}
        return [f"{d} {lane}" for d in used for lane in ("host", "compute", "comm")
                if lane == "compute" or (d, lane) in has][::-1]

    def shown_devices(self) -> list[str]:
        """The devices with lanes: every one the plan uses, or above ``GROUPED_ABOVE``
        devices the busiest of each group (:func:`widgets.device_groups.device_groups`)."""
        s = self.session
        used = list(s.plan.devices)
        if not grouped(len(s.cluster.ids)):
            return used
        busy = s.prediction.busy_s
        return [worst_device({d: busy.get(d, 0.0) for d in grp.devices})
                for grp in device_groups(s.plan, s.cluster.ids) if grp.stages]

    def columns(self) -> dict[str, Any]:
        """One bar per interval (ms); beyond ``MAX_BARS``, neighbours of the same kind on a
        lane closer than step/MAX_BARS are merged into one bar."""
        pred = self.session.prediction
        shown = set(self.shown_devices())
        bars = sorted((iv for iv in pred.timeline if iv.device in shown),
                      key=lambda iv: (iv.device, iv.lane, iv.start_s))
        tol_ms = pred.step_s / MAX_BARS * 1e3 if len(bars) > MAX_BARS else 0.0
        cols: dict[str, list] = {k: [] for k in ("lane", "start", "end", "color", "label")}
        last, count, first_label = None, 0, ""
        for iv in bars:
            lane = f"{iv.device} {iv.lane}"
            kind = iv.kind
            if (last == kind and tol_ms and cols["lane"][-1] == lane
                    and iv.start_s * 1e3 - cols["end"][-1] <= tol_ms):
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
