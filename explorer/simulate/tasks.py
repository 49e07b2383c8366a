"""Builds the task graph of one step: forwards, backwards, transfers, all-reduces, optimizer steps.

The result is a :class:`~explorer.simulate.taskgraph.TaskGraph`. The forwards and backwards of
a micro-batch are one block laid out from a per-op template, durations come from the cost
tables as arrays, dependencies are built from the graph's edge arrays; a priority is one
integer, so the schedule's per-resource queues are heaps of ints
(:mod:`explorer.simulate.schedule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.costs.strategies import BUCKET_BYTES, buckets
from explorer.simulate import tensor as split
from explorer.simulate.arrays import KIND_INPUT, GraphArrays, sums_by_stage
from explorer.simulate.effects import (
    ALLGATHER,
    REDUCE_SCATTER,
    add_weight_gathers,
    stage_effects,
)
from explorer.simulate.seconds import Seconds, plain_costs
from explorer.simulate.taskgraph import (
    ALLREDUCE,
    BWD,
    FWD,
    GATE,
    OPTIMIZER,
    SEND,
    Column,
    FwdBwdLayout,
    Prefixed,
    Receives,
    Repeated,
    Resource,
    TaskGraph,
)

_LAST = 10**9  # schedule slot of the optimizer step and of weight gradients sent home


def build_tasks(graph: OpGraph, plan: Plan, costs: CostModel,
                others: dict[str, float] | None = None) -> TaskGraph:
    """The task graph of one step of ``graph`` under ``plan``; ``others`` (device -> how many
    other replicas of its stage compute beside it) slows ops where contention was measured."""
    return _Builder(graph, plan, costs, others).build()


class _Builder:
    """Collects the tasks one kind after another, then makes the :class:`TaskGraph`."""

    def __init__(self, graph: OpGraph, plan: Plan, costs: CostModel,
                 others: dict[str, float] | None = None) -> None:
        self.g, self.plan, self.costs = graph, plan, costs
        self.others = others
        # per task
        self.kind = Column()
        self.res: list[int] = []
        self.dur: list[float] = []
        # the schedule priority (a tuple once) as one order-keeping int, of the tasks after
        # the forward/backward block (whose own are kept as an array)
        self.enc = Column()
        self.label = Column()
        self.mb = Column()
        self.nbytes = Column()
        self.node = Column()  # the op of a forward or backward, the producer of a transfer
        self.resources: list[Resource] = []
        self.res_index: dict[Resource, int] = {}
        self.late_xfer: list[tuple[int, float]] = []  # (transfer, late-receive wait s)
        self.transfer_bytes = 0

    def resource(self, key: Resource) -> int:
        r = self.res_index.get(key)
        if r is None:
            r = self.res_index[key] = len(self.resources)
            self.resources.append(key)
        return r

    def task(self, kind: str, res: int, dur: float, enc: int, label: str, mb: int = -1,
             nbytes: int = 0, node: int = -1) -> int:
        t = len(self.kind)
        self.kind.append(kind)
        self.res.append(res)
        self.dur.append(dur)
        self.enc.append(enc)
        self.label.append(label)
        self.mb.append(mb)
        self.nbytes.append(nbytes)
        self.node.append(node)
        return t

    def prio(self, slot: int) -> int:
        """The priority tuple ``(slot,)`` as an int that orders like the ``(slot, x)`` ones."""
        return slot * self.W

    # -- building ------------------------------------------------------------------------
    def build(self) -> TaskGraph:
        g, plan, costs = self.g, self.plan, self.costs
        A = GraphArrays.of(g)
        N = A.n
        self.W = W = 2 * N + 2  # (slot, x) with -N < x < N  ->  slot * W + x + N + 1
        names, out_b = A.names, A.out_bytes
        succs = g.succs
        if type(plan).assignment is Plan.assignment:  # the same list, faster
            stage = list(map(plan.placement.__getitem__, names))
        else:
            stage = plan.assignment(g)
        st = np.asarray(stage, dtype=np.int64)
        S, M = len(plan.stages), plan.micro_batches
        reps = [plan.stages[s] for s in range(S)]
        frac = [1.0 / (plan.replicas_of(s) * M) for s in range(S)]
        # the slowest replica sets a stage's pace
        types = [{costs.cluster.device(d).type_key: d for d in reps[s]} for s in range(S)]
        is_op, has_b = A.is_op, A.has_b
        ops_arr = np.flatnonzero(is_op)
        st_ops = st[ops_arr]
        ops_by_stage = [ops_arr[st_ops == s] for s in range(S)]
        first_op = [int(o[0]) if len(o) else N for o in ops_by_stage]
        order = sorted(range(S), key=lambda s: first_op[s])
        active = [s for s in order if first_op[s] < N]
        rank = {s: k for k, s in enumerate(active)}
        warm = {s: min(len(active) - rank[s], M) for s in active}
        stage_res = [self.resource(("stage", s, -1)) for s in range(S)]  # = range(S)
        if plan.schedule == "gpipe":
            slot_f = [list(range(M)) for _ in range(S)]
            slot_b = [[M + m for m in range(M)] for _ in range(S)]
        else:
            slot_f, slot_b = [], []
            for s in range(S):
                w = warm.get(s, 1)
                slot_f.append([m if m < w else w + 2 * (m - w) + 1 for m in range(M)])
                slot_b.append([w + 2 * m for m in range(M)])

        # forwards and backwards: per micro-batch, every op's forward then its backward
        nb = has_b[ops_arr]
        width = 1 + nb.astype(np.int64)
        off_ops = np.cumsum(width) - width
        per_m = int(width.sum())
        off_f = np.full(N, -1, dtype=np.int64)
        off_f[ops_arr] = off_ops
        off_b = np.full(N, -1, dtype=np.int64)
        off_b[ops_arr[nb]] = off_ops[nb] + 1
        tpl_node = np.empty(per_m, dtype=np.int64)
        tpl_node[off_ops] = ops_arr
        tpl_node[off_ops[nb] + 1] = ops_arr[nb]
        tpl_isb = np.zeros(per_m, dtype=bool)
        tpl_isb[off_ops[nb] + 1] = True
        tpl_stage = st[tpl_node]
        sec = Seconds(costs, self.others)
        fwd_d = np.zeros(N)
        bwd_d = np.zeros(N)
        for s in range(S):
            idx = ops_by_stage[s]
            if len(idx):
                fwd_d[idx] = sec.slowest("fwd_s", idx, types[s].values(), frac[s])
                idx = idx[has_b[idx]]
                bwd_d[idx] = sec.slowest("bwd_s", idx, types[s].values(), frac[s])
        tensor_bytes = 0
        if plan.uses_tensor_parallel:
            tensor_bytes = split.split_op_seconds(
                g, plan, costs, sec, ops_by_stage, [list(types[s].values()) for s in range(S)],
                frac, fwd_d, bwd_d)
        # the plan's memory settings: precision and recomputed forwards change op times
        # (a plan with tensor-parallel stages has none: Plan refuses the two together)
        eff = (stage_effects(g, plan, A, st, costs.cluster)
               if plan.uses_memory_settings and not plan.uses_tensor_parallel else None)
        out_act = A.out_b if eff is None else eff.act_bytes  # activations' bytes
        if eff is not None:
            eff.apply_compute(g, costs, plan, A, st, fwd_d, bwd_d)
        # the processor time per message, per stage (the slowest replica's platform)
        msg = np.array([max(costs.platform(d).message_s(costs.message_s) for d in reps[s])
                        for s in range(S)], dtype=np.float64)
        if msg.any():
            _message_time(A, st, S, fwd_d, bwd_d, msg)
        self.kind = Column(*[np.array([FWD, BWD], dtype=object)[tpl_isb.view(np.int8)]] * M)
        self.res = tpl_stage.tolist() * M
        fb = FwdBwdLayout(per_m, off_f, off_b, tpl_stage,
                          np.where(tpl_isb, bwd_d[tpl_node], fwd_d[tpl_node]),
                          _queue_order(tpl_stage, tpl_isb, slot_f, slot_b, per_m))
        self.dur = fb.dur_s.tolist() * M
        self.label = Column(*[A.names_obj[tpl_node]] * M)
        self.node = Column(*[tpl_node] * M)
        self.mb = Column(*[np.full(per_m, m) for m in range(M)])
        self.nbytes = Column(np.zeros(per_m * M, dtype=np.int64))
        x = np.where(tpl_isb, -tpl_node, tpl_node) + (N + 1)
        sf, sb = np.asarray(slot_f, dtype=np.int64), np.asarray(slot_b, dtype=np.int64)
        enc_fb = np.concatenate([np.where(tpl_isb, sb[tpl_stage, m], sf[tpl_stage, m]) * W + x
                                 for m in range(M)])

        # dependencies: blocks of (src, dst) arrays, and pairs collected one by one
        src_parts: list[np.ndarray] = []
        dst_parts: list[np.ndarray] = []
        py_src: list[int] = []
        py_dst: list[int] = []

        def edges(src: np.ndarray, dst: np.ndarray, m_src: int = 0, m_dst: int = 0) -> None:
            src_parts.append(src + m_src * per_m if m_src else src)
            dst_parts.append(dst + m_dst * per_m if m_dst else dst)

        e_p, e_c = A.e_p, A.e_c
        same = st[e_p] == st[e_c]
        op_c = is_op[e_c]
        # forward edges and activation transfers (one per tensor, micro-batch, destination)
        sel = op_c & is_op[e_p] & same
        fs, fd = off_f[e_p[sel]], off_f[e_c[sel]]
        for m in range(M):
            edges(fs, fd, m, m)
        # a weight or buffer used on another stage is sent there once; an activation once per
        # micro-batch. Transfers are made in the order their first consumer (by node, then
        # input) meets them.
        sel = op_c & (A.kcode[e_p] != KIND_INPUT) & ~same
        cp, ci = e_p[sel], e_c[sel]
        xf_parts = []  # received activations, for memory
        if len(cp):
            keys = cp * S + st[ci]
            uk, k_edge, sizes, base = self._first_seen(keys, np.where(is_op[cp], M, 1))
            up, us = uk // S, uk % S
            u_act = is_op[up]
            k_task = np.repeat(np.arange(len(uk)), sizes)
            m_task = np.arange(len(k_task)) - np.repeat(base - base[0], sizes)
            tp, ts, t_act = up[k_task], us[k_task], u_act[k_task]
            enc = np.where(t_act, sf[ts, m_task], 0) * W + tp + (N + 1)
            labels = A.names_obj[tp]
            for j in np.flatnonzero(~t_act).tolist():
                labels[j] = f"{names[tp[j]]} -> stage {ts[j]}"
            ob = out_act[tp]
            self._transfers(st[tp], ts, np.where(t_act, ob // M, ob), enc, labels,
                            np.where(t_act, m_task, -1), np.where(t_act, tp, -1))
            # edges: producer's forward -> transfer -> consumer's forward (a weight's one
            # transfer feeds every micro-batch)
            e_base, e_act = base[k_edge], u_act[k_edge]
            fi = off_f[ci]
            ab = base[u_act]
            for m in range(M):
                edges(np.where(e_act, e_base + m, e_base), fi, 0, m)
                edges(off_f[up[u_act]], ab + m, m)
            xa = np.flatnonzero(t_act)
            xf_parts.append((base[0] + xa, ts[xa], tp[xa], m_task[xa],
                             ~A.grad_named[tp[xa]], out_act[tp[xa]] // M))
        # backward edges: a node's backward waits for its consumers' backwards
        bops = ops_arr[nb]
        for m in range(M):
            edges(off_f[bops], off_b[bops], m, m)
        both = has_b[e_p] & has_b[e_c]
        sel = both & same
        bs, bd = off_b[e_c[sel]], off_b[e_p[sel]]
        for m in range(M):
            edges(bs, bd, m, m)
        # activation gradients sent back, once per micro-batch, made in the order of (node,
        # consumer)
        sel = both & ~same
        bi_, bc_ = e_p[sel], e_c[sel]
        if len(bi_):
            o = np.lexsort((bc_, bi_))
            bi_, bc_ = bi_[o], bc_[o]
            keys = bi_ * S + st[bc_]
            uk, k_edge, sizes, base = self._first_seen(keys, np.full(len(keys), M))
            ui, us = uk // S, uk % S
            k_task = np.repeat(np.arange(len(uk)), M)
            m_task = np.tile(np.arange(M), len(uk))
            tp, ts = ui[k_task], us[k_task]
            enc = sb[ts, m_task] * W - tp + (N + 1)
            labels = Prefixed("grad ", np.repeat(A.names_obj[ui], M))
            self._transfers(ts, st[tp], out_act[tp] // M, enc, labels, m_task, tp)
            for m in range(M):
                edges(base + m, off_b[ui], 0, m)
                edges(off_b[bc_], base[k_edge] + m, m)
            xf_parts.append((base[0] + np.arange(len(k_task)), st[tp], tp, m_task,
                             np.zeros(len(tp), dtype=bool), out_act[tp] // M))
        receives = Receives(*(np.concatenate([x[k] for x in xf_parts]) if xf_parts else
                              np.zeros(0, dtype=bool if k == 4 else np.int64)
                              for k in range(6)))
        # 1F1B: at most `warm` micro-batches in flight on a stage
        if plan.schedule == "1f1b" and M > 1:
            for s in active:
                w = warm[s]
                fo = off_f[ops_by_stage[s]]
                bo = off_b[ops_by_stage[s][has_b[ops_by_stage[s]]]]
                if not len(bo):
                    continue
                for m in range(w, M):
                    gate = self.task(GATE, self.resource(("gate", s, m - w)), 0.0,
                                     self.prio(0), "", m - w)
                    edges(bo, np.full(len(bo), gate), m - w)
                    edges(np.full(len(fo), gate), fo, 0, m)
        # gradients: params consumed on other stages send their gradient home; replicated
        # stages all-reduce in buckets; then each stage steps its optimizer
        is_pg = np.zeros(N, dtype=bool)
        is_pg[A.pg] = True
        sent_home: dict[int, list[int]] = {}  # param -> its gradients sent from other stages
        sel = is_pg[e_p] & has_b[e_c] & ~same
        gp_, gc_ = e_p[sel], e_c[sel]
        if len(gp_):
            o = np.lexsort((gc_, gp_))
            gp_, gc_ = gp_[o], gc_[o]
            keys = gp_ * S + st[gc_]
            uk, k_edge, _, base = self._first_seen(keys, np.ones(len(keys), dtype=np.int64))
            up, us = uk // S, uk % S
            self._transfers(us, st[up], A.out_b[up], _LAST * W - up + (N + 1),
                            Prefixed("grad ", A.names_obj[up]),
                            np.full(len(up), -1), up)
            for m in range(M):
                edges(off_b[gc_], base[k_edge], m)
            for p, t in zip(up.tolist(), base.tolist(), strict=True):
                sent_home.setdefault(p, []).append(t)
        allreduce_bytes = tensor_bytes
        pg = A.pg
        trainable_bytes = [0] * S
        trainable_count = [0] * S
        held = split.per_device(g, plan, A.param_bytes)  # (split weights: a device's share)
        out_b = split.per_device(g, plan, out_b)
        zero = [0] * S if eff is None else eff.zero
        stepped = [0] * S  # bytes each rank's optimizer steps (its shards under ZeRO)
        if A.trainable:  # (int64 sums: exact in any order)
            tr = np.asarray(A.trainable, dtype=np.int64)
            held_a = A.pbytes if held is A.param_bytes else np.asarray(held, dtype=np.int64)
            trainable_bytes = sums_by_stage(S, st[tr], held_a[tr])
            trainable_count = np.bincount(st[tr], minlength=S).tolist()
            stepped = sums_by_stage(S, st[tr], held_a[tr] if eff is None else eff.shard[tr])
        if eff is not None:
            allreduce_bytes += add_weight_gathers(
                self, eff, A, st, succs, ops_by_stage, fb, (sf, sb), M, py_src, py_dst)
        # fp16 anywhere: every stage divides its reduced gradients by the loss scale before
        # its optimizer step, one elementwise pass over them, priced as an SGD step over
        # those bytes (also one elementwise pass per gradient)
        fp16 = any(plan.settings_of(s).precision == "fp16" for s in range(S))
        for s in range(S):
            params = pg[st[pg] == s][::-1].tolist()
            before_opt = [t for p in params for t in sent_home.get(p, ())]
            unscaled = (stepped[s] if zero[s] >= 2 else trainable_bytes[s]) if fp16 else 0
            d_opt = max((costs.optimizer_s(dv, plan.optimizer, stepped[s], trainable_count[s])
                         + (costs.optimizer_s(dv, "sgd", unscaled, trainable_count[s])
                            if unscaled else 0.0)) * self._opt_slowed(dv)
                        + split.optimizer_extra_s(costs, plan, s, dv, trainable_count[s])
                        for dv in types[s].values())
            seq_s, seq_bytes = split.sequence_grads(self.g, plan, costs, s)  # (norms' grads)
            d_opt, allreduce_bytes = d_opt + seq_s, allreduce_bytes + seq_bytes
            zero_calls = 0  # ZeRO's collectives of the stage's buckets
            if plan.replicas_of(s) > 1 and params:
                group = reps[s][::plan.tensor_of(s)]  # (one device of each replica)
                has_b_l, off_b_l = has_b.tolist(), off_b.tolist()
                chan = self.resource(("allreduce", s, -1))
                # the first bucket also waits for the slowest replica to catch up
                lag = self._replica_lag(fb, s, group, M, d_opt)
                bucket: list[int] = []
                size = 0
                for k, p in enumerate([*params, None]):
                    if p is not None:
                        bucket.append(p)
                        size += out_b[p]
                    if bucket and (p is None or size >= BUCKET_BYTES):
                        k_ = len(group)
                        if zero[s] >= 2:  # each rank keeps 1/k of the gradient
                            d = costs.reduce_scatter_s(group, size) + lag
                            zero_calls += 1
                            allreduce_bytes += int((k_ - 1) * size)
                            t = self.task(REDUCE_SCATTER, chan, d, self.prio(k),
                                          f"reduce-scatter {size} B", -1, size)
                            eff.grad_done.update(dict.fromkeys(bucket, t))  # type: ignore
                        else:
                            d = costs.allreduce_s(group, size) + lag
                            allreduce_bytes += int(2 * (k_ - 1) * size)
                            t = self.task(ALLREDUCE, chan, d, self.prio(k),
                                          f"all-reduce {size} B", -1, size)
                        lag = 0.0
                        for q in bucket:
                            for c in succs[q]:
                                if has_b_l[c] and stage[c] == s:
                                    bc = off_b_l[c]
                                    for m in range(M):
                                        py_src.append(bc + m * per_m)
                                        py_dst.append(t)
                            for x_ in sent_home.get(q, ()):
                                py_src.append(x_)
                                py_dst.append(t)
                        before_opt.append(t)
                        bucket, size = [], 0
            if not trainable_count[s]:
                continue
            mine = [int(held[i]) for i in A.trainable if stage[i] == s] \
                if zero[s] in (1, 2) else []
            zero_calls += len(buckets(mine)) if mine else 0
            if zero_calls:  # what each costs the ranks' processors beyond the link, waited
                # for around the step (DeviceCosts.collective_s, measured on CPU ranks)
                d_opt += zero_calls * max(costs.device_costs(d).collective_s for d in reps[s])
            t = self.task(OPTIMIZER, stage_res[s], d_opt, self.prio(_LAST),
                          f"{plan.optimizer} step")
            py_src.extend(before_opt)
            py_dst.extend([t] * len(before_opt))
            last = np.where(off_b[ops_by_stage[s]] >= 0, off_b[ops_by_stage[s]],
                            off_f[ops_by_stage[s]])
            for m in range(M):
                edges(last, np.full(len(last), t), m)
            if zero[s] in (1, 2):  # the updated shards gathered into the full weights,
                # one all-gather per bucket of them, in turn
                for bucket in buckets(mine):
                    size = sum(mine[k] for k in bucket)
                    ag = self.task(ALLGATHER, self.resource(("allreduce", s, -1)),
                                   costs.allgather_s(reps[s], size), self.prio(_LAST),
                                   f"all-gather {size} B", -1, size)
                    allreduce_bytes += int((len(reps[s]) - 1) * size)
                    py_src.append(t)
                    py_dst.append(ag)
        # successor lists and dependency counts
        T = len(self.kind)
        src = np.concatenate([*src_parts, np.asarray(py_src, dtype=np.int64)])
        dst = np.concatenate([*dst_parts, np.asarray(py_dst, dtype=np.int64)])
        # grouped by task (a stable sort is quick here: the blocks come mostly in order; the
        # order among a task's successors does not matter)
        succ_flat_a = dst[np.argsort(src, kind="stable")]
        succ_ptr_a = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=T))])
        succ_flat, succ_ptr = succ_flat_a.tolist(), succ_ptr_a.tolist()
        # per forward/backward task, the transfers it receives that can arrive late
        late_in: dict[int, list[tuple[int, float, int]]] = {}
        n_fb = per_m * M
        for x, wait in self.late_xfer:
            s_send = self.resources[self.res[x]][1]
            for u in succ_flat[succ_ptr[x]:succ_ptr[x + 1]]:
                if u < n_fb:
                    late_in.setdefault(u, []).append((x, wait, s_send))
        ndeps = np.bincount(dst, minlength=T)
        # the queues order tasks by (priority, task id): one int, priority * T + id
        n_enc = len(enc_fb)
        if n_enc and int(enc_fb.max()) < 2**62 // T:
            key = (enc_fb * T + np.arange(n_enc)).tolist()
        else:
            key = [e * T + t for t, e in enumerate(enc_fb.tolist())]
        key += _keys(self.enc, n_enc, T)
        negative = not ((fwd_d >= 0.0).all() and (bwd_d >= 0.0).all()
                        and (np.asarray(self.dur[n_enc:], dtype=np.float64) >= 0.0).all())
        return TaskGraph(
            kind=self.kind, res=self.res, dur=self.dur, label=self.label, mb=self.mb,
            nbytes=self.nbytes, node=self.node, key=key, resources=self.resources,
            succ_flat=succ_flat, succ_ptr=succ_ptr, succ_flat_a=succ_flat_a,
            succ_ptr_a=succ_ptr_a, ndeps=ndeps.tolist(),
            first=np.flatnonzero(ndeps == 0).tolist(), late_in=late_in,
            negative_times=bool(negative), plan=plan, arrays=A, stage=stage, stage_a=st,
            batch_fraction=frac, fb=fb, receives=receives,
            transfer_bytes=self.transfer_bytes, allreduce_bytes=allreduce_bytes, effects=eff,
            segment_stages=[any(self.costs.device_costs(d).runtime == "segments" for d in st)
                            for st in plan.stages])

    def _opt_slowed(self, device: str) -> float:
        """How much slower ``device``'s optimizer step runs beside its stage's other replicas
        (they step the same parameters at the same moment), as its platform says from the
        profile's ``DeviceCosts.optimizer_contention``."""
        others = (self.others or {}).get(device, 0.0)
        ratio = self.costs.device_costs(device).optimizer_contention
        return self.costs.platform(device).optimizer_slowdown(ratio, others)

    def _replica_lag(self, fb: FwdBwdLayout, s: int, devices: list[str], M: int,
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

    def _first_seen(self, keys: np.ndarray, sizes: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Distinct ``keys`` in the order they first occur, each making ``sizes`` tasks (the
        size at its first occurrence) from the next free task id on.

        Returns the keys in that order, each key's place in it per occurrence, the sizes, and
        each key's first task id.
        """
        uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        o = np.argsort(first)
        rank = np.empty(len(o), dtype=np.int64)
        rank[o] = np.arange(len(o))
        size = sizes[first[o]]
        return uniq[o], rank[inv.reshape(-1)], size, len(self.kind) + np.cumsum(size) - size

    def _transfers(self, a: np.ndarray, b: np.ndarray, nbytes: np.ndarray, enc: np.ndarray,
                   label: Sequence[str], mb: np.ndarray, node: np.ndarray) -> None:
        """Transfer tasks from stage ``a[k]`` to ``b[k]`` of ``nbytes[k]`` bytes, in order.

        Each ordered pair of stages is one link (a resource, made at its first transfer).
        Replicated stages send their shards side by side: a transfer takes as long as
        ``costs.transfer_s`` between the first devices for its bytes over the narrower side.
        """
        S = len(self.plan.stages)
        stages, costs = self.plan.stages, self.costs
        self.transfer_bytes += int(nbytes.sum())
        link = a * S + b
        uniq, first, inv = np.unique(link, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        lres, lsrc, ldst, lwidth, llat, lbw, llate = [], [], [], [], [], [], []
        for k in np.argsort(first).tolist():  # (resources in order of first use)
            sa, sb_ = divmod(int(uniq[k]), S)
            src, dst = stages[sa][0], stages[sb_][0]
            lk = costs.cluster.link(src, dst)
            lres.append((k, self.resource(("link", sa, sb_))))
            lsrc.append((k, src))
            ldst.append((k, dst))
            lwidth.append((k, min(len(stages[sa]), len(stages[sb_]))))
            llat.append((k, lk.latency_s if src != dst else 0.0))
            lbw.append((k, lk.bandwidth_bytes_per_s if src != dst else np.inf))
            llate.append((k, costs.platform(src).late_receive_s(lk.late_receive_s)
                          if src != dst else 0.0))

        def per_link(pairs: list, dtype: Any) -> np.ndarray:
            out = np.empty(len(pairs), dtype=dtype)
            for k, v in pairs:
                out[k] = v
            return out

        res = per_link(lres, np.int64)[inv]
        n = np.maximum(nbytes // per_link(lwidth, np.int64)[inv], 1)
        if plain_costs(costs):  # CostModel.transfer_s: latency + bytes / bandwidth x link_scale
            src_is_dst = (per_link(lsrc, object) == per_link(ldst, object))[inv]
            dur = per_link(llat, np.float64)[inv] + n / per_link(lbw, np.float64)[inv] \
                * costs.link_scale
            dur = np.where(src_is_dst, 0.0, dur).tolist()
        else:
            srcs, dsts = per_link(lsrc, object)[inv], per_link(ldst, object)[inv]
            dur = [costs.transfer_s(x, y, k) for x, y, k in
                   zip(srcs.tolist(), dsts.tolist(), n.tolist(), strict=True)]
        count = len(a)
        # activations and their gradients (sent while the ranks compute) whose receive may be
        # posted late, where the sender's platform has such a wait: (task, wait)
        late = per_link(llate, np.float64)[inv]
        for k in np.flatnonzero((late > 0) & (np.asarray(mb) >= 0)).tolist():
            self.late_xfer.append((len(self.kind) + k, float(late[k])))
        self.kind.extend(Repeated(SEND, count))
        self.res.extend(res.tolist())
        self.dur.extend(dur)
        self.enc.extend(np.asarray(enc, dtype=np.int64))
        self.label.extend(label)
        self.mb.extend(np.asarray(mb))
        self.nbytes.extend(np.asarray(nbytes))
        self.node.extend(np.asarray(node))


def _keys(enc: Column, first: int, T: int) -> list[int]:
    """``enc[k] * T + first + k`` for every k: as int64 arrays where those hold the result, as
    Python ints (of any size) where not (the optimizer steps' priorities)."""
    try:
        a = enc.array(np.int64)
    except OverflowError:
        return [e * T + t for t, e in enumerate(enc, first)]
    fits = a < (2**62 - first - len(enc)) // T
    key = (np.where(fits, a, 0) * T + np.arange(first, first + len(enc))).tolist()
    for k in np.flatnonzero(~fits).tolist():
        key[k] = enc[k] * T + first + k
    return key


def _queue_order(tpl_stage: np.ndarray, tpl_isb: np.ndarray, slot_f: list[list[int]],
                 slot_b: list[list[int]], per_m: int) -> tuple[np.ndarray, ...]:
    """Per stage, its forward and backward task ids in the order of their queue keys
    ((slot, x) with x the node for a forward, minus the node for a backward): block by block
    in slot order, a block being one micro-batch's forwards in node order or its backwards in
    reverse node order (the template lays ops out in node order)."""
    out = []
    for s in range(len(slot_f)):
        fwd = np.flatnonzero((tpl_stage == s) & ~tpl_isb)
        bwd = np.flatnonzero((tpl_stage == s) & tpl_isb)[::-1]
        blocks = sorted([(slot, m, fwd) for m, slot in enumerate(slot_f[s])]
                        + [(slot, m, bwd) for m, slot in enumerate(slot_b[s])],
                        key=lambda b: b[0])
        out.append(np.concatenate([tpl + m * per_m for _, m, tpl in blocks]) if blocks else
                   np.zeros(0, dtype=np.int64))
    return tuple(out)


def _message_time(A: GraphArrays, st: np.ndarray, S: int, fwd_d: np.ndarray,
                  bwd_d: np.ndarray, message_s: np.ndarray) -> None:
    """Charge each device's processor (``message_s`` per stage) for the activations and
    gradients it sends and receives, where the runtime does it: an op's output goes once to
    each other stage that uses it (at the end of its forward) and is received by its first
    consumer there; the gradient comes back once per such stage, sent by the backward of the
    earliest consumer there (the last to run) and received by the producer's backward."""
    e_p, e_c = A.e_p, A.e_c
    for is_b in (False, True):
        sel = st[e_p] != st[e_c]
        sel &= (A.has_b[e_p] & A.has_b[e_c]) if is_b else (A.is_op[e_p] & A.is_op[e_c])
        p, c = e_p[sel], e_c[sel]
        if not len(p):
            continue
        # edges come by consumer in node order: a key's first edge has its first consumer
        _, first = np.unique(p * S + st[c], return_index=True)
        d = bwd_d if is_b else fwd_d
        np.add.at(d, p[first], message_s[st[p[first]]])
        np.add.at(d, c[first], message_s[st[c[first]]])
