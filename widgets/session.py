"""The explorer's state without any drawing: a plan being edited, its pins, history and estimate.

A :class:`Session` holds one graph, cluster and cost model, the plan the user is editing, the
graph items shown and selected, and the message line. Every edit makes a new
:class:`explorer.Plan` (plans are immutable), pushes the previous one on the undo stack
(:mod:`widgets.history`) and asks
:func:`explorer.simulate` for a fresh estimate. Nothing here computes a number of its own: step
times, memory and bytes all come from ``explorer``. The widget's panels call the session and
redraw from it when it says what changed (:meth:`Session.observe`). What it opens on comes
from :mod:`widgets.opening`; the background measurement from :mod:`widgets.measure`.

Edits that cannot be made (an unknown node or device, a plan for another graph) raise
:class:`explorer.ExplorerError` and leave the state as it was.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.units import MiB
from explorer.costs.kernels import Kernels
from explorer.partition import algorithm as get_algorithm
from widgets.edits import (
    count_label,
    first_device,
    leaving_replicas,
    memory_label,
    placed_on,
    run_problem,
    split_over,
    split_targets,
    targets,
    with_owned,
)
from widgets.graphview import GraphView
from widgets.history import History, Snapshot
from widgets.measure import (
    BackgroundJob,
    precision_work,
    untimed_precision,
)
from widgets.opening import opening
from widgets.session_measuring import BackgroundMeasuring
from widgets.splits import degrees_text

#: most ops "expand all" draws one by one
EXPAND_ALL_OPS = 3000


@dataclass
class PlanEntry:
    """A plan in the side-by-side table, with its prediction."""

    name: str
    plan: ex.Plan
    prediction: ex.Prediction
    solve_s: float = 0.0

    def row(self) -> dict[str, Any]:
        p = self.prediction
        return {"plan": self.name, "degrees": degrees_text(self.plan),
                "step_ms": p.step_s * 1e3,
                "max_memory_mib": max(p.peak_bytes.values(), default=0) / MiB,
                "fits": p.fits, "cross_mib": p.cross_device_bytes / MiB,
                "gap_pct": p.gap * 100, "lower_bound_ms": p.lower_bound_s * 1e3,
                "solve_s": self.solve_s}


@dataclass
class Session(BackgroundMeasuring):
    """A plan under edit for one graph on one cluster, with undo/redo, pins and estimates.

    >>> import explorer as ex
    >>> from explorer.models.synthetic import layered_dag, roofline_costs
    >>> g = layered_dag(40, seed=0)
    >>> cl = ex.Cluster.preset("2xH100")
    >>> s = Session(g, cl, roofline_costs(g, cl))
    >>> op = g.ops[0].name
    >>> s.assign([op], cl.ids[1]); s.plan.devices_of(op) == (cl.ids[1],)
    True
    >>> s.undo(); s.plan.devices_of(op) == (cl.ids[0],)
    True
    """

    graph: ex.OpGraph
    cluster: ex.Cluster
    costs: ex.CostModel
    plan: ex.Plan | None = None
    pins: dict[str, str] = field(default_factory=dict)
    plans: list[PlanEntry] = field(default_factory=list)
    measurement: ex.Measurement | None = None
    report: ex.Report | None = None
    _history: History = field(default_factory=History, repr=False)
    _listeners: list[Callable[[Session, str], None]] = field(default_factory=list, repr=False)
    prediction: ex.Prediction | None = field(default=None, repr=False)
    estimate_s: float = 0.0  # how long the last estimate took (simulation), seconds
    #: the graph items shown (modules folded or expanded); built from ``graph``
    view: GraphView = field(init=False, repr=False)
    #: positions in ``view.items`` of the selected items
    selected: list[int] = field(default_factory=list, init=False)
    #: the message line: the last notice or error, as text
    message: str = field(default="", init=False)
    message_is_error: bool = field(default=False, init=False)
    message_detail: str = field(default="", init=False, repr=False)  # an unexpected error's trace
    #: where the message belongs: the area of the control that caused it ("": the top line)
    message_where: str = field(default="", init=False)
    _where: str = field(default="", init=False, repr=False)
    #: the capture with real weights and profile running in the background (None: none)
    measuring: BackgroundJob | None = field(default=None, init=False, repr=False)
    #: how far it is ("" when there is none), for the status line
    measure_status: str = field(default="", init=False)
    #: whether background measuring is under way (or waits to start): its numbers not in yet
    measure_running: bool = field(default=False, init=False)
    #: while measuring goes on, what the preliminary numbers swapped in are ("preliminary: 1
    #: of 8 runs"; "" while the numbers are estimates or final)
    preliminary: str = field(default="", init=False)
    #: the plan the last real run (``report``) ran: the report is stale once the plan under
    #: edit is another
    report_plan: ex.Plan | None = field(default=None, init=False, repr=False)
    #: the plan picked to open with (a quick baseline, :func:`widgets.opening.auto_plan`)
    #: and the line saying so, checked again when measured numbers replace the estimates
    _opened: ex.Plan | None = field(default=None, init=False, repr=False)
    _opening_note: str = field(default="", init=False, repr=False)
    #: how the model is built again (a built-in model's ``record``), for a native script
    model_source: dict | None = field(default=None, init=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.costs.check(self.graph)
        if self.plan is None:
            self.plan = ex.Plan.single(self.graph, self.cluster.ids[0])
        else:
            self.plan.validate(self.graph, self.cluster)
        self.pins = {n: d for n, d in self.pins.items()}
        for n in self.plan.pinned:
            self.pins.setdefault(n, self.plan.devices_of(n)[0])
        self.view = GraphView(self.graph)
        self._estimate()

    @classmethod
    def open(cls, model: Any, example_inputs: Any = None, cluster: Any = None,
             loss_fn: Any = None, targets: Any = None, costs: ex.CostModel | None = None,
             plan: ex.Plan | None = None, progress: bool = True,
             measure: str = "background", start: bool = True,
             kernels: Kernels = "eager") -> Session:
        """A session on a module (captured with its example batch), a built-in model, or an
        already captured graph (``open(graph, costs, plan)``); profiled on ``cluster`` (this
        machine's devices by default) unless ``costs`` are given. Without a plan, the session
        opens with the fastest of the quick baselines that fits
        (:func:`widgets.opening.auto_plan`).

        ``measure`` says when measured numbers come (:mod:`widgets.measure`): "background"
        opens at once on a capture that runs nothing and roofline estimates, then captures
        with real weights and profiles the devices that are here in a thread, and swaps the
        measured numbers in: the profile's preliminary ones after its first run
        (:attr:`preliminary` says so), the final ones when it ends (:meth:`wait_measured`
        waits for them); "now"
        measures before opening; "never" keeps the roofline estimates and runs nothing.
        Without ``start`` the background work waits for :meth:`start_measuring` (the widget
        draws its first picture first: nothing measures before it). ``kernels="compiled"``
        prices devices that are not here (GPU presets) as ``torch.compile`` runs the ops
        (``ex.profile``'s ``kernels``)."""
        o = opening(model, example_inputs, cluster, loss_fn, targets, costs, plan, progress,
                    measure, kernels)
        session = cls(o.graph, o.costs.cluster, o.costs, o.plan)
        session.model_source = o.source
        if o.note:
            session._opened, session._opening_note = o.plan, o.note
            session.say(o.note)
        if o.work is not None:
            session.measure_in_background(o.work, start)
        return session

    # -- observers -----------------------------------------------------------------------
    def observe(self, fn: Callable[[Session, str], None]) -> None:
        """Call ``fn(session, what)`` after every change: "plan" (plan or pins), "plans" (the
        table), "run", "costs", "view" (items shown; clears the selection), "selection",
        "message"."""
        self._listeners.append(fn)

    def _changed(self, what: str) -> None:
        for fn in list(self._listeners):
            fn(self, what)

    # -- queries -------------------------------------------------------------------------
    @property
    def can_undo(self) -> bool:
        return bool(self._history.done)

    @property
    def can_redo(self) -> bool:
        return bool(self._history.undone)

    @property
    def history(self) -> list[str]:
        """Labels of the edits undo would take back, oldest first."""
        return self._history.labels

    def targets(self) -> list[str]:
        """Where nodes can be assigned: every device, and each replicated stage as a whole
        (named by its devices joined with "+")."""
        return targets(self.plan, self.cluster)

    @property
    def report_is_stale(self) -> bool:
        """Whether the last real run's ``report`` is for another plan than the one under
        edit (edited, loaded or solved since)."""
        return self.report is not None and self.report_plan != self.plan

    @property
    def run_problem(self) -> str:
        """Why the plan under edit cannot run real steps ("" when it can)."""
        return run_problem(self.graph, self.plan)

    def device_label(self, name: str) -> str:
        """The device (or "+"-joined replicated stage) a node is placed on."""
        return "+".join(self.plan.devices_of(name))

    # -- the items shown and selected ----------------------------------------------------
    @property
    def selected_names(self) -> list[str]:
        """Graph node names of the selected items (ops and what they own)."""
        return self.view.names(self.selected)

    def select(self, names_or_keys: Iterable[str]) -> list[int]:
        """Select items by node name, module path or item key (as clicking does); a node or
        module inside a folded module is shown by expanding what it is in. Returns the
        selected positions in ``view.items``."""
        before = [it.key for it in self.view.items]
        try:
            idx = self.view.find(list(names_or_keys))
        finally:
            if [it.key for it in self.view.items] != before:
                self.selected = []
                self._changed("view")
        return self.select_items(idx)

    def select_items(self, positions: Iterable[int]) -> list[int]:
        """Select shown items by position in ``view.items`` (what the graph reports)."""
        self.selected = sorted(int(k) for k in positions if 0 <= int(k) < len(self.view.items))
        self._changed("selection")
        return self.selected

    def expand(self, keys: Iterable[str] | None = None) -> None:
        """Show the parts of the given items (by key; the selected ones when None)."""
        keys = self._keys(keys)
        if not keys:
            raise ExplorerError("select a module to expand")
        self._set_view(self.view.expand, keys)

    def collapse(self, keys: Iterable[str] | None = None) -> None:
        """Fold items back into the modules they are in (the selected ones when None; every
        module when nothing is selected)."""
        keys = self._keys(keys)
        if keys:
            self._set_view(self.view.collapse, keys)
        else:
            self.collapse_all()

    def collapse_all(self) -> None:
        """Show only the model's top-level modules."""
        self._set_view(self.view.collapse_all)

    def expand_all(self) -> None:
        """Show every op as its own item (for graphs of up to ``EXPAND_ALL_OPS`` ops)."""
        if len(self.graph.ops) > EXPAND_ALL_OPS:
            raise ExplorerError(f"{len(self.graph.ops):,} ops are too many to draw one by one "
                                f"(at most {EXPAND_ALL_OPS:,}); expand to a depth, or expand "
                                "the modules you are interested in")
        self._set_view(self.view.expand_all)

    def expand_to(self, depth: int) -> None:
        """Show modules down to ``depth`` parts of their path ("blocks.0" is depth 2)."""
        if depth < 1:
            raise ExplorerError("the depth to expand to is 1 or more (1: top-level modules)")
        self._set_view(self.view.expand_to, depth)

    def find(self, query: str) -> list[int]:
        """Select what ``query`` names: a node or module by exact name, else the modules and
        ops whose names contain it ("h.3", "attention"), closest matches first. Returns the
        selected positions; says how many matched."""
        names = self.view.search(query)
        if not names:
            raise ExplorerError(f"nothing in {self.graph.name} matches {query!r}; type part of "
                                "a module path or op name (the find box suggests them)")
        picked = self.select(names)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        self.say(f"found {len(names)} match(es) for {query!r}: {shown}")
        return picked

    # -- the message line ----------------------------------------------------------------
    def say(self, text: str, error: bool = False, detail: str = "") -> None:
        """Show ``text`` on the message line ("" clears it); ``detail`` is shown folded. The
        message goes next to the control being used (see :meth:`guarded`)."""
        self.message, self.message_is_error, self.message_detail = text, error, detail
        self.message_where = self._where
        self._changed("message")

    def guarded(self, fn: Callable[..., Any], where: str = "") -> Callable[..., None]:
        """``fn`` wrapped as every control calls it: the message line is cleared first, and
        an error becomes the message instead of an exception (the kernel and widget live on).
        Messages said during the call belong to area ``where`` (shown next to the control).
        """
        @functools.wraps(fn)
        def call(*a: Any) -> None:
            self._where = where
            try:
                self.say("")
                fn(*a)
            except ExplorerError as e:
                self.say(str(e), error=True)
            except Exception as e:  # keep the kernel and the widget alive, say what happened
                self.say(f"{type(e).__name__}: {e}", error=True,
                         detail=traceback.format_exc(limit=6))
            finally:
                self._where = ""
        return call

    # -- edits ---------------------------------------------------------------------------
    def assign(self, names: Iterable[str], target: str) -> None:
        """Place nodes on a device, or on a replicated stage named ``"dev+dev"``.

        Parameters, buffers and inputs owned by a moved op (see :meth:`OpGraph.owner`) move
        with it. A device not used by the plan becomes a new stage; a device taken out of a
        replicated stage becomes a stage of its own (a device serves one stage), and the
        message says what that left of the replicated stage
        (:func:`widgets.edits.leaving_replicas`). Pinned nodes keep their pin, moved to the
        new device.
        """
        names = with_owned(self.graph, names)
        if not names:
            raise ExplorerError("select one or more nodes first, then assign them")
        plan = placed_on(self.plan, self.graph, self.cluster, names, target)
        left = leaving_replicas(self.plan, self.graph, names, target)
        moved = set(names)
        pins = {n: (first_device(plan, n) if n in moved else d) for n, d in self.pins.items()}
        self._commit(plan, pins, f"assign {count_label(self.graph, names)} to {target}")
        if left:
            self.say(left)

    def pin(self, names: Iterable[str]) -> None:
        """Fix nodes to their current device: partitioners re-solved around pins keep them."""
        names = with_owned(self.graph, names, owned=False)
        if not names:
            raise ExplorerError("select the nodes to pin first")
        pins = dict(self.pins)
        for n in names:
            pins[n] = first_device(self.plan, n)
        self._commit(self.plan.with_settings(pinned=frozenset(pins)), pins,
                     f"pin {count_label(self.graph, names)}")

    def unpin(self, names: Iterable[str] | None = None) -> None:
        """Release pins (all of them when ``names`` is None)."""
        names = (set(self.pins) if names is None
                 else set(with_owned(self.graph, names, owned=False)))
        pins = {n: d for n, d in self.pins.items() if n not in names}
        if pins == self.pins:
            return
        self._commit(self.plan.with_settings(pinned=frozenset(pins)), pins,
                     f"unpin {count_label(self.graph, names)}")

    def set_schedule(self, micro_batches: int | None = None, schedule: str | None = None,
                     optimizer: str | None = None) -> None:
        """Change the plan's micro-batch count, pipeline schedule or optimizer."""
        settings = {k: v for k, v in (("micro_batches", micro_batches), ("schedule", schedule),
                                      ("optimizer", optimizer)) if v is not None}
        if not settings:
            return
        plan = self.plan.with_settings(**settings)
        plan.validate(self.graph, self.cluster)
        self._commit(plan, self.pins, ", ".join(f"{k}={v}" for k, v in settings.items()))

    def split(self, names: Iterable[str], devices: str | Iterable[str],
              degree: int | None = None) -> None:
        """Split nodes over ``devices`` ("dev+dev" or a list) by tensor parallelism: they go
        to a stage of those devices whose layers are split ``degree`` ways (default: over all
        of them; see :func:`widgets.edits.split_over`). Pins move with the nodes."""
        devs = devices.split("+") if isinstance(devices, str) else list(devices)
        names = with_owned(self.graph, names)
        if not names:
            raise ExplorerError("select one or more nodes first, then split them")
        plan = split_over(self.plan, self.graph, self.cluster, names, devs, degree)
        pins = {n: first_device(plan, n) for n in self.pins}
        degree = plan.tensor_of(plan.stage_of(names[0]))
        self._commit(plan, pins, f"split {count_label(self.graph, names)} over "
                                 f"{'+'.join(devs)} (tensor {degree})")

    def split_targets(self) -> list[str]:
        """Device groups a selection can be split over (see :meth:`split`)."""
        return split_targets(self.plan, self.cluster)

    def set_memory(self, zero: int | None = None, recompute: str | None = None,
                   precision: str | None = None, stages: Iterable[int] | None = None,
                   tensor: int | None = None, sequence: bool | None = None,
                   async_tensor: bool | None = None, context: int | None = None) -> None:
        """Trade memory for time on ``stages`` (positions in ``plan.stages``; all of them
        when None): ZeRO stage 0-3 over the stage's replicas, activation recomputation
        (none, selective, full) and precision (fp32, bf16, fp16), or split the stages'
        layers ``tensor`` ways over their devices (``sequence``: and the ops between the
        split blocks along the sequence, ``async_tensor``: their collectives pipelined with
        the matrix products), or split each sample's sequence ``context`` ways over their
        replicas; what is not given stays."""
        chosen = range(len(self.plan.stages)) if stages is None else sorted(set(stages))
        plan = self.plan.with_memory(zero=zero, recompute=recompute, precision=precision,
                                     tensor=tensor, sequence=sequence,
                                     async_tensor=async_tensor, context=context,
                                     stages=chosen)
        if plan == self.plan:
            return
        self._commit(plan, self.pins, "memory: " + memory_label(plan, list(chosen)))
        precision = untimed_precision(self.graph, self.costs, plan)
        if precision is not None and (self.measuring is None or not self.measuring.running):
            self.measure_running = True
            self._measure_report("starting")  # estimates from the fp32 times till then
            self.measuring = BackgroundJob(
                precision_work(self.graph, self.cluster, precision), self._measure_report,
                self._measured_early, self._precision_measured, self._measure_failed).start()

    def load(self, plan: ex.Plan | str | Path, name: str | None = None) -> None:
        """Make ``plan`` (a Plan, or a path to a plan JSON file) the plan under edit."""
        if not isinstance(plan, ex.Plan):
            plan = ex.Plan.load(plan, self.graph, self.cluster)
        plan.validate(self.graph, self.cluster)
        pins = {n: first_device(plan, n) for n in plan.pinned}
        self._commit(plan, pins, f"load {name or plan.algorithm}")

    def undo(self) -> None:
        self._restore(self._history.undo(Snapshot(self.plan, dict(self.pins), "")))

    def redo(self) -> None:
        self._restore(self._history.redo(Snapshot(self.plan, dict(self.pins), "")))

    # -- partitioners --------------------------------------------------------------------
    def solve(self, algorithm: str, around_pins: bool = True, load: bool = True,
              **options: Any) -> PlanEntry:
        """Run a registered partitioner (with the pins when ``around_pins``), add its plan to
        the table and, with ``load``, make it the plan under edit."""
        get_algorithm(algorithm)  # unknown names raise with the list of known ones
        with self._lock:
            t0 = time.perf_counter()
            plan = ex.partition(self.graph, self.cluster, self.costs, algorithm,
                                pins=self.pins if around_pins else None, **options)
            took = time.perf_counter() - t0
            name = algorithm + (" (pinned)" if around_pins and self.pins else "")
            entry = PlanEntry(self._unique(name), plan,
                              ex.simulate(self.graph, plan, self.costs), took)
        self.plans.append(entry)
        self._changed("plans")
        if load:
            self.load(plan, entry.name)
        return entry

    def keep(self, name: str | None = None) -> PlanEntry:
        """Add the plan under edit to the table (to compare hand edits with solvers)."""
        entry = PlanEntry(self._unique(name or self.plan.algorithm), self.plan, self.prediction)
        self.plans.append(entry)
        self._changed("plans")
        return entry

    def entry(self, name: str) -> PlanEntry:
        for e in self.plans:
            if e.name == name:
                return e
        raise ExplorerError(f"no plan named {name!r} in the table; it has "
                            f"{', '.join(e.name for e in self.plans) or 'no plans yet'}")

    # -- real steps, calibration, export -------------------------------------------------
    def run(self, steps: int = 5, warmup: int = 2, force: bool = False,
            progress: bool = True, **kw: Any) -> ex.Report:
        """Run real training steps with the plan under edit and compare with its estimate
        (after the background measurement: real steps need the capture with real weights)."""
        self.wait_measured()
        meas = ex.run(self.graph, None, self.plan, steps=steps, warmup=warmup,
                      costs=self.costs, cluster=self.cluster, force=force, progress=progress,
                      **kw)
        self.measurement = meas
        self.report, self.report_plan = ex.compare(self.prediction, meas), self.plan
        self._changed("run")
        return self.report

    def calibrate(self) -> ex.Prediction:
        """Fit the cost model to the last real run, then estimate again."""
        if self.measurement is None:
            raise ExplorerError("run real steps first: calibration fits the cost model to them")
        self.costs = ex.calibrate(self.costs, self.measurement)
        self.plans = [replace(e, prediction=ex.simulate(self.graph, e.plan, self.costs))
                      for e in self.plans]
        self._estimate()
        self._changed("costs")
        return self.prediction

    def save(self, path: str | Path) -> Path:
        return self.plan.save(path)

    def export(self, path: str | Path, steps: int = 10, overwrite: bool = False,
               factory: str | None = None, native: bool = False) -> Path:
        """Write the torchrun script (and its plan JSON and job folder) for the plan under edit;
        an existing script is replaced only with ``overwrite`` (after the background
        measurement: the script needs the capture with real weights). ``factory``: the
        user's ``"module:function"`` that builds the model on every rank (a factory a loaded
        plan names is used only when the user names it here). ``native``: one plain PyTorch
        script instead (``ex.export_script(..., native=True)``), for a session on a built-in
        model or with a ``factory``."""
        plan = self.plan
        if native:
            if self.model_source and not plan.model:
                plan = replace(plan, model=self.model_source)
        else:
            self.wait_measured()
        return ex.export_script(plan, path, graph=self.graph, costs=self.costs, steps=steps,
                                overwrite=overwrite, factory=factory or None, native=native)

    # -- internals -----------------------------------------------------------------------
    def _keys(self, keys: Iterable[str] | None) -> list[str]:
        if keys is None:
            return [self.view.items[k].key for k in self.selected]
        return list(keys)

    def _set_view(self, change: Callable[..., None], *args: Any) -> None:
        change(*args)
        self.selected = []
        self._changed("view")

    def _unique(self, name: str) -> str:
        taken = {e.name for e in self.plans}
        out, k = name, 2
        while out in taken:
            out, k = f"{name} #{k}", k + 1
        return out

    def _commit(self, plan: ex.Plan, pins: Mapping[str, str], label: str) -> None:
        prev = Snapshot(self.plan, dict(self.pins), label)
        with self._lock:  # the measured costs are not swapped in halfway through
            old = (self.plan, self.pins, self.prediction)
            self.plan, self.pins = plan, dict(pins)
            try:
                self._estimate()
            except Exception:
                self.plan, self.pins, self.prediction = old
                raise
        self._history.push(prev)
        self._changed("plan")

    def _restore(self, snap: Snapshot) -> None:
        with self._lock:
            self.plan, self.pins = snap.plan, dict(snap.pins)
            self._estimate()
        self._changed("plan")

    def _estimate(self) -> None:
        t0 = time.perf_counter()
        self.prediction = ex.simulate(self.graph, self.plan, self.costs)
        self.estimate_s = time.perf_counter() - t0
