"""Real training steps under a plan: launch one process per device, gather what they measured.

The launcher starts ``python -m explorer.runtime.rank JOB`` once per device with the environment
torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), each in its own
process group, watches them (:mod:`explorer.runtime.watch`), and ends every one of them on
failure, time-out or interrupt, so no process outlives a run. A failed rank becomes an
:class:`RunFailed` naming the rank, its device and the cause; the caller (a notebook kernel)
keeps running. Many short runs in a row (the profiler's) can share rank processes started once
instead (:class:`explorer.runtime.pool.RankPool`).
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from explorer.capture.step import copies
from explorer.capture.tracing import TrainStep, batch_splits, capture
from explorer.core.errors import ExplorerError, MemoryExceededError, PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.plan_layout import plan_placements
from explorer.costs.model import CostModel
from explorer.costs.strategies import recompute_units, rerun_ops, saved_across_units
from explorer.platforms.net import free_port
from explorer.runtime.folders import job_folder, space_errors
from explorer.runtime.jobfiles import Job, Runtime, program_parts, write_job
from explorer.runtime.params import make_optimizer
from explorer.runtime.pool import RankPool
from explorer.runtime.segments import choose_runtime
from explorer.runtime.tensor_parallel import check_async_tensor, check_supported
from explorer.runtime.watch import rank_env, read_results, start_rank, stop, watch
from explorer.simulate.simulator import execution_order, simulate, unit_costs


@dataclass(frozen=True)
class Measurement:
    """What real steps measured. ``step_s`` is the median over the measured steps of the
    slowest rank's step time; per-device figures are medians too."""

    step_s: float
    step_samples_s: tuple[float, ...]
    busy_s: dict[str, float]
    peak_bytes: dict[str, int]
    memory_source: str
    losses: tuple[float, ...]
    energy_j: float | None
    energy_by_device_j: dict[str, float] | None
    algorithm: str
    steps: int
    warmup: int
    task_s: dict[str, float] = field(default_factory=dict, repr=False)
    #: per device, its busy time in each measured step (``busy_s`` is their median)
    busy_samples_s: dict[str, tuple[float, ...]] = field(default_factory=dict, repr=False)
    grads: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    #: per CPU rank, the cores it was pinned to (:meth:`explorer.platforms.Platform.pin_rank`);
    #: None where it was not pinned
    cores: dict[str, tuple[int, ...] | None] = field(default_factory=dict, repr=False)
    #: per rank, whether its process kept the memory it freed for the next step
    #: (:meth:`explorer.platforms.Platform.hold_freed_memory`)
    memory_held: dict[str, bool] = field(default_factory=dict, repr=False)
    #: the seed random ops (dropout) drew from: the same seed gives the same losses
    seed: int = 0
    #: how the ranks ran their ops: as generated segments ("segments") or one at a time
    #: ("ops")
    runtime: Runtime = "segments"
    #: whether the segments ran through ``torch.compile`` (``compile=True``)
    compiled: bool = False
    #: per CPU rank, the bytes of each memory category (parameters, gradients, optimizer
    #: state, activations, gathered, buffers) held at its peak; empty for GPU ranks
    peak_by_category: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    plan: Plan | None = field(default=None, repr=False, compare=False)
    graph: OpGraph | None = field(default=None, repr=False, compare=False)


def device_map(plan: Plan, cluster: Any = None) -> dict[str, str]:
    """The torch device of every device in the plan; devices not on this machine are refused."""
    out = {}
    absent = []
    for d in plan.devices:
        dev = None
        if cluster is not None and d in cluster.ids:
            dev = cluster.device(d)
        if dev is not None and dev.present:
            out[d] = dev.torch_device or "cpu"
        elif dev is None and d.startswith("cpu:"):
            out[d] = "cpu"
        elif dev is None and d.startswith("cuda:") and torch.cuda.is_available():
            out[d] = d
        else:
            absent.append(d)
    if absent:
        raise PlanError(f"the plan uses {', '.join(absent)}, which this machine does not have; "
                        "to run for real, plan for Cluster.cpu(n) or Cluster.discover(), or "
                        "export the plan and launch it where those devices are")
    if any(v.startswith("cuda") for v in out.values()) and any(v == "cpu" for v in out.values()):
        raise PlanError("a real run uses either GPUs (NCCL) or CPU ranks (gloo), not both")
    return out


def run(model: Any, example_inputs: Any = None, plan: Plan | None = None, steps: int = 5,
        warmup: int = 2, loss_fn: Any = None, targets: Any = None, costs: CostModel | None = None,
        cluster: Any = None, lr: float = 1e-3, force: bool = False, timeout_s: float = 600.0,
        progress: bool = True, record: bool = False, keep: str | Path | None = None,
        device_override: dict[str, str] | None = None, seed: int = 0,
        pool: RankPool | None = None, runtime: Runtime | None = None,
        compile: bool = False) -> Measurement:
    """Run ``steps`` real training steps (after ``warmup``) of the model under ``plan``.

    ``model`` is an ``nn.Module`` (captured with ``example_inputs``, ``loss_fn``, ``targets``)
    or an already captured :class:`OpGraph`. With ``costs`` the ranks follow the simulated
    schedule of that cost model (and ``cluster`` defaults to its cluster); without, the schedule
    is simulated with unit costs. A plan predicted not to fit in memory needs ``force=True``.
    ``record=True`` keeps the gradients of the first step (for checking against one device).
    The plan's memory settings (:meth:`Plan.with_memory`) run as they say: ZeRO 1-3 over a
    stage's replicas (:mod:`explorer.runtime.sharding`), recomputation
    (:mod:`explorer.runtime.recompute`), bf16/fp16 autocast with fp32 weights; on CPU ranks
    the peak is also told apart by category (``peak_by_category``).
    Random ops (dropout) draw from ``seed``: the same seed gives the same losses, and what
    they draw depends on the rows and the op, not on the plan
    (:func:`explorer.runtime.stage.draw_seed`). With ``pool`` the steps run on its rank
    processes (started once for many runs) rather than on processes started for this run.
    Each rank runs its consecutive ops as generated segments with one backward each
    (:mod:`explorer.runtime.segments`), the work eager PyTorch does; ``runtime="ops"`` runs
    them one at a time instead (as the profiler times them). ``compile=True`` runs each
    segment's code through ``torch.compile`` (inductor, :mod:`explorer.runtime.
    segment_compile`): the segments only, compiled on the first (warm-up) step, seeded random
    ops drawing what they draw eagerly.
    """
    if plan is None:
        raise ExplorerError("run needs a plan: ex.run(model, example_inputs, plan)")
    graph = model if isinstance(model, OpGraph) else capture(model, example_inputs, loss_fn,
                                                             targets)
    if graph.source != "export" or graph.runtime is None or graph.runtime.program is None:
        raise ExplorerError("real runs need a graph captured with torch.export; this one came "
                            f"from {graph.source}: {'; '.join(graph.notes)}")
    if steps < 1 or warmup < 0:
        raise ExplorerError("steps must be >= 1 and warmup >= 0")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ExplorerError(f"seed must be a whole number >= 0, not {seed!r}")
    cluster = cluster if cluster is not None else (costs.cluster if costs else None)
    plan.validate(graph)
    check_supported(graph, plan)
    runtime = choose_runtime(runtime, compile)
    try:
        plan.check_runnable(graph.batch_size, batch_splits(graph))
    except PlanError as e:
        raise PlanError("; ".join([str(e), *graph.notes[:1]])) from None
    check_async_tensor(plan, cluster)
    dmap = device_override or device_map(plan, cluster)
    scored = costs if costs is not None else unit_costs(graph, plan)
    if cluster is not None and costs is not None and not force:
        pred = simulate(graph, plan, costs)
        if not pred.fits:
            raise MemoryExceededError(
                f"the prediction says this plan does not fit: {pred.memory_report()}; "
                "run it anyway with force=True, or choose a plan that fits")
    schedule = execution_order(graph, plan, scored)
    rt = graph.runtime
    with contextlib.ExitStack() as stack:
        folder = job_folder(stack) if keep is None else Path(keep)
        stack.enter_context(space_errors(folder))  # a full folder said so, not torch's error
        calls, state = program_parts(rt.program, len(rt.inputs))
        placements, split_ops, local_ops, sequence_ops = plan_placements(graph, plan)
        write_job(folder, Job(
            calls=calls, state=state, plan=plan, schedule=schedule, inputs=list(rt.inputs),
            targets=list(rt.targets), steps=steps, warmup=warmup, lr=lr, record=record,
            timeout_s=timeout_s, device_map=dmap,
            requires_grad=[n.requires_grad for n in graph.nodes], loss=graph.loss, seed=seed,
            units=recompute_units(graph), kept_outputs=saved_across_units(graph).tolist(),
            reruns=rerun_ops(graph, plan),
            backward_scratch=[n.backward_scratch_bytes for n in graph.nodes],
            placements=placements, split_ops=split_ops, local_ops=local_ops,
            sequence_ops=sequence_ops, runtime=runtime, compile=compile))
        results, grads = launch(folder, len(plan.devices), warmup + steps, timeout_s, progress,
                                plan, pool)
    return replace(_measurement(results, grads, plan, graph, steps, warmup), seed=seed,
                   runtime=runtime, compiled=compile)


def launch(folder: Path, world: int, total_steps: int, timeout_s: float, progress: bool,
           plan: Plan, pool: RankPool | None = None
           ) -> tuple[list[dict], dict[str, torch.Tensor] | None]:
    """Run the job in ``folder`` on ``world`` ranks and wait for them; never leave one. The
    ranks are processes started for this run, or those of ``pool``."""
    if pool is not None:
        return pool.run(folder, world, total_steps, timeout_s, progress, plan)
    env = rank_env(world, free_port())
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as logs:
        try:
            for r in range(world):
                log = logs.enter_context(open(folder / f"log-{r}.txt", "w"))
                procs.append(start_rank([str(folder)], r, env, log))
            watch(folder, procs, plan, total_steps, timeout_s, progress)
        finally:
            stop(procs)
    return read_results(folder, world)


def _energy_per_step(measured: list[dict]) -> float | None:
    """Joules per step from the energy counter read before the first measured step and after
    the last: NVML's counter advances in coarse ticks, so a short step read on its own often
    reads zero. None where there is no counter, or it did not advance over the whole window
    (too few or too short steps to see a tick)."""
    marks = [s.get("energy_counter_j") for s in measured]
    if not marks or any(mk is None or None in mk for mk in marks):
        return None
    total = marks[-1][1] - marks[0][0]
    return total / len(measured) if total > 0 else None


def _measurement(results: list[dict], grads, plan: Plan, graph: OpGraph, steps: int,
                 warmup: int) -> Measurement:
    measured = [[s for s in r["steps"] if s["measured"]] for r in results]
    per_step = [max(m[k]["step_s"] for m in measured) for k in range(steps)]
    busy = {r["device"]: statistics.median(s["busy_s"] for s in m)
            for r, m in zip(results, measured, strict=True)}
    # (a CPU rank reports its peak from one step only, maybe a warm-up step: Job.memory_step)
    counted = [[s for s in r["steps"] if s["peak_bytes"] is not None
                and (s["measured"] or s.get("memory_step"))] for r in results]
    peak = {r["device"]: max(s["peak_bytes"] for s in c)
            for r, c in zip(results, counted, strict=True)}
    losses = []
    for k in range(warmup + steps):
        vals = [r["steps"][k]["loss"] for r in results if r["steps"][k]["loss"] is not None]
        losses.append(sum(vals) / len(vals) if vals else float("nan"))
    energies = {r["device"]: e for r, m in zip(results, measured, strict=True)
                if (e := _energy_per_step(m)) is not None}
    return Measurement(
        step_s=statistics.median(per_step), step_samples_s=tuple(per_step), busy_s=busy,
        peak_bytes=peak, memory_source=results[0]["memory_source"], losses=tuple(losses),
        energy_j=sum(energies.values()) if len(energies) == len(results) else None,
        energy_by_device_j=energies if len(energies) == len(results) else None,
        algorithm=plan.algorithm, steps=steps, warmup=warmup,
        task_s={k: v for r in results for k, v in r.get("task_s", {}).items()},
        busy_samples_s={r["device"]: tuple(s["busy_s"] for s in m)
                        for r, m in zip(results, measured, strict=True)},
        grads=grads,
        cores={r["device"]: tuple(r["cores"]) if r.get("cores") else None for r in results},
        memory_held={r["device"]: bool(r.get("held")) for r in results},
        peak_by_category={r["device"]: max(c, key=lambda s: s["peak_bytes"])["peak_by_category"]
                          for r, c in zip(results, counted, strict=True)
                          if c[0].get("peak_by_category") is not None},
        plan=plan,
        graph=graph)


@dataclass(frozen=True)
class Reference:
    """Plain PyTorch training on one device: the loss of every step, the first step's grads."""

    losses: tuple[float, ...]
    grads: dict[str, torch.Tensor]


def reference(model: Any, steps: int, shards: int = 1, optimizer: str = "adam",
              lr: float = 1e-3, example_inputs: Any = None, targets: Any = None,
              loss_fn: Any = None) -> Reference:
    """Train ``model`` for ``steps`` on one device in eager PyTorch, as a check on real runs.

    The batch is cut into ``shards`` equal slices along dim 0 and the step's loss and gradients
    are the mean over slices: what a plan with that many replicas x micro-batches computes.
    (For models without batch statistics this equals the whole batch at once.) ``model`` may
    be a built-in model from ``ex.builtin_model``, which carries its batch and loss.
    """
    if hasattr(model, "module") and hasattr(model, "example_inputs"):
        module, example_inputs = model.module, model.example_inputs
        targets, loss_fn = model.targets, model.loss_fn
    else:
        module = model
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    tgts = tuple(targets) if isinstance(targets, (tuple, list)) else \
        ((targets,) if targets is not None else ())
    step = TrainStep(module, loss_fn, len(inputs)).train()
    params = list(module.parameters())
    opt = make_optimizer(optimizer, params, lr)
    rows = inputs[0].shape[0] // shards
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(shards):
            sl = slice(k * rows, (k + 1) * rows)
            # fresh copies: a model that changes its inputs in place leaves the caller's alone
            loss = step(*copies(tuple(t[sl] for t in (*inputs, *tgts)))) / shards
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        if first is None:
            first = {n: p.grad.detach().clone() for n, p in module.named_parameters()
                     if p.grad is not None}
        opt.step()
    return Reference(tuple(losses), first or {})
