"""The segment runtime: ops grouped into segments on hand-built schedules, their generated code,
and (slow) real runs with ``runtime="segments"`` equal to the op path and to one device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from builders import tiny_builtin_graph
from torch import nn
from torch.utils.checkpoint import checkpoint

import explorer as ex
from explorer.core.schedule import BWD, FWD, Action
from explorer.core.segments import grad_sources, group_segments
from explorer.costs.strategies import recompute_units, rerun_ops
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool
from explorer.runtime.checkpointing import checkpointing
from explorer.runtime.jobfiles import (
    Job,
    fill_refs,
    job_problem,
    program_parts,
    read_job,
    resolve_target,
    write_job,
)
from explorer.runtime.launch import reference
from explorer.runtime.segments import (
    CheckpointedRun,
    CheckpointRegions,
    choose_runtime,
    rerunning_units,
    segment_code,
)
from explorer.simulate.simulator import execution_order

STEPS, WARMUP = 2, 1


def _f(m: int, node: int) -> Action:
    return Action(FWD, m, node)


def _b(m: int, node: int) -> Action:
    return Action(BWD, m, node)


def _groups(actions, s, stage, preds, loss=None, requires_grad=None):
    kind = ["input" if not p else "op" for p in preds]
    needs = requires_grad or [k == "op" for k in kind]
    return [(seg.micro_batch, seg.nodes)
            for seg in group_segments(actions, s, stage, kind, preds, needs, loss)]


# a chain x -> a -> b -> c (the loss), every node on stage 0
CHAIN = [[], [0], [1], [2]]


class TestGrouping:
    def test_one_stage_one_micro_batch_is_one_segment(self):
        actions = [_f(0, 1), _f(0, 2), _f(0, 3), _b(0, 3), _b(0, 2), _b(0, 1),
                   Action.optimizer_step()]
        segs = group_segments(actions, 0, [0] * 4, ["input", "op", "op", "op"], CHAIN,
                              [False, True, True, True], loss=3)
        assert [(s.micro_batch, s.nodes) for s in segs] == [(0, (1, 2, 3))]
        seg = segs[0]
        assert seg.inputs == (0,) and seg.uses == (1,)
        assert seg.outputs == (3,)  # the loss, read by nobody
        assert (seg.forward_at, seg.backward_at) == (0, 3)  # its backward: b(c), the first

    def test_one_micro_batch_per_segment(self):
        """GPipe's forwards of two micro-batches follow each other: two segments."""
        actions = [_f(0, 1), _f(0, 2), _f(0, 3), _f(1, 1), _f(1, 2), _f(1, 3),
                   _b(0, 3), _b(0, 2), _b(0, 1), _b(1, 3), _b(1, 2), _b(1, 1)]
        assert _groups(actions, 0, [0] * 4, CHAIN, loss=3) == [(0, (1, 2, 3)),
                                                                 (1, (1, 2, 3))]

    def test_a_receive_after_a_send_cuts_the_segment(self):
        """a and c on stage 0, b (between them) on stage 1: c waits for b's value, which
        needs a's, sent when a's segment ends: c cannot run in a's segment. A value
        received earlier does not cut."""
        stage = [0, 0, 1, 0]
        actions = [_f(0, 1), _f(0, 3), _b(0, 3), _b(0, 1)]
        assert _groups(actions, 0, stage, CHAIN, loss=3) == [(0, (1,)), (0, (3,))]
        # d reads b too, after c: b was received for c, so d joins c's segment
        preds = [[], [0], [1], [2], [2, 3]]
        actions = [_f(0, 1), _f(0, 3), _f(0, 4), _b(0, 4), _b(0, 3), _b(0, 1)]
        assert _groups(actions, 0, [0, 0, 1, 0, 0], preds, loss=4) == [(0, (1,)),
                                                                         (0, (3, 4))]

    def test_a_receive_after_ops_that_send_nothing_moves_to_the_start(self):
        """The last stage: k needs nothing from stage 0, b reads a's value. Receiving it
        before k runs passes no send, so (k, b) is one segment that reads a as input."""
        preds = [[], [0], [0], [1, 2]]  # x, a (stage 0), k, b (the loss)
        actions = [_f(0, 2), _f(0, 3), _b(0, 3), _b(0, 2)]
        segs = group_segments(actions, 1, [1, 0, 1, 1], ["input", "op", "op", "op"], preds,
                              [False, True, True, True], loss=3)
        assert [(seg.nodes, seg.inputs) for seg in segs] == [((2, 3), (0, 1))]

    def test_a_gradient_receive_after_a_gradient_send_cuts(self):
        """c reads e (stage 1); a reads c and feeds b (stage 0) and d (stage 1); b reads a
        and e. In backward order b, a, c: b's backward sends e's gradient, a's waits for
        d's, which may need it: b cannot be in a's segment. Without b reading e nothing is
        sent before the receive, which moves to the segment backward's start."""
        # x, e, c, a, b, d
        stage = [0, 1, 0, 0, 0, 1]
        actions = [_f(0, 2), _f(0, 3), _f(0, 4), _b(0, 4), _b(0, 3), _b(0, 2)]
        preds = [[], [0], [1], [2], [3, 1], [3]]
        assert _groups(actions, 0, stage, preds, loss=4) == [(0, (2, 3)), (0, (4,))]
        preds = [[], [0], [1], [2], [3], [3]]
        assert _groups(actions, 0, stage, preds, loss=4) == [(0, (2, 3, 4))]

    def test_backward_actions_of_a_segment_are_consecutive(self):
        """Two micro-batches' backwards interleaved op by op: a segment of one micro-batch
        would run its backward across the other's, so each op is its own segment."""
        actions = [_f(0, 1), _f(0, 2), _f(1, 1), _f(1, 2),
                   _b(0, 2), _b(1, 2), _b(0, 1), _b(1, 1)]
        assert _groups(actions, 0, [0, 0, 0], [[], [0], [1]], loss=2) == [
            (0, (1,)), (0, (2,)), (1, (1,)), (1, (2,))]

    def test_a_placement_that_interleaves_stages(self):
        """Every other op on the other stage: each op waits for the one before, so each is
        a segment of its own on both stages, and every segment reads across."""
        graph = tiny_builtin_graph("mlp")
        ops = [n.name for n in graph.nodes if n.kind == "op"]
        plan = ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)],
                                       {nm: k % 2 for k, nm in enumerate(ops)})
        for s, actions in enumerate(execution_order(graph, plan)):
            segs = _real_segments(graph, plan, s, actions)
            assert [seg.nodes for seg in segs] == [(a.node,) for a in actions if a.kind == FWD]

    @pytest.mark.parametrize("path", ["single", "gpipe", "1f1b", "data-parallel"])
    @pytest.mark.parametrize("name", ["mlp", "gpt"])
    def test_built_in_plans_keep_the_rules(self, name, path):
        """The built-in models' plans: the rules hold on every stage; one device and
        data-parallel replicas run each micro-batch as one segment of all their ops (a
        pipeline's schedule may interleave a micro-batch's backward with the next one's
        forward, which cuts)."""
        graph = tiny_builtin_graph(name)
        plan = _plan(name, path)
        for s, actions in enumerate(execution_order(graph, plan)):
            segs = _real_segments(graph, plan, s, actions)
            _check_rules(graph, plan, s, actions, segs)
            if path in ("single", "data-parallel"):
                ops = tuple(a.node for a in actions if a.kind == FWD and a.micro_batch == 0)
                assert [(seg.micro_batch, seg.nodes) for seg in segs] == [
                    (m, ops) for m in range(plan.micro_batches)]

    def test_random_placements_keep_the_rules(self):
        """Ops placed at random over three stages: every segment's forward and backward
        actions are consecutive and only its first actions wait for other stages."""
        graph = tiny_builtin_graph("gpt")
        ops = [n.name for n in graph.nodes if n.kind == "op"]
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            place = torch.randint(0, 3, (len(ops),), generator=gen).tolist()
            plan = ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",), ("cpu:2",)],
                                           dict(zip(ops, place, strict=True)),
                                           micro_batches=2)
            for s, actions in enumerate(execution_order(graph, plan)):
                _check_rules(graph, plan, s, actions, _real_segments(graph, plan, s, actions))


def _facts(graph, plan):
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    preds = [[index[p] for p in n.inputs] for n in graph.nodes]
    stage = [plan.placement[n.name] for n in graph.nodes]
    return preds, stage


def _real_segments(graph, plan, s, actions):
    preds, stage = _facts(graph, plan)
    return group_segments(actions, s, stage, [n.kind for n in graph.nodes], preds,
                          [n.requires_grad for n in graph.nodes],
                          [n.name for n in graph.nodes].index(graph.loss))


def _one_device_segment(graph):
    """The single-device plan's one segment of ``graph``, the job's calls, state and each
    call's target (None for a non-op)."""
    plan = ex.Plan.single(graph, "cpu:0")
    (seg,) = _real_segments(graph, plan, 0, execution_order(graph, plan)[0])
    rt = graph.runtime
    calls, state = program_parts(rt.program, len(rt.inputs))
    targets = [resolve_target(c.target) if c.kind == "op" else None for c in calls]
    return seg, calls, state, targets


def test_a_zero_3_stage_cuts_its_segments_where_the_unit_changes():
    """With units (a ZeRO 3 stage's gather groups), each segment holds one unit's ops, in
    the order the uncut segments hold them."""
    graph = tiny_builtin_graph("gpt")
    plan = _plan("gpt", "data-parallel")
    units = recompute_units(graph)
    preds, stage = _facts(graph, plan)
    actions = execution_order(graph, plan)[0]
    cut = group_segments(actions, 0, stage, [n.kind for n in graph.nodes], preds,
                         [n.requires_grad for n in graph.nodes],
                         [n.name for n in graph.nodes].index(graph.loss), units)
    whole = _real_segments(graph, plan, 0, actions)
    assert len(cut) > len(whole) == plan.micro_batches
    for seg in cut:
        assert len({units[i] for i in seg.nodes}) == 1
    for m, seg in enumerate(whole):
        assert sum((c.nodes for c in cut if c.micro_batch == m), ()) == seg.nodes
    _check_rules(graph, plan, 0, actions, cut)


def test_rerunning_units_name_only_the_units_that_run_an_op_again():
    units = ["a", "a", "b", "b", "c"]
    assert rerunning_units(units, [False, True, False, False, False]) == ["a", "a", "", "", ""]
    assert rerunning_units(units, None) == units


@pytest.mark.parametrize("name,mode", [("gpt", "full"), ("gpt", "selective"), ("mlp", "full")])
def test_a_recomputing_segment_checkpoints_each_run_of_a_rerunning_unit_inside_it(name, mode):
    """Recomputing, the single-device segment stays one (one autograd backward), its code
    calling each maximal run of consecutive ops of a unit that runs an op again under
    checkpoint, as a user checkpoints a block inside the forward: gpt's blocks are such runs,
    mlp's units (one module each) run nothing again, so its code checkpoints nothing. The
    values and gradients are those of the code without checkpointing."""
    graph = tiny_builtin_graph(name)
    plan = ex.Plan.single(graph, "cpu:0")
    seg, calls, state, targets = _one_device_segment(graph)
    rt = graph.runtime
    reruns = rerun_ops(graph, plan.with_memory(recompute=mode))
    units = rerunning_units(recompute_units(graph), reruns)
    called: list = []

    def run(region, reads):
        called.append(region)
        return checkpoint(region.body.forward, *reads, use_reentrant=False)

    regions = CheckpointRegions(units=units, buffer=[c.kind == "buffer" for c in calls],
                                how=lambda nodes: checkpointing(mode, [targets[i] for i in nodes]),
                                run=run)
    plain = segment_code(seg, calls, targets, [False] * len(calls))
    code = segment_code(seg, calls, targets, [False] * len(calls), regions=regions)
    runs = [m for m in code.module.modules() if isinstance(m, CheckpointedRun)]
    expected: list[list[int]] = []  # the maximal runs of consecutive ops of one unit
    for k, i in enumerate(seg.nodes):
        if units[i] and k and units[seg.nodes[k - 1]] == units[i]:
            expected[-1].append(i)
        elif units[i]:
            expected.append([i])
    assert len(runs) == len(expected) == (name == "gpt") * len({units[i] for i in seg.nodes
                                                                 if units[i]})
    assert [sum(n.op == "call_function" for n in r.body.graph.nodes) for r in runs] == \
        [len(run) for run in expected]
    batch = {**{f"input_{k}": t for k, t in enumerate(rt.inputs)},
             **{f"target_{k}": t for k, t in enumerate(rt.targets)}}
    grads = []
    for c in (plain, code):
        args = [state[calls[p].name].detach().clone().requires_grad_(calls[p].kind == "param")
                if calls[p].kind in ("param", "buffer") else batch[calls[p].name]
                for p in seg.inputs]
        (loss,) = c.forward(*args)
        loss.backward()
        grads.append([a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad])
    assert len(called) == len(runs)
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.equal(got, want)


def _check_rules(graph, plan, s, actions, segs):
    """Every forward action in exactly one segment; a segment's forward and backward actions
    consecutive; no op reads a value of another stage not yet received after an op of its
    segment that sends its value; no op waits for a gradient from another stage after (in
    backward order) an op of its segment that may send one."""
    preds, stage = _facts(graph, plan)
    succs = [[] for _ in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    requires = [n.requires_grad for n in graph.nodes]
    covered = sorted(seg.forward_at + k for seg in segs for k in range(len(seg.nodes)))
    assert covered == [k for k, a in enumerate(actions) if a.kind == FWD]
    seen: set = set()
    for seg in segs:
        m = seg.micro_batch
        assert [actions[seg.forward_at + k] for k in range(len(seg.nodes))] == \
            [_f(m, i) for i in seg.nodes]
        sent = False
        for i in seg.nodes:
            remote = {(m, p) for p in preds[i] if stage[p] != s
                      and graph.nodes[p].kind == "op"} - seen
            assert not (remote and sent)
            seen |= remote
            sent = sent or any(stage[c] != s for c in succs[i])
        with_backward = [i for i in seg.nodes if _b(m, i) in actions]
        assert with_backward == [i for i in seg.nodes if requires[i]]
        assert seg.backward_nodes == tuple(with_backward)
        if not with_backward:
            assert seg.backward_at is None
            continue
        at = sorted(actions.index(_b(m, i)) for i in with_backward)
        assert at == list(range(at[0], at[0] + len(at))) and seg.backward_at == at[0]
        sent = False
        for k in at:
            i = actions[k].node
            assert not (grad_sources(i, s, stage, succs, requires) and sent)
            sent = sent or any(stage[p] != s and graph.nodes[p].kind == "op" and requires[p]
                               for p in preds[i])


def _plan(name: str, path: str) -> ex.Plan:
    """The plans of the correctness runs: one device; two pipeline stages with 2 (GPipe) or
    4 (1F1B) micro-batches; two data-parallel replicas."""
    graph = tiny_builtin_graph(name)
    cluster = ex.Cluster.cpu(2, measure=False)
    if path == "single":
        return ex.Plan.single(graph, "cpu:0")
    costs = roofline_costs(graph, cluster)
    if path == "gpipe":
        return ex.partition(graph, cluster, costs, "even-layers", micro_batches=2,
                            schedule="gpipe")
    if path == "1f1b":
        return ex.partition(graph, cluster, costs, "even-layers", micro_batches=4,
                            schedule="1f1b")
    if path == "stages":
        return ex.partition(graph, cluster, costs, "even-layers")
    if path == "interleaved":
        ops = [n.name for n in graph.nodes if n.kind == "op"]
        return ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)],
                                       {nm: k % 2 for k, nm in enumerate(ops)})
    assert path == "data-parallel"
    return ex.partition(graph, cluster, costs, "data-parallel")


class TestCode:
    @pytest.mark.parametrize("name", ["mlp", "gpt"])
    def test_generated_code_computes_what_the_ops_compute(self, name):
        """The single-device segment's generated Python (no interpreter) gives the values
        the op path's calls give, bit for bit."""
        graph = tiny_builtin_graph(name)
        seg, calls, state, targets = _one_device_segment(graph)
        rt = graph.runtime
        code = segment_code(seg, calls, targets, [False] * len(calls))
        assert "torch.ops.aten" in code.module.code and "Interpreter" not in code.module.code
        batch = {**{f"input_{k}": t for k, t in enumerate(rt.inputs)},
                 **{f"target_{k}": t for k, t in enumerate(rt.targets)}}
        values = {c.name: (state[c.name] if c.kind in ("param", "buffer") else batch[c.name])
                  for c in calls if c.kind != "op"}
        for c, target in zip(calls, targets, strict=True):
            if c.kind == "op":
                values[c.name] = target(*fill_refs(c.args, values), **fill_refs(c.kwargs, values))
        outs = code.forward(*(values[calls[p].name] for p in seg.inputs))
        assert len(outs) == len(seg.outputs) == 1
        assert torch.equal(outs[0], values[graph.loss])

    def test_a_random_op_is_seeded_before_it_runs(self):
        seg, calls, _, targets = _one_device_segment(_dropout_graph())
        random = [isinstance(t, torch._ops.OpOverload)
                  and torch.Tag.nondeterministic_seeded in t.tags for t in targets]
        code = segment_code(seg, calls, targets, random)
        assert len(code.random) == 2
        lines = [line.strip() for line in code.module.code.splitlines()]
        drops = [k for k, line in enumerate(lines) if "aten.dropout.default" in line]
        assert len(drops) == 2
        for k, i in zip(drops, code.random, strict=True):
            assert lines[k - 1].startswith("reseed = explorer_runtime_segments_reseed(") or \
                lines[k - 1].startswith("reseed"), lines[k - 1]
            assert f"seed_{i}" in lines[k - 1]


class TestSettings:
    def test_the_default_is_the_segments(self):
        """Not asked, a run takes the segments, whatever the plan's settings; asked, the
        runtime asked for."""
        assert choose_runtime(None, False) == "segments"
        assert choose_runtime("ops", False) == "ops"
        assert choose_runtime(None, True) == "segments"
        graph = tiny_builtin_graph("mlp")
        plan = _plan("mlp", "data-parallel").with_memory(recompute="selective")
        meas = ex.run(graph, plan=plan, steps=1, warmup=0, progress=False)
        assert meas.runtime == "segments"

    def test_an_unknown_runtime_is_refused(self):
        graph = tiny_builtin_graph("mlp")
        with pytest.raises(ex.ExplorerError, match="runtime must be one of 'ops', 'segments'"):
            ex.run(graph, plan=ex.Plan.single(graph, "cpu:0"), runtime="fast")

    def test_the_job_records_the_runtime(self, tmp_path):
        """job.json carries the runtime, checked on read; a folder without it runs ops."""
        graph = tiny_builtin_graph("mlp")
        plan = ex.Plan.single(graph, "cpu:0")
        rt = graph.runtime
        calls, state = program_parts(rt.program, len(rt.inputs))
        job = Job(calls=calls, state=state, plan=plan, schedule=execution_order(graph, plan),
                  inputs=list(rt.inputs), targets=list(rt.targets), steps=1, warmup=0,
                  lr=1e-3, record=False, timeout_s=60.0, device_map={"cpu:0": "cpu"},
                  requires_grad=[n.requires_grad for n in graph.nodes], loss=graph.loss,
                  runtime="segments")
        assert job_problem(job) is None
        assert "field 'runtime' is 'fast', but it must be 'ops' or 'segments'" in \
            job_problem(dataclasses.replace(job, runtime="fast"))
        write_job(tmp_path, job)
        assert read_job(tmp_path).runtime == "segments"
        meta = (tmp_path / "job.json").read_text()
        (tmp_path / "job.json").write_text(meta.replace(', "runtime": "segments"', ""))
        assert read_job(tmp_path).runtime == "ops"


# -- real runs (slow) -----------------------------------------------------------------------
_RUNS: dict = {}


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's real runs."""
    with RankPool() as ranks:
        yield ranks


def _run(pool: RankPool, graph, plan, runtime: str, key, seed: int = 0) -> ex.Measurement:
    full = (key, runtime, seed)
    if full not in _RUNS:
        _RUNS[full] = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False,
                             record=True, timeout_s=180, runtime=runtime, seed=seed,
                             pool=pool)
        assert _RUNS[full].runtime == runtime
    return _RUNS[full]


def _assert_same_as_ops(seg: ex.Measurement, ops: ex.Measurement) -> None:
    """The same ops in the same order: losses and first gradients bit for bit."""
    assert seg.losses == ops.losses
    assert set(seg.grads) == set(ops.grads)
    for k, g in ops.grads.items():
        assert torch.equal(seg.grads[k], g), k


def _assert_like_one_device(meas: ex.Measurement, name: str, plan: ex.Plan,
                            rtol: float = 1e-5, grad_share: float | None = None) -> None:
    shards = max(len(s) for s in plan.stages) * plan.micro_batches
    ref = reference(ex.builtin_model(name, "tiny"), STEPS + WARMUP, shards,
                    optimizer=plan.optimizer)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=rtol, atol=1e-6 if grad_share is None else 0)
    assert set(meas.grads) == set(ref.grads)
    for k, g in ref.grads.items():
        if grad_share is None:
            torch.testing.assert_close(meas.grads[k], g, rtol=1e-4, atol=1e-6, msg=k)
        else:
            torch.testing.assert_close(meas.grads[k], g, rtol=0,
                                       atol=grad_share * float(g.abs().max()), msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["single", "gpipe", "1f1b", "data-parallel"])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_segments_equal_the_op_path_and_one_device(name, path, pool):
    """One CPU rank, two pipeline stages (GPipe over 2, 1F1B over 4 micro-batches) and two
    data-parallel replicas: the segment runtime's losses and first gradients are the op
    path's bit for bit, and one device's in eager PyTorch within float rounding."""
    graph, plan = tiny_builtin_graph(name), _plan(name, path)
    seg = _run(pool, graph, plan, "segments", (name, path))
    _assert_same_as_ops(seg, _run(pool, graph, plan, "ops", (name, path)))
    _assert_like_one_device(seg, name, plan)


@pytest.mark.slow
def test_segments_run_an_interleaved_placement(pool):
    """Every other op on the other rank: one-op segments sending and receiving each way."""
    graph, plan = tiny_builtin_graph("mlp"), _plan("mlp", "interleaved")
    seg = _run(pool, graph, plan, "segments", ("mlp", "interleaved"))
    _assert_same_as_ops(seg, _run(pool, graph, plan, "ops", ("mlp", "interleaved")))
    _assert_like_one_device(seg, "mlp", plan)


@pytest.mark.slow
def test_segments_run_replica_counts_that_differ(pool):
    """Stage 0 on two replicas, stage 1 on one: stage 1's rank runs each segment on both
    shards of a micro-batch in turn, receiving from and sending to either replica."""
    graph = tiny_builtin_graph("mlp")
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1"), ("cpu:2",)],
                                   {nm: int(k >= len(ops) // 2) for k, nm in enumerate(ops)})
    seg = _run(pool, graph, plan, "segments", ("mlp", "replicas 2, 1"))
    _assert_same_as_ops(seg, _run(pool, graph, plan, "ops", ("mlp", "replicas 2, 1")))
    _assert_like_one_device(seg, "mlp", plan)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_segments_run_zero(zero, pool):
    """Two data-parallel replicas with ZeRO 1-3 train as the op path and one device. ZeRO 3
    gathers a unit's weights for its segment, as the op path gathers them for its ops: no
    more gathered at the peak than op by op, and the peak within 5 % of the prediction."""
    graph = tiny_builtin_graph("gpt")
    plan = _plan("gpt", "data-parallel").with_memory(zero=zero)
    seg = _run(pool, graph, plan, "segments", ("gpt", "zero", zero))
    ops = _run(pool, graph, plan, "ops", ("gpt", "zero", zero))
    _assert_same_as_ops(seg, ops)
    _assert_like_one_device(seg, "gpt", plan)
    if zero == 3:
        for d, by in ops.peak_by_category.items():
            assert 0 < seg.peak_by_category[d]["gathered"] <= by["gathered"], d
        predicted = ex.simulate(graph, plan, roofline_costs(
            graph, ex.Cluster.cpu(2, measure=False))).peak_bytes
        for d, peak in predicted.items():
            assert abs(seg.peak_bytes[d] / peak - 1) < 0.05, (d, seg.peak_bytes[d], peak)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_segments_recompute_a_unit_in_its_backward(name, mode, pool):
    """Recomputation checkpoints each unit's segment (torch's selective checkpointing; with
    "selective" matmul outputs kept): the values run again are the values the
    forward made, so losses and gradients equal the op path's recomputation and the run
    without it bit for bit; on gpt (whose activations outweigh what a unit holds to run
    again) the fuller rank holds less at its peak than without."""
    graph = tiny_builtin_graph(name)
    path = "1f1b" if name == "gpt" else "gpipe"
    plan = _plan(name, path)
    again = plan.with_memory(recompute=mode)
    seg = _run(pool, graph, again, "segments", (name, path, mode))
    plain = _run(pool, graph, plan, "segments", (name, path))
    _assert_same_as_ops(seg, _run(pool, graph, again, "ops", (name, path, mode)))
    _assert_same_as_ops(seg, plain)
    if name == "gpt":
        fuller = max(plain.peak_bytes, key=plain.peak_bytes.get)
        assert seg.peak_bytes[fuller] < plain.peak_bytes[fuller]


# (loss rtol, gradient share of its tensor's largest) against fp32 on one device, as the op
# path's own precision test allows
PRECISION_TOLERANCE = {"bf16": (1e-3, 6e-2), "fp16": (1e-4, 5e-3)}


@pytest.mark.slow
@pytest.mark.parametrize("name,precision", [("mlp", "bf16"), ("gpt", "bf16"),
                                            ("gpt", "fp16")])
def test_segments_run_a_lower_precision_stage(name, precision, pool):
    """Autocast around a segment casts as it does around each op (fp16 with the loss
    scale): the op path's losses and gradients, and one device's within the precision's
    tolerance."""
    graph = tiny_builtin_graph(name)
    plan = _plan(name, "stages").with_memory(precision=precision)
    seg = _run(pool, graph, plan, "segments", (name, precision))
    _assert_same_as_ops(seg, _run(pool, graph, plan, "ops", (name, precision)))
    rtol, share = PRECISION_TOLERANCE[precision]
    _assert_like_one_device(seg, name, plan, rtol=rtol, grad_share=share)


def _dropout_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 32),
                          nn.Dropout(0.3), nn.Linear(32, 1))
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    return ex.capture(model, x, nn.MSELoss(), y, name="dropout-mlp")


@pytest.mark.slow
def test_dropout_draws_what_the_op_path_draws(pool):
    """Dropout in a segment draws the op path's masks: one device and a two-stage pipeline
    over two micro-batches give the op path's losses bit for bit, repeat them, and another
    seed draws otherwise."""
    graph = _dropout_graph()
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    half = {nm: int(k >= len(ops) // 2) for k, nm in enumerate(ops)}
    plans = {"single": ex.Plan.single(graph, "cpu:0"),
             "pipeline-2mb": ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)], half,
                                                     micro_batches=2)}
    for name, plan in plans.items():
        seg = _run(pool, graph, plan, "segments", ("dropout", name))
        assert seg.losses == _run(pool, graph, plan, "ops", ("dropout", name)).losses, name
        again = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False,
                       timeout_s=180, runtime="segments", pool=pool)
        assert again.losses == seg.losses, name
    single = plans["single"]
    assert _run(pool, graph, single, "segments", ("dropout", "single"), seed=1).losses \
        != _run(pool, graph, single, "segments", ("dropout", "single")).losses


@pytest.mark.slow
@pytest.mark.parametrize("path", ["single", "gpipe", "1f1b", "data-parallel"])
def test_segments_measure_peak_memory_as_predicted(path, pool):
    """The tensor accounting runs on the segment path: in a rank's last step it counts what
    autograd saves while it is saved, the segments' outputs and inputs as the op path counts
    values, and each gradient the backward makes inside a segment while it lives (the op path
    misses the gradient a weight's accumulation makes anew). So it measures at least what the
    op path does, and what the simulator predicts: the plan's largest peak within 1 %, each
    rank's within 1 %. (The 1F1B rank holding only the MLP's head and loss sends the gradients
    of its four micro-batches' inputs: each is gone once sent; a slot that the received
    activation kept had held them all to the step's end, 11 % more.)"""
    graph, plan = tiny_builtin_graph("mlp"), _plan("mlp", path)
    seg = _run(pool, graph, plan, "segments", ("mlp", path))
    ops = _run(pool, graph, plan, "ops", ("mlp", path))
    assert seg.memory_source == ops.memory_source == "tensor accounting"
    predicted = ex.simulate(graph, plan, roofline_costs(graph, ex.Cluster.cpu(2, measure=False))
                            ).peak_bytes
    largest = max(predicted.values())
    assert abs(max(seg.peak_bytes.values()) - largest) <= 0.01 * largest
    for d, peak in predicted.items():
        assert abs(seg.peak_bytes[d] - peak) <= 0.01 * peak, (d, seg.peak_bytes[d], peak)
        assert seg.peak_bytes[d] >= ops.peak_bytes[d], d
        assert seg.peak_by_category[d]["parameters"] == ops.peak_by_category[d]["parameters"]


class TestCommandLine:
    def test_the_run_command_takes_the_runtime(self, capsys):
        from explorer.cli.commands import build_parser

        assert build_parser().parse_args(["run"]).runtime is None  # (the run chooses)
        assert build_parser().parse_args(["run", "--runtime", "ops"]).runtime == "ops"
        assert build_parser().parse_args(["run", "--runtime", "segments"]).runtime == "segments"
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["run", "--runtime", "fast"])
        assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err

    @pytest.mark.slow
    def test_explorer_run_runs_segments(self, capsys, monkeypatch, tmp_path):
        import json

        from explorer.cli.commands import main
        from explorer.platforms.cpu import host as cpu_host

        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        monkeypatch.setattr(cpu_host, "host_profile", lambda measure: cpu_host.nominal_profile())
        rc = main(["run", "--model", "mlp", "--size", "tiny", "--devices", "cpu:1",
                   "--algorithm", "single", "--runtime", "segments", "--steps", "1",
                   "--warmup", "0", "--json", "--quiet"])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["runtime"] == "segments" and len(out["losses"]) == 1
