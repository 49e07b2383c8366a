"""The tasks that end a step: weight gradients sent to their weight's stage, a replicated
stage's gradient reductions in buckets, each stage's optimizer step; and ZeRO 1-2's gathers of
the shards the last step updated, during the forward.

:class:`GradientTasks` is the part of the task builder (:mod:`explorer.simulate.tasks`) that
makes them, after the forwards, backwards and their transfers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from explorer.costs.strategies import buckets
from explorer.simulate import tensor as split
from explorer.simulate.arrays import sums_by_stage
from explorer.simulate.effects import ALLGATHER, REDUCE_SCATTER
from explorer.simulate.taskgraph import ALLREDUCE, OPTIMIZER, FwdBwdLayout, Prefixed

if TYPE_CHECKING:
    from explorer.simulate.tasks import TaskBuilder

#: schedule slot of the optimizer step and of weight gradients sent home
LAST_SLOT = 10**9


class GradientTasks:
    """Steps of the task builder: gradients home, reductions, optimizer steps."""

    def gradients_sent_home(self: TaskBuilder) -> None:
        """A weight read on other stages gets its gradient from each: one transfer per
        (weight, stage), after the last backward there that reaches it
        (``sent_home``: weight -> those transfers)."""
        A, st, S, M, N, W = self.A, self.st, self.S, self.M, self.A.n, self.W
        is_pg = np.zeros(N, dtype=bool)
        is_pg[A.pg] = True
        self.sent_home: dict[int, list[int]] = {}
        e_p, e_c = A.e_p, A.e_c
        sel = is_pg[e_p] & A.has_b[e_c] & (st[e_p] != st[e_c])
        weight, reader = e_p[sel], e_c[sel]
        if not len(weight):
            return
        o = np.lexsort((reader, weight))
        weight, reader = weight[o], reader[o]
        keys = weight * S + st[reader]
        uk, k_edge, _, base = self._first_seen(keys, np.ones(len(keys), dtype=np.int64))
        up, us = uk // S, uk % S
        self._transfers(us, st[up], A.out_b[up], LAST_SLOT * W - up + (N + 1),
                        Prefixed("grad ", A.names_obj[up]), np.full(len(up), -1), up)
        for m in range(M):
            self.edges.add(self.off_b[reader], base[k_edge], m)
        for p, t in zip(up.tolist(), base.tolist(), strict=True):
            self.sent_home.setdefault(p, []).append(t)

    def stage_sizes(self: TaskBuilder) -> None:
        """Per stage, its trainable weights' bytes and count, the bytes each rank's optimizer
        steps (its shards under ZeRO) and the ZeRO level in effect; each node's bytes on its
        device (split weights: a device's share)."""
        A, S, eff = self.A, self.S, self.eff
        self.trainable_bytes = [0] * S
        self.trainable_count = [0] * S
        self.held = split.per_device(self.g, self.plan, A.param_bytes)
        self.out_bytes = split.per_device(self.g, self.plan, A.out_bytes)
        self.zero = [0] * S if eff is None else eff.zero
        self.stepped = [0] * S
        if A.trainable:  # (int64 sums: exact in any order)
            tr = np.asarray(A.trainable, dtype=np.int64)
            held = (A.pbytes if self.held is A.param_bytes else
                    np.asarray(self.held, dtype=np.int64))
            on = self.st[tr]
            self.trainable_bytes = sums_by_stage(S, on, held[tr])
            self.trainable_count = np.bincount(on, minlength=S).tolist()
            self.stepped = sums_by_stage(S, on, held[tr] if eff is None else eff.shard[tr])

    def reductions_and_optimizer_steps(self: TaskBuilder) -> None:
        """Per stage: its gradients reduced across replicas in buckets, then its optimizer
        step (after every backward, reduction and gradient sent home); under ZeRO 1-2 the
        gathers of the shards the step before updated."""
        pipelined = self.exchanges_activations()
        for s in range(self.S):
            weights = self.A.pg[self.st[self.A.pg] == s][::-1].tolist()
            waits_for = [t for p in weights for t in self.sent_home.get(p, ())]
            opt_s = self.optimizer_seconds(s)
            calls = 0  # ZeRO's collectives of the stage's buckets
            if self.plan.replicas_of(s) > 1 and weights:
                reductions, calls = self.bucket_reductions(s, weights, opt_s)
                waits_for += reductions
            if not self.trainable_count[s]:
                continue
            mine = ([i for i in self.A.trainable if self.stage[i] == s]
                    if self.zero[s] in (1, 2) else [])
            calls += len(buckets([int(self.held[i]) for i in mine])) if mine else 0
            if calls:  # what each costs the ranks' processors beyond the link, waited
                # for around the step (DeviceCosts.collective_s, measured on CPU ranks)
                opt_s += calls * max(self.costs.device_costs(d).collective_s
                                     for d in self.reps[s])
            step = self.task(OPTIMIZER, self.stage_res[s], opt_s, self.prio(LAST_SLOT),
                             f"{self.plan.optimizer} step")
            self.edges.src.extend(waits_for)
            self.edges.dst.extend([step] * len(waits_for))
            ops = self.ops_by_stage[s]
            last = np.where(self.off_b[ops] >= 0, self.off_b[ops], self.off_f[ops])
            for m in range(self.M):
                self.edges.add(last, np.full(len(last), step), m)
            if self.zero[s] in (1, 2):
                self.shard_gathers(s, step, mine, deferred=not pipelined[s])

    def exchanges_activations(self: TaskBuilder) -> np.ndarray:
        """Per stage, whether it sends or receives an op's output to or from another stage
        (a pipeline stage)."""
        A, st = self.A, self.st
        out = np.zeros(self.S, dtype=bool)
        cross = A.is_op[A.e_p] & A.is_op[A.e_c] & (st[A.e_p] != st[A.e_c])
        out[st[A.e_c[cross]]] = True
        out[st[A.e_p[cross]]] = True
        return out

    def optimizer_seconds(self: TaskBuilder, s: int) -> float:
        """Stage ``s``'s optimizer step on its slowest device, with fp16's unscaling of the
        reduced gradients and what sequence parallelism adds (the norms' gradients'
        all-reduce, whose bytes count as reduced)."""
        plan, costs = self.plan, self.costs
        # fp16 anywhere: every stage divides its reduced gradients by the loss scale before
        # its optimizer step, one elementwise pass over them, priced as an SGD step over
        # those bytes (also one elementwise pass per gradient)
        fp16 = any(plan.settings_of(k).precision == "fp16" for k in range(self.S))
        count = self.trainable_count[s]
        unscaled = ((self.stepped[s] if self.zero[s] else self.trainable_bytes[s])
                    if fp16 else 0)
        opt_s = max((costs.optimizer_s(dv, plan.optimizer, self.stepped[s], count)
                     + (costs.optimizer_s(dv, "sgd", unscaled, count) if unscaled else 0.0))
                    * self._opt_slowed(dv)
                    + split.optimizer_extra_s(costs, plan, s, dv, count)
                    for dv in self.types[s].values())
        seq_s, seq_bytes = split.sequence_grads(self.g, plan, costs, s)  # (norms' grads)
        self.allreduce_bytes += seq_bytes
        return opt_s + seq_s

    def reduces_each_micro_batch(self: TaskBuilder, s: int, weights: list[int]) -> bool:
        """Whether stage ``s`` reduce-scatters each micro-batch's gradients apart, as FSDP and
        DeepSpeed do under ZeRO 2-3 (only the shards accumulate over the micro-batches): so
        it does over several micro-batches, unless one of its ``weights`` is read on another
        stage too (that gradient comes home at the step's end; the runtime's rule too)."""
        return (self.zero[s] >= 2 and self.M > 1
                and not any(self.stage[c] != s for p in weights for c in self.g.succs[p]))

    def bucket_reductions(self: TaskBuilder, s: int, weights: list[int], opt_s: float
                          ) -> tuple[list[int], int]:
        """Stage ``s``'s replicas reduce their gradients in buckets of ``BUCKET_BYTES`` (in
        the order the backward makes them), each once the backwards that reach its weights
        are done: an all-reduce, or under ZeRO a reduce-scatter; where the stage reduces
        each micro-batch apart (:meth:`reduces_each_micro_batch`), one per bucket and
        micro-batch, once that micro-batch's backwards reach its weights. Returns the tasks
        and how many were reduce-scatters."""
        costs, M, per_m = self.costs, self.M, self.per_m
        group = split.replica_group(self.plan, s)
        has_b, off_b = self.A.has_b.tolist(), self.off_b.tolist()
        channel = self.resource(("allreduce", s, -1))
        # the first bucket also waits for the slowest replica to catch up
        lag = self._replica_lag(self.fb, s, group, M, opt_s)
        each = self.reduces_each_micro_batch(s, weights)
        made: list[int] = []
        scatters = 0
        n = len(group)
        k = -1  # (the position of the bucket's last weight in ``weights``: its priority)
        cuts = buckets([self.out_bytes[p] for p in weights])
        for bucket in ([weights[j] for j in cut] for cut in cuts):
            k += len(bucket)
            size = sum(self.out_bytes[p] for p in bucket)
            readers = [c for q in bucket for c in self.g.succs[q]
                       if has_b[c] and self.stage[c] == s]
            for m in range(M) if each else (None,):
                if self.zero[s]:  # each rank keeps 1/n of the gradient
                    t = self.task(REDUCE_SCATTER, channel,
                                  costs.reduce_scatter_s(group, size) + lag,
                                  self.prio(k + (m or 0) * len(weights)),
                                  f"reduce-scatter {size} B", -1 if m is None else m, size)
                    scatters += 1
                    self.allreduce_bytes += int((n - 1) * size)
                    for q in bucket:  # (the full gradient's end, per micro-batch where apart)
                        self.eff.grad_done.setdefault(q, []).append(t)  # type: ignore[union-attr]
                else:
                    t = self.task(ALLREDUCE, channel, costs.allreduce_s(group, size) + lag,
                                  self.prio(k), f"all-reduce {size} B", -1, size)
                    self.allreduce_bytes += int(2 * (n - 1) * size)
                lag = 0.0
                for c in readers:
                    for mb in range(M) if m is None else (m,):
                        self.edges.src.append(off_b[c] + mb * per_m)
                        self.edges.dst.append(t)
                for q in bucket:
                    for x in self.sent_home.get(q, ()):
                        self.edges.src.append(x)
                        self.edges.dst.append(t)
                made.append(t)
        return made, scatters

    def shard_gathers(self: TaskBuilder, s: int, step: int, weights: list[int],
                      deferred: bool) -> None:
        """ZeRO 1-2: the updated shards gathered into the full ``weights`` (the stage's, in
        graph order), one all-gather per bucket, in turn, as the runtime runs them
        (:class:`~explorer.runtime.sharding.UpdatedShards`): ``deferred`` (a stage that
        exchanges no activations with another), the shards the last step updated during this step's
        forward (Megatron's distributed optimizer overlaps them so), the first from the
        step's start and each next once the forward reaches the bucket before it (prefetch
        depth 1), the first forward of an op reading one of a bucket's weights waiting for
        its gather and the optimizer ``step`` for all; on a pipeline stage, after its
        optimizer step."""
        group = split.replica_group(self.plan, s)
        ops = self.ops_by_stage[s]
        pos = {int(o): k for k, o in enumerate(ops.tolist())}
        sizes = [int(self.held[p]) for p in weights]
        # (cut by the fp32 bytes, as the runtime cuts them; a 2-byte working copy moves half)
        moved = [b // 2 if self.eff.half_weights[p] else b
                 for p, b in zip(weights, sizes, strict=True)]
        channel = self.resource(("allreduce", s, -1))
        N, reached = self.A.n, -1  # (the previous bucket's first reader, by position)
        for bucket in buckets(sizes):
            size = sum(moved[k] for k in bucket)
            readers = sorted({pos[c] for k in bucket for c in self.g.succs[weights[k]]
                              if c in pos})
            first = int(ops[readers[0]]) if readers else N - 1
            gather = self.task(ALLGATHER, channel, self.costs.allgather_s(group, size),
                               int(self.slots_f[s, 0]) * self.W + first + N + 1
                               if deferred else self.prio(LAST_SLOT),
                               f"all-gather {size} B", -1, size)
            self.allreduce_bytes += int((len(group) - 1) * size)
            if not deferred:
                self.edges.src.append(step)
                self.edges.dst.append(gather)
                continue
            if reached > 0:
                self.edges.src.append(int(self.off_f[ops[reached - 1]]))
                self.edges.dst.append(gather)
            for k in readers:
                self.edges.src.append(gather)
                self.edges.dst.append(int(self.off_f[ops[k]]))
            self.edges.src.append(gather)
            self.edges.dst.append(step)
            if readers:
                reached = readers[0]

    def _opt_slowed(self: TaskBuilder, device: str) -> float:
        """How much slower ``device``'s optimizer step runs beside its stage's other replicas
        (they step the same parameters at the same moment), as its platform says from the
        profile's ``DeviceCosts.optimizer_contention``."""
        others = (self.others or {}).get(device, 0.0)
        ratio = self.costs.device_costs(device).optimizer_contention
        return self.costs.platform(device).optimizer_slowdown(ratio, others)

    def _replica_lag(self: TaskBuilder, fb: FwdBwdLayout, s: int, devices: list[str], M: int,
                     opt_s: float) -> float:
        """How long stage ``s``'s gradient all-reduce waits, on average, for its slowest
        replica beyond the replicas' common pace, as the platform of the replica that wanders
        most (``DeviceCosts.replica_spread``) says from the stage's busy time."""
        costs = self.costs
        widest = max(devices, key=lambda d: costs.device_costs(d).replica_spread)
        spread = costs.device_costs(widest).replica_spread
        if spread <= 0.0:
            return 0.0
        busy = M * float(fb.dur_s[fb.stage == s].sum()) + opt_s
        return costs.platform(widest).replica_lag_s(spread, busy, len(devices))
