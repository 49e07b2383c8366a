"""The explorer's first line (what graph on what cluster) and its message lines: one at the top
for what code does, and one under each group of controls for what those controls say."""

from __future__ import annotations

import html

import ipywidgets as W

from explorer.capture.fake import FAKE_NOTE
from explorer.core.units import format_bytes
from widgets.device_groups import device_span, grouped
from widgets.panels.base import Panel
from widgets.session import Session


def devices_text(ids: tuple[str, ...]) -> str:
    """A cluster's devices in the header: each one, or above ``GROUPED_ABOVE`` their count
    and ranges ("64 devices: H100:0-63")."""
    if grouped(len(ids)):
        return f"{len(ids)} devices: {device_span(ids)}"
    return ", ".join(ids)


class StatusPanel(Panel):
    """``header`` names the graph and the cluster; ``message`` (the top line) and the lines
    made by :meth:`line` show the session's message (notices in green, errors in red, an
    unexpected error's trace folded under "details"): the message appears on the line of the
    area whose control caused it (:attr:`Session.message_where`), or on the top line."""

    topics = frozenset({"message", "measure"})

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.header = W.HTML(self.render_header())
        self.lines: dict[str, W.HTML] = {}
        self.message = self.line("")

    def render_header(self) -> str:
        """The first line: the graph, the cluster and where the numbers come from (with the
        background measurement's progress, :attr:`Session.measure_status`)."""
        g, cl = self.session.graph, self.session.cluster
        # while the capture with real weights runs, the status line says what the note would
        notes = [n for n in g.notes if n != FAKE_NOTE or not self.session.measure_running]
        status = self.session.measure_status
        # compact lines (a widget's text has a line as tall as a button otherwise)
        return (f"<div style='line-height:1.4'><b>{html.escape(g.name)}</b>: {len(g.ops):,} ops, "
                f"{format_bytes(g.param_bytes)} of parameters, batch {g.batch_size}, on "
                f"{html.escape(cl.name)} ({html.escape(devices_text(cl.ids))})"
                + (", ops priced as compiled (fused) kernels"
                   if self.session.costs.kernels == "compiled" else "")
                + (f" <i>({html.escape('; '.join(notes))})</i>" if notes else "")
                + (f"<br><span class='pe-measure'>{html.escape(status)}</span>"
                   if status else "") + "</div>")

    def line(self, where: str) -> W.HTML:
        """The message line of area ``where`` (made once; put it under that area's controls).
        """
        if where not in self.lines:
            # as wide as its column less the widget's margins (not width 100%, which the
            # margins push past the column's right edge), never wider
            w = self.lines[where] = W.HTML("", layout=W.Layout(width="auto", min_width="0",
                                                               max_width="100%"))
            w.add_class("pe-message")
            w.add_class(f"pe-message-{where or 'top'}")
        return self.lines[where]

    def update(self, what: str) -> None:
        s = self.session
        if what in ("measure", "all"):
            self.header.value = self.render_header()
            if what == "measure":
                return
        here = s.message_where if s.message_where in self.lines else ""
        for where, w in self.lines.items():
            w.value = self.render() if where == here and s.message else ""

    def render(self) -> str:
        """The session's message as HTML."""
        s = self.session
        color = "#b00020" if s.message_is_error else "#1a5e20"
        # long paths and trace lines wrap inside the box instead of running out of it
        extra = ("<details><summary>details</summary><pre style='white-space:pre-wrap;"
                 f"overflow-wrap:anywhere;margin:4px 0 0'>{html.escape(s.message_detail)}"
                 "</pre></details>" if s.message_detail else "")
        return (f"<div style='color:{color};padding:4px;border:1px solid {color};"
                "border-radius:4px;box-sizing:border-box;max-width:100%;line-height:1.4;"
                "white-space:normal;overflow-wrap:anywhere'>"
                f"{html.escape(s.message)}{extra}</div>")
