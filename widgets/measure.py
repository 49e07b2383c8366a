"""The first picture without waiting: capture without running, roofline numbers, measure later.

Capturing a model by running it and profiling it on this machine's CPU ranks can take a minute
for a model of GPT-2's size. The explorer does not wait for it: :func:`first_graph` captures
the model on fake tensors (the same graph and fingerprint, nothing run) and
:func:`roofline_model` estimates every device from FLOPs and bytes, so the widget opens in
seconds. :func:`measuring_work` is what is left to do, which a :class:`BackgroundJob` runs in a
thread: the capture with real weights (to run steps and export scripts) and, where the devices
are present, the profile. The session swaps the profile's preliminary numbers in as soon as its
first run is done (:class:`explorer.profiling.Preliminary`), and the final ones when it ends.

A job never outlives the interpreter while inside torch: a daemon thread that is in a torch
call when Python finalizes is ended there and aborts the whole process ("terminate called
without an active exception"). Each running job is stopped at exit (:mod:`atexit`, which a
Jupyter kernel's shutdown runs too): :meth:`BackgroundJob.stop` asks its work to end at the
next progress report and raises :class:`MeasuringStopped` in its thread, whose unwinding ends
the profile's rank processes, and waits a bounded time for the thread to leave.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import explorer as ex
from explorer.capture.fake import is_fake_graph
from explorer.core.errors import CaptureError, CaptureTimeout, ExplorerError
from explorer.core.graph import OpGraph
from explorer.costs.kernels import Kernels
from explorer.models.synthetic import roofline_costs
from explorer.profiling import Preliminary

_log = logging.getLogger(__name__)
#: the folders of the explorer's own code (see :func:`runs_ours`)
_OURS = (str(Path(ex.__file__).parent), str(Path(__file__).parent))

#: when the measured numbers come: "background" (a thread, the widget opens on rooflines),
#: "now" (before the widget opens) or "never" (rooflines only, nothing run)
MEASURE_MODES = ("background", "now", "never")

#: how long stopping a job waits for its thread to leave the work (seconds): the time one op,
#: a rank run's clean-up or a rank's kill takes, not a whole profile
STOP_WAIT_S = 20.0

#: told the real graph and a profile's preliminary numbers while the work goes on
Early = Callable[[OpGraph, Preliminary], None]
#: the work of a background job: called with a function that reports progress and one told
#: the preliminary numbers (:data:`Early`), returns the real graph and its final cost model
Work = Callable[[Callable[[str], None], Early], tuple[OpGraph, ex.CostModel]]


def check_mode(measure: str) -> None:
    if measure not in MEASURE_MODES:
        raise ExplorerError(f"measure={measure!r} is not known; use one of "
                            f"{', '.join(MEASURE_MODES)}")


def roofline_model(graph: OpGraph, cluster: ex.Cluster, kernels: Kernels = "eager"
                   ) -> ex.CostModel:
    """Roofline estimates on every device of ``cluster``, present or not: the costs the
    profiler gives devices that are absent, built at once for the ones it would measure."""
    return roofline_costs(graph, cluster, kernels)


def has_present(cluster: ex.Cluster) -> bool:
    """Whether some device of ``cluster`` is on this machine (and can be profiled)."""
    return any(d.present for d in cluster.devices)


def first_graph(module: Any, inputs: Any, loss_fn: Any, targets: Any, name: str | None,
                measure: str) -> tuple[OpGraph, bool]:
    """The graph to open on, and whether it was captured without running (fake tensors).

    With ``measure="now"``, or when the model cannot be traced on fake tensors (code that reads
    tensor values, or a tensor made outside the trace that fake tensors refuse), the model is
    captured by running it."""
    if measure != "now":
        try:
            return ex.capture(module, inputs, loss_fn, targets, name=name, fake=True), True
        except CaptureTimeout:
            raise  # the real capture would run the same forward and wait as long again
        except CaptureError:
            pass  # e.g. data-dependent code: the real capture below says what is wrong
        except Exception as e:  # torch refused the fake trace: the real capture is the one
            _log.debug("the capture on fake tensors failed (%s: %s); capturing by running",
                       type(e).__name__, e)
    return ex.capture(module, inputs, loss_fn, targets, name=name), False


def measuring_work(real: OpGraph | Callable[[], OpGraph], cluster: ex.Cluster,
                   fingerprint: str, kernels: Kernels = "eager") -> Work:
    """What is left after opening on estimates: the capture with real weights (``real`` when
    it is a function that captures; a graph is already real) and, when devices of
    ``cluster`` are present, their profile (rooflines for the others), whose preliminary
    numbers go to ``early`` as soon as its first run is done; before it, the host's CPU
    ranks where ``cluster`` leaves them to be measured later (:meth:`ex.Cluster.measured`):
    the cost model returned has the measured cluster."""
    def work(report: Callable[[str], None], early: Early) -> tuple[OpGraph, ex.CostModel]:
        graph = real
        if not isinstance(graph, OpGraph):
            report("capturing the model with real weights")
            graph = graph()
        if graph.fingerprint != fingerprint:
            raise CaptureError(f"the capture with real weights gave another graph "
                               f"({len(graph.ops):,} ops) than the one without running; the "
                               "numbers stay roofline estimates. Open it with measure='now'")
        if not has_present(cluster):
            return graph, roofline_model(graph, cluster, kernels)
        measured = cluster
        if cluster.measure_later:
            report("measuring this host's CPU ranks (once per host)")
            measured = cluster.measured()
        here = ", ".join(d.id for d in measured.devices if d.present)
        report(f"profiling {len(graph.ops):,} ops on {here}")
        return graph, ex.profile(graph, measured, progress=False, report=report,
                                 partial=lambda pre: early(graph, pre))
    return work


def precision_work(graph: OpGraph, cluster: ex.Cluster, precision: str) -> Work:
    """Time the present devices in ``precision`` too (``ex.profile(..., precisions=)``: the
    cached fp32 profile, then the ops under autocast), so stages set to compute in it are
    estimated from what it costs here rather than from the fp32 times."""
    def work(report: Callable[[str], None], early: Early) -> tuple[OpGraph, ex.CostModel]:
        report(f"timing the ops in {precision} on "
               + ", ".join(d.id for d in cluster.devices if d.present))
        return graph, ex.profile(graph, cluster, progress=False, report=report,
                                 precisions=(precision,))
    return work


def add_precision_times(costs: ex.CostModel, timed: ex.CostModel) -> None:
    """Copy the half-precision times of ``timed`` (:func:`precision_work`'s profile) into
    ``costs``, in place."""
    for key, dc in costs.per_type.items():
        got = timed.per_type.get(key)
        if got is not None and got.precision_s:
            dc.precision_s = {**dc.precision_s, **got.precision_s}


def untimed_precision(graph: OpGraph, costs: ex.CostModel, plan: ex.Plan) -> str | None:
    """A half precision a stage of ``plan`` computes in on a present, measured device whose
    profile was not timed in it (None: none): what :func:`precision_work` would time."""
    if graph.runtime is None:
        return None
    for k, devs in enumerate(plan.stages):
        precision = plan.settings_of(k).precision
        if precision == "fp32":
            continue
        for d in devs:
            dc = costs.device_costs(d)
            if (costs.cluster.device(d).present and "measured" in dc.source
                    and precision not in dc.precision_s):
                return precision
    return None


def opening_costs(graph: OpGraph, capture: Callable[[], OpGraph] | None,
                  cluster: ex.Cluster, measure: str, progress: bool, kernels: Kernels = "eager"
                  ) -> tuple[ex.CostModel, Work | None]:
    """The costs to open ``graph`` on, and the work left for the background (None: none).

    ``capture`` captures with real weights when ``graph`` was captured without running
    (None: ``graph`` is real). A real graph on devices that are all absent has its rooflines
    at once (what the profiler would give them; nothing run, no cache read); a real graph
    measured ``"now"`` is profiled before opening. ``kernels``: how the estimates run the ops
    (:func:`ex.profile`'s; "compiled" only where no device is here)."""
    if kernels == "compiled" and has_present(cluster):  # (before anything runs)
        here = ", ".join(d.id for d in cluster.devices if d.present)
        raise ExplorerError(f"kernels='compiled' prices devices that are not here (GPU presets "
                            f"such as \"8xH100\"); {here} here are measured as they run: "
                            "open with kernels='eager', or on a preset cluster")
    if capture is None and not has_present(cluster):
        return roofline_model(graph, cluster, kernels), None
    if capture is None and measure == "now":
        return ex.profile(graph, cluster, progress=progress, kernels=kernels), None
    work = (measuring_work(capture or graph, cluster, graph.fingerprint, kernels)
            if measure == "background" else None)
    return roofline_model(graph, cluster, kernels), work


def numbers_status(preliminary: str) -> str:
    """What the status line says the numbers are while measuring goes on: roofline
    estimates, or measured with ``preliminary``'s label (e.g. "preliminary: 1 of 8 runs")."""
    return f"measured ({preliminary})" if preliminary else "roofline estimates"


def measured_status(cluster: ex.Cluster, graph: OpGraph) -> str:
    """What the status line says once the background work is done (``graph``: the graph it
    left, captured with real weights or, for a model built on the meta device, on fake
    tensors still)."""
    here = [d.id for d in cluster.devices if d.present]
    if here:
        return f"measured: the numbers are from the profile of {', '.join(here)}"
    if is_fake_graph(graph.notes):
        return ("roofline estimates (devices not here; captured on fake tensors, the model "
                "has no weights: it is planned and simulated, not run; to export it, name "
                "the function that builds it: export(path, factory=\"module:function\"))")
    return ("roofline estimates (devices not here; captured with real weights: export is "
            "ready, real steps run where the devices are)")


def starting_a_thread(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``Thread.start`` (waiting for a thread it starts)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is threading.Thread.start.__code__:
            return True
        frame = frame.f_back
    return False


def runs_ours(thread: threading.Thread) -> bool:
    """Whether ``thread`` is running code of the explorer's (a frame of ``explorer/`` or
    ``widgets/`` on its stack)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OURS):
            return True
        frame = frame.f_back
    return False


class MeasuringStopped(BaseException):
    """Ends a background job's work early (:meth:`BackgroundJob.stop`). A ``BaseException``,
    like ``KeyboardInterrupt``, so that no ``except Exception`` on the way (a capture's
    fallback, a profile's warning) takes it for a failure and carries on measuring."""


class BackgroundJob:
    """``work`` run in a daemon thread: ``report(text)`` says how far it is, ``early(graph,
    preliminary)`` takes preliminary numbers, ``finish(result)`` its result and ``fail(error,
    trace)`` its error (each called from the thread). :meth:`wait` blocks until it is over;
    :meth:`stop` ends it early (done for every running job at interpreter exit)."""

    def __init__(self, work: Work, report: Callable[[str], None], early: Early,
                 finish: Callable[[tuple[OpGraph, ex.CostModel]], None],
                 fail: Callable[[BaseException, str], None]) -> None:
        self.error: BaseException | None = None
        #: whether :meth:`stop` ended the work before it was done
        self.stopped = False
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._before: set[int | None] = set()  # the threads there before it started
        self._thread = threading.Thread(target=self._run,
                                        args=(work, report, early, finish, fail),
                                        name="explorer-measure", daemon=True)

    def start(self) -> BackgroundJob:
        self._before = {t.ident for t in threading.enumerate()}
        atexit.register(self.stop)  # (unregistered when the work is over)
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the job is over (within ``timeout_s`` seconds; None: as long as it takes)."""
        return self._done.wait(timeout_s)

    def stop(self, timeout_s: float = STOP_WAIT_S) -> bool:
        """End the work early and wait (``timeout_s`` seconds at most) until its threads have
        left it; whether they have. The work stops at its next progress report, or where it
        is (:class:`MeasuringStopped` raised in its thread and in the threads it started that
        still run the explorer's code, such as a capture's worker: a torch call one is in
        finishes first, and the profile's rank processes are ended as the error unwinds).
        Nothing is reported, finished or failed after a stop; the numbers so far stay."""
        if not self.started or self._done.is_set():
            return True
        self._stopping.set()
        end = time.monotonic() + timeout_s
        thread = self._thread
        # not while it starts a thread: the error would leave that one running unwatched
        while starting_a_thread(thread) and time.monotonic() < end:
            time.sleep(0.005)
        helpers = [t for t in threading.enumerate()
                   if t.ident not in self._before and t is not thread and runs_ours(t)]
        for t in (thread, *helpers):
            if t.ident is not None and t.is_alive() and not self._done.is_set():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident),
                                                           ctypes.py_object(MeasuringStopped))
        for t in (thread, *helpers):
            t.join(max(0.0, end - time.monotonic()))
        left = [t.name for t in (thread, *helpers) if t.is_alive()]
        if left:
            _log.warning("the background measuring did not stop within %g s (%s still "
                         "running)", timeout_s, ", ".join(left))
            return False
        return True

    def _checked(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn``, which first ends the work when :meth:`stop` was asked (a step boundary)."""
        def call(*args: object) -> None:
            if self._stopping.is_set():
                raise MeasuringStopped
            fn(*args)
        return call

    def _run(self, work: Work, report: Callable[[str], None], early: Early,
             finish: Callable[[tuple[OpGraph, ex.CostModel]], None],
             fail: Callable[[BaseException, str], None]) -> None:
        try:
            try:
                result = work(self._checked(report), self._checked(early))
                if self._stopping.is_set():
                    raise MeasuringStopped
                finish(result)
            except MeasuringStopped:
                self.stopped = True
            except BaseException as e:  # the thread must say what went wrong, whatever it is
                if self._stopping.is_set():  # (an error of the stop's unwinding: stopped)
                    self.stopped = True
                else:
                    self.error = e
                    fail(e, traceback.format_exc(limit=6))
            finally:
                self._done.set()
                atexit.unregister(self.stop)
        except MeasuringStopped:  # raised in the thread just as the work ended by itself
            self.stopped = True
