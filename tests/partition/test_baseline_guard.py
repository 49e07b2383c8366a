"""The registry's final check: no guarded partitioner's plan is slower than single or data-parallel.

Unit tests of :func:`explorer.partition.guard.never_slower` on hand-built cases (the note, pins,
memory), and hypothesis properties over every guarded partitioner on random layered DAGs and
random clusters (device count and speeds, link latency and bandwidth, memory).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import cluster, costs, device, graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.plan import Plan
from explorer.devices.cluster import Cluster
from explorer.devices.records import Link
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition import algorithm, algorithms, partition
from explorer.partition.guard import baseline_plans, broken_pins, never_slower
from explorer.simulate.simulator import simulate

GUARDED = [nm for nm in algorithms() if algorithm(nm).guarded]
#: refusals a partitioner may give for pins it cannot honour, by words in the message
PIN_REFUSALS = ("pin", "cycle")


def chain(n: int = 4, weight_bytes: int = 0):
    """x -> op0 -> ... -> op{n-1}, each op 1 s forward and 2 s backward; a weight on op0."""
    rows = [("x", "input", [], 8)]
    if weight_bytes:
        rows.append(("w", "param", [], weight_bytes))
    rows += [(f"op{i}", "op", [f"op{i - 1}" if i else "x"] + (["w"] if weight_bytes and not i
                                                            else []), 64) for i in range(n)]
    return graph(rows)


def chain_costs(g, cl):
    ops = [nd.name for nd in g.nodes if nd.kind == "op"]
    return costs(g, cl, dict.fromkeys(ops, 1.0), dict.fromkeys(ops, 2.0))


def split(g, cl) -> Plan:
    """Every op on its own device, round robin: only transfers added."""
    return Plan.from_assignment(g, [(d,) for d in cl.ids],
                                {i: i % len(cl) for i in range(len(g))}, algorithm="test")


def test_slower_plan_gives_way_to_the_fastest_baseline_with_a_note():
    g = chain()
    cl = cluster(2, latency_s=1.0)
    c = chain_costs(g, cl)
    own = split(g, cl)
    out = never_slower(g, c, own, "test", cl.ids)
    steps = {lb: simulate(g, p, c).step_s for lb, p in baseline_plans(g, cl.ids, None)}
    best = min(steps, key=steps.get)
    assert best == "data-parallel"  # replicas halve the work, no weights to all-reduce
    assert out.options["fallback"] == best and out.algorithm == "test"
    assert simulate(g, out, c).step_s == pytest.approx(steps[best])
    note = out.notes[-1]
    assert note.startswith("data-parallel is faster than test's own plan (2 stages on 2 "
                           "devices): 6,000.0 ms per step against 1")
    assert note.endswith("less), so this is the data-parallel plan")


def test_own_plan_kept_on_a_tie():
    g = chain()
    cl = cluster(2, latency_s=1.0)
    c = chain_costs(g, cl)
    plans = dict(baseline_plans(g, cl.ids, None, algorithm="test"))
    assert never_slower(g, c, plans["data-parallel"], "test", cl.ids) is plans["data-parallel"]
    assert never_slower(g, c, plans["single"], "test", cl.ids[:1]) is plans["single"]


def test_a_baseline_that_does_not_fit_is_no_fallback():
    # a weight too big for one device: single and data-parallel (a full replica each) are
    # over memory, so the slow split is returned as it is
    g = chain(weight_bytes=600 * 2**20)
    cl = cluster(2, latency_s=1.0, memory=2**30)
    c = chain_costs(g, cl)
    plans = dict(baseline_plans(g, cl.ids, None))
    assert not any(simulate(g, p, c).fits for p in plans.values())
    own = Plan.from_assignment(g, [("d:0",), ("d:1",)],
                               {i: int(nd.name in ("op2", "op3")) for i, nd in
                                enumerate(g.nodes)}, algorithm="test")
    assert never_slower(g, c, own, "test", cl.ids) is own


def test_a_baseline_that_breaks_a_pin_is_no_fallback():
    g = chain()
    cl = cluster(2, latency_s=1.0)
    c = chain_costs(g, cl)
    pins = {"op1": "d:1"}
    plans = dict(baseline_plans(g, cl.ids, pins))
    assert broken_pins(plans["data-parallel"], pins) == ["op1"]
    assert broken_pins(plans["single"], pins) == []
    # data-parallel (no transfers) would be the fastest, yet the fallback is single with op1
    # on d:1, still faster than the split
    assert simulate(g, plans["data-parallel"], c).step_s < simulate(g, plans["single"],
                                                                     c).step_s
    out = never_slower(g, c, split(g, cl), "test", cl.ids, pins)
    assert out.options["fallback"] == "single"
    assert out.devices_of("op1") == ("d:1",)
    assert "; data-parallel would break the pins (it runs op1 on every device" in out.notes[-1]


@pytest.mark.parametrize("name", GUARDED)
def test_registry_applies_it_and_the_switch_skips_it(name):
    """A slow link and a big weight: single is the fastest plan; with the partitioner's own
    baseline switch off, the registry returns its plan unchecked."""
    g = chain(weight_bytes=4_000_000)
    cl = cluster(3, latency_s=1e-3, bandwidth=1e6)
    c = chain_costs(g, cl)
    plan = partition(g, cl, c, name)
    single = simulate(g, partition(g, cl, c, "single"), c).step_s
    assert simulate(g, plan, c).step_s <= single * (1 + 1e-9)
    switch = next(s for s in ("compare_baselines", "baselines") if s in algorithm(name).options)
    assert "fallback" not in partition(g, cl, c, name, **{switch: False}).options


def random_cluster(draw, memory_bytes: int | None) -> Cluster:
    n = draw(st.integers(2, 5))
    speeds = [draw(st.sampled_from([1e9, 2e9, 5e9])) for _ in range(n)]
    link = Link(draw(st.sampled_from([0.0, 1e-5, 1e-3])),
                draw(st.sampled_from([1e6, 1e8, 1e10, float("inf")])), "test")
    devs = tuple(replace(device(i, memory_bytes or 2**34), flops_per_s=s,
                         half_flops_per_s=s, name=f"test dev {s:.0e}")
                 for i, s in enumerate(speeds))
    return Cluster(name=f"random:{n}", devices=devs, default_link=link)


@st.composite
def cases(draw, sizes, max_pins: int = 2):
    """(graph, cluster, pins): memory from 40 % to 4x what the whole model needs on one
    device, so single and data-parallel do not always fit."""
    g = layered_dag(draw(sizes), width=draw(st.integers(1, 8)),
                    fan_in=draw(st.integers(1, 3)), seed=draw(st.integers(0, 10**6)))
    roomy = random_cluster(draw, None)
    need = simulate(g, Plan.single(g, roomy.ids[0]), roofline_costs(g, roomy)).peak_bytes[
        roomy.ids[0]]
    factor = draw(st.sampled_from([0.4, 0.8, 1.2, 4.0]))
    cl = Cluster(roomy.name, tuple(replace(d, memory_bytes=int(need * factor))
                                   for d in roomy.devices), roomy.default_link)
    names = [nd.name for nd in g.nodes if nd.kind == "op"]
    pinned = draw(st.lists(st.sampled_from(names), max_size=max_pins, unique=True))
    return g, cl, {nm: draw(st.sampled_from(cl.ids)) for nm in pinned}


def check_never_slower(name, g, cl, pins):
    c = roofline_costs(g, cl)
    fitting = [lb for lb, base in baseline_plans(g, cl.ids, pins)
               if not broken_pins(base, pins) and simulate(g, base, c).fits]
    try:
        plan = partition(g, cl, c, name, pins=pins)
    except MemoryExceededError:
        assert not fitting, f"raised, yet {fitting} fits"
        return
    except ExplorerError as exc:
        if pins and any(w in str(exc).lower() for w in PIN_REFUSALS):
            return
        raise
    pred = simulate(g, plan, c)
    for label, base in baseline_plans(g, cl.ids, pins):
        other = simulate(g, base, c)
        if other.fits and not broken_pins(base, pins):
            assert pred.fits, (label, pred.memory_report())
            assert pred.step_s <= other.step_s * (1 + 1e-9), label
    if "fallback" in plan.options:
        assert pred.fits and any("faster than" in nt or "does not fit" in nt
                                 for nt in plan.notes)


@pytest.mark.parametrize("name", GUARDED)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(st.integers(2, 60)))
def test_never_slower_on_small_random_graphs_and_clusters(name, case):
    check_never_slower(name, *case)


@pytest.mark.slow
@pytest.mark.parametrize("name", GUARDED)
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(st.integers(500, 3000), max_pins=1))
def test_never_slower_on_medium_random_graphs_and_clusters(name, case):
    check_never_slower(name, *case)
