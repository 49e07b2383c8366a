"""The notebook explorer: one widget with the graph colored by device, editing and estimates.

Built on ipywidgets for the controls and bokeh (through jupyter_bokeh's ``BokehModel``) for the
graph, the memory bars and the timeline. All state is in one :class:`widgets.session.Session`;
the panels in :mod:`widgets.panels` call it and redraw from it. :class:`Explorer` builds the
session and the panels, lays them out and routes every change of the session to
:meth:`Explorer.update`.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import publish_display_data

import explorer as ex
from explorer.costs.kernels import Kernels
from explorer.devices.cluster import parse_devices
from explorer.models.builtin import DEFAULT_SIZE
from widgets.panels.base import Panel, bokehjs_for_this_page, renew_bokeh_views
from widgets.panels.editing import EditingPanel
from widgets.panels.estimate import EstimatePanel
from widgets.panels.graph import GraphPanel
from widgets.panels.memory import MemoryPanel
from widgets.panels.plans import PlansPanel
from widgets.panels.run import RunPanel
from widgets.panels.stages import StageSettingsPanel
from widgets.panels.status import StatusPanel
from widgets.panels.timeline import TimelinePanel
from widgets.session import Session

TABS = ("timeline", "partitioners", "plan settings", "run for real", "export")


class Explorer(W.VBox):
    """The explorer widget.

    ``Explorer(model, example_inputs, cluster=..., loss_fn=..., targets=...)`` captures and
    profiles the model: with ``measure="background"`` (the default) it opens at once on a
    capture that runs nothing and roofline estimates, and swaps the measured numbers in: the
    profile's preliminary ones after its first run, the final ones when the capture with real
    weights and the profile, run in a thread, are done (the header says how far it is;
    ``session.wait_measured()`` waits for the final ones); ``measure="now"`` measures first,
    ``"never"`` not at all (see :meth:`Session.open`). ``Explorer(graph, costs, plan)`` (the
    plan optional) opens an already captured graph;
    ``Explorer.builtin("gpt", size="small", devices="cpu:2")`` opens a built-in model.
    ``kernels="compiled"`` prices GPU presets as ``torch.compile`` runs the ops (fused
    kernels: ``ex.profile``'s ``kernels``).
    Without a plan it opens with the fastest quick baseline that fits.

    The state is ``session`` (a :class:`Session`: drive it from code and the widget follows);
    the panels are ``status``, ``graph``, ``estimate``, ``memory``, ``editing``, ``timeline``,
    ``plans``, ``runs`` and ``stages`` (memory settings per stage), each documenting the
    controls it shows.
    """

    def __init__(self, model: Any, example_inputs: Any = None, cluster: Any = None,
                 loss_fn: Any = None, targets: Any = None, costs: ex.CostModel | None = None,
                 plan: ex.Plan | None = None, backend: str = "canvas", height: int = 560,
                 progress: bool = True, measure: str = "background",
                 kernels: Kernels = "eager") -> None:
        # the background measuring starts once the first picture is drawn (below): it would
        # take the processor from it, all the more on a busy machine
        self.session = s = Session.open(model, example_inputs, cluster, loss_fn, targets, costs,
                                        plan, progress, measure, start=False, kernels=kernels)
        self.status = StatusPanel(s)
        self.graph = GraphPanel(s, backend, height)
        self.estimate = EstimatePanel(s)
        self.memory = MemoryPanel(s, backend)
        self.editing = EditingPanel(s)
        self.timeline = TimelinePanel(s, backend)
        self.plans = PlansPanel(s)
        self.runs = RunPanel(s)
        self.stages = StageSettingsPanel(s)
        self.panels: tuple[Panel, ...] = (self.status, self.graph, self.estimate, self.memory,
                                          self.editing, self.timeline, self.plans, self.runs,
                                          self.stages)
        line = self.status.line
        # the graph and the side column share a row while both fit, else the side wraps under;
        # the editing controls come first, beside the top of the graph however many devices
        # the numbers and bars below them list; the view's controls under the graph
        graph = W.VBox([self.graph.widget, self.graph.controls],
                       layout=W.Layout(flex="3 1 320px", min_width="0"))
        side = W.VBox([self.editing.widget, line("side"), self.estimate.table,
                       self.memory.widget],
                      layout=W.Layout(flex="2 1 300px", min_width="0", max_width="100%"))
        self.tabs = W.Tab([self.timeline.widget,
                           W.VBox([self.plans.solvers, line("partitioners")]),
                           W.VBox([self.editing.settings, self.stages.widget, line("settings")]),
                           W.VBox([self.runs.widget, line("run")]),
                           W.VBox([self.plans.files, line("export")])])
        for k, title in enumerate(TABS):
            self.tabs.set_title(k, title)
        super().__init__([self.status.header, self.status.message,
                          W.HBox([graph, side],
                                 layout=W.Layout(flex_flow="row wrap", width="100%")),
                          self.tabs],
                         layout=W.Layout(width="100%", overflow="hidden"))
        self.add_class("pe-explorer")
        s.observe(lambda _session, what: self.update(what))
        self.update()
        s.start_measuring()

    def _ipython_display_(self) -> None:
        # a view drawn now shows the plots as they are now, not as they were first shown
        renew_bokeh_views(self)
        # BokehJS with the first display from each page (a reloaded page has lost the copy
        # loaded before), not with every one
        bundle = bokehjs_for_this_page()
        if bundle:
            publish_display_data(bundle)
        publish_display_data(self._repr_mimebundle_())

    @classmethod
    def builtin(cls, name: str = "gpt", size: str = DEFAULT_SIZE, devices: str = "cpu:2",
                **kw: Any) -> Explorer:
        """An explorer on a built-in model (see ``explorer models``) at ``size`` (the command
        line's default unless given; a published shape such as ``"llama-70b"`` has that one
        size only) and devices ("cpu:2", "gpu", "4xH100", ...). CPU ranks of a host not
        measured yet open on nominal figures: the background measuring measures the host
        (``Cluster.cpu(n, measure="later")``)."""
        return cls(ex.builtin_model(name, size), cluster=parse_devices(devices, measure="later"),
                   **kw)

    def update(self, what: str = "all") -> None:
        """Redraw the panels that show ``what`` changed in the session ("all": every panel)."""
        for p in self.panels:
            if what == "all" or what in p.topics:
                p.update(what)

    @property
    def message(self) -> str:
        """The message line's text (errors and notices), without markup."""
        return self.session.message

    # -- actions (also callable from code) -----------------------------------------------
    def select(self, names_or_keys: list[str]) -> None:
        """Select items by node name, module path or item key (as clicking does); a node or
        module inside a folded module is shown by expanding what it is in."""
        self.session.select(names_or_keys)

    def assign(self, target: str) -> None:
        """Move the selection to ``target`` (a device, or ``"dev+dev"`` for a replicated
        stage), as the assign button does; the session says what is wrong with a target."""
        self.editing.assign(target)

    def split(self, devices: str) -> None:
        """Split the selection over ``devices`` (``"dev+dev"``) by tensor parallelism, as the
        split button does (see :meth:`Session.split`)."""
        self.editing.split(devices)
