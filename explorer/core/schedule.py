"""The schedule as data: per stage, the ordered actions its ranks run in one training step.

The simulator decides the order (:func:`explorer.simulate.simulator.execution_order`), the
runtime follows it, and a job folder stores it as JSON. As in ``torch.distributed.pipelining``,
an action is a small immutable record: what to run (the forward or backward of one node for one
micro-batch, or the optimizer step) and nothing about how. An :class:`Action` is a named tuple,
so it unpacks as ``kind, micro_batch, node`` and equals the plain tuple of those three.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from explorer.core.errors import ExplorerError

ActionKind = Literal["fwd", "bwd", "optimizer"]
FWD: ActionKind = "fwd"
BWD: ActionKind = "bwd"
OPTIMIZER: ActionKind = "optimizer"
KINDS: tuple[ActionKind, ...] = (FWD, BWD, OPTIMIZER)

#: version of the JSON form written by :func:`schedule_to_json`
SCHEDULE_FORMAT = 2


class Action(NamedTuple):
    """One task of a rank: ``kind`` of node ``node`` (an index into the graph's nodes) on
    micro-batch ``micro_batch``; the optimizer step has node and micro-batch -1."""

    kind: ActionKind
    micro_batch: int
    node: int

    @classmethod
    def optimizer_step(cls) -> Action:
        return cls(OPTIMIZER, -1, -1)


#: per stage (index into ``Plan.stages``), the actions every rank of that stage runs, in order
Schedule = list[list[Action]]


def schedule_to_json(schedule: Schedule) -> dict[str, Any]:
    """The schedule as a JSON-ready object, with its format version."""
    return {"format": SCHEDULE_FORMAT,
            "stages": [[{"kind": a.kind, "micro_batch": a.micro_batch, "node": a.node}
                        for a in actions] for actions in schedule]}


def schedule_from_json(data: Any) -> Schedule:
    """The schedule :func:`schedule_to_json` wrote.

    The format before versioning (a bare list per stage of ``[kind, micro_batch, node]``
    lists, as older exported scripts carry) is read too.
    """
    if isinstance(data, list):  # unversioned: [[[kind, micro_batch, node], ...], ...]
        return [[_action(*a) for a in actions] for actions in data]
    version = data.get("format") if isinstance(data, dict) else None
    if version != SCHEDULE_FORMAT:
        raise ExplorerError(f"this job's schedule has format {version!r}, but this version of "
                            f"the explorer reads format {SCHEDULE_FORMAT}; export the plan "
                            "again (ex.export_script) or run it with ex.run")
    return [[_action(a["kind"], a["micro_batch"], a["node"]) for a in actions]
            for actions in data["stages"]]


def _action(kind: str, micro_batch: int, node: int) -> Action:
    if kind not in KINDS:
        raise ExplorerError(f"unknown action {kind!r} in a job's schedule; export the plan "
                            "again with this version of the explorer")
    return Action(kind, int(micro_batch), int(node))  # type: ignore[arg-type]
