"""The checkpoint probe: what a checkpointed span costs beyond the ops it runs again, per span,
per saved tensor and per op under a policy, fitted from runs with and without recomputation;
measured once per host; and the simulator charging it to a recomputing stage of the segment
runtime."""

from __future__ import annotations

import dataclasses

import pytest
from builders import costs, tiny_builtin_graph

import explorer as ex
from explorer.costs.strategies import checkpoint_spans, recomputation
from explorer.profiling import checkpoint_probe
from explorer.profiling.checkpoint_probe import BLOCKS, DEPTHS, RUNS, fit, probe_graph
from explorer.runtime import RankPool
from explorer.simulate.simulator import simulate

COSTS = {"span_fwd_s": 4e-5, "span_bwd_s": 9e-5, "saved_fwd_s": 5e-6, "saved_bwd_s": 6e-6,
         "policy_op_fwd_s": 2e-5, "policy_op_bwd_s": 2.5e-5}


def _spans(graph, mode):
    n = len(graph)
    has_b = [x.kind == "op" and x.requires_grad for x in graph.nodes]
    again = (recomputation(graph, mode, [0] * n, has_b).first_use >= 0).tolist()
    return checkpoint_spans(graph, [mode] * n, [0] * n, has_b, again)


def _steps(graphs, costs, fwd=2e-3, bwd=3e-3):
    """(forward, backward) seconds of a step of each probe run made from ``costs`` (each
    op's share of the plain forward run again; deeper blocks' steps longer)."""
    steps = {}
    for mode, depth in RUNS:
        g = graphs[depth]
        ops = sum(x.kind == "op" for x in g.nodes)
        f, b = fwd * depth, bwd * depth
        if mode == "none":
            steps[mode, depth] = (f, b)
            continue
        spans = _spans(g, mode)
        policy_ops = sum(len(x.ops) for x in spans if x.policy)
        saves = sum(x.saves for x in spans)
        steps[mode, depth] = (
            f + len(spans) * costs["span_fwd_s"] + saves * costs["saved_fwd_s"]
            + policy_ops * costs["policy_op_fwd_s"],
            b + f / ops * sum(len(x.rerun) for x in spans) + len(spans) * costs["span_bwd_s"]
            + saves * costs["saved_bwd_s"] + policy_ops * costs["policy_op_bwd_s"])
    return steps


def test_fit_recovers_the_costs_the_runs_were_made_with():
    """Steps made from known costs give those costs back: per span and per saved tensor
    from the full runs of the two depths, per op under the policy from the selective one."""
    graphs = {depth: probe_graph(depth) for depth in DEPTHS}
    for g in graphs.values():
        for mode in ("full", "selective"):
            spans = _spans(g, mode)
            assert len(spans) == BLOCKS and all(x.policy == (mode == "selective")
                                                for x in spans)
            assert all(x.saves > 0 for x in spans)
    assert _spans(graphs[4], "full")[0].saves == 4 * _spans(graphs[1], "full")[0].saves
    assert fit(graphs, _steps(graphs, COSTS)) == pytest.approx(COSTS, rel=1e-9)
    # spans that cost the same whatever they save: no cost per saved tensor
    flat = dict(COSTS, saved_fwd_s=0.0, saved_bwd_s=0.0)
    assert fit(graphs, _steps(graphs, flat)) == pytest.approx(flat, rel=1e-9, abs=1e-12)
    # a cost per saved tensor only: none per span, and none below 0 on noise that says less
    only = dict(COSTS, span_fwd_s=0.0, span_bwd_s=0.0)
    assert fit(graphs, _steps(graphs, only)) == pytest.approx(only, rel=1e-9, abs=1e-12)
    noisy = _steps(graphs, only)
    noisy["full", 1] = (noisy["full", 1][0] + 2e-4, noisy["full", 1][1])
    got = fit(graphs, noisy)
    assert all(v >= 0.0 for v in got.values()) and got["span_fwd_s"] > 0.0
    # runs no slower than without recomputation: nothing below 0
    plain = {run: _steps(graphs, COSTS)["none", run[1]] for run in RUNS}
    assert fit(graphs, plain) == dict.fromkeys(COSTS, 0.0)


def one_rank() -> ex.Cluster:
    """One CPU rank as if this host's link were measured (nothing is)."""
    nominal = ex.Cluster.cpu(1, measure=False)
    return dataclasses.replace(nominal, default_link=dataclasses.replace(
        nominal.default_link, source="measured (stand-in)"))


def test_measured_once_per_host_afresh_when_asked_and_unknown_when_it_fails(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(checkpoint_probe, "measure_checkpoint_costs",
                        lambda pool=None: calls.append(1) or dict(COSTS))
    assert checkpoint_probe.checkpoint_costs(one_rank()) == COSTS
    assert checkpoint_probe.checkpoint_costs(one_rank()) == COSTS and len(calls) == 1
    assert checkpoint_probe.checkpoint_costs(one_rank(), cache=False) == COSTS
    assert len(calls) == 2
    assert checkpoint_probe.checkpoint_costs(ex.Cluster.cpu(1, measure=False)) == {}

    def broken(pool=None):
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(checkpoint_probe, "measure_checkpoint_costs", broken)
    assert checkpoint_probe.checkpoint_costs(one_rank(), cache=False) == {}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_simulator_charges_each_span_and_runs_again_what_checkpoint_runs_again(mode):
    """A recomputing stage profiled for the segments: each span's forward costs the span
    cost more (and per saved tensor, and per op under the policy), its backward the span
    cost (and per saved tensor) and the forward of
    the ops checkpoint runs again; the op path's profile keeps the op path's rule and no
    span cost."""
    g = tiny_builtin_graph("gpt")
    cl = ex.Cluster.cpu(1, measure=False)
    c = costs(g, cl, {n.name: 1e-4 for n in g.nodes if n.kind == "op"},
              {n.name: 2e-4 for n in g.nodes if n.kind == "op"})
    key = cl.devices[0].type_key
    plan = ex.Plan.single(g, "cpu:0")
    again = plan.with_memory(recompute=mode)
    spans = _spans(g, mode)
    assert spans and all(len(x.rerun) <= len(x.ops) for x in spans)
    assert (mode == "selective") == all(x.policy for x in spans)
    plain = simulate(g, plan, c).step_s
    for runtime, checkpoint in (("ops", COSTS), ("segments", {}), ("segments", COSTS)):
        dc = dataclasses.replace(c.per_type[key], runtime=runtime, checkpoint=checkpoint)
        step = simulate(g, again, dataclasses.replace(c, per_type={key: dc})).step_s
        if runtime == "ops":  # (the simulator's own rule: the ops making a dropped value)
            rule = recomputation(g, mode)
            expected = 1e-4 * int((rule.first_use >= 0).sum())
        else:
            policy_ops = sum(len(x.ops) for x in spans if x.policy)
            expected = 1e-4 * sum(len(x.rerun) for x in spans) + (
                len(spans) * (COSTS["span_fwd_s"] + COSTS["span_bwd_s"])
                + sum(x.saves for x in spans) * (COSTS["saved_fwd_s"] + COSTS["saved_bwd_s"])
                + policy_ops * (COSTS["policy_op_fwd_s"] + COSTS["policy_op_bwd_s"])
                if checkpoint else 0.0)
        assert step - plain == pytest.approx(expected, rel=1e-6), runtime


def test_a_span_runs_again_up_to_its_last_saving_op_and_a_policy_keeps_what_it_keeps():
    """gpt's blocks: full runs again every op of a block up to the last one that saves a
    value (checkpoint stops early there), selective all of those but the matmul-like ones;
    the spans are the blocks' runs of consecutive ops."""
    g = tiny_builtin_graph("gpt")
    full, selective = _spans(g, "full"), _spans(g, "selective")
    assert [x.ops for x in full] == [x.ops for x in selective]
    for f, s in zip(full, selective, strict=True):
        assert list(f.ops) == list(range(f.ops[0], f.ops[-1] + 1)) or all(
            g.nodes[i].kind != "op" for i in set(range(f.ops[0], f.ops[-1])) - set(f.ops))
        saving = [i for i in f.ops if g.nodes[i].saves and g.nodes[i].requires_grad]
        assert f.rerun == tuple(i for i in f.ops if i <= saving[-1])
        assert set(s.rerun) == {i for i in f.rerun
                                if not ex.costs.strategies.is_matmul_like(g.nodes[i])}
        assert f.backward_at == max(i for i in f.ops if g.nodes[i].requires_grad)


@pytest.mark.slow
def test_the_probe_runs_on_one_cpu_rank():
    with RankPool(1) as pool:  # (as the profiler's rank is)
        got = checkpoint_probe.measure_checkpoint_costs(steps=4, warmup=1, pool=pool)
    assert set(got) == set(COSTS)
    assert all(0.0 <= v < 0.1 for v in got.values())  # seconds: a measurement, noise and all
    # checkpointing costs something: per span, with what its spans save (a noisy host's fit
    # may give all of it to the spans or all to the saved tensors, never less than nothing)
    assert sum(got[k] for k in ("span_fwd_s", "span_bwd_s", "saved_fwd_s", "saved_bwd_s")) > 0


def test_what_a_span_saves_besides_outputs_is_held_from_its_recomputation():
    """Checkpoint keeps none of what a span's ops save: their statistics and masks (gpt's
    layer norms') are made again with the span, in the backward, not held from the forward
    as the op path's recomputation holds them; so the fuller device's peak is lower."""
    g = tiny_builtin_graph("gpt")
    cl = ex.Cluster.cpu(1, measure=False)
    c = costs(g, cl, {n.name: 1e-4 for n in g.nodes if n.kind == "op"},
              {n.name: 2e-4 for n in g.nodes if n.kind == "op"})
    key = cl.devices[0].type_key
    plan = ex.Plan.single(g, "cpu:0").with_memory(recompute="full")
    assert sum(g.nodes[i].saved_extra_bytes for x in _spans(g, "full") for i in x.rerun) > 0
    peaks = {}
    for runtime in ("ops", "segments"):
        dc = dataclasses.replace(c.per_type[key], runtime=runtime)
        peaks[runtime] = simulate(g, plan, dataclasses.replace(c, per_type={key: dc})
                                  ).peak_bytes["cpu:0"]
    assert peaks["segments"] < peaks["ops"]
