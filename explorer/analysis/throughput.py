"""Throughput as people who train language models speak of it: tokens per second per device,
model FLOP/s per device and model FLOPs utilization (MFU), beside a plan's predicted step.

A graph is a language model here when its first embedding reads an integer input of token
ids; its tokens per step are that input's elements (batch x sequence). Model FLOPs are the
graph's own forward and backward FLOPs (``OpGraph.total_flops``, as ``FlopCounterMode``
counts them: fused attention's full ``T x T`` scores, a recomputed forward not counted
again), so MFU is what PaLM (Chowdhery et al. 2022, appendix B) defines: model FLOP/s over
the devices' peak FLOP/s, each device's peak at its stage's precision (bf16/fp16 tensor-core
peak for a half-precision stage, fp32 otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.tensor_layout import EMBEDDING_OPS
from explorer.devices.cluster import Cluster

_TOKEN_DTYPES = ("int64", "int32")


@dataclass(frozen=True)
class Throughput:
    """A step's throughput per device, from its predicted (or measured) seconds."""

    tokens_per_step: int
    step_s: float
    devices: int
    tokens_per_s_per_device: float
    model_flops_per_s_per_device: float
    #: model FLOP/s over the devices' peak FLOP/s at the plan's precision, 0..1
    mfu: float

    def as_dict(self) -> dict[str, float | int]:
        return {"tokens_per_step": self.tokens_per_step,
                "tokens_per_s_per_device": self.tokens_per_s_per_device,
                "model_tflops_per_s_per_device": self.model_flops_per_s_per_device / 1e12,
                "mfu": self.mfu}

    def describe(self) -> str:
        return (f"{self.tokens_per_s_per_device:,.0f} tokens/s/device, "
                f"{self.model_flops_per_s_per_device / 1e12:,.1f} TFLOP/s/device, "
                f"MFU {self.mfu:.1%}")


def tokens_per_step(graph: OpGraph) -> int | None:
    """The tokens a step of ``graph`` trains on, or None when it is not a language model
    (its first embedding does not read an integer input, directly or through views)."""
    for n in graph.ops:
        if n.op not in EMBEDDING_OPS:
            continue
        for name in n.inputs:
            source = graph[name]
            while source.kind == "op" and source.is_view and source.inputs:  # ids.view(-1, T)
                source = graph[source.inputs[0]]
            if source.kind == "input" and source.dtype in _TOKEN_DTYPES and source.shapes:
                return math.prod(source.shapes[0])
        return None
    return None


def peak_flops_per_s(cluster: Cluster, plan: Plan) -> float:
    """The plan's devices' summed peak FLOP/s, each at its stage's precision."""
    total = 0.0
    for s, devices in enumerate(plan.stages):
        half = plan.settings_of(s).precision != "fp32"
        for d in devices:
            dev = cluster.device(d)
            total += dev.half_flops_per_s if half else dev.flops_per_s
    return total


def throughput(graph: OpGraph, plan: Plan, cluster: Cluster, step_s: float
               ) -> Throughput | None:
    """Tokens/s and model FLOP/s per device and MFU of ``plan`` at ``step_s`` seconds a step;
    None when ``graph`` is not a language model or the step takes no time."""
    tokens = tokens_per_step(graph)
    if tokens is None or not step_s > 0:
        return None
    n = len(plan.devices)
    flops_per_s = graph.total_flops / step_s
    return Throughput(tokens, step_s, n, tokens / step_s / n, flops_per_s / n,
                      flops_per_s / peak_flops_per_s(cluster, plan))


__all__ = ["Throughput", "peak_flops_per_s", "throughput", "tokens_per_step"]
