"""Export a plan as a training script that runs under ``torchrun``, with the data it reads.

The script is a fixed launcher: its text is the same for every plan (only the process count in
its usage note changes, written as a number). Everything about the model and the plan is data
in the job folder beside it: the exported program (``torch.export``), the plan JSON, the task
order and the example batch. At run time the plan is read back through ``Plan.load``, so it is
checked like any other plan file, and the same code as ``ex.run`` runs it. Nothing a plan
holds is ever pasted into the script as code. Edit its ``batches`` function to feed real data.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from explorer.capture.tracing import captured_graph
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.tensor_layout import plan_placements
from explorer.costs.model import CostModel
from explorer.runtime.jobfiles import write_job
from explorer.runtime.tensor_parallel import check_supported
from explorer.runtime.worker import main as worker_main
from explorer.simulate.simulator import execution_order

SCRIPT = '''#!/usr/bin/env python
"""Train a model under a partition plan: one process per device, %(n)d in all.

Written by `explorer export`.

Launch on one machine:
    torchrun --standalone --nproc_per_node %(n)d THIS_SCRIPT.py
On a cluster, e.g. two nodes of %(half)d processes each:
    torchrun --nnodes 2 --nproc_per_node %(half)d --rdzv-backend c10d \\\\
        --rdzv-endpoint HOST:29500 THIS_SCRIPT.py

Options: --steps N, --warmup N, --lr X (defaults: the job folder's job.json).
The model, the plan and the task order are data in the folder beside this script named after
it with `_job` added (plan.json is the plan); they are read and checked when it starts. Nothing
here needs editing except `batches`, which feeds each step's data.
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
    return worker_main([str(job), *argv], batches=batches, verbose=True)


def export_script(plan: Plan, path: str | Path, graph: OpGraph | None = None,
                  costs: CostModel | None = None, steps: int = 10, warmup: int = 2,
                  lr: float = 1e-3, overwrite: bool = False) -> Path:
    """Write ``path`` (a torchrun script) and its data folder ``<stem>_job/`` beside it.

    ``graph`` defaults to the graph this plan was made for, if it was captured in this
    process. With ``costs`` the ranks follow that cost model's simulated schedule. An existing
    script or job folder is refused unless ``overwrite``.
    """
    graph = graph or captured_graph(plan.graph_fingerprint)
    if graph is None:
        raise ExplorerError("export needs the captured model this plan was made for: pass "
                            "graph=ex.capture(model, example_inputs, ...)")
    if graph.runtime is None or graph.runtime.program is None:
        raise ExplorerError("export needs a graph captured with torch.export; this one came "
                            f"from {graph.source}")
    plan.validate(graph)
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
    try:
        write_job(job, rt.program, plan, order, rt.inputs, rt.targets, int(steps), int(warmup),
                  float(lr), False, 1800.0, kinds, [n.requires_grad for n in graph.nodes],
                  graph.loss, layout=plan_placements(graph, plan))
        path.write_text(script_text(len(plan.devices)))
        path.chmod(0o755)
    except (OSError, ExplorerError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ExplorerError(f"cannot write {path} and {job.name}/: {why}; choose a folder "
                            "you can write to") from exc
    return path
