"""A job folder: everything a rank reads to run its part of a plan, written once per run.

The folder holds ``program.pt`` (the ops of ``torch.export``'s graph as :class:`OpCall` records
with their arguments, and the weights), ``plan.json``, ``batch.pt`` (the example batch) and
``job.json`` (the schedule each stage follows and the run's settings). ``job.json`` carries a
format version; a folder written before versioning (as an older exported script has) is read
too. A job written with a model source (``job.json``'s ``model``: the user's factory or a
built-in model) holds no parameters or buffers: each rank builds them from that source
(:mod:`explorer.runtime.modelsource`).

A job is one typed record, :class:`Job`, written by name (:func:`write_job`) and read back
checked (:func:`read_job`) before any rank computes: ``plan.json`` must be the plan
``program.pt`` was exported with (its graph fingerprint and every node's stage), the schedule
must run each node on the stage the plan places it, and every value of ``job.json`` must have
its type and range (:func:`job_problem`), or :class:`JobError` names the field.
"""

from __future__ import annotations

import json
import math
import operator
import pickle
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, treespec_dumps

from explorer.capture.step import strip_wrapper
from explorer.capture.tracing import program_state, program_structure
from explorer.core.errors import ExplorerError
from explorer.core.factory import FACTORY_PATTERN
from explorer.core.plan import Plan
from explorer.core.schedule import OPTIMIZER, Schedule, schedule_from_json, schedule_to_json
from explorer.models.builtin import SIZES, model_names, shape_names
from explorer.runtime.modelsource import SourceWeights

#: version of ``job.json``; the schedule inside has a version of its own
JOB_FORMAT = 2

#: how a rank runs its stage's ops: one at a time from Python ("ops",
#: :class:`explorer.runtime.stage.StageRunner`), or as generated segments of consecutive ops
#: with one backward each ("segments", :mod:`explorer.runtime.segments`)
Runtime = Literal["ops", "segments"]
RUNTIMES: tuple[Runtime, ...] = ("ops", "segments")


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
    #: per node, whether the plan's recomputation runs its op again in a backward
    #: (:func:`explorer.costs.strategies.rerun_ops`): the segment runtime checkpoints only the
    #: units that run an op again; None: every unit of a recomputing stage
    reruns: list[bool] | None = None
    #: DTensor placement of each weight a tensor-parallel stage splits (others: replicated)
    placements: dict[str, str] = field(default_factory=dict)
    #: the ops tensor-parallel stages split (run on DTensors; the others on whole tensors)
    split_ops: list[str] = field(default_factory=list)
    #: of those, the ops of head-split attention, run on each rank's own heads (plain shards)
    local_ops: list[str] = field(default_factory=list)
    #: of those, the ops whose output is split along the sequence (sequence parallelism)
    sequence_ops: list[str] = field(default_factory=list)
    #: how the ranks run their ops (:data:`Runtime`)
    runtime: Runtime = "ops"
    #: whether each segment's ops run through ``torch.compile`` (``runtime="segments"``
    #: only: :mod:`explorer.runtime.segment_compile`)
    compile: bool = False
    #: per node, the bytes its backward holds beyond its inputs' gradients at the whole
    #: batch (``OpNode.backward_scratch_bytes``): the op path counts them while the op's
    #: backward runs, as the simulator does (segments see them made); None: none
    backward_scratch: list[int] | None = None

    @property
    def memory_step(self) -> int:
        """The step a CPU rank counts its memory in: the last warm-up step where there are two
        (every step after the first holds the optimizer's state, so it holds what a measured
        step holds, and no timed step pays for the counting), else the last step."""
        return self.warmup - 1 if self.warmup >= 2 else self.warmup + self.steps - 1


class JobError(ExplorerError):
    """A job folder whose files do not belong together or hold values a rank cannot run."""


#: a rank's torch device in ``job.json``'s ``device_map``
DEVICE_PATTERN = r"cpu|cuda(:[0-9]{1,4})?"
#: the most steps, warm-up steps and seconds of time limit a job may ask for
MAX_STEPS = 10**9
MAX_TIMEOUT_S = 10**7


def program_parts(program: Any, n_inputs: int, model: Mapping[str, Any] | None = None,
                  seed: int = 0) -> tuple[list[OpCall], Mapping[str, torch.Tensor]]:
    """A job's ``calls`` and ``state`` from the exported program: with a ``model`` source the
    state holds only the program's own constants and builds the model's tensors from the
    source (:class:`~explorer.runtime.modelsource.SourceWeights`)."""
    calls, state = program_calls(program, n_inputs)
    if not model:
        return calls, state
    keys = model_keys(program, n_inputs)
    return calls, SourceWeights({k: v for k, v in state.items() if k not in keys}, keys,
                                dict(model), seed)


def write_job(folder: Path, job: Job) -> None:
    """Write the job folder ranks read with :func:`read_job`: ``job`` checked first
    (:func:`job_problem`), its program and the plan it was made for in ``program.pt`` (so
    that an edited ``plan.json`` is refused), the plan, the batch and the settings. With a
    model source (``job.model``, ``job.state`` a ``SourceWeights``), the model's parameters
    and buffers are left out: ranks build them from it."""
    problem = job_problem(job)
    if problem:
        raise JobError(f"cannot write this job: {problem}")
    if isinstance(job.state, SourceWeights):
        constants, keys = dict(job.state.constants), dict(job.state.keys)
    else:
        constants, keys = dict(job.state), {}
    for k, v in constants.items():
        if isinstance(v, FakeTensor):
            raise ExplorerError(f"{k} of this graph has no value (it was captured on fake "
                                "tensors) and the model does not make it; capture with real "
                                "weights to export it")
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"calls": [c.__dict__ for c in job.calls], "state": constants, "keys": keys,
                "fingerprint": job.plan.graph_fingerprint, "plan": _plan_record(job.plan)},
               folder / "program.pt")
    job.plan.save(folder / "plan.json")
    torch.save({"inputs": list(job.inputs), "targets": list(job.targets)}, folder / "batch.pt")
    (folder / "job.json").write_text(json.dumps({
        "format": JOB_FORMAT, "schedule": schedule_to_json(job.schedule),
        **{name: getattr(job, name) for name in _SETTINGS},
        **({"model": dict(job.model)} if job.model else {})}))


#: the fields of :class:`Job` that ``job.json`` holds as they are (besides format, schedule
#: and model), with what each defaults to when an older folder lacks it (required: no entry)
_SETTINGS = ("steps", "warmup", "lr", "record", "timeout_s", "device_map", "requires_grad",
             "loss", "seed", "units", "kept_outputs", "placements", "split_ops", "local_ops",
             "sequence_ops", "runtime", "compile", "backward_scratch", "reruns")
_DEFAULTS: dict[str, Any] = {"seed": 0, "units": None, "kept_outputs": None, "reruns": None,
                             "placements": {}, "split_ops": [], "local_ops": [],
                             "sequence_ops": [], "runtime": "ops", "compile": False,
                             "backward_scratch": None}


def _plan_record(plan: Plan) -> Any:
    """``plan`` as its JSON reads (lists, not tuples): what ``plan.json`` is compared with."""
    return json.loads(json.dumps(plan.to_dict()))


def model_keys(program: Any, n_inputs: int) -> dict[str, str]:
    """Node names of the program's parameters and buffers, with their names in the model."""
    sig = program.graph_signature
    model_names = {*sig.inputs_to_parameters.values(), *sig.inputs_to_buffers.values()}
    _, state_keys, _ = program_structure(program, n_inputs)
    return {nm: strip_wrapper(key) for nm, key in state_keys.items() if key in model_names}


def read_job(folder: Path) -> Job:
    """The job :func:`write_job` wrote in ``folder``, checked: :class:`JobError` (naming the
    file and the field) when its files do not belong together or a value is out of range."""
    meta = _job_json(folder)
    version = meta.get("format")
    if version is None:  # before versioning: the schedule was a bare list under "order"
        schedule = _schedule(folder, meta, "order")
    elif version == JOB_FORMAT:
        schedule = _schedule(folder, meta, "schedule")
    else:
        raise ExplorerError(f"job folder {folder} has format {version!r}, but this version of "
                            f"the explorer reads format {JOB_FORMAT}; export the plan again "
                            "(ex.export_script) or run it with ex.run")
    missing = [k for k in _SETTINGS if k not in meta and k not in _DEFAULTS]
    if missing:
        raise JobError(f"{folder / 'job.json'} has no field {missing[0]!r}; export the plan "
                       "again")
    batch = torch.load(folder / "batch.pt", weights_only=False)
    prog = torch.load(folder / "program.pt", weights_only=False,  # written by write_job
                      pickle_module=_PROGRAM_PICKLE)
    plan = Plan.load(folder / "plan.json")
    _check_plan(folder, plan, prog)
    source = meta.get("model") or {}
    problem = _model_problem(source)
    if problem:
        raise JobError(f"{folder / 'job.json'}: field 'model' {problem}; fix it or export the "
                       "plan again")
    seed = meta.get("seed", 0)
    calls = [OpCall(**c) for c in prog["calls"]]
    job = Job(calls=calls,
              state=(SourceWeights(prog["state"], prog["keys"], source, seed) if source
                     else prog["state"]),
              plan=plan, schedule=schedule, inputs=batch["inputs"], targets=batch["targets"],
              model=source, **{k: meta.get(k, _DEFAULTS.get(k)) for k in _SETTINGS})
    problem = job_problem(job)
    if problem:
        raise JobError(f"{folder / 'job.json'}: {problem}; fix it or export the plan again")
    return job


def _job_json(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "job.json").read_text())
    except OSError as exc:
        raise JobError(f"cannot read {folder / 'job.json'}: {exc.strerror or exc}; is "
                       f"{folder} a job folder?") from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8 among them
        raise JobError(f"{folder / 'job.json'} is not JSON ({exc}); export the plan "
                       "again") from exc
    if not isinstance(meta, dict):
        raise JobError(f"{folder / 'job.json'} is not a JSON object; export the plan again")
    return meta


def _schedule(folder: Path, meta: dict[str, Any], key: str) -> Schedule:
    try:
        return schedule_from_json(meta[key])
    except ExplorerError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise JobError(f"{folder / 'job.json'}: field {key!r} is not a schedule ({exc!r}); "
                       "export the plan again") from exc


def _check_plan(folder: Path, plan: Plan, prog: Mapping[str, Any]) -> None:
    """Refuse a ``plan.json`` other than the plan ``program.pt`` was exported with: another
    graph, a node moved to another stage (each rank would wait for work the others never
    send), or any other setting. Folders written before the plan was recorded pass."""
    fingerprint = prog.get("fingerprint")
    if fingerprint is not None and plan.graph_fingerprint != fingerprint:
        raise JobError(f"{folder / 'plan.json'} is a plan for graph {plan.graph_fingerprint}, "
                       f"but {folder / 'program.pt'} holds the program of graph "
                       f"{fingerprint}: the files of this job folder do not belong together; "
                       "export the plan again")
    recorded = prog.get("plan")
    got = _plan_record(plan)
    if recorded is None or got == recorded:
        return
    was, now = recorded.get("placement", {}), got.get("placement", {})
    moved = [n for n in was if now.get(n) != was[n]]
    if moved:
        what = (f"node {moved[0]!r} is on stage {now.get(moved[0])} instead of "
                f"{was[moved[0]]}" + (f" (and {len(moved) - 1} more nodes moved)"
                                      if len(moved) > 1 else ""))
    else:
        what = "its " + ", ".join(sorted(k for k in {*recorded, *got}
                                         if recorded.get(k) != got.get(k))) + " changed"
    raise JobError(f"{folder / 'plan.json'} is not the plan this job was exported with "
                   f"({what}): the ranks would not run the same plan; plan.json is not to be "
                   "edited, export the edited plan again instead")


# -- checking a job's values -------------------------------------------------------------
def _whole(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _positive(hi: float = math.inf) -> Callable[[Any], bool]:
    return lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v) and 0 < v <= hi)


def _text_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                       for k, x in v.items())


def _list_of(kind: type, n: int | None = None) -> Callable[[Any], bool]:
    return lambda v: (isinstance(v, list) and (n is None or len(v) == n)
                      and all(isinstance(x, kind) for x in v))


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def job_problem(job: Job) -> str | None:
    """What is wrong with ``job``'s values (the field, what it holds and what it must hold),
    or None: types, finite numbers in range, per-node lists one entry per node, the devices
    of the plan, a known model source, and a schedule that runs each node on its stage."""
    n = len(job.calls)
    names = {c.name for c in job.calls}
    rules: list[tuple[str, Callable[[Any], bool], str]] = [
        ("steps", _whole(1, MAX_STEPS), f"a whole number from 1 to {MAX_STEPS}"),
        ("warmup", _whole(0, MAX_STEPS), f"a whole number from 0 to {MAX_STEPS}"),
        ("lr", _positive(), "a finite number > 0"),
        ("record", lambda v: isinstance(v, bool), "true or false"),
        ("timeout_s", _positive(MAX_TIMEOUT_S), f"a finite number of seconds > 0 (at most "
                                                f"{MAX_TIMEOUT_S})"),
        ("seed", _whole(0, 2**63 - 1), "a whole number >= 0"),
        ("device_map", lambda v: _text_map(v) and set(v) == set(job.plan.devices) and all(
            re.fullmatch(DEVICE_PATTERN, x) for x in v.values()),
         f"the torch device of each of the plan's devices ({', '.join(job.plan.devices)}): "
         "cpu, cuda or cuda:N"),
        ("requires_grad", _list_of(bool, n), f"one true or false per node ({n})"),
        ("loss", lambda v: isinstance(v, str) and v in names, "the name of a node"),
        ("units", lambda v: v is None or _list_of(str, n)(v),
         f"null or one unit name per node ({n})"),
        ("kept_outputs", lambda v: v is None or _list_of(bool, n)(v),
         f"null or one true or false per node ({n})"),
        ("reruns", lambda v: v is None or _list_of(bool, n)(v),
         f"null or one true or false per node ({n})"),
        ("placements", _text_map, "an object of weight names and placements (text)"),
        ("split_ops", _list_of(str), "a list of op names"),
        ("local_ops", _list_of(str), "a list of op names"),
        ("sequence_ops", _list_of(str), "a list of op names"),
        ("runtime", lambda v: isinstance(v, str) and v in RUNTIMES,
         " or ".join(repr(r) for r in RUNTIMES)),
        ("compile", lambda v: isinstance(v, bool), "true or false"),
        ("backward_scratch", lambda v: v is None or (_list_of(int, n)(v) and min(v, default=0)
         >= 0), f"null or one whole number of bytes >= 0 per node ({n})"),
    ]
    for name, ok, what in rules:
        value = getattr(job, name)
        if not ok(value):
            return f"field {name!r} is {_shown(value)}, but it must be {what}"
    if job.compile and job.runtime != "segments":
        return (f"field 'compile' is true, but field 'runtime' is {job.runtime!r}: only "
                "runtime 'segments' compiles (--runtime segments)")
    for name in ("inputs", "targets"):
        if not _list_of(torch.Tensor)(getattr(job, name)):
            return f"the batch's {name} are not a list of tensors"
    problem = _model_problem(job.model)
    if problem:
        return f"field 'model' {problem}"
    return _schedule_problem(job)


def _model_problem(source: Any) -> str | None:
    """What is wrong with a job's model source (empty, a factory or a built-in model)."""
    if not isinstance(source, dict):
        return f"is {_shown(source)}, not an object"
    if not source:
        return None
    if set(source) == {"factory"}:
        ok = isinstance(source["factory"], str) and re.fullmatch(FACTORY_PATTERN,
                                                                 source["factory"])
        return None if ok else (f"names factory {_shown(source['factory'])}, not one of the "
                                "form module:function")
    if set(source) != {"builtin", "size", "batch_size"}:
        return (f"is {_shown(source)}; it must be {{\"factory\": \"module:function\"}} or "
                "a built-in model {\"builtin\", \"size\", \"batch_size\"}")
    name, size, batch = source["builtin"], source["size"], source["batch_size"]
    if name not in model_names() and name not in shape_names():
        return (f"names built-in model {_shown(name)}; known models: "
                f"{', '.join(sorted([*model_names(), *shape_names()]))}")
    sizes = ("default",) if name in shape_names() else SIZES
    if size not in sizes:
        return f"names size {_shown(size)} of {name}; known sizes: {', '.join(sizes)}"
    if not _whole(1, 2**31)(batch):
        return f"has batch_size {_shown(batch)}, not a whole number >= 1"
    return None


def _schedule_problem(job: Job) -> str | None:
    """Whether the schedule runs each node on the stage the plan places it, on the plan's
    micro-batches: a schedule of another plan would leave ranks waiting on each other."""
    plan, calls = job.plan, job.calls
    if len(job.schedule) != len(plan.stages):
        return (f"the schedule has {len(job.schedule)} stages but plan.json has "
                f"{len(plan.stages)}")
    for stage, actions in enumerate(job.schedule):
        for a in actions:
            if a.kind == OPTIMIZER:
                continue
            if not 0 <= a.node < len(calls) or not 0 <= a.micro_batch < plan.micro_batches:
                return (f"the schedule's stage {stage} has a {a.kind} of node {a.node} on "
                        f"micro-batch {a.micro_batch}, outside the program's {len(calls)} "
                        f"nodes and the plan's {plan.micro_batches} micro-batches")
            name = calls[a.node].name
            if plan.placement.get(name) != stage:
                return (f"the schedule runs node {name!r} on stage {stage}, but plan.json "
                        f"places it on stage {plan.placement.get(name)}: they are not of "
                        "the same plan")
    return None
