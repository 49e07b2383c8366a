"""Tensor parallelism on one stage: its split weights as DTensors on a device mesh of each
tensor group's ranks, placed as :func:`~explorer.core.plan_layout.plan_placements` says, and
the ops the layout splits run Megatron-style on local shards: a column-parallel linear or
convolution on its weight's shard and its whole input, the ops between on their local shards
(split along the features, or a convolution's channels; a head-split attention's on the rank's
own heads), a row-parallel one's partial sums all-reduced right after it. The only
communication is the layout's collectives (and DTensor's, for the vocabulary-parallel
embedding, whose masked lookup it runs, and a vocabulary-parallel loss's,
:mod:`explorer.runtime.vocab_loss`): no per-op DTensor dispatch. Other ops run on whole
plain tensors, as one device runs them.

The gradient of a whole value that split ops read is a partial sum on every rank; the stage
all-reduces it once, after the last of those ops' backward (:mod:`explorer.runtime.stage`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_leaves, tree_map

from explorer.core.errors import ExplorerError, PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan, check_tensor_alone
from explorer.core.plan_layout import stage_layout
from explorer.core.tensor_layout import (
    EMBEDDING_OPS,
    REPLICATE,
    RESHAPE_OPS,
    SEQUENCE_RANDOM,
    SPLIT_OPS,
    TRANSPOSED_OPS,
    shard_dim,
    shard_parts,
    split_dim,
)
from explorer.devices.cluster import Cluster
from explorer.platforms import platform_of
from explorer.runtime.head_shapes import (
    expanded_sizes,
    transposed_dim,
    unsqueezed_dim,
    view_of_heads,
    whole_shape,
)
from explorer.runtime.sequence_parallel import (
    SEQ_DIM,
    ScatteredSequence,
    SequenceColumnLinear,
    reduce_partial_grads,
)
from explorer.runtime.tensor_collectives import AllReduced, Gathered, PartialGrad
from explorer.runtime.vocab_loss import VOCAB_CALLS, on_vocab


def check_async_tensor(plan: Plan, cluster: Cluster | None) -> None:
    """Refuse a stage with async tensor parallelism on devices that would pipeline its
    collectives (GPUs): the runtime runs them in turn, so its step would not be the one
    predicted. (CPU ranks cannot pipeline them: the prediction is plain sequence
    parallelism's, which they run.)"""
    if cluster is None:
        return
    for s in range(len(plan.stages)):
        if plan.settings_of(s).async_tensor and any(
                platform_of(cluster.device(d).kind).pipelines_tensor_collectives
                for d in plan.stages[s]):
            raise PlanError(f"stage {s} asks for async tensor parallelism on "
                            f"{plan.stages[s][0]}, whose collectives the explorer's runtime "
                            "runs in turn: export the plan as a native script (explorer export "
                            "--native; it compiles the blocks with torch's async tensor "
                            "parallelism), or set async_tensor off to run it here")


def check_supported(graph: OpGraph, plan: Plan) -> None:
    """The runtime runs tensor-parallel stages (replicated or not, in pipelines or alone)
    whose weights no other stage reads, that hold the whole of each head-split attention
    core they hold part of, and each sequence-scattered transposed linear with its view;
    without ZeRO, recomputation or reduced precision (:func:`check_tensor_alone`)."""
    check_tensor_alone(plan)
    def elsewhere(i: int) -> list[int]:  # node i's readers on another stage than its own
        own = plan.stage_of(graph.nodes[i].name)
        return [c for c in graph.succs[i] if plan.stage_of(graph.nodes[c].name) != own]

    for s in range(len(plan.stages)):
        if plan.tensor_of(s) == 1:
            continue
        layout = stage_layout(graph, plan, s)
        for name in layout.partial_rows:
            cut = [graph.nodes[c].name for c in elsewhere(graph.index[name])]
            if cut and s in (plan.stage_of(name), plan.stage_of(cut[0])):
                raise ExplorerError(f"a stage ends between {name!r}, a row-parallel projection "
                                    f"whose partial sums sequence parallelism scatters, and "
                                    f"{cut[0]!r}, the view that scatters them; the runtime "
                                    "cannot run that: move the cut after the view, or set "
                                    "sequence off")
        for name in layout.local_ops:
            if plan.stage_of(name) == s and elsewhere(graph.index[name]):
                raise ExplorerError(f"{name!r} of a head-split attention on tensor-parallel "
                                    f"stage {s} sends its value to another stage; the runtime "
                                    "cannot run that: keep each attention on one stage")
        for i, n in enumerate(graph.nodes):
            crossing = elsewhere(i)
            if n.kind in ("param", "buffer") and crossing and s in (
                    plan.stage_of(n.name), *(plan.stage_of(graph.nodes[c].name)
                                             for c in crossing)):
                raise ExplorerError(f"weight {n.name!r} is read on another stage than its own, "
                                    f"and one of them (stage {s}) is tensor-parallel; the "
                                    "runtime cannot run that yet: place the weight with its "
                                    "consumers")


class TensorMesh:
    """One rank's view of its stage's tensor mesh and the layout of its weights.

    Split weights are DTensors (each rank holds its shard); replicated weights are plain
    tensors. Values between ops are plain tensors: whole, or (the outputs of split ops that no
    all-reduce ends) this rank's local shard, which :meth:`call` marks with the dimension it
    splits (:meth:`split_dim`)."""

    def __init__(self, device_type: str, ranks: list[int], placements: dict[str, str]
                 ) -> None:
        self.mesh = DeviceMesh(device_type, ranks)
        self.degree = self.mesh.size()
        self.placements = placements
        #: id -> (weak reference, split dimension from the end) of every local shard of a
        #: split op's output alive
        self.shards: dict[int, tuple[weakref.ref, int]] = {}
        #: id -> weight read whole by a sequence-parallel op (its gradient a partial sum)
        self.sequence_params: dict[int, torch.Tensor] = {}
        #: id -> a row-parallel transposed linear's partial sums, for the view after it to
        #: reduce-scatter along the sequence (:meth:`scattered_rows`)
        self.partial_rows: dict[int, weakref.ref] = {}

    @functools.cached_property
    def group(self) -> Any:
        """The process group of the mesh (asked for on its ranks only)."""
        return self.mesh.get_group()

    @functools.cached_property
    def index(self) -> int:
        """This rank's place in the mesh."""
        return self.mesh.get_local_rank()

    @classmethod
    def of_rank(cls, plan: Plan, stage: int, rank: int, device_type: str,
                placements: dict[str, str]) -> TensorMesh | None:
        """The mesh of ``rank``'s tensor group (its replica of ``stage``), or None where the
        stage is not tensor-parallel.

        Every rank makes every tensor group's mesh, in stage order, as the process groups
        behind them require. DTensor's layout caches are emptied first: a rank that ran
        another job before (a :class:`~explorer.runtime.pool.RankPool`'s) would otherwise
        lay out its values on the earlier run's meshes, equal to this run's by ranks but
        bound to process groups since destroyed, or that now name other ranks."""
        _clear_sharding_prop_cache()
        mine = None
        for s, devs in enumerate(plan.stages):
            k = plan.tensor_of(s)
            for r in range(len(devs) // k if k > 1 else 0):
                ranks = [plan.devices.index(d) for d in devs[r * k:(r + 1) * k]]
                mesh = cls(device_type, ranks, placements)
                mine = mesh if s == stage and rank in ranks else mine
        return mine

    def distribute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Weight ``name`` (the same whole tensor on every rank) as its placement says: a
        DTensor of this rank's shard where it is split, else ``t`` itself; nothing is sent."""
        placement = self.placements.get(name, REPLICATE)
        dim, parts = shard_dim(placement), shard_parts(placement)
        if dim is None:
            return t
        return distribute_tensor(t, self.mesh, [Shard(dim) if parts == 1 else
                                                _StridedShard(dim, split_factor=parts)],
                                 src_data_rank=None)

    # -- ops -------------------------------------------------------------------------------
    def call(self, fn: Any, args: Any, kwargs: Any, split: bool, local: bool = False,
             sequence: bool = False) -> Any:
        """``fn(*args, **kwargs)``, differentiable: a ``local`` op (of head-split attention)
        on this rank's own heads (:meth:`on_heads`); a ``split`` op on this rank's shards
        (:meth:`on_shards`), but a vocabulary-parallel embedding, which DTensor runs (its
        masked lookup; :meth:`settled` reduces its partial sums) and a vocabulary-parallel
        loss and the shape ops before it (:func:`~explorer.runtime.vocab_loss.on_vocab`); any
        other op on whole plain tensors, as one device runs it, a local shard it reads
        gathered first (a random op in a split block: every rank draws the mask one device
        would). ``sequence``: the op's output is split along the sequence (a row-parallel
        linear's reduce-scattered; a token-wise op's, on sequence shards, as it is; the view of
        a transposed linear's partial sums, reduce-scattered: :meth:`scattered_rows`).

        A column-parallel linear reading a sequence shard gathers it
        (:class:`~explorer.runtime.sequence_parallel.SequenceColumnLinear`)."""
        if sequence and args and self.is_partial_rows(args[0]):
            return self.scattered_rows(fn, args, kwargs)
        if local:
            return self.on_heads(fn, args, kwargs)
        if split and str(fn) in EMBEDDING_OPS:
            return fn(*self.enter(args), **self.enter(kwargs))
        if split and str(fn) in VOCAB_CALLS:
            return on_vocab(self, fn, args, kwargs)
        if split:
            return self.on_shards(fn, args, kwargs, sequence)
        return fn(*mapped(self.whole_plain, args), **mapped(self.whole_plain, kwargs))

    def run_op(self, fn: Any, args: Any, kwargs: Any, split: bool, local: bool,
               sequence: bool, loss: bool) -> Any:
        """An op of the stage as both runtimes call it: :meth:`call`, then its output
        :meth:`settled` (the loss made :meth:`whole`, on every rank)."""
        out = self.call(fn, args, kwargs, split, local, sequence)
        return self.whole(out) if loss else self.settled(out, sequence)

    def op(self, fn: Any, name: str, split: bool, local: bool, sequence: bool,
           loss: bool) -> Any:
        """``fn`` as a function a segment's code calls in its place (:meth:`run_op` with
        these flags), named ``name`` in that code."""
        def tensor_op(*args: Any, **kwargs: Any) -> Any:
            return self.run_op(fn, args, kwargs, split, local, sequence, loss)
        tensor_op.__name__ = tensor_op.__qualname__ = name
        return tensor_op

    def partial_entry(self, value: Any) -> Any:
        """``value`` as split ops read it inside a segment: each whole tensor that needs a
        gradient through :class:`PartialGrad` (the sum of those ops' partial gradients
        all-reduced once, Megatron's ``f``); local shards as they are."""
        def enter(t: Any) -> Any:
            if (isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
                    and not self.is_shard(t) and not self.is_partial_rows(t)):
                return PartialGrad.apply(t, self.group)
            return t
        return mapped(enter, value)

    def on_shards(self, fn: Any, args: Any, kwargs: Any, sequence: bool = False) -> Any:
        """A split op on local shards, Megatron-style: split weights' shards, the local shards
        of split ops' outputs as they are, whole inputs as they are where the op reads them
        whole (a column-parallel op's input, what broadcasts) or narrowed to this rank's part
        of their split dimension where it reads them split (a row-parallel linear's input
        after a random op ran whole). A row-parallel op's partial sums are all-reduced right
        away and its bias added after (along a convolution's channels); any other output is
        a local shard, split along the features (a linear's), the channels (a
        convolution's), or as the local shards it reads are. Under sequence parallelism
        (``sequence``) a row-parallel op's partial sums are reduce-scattered along the
        sequence instead, and the replicated weights a token-wise op reads get their partial
        gradients all-reduced once a step (:meth:`reduce_sequence_grads`)."""
        args, kwargs = list(args), dict(kwargs)
        if str(fn) in TRANSPOSED_OPS and isinstance(args[2], DTensor):
            return self.transposed(fn, args, kwargs, sequence)
        weight = next((t for t in args if isinstance(t, DTensor)), None)
        dim = -1 if weight is None else split_dim(weight.ndim)
        row = weight is not None and weight.placements[0] == Shard(1)
        if weight is not None and not row and self.split_dim(args[0]) == SEQ_DIM:
            return self.marked(SequenceColumnLinear.apply(
                args[0], *(self.local(t) for t in args[1:3]),
                *([None] if len(args) < 3 else []), self.group, self.degree))
        if sequence and weight is None:
            return self.on_positions(fn, args, kwargs)
        bias = None
        if row:  # (linear(input, weight, bias), conv2d(input, weight, bias, stride, ...))
            if "bias" in kwargs:
                bias, kwargs["bias"] = kwargs["bias"], None
            elif len(args) > 2:
                bias, args[2] = args[2], None
            if not self.is_shard(args[0]):
                args[0] = self.narrowed(args[0], dim)
        args = [self.local(t) for t in args]
        if weight is None:  # an element-wise op
            tensors = [t for t in args if isinstance(t, torch.Tensor) and t.ndim]
            ref = next((t for t in tensors if self.is_shard(t)), None)
            dim = self.split_dim(ref) if ref is not None else -1
            width = (ref.shape[dim] if ref is not None else
                     max((t.shape[-1] for t in tensors), default=0) // self.degree)
            args = [self.narrowed(t, dim) if isinstance(t, torch.Tensor) and t.ndim >= -dim
                    and not self.is_shard(t) and (ref is not None or width > 1)
                    and t.shape[dim] == width * self.degree else t for t in args]
        out = fn(*args, **kwargs)
        if row and sequence:  # (the bias's gradient: this rank's positions' partial sum)
            out = self.marked(ScatteredSequence.apply(out, self.group, self.degree), SEQ_DIM)
            if bias is None:
                return out
            if bias.is_leaf and bias.requires_grad:
                self.sequence_params.setdefault(id(bias), bias)
            return self.marked(out + bias, SEQ_DIM)
        if row:
            out = AllReduced.apply(out, self.group)
            return out if bias is None else out + bias.view(-1, *(1,) * (-dim - 1))
        return self.marked(out, dim)

    def transposed(self, fn: Any, args: list, kwargs: dict, sequence: bool = False) -> Any:
        """``addmm(bias, x, weight)`` with its ``(in, out)`` weight split (Hugging Face's
        ``Conv1D``): column-parallel (weight split along dim 1, the output features) on the
        whole input, its output a local shard of the features; row-parallel (dim 0, the input
        features) on this rank's features of the input, its partial sums all-reduced and the
        whole bias added after (``sequence``: each rank adding its share of the bias, the sums
        left for the view after it to reduce-scatter, :meth:`scattered_rows`)."""
        bias, x, weight = args[:3]
        if shard_dim_of(weight) == 1:
            return self.marked(fn(self.local(bias), x, self.local(weight), *args[3:], **kwargs))
        if kwargs or len(args) > 3:
            raise ExplorerError("a row-parallel addmm with beta or alpha cannot be split; run "
                                "it whole (tensor degree 1 on its stage)")
        x = x if self.is_shard(x) else self.narrowed(x, -1)
        out = torch.mm(x, self.local(weight))
        added = bias.to(out.dtype)  # (under autocast, as one device's addmm adds it)
        if not sequence:
            return AllReduced.apply(out, self.group) + added
        if bias.is_leaf and bias.requires_grad:  # (its gradient: this rank's share)
            self.sequence_params.setdefault(id(bias), bias)
        return self.pending(out + added / self.degree)

    def pending(self, partial: torch.Tensor) -> torch.Tensor:
        """``partial``, remembered as a row-parallel transposed linear's partial sums (for
        :meth:`scattered_rows`)."""
        key = id(partial)
        self.partial_rows[key] = weakref.ref(
            partial, lambda _, key=key: self.partial_rows.pop(key, None))
        return partial

    def carried(self, t: Any, into: torch.Tensor) -> torch.Tensor:
        """``into``, a stand-in for ``t`` that an op reads, remembered as ``t`` is: a local
        shard along its dimension, partial sums with their bias."""
        if self.is_shard(t):
            self.marked(into, self.split_dim(t))
        if self.is_partial_rows(t):
            self.pending(into)
        return into

    def is_partial_rows(self, t: Any) -> bool:
        """Whether ``t`` is a row-parallel transposed linear's partial sums, not reduced yet."""
        hit = self.partial_rows.get(id(t))
        return hit is not None and hit() is t

    def scattered_rows(self, fn: Any, args: Any, kwargs: Any) -> Any:
        """The view of a row-parallel transposed linear's partial sums back to ``(batch, seq,
        features)``, reduce-scattered along the sequence: this rank's positions' sums."""
        return self.marked(ScatteredSequence.apply(fn(*args, **kwargs), self.group,
                                                   self.degree), SEQ_DIM)

    def on_positions(self, fn: Any, args: Any, kwargs: Any) -> Any:
        """A token-wise op on this rank's positions: its sequence shards as they are, its whole
        ``(..., seq, features)`` inputs narrowed to the positions (their gradients then partial
        sums, which the stage all-reduces), the replicated weights it reads as they are, their
        gradients remembered for :meth:`reduce_sequence_grads`; its output a sequence shard."""
        if str(fn) in SEQUENCE_RANDOM:
            return self.random_on_positions(fn, args, kwargs)
        tensors = [t for t in args if isinstance(t, torch.Tensor) and t.ndim >= -SEQ_DIM]
        ref = next((t for t in tensors if self.is_shard(t)), None)
        positions = (ref.shape[SEQ_DIM] if ref is not None else  # (all whole: from elsewhere)
                     max(t.shape[SEQ_DIM] for t in tensors) // self.degree)

        def read(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or self.is_shard(t):
                return t
            if t.is_leaf and t.requires_grad:
                self.sequence_params.setdefault(id(t), t)
                return t
            if t.ndim >= -SEQ_DIM and t.shape[SEQ_DIM] == positions * self.degree:
                return self.narrowed(t, SEQ_DIM)
            return t
        return self.marked(fn(*mapped(read, args), **mapped(read, kwargs)), SEQ_DIM)

    def random_on_positions(self, fn: Any, args: Any, kwargs: Any) -> Any:
        """A dropout on this rank's positions of ``args[0]`` (narrowed to them where it is
        whole): the mask drawn whole, as one device draws it (a dropout of ones), and its part
        for these positions applied (a copy: the whole mask is not kept)."""
        x = args[0] if self.is_shard(args[0]) else self.narrowed(args[0], SEQ_DIM)
        whole = whole_shape(x.shape, SEQ_DIM, self.degree)
        drawn = fn(torch.ones(whole, dtype=x.dtype, device=x.device), *args[1:], **kwargs)
        if isinstance(drawn, tuple):  # (native_dropout: the output and the mask kept)
            scale, kept = (self.narrowed(t, SEQ_DIM).clone() for t in drawn)
            return self.marked((x * scale, kept), SEQ_DIM)
        return self.marked(x * self.narrowed(drawn, SEQ_DIM).clone(), SEQ_DIM)

    def reduce_sequence_grads(self) -> None:
        """All-reduce the partial gradients of the weights token-wise ops read (once a step,
        before the optimizer; every rank of the mesh calls it)."""
        reduce_partial_grads(list(self.sequence_params.values()), self.group, local)

    def on_heads(self, fn: Any, args: Any, kwargs: Any) -> Any:
        """``fn`` on the local shards of its split inputs (no communication) and its whole
        plain ones; its outputs local shards, split along the dimension that holds this rank's
        heads, followed through the shape ops (:mod:`~explorer.runtime.head_shapes`: a view's
        or reshape's sizes divided where the heads or features lie, an expand's kept there).
        An attention with dropout runs whole on every rank (its masks are drawn for all heads
        at once), each keeping its heads' part."""
        args, kwargs = mapped(self.local, args), mapped(self.local, kwargs)
        op, x = str(fn), args[0] if args else None
        ref = next((t for t in tree_leaves((args, kwargs)) if self.is_shard(t)), None)
        dim = -1 if ref is None else self.split_dim(ref)
        if op in RESHAPE_OPS:
            shape, dim = self.local_shape(x, list(args[1]))
            args = (x, shape, *args[2:])
        elif op in SPLIT_OPS:
            sizes = args[1]
            args = (x, [n // self.degree for n in sizes] if isinstance(sizes, (list, tuple))
                    else sizes // self.degree, *args[2:])
        elif self.is_shard(x) and op == "aten.transpose.int":
            dim = transposed_dim(x.ndim, dim, args[1], args[2])
        elif self.is_shard(x) and op == "aten.unsqueeze.default":
            dim = unsqueezed_dim(x.ndim, dim, args[1])
        elif self.is_shard(x) and op == "aten.expand.default":
            args = (x, expanded_sizes(x.shape, dim, args[1]), *args[2:])
        elif op == ATTENTION and kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0):
            # (its dropout masks are drawn for all heads at once: the whole attention runs on
            # every rank, as one device runs it, and each keeps its heads' part)
            whole = fn(*[self.gathered(t) if self.is_shard(t) else t for t in args], **kwargs)
            return self.marked(self.narrowed(whole, dim), dim)
        return self.marked(fn(*args, **kwargs), dim)

    def local(self, t: Any) -> Any:
        """What a split op run on local shards reads of ``t``: a split weight's shard; a
        replicated parameter with its gradient all-reduced (every rank's is a partial sum,
        Megatron's ``f``); anything else as it is."""
        if isinstance(t, DTensor):
            return t.to_local()
        if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad:
            return PartialGrad.apply(t, self.group)
        return t

    def local_shape(self, x: torch.Tensor, shape: list[int]) -> tuple[list[int], int]:
        """``shape`` (of the whole tensor) for this rank's heads of it, and the dimension the
        view is split along (see :meth:`on_heads`): followed from the shard's own split where
        ``x`` is a local shard (:func:`~explorer.runtime.head_shapes.view_of_heads`), else the
        head count of ``(batch, seq, heads, head_dim)`` or the last dimension divided."""
        k = self.degree
        if self.is_shard(x):
            view = view_of_heads(x.shape, self.split_dim(x), shape, k)
            if view is None:
                raise ExplorerError(f"a view of this rank's heads ({tuple(x.shape)}) to "
                                    f"{shape} mixes them with other dimensions; run the "
                                    "attention whole (tensor degree 1 on its stage)")
            return view
        d = 2 if len(shape) == 4 else len(shape) - 1
        if len(shape) not in (2, 3, 4) or shape[d] % k:
            raise ExplorerError(f"cannot split a view to {shape} by heads {k} ways; run the "
                                "attention whole (tensor degree 1 on its stage)")
        shape[d] //= k
        if -1 not in shape and torch.Size(shape).numel() != x.numel():
            raise ExplorerError(f"a view of this rank's heads ({tuple(x.shape)}) to {shape} "
                                "does not fit; run the attention whole (tensor degree 1 on "
                                "its stage)")
        return shape, d - len(shape)

    # -- values ----------------------------------------------------------------------------
    def marked(self, value: Any, dim: int = -1) -> Any:
        """``value`` with every tensor in it remembered as a local shard split along ``dim``
        (from the end)."""
        if isinstance(value, (list, tuple)):
            for t in value:
                self.marked(t, dim)
        elif isinstance(value, torch.Tensor) and value.ndim:
            key = id(value)
            self.shards[key] = (weakref.ref(value, lambda _, key=key: self.shards.pop(key, None)),
                                dim)
        return value

    def split_dim(self, t: Any) -> int | None:
        """The dimension (from the end) along which ``t`` is this rank's local shard of a
        split op's output; None where it is not one."""
        hit = self.shards.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def is_shard(self, t: Any) -> bool:
        """Whether ``t`` is this rank's local shard of a split op's output."""
        return self.split_dim(t) is not None

    def narrowed(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's part of whole ``t``'s dimension ``dim`` (differentiable: the gradient
        of ``t`` is then this rank's partial sum)."""
        width = t.shape[dim] // self.degree
        return t.narrow(dim, self.index * width, width)

    def gathered(self, t: torch.Tensor) -> torch.Tensor:
        """The whole of local shard ``t`` (all-gathered along its split dimension;
        differentiable: the gradient of the shard is its part of the whole's)."""
        dim = self.split_dim(t)
        return Gathered.apply(t, self.group, self.index, self.degree, -1 if dim is None else dim)

    def whole_plain(self, t: Any) -> Any:
        """``t`` as the whole plain tensor an unsplit op reads."""
        if isinstance(t, DTensor):
            return self.whole(t).to_local()
        return self.gathered(t) if self.is_shard(t) else t

    def enter(self, value: Any) -> Any:
        """``value`` with every plain tensor in it as a replicated DTensor (what DTensor's
        own ops read)."""
        return tree_map(lambda t: DTensor.from_local(t, self.mesh, [Replicate()],
                                                     run_check=False)
                        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t,
                        value)

    def matching(self, grads: list, dims: list[int | None]) -> list:
        """Gradients received from another stage (plain, whole) as the outputs they are for:
        this rank's part where those are local shards (split along ``dims``, from the end)."""
        return [self.narrowed(g, d) if d is not None and isinstance(g, torch.Tensor) and g.ndim
                else g for g, d in zip(grads, dims, strict=False)]

    def settled(self, value: Any, sequence: bool = False) -> Any:
        """``value`` with a DTensor's partial sums all-reduced and made plain (``sequence``:
        reduce-scattered along the sequence, a sequence shard): an op's output is reduced
        once, right after the op (as the simulator counts it), however many ops read it; a
        vocabulary-parallel embedding's masked partial sums can be reduced only once."""
        def settle(t: Any) -> Any:
            if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
                return t
            if sequence:
                return self.marked(_Reduced.apply(t, Shard(t.ndim + SEQ_DIM)).to_local(),
                                   SEQ_DIM)
            return _Reduced.apply(t).to_local()
        return tree_map(settle, value)

    def reduced_sum(self, grads: list) -> list:
        """Partial sums (the gradients of a whole value split ops read) all-reduced in place."""
        for g in grads:
            if isinstance(g, torch.Tensor):
                dist.all_reduce(g, group=self.group)
        return grads

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` replicated on every rank (all-reduced or all-gathered as its placement needs);
        differentiable."""
        return t.redistribute(self.mesh, [Replicate()]) if isinstance(t, DTensor) else t

    def plain(self, value: Any) -> Any:
        """``value`` with every DTensor or local shard in it as the whole plain tensor (what
        is sent to another stage); every rank of the mesh must call it (it gathers)."""
        with torch.no_grad():
            return tree_map(lambda t: self.whole_plain(t.detach()) if isinstance(t, DTensor)
                            else self.gathered(t) if self.is_shard(t) else t, value)


#: the attention of a head-split core, whose dropout draws its masks for every head at once
ATTENTION = "aten.scaled_dot_product_attention.default"


def shard_dim_of(t: DTensor) -> int | None:
    """The dimension a DTensor's (first) placement splits; None where it is replicated."""
    placement = t.placements[0]
    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def mapped(fn: Any, value: Any) -> Any:
    """``fn`` of every leaf of an op's arguments (tuples, lists and dicts of them): a
    cheaper :func:`~torch.utils._pytree.tree_map` for the few shapes ATen calls take."""
    if isinstance(value, (list, tuple)):
        return type(value)(mapped(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: mapped(fn, v) for k, v in value.items()}
    return fn(value)


class _Reduced(torch.autograd.Function):
    """Partial sums all-reduced (or reduce-scattered to ``placement``); the gradient of every
    rank's part is the (replicated) gradient of the sum. (DTensor's own backward would lay
    that gradient out as the partial input, which it cannot do for an embedding's masked
    partial sums.)"""

    @staticmethod
    def forward(ctx, t, placement=None):  # type: ignore[override]
        return t.redistribute(t.device_mesh, [placement or Replicate()] * t.device_mesh.ndim)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.redistribute(g.device_mesh, [Replicate()] * g.device_mesh.ndim), None


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
