"""The stage DP's cost model: a table of per-layer costs, no graph and no cost model.

:class:`StageCostTable` holds everything the solver needs and the reference cost function of
one stage; :class:`Stage` and :class:`StageSolution` are the solver's answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def replicated_bytes(params: Any, sharded: Any, working: Any, replicas: int) -> Any:
    """What a stage's weights, gradients and optimizer state take on each of its ``replicas``
    devices, from what they take on one (``params``): less ZeRO's shards of ``sharded``,
    plus ``working`` (what replicas hold more: ZeRO 1-2's 2-byte working copies under
    bf16/fp16); either None for nothing. Floats or arrays alike."""
    if replicas <= 1:
        return params
    if sharded is not None:
        params = params - sharded * (1.0 - 1.0 / replicas)
    if working is not None:
        params = params + working
    return params


@dataclass(frozen=True)
class StageNet:
    """A tensor that may cross stage boundaries, in layer terms.

    ``producer`` is the producing layer, ``consumers`` the distinct later layers that read it
    (sorted, all > producer). Activations (``per_micro_batch``) are sent once per micro-batch;
    weights once per step. ``grad`` says whether a gradient flows back to the producer.
    """

    producer: int
    consumers: tuple[int, ...]
    nbytes: int
    per_micro_batch: bool = True
    grad: bool = True


@dataclass(frozen=True, eq=False)
class StageCostTable:
    """The stage DP's cost model, per layer ``j`` (``L`` layers) and device position ``d``.

    A stage is ``(j0, j1, d, r)``: layers ``j0..j1-1`` on the ``r`` devices at positions
    ``d..d+r-1``, each replica running ``1/(r*M)`` of the batch per micro-batch. Its time for
    one step (:meth:`stage_time_s`) is

    * compute: ``max`` over the device types in the group of
      ``M * fixed + var / r + optimizer`` summed over its layers (the slowest replica sets
      the pace; fixed per-op costs do not shrink with the batch);
    * transfers it receives: activations from earlier stages (one per tensor, destination
      stage and micro-batch: latency + bytes/r over the link from position ``d-1``), and
      gradients from later stages (over the link to position ``d+r``), weights once per step;
    * the ring all-reduce of its gradients when ``r > 1``.

    Its memory (:meth:`stage_memory_bytes`) is its parameters (with gradients and optimizer
    state) plus saved and received activations of the micro-batches in flight at batch
    fraction ``1/(r*M)``, plus copies of weights it receives; in flight are all ``M`` with
    GPipe, ``min(S - stage index, M)`` with 1F1B. The score of a split into ``S`` stages is the
    slowest stage's time times ``(M + S - 1) / M``, the pipeline bubble.

    ``layer_pins[j]`` are the pinned device keys of layer ``j``. With ``pins_by_position`` the
    keys are device positions that must lie in the stage's group; otherwise (identical
    devices and links, where positions are interchangeable) they are device labels: every
    layer pinned to one label must be in one stage, and a stage needs at least as many
    replicas as labels pinned to it.
    """

    fixed_s: np.ndarray  # (types, L): per micro-batch, the per-op costs that do not shrink
    var_s: np.ndarray  # (types, L): per step at the whole batch, the part that shrinks
    optimizer_s: np.ndarray  # (types, L): the optimizer step of the layer's parameters
    param_bytes: np.ndarray  # (L,): params, gradients, optimizer state, buffers
    act_bytes: np.ndarray  # (L,): saved activations of one micro-batch at the whole batch
    grad_bytes: np.ndarray  # (L,): gradient bytes all-reduced when the stage is replicated
    nets: tuple[StageNet, ...]
    device_type: tuple[int, ...]  # (D,): row of fixed_s/var_s/optimizer_s for each position
    capacity_bytes: tuple[float, ...]  # (D,)
    link_latency_s: tuple[float, ...]  # (D-1,): link between positions d and d+1
    link_s_per_byte: tuple[float, ...]  # (D-1,)
    allreduce_latency_s: np.ndarray  # (D, D+1): [d, r] ring over positions d..d+r-1
    allreduce_s_per_byte: np.ndarray  # (D, D+1)
    micro_batches: int = 1
    schedule: str = "1f1b"
    replicas: tuple[int, ...] = (1,)
    layer_pins: tuple[frozenset[int], ...] = ()
    pins_by_position: bool = True
    # (L,): the part of param_bytes ZeRO divides by a stage's replica count (None: no ZeRO)
    sharded_bytes: np.ndarray | None = None
    #: (L,) what a replicated stage holds more per layer (ZeRO 1-2's 2-byte working copies
    #: of the weights under bf16/fp16; None: nothing)
    working_bytes: np.ndarray | None = None

    @property
    def n_layers(self) -> int:
        return int(self.param_bytes.shape[0])

    @property
    def n_devices(self) -> int:
        return len(self.device_type)

    def in_flight(self, remaining: int) -> int:
        """Micro-batches whose activations a stage keeps, ``remaining`` = S - stage index."""
        m = self.micro_batches
        return m if self.schedule == "gpipe" else min(remaining, m)

    def pins_of(self, j: int) -> frozenset[int]:
        return self.layer_pins[j] if self.layer_pins else frozenset()

    # -- the cost function, stage by stage (reference implementation) --------------------
    def _crossing(self, j0: int, j1: int) -> tuple[float, float, float, float, float, float]:
        """(recv count, recv bytes, recv activation bytes, recv weight bytes, grad count,
        grad bytes) for stage j0..j1-1, straight from the nets."""
        m = self.micro_batches
        rc = rb = ract = rpar = gc = gb = 0.0
        for net in self.nets:
            times = m if net.per_micro_batch else 1
            if net.producer < j0 and any(j0 <= c < j1 for c in net.consumers):
                rc += times
                rb += net.nbytes
                if net.per_micro_batch:
                    ract += net.nbytes
                else:
                    rpar += net.nbytes * (2 if net.grad else 1)
            if net.grad and j0 <= net.producer < j1 and net.consumers[-1] >= j1:
                gc += times
                gb += net.nbytes
        return rc, rb, ract, rpar, gc, gb

    def stage_time_s(self, j0: int, j1: int, d: int, r: int) -> float:
        """Seconds per step of stage ``(j0, j1, d, r)`` (inf when it cannot exist)."""
        if not (0 <= j0 < j1 <= self.n_layers and r >= 1 and 0 <= d and d + r <= self.n_devices):
            return math.inf
        m = self.micro_batches
        types = sorted({self.device_type[p] for p in range(d, d + r)})
        comp = max(m * float(self.fixed_s[k, j0:j1].sum()) + float(self.var_s[k, j0:j1].sum()) / r
                   + float(self.optimizer_s[k, j0:j1].sum()) for k in types)
        rc, rb, _, _, gc, gb = self._crossing(j0, j1)
        xfer = 0.0
        if rc:
            if d == 0:
                return math.inf
            xfer += self.link_latency_s[d - 1] * rc + self.link_s_per_byte[d - 1] * rb / r
        if gc:
            if d + r >= self.n_devices:
                return math.inf
            e = d + r - 1
            xfer += self.link_latency_s[e] * gc + self.link_s_per_byte[e] * gb / r
        ar = 0.0
        nbytes = float(self.grad_bytes[j0:j1].sum())
        if r > 1 and nbytes > 0:
            ar = float(self.allreduce_latency_s[d, r]) + float(
                self.allreduce_s_per_byte[d, r]) * nbytes
        return comp + xfer + ar

    def stage_memory_bytes(self, j0: int, j1: int, d: int, r: int, remaining: int) -> float:
        """Estimated peak bytes on each device of stage ``(j0, j1, d, r)``."""
        _, _, ract, rpar, _, _ = self._crossing(j0, j1)
        frac = self.in_flight(remaining) / (r * self.micro_batches)
        params = replicated_bytes(
            float(self.param_bytes[j0:j1].sum()),
            None if self.sharded_bytes is None else float(self.sharded_bytes[j0:j1].sum()),
            None if self.working_bytes is None else float(self.working_bytes[j0:j1].sum()), r)
        return params + (float(self.act_bytes[j0:j1].sum()) + ract) * frac + rpar

    def stage_capacity_bytes(self, d: int, r: int) -> float:
        return min(self.capacity_bytes[d:d + r])

    def stage_allowed(self, j0: int, j1: int, d: int, r: int) -> bool:
        """Replica count and pins allow the stage (memory aside)."""
        if r not in self.replicas or d + r > self.n_devices:
            return False
        keys = set().union(*(self.pins_of(j) for j in range(j0, j1)))
        if self.pins_by_position:
            return all(d <= k < d + r for k in keys)
        if len(keys) > r:
            return False
        return all(all(j0 <= j < j1 for j in range(self.n_layers) if k in self.pins_of(j))
                   for k in keys)

    def stage_feasible(self, j0: int, j1: int, d: int, r: int, remaining: int) -> bool:
        return (self.stage_allowed(j0, j1, d, r)
                and self.stage_memory_bytes(j0, j1, d, r, remaining)
                <= self.stage_capacity_bytes(d, r))

    def score(self, stages: Sequence[tuple[int, int, int, int]]) -> float:
        """The objective of a whole split: slowest stage x (M + S - 1) / M; inf if invalid."""
        s_count = len(stages)
        if not s_count or stages[0][0] != 0 or stages[-1][1] != self.n_layers:
            return math.inf
        worst = 0.0
        pos = 0
        for idx, (j0, j1, d, r) in enumerate(stages):
            if d != pos or (idx and stages[idx - 1][1] != j0):
                return math.inf
            pos = d + r
            if not self.stage_feasible(j0, j1, d, r, s_count - idx):
                return math.inf
            worst = max(worst, self.stage_time_s(j0, j1, d, r))
        m = self.micro_batches
        return worst * (m + s_count - 1) / m


@dataclass(frozen=True)
class Stage:
    """One stage of a solution: layers ``first_layer..end_layer-1`` on ``replicas`` devices
    starting at position ``first_device``."""

    first_layer: int
    end_layer: int
    first_device: int
    replicas: int
    time_s: float
    memory_bytes: float
    capacity_bytes: float


@dataclass(frozen=True)
class StageSolution:
    """The solver's answer: the chosen stages, and the best bottleneck for every stage count."""

    stages: tuple[Stage, ...]
    bottleneck_s: float
    score_s: float  # bottleneck x (M + S - 1) / M: what the split was chosen by
    best_by_stages_s: tuple[float, ...]  # [S-1]: the smallest bottleneck with S stages

    @property
    def feasible(self) -> bool:
        return bool(self.stages)


__all__ = ["Stage", "StageCostTable", "StageNet", "StageSolution"]
