"""The ZeRO collective probe: the ZeRO 3 run's step error beyond the plain run's, per collective
on a rank's path; measured once per host."""

from __future__ import annotations

import dataclasses

import pytest
from builders import costs, host_cache_without

import explorer as ex
from explorer.profiling import collective_probe
from explorer.profiling.collective_probe import fit, probe_graph
from explorer.runtime import RankPool
from explorer.simulate.simulator import simulate


def two_ranks() -> ex.Cluster:
    """Two CPU ranks as if this host's link were measured (nothing is)."""
    nominal = ex.Cluster.cpu(2, measure=False)
    return dataclasses.replace(nominal, default_link=dataclasses.replace(
        nominal.default_link, source="measured (stand-in)"))


def test_fit_is_the_extra_error_per_collective_on_the_path():
    g = probe_graph()
    cl = ex.Cluster.cpu(2, measure=False)
    c = costs(g, cl, {n.name: 1e-4 for n in g.nodes if n.kind == "op"},
              {n.name: 2e-4 for n in g.nodes if n.kind == "op"})
    plain = ex.Plan.from_assignment(g, [tuple(cl.ids)], {n.name: 0 for n in g.nodes})
    plans = (plain, plain.with_memory(zero=3))
    pred = [simulate(g, p, c).step_s for p in plans]
    # nine gather groups (each linear layer a top-level module of the Sequential), each
    # gathered in the forward and again in the backward, and the gradients' reduce-scatter
    # (one bucket): about 19 on the path (the simulator finds how many lengthen the step)
    per_call = 3e-4
    measured = [pred[0] + 1e-3, pred[1] + 1e-3 + 19 * per_call]
    assert fit(g, plans, c, measured) == pytest.approx(per_call, rel=0.02)
    # a ZeRO run no further off than the plain one: nothing to charge
    assert fit(g, plans, c, [pred[0] + 1e-3, pred[1]]) == 0.0


def test_measured_once_per_host_afresh_when_asked_and_unknown_when_it_fails(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(collective_probe, "measure_collective_s",
                        lambda pool=None: calls.append(1) or 2e-4)
    two = two_ranks()
    assert collective_probe.collective_costs(two) == 2e-4
    assert collective_probe.collective_costs(two) == 2e-4 and len(calls) == 1  # cached
    assert collective_probe.collective_costs(two, cache=False) == 2e-4 and len(calls) == 2
    # no host measurements for one rank or nominal ranks
    assert collective_probe.collective_costs(ex.Cluster.cpu(1, measure=False)) == 0.0
    assert collective_probe.collective_costs(ex.Cluster.cpu(2, measure=False)) == 0.0

    def broken(pool=None):
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(collective_probe, "measure_collective_s", broken)
    assert collective_probe.collective_costs(two, cache=False) == 0.0


@pytest.mark.slow
def test_the_probe_runs_on_two_cpu_ranks(tmp_path, monkeypatch):
    host_cache_without(tmp_path, monkeypatch, collective_probe.PROBE_KEY)
    with RankPool(1) as pool:  # (the profile's runs on it, as the profiler's are)
        value = collective_probe.measure_collective_s(steps=3, warmup=1, pool=pool, rounds=1,
                                                      repeats=2)
    assert 0.0 <= value < 0.1  # seconds per collective: a measurement, noise and all
