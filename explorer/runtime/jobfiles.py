"""A job folder: everything a rank reads to run its part of a plan, written once per run.

The folder holds ``program.pt`` (the ops of ``torch.export``'s graph as :class:`OpCall` records
with their arguments, and the weights), ``plan.json``, ``batch.pt`` (the example batch) and
``job.json`` (the schedule each stage follows and the run's settings). ``job.json`` carries a
format version; a folder written before versioning (as an older exported script has) is read
too. A job written with a model source (``job.json``'s ``model``: the user's factory or a
built-in model) holds no parameters or buffers: each rank builds them from that source
(:mod:`explorer.runtime.modelsource`).
"""

from __future__ import annotations

import json
import operator
import pickle
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, treespec_dumps

from explorer.capture.step import strip_wrapper
from explorer.capture.tracing import program_state, program_structure
from explorer.core.errors import ExplorerError
from explorer.core.plan import Plan
from explorer.core.schedule import Schedule, schedule_from_json, schedule_to_json
from explorer.runtime.modelsource import SourceWeights

#: version of ``job.json``; the schedule inside has a version of its own
JOB_FORMAT = 2


@dataclass(frozen=True)
class Ref:
    """A reference to another node's value inside an op's arguments."""

    name: str


class _ProgramUnpickler(pickle.Unpickler):
    """Reads program files written before :class:`Ref` moved here from the worker module."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("explorer.runtime.worker", "_Ref"):
            return Ref
        return super().find_class(module, name)


_PROGRAM_PICKLE = types.SimpleNamespace(
    __name__="pickle", Unpickler=_ProgramUnpickler, load=pickle.load, dump=pickle.dump,
    Pickler=pickle.Pickler, HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL)


@dataclass
class OpCall:
    """One node of the program a rank runs: enough to call it, nothing of torch.fx."""

    name: str
    kind: str  # input, param, buffer, op
    target: str  # "aten.linear.default", "operator.getitem"; "" for placeholders
    args: Any
    kwargs: Any
    inputs: list[str]
    spec: str | None  # pytree spec of the output when it is not a single tensor
    nflat: int


def target_name(target: Any) -> str:
    """The name an op's callable is stored under in a job folder."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    mod = getattr(target, "__module__", "")
    if mod in ("_operator", "operator"):
        return f"operator.{target.__name__}"
    raise ExplorerError(f"cannot run op {target!r} across processes; please report it")


def resolve_target(name: str) -> Any:
    """The callable :func:`target_name` named."""
    if name.startswith("operator."):
        return getattr(operator, name.split(".", 1)[1])
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def map_leaves(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """``x`` with its lists, tuples and dicts rebuilt as plain ones and ``leaf`` applied to
    everything else."""
    if isinstance(x, list):
        return [map_leaves(v, leaf) for v in x]
    if isinstance(x, tuple):
        return tuple(map_leaves(v, leaf) for v in x)
    if isinstance(x, dict):
        return {k: map_leaves(v, leaf) for k, v in x.items()}
    return leaf(x)


def fill_refs(x: Any, lookup: dict[str, Any]) -> Any:
    """Arguments with every node reference replaced by its value (on every op call of a
    step: written out rather than through :func:`map_leaves`, which costs a call per leaf)."""
    if isinstance(x, Ref):
        return lookup[x.name]
    if isinstance(x, list):
        return [fill_refs(v, lookup) for v in x]
    if isinstance(x, tuple):
        return tuple(fill_refs(v, lookup) for v in x)
    if isinstance(x, dict):
        return {k: fill_refs(v, lookup) for k, v in x.items()}
    return x


def on_device(x: Any, device: torch.device) -> Any:
    """Arguments with every device in them replaced by ``device``: a program captured on one
    device creates its constants (``arange``, ``full``, ``zeros``) on the rank's device."""
    return map_leaves(x, lambda v: device if isinstance(v, torch.device) else v)


def _plain(x: Any) -> Any:
    """fx's immutable containers as plain lists and dicts (some ATen schemas insist)."""
    return map_leaves(x, lambda v: v)


def program_calls(program: Any, n_inputs: int) -> tuple[list[OpCall], dict[str, torch.Tensor]]:
    """The exported program as a list of :class:`OpCall` plus its parameters and buffers."""
    fx_nodes, state_keys, trainable = program_structure(program, n_inputs)
    names = {fx: n for n, fx in fx_nodes.items()}

    def ref(a: Any) -> Ref:
        return Ref(names[a])

    calls = []
    for nm, fx in fx_nodes.items():
        val = fx.meta.get("val")
        flat, spec = tree_flatten(val)
        if fx.op == "placeholder":
            kind = ("param" if nm in trainable else "buffer") if nm in state_keys else "input"
            calls.append(OpCall(nm, kind, "", (), {}, [], None, 1))
            continue
        calls.append(OpCall(
            nm, "op", target_name(fx.target), _plain(torch.fx.node.map_arg(fx.args, ref)),
            _plain(torch.fx.node.map_arg(fx.kwargs, ref)),
            list(dict.fromkeys(names[a] for a in fx.all_input_nodes)),
            None if isinstance(val, torch.Tensor) else treespec_dumps(spec), len(flat)))
    return calls, program_state(program, state_keys)


@dataclass
class Job:
    """Everything a rank needs, as written to a job folder."""

    calls: list[OpCall]
    #: tensors by node name (built from ``model`` on first use when the job has a source)
    state: Mapping[str, torch.Tensor]
    plan: Plan
    schedule: Schedule
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    steps: int
    warmup: int
    lr: float
    record: bool
    timeout_s: float
    device_map: dict[str, str]
    requires_grad: list[bool]
    loss: str
    #: what random ops draw from (:func:`explorer.runtime.stage.draw_seed`)
    seed: int = 0
    #: where the weights come from when the folder holds none: ``{"factory": ...}`` or a
    #: built-in model (empty: they are in ``program.pt``)
    model: dict[str, Any] = field(default_factory=dict)
    #: per node, its recomputation unit (:func:`explorer.costs.strategies.recompute_units`)
    units: list[str] | None = None
    #: per node, whether recomputation keeps its output (an op of another unit saves it:
    #: :func:`explorer.costs.strategies.saved_across_units`); None: none is
    kept_outputs: list[bool] | None = None
    #: DTensor placement of each weight a tensor-parallel stage splits (others: replicated)
    placements: dict[str, str] = field(default_factory=dict)
    #: the ops tensor-parallel stages split (run on DTensors; the others on whole tensors)
    split_ops: list[str] = field(default_factory=list)
    #: of those, the ops of head-split attention, run on each rank's own heads (plain shards)
    local_ops: list[str] = field(default_factory=list)
    #: of those, the ops whose output is split along the sequence (sequence parallelism)
    sequence_ops: list[str] = field(default_factory=list)


def write_job(folder: Path, program: Any, plan: Plan, schedule: Schedule, inputs, targets,
              steps: int, warmup: int, lr: float, record: bool, timeout_s: float,
              device_map: dict[str, str], requires_grad: list[bool], loss: str,
              seed: int = 0, units: list[str] | None = None,
              kept_outputs: list[bool] | None = None,
              model: Mapping[str, Any] | None = None,
              layout: tuple[dict[str, str], list[str], list[str], list[str]] | None = None
              ) -> None:
    """Write the job folder ranks read with :func:`read_job`. With a ``model`` source, the
    program's parameters and buffers are left out: ranks build them from it. ``layout``: the
    placements of split weights, the split ops, those of them run on local shards and those
    whose outputs are split along the sequence
    (:func:`~explorer.core.tensor_layout.plan_placements`)."""
    calls, state = program_calls(program, len(inputs))
    keys = model_keys(program, len(inputs)) if model else {}
    state = {k: v for k, v in state.items() if k not in keys}
    for k, v in state.items():
        if isinstance(v, FakeTensor):
            raise ExplorerError(f"{k} of this graph has no value (it was captured on fake "
                                "tensors) and the model does not make it; capture with real "
                                "weights to export it")
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"calls": [c.__dict__ for c in calls], "state": state, "keys": keys},
               folder / "program.pt")
    plan.save(folder / "plan.json")
    torch.save({"inputs": list(inputs), "targets": list(targets)}, folder / "batch.pt")
    (folder / "job.json").write_text(json.dumps({
        "format": JOB_FORMAT, "schedule": schedule_to_json(schedule), "steps": steps,
        "warmup": warmup, "lr": lr, "record": record, "timeout_s": timeout_s,
        "device_map": device_map, "requires_grad": requires_grad, "loss": loss,
        "seed": seed, "units": units, "kept_outputs": kept_outputs,
        **({"model": dict(model)} if model else {}),
        "placements": layout[0] if layout else {}, "split_ops": layout[1] if layout else [],
        "local_ops": layout[2] if layout else [],
        "sequence_ops": layout[3] if layout else []}))


def model_keys(program: Any, n_inputs: int) -> dict[str, str]:
    """Node names of the program's parameters and buffers, with their names in the model."""
    sig = program.graph_signature
    model_names = {*sig.inputs_to_parameters.values(), *sig.inputs_to_buffers.values()}
    _, state_keys, _ = program_structure(program, n_inputs)
    return {nm: strip_wrapper(key) for nm, key in state_keys.items() if key in model_names}


def read_job(folder: Path) -> Job:
    """The job :func:`write_job` wrote in ``folder``."""
    meta = json.loads((folder / "job.json").read_text())
    version = meta.get("format")
    if version is None:  # before versioning: the schedule was a bare list under "order"
        schedule = schedule_from_json(meta["order"])
    elif version == JOB_FORMAT:
        schedule = schedule_from_json(meta["schedule"])
    else:
        raise ExplorerError(f"job folder {folder} has format {version!r}, but this version of "
                            f"the explorer reads format {JOB_FORMAT}; export the plan again "
                            "(ex.export_script) or run it with ex.run")
    batch = torch.load(folder / "batch.pt", weights_only=False)
    prog = torch.load(folder / "program.pt", weights_only=False,  # written by write_job
                      pickle_module=_PROGRAM_PICKLE)
    source = meta.get("model") or {}
    seed = int(meta.get("seed", 0))
    state = (SourceWeights(prog["state"], prog["keys"], source, seed) if source
             else prog["state"])
    return Job([OpCall(**c) for c in prog["calls"]], state,
               Plan.load(folder / "plan.json"), schedule, batch["inputs"], batch["targets"],
               meta["steps"], meta["warmup"], meta["lr"], meta["record"], meta["timeout_s"],
               meta["device_map"], meta["requires_grad"], meta["loss"], seed, source,
               meta.get("units"), meta.get("kept_outputs"), dict(meta.get("placements", {})),
               list(meta.get("split_ops", [])), list(meta.get("local_ops", [])),
               list(meta.get("sequence_ops", [])))
