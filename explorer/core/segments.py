"""How the segment runtime groups a rank's ops: the largest runs of consecutive forward
actions of one micro-batch that can run as one piece of code with one backward.

The runtime (:mod:`explorer.runtime.segments`) generates and runs each segment's code; the
simulator reads the same grouping to hold what a segment's backward holds as the runtime does
(the gradients it receives, from the segment's backward start to its end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from explorer.core.schedule import BWD, FWD, Action


@dataclass(frozen=True)
class Segment:
    """Ops of one stage run as one piece of code on one micro-batch (each shard in turn).

    Nodes are indices into the job's program; positions are indices into the rank's actions.
    """

    micro_batch: int
    #: the ops, in the order their forward runs
    nodes: tuple[int, ...]
    #: the nodes the ops read that are made outside the segment (ops of other segments or
    #: stages, batch inputs, weights), in the order of their first use
    inputs: tuple[int, ...]
    #: the ops whose value is read outside the segment (by another segment or stage), and the
    #: loss, in node order
    outputs: tuple[int, ...]
    #: per input, how many of the segment's ops read it
    uses: tuple[int, ...]
    #: the ops that have a backward action (those that need a gradient), and per input how
    #: many of them read it
    backward_nodes: tuple[int, ...]
    backward_uses: tuple[int, ...]
    #: per output, how many ops of this stage outside the segment read it
    readers_after: tuple[int, ...]
    #: the position of the segment's first forward action (it runs there; unique per segment)
    forward_at: int
    #: the position of its first backward action (its backward runs there), or None
    backward_at: int | None


def grad_sources(i: int, s: int, stage: Sequence[int], succs: Sequence[Sequence[int]],
                 requires_grad: Sequence[bool]) -> list[int]:
    """The other stages op ``i``'s backward receives a gradient from (those with a consumer
    of it that needs one), as the op path receives them."""
    return sorted({stage[c] for c in succs[i] if requires_grad[c]} - {s})


def group_segments(actions: Sequence[Action], s: int, stage: Sequence[int],
                   kind: Sequence[str], preds: Sequence[Sequence[int]],
                   requires_grad: Sequence[bool], loss: int | None = None,
                   units: Sequence[str] | None = None) -> list[Segment]:
    """Stage ``s``'s forward actions (``actions``, the rank's order) grouped into segments
    (:func:`segment_runs`), each with what the runtime needs to run it; ``loss`` is the loss
    node, always an output."""
    succs = _successors(preds)
    fwd_at = {(a.micro_batch, a.node): k for k, a in enumerate(actions) if a.kind == FWD}
    bwd_at = {(a.micro_batch, a.node): k for k, a in enumerate(actions) if a.kind == BWD}
    return [_segment(m, nodes, s, stage, preds, succs, loss, fwd_at, bwd_at)
            for m, nodes in segment_runs(actions, s, stage, kind, preds, requires_grad,
                                         units, succs, bwd_at)]


def segment_runs(actions: Sequence[Action], s: int, stage: Sequence[int],
                 kind: Sequence[str], preds: Sequence[Sequence[int]],
                 requires_grad: Sequence[bool], units: Sequence[str] | None = None,
                 succs: Sequence[Sequence[int]] | None = None,
                 bwd_at: dict[tuple[int, int], int] | None = None
                 ) -> list[tuple[int, list[int]]]:
    """Stage ``s``'s forward actions (``actions``, the rank's order) grouped into segments,
    as (micro-batch, ops in forward order) pairs.

    A segment grows over consecutive forward actions of one micro-batch. It is cut before an
    op that reads an op's value made on another stage which no earlier op of the micro-batch
    received, if an op of the segment sends its value to another stage; and before an op
    that would leave the segment's backward actions not consecutive, or with a gradient
    receive (:func:`grad_sources`) after (in backward order) an op that may send a gradient
    to another stage (one that reads another stage's value). Ops without a backward action
    (those that need no gradient: sizes, index ranges, a buffer's alias) join any segment.
    ``kind`` is each node's kind ("op", "input", "param", "buffer"); ``succs`` (each
    node's consumers) and ``bwd_at`` (each backward action's position by (micro-batch,
    node)) are found from ``preds`` and ``actions`` where not given. With ``units`` (each
    node's unit,
    :func:`~explorer.costs.strategies.unit_of`) a segment is also cut where the unit
    changes: a ZeRO 3 stage gathers its weights a unit at a time, as FSDP2 gathers a wrapped
    block's, and a segment holds what it gathers until it ends; a recomputing stage runs a
    unit's forward again in its backward, as checkpointing a block does.
    """
    if succs is None:
        succs = _successors(preds)
    if bwd_at is None:
        bwd_at = {(a.micro_batch, a.node): k for k, a in enumerate(actions) if a.kind == BWD}
    n = len(stage)
    remote = [kind[i] == "op" and stage[i] != s for i in range(n)]
    #: per op of the stage: its forward sends its value to another stage; its backward
    #: receives a gradient from another stage; its backward may send one to another stage
    mine = {a.node for a in actions if a.kind == FWD}
    sends = {i: any(stage[c] != s for c in succs[i]) for i in mine}
    receives = {i: bool(grad_sources(i, s, stage, succs, requires_grad)) for i in mine}
    grad_sends = {i: any(remote[p] and requires_grad[p] for p in preds[i]) for i in mine}

    runs: list[tuple[int, list[int]]] = []
    received: set[tuple[int, int]] = set()  # (micro-batch, node) values from other stages
    current: list[int] = []
    back = _BackwardRun()
    m_now = -1
    last_at = -2
    for k, a in enumerate(actions):
        if a.kind != FWD:
            continue
        m, i = a.micro_batch, a.node
        new = {(m, p) for p in preds[i] if remote[p] and (m, p) not in received}
        at = bwd_at.get((m, i))
        if current and (m != m_now or k != last_at + 1 or (new and back.sends_forward)
                        or (units is not None and units[i] != units[current[-1]])
                        or not back.admits(at, receives[i], grad_sends[i])):
            runs.append((m_now, current))
            current, back = [], _BackwardRun()
        current.append(i)
        back.add(at, receives[i], grad_sends[i], sends[i])
        received |= new
        m_now, last_at = m, k
    if current:
        runs.append((m_now, current))
    return runs


def _successors(preds: Sequence[Sequence[int]]) -> list[list[int]]:
    succs: list[list[int]] = [[] for _ in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    return succs


def _segment(m: int, nodes: list[int], s: int, stage: Sequence[int],
             preds: Sequence[Sequence[int]], succs: Sequence[Sequence[int]], loss: int | None,
             fwd_at: dict[tuple[int, int], int], bwd_at: dict[tuple[int, int], int]
             ) -> Segment:
    inside = set(nodes)
    backward = tuple(i for i in nodes if (m, i) in bwd_at)
    uses: dict[int, int] = {}
    backward_uses: dict[int, int] = {}
    for i in nodes:
        for p in preds[i]:
            if p not in inside:
                uses[p] = uses.get(p, 0) + 1
                backward_uses[p] = backward_uses.get(p, 0) + ((m, i) in bwd_at)
    outputs = tuple(sorted(i for i in nodes if i == loss
                           or any(c not in inside for c in succs[i])))
    at = [bwd_at[(m, i)] for i in nodes if (m, i) in bwd_at]
    return Segment(micro_batch=m, nodes=tuple(nodes), inputs=tuple(uses),
                   outputs=outputs, uses=tuple(uses.values()), backward_nodes=backward,
                   backward_uses=tuple(backward_uses.values()),
                   readers_after=tuple(sum(1 for c in succs[o] if stage[c] == s
                                           and c not in inside) for o in outputs),
                   forward_at=fwd_at[(m, nodes[0])], backward_at=min(at) if at else None)


class _BackwardRun:
    """What :func:`group_segments` needs of a growing segment to admit one more op, kept as
    the segment grows (each op's check is then constant time): its ops' backward positions,
    which are consecutive (``first`` .. ``last``), whether one of them receives a gradient
    from another stage or may send one, and whether an op's forward sends its value."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.last: int | None = None
        self.receives = self.sends = self.sends_forward = False

    def admits(self, at: int | None, receives: bool, sends: bool) -> bool:
        """Whether an op whose backward runs at position ``at`` (None: it has none) keeps
        the backward positions consecutive and, in backward order, no gradient receive
        after an op that may send one. Its position can only extend the run at either end:
        first in backward order (then it must not send before a receive of the run), or
        last (then it must not receive after a send of the run)."""
        if at is None or self.first is None:
            return True
        if at == self.first - 1:
            return not (sends and self.receives)
        if at == self.last + 1:
            return not (receives and self.sends)
        return False

    def add(self, at: int | None, receives: bool, sends: bool, sends_forward: bool) -> None:
        self.sends_forward = self.sends_forward or sends_forward
        if at is None:
            return
        self.first = at if self.first is None else min(self.first, at)
        self.last = at if self.last is None else max(self.last, at)
        self.receives = self.receives or receives
        self.sends = self.sends or sends
