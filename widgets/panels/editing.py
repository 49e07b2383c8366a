"""Hand edits of the plan under edit: the selection, assign to a device, pins, undo/redo and the
plan's settings (micro-batches, schedule, optimizer)."""

from __future__ import annotations

import html

import ipywidgets as W

from explorer.core.errors import ExplorerError
from explorer.core.plan import OPTIMIZER_STATE, SCHEDULES
from widgets.edits import run_problem
from widgets.panels.base import Panel, button, wrapping
from widgets.session import Session

NOTHING_SELECTED = "<i>click, box- or lasso-select nodes in the graph</i>"


def renew(menu: W.Dropdown, options: list[str]) -> None:
    """Give ``menu`` new options, keeping its choice where it is still one of them."""
    if list(menu.options) != options:
        keep = menu.value
        menu.options = options
        if keep in options:
            menu.value = keep


class EditingPanel(Panel):
    """``widget``: what is selected (``selection``), the ``target`` device with
    ``assign_button``, the devices to ``split_over`` with ``split_button`` (tensor
    parallelism over all of them), and ``pin_button``, ``unpin_button``, ``undo_button``,
    ``redo_button``.
    ``settings``: ``micro_batches``, ``schedule``, ``optimizer`` and ``apply_button``."""

    topics = frozenset({"plan", "costs", "view", "selection"})

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        s = session
        self.selection = W.HTML(NOTHING_SELECTED)
        self.selection.add_class("pe-selection")
        self.target = W.Dropdown(options=s.targets(), description="device",
                                 layout=W.Layout(width="220px"))
        self.target.add_class("pe-target")
        self.assign_button = button(s, "assign", "move the selection to this device",
                                    lambda *_: self.assign(self.target.value), "pe-assign",
                                    "primary", where="side")
        # (as wide as its longest choice otherwise: many devices push the button under it)
        self.split_over = W.Dropdown(options=s.split_targets(), description="split over",
                                     style={"description_width": "initial"},
                                     layout=W.Layout(width="auto", max_width="260px"))
        self.split_over.add_class("pe-split-over")
        self.split_button = button(s, "split", "split the selection's layers over these "
                                   "devices (tensor parallelism)",
                                   lambda *_: self.split(self.split_over.value), "pe-split",
                                   where="side")
        self.pin_button = button(s, "pin", "fix the selection to its device",
                                 lambda *_: s.pin(s.selected_names), "pe-pin", where="side")
        self.unpin_button = button(s, "unpin", "release the selection's pins",
                                   lambda *_: s.unpin(s.selected_names or None), "pe-unpin",
                                   where="side")
        self.undo_button = button(s, "undo", "take back the last edit", lambda *_: s.undo(),
                                  "pe-undo", where="side")
        self.redo_button = button(s, "redo", "redo the edit taken back", lambda *_: s.redo(),
                                  "pe-redo", where="side")
        self.widget = W.VBox([
            self.selection, wrapping([self.target, self.assign_button]),
            wrapping([self.split_over, self.split_button]),
            wrapping([self.pin_button, self.unpin_button, self.undo_button, self.redo_button])])

        self.micro_batches = W.BoundedIntText(value=s.plan.micro_batches, min=1, max=4096,
                                              description="micro-batches",
                                              style={"description_width": "initial"})
        self.schedule = W.Dropdown(options=list(SCHEDULES), value=s.plan.schedule,
                                   description="schedule")
        self.optimizer = W.Dropdown(options=sorted(OPTIMIZER_STATE), value=s.plan.optimizer,
                                    description="optimizer")
        self.apply_button = button(
            s, "apply", "change the plan's settings",
            lambda *_: s.set_schedule(self.micro_batches.value, self.schedule.value,
                                      self.optimizer.value), "pe-settings", where="settings")
        # says while editing when the plan could not run real steps (the batch must split)
        self.runnable = W.HTML("")
        self.runnable.add_class("pe-runnable")
        self.micro_batches.observe(lambda _: self._check_runnable(), "value")
        self.settings = W.VBox([wrapping([self.micro_batches, self.schedule, self.optimizer]),
                                self.runnable, self.apply_button])

    def assign(self, target: str) -> None:
        """Move the selection to ``target`` (a device, or ``"dev+dev"`` for a replicated
        stage), as the assign button does; the session says what is wrong with a target."""
        if target in self.target.options:
            self.target.value = target
        self.session.assign(self.session.selected_names, target)

    def split(self, devices: str) -> None:
        """Split the selection over ``devices`` ("dev+dev"), as the split button does."""
        if devices in self.split_over.options:
            self.split_over.value = devices
        if not devices:
            raise ExplorerError("this cluster has one device: there is nothing to split over")
        self.session.split(self.session.selected_names, devices)

    def update(self, what: str) -> None:
        s = self.session
        if what in ("view", "selection", "all"):
            self._show_selection()
        if what in ("plan", "costs", "all"):
            renew(self.target, s.targets())
            renew(self.split_over, s.split_targets())
            self.undo_button.disabled = not s.can_undo
            self.redo_button.disabled = not s.can_redo
            self.micro_batches.value, self.schedule.value, self.optimizer.value = (
                s.plan.micro_batches, s.plan.schedule, s.plan.optimizer)
            self._check_runnable()

    def _check_runnable(self) -> None:
        s = self.session
        plan = s.plan.with_settings(micro_batches=self.micro_batches.value)
        why = run_problem(s.graph, plan)
        self.runnable.value = (f"<span style='color:#b00020'>cannot run for real: "
                               f"{html.escape(why)}</span>" if why else "")

    def _show_selection(self) -> None:
        items = [self.session.view.items[k] for k in self.session.selected]
        if not items:
            self.selection.value = NOTHING_SELECTED
            return
        n_ops = sum(len(it.ops) for it in items)
        names = ", ".join(html.escape(it.label) for it in items[:4])
        more = f" and {len(items) - 4} more" if len(items) > 4 else ""
        self.selection.value = (f"selected <b>{len(items)}</b> item(s), {n_ops} ops: "
                                f"{names}{more}")
