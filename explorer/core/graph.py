"""The captured computation graph of one training step: operations, tensors and module hierarchy."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx

#: node kinds: graph inputs (the batch), trainable parameters, buffers, and operations
KINDS = ("input", "param", "buffer", "op")


@dataclass(frozen=True)
class OpNode:
    """One node of the graph.

    ``inputs`` names the producer nodes this node reads, in argument order without repeats.
    ``saves`` names the producers (possibly this node itself) whose outputs autograd keeps for
    this node's backward; ``saved_extra_bytes`` counts saved tensors that are neither an input nor
    the output (masks, indices, statistics). FLOPs come from ``torch.utils.flop_counter``.
    """

    name: str
    kind: str
    op: str
    module_path: str = ""
    module_type: str = ""
    inputs: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    out_bytes: int = 0
    param_bytes: int = 0
    requires_grad: bool = False
    fwd_flops: int = 0
    bwd_flops: int = 0
    saves: tuple[str, ...] = ()
    saved_extra_bytes: int = 0
    #: bytes of memory the op's outputs share with an input (views): not new memory
    is_view: bool = False
    #: the most bytes the op's backward holds at once beyond its inputs' gradients: the
    #: gradients passed between the autograd nodes one captured op is made of (a
    #: cross-entropy's log-softmax gradient), held only while that backward runs
    backward_scratch_bytes: int = 0
    #: the share of ``fwd_flops`` and ``bwd_flops`` the op's kernels compute: a causal
    #: attention's flash kernel skips the score blocks its mask hides (about half), while
    #: its FLOPs count them all, as FlopCounterMode and Megatron-LM's formula do
    computed_fraction: float = 1.0

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops


def computed_share(nodes: Iterable[OpNode]) -> float:
    """The share of the ``nodes``' FLOPs their kernels compute (:attr:`OpNode.computed_fraction`
    weighted by each node's FLOPs; 1 where they count none)."""
    nodes = list(nodes)
    flops = sum(n.flops for n in nodes)
    if not flops:
        return 1.0
    return sum(n.flops * n.computed_fraction for n in nodes) / flops


@dataclass
class OpGraph:
    """Operations of one training step's forward pass, in topological order.

    The backward pass mirrors the forward graph: every node with ``requires_grad`` inputs has a
    backward task that sends gradients back along its input edges. ``source`` says how the graph
    was captured: ``"export"`` (ATen ops from ``torch.export``) or ``"hooks"`` (one node per leaf
    module, the fallback when export fails). ``loss`` names the node whose output is the loss.
    """

    name: str
    nodes: list[OpNode]
    batch_size: int
    source: str = "export"
    loss: str = ""
    notes: tuple[str, ...] = ()
    #: runtime objects kept for profiling and execution (never serialised)
    runtime: Any = field(default=None, repr=False, compare=False)
    #: the user's function that builds the model, ``"module:function"`` (empty: none given):
    #: exported scripts call it instead of carrying weights
    factory: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for n in self.nodes:
            if n.kind not in KINDS:
                raise ValueError(f"node {n.name!r} has unknown kind {n.kind!r}")
            for p in n.inputs:
                if p not in seen:
                    raise ValueError(f"node {n.name!r} reads {p!r} before it is produced")
            if n.name in seen:
                raise ValueError(f"duplicate node name {n.name!r}")
            seen.add(n.name)
        if not self.loss and self.nodes:
            self.loss = self.nodes[-1].name

    # -- lookups -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    def __getitem__(self, name: str) -> OpNode:
        return self.nodes[self.index[name]]

    def __contains__(self, name: str) -> bool:
        return name in self.index

    @cached_property
    def index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    @cached_property
    def preds(self) -> list[list[int]]:
        """Producer indices of each node."""
        return [[self.index[p] for p in n.inputs] for n in self.nodes]

    @cached_property
    def succs(self) -> list[list[int]]:
        """Consumer indices of each node."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for i, ps in enumerate(self.preds):
            for p in ps:
                out[p].append(i)
        return out

    @cached_property
    def edges(self) -> list[tuple[int, int, int]]:
        """(producer, consumer, bytes) for every edge."""
        return [(p, i, self.nodes[p].out_bytes) for i, ps in enumerate(self.preds) for p in ps]

    @property
    def ops(self) -> list[OpNode]:
        return [n for n in self.nodes if n.kind == "op"]

    @property
    def param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes if n.kind != "buffer")

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    @cached_property
    def fingerprint(self) -> str:
        """A stable hash of structure, shapes and dtypes: equal graphs, equal fingerprints."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(json.dumps([n.name, n.kind, n.op, n.inputs, n.shapes, n.dtype,
                                 n.param_bytes, n.module_path]).encode())
        h.update(str(self.batch_size).encode())
        return h.hexdigest()[:16]

    # -- module hierarchy ----------------------------------------------------------------
    def owner(self, i: int) -> int:
        """Index of the node a parameter, buffer or input lives with: its first consumer.

        They follow their first consumer when a placement is made from the ops alone.
        """
        n = self.nodes[i]
        if n.kind in ("param", "buffer", "input") and self.succs[i]:
            return self.succs[i][0]
        return i

    def layer_key(self, i: int, depth: int | None = None) -> str:
        """The module a node belongs to, cut to ``depth`` path components (None: the leaf)."""
        j = self.owner(i)
        path = self.nodes[j].module_path
        if depth is not None:
            path = ".".join(path.split(".")[:depth]) if path else ""
        return path

    def layers(self, depth: int | None = None) -> list[list[int]]:
        """Runs of consecutive ops (in topological order) belonging to the same module.

        Parameters, buffers and inputs join their owner's layer. Every op lands in exactly
        one layer and the layers are in topological order, so cutting this list into
        contiguous pieces always gives stages whose quotient graph is acyclic.
        """
        groups: list[list[int]] = []
        last = None
        owned: dict[int, list[int]] = {}
        for i, n in enumerate(self.nodes):
            if n.kind != "op":
                owned.setdefault(self.owner(i), []).append(i)
        for i, n in enumerate(self.nodes):
            if n.kind != "op":
                continue
            key = self.layer_key(i, depth)
            if key != last or not groups:
                groups.append([])
                last = key
            groups[-1].extend(owned.get(i, []))
            groups[-1].append(i)
        orphans = [i for i, n in enumerate(self.nodes)
                   if n.kind != "op" and self.owner(i) == i]
        if orphans:
            if not groups:
                groups.append([])
            groups[0][:0] = orphans
        return groups

    def module_depth(self) -> int:
        return max((n.module_path.count(".") + 1 for n in self.nodes if n.module_path), default=0)

    # -- conversions ---------------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, kind=n.kind, op=n.op, module=n.module_path,
                       out_bytes=n.out_bytes, fwd_flops=n.fwd_flops, bwd_flops=n.bwd_flops)
        for p, c, b in self.edges:
            g.add_edge(self.nodes[p].name, self.nodes[c].name, bytes=b)
        return g

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "nodes": len(self.nodes),
            "ops": sum(1 for n in self.nodes if n.kind == "op"),
            "params_bytes": self.param_bytes,
            "gflops_per_step": self.total_flops / 1e9,
            "batch_size": self.batch_size,
            "fingerprint": self.fingerprint,
        }
