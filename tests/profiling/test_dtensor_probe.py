"""The DTensor cost probe's fit: per kind of op, the median of measured less simulated."""

from __future__ import annotations

import dataclasses

import pytest
from builders import tiny_builtin_graph

import explorer as ex
from explorer.core.tensor_layout import megatron_layout
from explorer.profiling import dtensor_probe
from explorer.profiling.dtensor_probe import KEYS, fit, probe_graph
from explorer.simulate.prediction import Interval


def test_fit_takes_medians_per_kind_of_op():
    g = probe_graph()
    plan = ex.Plan.from_assignment(g, [("cpu:0", "cpu:1")],
                                   {n.name: 0 for n in g.nodes if n.kind == "op"}
                                   ).with_tensor(2)
    lay = megatron_layout(g, 2)
    assert len(lay.reduce_forward) == 3 and len(lay.reduce_backward) == 2
    timeline, task_s = [], {}
    for i, n in enumerate(g.nodes):
        if n.kind != "op":
            continue
        reads = sum(p in lay.placements for p in n.inputs)  # split weights
        for kind, red, op_s in (("fwd", lay.reduce_forward, 0.1),
                                ("bwd", lay.reduce_backward, 0.2)):
            timeline.append(Interval("cpu:0", "compute", kind, 0.0, 1.0, n.name))
            # (split ops without a split weight run on plain shards: their extra is noise)
            extra = (op_s + (5.0 if n.name in red else 0.0) if reads and n.name in
                     lay.split_ops else 7.0 if n.name in lay.split_ops else 0.0)
            task_s[f"{kind}:{i}"] = 1.0 + extra
    timeline.append(Interval("cpu:0", "compute", "optimizer", 0.0, 1.0, "adam step"))
    params = sum(n.kind == "param" for n in g.nodes)
    task_s["optimizer:-1"] = 1.0 + 0.5 * params
    got = fit(g, plan, timeline, task_s)
    assert set(got) == set(KEYS)
    # (no unsplit op of the probe reads a split weight)
    assert got == pytest.approx({"op_fwd_s": 0.1, "op_bwd_s": 0.2, "collective_s": 5.0,
                                 "read_fwd_s": 0.0, "read_bwd_s": 0.0,
                                 "optimizer_tensor_s": 0.5, "step_s": 0.0})


def test_measured_once_per_host_afresh_when_asked_and_unknown_when_it_fails(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    value = dict.fromkeys(KEYS, 1e-4)
    monkeypatch.setattr(dtensor_probe, "measure_dtensor_costs",
                        lambda pool=None: calls.append(1) or value)
    nominal = ex.Cluster.cpu(2, measure=False)  # as if this host's link were measured
    two = dataclasses.replace(nominal, default_link=dataclasses.replace(
        nominal.default_link, source="measured (stand-in)"))
    assert dtensor_probe.dtensor_costs(two) == value
    assert dtensor_probe.dtensor_costs(two) == value and len(calls) == 1  # from the cache
    assert dtensor_probe.dtensor_costs(two, cache=False) == value and len(calls) == 2
    # no host measurements for one rank or nominal ranks
    assert dtensor_probe.dtensor_costs(ex.Cluster.cpu(1, measure=False)) == {}
    assert dtensor_probe.dtensor_costs(nominal) == {}

    def broken(pool=None):
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(dtensor_probe, "measure_dtensor_costs", broken)
    assert dtensor_probe.dtensor_costs(two, cache=False) == {}


def test_what_the_fit_misses_of_the_step_goes_to_the_collectives_and_the_step():
    g = probe_graph()
    plan = ex.Plan.from_assignment(g, [("cpu:0", "cpu:1")],
                                   {n.name: 0 for n in g.nodes if n.kind == "op"}
                                   ).with_tensor(2)
    two = plan.with_settings(micro_batches=2)
    value = dict.fromkeys(KEYS, 1e-3)
    # 3 forward and 2 backward all-reduces a step: 5 ms missed is 1 ms more each
    got = dtensor_probe.to_step(g, value, [(plan, 0.010, 0.015)])
    assert got == pytest.approx({**value, "collective_s": 2e-3, "step_s": 1e-3})
    # 5 collectives missed 7 ms, 10 of them 12 ms: 1 ms each, and 2 ms once a step
    got = dtensor_probe.to_step(g, value, [(plan, 0.010, 0.017), (two, 0.020, 0.032)])
    assert got == pytest.approx({**value, "collective_s": 2e-3, "step_s": 3e-3})
    # a step's part below nothing: all of it per collective (19 ms over 15)
    got = dtensor_probe.to_step(g, value, [(plan, 0.010, 0.013), (two, 0.020, 0.036)])
    assert got == pytest.approx({**value, "collective_s": 1e-3 + 19e-3 / 15, "step_s": 1e-3})
    # never below nothing
    assert dtensor_probe.to_step(g, value, [(plan, 0.020, 0.010)])["collective_s"] == 0.0


def test_model_costs_from_its_own_split_run(monkeypatch):
    """The tiny GPT split two ways on two real CPU ranks: every cost, at least 0; a graph
    that a two-way split leaves whole runs nothing; a run that fails leaves the host probe's
    figures (nothing from here)."""
    g = tiny_builtin_graph("gpt")
    dc = ex.profile(g, ex.Cluster.cpu(1), repeats=2, warmup=1, progress=False,
                    cache=False).per_type[ex.Cluster.cpu(1).devices[0].type_key]
    got = dtensor_probe.model_dtensor_costs(g, dc)
    assert set(got) == set(KEYS) and all(0.0 <= v < 1.0 for v in got.values())
    assert got["op_fwd_s"] > 0.0 or got["op_bwd_s"] > 0.0  # reading split weights costs

    def never(*args, **kwargs):
        raise AssertionError("ran")

    monkeypatch.setattr(dtensor_probe, "split_run_costs", never)
    resnet = tiny_builtin_graph("resnet")  # (its blocks' channels do not split two ways)
    assert not megatron_layout(resnet, 2).placements
    assert dtensor_probe.model_dtensor_costs(resnet, dc) == {}

    def broken(*args, **kwargs):
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(dtensor_probe, "split_run_costs", broken)
    assert dtensor_probe.model_dtensor_costs(g, dc) == {}
