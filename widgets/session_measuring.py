"""A session's measured numbers, taken in the background: the capture with real weights and
the profile run in a thread (:mod:`widgets.measure`), and their numbers swapped in as they come
(the profile's preliminary ones, then the final ones), keeping the plan under edit, its pins,
undo history and table.

:class:`BackgroundMeasuring` holds these steps of :class:`widgets.session.Session`, which
inherits them; it has no state of its own (the fields are the session's).
"""

from __future__ import annotations

from dataclasses import replace

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.units import format_seconds
from explorer.partition.quick import QUICK_BASELINES, fastest_quick_baseline
from explorer.profiling import Preliminary
from widgets.edits import run_problem
from widgets.measure import (
    BackgroundJob,
    Work,
    add_precision_times,
    measured_status,
    numbers_status,
)


class BackgroundMeasuring:
    """The background measurement's steps of a :class:`~widgets.session.Session`."""

    def measure_in_background(self, work: Work, start: bool = True) -> None:
        """Run ``work`` (see :func:`widgets.measure.measuring_work`) in a thread (once
        :meth:`start_measuring` is called, without ``start``); its real
        graph and measured costs replace the estimates when it is done (the plan under edit,
        pins, undo history and table stay: the graph is the same), and the profile's
        preliminary numbers before that, as soon as its first run is done (``preliminary``
        says so). Progress is ``measure_status`` (topic "measure"); an error becomes the
        message and the numbers so far stay."""
        self.measure_running = True
        self._measure_report("starting")
        self.measuring = BackgroundJob(work, self._measure_report, self._measured_early,
                                       self._measured, self._measure_failed)
        if start:
            self.start_measuring()

    def start_measuring(self) -> None:
        """Start the background measurement that waits (:meth:`open` without ``start``)."""
        if self.measuring is not None and not self.measuring.started:
            self.measuring.start()

    def wait_measured(self, timeout_s: float | None = None) -> bool:
        """Wait for the background measurement (``timeout_s`` seconds at most; None: as
        long as it takes). True once the measured numbers are in; False when there is
        nothing to wait for. Raises when it failed or is not done in time."""
        job = self.measuring
        if job is None:
            return False
        self.start_measuring()  # (one that waits would never end)
        if not job.wait(timeout_s):
            raise ExplorerError(f"still measuring after {timeout_s:g} s "
                                f"({self.measure_status}); wait longer, or keep editing: the "
                                "numbers change when it is done")
        if job.error is not None:
            raise ExplorerError(f"measuring failed ({type(job.error).__name__}: "
                                f"{job.error}); the numbers are "
                                f"{numbers_status(self.preliminary)} and real "
                                "steps cannot run: open with measure='now' to see the error "
                                "where it happens") from job.error
        return True

    def _measure_report(self, text: str) -> None:
        self.measure_status = (f"{numbers_status(self.preliminary)}; measuring in the "
                               f"background: {text}" if text else "")
        self._changed("measure")

    def _measured_early(self, graph: OpGraph, pre: Preliminary) -> None:
        try:
            self._swap_costs(graph, pre.costs)
        except Exception as e:  # the final numbers still come: say it, keep measuring
            self.say(f"the preliminary measured numbers could not be shown "
                     f"({type(e).__name__}: {e}); the final ones follow", error=True)
            return
        self.preliminary = pre.label
        self.measure_status = numbers_status(self.preliminary)
        self._changed("costs")
        self._changed("measure")
        self._check_opening()

    def _swap_costs(self, graph: OpGraph, costs: ex.CostModel) -> None:
        """Measured ``costs`` (of the real ``graph``) in place of the numbers so far, and
        their cluster (the same devices, measured where they were nominal till then: see
        :meth:`ex.Cluster.measured`); the plan under edit, pins, undo history and table stay
        (the graph and the device ids are the same)."""
        if costs.cluster.ids != self.cluster.ids:
            raise ExplorerError(f"the measured numbers are for other devices "
                                f"({', '.join(costs.cluster.ids)}) than the explorer's "
                                f"({', '.join(self.cluster.ids)})")
        with self._lock:
            plans = [replace(e, prediction=ex.simulate(graph, e.plan, costs))
                     for e in self.plans]
            self.graph, self.costs, self.cluster, self.plans = graph, costs, costs.cluster, plans
            self._estimate()

    def _check_opening(self) -> None:
        """The line saying which quick baseline the session opened with, said again on the
        numbers now in (while it is still the message): the opened plan may no longer be
        the fastest of them once measured numbers replace the estimates."""
        if self._opened is None or not self._opening_note or self.message != self._opening_note:
            return
        best = fastest_quick_baseline(self.graph, self.cluster, self.costs,
                                      lambda p: run_problem(self.graph, p))
        if best is None:
            return
        opened = self._opened.algorithm
        if best.name == opened:
            note = (f"opened with the {opened} plan, the fastest of the quick baselines "
                    f"({', '.join(QUICK_BASELINES)}) on the {self._numbers()} too; solve for "
                    "better ones under partitioners")
        else:
            was = ex.simulate(self.graph, self._opened, self.costs)
            note = (f"opened with the {opened} plan, the fastest of the quick baselines on "
                    f"roofline estimates; on the {self._numbers()} the {best.name} plan is "
                    f"faster ({format_seconds(best.prediction.step_s)} per step against "
                    f"{format_seconds(was.step_s)}): solve {best.name} under partitioners "
                    "to load it")
        self._opening_note = note
        self.say(note)

    def _numbers(self) -> str:
        """What the numbers now in are, for a line about them."""
        return "preliminary measured numbers" if self.preliminary else "measured numbers"

    def _measured(self, result: tuple[OpGraph, ex.CostModel]) -> None:
        self._swap_costs(*result)
        self.preliminary = ""
        self.measure_running = False
        self.measure_status = measured_status(self.cluster, self.graph)
        self._changed("costs")
        self._changed("measure")
        self._check_opening()

    def _precision_measured(self, result: tuple[OpGraph, ex.CostModel]) -> None:
        add_precision_times(self.costs, result[1])  # (calibration and all else kept)
        self._measured((self.graph, self.costs))

    def _measure_failed(self, error: BaseException, trace: str) -> None:
        now = numbers_status(self.preliminary)
        self.measure_running = False
        self.measure_status = f"{now} (measuring failed: see the message)"
        self._changed("measure")
        self.say(f"measuring in the background failed ({type(error).__name__}: {error}); the "
                 f"numbers stay {now}", error=True, detail=trace)
