"""Every registered partitioner on random DAGs: valid plans, pins honoured, deterministic.

One module over ``explorer.partition.algorithms()``, so a partitioner added later is checked
too. Graphs are small random layered DAGs (``explorer.models.synthetic.layered_dag``) with random
pins on ops and weights.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from builders import cluster, costs, graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from explorer.core.errors import ExplorerError
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition import algorithm, algorithms, partition
from explorer.simulate.simulator import simulate

NAMES = algorithms()
BASELINES = {"single", "data-parallel", "even-layers", "balanced-params"}
#: refusals a partitioner may give for pins it cannot honour, by words in the message
PIN_REFUSALS = ("pin", "cycle")


@st.composite
def cases(draw, max_pins: int = 3):
    """(graph arguments, cluster preset, pins): the graph is rebuilt from its arguments."""
    args = {"n": draw(st.integers(2, 30)), "width": draw(st.integers(1, 5)),
            "fan_in": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 10**6))}
    preset = draw(st.sampled_from(["2xT4", "3xT4", "4xH100"]))
    g = layered_dag(**args)
    ids = Cluster.preset(preset).ids
    names = [nd.name for nd in g.nodes if nd.kind != "input"]
    pinned = draw(st.lists(st.sampled_from(names), max_size=max_pins, unique=True))
    pins = {nm: draw(st.sampled_from(ids)) for nm in pinned}
    return args, preset, pins


def plan_or_pin_refusal(name, g, cl, c, pins):
    """The plan, or None when the partitioner refuses the pins themselves (and says so)."""
    try:
        return partition(g, cl, c, name, pins=pins)
    except ExplorerError as exc:
        if pins and any(w in str(exc).lower() for w in PIN_REFUSALS):
            return None
        raise


def check_valid(plan, g, cl, c) -> None:
    plan.validate(g, cl)
    assert set(plan.placement) == {nd.name for nd in g.nodes}
    used = [d for s in plan.stages for d in s]
    assert len(used) == len(set(used)) and set(used) <= set(cl.ids)
    assert all(0 <= s < len(plan.stages) for s in plan.placement.values())
    pred = simulate(g, plan, c)
    assert math.isfinite(pred.step_s) and pred.step_s > 0
    assert pred.step_s >= pred.lower_bound_s * (1 - 1e-9)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_valid_plan_pins_honoured_deterministic(name, case):
    args, preset, pins = case
    g, cl = layered_dag(**args), Cluster.preset(preset)
    c = roofline_costs(g, cl)
    plan = plan_or_pin_refusal(name, g, cl, c, pins)
    # the same seed, a graph and costs built afresh: the same answer (or the same refusal)
    g2 = layered_dag(**args)
    again = plan_or_pin_refusal(name, g2, cl, roofline_costs(g2, cl), pins)
    if plan is None:
        assert again is None
        return
    assert again is not None
    assert (again.stages, dict(again.placement), again.micro_batches, again.schedule) == \
        (plan.stages, dict(plan.placement), plan.micro_batches, plan.schedule)
    check_valid(plan, g, cl, c)
    assert set(pins) <= plan.pinned
    for nm, dev in pins.items():
        # the node runs on its device: alone there, or with the other replicas of a
        # replicated stage (data-parallel, or a baseline that an algorithm fell back to)
        assert dev in plan.devices_of(nm), (nm, dev, plan.devices_of(nm))


@pytest.mark.parametrize("name", sorted(set(NAMES) - BASELINES - {"wap"}))
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_pins=0))
def test_never_slower_than_single_or_data_parallel(name, case):
    """Small random graphs (wap excepted: it optimises samples per joule)."""
    args, preset, _ = case
    g, cl = layered_dag(**args), Cluster.preset(preset)
    c = roofline_costs(g, cl)
    pred = simulate(g, partition(g, cl, c, name), c)
    assert pred.fits
    for base in ("single", "data-parallel"):
        other = simulate(g, partition(g, cl, c, base), c)
        if other.fits:
            assert pred.step_s <= other.step_s * (1 + 1e-9), base


#: partitioners whose plan goes through the registry's final check against the baselines, by
#: the simulator, at every graph size (``explorer.partition.guard.never_slower``)
GUARDED = [nm for nm in NAMES if algorithm(nm).guarded]


@pytest.mark.parametrize("name", GUARDED)
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(5_001, 8_000), seed=st.integers(0, 10**6),
       preset=st.sampled_from(["2xT4", "4xH100", "8xH100"]))
def test_never_slower_than_the_baselines_on_larger_graphs(name, n, seed, preset):
    """Past the 5,000 nodes up to which the guard once ran (and beyond which the op-level
    searches rank their candidates by a list-scheduling estimate): still never slower than
    ``single`` and ``data-parallel``, and a note says when a baseline is returned."""
    g, cl = layered_dag(n, seed=seed), Cluster.preset(preset)
    c = roofline_costs(g, cl)
    plan = partition(g, cl, c, name)
    pred = simulate(g, plan, c)
    assert pred.fits
    for base in ("single", "data-parallel"):
        other = simulate(g, partition(g, cl, c, base), c)
        if other.fits:
            assert pred.step_s <= other.step_s * (1 + 1e-9), base
    if plan.options.get("fallback"):
        assert any("faster than" in note for note in plan.notes)


@pytest.mark.parametrize("name", sorted(set(NAMES) - BASELINES))
def test_returns_single_when_single_is_fastest(name):
    """A slow link and a big weight: splitting only adds transfers and all-reduces, so the
    plan must be as fast as everything on one device (and be that plan, not another)."""
    g = graph([("x", "input", [], 1000), ("w", "param", [], 4_000_000),
               ("a", "op", ["x", "w"], 1000), ("b", "op", ["a"], 1000),
               ("c", "op", ["b"], 4)])
    cl = cluster(3, latency_s=1e-3, bandwidth=1e6, memory=2**30)
    c = costs(g, cl, {"a": 1e-4, "b": 1e-4, "c": 1e-4}, {"a": 2e-4, "b": 2e-4, "c": 2e-4})
    single = simulate(g, partition(g, cl, c, "single"), c)
    plan = partition(g, cl, c, name)
    assert simulate(g, plan, c).step_s == pytest.approx(single.step_s, rel=1e-9)
    assert len(plan.devices) == 1


_SCRIPT = """
import json
from explorer.devices.cluster import Cluster
from explorer.partition import algorithm, algorithms, partition
from explorer.models.synthetic import layered_dag, roofline_costs
out = {}
for n, preset, pins in ((24, "3xT4", {"op5": "T4:2"}), (40, "4xH100", {})):
    g = layered_dag(n, width=3, seed=7)
    cl = Cluster.preset(preset)
    c = roofline_costs(g, cl)
    for name in algorithms():
        try:
            p = partition(g, cl, c, name, pins=pins)
            out[f"{n}/{name}"] = [p.stages, sorted(p.placement.items()), p.micro_batches]
        except Exception as exc:
            out[f"{n}/{name}"] = repr(exc)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_same_plans_in_processes_with_other_string_hashes():
    """No partitioner depends on set or dict order of strings, which differs per process."""
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                             text=True, timeout=300, check=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0].keys() == runs[1].keys()
    differ = [k for k in runs[0] if runs[0][k] != runs[1][k]]
    assert not differ, differ


def _small_batch_graph(batch: int):
    """A tiny chain with a weight, for ``batch`` samples (builders' exact-number graph)."""
    return graph([("x", "input", [], 1000), ("w", "param", [], 40_000),
                  ("a", "op", ["x", "w"], 1000), ("b", "op", ["a"], 1000),
                  ("v", "param", [], 40_000), ("c", "op", ["b", "v"], 1000),
                  ("d", "op", ["c"], 4)], batch=batch)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("devices", [4, 8])
def test_a_plan_for_a_batch_smaller_than_the_devices(name, batch, devices):
    """Every partitioner returns a valid plan when the batch has fewer samples than the
    cluster has devices: no stage holds more replicas than samples, and replicas x
    micro-batches divide the batch (what a real run needs)."""
    g = _small_batch_graph(batch)
    cl = cluster(devices, latency_s=1e-6, bandwidth=1e11)
    c = costs(g, cl, {"a": 1e-3, "b": 2e-3, "c": 1e-3, "d": 1e-4},
              {"a": 2e-3, "b": 4e-3, "c": 2e-3, "d": 2e-4})
    plan = partition(g, cl, c, name)
    check_valid(plan, g, cl, c)
    assert plan.data_parallel <= batch
    plan.check_batch(batch)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 24), seed=st.integers(0, 10**6), batch=st.integers(1, 3),
       preset=st.sampled_from(["4xH100", "8xH100"]))
def test_random_graphs_with_a_batch_smaller_than_the_devices(name, n, seed, batch, preset):
    g, cl = layered_dag(n, width=3, seed=seed, batch_size=batch), Cluster.preset(preset)
    c = roofline_costs(g, cl)
    plan = partition(g, cl, c, name)
    check_valid(plan, g, cl, c)
    assert plan.data_parallel <= batch
