"""Compiled segments: a segment's generated code run through ``torch.compile`` (inductor), for
``ex.run(..., runtime="segments", compile=True)`` (a pass over the code
:func:`explorer.runtime.segments.segment_code` makes).

The segment's ops are cut into pieces before each random op's reseed
(:func:`explorer.runtime.segments.reseed`); each piece becomes a module of its own, compiled on
its first call, and the segment's module calls the pieces in turn with the reseeds between
them, outside the compiler. Dynamo cannot trace ``Generator.manual_seed`` (it breaks the graph
there) and guards on a seed passed in as a number, compiling again for the next seed; kept
out, the seeds never reach it. The random op, first of its piece, draws from the generator as
the ATen op does (inductor's ``fallback_random``: the op itself, not inductor's own random
numbers), so a compiled run draws the masks the op path and the eager segments draw, and a
seeded run repeats.

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

from explorer.runtime.segments import SegmentCode, reseed

#: what ``torch.compile`` is told for every piece: random ops call the ATen op (on the
#: generator the segment reseeds) instead of inductor's own random numbers
COMPILE_OPTIONS: dict[str, Any] = {"fallback_random": True}


def compile_segment(code: SegmentCode) -> SegmentCode:
    """``code`` with its ops run through ``torch.compile`` in pieces cut at each reseed (the
    same inputs, outputs and calling convention; each piece compiles on its first call)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    root = torch.nn.Module()
    piece: list[torch.fx.Node] = []

    def flush() -> None:
        if not piece:
            return
        name = f"piece_{len(root._modules)}"
        reads, outs, module = _piece_module(piece)
        root.add_module(name, torch.compile(module, options=COMPILE_OPTIONS))
        made = graph.call_module(name, tuple(env[r] for r in reads))
        for k, o in enumerate(outs):
            env[o] = graph.call_function(operator.getitem, (made, k))
        piece.clear()

    for node in code.module.graph.nodes:
        if node.op == "call_function" and node.target is not reseed:
            piece.append(node)
            continue
        flush()
        env[node] = graph.node_copy(node, env.__getitem__)
    module = torch.fx.GraphModule(root, graph, class_name="CompiledSegment")
    return dataclasses.replace(code, module=module, forward=module.forward)


def _piece_module(nodes: list[torch.fx.Node]
                  ) -> tuple[list[torch.fx.Node], list[torch.fx.Node], torch.fx.GraphModule]:
    """The values a run of ops reads from outside it (in order of first use), those of its
    ops read outside it, and a module computing the latter from the former."""
    inside = set(nodes)
    reads = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = torch.fx.Graph()
    env = {r: graph.placeholder(r.name) for r in reads}
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outs))
    return reads, outs, torch.fx.GraphModule(torch.nn.Module(), graph, class_name="Piece")
