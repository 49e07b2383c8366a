"""Plans: where every node runs and how the step runs, as versioned JSON validated on load.

A plan places every node of a graph on a *stage*: a set of devices that run those nodes. A
stage with one device is plain model parallelism; a stage with several devices holds replicas
that split the batch and all-reduce their gradients (data parallelism). One stage holding every
device is pure data parallelism; one stage per device is an op- or layer-level placement.
Micro-batches and a schedule (GPipe or 1F1B) say how the batch flows through the stages.

A plan file is untrusted input: before anything else reads it, it is checked against one
declarative schema (``PLAN_SCHEMA`` in :mod:`explorer.core.plan_schema`: types, ranges and
what a name may be made of), so a damaged or hostile file fails with a :class:`PlanError` and
never reaches the rest of the explorer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan_schema import (
    ASYNC_TENSOR_VERSION,
    INTERLEAVED,
    INTERLEAVED_VERSION,
    MAX_PLAN_BYTES,
    MEMORY_VERSION,
    OPTIMIZER_STATE,
    PLAN_FORMAT,
    PLAN_SCHEMA,
    PLAN_VERSION,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    TENSOR_VERSION,
    ZERO_STAGES,
    all_whole,
    shown,
)

__all__ = ["DEFAULT_SETTINGS", "INTERLEAVED", "OPTIMIZER_STATE", "PRECISIONS", "RECOMPUTE",
           "SCHEDULES", "ZERO_STAGES", "Plan", "StageSettings", "check_mesh",
           "check_no_context", "check_tensor_alone"]


@dataclass(frozen=True)
class StageSettings:
    """How one stage runs: sharded state, recomputation, precision, and its tensor-parallel
    degree (the stage's devices form a mesh of ``devices / tensor`` replicas x ``tensor``
    devices that split each layer, device ``k`` in replica ``k // tensor``); ``sequence``:
    the ops between the split blocks (norms, residual adds) also split, along the sequence
    (Megatron-LM's sequence parallelism; only with a tensor degree above 1);
    ``async_tensor``: the all-gathers and reduce-scatters of a sequence-parallel split are
    pipelined with the matrix products that read or make them, piece by piece (torch's async
    tensor parallelism, Megatron-LM's tensor-parallel communication overlap; only with
    sequence parallelism, whose collectives they are, and only where the devices can: GPUs
    with symmetric memory); ``context``: each replica's ``context`` x ``tensor`` devices
    also split every sample's sequence ``context`` ways (context parallelism, ring
    attention: the replicas are ``devices / (context x tensor)``, the context ranks ``tensor``
    apart, as Megatron-LM orders them; predicted, real steps do not run it yet)."""

    zero: int = 0
    recompute: str = "none"
    precision: str = "fp32"
    tensor: int = 1
    sequence: bool = False
    async_tensor: bool = False
    context: int = 1

    def __post_init__(self) -> None:
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise PlanError(f"ZeRO stage {self.zero!r} does not exist; use one of 0, 1, 2, 3")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if isinstance(self.tensor, bool) or not isinstance(self.tensor, int) or self.tensor < 1:
            raise PlanError(f"tensor-parallel degree {self.tensor!r} must be a whole number >= 1")
        if not isinstance(self.sequence, bool):
            raise PlanError(f"sequence {self.sequence!r} must be true or false")
        if self.sequence and self.tensor == 1:
            raise PlanError("sequence parallelism splits the ops between tensor-parallel "
                            "blocks: set a tensor degree above 1 with it")
        if not isinstance(self.async_tensor, bool):
            raise PlanError(f"async_tensor {self.async_tensor!r} must be true or false")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise PlanError(f"context-parallel degree {self.context!r} must be a whole number "
                            ">= 1")
        if self.async_tensor and not self.sequence:
            raise PlanError("async tensor parallelism pipelines the all-gathers and "
                            "reduce-scatters of sequence parallelism with the matrix products: "
                            "turn sequence parallelism on with it")

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_SETTINGS

    def describe(self) -> str:
        """``"zero 3, recompute full, bf16"``; empty for the defaults."""
        parts = ([f"zero {self.zero}"] if self.zero else []) + (
            [f"recompute {self.recompute}"] if self.recompute != "none" else []) + (
            [self.precision] if self.precision != "fp32" else []) + (
            [f"tensor {self.tensor}"] if self.tensor > 1 else []) + (
            ["sequence"] if self.sequence else []) + (
            ["async tensor"] if self.async_tensor else []) + (
            [f"context {self.context}"] if self.context > 1 else [])
        return ", ".join(parts)


DEFAULT_SETTINGS = StageSettings()


def check_tensor_alone(plan: Plan) -> None:
    """Refuse to run tensor-parallel stages in a plan with ZeRO, recomputation or reduced
    precision: the simulator predicts such plans, the runtimes do not run them yet."""
    if plan.uses_tensor_parallel and plan.uses_memory_strategies:
        raise PlanError("real steps of tensor-parallel stages with ZeRO, recomputation or "
                        "bf16/fp16 do not run yet (the prediction stands): to run it, set "
                        "zero=0, recompute='none' and precision='fp32', or tensor=1")


def check_mesh(stage: int, devices: int, settings: StageSettings) -> None:
    """Refuse ``settings`` on a stage of ``devices`` devices that its tensor degree, or its
    context x tensor degrees, do not divide."""
    if devices % settings.tensor:
        raise PlanError(f"stage {stage} has {devices} devices, which a tensor-parallel degree "
                        f"{settings.tensor} does not divide; use a degree that divides it")
    if devices % (settings.tensor * settings.context):
        raise PlanError(f"stage {stage} has {devices} devices, which context "
                        f"{settings.context} x tensor {settings.tensor} does not divide; use "
                        "degrees whose product divides it")


def check_no_context(plan: Plan) -> None:
    """Refuse to run context-parallel stages: the simulator predicts them (ring attention),
    the runtimes and scripts do not run them yet."""
    if plan.uses_context_parallel:
        raise PlanError("real steps of context-parallel stages do not run yet (the prediction "
                        "stands): to run the plan, set context=1 (--context 1)")


@dataclass(frozen=True)
class Plan:
    """Node placement plus how the step runs. Build with :meth:`from_assignment`."""

    graph_fingerprint: str
    stages: tuple[tuple[str, ...], ...]
    placement: Mapping[str, int]
    micro_batches: int = 1
    schedule: str = "gpipe"
    optimizer: str = "adam"
    algorithm: str = "manual"
    options: Mapping[str, Any] = field(default_factory=dict)
    pinned: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()
    graph_name: str = ""
    #: how the graph's model is built: a built-in one, ``{"builtin": "gpt", "size": "tiny",
    #: "batch_size": 8}`` (what ``explorer export`` and ``run --plan`` rebuild), or the user's
    #: factory, ``{"factory": "mypkg.models:build_llama"}`` (what exported scripts call)
    model: Mapping[str, Any] | None = None
    #: memory settings per stage (empty: the defaults everywhere); see :meth:`with_memory`
    stage_settings: tuple[StageSettings, ...] = ()

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_assignment(cls, graph: OpGraph, stages: Iterable[Iterable[str]],
                        assign: Mapping[Any, int], **settings: Any) -> Plan:
        """A plan from a stage per node, by index or name; unassigned nodes follow their owner.

        Parameters, buffers and inputs left out of ``assign`` go to the stage of their first
        consumer. Ops left out raise :class:`PlanError`.
        """
        by_name: dict[str, int] = {}
        for k, s in assign.items():
            by_name[graph.nodes[k].name if isinstance(k, int) else k] = int(s)
        placement: dict[str, int] = {}
        for i, n in enumerate(graph.nodes):
            if n.name in by_name:
                placement[n.name] = by_name[n.name]
            elif n.kind != "op":
                owner = graph.nodes[graph.owner(i)].name
                placement[n.name] = by_name.get(owner, 0)
            else:
                raise PlanError(f"op {n.name!r} has no stage: every op must be placed")
        plan = cls(graph.fingerprint, tuple(tuple(s) for s in stages), placement,
                   graph_name=graph.name, **settings)
        plan.validate(graph)
        return plan

    @classmethod
    def single(cls, graph: OpGraph, device_id: str, **settings: Any) -> Plan:
        return cls.from_assignment(graph, [(device_id,)],
                                   {i: 0 for i in range(len(graph))}, **settings)

    # -- queries -------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for s in self.stages for d in s)

    def stage_of(self, name: str) -> int:
        return self.placement[name]

    def devices_of(self, name: str) -> tuple[str, ...]:
        return self.stages[self.placement[name]]

    def stage_of_device(self, device_id: str) -> int:
        for s, devs in enumerate(self.stages):
            if device_id in devs:
                return s
        raise PlanError(f"device {device_id!r} is not used by this plan; it uses "
                        f"{', '.join(self.devices)}")

    def settings_of(self, stage: int) -> StageSettings:
        """The memory settings of ``stage`` (the defaults where none were set)."""
        return self.stage_settings[stage] if self.stage_settings else DEFAULT_SETTINGS

    @property
    def uses_memory_settings(self) -> bool:
        return any(not st.is_default for st in self.stage_settings)

    @property
    def uses_memory_strategies(self) -> bool:
        """Whether some stage sets ZeRO, recomputation or a reduced precision (the memory
        settings but the tensor split)."""
        return any(replace(st, tensor=1, sequence=False, async_tensor=False, context=1)
                   != DEFAULT_SETTINGS for st in self.stage_settings)

    @property
    def uses_context_parallel(self) -> bool:
        return any(st.context > 1 for st in self.stage_settings)

    def context_of(self, stage: int) -> int:
        """The context-parallel degree of ``stage`` (1: each device holds whole samples)."""
        return self.settings_of(stage).context

    @property
    def uses_tensor_parallel(self) -> bool:
        return any(st.tensor > 1 for st in self.stage_settings)

    def sequence_of(self, stage: int) -> bool:
        """Whether ``stage``'s tensor split also splits the ops between its blocks along the
        sequence."""
        return self.settings_of(stage).sequence

    def tensor_of(self, stage: int) -> int:
        """The tensor-parallel degree of ``stage`` (1: each device holds whole layers)."""
        return self.settings_of(stage).tensor

    def replicas_of(self, stage: int) -> int:
        """How many replicas of ``stage`` split the batch's tokens: its devices / its tensor
        degree (under context parallelism, each sample's sequence too: the replicas of whole
        samples are ``replicas_of / context_of``)."""
        return len(self.stages[stage]) // self.tensor_of(stage)

    def data_replicas_of(self, stage: int) -> int:
        """How many replicas of ``stage`` split the batch's samples: its replicas of the
        tokens over its context degree (the context ranks of a replica share its samples)."""
        return self.replicas_of(stage) // self.context_of(stage)

    @property
    def data_parallel(self) -> int:
        """Largest replica count of any stage."""
        return max((self.replicas_of(s) for s in range(len(self.stages))), default=1)

    def assignment(self, graph: OpGraph) -> list[int]:
        """Stage index of every node, in graph order."""
        return [self.placement[n.name] for n in graph.nodes]

    # -- editing (returns new plans) -----------------------------------------------------
    def move(self, names: Iterable[str], stage: int) -> Plan:
        if not 0 <= stage < len(self.stages):
            raise PlanError(f"stage {stage} does not exist; this plan has {len(self.stages)}")
        placement = dict(self.placement)
        for nm in names:
            if nm not in placement:
                raise PlanError(f"no node named {nm!r} in this plan")
            placement[nm] = stage
        edited = self.algorithm == "manual" or self.algorithm.endswith("+edits")
        return replace(self, placement=placement,
                       algorithm=self.algorithm if edited else f"{self.algorithm}+edits")

    def with_settings(self, **settings: Any) -> Plan:
        return replace(self, **settings)

    def with_tensor(self, degree: int, stages: Iterable[int] | None = None,
                    sequence: bool = False) -> Plan:
        """This plan with ``stages`` (default: all) split ``degree`` ways by tensor
        parallelism (``sequence``: and the ops between the split blocks along the sequence);
        the degree must divide each chosen stage's device count."""
        return self.with_memory(tensor=degree, stages=stages, sequence=sequence and degree > 1)

    def with_memory(self, *, zero: int | None = None, recompute: str | None = None,
                    precision: str | None = None, tensor: int | None = None,
                    sequence: bool | None = None, async_tensor: bool | None = None,
                    context: int | None = None, stages: Iterable[int] | None = None) -> Plan:
        """This plan with ZeRO, recomputation, precision or the tensor-parallel degree set on
        ``stages`` (default: all); what is not given stays as it was (but sequence
        parallelism ends with a tensor degree of 1, and async tensor parallelism with it).
        ``async_tensor=True`` applies to the chosen stages with sequence parallelism; a
        :class:`PlanError` where none has it."""
        chosen = range(len(self.stages)) if stages is None else list(stages)
        current = [self.settings_of(s) for s in range(len(self.stages))]
        for s in chosen:
            if not 0 <= s < len(self.stages):
                raise PlanError(f"stage {s} does not exist; this plan has {len(self.stages)}")
            old = current[s]
            degree = old.tensor if tensor is None else tensor
            split_sequence = (old.sequence if sequence is None else sequence) and degree > 1
            current[s] = StageSettings(
                zero=old.zero if zero is None else zero,
                recompute=old.recompute if recompute is None else recompute,
                precision=old.precision if precision is None else precision,
                tensor=degree, sequence=split_sequence,
                async_tensor=split_sequence and (old.async_tensor if async_tensor is None
                                                 else async_tensor),
                context=old.context if context is None else context)
            check_mesh(s, len(self.stages[s]), current[s])
        if async_tensor and not any(current[s].sequence for s in chosen):
            raise PlanError("async tensor parallelism pipelines the collectives of sequence "
                            "parallelism: split a stage by tensor and sequence first")
        kept = () if all(st.is_default for st in current) else tuple(current)
        return replace(self, stage_settings=kept)

    # -- validation ----------------------------------------------------------------------
    def validate(self, graph: OpGraph, cluster: Any = None) -> None:
        """Raise :class:`PlanError` saying what is wrong, if anything.

        The plan must pass ``PLAN_SCHEMA`` (so what validates also saves and loads back) and
        every number in it must be within what ``graph`` (and ``cluster``) allow.
        """
        PLAN_SCHEMA(self.to_dict(), "")
        if self.graph_fingerprint != graph.fingerprint:
            raise PlanError(
                f"this plan was made for graph {self.graph_name or '?'} "
                f"(fingerprint {self.graph_fingerprint}), not for {graph.name} "
                f"(fingerprint {graph.fingerprint}); capture the same model with the same "
                "example batch shape, or make a new plan for this graph")
        if not self.stages:
            raise PlanError("the plan has no stages")
        seen: dict[str, int] = {}
        for s, devs in enumerate(self.stages):
            if not devs:
                raise PlanError(f"stage {s} has no device")
            for d in devs:
                if d in seen:
                    raise PlanError(f"device {d!r} is in stage {seen[d]} and stage {s}; a "
                                    "device can serve one stage only")
                seen[d] = s
        if cluster is not None:
            unknown = [d for d in seen if d not in cluster.ids]
            if unknown:
                raise PlanError(f"the plan uses devices {', '.join(unknown)} that this cluster "
                                f"({cluster.name}) does not have; it has "
                                f"{', '.join(cluster.ids)}")
        names = graph.index  # (every node's name, as keys)
        if self.placement.keys() != names.keys():
            missing = [n for n in names if n not in self.placement]
            extra = [n for n in self.placement if n not in names]
            if missing:
                raise PlanError(f"{len(missing)} nodes of the graph are not placed, e.g. "
                                f"{sorted(missing)[:3]}")
            if extra:
                raise PlanError(f"the plan places {len(extra)} nodes the graph does not have, "
                                f"e.g. {sorted(extra)[:3]}")
        if not all_whole(0, len(self.stages) - 1)(self.placement.values()):
            bad = [(n, s) for n, s in self.placement.items()
                   if not isinstance(s, int) or not 0 <= s < len(self.stages)]
            if bad:
                raise PlanError(f"node {bad[0][0]!r} is on stage {bad[0][1]!r}, but stages run "
                                f"from 0 to {len(self.stages) - 1}")
        if self.stage_settings and len(self.stage_settings) != len(self.stages):
            raise PlanError(f"the plan has memory settings for {len(self.stage_settings)} "
                            f"stages but {len(self.stages)} stages; set them with with_memory")
        self.check_sizes(graph.batch_size, len(graph.nodes))
        for s, devs in enumerate(self.stages):
            check_mesh(s, len(devs), self.settings_of(s))
        unknown_pins = [p for p in self.pinned if p not in names]
        if unknown_pins:
            raise PlanError(f"pinned nodes {unknown_pins[:3]} are not in the graph")

    def check_sizes(self, batch_size: int, n_nodes: int) -> None:
        """Numbers within what the graph allows: no more stages than nodes, and no more
        replicas in a stage than the batch has samples (when the batch size is known).

        Micro-batches smaller than a sample are a what-if the simulator can answer (up to
        ``MAX_MICRO_BATCHES``); :meth:`check_batch` refuses them for real runs."""
        if len(self.stages) > max(n_nodes, 1):
            raise PlanError(f"the plan has {len(self.stages)} stages for a graph of {n_nodes} "
                            "nodes; a stage with nothing on it cannot run")
        for s in range(len(self.stages)):
            whole = self.data_replicas_of(s)
            if 0 < batch_size < whole:
                raise PlanError(f"stage {s} has {whole} replicas for a batch of "
                                f"{batch_size} samples; use at most {batch_size} devices")

    def check_batch(self, batch_size: int) -> None:
        """A real run splits the batch over replicas and micro-batches: it must divide."""
        for s in range(len(self.stages)):
            reps = self.replicas_of(s)
            parts = reps * self.micro_batches
            if parts > batch_size:
                raise PlanError(f"stage {s} splits the batch of {batch_size} into {reps} "
                                f"replicas x {self.micro_batches} micro-batches = {parts} "
                                "parts, more than it has samples; use fewer micro-batches or "
                                "replicas")
            if batch_size % parts:
                raise PlanError(f"stage {s} splits the batch of {batch_size} into {reps} "
                                f"replicas x {self.micro_batches} micro-batches = {parts} parts, "
                                "which does not divide it; change the batch size or the plan")

    def check_runnable(self, batch_size: int, batch_splits: bool | None) -> None:
        """What a real run needs of the batch: it divides over replicas x micro-batches
        (:meth:`check_batch`), and it is split at all only where the graph's batch dimension
        is dynamic (``batch_splits``; None when unknown, as for a graph not exported); and
        no tensor-parallel stage with ZeRO, recomputation or reduced precision
        (:func:`check_tensor_alone`)."""
        check_tensor_alone(self)
        check_no_context(self)
        self.check_batch(batch_size)
        splits = self.data_parallel * self.micro_batches
        if splits > 1 and batch_splits is False:
            raise PlanError("this model was exported with a fixed batch size, so a plan that "
                            "splits the batch (replicas or micro-batches) cannot run")

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        settings = ({"stage_settings": [{"zero": st.zero, "recompute": st.recompute,
                                         "precision": st.precision,
                                         **({"tensor": st.tensor} if st.tensor > 1 else {}),
                                         **({"sequence": True} if st.sequence else {}),
                                         **({"async_tensor": True} if st.async_tensor
                                            else {}),
                                         **({"context": st.context} if st.context > 1
                                            else {})}
                                        for st in self.stage_settings]}
                    if self.uses_memory_settings else {})
        version = (ASYNC_TENSOR_VERSION if any(st.async_tensor or st.context > 1
                                               for st in self.stage_settings)
                   else INTERLEAVED_VERSION if self.schedule == INTERLEAVED
                   else TENSOR_VERSION if self.uses_tensor_parallel
                   else MEMORY_VERSION if settings or "factory" in (self.model or {}) else 1)
        return {
            "format": PLAN_FORMAT, "version": version,
            "graph": {"fingerprint": self.graph_fingerprint, "name": self.graph_name},
            "stages": [list(s) for s in self.stages],
            "placement": dict(self.placement),
            "micro_batches": self.micro_batches, "schedule": self.schedule,
            "optimizer": self.optimizer, "algorithm": self.algorithm,
            "options": _jsonable(self.options), "pinned": sorted(self.pinned),
            "notes": list(self.notes),
            **({"model": dict(self.model)} if self.model is not None else {}),
            **settings,
        }

    @classmethod
    def from_dict(cls, d: Any, graph: OpGraph | None = None, cluster: Any = None) -> Plan:
        """A plan from its JSON form, checked against ``PLAN_SCHEMA`` before anything else."""
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise PlanError("this is not a Partition Explorer plan (no "
                            f"\"format\": \"{PLAN_FORMAT}\" field)")
        version = d.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PlanError(f"the plan has no valid format version ({shown(version)}); the "
                            "file is damaged, export the plan again")
        if version > PLAN_VERSION:
            raise PlanError(f"plan format version {version!r} is newer than this explorer "
                            f"understands ({PLAN_VERSION}); upgrade partition-explorer")
        f = PLAN_SCHEMA(d, "")  # earlier versions are the latest without its new fields
        plan = cls(
            graph_fingerprint=f["graph"]["fingerprint"], graph_name=f["graph"]["name"],
            stages=tuple(tuple(s) for s in f["stages"]), placement=f["placement"],
            micro_batches=f["micro_batches"], schedule=f["schedule"],
            optimizer=f["optimizer"], algorithm=f["algorithm"], options=f["options"],
            pinned=frozenset(f["pinned"]), notes=tuple(f["notes"]), model=f["model"],
            stage_settings=tuple(StageSettings(**st) for st in f["stage_settings"]))
        if graph is not None:
            plan.validate(graph, cluster)
        return plan

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1))
            tmp.replace(path)  # never leave a half-written plan behind
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise PlanError(f"cannot save the plan to {path}: {exc.strerror or exc}") from exc
        return path

    @classmethod
    def load(cls, path: str | Path, graph: OpGraph | None = None, cluster: Any = None) -> Plan:
        """Read a plan; with ``graph`` (and ``cluster``), refuse one that does not fit them."""
        path = Path(path)
        try:
            with path.open("rb") as f:
                data = f.read(MAX_PLAN_BYTES + 1)
        except OSError as exc:
            raise PlanError(f"cannot read plan file {path}: {exc.strerror or exc}") from exc
        if len(data) > MAX_PLAN_BYTES:
            raise PlanError(f"{path} is larger than {MAX_PLAN_BYTES // 2**20} MiB: not a plan")
        return cls.from_json(data, graph, cluster, source=str(path))

    @classmethod
    def from_json(cls, data: str | bytes, graph: OpGraph | None = None, cluster: Any = None,
                  source: str = "the plan") -> Plan:
        """A plan from the text of a plan file (UTF-8 JSON) of at most ``MAX_PLAN_BYTES``,
        refused by its size before it is parsed."""
        if _utf8_bytes_over(data, MAX_PLAN_BYTES):
            raise PlanError(f"{source} is larger than {MAX_PLAN_BYTES // 2**20} MiB: not a plan")
        try:
            d = json.loads(data)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{source} is not valid JSON (line {exc.lineno}, column "
                            f"{exc.colno}: {exc.msg}); the file is damaged, export the plan "
                            "again") from exc
        except (UnicodeDecodeError, RecursionError, ValueError) as exc:
            raise PlanError(f"{source} is not UTF-8 JSON of reasonable depth ({exc}); the "
                            "file is damaged, export the plan again") from exc
        return cls.from_dict(d, graph, cluster)


def _utf8_bytes_over(data: Any, limit: int) -> bool:
    """Whether ``data`` (bytes, or text as UTF-8) holds more than ``limit`` bytes, counted a
    chunk at a time (never a copy of a large text)."""
    if not isinstance(data, str):
        return len(data) > limit
    if len(data) > limit or data.isascii():
        return len(data) > limit
    chunk, total = 2**20, 0
    for i in range(0, len(data), chunk):
        total += len(data[i:i + chunk].encode("utf-8", "surrogatepass"))
        if total > limit:
            return True
    return False


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return {str(k): repr(v) for k, v in dict(x).items()}
