"""Interleaved 1F1B: the order of Megatron-LM's virtual pipeline stages, its smaller bubble,
its memory, and the plans it refuses."""

from __future__ import annotations

import pytest
from builders import cluster, costs, graph

import explorer as ex
from explorer.core.errors import PlanError
from explorer.core.plan import INTERLEAVED, Plan
from explorer.models.synthetic import roofline_costs
from explorer.simulate.simulator import execution_order
from explorer.simulate.tasks import TaskBuilder


def megatron_order(p: int, v: int, M: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s (kind, chunk, micro-batch) in turn, written as Megatron-LM's
    ``forward_backward_pipelining_with_interleaving`` runs them: warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards."""
    total = M * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def micro_batch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [("F", chunk(k, True), micro_batch(k)) for k in range(warmup)]
    for i in range(total - warmup):
        k = i + warmup
        order.append(("F", chunk(k, True), micro_batch(k)))
        order.append(("B", chunk(i, False), micro_batch(i)))
    order += [("B", chunk(i, False), micro_batch(i)) for i in range(total - warmup, total)]
    return order


def chain(layers: int):
    """A chain of equal ops (forward 1 s, backward 2 s) and a free loss, their costs."""
    spec = [("x", "input", [], 64)]
    prev = "x"
    for k in range(layers):
        spec.append((f"op{k}", "op", [prev], 64, 0, [prev]))  # (saves its input)
        prev = f"op{k}"
    spec.append(("loss", "op", [prev], 4))
    g = graph(spec)
    names = [f"op{k}" for k in range(layers)]
    return g, {**dict.fromkeys(names, 1.0), "loss": 0.0}, {**dict.fromkeys(names, 2.0),
                                                           "loss": 0.0}


def interleaved_plan(g, p: int, v: int, M: int) -> Plan:
    """The chain's ops cut into ``p v`` equal chunks, chunk ``j`` on stage ``j mod p``."""
    ops = [n.name for n in g.nodes if n.kind == "op"]
    per = len(ops) // (p * v)
    assign = {nm: min(k // per, p * v - 1) % p for k, nm in enumerate(ops)}
    return Plan.from_assignment(g, [(f"d:{s}",) for s in range(p)], assign,
                                micro_batches=M, schedule=INTERLEAVED)


@pytest.mark.parametrize("p,v,M", [(2, 2, 2), (2, 2, 6), (3, 2, 6), (4, 2, 8), (2, 3, 4),
                                   (4, 3, 12)])
def test_the_slots_order_each_stage_as_megatron_does(p, v, M):
    g, _, _ = chain(p * v * 2)
    plan = interleaved_plan(g, p, v, M)
    b = TaskBuilder(g, plan, costs(g, cluster(p), *chain(p * v * 2)[1:]))
    b.place_stages()
    vs = b.virtual
    assert vs is not None and vs.chunks == v
    for s in range(p):
        blocks = sorted([(int(vs.slot_f[s, c, m]), "F", c, m) for c in range(v)
                         for m in range(M)] + [(int(vs.slot_b[s, c, m]), "B", c, m)
                                               for c in range(v) for m in range(M)])
        assert len({slot for slot, *_ in blocks}) == 2 * M * v  # no two share a slot
        assert [x[1:] for x in blocks] == megatron_order(p, v, M, s)


@pytest.mark.parametrize("p,v,M", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_uniform_chunks_run_in_megatron_order_with_the_smaller_bubble(p, v, M):
    """Equal chunks on free links: each stage runs Megatron-LM's order, and the step is
    ``(M + (p - 1) / v)`` micro-batches' work where 1F1B takes ``M + p - 1``."""
    layers = p * v * 2
    g, fwd, bwd = chain(layers)
    cm = costs(g, cluster(p), fwd, bwd)
    plan = interleaved_plan(g, p, v, M)
    order = execution_order(g, plan, cm)
    chunk_of = TaskBuilder(g, plan, cm)
    chunk_of.place_stages()
    for s in range(p):
        seen = []
        for a in order[s]:
            if a.kind != "optimizer":
                key = (a.kind[0].upper(), int(chunk_of.chunk[a.node]), a.micro_batch)
                if key not in seen:
                    seen.append(key)
        assert seen == megatron_order(p, v, M, s)
    work = layers / p * 3.0 / M  # one micro-batch's forward and backward on a stage
    step = ex.simulate(g, plan, cm).step_s
    plain = ex.simulate(g, _contiguous(g, p, M), cm).step_s
    assert plain == pytest.approx((M + p - 1) * work, rel=1e-6)
    assert step == pytest.approx((M + (p - 1) / v) * work, rel=1e-6)
    assert step < plain


def _contiguous(g, p: int, M: int) -> Plan:
    ops = [n.name for n in g.nodes if n.kind == "op"]
    per = len(ops) // p
    return Plan.from_assignment(g, [(f"d:{s}",) for s in range(p)],
                                {nm: min(k // per, p - 1) for k, nm in enumerate(ops)},
                                micro_batches=M, schedule="1f1b")


def test_more_warm_up_forwards_hold_more_activations_on_the_first_stage():
    """Megatron-LM's count: the first stage holds ``2(p-1) + (v-1)p + 1`` chunks' activations
    at once, where 1F1B holds ``p`` micro-batches' (each ``v`` chunks)."""
    p, v, M = 4, 2, 8
    g, fwd, bwd = chain(p * v * 2)
    cm = costs(g, cluster(p), fwd, bwd)
    il = ex.simulate(g, interleaved_plan(g, p, v, M), cm).memory["d:0"].activations_bytes
    plain = ex.simulate(g, _contiguous(g, p, M), cm).memory["d:0"].activations_bytes
    chunks_held = 2 * (p - 1) + (v - 1) * p + 1
    assert il / plain == pytest.approx(chunks_held / (p * v), rel=0.05)


class TestRefused:
    def test_a_placement_not_in_chunks_taken_in_turn(self):
        g, fwd, bwd = chain(8)
        plan = _contiguous(g, 2, 4).with_settings(schedule=INTERLEAVED)
        with pytest.raises(PlanError, match="chunks that go round the pipeline"):
            ex.simulate(g, plan, costs(g, cluster(2), fwd, bwd))

    def test_micro_batches_not_a_multiple_of_the_stages(self):
        g, fwd, bwd = chain(8)
        with pytest.raises(PlanError, match="multiple of the 2 stages"):
            ex.simulate(g, interleaved_plan(g, 2, 2, 3), costs(g, cluster(2), fwd, bwd))

    def test_zero_3(self):
        g, fwd, bwd = chain(8)
        plan = Plan.from_assignment(
            g, [("d:0", "d:1"), ("d:2", "d:3")],
            {n.name: (k // 2) % 2 for k, n in enumerate(x for x in g.nodes if x.kind == "op")},
            micro_batches=4, schedule=INTERLEAVED).with_memory(zero=3)
        with pytest.raises(PlanError, match="ZeRO 3"):
            ex.simulate(g, plan, costs(g, cluster(4), fwd, bwd))

    def test_more_chunks_than_layers(self):
        bm = ex.builtin_model("mlp", "tiny")
        g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
        cl = ex.Cluster.cpu(2, measure=False)
        cm = roofline_costs(g, cl)
        with pytest.raises(PlanError, match="virtual stages each need"):
            ex.partition(g, cl, cm, "even-layers", virtual_stages=64, micro_batches=2)
        with pytest.raises(PlanError, match="whole number of chunks"):
            ex.partition(g, cl, cm, "even-layers", virtual_stages=0)


def test_an_interleaved_plan_saves_and_loads(tmp_path):
    g, _, _ = chain(8)
    plan = interleaved_plan(g, 2, 2, 4)
    assert plan.to_dict()["version"] == 4
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json", g)
    assert back.schedule == INTERLEAVED and back.placement == plan.placement
