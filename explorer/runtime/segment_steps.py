"""The segment runtime's steps on a rank (the runtime half of :mod:`explorer.runtime.segments`):
a segment's forward, its one backward, and its inputs' gradients handed on as the op path
hands them; mixed into :class:`explorer.runtime.stage.StageRunner`, whose state they use."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from explorer.runtime.comm import ACTIVATION, GRADIENT
from explorer.runtime.segments import Segment, grad_sources
from explorer.runtime.tensor_parallel import local


class SegmentSteps:
    """A :class:`~explorer.runtime.stage.StageRunner`'s steps of segments (``runtime=
    "segments"``): the same values, messages, weights and memory accounting as its ops."""

    layout: Any
    tracker: Any
    weights: Any
    messenger: Any
    job: Any
    codes: dict
    env: dict
    fwd_left: dict
    grad: dict
    bwd_left: dict
    losses: list
    segment_edges: dict
    segment_slots: dict
    generator: Any
    _draw: Any  # (micro-batch, shard, node) -> the seed the op path draws from

    def _segment_forward(self, seg: Segment, u: int) -> None:
        """Run segment ``seg``'s forward on shard ``u``: receive what it reads from other
        stages, call its code once, then send, keep or release its outputs and release the
        inputs it was the last local reader of."""
        L, tracker = self.layout, self.tracker
        m = seg.micro_batch
        slots: list = []
        args = [self._arg(m, u, p, slots) for p in seg.inputs]
        code = self.codes[seg.nodes]
        if code.random:
            args.append(self.generator)
            args += [self._draw(m, u, i) for i in code.random]
        # (a GPU's allocator measures itself: no need to count what autograd saves)
        saving = (tracker.saving() if L.tdev.type != "cuda" else contextlib.nullcontext())
        with saving, self._autocast():
            outs = code.forward(*args)
        env = self.env[(m, u)]
        edges = []
        for o, readers, out in zip(seg.outputs, seg.readers_after, outs, strict=True):
            flat, _ = tree_flatten(out)
            for t in flat:
                if isinstance(t, torch.Tensor):
                    tracker.add(t)
            env[o] = out
            edges.append([get_gradient_edge(t) if isinstance(t, torch.Tensor)
                          and t.requires_grad else None for t in flat])
            self.fwd_left[(m, u, o)] = readers
            for t in L.remote_stages(o):
                for dst in L.peers_to(t, u):
                    self.messenger.send(out, dst, L.tag(ACTIVATION, m, u, o))
            if L.names[o] == L.loss_name:
                self.losses.append(float(local(out.detach())))
        self.segment_edges[(seg.forward_at, u)] = edges
        self.segment_slots[(seg.forward_at, u)] = slots
        for p, n in zip(seg.inputs, seg.uses, strict=True):
            if L.kind[p] == "param":
                for _ in range(n):
                    self.weights.forward_done(p, m, u)
            k = (m, u, p)
            if k in self.fwd_left:
                self.fwd_left[k] -= n
                if self.fwd_left[k] == 0:
                    self._release_output(m, u, p)
        for o in seg.outputs:
            if self.fwd_left[(m, u, o)] == 0 and L.names[o] != L.loss_name:
                self._release_output(m, u, o)

    def _segment_backward(self, seg: Segment, u: int) -> None:
        """Run segment ``seg``'s backward on shard ``u``: its outputs' gradients (from later
        segments, other stages, or the loss's own), one autograd backward, then its inputs'
        gradients handed on as the op path hands them."""
        L = self.layout
        m = seg.micro_batch
        edges = self.segment_edges.pop((seg.forward_at, u), None) or []
        slots = self.segment_slots.pop((seg.forward_at, u), [])
        for o in seg.outputs:
            if o not in seg.backward_nodes:  # (no backward: the op path receives nothing)
                continue
            for t in grad_sources(o, L.s, L.stage, L.succs, L.requires_grad):
                self._store_grad((m, u, o), self.messenger.recv(L.peer_from(t, u),
                                                                L.tag(GRADIENT, m, u, o)))
        pairs, held = [], []
        for o, out_edges in zip(seg.outputs, edges, strict=True):
            if L.names[o] == L.loss_name:
                grads = [torch.full_like(self.env[(m, u)][o], self.weights.loss_scale
                                         / (L.micro_batches * L.shards))]
                self._release_output(m, u, o)
            else:
                grads = self.grad.pop((m, u, o), None)
            held += [g for g in grads or [] if g is not None]
            pairs += [(e, g) for e, g in zip(out_edges, grads or [], strict=False)
                      if e is not None and g is not None]
        self.weights.shards.current = (m, u)
        # (what autograd saved is counted free when it frees it, inside the backward: the
        # gradients flowing between the segment's ops are not counted, as its forward's
        # values that only live inside it are not)
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
        made = [g for _, _, slot in slots for g in slot]
        for g in made:
            self.tracker.add(g)
        for g in held:
            self.tracker.drop(g)
        self._route_segment_grads(seg, u, slots)
        for g in made:
            self.tracker.drop(g)

    def _route_segment_grads(self, seg: Segment, u: int, slots: list) -> None:
        """Hand the gradients of segment ``seg``'s inputs on (as :meth:`_route_input_grads`
        does for one op): to parameters, to the producing segment on this stage, or (after
        its last local reader) to the producer's stage."""
        L = self.layout
        m = seg.micro_batch
        per_pred: dict[int, list] = {}
        for p, pos, slot in slots:
            if slot:
                lst = per_pred.setdefault(p, [None] * L.nflat[p])
                lst[pos] = slot[0] if lst[pos] is None else lst[pos] + slot[0]
        for p, n in zip(seg.inputs, seg.backward_uses, strict=True):
            if L.kind[p] == "param":
                for _ in range(n):
                    self.weights.used(p, (m, u))
                continue
            if L.kind[p] != "op" or not L.requires_grad[p]:
                continue
            gk = (m, u, p)
            if p in per_pred:
                self._store_grad(gk, per_pred[p])
            if L.stage[p] != L.s:
                self._readers_done(m, u, p, n)

