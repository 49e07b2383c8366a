"""Tensor parallelism on one stage: its weights as DTensors on a device mesh of each tensor
group's ranks, placed as :func:`~explorer.core.tensor_layout.plan_placements` says; the ops the
layout splits read DTensors, so the exported program's ATen calls run unchanged and DTensor's
sharding propagation and redistribution do the communication, and the others run on whole
plain tensors.

A split op's partial sums are all-reduced once, right after it; what a whole op, another
stage or the memory accounting (each rank's local shard) reads of a DTensor is made plain.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.tensor_layout import REPLICATE, RESHAPE_OPS, megatron_layout, shard_dim


def check_supported(graph: OpGraph, plan: Plan) -> None:
    """The runtime runs tensor-parallel stages (replicated or not, in pipelines or alone)
    whose weights no other stage reads, and that hold the whole of each head-split
    attention core they hold part of."""
    for s in range(len(plan.stages)):
        if plan.tensor_of(s) == 1:
            continue
        for name in megatron_layout(graph, plan.tensor_of(s)).local_ops:
            i = graph.index[name]
            if plan.stage_of(name) == s and any(
                    plan.stage_of(graph.nodes[c].name) != s for c in graph.succs[i]):
                raise ExplorerError(f"{name!r} of a head-split attention on tensor-parallel "
                                    f"stage {s} sends its value to another stage; the runtime "
                                    "cannot run that: keep each attention on one stage")
        for i, n in enumerate(graph.nodes):
            crossing = [c for c in graph.succs[i] if plan.stage_of(graph.nodes[c].name)
                        != plan.stage_of(n.name)]
            if n.kind in ("param", "buffer") and crossing and s in (
                    plan.stage_of(n.name), *(plan.stage_of(graph.nodes[c].name)
                                             for c in crossing)):
                raise ExplorerError(f"weight {n.name!r} is read on another stage than its own, "
                                    f"and one of them (stage {s}) is tensor-parallel; the "
                                    "runtime cannot run that yet: place the weight with its "
                                    "consumers")


class TensorMesh:
    """One rank's view of its stage's tensor mesh and the layout of its weights."""

    def __init__(self, device_type: str, ranks: list[int], placements: dict[str, str]
                 ) -> None:
        self.mesh = DeviceMesh(device_type, ranks)
        self.placements = placements
        #: ops without a sharding rule, run on whole values (see :meth:`call`)
        self.no_rule_ops: set[Any] = set()

    @classmethod
    def of_rank(cls, plan: Plan, stage: int, rank: int, device_type: str,
                placements: dict[str, str]) -> TensorMesh | None:
        """The mesh of ``rank``'s tensor group (its replica of ``stage``), or None where the
        stage is not tensor-parallel.

        Every rank makes every tensor group's mesh, in stage order, as the process groups
        behind them require."""
        mine = None
        for s, devs in enumerate(plan.stages):
            k = plan.tensor_of(s)
            for r in range(len(devs) // k if k > 1 else 0):
                ranks = [plan.devices.index(d) for d in devs[r * k:(r + 1) * k]]
                mesh = cls(device_type, ranks, placements)
                mine = mesh if s == stage and rank in ranks else mine
        return mine

    def distribute(self, name: str, t: torch.Tensor) -> DTensor:
        """Weight ``name`` (the same whole tensor on every rank) as its placement says; each
        rank keeps its shard, nothing is sent."""
        dim = shard_dim(self.placements.get(name, REPLICATE))
        placement = Replicate() if dim is None else Shard(dim)
        return distribute_tensor(t, self.mesh, [placement], src_data_rank=None)

    def enter(self, value: Any) -> Any:
        """``value`` with every plain tensor in it as a replicated DTensor (the batch, buffers,
        constants the program makes)."""
        return tree_map(lambda t: DTensor.from_local(t, self.mesh, [Replicate()],
                                                     run_check=False)
                        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t,
                        value)

    def call(self, fn: Any, args: Any, kwargs: Any, split: bool, local: bool = False) -> Any:
        """``fn(*args, **kwargs)``: a ``local`` op (of head-split attention) on this rank's
        own heads (:meth:`on_heads`); a ``split`` op on DTensors (plain inputs enter replicated;
        its split weights already are DTensors), so DTensor's sharding rules do the work and
        the communication; any other op on every rank on whole plain tensors, as one device
        runs it (DTensor's dispatch costs more than a small op), random ops included (every
        rank draws the mask one device would). A split op DTensor has no rule for
        (``NotImplementedError``) runs whole too. Differentiable either way."""
        if local:
            return self.on_heads(fn, args, kwargs)
        if split and fn not in self.no_rule_ops:
            try:
                return fn(*self.enter(args), **self.enter(kwargs))
            except NotImplementedError:
                self.no_rule_ops.add(fn)
        args, kwargs = tree_map(lambda t: self.whole(t).to_local() if isinstance(t, DTensor)
                                else t, (args, kwargs))
        out = fn(*args, **kwargs)
        return self.enter(out) if split else out

    def on_heads(self, fn: Any, args: Any, kwargs: Any) -> Any:
        """``fn`` on the local shards of its DTensor inputs (no communication) and its whole
        plain ones, a view's or reshape's head count (the third of ``(batch, seq, heads,
        head_dim)``) or feature count (the last of ``(batch, seq, features)``) divided by the
        degree; its outputs as DTensors of those shards split along their last dimension,
        which is how the row-parallel projection that ends the block reads its input (what
        the others read, their local shards, is the same either way)."""
        args, kwargs = tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t,
                                (args, kwargs))
        if str(fn) in RESHAPE_OPS:
            args = (args[0], self.local_shape(args[0], list(args[1])), *args[2:])
        out = fn(*args, **kwargs)
        return tree_map(lambda t: DTensor.from_local(t, self.mesh, [Shard(t.ndim - 1)],
                                                     run_check=False)
                        if isinstance(t, torch.Tensor) and t.ndim else t, out)

    def local_shape(self, x: torch.Tensor, shape: list[int]) -> list[int]:
        """``shape`` (of the whole tensor) for this rank's heads of it (see :meth:`on_heads`)."""
        k = self.mesh.size()
        d = 2 if len(shape) == 4 else len(shape) - 1
        if len(shape) not in (3, 4) or shape[d] % k:
            raise ExplorerError(f"cannot split a view to {shape} by heads {k} ways; run the "
                                "attention whole (tensor degree 1 on its stage)")
        shape[d] //= k
        if -1 not in shape and torch.Size(shape).numel() != x.numel():
            raise ExplorerError(f"a view of this rank's heads ({tuple(x.shape)}) to {shape} "
                                "does not fit; run the attention whole (tensor degree 1 on "
                                "its stage)")
        return shape

    def matching(self, grads: list, is_dtensor: list[bool]) -> list:
        """Gradients received from another stage (plain, whole) as the outputs they are for:
        replicated DTensors where those are DTensors."""
        return [self.enter(g) if dt and isinstance(g, torch.Tensor) else g
                for g, dt in zip(grads, is_dtensor, strict=False)]

    def settled(self, value: Any) -> Any:
        """``value`` with its partial sums all-reduced: an op's output is reduced once, right
        after the op (as the simulator counts it), however many ops read it; a
        vocabulary-parallel embedding's masked partial sums can be reduced only once."""
        return tree_map(lambda t: _Reduced.apply(t) if isinstance(t, DTensor)
                        and any(p.is_partial() for p in t.placements) else t, value)

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` replicated on every rank (all-reduced or all-gathered as its placement needs);
        differentiable."""
        return t.redistribute(self.mesh, [Replicate()]) if isinstance(t, DTensor) else t


    def plain(self, value: Any) -> Any:
        """``value`` with every DTensor in it as the whole plain tensor (what is sent to
        another stage); every rank of the mesh must call it (it gathers)."""
        return tree_map(lambda t: self.whole(t.detach()).to_local()
                        if isinstance(t, DTensor) else t, value)


class _Reduced(torch.autograd.Function):
    """Partial sums all-reduced; the gradient of every rank's part is the (replicated)
    gradient of the sum. (DTensor's own backward would lay that gradient out as the partial
    input, which it cannot do for an embedding's masked partial sums.)"""

    @staticmethod
    def forward(ctx, t):  # type: ignore[override]
        return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.redistribute(g.device_mesh, [Replicate()] * g.device_mesh.ndim)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or ``t`` itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def like(t: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` laid out as ``t``: a DTensor of that local shard where ``t`` is one."""
    if isinstance(t, DTensor):
        return DTensor.from_local(shard, t.device_mesh, t.placements, run_check=False)
    return shard


def placed_like(t: torch.Tensor, like_: torch.Tensor) -> torch.Tensor:
    """``t`` redistributed to ``like_``'s placements where both are DTensors that differ."""
    if isinstance(t, DTensor) and isinstance(like_, DTensor) and \
            tuple(t.placements) != tuple(like_.placements):
        with torch.no_grad():
            return t.redistribute(like_.device_mesh, like_.placements)
    return t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered from every rank of a DTensor), or ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
