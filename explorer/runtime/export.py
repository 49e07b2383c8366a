"""Export a plan as a training script that runs under ``torchrun``, with the data it reads.

The script is a short, fixed launcher; everything about the model and the plan is data next to
it: the exported program (``torch.export``), the plan JSON, the task order and the example
batch. It runs the same code as ``ex.run``, so a plan that runs in the notebook runs on a
cluster. Edit its ``batches`` function to feed real data.
"""

from __future__ import annotations

from pathlib import Path

from explorer.capture.tracing import captured_graph
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.runtime.jobfiles import write_job
from explorer.simulate.simulator import execution_order

SCRIPT = '''#!/usr/bin/env python
"""Train {name} under plan "{algorithm}" on {n} devices ({devices}).

Launch on one machine:
    torchrun --standalone --nproc_per_node {n} {script}
On a cluster ({n} processes in all), e.g. two nodes:
    torchrun --nnodes 2 --nproc_per_node {half} --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 {script}

Options: --steps N (default {steps}), --warmup N (default {warmup}), --lr X (default {lr}).
The model, the plan and the task order are data in {job}/ (plan.json is the plan); nothing
here needs editing except `batches`, which feeds each step's data.
"""

import sys
from pathlib import Path

from explorer.runtime.worker import main

JOB = Path(__file__).resolve().with_name("{job}")


def batches(step):
    """Inputs and targets for a step, as lists of tensors (batch first), or None to reuse the
    example batch the plan was made with. Every rank must return the same batch."""
    return None


if __name__ == "__main__":
    sys.exit(main([str(JOB), *sys.argv[1:]], batches=batches, verbose=True))
'''


def export_script(plan: Plan, path: str | Path, graph: OpGraph | None = None,
                  costs: CostModel | None = None, steps: int = 10, warmup: int = 2,
                  lr: float = 1e-3) -> Path:
    """Write ``path`` (a torchrun script) and its data folder ``<stem>_job/`` beside it.

    ``graph`` defaults to the graph this plan was made for, if it was captured in this
    process. With ``costs`` the ranks follow that cost model's simulated schedule.
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
    path = Path(path)
    if path.suffix != ".py":
        raise ExplorerError(f"the script name should end in .py, not {path.name!r}")
    if not path.parent.is_dir():
        raise ExplorerError(f"folder {path.parent} does not exist")
    job = path.with_name(f"{path.stem}_job")
    cluster = costs.cluster if costs is not None else None
    kinds = {}
    for d in plan.devices:
        dev = cluster.device(d) if cluster is not None and d in cluster.ids else None
        gpu = (dev.kind == "cuda") if dev is not None else not d.startswith("cpu")
        kinds[d] = "cuda" if gpu else "cpu"
    order = execution_order(graph, plan, costs)
    rt = graph.runtime
    write_job(job, rt.program, plan, order, rt.inputs, rt.targets, steps, warmup, lr, False,
              1800.0, kinds, [n.requires_grad for n in graph.nodes], graph.loss)
    n = len(plan.devices)
    path.write_text(SCRIPT.format(
        name=graph.name, algorithm=plan.algorithm, n=n, devices=", ".join(plan.devices),
        script=path.name, half=max(n // 2, 1), steps=steps, warmup=warmup, lr=lr,
        job=job.name))
    path.chmod(0o755)
    return path
