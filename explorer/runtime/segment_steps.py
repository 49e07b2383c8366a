"""The segment runtime's steps on a rank (the runtime half of :mod:`explorer.runtime.segments`):
a segment's forward, its one backward, and its inputs' gradients handed on as the op path
hands them; mixed into :class:`explorer.runtime.stage.StageRunner`, whose state they use.

On a tensor-parallel stage each op of a segment's code is called through the stage's
:class:`~explorer.runtime.tensor_parallel.TensorMesh` as the op path calls it
(:meth:`~explorer.runtime.tensor_parallel.TensorMesh.run_op`: split, local and sequence ops
on local shards, the others on whole tensors, every output settled). The gradient of a whole
value that split ops read is a partial sum on each rank: inside the segment the split ops
read it through :class:`~explorer.runtime.tensor_parallel.PartialGrad` (their partial sums
all-reduced once per segment); a segment input they read enters a second time, its partial
sums held and all-reduced once after the last such reader on the stage, as the op path does
(:meth:`~explorer.runtime.stage.StageRunner._hold_partial`). Values sent to other stages go
whole, gradients received for local shards are narrowed to them."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from explorer.core.segments import Segment, grad_sources
from explorer.core.tensor_layout import EMBEDDING_OPS, RESHAPE_OPS
from explorer.runtime.accounting import count_gradients_made
from explorer.runtime.checkpointing import Held, checkpointing, recompute_contexts
from explorer.runtime.comm import ACTIVATION, GRADIENT
from explorer.runtime.segments import (
    CheckpointedRun,
    CheckpointRegions,
    SegmentCode,
    rerunning_units,
    segment_code,
)
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
    generator: Any
    mesh: Any
    split: set
    local: set
    sequence: set
    shard_dims: dict
    _draw: Any  # (micro-batch, shard, node) -> the seed the op path draws from
    _stand_in: Any  # what autograd keeps of a gathered weight (ZeRO 3), or None
    checkpointed: bool  # the stage recomputes its segments' units in their backward
    recompute_mode: Any  # "full" or "selective" where checkpointed
    #: per segment run (its first action's position, shard), what its checkpointed runs hold
    #: counted in a CPU rank's memory step until its backward ends
    recompute_held: dict[tuple[int, int], list[Held]]
    _segment_run: tuple[int, int]  # the segment run whose forward runs now
    #: per parameter, the uses of the segment whose backward runs now not yet done
    param_uses: dict[int, int]
    memory_step: bool  # (a CPU rank's step that counts what autograd holds)
    hooked: set  # the autograd nodes counting their gradients this step
    _gradient_boundary: Any  # node -> whether a segment's own nodes end there
    _hold_partial: Any
    _tensor_targets: list | None = None
    _regions: CheckpointRegions | None = None  # what a recomputing stage checkpoints
    #: per segment code (by id), its arguments as every step has them (:meth:`_reads_of`)
    _code_reads: dict

    def _start_segments(self) -> None:
        """A new step's segment runs: none yet."""
        #: per segment run (its forward position, shard): its outputs' gradient edges and
        #: its inputs' gradient slots, until its backward
        self.segment_edges: dict[tuple[int, int], list[list]] = {}
        self.segment_slots: dict[tuple[int, int], list] = {}
        #: and (tensor parallelism) the whole inputs its split ops read, their slots
        self.segment_partial_slots: dict[tuple[int, int], tuple[list[int], list]] = {}

    def _segment_code(self, seg: Segment) -> SegmentCode:
        """Segment ``seg``'s code; on a tensor-parallel stage each op called through the
        mesh, and split ops reading whole values apart (:func:`segment_code`)."""
        L = self.layout
        if self.checkpointed and self._regions is None:  # (once for all the segments)
            self._regions = self._checkpoint_regions()
        regions = self._regions
        if self.mesh is None:
            return segment_code(seg, L.calls, L.targets, L.random, regions=regions)
        if self._tensor_targets is None:
            self._tensor_targets = [
                self.mesh.op(t, f"tensor_{L.calls[i].target.replace('.', '_')}",
                             i in self.split, i in self.local, i in self.sequence,
                             L.names[i] == L.loss_name)
                if L.kind[i] == "op" and L.stage[i] == L.s else t
                for i, t in enumerate(L.targets)]
        return segment_code(seg, L.calls, self._tensor_targets, L.random, self._split_read,
                            self.mesh.partial_entry, regions)

    def _checkpoint_regions(self) -> CheckpointRegions:
        """What a recomputing stage's segments checkpoint: each run of consecutive ops of a
        unit that runs an op again (the job's ``reruns``, the simulator's rule; a unit that
        runs none keeps each value it saves anyway), as
        :func:`~explorer.runtime.checkpointing.checkpointing` says for its ops."""
        L = self.layout
        return CheckpointRegions(
            units=rerunning_units(self.job.units, self.job.reruns),
            buffer=[k == "buffer" for k in L.kind],
            how=lambda nodes: checkpointing(self.recompute_mode,
                                            [L.targets[i] for i in nodes]),
            run=self._run_checkpointed)

    def _reads_of(self, code: SegmentCode) -> tuple[list, list[tuple[int, int, bool]]]:
        """``code``'s arguments as every step has them: a list with each weight's tensor in
        its place (this rank's, updated in place all run long; a ZeRO 3 weight is gathered
        anew and a 2-byte working copy read anew, so they are not among them), and the places
        of the others, each with the node it reads and whether split ops read it there."""
        reads = self._code_reads.get(id(code))
        if reads is None:
            L, value = self.layout, self.weights.value
            read_anew = self.weights.shards.ghost.keys() | self.weights.shards.working.keys()
            fixed: list = [None] * len(code.reads)
            varying = []
            for k, (p, split) in enumerate(code.reads):
                if L.kind[p] in ("param", "buffer") and p not in read_anew and not split:
                    fixed[k] = value[p]
                else:
                    varying.append((k, p, split))
            reads = self._code_reads[id(code)] = (fixed, varying)
        return reads

    def _reads_partially(self, i: int) -> bool:
        """Whether op ``i``'s gradient of a whole input is this rank's partial sum: ``i``
        runs on local shards (not a vocabulary-parallel embedding, nor the only view on
        sequence shards, which scatters partial sums: their gradient is the whole)."""
        target = str(self.layout.targets[i])
        return (self.mesh is not None and (i in self.split or i in self.local)
                and target not in EMBEDDING_OPS and not (i in self.sequence
                                                         and target in RESHAPE_OPS))

    def _split_read(self, i: int, p: int) -> bool:
        """Whether op ``i``'s gradient of value ``p`` is this rank's partial sum when ``p``
        is whole (held apart, then all-reduced)."""
        L = self.layout
        return L.kind[p] == "op" and L.requires_grad[p] and self._reads_partially(i)

    def _segment_forward(self, seg: Segment, u: int) -> None:
        """Run segment ``seg``'s forward on shard ``u``: receive what it reads from other
        stages, call its code once, then send, keep or release its outputs and release the
        inputs it was the last local reader of."""
        L, tracker = self.layout, self.tracker
        m = seg.micro_batch
        slots: list = []
        code = self.codes[seg.nodes]
        # (inputs split ops read whole: their partial gradients' slots, apart)
        partial_slots: list = []
        whole_split: list[int] = []
        fixed, varying = self._reads_of(code)
        if self.weights.updated.stale:  # (ZeRO 1, 2: the updated shards' gathers landed)
            for p, _ in code.reads:
                self.weights.updated.fresh(p)
        args = list(fixed)
        for k, p, split in varying:
            if not split:
                args[k] = self._arg(m, u, p, slots)
                continue
            val = self._value(m, u, p)
            whole = not any(self.mesh.is_shard(t) for t in tree_flatten(val)[0])
            if whole:
                whole_split.append(p)
            args[k] = self._enter(p, val, partial_slots if whole else slots)
        if code.random:
            args.append(self.generator)
            args += [self._draw(m, u, i) for i in code.random]
        # (what autograd saves is counted in a CPU rank's memory step, a GPU's allocator
        # measures itself; but a gathered ZeRO 3 weight is saved as a reference that gathers
        # it again, on any device in any step)
        saving = (tracker.saving(self._stand_in) if self.memory_step
                  or self.weights.shards.ghost else contextlib.nullcontext())
        self._segment_run = (seg.forward_at, u)
        with saving, self._autocast():
            outs = code.forward(*args)
        if self.memory_step:  # (and the gradients its backward passes between its ops)
            count_gradients_made(tracker, tree_flatten(list(outs))[0], self.hooked,
                                 self._gradient_boundary)
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
            remote, sent = L.remote_stages(o), out
            if self.mesh is not None:  # (local shards go whole, every rank gathering)
                self.shard_dims[(m, u, o)] = [self.mesh.split_dim(t) for t in flat]
                sent = self.mesh.plain(out) if remote else out
            for t in remote:
                for dst in L.peers_to(t, u):
                    self.messenger.send(sent, dst, L.tag(ACTIVATION, m, u, o))
            if L.names[o] == L.loss_name:
                self.losses.append(float(local(out.detach())))
        self.segment_edges[(seg.forward_at, u)] = edges
        self.segment_slots[(seg.forward_at, u)] = slots
        if whole_split:
            self.segment_partial_slots[(seg.forward_at, u)] = (whole_split, partial_slots)
        gathered = self.weights.shards.ghost
        for p, n in zip(seg.inputs, seg.uses, strict=True):
            if L.kind[p] == "param":
                for _ in range(n if gathered else 0):  # (ZeRO 3: this use is done)
                    self.weights.forward_done(p, m, u)
                continue
            k = (m, u, p)
            if k in self.fwd_left:
                self.fwd_left[k] -= n
                if self.fwd_left[k] == 0:
                    self._release_output(m, u, p)
        for o in seg.outputs:
            if self.fwd_left[(m, u, o)] == 0 and L.names[o] != L.loss_name:
                self._release_output(m, u, o)

    def _run_checkpointed(self, run: CheckpointedRun, reads: tuple) -> Any:
        """A checkpointed run of a segment's ops on ``reads`` under ``torch.utils.checkpoint``
        (non-reentrant, :mod:`explorer.runtime.checkpointing`, as ``run.how`` says): its
        forward keeps its inputs (and with "selective" its matmul-like ops' outputs); the
        segment's backward runs the rest again (the same seeds and precision) and
        back-propagates through that. What that holds is counted in a CPU rank's memory step
        until the segment's backward ends."""
        # (buffers reach the body from outside checkpoint, as a module's buffers do: one a
        # kept op updates in place, a batch norm's step count, must not be saved as an input)
        buffers = {k: a for k, a in enumerate(reads) if run.buffers[k]}

        def forward(*inputs: Any) -> Any:
            given = iter(inputs)
            every = [buffers[k] if k in buffers else next(given) for k in range(len(reads))]
            with self._autocast():  # (the generated code itself: checkpoint's early stop
                # raises through it, which a module call would report at a cost)
                return run.body.forward(*every)

        held = Held(self.tracker) if self.memory_step else None
        if held is not None:
            self.recompute_held.setdefault(self._segment_run, []).append(held)
        return checkpoint(forward, *[a for k, a in enumerate(reads) if k not in buffers],
                          use_reentrant=False, preserve_rng_state=False,
                          context_fn=recompute_contexts(run.how, held))

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
                got = self.messenger.recv(L.peer_from(t, u), L.tag(GRADIENT, m, u, o))
                if self.mesh is not None:
                    got = self.mesh.matching(got, self.shard_dims.get((m, u, o), []))
                self._store_grad((m, u, o), got)
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
        self.param_uses = {p: n for p, n in zip(seg.inputs, seg.backward_uses, strict=True)
                           if L.kind[p] == "param" and n}
        # (in the memory step, what autograd saved is counted free when it frees it, and a
        # gradient passed between the segment's ops from when it is made until it is freed)
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
        for held_now in self.recompute_held.pop((seg.forward_at, u), ()):
            held_now.release()
        whole_split, partial_slots = self.segment_partial_slots.pop((seg.forward_at, u),
                                                                    ((), []))
        made = [g for _, _, slot in [*slots, *partial_slots] for g in slot]
        for g in made:
            self.tracker.add(g)
        for g in held:
            self.tracker.drop(g)
        self._hold_segment_partials(seg, u, whole_split, partial_slots)
        self._route_segment_grads(seg, u, slots)
        release_slots(slots)
        release_slots(partial_slots)
        for g in made:
            self.tracker.drop(g)

    def param_grad_made(self, p: int) -> None:
        """Autograd has added parameter ``p``'s gradient of the segment whose backward runs
        now: the segment's uses of it are done, so a gradient complete for the step starts
        its all-reduce (or reduce-scatter) here, overlapping the rest of the backward, as
        DDP's hooks start theirs."""
        for _ in range(self.param_uses.pop(p, 0)):
            self.weights.used(p, self.weights.shards.current)

    def _hold_segment_partials(self, seg: Segment, u: int, whole_split: Any,
                               partial_slots: list) -> None:
        """Hold the partial sums of the gradients of the whole inputs ``whole_split`` that
        segment ``seg``'s split ops read, as many of those readers done as it has (the last
        on the stage all-reduces their sum, :meth:`_hold_partial`)."""
        L = self.layout
        per_pred = _summed(partial_slots, L.nflat)
        for p in whole_split:
            n = sum(1 for i in seg.backward_nodes for q in L.preds[i]
                    if q == p and self._split_read(i, p))
            if n:
                self._hold_partial((seg.micro_batch, u, p), per_pred.get(p), n)

    def _route_segment_grads(self, seg: Segment, u: int, slots: list) -> None:
        """Hand the gradients of segment ``seg``'s inputs on (as :meth:`_route_input_grads`
        does for one op): to parameters, to the producing segment on this stage, or (after
        its last local reader) to the producer's stage."""
        L = self.layout
        m = seg.micro_batch
        per_pred = _summed(slots, L.nflat)
        for p, n in zip(seg.inputs, seg.backward_uses, strict=True):
            if L.kind[p] == "param":  # (those no gradient reached: done now)
                for _ in range(self.param_uses.pop(p, 0)):
                    self.weights.used(p, (m, u))
                continue
            if L.kind[p] != "op" or not L.requires_grad[p]:
                continue
            gk = (m, u, p)
            if p in per_pred:
                self._store_grad(gk, per_pred[p])
            if L.stage[p] != L.s:
                self._readers_done(m, u, p, n)



def release_slots(slots: list) -> None:
    """Empty the gradient slots ``(input, part, slot)`` of entered tensors once their
    gradients are handed on: the entry's autograd node keeps its slot as long as the entered
    tensor lives (a received activation: the whole step), and with it the gradient."""
    for _, _, slot in slots:
        slot.clear()


def _summed(slots: list, nflat: list[int]) -> dict[int, list]:
    """Per input, the gradients its entries' ``slots`` got, summed per tensor of it."""
    per_pred: dict[int, list] = {}
    for p, pos, slot in slots:
        if slot:
            lst = per_pred.setdefault(p, [None] * nflat[p])
            lst[pos] = slot[0] if lst[pos] is None else lst[pos] + slot[0]
    return per_pred
