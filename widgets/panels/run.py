"""Real training steps under the plan under edit: predicted vs measured, and calibration."""

from __future__ import annotations

import html

import ipywidgets as W

from explorer.core.units import format_bytes, format_seconds
from widgets.panels.base import Panel, button, checkbox, html_table, wrapping
from widgets.session import Session

#: what a report of an earlier plan says above it
STALE = ("this report is of an earlier plan: the plan has changed since it ran; run for real "
         "again to compare this one (undo back to that plan to read it as current)")


class RunPanel(Panel):
    """``widget``: ``steps``, ``force``, ``run_button``, ``calibrate_button``, the ranks'
    output (``output``) and the predicted vs measured ``report`` (marked :data:`STALE`
    once the plan under edit is another than the one it ran)."""

    topics = frozenset({"run", "plan"})

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        s = session
        self.steps = W.BoundedIntText(value=5, min=1, max=1000, description="steps")
        self.force = checkbox("run even if predicted not to fit")
        self.run_button = button(s, "run for real", "train a few steps under the plan",
                                 self._run, "pe-run", "warning", where="run")
        self.calibrate_button = button(s, "calibrate", "fit the cost model to the run and "
                                       "estimate again", self._calibrate, "pe-calibrate",
                                       where="run")
        self.runnable = W.HTML("")
        self.runnable.add_class("pe-runnable")
        self.output = W.Output()
        self.report = W.HTML("")
        self.report.add_class("pe-report")
        self.widget = W.VBox([
            wrapping([self.steps, self.force, self.run_button, self.calibrate_button]),
            self.runnable, self.output, self.report])

    def update(self, what: str) -> None:
        why = self.session.run_problem
        self.runnable.value = (f"<span style='color:#b00020'>this plan cannot run for real: "
                               f"{html.escape(why)}</span>" if why else "")
        rep = self.session.report
        if rep is None:
            self.report.value = ""
            return
        rows = []
        for r in rep.rows:
            fmt = format_seconds if r.unit == "s" else format_bytes
            rows.append((html.escape(r.what), html.escape(r.device), fmt(r.predicted),
                         fmt(r.measured), f"{r.error:+.1%}"))
        table = html_table(("", "device", "predicted", "measured", "error"), rows,
                           f"memory measured by {html.escape(rep.memory_source)}; the "
                           f"ranks ran {html.escape(rep.ran_as)}")
        if self.session.report_is_stale:  # kept to compare with, marked as another plan's
            table = (f"<div class='pe-report-stale'><b>{STALE}</b><div style='opacity:0.55'>"
                     f"{table}</div></div>")
        self.report.value = table

    def _run(self, *_) -> None:
        self.output.clear_output()
        self.run_button.disabled = True
        failed: Exception | None = None
        # the ranks' output goes to the output area, an error must not: in a notebook the
        # output area would show it as a traceback and swallow it, leaving no report
        with self.output:
            try:
                report = self.session.run(self.steps.value, force=self.force.value)
            except Exception as e:
                failed = e
            finally:
                self.run_button.disabled = False
        if failed is not None:
            raise failed
        self.session.say(f"ran {self.steps.value} steps: step time error "
                         f"{report.step_error:+.1%}")

    def _calibrate(self, *_) -> None:
        pred = self.session.calibrate()
        self.session.say(f"calibrated: the plan now predicts {format_seconds(pred.step_s)} "
                         "per step")
