"""The profiler: measured numbers on CPU ranks, roofline elsewhere, a cache per graph and device.

A real measurement runs the graph through the runtime in a worker process (seconds), so the
module measures once, into a cache folder of its own, and the cache tests stand a fake
measurement in for the real one.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import types
import warnings

import pytest
import torch

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.costs.model import DeviceCosts, roofline
from explorer.devices.cluster import Cluster
from explorer.platforms import CPU_PLATFORM, NO_PLATFORM
from explorer.platforms.cpu import rank_settings_tag
from explorer.platforms.load import HostLoad
from explorer.runtime import RankPool

ops = importlib.import_module("explorer.profiling.ops")
profile_cache = importlib.import_module("explorer.profiling.profile_cache")
host = importlib.import_module("explorer.profiling.host")
profiler = importlib.import_module("explorer.profiling.profiler")
dtensor_probe = importlib.import_module("explorer.profiling.dtensor_probe")
collective_probe = importlib.import_module("explorer.profiling.collective_probe")
checkpoint_probe = importlib.import_module("explorer.profiling.checkpoint_probe")
recheck = importlib.import_module("explorer.profiling.recheck")
FAST = {"repeats": 2, "warmup": 1, "progress": False}
CPU_KEY = Cluster.cpu(1, measure=False).devices[0].type_key


@pytest.fixture(scope="module")
def gpt() -> ex.OpGraph:
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """This module's own profile cache, empty at the start."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        yield root / "partition-explorer" / "profiles"


@pytest.fixture(scope="module")
def measured(gpt, module_cache):
    """gpt profiled on two CPU ranks for real, and the torch thread count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        costs = ex.profile(gpt, Cluster.cpu(2, measure=False), **FAST)
        return costs, torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty profile cache for one test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "partition-explorer" / "profiles"


@pytest.fixture
def fake(monkeypatch):
    """Replace the real measurement: every op 1 ms forward, 2 ms backward; calls are counted."""
    calls = []

    def measure(graph, dev, repeats, warmup, progress, pool=None, report=None, first=None,
                runtime="segments"):
        calls.append((dev.id, repeats))
        ops = [n.kind == "op" for n in graph.nodes]
        return DeviceCosts(dev.type_key, [1e-3 * o for o in ops], [2e-3 * o for o in ops],
                           ["measured" if o else "free" for o in ops], 1e-6, runtime=runtime)

    monkeypatch.setattr(ops, "measure", measure)
    # the re-check's look at a few ops steady too, as on a quiet host: whether a cache entry
    # is used must not depend on how busy this machine is between two profiles (the re-check
    # itself is tested with looks of its own, TestLoadAndRecheck)
    monkeypatch.setattr(recheck, "look", lambda graph, dev, nodes, meter=None, **kw:
                        recheck.Look((1e-4,) * len(nodes), (1e-4,) * len(nodes))
                        if nodes else None)
    return calls


def _no_measuring(*args, **kwargs):
    raise AssertionError("measured again instead of reading the cache")


@pytest.mark.slow
class TestMeasured:
    def test_every_op_measured(self, gpt, measured):
        costs, _ = measured
        for i, n in enumerate(gpt.nodes):
            if n.kind == "op":
                assert costs.source(i, "cpu:0") == "measured"
                assert costs.fwd_s(i, "cpu:0") > 0, n.name
            else:
                assert costs.source(i, "cpu:0") == "free"
                assert costs.fwd_s(i, "cpu:0") == costs.bwd_s(i, "cpu:0") == 0.0
        costs.check(gpt)

    def test_backward_only_where_a_gradient_flows(self, gpt, measured):
        costs, _ = measured
        ops = [(i, n) for i, n in enumerate(gpt.nodes) if n.kind == "op"]
        no_grad = [i for i, n in ops if not n.requires_grad]
        assert no_grad  # arange, sizes of the token batch
        assert [costs.bwd_s(i, "cpu:0") for i in no_grad] == [0.0] * len(no_grad)
        assert [n.name for i, n in ops if n.requires_grad and costs.bwd_s(i, "cpu:0") <= 0] \
            == []

    def test_cpu_ranks_share_one_profile(self, gpt, measured):
        costs, _ = measured
        assert list(costs.per_type) == [CPU_KEY]
        i = gpt.index[gpt.loss]
        assert costs.fwd_s(i, "cpu:0") == costs.fwd_s(i, "cpu:1")

    def test_optimizer_and_overhead_measured(self, measured):
        dc = measured[0].per_type[CPU_KEY]
        assert set(dc.optimizer_s_per_byte) == {"sgd", "momentum", "adam", "adamw"}
        assert dc.overhead_s > 0
        assert dc.optimizer_s_per_byte["adam"] + dc.optimizer_s_per_tensor["adam"] > 0

    def test_threads_restored(self, measured):
        assert measured[1] == 2

    def test_cpu_ranks_measured_with_one_thread(self):
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            with pytest.raises(RuntimeError, match="boom"), \
                    ops.device_threads(Cluster.cpu(1, measure=False).devices[0]):
                assert torch.get_num_threads() == 1
                raise RuntimeError("boom")
            assert torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(before)

    @pytest.mark.parametrize("micro_batches", [1, 2])
    def test_op_times_add_up_to_the_median_step(self, gpt, monkeypatch, micro_batches):
        run_mod = importlib.import_module("explorer.runtime.launch")
        real, runs = run_mod.run, []

        def recording(*args, **kwargs):
            runs.append(real(*args, **kwargs))
            return runs[-1]

        monkeypatch.setattr(run_mod, "run", recording)
        dev = Cluster.cpu(1, measure=False).devices[0]
        fwd, bwd, opt = ops.measure_in_runtime(gpt, dev, 3, 1, False, micro_batches)
        (meas,) = runs
        busy = meas.busy_s[dev.id]
        assert micro_batches * (sum(fwd) + sum(bwd)) + opt == pytest.approx(busy, rel=1e-9)
        # one factor for every op: the medians' proportions stand. The factor itself is near 1
        # on a quiet host; on a loaded one a step's busy time runs well past its ops' medians
        # (a rank taken off its core mid-step), so only a gross error is refused here
        k = opt / meas.task_s["optimizer:-1"]
        assert 0.5 < k < 3.0
        for i in range(len(gpt)):
            assert fwd[i] == pytest.approx(meas.task_s.get(f"fwd:{i}", 0.0) * k, rel=1e-9)
            assert bwd[i] == pytest.approx(meas.task_s.get(f"bwd:{i}", 0.0) * k, rel=1e-9)

    def test_runs_in_rounds_and_averages_them(self, gpt, monkeypatch):
        calls = []

        def fake_run(graph, dev, repeats, warmup, progress, micro_batches=1, pool=None,
                     runtime="ops"):
            calls.append(micro_batches)
            slow = 1.0 + 0.5 * (len(calls) > 3)  # the host slows down in the second round
            ops = [slow * (n.kind == "op") * 1e-3 / micro_batches for n in graph.nodes]
            return ops, [2 * t for t in ops], slow * 1e-3

        monkeypatch.setattr(ops, "measure_in_runtime", fake_run)
        monkeypatch.setattr(ops, "ROUNDS", 2)
        dc = ops.measure(gpt, Cluster.cpu(1, measure=False).devices[0], 2, 0, False,
                         runtime="ops")
        assert calls == [1, 2, 4, 1, 2, 4]  # in turn: a slow spell lands on every split
        i = gpt.index[gpt.loss]
        assert dc.fwd_s[i] == pytest.approx(1.25e-3) and dc.bwd_s[i] == pytest.approx(2.5e-3)
        assert dc.fractions == [0.5, 0.25]
        assert dc.fwd_at[1][i] == pytest.approx(1.25e-3 / 4)

    def test_a_precision_is_timed_in_rounds_beside_fp32(self, gpt, monkeypatch):
        # each round times fp32 then bf16 back to back; the ratio of the two scales the fp32
        # profile the times go with, even if that was measured at a slower moment
        calls = []

        def fake_run(graph, dev, repeats, warmup, progress, micro_batches=1, pool=None,
                     precision="fp32"):
            calls.append(precision)
            slow = 1.0 + (len(calls) > 2)  # the host slows down in the second round
            k = slow * (3.0 if precision == "bf16" else 1.0)
            ops_ = [k * (n.kind == "op") * 1e-3 for n in graph.nodes]
            return ops_, [2 * t for t in ops_], 1e-3

        monkeypatch.setattr(ops, "measure_in_runtime", fake_run)
        monkeypatch.setattr(ops, "ROUNDS", 2)
        ones = [5e-3 * (n.kind == "op") for n in gpt.nodes]
        base = DeviceCosts(CPU_KEY, ones, ones, ["measured"] * len(gpt), 1e-6)
        fwd, bwd = ops.measure_precision(gpt, Cluster.cpu(1, measure=False).devices[0],
                                         "bf16", base, 2, 0)
        assert calls == ["fp32", "bf16", "fp32", "bf16"]
        i = gpt.index[gpt.loss]
        assert fwd[i] == pytest.approx(15e-3) and bwd[i] == pytest.approx(15e-3)
        assert fwd[gpt.index[next(n.name for n in gpt.nodes if n.kind == "input")]] == 0.0

    def test_bf16_measured_beside_the_profile(self, gpt, measured, module_cache):
        # (the module's cached profile is put back as it was: other tests compare with it)
        (entry,) = module_cache.iterdir()
        kept = entry.read_text()
        try:
            costs = ex.profile(gpt, Cluster.cpu(2, measure=False), precisions=("bf16",),
                               **FAST)
        finally:
            entry.write_text(kept)
        fwd, bwd = costs.per_type[CPU_KEY].precision_s["bf16"]
        timed = [i for i, n in enumerate(gpt.nodes) if n.kind == "op"]
        assert all(fwd[i] > 0 for i in timed)
        assert sum(bwd) > 0
        plan = ex.Plan.single(gpt, "cpu:0").with_memory(precision="bf16")
        f, b = costs.precision_factors(gpt, "cpu:0", "bf16")
        assert ex.simulate(gpt, plan, costs).step_s > 0 and (f != 1).any() and (b != 1).any()

    def test_bad_repeats(self, gpt):
        cl = Cluster.cpu(1, measure=False)
        with pytest.raises(ExplorerError, match="repeats must be >= 1"):
            ex.profile(gpt, cl, repeats=0, progress=False)
        with pytest.raises(ExplorerError, match="warmup >= 0"):
            ex.profile(gpt, cl, warmup=-1, progress=False)


class TestCache:
    @pytest.mark.slow
    def test_second_call_is_read_from_the_cache(self, gpt, measured, module_cache,
                                                monkeypatch):
        files = [p.name for p in module_cache.iterdir()]
        tag = rank_settings_tag()
        assert files == [f"{gpt.fingerprint}-cpu_CPU_rank_1_thread_-r2{tag}-segments.json"]
        monkeypatch.setattr(ops, "measure", _no_measuring)
        again = ex.profile(gpt, Cluster.cpu(2, measure=False), **FAST)
        assert again == measured[0]

    def test_cache_false_measures_again(self, gpt, fake, cache):
        cl = Cluster.cpu(1, measure=False)
        ex.profile(gpt, cl, **FAST)
        ex.profile(gpt, cl, **FAST)
        assert len(fake) == 1
        ex.profile(gpt, cl, cache=False, **FAST)
        assert fake == [("cpu:0", 2), ("cpu:0", 2)]

    def test_other_repeats_are_another_entry(self, gpt, fake, cache):
        cl = Cluster.cpu(1, measure=False)
        ex.profile(gpt, cl, **FAST)
        ex.profile(gpt, cl, repeats=3, warmup=0, progress=False)
        assert fake == [("cpu:0", 2), ("cpu:0", 3)]
        tag = rank_settings_tag()
        assert sorted(p.name.rsplit("-r", 1)[1] for p in cache.iterdir()) == [
            f"2{tag}-segments.json", f"3{tag}-segments.json"]

    @pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins cores on Linux only")
    def test_pinned_and_unpinned_ranks_are_profiled_apart(self, gpt, fake, cache, monkeypatch):
        monkeypatch.setenv("EXPLORER_MALLOC", "0")
        cl = Cluster.cpu(1, measure=False)
        ex.profile(gpt, cl, **FAST)
        monkeypatch.setenv("EXPLORER_PIN", "0")
        ex.profile(gpt, cl, **FAST)
        ex.profile(gpt, cl, **FAST)
        assert len(fake) == 2
        assert sorted(p.name.endswith("-r2-pinned-segments.json") for p in cache.iterdir()) == [
            False, True]

    @pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
    def test_ranks_that_hold_freed_memory_are_profiled_apart(self, gpt, fake, cache,
                                                             monkeypatch):
        cl = Cluster.cpu(1, measure=False)
        monkeypatch.setenv("EXPLORER_PIN", "0")
        ex.profile(gpt, cl, **FAST)
        monkeypatch.setenv("EXPLORER_MALLOC", "0")
        ex.profile(gpt, cl, **FAST)
        ex.profile(gpt, cl, **FAST)
        assert len(fake) == 2
        assert sorted(p.name.rsplit("-r", 1)[1] for p in cache.iterdir()) == [
            "2-held-segments.json", "2-segments.json"]

    @pytest.mark.parametrize("damage", ["{not json", json.dumps({"version": 1}),
                                        json.dumps({"version": 999, "torch": "x"})])
    def test_damaged_or_old_entry_is_measured_again(self, gpt, fake, cache, damage):
        cl = Cluster.cpu(1, measure=False)
        ex.profile(gpt, cl, **FAST)
        (entry,) = cache.iterdir()
        entry.write_text(damage)
        costs = ex.profile(gpt, cl, **FAST)
        assert len(fake) == 2
        assert costs.fwd_s(gpt.index[gpt.loss], "cpu:0") == pytest.approx(1e-3)
        assert json.loads(entry.read_text())["version"] == profile_cache.PROFILE_VERSION
        assert [p.name for p in cache.iterdir()] == [entry.name]  # no .tmp left behind

    def test_precisions_are_measured_once_and_kept_with_the_profile(self, gpt, fake, cache,
                                                                     monkeypatch):
        timed = []

        def measure_precision(graph, dev, precision, base, *args, **kwargs):
            timed.append(precision)
            return [[2 * t for t in base.fwd_s], [2 * t for t in base.bwd_s]]

        monkeypatch.setattr(ops, "measure_precision", measure_precision)
        cl = Cluster.cpu(1, measure=False)
        ex.profile(gpt, cl, **FAST)
        costs = ex.profile(gpt, cl, precisions=("bf16",), **FAST)
        again = ex.profile(gpt, cl, precisions=("bf16",), **FAST)
        assert len(fake) == 1 and timed == ["bf16"]  # the fp32 profile and bf16 from cache
        assert again.per_type[CPU_KEY].precision_s == costs.per_type[CPU_KEY].precision_s
        plan = ex.Plan.single(gpt, "cpu:0")
        assert ex.simulate(gpt, plan.with_memory(precision="bf16"), again).step_s \
            == pytest.approx(2 * ex.simulate(gpt, plan, again).step_s, rel=0.05)
        with pytest.raises(ExplorerError, match="use bf16 or fp16"):
            ex.profile(gpt, cl, precisions=("fp8",), **FAST)

    def test_unwritable_cache_does_not_stop_profiling(self, gpt, fake, tmp_path, monkeypatch):
        blocker = tmp_path / "file"
        blocker.write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where a folder should be
        costs = ex.profile(gpt, Cluster.cpu(1, measure=False), **FAST)
        assert costs.source(gpt.index[gpt.loss], "cpu:0") == "measured"


class TestRoofline:
    def test_preset_cluster_gets_estimates(self, gpt, cache, monkeypatch):
        monkeypatch.setattr(ops, "measure", _no_measuring)
        cl = Cluster.preset("2xT4")
        costs = ex.profile(gpt, cl, progress=False)
        t4 = cl.devices[0]
        assert costs.per_type == {t4.type_key: roofline(gpt, t4)}
        assert {costs.source(i, "T4:1") for i, n in enumerate(gpt.nodes) if n.kind == "op"} \
            == {"roofline"}
        assert not cache.exists()  # estimates are not cached

    def test_graph_without_runtime_is_estimated(self, chain3, cache, monkeypatch):
        monkeypatch.setattr(ops, "measure", _no_measuring)
        costs = ex.profile(chain3, Cluster.cpu(1, measure=False), progress=False)
        assert costs.source(1, "cpu:0") == "roofline"

    @pytest.mark.slow
    def test_mixed_cluster(self, gpt, measured, monkeypatch):
        monkeypatch.setattr(ops, "measure", _no_measuring)  # the CPU part is in the cache
        # (its re-check cannot time ops here, so the entry is read as it is: a busy host
        # must not turn this read into a measurement; TestLoadAndRecheck tests the re-check)
        monkeypatch.setattr(recheck, "look", lambda *args, **kwargs: None)
        cpu = Cluster.cpu(1, measure=False)
        t4 = Cluster.preset("T4")
        cl = Cluster("cpu+T4", (*cpu.devices, *t4.devices), t4.default_link)
        costs = ex.profile(gpt, cl, **FAST)
        i = gpt.index[gpt.loss]
        assert costs.source(i, "cpu:0") == "measured"
        assert costs.fwd_s(i, "cpu:0") == measured[0].fwd_s(i, "cpu:0")
        assert costs.source(i, "T4:0") == "roofline"
        assert costs.fwd_s(i, "T4:0") == roofline(gpt, t4.devices[0]).fwd_s[i]
        assert sorted(costs.per_type) == sorted([CPU_KEY, t4.devices[0].type_key])


@pytest.mark.slow
class TestContention:
    @pytest.fixture(scope="class")
    def ranks(self):
        """Two rank processes shared by the class's real contention runs (a profile runs
        them on a pool of two ranks too)."""
        with RankPool(2) as pool:
            yield pool

    @pytest.fixture(scope="class")
    def measured_host(self, tmp_path_factory):
        """This host measured once for real (its compute, copy and link runs, in a cache
        folder of its own), as clusters of two ranks and of one; each test profiles on them
        with a profile cache of its own."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("host")))
            return Cluster.cpu(2), Cluster.cpu(1)

    @pytest.mark.parametrize("runtime", ["segments", "ops"])
    def test_measured_on_two_real_ranks(self, runtime, ranks):
        bm = ex.builtin_model("mlp", "tiny")
        g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
        devices = list(Cluster.cpu(2, measure=False).devices)
        ratios, spread, opt = host.measure_contention(g, devices, repeats=3, warmup=1,
                                                      progress=False, runtime=runtime,
                                                      pool=ranks)
        assert len(ratios) == len(g)
        assert all(0.5 <= r <= 4.0 for r in ratios)
        # in segments no op is timed apart: each slows as the whole model did
        assert (len(set(ratios)) == 1) == (runtime == "segments")
        assert 0.5 <= opt <= 4.0 and opt != 1.0  # measured, not the default
        # the busier of two ranks is above their mean, by less than the mean itself
        assert 0.0 < spread < 1.0

    def test_profile_measures_it_once_for_a_measured_host(self, gpt, fake, cache, monkeypatch,
                                                          measured_host):
        calls = []
        monkeypatch.setattr(host, "measure_contention",
                            lambda g, ranks, *a, **kw: calls.append([d.id for d in ranks])
                            or ([1.25] * len(g), 0.05, 1.3))
        monkeypatch.setattr("explorer.profiling.host.cpu_message_s", lambda cl, **kw: 0.0)
        monkeypatch.setattr(dtensor_probe, "dtensor_costs", lambda *a, **kw: {})
        monkeypatch.setattr(dtensor_probe, "model_dtensor_costs", lambda *a, **kw: {})
        monkeypatch.setattr(collective_probe, "collective_costs", lambda *a, **kw: 0.0)
        monkeypatch.setattr(checkpoint_probe, "checkpoint_costs", lambda *a, **kw: {})
        two, one = measured_host
        costs = ex.profile(gpt, two, **FAST)
        assert costs.per_type[CPU_KEY].contention == [1.25] * len(gpt)
        assert costs.per_type[CPU_KEY].replica_spread == 0.05
        assert calls == [["cpu:0", "cpu:1"]]
        again = ex.profile(gpt, two, **FAST)  # read back from the cache with the profile
        assert again.per_type[CPU_KEY].contention == [1.25] * len(gpt)
        assert again.per_type[CPU_KEY].replica_spread == 0.05
        assert again.per_type[CPU_KEY].optimizer_contention == 1.3
        assert len(calls) == 1 and len(fake) == 1
        # not for one rank, nor for nominal ranks (no host measurements)
        assert ex.profile(gpt, one, cache=False, **FAST).per_type[
            CPU_KEY].contention == []
        assert ex.profile(gpt, Cluster.cpu(2, measure=False), cache=False, **FAST).per_type[
            CPU_KEY].contention == []
        assert len(calls) == 1

    def test_split_costs_fitted_on_the_model_are_kept_with_the_profile(self, gpt, fake, cache,
                                                                        monkeypatch,
                                                                        measured_host):
        """What a two-way split adds is fitted on the model's own split run where that
        works, stored with its profile; the host probe's figures (measured only then) where
        it does not."""
        model = dict.fromkeys(dtensor_probe.KEYS, 2e-3)
        probe = dict.fromkeys(dtensor_probe.KEYS, 1e-3)
        fits, probes = [], []
        monkeypatch.setattr(host, "measure_contention",
                            lambda g, ranks, *a, **kw: ([1.0] * len(g), 0.0, 1.0))
        monkeypatch.setattr("explorer.profiling.host.cpu_message_s", lambda cl, **kw: 0.0)
        monkeypatch.setattr(dtensor_probe, "dtensor_costs",
                            lambda *a, **kw: probes.append(1) or probe)
        monkeypatch.setattr(dtensor_probe, "model_dtensor_costs",
                            lambda g, dc, report=None: fits.append(g.name) or model)
        monkeypatch.setattr(collective_probe, "collective_costs", lambda *a, **kw: 0.0)
        monkeypatch.setattr(checkpoint_probe, "checkpoint_costs", lambda *a, **kw: {})
        two, _ = measured_host
        assert ex.profile(gpt, two, **FAST).per_type[CPU_KEY].dtensor == model
        assert ex.profile(gpt, two, **FAST).per_type[CPU_KEY].dtensor == model  # cached
        assert fits == [gpt.name] and probes == []  # (the host probe not needed)
        monkeypatch.setattr(dtensor_probe, "model_dtensor_costs", lambda *a, **kw: {})
        assert ex.profile(gpt, two, cache=False, **FAST).per_type[CPU_KEY].dtensor == probe
        assert probes == [1]

    def test_a_failed_measurement_leaves_it_out_with_a_warning(self, gpt, fake, cache,
                                                               monkeypatch, measured_host):
        from explorer.runtime.watch import RunFailed

        def broken(*args, **kwargs):
            raise RunFailed("rank 1 (cpu:1) was killed by SIGKILL")

        monkeypatch.setattr(host, "measure_contention", broken)
        monkeypatch.setattr("explorer.profiling.host.cpu_message_s", lambda cl, **kw: 0.0)
        monkeypatch.setattr(dtensor_probe, "dtensor_costs", lambda *a, **kw: {})
        monkeypatch.setattr(dtensor_probe, "model_dtensor_costs", lambda *a, **kw: {})
        monkeypatch.setattr(collective_probe, "collective_costs", lambda *a, **kw: 0.0)
        monkeypatch.setattr(checkpoint_probe, "checkpoint_costs", lambda *a, **kw: {})
        with pytest.warns(UserWarning, match="slow each other.*SIGKILL"):
            costs = ex.profile(gpt, measured_host[0], **FAST)
        assert costs.per_type[CPU_KEY].contention == []
        assert costs.source(gpt.index[gpt.loss], "cpu:0") == "measured"


class TestSharedRanks:
    """A profile's runs share rank processes (a RankPool) ended when the profile is done."""

    @pytest.fixture
    def runs(self, monkeypatch, cache):
        """Stand-in runs (none started): each records the pool it was given."""
        got = []

        def run(graph, plan, pool=None, **kwargs):
            got.append((len(plan.devices), pool))
            ids = plan.devices
            return types.SimpleNamespace(task_s={"fwd:1": 1e-3}, busy_s={},
                                         busy_samples_s={d: (1e-3,) for d in ids})

        monkeypatch.setattr("explorer.runtime.launch.run", run)
        monkeypatch.setattr(host, "cpu_message_s",
                            lambda cl, pool=None, report=None, runtime=None:
                            got.append(("message", pool)) or 0.0)
        monkeypatch.setattr(dtensor_probe, "dtensor_costs",
                            lambda cl, cache, pool=None, report=None:
                            got.append(("dtensor", pool)) or {"op_fwd_s": 1e-4})
        # (the model's split runs start ranks of their own, as ex.run does: not one of these)
        monkeypatch.setattr(dtensor_probe, "model_dtensor_costs", lambda *a, **kw: {})
        monkeypatch.setattr(collective_probe, "collective_costs",
                            lambda cl, cache, pool=None, report=None:
                            got.append(("collective", pool)) or 2e-4)
        monkeypatch.setattr(checkpoint_probe, "checkpoint_costs",
                            lambda cl, cache, pool=None, report=None:
                            got.append(("checkpoint", pool)) or {"span_fwd_s": 1e-4})
        return got

    @pytest.fixture
    def host2(self):
        """Two CPU ranks as if this host's link were measured (nothing is)."""
        two = Cluster.cpu(2, measure=False)
        return dataclasses.replace(two, default_link=dataclasses.replace(
            two.default_link, source="measured (stand-in)"))

    def test_every_run_of_a_profile_on_one_pool(self, gpt, runs, host2, monkeypatch):
        closed = []
        monkeypatch.setattr(RankPool, "close", lambda self: closed.append(self))
        said = []
        costs = ex.profile(gpt, host2, report=said.append, **FAST)
        pools = {id(p) for _, p in runs}
        assert len(pools) == 1 and runs[0][1] is not None
        assert [n for n, _ in runs] == [1] * 9 + [1, 2] * 2 + ["message", "dtensor",
                                                               "collective", "checkpoint"]
        assert costs.per_type[CPU_KEY].dtensor == {"op_fwd_s": 1e-4}
        assert costs.per_type[CPU_KEY].collective_s == 2e-4
        assert costs.per_type[CPU_KEY].checkpoint == {"span_fwd_s": 1e-4}
        assert closed == [runs[0][1]] and runs[0][1].size == 2
        # how far it is, in words, for a widget: the whole profile's runs, counted before the
        # first (9 op timing: 3 on the op path, 6 in segments; 4 contention, 4 of the model
        # split two ways, stood in for here)
        assert said == [f"profiling gpt on cpu:0: {k} of 17 runs" for k in range(10)] + [
            f"contention of gpt on cpu:0+cpu:1: {k} of 17 runs" for k in range(9, 14)]

    @pytest.mark.parametrize("runtime,first_runs,total,first_s,final_s", [
        # the op path: its first run alone (2 ms), then the mean of the rounds
        ("ops", 1, 14, 2e-3, 1.5e-3),
        # segments: the first op-path run fitted to the first segment run (0.6 ms), then to
        # the mean of the segment rounds (9 op timing runs: 3 on the op path, 6 in segments)
        ("segments", 2, 17, 0.6e-3, 0.8e-3)])
    def test_preliminary_numbers_after_the_first_run_final_ones_unchanged(
            self, gpt, runs, host2, cache, monkeypatch, runtime, first_runs, total, first_s,
            final_s):
        stand_in = ex.runtime.launch.run

        def first_runs_differ(graph, plan, **kwargs):  # 2 ms on the op path's first run,
            meas = stand_in(graph, plan, **kwargs)   # 0.6 ms in the first segment run, else 1
            if len(runs) == 1:
                meas.task_s = {"fwd:1": 2e-3}
            if len(runs) == 2 and kwargs.get("runtime") == "segments":
                meas.task_s = {"fwd:1": 0.6e-3}
            return meas

        monkeypatch.setattr("explorer.runtime.launch.run", first_runs_differ)
        early = []
        final = ex.profile(gpt, host2, partial=lambda pre: early.append((pre, len(runs))),
                           runtime=runtime, **FAST)
        [(pre, runs_then)] = early
        assert runs_then == first_runs  # told after the first run(s), before the others
        # op timing, 4 contention, 4 of the model split two ways
        assert (pre.runs_done, pre.runs_total) == (first_runs, total)
        assert pre.label == f"preliminary: {first_runs} of {total} runs"
        dc = pre.costs.per_type[CPU_KEY]
        assert dc.fwd_s[1] == pytest.approx(first_s)
        assert dc.source[gpt.index[gpt.loss]] == "measured" and dc.runtime == runtime
        assert dc.fractions == [] and dc.contention == []  # not measured yet
        pre.costs.check(gpt)
        # the final profile: every run, as without ``partial``; only it is cached
        assert final.per_type[CPU_KEY].fwd_s[1] == pytest.approx(final_s)
        assert final.per_type[CPU_KEY].fractions == [0.5, 0.25]
        runs.clear()
        alone = ex.profile(gpt, host2, cache=False, runtime=runtime, **FAST).per_type[CPU_KEY]
        timed_here = ("overhead_s", "optimizer_s_per_byte", "optimizer_s_per_tensor")
        for f in dataclasses.fields(DeviceCosts):  # those timed in this process aside
            if f.name not in timed_here:
                assert getattr(alone, f.name) == getattr(final.per_type[CPU_KEY], f.name)
        cached = profile_cache.load(
            profile_cache.cache_path(gpt, host2.devices[0], FAST["repeats"], runtime), len(gpt))
        # (DTensor's, ZeRO's collective and checkpointing costs are host measurements,
        # cached apart and set on every profile)
        assert cached == dataclasses.replace(final.per_type[CPU_KEY], dtensor={},
                                             collective_s=0.0, checkpoint={})

    def test_no_preliminary_numbers_from_the_cache(self, gpt, runs, host2, cache):
        ex.profile(gpt, host2, **FAST)
        early = []
        ex.profile(gpt, host2, partial=early.append, **FAST)
        assert early == []

    def test_each_run_on_its_own_processes_when_asked(self, gpt, runs, host2, monkeypatch):
        monkeypatch.setattr(profiler, "REUSE_RANKS", False)
        ex.profile(gpt, host2, **FAST)
        assert {p for _, p in runs} == {None}


class TestLoadAndRecheck:
    """A profile records how busy the host was; a cached one is re-checked before use."""

    @pytest.fixture
    def looks(self, monkeypatch):
        """Stand-in looks at the re-check's ops (nothing timed): each op takes ``wall`` and
        ``cpu`` seconds, as set; the looks are counted."""
        state = {"wall": 1e-4, "cpu": 1e-4, "looks": 0}

        def look(graph, dev, nodes, meter=None, budget_s=recheck.RECHECK_BUDGET_S):
            state["looks"] += 1
            if meter is not None:  # as a loop that got cpu/wall of its core
                meter.wall_s += state["wall"] * len(nodes)
                meter.cpu_s += state["cpu"] * len(nodes)
            return recheck.Look((state["wall"],) * len(nodes), (state["cpu"],) * len(nodes))

        monkeypatch.setattr(recheck, "look", look)
        monkeypatch.setattr(ops, "load_per_core", lambda: 0.25)  # a quiet host's
        return state

    @staticmethod
    def _said(caught, what: str) -> list[str]:
        return [str(w.message) for w in caught if what in str(w.message)]

    def _profile(self, gpt, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            costs = ex.profile(gpt, Cluster.cpu(1, measure=False), **FAST, **kwargs)
        return costs, caught

    def test_the_reference_ops_are_the_largest_and_run_alone(self, gpt):
        nodes = recheck.reference_nodes(gpt)
        assert len(nodes) == recheck.RECHECK_OPS
        flops = sorted((n.fwd_flops for n in gpt.nodes if n.kind == "op"), reverse=True)
        assert sorted(gpt.nodes[i].fwd_flops for i in nodes) == sorted(
            flops[:recheck.RECHECK_OPS])
        got = recheck.look(gpt, Cluster.cpu(1, measure=False).devices[0], nodes)
        assert got is not None and all(t > 0 for t in got.wall_s + got.cpu_s)
        assert recheck.reference_nodes(ex.OpGraph("empty", [], batch_size=1)) == ()

    def test_a_busy_host_is_told_by_the_cpu_platform(self):
        quiet = HostLoad(cpu_share=0.98, load_per_core=0.5, cores=2)
        assert CPU_PLATFORM.busy_host(quiet) is None
        assert NO_PLATFORM.busy_host(HostLoad(0.3, 4.0, 2)) is None  # (neutral: never)
        assert "got 40% of a core" in CPU_PLATFORM.busy_host(HostLoad(0.4, 0.5, 2))
        assert "load average 3.0 per core" in CPU_PLATFORM.busy_host(HostLoad(0.5, 3.0, 2))
        # a high load average alone (it lags, and counts the run's own ranks of a moment
        # before) does not make a profile whose loops got all of their core a busy one
        assert CPU_PLATFORM.busy_host(HostLoad(1.0, 3.0, 2)) is None

    def test_a_profile_measured_under_load_warns_and_records_it(self, gpt, fake, cache, looks):
        looks["wall"] = 2.5e-4  # the timing loops got 40 % of their core
        _, caught = self._profile(gpt)
        (said,) = self._said(caught, "busy machine")
        assert "got 40% of a core" in said and "cache=False" in said
        (entry,) = cache.iterdir()
        assert json.loads(entry.read_text())["load"]["cpu_share"] == pytest.approx(0.4)
        # used again while as busy (it holds by wall time): used, and said again
        _, caught = self._profile(gpt)
        assert len(fake) == 1 and "cached in" in self._said(caught, "busy machine")[0]

    def test_a_faithful_cached_profile_is_used_as_it_is(self, gpt, fake, cache, looks):
        first, caught = self._profile(gpt)
        assert not self._said(caught, "busy machine")
        looks["wall"] = 3e-4  # busy now, but its ops take the processor time they took
        again, caught = self._profile(gpt)
        assert len(fake) == 1 and again == first
        assert not self._said(caught, "no longer holds")
        assert looks["looks"] == 3  # two when measured, one re-check

    @pytest.mark.parametrize("scaled", [3.0, 1 / 3])
    def test_a_cached_profile_far_off_is_measured_again(self, gpt, fake, cache, looks,
                                                        scaled):
        self._profile(gpt)
        (entry,) = cache.iterdir()
        d = json.loads(entry.read_text())
        d["fwd_s"] = [t * scaled for t in d["fwd_s"]]
        d["bwd_s"] = [t * scaled for t in d["bwd_s"]]
        entry.write_text(json.dumps(d))
        costs, caught = self._profile(gpt)
        (said,) = self._said(caught, "no longer holds")
        assert ("3.0x faster" if scaled > 1 else "3.0x slower") in said
        assert len(fake) == 2  # measured again, and replaced
        i = gpt.index[gpt.loss]
        assert costs.fwd_s(i, "cpu:0") == pytest.approx(1e-3)
        assert json.loads(entry.read_text())["fwd_s"][i] == pytest.approx(1e-3)

    def test_a_profile_measured_busy_is_measured_again_once_quiet(self, gpt, fake, cache,
                                                                  looks):
        looks["wall"] = 3e-4  # its ops (and so its times) took 3x their processor time
        self._profile(gpt)
        looks["wall"] = 1e-4  # quiet now
        _, caught = self._profile(gpt)
        assert len(fake) == 2 and "3.0x faster" in self._said(caught, "no longer holds")[0]
        _, caught = self._profile(gpt)  # and the new one holds
        assert len(fake) == 2 and not self._said(caught, "busy machine")
