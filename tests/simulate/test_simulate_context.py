"""Context parallelism: the plan setting, and ring attention in the simulator by hand."""

from __future__ import annotations

import pytest
from builders import costs, device, tiny_builtin_graph

import explorer as ex
from explorer.core.errors import PlanError
from explorer.core.plan import StageSettings
from explorer.devices.cluster import Cluster, Link
from explorer.simulate.context import context_group, keys_and_values

LAT_S, BW = 1e-3, 1e6


def _gpus(n: int) -> Cluster:
    return Cluster(name=f"test:{n}", devices=tuple(device(i, kind="cuda") for i in range(n)),
                   default_link=Link(LAT_S, BW, "test"))


def _one_stage(graph, devices) -> ex.Plan:
    return ex.Plan.from_assignment(graph, [tuple(devices)],
                                   {n.name: 0 for n in graph.nodes if n.kind == "op"})


def test_ring_attention_by_hand():
    """Two devices that split each sample's sequence run every token-wise op as two
    data-parallel replicas do (the same share of the tokens, the same memory); each
    attention adds its ring: the keys and values (before grouped-query attention repeats
    them) go once round in the forward, twice in the backward, each ring in 2 steps beside
    the attention of the step before, so half of it is exposed."""
    g = tiny_builtin_graph("llama")
    attention = [i for i, n in enumerate(g.nodes) if n.op.startswith(
        "aten.scaled_dot_product_attention")]
    assert len(attention) == 2
    for i in attention:  # (the ring carries the 2 key-value heads, not the 4 repeated)
        assert [g.nodes[j].out_bytes for j in keys_and_values(g, i)] == [
            g.nodes[g.index[name]].out_bytes // 2 for name in g.nodes[i].inputs[1:3]]
    fwd = {n.name: 1.0 for n in g.nodes if n.kind == "op"}
    bwd = {n.name: 2.0 for n in g.nodes if n.kind == "op"}
    cm = costs(g, _gpus(2), fwd, bwd)
    replicas = _one_stage(g, cm.cluster.ids)
    ring = replicas.with_memory(context=2)
    assert context_group(ring, 0) == ("d:0", "d:1")
    plain, pred = ex.simulate(g, replicas, cm), ex.simulate(g, ring, cm)
    block = sum(g.nodes[j].out_bytes for j in keys_and_values(g, attention[0])) // 2
    ring_s = LAT_S + block / BW  # one step of a ring of two
    # forward: 0.5 s beside a ring of ring_s, in 2 pieces; backward 1 s beside 2 ring_s
    assert pred.step_s - plain.step_s == pytest.approx(2 * (ring_s / 2 + 2 * ring_s / 2),
                                                       rel=1e-9)
    assert pred.peak_bytes == plain.peak_bytes
    assert pred.allreduce_bytes - plain.allreduce_bytes == 2 * 3 * block * 2


def test_context_ranks_are_tensor_apart_and_the_mesh_must_divide():
    g = tiny_builtin_graph("llama")
    plan = _one_stage(g, [f"d:{i}" for i in range(8)]).with_tensor(2).with_memory(context=2)
    assert context_group(plan, 0) == ("d:0", "d:2")
    assert plan.replicas_of(0) == 4 and plan.context_of(0) == 2
    assert plan.settings_of(0).describe() == "tensor 2, context 2"
    with pytest.raises(PlanError, match="context 4 x tensor 2 does not divide"):
        _one_stage(g, [f"d:{i}" for i in range(4)]).with_tensor(2).with_memory(context=4)
    with pytest.raises(PlanError, match="context-parallel degree 0"):
        StageSettings(context=0)


def test_context_is_predicted_and_refused_for_real_steps(tmp_path):
    g = tiny_builtin_graph("llama")
    cl = ex.Cluster.preset("2xH100")
    plan = _one_stage(g, cl.ids).with_memory(context=2)
    d = plan.to_dict()
    assert d["version"] == 5 and d["stage_settings"][0]["context"] == 2
    assert ex.Plan.from_dict(d, g) == plan
    with pytest.raises(PlanError, match="context-parallel stages do not run yet"):
        plan.check_runnable(g.batch_size, None)
    with pytest.raises(PlanError, match="context-parallel stages do not run yet"):
        ex.export_script(plan, tmp_path / "train.py", graph=g)
    d["stage_settings"][0]["context"] = 0
    with pytest.raises(PlanError, match="context"):
        ex.Plan.from_dict(d, g)


def test_the_ring_carries_each_device_s_heads_at_the_stage_s_precision():
    """Tensor 2 x context 2: each device's ring carries its share of the key-value heads,
    whatever else the stage sets (ZeRO, recomputation), and 2-byte ones under bf16."""
    g = tiny_builtin_graph("llama")
    fwd = {n.name: 1.0 for n in g.nodes if n.kind == "op"}
    cm = costs(g, _gpus(4), fwd, {k: 2 * v for k, v in fwd.items()})
    split = _one_stage(g, cm.cluster.ids).with_tensor(2)

    def ring_bytes(**settings) -> int:
        base = split.with_memory(**settings) if settings else split
        return (ex.simulate(g, base.with_memory(context=2), cm).allreduce_bytes
                - ex.simulate(g, base, cm).allreduce_bytes)

    heads = sum(g.nodes[j].out_bytes for i, n in enumerate(g.nodes)
                if n.op.startswith("aten.scaled_dot_product_attention")
                for j in keys_and_values(g, i))
    # (every device sends its block: whole / (2 replicas of the tokens) / 2 tensor ranks)
    assert ring_bytes() == 3 * heads // 4 * 4
    assert ring_bytes(zero=1) == ring_bytes(recompute="full") == ring_bytes()
    assert ring_bytes(precision="bf16") == ring_bytes() // 2


def test_a_batch_smaller_than_the_devices_is_split_by_sequence():
    """Sixteen devices over the tiny Llama's batch of 8: as data-parallel replicas they are
    too many, as 8 replicas x 2 context ranks each they are not."""
    g = tiny_builtin_graph("llama")
    cm = costs(g, _gpus(16), {n.name: 1.0 for n in g.nodes if n.kind == "op"}, {})
    ops = {n.name: 0 for n in g.nodes if n.kind == "op"}
    with pytest.raises(PlanError, match="16 replicas for a batch of 8 samples"):
        ex.Plan.from_assignment(g, [cm.cluster.ids], ops)
    plan = ex.Plan.from_assignment(g, [cm.cluster.ids], ops,
                                   stage_settings=(StageSettings(context=2),))
    assert ex.simulate(g, plan, cm).step_s > 0
