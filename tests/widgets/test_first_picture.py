"""The explorer opens on roofline estimates at once and swaps measured numbers in when ready."""

from __future__ import annotations

import dataclasses
import re
import threading

import pytest
import torch

import explorer as ex
from explorer.capture.fake import FAKE_NOTE
from explorer.core.errors import ExplorerError
from explorer.models.synthetic import roofline_costs
from explorer.profiling import Preliminary
from widgets import Session

pytest.importorskip("jupyter_bokeh")

#: what the patched profiler's costs are scaled by, so that measured numbers differ
MEASURED_SCALE = 3.0


def shown_step_s(w) -> float:
    return float(re.search(r"class='pe-step' data-value='([^']+)'", w.estimate.table.value)[1])


class BlockingProfiler:
    """Stands in for ``ex.profile``: blocks until released, then gives scaled rooflines (or
    raises ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.reported = threading.Event()
        self.calls = 0
        self.error = error

    def __call__(self, graph, cluster, report=None, **kw):
        self.calls += 1
        if report is not None:  # as the profiler tells how far it is
            report("profiling mlp on cpu:0: 2 of 6 runs")
            self.reported.set()
        assert self.release.wait(60), "the test never released the profiler"
        if self.error is not None:
            raise self.error
        return dataclasses.replace(roofline_costs(graph, cluster), compute_scale=MEASURED_SCALE)


class StagedProfiler(BlockingProfiler):
    """Stands in for ``ex.profile`` with preliminary numbers: after its first run it gives
    rooflines scaled by ``PRELIMINARY_SCALE`` to ``partial`` (once ``go`` is set), then blocks
    until released."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.early = threading.Event(), threading.Event()

    def __call__(self, graph, cluster, report=None, partial=None, **kw):
        report("profiling mlp on cpu:0: 1 of 6 runs")
        assert self.go.wait(60), "the test never let the first run end"
        partial(Preliminary(dataclasses.replace(roofline_costs(graph, cluster),
                                                compute_scale=PRELIMINARY_SCALE), 1, 8))
        report("profiling mlp on cpu:0: 2 of 6 runs")
        self.early.set()
        return super().__call__(graph, cluster, **kw)


#: what the preliminary numbers are scaled by
PRELIMINARY_SCALE = 2.0


@pytest.fixture
def profiler(monkeypatch):
    p = BlockingProfiler()
    monkeypatch.setattr(ex, "profile", p)
    yield p
    p.release.set()  # never leave the thread waiting


def open_mlp(**kw):
    from widgets import Explorer

    return Explorer(ex.builtin_model("mlp", "tiny"), cluster=ex.Cluster.cpu(2, measure=False),
                    progress=False, **kw)


def test_opens_on_rooflines_while_measuring_then_shows_measured_numbers(profiler):
    w = open_mlp()
    s = w.session
    assert FAKE_NOTE in s.graph.notes  # captured without running
    assert "measuring" in s.measure_status and "measuring" in w.status.header.value
    roof = roofline_costs(s.graph, s.cluster)
    assert shown_step_s(w) == pytest.approx(ex.simulate(s.graph, s.plan, roof).step_s)
    s.assign([s.graph.ops[0].name], "cpu:1")  # editing goes on meanwhile
    plan = s.plan
    with pytest.raises(ExplorerError, match="still measuring"):
        s.wait_measured(0.01)
    assert profiler.reported.wait(60)  # the profile's progress, in the widget
    assert "2 of 6 runs" in s.measure_status and "2 of 6 runs" in w.status.header.value
    profiler.release.set()
    assert s.wait_measured(60)
    assert s.plan is plan and s.graph.runtime is not None  # the real graph, the same plan
    assert s.costs.compute_scale == MEASURED_SCALE
    measured = ex.simulate(s.graph, plan, s.costs).step_s
    assert shown_step_s(w) == pytest.approx(measured) and measured > ex.simulate(
        s.graph, plan, roof).step_s
    assert "measured" in w.status.header.value and "measuring" not in w.status.header.value
    assert profiler.calls == 1


def test_an_error_while_measuring_becomes_the_message(profiler):
    profiler.error = RuntimeError("the profiler broke")
    w = open_mlp()
    before = shown_step_s(w)
    profiler.release.set()
    with pytest.raises(ExplorerError, match=r"measuring failed.*the profiler broke"):
        w.session.wait_measured(60)
    assert "the profiler broke" in w.message and w.session.message_is_error
    assert "the profiler broke" in w.status.message.value
    assert "failed" in w.status.header.value
    assert shown_step_s(w) == before  # the estimates stay, and editing goes on
    w.session.assign([w.session.graph.ops[0].name], "cpu:1")
    with pytest.raises(ExplorerError, match="measuring failed"):
        w.session.run(steps=1)  # real steps need what failed


def test_measure_now_and_never(profiler):
    profiler.release.set()
    now = open_mlp(measure="now")
    assert profiler.calls == 1 and now.session.costs.compute_scale == MEASURED_SCALE
    assert now.session.graph.runtime is not None and not now.session.wait_measured()
    never = open_mlp(measure="never")
    assert profiler.calls == 1 and FAKE_NOTE in never.session.graph.notes
    assert not never.session.wait_measured() and never.session.measure_status == ""
    with pytest.raises(ExplorerError, match="measure='sometime' is not known"):
        open_mlp(measure="sometime")


def test_absent_devices_need_no_profile_only_the_real_capture(profiler):
    bm = ex.builtin_model("mlp", "tiny")
    s = Session.open(bm, cluster=ex.Cluster.preset("2xH100"))
    assert FAKE_NOTE in s.graph.notes
    assert s.wait_measured(60) and s.graph.runtime is not None
    assert profiler.calls == 0 and "roofline estimates" in s.measure_status


def test_preliminary_numbers_then_final_ones_and_no_edit_is_lost(monkeypatch):
    staged = StagedProfiler()
    monkeypatch.setattr(ex, "profile", staged)
    try:
        w = open_mlp()
        s = w.session
        ops = [op.name for op in s.graph.ops]
        s.assign(ops[:1], "cpu:1")  # edits while the rooflines show
        s.keep("one moved")
        assert s.costs.compute_scale == 1.0 and "roofline estimates" in s.measure_status
        staged.go.set()
        assert staged.early.wait(60)
        assert s.costs.compute_scale == PRELIMINARY_SCALE and s.graph.runtime is not None
        assert s.preliminary == "preliminary: 1 of 8 runs"
        header = w.status.header.value
        assert "measured (preliminary: 1 of 8 runs); measuring in the background: " \
               "profiling mlp on cpu:0: 2 of 6 runs" in s.measure_status
        assert "measured (preliminary: 1 of 8 runs)" in header
        assert "roofline" not in s.measure_status
        assert s.plan.devices_of(ops[0]) == ("cpu:1",)  # the edit made before stays
        assert shown_step_s(w) == pytest.approx(ex.simulate(s.graph, s.plan, s.costs).step_s)
        kept = s.plans[-1]
        assert kept.prediction.step_s == pytest.approx(
            ex.simulate(s.graph, kept.plan, s.costs).step_s)  # the table re-estimated too
        s.assign(ops[1:2], "cpu:1")  # and edits on the preliminary numbers
        edited = s.plan
        staged.release.set()
        assert s.wait_measured(60)
        assert s.costs.compute_scale == MEASURED_SCALE and s.preliminary == ""
        assert s.plan is edited and "preliminary" not in w.status.header.value
        assert "measured: the numbers are from the profile" in w.status.header.value
        assert shown_step_s(w) == pytest.approx(ex.simulate(s.graph, edited, s.costs).step_s)
        s.undo()  # the history made across both swaps is all there
        assert s.plan.devices_of(ops[1]) != ("cpu:1",) and s.plan.devices_of(ops[0]) == (
            "cpu:1",)
        s.undo()
        assert s.plan.devices_of(ops[0]) != ("cpu:1",)
        s.redo()
        s.redo()
        assert s.plan.devices_of(ops[1]) == ("cpu:1",)
    finally:
        staged.go.set()
        staged.release.set()


def test_a_failure_after_preliminary_numbers_keeps_them(monkeypatch):
    staged = StagedProfiler()
    staged.error = RuntimeError("a contention run broke")
    monkeypatch.setattr(ex, "profile", staged)
    staged.go.set()
    staged.release.set()
    w = open_mlp()
    with pytest.raises(ExplorerError, match=r"numbers are measured \(preliminary: 1 of 8"):
        w.session.wait_measured(60)
    assert w.session.costs.compute_scale == PRELIMINARY_SCALE
    assert "measured (preliminary: 1 of 8 runs) (measuring failed" in w.status.header.value


class MeasuringCalls:
    """Stands in around what measures (the profiler, a capture that runs the model, the
    host's probes): records the thread each call is made on, then does what it stands for."""

    def __init__(self, monkeypatch, profiler) -> None:
        import explorer.platforms.cpu.host as cpu_host
        import explorer.profiling.host as profiling_host

        self.calls: list[tuple[str, str]] = []  # (what, thread name)
        self.lock = threading.Lock()
        monkeypatch.setattr(ex, "profile", self.wrap("profile", profiler))
        for owner, name in ((cpu_host, "measure_host_profile"),
                            (profiling_host, "cpu_message_s"),
                            (profiling_host, "measure_contention")):
            monkeypatch.setattr(owner, name, self.wrap(name, getattr(owner, name)))
        real_capture = ex.capture

        def capture(*a, **kw):
            if not kw.get("fake"):  # (the capture on fake tensors runs nothing)
                self.record("capture with real weights")
            return real_capture(*a, **kw)
        monkeypatch.setattr(ex, "capture", capture)

    def record(self, what: str) -> None:
        with self.lock:
            self.calls.append((what, threading.current_thread().name))

    def wrap(self, what, fn):
        def call(*a, **kw):
            self.record(what)
            return fn(*a, **kw)
        return call


def first_picture_threads(monkeypatch) -> list[list[str]]:
    """Patches the explorer so that, when it draws its first picture, the names of the
    threads then alive are kept (in the list returned)."""
    from widgets import Explorer

    seen: list[list[str]] = []
    update = Explorer.update

    def first_update(self, what="all"):
        if not seen:
            seen.append([t.name for t in threading.enumerate()])
        update(self, what)
    monkeypatch.setattr(Explorer, "update", first_update)
    return seen


def test_nothing_measures_before_the_first_picture(monkeypatch, profiler):
    profiler.release.set()
    calls = MeasuringCalls(monkeypatch, profiler)
    seen = first_picture_threads(monkeypatch)
    before = {t.name for t in threading.enumerate()}
    w = open_mlp()
    s = w.session
    assert seen and [t for t in seen[0] if t not in before] == []  # none started yet
    here = threading.current_thread().name
    assert [c for c in calls.calls if c[1] == here] == []  # nothing on the caller's thread
    assert "measuring" in s.measure_status  # and it does measure, after the picture
    assert s.wait_measured(120) and s.graph.runtime is not None
    assert [c[0] for c in calls.calls] == ["capture with real weights", "profile"]
    assert [c for c in calls.calls if c[1] == here] == []


def test_a_captured_graph_on_absent_devices_opens_without_the_profiler(monkeypatch):
    calls = MeasuringCalls(monkeypatch, ex.profile)
    bm = ex.builtin_model("mlp", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="mlp")
    calls.calls.clear()
    from widgets import Explorer

    w = Explorer(graph, cluster=ex.Cluster.preset("2xH100"), progress=False)
    assert calls.calls == []
    roof = roofline_costs(graph, w.session.cluster)
    assert shown_step_s(w) == pytest.approx(ex.simulate(graph, w.session.plan, roof).step_s)


#: what the stand-in host measurement says a CPU rank computes (not the nominal figure)
HOST_FLOPS_PER_S = 7e9


@pytest.fixture
def unmeasured_host(monkeypatch, tmp_path):
    """An empty host measurement cache (nothing memoised either), and a stand-in for the
    host's measurement that gives figures unlike the nominal ones at once."""
    import explorer.platforms.cpu.host as cpu_host

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_host, "_MEMO", {})

    def measure_host_profile():
        prof = cpu_host.nominal_profile()
        prof.update(flops_per_s=HOST_FLOPS_PER_S, compute_source="measured (a stand-in)",
                    link_source="measured (a stand-in)", link_probes=1, link_measured=True)
        return prof
    monkeypatch.setattr(cpu_host, "measure_host_profile", measure_host_profile)
    return tmp_path


def open_builtin_on_cpu_ranks():
    from widgets import Explorer

    return Explorer.builtin("mlp", "tiny", devices="cpu:2", progress=False)


def open_on_this_machine(monkeypatch):
    from explorer.devices import discovery
    from widgets import Explorer

    # (no GPU, as on a laptop: the CPU ranks of this machine)
    monkeypatch.setattr(discovery, "nvml_gpus", lambda: ("no NVIDIA GPU found", []))
    return Explorer(ex.builtin_model("mlp", "tiny"), progress=False)


def open_on_a_device_spec():
    from widgets import Explorer

    return Explorer(ex.builtin_model("mlp", "tiny"), cluster="cpu:2", progress=False)


@pytest.mark.parametrize("opened", ["builtin on cpu:2", "model without a cluster",
                                    "model on a device spec"])
def test_nothing_measures_the_host_before_the_first_picture(monkeypatch, profiler,
                                                             unmeasured_host, opened):
    profiler.release.set()
    calls = MeasuringCalls(monkeypatch, profiler)
    seen = first_picture_threads(monkeypatch)
    before = {t.name for t in threading.enumerate()}
    w = (open_builtin_on_cpu_ranks() if opened == "builtin on cpu:2"
         else open_on_a_device_spec() if opened == "model on a device spec"
         else open_on_this_machine(monkeypatch))
    s = w.session
    try:
        assert seen and [t for t in seen[0] if t not in before] == []  # none started yet
        here = threading.current_thread().name
        assert [c for c in calls.calls if c[1] == here] == []  # nothing on the caller's thread
        assert s.cluster.measure_later  # nominal figures till the host is measured
        assert all(d.flops_per_s != HOST_FLOPS_PER_S for d in s.cluster.devices)
        plan = s.plan
        s.assign([s.graph.ops[0].name], s.cluster.ids[-1])  # an edit made meanwhile
        edited = s.plan
        assert edited is not plan
        assert s.wait_measured(120)
        assert sorted(c[0] for c in calls.calls) == ["capture with real weights",
                                                      "measure_host_profile", "profile"]
        assert [c for c in calls.calls if c[1] == here] == []
        # the measured host is swapped in (the costs' cluster and the session's), the edit
        # kept
        assert s.costs.cluster is s.cluster and not s.cluster.measure_later
        assert s.plan is edited
        assert all(d.flops_per_s == HOST_FLOPS_PER_S for d in s.cluster.devices)
        assert shown_step_s(w) == pytest.approx(ex.simulate(s.graph, edited, s.costs).step_s)
    finally:  # (a failure leaves no measuring running on into the next test)
        if s.measuring is not None:
            s.measuring.stop()


def test_a_capture_past_its_time_limit_is_not_run_again(monkeypatch):
    from widgets import measure

    calls = []

    def timed_out(*args, fake=False, **kw):
        calls.append(fake)
        raise ex.CaptureTimeout("capturing did not finish within 1 s")

    monkeypatch.setattr(measure.ex, "capture", timed_out)
    with pytest.raises(ex.CaptureTimeout):
        measure.first_graph(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), None, None, None,
                            "background")
    assert calls == [True]  # the real capture would run the same forward, as long again


def test_costs_priced_as_compiled_kernels_open_as_given_and_say_so():
    from widgets import Explorer

    bm = ex.builtin_model("llama", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, fake=True)
    cluster = ex.Cluster.preset("2xH100")
    compiled = ex.profile(graph, cluster, progress=False, kernels="compiled")
    w = Explorer(graph, compiled, ex.Plan.single(graph, cluster.ids[0]), progress=False)
    assert w.session.costs.kernels == "compiled"
    assert "ops priced as compiled (fused) kernels" in w.status.header.value
    assert shown_step_s(w) == pytest.approx(
        ex.simulate(graph, w.session.plan, compiled).step_s)
    eager = Explorer(graph, ex.profile(graph, cluster, progress=False),
                     ex.Plan.single(graph, cluster.ids[0]), progress=False)
    assert "compiled" not in eager.status.header.value
    assert shown_step_s(w) < shown_step_s(eager)


def test_a_model_opens_on_presets_priced_as_compiled_kernels():
    from widgets import Explorer

    bm = ex.builtin_model("llama", "tiny")
    compiled = Explorer(bm, cluster="2xH100", kernels="compiled", progress=False,
                        measure="never")
    eager = Explorer(bm, cluster="2xH100", progress=False, measure="never")
    assert compiled.session.costs.kernels == "compiled"
    assert eager.session.costs.kernels == "eager"
    assert "ops priced as compiled (fused) kernels" in compiled.status.header.value
    plan = eager.session.plan
    assert (ex.simulate(compiled.session.graph, plan, compiled.session.costs).step_s
            < ex.simulate(eager.session.graph, plan, eager.session.costs).step_s)
    # devices that are here are measured as they run; costs given say how they were priced
    with pytest.raises(ExplorerError, match="cpu:0 here are measured as they run"):
        Explorer(bm, cluster="cpu:1", kernels="compiled", progress=False)
    with pytest.raises(ExplorerError, match="give one or the other"):
        Explorer(compiled.session.graph, compiled.session.costs, kernels="compiled",
                 progress=False)
    with pytest.raises(ExplorerError, match="kernels must be one of"):
        Explorer(bm, cluster="2xH100", kernels="fused", progress=False)
