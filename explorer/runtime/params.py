"""A rank's weights: its parameters and buffers, copies of other stages' weights it uses, their
gradients brought home and all-reduced across replicas, and the optimizer step."""

from __future__ import annotations

from typing import Any

import torch

from explorer.core.errors import ExplorerError
from explorer.runtime.accounting import MemTracker
from explorer.runtime.comm import WEIGHT, WEIGHT_GRADIENT, GradBuckets, Messenger
from explorer.runtime.layout import RankLayout
from explorer.runtime.tensor_parallel import TensorMesh, full, like, local, placed_like


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


class Weights:
    """The parameters and buffers one rank holds, by node index.

    ``owned`` are its stage's; ``used_remote`` are other stages' weights an op of this stage
    uses: a copy, refreshed from its owner before each step, whose gradient goes back to the
    owner at the end of the step. Gradients, optimizer state and the copies are counted in
    ``tracker``.
    """

    def __init__(self, layout: RankLayout, state: dict[str, torch.Tensor], lr: float,
                 messenger: Messenger, tracker: MemTracker, group: Any, record: bool,
                 mesh: TensorMesh | None = None) -> None:
        L = self.layout = layout
        self.messenger, self.tracker, self.record = messenger, tracker, record
        weight = [k in ("param", "buffer") for k in L.kind]
        self.owned = [i for i in range(len(L.names)) if weight[i] and L.stage[i] == L.s]
        self.used_remote = [i for i in range(len(L.names)) if weight[i] and L.stage[i] != L.s
                            and any(L.stage[c] == L.s for c in L.succs[i])]
        self.value: dict[int, torch.Tensor] = {}
        for i in self.owned + self.used_remote:
            t = state[L.names[i]].detach().to(L.tdev).clone()
            if mesh is not None:  # a tensor-parallel stage: its shard, as a DTensor
                t = mesh.distribute(L.names[i], t)
            if L.kind[i] == "param" and t.is_floating_point():
                t.requires_grad_(True)
            self.value[i] = t
            tracker.add(t)
        params = [self.value[i] for i in self.owned if L.kind[i] == "param"]
        self.optimizer = make_optimizer(L.plan.optimizer, params, lr) if params else None
        # local backward uses of each param per step (a remote use counts once: its gradient
        # arrives at the end of the step)
        self.uses = {i: L.local_consumers(i) * L.micro_batches * len(L.units)
                     + any(L.stage[c] != L.s for c in L.succs[i])
                     for i in self.value if L.kind[i] == "param"}
        self.uses_left = dict(self.uses)
        self.buckets = GradBuckets(
            [(i, self.value[i]) for i in reversed(self.owned)
             if L.kind[i] == "param" and self.value[i].requires_grad], group)
        self.grads_tracked: set[int] = set()
        self.state_tracked: set[int] = set()
        #: the first step's gradients of this rank's parameters, when the job records them
        self.first_grads: dict[str, torch.Tensor] | None = None
        for i, t in self.value.items():
            if L.kind[i] == "param" and t.requires_grad:
                t.register_post_accumulate_grad_hook(self.grad_born)

    def start_step(self) -> None:
        """Send this rank's weights to the other stages' ranks that use them, receive the
        copies it uses."""
        L = self.layout
        self.uses_left = dict(self.uses)
        self.buckets.start_step()
        for i in self.owned:
            for _, dst in L.weight_users(i):
                self.messenger.send(self.value[i].detach(), dst, L.tag(WEIGHT, 0, 0, i))
        for i in self.used_remote:
            (t,) = self.messenger.recv(L.weight_home(i), L.tag(WEIGHT, 0, 0, i))
            with torch.no_grad():
                self.value[i].copy_(t)

    def used(self, p: int) -> None:
        """A backward that used parameter ``p`` is done."""
        self.uses_left[p] -= 1
        if self.uses_left[p] == 0 and self.layout.stage[p] == self.layout.s:
            self._place_grad(self.value[p])
            self.buckets.ready(p)

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
            self.tracker.add(placed)

    def finish(self) -> None:
        """Gradients home, all-reduced across replicas, then the optimizer step."""
        L, msg = self.layout, self.messenger
        # remote param copies send their gradient to the owner; owners add what they receive
        for i in self.used_remote:
            if L.kind[i] != "param" or not self.value[i].requires_grad:
                continue
            g = self.value[i].grad
            msg.send(g if g is not None else torch.zeros_like(self.value[i]), L.weight_home(i),
                     L.tag(WEIGHT_GRADIENT, 0, L.j, i))
            self.drop_grad(self.value[i])
        for i in self.owned:
            if L.kind[i] != "param" or not self.value[i].requires_grad:
                continue
            users = L.weight_users(i)
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
        if self.record and self.first_grads is None:
            self.first_grads = {L.names[i]: full(self.value[i].grad.detach()).cpu().clone()
                                for i in self.owned if L.kind[i] == "param"
                                and self.value[i].grad is not None}
        if self.optimizer is not None:
            self.optimizer.step()
            self._track_optimizer_state()
        for t in self.value.values():
            self.drop_grad(t)

    def _track_optimizer_state(self) -> None:
        assert self.optimizer is not None
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and \
                        id(v) not in self.state_tracked:
                    self.state_tracked.add(id(v))
                    self.tracker.add(v)

    def grad_born(self, p: torch.Tensor) -> None:
        """Count a parameter's gradient from when autograd (or this class) creates it."""
        if p.grad is None:  # autograd may call the hook for an undefined gradient
            return
        if id(p) not in self.grads_tracked:
            self.grads_tracked.add(id(p))
            self.tracker.add(p.grad)

    def drop_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            if id(p) in self.grads_tracked:
                self.grads_tracked.discard(id(p))
                self.tracker.drop(p.grad)
            p.grad = None
