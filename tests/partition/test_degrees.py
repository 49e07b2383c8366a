"""The degrees search: exact against brute force on tiny graphs, pins, memory, never worse."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from builders import cluster, tiny_builtin_graph
from partition.test_pase import fc_costs, wide_fc

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.plan import StageSettings
from explorer.costs.memory import node_memory_bytes
from explorer.models.builtin import build_gpt
from explorer.models.dense import GPTConfig
from explorer.models.synthetic import roofline_costs
from explorer.partition.degrees import (
    build_space,
    candidate_plan,
    enumerate_candidates,
    mesh_costs,
)
from explorer.partition.degrees.interleave import interleaved
from explorer.partition.degrees.partitioner import with_memory_settings
from explorer.partition.pipeline_dp import choose_layers
from explorer.simulate.simulator import simulate


def _case(name: str, devices: str):
    g = tiny_builtin_graph(name)
    cl = ex.Cluster.preset(devices)
    return g, cl, roofline_costs(g, cl)


def _space(g, cl, costs, depth, pins=None, **kw):
    layers, _ = choose_layers(g, depth, 400, 1, False)
    return build_space(g, costs, cl.ids, layers, "adam", kw.get("tensor_degrees"),
                       kw.get("micro_batches"), ("1f1b", "gpipe"), pins or {}, 1.0,
                       kw.get("settings"), context_degrees=kw.get("context_degrees", (1,)))


def _brute_estimate(space, costs, batch):
    """The best score over every mesh, micro-batch count, schedule and every contiguous
    split, each scored by the reference (stage by stage) estimate."""
    n_layers = len(space.layers)
    best = math.inf
    for dp, tp, cp in space.meshes(batch):
        pin_stage = space.pin_stages(dp * cp * tp)
        if pin_stage is None:
            continue
        for m in space.micro_batch_choices(batch, dp):
            for sched in space.schedules:
                mesh = mesh_costs(space, costs, dp, tp, m, sched, cp)
                for s in range(1, min(len(space.ids) // (dp * cp * tp), n_layers) + 1):
                    for cuts in itertools.combinations(range(1, n_layers), s - 1):
                        for _, lc in space.splits(tp, cp):
                            best = min(best, mesh.score_s(lc, (0, *cuts, n_layers), pin_stage))
    return best


@pytest.mark.parametrize("name,devices,depth,pin,contexts", [
    ("mlp", "4xH100", 2, False, (1,)), ("gpt", "4xH100", 2, False, (1,)),
    ("gpt", "4xT4", 2, True, (1,)), ("mlp", "3xT4", 2, True, (1,)),
    ("llama", "4xH100", 2, False, (1, 2))])
def test_search_is_exact_for_its_estimate(name, devices, depth, pin, contexts):
    g, cl, costs = _case(name, devices)
    pins = {}
    if pin:  # the last op on the last device, the first op on the first
        ops = [n.name for n in g.nodes if n.kind == "op"]
        pins = {ops[-1]: cl.ids[-1], ops[0]: cl.ids[0]}
    space = _space(g, cl, costs, depth, pins, context_degrees=contexts)
    assert len(space.by_tensor) > 1 or name == "mlp"  # some tensor degree splits weights
    assert bool(space.by_sequence) == (name != "mlp")  # and the transformers' sequence too
    # (the llama's fused attention: each split with the samples' sequence split in two)
    assert {c for _, _, c in space.by_context} == set(contexts) - {1}
    cands = enumerate_candidates(space, costs, g.batch_size)
    brute = _brute_estimate(space, costs, g.batch_size)
    assert cands and math.isclose(cands[0].estimate_s, brute, rel_tol=1e-9)
    assert {c.cp for c in cands} == set(contexts)
    # every candidate's cuts score what the DP says under the reference estimate
    for c in cands[:40] + [c for c in cands if c.cp > 1][:20]:
        mesh = mesh_costs(space, costs, c.dp, c.tp, c.micro_batches, c.schedule, c.cp)
        assert math.isclose(mesh.score_s(space.layer_costs(c.tp, c.sequence, c.cp), c.bounds,
                                         space.pin_stages(c.dp * c.cp * c.tp)), c.estimate_s,
                            rel_tol=1e-9)


def test_simulating_every_candidate_equals_brute_force_by_the_simulator():
    g, cl, costs = _case("gpt", "4xH100")
    space = _space(g, cl, costs, None)
    cands = enumerate_candidates(space, costs, g.batch_size)
    brute = min(r.step_s for c in cands
                for r in [simulate(g, candidate_plan(g, space, c, "adam", {}, {}), costs)]
                if r.fits)
    plan = ex.partition(g, cl, costs, "degrees", simulate_top=len(cands),
                        compare_pipeline_dp=False, compare_baselines=False, virtual_stages=[1])
    assert math.isclose(simulate(g, plan, costs).step_s, brute, rel_tol=1e-12)
    o = plan.options
    assert o["dp"] * o["tp"] * o["pp"] <= len(cl)
    assert o["degrees"] == f"{o['dp']}x{o['tp']}x{o['pp']}"
    assert plan.tensor_of(0) == o["tp"] and len(plan.stages) == o["pp"]
    assert "degrees: data" in plan.notes[0]


def test_context_degrees_are_searched_and_simulated_as_planned():
    """With context degrees, every candidate (those splitting samples' sequences too) is
    simulated as its plan says; the search returns the fastest, by brute force."""
    g, cl, costs = _case("llama", "4xH100")
    space = _space(g, cl, costs, None, context_degrees=(1, 2))
    cands = enumerate_candidates(space, costs, g.batch_size)
    plans = [candidate_plan(g, space, c, "adam", {}, {}) for c in cands]
    for c, plan in zip(cands, plans, strict=True):
        assert plan.context_of(0) == c.cp and plan.replicas_of(0) == c.dp * c.cp
    brute = min(r.step_s for plan in plans for r in [simulate(g, plan, costs)] if r.fits)
    plan = ex.partition(g, cl, costs, "degrees", simulate_top=len(cands),
                        compare_pipeline_dp=False, compare_baselines=False, virtual_stages=[1],
                        context_degrees=[1, 2])
    assert math.isclose(simulate(g, plan, costs).step_s, brute, rel_tol=1e-12)
    assert plan.options["cp"] == plan.context_of(0)
    with pytest.raises(ExplorerError, match="context_degrees are whole numbers"):
        ex.partition(g, cl, costs, "degrees", context_degrees=[0])
    gpt, _, gpt_costs = _case("gpt", "4xH100")  # (its attention is written out of matmuls)
    with pytest.raises(ExplorerError, match="this graph has none"):
        ex.partition(gpt, cl, gpt_costs, "degrees", context_degrees=[1, 2])


def test_memory_settings_rank_the_simulated_candidates():
    """With ``memory``, every candidate is simulated as it will run: the plan returned
    carries the settings and is the fastest of all candidates with them, by brute force."""
    g, cl, costs = _case("gpt", "4xH100")
    memory = {"zero": 1, "precision": "bf16"}
    space = _space(g, cl, costs, None)
    cands = enumerate_candidates(space, costs, g.batch_size)
    brute = min(r.step_s for c in cands for r in [
        simulate(g, candidate_plan(g, space, c, "adam", {}, {}).with_memory(**memory), costs)]
        if r.fits)
    plan = ex.partition(g, cl, costs, "degrees", simulate_top=len(cands), memory=memory,
                        compare_pipeline_dp=False, compare_baselines=False,
                        virtual_stages=[1])
    assert all(plan.settings_of(s).precision == "bf16" for s in range(len(plan.stages)))
    assert all(plan.settings_of(s).zero == 1 for s in range(len(plan.stages)))
    assert math.isclose(simulate(g, plan, costs).step_s, brute, rel_tol=1e-12)
    # async tensor parallelism on the sequence-parallel candidates: brute force again
    overlapped = {**memory, "async_tensor": True}
    brute = min(r.step_s for c in cands for r in [simulate(g, with_memory_settings(
        candidate_plan(g, space, c, "adam", {}, {}), overlapped), costs)] if r.fits)
    plan = ex.partition(g, cl, costs, "degrees", simulate_top=len(cands), memory=overlapped,
                        compare_pipeline_dp=False, compare_baselines=False,
                        virtual_stages=[1])
    assert math.isclose(simulate(g, plan, costs).step_s, brute, rel_tol=1e-12)
    assert all(plan.settings_of(s).async_tensor == plan.sequence_of(s)
               for s in range(len(plan.stages)))
    assert any(c.sequence for c in cands)
    with pytest.raises(ExplorerError, match="ZeRO stage 5"):
        ex.partition(g, cl, costs, "degrees", memory={"zero": 5})
    with pytest.raises(ExplorerError, match="no setting 'zro'; its settings are zero"):
        ex.partition(g, cl, costs, "degrees", memory={"zro": 1})


@pytest.mark.parametrize("name,devices", [("mlp", "4xH100"), ("gpt", "4xT4"),
                                          ("gpt", "8xH100"), ("mlp", "2xT4")])
def test_never_worse_than_pipeline_dp_and_the_baselines(name, devices):
    g, cl, costs = _case(name, devices)
    got = simulate(g, ex.partition(g, cl, costs, "degrees"), costs)
    assert got.fits
    for other in ("pipeline-dp", "single", "data-parallel"):
        ref = simulate(g, ex.partition(g, cl, costs, other), costs)
        if ref.fits:
            assert got.step_s <= ref.step_s * (1 + 1e-9), other


def test_pins_are_honoured():
    g, cl, costs = _case("gpt", "4xT4")
    ops = [n.name for n in g.nodes if n.kind == "op"]
    pins = {ops[-1]: cl.ids[3], ops[len(ops) // 2]: cl.ids[2]}
    plan = ex.partition(g, cl, costs, "degrees", pins=pins)
    for name, dev in pins.items():
        assert dev in plan.devices_of(name)
    assert pins.keys() <= plan.pinned


def test_memory_limit_rejects_plans_that_do_not_fit():
    g = tiny_builtin_graph("gpt")
    roomy = ex.Cluster.preset("4xT4")
    costs = roofline_costs(g, roomy)
    whole = simulate(g, ex.Plan.single(g, roomy.ids[0]), costs).peak_bytes[roomy.ids[0]]
    tight = replace(roomy, devices=tuple(replace(d, memory_bytes=int(whole * 0.6))
                                         for d in roomy.devices))
    costs = roofline_costs(g, tight)
    space = _space(g, tight, costs, None)
    cands = enumerate_candidates(space, costs, g.batch_size)
    assert cands and not any(c.devices == 1 and c.micro_batches == 1 for c in cands)
    for c in cands:  # every stage of every candidate fits by the estimate
        mesh = mesh_costs(space, costs, c.dp, c.tp, c.micro_batches, c.schedule)
        for k in range(c.pp):
            assert mesh.stage_memory_bytes(space.layer_costs(c.tp, c.sequence), c.bounds[k],
                                           c.bounds[k + 1], c.pp - k) <= space.capacity_bytes
    plan = ex.partition(g, tight, costs, "degrees", compare_pipeline_dp=False)
    pred = simulate(g, plan, costs)
    assert pred.fits and len(plan.devices) > 1


@pytest.mark.parametrize("settings", [StageSettings(zero=3, recompute="full"),
                                      StageSettings(zero=1, precision="bf16")], ids=str)
def test_the_estimate_holds_what_the_memory_settings_hold(settings):
    """With ``memory``, a stage's estimated memory is what the settings leave on each
    device: ZeRO's shards over the mesh's replicas, recomputation's and the precision's
    activations (one stage of 4 replicas: the per-node memory at a quarter of the batch).
    Under ZeRO 1-2 in bf16 the estimate keeps each weight's fp32 bytes and autocast's copies
    where the replicas hold a bf16 working copy and an fp32 master shard: it errs on the
    safe side, by less than a fifth on this model."""
    g = tiny_builtin_graph("gpt")
    cl = ex.Cluster.preset("4xT4")
    costs = roofline_costs(g, cl)
    space = _space(g, cl, costs, None, settings=settings)
    mesh = mesh_costs(space, costs, 4, 1, 1, "1f1b")
    want = sum(node_memory_bytes(g, "adam", 1, 0.25, settings, 4, cl.devices[0].kind))
    got = mesh.stage_memory_bytes(space.layer_costs(1, False), 0, len(space.layers), 1)
    if settings.zero == 3 or settings.precision == "fp32":
        assert got == pytest.approx(want, rel=1e-3)
    else:
        assert want <= got < 1.2 * want
    plain = _space(g, cl, costs, None)
    assert got < mesh.stage_memory_bytes(plain.layer_costs(1, False), 0, len(space.layers), 1)


def test_options_are_checked():
    g, cl, costs = _case("mlp", "2xT4")
    with pytest.raises(ExplorerError, match="simulate_top"):
        ex.partition(g, cl, costs, "degrees", simulate_top=0)
    with pytest.raises(ExplorerError, match="schedule"):
        ex.partition(g, cl, costs, "degrees", schedules=["zigzag"])
    plan = ex.partition(g, cl, costs, "degrees", tensor_degrees=[2], micro_batches=[2],
                        schedules=["gpipe"], compare_pipeline_dp=False,
                        compare_baselines=False)
    assert plan.micro_batches == 2 and plan.options["tp"] in (1, 2)


def test_tensor_split_chosen_where_it_wins_and_agrees_with_pase():
    """Two big linears on slow links: splitting them (column then row) beats replicating them
    (64 MiB gradient all-reduces) and pipelining them; PaSE finds the same split."""
    g = wide_fc(conv_first=False)
    cl = cluster(4, latency_s=1e-5, bandwidth=1e9, memory=64 * 2**30)
    costs = fc_costs(g, cl)
    plan = ex.partition(g, cl, costs, "degrees")
    assert plan.options["degrees"] == "1x4x1" and plan.tensor_of(0) == 4
    step = simulate(g, plan, costs).step_s
    assert step < simulate(g, ex.partition(g, cl, costs, "pipeline-dp"), costs).step_s
    assert step == pytest.approx(simulate(g, ex.partition(g, cl, costs, "pase"), costs).step_s)


def test_a_graph_too_deep_for_stage_cuts_gets_one_stage_meshes_with_a_note():
    from explorer.models.synthetic import layered_dag
    g = layered_dag(400, seed=3)
    cl = ex.Cluster.preset("4xH100")
    costs = roofline_costs(g, cl)
    with pytest.raises(ExplorerError, match="too many layers"):
        choose_layers(g, None, 2, 1, False)
    plan = ex.partition(g, cl, costs, "degrees", max_layers=2)
    assert len(plan.stages) == 1
    assert any("one pipeline stage only" in nt and "too many layers" in nt
               for nt in plan.notes)
    for base in ("single", "data-parallel"):  # and no slower than the baselines
        other = ex.partition(g, cl, costs, base)
        assert simulate(g, plan, costs).step_s <= simulate(g, other, costs).step_s * (1 + 1e-9)
    with pytest.raises(ExplorerError, match="too many"):  # an explicit depth still says
        ex.partition(g, cl, costs, "degrees", max_layers=2, depth=1)


@pytest.fixture(scope="module")
def gpt_pipeline():
    """A GPT shape (fake capture) on four H100s of 12 GiB each: too large for data
    parallelism alone, so the search's best is a 1F1B pipeline."""
    cfg = GPTConfig(vocab_size=32000, seq_len=1024, d_model=2048, n_heads=16, n_layers=16,
                    batch_size=1, fused_attention=True)
    module, inputs, targets, loss_fn, _ = build_gpt(cfg, 16, None)
    g = ex.capture(module, inputs, loss_fn, targets, name="gpt-2048")
    cl = ex.Cluster.preset("4xH100")
    cl = replace(cl, devices=tuple(replace(d, memory_bytes=12 * 2**30) for d in cl.devices))
    return g, cl, ex.profile(g, cl, progress=False)


def test_the_best_pipeline_is_interleaved_where_that_is_faster(gpt_pipeline):
    """The 1F1B pipeline the search finds, re-cut into 2 and 4 chunks per stage (the
    simulator's every choice, by brute force): the fastest that fits is returned. By default
    every simulated pipeline is re-cut, also into one layer a chunk: never slower."""
    g, cl, costs = gpt_pipeline
    search = {"micro_batches": [8], "schedules": ["1f1b"], "tensor_degrees": [1],
              "simulate_top": 1}
    plain = ex.partition(g, cl, costs, "degrees", virtual_stages=[1], **search)
    assert plain.schedule == "1f1b" and len(plain.stages) > 1
    layers, _ = choose_layers(g, plain.options["depth"], 400, 1, False)
    steps = {1: simulate(g, plain, costs).step_s}
    for v in (2, 4):
        recut = interleaved(g, plain, costs, layers, v)
        pred = simulate(g, recut, costs)
        if pred.fits:
            steps[v] = pred.step_s
        ops = [n.name for n in g.nodes if n.kind == "op"]
        runs = [recut.placement[a] for a, b in itertools.pairwise(ops)
                if recut.placement[a] != recut.placement[b]] + [recut.placement[ops[-1]]]
        assert runs == list(range(len(plain.stages))) * v  # chunks taken in turn
    plan = ex.partition(g, cl, costs, "degrees", virtual_stages=[1, 2, 4], **search)
    best = min(steps, key=steps.get)
    assert best > 1  # (interleaving wins here)
    assert plan.schedule == "interleaved-1f1b" and plan.options["virtual_stages"] == best
    assert math.isclose(simulate(g, plan, costs).step_s, steps[best], rel_tol=1e-12)
    assert "chunks of layers per stage under interleaved 1F1B" in plan.notes[-1]
    assert plan.stages == plain.stages and plan.stage_settings == plain.stage_settings
    most = len(layers) // len(plain.stages)
    deepest = simulate(g, interleaved(g, plain, costs, layers, most), costs)
    default = simulate(g, ex.partition(g, cl, costs, "degrees", **{**search,
                                                                    "simulate_top": 4}), costs)
    assert default.fits and default.step_s <= min(
        [steps[best]] + [deepest.step_s] * deepest.fits) * (1 + 1e-9)
    # only interleaved plans, when asked for
    only = ex.partition(g, cl, costs, "degrees", **{**search,
                                                      "schedules": ["interleaved-1f1b"]})
    assert only.schedule == "interleaved-1f1b"
    with pytest.raises(ExplorerError, match="virtual_stages are whole numbers"):
        ex.partition(g, cl, costs, "degrees", virtual_stages=[0], **search)
