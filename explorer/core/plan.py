"""Plans: where every node runs and how the step runs, as versioned JSON validated on load.

A plan places every node of a graph on a *stage*: a set of devices that run those nodes. A
stage with one device is plain model parallelism; a stage with several devices holds replicas
that split the batch and all-reduce their gradients (data parallelism). One stage holding every
device is pure data parallelism; one stage per device is an op- or layer-level placement.
Micro-batches and a schedule (GPipe or 1F1B) say how the batch flows through the stages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph

#: bytes of optimizer state per byte of trainable parameters (torch.optim defaults)
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}

PLAN_FORMAT = "partition-explorer-plan"
PLAN_VERSION = 1
SCHEDULES = ("gpipe", "1f1b")


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

    @property
    def data_parallel(self) -> int:
        """Largest replica count of any stage."""
        return max((len(s) for s in self.stages), default=1)

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

    # -- validation ----------------------------------------------------------------------
    def validate(self, graph: OpGraph, cluster: Any = None) -> None:
        """Raise :class:`PlanError` saying what is wrong, if anything."""
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
        names = {n.name for n in graph.nodes}
        missing = [n for n in names if n not in self.placement]
        extra = [n for n in self.placement if n not in names]
        if missing:
            raise PlanError(f"{len(missing)} nodes of the graph are not placed, e.g. "
                            f"{sorted(missing)[:3]}")
        if extra:
            raise PlanError(f"the plan places {len(extra)} nodes the graph does not have, e.g. "
                            f"{sorted(extra)[:3]}")
        bad = [(n, s) for n, s in self.placement.items()
               if not isinstance(s, int) or not 0 <= s < len(self.stages)]
        if bad:
            raise PlanError(f"node {bad[0][0]!r} is on stage {bad[0][1]!r}, but stages run from "
                            f"0 to {len(self.stages) - 1}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or self.micro_batches < 1:
            raise PlanError(f"micro_batches must be a whole number >= 1, not "
                            f"{self.micro_batches!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; choose one of "
                            f"{', '.join(SCHEDULES)}")
        if self.optimizer not in OPTIMIZER_STATE:
            raise PlanError(f"unknown optimizer {self.optimizer!r}; choose one of "
                            f"{', '.join(OPTIMIZER_STATE)}")
        unknown_pins = [p for p in self.pinned if p not in names]
        if unknown_pins:
            raise PlanError(f"pinned nodes {unknown_pins[:3]} are not in the graph")

    def check_batch(self, batch_size: int) -> None:
        """A real run splits the batch over replicas and micro-batches: it must divide."""
        for s, devs in enumerate(self.stages):
            parts = len(devs) * self.micro_batches
            if batch_size % parts:
                raise PlanError(f"stage {s} splits the batch of {batch_size} into {len(devs)} "
                                f"replicas x {self.micro_batches} micro-batches = {parts} parts, "
                                "which does not divide it; change the batch size or the plan")

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION,
            "graph": {"fingerprint": self.graph_fingerprint, "name": self.graph_name},
            "stages": [list(s) for s in self.stages],
            "placement": dict(self.placement),
            "micro_batches": self.micro_batches, "schedule": self.schedule,
            "optimizer": self.optimizer, "algorithm": self.algorithm,
            "options": _jsonable(self.options), "pinned": sorted(self.pinned),
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Any, graph: OpGraph | None = None, cluster: Any = None) -> Plan:
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise PlanError("this is not a Partition Explorer plan (no "
                            f"\"format\": \"{PLAN_FORMAT}\" field)")
        version = d.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PlanError(f"the plan has no valid format version ({version!r}); the file is "
                            "damaged, export the plan again")
        if version > PLAN_VERSION:
            raise PlanError(f"plan format version {version!r} is newer than this explorer "
                            f"understands ({PLAN_VERSION}); upgrade partition-explorer")
        try:
            plan = cls(
                graph_fingerprint=str(d["graph"]["fingerprint"]),
                graph_name=str(d["graph"].get("name", "")),
                stages=tuple(tuple(str(x) for x in s) for s in d["stages"]),
                placement={str(k): v for k, v in dict(d["placement"]).items()},
                micro_batches=d.get("micro_batches", 1), schedule=d.get("schedule", "gpipe"),
                optimizer=d.get("optimizer", "adam"), algorithm=d.get("algorithm", "manual"),
                options=dict(d.get("options", {})), pinned=frozenset(d.get("pinned", [])),
                notes=tuple(d.get("notes", [])))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"the plan is damaged: field {exc} is missing or has the wrong "
                            "type; export the plan again") from exc
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
            text = path.read_text()
        except OSError as exc:
            raise PlanError(f"cannot read plan file {path}: {exc.strerror or exc}") from exc
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                            f"{exc.msg}); the file is damaged, export the plan again") from exc
        return cls.from_dict(d, graph, cluster)


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return {str(k): repr(v) for k, v in dict(x).items()}
