"""Published training runs at cluster scale, re-created in the explorer and predicted.

Run: python benchmarks/published.py [--rows NAME,...] [--results DIR]

Nothing here can run a 70B model on 768 GPUs; what others measured and published is the only
truth at that scale. Each row is one published run as the explorer sees it: the published
shape captured on fake tensors with the run's global batch, the cluster as a GPU preset
(nodes of 8 H100s over InfiniBand), and the published parallelism as a plan (data x context x
tensor x pipeline degrees, sequence and async tensor parallelism, micro-batches of the
published size with gradient accumulation, 1F1B or interleaved 1F1B over the published
virtual stages, recomputation, bf16 with fp32 master weights, ZeRO 1 for Megatron's
distributed optimizer and ZeRO 3 for FSDP's full shard), costed by the H100 datasheet
roofline (the ops priced as the fused kernels Megatron-Core and NeMo run,
``kernels="compiled"``; llm-foundry's as eager ones). The simulator's step gives
tokens/s/GPU, TFLOP/s/GPU (Megatron-LM's formula for its GPT rows, the graph's own FLOPs for
all) and MFU, set against the published figure.

A run whose parallelism the plan space cannot express is listed with the reason instead of
a number: a prediction of some other configuration would not be a check of anything.

Sources (as given by the published-runs issue): Megatron-LM README model table (commit
f2e5db40, r0.8.0; H100, vocab 131072, seq 4096, DP = 48 x (TP x PP) sized, bf16, overlapped
communication); NVIDIA dgxc-benchmarking (NeMo 24.12, DGX H100, seq 8192, flash attention, no
recomputation, distributed optimizer); MosaicML llm-foundry throughput table (MPT, FSDP full
shard, seq 2048, vocab 50368).

Writes ``benchmarks/results/published.json`` (``--results``), which ``python
benchmarks/report.py`` renders into docs/published.md; prints the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_results_option, write_result

import explorer as ex
from explorer.analysis.throughput import throughput
from explorer.cli.commands import plan_degrees
from explorer.core.units import GiB, table
from explorer.costs.kernels import Kernels
from explorer.models.builtin import build_gpt, build_llama
from explorer.models.dense import GPTConfig
from explorer.models.llama import LlamaConfig

#: what a published run reports: Megatron's TFLOP/s per GPU, or tokens/s per GPU
Metric = Literal["tflops", "tokens"]
#: the GPU preset the runs are priced on by default: the H100 datasheet's roofline
GPU = "H100"
#: the degrees search runs on rows of at most this many GPUs (beyond, its memory-aware
#: fallback simulates plans with settings for minutes on a 2-core machine)
SEARCH_GPUS = 1024


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its model, cluster, parallelism and measured throughput."""

    name: str
    source: str
    model: GPTConfig | LlamaConfig
    gpus: int
    tensor: int
    pipeline: int
    micro_batch_size: int
    global_batch: int
    metric: Metric
    published: float
    context: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    #: tensor-parallel communication overlapped with the matrix products (Megatron-LM's
    #: --tp-comm-overlap, NeMo's tp_comm_overlap): async tensor parallelism
    async_tensor: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    #: 1: Megatron's distributed optimizer; 3: FSDP full shard
    zero: int = 1
    #: "compiled": the framework runs fused kernels (Transformer Engine's fused norms,
    #: activations and rotary embeddings in Megatron-Core and NeMo), priced as
    #: ``ex.profile(..., kernels="compiled")`` prices torch.compile's; "eager": one kernel per op
    kernels: Kernels = "compiled"

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline * self.context)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per replica and step (gradient accumulation steps x pipeline
        micro-batches)."""
        return self.global_batch // (self.data * self.micro_batch_size)

    @property
    def parallelism(self) -> str:
        parts = [f"DP{self.data}", f"TP{self.tensor}", f"PP{self.pipeline}"]
        parts += [f"CP{self.context}"] * (self.context > 1)
        parts += [f"VP{self.virtual_stages}"] * (self.virtual_stages > 1)
        parts += ["SP"] * self.sequence_parallel
        parts += ["async TP"] * self.async_tensor
        parts += ["FSDP" if self.zero == 3 else f"ZeRO{self.zero}"]
        parts += [f"recompute {self.recompute}"] * (self.recompute != "none")
        parts += ["fused kernels"] * (self.kernels == "compiled")
        return " ".join(parts)


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
              batch: int, tflops: float) -> PublishedRun:
    cfg = GPTConfig(vocab_size=131072, seq_len=4096, d_model=hidden, n_heads=heads,
                    n_layers=layers, batch_size=1, fused_attention=True)
    # (Megatron-Core overlaps tensor-parallel communication, with sequence parallelism)
    return PublishedRun(f"megatron-{size}", "Megatron-LM README (r0.8.0)", cfg, gpus, tp, pp,
                        1, batch, "tflops", tflops, sequence_parallel=tp > 1,
                        async_tensor=tp > 1)


_LLAMA3_8B = LlamaConfig(vocab_size=128256, seq_len=8192, d_model=4096, n_layers=32, n_heads=32,
                         n_kv_heads=8, ffn_dim=14336, batch_size=1, rope_theta=500000.0)
_LLAMA3_70B = LlamaConfig(vocab_size=128256, seq_len=8192, d_model=8192, n_layers=80,
                          n_heads=64, n_kv_heads=8, ffn_dim=28672, batch_size=1,
                          rope_theta=500000.0)
_GPT3_175B = GPTConfig(vocab_size=50257, seq_len=2048, d_model=12288, n_heads=96, n_layers=96,
                       batch_size=1, fused_attention=True)


def _mpt(hidden: int, layers: int, heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=50368, seq_len=2048, d_model=hidden, n_heads=heads,
                     n_layers=layers, batch_size=1, fused_attention=True)


_DGXC = "NVIDIA dgxc-benchmarking (NeMo 24.12)"
_FOUNDRY = "MosaicML llm-foundry throughput table"

RUNS = (
    _megatron("1.7b", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _megatron("7.1b", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _megatron("16b", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _megatron("70b", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _megatron("177b", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    PublishedRun("dgxc-llama3-8b", _DGXC, _LLAMA3_8B, 8, 1, 1, 1, 128, "tokens", 10254,
                 context=2),
    PublishedRun("dgxc-llama3-70b", _DGXC, _LLAMA3_70B, 64, 4, 4, 1, 128, "tokens", 1121,
                 context=2, virtual_stages=5, sequence_parallel=True, async_tensor=True),
    PublishedRun("dgxc-gpt3-175b", _DGXC, _GPT3_175B, 128, 4, 8, 1, 256, "tokens", 493,
                 virtual_stages=12, sequence_parallel=True, async_tensor=True),
    PublishedRun("foundry-mpt-7b", _FOUNDRY, _mpt(4096, 32, 32), 8, 1, 1, 6, 48, "tokens",
                 10643, zero=3, kernels="eager"),
    PublishedRun("foundry-mpt-70b", _FOUNDRY, _mpt(8192, 80, 64), 64, 1, 1, 8, 2048, "tokens",
                 1039, recompute="full", zero=3, kernels="eager"),
)


def megatron_flops(cfg: GPTConfig, batch: int) -> float:
    """Megatron-LM's FLOPs per step of a GPT without recomputation (Narayanan et al. 2021,
    eq. 3 at three passes instead of four): ``72 B s l h^2 (1 + s / 6h + V / 12lh)``."""
    b, s, h, layers, v = batch, cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.vocab_size
    return 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


def published_plan(graph: ex.OpGraph, cluster: ex.Cluster, run: PublishedRun) -> ex.Plan:
    """The run's parallelism as a plan: ``pipeline`` stages of ``data x tensor`` GPUs (tensor
    groups inside a node), the layers cut evenly by op count into ``pipeline x
    virtual_stages`` chunks taken in turn around the stages, 1F1B (interleaved with virtual
    stages) over the run's micro-batches, its memory settings on every stage."""
    layers = graph.layers()
    group = run.data * run.context * run.tensor
    chunks = run.pipeline * run.virtual_stages
    ops = [sum(1 for i in layer if graph.nodes[i].kind == "op") for layer in layers]
    total, cut, assign = sum(ops), 0, {}
    for j, layer in enumerate(layers):
        chunk = min(chunks - 1, cut * chunks // total)
        cut += ops[j]
        assign.update(dict.fromkeys(layer, chunk % run.pipeline))
    stages = [cluster.ids[k * group:(k + 1) * group] for k in range(run.pipeline)]
    schedule = "interleaved-1f1b" if run.virtual_stages > 1 else "1f1b"
    plan = ex.Plan.from_assignment(graph, stages, assign, micro_batches=run.micro_batches,
                                   schedule=schedule, algorithm="published")
    return plan.with_memory(precision="bf16", zero=run.zero, recompute=run.recompute,
                            tensor=run.tensor, sequence=run.sequence_parallel,
                            async_tensor=run.async_tensor or None, context=run.context)


def predict(run: PublishedRun, gpu: str = GPU, search: bool = True) -> dict[str, object]:
    """One row: the run as published and as the explorer predicts it on ``gpu`` presets,
    with (``search``) what the degrees search finds on the same model and cluster."""
    t0 = time.perf_counter()
    row: dict[str, object] = {"run": run.name, "GPUs": run.gpus,
                              "parallelism": run.parallelism,
                              "global batch": f"{run.global_batch} x {run.model.seq_len}"}
    unit = "TFLOP/s/GPU" if run.metric == "tflops" else "tokens/s/GPU"
    row["published"] = f"{run.published:,.1f} {unit}"
    build = build_gpt if isinstance(run.model, GPTConfig) else build_llama
    module, inputs, targets, loss_fn, _ = build(run.model, run.global_batch, None)
    graph = ex.capture(module, inputs, loss_fn, targets, name=run.name)
    cluster = ex.Cluster.preset(f"{run.gpus}x{gpu}")
    costs = ex.profile(graph, cluster, progress=False, kernels=run.kernels)
    try:
        plan = published_plan(graph, cluster, run)
    except ex.ExplorerError as e:
        return {**row, "predicted": "-", "error": "-", "notes": f"not expressible yet: {e}"}
    pred = ex.simulate(graph, plan, costs)
    rate = throughput(graph, plan, costs.cluster, pred.step_s)
    tokens = rate.tokens_per_s_per_device
    tflops = (megatron_flops(run.model, run.global_batch) / pred.step_s / run.gpus / 1e12
              if run.metric == "tflops" else rate.model_flops_per_s_per_device / 1e12)
    predicted = tflops if run.metric == "tflops" else tokens
    peak = max(pred.peak_bytes.values())
    row.update({"predicted": f"{predicted:,.1f} {unit}",
                "error": f"{predicted / run.published - 1:+.1%}",
                "step s": f"{pred.step_s:.3f}", "tokens/s/GPU": f"{tokens:,.0f}",
                "model TFLOP/s/GPU": f"{rate.model_flops_per_s_per_device / 1e12:,.1f}",
                "MFU": f"{rate.mfu:.1%}", "peak GiB/GPU": f"{peak / GiB:.1f}",
                "fits": "yes" if pred.fits else "no"})
    row["search"] = ("not run (--no-search)" if not search
                     else f"not run above {SEARCH_GPUS} GPUs" if run.gpus > SEARCH_GPUS
                     else searched(graph, cluster, costs, run, pred.step_s, pred.fits))
    row["notes"] = f"predicted in {time.perf_counter() - t0:.0f} s"
    return row


def searched(graph: ex.OpGraph, cluster: ex.Cluster, costs: ex.CostModel, run: PublishedRun,
             published_s: float, published_fits: bool) -> str:
    """What the degrees search finds with the run's micro-batches, 1F1B (its best pipeline
    interleaved where faster) and memory settings (its candidates simulated with the run's
    precision, ZeRO and recomputation, as
    ``explorer plan --algorithm degrees --precision bf16 --zero 1`` ranks them), against the
    published configuration's predicted step."""
    memory = {"precision": "bf16", "recompute": run.recompute, "zero": run.zero,
              "async_tensor": run.async_tensor}
    try:
        plan = ex.partition(graph, cluster, costs, "degrees", micro_batches=[run.micro_batches],
                            schedules=["1f1b"], memory=memory,
                            context_degrees=sorted({1, run.context}))
    except ex.ExplorerError as e:
        return f"no plan: {e}"
    step_s = ex.simulate(graph, plan, costs).step_s
    why = "" if published_fits else " (the published one does not fit by the prediction)"
    chunks = plan.options.get("virtual_stages", 1)
    virtual = f", {chunks} virtual stages" if chunks > 1 else ""
    return (f"{plan_degrees(plan)['text']} (dp x tp x pp{virtual}, "
            f"{plan.settings_of(0).describe()}): "
            f"{published_s / step_s:.2f}x the published configuration's throughput{why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="",
                    help="comma-separated run names (default all): "
                         + ", ".join(r.name for r in RUNS))
    ap.add_argument("--gpu", default=GPU,
                    help=f"the GPU preset to price the runs on (default {GPU}: the datasheet "
                         "roofline; H100-measured: the roofline fitted on one H100)")
    ap.add_argument("--no-search", action="store_true",
                    help="skip the degrees search on each row's model and cluster")
    add_results_option(ap)
    args = ap.parse_args(argv)
    wanted = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {r.name for r in RUNS})
    if unknown:
        ap.error(f"unknown run(s) {', '.join(unknown)}; known: "
                 + ", ".join(r.name for r in RUNS))
    runs = [r for r in RUNS if not wanted or r.name in wanted]
    rows = []
    for run in runs:
        rows.append(predict(run, args.gpu, not args.no_search))
        print(f"{run.name}: {rows[-1]['predicted']} against {rows[-1]['published']}",
              file=sys.stderr, flush=True)
    columns = list(dict.fromkeys(c for r in rows for c in r))
    print(table(columns, [[str(r.get(c, "")) for c in columns] for r in rows]))
    errors = [abs(float(str(r["error"]).rstrip("%")) / 100) for r in rows
              if r["error"] != "-"]
    within = sum(e <= 0.15 for e in errors)
    summary = (f"{len(errors)} of {len(rows)} runs predicted; {within} within 15 % of the "
               "published throughput" + (f", mean error {sum(errors) / len(errors):.1%}, max "
                                          f"{max(errors):.1%}" if errors else ""))
    print(summary)
    write_result("published", rows, title="Published training runs against the explorer's "
                 "prediction", notes=summary + f". {args.gpu} preset (roofline, no profile); "
                 "nodes of 8 over 8 x 400 Gb/s InfiniBand.", folder=args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
