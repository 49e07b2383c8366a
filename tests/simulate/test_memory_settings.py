"""The simulator under per-stage memory settings (ZeRO, recomputation, precision), by hand.

Two graphs: ``chain`` (x -> mm1 -> relu1 -> mm2 -> loss, weights w1, w2; relu1 saves its
output, mm1 saves x, mm2 saves relu1) with big weights for ZeRO, and the same with small
weights for activations. Forward times 1, 2, 3, 4 s and backward 10, 20, 30, 40 s.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from builders import cluster, costs

from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import Plan
from explorer.costs.strategies import (
    activation_bytes,
    gathered_half,
    half_outputs,
    recomputation,
    recomputed_outputs,
    rerun_ops,
    saved_across_units,
    shard_bytes,
    unit_of,
)
from explorer.devices.cluster import Cluster, Device, Link
from explorer.simulate.arrays import GraphArrays
from explorer.simulate.effects import stage_effects
from explorer.simulate.simulator import simulate

MiB = 2**20
FWD = {"mm1": 1.0, "relu1": 2.0, "mm2": 3.0, "loss": 4.0}
BWD = {"mm1": 10.0, "relu1": 20.0, "mm2": 30.0, "loss": 40.0}


def chain(w1: int = 8, w2: int = 8, mm2_module: str = "layers.1.fc") -> OpGraph:
    def op(name, aten, module, inputs, out, saves):
        return OpNode(name, "op", aten, module, inputs=inputs, out_bytes=out,
                      requires_grad=True, saves=saves)

    def weight(name, module, nbytes):
        return OpNode(name, "param", "param", module, out_bytes=nbytes, param_bytes=nbytes,
                      requires_grad=True)

    nodes = [OpNode("x", "input", "input", out_bytes=800),
             weight("w1", "layers.0.fc", w1),
             op("mm1", "aten.mm.default", "layers.0.fc", ("x", "w1"), 1600, ("x",)),
             op("relu1", "aten.relu.default", "layers.0.act", ("mm1",), 1600, ("relu1",)),
             weight("w2", mm2_module, w2),
             op("mm2", "aten.mm.default", mm2_module, ("relu1", "w2"), 800, ("relu1",)),
             op("loss", "aten.sum.default", "", ("mm2",), 4, ())]
    return OpGraph("chain", nodes, 8, "export", "loss")


def chain4() -> OpGraph:
    """x -> mm1 -> relu1 -> mm2 -> relu2 (all of unit layers.0) -> mm3 (layers.1) -> loss;
    every op's output 1600 B but mm3's 800 and the loss's 4, x 800. mm1 saves x, each relu
    its output, mm2 relu1, mm3 relu2 (so relu2 is saved by another unit)."""
    def op(name, aten, module, inputs, out, saves):
        return OpNode(name, "op", aten, module, inputs=inputs, out_bytes=out,
                      requires_grad=True, saves=saves)

    def weight(name, module):
        return OpNode(name, "param", "param", module, out_bytes=8, param_bytes=8,
                      requires_grad=True)

    nodes = [OpNode("x", "input", "input", out_bytes=800),
             weight("w1", "layers.0.fc1"),
             op("mm1", "aten.mm.default", "layers.0.fc1", ("x", "w1"), 1600, ("x",)),
             op("relu1", "aten.relu.default", "layers.0.act1", ("mm1",), 1600, ("relu1",)),
             weight("w2", "layers.0.fc2"),
             op("mm2", "aten.mm.default", "layers.0.fc2", ("relu1", "w2"), 1600, ("relu1",)),
             op("relu2", "aten.relu.default", "layers.0.act2", ("mm2",), 1600, ("relu2",)),
             weight("w3", "layers.1.fc"),
             op("mm3", "aten.mm.default", "layers.1.fc", ("relu2", "w3"), 800, ("relu2",)),
             op("loss", "aten.sum.default", "", ("mm3",), 4, ())]
    return OpGraph("chain4", nodes, 8, "export", "loss")


FWD4 = {"mm1": 1.0, "relu1": 2.0, "mm2": 3.0, "relu2": 4.0, "mm3": 5.0, "loss": 6.0}
BWD4 = {k: 10 * v for k, v in FWD4.items()}


def zero_case(zero: int, bandwidth: float = float("inf")):
    """w1 40 MiB, w2 30 MiB (one 25 MB gradient bucket each), one stage of two replicas."""
    g = chain(40 * MiB, 30 * MiB)
    cl = cluster(2, bandwidth=bandwidth, memory=2**40)
    plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))})
    return g, simulate(g, plan.with_memory(zero=zero), costs(g, cl, FWD, BWD))


def backward_s(pred, label: str) -> float:
    iv = next(iv for iv in pred.timeline if iv.kind == "bwd" and iv.label == label)
    return iv.end_s - iv.start_s


class TestZero:
    # adam: 2 bytes of state per byte of weight; 70 MiB of weights over 2 replicas
    def test_zero_1_shards_the_optimizer_state(self):
        _, pred = zero_case(1)
        m = pred.memory["d:0"]
        # the full gradients stay until the optimizer step (the distributed optimizer's
        # gradient buffer), beside the rank's reduced shards: w2's half from its
        # reduce-scatter in w1's backward on (w1's is made as the step starts)
        assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.gathered_bytes) == (
            70 * MiB, 70 * MiB + 15 * MiB, 70 * MiB, 0)
        # reduce-scatter (k-1) x 70 MiB, and the shards the step before updated all-gathered
        # (k-1) x 70 MiB (an all-reduce's traffic), one collective per 25 MB bucket of
        # weights, as the runtime does
        assert pred.allreduce_bytes == 70 * MiB + 70 * MiB
        kinds = [iv.kind for iv in pred.timeline if iv.device == "d:0"]
        assert kinds[-4:] == ["reduce-scatter", "bwd", "reduce-scatter", "optimizer"]
        assert kinds.count("reduce-scatter") == 2 and "allreduce" not in kinds
        gathered = [iv.label for iv in pred.timeline
                    if iv.device == "d:0" and iv.kind == "all-gather"]
        assert gathered == [f"all-gather {40 * MiB} B", f"all-gather {30 * MiB} B"]

    def test_zero_1_gathers_the_updated_shards_during_the_forward(self):
        # 1e7 B/s: w1's gather (half of 40 MiB to receive) takes 2.1 s, w2's 1.6 s; the
        # first starts with the step and mm1 waits for it; the second starts as mm1 does
        # (its bucket reached) and mm2 waits for it, while relu1 runs beside it
        _, pred = zero_case(1, bandwidth=1e7)
        at = {(iv.kind, iv.label): (iv.start_s, iv.end_s) for iv in pred.timeline
              if iv.device == "d:0"}
        w1 = at[("all-gather", f"all-gather {40 * MiB} B")]
        w2 = at[("all-gather", f"all-gather {30 * MiB} B")]
        assert w1[0] == 0.0 and w1[1] == pytest.approx(40 * MiB / 2 / 1e7, rel=0.01)
        assert at[("fwd", "mm1")][0] == pytest.approx(w1[1])
        assert w2[0] == pytest.approx(w1[1])
        assert at[("fwd", "relu1")][0] < w2[1] == pytest.approx(at[("fwd", "mm2")][0])
        assert at[("optimizer", "adam step")][0] >= w2[1]

    @pytest.mark.parametrize("zero", [2, 3])
    def test_each_micro_batch_is_reduce_scattered_apart(self, zero):
        # two micro-batches: a reduce-scatter per bucket and micro-batch, each once that
        # micro-batch's backward has made the bucket's gradients (as FSDP does); the full
        # gradients of one micro-batch at most are held beside the shards (ZeRO 1 keeps
        # them whole over the step and reduces once)
        g = chain(40 * MiB, 30 * MiB)
        cl = cluster(2, bandwidth=1e7, memory=2**40)
        plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))},
                                    micro_batches=2, schedule="1f1b")
        pred = simulate(g, plan.with_memory(zero=zero), costs(g, cl, FWD, BWD))
        ivs = [iv for iv in pred.timeline if iv.device == "d:0"]
        scatters = [iv for iv in ivs if iv.kind == "reduce-scatter"]
        assert [(iv.label, iv.micro_batch) for iv in scatters] == [
            (f"reduce-scatter {size} B", m) for m in (0, 1) for size in (30 * MiB, 40 * MiB)]
        for iv in scatters:  # after the backward of the bucket's weight's reader
            reader = "mm2" if iv.label.endswith(f"{30 * MiB} B") else "mm1"
            made = next(b for b in ivs if b.kind == "bwd" and b.label == reader
                        and b.micro_batch == iv.micro_batch)
            assert iv.start_s >= made.end_s
        assert scatters[1].end_s < next(b.start_s for b in ivs if b.kind == "bwd"
                                        and b.micro_batch == 1)
        m = pred.memory["d:0"]
        shards = 35 * MiB
        assert m.grads_bytes <= 40 * MiB + 30 * MiB + shards < 2 * 70 * MiB
        whole = simulate(g, plan.with_memory(zero=1), costs(g, cl, FWD, BWD))
        assert [iv.micro_batch for iv in whole.timeline
                if iv.device == "d:0" and iv.kind == "reduce-scatter"] == [-1, -1]
        assert pred.allreduce_bytes > whole.allreduce_bytes

    def test_a_2_byte_working_copy_makes_its_gradients_in_2_bytes(self):
        # ZeRO 1 under bf16: the second micro-batch's backward of mm1 makes w1's gradient in
        # the working copy's 2 bytes (20 MiB, not 40) before adding it into the fp32
        # gradient held for the optimizer; the rest of the peak is the same
        g = chain(40 * MiB, 30 * MiB)
        cl = cluster(2, bandwidth=1e7, memory=2**40)
        plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))},
                                    micro_batches=2, schedule="1f1b")
        grads = {p: simulate(g, plan.with_memory(zero=1, precision=p),
                             costs(g, cl, FWD, BWD)).memory["d:0"].grads_bytes
                 for p in ("fp32", "bf16")}
        assert grads["fp32"] - grads["bf16"] == 20 * MiB

    @pytest.mark.parametrize("zero", [1, 2])
    def test_a_pipeline_stage_gathers_after_its_optimizer_step(self, zero):
        # mm1 (w1) on two replicas, mm2 (w2) and the rest on a third device: the replicated
        # stage sends mm1's output on, so it gathers its updated shards once its optimizer
        # has stepped them (a deferred gather would hold back the forward the next stage
        # waits for)
        g = chain(40 * MiB, 30 * MiB)
        cl = cluster(3, bandwidth=1e7, memory=2**40)
        names = [n.name for n in g.nodes]
        second = {"w2", "mm2", "loss"} & set(names)
        plan = Plan.from_assignment(g, [("d:0", "d:1"), ("d:2",)],
                                    {nm: int(nm in second) for nm in names})
        pred = simulate(g, plan.with_memory(zero=zero), costs(g, cl, FWD, BWD))
        ivs = [iv for iv in pred.timeline if iv.device == "d:0"]
        step = next(iv for iv in ivs if iv.kind == "optimizer")
        assert min(iv.start_s for iv in ivs if iv.kind == "fwd") == 0.0
        assert min(iv.start_s for iv in ivs if iv.kind == "all-gather") >= step.end_s

    @pytest.mark.parametrize("zero, optimizer_calls", [(1, 4), (2, 4), (3, 2)])
    def test_each_collective_costs_the_ranks_what_the_host_probe_measured(
            self, zero, optimizer_calls):
        # DeviceCosts.collective_s per ZeRO collective, on the rank's processor: ZeRO 3's
        # gathers in the ops that wait for them (mm1 and mm2 each read one group, forward and
        # backward), the buckets' reduce-scatters (ZeRO 1-3) and all-gathers of updated
        # shards (ZeRO 1, 2; w1's and w2's buckets) in the optimizer step
        g = chain(40 * MiB, 30 * MiB)
        cl = cluster(2, memory=2**40)
        plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))})
        plan = plan.with_memory(zero=zero)
        c = costs(g, cl, FWD, BWD)

        def durations(pred) -> dict[tuple[str, str], float]:
            return {(iv.kind, iv.label): iv.end_s - iv.start_s for iv in pred.timeline
                    if iv.device == "d:0" and iv.kind in ("fwd", "bwd", "optimizer")}

        before = durations(simulate(g, plan, c))
        for dc in c.per_type.values():
            dc.collective_s = 100.0
        extra = {k: v - before[k] for k, v in durations(simulate(g, plan, c)).items()
                 if v != before[k]}
        want = {("optimizer", "adam step"): 100.0 * optimizer_calls}
        if zero == 3:
            want.update({(k, op): 100.0 for k in ("fwd", "bwd") for op in ("mm1", "mm2")})
        assert extra == pytest.approx(want)

    def test_zero_2_frees_each_full_gradient_after_its_reduce_scatter(self):
        _, pred = zero_case(2)
        m = pred.memory["d:0"]
        # at mm1's backward: w1's full gradient (40) and w2's shard (15); w2's full gradient
        # was reduce-scattered after mm2's backward
        assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (70 * MiB, 55 * MiB,
                                                                      70 * MiB)
        assert pred.allreduce_bytes == 70 * MiB + 70 * MiB  # reduce-scatters + all-gather
        labels = [iv.label for iv in pred.timeline if iv.kind == "reduce-scatter"
                  and iv.device == "d:0"]
        assert labels == [f"reduce-scatter {30 * MiB} B", f"reduce-scatter {40 * MiB} B"]

    def test_zero_3_shards_weights_and_gathers_them_per_use(self):
        _, pred = zero_case(3)
        m = pred.memory["d:0"]
        # weights as shards (35), the optimizer state of the shards (70), gradients as in
        # ZeRO 2, and at the peak (mm1's backward) w1's gathered copy (40)
        assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.gathered_bytes) == (
            35 * MiB, 55 * MiB, 70 * MiB, 40 * MiB)
        # each weight gathered for the forward and for the backward, plus the reduce-scatters
        assert pred.allreduce_bytes == 2 * 70 * MiB + 70 * MiB
        gathers = [iv.label for iv in pred.timeline if iv.kind == "all-gather"
                   and iv.device == "d:0"]
        assert sorted(gathers) == ["all-gather w1", "all-gather w1 (backward)",
                                   "all-gather w2", "all-gather w2 (backward)"]

    def test_zero_3_gathers_a_layers_weights_in_one_collective(self):
        # mm2 reads w2 (30 MiB) and a bias b2 (2 MiB): both move in one all-gather, as FSDP2
        # gathers a module's parameters, for the forward and again for the backward
        g = chain(40 * MiB, 30 * MiB)
        nodes = list(g.nodes)
        k = next(i for i, n in enumerate(nodes) if n.name == "mm2")
        nodes[k] = dataclasses.replace(nodes[k], inputs=("relu1", "w2", "b2"))
        nodes.insert(k, dataclasses.replace(nodes[k - 1], name="b2", out_bytes=2 * MiB,
                                            param_bytes=2 * MiB))
        g = OpGraph("chain", nodes, 8, "export", "loss")
        cl = cluster(2, bandwidth=10 * MiB, memory=2**40)
        plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))})
        pred = simulate(g, plan.with_memory(zero=3), costs(g, cl, FWD, BWD))
        ivs = {iv.label: iv for iv in pred.timeline if iv.kind == "all-gather"
               and iv.device == "d:0"}
        assert sorted(ivs) == ["all-gather w1", "all-gather w1 (backward)",
                               "all-gather w2, b2", "all-gather w2, b2 (backward)"]
        # half of 32 MiB at 10 MiB/s
        assert ivs["all-gather w2, b2"].end_s - ivs["all-gather w2, b2"].start_s == \
            pytest.approx(1.6)

    def test_zero_3_gathers_a_blocks_weights_in_one_collective(self):
        # mm2 in the same block as mm1 (layers.0): w1 and w2 move in one all-gather before
        # mm1, and live together until mm2's forward is done; again for the backward
        g = chain(40 * MiB, 30 * MiB, mm2_module="layers.0.out")
        cl = cluster(2, memory=2**40)
        plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))})
        pred = simulate(g, plan.with_memory(zero=3), costs(g, cl, FWD, BWD))
        gathers = [iv.label for iv in pred.timeline if iv.kind == "all-gather"
                   and iv.device == "d:0"]
        assert sorted(gathers) == ["all-gather w1, w2", "all-gather w1, w2 (backward)"]
        assert pred.memory["d:0"].gathered_bytes == 70 * MiB

    def test_zero_3_under_bf16_gathers_2_byte_weights_and_keeps_no_copy_of_them(self):
        # FSDP2's mixed-precision policy: each fp32 shard cast before its gather, so the
        # gathers move and hold half the bytes; autocast makes no copy of a 2-byte weight,
        # so what the matmuls save of their weights is the gathered copy (gathered again
        # for the backward), not a copy kept from forward to backward
        g = chain(40 * MiB, 30 * MiB, mm2_module="layers.0.out")
        g = OpGraph("chain", [dataclasses.replace(n, saves=tuple(n.inputs)) if n.name in
                              ("mm1", "mm2") else n for n in g.nodes], 8, "export", "loss")
        cl = cluster(2, bandwidth=10 * MiB, memory=2**40)
        plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))})
        c = costs(g, cl, FWD, BWD)
        full = simulate(g, plan.with_memory(zero=3), c)
        half = simulate(g, plan.with_memory(zero=3, precision="bf16"), c)
        assert half.memory["d:0"].gathered_bytes == 35 * MiB
        assert full.memory["d:0"].gathered_bytes == 70 * MiB
        spans = [{iv.label: iv.end_s - iv.start_s for iv in pred.timeline
                  if iv.kind == "all-gather" and iv.device == "d:0"} for pred in (full, half)]
        assert spans[1]["all-gather w1, w2"] == pytest.approx(spans[0]["all-gather w1, w2"] / 2)
        # the gathers' traffic halves; the reduce-scatters' (fp32 gradients) does not
        assert full.allreduce_bytes - half.allreduce_bytes == 70 * MiB
        # without ZeRO the matmuls save autocast's copies of w1 and w2; under ZeRO, none
        arrays = GraphArrays(g)
        on_one = np.zeros(len(g), dtype=np.int64)
        for zero, copied in ((0, {"w1", "w2"}), (1, set()), (3, set())):
            eff = stage_effects(g, plan.with_memory(zero=zero, precision="bf16"), arrays,
                                on_one, cl)
            assert {g.nodes[q].name for q in eff.casts[1]} - {"x", "relu1"} == copied

    def test_zero_1_under_bf16_keeps_a_2_byte_working_copy_and_an_fp32_master_shard(self):
        # Megatron's distributed optimizer (and DeepSpeed) under bf16: each rank holds the
        # weights in bf16 (35 MiB of 70) and its quarter of the fp32 master copy (17.5 MiB)
        # with its quarter of Adam's state; the updated shards are gathered in bf16
        g = chain(40 * MiB, 30 * MiB)
        cl = cluster(4, bandwidth=10 * MiB, memory=2**40)
        plan = Plan.from_assignment(g, [cl.ids], {i: 0 for i in range(len(g))})
        c = costs(g, cl, FWD, BWD)
        full = simulate(g, plan.with_memory(zero=1), c)
        half = simulate(g, plan.with_memory(zero=1, precision="bf16"), c)
        assert full.memory["d:0"].params_bytes == 70 * MiB
        assert half.memory["d:0"].params_bytes == 35 * MiB + 70 * MiB // 4
        assert half.memory["d:0"].optimizer_bytes == full.memory["d:0"].optimizer_bytes
        gathered = [sum(iv.end_s - iv.start_s for iv in pred.timeline
                        if iv.kind == "all-gather" and iv.device == "d:0")
                    for pred in (full, half)]
        assert gathered[1] == pytest.approx(gathered[0] / 2)

    def test_gathers_are_priced_as_half_a_ring_all_reduce_and_prefetched(self):
        # 10 MiB/s: gathering w1 (40 MiB) over 2 ranks moves half of it: 2 s
        _, pred = zero_case(3, bandwidth=10 * MiB)
        ivs = {(iv.kind, iv.label): iv for iv in pred.timeline if iv.device == "d:0"}
        w1 = ivs[("all-gather", "all-gather w1")]
        assert w1.end_s - w1.start_s == pytest.approx(2.0)
        assert ivs[("fwd", "mm1")].start_s == pytest.approx(2.0)  # waits for its weight
        # w2's gather starts when mm1 (two ops before its user mm2) is done, over relu1's
        # forward
        assert ivs[("all-gather", "all-gather w2")].start_s == pytest.approx(
            ivs[("fwd", "mm1")].end_s)
        rs = [iv for iv in pred.timeline if iv.kind == "reduce-scatter" and iv.device == "d:0"]
        assert rs[0].end_s - rs[0].start_s == pytest.approx(1.5)

    def test_one_replica_changes_nothing(self):
        g = chain(40 * MiB, 30 * MiB)
        cl = cluster(1, memory=2**40)
        c = costs(g, cl, FWD, BWD)
        plan = Plan.single(g, "d:0")
        assert simulate(g, plan.with_memory(zero=3), c).memory == simulate(g, plan, c).memory

    def test_shards_are_padded_to_whole_elements_per_rank(self):
        assert shard_bytes(40, 3) == 16  # 10 elements -> 4 per rank
        assert shard_bytes(40, 1) == 40


class TestRecompute:
    def run(self, g: OpGraph, micro_batches: int, **settings):
        cl = cluster(1, memory=2**40)
        plan = Plan.single(g, "d:0", micro_batches=micro_batches)
        plan = plan.with_memory(**settings) if settings else plan
        return simulate(g, plan, costs(g, cl, FWD, BWD))

    def test_selective_recomputes_cheap_ops_before_the_backward_that_needs_them(self):
        # mm2 in relu1's unit: relu1 is recomputed at the start of mm2's backward (2 s more);
        # the matmuls not
        pred = self.run(chain(mm2_module="layers.0.fc2"), 1, recompute="selective")
        assert pred.step_s == pytest.approx(110.0 + 2.0)
        assert backward_s(pred, "mm2") == pytest.approx(32.0)

    @pytest.mark.parametrize("mode", ["selective", "full"])
    def test_an_output_another_unit_saves_is_kept(self, mode):
        # relu1 (unit layers.0) is saved by mm2 of unit layers.1: kept as it is without
        # recomputation (and so is the input x, which mm1 saves); nothing else is saved
        g = chain()
        assert saved_across_units(g).tolist() == [True, False, False, True, False, False,
                                                  False]
        assert not recomputed_outputs(g, mode)[g.index["relu1"]]
        assert self.run(g, 1, recompute=mode).memory["d:0"].activations_bytes == \
            self.run(g, 1).memory["d:0"].activations_bytes

    def test_selective_keeps_what_it_recomputes_from(self):
        # (mm2 in relu1's unit) GPipe, 2 micro-batches (half the bytes each). Without
        # recomputation the peak is in micro-batch 0's relu1 backward: its x 400, relu1 800,
        # relu1's and mm1's gradients 800 each, and micro-batch 1's x 400, relu1 800 and
        # loss 2 = 4002. Recomputed, relu1 is not kept but mm1 (which nobody saves otherwise)
        # is, until the unit's last backward (mm1's), as the runtime holds what a unit
        # recomputes from; in micro-batch 0's relu1 backward: x 400, mm1 800, relu1 again
        # 800, relu1's gradient 800 and mm1's 800, and micro-batch 1's x 400, mm1 800 and
        # loss 2 = 4802 (relu1 and its source are the same size: selective saves nothing)
        g = chain(mm2_module="layers.0.fc2")
        assert self.run(g, 2).memory["d:0"].activations_bytes == 4002
        assert self.run(g, 2, recompute="selective").memory["d:0"].activations_bytes == 4802

    def test_a_dropped_value_is_made_again_when_the_first_backward_needs_it(self):
        # full: relu1 (saved by relu1 and mm2, both of its unit) is dropped; relu2 is kept
        # (mm3 of another unit saves it). relu1 is made again, from x through mm1, in mm2's
        # backward: the first that unpacks it, not relu2's (the unit's first backward, which
        # needs nothing recomputed). x is held until the unit's last backward (mm1's)
        g = chain4()
        rec = recomputation(g, "full")
        names = [n.name for n in g.nodes]
        assert [names[i] for i in rec.dropped.nonzero()[0]] == ["relu1"]
        assert {names[i]: names[v] for i, v in enumerate(rec.first_use) if v >= 0} == \
            {"mm1": "mm2", "relu1": "mm2"}
        assert [(names[a], names[b]) for a, b in zip(*rec.sources, strict=True)] == \
            [("x", "mm1")]
        # selective: mm1 (matmul-like) is kept, relu1 made again from it
        rec = recomputation(g, "selective")
        assert {names[i]: names[v] for i, v in enumerate(rec.first_use) if v >= 0} == \
            {"relu1": "mm2"}
        assert [(names[a], names[b]) for a, b in zip(*rec.sources, strict=True)] == \
            [("mm1", "mm1")]

    def test_the_runtime_is_told_which_ops_run_again(self):
        # what the segment runtime checkpoints: the units with an op that runs again, on the
        # stages that recompute; a unit whose saved values another unit saves runs nothing
        g = chain4()
        names = [n.name for n in g.nodes]
        assert rerun_ops(g, Plan.single(g, "d:0")) == [False] * len(g)
        full = rerun_ops(g, Plan.single(g, "d:0").with_memory(recompute="full"))
        assert [names[i] for i, again in enumerate(full) if again] == ["mm1", "relu1"]
        selective = rerun_ops(g, Plan.single(g, "d:0").with_memory(recompute="selective"))
        assert [names[i] for i, again in enumerate(selective) if again] == ["relu1"]
        # one op per unit (an MLP of Linear and ReLU modules): each saved value is another
        # unit's, so nothing runs again
        per_op = OpGraph("per-op", [dataclasses.replace(n, module_path=f"layers.{k}")
                                    for k, n in enumerate(g.nodes)], 8, "export", "loss")
        assert not any(rerun_ops(per_op, Plan.single(per_op, "d:0").with_memory(
            recompute="full")))

    def test_full_recomputation_runs_in_the_backward_that_unpacks(self):
        # Without recomputation the peak is relu2's backward: x 800, relu1 1600, relu2 1600,
        # relu2's gradient 1600 and mm2's 1600 = 7200. With full recomputation relu1 is not
        # there yet (it comes back in mm2's backward, after relu2's is freed): the peak is
        # 5600 in relu2's backward (x, relu2, two gradients), and again in mm2's (x, relu1
        # again, mm2's gradient, relu1's gradient). mm1 and relu1 (1 + 2 s) run in mm2's
        # backward, relu2's is unchanged
        g = chain4()
        cl = cluster(1, memory=2**40)
        c = costs(g, cl, FWD4, BWD4)
        plain = simulate(g, Plan.single(g, "d:0"), c)
        pred = simulate(g, Plan.single(g, "d:0").with_memory(recompute="full"), c)
        assert plain.memory["d:0"].activations_bytes == 7200
        assert pred.memory["d:0"].activations_bytes == 5600
        assert pred.step_s == pytest.approx(plain.step_s + 3.0)
        assert backward_s(pred, "mm2") == pytest.approx(30.0 + 3.0)
        assert backward_s(pred, "relu2") == pytest.approx(40.0)

    def test_a_value_another_unit_recomputes_from_is_held_though_its_own_drops_it(self):
        # x -> mm1 (layers.0) -> relu1 (layers.1, saves its output) -> neg (layers.2, saves
        # nothing) -> mm2 (layers.2, saves neg) -> loss. Full: relu1 is dropped by its unit
        # (made again in its backward), but layers.2 holds it, to make neg again from, until
        # its last backward (neg's). The peak, mm2's backward: x 800, mm1 1600 (relu1's
        # source), relu1 1600, neg again 1600, mm2's gradient 800, neg's 1600 = 8000; more
        # than without recomputation (x, relu1, neg and the two gradients: 6400)
        def op(name, aten, module, inputs, out, saves):
            return OpNode(name, "op", aten, module, inputs=inputs, out_bytes=out,
                          requires_grad=True, saves=saves)

        w2 = OpNode("w2", "param", "param", "layers.2.fc", out_bytes=8, param_bytes=8,
                    requires_grad=True)
        w1 = dataclasses.replace(w2, name="w1", module_path="layers.0.fc")
        g = OpGraph("fork", [
            OpNode("x", "input", "input", out_bytes=800), w1,
            op("mm1", "aten.mm.default", "layers.0.fc", ("x", "w1"), 1600, ("x",)),
            op("relu1", "aten.relu.default", "layers.1.act", ("mm1",), 1600, ("relu1",)),
            op("neg", "aten.neg.default", "layers.2.neg", ("relu1",), 1600, ()), w2,
            op("mm2", "aten.mm.default", "layers.2.fc", ("neg", "w2"), 800, ("neg",)),
            op("loss", "aten.sum.default", "", ("mm2",), 4, ())], 8, "export", "loss")
        assert self.run(g, 1).memory["d:0"].activations_bytes == 6400
        assert self.run(g, 1, recompute="full").memory["d:0"].activations_bytes == 8000

    def test_what_ops_save_besides_outputs_is_kept_from_the_forward(self):
        # relu1 saves 400 B of extras (statistics, a mask): recomputation makes outputs
        # again, not those; they live from relu1's forward to its backward as without it.
        # (mm2 in relu1's unit, full, GPipe over 2 micro-batches: half the bytes each) the
        # peak is micro-batch 0's relu1 backward: its x 400, relu1 again 800, its gradient
        # and mm1's 800 each, its extras 200; and micro-batch 1's x 400, loss 2 and extras
        # 200, made in its forward = 3602
        g = chain(mm2_module="layers.0.fc2")
        nodes = [dataclasses.replace(n, saved_extra_bytes=400) if n.name == "relu1" else n
                 for n in g.nodes]
        g = OpGraph("chain", nodes, 8, "export", "loss")
        assert self.run(g, 2, recompute="full").memory["d:0"].activations_bytes == 3602

    def test_full_reruns_what_a_units_backward_needs(self):
        # units layers.0 (mm1, relu1), layers.1 (mm2), "" (loss). mm1 saves x (made outside
        # its unit), relu1 saves its output, which mm2 of another unit saves too: kept. Nothing
        # a unit's backward unpacks is recomputed: no forward runs again
        pred = self.run(chain(), 1, recompute="full")
        assert pred.step_s == pytest.approx(110.0)
        # mm2 in layers.0 too: relu1 is saved inside its unit only, so it runs again (2 s),
        # and mm1 it is made from (1 s), at the start of the unit's first backward (mm2's);
        # mm2's output and the loss are saved by nobody: not run again
        pred = self.run(chain(mm2_module="layers.0.fc2"), 1, recompute="full")
        assert pred.step_s == pytest.approx(110.0 + 3.0)
        assert backward_s(pred, "mm2") == pytest.approx(33.0)

    def test_full_keeps_only_unit_inputs(self):
        # mm2 in layers.0 too: relu1 is inside its unit, not kept (as selective above); mm1
        # and relu1 (1.5 s per micro-batch) run again in mm2's backward
        g = chain(mm2_module="layers.0.fc2")
        pred = self.run(g, 2, recompute="full")
        assert pred.memory["d:0"].activations_bytes == 3202
        assert pred.step_s == pytest.approx(110.0 + 2 * 1.5)

    def test_units_are_repeated_blocks(self):
        assert unit_of("model.layers.3.attn.q") == "model.layers.3"
        assert unit_of("model.embed") == "model"
        assert unit_of("") == ""


class TestPrecision:
    def test_cpu_autocast_halves_activations_and_keeps_times(self):
        # on CPU ranks sum follows its input: every op's output is 2-byte, the input not.
        # mm1 saves autocast's 2-byte copy of x (400), not x. The peak (relu1's backward):
        # x's copy 400 + relu1, its gradient and mm1's 800 each
        g = chain()
        cl = cluster(1, memory=2**40)
        c = costs(g, cl, FWD, BWD)
        plan = Plan.single(g, "d:0")
        pred = simulate(g, plan.with_memory(precision="bf16"), c)
        assert pred.memory["d:0"].activations_bytes == 2800
        assert pred.step_s == simulate(g, plan, c).step_s

    def test_a_norm_follows_its_inputs_precision_not_its_weights(self):
        # conv (2-byte under autocast) -> batch_norm (fp32 weight and statistics) -> relu:
        # torch's norms make their output in their input's dtype, so both are 2-byte too;
        # an add of an fp32 weight follows the widest input (fp32)
        def op(name, aten, inputs):
            return OpNode(name, "op", aten, "m", inputs=inputs, out_bytes=64,
                          requires_grad=True)

        def weight(name):
            return OpNode(name, "param", "param", "m", out_bytes=8, param_bytes=8,
                          requires_grad=True)

        g = OpGraph("cnn", [
            OpNode("x", "input", "input", out_bytes=64), weight("w"), weight("g"),
            weight("b"), op("conv", "aten.conv2d.default", ("x", "w")),
            op("bn", "aten.batch_norm.default", ("conv", "g", "b")),
            op("relu", "aten.relu.default", ("bn",)),
            op("biased", "aten.add.Tensor", ("relu", "b")),
            op("loss", "aten.sum.default", ("biased",))], 8, "export", "loss")
        for kind in ("cpu", "cuda"):
            half = dict(zip([n.name for n in g.nodes], half_outputs(g, kind).tolist(),
                            strict=True))
            assert (half["conv"], half["bn"], half["relu"], half["biased"]) == \
                (True, True, True, False), kind

    def test_weights_gathered_in_two_bytes_make_two_byte_outputs(self):
        # ZeRO under bf16 gathers 2-byte weights: an embedding's lookup and a norm's scale
        # come out in 2 bytes, an add of an fp32 activation and a 2-byte weight in fp32 (type
        # promotion); fp32 and plain replicas keep fp32 weights
        def op(name, aten, inputs):
            return OpNode(name, "op", aten, "m", inputs=inputs, out_bytes=64,
                          requires_grad=True)

        g = OpGraph("embedding", [
            OpNode("ids", "input", "input", out_bytes=16, dtype="int64"),
            OpNode("table", "param", "param", "m", out_bytes=64, param_bytes=64,
                   requires_grad=True),
            OpNode("scale", "param", "param", "m", out_bytes=8, param_bytes=8,
                   requires_grad=True),
            OpNode("x", "input", "input", out_bytes=64),
            op("lookup", "aten.embedding.default", ("table", "ids")),
            op("scaled", "aten.mul.Tensor", ("lookup", "scale")),
            op("mixed", "aten.add.Tensor", ("x", "scale")),
            op("loss", "aten.sum.default", ("scaled", "mixed"))], 8, "export", "loss")
        assert gathered_half(g, 3, "bf16").tolist() == [False, True, True] + [False] * 5
        assert gathered_half(g, 1, "bf16").tolist() == gathered_half(g, 3, "bf16").tolist()
        assert not gathered_half(g, 0, "bf16").any() and not gathered_half(g, 3, "fp32").any()
        act = activation_bytes(g, "bf16", "cuda", gathered_half(g, 3, "bf16"))
        assert dict(zip([n.name for n in g.nodes], act.tolist(), strict=True)) == {
            "ids": 16, "table": 64, "scale": 8, "x": 64, "lookup": 32, "scaled": 32,
            "mixed": 64, "loss": 64}
        assert activation_bytes(g, "bf16", "cuda").tolist()[4:7] == [64, 64, 64]

    def test_matmuls_save_two_byte_copies_of_their_weights_and_extras(self):
        # mm1 also saves w1 (8000 bytes, fp32 master weight): its 4000-byte copy lives from
        # mm1's forward to its backward; and 600 bytes mm1 saves besides its inputs are made
        # in bf16 (300). The peak moves to mm1's backward (w1's 8000-byte gradient made):
        # x's copy 400, w1's 4000, the extras 300 and mm1's incoming gradient 800
        g = chain(w1=8000)
        nodes = [dataclasses.replace(n, saves=("x", "w1"), saved_extra_bytes=600)
                 if n.name == "mm1" else n for n in g.nodes]
        g = OpGraph("chain", nodes, 8, "export", "loss")
        c = costs(g, cluster(1, memory=2**40), FWD, BWD)
        pred = simulate(g, Plan.single(g, "d:0").with_memory(precision="bf16"), c)
        assert pred.memory["d:0"].activations_bytes == 5500

    def test_fp16_unscales_the_gradients_before_the_optimizer(self):
        # fp16's loss scale: one elementwise pass over the stage's gradients (w1 + w2 =
        # 70 MiB; priced as an SGD step over them) lengthens the optimizer step; bf16 has none
        g = chain(40 * MiB, 30 * MiB)
        c = costs(g, cluster(1, memory=2**40), FWD, BWD, opt_per_byte=1e-9)
        plan = Plan.single(g, "d:0")

        def opt_s(precision: str) -> float:
            pred = simulate(g, plan.with_memory(precision=precision), c)
            return next(iv.end_s - iv.start_s for iv in pred.timeline if iv.kind == "optimizer")

        assert opt_s("bf16") == pytest.approx(70 * MiB * 1e-9)
        assert opt_s("fp16") == pytest.approx(2 * 70 * MiB * 1e-9)

    def test_gpu_matmuls_run_at_the_half_peak_other_ops_at_half_the_bytes(self):
        g = chain()
        dev = Device("g:0", "cuda", "gpu", 2**40, 1e12, 4e12, 1e12, 100.0, 10.0, False, "",
                     "test")
        cl = Cluster("gpu", (dev,), Link(0.0, float("inf"), "test"))
        c = costs(g, cl, FWD, BWD)
        pred = simulate(g, Plan.single(g, "g:0").with_memory(precision="bf16"), c)
        # mm 1/4, relu 1/2, sum stays fp32 on CUDA
        want = sum(FWD.values()) + sum(BWD.values()) - 0.75 * (1 + 3 + 10 + 30) \
            - 0.5 * (2 + 20)
        assert pred.step_s == pytest.approx(want)
        assert pred.lower_bound_s == pytest.approx(want)  # one device: all of it is compute
        assert half_outputs(g, "cuda").tolist() == [False, False, True, True, False, True,
                                                   False]

    def test_times_measured_in_the_precision_replace_the_rule(self):
        # a device timed in bf16 (its profile's precision_s) is predicted from those times,
        # forward and backward each, on CPU ranks and GPUs alike; the lower bound follows
        g = chain()
        dev = Device("g:0", "cuda", "gpu", 2**40, 1e12, 4e12, 1e12, 100.0, 10.0, False, "",
                     "test")
        for cl in (cluster(1, memory=2**40), Cluster("gpu", (dev,), Link(0.0, 1.0, "t"))):
            c = costs(g, cl, FWD, BWD)
            dc = c.per_type[cl.devices[0].type_key]
            dc.precision_s["bf16"] = [[2 * t for t in dc.fwd_s], [3 * t for t in dc.bwd_s]]
            pred = simulate(g, Plan.single(g, cl.devices[0].id).with_memory(precision="bf16"),
                            c)
            want = 2 * sum(FWD.values()) + 3 * sum(BWD.values())
            assert pred.step_s == pytest.approx(want)
            assert pred.lower_bound_s == pytest.approx(2 * sum(FWD.values())
                                                       + 2 * sum(BWD.values()))
            f, b = c.precision_factors(g, cl.devices[0].id, "bf16")
            assert f[g.index["mm1"]] == 2 and b[g.index["mm1"]] == 3
            assert f[g.index["x"]] == 1  # (no time: no factor)
            # another precision the device was not timed in keeps the rule
            assert c.precision_factors(g, cl.devices[0].id, "fp16")[0][g.index["x"]] == 1


def test_default_settings_change_nothing():
    g, _ = zero_case(0)
    cl = cluster(2, memory=2**40)
    c = costs(g, cl, FWD, BWD)
    plan = Plan.from_assignment(g, [("d:0", "d:1")], {i: 0 for i in range(len(g))})
    a, b = simulate(g, plan, c), simulate(g, plan.with_memory(zero=0), c)
    assert (a.step_s, a.memory, a.allreduce_bytes) == (b.step_s, b.memory, b.allreduce_bytes)
