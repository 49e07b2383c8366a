"""What every panel shares: the panel base class, guarded buttons, bokeh in ipywidgets, tables."""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import bokeh
import ipywidgets as W
from bokeh.resources import INLINE
from IPython import get_ipython
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
           style: str = "", where: str = "") -> W.Button:
    """A button that calls ``fn`` guarded by the session: errors become its message, shown
    in area ``where`` (next to the button; see :meth:`Session.guarded`)."""
    b = W.Button(description=text, tooltip=tip, button_style=style,
                 layout=W.Layout(width="auto", min_width="fit-content"))
    b.add_class(css)
    b.on_click(session.guarded(fn, where))
    return b


def checkbox(description: str, value: bool = False) -> W.Checkbox:
    """A checkbox whose label is shown whole (not cut to the description width)."""
    return W.Checkbox(value=value, description=description, indent=False,
                      layout=W.Layout(width="auto"))


def wrapping(children: list[W.Widget]) -> W.HBox:
    """A row of controls that wraps onto more lines when the notebook is narrow."""
    return W.HBox(children, layout=W.Layout(flex_flow="row wrap", align_items="center"))


class CurrentBokehModel(BokehModel):
    """jupyter_bokeh's ``BokehModel`` whose every view, however late it is drawn, shows the
    document as it is now.

    ``BokehModel`` puts its document in ``render_bundle`` once, when it is made; later changes
    reach the views already drawn as patches only. A view drawn later (the widget displayed
    again, or the page reloaded, which asks the kernel for every widget's state) would draw the
    document as it was made, and get patches meant for the current one. This model notes every
    change of its document and puts the current document in the bundle before a view can be
    drawn from it: when its state is asked for (:meth:`get_state`) and when it, or a widget
    holding it, is displayed (:meth:`renew`, :func:`renew_bokeh_views`). Renewing re-draws the
    views already shown, from the same (current) document."""

    def __init__(self, model: Any, **kwargs: Any) -> None:
        #: whether the document changed since ``render_bundle`` was made
        self.changed_since_bundle = False
        super().__init__(model, **kwargs)

    def _document_patched(self, event: Any) -> None:
        self.changed_since_bundle = True
        super()._document_patched(event)

    def renew(self) -> bool:
        """Put the current document in ``render_bundle`` if it changed since the bundle was
        made (the front ends then draw their views of it again); whether it did."""
        if not self.changed_since_bundle:
            return False
        self.changed_since_bundle = False
        self.render_bundle = self._model_to_traits(self._model)
        return True

    def get_state(self, key: Any = None, drop_defaults: bool = False) -> dict[str, Any]:
        """The widget's state (see ``ipywidgets.Widget.get_state``), with the document as it
        is now in ``render_bundle``."""
        if key is None or key == "render_bundle" or (
                not isinstance(key, str) and "render_bundle" in key):
            try:
                self.renew()
            except Exception:  # a page asking for every widget's state restores none if one
                self.changed_since_bundle = True  # fails: it gets this one's last bundle
        return super().get_state(key, drop_defaults)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        self.renew()
        return super()._repr_mimebundle_(**kwargs)


def renew_bokeh_views(widget: W.Widget) -> int:
    """Renew (:meth:`CurrentBokehModel.renew`) the bokeh models in ``widget`` and the widgets
    it holds, before it is displayed (again); how many had changed."""
    if isinstance(widget, CurrentBokehModel):
        return int(widget.renew())
    return sum(renew_bokeh_views(child) for child in getattr(widget, "children", ()))


class PlotBox(W.VBox):
    """A column of widgets holding bokeh plots: displayed on its own (a panel's ``widget``),
    its plots' views show their current document too (:func:`renew_bokeh_views`)."""

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        renew_bokeh_views(self)
        return super()._repr_mimebundle_(**kwargs)


def bokeh_widget(model: Any, css: str = "") -> W.Widget:
    """A bokeh model as an ipywidget (jupyter_bokeh's, whose views all show the current
    document: :class:`CurrentBokehModel`), with a CSS class to find it by."""
    w = CurrentBokehModel(model)
    if css:
        w.add_class(css)
    return w


#: the page connections (see :func:`page_connection`) BokehJS was sent to
PAGES_WITH_BOKEHJS: set[str] = set()


def page_connection() -> str:
    """Which page the running cell was sent from: the session of the kernel request.

    A JupyterLab page connects to the kernel with a session of its own, a new one after a
    reload (as does each headless run, nbclient's for one); "" outside a kernel."""
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return ""
    return str(kernel.get_parent().get("header", {}).get("session", ""))


def bokehjs_bundle() -> dict[str, str]:
    """The display data that loads BokehJS (offline, inline) into a page that lacks it.

    A page loads BokehJS once, but a kernel outlives its pages: after a browser reload the
    kernel's widgets are drawn in a page without it. So the first explorer shown from each page
    (see :func:`bokehjs_for_this_page`) carries this bundle; the check makes it a no-op in a
    page that has BokehJS already (loading it twice would break the plots drawn with the first
    copy). It is inline (megabytes in a saved notebook, once) because nothing offline serves it
    by URL: jupyter_bokeh's JupyterLab extension expects ``window.Bokeh`` and does not bundle
    it, bokeh has no Jupyter server extension for its static files and a CDN needs the
    internet. One MIME type only (JupyterLab runs ``application/javascript`` in a trusted
    notebook): bokeh's own loader adds a copy as ``application/vnd.bokehjs_load.v0+json``,
    which would double what is saved."""
    code = "\n".join(f"(function() {{\n{js}\n}}).call(window);" for js in INLINE.js_raw)
    guarded = ("if (typeof window.Bokeh === 'undefined' || "
               f"window.Bokeh.version !== {bokeh.__version__!r}) {{\n{code}\n}}")
    return {"application/javascript": guarded}


def bokehjs_for_this_page() -> dict[str, str] | None:
    """The BokehJS bundle if the page the running cell came from was not sent it yet, else
    None: shown with the first explorer of each page, not with every one (five explorers made a
    40 MB notebook). Outside a kernel (no page to tell apart) always the bundle."""
    page = page_connection()
    if page and page in PAGES_WITH_BOKEHJS:
        return None
    if page:
        PAGES_WITH_BOKEHJS.add(page)
    return bokehjs_bundle()


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
