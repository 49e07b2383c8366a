"""The simulator's fast paths give the results of the straightforward implementation it replaced.

``data/simulate_expected.json`` holds what the original event-driven simulator (before the
array-based rewrite) predicted for a broad set of cases: tiny and synthetic graphs with views,
buffers, shared weights, saved tensors and non-trainable ops; one device, pipelines, op-level
interleaved placements, replicated stages, stages without ops, parameters consumed on other
stages; GPipe and 1F1B with 1 to 4 micro-batches; scaled, calibrated and unit costs. Every
:class:`Prediction` field and the per-stage execution order must match it (floats to 1e-12
relative). Regenerate the file only when the simulator's results change on purpose:
``python tests/test_simulate_speed.py --regenerate`` (the memory figures were, when activation
gradients came to be modelled as autograd's buffers, and again when the gradient a weight's
accumulation makes anew came to be counted; everything else is the original's).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import pickle
import random
import sys
from pathlib import Path

import pytest
from brute import tiny_graph

from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.simulate.simulator import (
    Interval,
    Prediction,
    execution_order,
    lower_bound_s,
    simulate,
    unit_costs,
)

DATA = Path(__file__).parent / "data" / "simulate_expected.json"
REL = 1e-12
FULL_TIMELINE = 40  # timelines up to this many intervals are stored whole, longer ones digested


# -- cases ---------------------------------------------------------------------------------

def rich_graph(seed: int, n_ops: int = 12, batch_size: int = 8) -> OpGraph:
    """A random DAG with what captured graphs have: views (of ops and of inputs), buffers,
    weights shared by several ops, ops owning parameters, non-trainable ops, saved inputs and
    outputs, extra saved bytes, zero-byte outputs, two inputs, and ops named ``grad ...``."""
    rng = random.Random(seed)
    nodes = [OpNode("input_0", "input", "input", shapes=((batch_size, 16),),
                    out_bytes=batch_size * 64)]
    if rng.random() < 0.5:
        nodes.append(OpNode("input_1", "input", "input", shapes=((batch_size, 4),),
                            out_bytes=batch_size * 16))
    inputs = [n.name for n in nodes]
    ops: list[str] = []
    weights: list[str] = []
    for k in range(n_ops):
        pool = ops[-6:] or inputs
        srcs = rng.sample(pool, min(len(pool), rng.randint(1, 3)))
        if ops and rng.random() < 0.15:
            srcs.append(rng.choice(inputs))
        srcs = list(dict.fromkeys(srcs))
        extra = []
        r = rng.random()
        if r < 0.3:
            pb = rng.choice([256, 4096, 65536, 1 << 20])
            nodes.append(OpNode(f"w{k}", "param", "param", f"l{k}", "", (), ((pb // 4,),),
                                "float32", pb, pb, True))
            weights.append(f"w{k}")
            extra.append(f"w{k}")
        elif r < 0.45 and weights:
            extra.append(rng.choice(weights))  # a shared weight
        elif r < 0.5:
            nodes.append(OpNode(f"buf{k}", "buffer", "buffer", f"l{k}", "", (), ((16,),),
                                "float32", 64, 64, False))
            extra.append(f"buf{k}")
        name = f"grad op{k}" if rng.random() < 0.08 else f"op{k}"
        view = rng.random() < 0.2
        out = 0 if rng.random() < 0.05 else rng.choice([1, 16, 256]) * 1024
        flops = rng.choice([0, 1, 10, 100, 1000]) * 10**6
        saves = tuple(s for s in [*srcs, name] if rng.random() < 0.4)
        nodes.append(OpNode(
            name, "op", "view" if view else "synthetic", f"l{k}", "Synthetic",
            tuple(srcs + extra), ((max(out, 4) // 4,),), rng.choice(["float32", "bfloat16"]),
            out, rng.choice([0, 0, 0, 512]), rng.random() > 0.1, flops, 2 * flops, saves,
            rng.choice([0, 0, 128, 4096]), view))
        ops.append(name)
    return OpGraph(f"rich{seed}", nodes, batch_size, "synthetic", ops[-1])


def make_graph(spec: list) -> OpGraph:
    kind, *args = spec
    if kind == "tiny":
        return tiny_graph(*args)
    if kind == "rich":
        return rich_graph(*args)
    if kind == "layered":
        n, width, seed = args
        return layered_dag(n, width=width, seed=seed)
    raise ValueError(kind)


def make_plan(graph: OpGraph, ids: tuple[str, ...], spec: dict) -> Plan:
    """Stages and a placement of the ops (and some weights) on them, as ``spec`` says."""
    rng = random.Random(spec["seed"])
    layout = spec["layout"]
    ops = [i for i, n in enumerate(graph.nodes) if n.kind == "op"]
    devs = list(ids)
    if layout == "single":
        stages = [(devs[0],)]
    elif layout == "dp":
        stages = [tuple(devs)]
    elif layout == "replicated":  # the first stage holds two replicas
        stages = [tuple(devs[:2])] + [(d,) for d in devs[2:]]
    else:
        stages = [(d,) for d in devs]
    k = len(stages)
    assign: dict[int, int] = {}
    if layout in ("pipeline", "replicated", "reversed", "empty-stage"):
        used = k - 1 if layout == "empty-stage" else k
        for j, i in enumerate(ops):
            s = min(j * used // len(ops), used - 1)
            assign[i] = used - 1 - s if layout == "reversed" else s
    else:
        for i in ops:
            assign[i] = rng.randrange(k)
    if layout in ("random", "empty-stage", "replicated"):
        for i, n in enumerate(graph.nodes):  # some weights live away from their consumers
            if n.kind in ("param", "buffer") and rng.random() < 0.35:
                assign[i] = rng.randrange(k)
    return Plan.from_assignment(graph, stages, assign, micro_batches=spec["micro_batches"],
                                schedule=spec["schedule"], optimizer=spec["optimizer"],
                                algorithm=layout)


def make_case(case: dict) -> tuple[OpGraph, Plan, CostModel]:
    graph = make_graph(case["graph"])
    if case["costs"] == "unit":
        cl = Cluster.preset(case["cluster"])
        plan = make_plan(graph, cl.ids, case["plan"])
        return graph, plan, unit_costs(graph, plan)
    cl = Cluster.preset(case["cluster"])
    costs = roofline_costs(graph, cl)
    if isinstance(case["costs"], dict):
        tweaks = dict(case["costs"])
        overhead = tweaks.pop("overhead_s", None)
        costs = dataclasses.replace(costs, **tweaks)
        if overhead is not None:
            for dc in costs.per_type.values():
                dc.overhead_s = overhead
    return graph, make_plan(graph, cl.ids, case["plan"]), costs


def cases() -> list[dict]:
    rng = random.Random(2024)
    out = []
    layouts = ["single", "dp", "pipeline", "random", "replicated", "reversed", "empty-stage"]
    clusters = ["3xT4", "4xH100", "2xH100+2xT4", "2xA100-40GB+1xT4"]
    tweak_choices = ["roofline", "unit", {"compute_scale": 1.7, "link_scale": 0.6},
                     {"extra_op_s": 3e-5, "overhead_s": 2e-5},
                     {"extra_op_s": -5e-5}]  # calibration may fit a negative per-op cost
    for j in range(72):
        if j % 3 == 0:
            g = ["tiny", j, rng.randint(3, 7)]
        else:
            g = ["rich", j, rng.randint(4, 14)]
        out.append({"graph": g, "cluster": rng.choice(clusters),
                    "costs": tweak_choices[j % len(tweak_choices)],
                    "plan": {"layout": layouts[j % len(layouts)], "seed": j,
                             "micro_batches": rng.randint(1, 4),
                             "schedule": rng.choice(["gpipe", "1f1b"]),
                             "optimizer": rng.choice(["adam", "sgd", "momentum"])}})
    for j in range(12):
        out.append({"graph": ["layered", rng.choice([150, 240, 300]), rng.choice([3, 8]), j],
                    "cluster": rng.choice(["4xH100", "2xH100+2xT4"]),
                    "costs": tweak_choices[j % len(tweak_choices)],
                    "plan": {"layout": ["pipeline", "random", "replicated", "reversed",
                                        "empty-stage", "dp"][j % 6], "seed": 100 + j,
                             "micro_batches": 1 + j % 4,
                             "schedule": ["gpipe", "1f1b"][j // 6 % 2],
                             "optimizer": "adam"}})
    return out


# -- summaries -----------------------------------------------------------------------------

def _digest(x) -> str:
    return hashlib.sha256(json.dumps(x).encode()).hexdigest()[:20]


def summarize(pred: Prediction, order: list) -> dict:
    tl = [[iv.device, iv.lane, iv.kind, iv.start_s, iv.end_s, iv.label, iv.micro_batch]
          for iv in pred.timeline]
    if len(tl) <= FULL_TIMELINE:
        timeline = tl
    else:
        timeline = {"n": len(tl), "sha": _digest([[r[0], r[1], r[2], r[5], r[6]] for r in tl]),
                    "start_sum": math.fsum(r[3] for r in tl),
                    "end_sum": math.fsum(r[4] for r in tl), "end_max": max(r[4] for r in tl)}
    cp = list(pred.critical_path)
    if len(cp) > 60:
        cp = {"n": len(cp), "sha": _digest(cp), "head": cp[:5], "tail": cp[-5:]}
    return {
        "step_s": pred.step_s, "busy_s": pred.busy_s, "timeline": timeline,
        "memory": {d: [m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.buffers_bytes,
                       m.activations_bytes] for d, m in pred.memory.items()},
        "capacity_bytes": pred.capacity_bytes, "transfer_bytes": pred.transfer_bytes,
        "allreduce_bytes": pred.allreduce_bytes, "energy_j": pred.energy_j,
        "energy_by_device_j": pred.energy_by_device_j, "critical_path": cp,
        "bottleneck": pred.bottleneck, "lower_bound_s": pred.lower_bound_s,
        "algorithm": pred.algorithm,
        "execution_order": {"n": [len(s) for s in order], "sha": _digest(order)},
    }


def run_case(case: dict, sim_module=None) -> dict:
    sim = sim_module or sys.modules["explorer.simulate.simulator"]
    graph, plan, costs = make_case(case)
    pred = sim.simulate(graph, plan, costs)
    order = [[list(x) for x in s] for s in sim.execution_order(graph, plan, costs)]
    return summarize(pred, order)


def assert_same(got, want, path: str = "") -> None:
    """Equal structure; floats equal to ``REL`` relative."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, (int, float)) and isinstance(want, (int, float)), path
        assert math.isclose(got, want, rel_tol=REL, abs_tol=1e-15), f"{path}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{path}: keys differ"
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: lengths differ"
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}[{k}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _stored() -> list[dict]:
    return json.loads(DATA.read_text())


# -- tests ---------------------------------------------------------------------------------

def test_stored_cases_cover_the_generated_ones():
    assert [c["case"] for c in _stored()] == json.loads(json.dumps(cases()))


@pytest.mark.parametrize("k", range(len(cases())))
def test_same_results_as_the_reference_simulator(k):
    entry = _stored()[k]
    assert_same(json.loads(json.dumps(run_case(entry["case"]))), entry["expected"])


@pytest.fixture(scope="module")
def layered():
    g = layered_dag(400, seed=3)
    cl = Cluster.preset("4xH100")
    costs = roofline_costs(g, cl)
    plan = make_plan(g, cl.ids, {"layout": "random", "seed": 1, "micro_batches": 3,
                                 "schedule": "1f1b", "optimizer": "adam"})
    return g, plan, costs


class TestPrediction:
    def test_timeline_is_a_sorted_tuple_of_intervals(self, layered):
        pred = simulate(*layered)
        tl = pred.timeline
        assert isinstance(tl, tuple) and tl and all(isinstance(iv, Interval) for iv in tl)
        assert pred.timeline is tl  # built once
        keys = [(iv.device, iv.start_s) for iv in tl]
        assert keys == sorted(keys)
        for d, busy in pred.busy_s.items():
            work = math.fsum(iv.end_s - iv.start_s for iv in tl
                             if iv.device == d and iv.lane == "compute")
            assert work == pytest.approx(busy, rel=1e-9)

    def test_copies_pickles_and_equality(self, layered):
        pred = simulate(*layered)
        again = simulate(*layered)
        assert pred == again
        for other in (pickle.loads(pickle.dumps(pred)), copy.deepcopy(again),
                      dataclasses.replace(again)):
            assert other == pred
            assert other.timeline == pred.timeline
        with pytest.raises(dataclasses.FrozenInstanceError):
            pred.timeline = ()  # type: ignore[misc]
        assert dataclasses.asdict(pred)["timeline"][0] == dataclasses.asdict(
            pred.timeline[0])

    def test_constructed_with_a_plain_tuple(self):
        iv = Interval("d", "compute", "fwd", 0.0, 1.0, "a", 0)
        p = Prediction(1.0, {"d": 1.0}, (iv,), {}, {}, 0, 0, 0.0, {}, ("fwd a",), "d", 1.0,
                       "manual")
        assert p.timeline == (iv,)
        assert p.gap == 0.0

    def test_execution_order_follows_the_timeline(self, layered):
        graph, plan, costs = layered
        pred = simulate(graph, plan, costs)
        order = execution_order(graph, plan, costs)
        for s, devs in enumerate(plan.stages):
            tl = [(iv.kind, iv.micro_batch, iv.label) for iv in pred.timeline
                  if iv.device == devs[0] and iv.lane == "compute"]
            got = [(k, m, graph.nodes[i].name if i >= 0 else f"{plan.optimizer} step")
                   for k, m, i in order[s]]
            assert got == tl

    def test_lower_bound_is_below_the_step(self, layered):
        graph, plan, costs = layered
        pred = simulate(graph, plan, costs)
        assert pred.lower_bound_s == lower_bound_s(graph, costs)
        assert 0 < pred.lower_bound_s <= pred.step_s


class _Doubled(CostModel):
    """A cost model whose methods are overridden: the simulator must call them."""

    def fwd_s(self, i, device_id, fraction=1.0):
        return 2 * super().fwd_s(i, device_id, fraction)

    def bwd_s(self, i, device_id, fraction=1.0):
        return 2 * super().bwd_s(i, device_id, fraction)

    def transfer_s(self, src, dst, nbytes):
        return 2 * super().transfer_s(src, dst, nbytes)


def test_overridden_cost_methods_are_used():
    g = layered_dag(60, seed=1)
    cl = Cluster.preset("2xH100")
    costs = roofline_costs(g, cl)
    doubled = _Doubled(costs.graph_fingerprint, cl, costs.per_type)
    plan = make_plan(g, cl.ids, {"layout": "random", "seed": 0, "micro_batches": 2,
                                 "schedule": "gpipe", "optimizer": "sgd"})
    a, b = simulate(g, plan, costs), simulate(g, plan, doubled)
    assert sum(b.busy_s.values()) > 1.9 * sum(a.busy_s.values())
    assert b.lower_bound_s == pytest.approx(2 * a.lower_bound_s)
    assert b.step_s > 1.9 * a.step_s


class _OneByOne(CostModel):
    """Same numbers as CostModel, asked node by node (the simulator's slow path)."""

    def fwd_s(self, i, device_id, fraction=1.0):
        return super().fwd_s(i, device_id, fraction)


@pytest.mark.parametrize("micro_batches", [2, 3, 8])
def test_measured_fractions_are_used_for_micro_batches(micro_batches):
    """Costs profiled at fractions of the batch interpolate the same in the array path."""
    g = layered_dag(60, seed=3)
    cl = Cluster.preset("2xH100")
    costs = roofline_costs(g, cl)
    rng = random.Random(micro_batches)
    for dc in costs.per_type.values():
        dc.fractions = [0.5, 0.25]
        dc.fwd_at = [[t * rng.uniform(0.4, 0.9) for t in dc.fwd_s] for _ in range(2)]
        dc.bwd_at = [[t * rng.uniform(0.4, 0.9) for t in dc.bwd_s] for _ in range(2)]
    costs.extra_op_s, costs.compute_scale = 1e-6, 1.3
    plan = make_plan(g, cl.ids, {"layout": "pipeline", "seed": 0,
                                 "micro_batches": micro_batches,
                                 "schedule": "1f1b", "optimizer": "sgd"})
    fast = simulate(g, plan, costs)
    slow = simulate(g, plan, _OneByOne(costs.graph_fingerprint, cl, costs.per_type,
                                       costs.compute_scale, costs.link_scale,
                                       costs.extra_op_s))
    assert fast.step_s == pytest.approx(slow.step_s, rel=1e-12)
    assert fast.busy_s == pytest.approx(slow.busy_s, rel=1e-12)
    plain = roofline_costs(g, cl)  # the same times without the measured fractions differ
    plain.extra_op_s, plain.compute_scale = 1e-6, 1.3
    assert simulate(g, plan, plain).step_s != pytest.approx(fast.step_s, rel=1e-6)


def test_editing_a_graphs_nodes_is_noticed():
    """The simulator keeps per-graph arrays between calls; a changed node must not reuse them."""
    g = layered_dag(80, seed=2)
    cl = Cluster.preset("2xH100")
    costs = roofline_costs(g, cl)
    plan = make_plan(g, cl.ids, {"layout": "pipeline", "seed": 0, "micro_batches": 2,
                                 "schedule": "gpipe", "optimizer": "adam"})
    before = simulate(g, plan, costs)
    i = next(k for k, n in enumerate(g.nodes) if n.kind == "op")
    g.nodes[i] = dataclasses.replace(g.nodes[i], out_bytes=g.nodes[i].out_bytes * 10_000)
    after = simulate(g, plan, costs)
    fresh = OpGraph(g.name, list(g.nodes), g.batch_size, g.source, g.loss)
    assert after.peak_bytes != before.peak_bytes
    assert after == simulate(fresh, plan, costs)


def test_a_graph_without_ops():
    g = OpGraph("empty", [OpNode("x", "input", "input", out_bytes=64),
                          OpNode("w", "param", "param", out_bytes=16, param_bytes=16,
                                 requires_grad=True)], 8)
    cl = Cluster.preset("2xH100")
    plan = Plan.from_assignment(g, [(cl.ids[0],), (cl.ids[1],)], {"w": 1})
    pred = simulate(g, plan, roofline_costs(g, cl))  # only the optimizer step runs
    assert [iv.kind for iv in pred.timeline] == ["optimizer"]
    assert pred.critical_path == ("optimizer adam step",)
    assert type(pred.busy_s[cl.ids[0]]) is float and pred.busy_s[cl.ids[0]] == 0.0
    assert pred.step_s == pred.busy_s[cl.ids[1]] > 0
    assert pred.memory[cl.ids[1]].params_bytes == 16
    assert execution_order(g, plan) == [[], [("optimizer", -1, -1)]]


@pytest.mark.slow
def test_a_100k_node_graph_simulates_in_seconds():
    g = layered_dag(100_000)
    cl = Cluster.preset("8xH100")
    costs = roofline_costs(g, cl)
    ops = [i for i, n in enumerate(g.nodes) if n.kind == "op"]
    plan = Plan.from_assignment(g, [(d,) for d in cl.ids],
                                {i: k * 8 // len(ops) for k, i in enumerate(ops)})
    pred = simulate(g, plan, costs)  # its speed is measured by benchmarks/scale.py
    assert pred.step_s > 0 and pred.fits
    assert pred.critical_path and len(pred.timeline) >= 2 * len(ops)


# -- regeneration --------------------------------------------------------------------------

def regenerate(sim_module=None) -> None:
    out = [{"case": c, "expected": run_case(c, sim_module)} for c in cases()]
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {len(out)} cases to {DATA} ({DATA.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    if "--regenerate" in sys.argv:
        regenerate()
