"""The engine's estimate of the plan under edit in numbers: step time, bound, memory, bytes."""

from __future__ import annotations

import html

import ipywidgets as W

from explorer.analysis.throughput import throughput
from explorer.core.units import format_bytes, format_seconds
from widgets.device_groups import device_groups, device_span, grouped, spread_text, worst_device
from widgets.panels.base import Panel
from widgets.session import Session


def folded(line: str, detail: str, css: str) -> str:
    """HTML: ``line`` with ``detail`` folded under it (both HTML), opened by a click on
    "per stage"."""
    return (f"<details class='{css}'><summary>{line}"
            " <span style='color:#1f77b4'>(per stage)</span></summary>"
            f"<div style='font-size:12px'>{detail}</div></details>")


class EstimatePanel(Panel):
    """``table`` shows the session's prediction; the step time, the bytes across devices and
    each device's peak memory carry their exact value in ``data-value`` attributes (classes
    ``pe-step``, ``pe-cross``, ``pe-mem``) for tests and scripts to read. Above
    ``GROUPED_ABOVE`` devices, busy time and peak memory are said per group of devices
    (:func:`widgets.device_groups.device_groups`: per stage) as their spread with the device
    that has the most named, and ``pe-mem`` is the device with the highest peak only."""

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
        if len(p.over_memory_bytes) > 3:  # (not a paragraph per device)
            worst = worst_device(p.over_memory_bytes)
            over = (f"{len(p.over_memory_bytes)} devices ({device_span(p.over_memory_bytes)}); "
                    f"the most {worst}, by {format_bytes(p.over_memory_bytes[worst])}")
        if grouped(len(s.cluster.ids)):
            busy = folded(html.escape(spread_text(p.busy_s, sorted(used), format_seconds)),
                          self.grouped_text(p.busy_s, format_seconds, used), "pe-busy")
        else:
            busy = " ".join(f"{d} {format_seconds(b)}" for d, b in p.busy_s.items()
                            if d in used)
        rows = [
            ("step time", f"<span class='pe-step' data-value='{p.step_s!r}'>"
                          f"{format_seconds(p.step_s)}</span>"),
            *self.throughput_rows(),
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
        if grouped(len(s.cluster.ids)):  # the spread, the device with the most as its span
            worst = worst_device(p.peak_bytes)
            everyone = html.escape(spread_text(p.peak_bytes, list(p.peak_bytes), format_bytes))
            mine = f"<span class='pe-mem' data-device='{worst}' data-value='{p.peak_bytes[worst]}'>"
            cut = everyone.rfind(worst)  # ("... on each": said after it)
            line = (f"{everyone[:cut]}{mine}{worst}</span>{everyone[cut + len(worst):]}"
                    if cut >= 0 else f"{everyone} ({mine}{worst}</span>)")
            peak = folded(line,
                          self.grouped_text(p.peak_bytes, format_bytes, set(s.cluster.ids)),
                          "pe-peak")
        rows.append(("peak memory", peak))
        why = s.run_problem
        if why:
            rows.append(("real run", f"<span class='pe-cannot-run' style='color:#b00020'>"
                                     f"cannot run: {html.escape(why)}</span>"))
        if over:
            rows.append(("does not fit", f"<span style='color:#d62728'>{html.escape(over)}"
                                         "</span>"))
        self.table.value = (
            "<table style='font-size:13px;table-layout:auto;width:100%;line-height:1.35'>"
            + "".join(
                f"<tr><td style='padding-right:8px;color:#555'>{k}</td><td>{v}</td></tr>"
                for k, v in rows) + "</table>"
            f"<div style='color:#888;font-size:11px'>estimated in {s.estimate_s * 1e3:.0f} ms"
            "</div>")

    def throughput_rows(self) -> list[tuple[str, str]]:
        """For a language model, a row of tokens/s and model TFLOP/s per device and MFU (the
        values in ``pe-rate``'s ``data-tokens`` and ``data-mfu``); none for other models."""
        s = self.session
        rate = throughput(s.graph, s.plan, s.costs.cluster, s.prediction.step_s)
        if rate is None:
            return []
        tokens = rate.tokens_per_s_per_device
        return [("throughput", f"<span class='pe-rate' data-tokens='{tokens!r}' "
                               f"data-mfu='{rate.mfu!r}'>{html.escape(rate.describe())}</span>")]

    def grouped_text(self, values: dict[str, float], fmt, shown: set[str]) -> str:
        """``values`` per device group of the plan (those of devices in ``shown``), one line
        each: the group, its devices and their spread (:func:`spread_text`)."""
        s = self.session
        lines = []
        for grp in device_groups(s.plan, s.cluster.ids):
            devs = [d for d in grp.devices if d in shown]
            if devs:
                lines.append(f"<span class='pe-group'>{html.escape(grp.label)} "
                             f"({html.escape(device_span(devs))}): "
                             f"{html.escape(spread_text(values, devs, fmt))}</span>")
        return "<br>".join(lines)
