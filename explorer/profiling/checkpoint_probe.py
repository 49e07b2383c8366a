"""What ``torch.utils.checkpoint`` costs a recomputing stage beyond the ops it runs again: a host
probe that runs one plan with and without recomputation on one CPU rank and compares them.

The segment runtime checkpoints each span of a unit's ops that runs an op again
(:func:`explorer.costs.strategies.checkpoint_spans`) as a user checkpoints a block: one call
of non-reentrant checkpoint per span and micro-batch, its saved-tensor hooks packing what the
span saves, and in the backward a recomputation set up and run under hooks of its own; under
torch's selective checkpointing a policy is also called from Python for every op of the span,
in the forward and again in the recomputation. On CPU ranks that is processor time the ops'
profile does not hold, tens to hundreds of microseconds per span, more the more tensors
the span saves (each goes through checkpoint's hooks three times). The probe measures it once
per host (or afresh, as the profile is): small residual MLPs of :data:`BLOCKS` blocks (each a
span) of one and of four layers (:data:`DEPTHS`), run in segments without recomputation, with
"full" and (the shallow one) with "selective" in turn (:data:`ROUNDS` times); the forward and
backward each run adds, less the forward it runs again in the backward, per span and per
saved tensor (the "full" runs of both depths) and then per op under the policy (the
"selective" one) is ``DeviceCosts.checkpoint``, which the simulator charges each span
(:mod:`explorer.simulate.effects`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np
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
PROBE_KEY = ("checkpoint cost per span, per saved tensor and per op under a policy, segment "
             "runtime on 1 CPU rank")
KEYS = CHECKPOINT_KEYS
#: how many times each of the runs is made, in turn
ROUNDS = 3
#: the probe model's residual blocks, each a checkpointed span
BLOCKS = 6
#: the layers of a block in the probe's two models: spans that save four times as many
#: tensors tell the cost per span from the cost per saved tensor
DEPTHS = (1, 4)
#: the probe's runs: (recomputation, depth); selective runs on the shallow blocks only
RUNS = (("none", 1), ("full", 1), ("selective", 1), ("none", 4), ("full", 4))


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Probe(nn.Module):
    """:data:`BLOCKS` residual blocks of ``depth`` layers each (a block is a span)."""

    def __init__(self, depth: int, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(*(_Layer(width) for _ in range(depth)))
                                    for _ in range(BLOCKS))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def probe_graph(depth: int = 1) -> OpGraph:
    """The probe's model with blocks of ``depth`` layers (small tensors: what checkpointing
    adds is most of what it costs)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    return capture(_Probe(depth), (x,), nn.functional.cross_entropy, (y,),
                   name=f"checkpoint-probe-{depth}")


def checkpoint_costs(cluster: Cluster, cache: bool = True, pool: RankPool | None = None,
                     report: ops.Report | None = None) -> dict[str, float]:
    """The checkpointing costs of this host's CPU ranks ({} without a measured CPU rank, or
    when the probe fails): from the host measurement cache, or measured (``cache=False``
    measures afresh and replaces the entry)."""
    return host.measured_once(
        cluster, cache, PROBE_KEY, KEYS, lambda: measure_checkpoint_costs(pool=pool),
        "measuring what checkpointing adds on CPU ranks",
        f"{BLOCKS}-block residual MLPs of {DEPTHS} layers a block on 1 CPU rank in "
        f"segments, without recomputation, full and selective in turn ({ROUNDS} rounds): "
        "the medians' differences less the forward run again, per span and per saved "
        "tensor (full, both depths), then per op under the policy (selective)",
        report, ranks=1) or {}


def measure_checkpoint_costs(steps: int = 20, warmup: int = 3, pool: RankPool | None = None
                             ) -> dict[str, float]:
    """Run the probe (a few seconds, on ``pool``'s rank where given) and fit its costs."""
    graphs = {depth: probe_graph(depth) for depth in DEPTHS}
    dev = Cluster.cpu(1, measure=False).devices[0]
    times: dict[tuple[str, int], list[tuple[float, float]]] = {run: [] for run in RUNS}
    for _ in range(ROUNDS):  # in turn: a host that slows down moves all runs alike
        for mode, depth in RUNS:
            plan = Plan.single(graphs[depth], dev.id, optimizer="adam")
            if mode != "none":
                plan = plan.with_memory(recompute=mode)
            meas = launch.run(graphs[depth], plan=plan, steps=steps, warmup=warmup,
                              progress=False, pool=pool, runtime="segments", timeout_s=300.0)
            task = meas.task_s
            times[mode, depth].append((sum(v for k, v in task.items() if k.startswith("fwd:")),
                                       sum(v for k, v in task.items() if k.startswith("bwd:"))))
    median = {run: (statistics.median(f for f, _ in t), statistics.median(b for _, b in t))
              for run, t in times.items()}
    return fit(graphs, median)


@dataclass(frozen=True)
class _Extra:
    """What one recomputing run of a probe model took beyond its run without, and what its
    spans hold."""

    fwd_s: float
    #: less the forward its spans run again (each op's share of the plain forward)
    bwd_s: float
    spans: int
    saves: int
    policy_ops: int


def _extra(graph: OpGraph, mode: str, steps: dict[tuple[str, int], tuple[float, float]],
           depth: int) -> _Extra:
    n = len(graph)
    stage = [0] * n
    has_b = [x.kind == "op" and x.requires_grad for x in graph.nodes]
    again = (recomputation(graph, mode, stage, has_b).first_use >= 0).tolist()
    spans = checkpoint_spans(graph, [mode] * n, stage, has_b, again)
    (fwd_none, bwd_none), (fwd, bwd) = steps["none", depth], steps[mode, depth]
    per_op = fwd_none / max(sum(x.kind == "op" for x in graph.nodes), 1)
    return _Extra(fwd_s=fwd - fwd_none,
                  bwd_s=bwd - bwd_none - per_op * sum(len(x.rerun) for x in spans),
                  spans=len(spans), saves=sum(x.saves for x in spans),
                  policy_ops=sum(len(x.ops) for x in spans if x.policy))


def _per_span_and_saved(runs: list[_Extra], seconds: list[float]) -> tuple[float, float]:
    """Seconds per span and per saved tensor that best give ``seconds`` (one per run), by
    least squares, neither below 0."""
    a = np.array([[r.spans, r.saves] for r in runs], dtype=float)
    y = np.array(seconds, dtype=float)
    both = np.linalg.lstsq(a, y, rcond=None)[0]
    if (both >= 0).all():
        return float(both[0]), float(both[1])
    # one of them below 0: the other alone
    fits = []
    for k in (0, 1):
        col = a[:, k]
        x = max(float(col @ y / (col @ col)), 0.0)
        fits.append((float(((y - x * col) ** 2).sum()), k, x))
    _, k, x = min(fits)
    return (x, 0.0) if k == 0 else (0.0, x)


def fit(graphs: dict[int, OpGraph], steps: dict[tuple[str, int], tuple[float, float]]
        ) -> dict[str, float]:
    """The costs of :data:`KEYS` from the (forward, backward) seconds of one step of each
    probe model (by depth: ``graphs``) on one device for each of :data:`RUNS` (``steps``):
    the "full" runs' extra forward, and extra backward less the forward run again, per span
    and per tensor the spans save (the two depths tell them apart); then the "selective"
    run's extra, less what its spans and saved tensors cost, per op of its spans (all under
    the policy). None below 0."""
    full = [_extra(graphs[depth], "full", steps, depth) for depth in DEPTHS]
    out: dict[str, float] = {}
    out["span_fwd_s"], out["saved_fwd_s"] = _per_span_and_saved(full, [r.fwd_s for r in full])
    out["span_bwd_s"], out["saved_bwd_s"] = _per_span_and_saved(full, [r.bwd_s for r in full])
    sel = _extra(graphs[DEPTHS[0]], "selective", steps, DEPTHS[0])
    for part in ("fwd", "bwd"):
        spans_cost = sel.spans * out[f"span_{part}_s"] + sel.saves * out[f"saved_{part}_s"]
        out[f"policy_op_{part}_s"] = max(
            (getattr(sel, f"{part}_s") - spans_cost) / max(sel.policy_ops, 1), 0.0)
    return {k: out[k] for k in KEYS}
