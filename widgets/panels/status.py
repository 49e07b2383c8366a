"""The explorer's first lines: what graph on what cluster, and the message line."""

from __future__ import annotations

import html

import ipywidgets as W

from explorer.core.units import format_bytes
from widgets.panels.base import Panel
from widgets.session import Session


class StatusPanel(Panel):
    """``header`` names the graph and the cluster; ``message`` shows the session's message
    (notices in green, errors in red, an unexpected error's trace folded under "details")."""

    topics = frozenset({"message"})

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        g, cl = session.graph, session.cluster
        self.header = W.HTML(
            f"<b>{html.escape(g.name)}</b>: {len(g.ops):,} ops, "
            f"{format_bytes(g.param_bytes)} of parameters, batch {g.batch_size}, on "
            f"{html.escape(cl.name)} ({', '.join(cl.ids)})"
            + (f" <i>({html.escape('; '.join(g.notes))})</i>" if g.notes else ""))
        self.message = W.HTML("")
        self.message.add_class("pe-message")

    def update(self, what: str) -> None:
        s = self.session
        if not s.message:
            self.message.value = ""
            return
        color = "#b00020" if s.message_is_error else "#1a5e20"
        extra = (f"<details><summary>details</summary><pre>{html.escape(s.message_detail)}"
                 "</pre></details>" if s.message_detail else "")
        self.message.value = (f"<div style='color:{color};padding:4px;border:1px solid {color};"
                              f"border-radius:4px'>{html.escape(s.message)}{extra}</div>")
