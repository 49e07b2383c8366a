"""PaSE: per-layer parallelization strategies (batch and feature splits) by dynamic programming.

Seed: Elango, "PaSE: Parallelization Strategies for Efficient DNN Training", IPDPS 2021. Each
layer (a vertex of the layer graph built from ``graph.layers(depth)``) picks a *configuration*
``(b, f)``: its batch split over ``b`` devices and its output-feature (output-channel) split
over ``f`` devices, ``b x f <= p``. The cost of a strategy is the sum over layers of the
layer's cost under its configuration plus, for every edge between layers, the cost of moving
the bytes that are not already where the consumer needs them. Vertices are visited in an
order that keeps each step's *dependent set* (visited vertices with edges to unvisited ones)
small, and a dynamic program over that order keeps one table entry per configuration
assignment of the dependent set; it is exact for the cost model and costs about
``K^(M+1)`` for ``K`` configurations per layer and a largest dependent set of ``M`` layers.

The cost model (all seconds, from the :class:`~explorer.costs.model.CostModel`; ``p`` devices at
positions ``0..p-1``; a configuration ``(b, f)`` uses positions ``0..b*f-1``, position
``d`` holding batch slice ``d // f`` of ``b`` and feature shard ``d % f`` of ``f``):

* compute: the layer's forward and backward at batch fraction ``1 / (b*f)`` (the per-op
  overhead does not shrink, as everywhere in the cost model: a feature split shrinks the work
  of an op like a batch split does) plus the optimizer step of ``1/f`` of its parameters, on
  the slowest device type;
* the ring all-reduce of the weight gradients (``grad_bytes / f`` per shard) across the ``b``
  replicas of each weight shard. Gradients are all-reduced in 25 MB buckets, as PyTorch DDP
  and the simulator do (:data:`explorer.simulate.simulator.BUCKET_BYTES`), so a layer pays the
  bandwidth term of its bytes and its bytes' share of a bucket's latency;
* for ``f > 1``, the all-gather of the outputs across the ``f`` shards of each batch slice
  (``out_bytes / b``: half of a ring all-reduce) and, in the backward, the all-reduce of the
  input gradient, which every feature shard holds as a partial sum (``in_bytes / b``);
* for every tensor between two layers, a *re-distribution* in each direction: a layer's
  output lies on positions ``0..b*f-1``, batch slice ``d // f`` at full features on position
  ``d`` (after the all-gather), and a consumer ``(b2, f2)`` needs on each of its positions its
  batch slice at full features (linear and convolution layers split output channels, so each
  shard reads every input feature). The forward moves, to each position ``d``, the part of
  its needed slice it does not hold already; positions receive in parallel, so the time is
  ``latency + max_d missing_d x bytes / bandwidth`` over the slowest link, per tensor. The
  backward moves the gradient the other way with the same formula (consumer layout to
  producer need). See :func:`missing_fraction`.

Equally cheap strategies are told apart by :data:`TIE_S` (a nanosecond) per extra device a
configuration uses, so free layers (views, shape arithmetic) take no extra devices and splits
that save less than that are not made.

Memory per device: a device at position ``d`` holds, for every layer with ``d < b*f``,
``(params + grads + optimizer state) / f + saved activations / b``
(:func:`explorer.costs.memory.node_memory_bytes`). Position 0 takes part in every layer, so it holds
the most; that sum must fit the smallest device. When the cheapest strategy does not fit, a
Lagrangian search (cost + lambda x memory, lambda bisected) finds a strategy that fits; it is
then no longer guaranteed optimal (``PaseSolution.exact`` says so).

Only layers that own trainable weights are offered feature splits (the split divides the
weight; at most its first dimension, the output features or channels); the others split the
batch only. Batch splits divide the batch; split factors are the divisors of ``p`` and the
powers of two up to it. Weights shared between layers (tied embeddings) are not charged
across layers. Data parallelism (every layer at its largest batch split, ``(p, 1)`` when
``p`` divides the batch) and Krizhevsky's "one weird trick" (fully connected layers, those
with a ``Linear`` module or a linear/addmm/mm/matmul op and weights, at ``(1, p)``; every
other layer data parallel) are points in the space, always kept among a layer's candidates,
so the search is never worse than them under its own cost model.

Plans: a :class:`~explorer.core.plan.Plan` expresses batch splits as a stage with several
devices (replicas) and feature splits only as a stage's tensor degree, applied by the Megatron
layout to every layer of the stage. The registered partitioner ``pase`` returns a batch-only
strategy as stages (consecutive layers sharing a configuration form a stage on consecutive
devices, every device in at most one stage); when feature splits win, it also lays the
strategy out as one tensor-parallel stage (:mod:`.tensor`), keeps whichever the simulator finds
faster, and says in a note what of the strategy the plan does not express; the full strategy
and its PaSE cost go to ``plan.options["pase_strategy"]``.

Modules: :mod:`.problem` (the cost table), :mod:`.solver` (the DP), :mod:`.costs` (the cost
model), :mod:`.model` (a graph's problem), :mod:`.strategy` (the search over depths),
:mod:`.layout` (strategies as plans), :mod:`.tensor` (feature splits as a
tensor-parallel stage), :mod:`.partitioner` (the registered ``pase``).
"""

from __future__ import annotations

from explorer.partition.pase.costs import (
    LayerInfo,
    layer_configs,
    missing_fraction,
    ring_allreduce_s,
    split_factors,
    unary_cost_s,
)
from explorer.partition.pase.model import data_parallel_choice, one_weird_trick_choice, pase_problem
from explorer.partition.pase.partitioner import pase
from explorer.partition.pase.problem import TIE_S, Config, PaseProblem, PaseSolution, TooDenseError
from explorer.partition.pase.solver import dependent_order, solve
from explorer.partition.pase.strategy import PaseResult, pase_search

__all__ = ["TIE_S", "Config", "LayerInfo", "PaseProblem", "PaseResult", "PaseSolution",
           "TooDenseError", "data_parallel_choice", "dependent_order", "layer_configs",
           "missing_fraction", "one_weird_trick_choice", "pase", "pase_problem", "pase_search",
           "ring_allreduce_s", "solve", "split_factors", "unary_cost_s"]
