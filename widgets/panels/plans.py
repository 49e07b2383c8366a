"""Plans side by side: run partitioners, keep the plan under edit, pick one to edit; plan files
and the exported training script."""

from __future__ import annotations

import html
import json
from pathlib import Path

import ipywidgets as W

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.factory import untrusted_factory
from explorer.core.units import format_bytes, format_seconds
from explorer.partition import algorithm as get_algorithm
from widgets.panels.base import Panel, button, checkbox, html_table, wrapping
from widgets.session import Session

NO_PLANS = "<i>no plans yet: solve, or keep the current plan</i>"
OPTIONS_EXAMPLE = "e.g. {\"micro_batches\": 4}"


class PlansPanel(Panel):
    """``solvers``: the ``algorithm`` with its ``options`` (JSON), ``around_pins``,
    ``solve_button``, ``keep_button``, the plans ``table``, and ``pick`` with
    ``load_button``. ``files``: ``path`` with ``save_button`` and ``load_file_button``,
    ``script_path`` with ``export_button`` (``overwrite`` replaces an existing script;
    ``factory``: the user's model factory, the only way one is imported; ``native``: a plain
    PyTorch script instead)."""

    topics = frozenset({"plans", "costs"})

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        s = session
        names = ex.algorithms()
        self.algorithm = W.Dropdown(options=names,
                                    value="pardnn" if "pardnn" in names else names[0],
                                    description="algorithm")
        self.algorithm.add_class("pe-algorithm")
        self.help = W.HTML("")
        self.options = W.Textarea(layout=W.Layout(width="100%", height="60px"))
        self.algorithm.observe(lambda _: self._show_algorithm(), "value")
        self.around_pins = checkbox("re-solve around my pins", True)
        self.solve_button = button(s, "solve", "run the partitioner", self._solve, "pe-solve",
                                   "primary",
                                   where="partitioners")
        self.keep_button = button(s, "keep current", "add the plan under edit to the table",
                                  self._keep, "pe-keep", where="partitioners")
        self.table = W.HTML(NO_PLANS)
        self.table.add_class("pe-plans")
        self.pick = W.Dropdown(options=[], description="plan")
        self.load_button = button(s, "load into editor", "edit this plan", self._load_entry,
                                  "pe-load-entry", where="partitioners")
        self._show_algorithm()
        self.solvers = W.VBox([
            wrapping([self.algorithm, self.around_pins, self.solve_button, self.keep_button]),
            self.help, self.options, self.table, wrapping([self.pick, self.load_button])])

        stem = s.graph.name or "model"
        self.path = W.Text(value=f"{stem}_plan.json", description="plan file")
        self.script_path = W.Text(value=f"train_{stem}.py", description="script")
        self.overwrite = checkbox("overwrite")
        # a plain PyTorch script to read and keep, rather than the launcher and job folder
        self.native = checkbox("plain PyTorch")
        self.save_button = button(s, "save plan", "write the plan JSON", self._save, "pe-save",
                                  where="export")
        self.load_file_button = button(s, "load plan", "read a plan JSON", self._load_file,
                                       "pe-load", where="export")
        self.export_button = button(s, "export script", "write a torchrun training script",
                                    self._export, "pe-export", where="export")
        # empty unless the user types a factory: one a loaded plan names is never imported
        self.factory = W.Text(value="", placeholder="module:function (optional)",
                              description="factory")
        self.factory.add_class("pe-factory")
        self.files = W.VBox([wrapping([self.path, self.save_button, self.load_file_button]),
                             wrapping([self.script_path, self.factory, self.overwrite,
                                       self.native, self.export_button])])

    def update(self, what: str) -> None:
        entries = self.session.plans
        if not entries:
            return
        fitting = [e.prediction.step_s for e in entries if e.prediction.fits]
        best = min(fitting) if fitting else None
        rows = []
        for e in entries:
            r, p = e.row(), e.prediction
            mark = " *" if best is not None and p.step_s == best else ""
            # the units the estimate panel picks (s or ms, GiB or MiB), not fixed ones
            rows.append((html.escape(e.name) + mark, r["degrees"], format_seconds(p.step_s),
                         format_bytes(max(p.peak_bytes.values(), default=0)),
                         "yes" if p.fits else "NO", format_bytes(p.cross_device_bytes),
                         f"{r['gap_pct']:+.0f} %", format_seconds(e.solve_s)))
        self.table.value = html_table(
            ("plan", "dp x tp x pp", "step", "max memory", "fits", "across devices", "gap to bound",
             "solved in"), rows, "* fastest that fits")
        self.pick.options = [e.name for e in entries]
        self.pick.value = entries[-1].name

    def _show_algorithm(self) -> None:
        alg = get_algorithm(self.algorithm.value)
        self.help.value = f"<i>{html.escape(alg.summary)}</i>"
        self.options.value = json.dumps(dict(alg.options), default=str)

    def _solve(self, *_) -> None:
        s = self.session
        try:
            opts = json.loads(self.options.value or "{}")
        except json.JSONDecodeError as e:
            raise ExplorerError(f"the options must be JSON, {OPTIONS_EXAMPLE}: {e}") from None
        if not isinstance(opts, dict):
            raise ExplorerError(f"the options must be a JSON object, {OPTIONS_EXAMPLE}")
        s.say(f"solving with {self.algorithm.value} ...")
        self.solve_button.disabled = True
        try:
            e = s.solve(self.algorithm.value, around_pins=self.around_pins.value, **opts)
        finally:
            self.solve_button.disabled = False
        s.say(f"{e.name}: {format_seconds(e.prediction.step_s)} per step, solved in "
              f"{e.solve_s:.2f} s; loaded into the editor")

    def _keep(self, *_) -> None:
        e = self.session.keep()
        self.session.say(f"kept the current plan as {e.name!r}")

    def _load_entry(self, *_) -> None:
        if not self.pick.value:
            raise ExplorerError("no plan to load yet: solve or keep one first")
        e = self.session.entry(self.pick.value)
        self.session.load(e.plan, e.name)

    def _save(self, *_) -> None:
        p = self.session.save(self.path.value)
        self.session.say(f"saved {p}")

    def _load_file(self, *_) -> None:
        path = Path(self.path.value)
        self.session.load(path, path.name)
        asked = (self.session.plan.model or {}).get("factory")
        self.session.say(f"loaded {path}" + (
            f"; it asks for model factory {asked!r}, which exporting would import and call "
            "on every rank: type it in the factory box only if you trust that code"
            if asked else ""))

    def _export(self, *_) -> None:
        factory = self.factory.value.strip() or None
        asked = (self.session.plan.model or {}).get("factory")
        if asked and factory is None:
            raise untrusted_factory(asked, f"type {asked} in the factory box beside the "
                                    "export button")
        p = self.session.export(self.script_path.value, overwrite=self.overwrite.value,
                                factory=factory, native=self.native.value)
        what = "a plain PyTorch script" if self.native.value else "the launcher and its job"
        self.session.say(f"wrote {p} ({what}): run it with torchrun --nproc_per_node "
                         f"{len(self.session.plan.devices)} {p.name}")
