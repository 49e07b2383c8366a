"""Compiled segments: a segment's generated code run through ``torch.compile`` (inductor), for
``ex.run(..., runtime="segments", compile=True)`` (a pass over the code
:func:`explorer.runtime.segments.segment_code` makes).

The segment's ops are cut into pieces before each random op's reseed
(:func:`explorer.runtime.segments.reseed`) and around each checkpointed run of a recomputing
stage (:class:`explorer.runtime.segments.CheckpointedRun`); each piece becomes a module of its
own, compiled on its first call, and the segment's module calls the pieces in turn with the
reseeds between them, outside the compiler. Dynamo cannot trace ``Generator.manual_seed`` (it
breaks the graph there) and guards on a seed passed in as a number, compiling again for the
next seed; kept out, the seeds never reach it. The random op, first of its piece, draws from
the generator as the ATen op does (inductor's ``fallback_random``: the op itself, not
inductor's own random numbers), so a compiled run draws the masks the op path and the eager
segments draw, and a seeded run repeats.

Memory accounting on CPU ranks (:meth:`explorer.runtime.accounting.MemTracker.saving`) works
as for eager segments: the saved-tensor hooks around a segment's forward see what each
piece's compiled forward (AOTAutograd's) saves for its backward, which is what a compiled
segment holds between its forward and backward; it may be fewer and other tensors than the
eager ops save (a ReLU's boolean mask in place of its output, a fused chain's input only). A
ZeRO 3 stage's gathered weights are saved as references there too. On a tensor-parallel stage
each op is called through the stage's mesh in Python (DTensors): dynamo breaks its graphs at
those calls, so such a stage computes what its eager segments do but gains little.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from explorer.runtime.segments import (
    CheckpointedRun,
    SegmentCode,
    call_piece,
    piece_module,
    reseed,
)

#: what ``torch.compile`` is told for every piece: random ops call the ATen op (on the
#: generator the segment reseeds) instead of inductor's own random numbers
COMPILE_OPTIONS: dict[str, Any] = {"fallback_random": True}


def compile_segment(code: SegmentCode) -> SegmentCode:
    """``code`` with its ops run through ``torch.compile`` in pieces cut at each reseed (the
    same inputs, outputs and calling convention; each piece compiles on its first call)."""
    module = _compiled(code.module)
    return dataclasses.replace(code, module=module, forward=module.forward)


def _compiled(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``module``'s calls in compiled pieces cut at each reseed and each checkpointed run
    (:class:`~explorer.runtime.segments.CheckpointedRun`, which stays under
    ``torch.utils.checkpoint``, outside the compiler: its body is compiled the same way where
    it is checkpointed without a policy, "full", and runs eager where a policy chooses what
    to keep)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    root = torch.nn.Module()
    piece: list[torch.fx.Node] = []

    def flush() -> None:
        if not piece:
            return
        name = f"piece_{len(root._modules)}"
        reads, outs, part = piece_module(piece)
        root.add_module(name, torch.compile(part, options=COMPILE_OPTIONS))
        call_piece(graph, env, name, reads, outs)
        piece.clear()

    regions = {n for n in module.graph.nodes if n.op == "call_module"}
    for node in module.graph.nodes:
        if (node.op == "call_function" and node.target is not reseed
                and not (node.target is operator.getitem and node.args[0] in regions)):
            piece.append(node)
            continue
        flush()
        if node.op == "call_module":  # (a policy's run stays eager: torch's selective
            # checkpointing sees the ATen ops a compiled body no longer calls, and a
            # compiled body under it back-propagates NaN)
            run = module.get_submodule(node.target)
            body = _compiled(run.body) if run.how == "full" else run.body
            root.add_module(node.target, CheckpointedRun(body, run.how, run.buffers,
                                                         run._run))
        env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(root, graph, class_name="CompiledSegment")
