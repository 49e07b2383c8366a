"""Core types every stage of the flow shares: the op graph, the plan, errors and units."""

from explorer.core.errors import (
    CaptureError,
    CaptureTimeout,
    ExplorerError,
    InputMismatchError,
    MemoryExceededError,
    PlanError,
    UnknownNameError,
)
from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import OPTIMIZER_STATE, Plan, StageSettings

__all__ = ["OPTIMIZER_STATE", "CaptureError", "CaptureTimeout", "ExplorerError",
           "InputMismatchError", "MemoryExceededError", "OpGraph", "OpNode", "Plan", "PlanError",
           "StageSettings", "UnknownNameError"]
