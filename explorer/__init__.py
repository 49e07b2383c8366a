"""Partition Explorer: plan how a PyTorch model's training step is split across devices.

    import explorer as ex
    graph = ex.capture(model, example_inputs, loss_fn=..., targets=...)
    cluster = ex.Cluster.cpu(2)            # or Cluster.discover(), Cluster.preset("4xH100")
    costs = ex.profile(graph, cluster)
    plan = ex.partition(graph, cluster, costs, "even-layers")
    pred = ex.simulate(graph, plan, costs)
"""

from explorer.analysis import Report, calibrate, compare
from explorer.capture import capture
from explorer.core import (
    CaptureError,
    CaptureTimeout,
    ExplorerError,
    InputMismatchError,
    MemoryExceededError,
    OpGraph,
    OpNode,
    Plan,
    PlanError,
    StageSettings,
    UnknownNameError,
)
from explorer.costs import CostModel
from explorer.devices import Cluster, Device, Link
from explorer.models import build as builtin_model
from explorer.models import model_names
from explorer.partition import algorithm, algorithms, partition
from explorer.profiling import profile
from explorer.runtime import Measurement, RunFailed, export_script, reference, run
from explorer.simulate import Prediction, simulate

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CaptureTimeout",
    "Cluster",
    "CostModel",
    "Device",
    "ExplorerError",
    "InputMismatchError",
    "Link",
    "Measurement",
    "MemoryExceededError",
    "OpGraph",
    "OpNode",
    "Plan",
    "PlanError",
    "Prediction",
    "Report",
    "RunFailed",
    "StageSettings",
    "UnknownNameError",
    "algorithm",
    "algorithms",
    "builtin_model",
    "calibrate",
    "capture",
    "compare",
    "export_script",
    "model_names",
    "partition",
    "profile",
    "reference",
    "run",
    "simulate",
]
