"""The real-run path on two CPU ranks against what a PyTorch user would run instead: DDP, the
1F1B pipeline schedule of ``torch.distributed.pipelining``, FSDP2, and the plan's own native
script.

Run: python benchmarks/native_dist.py [--quick] [--models gpt,resnet] [--sizes default]
       [--rounds 2] [--steps 10] [--runtime auto|ops|segments] [--timeout-s 900]

For each built-in model (gpt, resnet) at each size, three plans run on ``cpu:2`` through
``ex.run`` (two rank processes, one thread each, gloo), each against its PyTorch counterpart
run in the same process set-up (two processes started with ``MASTER_ADDR``/``MASTER_PORT``,
``torch.set_num_threads(1)``, pinned and with the allocator set up as the CPU platform sets up
a rank: :meth:`explorer.platforms.Platform.pin_rank` and ``hold_freed_memory``), with the
plan's optimizer (Adam, :func:`explorer.runtime.params.make_optimizer`) at the same learning
rate:

- ``data parallel``: one stage holding both devices (each replica takes half the batch and
  the gradients are averaged) against ``DistributedDataParallel`` on gloo, each rank fed the
  same half of the batch. DDP runs with ``broadcast_buffers=False``: the explorer's replicas
  keep their own buffers (BatchNorm's running statistics), as such a DDP does; the loss does
  not read them in training mode. Target: explorer / reference <= 1.10.
- ``1F1B pipeline``: two stages, one device each, four micro-batches, schedule ``1f1b``,
  against ``Schedule1F1B`` over two ``PipelineStage``s. The model is cut at the same layer on
  both sides (gpt: before block ``n_layers // 2``; resnet: before stage ``layer{k + 1}``,
  ``k`` = half the stages, rounded down): the reference's halves are modules written here over
  the built-in model's own layers (:class:`GPTFront`, :class:`GPTBack`, :class:`ResNetFront`,
  :class:`ResNetBack`), and the plan puts every op before the first op of the back half's
  first layer on stage 0, the rest (with the loss) on stage 1. The schedule's loss is the
  model's own loss function per micro-batch. Target <= 1.10.
- ``ZeRO-3``: the data-parallel plan with ``zero=3`` (parameters, gradients and optimizer state
  sharded over the replicas, :class:`explorer.core.plan.StageSettings`) against FSDP2,
  ``fully_shard`` on every block (gpt's transformer blocks, resnet's basic blocks) then on the
  root. Target <= 1.25.
- ``native script, data parallel``, ``native script, 1F1B pipeline`` and ``native script,
  ZeRO-3``: the same three plans against their own native scripts (``explorer export
  --native``: DDP; ``pipeline()`` cut where the second stage begins, run by
  ``Schedule1F1B``; FSDP2 ``fully_shard`` per block), started as torchrun starts them, each
  rank set up as the others are (:data:`NATIVE_RANK`); their step times as the script prints
  them (rank 0, from the step's start to its optimizer step and loss all-reduce). Target:
  within 1.10 either way.

``ex.run`` takes ``--runtime``; ``auto`` (the default) is what ``ex.run`` takes unasked
(:func:`explorer.runtime.segments.choose_runtime`: the segments); the ``runtime`` column
records which ran. Each case runs ``--rounds`` times, the
explorer then the reference, ``--steps`` measured steps each after :data:`WARMUP` steps; a
step's time is the slowest rank's, from a barrier to the end of its optimizer step (as
``ex.run`` times it), and each column is the median over all measured steps (``--rounds x
--steps``, 20 by default).

Same work on both sides: the explorer's ranks start from the weights and batch captured from
``ex.builtin_model(name, size)``, and each reference rank rebuilds that model (built-in models
are deterministic) before wrapping or cutting it. Every round checks that (1) a SHA-256 of the
parameters (by name) and of the batch, taken by the reference's rank 0 from the model it
built, equals the one of the captured program's parameters and batch that ``ex.run`` runs,
and (2) the first step's loss (before any update; the mean over ranks or micro-batches as
each side reports it) agrees within :data:`LOSS_RTOL`. A mismatch stops the benchmark; the
``first loss`` column is the explorer's, ``loss gap`` the largest relative difference seen
(resnet's pipeline loss differs from its data-parallel one on both sides: BatchNorm
normalises over each micro-batch).
A rank of either side that fails, or runs past ``--timeout-s``, ends both.

``--quick``: the small size, 1 round, 2 steps after 1 warm-up step, ``ex.run``'s runs on one
shared pool of rank processes (a smoke run; not a measurement). Prints its table and records
it as ``benchmarks/results/native_dist.json`` (``--results``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

import torch
import torch.distributed as dist
from _common import add_results_option, dry_run_ranks, load_average, write_result
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.units import table
from explorer.platforms import platform_of
from explorer.platforms.net import free_port
from explorer.runtime import RankPool
from explorer.runtime.params import make_optimizer
from explorer.runtime.segments import choose_runtime

Case = Literal["data parallel", "1F1B pipeline", "ZeRO-3", "native script, data parallel",
               "native script, 1F1B pipeline", "native script, ZeRO-3"]
RuntimeChoice = Literal["auto", "ops", "segments"]
CASES: tuple[Case, ...] = ("data parallel", "1F1B pipeline", "ZeRO-3",
                           "native script, data parallel", "native script, 1F1B pipeline",
                           "native script, ZeRO-3")
#: what each case runs against, and its target ratio (explorer / reference)
REFERENCE: dict[Case, str] = {"data parallel": "DistributedDataParallel",
                              "1F1B pipeline": "Schedule1F1B",
                              "ZeRO-3": "fully_shard (FSDP2)",
                              "native script, data parallel": "explorer export --native",
                              "native script, 1F1B pipeline": "explorer export --native",
                              "native script, ZeRO-3": "explorer export --native"}
TARGET: dict[Case, float] = {"data parallel": 1.10, "1F1B pipeline": 1.10, "ZeRO-3": 1.25,
                             "native script, data parallel": 1.10,
                             "native script, 1F1B pipeline": 1.10,
                             "native script, ZeRO-3": 1.10}
#: the cases whose reference is the plan's own native script: within the target either way
NATIVE: dict[Case, Case] = {"native script, data parallel": "data parallel",
                            "native script, 1F1B pipeline": "1F1B pipeline",
                            "native script, ZeRO-3": "ZeRO-3"}
MODELS = ("gpt", "resnet")
DEVICES = ("cpu:0", "cpu:1")
WORLD = len(DEVICES)
MICRO_BATCHES = 4
LR = 1e-3  # ex.run's default learning rate
WARMUP = 3
#: how far apart the two sides' first losses may be, relative to the loss
LOSS_RTOL = 1e-5
#: seconds one run (either side's) may take by default before its processes are ended
TIMEOUT_S = 900.0


class NotSameWork(ExplorerError):
    """The explorer's run and the reference did not start from the same weights and batch."""


# -- the model cut in two (the pipeline's stages) ---------------------------------------------
class GPTFront(nn.Module):
    """A built-in GPT's embeddings and its first ``cut`` blocks (its layers, not copies)."""

    def __init__(self, gpt: nn.Module, cut: int) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.Sequential(*list(gpt.blocks)[:cut])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T) int64
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        return self.blocks(self.tok_emb(tokens) + self.pos_emb(positions))  # (B, T, C)


class GPTBack(nn.Module):
    """A built-in GPT's blocks from ``cut`` on, final LayerNorm and LM head."""

    def __init__(self, gpt: nn.Module, cut: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*list(gpt.blocks)[cut:])
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        return self.lm_head(self.ln_f(self.blocks(x)))  # (B, T, V)


class ResNetFront(nn.Module):
    """A built-in ResNet's stem and its first ``cut`` stages (``layer1`` ... ``layer{cut}``)."""

    def __init__(self, resnet: nn.Module, cut: int) -> None:
        super().__init__()
        self.stem = resnet.stem
        self.layers = nn.Sequential(*(getattr(resnet, f"layer{s}") for s in range(1, cut + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        return self.layers(self.stem(x))  # (B, C, H', W')


class ResNetBack(nn.Module):
    """A built-in ResNet's stages from ``layer{cut + 1}`` on, pooling and classifier."""

    def __init__(self, resnet: nn.Module, cut: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(getattr(resnet, f"layer{s}")
                                      for s in range(cut + 1, resnet.n_stages + 1)))
        self.avgpool, self.fc = resnet.avgpool, resnet.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H', W')
        return self.fc(torch.flatten(self.avgpool(self.layers(x)), 1))  # (B, n_classes)


@dataclass(frozen=True)
class Cut:
    """Where a built-in model is cut in two: the module path of the back half's first layer,
    and the two halves as modules over the model's own layers."""

    back_starts_at: str
    front: nn.Module
    back: nn.Module


def cut_in_two(name: str, module: nn.Module) -> Cut:
    """Built-in model ``name`` (gpt or resnet) cut at half its blocks or stages."""
    if name == "gpt":
        k = len(module.blocks) // 2
        return Cut(f"blocks.{k}", GPTFront(module, k), GPTBack(module, k))
    if name == "resnet":
        k = module.n_stages // 2
        return Cut(f"layer{k + 1}", ResNetFront(module, k), ResNetBack(module, k))
    raise ExplorerError(f"no cut is written for model {name!r}; use one of {', '.join(MODELS)}")


def blocks_of(name: str, module: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one: gpt's transformer blocks, resnet's basic
    blocks."""
    if name == "gpt":
        return list(module.blocks)
    return [b for s in range(1, module.n_stages + 1) for b in getattr(module, f"layer{s}")]


# -- the explorer's plans ---------------------------------------------------------------------
def plan_for(case: Case, graph: OpGraph, name: str, module: nn.Module) -> ex.Plan:
    """The plan of ``case`` on :data:`DEVICES` for ``graph``, captured from ``module``
    (built-in model ``name``)."""
    every = {i: 0 for i, n in enumerate(graph.nodes) if n.kind == "op"}
    case = NATIVE.get(case, case)
    if case == "data parallel":
        return ex.Plan.from_assignment(graph, [DEVICES], every)
    if case == "ZeRO-3":
        return ex.Plan.from_assignment(graph, [DEVICES], every).with_memory(zero=3)
    start = cut_in_two(name, module).back_starts_at
    stage, assign = 0, {}
    for i, n in enumerate(graph.nodes):
        if n.kind != "op":
            continue
        if n.module_path == start or n.module_path.startswith(start + "."):
            stage = 1
        assign[i] = stage
    return ex.Plan.from_assignment(graph, [DEVICES[:1], DEVICES[1:]], assign,
                                   micro_batches=MICRO_BATCHES, schedule="1f1b")


def chosen_runtime(runtime: RuntimeChoice) -> Literal["ops", "segments"]:
    """``runtime``, or for ``auto`` what ``ex.run`` takes unasked."""
    return choose_runtime(None if runtime == "auto" else runtime, False)


# -- same start on both sides -----------------------------------------------------------------
def start_fingerprint(params: Iterable[tuple[str, torch.Tensor]],
                      batch: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the parameters (sorted by name, each name, shape, dtype and bytes) and of the
    batch tensors in order."""
    h = hashlib.sha256()
    for nm, t in sorted(params, key=lambda kv: kv[0]):
        h.update(f"{nm}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    for t in batch:
        h.update(f"{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def graph_fingerprint(graph: OpGraph) -> str:
    """:func:`start_fingerprint` of what ``ex.run`` runs: the captured program's parameters
    (named as in the model, without the capture's ``model.`` prefix) and batch."""
    program = graph.runtime.program
    params = [(k.removeprefix("model."), program.state_dict[k])
              for k in program.graph_signature.parameters]
    return start_fingerprint(params, [*graph.runtime.inputs, *graph.runtime.targets])


def check_same_start(case: str, explorer_print: str, reference_print: str,
                     explorer_loss: float, reference_loss: float) -> float:
    """How far apart the first losses are (relative to the reference's, at least 1); raise
    :class:`NotSameWork` unless both sides start from the same weights and batch (equal
    fingerprints) and that is within :data:`LOSS_RTOL`."""
    if explorer_print != reference_print:
        raise NotSameWork(f"{case}: the reference's weights or batch differ from the captured "
                          "ones ex.run runs; the built-in model is no longer deterministic, "
                          "or the reference builds another one")
    gap = abs(explorer_loss - reference_loss) / max(1.0, abs(reference_loss))
    if not gap <= LOSS_RTOL:
        raise NotSameWork(f"{case}: first losses differ (explorer {explorer_loss!r}, reference "
                          f"{reference_loss!r}): the two sides do not compute the same step")
    return gap


# -- the reference, in rank processes of its own ----------------------------------------------
def reference_step(case: Case, name: str, size: str, optimizer: str, rank: int
                   ) -> tuple[Callable[[], float | None], str]:
    """One training step of ``case``'s reference on this rank (returning its loss, None on a
    pipeline rank without the loss) and the fingerprint of the model it started from."""
    bm = ex.builtin_model(name, size)
    module, loss_fn = bm.module, bm.loss_fn
    printed = start_fingerprint(module.named_parameters(), [*bm.example_inputs, *bm.targets])
    if case == "1F1B pipeline":
        cut = cut_in_two(name, module)
        part = cut.front if rank == 0 else cut.back
        schedule = Schedule1F1B(PipelineStage(part, rank, WORLD, torch.device("cpu")),
                                MICRO_BATCHES, loss_fn=loss_fn)
        opt = make_optimizer(optimizer, list(part.parameters()), LR)

        def pipelined() -> float | None:
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(*bm.example_inputs, return_outputs=False)
                loss = None
            else:
                losses: list[torch.Tensor] = []
                schedule.step(target=bm.targets[0], losses=losses, return_outputs=False)
                loss = sum(float(x) for x in losses) / len(losses)
            opt.step()
            return loss

        return pipelined, printed
    rows = bm.batch_size // WORLD
    half = [t[rank * rows:(rank + 1) * rows] for t in (*bm.example_inputs, *bm.targets)]
    inputs, targets = half[:len(bm.example_inputs)], half[len(bm.example_inputs):]
    if case == "ZeRO-3":
        for block in blocks_of(name, module):
            fully_shard(block)
        model = fully_shard(module)
    else:
        model = DistributedDataParallel(module, broadcast_buffers=False)
    opt = make_optimizer(optimizer, list(model.parameters()), LR)

    def replicated() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), *targets)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return replicated, printed


def reference_rank(case: Case, name: str, size: str, optimizer: str, total: int,
                   out: Path, timeout_s: float) -> NoReturn:
    """This process as reference rank ``RANK``: set up as a CPU rank is, join the gloo group,
    run ``total`` steps, write each step's seconds and loss to ``out``, and end (this does
    not return)."""
    rank = int(os.environ["RANK"])
    platform = platform_of("cpu")
    torch.set_num_threads(1)
    platform.pin_rank(int(os.environ["LOCAL_RANK"]), 1)
    platform.hold_freed_memory()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))
    step, printed = reference_step(case, name, size, optimizer, rank)
    times, losses = [], []
    for _ in range(total):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    out.write_text(json.dumps({"step_s": times, "losses": losses, "fingerprint": printed}))
    dist.barrier()
    dist.destroy_process_group()
    # the results are written: the process ends here, freeing nothing (freeing DDP's reducer
    # destroys its gloo group, which can wait for a worker thread that waits for the
    # interpreter lock, and the rank hangs at exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass(frozen=True)
class ReferenceRun:
    """What the reference's ranks measured: each measured step's slowest rank, the first
    step's loss (mean over the ranks that have one) and rank 0's start fingerprint."""

    step_samples_s: tuple[float, ...]
    first_loss: float
    fingerprint: str


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> int | None:
    """Wait for every process to end; the index of the first that failed (exited non-zero,
    or was still running after ``timeout_s``), or None. Returns at the first failure, so the
    caller ends the others rather than wait for them to time out in a collective."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad[0]
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            return codes.index(None)
        time.sleep(0.05)


def run_ranks(what: str, command_of: Callable[[int], list[str]], folder: Path,
              timeout_s: float) -> list[Path]:
    """``command_of(rank)`` (Python's arguments) on :data:`WORLD` fresh processes started as
    torchrun starts them; none outlives the call. Their logs, in ``folder``. A rank that
    fails, or runs past ``timeout_s``, raises :class:`ExplorerError` with its log's end."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1"}
    logs = [folder / f"log-{r}.txt" for r in range(WORLD)]
    procs = []
    try:
        for r in range(WORLD):
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, *command_of(r)],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=log, stderr=subprocess.STDOUT))
        failed = wait_all(procs, timeout_s)
    finally:
        for p in procs:  # a rank left waiting for a failed one, or past its time
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed is not None:
        raise ExplorerError(f"{what} rank {failed} "
                            + ("did not finish in time" if procs[failed].returncode is None
                               else f"exited with {procs[failed].returncode}")
                            + f":\n{logs[failed].read_text()[-3000:]}")
    return logs


def run_reference(case: Case, name: str, size: str, optimizer: str, steps: int,
                  warmup: int, timeout_s: float) -> ReferenceRun:
    """``case``'s reference on :data:`WORLD` fresh rank processes; none outlives the call."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank-{r}.json" for r in range(WORLD)]
        run_ranks(f"{case} reference",
                  lambda r: [__file__, "--reference-rank", case, name, size, optimizer,
                             str(warmup + steps), str(outs[r]), str(timeout_s)],
                  Path(tmp), timeout_s)
        got = [json.loads(o.read_text()) for o in outs]
    per_step = [max(g["step_s"][k] for g in got) for k in range(warmup, warmup + steps)]
    first = [g["losses"][0] for g in got if g["losses"][0] is not None]
    return ReferenceRun(tuple(per_step), sum(first) / len(first), got[0]["fingerprint"])


#: how a native script's rank starts here: set up as the reference's ranks and ``ex.run``'s
#: are (one thread, pinned to its core, freed memory held by the allocator: the CPU platform's
#: set-up), then the script, as ``python SCRIPT`` runs it
NATIVE_RANK = """\
import os, runpy, sys
import torch
from explorer.platforms import platform_of
torch.set_num_threads(1)
platform = platform_of("cpu")
platform.pin_rank(int(os.environ["LOCAL_RANK"]), 1)
platform.hold_freed_memory()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_native_script(plan: ex.Plan, graph: OpGraph, model: ex.models.BuiltinModel,
                      steps: int, warmup: int, timeout_s: float) -> ReferenceRun:
    """The plan's native script (``ex.export_script(..., native=True)``) on :data:`WORLD`
    fresh processes started as torchrun starts them, from the built-in model's factory: its
    printed step times (rank 0's, from the step's start to the end of its optimizer step and
    loss all-reduce) and first loss. Its weights are the factory's, as the captured ones are
    (the fingerprint is the graph's: only the first loss checks the start)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = ex.export_script(plan, Path(tmp) / "train.py", graph=graph, model=model,
                                  steps=warmup + steps, lr=LR, native=True)
        logs = run_ranks("native script", lambda r: ["-c", NATIVE_RANK, str(script)],
                         Path(tmp), timeout_s)
        lines = [line for line in logs[0].read_text().splitlines() if line.startswith("step ")]
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in lines]
    times = [float(line.rsplit(", ", 1)[1].split(" ms")[0]) / 1e3 for line in lines]
    return ReferenceRun(tuple(times[warmup:]), losses[0], graph_fingerprint(graph))


# -- the rows ---------------------------------------------------------------------------------
def measure(name: str, size: str, rounds: int, steps: int, warmup: int,
            runtime: RuntimeChoice, timeout_s: float = TIMEOUT_S,
            pool: RankPool | None = None) -> list[dict[str, object]]:
    """One row per case for built-in model ``name`` at ``size``: the explorer's and the
    reference's median step, interleaved over ``rounds``. ``ex.run`` runs on ``pool``'s rank
    processes where given (a quick run's), else on ranks started for each run."""
    bm = ex.builtin_model(name, size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    printed = graph_fingerprint(graph)
    plans = {case: plan_for(case, graph, name, bm.module) for case in CASES}
    got: dict[Case, dict[str, list[float]]] = {c: {"ex": [], "ref": []} for c in CASES}
    first_loss: dict[Case, float] = {}
    gap: dict[Case, float] = {}
    used: dict[Case, str] = {}
    for _ in range(rounds):
        for case in CASES:
            plan = plans[case]
            used[case] = chosen_runtime(runtime)
            m = ex.run(graph, plan=plan, steps=steps, warmup=warmup, progress=False,
                       runtime=used[case], timeout_s=timeout_s, pool=pool)
            ref = (run_native_script(plan, graph, bm, steps, warmup, timeout_s)
                   if case in NATIVE else
                   run_reference(case, name, size, plan.optimizer, steps, warmup, timeout_s))
            print(f"{name} {size} {case} ({used[case]}): explorer "
                  f"{statistics.median(m.step_samples_s) * 1e3:.1f} ms, reference "
                  f"{statistics.median(ref.step_samples_s) * 1e3:.1f} ms", file=sys.stderr)
            gap[case] = max(gap.get(case, 0.0), check_same_start(
                f"{name} {size} {case}", printed, ref.fingerprint, m.losses[0], ref.first_loss))
            got[case]["ex"] += m.step_samples_s
            got[case]["ref"] += ref.step_samples_s
            first_loss[case] = m.losses[0]
    rows = []
    for case in CASES:
        ex_s, ref_s = (statistics.median(got[case][k]) for k in ("ex", "ref"))
        ratio = round(ex_s / ref_s, 2)
        # (the native script: as fast as ex.run within the target, either way)
        met = (ratio <= TARGET[case] and (case not in NATIVE or 1 / ratio <= TARGET[case]))
        rows.append({"model": name, "size": size, "case": case, "reference": REFERENCE[case],
                     "runtime": used[case], "steps each": len(got[case]["ex"]),
                     "explorer ms": round(ex_s * 1e3, 2), "reference ms": round(ref_s * 1e3, 2),
                     "ratio": ratio, "target": TARGET[case],
                     "met": "yes" if met else "no",
                     "first loss": round(first_loss[case], 5),
                     "loss gap": f"{gap[case]:.0e}"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sizes", default="default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runtime", choices=["auto", "ops", "segments"], default="auto",
                    help="ex.run's runtime (auto: what ex.run takes unasked, the segments)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: small size, 1 round, 2 steps after 1 warm-up step")
    ap.add_argument("--timeout-s", type=float, default=TIMEOUT_S,
                    help="seconds one run of either side may take")
    ap.add_argument("--reference-rank", nargs=7, help=argparse.SUPPRESS,
                    metavar=("CASE", "MODEL", "SIZE", "OPTIMIZER", "STEPS", "OUT", "TIMEOUT"))
    add_results_option(ap)
    args = ap.parse_args()
    if args.reference_rank:
        case, name, size, optimizer, total, out, timeout_s = args.reference_rank
        reference_rank(case, name, size, optimizer, int(total), Path(out), float(timeout_s))
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not one of {', '.join(MODELS)}")
    sizes, rounds, steps, warmup = ((["small"], 1, 2, 1) if args.quick else
                                    (args.sizes.split(","), args.rounds, args.steps, WARMUP))
    with dry_run_ranks(args.quick) as pool:
        rows = [row for size in sizes for name in models
                for row in measure(name, size, rounds, steps, warmup, args.runtime,
                                   args.timeout_s, pool)]
    title = (f"Two CPU ranks (gloo, one thread each): ex.run's data-parallel, 1F1B and ZeRO-3 "
             f"plans against DDP, Schedule1F1B and FSDP2, and against the plans' own native "
             f"scripts ({rounds} interleaved rounds of {steps} steps each way; median step)")
    print(title)
    print(table(list(rows[0]), [list(r.values()) for r in rows]))
    write_result("native_dist", rows, title=title, folder=args.results,
                 notes=f"{load_average()} at the end; first losses of both sides agree")


if __name__ == "__main__":
    main()
