"""Segments: a rank's forward ops grouped into the largest runs that execute as one piece of
generated code, each with one autograd backward (the compiler half of the segment runtime;
:class:`explorer.runtime.stage.StageRunner` runs them, ``runtime="segments"``).

A segment is a run of forward actions of one stage that are consecutive in the rank's action
order and all of one micro-batch. A value made on another stage is a segment input, received
before the segment starts; its outputs are sent when it ends. Its backward runs at the first
backward action of its ops in the rank's order, as one ``torch.autograd.backward`` from the
gradients of its outputs (as ``torch.distributed.pipelining``'s ``stage_backward`` does),
after receiving every gradient they need from other stages, and sends its inputs' gradients
when it ends; so the backward actions of its ops must be consecutive too. Moving a receive
earlier than the op path does could deadlock only where it passes a send (the other rank may
need what is sent to make what is received), so a run is cut where a receive would pass a send
of the op path's order: before an op that reads a value of another stage no earlier op
received, when an op before it in the segment sends its value to another stage; and where an
op that waits for a gradient from another stage has its backward after one that sends a
gradient. Each segment thus receives, computes and sends in an order that adds no deadlock
to the op path's (whose order is a piece of one global topological order).

Each segment becomes a ``torch.fx.GraphModule`` built from the job's op calls, called through
its generated Python code; a random op (dropout) is preceded by a call that seeds the
generator with what the op path draws (:func:`explorer.runtime.stage.draw_seed`), so both paths
draw the same masks.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from explorer.core.errors import ExplorerError
from explorer.core.segments import Segment
from explorer.runtime.checkpointing import Checkpointing
from explorer.runtime.jobfiles import RUNTIMES, OpCall, Ref, Runtime, map_leaves


def rerunning_units(units: Sequence[str], reruns: Sequence[bool] | None) -> list[str]:
    """Per node, its unit where recomputation runs an op of that unit again (``reruns``, the
    job's; None: every unit), else "": the segments of a recomputing stage are cut where such
    a unit starts or ends (its segment is checkpointed), not between units that run nothing
    again."""
    if reruns is None:
        return list(units)
    again = {u for u, r in zip(units, reruns, strict=True) if r}
    return [u if u in again else "" for u in units]


def choose_runtime(asked: Runtime | None, compile: bool) -> Runtime:
    """The runtime a run (or an exported script) uses: ``asked``, by default the segments,
    which run every plan (the op path stays as the profiler's way to time single ops, and to
    compare with). ``compile=True`` compiles the segments' code, so it needs them."""
    if asked is not None and asked not in RUNTIMES:
        raise ExplorerError(f"runtime must be one of {', '.join(map(repr, RUNTIMES))}, not "
                            f"{asked!r}")
    if not isinstance(compile, bool):
        raise ExplorerError(f"compile must be True or False, not {compile!r}")
    if compile and asked == "ops":
        raise ExplorerError("compile=True compiles the segments' code, and runtime='ops' runs "
                            "one op at a time: use runtime='segments' (--runtime segments), "
                            "or compile=False")
    return asked or "segments"


def reseed(generator: torch.Generator, seed: int) -> None:
    """Seed ``generator`` (called by a segment's code before each random op)."""
    generator.manual_seed(seed)


@dataclass(frozen=True)
class SegmentCode:
    """A segment's generated code: call ``forward(*reads, generator, *seeds)`` (generator
    and seeds only when ``random`` is not empty) for a tuple of the segment's outputs."""

    module: torch.fx.GraphModule
    #: the random ops, in order: one seed each (:func:`explorer.runtime.stage.draw_seed`)
    random: tuple[int, ...]
    forward: Callable[..., tuple[Any, ...]]
    #: per placeholder before the generator, the input it takes and whether the ops that
    #: read it there are split ops whose gradient of it is a partial sum (tensor
    #: parallelism: an input read both ways comes in twice, once for each)
    reads: tuple[tuple[int, bool], ...]


def segment_code(segment: Segment, calls: Sequence[OpCall], targets: Sequence[Any],
                 random: Sequence[bool],
                 split_reads: Callable[[int, int], bool] | None = None,
                 partial: Callable[[Any], Any] | None = None,
                 regions: CheckpointRegions | None = None) -> SegmentCode:
    """The ``torch.fx`` module that runs ``segment``'s ops: one placeholder per input (then
    the generator and a seed per random op), each op called as the op path calls it (same
    target, same arguments), a reseed before each random op, its outputs as a tuple.

    On a tensor-parallel stage, ``split_reads(i, p)`` says whether op ``i``'s gradient of
    its input ``p`` is a partial sum when ``p`` is whole (``i`` runs on local shards): such
    ops read an input through a placeholder of their own, and a value the segment makes
    through ``partial`` (called once per value: :meth:`~explorer.runtime.tensor_parallel.
    TensorMesh.partial_entry`), so that their partial sums are kept apart from the whole
    gradients and made whole as the op path makes them."""
    graph = torch.fx.Graph()
    index = {c.name: k for k, c in enumerate(calls)}
    readers: dict[int, list[int]] = {}  # per node, the segment's ops that read it
    for i in segment.nodes:
        for name in dict.fromkeys(calls[i].inputs):
            readers.setdefault(index[name], []).append(i)

    def is_split(i: int, p: int) -> bool:
        return split_reads is not None and split_reads(i, p)

    # (node name, read by split ops) -> the fx node it is read as
    value: dict[tuple[str, bool], torch.fx.Node] = {}
    reads: list[tuple[int, bool]] = []
    for p in segment.inputs:
        for split in sorted({is_split(i, p) for i in readers[p]}):
            name = _identifier(calls[p].name) + ("_split" if split else "")
            value[(calls[p].name, split)] = graph.placeholder(name)
            reads.append((p, split))
    drawn = tuple(i for i in segment.nodes if random[i])
    owner: dict[torch.fx.Node, int] = {}  # each call -> the op it runs (or seeds, or enters)
    generator = graph.placeholder("generator") if drawn else None
    seeds = {i: graph.placeholder(f"seed_{i}") for i in drawn}

    for i in segment.nodes:
        call = calls[i]

        def node_of(v: Any, i: int = i) -> Any:
            if not isinstance(v, Ref):
                return v
            key = (v.name, is_split(i, index[v.name]))
            return value[key] if key in value else value[(v.name, not key[1])]

        if i in seeds:
            owner[graph.call_function(reseed, (generator, seeds[i]))] = i
        out = graph.call_function(
            targets[i], map_leaves(call.args, node_of), map_leaves(call.kwargs, node_of))
        owner[out] = i
        value[(call.name, False)] = out
        if partial is not None and any(is_split(c, i) for c in readers.get(i, ())):
            value[(call.name, True)] = graph.call_function(partial, (out,))
            owner[value[(call.name, True)]] = i
    graph.output(tuple(value[(calls[o].name, False)] for o in segment.outputs))
    module = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="Segment")
    if regions is not None:
        module = _checkpointed_runs(module, segment, regions, owner,
                                    [p for p, _ in reads])
    return SegmentCode(module=module, random=drawn, forward=module.forward,
                       reads=tuple(reads))


@dataclass(frozen=True)
class CheckpointRegions:
    """Which of a recomputing stage's ops a segment checkpoints, and how
    (:func:`segment_code`)."""

    #: per node, the unit whose ops run again in a backward
    #: (:func:`rerunning_units`), "" for an op that is not checkpointed
    units: Sequence[str]
    #: per node, whether it is a buffer (read from outside checkpoint, as a module reads its
    #: buffers: a batch norm's step count, which a kept op updates in place, is no input)
    buffer: Sequence[bool]
    #: how a run of ops (their nodes) is checkpointed
    #: (:func:`~explorer.runtime.checkpointing.checkpointing`)
    how: Callable[[list[int]], Checkpointing]
    #: what runs a :class:`CheckpointedRun` (``torch.utils.checkpoint`` around its body, the
    #: rank's precision and memory counting with it)
    run: Callable[[CheckpointedRun, tuple], Any]


class CheckpointedRun(torch.nn.Module):
    """Consecutive ops of a segment of one unit that runs ops again, called as one function
    under ``torch.utils.checkpoint`` from the segment's code, as a user checkpoints a block
    inside the model's forward: the segment keeps one autograd backward."""

    def __init__(self, body: torch.fx.GraphModule, how: Checkpointing,
                 buffers: tuple[bool, ...], run: Callable[[CheckpointedRun, tuple], Any]
                 ) -> None:
        super().__init__()
        self.body = body
        self.how = how
        #: per argument of ``body``, whether it is a buffer
        self.buffers = buffers
        self._run = run

    def forward(self, *reads: Any) -> Any:
        return self._run(self, reads)


def _checkpointed_runs(module: torch.fx.GraphModule, segment: Segment,
                       regions: CheckpointRegions, owner: dict[torch.fx.Node, int],
                       placeholder_nodes: list[int]) -> torch.fx.GraphModule:
    """``module`` (a segment's code) with each maximal run of consecutive ops of one unit of
    ``regions`` that has a backward (with the calls ``owner`` says are of its ops: reseeds
    before its random ops, partial-sum entries after them) moved into a
    :class:`CheckpointedRun`; the rest as it was. ``placeholder_nodes``: the node each
    placeholder before the generator reads."""
    backward = set(segment.backward_nodes)
    runs: list[list[int]] = []
    before = ""  # the unit of the op before
    for i in segment.nodes:
        unit = regions.units[i]
        if unit and unit == before:
            runs[-1].append(i)
        elif unit:
            runs.append([i])
        before = unit
    run_of = {i: k for k, r in enumerate(runs) if backward.intersection(r) for i in r}
    if not run_of:
        return module
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    buffer_of = {ph: k < len(placeholder_nodes) and regions.buffer[placeholder_nodes[k]]
                 for k, ph in enumerate(placeholders)}
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    piece: list[torch.fx.Node] = []

    def flush() -> None:
        if not piece:
            return
        reads, outs, body = piece_module(piece)
        name = f"checkpointed_{len(root._modules)}"
        how = regions.how(runs[run_of[owner[piece[-1]]]])
        root.add_module(name, CheckpointedRun(
            body, how, tuple(buffer_of.get(r, False) for r in reads), regions.run))
        call_piece(graph, env, name, reads, outs)
        piece.clear()

    for node in module.graph.nodes:
        k = run_of.get(owner.get(node, -1))
        if k is not None and (not piece or run_of[owner[piece[-1]]] == k):
            piece.append(node)
            continue
        flush()
        if k is not None:
            piece.append(node)
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(root, graph, class_name="Segment")


def piece_module(nodes: list[torch.fx.Node]
                 ) -> tuple[list[torch.fx.Node], list[torch.fx.Node], torch.fx.GraphModule]:
    """The values a run of fx calls reads from outside it (in order of first use), those of
    its calls read outside it, and a module computing the latter (a tuple) from the former."""
    inside = set(nodes)
    reads = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = torch.fx.Graph()
    env = {r: graph.placeholder(r.name) for r in reads}
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outs))
    return reads, outs, torch.fx.GraphModule(torch.nn.Module(), graph, class_name="Piece")


def call_piece(graph: torch.fx.Graph, env: dict[torch.fx.Node, torch.fx.Node], name: str,
               reads: list[torch.fx.Node], outs: list[torch.fx.Node]) -> None:
    """Call submodule ``name`` (made by :func:`piece_module`) in ``graph`` on what ``env``
    maps its ``reads`` to, and map each of its ``outs`` to its item of the result."""
    made = graph.call_module(name, tuple(env[r] for r in reads))
    for k, o in enumerate(outs):
        env[o] = graph.call_function(operator.getitem, (made, k))


def _identifier(name: str) -> str:
    """A Python identifier for a node name (fx makes it unique)."""
    text = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return text if text and not text[0].isdigit() else f"n_{text}"
