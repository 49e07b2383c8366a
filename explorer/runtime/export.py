"""Export a plan as a training script that runs under ``torchrun``, with the data it reads.

The script is a fixed launcher: its text is the same for every plan (only the process count in
its usage note changes, written as a number). Everything about the model and the plan is data
in the job folder beside it: the exported program (``torch.export``), the plan JSON, the task
order and the example batch. At run time the plan is read back through ``Plan.load``, so it is
checked like any other plan file, and the same code as ``ex.run`` runs it. Nothing a plan
holds is ever pasted into the script as code. Edit its ``batches`` function to feed real data.

With a model source (the user's ``"module:function"`` factory, or the built-in model a plan
records) the job folder holds no weights: every rank calls the source to build the model and
takes the tensors it holds. That is how a plan for a graph captured on fake tensors (a model
larger than the machine that planned it) is exported; its example batch is then a placeholder
of the captured shapes (zeros for integer tensors, noise for floating point ones).
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from explorer.capture.tracing import captured_graph, step_program
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan, check_no_context
from explorer.core.plan_layout import plan_placements
from explorer.costs.model import CostModel
from explorer.costs.strategies import recompute_units, rerun_ops, saved_across_units
from explorer.runtime.jobfiles import (
    Job,
    Runtime,
    job_problem,
    program_parts,
    write_job,
)
from explorer.runtime.modelsource import model_source
from explorer.runtime.native_script import model_on_meta, native_plan, write_native_script
from explorer.runtime.segments import choose_runtime
from explorer.runtime.tensor_parallel import check_supported
from explorer.runtime.worker import main as worker_main
from explorer.simulate.simulator import execution_order, simulate

SCRIPT = '''#!/usr/bin/env python
"""Train a model under a partition plan: one process per device, %(n)d in all.

Written by `explorer export`.

Launch on one machine:
    torchrun --standalone --nproc_per_node %(n)d THIS_SCRIPT.py
On a cluster, e.g. two nodes of %(half)d processes each:
    torchrun --nnodes 2 --nproc_per_node %(half)d --rdzv-backend c10d \\\\
        --rdzv-endpoint HOST:29500 THIS_SCRIPT.py

Options: --steps N, --warmup N, --lr X, --runtime ops|segments, --compile (or
--no-compile: the segments through torch.compile or not); defaults: the job folder's job.json.
The model, the plan and the task order are data in the folder beside this script named after
it with `_job` added (plan.json is the plan); they are read and checked when it starts: a
plan.json other than the one program.pt was exported for, or a job.json value out of range,
is refused. Nothing here needs editing except `batches`, which feeds each step's data. A rank
that fails says why on stderr.

THE JOB FOLDER IS CODE, NOT DATA: program.pt and batch.pt are pickles, read with
torch.load(weights_only=False), and loading a pickle can run any code in it (as can a model
factory that plan.json names). A job folder is as dangerous as a script: run only one you
exported yourself, or trust like any other program.
"""

import sys
from pathlib import Path

from explorer.runtime.export import launch

HERE = Path(__file__).resolve()
JOB = HERE.with_name(HERE.stem + "_job")


def batches(step):
    """Inputs and targets for a step, as lists of tensors (batch first), or None to reuse the
    example batch the plan was made with. Every rank must return the same batch."""
    return None


if __name__ == "__main__":
    sys.exit(launch(JOB, sys.argv[1:], batches))
'''


#: the time limit of an exported job's collectives (torch.distributed's time-out), seconds
JOB_TIMEOUT_S = 1800.0


def script_text(n_processes: int) -> str:
    """The launcher's text: fixed, but for the process count (a number) in its usage note."""
    n = int(n_processes)
    return SCRIPT % {"n": n, "half": max(n // 2, 1)}


def launch(job: Path, argv: list[str], batches: Any = None) -> int:
    """What an exported script runs: say which plan (from the job's checked plan.json), then
    run this rank's share of it."""
    try:
        plan = Plan.load(Path(job) / "plan.json")
    except ExplorerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(f"plan {plan.algorithm} for graph {plan.graph_name or plan.graph_fingerprint} "
              f"on {len(plan.devices)} devices ({', '.join(plan.devices)})", flush=True)
    return worker_main([str(job), *argv], batches=batches, verbose=True,
                       on_fail=report_failure)


def report_failure(rank: int, exc: BaseException) -> None:
    """What a rank of an exported script does as it fails: say why on stderr (torchrun shows
    each rank's stderr; ``error-RANK.txt`` in the job folder has it too) and in torchrun's
    error file, so its ``ChildFailedError`` summary names the cause."""
    if isinstance(exc, ExplorerError):
        text = f"error: rank {rank}: {exc}"
    else:
        kind = "out of memory" if isinstance(exc, MemoryError) else type(exc).__name__
        tail = "".join(traceback.format_exception(exc)[-6:])
        text = f"error: rank {rank} failed: {kind}: {exc}\n{tail}"
    print(text, file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def export_script(plan: Plan, path: str | Path, graph: OpGraph | None = None,
                  costs: CostModel | None = None, steps: int = 10, warmup: int = 2,
                  lr: float = 1e-3, overwrite: bool = False, factory: str | None = None,
                  runtime: Runtime | None = None, compile: bool = False, native: bool = False,
                  model: Any = None) -> Path:
    """Write ``path`` (a torchrun script) and its data folder ``<stem>_job/`` beside it.

    ``native=True`` writes instead one PyTorch script a person can read and keep, with no
    job folder and no explorer runtime: the model built from its source, a ``DeviceMesh``,
    ``DistributedDataParallel`` / ``fully_shard`` / ``torch.utils.checkpoint`` / autocast as
    the plan says (:mod:`explorer.runtime.native_script`; a plan they cannot express is
    refused, saying what stops it). Its model source is the plan's, ``factory``, or
    ``model``: the built-in model (``ex.builtin_model(...)``) the plan was made for.

    ``graph`` defaults to the graph this plan was made for, if it was captured in this
    process. With ``costs`` the ranks follow that cost model's simulated schedule. An existing
    script or job folder is refused unless ``overwrite``.

    ``factory`` (``"module:function"``, else the plan's or the graph's) names the user's
    function that builds the model: it is recorded in the job's plan, and the ranks call it
    instead of reading weights from the job folder. A plan for a built-in model is rebuilt
    from :mod:`explorer.models` the same way. Either is needed for a graph captured on fake
    tensors.

    ``runtime`` and ``compile`` are how the ranks run their ops, as in ``ex.run``: as
    segments unless ``runtime="ops"`` asks for one at a time, with
    ``compile=True`` running the segments through ``torch.compile``. The script's
    ``--runtime`` and ``--compile`` / ``--no-compile`` override them.
    """
    runtime = choose_runtime(runtime, compile)
    graph = graph or captured_graph(plan.graph_fingerprint)
    if graph is None:
        raise ExplorerError("export needs the captured model this plan was made for: pass "
                            "graph=ex.capture(model, example_inputs, ...)")
    if model is not None:
        plan = replace(plan, model=model.record)
    if native:
        if compile:
            raise ExplorerError("compile=True is the explorer runtime's; a native script runs "
                                "plain PyTorch: export without native to compile segments")
        return _export_native(plan, path, graph, costs, steps, lr, overwrite, factory)
    program = step_program(graph)
    if graph.source != "export" or program is None:
        raise ExplorerError("export needs a graph captured with torch.export; this one came "
                            f"from {graph.source}")
    source = model_source(plan, graph, factory)
    if graph.runtime is None and not source:
        raise ExplorerError("this graph was captured without running the model (fake "
                            "tensors), so there are no weights to export: name the function "
                            "that builds it, ex.export_script(..., factory=\"module:function\") "
                            "or ex.capture(..., factory=...)")
    if "factory" in source:
        plan = replace(plan, model=source)
    plan.validate(graph)
    check_no_context(plan)
    plan.check_batch(graph.batch_size)
    check_supported(graph, plan)
    path = Path(path)
    if path.suffix != ".py":
        raise ExplorerError(f"the script name should end in .py, not {path.name!r}")
    if not path.parent.is_dir():
        raise ExplorerError(f"folder {path.parent} does not exist")
    job = path.with_name(f"{path.stem}_job")
    if not overwrite:
        for p in (path, job):
            if p.exists() or p.is_symlink():
                raise ExplorerError(f"{p} already exists; choose another name or overwrite it "
                                    "(overwrite=True, or --force on the command line)")
    cluster = costs.cluster if costs is not None else None
    kinds = {}
    for d in plan.devices:
        dev = cluster.device(d) if cluster is not None and d in cluster.ids else None
        gpu = (dev.kind == "cuda") if dev is not None else not d.startswith("cpu")
        kinds[d] = "cuda" if gpu else "cpu"
    order = execution_order(graph, plan, costs)
    rt = graph.runtime
    inputs, targets = (rt.inputs, rt.targets) if rt is not None else placeholder_batch(graph)
    calls, state = program_parts(program, len(inputs), source)
    placements, split_ops, local_ops, sequence_ops = plan_placements(graph, plan)
    record = Job(
        calls=calls, state=state, plan=plan, schedule=order, inputs=list(inputs),
        targets=list(targets), steps=int(steps), warmup=int(warmup), lr=float(lr),
        record=False, timeout_s=JOB_TIMEOUT_S, device_map=kinds,
        requires_grad=[n.requires_grad for n in graph.nodes], loss=graph.loss, seed=0,
        model=source, units=recompute_units(graph),
        kept_outputs=saved_across_units(graph).tolist(), reruns=rerun_ops(graph, plan),
        backward_scratch=[n.backward_scratch_bytes for n in graph.nodes], placements=placements,
        split_ops=split_ops, local_ops=local_ops, sequence_ops=sequence_ops,
        runtime=runtime, compile=compile)
    problem = job_problem(record)  # before anything is written
    if problem:
        raise ExplorerError(f"cannot export this job: {problem}")
    try:
        write_job(job, record)
        path.write_text(script_text(len(plan.devices)))
        path.chmod(0o755)
    except (OSError, ExplorerError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ExplorerError(f"cannot write {path} and {job.name}/: {why}; choose a folder "
                            "you can write to") from exc
    return path


def _export_native(plan: Plan, path: str | Path, graph: OpGraph, costs: CostModel | None,
                   steps: int, lr: float, overwrite: bool, factory: str | None) -> Path:
    """``export_script(..., native=True)``: the plan as a PyTorch script, its prediction
    (with ``costs``) in its header."""
    plan.validate(graph)
    check_no_context(plan)
    plan.check_batch(graph.batch_size)
    source = model_source(plan, graph, factory)
    native = native_plan(graph, plan, source, model_on_meta(source) if source else None)
    if costs is not None:
        predicted = simulate(graph, plan, costs)
        native = replace(native, predicted_step_s=predicted.step_s,
                         predicted_peak_bytes=max(predicted.peak_bytes.values()))
    try:
        return write_native_script(native, path, steps=steps, lr=lr, overwrite=overwrite)
    except OSError as exc:
        raise ExplorerError(f"cannot write {path}: {exc.strerror or exc}; choose a folder "
                            "you can write to") from exc


def placeholder_batch(graph: OpGraph) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inputs and targets of the graph's shapes and dtypes: zeros for integer tensors (valid
    token ids and class labels), seeded noise for floating point ones."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[torch.Tensor]] = {"input": [], "target": []}
    for n in graph.nodes:
        if n.kind != "input":
            continue
        dtype = getattr(torch, n.dtype)
        shape = n.shapes[0]
        t = (torch.randn(shape, generator=gen).to(dtype) if dtype.is_floating_point
             else torch.zeros(shape, dtype=dtype))
        out["target" if n.name.startswith("target_") else "input"].append(t)
    return out["input"], out["target"]
