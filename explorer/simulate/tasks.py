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
from explorer.simulate import tensor as split
from explorer.simulate.arrays import KIND_INPUT, GraphArrays
from explorer.simulate.context import add_ring_attention
from explorer.simulate.effects import add_weight_gathers, stage_effects
from explorer.simulate.gradient_tasks import GradientTasks
from explorer.simulate.pipeline_order import PipelineOrder, queue_order
from explorer.simulate.seconds import Seconds, plain_costs
from explorer.simulate.taskgraph import (
    BWD,
    FWD,
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


def build_tasks(graph: OpGraph, plan: Plan, costs: CostModel,
                others: dict[str, float] | None = None) -> TaskGraph:
    """The task graph of one step of ``graph`` under ``plan``; ``others`` (device -> how many
    other replicas of its stage compute beside it) slows ops where contention was measured."""
    return TaskBuilder(graph, plan, costs, others).build()


class _Edges:
    """A step's dependencies as they are made: blocks of (source, destination) task arrays
    (one micro-batch's, shifted to another's) and pairs added one at a time."""

    def __init__(self, per_mb: int) -> None:
        self.per_mb = per_mb
        self.src_blocks: list[np.ndarray] = []
        self.dst_blocks: list[np.ndarray] = []
        self.src: list[int] = []
        self.dst: list[int] = []

    def add(self, src: np.ndarray, dst: np.ndarray, m_src: int = 0, m_dst: int = 0) -> None:
        """Edges ``src[k] -> dst[k]``, the sources' tasks those of micro-batch ``m_src`` and
        the destinations' those of ``m_dst`` (where they are forwards or backwards)."""
        self.src_blocks.append(src + m_src * self.per_mb if m_src else src)
        self.dst_blocks.append(dst + m_dst * self.per_mb if m_dst else dst)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return (np.concatenate([*self.src_blocks, np.asarray(self.src, dtype=np.int64)]),
                np.concatenate([*self.dst_blocks, np.asarray(self.dst, dtype=np.int64)]))


class TaskBuilder(PipelineOrder, GradientTasks):
    """Collects the tasks one kind after another, then makes the :class:`TaskGraph`
    (:meth:`build` names the steps)."""

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
        self.allreduce_bytes = 0
        # the received activations and gradients, for memory (column blocks of Receives)
        self.receive_blocks: list[tuple[np.ndarray, ...]] = []

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
        """The steps, in the order their tasks are numbered."""
        self.place_stages()
        self.schedule_slots()
        self.block_template()
        self.op_seconds()
        self.issue_seconds()
        self.block_tasks()
        self.edges = _Edges(self.per_m)
        self.forward_edges_and_transfers()
        self.backward_edges_and_transfers()
        self.one_f_one_b_gates()
        self.gradients_sent_home()
        self.stage_sizes()
        if self.eff is not None:
            self.allreduce_bytes += add_weight_gathers(self)
        self.reductions_and_optimizer_steps()
        self.host_issue()
        return self.task_graph()

    def place_stages(self) -> None:
        """Each node's stage, the stages' replicas, share of the batch and device types, the
        ops of each stage, and which stages run ops (in the order their first ops come)."""
        g, plan = self.g, self.plan
        A = self.A = GraphArrays.of(g)
        N = A.n
        self.W = 2 * N + 2  # (slot, x) with -N < x < N  ->  slot * W + x + N + 1
        if type(plan).assignment is Plan.assignment:  # the same list, faster
            self.stage = list(map(plan.placement.__getitem__, A.names))
        else:
            self.stage = plan.assignment(g)
        st = self.st = np.asarray(self.stage, dtype=np.int64)
        S, M = self.S, self.M = len(plan.stages), plan.micro_batches
        self.reps = [plan.stages[s] for s in range(S)]
        self.frac = [1.0 / (plan.replicas_of(s) * M) for s in range(S)]
        # the slowest replica sets a stage's pace
        self.types = [{self.costs.cluster.device(d).type_key: d for d in self.reps[s]}
                      for s in range(S)]
        ops = self.ops = np.flatnonzero(A.is_op)
        self.ops_by_stage = [ops[st[ops] == s] for s in range(S)]
        first_op = [int(o[0]) if len(o) else N for o in self.ops_by_stage]
        order = sorted(range(S), key=lambda s: first_op[s])
        self.active = [s for s in order if first_op[s] < N]
        rank = {s: k for k, s in enumerate(self.active)}
        self.warm = {s: min(len(self.active) - rank[s], M) for s in self.active}
        self.place_chunks()
        self.stage_res = [self.resource(("stage", s, -1)) for s in range(S)]  # = range(S)

    def block_template(self) -> None:
        """One micro-batch's block of tasks: every op's forward, each followed by its
        backward where it has one (``off_f``/``off_b``: a node's slots in it)."""
        A, N, ops = self.A, self.A.n, self.ops
        self.nb = nb = A.has_b[ops]
        width = 1 + nb.astype(np.int64)
        off_ops = np.cumsum(width) - width
        self.per_m = per_m = int(width.sum())
        self.off_f = np.full(N, -1, dtype=np.int64)
        self.off_f[ops] = off_ops
        self.off_b = np.full(N, -1, dtype=np.int64)
        self.off_b[ops[nb]] = off_ops[nb] + 1
        self.tpl_node = np.empty(per_m, dtype=np.int64)
        self.tpl_node[off_ops] = ops
        self.tpl_node[off_ops[nb] + 1] = ops[nb]
        self.tpl_isb = np.zeros(per_m, dtype=bool)
        self.tpl_isb[off_ops[nb] + 1] = True
        self.tpl_stage = self.st[self.tpl_node]
        self.tpl_chunk = self.chunk[self.tpl_node]

    def op_seconds(self) -> None:
        """Each op's forward and backward seconds on its stage's slowest device type: from
        the costs, split ops' shares, the memory settings' precision and recomputation, and
        the processor time of the messages an op sends and receives."""
        g, plan, costs, A, st, S = self.g, self.plan, self.costs, self.A, self.st, self.S
        sec = Seconds(costs, self.others)
        self.fwd_d = fwd_d = np.zeros(A.n)
        self.bwd_d = bwd_d = np.zeros(A.n)
        for s in range(S):
            idx = self.ops_by_stage[s]
            if len(idx):
                fwd_d[idx] = sec.slowest("fwd_s", idx, self.types[s].values(), self.frac[s])
                idx = idx[A.has_b[idx]]
                bwd_d[idx] = sec.slowest("bwd_s", idx, self.types[s].values(), self.frac[s])
        devices = [list(self.types[s].values()) for s in range(S)]
        if plan.uses_tensor_parallel:  # split ops: their share of the work
            split.split_op_seconds(g, plan, costs, sec, self.ops_by_stage, devices, self.frac,
                                   fwd_d, bwd_d)
        # the plan's memory settings: precision changes op times (a split op's too), then
        # the tensor split's collectives join the ops that wait for them, then recomputed
        # forwards (their collectives with them) join the backwards that run them again
        self.eff = (stage_effects(g, plan, A, st, costs.cluster)
                    if plan.uses_memory_strategies else None)
        self.out_act = A.out_b if self.eff is None else self.eff.act_bytes  # activations' bytes
        if self.eff is not None:
            self.eff.scale_by_precision(g, costs, plan, A, st, fwd_d, bwd_d)
        if plan.uses_tensor_parallel:
            self.allreduce_bytes += split.add_split_collectives(g, plan, costs, devices,
                                                                self.frac, fwd_d, bwd_d)
        if plan.uses_context_parallel:
            self.allreduce_bytes += add_ring_attention(
                g, plan, costs, self.ops_by_stage, self.frac, fwd_d, bwd_d)
        if self.eff is not None:
            self.eff.add_recomputation(g, costs, plan, A, st, fwd_d, bwd_d)
        # the processor time per message, per stage (the slowest replica's platform)
        msg = np.array([max(costs.platform(d).message_s(costs.message_s) for d in self.reps[s])
                        for s in range(S)], dtype=np.float64)
        if msg.any():
            _message_time(A, st, S, fwd_d, bwd_d, msg)

    def issue_seconds(self) -> None:
        """Where a stage's devices run their kernels apart from the host that issues them
        (``DeviceCosts.host_s``: GPUs), each op's host seconds to issue its forward and its
        backward on the stage's slowest device for it, recomputed forwards issued again in
        the backward that reruns them; ``host_f`` and ``host_b`` are None where every stage
        has one timeline."""
        A, S, per_type = self.A, self.S, self.costs.per_type
        self.host_f = self.host_b = None
        self.two_timelines = [any(per_type[k].two_timelines for k in self.types[s])
                              for s in range(S)]
        if not any(self.two_timelines):
            return
        host_f, host_b = np.zeros(A.n), np.zeros(A.n)
        for s in range(S):
            idx = self.ops_by_stage[s]
            for k in self.types[s]:
                dc = per_type[k]
                if dc.two_timelines and len(idx):
                    host_f[idx] = np.maximum(host_f[idx], dc.host_times(False)[idx])
                    host_b[idx] = np.maximum(host_b[idx], dc.host_times(True)[idx])
        host_b[~A.has_b] = 0.0
        if self.eff is not None:
            host_b += np.where(A.has_b, self.eff.run_again(A, self.st, host_f), 0.0)
        self.host_f, self.host_b = host_f, host_b

    def block_tasks(self) -> None:
        """The forward and backward tasks of every micro-batch, from the template, and their
        queue priorities (``enc_fb``)."""
        A, M, N, W, per_m = self.A, self.M, self.A.n, self.W, self.per_m
        tpl_node, tpl_isb, tpl_stage = self.tpl_node, self.tpl_isb, self.tpl_stage
        self.kind = Column(*[np.array([FWD, BWD], dtype=object)[tpl_isb.view(np.int8)]] * M)
        self.res = tpl_stage.tolist() * M
        self.fb = FwdBwdLayout(per_m, self.off_f, self.off_b, tpl_stage,
                               np.where(tpl_isb, self.bwd_d[tpl_node], self.fwd_d[tpl_node]),
                               queue_order(tpl_stage, self.tpl_chunk, tpl_isb,
                                            self.chunk_slots_f, self.chunk_slots_b, per_m))
        self.dur = self.fb.dur_s.tolist() * M
        self.label = Column(*[A.names_obj[tpl_node]] * M)
        self.node = Column(*[tpl_node] * M)
        self.mb = Column(*[np.full(per_m, m) for m in range(M)])
        self.nbytes = Column(np.zeros(per_m * M, dtype=np.int64))
        x = np.where(tpl_isb, -tpl_node, tpl_node) + (N + 1)
        sf, sb, tpl_chunk = self.chunk_slots_f, self.chunk_slots_b, self.tpl_chunk
        self.enc_fb = np.concatenate([np.where(tpl_isb, sb[tpl_stage, tpl_chunk, m],
                                               sf[tpl_stage, tpl_chunk, m]) * W + x
                                      for m in range(M)])

    def forward_edges_and_transfers(self) -> None:
        """Forward edges, and the transfers of values read on other stages: a weight or
        buffer sent there once, an activation once per micro-batch; made in the order their
        first consumer (by node, then input) meets them."""
        A, st, S, M, N, W = self.A, self.st, self.S, self.M, self.A.n, self.W
        off_f, is_op, edges = self.off_f, A.is_op, self.edges
        e_p, e_c = A.e_p, A.e_c
        same = st[e_p] == st[e_c]
        op_c = is_op[e_c]
        sel = op_c & is_op[e_p] & same
        fs, fd = off_f[e_p[sel]], off_f[e_c[sel]]
        for m in range(M):
            edges.add(fs, fd, m, m)
        sel = op_c & (A.kcode[e_p] != KIND_INPUT) & ~same
        value, reader = e_p[sel], e_c[sel]
        if not len(value):
            return
        # one key per (value, receiving stage); each makes M transfers (an activation) or 1
        keys, key_of_edge, count, first_task = self._first_seen(value * S + st[reader],
                                                                np.where(is_op[value], M, 1))
        sent, to = keys // S, keys % S
        activation = is_op[sent]
        k_task = np.repeat(np.arange(len(keys)), count)
        m_task = np.arange(len(k_task)) - np.repeat(first_task - first_task[0], count)
        t_value, t_to, t_activation = sent[k_task], to[k_task], activation[k_task]
        to_chunk = self._first_chunk(reader, key_of_edge, len(keys))[k_task]
        enc = (np.where(t_activation, self.chunk_slots_f[t_to, to_chunk, m_task], 0) * W
               + t_value + (N + 1))
        labels = A.names_obj[t_value]
        for j in np.flatnonzero(~t_activation).tolist():
            labels[j] = f"{A.names[t_value[j]]} -> stage {t_to[j]}"
        nbytes = self.out_act[t_value]
        self._transfers(st[t_value], t_to, np.where(t_activation, nbytes // M, nbytes), enc,
                        labels, np.where(t_activation, m_task, -1),
                        np.where(t_activation, t_value, -1))
        # edges: producer's forward -> transfer -> consumer's forward (a weight's one
        # transfer feeds every micro-batch)
        edge_first, edge_activation = first_task[key_of_edge], activation[key_of_edge]
        reader_f = off_f[reader]
        activation_first = first_task[activation]
        for m in range(M):
            edges.add(np.where(edge_activation, edge_first + m, edge_first), reader_f, 0, m)
            edges.add(off_f[sent[activation]], activation_first + m, m)
        xa = np.flatnonzero(t_activation)
        self.receive_blocks.append((first_task[0] + xa, t_to[xa], t_value[xa], m_task[xa],
                                    ~A.grad_named[t_value[xa]], self.out_act[t_value[xa]] // M))

    def backward_edges_and_transfers(self) -> None:
        """Backward edges (a node's backward waits for its forward and its consumers'
        backwards), and activation gradients sent back, once per micro-batch, made in the
        order of (node, consumer)."""
        A, st, S, M, N, W = self.A, self.st, self.S, self.M, self.A.n, self.W
        off_f, off_b, has_b, edges = self.off_f, self.off_b, A.has_b, self.edges
        e_p, e_c = A.e_p, A.e_c
        same = st[e_p] == st[e_c]
        bops = self.ops[self.nb]
        for m in range(M):
            edges.add(off_f[bops], off_b[bops], m, m)
        both = has_b[e_p] & has_b[e_c]
        sel = both & same
        bs, bd = off_b[e_c[sel]], off_b[e_p[sel]]
        for m in range(M):
            edges.add(bs, bd, m, m)
        sel = both & ~same
        node, reader = e_p[sel], e_c[sel]
        if not len(node):
            return
        o = np.lexsort((reader, node))
        node, reader = node[o], reader[o]
        # one key per (node, stage its gradient comes from), M transfers each
        keys, key_of_edge, _, first_task = self._first_seen(node * S + st[reader],
                                                            np.full(len(node), M))
        sent, sender = keys // S, keys % S
        k_task = np.repeat(np.arange(len(keys)), M)
        m_task = np.tile(np.arange(M), len(keys))
        t_node, t_from = sent[k_task], sender[k_task]
        from_chunk = self._first_chunk(reader, key_of_edge, len(keys))[k_task]
        enc = self.chunk_slots_b[t_from, from_chunk, m_task] * W - t_node + (N + 1)
        labels = Prefixed("grad ", np.repeat(A.names_obj[sent], M))
        self._transfers(t_from, st[t_node], self.out_act[t_node] // M, enc, labels, m_task,
                        t_node)
        for m in range(M):
            edges.add(first_task + m, off_b[sent], 0, m)
            edges.add(off_b[reader], first_task[key_of_edge] + m, m)
        self.receive_blocks.append((first_task[0] + np.arange(len(k_task)), st[t_node],
                                    t_node, m_task, np.zeros(len(t_node), dtype=bool),
                                    self.out_act[t_node] // M))

    def host_issue(self) -> None:
        """Where stages have two timelines: when each of their tasks is issued (``release``,
        the earliest it may start) and for how long the host issued it (``issue_s``).

        The host issues its stage's forwards and backwards one after another in the queue's
        order, from the step's start, never waiting for the device: launches and NCCL's
        sends, receives and all-reduces return at once, and the device's stream runs what
        they enqueue in that order. The optimizer step is issued after the last of them.
        The step ends when the loss is read, which waits for the device: its end is the
        later of the two timelines'.
        """
        self.release = self.issue_s = None
        if self.host_f is None:
            return
        T, M, n_fb = len(self.kind), self.M, self.per_m * self.M
        tpl_node, tpl_isb = self.tpl_node, self.tpl_isb
        issue = np.zeros(T)
        issue[:n_fb] = np.tile(np.where(tpl_isb, self.host_b[tpl_node],
                                        self.host_f[tpl_node]), M)
        release = np.zeros(T)
        host_end = np.zeros(self.S)
        for s, q in enumerate(self.fb.queue):
            if self.two_timelines[s] and len(q):
                ends = np.cumsum(issue[q])
                release[q] = ends
                host_end[s] = ends[-1]
        for t in range(n_fb, T):
            if self.kind[t] == OPTIMIZER:  # (on its stage's resource: index = stage)
                release[t] = host_end[self.res[t]]
        self.release, self.issue_s = release, issue

    def task_graph(self) -> TaskGraph:
        """The tasks as a :class:`TaskGraph`: successor lists, dependency counts, the late
        receives of each forward and backward, and the queue keys."""
        T = len(self.kind)
        src, dst = self.edges.arrays()
        # grouped by task (a stable sort is quick here: the blocks come mostly in order; the
        # order among a task's successors does not matter)
        succ_flat_a = dst[np.argsort(src, kind="stable")]
        succ_ptr_a = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=T))])
        succ_flat, succ_ptr = succ_flat_a.tolist(), succ_ptr_a.tolist()
        # per forward/backward task, the transfers it receives that can arrive late
        late_in: dict[int, list[tuple[int, float, int]]] = {}
        n_fb = self.per_m * self.M
        for x, wait in self.late_xfer:
            s_send = self.resources[self.res[x]][1]
            for u in succ_flat[succ_ptr[x]:succ_ptr[x + 1]]:
                if u < n_fb:
                    late_in.setdefault(u, []).append((x, wait, s_send))
        ndeps = np.bincount(dst, minlength=T)
        # the queues order tasks by (priority, task id): one int, priority * T + id
        enc_fb = self.enc_fb
        n_enc = len(enc_fb)
        if n_enc and int(enc_fb.max()) < 2**62 // T:
            key = (enc_fb * T + np.arange(n_enc)).tolist()
        else:
            key = [e * T + t for t, e in enumerate(enc_fb.tolist())]
        key += _keys(self.enc, n_enc, T)
        negative = not ((self.fwd_d >= 0.0).all() and (self.bwd_d >= 0.0).all()
                        and (np.asarray(self.dur[n_enc:], dtype=np.float64) >= 0.0).all())
        parts = self.receive_blocks
        receives = Receives(*(np.concatenate([x[k] for x in parts]) if parts else
                              np.zeros(0, dtype=bool if k == 4 else np.int64)
                              for k in range(6)))
        return TaskGraph(
            kind=self.kind, res=self.res, dur=self.dur, label=self.label, mb=self.mb,
            nbytes=self.nbytes, node=self.node, key=key, resources=self.resources,
            succ_flat=succ_flat, succ_ptr=succ_ptr, succ_flat_a=succ_flat_a,
            succ_ptr_a=succ_ptr_a, ndeps=ndeps.tolist(),
            first=np.flatnonzero(ndeps == 0).tolist(), late_in=late_in,
            negative_times=bool(negative), plan=self.plan, arrays=self.A, stage=self.stage,
            stage_a=self.st, batch_fraction=self.frac, fb=self.fb, receives=receives,
            transfer_bytes=self.transfer_bytes, allreduce_bytes=self.allreduce_bytes,
            effects=self.eff, release=self.release, issue_s=self.issue_s,
            segment_stages=[any(self.costs.device_costs(d).runtime == "segments" for d in st)
                            for st in self.plan.stages])

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

    def _first_chunk(self, reader: np.ndarray, key_of_edge: np.ndarray, keys: int
                     ) -> np.ndarray:
        """Per key, the first chunk its readers (one per edge) are in on their stage (0 but
        under interleaved 1F1B)."""
        if self.virtual is None:
            return np.zeros(keys, dtype=np.int64)
        first = np.full(keys, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, key_of_edge, self.chunk[reader])
        return first

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
