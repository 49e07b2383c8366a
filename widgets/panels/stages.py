"""Settings per stage: ZeRO sharding, activation recomputation, precision, tensor parallelism
and sequence parallelism with it.

Each change is an edit of the plan under edit (undoable, estimated at once by the engine like
every other edit); the table under the controls shows every stage's settings.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Iterator

import ipywidgets as W

from explorer.core.plan import PRECISIONS, RECOMPUTE, ZERO_STAGES
from explorer.core.plan_layout import unsplit_notes
from widgets.panels.base import Panel, html_table, wrapping
from widgets.session import Session
from widgets.splits import degrees_text


def tensor_degrees(n_devices: int) -> list[int]:
    """The tensor-parallel degrees offered for a cluster of ``n_devices``: 1, 2, 4 ... and
    ``n_devices`` itself (a degree that does not divide a stage's devices is refused)."""
    out, d = [], 1
    while d <= n_devices:
        out.append(d)
        d *= 2
    return sorted({*out, max(n_devices, 1)})

#: the stage choice that applies to every stage
ALL_STAGES = -1
ZERO_TEXT = {0: "0: none", 1: "1: optimizer state", 2: "2: + gradients", 3: "3: + weights"}


class StageSettingsPanel(Panel):
    """``widget``: the ``stage`` to set (or all of them), ``zero``, ``recompute``,
    ``precision``, the ``tensor`` degree and ``sequence`` parallelism with it, applied as soon
    as one changes (what the plan
    cannot do is refused with a message next to the controls); ``table`` lists each stage's
    settings and ``note`` says where a setting has no effect."""

    topics = frozenset({"plan"})

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        style = {"description_width": "initial"}
        self.stage = W.Dropdown(description="memory settings of", style=style,
                                layout=W.Layout(width="auto"))
        self.stage.add_class("pe-stage")
        self.zero = W.Dropdown(options=[(ZERO_TEXT[z], z) for z in ZERO_STAGES],
                               description="ZeRO", style=style, layout=W.Layout(width="auto"))
        self.recompute = W.Dropdown(options=list(RECOMPUTE), description="recompute",
                                    style=style, layout=W.Layout(width="auto"))
        self.precision = W.Dropdown(options=list(PRECISIONS), description="precision",
                                    style=style, layout=W.Layout(width="auto"))
        self.tensor = W.Dropdown(options=tensor_degrees(len(session.cluster.ids)),
                                 description="tensor-parallel degree", style=style,
                                 layout=W.Layout(width="auto"))
        self.sequence = W.Checkbox(description="sequence-parallel", indent=False,
                                   layout=W.Layout(width="auto"))
        self.async_tensor = W.Checkbox(description="async (on GPUs)", indent=False,
                                       layout=W.Layout(width="auto"))
        self.context = W.Dropdown(options=tensor_degrees(len(session.cluster.ids)),
                                  description="context-parallel degree", style=style,
                                  layout=W.Layout(width="auto"))
        for w, css in ((self.zero, "pe-zero"), (self.recompute, "pe-recompute"),
                       (self.precision, "pe-precision"), (self.tensor, "pe-tensor"),
                       (self.sequence, "pe-sequence"), (self.async_tensor, "pe-async-tensor"),
                       (self.context, "pe-context")):
            w.add_class(css)
            w.observe(self._on_setting, "value")
        self.stage.observe(lambda _: self._show_stage(), "value")
        self.table = W.HTML("")
        self.table.add_class("pe-stage-settings")
        self.note = W.HTML("")
        self._syncing = False
        self._apply = session.guarded(self.apply, "settings")
        title = W.HTML("<b>per stage</b>: ZeRO shards the optimizer state (1), the "
                       "gradients (2) and the weights (3) over a stage's replicas; a "
                       "tensor-parallel degree splits its layers over that many of its "
                       "devices (replicas x tensor), and sequence parallelism also splits "
                       "the norms and residual adds between its blocks along the sequence "
                       "(async: on GPUs, its collectives pipelined with the matrix products); "
                       "a context-parallel degree splits each sample's sequence over that "
                       "many replicas (ring attention; predicted only); "
                       "each change is estimated at once, and undo takes it back")
        self.widget = W.VBox([title, wrapping([self.stage, self.zero, self.recompute,
                                               self.precision, self.tensor, self.sequence,
                                               self.async_tensor, self.context]),
                              self.note, self.table])

    def apply(self) -> None:
        """Set the chosen stage(s) to the values the controls show (as changing one does)."""
        k = self.stage.value
        sequence = self.sequence.value and self.tensor.value > 1
        try:
            self.session.set_memory(self.zero.value, self.recompute.value,
                                    self.precision.value, None if k == ALL_STAGES else [k],
                                    tensor=self.tensor.value, sequence=sequence,
                                    async_tensor=self.async_tensor.value and sequence,
                                    context=self.context.value)
        finally:  # a refused change: the controls show the plan's settings again
            self._show_stage()

    def update(self, what: str) -> None:
        plan = self.session.plan
        options = [("all stages", ALL_STAGES)] + [
            (f"stage {k}: {'+'.join(devs)}", k) for k, devs in enumerate(plan.stages)]
        with self._sync():
            if list(self.stage.options) != options:
                keep = self.stage.value
                self.stage.options = options
                self.stage.value = keep if keep in dict(options).values() else ALL_STAGES
        self._show_stage()
        rows = []
        for k, devs in enumerate(plan.stages):
            st = plan.settings_of(k)
            rows.append((str(k), html.escape("+".join(devs)), ZERO_TEXT[st.zero],
                         st.recompute, st.precision,
                         f"{plan.data_replicas_of(k)} x "
                         + (f"{st.context} x " if st.context > 1 else "") + f"{st.tensor}"
                         + (" (sequence, async)" if st.async_tensor
                            else " (sequence)" if st.sequence else "")))
        self.table.value = html_table(
            ("stage", "devices", "ZeRO", "recompute", "precision",
             "replicas x [context x] tensor"), rows,
            f"plan: {degrees_text(plan)}")
        single = [k for k, devs in enumerate(plan.stages)
                  if len(devs) == 1 and plan.settings_of(k).zero]
        notes = [html.escape(line) for line in unsplit_notes(self.session.graph, plan)]
        if single:
            notes.append(f"ZeRO shards over a stage's replicas: stage(s) "
                         f"{', '.join(map(str, single))} run on one device, so it saves "
                         "nothing there")
        self.note.value = "<br>".join(f"<i>{line}</i>" for line in notes)

    def _show_stage(self) -> None:
        """The controls show the chosen stage's settings (the first stage's for all)."""
        k = self.stage.value
        st = self.session.plan.settings_of(0 if k in (None, ALL_STAGES) else k)
        with self._sync():
            self.zero.value, self.recompute.value, self.precision.value = (
                st.zero, st.recompute, st.precision)
            if st.tensor not in self.tensor.options:
                self.tensor.options = sorted({*self.tensor.options, st.tensor})
            self.tensor.value = st.tensor
            self.sequence.value = st.sequence
            self.sequence.disabled = st.tensor == 1
            self.async_tensor.value = st.async_tensor
            self.async_tensor.disabled = not st.sequence
            if st.context not in self.context.options:
                self.context.options = sorted({*self.context.options, st.context})
            self.context.value = st.context

    def _on_setting(self, _change) -> None:
        if not self._syncing:
            self._apply()

    @contextlib.contextmanager
    def _sync(self) -> Iterator[None]:
        """While the controls are set from the plan, their changes are not edits."""
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False
