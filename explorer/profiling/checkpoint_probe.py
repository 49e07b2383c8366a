"""What ``torch.utils.checkpoint`` costs a recomputing stage beyond the ops it runs again: a host
probe that runs one plan with and without recomputation on one CPU rank and compares them.

The segment runtime checkpoints each span of a unit's ops that runs an op again
(:func:`explorer.costs.strategies.checkpoint_spans`) as a user checkpoints a block: one call
of non-reentrant checkpoint per span and micro-batch, its saved-tensor hooks packing what the
span saves, and in the backward a recomputation set up and run under hooks of its own; under
torch's selective checkpointing a policy is also called from Python for every op of the span,
in the forward and again in the recomputation. On CPU ranks that is processor time the ops'
profile does not hold, tens to hundreds of microseconds per span. The probe measures it once
per host (or afresh, as the profile is): a small residual MLP of :data:`BLOCKS` blocks (each a
span), run in segments without recomputation, with "full" and with "selective" in turn
(:data:`ROUNDS` times); the forward and backward each run adds, less the forward it runs again
in the backward, per span (the "full" runs) and then per op under the policy (the
"selective" ones) is ``DeviceCosts.checkpoint``, which the simulator charges each span
(:mod:`explorer.simulate.effects`).
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from explorer.capture.tracing import capture
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CHECKPOINT_KEYS
from explorer.costs.strategies import checkpoint_spans, recomputation
from explorer.devices.cluster import Cluster
from explorer.profiling import host, ops
from explorer.runtime import launch
from explorer.runtime.pool import RankPool

#: the probe's entry in the host measurement cache
PROBE_KEY = ("checkpoint cost per span and per op under a policy, segment runtime on 1 CPU "
             "rank")
KEYS = CHECKPOINT_KEYS
#: how many times each of the three runs is made, in turn
ROUNDS = 3
#: the probe model's residual blocks, each a checkpointed span
BLOCKS = 6
MODES = ("none", "full", "selective")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Probe(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(BLOCKS))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def probe_graph() -> OpGraph:
    """The probe's model (small tensors: what checkpointing adds is most of what it costs)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    return capture(_Probe(), (x,), nn.functional.cross_entropy, (y,), name="checkpoint-probe")


def checkpoint_costs(cluster: Cluster, cache: bool = True, pool: RankPool | None = None,
                     report: ops.Report | None = None) -> dict[str, float]:
    """The checkpointing costs of this host's CPU ranks ({} without a measured CPU rank, or
    when the probe fails): from the host measurement cache, or measured (``cache=False``
    measures afresh and replaces the entry)."""
    return host.measured_once(
        cluster, cache, PROBE_KEY, KEYS, lambda: measure_checkpoint_costs(pool=pool),
        "measuring what checkpointing adds on CPU ranks",
        f"{BLOCKS}-block residual MLP on 1 CPU rank in segments, without recomputation, "
        f"full and selective in turn ({ROUNDS} rounds): the medians' differences less the "
        "forward run again, per span (full), then per op under the policy (selective)",
        report, ranks=1) or {}


def measure_checkpoint_costs(steps: int = 20, warmup: int = 3, pool: RankPool | None = None
                             ) -> dict[str, float]:
    """Run the probe (a few seconds, on ``pool``'s rank where given) and fit its costs."""
    graph = probe_graph()
    dev = Cluster.cpu(1, measure=False).devices[0]
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(ROUNDS):  # in turn: a host that slows down moves all three alike
        for mode in MODES:
            plan = Plan.single(graph, dev.id, optimizer="adam")
            if mode != "none":
                plan = plan.with_memory(recompute=mode)
            meas = launch.run(graph, plan=plan, steps=steps, warmup=warmup, progress=False,
                              pool=pool, runtime="segments", timeout_s=300.0)
            task = meas.task_s
            times[mode].append((sum(v for k, v in task.items() if k.startswith("fwd:")),
                                sum(v for k, v in task.items() if k.startswith("bwd:"))))
    median = {m: (statistics.median(f for f, _ in t), statistics.median(b for _, b in t))
              for m, t in times.items()}
    return fit(graph, median)


def fit(graph: OpGraph, steps: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The costs of :data:`KEYS` from the (forward, backward) seconds of one step of
    ``graph`` on one device for each of :data:`MODES` (``steps``): the "full" run's extra
    forward per span, and its extra backward per span less the forward it runs again (each
    op's share of the plain forward); then the "selective" run's extra, less its spans' cost,
    per op of its spans (all under the policy). None below 0."""
    n = len(graph)
    stage = [0] * n
    has_b = [x.kind == "op" and x.requires_grad for x in graph.nodes]
    fwd_none, bwd_none = steps["none"]
    per_op = fwd_none / max(sum(x.kind == "op" for x in graph.nodes), 1)
    out: dict[str, float] = {}
    for mode in ("full", "selective"):
        again = (recomputation(graph, mode, stage, has_b).first_use >= 0).tolist()
        spans = checkpoint_spans(graph, [mode] * n, stage, has_b, again)
        fwd, bwd = steps[mode]
        extra_f = fwd - fwd_none
        extra_b = bwd - bwd_none - per_op * sum(len(x.rerun) for x in spans)
        policy_ops = sum(len(x.ops) for x in spans if x.policy)
        if mode == "full":  # (no op of the probe updates state: no policy)
            out["span_fwd_s"] = max(extra_f / max(len(spans), 1), 0.0)
            out["span_bwd_s"] = max(extra_b / max(len(spans), 1), 0.0)
            continue
        out["policy_op_fwd_s"] = max((extra_f - len(spans) * out["span_fwd_s"])
                                     / max(policy_ops, 1), 0.0)
        out["policy_op_bwd_s"] = max((extra_b - len(spans) * out["span_bwd_s"])
                                     / max(policy_ops, 1), 0.0)
    return out
