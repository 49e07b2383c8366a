"""Memory per device at its peak: weights, gradients, optimizer state, buffers, and activations by
liveness along the simulated timeline.

:func:`memory_at_peaks` runs a :class:`_MemoryPass` over the scheduled step. What a stage holds
all step long (weights, buffers, optimizer state) is summed per stage; every other tensor's
life becomes two events on its stage's timeline (:mod:`explorer.simulate.peaks`), one named
step per kind of tensor: activations, what ops save besides them, backward scratch, autocast's
copies, activation gradients, graph inputs, received values and gradients, weight gradients
and ZeRO 3's gathered weights. Each stage's peak is the first maximum of their running total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE, Plan
from explorer.simulate.arrays import KIND_BUFFER, KIND_INPUT, KIND_PARAM, ranges, sums_by_stage
from explorer.simulate.effects import ALLGATHER, REDUCE_SCATTER
from explorer.simulate.peaks import EventArrays, Events, stage_peaks
from explorer.simulate.prediction import MemoryBreakdown
from explorer.simulate.schedule import Timing
from explorer.simulate.segment_spans import segment_backward_spans
from explorer.simulate.taskgraph import ALLREDUCE, OPTIMIZER, TaskGraph
from explorer.simulate.tensor import activations_per_device, per_device, saved_extra_per_device


def memory_at_peaks(graph: OpGraph, plan: Plan, tasks: TaskGraph, timing: Timing
                    ) -> dict[str, MemoryBreakdown]:
    """Per device, its memory at the moment the scheduled step needs most."""
    return _MemoryPass(graph, plan, tasks, timing).breakdowns()


@dataclass(frozen=True)
class _Held:
    """Per stage, the bytes held all step long."""

    params: list[int]
    buffers: list[int]
    optimizer: list[int]


@dataclass(frozen=True)
class _Saved:
    """Tensors kept for a backward, as (producer root, node whose backward keeps it) pairs:
    ``producer``/``keeper`` the op and input outputs (the first ``n_saved`` saved, the rest
    the sources a recomputation starts from, which count as saved by the backward that
    recomputes from them); ``any_producer``/``any_keeper`` the same of every node kind.
    ``cached``/``cached_until``: values of a checkpointed span that its policy keeps in its
    cache, held until the start of the backward of that op (where the span runs again)."""

    producer: np.ndarray
    keeper: np.ndarray
    n_saved: int
    any_producer: np.ndarray
    any_keeper: np.ndarray
    cached: np.ndarray
    cached_until: np.ndarray


class _MemoryPass:
    """One pass over a scheduled step's tasks: the lives of its tensors as memory events."""

    def __init__(self, graph: OpGraph, plan: Plan, tasks: TaskGraph, timing: Timing) -> None:
        self.graph, self.plan, self.tasks, self.timing = graph, plan, tasks, timing
        self.arrays = tasks.arrays
        self.stage, self.stage_a = tasks.stage, tasks.stage_a
        self.micro_batches = plan.micro_batches
        self.stages = len(plan.stages)
        #: tasks per micro-batch; the forward and backward task of each node in micro-batch 0
        self.per_mb, self.fwd, self.bwd = tasks.fb.per_mb, tasks.fb.fwd, tasks.fb.bwd
        self.start_a, self.end_a = timing.arrays
        self.fraction = np.asarray(tasks.batch_fraction)
        self.effects = tasks.effects
        # each node's output bytes on its device (split activations: a share)
        self.out_bytes = (activations_per_device(graph, plan, self.arrays.out_b)
                          if self.effects is None else self.effects.act_bytes)
        self.events = Events()

    def breakdowns(self) -> dict[str, MemoryBreakdown]:
        """Per device, its stage's memory at the stage's peak."""
        held = self.held_all_step()
        saved = self.saved()
        self.activations(saved)
        self.saved_extras()
        self.backward_scratch()
        self.autocast_copies()
        local_grad = self.activation_gradients()
        self.graph_inputs(saved)
        self.received(saved, local_grad)
        peaks = stage_peaks(self.stages, self.events.arrays(), self.weight_gradients(),
                            self.gathered_weights())
        out = {}
        for s in range(self.stages):
            activations, grads, gathered = peaks[s]
            breakdown = MemoryBreakdown(held.params[s], grads, held.optimizer[s],
                                        held.buffers[s], activations, gathered)
            for d in self.plan.stages[s]:
                out[d] = breakdown
        return out

    # -- helpers ---------------------------------------------------------------------------
    def size_on(self, nbytes: np.ndarray, stage: np.ndarray) -> np.ndarray:
        """Bytes of a micro-batch's share on each ``stage`` (a replica's share of the rows)."""
        return (nbytes * self.fraction[stage]).astype(np.int64)

    def task_of(self, offsets: np.ndarray, m: int) -> np.ndarray:
        """The tasks of micro-batch ``m`` at ``offsets`` of the per-micro-batch block."""
        return offsets + m * self.per_mb

    # -- all step long ---------------------------------------------------------------------
    def held_all_step(self) -> _Held:
        """Weights (a ZeRO-3 rank's shard; under ZeRO 1-2 in bf16/fp16, the 2-byte working
        copy and the fp32 master shard), buffers and optimizer state (a ZeRO rank's shard's)
        per stage, and a copy of each weight or buffer on every other stage that reads it."""
        A, st, S = self.arrays, self.stage_a, self.stages
        eff = self.effects
        params, buffers, optimizer = [0] * S, [0] * S, [0] * S
        param_bytes = per_device(self.graph, self.plan, A.param_bytes)  # (a device's share)
        zero = [0] * S if eff is None else eff.zero
        shard = param_bytes if eff is None else eff.shard.tolist()
        held = np.flatnonzero(A.pbytes)
        if len(held):
            # (sums of int64 arrays: exact, in any order)
            whole = (A.pbytes if param_bytes is A.param_bytes else
                     np.asarray(param_bytes, dtype=np.int64))[held]
            shards = whole if shard is param_bytes else np.asarray(shard, dtype=np.int64)[held]
            on, level = st[held], np.asarray(zero, dtype=np.int64)[st[held]]
            buf = A.kcode[held] == KIND_BUFFER
            buffers = sums_by_stage(S, on[buf], whole[buf])
            # (ZeRO 1-2 under bf16/fp16: a 2-byte working copy and the fp32 master shard)
            working = (np.zeros(len(held), dtype=bool) if eff is None
                       else eff.half_weights[held] & (level != 3))
            params = sums_by_stage(S, on[~buf], np.where(
                level == 3, shards, np.where(working, whole // 2 + shards, whole))[~buf])
            stepped = ~buf & (A.rg[held] | A.is_op[held])
            per_byte = OPTIMIZER_STATE[self.plan.optimizer]
            optimizer = sums_by_stage(S, on[stepped],
                                      np.where(level != 0, shards, whole)[stepped] * per_byte)
        e_p, e_c = A.e_p, A.e_c
        copied = (((A.kcode[e_p] == KIND_PARAM) | (A.kcode[e_p] == KIND_BUFFER))
                  & (st[e_c] != st[e_p]))
        for p, s in set(zip(e_p[copied].tolist(), st[e_c[copied]].tolist(), strict=True)):
            params[s] += A.out_bytes[p]
        return _Held(params, buffers, optimizer)

    def saved(self) -> _Saved:
        """The tensors kept for a backward: the graph's saved pairs, less what autocast saved
        a copy of (:meth:`autocast_copies`), plus a recomputation's sources, less the values
        a checkpoint policy caches (held as made by the forward, even where their own unit
        drops them as saved)."""
        A, N, eff = self.arrays, self.arrays.n, self.effects
        producer, keeper = A.saved
        any_producer, any_keeper = A.saved_any
        if eff is not None and len(eff.casts[0]):
            cast_keys = eff.casts[0] * N + eff.casts[1]
            cast = np.isin(keeper * N + producer, cast_keys)
            producer, keeper = producer[~cast], keeper[~cast]
            cast = np.isin(any_keeper * N + any_producer, cast_keys)
            any_producer, any_keeper = any_producer[~cast], any_keeper[~cast]
        n_saved = len(producer)
        cached = cached_until = np.zeros(0, dtype=np.int64)
        if eff is not None and len(eff.sources[0]):
            source, user = eff.sources
            if len(eff.span_first):
                first = eff.span_first[source]
                in_span = (first >= 0) & (first == eff.span_first[user])
                cached, cached_until = source[in_span], first[in_span]
                source, user = source[~in_span], user[~in_span]
            producer, keeper = np.concatenate([producer, source]), np.concatenate([keeper, user])
            any_producer = np.concatenate([any_producer, source])
            any_keeper = np.concatenate([any_keeper, user])
        return _Saved(producer, keeper, n_saved, any_producer, any_keeper, cached, cached_until)

    # -- the lives of tensors --------------------------------------------------------------
    def activations(self, saved: _Saved) -> None:
        """Activations of ops that own their memory: from the forward's start until the last
        forward consumer (through views), saving backward or the loss's backward. An output
        sent to another stage is handed to the send when its forward ends (the runtime's
        accounting); a recomputed one lives again from its recomputation
        (:meth:`recomputed`)."""
        A, st, N, eff = self.arrays, self.stage_a, self.arrays.n, self.effects
        is_op, has_b, fwd, bwd = A.is_op, A.has_b, self.fwd, self.bwd
        root = A.root_a
        owners = np.flatnonzero(is_op & (root == np.arange(N)))
        if not len(owners):
            return
        on = st[owners]
        size = self.size_on(self.out_bytes[owners], on)
        place = np.full(N, -1, dtype=np.int64)  # owning op -> its place in owners
        place[owners] = np.arange(len(owners))
        owner = root[A.e_p]
        reads = place[owner] >= 0
        owner, reader = owner[reads], A.e_c[reads]
        forward_read = (st[owner] == st[reader]) & is_op[reader]
        # (owner, task): a task besides the owner's forward that may end the activation's
        # life, as its offset in micro-batch 0's block
        ends = [(owner[forward_read], fwd[reader[forward_read]])]
        loss = self.graph.index.get(self.graph.loss, -1) if self.graph.loss else -1
        if loss >= 0 and place[loss] >= 0 and has_b[loss]:
            ends.append((np.array([loss]), bwd[[loss]]))
        producer, keeper = saved.producer, saved.keeper
        kept = (place[producer] >= 0) & (st[keeper] == st[producer]) & has_b[keeper]
        if eff is not None:  # recomputed outputs live again from their recomputation
            again = eff.dropped[producer] & (np.arange(len(producer)) < saved.n_saved)
            rerun = kept & again
            kept &= ~again
            # (checkpoint runs a span again whole, in its first backward: StageEffects.
            # rerun_at; the op path each op in the first backward that needs it)
            made_in = (np.where(eff.rerun_at >= 0, eff.rerun_at, eff.rc_op)
                       if len(eff.rerun_at) else eff.rc_op)
            self.recomputed(made_in, producer[rerun], keeper[rerun])
        ends.append((producer[kept], bwd[keeper[kept]]))
        end_owner = place[np.concatenate([o for o, _ in ends])]
        end_task = np.concatenate([t for _, t in ends])
        cached_at = place[saved.cached]
        for m in range(self.micro_batches):
            freed = self.end_a[self.task_of(fwd[owners], m)]
            np.maximum.at(freed, end_owner, self.end_a[self.task_of(end_task, m)])
            np.maximum.at(freed, cached_at,
                          self.start_a[self.task_of(bwd[saved.cached_until], m)])
            self.events.live(on, self.start_a[self.task_of(fwd[owners], m)], freed, size)

    def recomputed(self, made_in: np.ndarray, producer: np.ndarray, keeper: np.ndarray
                   ) -> None:
        """Saved outputs that recomputation drops (``producer``, saved by ``keeper``,
        pairwise): each lives again from the start of the backward that makes it again
        (``made_in``: per node) until the last backward that saved it is done."""
        if not len(producer):
            return
        st = self.stage_a
        unique, first, inverse = np.unique(producer, return_index=True, return_inverse=True)
        size = self.size_on(self.out_bytes[producer], st[producer])[first]
        for m in range(self.micro_batches):
            freed = np.full(len(unique), -np.inf)
            np.maximum.at(freed, inverse.reshape(-1), self.end_a[self.task_of(self.bwd[keeper],
                                                                              m)])
            made = self.start_a[self.task_of(self.bwd[made_in[unique]], m)]
            self.events.live(st[unique], made, freed, size)

    def saved_extras(self) -> None:
        """Extra tensors saved for the backward (masks, statistics, indices): made by the
        forward, kept until the backward. The op path's recomputation makes op outputs again,
        not these (it keeps them from the forward); checkpoint makes again all a span saves
        (StageEffects.extra_from: from the backward that runs the span again)."""
        A, st, eff = self.arrays, self.stage_a, self.effects
        extra = (saved_extra_per_device(self.graph, self.plan, A.extra) if eff is None
                 else eff.extra_bytes)
        ops = np.flatnonzero(A.has_b & (extra != 0))
        if not len(ops):
            return
        again = (eff.extra_from[ops] if eff is not None and len(eff.extra_from)
                 else np.full(len(ops), -1, dtype=np.int64))
        made = np.where(again >= 0, self.bwd[np.maximum(again, 0)], self.fwd[ops])
        size = self.size_on(extra[ops], st[ops])
        for m in range(self.micro_batches):
            self.events.live(st[ops], self.start_a[self.task_of(made, m)],
                             self.end_a[self.task_of(self.bwd[ops], m)], size)

    def backward_scratch(self) -> None:
        """The gradients an op's backward passes between the autograd nodes it is made of (a
        cross-entropy's log-softmax gradient): held while that backward runs."""
        A, st = self.arrays, self.stage_a
        scratch = saved_extra_per_device(self.graph, self.plan, A.scratch)
        ops = np.flatnonzero(A.has_b & (scratch != 0))
        if not len(ops):
            return
        size = self.size_on(scratch[ops], st[ops])
        for m in range(self.micro_batches):
            task = self.task_of(self.bwd[ops], m)
            self.events.live(st[ops], self.start_a[task], self.end_a[task], size)

    def autocast_copies(self) -> None:
        """bf16/fp16: the 2-byte copy a matmul-like op saved of what it read in fp32: a
        weight's whole, once a step (autocast's cache: from the first forward that casts it
        until the last backward that saved it), or per micro-batch (an activation's share of
        the micro-batch; a weight read through a view, gathered by ZeRO 3 or on a stage that
        recomputes) until the op's backward."""
        A, st, eff = self.arrays, self.stage_a, self.effects
        if eff is None or not len(eff.casts[0]):
            return
        op, value = eff.casts
        # (of a tensor-parallel stage's split weights and activations, a device's share)
        mine = per_device(self.graph, self.plan,
                          activations_per_device(self.graph, self.plan, A.out_b))
        size = np.where(A.kcode[value] == KIND_PARAM, mine[value] // 2,
                        self.size_on(mine[value] // 2, st[op]))
        once = eff.cast_once
        for m in range(self.micro_batches):
            self.events.live(st[op[~once]], self.start_a[self.task_of(self.fwd[op[~once]], m)],
                             self.end_a[self.task_of(self.bwd[op[~once]], m)], size[~once])
        if not once.any():
            return
        # one copy per (stage, weight): cast by its first forward, held by the cache until
        # the stage's last forward and by autograd until the last backward that saved it
        stage, weight = st[op[once]], value[once]
        first = np.min([self.start_a[self.task_of(self.fwd[op[once]], m)]
                        for m in range(self.micro_batches)], axis=0)
        last = np.max([self.end_a[self.task_of(self.bwd[op[once]], m)]
                       for m in range(self.micro_batches)], axis=0)
        keys, pair, where = np.unique(stage * A.n + weight, return_index=True,
                                      return_inverse=True)  # (pair: one cast of each key)
        where = where.reshape(-1)
        made, freed = np.full(len(keys), np.inf), np.zeros(len(keys))
        np.minimum.at(made, where, first)
        np.maximum.at(freed, where, last)
        self.events.live(stage[pair], made, freed, size[once][pair])

    def activation_gradients(self) -> np.ndarray:
        """Activation gradients, as autograd and the runtime hold them; returns, per node,
        whether its gradient is made on its own stage.

        A consumer's backward makes the gradient of each op it reads: a new tensor, or the
        consumer's own incoming gradient handed on (views, getitem, same-size add, cat: see
        GraphArrays.hands_on). Per op and stage, the first gradient made (in schedule order)
        is kept until the op's own backward (for an op on another stage: until it is sent,
        after the backward of its last consumer here); later ones are added into it and live
        for their backward only; a handed-on gradient keeps its buffer alive until the
        receiving op's backward."""
        A, st, S, N = self.arrays, self.stage_a, self.stages, self.arrays.n
        has_b, bwd = A.has_b, self.bwd
        both = has_b[A.e_p] & has_b[A.e_c]
        local_grad = np.zeros(N, dtype=bool)
        if not both.any():
            return local_grad
        hands_on, piece = (x[both] for x in A.hands_on)
        node, reader = A.e_p[both], A.e_c[both]
        new = ~hands_on
        maker = st[reader]  # the stage that makes (and holds) the gradient
        local = st[node] == maker
        local_grad[node[local]] = True
        _, gradient = np.unique(node * S + maker, return_inverse=True)  # per (node, stage)
        n_gradients = int(gradient.max()) + 1
        shared = np.flatnonzero(np.bincount(gradient, minlength=n_gradients)[gradient] > 1)
        shared_gradient = gradient[shared]
        far = np.flatnonzero(~local)
        size = self.size_on(self.out_bytes[node], maker)
        handing = np.flatnonzero(hands_on)
        receiver, receiver_of = np.unique(reader[handing], return_inverse=True)
        receiver_stage = st[receiver]
        receiver_size = self.size_on(self.out_bytes[receiver], receiver_stage)
        for m in range(self.micro_batches):
            task = self.task_of(bwd[reader], m)
            b0, b1 = self.start_a[task], self.end_a[task]
            # the first of several consumers' backwards (a zero-length one before a longer one
            # that starts at the same time: it ran first)
            first = np.ones(len(node), dtype=bool)
            if len(shared):
                o = np.lexsort((b1[shared], b0[shared], shared_gradient))
                head = np.ones(len(o), dtype=bool)
                head[1:] = shared_gradient[o][1:] != shared_gradient[o][:-1]
                first[shared] = False
                first[shared[o[head]]] = True
                first |= piece
            freed = self.end_a[self.task_of(bwd[node], m)]
            if len(far):  # sent home after the backward of the last consumer here
                sent = np.full(n_gradients, -np.inf)
                np.maximum.at(sent, gradient[far], b1[far])
                freed[far] = sent[gradient[far]]
            k = new & first
            self.events.live(maker[k], b0[k], freed[k], size[k])
            k = new & ~first
            self.events.live(maker[k], b0[k], b1[k], size[k])
            if len(handing):
                until = np.full(len(receiver), -np.inf)
                f = first[handing]
                np.maximum.at(until, receiver_of[f], freed[handing[f]])
                k = np.isfinite(until)
                self.events.live(receiver_stage[k],
                                 self.end_a[self.task_of(bwd[receiver[k]], m)], until[k],
                                 receiver_size[k])
        return local_grad

    def graph_inputs(self, saved: _Saved) -> None:
        """Graph inputs: from their first consumer's forward until their last use on each
        stage (a forward reading it, a backward that saved it)."""
        A, stage = self.arrays, self.stage
        start, end = self.timing.start, self.timing.end
        per_mb = self.per_mb
        saved_by: dict[int, list[int]] = {}
        sel = A.kcode[saved.producer] == KIND_INPUT
        for p, v in zip(saved.producer[sel].tolist(), saved.keeper[sel].tolist(), strict=True):
            saved_by.setdefault(p, []).append(v)
        fwd, bwd, has_b = _Items(self.fwd), _Items(self.bwd), _Items(A.has_b)
        on: list[int] = []
        made: list[float] = []
        freed: list[float] = []
        nbytes: list[int] = []
        for i in np.flatnonzero(A.kcode == KIND_INPUT).tolist():
            users_by_stage: dict[int, list[int]] = {}
            for c in self.graph.succs[i]:
                users_by_stage.setdefault(stage[c], []).append(c)
            for m in range(self.micro_batches):
                mo = m * per_mb
                for s, users in users_by_stage.items():
                    last = max(end[fwd[c] + mo] for c in users)
                    for v in saved_by.get(i, ()):
                        if stage[v] == s and has_b[v]:
                            last = max(last, end[bwd[v] + mo])
                    on.append(s)
                    made.append(min(start[fwd[c] + mo] for c in users))
                    freed.append(last)
                    nbytes.append(int(A.out_bytes[i] * self.tasks.batch_fraction[s]))
        if on:
            self.events.live(np.asarray(on, dtype=np.int64), np.asarray(made),
                             np.asarray(freed), np.asarray(nbytes, dtype=np.int64))

    def received(self, saved: _Saved, local_grad: np.ndarray) -> None:
        """Received activations and activation gradients: from the first task that needs them
        on the receiving stage (it receives them) until their last use there: the tasks
        waiting for them and, for activations, the backwards of the nodes that saved the
        tensor. A gradient for an op that also gets gradients on its own stage is added into
        those (one buffer), and of several received for one op and micro-batch the first is
        kept; a stage running segments receives its segment's gradients before the
        segment's one backward call, and holds them until it ends."""
        tasks, A, st = self.tasks, self.arrays, self.stage_a
        rc = tasks.receives
        if not len(rc.task):
            return
        start_a, end_a, has_b = self.start_a, self.end_a, A.has_b
        freed = end_a[rc.task]
        made = np.full(len(rc.task), np.inf)
        k, idx = ranges(tasks.succ_ptr_a[rc.task], tasks.succ_ptr_a[rc.task + 1])
        np.maximum.at(freed, k, end_a[tasks.succ_flat_a[idx]])
        np.minimum.at(made, k, start_a[tasks.succ_flat_a[idx]])
        made = np.where(np.isfinite(made), made, end_a[rc.task])
        by_producer = np.argsort(saved.any_producer, kind="stable")
        producer, keeper = saved.any_producer[by_producer], saved.any_keeper[by_producer]
        root = A.root_a[rc.node]
        lo = np.where(rc.activation, np.searchsorted(producer, root, side="left"), 0)
        hi = np.where(rc.activation, np.searchsorted(producer, root, side="right"), 0)
        k, idx = ranges(lo, hi)
        v = keeper[idx]
        ok = (st[v] == rc.stage[k]) & has_b[v]
        k, v = k[ok], v[ok]
        np.maximum.at(freed, k, end_a[self.bwd[v] + rc.mb[k] * self.per_mb])
        spans = segment_backward_spans(self.graph, self.plan, tasks, self.timing)
        for k in np.flatnonzero(~rc.activation).tolist() if spans else ():
            span = spans.get((int(rc.stage[k]), int(rc.mb[k]), int(rc.node[k])))
            if span is not None:
                made[k], freed[k] = span[0], max(freed[k], span[1])
        keep = rc.activation | ~local_grad[rc.node]
        gradients = np.flatnonzero(~rc.activation & keep)
        if len(gradients):  # one received gradient per op and micro-batch
            _, at = np.unique(rc.node[gradients] * self.micro_batches + rc.mb[gradients],
                              return_index=True)
            keep[gradients] = False
            keep[gradients[at]] = True
        size = (rc.nbytes[keep] * self.micro_batches * self.fraction[rc.stage[keep]]
                ).astype(np.int64)
        self.events.live(rc.stage[keep], made[keep], freed[keep], size)

    def optimizer_ends(self) -> list[float]:
        """Per stage, when its optimizer step ends (the step's end where it has none)."""
        tasks, end_a = self.tasks, self.end_a
        ends = [float(end_a.max()) if len(end_a) else 0.0] * self.stages
        for t in range(len(tasks.kind) - 1, -1, -1):
            if tasks.kind[t] == OPTIMIZER:
                ends[tasks.res[t]] = self.timing.end[t]
            elif tasks.kind[t] not in (ALLREDUCE, REDUCE_SCATTER, ALLGATHER):
                break  # the optimizer steps are the last tasks (with the all-reduces)
        return ends

    def weight_gradients(self) -> EventArrays:
        """Weight gradients: from the first backward that reaches a weight until the optimizer
        step has used it (torch frees them with zero_grad(set_to_none=True)); under ZeRO the
        rank's shard from its reduce-scatter on, and under ZeRO 2 and 3 the full gradient
        only until then; and what accumulating into them makes (:func:`_accumulations`)."""
        A, st, S, eff = self.arrays, self.stage_a, self.stages, self.effects
        pbytes = per_device(self.graph, self.plan, A.pbytes)
        holds = (pbytes != 0) & (A.kcode != KIND_BUFFER) & (A.rg | A.is_op)
        own_ops = np.flatnonzero(holds & A.is_op)
        sel = holds[A.e_p] & ~A.is_op[A.e_p]
        node = np.concatenate([own_ops, A.e_p[sel]])
        user = np.concatenate([own_ops, A.e_c[sel]])
        sel = A.has_b[user]
        node, user = node[sel], user[sel]
        if not len(node):
            return EventArrays.none()
        user_stage, M = st[user], self.micro_batches
        first_by_m = np.stack([self.start_a[self.task_of(self.bwd[user], m)]
                               for m in range(M)])  # [micro-batch, edge]
        keys, inverse = np.unique(node * S + user_stage, return_inverse=True)
        made = np.full(len(keys), np.inf)
        np.minimum.at(made, inverse, first_by_m.min(axis=0))
        on, size = keys % S, pbytes[keys // S]
        freed = step_end = np.asarray(self.optimizer_ends())[on]
        zero = [0] * S if eff is None else eff.zero
        apart = np.zeros(len(keys), dtype=bool)  # reduced a micro-batch at a time
        if eff is not None and max(zero):
            weight = keys // S
            ends = [[self.timing.end[t] for t in eff.grad_done[p]]
                    if p in eff.grad_done and zero[s] and self.stage[p] == s else []
                    for p, s in zip(weight.tolist(), on.tolist(), strict=True)]
            apart = np.array([len(e) > 1 for e in ends], dtype=bool)
            done = np.array([e[0] if e else np.nan for e in ends])
            k = np.flatnonzero(~np.isnan(done))
            full_kept = np.isnan(done) | (np.asarray(zero, dtype=np.int64)[on] == 1)
            freed = np.where(full_kept, freed, done)
            # each micro-batch's full gradient, from its first backward reaching the weight
            # to that micro-batch's reduce-scatter (in place of the one for the step)
            a = np.flatnonzero(apart)
            made_m = np.full((len(a), M), np.inf)  # (the keys reduced apart only)
            sel = np.flatnonzero(apart[inverse])
            np.minimum.at(made_m, np.searchsorted(a, inverse[sel]), first_by_m.T[sel])
            whole = ~apart
            on = np.concatenate([on[whole], np.repeat(on[a], M), on[k]])
            made = np.concatenate([made[whole], made_m.ravel(), done[k]])
            freed = np.concatenate([freed[whole],
                                    np.asarray([ends[i] for i in a.tolist()]).reshape(-1),
                                    step_end[k]])
            size = np.concatenate([size[whole], np.repeat(size[a], M),
                                   eff.shard[weight[k]]])
        # (a 2-byte working copy's backward makes its gradient in 2 bytes, added into the
        # fp32 gradient held for the optimizer)
        made_bytes = (np.where(eff.half_weights, pbytes // 2, pbytes)
                      if eff is not None and len(eff.half_weights) else pbytes)
        more = _accumulations(node, user, user_stage, self.bwd, self.per_mb, M,
                              self.timing.arrays, made_bytes, S, keys[apart])
        return EventArrays(np.concatenate([on, on, more.stage]),
                           np.concatenate([made, freed, more.time]),
                           np.concatenate([size, -size, more.nbytes]))

    def gathered_weights(self) -> EventArrays:
        """ZeRO 3's full weight copies: each gathered at its all-gather's start and freed
        when the last op it was gathered for is done."""
        eff, tasks = self.effects, self.tasks
        if eff is None or not eff.gathers:
            return EventArrays.none()
        start_a, end_a = self.start_a, self.end_a
        s = np.array([g.stage for g in eff.gathers], dtype=np.int64)
        made = np.array([start_a[g.task] for g in eff.gathers])
        freed = np.array([max(float(end_a[g.task]),
                              float(end_a[self.task_of(g.readers, g.mb)].max()))
                          for g in eff.gathers])
        b = np.array([tasks.nbytes[g.task] for g in eff.gathers], dtype=np.int64)
        return EventArrays(np.concatenate([s, s]), np.concatenate([made, freed]),
                           np.concatenate([b, -b]))


def _accumulations(node: np.ndarray, user: np.ndarray, stage: np.ndarray, off_b: np.ndarray,
                   per_m: int, M: int, task_times: tuple[np.ndarray, np.ndarray],
                   nbytes: np.ndarray, S: int, apart: np.ndarray) -> EventArrays:
    """Memory events of gradient accumulation: a backward that reaches a weight after the
    first on its stage (another micro-batch, another op reading it) makes the weight's
    gradient anew, and autograd adds it into the one held when that backward ends: a
    gradient's size more for the length of the backward. ``node`` are the weights, ``user``
    the ops whose backward reaches them, ``stage`` the stage holding each; ``apart`` the
    ``weight * S + stage`` keys whose gradient each micro-batch makes anew (reduced a
    micro-batch at a time: only another op of the same micro-batch adds into it)."""
    start_a, end_a = task_times
    task = (off_b[user][:, None] + np.arange(M)[None, :] * per_m).ravel()
    weight, held = np.repeat(node, M), np.repeat(stage, M)
    t0, t1 = start_a[task], end_a[task]
    key = weight * S + held
    if len(apart):
        key = key * M + np.where(np.isin(key, apart), np.tile(np.arange(M), len(user)), 0)
    order = np.lexsort((t0, key))
    again = np.zeros(len(order), dtype=bool)
    again[1:] = key[order][1:] == key[order][:-1]
    later = order[again]
    size = nbytes[weight[later]].astype(np.int64)
    return EventArrays(np.concatenate([held[later], held[later]]),
                       np.concatenate([t0[later], t1[later]]), np.concatenate([size, -size]))


class _Items:
    """An array read one item at a time as Python values (for a few items of a long array:
    cheaper than its ``tolist()``)."""

    def __init__(self, a: np.ndarray) -> None:
        self.item = a.item

    def __getitem__(self, k: int):
        return self.item(k)
