"""A rank's weights: its parameters and buffers, copies of other stages' weights it uses, their
gradients brought home and all-reduced (or, with ZeRO, reduce-scattered) across replicas, and the
optimizer step (on this replica's shard with ZeRO, :mod:`explorer.runtime.sharding`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from explorer.core.errors import ExplorerError
from explorer.core.plan import Plan
from explorer.costs.strategies import NORM_OPS, op_base_name
from explorer.runtime.accounting import BUFFERS, GRADIENTS, OPTIMIZER, PARAMETERS, MemTracker
from explorer.runtime.comm import WEIGHT, WEIGHT_GRADIENT, GradBuckets, Messenger
from explorer.runtime.layout import RankLayout
from explorer.runtime.sharding import GatheredRef, ScatterBuckets, Shards, UpdatedShards
from explorer.runtime.tensor_parallel import TensorMesh, full, like, local, placed_like

#: the fixed loss scale of plans with an fp16 stage: the backward starts from the loss gradient
#: times this, and the optimizer sees the gradients divided by it again (a power of two, so
#: both are exact); large enough to keep small fp16 gradients from vanishing, small enough
#: not to overflow on the models the explorer runs
FP16_LOSS_SCALE = 2.0 ** 10

#: the autocast dtype of each precision a plan's stage may run at (fp32: no autocast)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def loss_scale(plan: Plan) -> float:
    """What the loss gradient is multiplied by: :data:`FP16_LOSS_SCALE` when a stage runs in
    fp16 (the scale holds over the whole backward, so every stage divides by it), else 1."""
    fp16 = any(plan.settings_of(s).precision == "fp16" for s in range(len(plan.stages)))
    return FP16_LOSS_SCALE if fp16 else 1.0


def make_optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The optimizer behind each name a plan may carry."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ExplorerError(f"unknown optimizer {name!r}")


def cast_once(device_type: str, dtype: torch.dtype | None) -> contextlib.ExitStack:
    """Around a step's forwards under bf16/fp16 (``dtype``; None: fp32, no context): one
    autocast context, so that each weight is cast to 2 bytes once a step and its copy shared
    by every micro-batch in flight (autocast's cache, cleared when the outermost context
    ends), as eager PyTorch's pipeline schedules run under one; the per-op contexts nest in
    it. Closing the stack after the last forward leaves each copy to the backwards that
    saved it, as autocast around the forward alone does."""
    casts = contextlib.ExitStack()
    if dtype is not None:
        casts.enter_context(torch.autocast(device_type, dtype=dtype))
    return casts


class Weights:
    """The parameters and buffers one rank holds, by node index.

    ``owned`` are its stage's; ``used_remote`` are other stages' weights an op of this stage
    uses: a copy, refreshed from its owner before each step, whose gradient goes back to the
    owner at the end of the step. Gradients, optimizer state and the copies are counted in
    ``tracker``. With the stage's ZeRO setting (replicated stages only), its trainable
    parameters are sharded over the replicas (``shards``); ZeRO 3 gathers them a
    recomputation unit at a time (``units``: each node's; None: an op's weights at a time).
    """

    def __init__(self, layout: RankLayout, state: dict[str, torch.Tensor], lr: float,
                 messenger: Messenger, tracker: MemTracker, group: Any, record: bool,
                 mesh: TensorMesh | None = None, units: list[str] | None = None) -> None:
        L = self.layout = layout
        self.messenger, self.tracker, self.record, self.mesh = messenger, tracker, record, mesh
        weight = [k in ("param", "buffer") for k in L.kind]
        self.owned = [i for i in range(len(L.names)) if weight[i] and L.stage[i] == L.s]
        self.used_remote = [i for i in range(len(L.names)) if weight[i] and L.stage[i] != L.s
                            and any(L.stage[c] == L.s for c in L.succs[i])]
        replicas = len(L.plan.stages[L.s])
        #: the stage's ZeRO stage (0 where it has one replica: nothing to shard over)
        self.zero = L.plan.settings_of(L.s).zero if replicas > 1 else 0
        precision = L.plan.settings_of(L.s).precision
        self.shards = Shards(self.zero, group, replicas, L.j, tracker, messenger,
                             L.local_consumers,
                             AUTOCAST_DTYPES.get(precision) if self.zero else None)
        self.value: dict[int, torch.Tensor] = {}
        for i in self.owned + self.used_remote:
            t = state[L.names[i]].detach().to(L.tdev).clone()
            if mesh is not None:  # a tensor-parallel stage: its shard, as a DTensor
                t = mesh.distribute(L.names[i], t)
            trainable = L.kind[i] == "param" and t.is_floating_point()
            if trainable and self.zero and L.stage[i] == L.s:
                self.value[i] = self.shards.place(i, t)
                continue
            if trainable:
                t.requires_grad_(True)
            self.value[i] = t
            tracker.add(t, PARAMETERS if L.kind[i] == "param" else BUFFERS)
        #: ZeRO 1, 2: the updated shards, gathered as the next step's forward reads them
        #: where this stage exchanges no activations with another
        self.updated = UpdatedShards(self.shards, deferred=not any(
            L.kind[i] == "op" and L.kind[p] == "op" and (L.stage[i] == L.s) != (
                L.stage[p] == L.s) for i in range(len(L.names)) for p in L.preds[i]))
        self.shards.set_groups({i: min(c for c in L.succs[i] if L.stage[c] == L.s)
                                for i in self.shards.ghost if L.local_consumers(i)}, units)
        #: weights only fused norms read, which compute in their data input's dtype and on a
        #: CPU take no 2-byte weight beside an fp32 input: read in fp32 (cast up from a
        #: 2-byte copy, as autocast runs norms on a GPU)
        self.norm_weights = {i for i in self.owned if L.kind[i] == "param" and L.succs[i]
                             and all(L.targets[c] is not None and op_base_name(
                                 str(L.targets[c])) in NORM_OPS for c in L.succs[i])}
        params = [self.shards.shard.get(i, self.value[i]) for i in self.owned
                  if L.kind[i] == "param"]
        self.optimizer = make_optimizer(L.plan.optimizer, params, lr) if params else None
        # local backward uses of each param per step (a remote use counts once: its gradient
        # arrives at the end of the step)
        self.uses = {i: L.local_consumers(i) * L.micro_batches * len(L.units)
                     + any(L.stage[c] != L.s for c in L.succs[i])
                     for i in self.value if L.kind[i] == "param"}
        self.uses_left = dict(self.uses)
        #: ZeRO 2, 3 over several micro-batches: each micro-batch's gradients reduce-scattered
        #: apart once its backward is done with them, only the shards accumulating (as FSDP
        #: and DeepSpeed do), unless a weight of the stage is read on another stage too (that
        #: gradient comes home at the step's end); the simulator's rule too
        self.each_micro_batch = (self.zero >= 2 and L.micro_batches > 1 and not any(
            L.remote_stages(i) for i in self.shards.shard))
        self.micro_batch_uses = {i: L.local_consumers(i) * len(L.units)
                                 for i in self.shards.shard}
        self.micro_batch_left: dict[tuple[int, int], int] = {}
        self.loss_scale = loss_scale(L.plan)
        #: this rank's trainable weights, and with the ranks of other stages that use each
        #: (fixed for the run: the step walks these lists, not every node)
        self.trainable = [i for i in self.owned
                          if L.kind[i] == "param" and self.value[i].requires_grad]
        self.users = {i: L.weight_users(i) for i in self.trainable}
        self.copies = [i for i in self.used_remote
                       if L.kind[i] == "param" and self.value[i].requires_grad]
        #: how many parameters have optimizer state (it is counted when it appears)
        self._with_state = 0
        self.buckets = GradBuckets(
            [(i, self.value[i]) for i in reversed(self.trainable)],
            group if not self.zero else None)
        self.scatter = ScatterBuckets(self.shards, [i for i in reversed(self.owned)
                                                    if i in self.shards.shard])
        self.grads_tracked: set[int] = set()
        self.state_tracked: set[int] = set()
        #: the first step's gradients of this rank's parameters, when the job records them
        self.first_grads: dict[str, torch.Tensor] | None = None
        #: the hooks that count a gradient autograd makes from its making, held while a
        #: step counts memory (:attr:`counting`)
        self._made_hooks: list[RemovableHandle] = []
        self._counting = False

    def start_step(self) -> None:
        """Send this rank's weights to the other stages' ranks that use them, receive the
        copies it uses."""
        L = self.layout
        self.uses_left = dict(self.uses)
        self.buckets.start_step()
        self.scatter.start_step()
        self.shards.start_step()
        self.updated.start_step()
        for i in self.owned:
            if not L.remote_stages(i):
                continue
            self.updated.fresh(i)
            # (ZeRO 3: every replica gathers, those with users send)
            full = (self.shards.gather_full(i) if i in self.shards.ghost
                    or i in self.shards.working else self.value[i])
            for _, dst in L.weight_users(i):
                self.messenger.send(full.detach(), dst, L.tag(WEIGHT, 0, 0, i))
        for i in self.used_remote:
            (t,) = self.messenger.recv(L.weight_home(i), L.tag(WEIGHT, 0, 0, i))
            with torch.no_grad():
                self.value[i].copy_(t)

    def use(self, p: int, m: int, u: int) -> torch.Tensor:
        """Weight ``p`` for an op's forward on micro-batch ``m``, shard ``u`` (ZeRO 3:
        gathered; call :meth:`forward_done` after the op)."""
        if p in self.shards.ghost:
            return self._as_read(p, self.shards.use(p, m, u))
        self.updated.fresh(p)
        return (self._as_read(p, self.shards.read(p)) if p in self.shards.working
                else self.value[p])

    def _as_read(self, p: int, t: torch.Tensor) -> torch.Tensor:
        """A 2-byte copy of weight ``p`` as its ops read it (a norm's weight: in fp32)."""
        return t.float() if p in self.norm_weights and t.dtype != torch.float32 else t

    def prefetch(self, i: int) -> None:
        """Op ``i`` runs next: start gathering its sharded parameters (ZeRO 3)."""
        if self.shards.ghost:
            for p in self.layout.preds[i]:
                self.shards.prefetch(p)

    def forward_done(self, p: int, m: int, u: int) -> None:
        if p in self.shards.ghost:
            self.shards.forward_done(p, m, u)

    def for_recompute(self, p: int) -> torch.Tensor:
        """Weight ``p`` for a forward run again in the backward (ZeRO 3: gathered again)."""
        if p in self.shards.ghost:
            return self._as_read(p, self.shards.for_backward(p))
        if p in self.shards.working:
            return self._as_read(p, self.shards.working[p])
        return self.value[p].detach()

    def stand_in(self, t: torch.Tensor) -> GatheredRef | None:
        """What autograd keeps of ``t`` when it is a gathered weight (ZeRO 3), else None."""
        return self.shards.stand_in(t)

    def accumulated_bytes(self, nodes: Iterable[int]) -> int:
        """The bytes of the gradients a backward reading ``nodes`` makes for weights that
        have one already: autograd makes each anew and adds it into the one held (a
        segment's accounting sees them, :func:`~explorer.runtime.accounting.
        count_gradients_made`; the op path counts them so)."""
        L, value = self.layout, self.value
        return sum(value[p].grad.nbytes for p in nodes
                   if L.kind[p] == "param" and p not in self.shards.ghost
                   and value[p].grad is not None)

    def used(self, p: int, at: tuple[int, int] | None = None) -> None:
        """A backward that used parameter ``p`` (on micro-batch and shard ``at``; None: its
        gradient from another stage) is done."""
        if at is not None and p in self.shards.ghost:
            self.shards.backward_done(p, *at)
        self.uses_left[p] -= 1
        if self.each_micro_batch and at is not None and p in self.shards.shard:
            key = (p, at[0])
            left = self.micro_batch_left.get(key, self.micro_batch_uses[p]) - 1
            self.micro_batch_left[key] = left
            if left == 0:  # this micro-batch's gradient of p is made: reduced apart
                del self.micro_batch_left[key]
                self.scatter.ready(p, self._grad_of, at[0],
                                   release=lambda q: self.drop_grad(self.value[q]))
                self._take_shards(self.scatter.done())
            return
        if self.uses_left[p] == 0 and self.layout.stage[p] == self.layout.s:
            if p in self.shards.shard:
                self.scatter.ready(p, self._grad_of)
                self._take_shards(self.scatter.done())
            else:
                if self.mesh is not None:  # (a DTensor's gradient, laid out as it)
                    self._place_grad(self.value[p])
                self.buckets.ready(p)

    def _grad_of(self, p: int) -> torch.Tensor:
        """The full gradient of sharded parameter ``p`` (zeros where no op made one)."""
        v = self.value[p]
        return v.grad if v.grad is not None else torch.zeros(v.shape, dtype=v.dtype,
                                                               device=v.device)

    def _take_shards(self, reduced: list[tuple[int, torch.Tensor]]) -> None:
        """Reduce-scattered gradient shards to their parameters' shards; under ZeRO 2 and 3
        the full gradients freed (first: the shards of a bucket share one tensor, counted
        whole when the first is given). ZeRO 1 keeps them until the optimizer step, as the
        distributed optimizer keeps its gradient buffer; reduced a micro-batch at a time,
        they went when their reduce-scatter started, and the shards add up."""
        if self.zero >= 2 and not self.each_micro_batch:
            for p, _ in reduced:
                self.drop_grad(self.value[p])
        for p, grad in reduced:
            self._give_shard_grad(p, grad)

    def _give_shard_grad(self, p: int, grad: torch.Tensor) -> None:
        shard = self.shards.shard[p]
        if self.each_micro_batch and shard.grad is not None:
            with torch.no_grad():
                shard.grad.add_(grad)
            return
        self.drop_grad(shard)
        shard.grad = grad
        self.grad_born(shard)

    def _place_grad(self, p: torch.Tensor) -> None:
        """Lay a complete gradient out as its parameter (a split weight's gradient may come
        out of DTensor's backward replicated or as partial sums: each rank keeps its shard)."""
        g = p.grad
        if g is None:
            return
        placed = placed_like(g, p)
        if placed is not g:
            self.tracker.drop(g)
            p.grad = placed
            self.tracker.add(placed, GRADIENTS)

    def finish(self) -> None:
        """Gradients home, all-reduced across replicas, then the optimizer step."""
        L, msg = self.layout, self.messenger
        self.shards.cancel_prefetches()
        # remote param copies send their gradient to the owner; owners add what they receive
        for i in self.copies:
            g = self.value[i].grad
            msg.send(g if g is not None else torch.zeros_like(self.value[i]), L.weight_home(i),
                     L.tag(WEIGHT_GRADIENT, 0, L.j, i))
            self.drop_grad(self.value[i])
        for i in self.trainable:
            users = self.users[i]
            for jt, src in users:
                (g,) = msg.recv(src, L.tag(WEIGHT_GRADIENT, 0, jt, i))
                p = self.value[i]
                with torch.no_grad():
                    if p.grad is None:
                        p.grad = g
                        self.grad_born(p)
                    else:
                        p.grad += g
            if L.remote_stages(i):
                self.used(i)
        for i, reduced in self.buckets.wait_all(msg):
            p = self.value[i]
            if p.grad is None:
                p.grad = like(p, reduced.clone())
                self.grad_born(p)
            else:
                local(p.grad).copy_(reduced)
        if self.zero:  # (and the buckets of parameters no op of the step used)
            self._take_shards(self.scatter.flush(self._grad_of))
        if self.mesh is not None:  # (sequence parallelism: partial sums of norms' weights)
            self.mesh.reduce_sequence_grads()
        if self.loss_scale != 1.0:
            self._unscale()
        if self.record and self.first_grads is None:
            grads = {L.names[i]: self._full_grad(i) for i in self.owned
                     if L.kind[i] == "param" and self.value[i].requires_grad}
            # (a weight no op reads, as a tied one under its other name, has none)
            self.first_grads = {k: g.cpu().clone() for k, g in grads.items() if g is not None}
        self.updated.land_all()  # (the weights no op of the step read)
        if self.optimizer is not None:
            self.optimizer.step()
            self._track_optimizer_state()
        self.updated.optimizer_stepped()
        for t in [*self.value.values(), *self.shards.shard.values()]:
            self.drop_grad(t)

    def _unscale(self) -> None:
        """Divide this rank's reduced parameter gradients by the loss scale (fp16)."""
        with torch.no_grad():
            for i in self.owned:  # (ZeRO 1: the shard's, not the full gradient kept)
                for t in ((self.shards.shard[i],) if i in self.shards.shard else
                          (self.value[i],)):
                    if t.grad is not None:
                        t.grad.div_(self.loss_scale)

    def _full_grad(self, i: int) -> torch.Tensor | None:
        """The whole (reduced) gradient of parameter ``i``, also where it is sharded."""
        if i in self.shards.shard:
            return self.shards.full_grad(i)
        g = self.value[i].grad
        return full(g.detach()) if g is not None else None

    def _track_optimizer_state(self) -> None:
        assert self.optimizer is not None
        if len(self.optimizer.state) == self._with_state:  # (no parameter has new state)
            return
        self._with_state = len(self.optimizer.state)
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and \
                        id(v) not in self.state_tracked:
                    self.state_tracked.add(id(v))
                    self.tracker.add(v, OPTIMIZER)

    @property
    def counting(self) -> bool:
        """Whether this step counts memory (a CPU rank's memory step): a gradient autograd
        makes is counted from its making then. The hooks that count it are on the weights
        in that step only: a Python call per weight in every backward is time eager
        PyTorch does not spend."""
        return self._counting

    @counting.setter
    def counting(self, on: bool) -> None:
        if on and not self._counting:
            self._made_hooks = [self.value[i].register_post_accumulate_grad_hook(self.grad_born)
                                for i in (*self.trainable, *self.copies)]
        elif not on:
            for hook in self._made_hooks:
                hook.remove()
            self._made_hooks = []
        self._counting = on

    def grad_born(self, p: torch.Tensor) -> None:
        """Count a parameter's gradient from when autograd (or this class) creates it."""
        if p.grad is None:  # autograd may call the hook for an undefined gradient
            return
        if id(p) not in self.grads_tracked:
            self.grads_tracked.add(id(p))
            self.tracker.add(p.grad, GRADIENTS)

    def drop_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            if id(p) in self.grads_tracked:
                self.grads_tracked.discard(id(p))
                self.tracker.drop(p.grad)
            p.grad = None
