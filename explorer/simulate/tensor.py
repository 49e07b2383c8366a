"""Tensor parallelism in the simulator: what a stage's tensor split does to op times, weight
bytes and communication, as the Megatron-style layout (:mod:`explorer.core.tensor_layout`) says.

An op the layout splits (a head-split attention's core included) runs ``1 / tensor`` of its
work at its batch fraction, its per-op overhead unchanged: ``overhead + (t(fraction) -
overhead) / tensor`` (:meth:`explorer.simulate.seconds.Seconds.on`'s ``share``). Each all-reduce
the layout implies (a row-parallel block's output in the forward, a column-parallel block's
input gradient in the backward, a vocabulary-parallel embedding's output, a vocabulary-parallel
loss's three numbers per row; an all-gather before
a random op in a split block, which runs whole) runs inside the op that needs it, on the links
of one tensor group of the stage, as DTensor does it in the runtime: the op waits for it; under
async tensor parallelism, on devices that can (GPUs), a matrix product's all-gathers and
reduce-scatters run in pieces beside it (:func:`pipelined_s`). Split
weights hold ``1 / tensor`` of their bytes on each device, and so do their gradients and
optimizer state, and the activations the layout keeps split (and their gradients; a
convolution's along its channels, which divides its bytes the same; a vocabulary-parallel
loss's saved softmax, not its output). Stages with a tensor
degree of 1 are untouched.

The runtime runs split ops on local shards (Megatron-style), but reads split weights through
DTensors and runs the vocabulary-parallel embedding and the optimizer on them: where the
profile carries what that adds (``DeviceCosts.dtensor``, measured by a host probe), a split op
that reads a split weight gets its per-op cost in its forward and backward, each collective
its fixed cost (beyond the link's time: on a shared host, mostly the wait for the other ranks
to be scheduled), an unsplit op the cost per split weight it reads (gathered whole), and the
optimizer step the cost per parameter tensor.
"""

from __future__ import annotations

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.plan_layout import stage_layout
from explorer.core.tensor_layout import LOSS_OPS, TensorLayout
from explorer.costs.model import DTENSOR_KEYS, CostModel
from explorer.costs.strategies import is_matmul_like
from explorer.simulate.arrays import GraphArrays
from explorer.simulate.seconds import Seconds


def layouts(graph: OpGraph, plan: Plan) -> dict[int, TensorLayout]:
    """The layout of every tensor-parallel stage, by stage."""
    return {s: stage_layout(graph, plan, s) for s in range(len(plan.stages))
            if plan.tensor_of(s) > 1}


def tensor_group(plan: Plan, stage: int) -> tuple[str, ...]:
    """The devices of ``stage``'s first tensor group (the mesh is replicas x tensor)."""
    return plan.stages[stage][: plan.tensor_of(stage)]


def replica_group(plan: Plan, stage: int) -> tuple[str, ...]:
    """The devices of ``stage``'s first tensor rank, one in each replica: the group its
    gradient reductions and ZeRO gathers run over (the whole stage without a tensor split)."""
    return plan.stages[stage][:: plan.tensor_of(stage)]


def split_op_seconds(graph: OpGraph, plan: Plan, costs: CostModel, sec: Seconds,
                     ops_by_stage: list[np.ndarray], devices: list, frac: list[float],
                     fwd_s: np.ndarray, bwd_s: np.ndarray) -> None:
    """Set the forward and backward seconds of the ops each tensor-parallel stage splits
    (their share of the work, and what DTensor adds where the profile measured it)."""
    A = GraphArrays.of(graph)
    index, has_b = graph.index, A.has_b
    for s, layout in layouts(graph, plan).items():
        k = layout.degree
        dt = dtensor_costs(costs, devices[s])
        ops = ops_by_stage[s]
        is_split = np.isin(ops, [index[n] for n in layout.split_ops])
        split = ops[is_split]
        reads = split_weights_read(A, [index[n] for n in layout.placements])
        if len(split):
            on_dt = reads[split] > 0  # (the others run on plain local shards)
            fwd_s[split] = (sec.slowest("fwd_s", split, devices[s], frac[s], 1.0 / k)
                            + on_dt * dt["op_fwd_s"])
            on_dt, split = on_dt[has_b[split]], split[has_b[split]]
            bwd_s[split] = (sec.slowest("bwd_s", split, devices[s], frac[s], 1.0 / k)
                            + on_dt * dt["op_bwd_s"])
        whole = ops[~is_split]
        if len(whole) and (dt["read_fwd_s"] or dt["read_bwd_s"]):
            fwd_s[whole] += reads[whole] * dt["read_fwd_s"]
            bwd_s[whole] += np.where(has_b[whole], reads[whole] * dt["read_bwd_s"], 0.0)


def add_split_collectives(graph: OpGraph, plan: Plan, costs: CostModel, devices: list,
                          frac: list[float], fwd_s: np.ndarray, bwd_s: np.ndarray) -> int:
    """Add the collectives each tensor-parallel stage's layout implies to the ops that wait
    for them (pipelined with a matrix product where the stage asks for async tensor
    parallelism and its devices can: :func:`pipelined_s`); the bytes they move in a step
    (every device's sends: a ring of k moves 2 (k - 1) times the tensor, for every tensor
    group and micro-batch). Under bf16/fp16 the activations and their gradients they carry
    are 2 bytes an element."""
    index, M = graph.index, plan.micro_batches
    moved = 0
    for s, layout in layouts(graph, plan).items():
        k = layout.degree
        dt = dtensor_costs(costs, devices[s])
        half = 0.5 if plan.settings_of(s).precision != "fp32" else 1.0
        group = tensor_group(plan, s)
        # (an all-gather or a reduce-scatter moves half a ring all-reduce's bytes, priced as
        # the link measured it where it did; the fixed cost once per op and direction: a
        # collective right after another on the same ranks, as a column-parallel linear's
        # backward gathers its input and reduce-scatters its gradient, finds them in step)
        serial: dict[tuple[int, bool], float] = {}  # (op, backward): seconds it waits
        beside: dict[tuple[int, bool], float] = {}  # seconds it may pipeline with a product
        for backward, kind, by_op in layout.collectives():
            price = getattr(costs, f"{kind}_s")
            share = 1.0 if kind == "allreduce" else 0.5
            for name, nbytes in by_op.items():
                if plan.stage_of(name) != s:
                    continue
                size = int(nbytes * frac[s] * half)
                key = (index[name], backward)
                serial.setdefault(key, dt["collective_s"])
                waits = beside if kind != "allreduce" else serial
                waits[key] = waits.get(key, 0.0) + price(group, size)
                moved += int(plan.replicas_of(s) * 2 * share * (k - 1) * size * M)  # (all's)
        pipelines = plan.settings_of(s).async_tensor and all(
            costs.platform(d).pipelines_tensor_collectives for d in devices[s])
        for key, wait in serial.items():
            i, backward = key
            times, comm = bwd_s if backward else fwd_s, beside.get(key, 0.0)
            if pipelines and is_matmul_like(graph.nodes[i]):
                times[i] = pipelined_s(times[i], comm, k) + wait
            else:
                times[i] += comm + wait
    return moved


def pipelined_s(compute_s: float, comm_s: float, pieces: int) -> float:
    """Seconds of a matrix product and the all-gather or reduce-scatter it reads or makes,
    run in ``pieces`` (the tensor degree: one per rank's shard) with each piece's transfer
    beside another piece's product, as async tensor parallelism runs them (Wang et al.,
    "Overlap communication with dependent computation via decomposition", ASPLOS 2023): the
    longer of the two, plus one piece of the shorter that nothing hides (the first product or
    the last transfer)."""
    return max(compute_s, comm_s) + min(compute_s, comm_s) / pieces


def split_weights_read(A: GraphArrays, weights: list[int]) -> np.ndarray:
    """Per node, how many of the split ``weights`` (the DTensors of a tensor-parallel stage)
    it reads."""
    is_dt = np.zeros(A.n, dtype=bool)
    is_dt[weights] = True
    return np.bincount(A.e_c[is_dt[A.e_p]], minlength=A.n)


def dtensor_costs(costs: CostModel, devices) -> dict[str, float]:
    """What DTensor adds on the slowest of ``devices`` (per :data:`DTENSOR_KEYS`; 0 where the
    profile did not measure it)."""
    return {k: max(costs.device_costs(d).dtensor.get(k, 0.0) for d in devices)
            for k in DTENSOR_KEYS}


def optimizer_extra_s(costs: CostModel, plan: Plan, stage: int, device: str,
                      tensors: int) -> float:
    """What stepping ``tensors`` DTensor parameters adds to ``device``'s optimizer step on a
    tensor-parallel ``stage``, with the stage's cost per step (0 on other stages)."""
    if plan.tensor_of(stage) <= 1:
        return 0.0
    dt = costs.device_costs(device).dtensor
    return tensors * dt.get("optimizer_tensor_s", 0.0) + dt.get("step_s", 0.0)


def sequence_grads(graph: OpGraph, plan: Plan, costs: CostModel, stage: int
                   ) -> tuple[float, int]:
    """Seconds and bytes (every device's sends, all tensor groups) of the all-reduce, once a
    step before the optimizer, of the gradients of the weights a sequence-parallel
    ``stage``'s token-wise ops read whole (one all-reduce of them all); (0, 0) elsewhere."""
    if not plan.sequence_of(stage):
        return 0.0, 0
    layout = stage_layout(graph, plan, stage)
    sizes = [graph.nodes[graph.index[p]].out_bytes for p in sorted(layout.sequence_params)
             if plan.stage_of(p) == stage]
    if not sizes:
        return 0.0, 0
    group, k = tensor_group(plan, stage), plan.tensor_of(stage)
    fixed = dtensor_costs(costs, plan.stages[stage])["collective_s"]
    seconds = costs.allreduce_s(group, sum(sizes)) + fixed
    return seconds, plan.replicas_of(stage) * 2 * (k - 1) * sum(sizes)


def per_device(graph: OpGraph, plan: Plan, nbytes):
    """``nbytes`` (a list or array of bytes per node) with each weight a tensor-parallel stage
    splits divided by its degree: what one device holds. ``nbytes`` itself where none is."""
    return _divided(graph, plan, nbytes, lambda lay: lay.placements)


def activations_per_device(graph: OpGraph, plan: Plan, nbytes):
    """``nbytes`` (per node) with the outputs a tensor-parallel stage keeps split divided by
    its degree: those of the split ops but the ones whose output is all-reduced or
    reduce-scattered later (a row-parallel linear's or an embedding's partial sums are whole
    tensors)."""
    return _divided(graph, plan, nbytes,
                    lambda lay: [n for n in lay.split_ops if n not in lay.reduce_forward
                                 and n not in lay.partial_rows])


def saved_extra_per_device(graph: OpGraph, plan: Plan, nbytes):
    """``nbytes`` (per node: what an op saves for its backward beyond its inputs and output)
    divided as :func:`activations_per_device` divides outputs, and a vocabulary-parallel
    loss's too: it keeps the softmax of the device's share of the classes (its output, the
    loss, is whole)."""
    return _divided(graph, plan, nbytes,
                    lambda lay: [n for n in lay.split_ops if (n not in lay.reduce_forward
                                                              and n not in lay.partial_rows)
                                 or graph.nodes[graph.index[n]].op in LOSS_OPS])


def _divided(graph: OpGraph, plan: Plan, nbytes, names):
    split = layouts(graph, plan)
    if not split:
        return nbytes
    out = nbytes.copy()
    for s, layout in split.items():
        for name in names(layout):
            if plan.stage_of(name) == s:
                out[graph.index[name]] //= layout.degree
    return out
