"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline stages): each stage's
devices hold several chunks of the layers, taken in turn around the pipeline, and run one
micro-batch's chunks in the order Megatron-LM does.

With ``p`` stages, ``v`` chunks on each and ``M`` micro-batches (a multiple of ``p``), a stage
runs ``M v`` forwards and as many backwards ("virtual micro-batches"). Forward ``k`` is chunk
``(k // p) mod v`` of micro-batch ``(k // pv) p + k mod p``; backward ``k`` the same
micro-batch's chunk ``v - 1 - (k // p) mod v``. The stage of rank ``r`` runs
``2 (p - r - 1) + (v - 1) p`` forwards before its first backward, then one forward and one
backward in turn, as 1F1B does over the virtual micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from explorer.core.errors import PlanError
from explorer.core.plan_schema import INTERLEAVED

__all__ = ["INTERLEAVED", "VirtualStages", "virtual_stages"]


@dataclass(frozen=True)
class VirtualStages:
    """Where each op's chunk is and the order a stage runs its chunks' forwards and backwards.

    ``chunk``: per node, its chunk on its stage (0 for the nodes that are not ops).
    ``slot_f``/``slot_b``: [stage][chunk][micro-batch] the schedule slot of the forward and
    the backward (the stages that run no ops hold zeros). ``warm``: per stage, the virtual
    micro-batches it runs forward before its first backward, plus one (as ``warm`` in
    1F1B: forward ``k >= warm`` waits for backward ``k - warm``).
    """

    chunks: int
    chunk: np.ndarray
    slot_f: np.ndarray
    slot_b: np.ndarray
    warm: dict[int, int]

    def forward_order(self, micro_batches: int, stages: int) -> list[tuple[int, int]]:
        """(chunk, micro-batch) of forward ``k`` in turn."""
        return [_forward(k, stages, self.chunks) for k in range(micro_batches * self.chunks)]

    def backward_order(self, micro_batches: int, stages: int) -> list[tuple[int, int]]:
        """(chunk, micro-batch) of backward ``k`` in turn."""
        v = self.chunks
        return [(v - 1 - c, m) for c, m in self.forward_order(micro_batches, stages)]


def _forward(k: int, p: int, v: int) -> tuple[int, int]:
    return (k // p) % v, (k // (p * v)) * p + k % p


def virtual_stages(stage_of: np.ndarray, ops: np.ndarray, active: list[int], stages: int,
                   micro_batches: int) -> VirtualStages:
    """The chunks of an interleaved plan and its slots: ``stage_of`` per node, ``ops`` the op
    nodes in graph order, ``active`` the stages that run ops in the order their first ops
    come. :class:`PlanError` where the placement is not chunks taken in turn around the
    stages, or the micro-batches are not a multiple of the stages."""
    p = len(active)
    seq = stage_of[ops]
    run_start = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]]) if len(seq) else seq
    run_stage = seq[run_start]
    v = len(run_stage) // max(p, 1)
    if (p < 2 or v < 2 or len(run_stage) != p * v
            or not np.array_equal(run_stage, np.tile(np.asarray(active), v))):
        order = " ".join(str(int(s)) for s in run_stage[:24])
        more = " ..." if len(run_stage) > 24 else ""
        raise PlanError(
            "interleaved 1F1B needs the layers cut into chunks that go round the pipeline "
            "stages in turn, the same number on each stage (stage 0, 1, ..., p-1, 0, 1, ...), "
            f"but this plan's ops run on stages {order}{more} in graph order: place the "
            "chunks so (ex.partition(..., 'even-layers', virtual_stages=v) does), or use "
            "schedule='1f1b'")
    if micro_batches % p:
        raise PlanError(
            f"interleaved 1F1B runs the micro-batches in groups of one per pipeline stage, "
            f"so they must be a multiple of the {p} stages (not {micro_batches}); use "
            f"{max(p, micro_batches - micro_batches % p)} micro-batches, or schedule='1f1b'")
    run_index = np.cumsum(np.r_[True, seq[1:] != seq[:-1]]) - 1
    chunk = np.zeros(len(stage_of), dtype=np.int64)
    chunk[ops] = run_index // p
    M, total = micro_batches, micro_batches * v
    slot_f = np.zeros((stages, v, M), dtype=np.int64)
    slot_b = np.zeros((stages, v, M), dtype=np.int64)
    warm = {}
    for r, s in enumerate(active):
        w = warm[s] = min(2 * (p - r - 1) + (v - 1) * p + 1, total)
        for k in range(total):
            c, m = _forward(k, p, v)
            slot_f[s, c, m] = k if k < w else w + 2 * (k - w) + 1
            slot_b[s, v - 1 - c, m] = w + 2 * k
    return VirtualStages(v, chunk, slot_f, slot_b, warm)
