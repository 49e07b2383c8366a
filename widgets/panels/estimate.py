"""The engine's estimate of the plan under edit in numbers: step time, bound, memory, bytes."""

from __future__ import annotations

import html

import ipywidgets as W

from explorer.core.units import format_bytes, format_seconds
from widgets.panels.base import Panel
from widgets.session import Session


class EstimatePanel(Panel):
    """``table`` shows the session's prediction; the step time, the bytes across devices and
    each device's peak memory carry their exact value in ``data-value`` attributes (classes
    ``pe-step``, ``pe-cross``, ``pe-mem``) for tests and scripts to read."""

    topics = frozenset({"plan", "costs"})

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.table = W.HTML("")
        self.table.add_class("pe-estimate")

    def update(self, what: str) -> None:
        s = self.session
        p = s.prediction
        used = set(s.plan.devices)
        over = p.memory_report()
        busy = " ".join(f"{d} {format_seconds(b)}" for d, b in p.busy_s.items() if d in used)
        rows = [
            ("step time", f"<span class='pe-step' data-value='{p.step_s!r}'>"
                          f"{format_seconds(p.step_s)}</span>"),
            ("lower bound", f"{format_seconds(p.lower_bound_s)} (gap {p.gap:+.0%})"),
            ("bottleneck", html.escape(p.bottleneck)),
            ("busy", busy),
            ("across devices", f"<span class='pe-cross' data-value='{p.cross_device_bytes}'>"
                               f"{format_bytes(p.cross_device_bytes)}</span>"),
            ("energy", f"{p.energy_j:,.3g} J per step"),
            ("plan", html.escape(f"{s.plan.algorithm}; {len(s.plan.stages)} stage(s), "
                                 f"{s.plan.micro_batches} micro-batch(es), {s.plan.schedule}, "
                                 f"{s.plan.optimizer}; {len(s.pins)} pin(s)")),
        ]
        peak = " ".join(f"<span class='pe-mem' data-device='{d}' data-value='{b}'>"
                        f"{d} {format_bytes(b)}</span>" for d, b in p.peak_bytes.items())
        rows.append(("peak memory", peak))
        why = s.run_problem
        if why:
            rows.append(("real run", f"<span class='pe-cannot-run' style='color:#b00020'>"
                                     f"cannot run: {html.escape(why)}</span>"))
        if over:
            rows.append(("does not fit", f"<span style='color:#d62728'>{html.escape(over)}"
                                         "</span>"))
        self.table.value = (
            "<table style='font-size:13px;table-layout:auto;width:100%'>" + "".join(
                f"<tr><td style='padding-right:8px;color:#555'>{k}</td><td>{v}</td></tr>"
                for k, v in rows) + "</table>"
            f"<div style='color:#888;font-size:11px'>estimated in {s.estimate_s * 1e3:.0f} ms"
            "</div>")
