"""What every panel shares: the panel base class, guarded buttons, bokeh in ipywidgets, tables."""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ipywidgets as W
from bokeh.io import output_notebook
from bokeh.io.state import curstate
from bokeh.resources import INLINE
from jupyter_bokeh.widgets import BokehModel

from widgets.session import Session


class Panel:
    """One part of the explorer, drawn from ``session``.

    ``topics`` are the session's changes (see :meth:`Session.observe`) after which
    :meth:`update` redraws the panel.
    """

    topics: frozenset[str] = frozenset()

    def __init__(self, session: Session) -> None:
        self.session = session

    def update(self, what: str) -> None:
        """Redraw from the session after a change ``what`` (one of ``topics``, or "all")."""


def button(session: Session, text: str, tip: str, fn: Callable[..., Any], css: str,
           style: str = "") -> W.Button:
    """A button that calls ``fn`` guarded by the session (errors become its message)."""
    b = W.Button(description=text, tooltip=tip, button_style=style,
                 layout=W.Layout(width="auto"))
    b.add_class(css)
    b.on_click(session.guarded(fn))
    return b


def bokeh_widget(model: Any, css: str = "") -> W.Widget:
    """A bokeh model as an ipywidget (jupyter_bokeh), with a CSS class to find it by."""
    w = BokehModel(model)
    if css:
        w.add_class(css)
    return w


def load_bokehjs() -> None:
    """BokehJS must be in the page before the first bokeh widget: load it offline, once per
    kernel (bokeh remembers that it did)."""
    if not curstate().notebook:
        output_notebook(resources=INLINE, hide_banner=True)


def html_table(headers: Sequence[str], rows: Iterable[Sequence[str]], note: str = "") -> str:
    """An HTML table of already escaped cells, with an italic note under it."""
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in headers) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return (f"<table style='font-size:12px' border=1 cellpadding=3>{head}{body}</table>"
            + (f"<i>{note}</i>" if note else ""))


def swatch(text: str, color: str, fg: str = "white") -> str:
    """A colored label, as in the legends."""
    return (f"<span style='background:{color};color:{fg};padding:1px 6px;border-radius:3px'>"
            f"{html.escape(text)}</span>")
