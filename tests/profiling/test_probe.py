"""The per-message processor cost between CPU ranks, measured once per host."""

from __future__ import annotations

import pytest
from builders import host_cache_without

import explorer as ex
from explorer.profiling import dtensor_probe
from explorer.profiling import host as probe

# the probe runs real steps on two CPU ranks
pytestmark = pytest.mark.slow


def test_measured_through_the_runtime_on_two_ranks():
    messages, extra_busy_s = probe.message_probe(steps=4, warmup=2)
    # two stages x four micro-batches: activations forward and gradients back, both ends
    assert messages >= 2 * 2 * 4
    # tens to hundreds of microseconds per message end on a real machine, not seconds
    assert abs(extra_busy_s) / messages < 5e-3


def test_profile_sets_it_once_per_host_and_caches_it(tmp_path, monkeypatch):
    host_cache_without(tmp_path, monkeypatch, probe.PROBE_KEY)
    probe.forget_message_s()
    calls = []
    monkeypatch.setattr(probe, "measure_message_s",
                        lambda pool=None, runtime=None: calls.append(1) or 1.25e-4)
    # (the model's own split runs, four runs on ranks started for each, are not what this
    # test is about: test_dtensor_probe runs them for real)
    monkeypatch.setattr(dtensor_probe, "model_dtensor_costs", lambda *a, **kw: {})
    bm = ex.builtin_model("mlp", "tiny")
    g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
    cl = ex.Cluster.cpu(2)
    assert ex.profile(g, cl, progress=False).message_s == 1.25e-4
    probe.forget_message_s()  # a new process reads the cache file
    assert ex.profile(g, cl, progress=False).message_s == 1.25e-4
    assert calls == [1]
    # no probe for nominal ranks, one rank, presets, or when asked not to
    assert ex.profile(g, ex.Cluster.cpu(2, measure=False), progress=False).message_s == 0.0
    assert ex.profile(g, ex.Cluster.cpu(1), progress=False).message_s == 0.0
    assert ex.profile(g, ex.Cluster.preset("2xH100"), progress=False).message_s == 0.0
    assert ex.profile(g, cl, progress=False, message=False).message_s == 0.0


def test_a_probe_that_fails_leaves_the_cost_at_zero(tmp_path, monkeypatch):
    host_cache_without(tmp_path, monkeypatch, probe.PROBE_KEY)
    probe.forget_message_s()

    def broken(pool=None, runtime=None):
        raise RuntimeError("no ranks today")

    monkeypatch.setattr(probe, "measure_message_s", broken)
    assert probe.cpu_message_s(ex.Cluster.cpu(2)) == 0.0
