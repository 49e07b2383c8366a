"""Where nothing fits as it is, the memory-aware partitioners pick the memory settings (ZeRO,
recomputation, bf16) whose plan fits with the shortest simulated step: against brute force
over placements and settings on tiny graphs."""

from __future__ import annotations

import pytest
from brute import brute_force, tiny_graph
from builders import device

import explorer as ex
from explorer.core.errors import MemoryExceededError
from explorer.core.plan import Plan, StageSettings
from explorer.devices.cluster import Cluster, Link
from explorer.models.synthetic import roofline_costs
from explorer.partition.pipeline_dp.build import stage_cost_table
from explorer.partition.search.fallback import (
    MEMORY_CHOICES,
    best_of_baselines,
    memory_keywords,
)
from explorer.simulate.simulator import simulate

ALL_SETTINGS = (StageSettings(), *MEMORY_CHOICES)


def gpus(n: int, memory: int) -> Cluster:
    devs = tuple(device(i, memory, kind="cuda") for i in range(n))
    return Cluster(f"test:{n}", devs, Link(1e-6, 1e9, "test"))


def fitting_steps(graph, costs, plan: Plan) -> dict[StageSettings, float]:
    """The step of ``plan``'s placement under every memory setting that makes it fit."""
    out = {}
    for st in ALL_SETTINGS:
        pred = simulate(graph, plan.with_memory(**memory_keywords(st)), costs)
        if pred.fits:
            out[st] = pred.step_s
    return out


def tight_case(seed: int, n_devices: int, squeeze: float = 0.9):
    """A tiny graph on ``n_devices`` GPUs with a little less memory than everything on one
    device needs as it is."""
    g = tiny_graph(seed, 5)
    roomy = gpus(1, 2**40)
    need = simulate(g, Plan.single(g, "d:0"), roofline_costs(g, roomy)).peak_bytes["d:0"]
    cl = gpus(n_devices, int(need * squeeze))
    return g, cl, roofline_costs(g, cl)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["pipeline-dp", "pardnn", "m-etf"])
def test_one_device_gets_the_cheapest_settings_that_fit(seed, name):
    g, cl, c = tight_case(seed, 1)
    with pytest.raises(ValueError):  # nothing fits as it is
        brute_force(g, cl, c)
    best = {}
    for st in MEMORY_CHOICES:
        try:
            best[st] = brute_force(g, cl, c, stage_settings=(st,))[1].step_s
        except ValueError:
            continue
    opts = {"micro_batches": 1} if name == "pipeline-dp" else {}
    if not best:
        with pytest.raises(MemoryExceededError):
            ex.partition(g, cl, c, name, **opts)
        return
    plan = ex.partition(g, cl, c, name, **opts)
    pred = simulate(g, plan, c)
    assert pred.fits
    assert pred.step_s == pytest.approx(min(best.values()), rel=1e-9)
    assert plan.uses_memory_settings
    assert any("fits only with memory settings" in n for n in plan.notes)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["pipeline-dp", "pardnn", "m-etf"])
def test_its_placement_gets_its_cheapest_settings(seed, name):
    """Two devices with 70 % of what one device needs: settings only where the plan
    does not fit without them, then the cheapest for its placement."""
    g, cl, c = tight_case(seed, 2, squeeze=0.7)
    try:
        plan = ex.partition(g, cl, c, name)
    except MemoryExceededError:
        return  # nothing fits the devices even with the settings: said so
    pred = simulate(g, plan, c)
    assert pred.fits
    plain = plan.with_settings(stage_settings=())
    if not plan.uses_memory_settings:
        assert simulate(g, plain, c).fits
        return
    assert not simulate(g, plain, c).fits
    steps = fitting_steps(g, c, plain)
    assert pred.step_s == pytest.approx(min(steps.values()), rel=1e-9)


def test_baselines_fall_back_on_settings_with_a_note_on_their_cost():
    g, cl, c = tight_case(0, 2, squeeze=0.53)
    plan = best_of_baselines(g, cl, c, None, None, "adam", "test")
    pred = simulate(g, plan, c)
    assert pred.fits and plan.uses_memory_settings and plan.algorithm == "test"
    cands = [Plan.single(g, "d:0"), Plan.from_assignment(g, [("d:0", "d:1")],
                                                         {i: 0 for i in range(len(g))})]
    best = min(s for p in cands for s in fitting_steps(g, c, p).values())
    assert pred.step_s == pytest.approx(best, rel=1e-9)
    note, which = plan.notes[-2:]
    assert note.startswith("test: fits only with memory settings (")
    assert "against" in note and "without them (which does not fit)" in note
    label = plan.options["fallback"]
    assert which == f"test found no plan that fits without memory settings; this is the " \
        f"{label} plan with them"


def test_the_stage_table_shards_by_the_replica_count():
    g, cl, c = tight_case(2, 2)
    layers = g.layers(None)
    plain = stage_cost_table(g, c, cl.ids, layers, 1, "gpipe", "adam")
    zero3 = stage_cost_table(g, c, cl.ids, layers, 1, "gpipe", "adam",
                             settings=StageSettings(zero=3))
    weights = sum(n.param_bytes for n in g.nodes if n.kind == "param")  # all trainable
    last = len(layers)
    # adam: weight, gradient and two states, each halved over two replicas
    assert zero3.stage_memory_bytes(0, last, 0, 2, 1) == pytest.approx(
        plain.stage_memory_bytes(0, last, 0, 2, 1) - 4 * weights / 2)
    assert zero3.stage_memory_bytes(0, last, 0, 1, 1) == plain.stage_memory_bytes(0, last, 0, 1,
                                                                                  1)
