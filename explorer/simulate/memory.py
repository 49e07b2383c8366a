"""Memory per device at its peak: weights, gradients, optimizer state, buffers, and activations by
liveness along the simulated timeline."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE, Plan
from explorer.simulate.arrays import KIND_BUFFER, KIND_INPUT, KIND_PARAM, ranges, sums_by_stage
from explorer.simulate.effects import ALLGATHER, REDUCE_SCATTER, StageEffects
from explorer.simulate.prediction import MemoryBreakdown
from explorer.simulate.schedule import Timing
from explorer.simulate.segment_spans import segment_backward_spans
from explorer.simulate.taskgraph import ALLREDUCE, OPTIMIZER, TaskGraph
from explorer.simulate.tensor import activations_per_device, per_device, saved_extra_per_device


def memory_at_peaks(graph: OpGraph, plan: Plan, tasks: TaskGraph, timing: Timing
                    ) -> dict[str, MemoryBreakdown]:
    """Per device, its memory at the moment the scheduled step needs most."""
    A = tasks.arrays
    stage, st, M = tasks.stage, tasks.stage_a, plan.micro_batches
    N, S, per_m = A.n, len(plan.stages), tasks.fb.per_mb
    is_op, has_b, kcode = A.is_op, A.has_b, A.kcode
    off_f, off_b = tasks.fb.fwd, tasks.fb.bwd
    e_p, e_c = A.e_p, A.e_c
    start, end = timing.start, timing.end
    start_a, end_a = timing.arrays
    frac = np.asarray(tasks.batch_fraction)
    eff = tasks.effects
    out_b = (activations_per_device(graph, plan, A.out_b)  # (split activations: a share)
             if eff is None else eff.act_bytes)
    state_per_byte = OPTIMIZER_STATE[plan.optimizer]
    params = [0] * S
    bufs = [0] * S
    opt = [0] * S
    rg = A.rg
    param_bytes = per_device(graph, plan, A.param_bytes)  # (split weights: a device's share)
    zero = [0] * S if eff is None else eff.zero
    shard = param_bytes if eff is None else eff.shard.tolist()
    held = np.flatnonzero(A.pbytes)
    if len(held):
        # (sums of int64 arrays: exact, in any order)
        pb = (A.pbytes if param_bytes is A.param_bytes else
              np.asarray(param_bytes, dtype=np.int64))[held]
        sh = pb if shard is param_bytes else np.asarray(shard, dtype=np.int64)[held]
        hs, z = st[held], np.asarray(zero, dtype=np.int64)[st[held]]
        buf = kcode[held] == KIND_BUFFER
        bufs = sums_by_stage(S, hs[buf], pb[buf])
        params = sums_by_stage(S, hs[~buf], np.where(z == 3, sh, pb)[~buf])
        stepped = ~buf & (rg[held] | is_op[held])
        opt = sums_by_stage(S, hs[stepped], np.where(z != 0, sh, pb)[stepped] * state_per_byte)
    # a copy of each weight or buffer on every other stage that reads it
    sel = ((kcode[e_p] == KIND_PARAM) | (kcode[e_p] == KIND_BUFFER)) & (st[e_c] != st[e_p])
    for p, s in set(zip(e_p[sel].tolist(), st[e_c[sel]].tolist(), strict=True)):
        params[s] += A.out_bytes[p]
    root = A.root_a
    # saved-for-backward: (producer root, node whose backward keeps it); a recomputation's
    # sources count as saved by the backward that recomputes from them
    sv_p_a, sv_v_a = A.saved
    sv_p_any, sv_v_any = A.saved_any
    if eff is not None and len(eff.casts[0]):  # (what autocast saved is a copy: below)
        cast = np.isin(sv_v_a * N + sv_p_a, eff.casts[0] * N + eff.casts[1])
        sv_p_a, sv_v_a = sv_p_a[~cast], sv_v_a[~cast]
        cast = np.isin(sv_v_any * N + sv_p_any, eff.casts[0] * N + eff.casts[1])
        sv_p_any, sv_v_any = sv_p_any[~cast], sv_v_any[~cast]
    # (a source is held as made by the forward, even where its own unit drops it as saved)
    n_saved = len(sv_p_a)
    # (a value of a checkpointed span that its policy kept is held by the policy's cache until
    # the span runs again, at the start of its first backward: (value, that op) pairs)
    cached_p = cached_v = np.zeros(0, dtype=np.int64)
    if eff is not None and len(eff.sources[0]):
        src_p, src_v = eff.sources
        if len(eff.span_first):
            first = eff.span_first[src_p]
            cached = (first >= 0) & (first == eff.span_first[src_v])
            cached_p, cached_v = src_p[cached], first[cached]
            src_p, src_v = src_p[~cached], src_v[~cached]
        sv_p_a, sv_v_a = np.concatenate([sv_p_a, src_p]), np.concatenate([sv_v_a, src_v])
        sv_p_any = np.concatenate([sv_p_any, src_p])
        sv_v_any = np.concatenate([sv_v_any, src_v])

    # activation memory events: stage, time and bytes (an allocation positive, a free negative)
    ev_s: list[np.ndarray] = []
    ev_t: list[np.ndarray] = []
    ev_b: list[np.ndarray] = []

    def live(s: np.ndarray, t0: np.ndarray, t1: np.ndarray, nbytes: np.ndarray) -> None:
        keep = nbytes > 0
        if not keep.all():
            s, t0, t1, nbytes = s[keep], t0[keep], t1[keep], nbytes[keep]
        ev_s.extend((s, s))
        ev_t.extend((t0, np.maximum(t1, t0)))
        ev_b.extend((nbytes, -nbytes))

    def size_on(nbytes: np.ndarray, s: np.ndarray) -> np.ndarray:
        return (nbytes * frac[s]).astype(np.int64)

    # activations of ops that own their memory: from the forward's start until the last
    # forward consumer (through views), saving backward or the loss's backward. An output sent
    # to another stage is handed to the send when its forward ends (the runtime's accounting).
    rops = np.flatnonzero(is_op & (root == np.arange(N)))
    if len(rops):
        rs = st[rops]
        size = size_on(out_b[rops], rs)
        pos = np.full(N, -1, dtype=np.int64)  # root op -> its place in rops
        pos[rops] = np.arange(len(rops))
        owner = root[e_p]
        sel = pos[owner] >= 0
        own, con = owner[sel], e_c[sel]
        fsel = (st[own] == st[con]) & is_op[con]
        # (owner, base, step): a task besides the owner's forward that may end the
        # activation's life; micro-batch m's is base + m * step
        parts = [(own[fsel], off_f[con[fsel]], per_m)]
        loss = graph.index.get(graph.loss, -1) if graph.loss else -1
        if loss >= 0 and pos[loss] >= 0 and has_b[loss]:
            parts.append((np.array([loss]), off_b[[loss]], per_m))
        sel = (pos[sv_p_a] >= 0) & (st[sv_v_a] == st[sv_p_a]) & has_b[sv_v_a]
        if eff is not None:  # recomputed outputs live again from their recomputation
            again = eff.dropped[sv_p_a] & (np.arange(len(sv_p_a)) < n_saved)
            rc = sel & again
            sel &= ~again
            # (checkpoint runs a span again whole, in its first backward: StageEffects.
            # rerun_at; the op path each op in the first backward that needs it)
            made_in = (np.where(eff.rerun_at >= 0, eff.rerun_at, eff.rc_op)
                       if len(eff.rerun_at) else eff.rc_op)
            _recomputed(live, made_in, sv_p_a[rc], sv_v_a[rc], st, off_b, per_m, M,
                        start_a, end_a, size_on(out_b[sv_p_a[rc]], st[sv_p_a[rc]]))
        parts.append((sv_p_a[sel], off_b[sv_v_a[sel]], per_m))
        at_all = pos[np.concatenate([p[0] for p in parts])]
        base_all = np.concatenate([p[1] for p in parts])
        step_all = np.concatenate([np.full(len(p[0]), p[2], dtype=np.int64) for p in parts])
        cached_at = pos[cached_p]
        for m in range(M):
            t1 = end_a[off_f[rops] + m * per_m]
            np.maximum.at(t1, at_all, end_a[base_all + m * step_all])
            np.maximum.at(t1, cached_at, start_a[off_b[cached_v] + m * per_m])
            live(rs, start_a[off_f[rops] + m * per_m], t1, size)
    # extra tensors saved for the backward (masks, statistics, indices): made by the forward,
    # kept until the backward; the op path's recomputation makes op outputs again, not these
    # (it keeps them from the forward), checkpoint makes again all a span saves
    # (StageEffects.extra_from: from the backward that runs the span again)
    extra = saved_extra_per_device(graph, plan, A.extra) if eff is None else eff.extra_bytes
    xs_ = np.flatnonzero(has_b & (extra != 0))
    if len(xs_):
        again = (eff.extra_from[xs_] if eff is not None and len(eff.extra_from)
                 else np.full(len(xs_), -1, dtype=np.int64))
        made = np.where(again >= 0, off_b[np.maximum(again, 0)], off_f[xs_])
        for m in range(M):
            live(st[xs_], start_a[made + m * per_m], end_a[off_b[xs_] + m * per_m],
                 size_on(extra[xs_], st[xs_]))
    # the gradients an op's backward passes between the autograd nodes it is made of (a
    # cross-entropy's log-softmax gradient): held while that backward runs
    scratch = saved_extra_per_device(graph, plan, A.scratch)
    xs_ = np.flatnonzero(has_b & (scratch != 0))
    if len(xs_):
        for m in range(M):
            task = off_b[xs_] + m * per_m
            live(st[xs_], start_a[task], end_a[task], size_on(scratch[xs_], st[xs_]))
    # bf16/fp16: the 2-byte copy a matmul-like op saved of what it read in fp32, per
    # micro-batch (a weight's whole, an activation's share of the micro-batch)
    if eff is not None and len(eff.casts[0]):
        cv, cq = eff.casts
        size = np.where(kcode[cq] == KIND_PARAM, A.out_b[cq] // 2,
                        size_on(A.out_b[cq] // 2, st[cv]))
        for m in range(M):
            live(st[cv], start_a[off_f[cv] + m * per_m], end_a[off_b[cv] + m * per_m], size)
    # activation gradients, as autograd and the runtime hold them. A consumer's backward
    # makes the gradient of each op it reads: a new tensor, or the consumer's own incoming
    # gradient handed on (views, getitem, same-size add, cat: see GraphArrays.hands_on). Per
    # op and stage, the first gradient made (in schedule order) is kept until the op's own
    # backward (for an op on another stage: until it is sent, after the backward of its last
    # consumer here); later ones are added into it and live for their backward only; a
    # handed-on gradient keeps its buffer alive until the receiving op's backward.
    sel = has_b[e_p] & has_b[e_c]
    local_grad = np.zeros(N, dtype=bool)  # ops whose gradient is made on their own stage
    if sel.any():
        hand_a, piece_a = A.hands_on
        gp, gc = e_p[sel], e_c[sel]
        hand, piece = hand_a[sel], piece_a[sel]
        new = ~hand
        gs = st[gc]  # the stage that makes (and holds) the gradient
        local = st[gp] == gs
        local_grad[gp[local]] = True
        _, ginv = np.unique(gp * S + gs, return_inverse=True)
        n_g = int(ginv.max()) + 1
        shared = np.flatnonzero(np.bincount(ginv, minlength=n_g)[ginv] > 1)
        sh_g = ginv[shared]
        far = np.flatnonzero(~local)
        p_size = size_on(out_b[gp], gs)
        hi = np.flatnonzero(hand)
        uc, h_inv = np.unique(gc[hi], return_inverse=True)
        uc_s, uc_size = st[uc], size_on(out_b[uc], st[uc])
        for m in range(M):
            tb = off_b[gc] + m * per_m
            b0, b1 = start_a[tb], end_a[tb]
            # the first of several consumers' backwards (a zero-length one before a longer one
            # that starts at the same time: it ran first)
            first = np.ones(len(gp), dtype=bool)
            if len(shared):
                o = np.lexsort((b1[shared], b0[shared], sh_g))
                head = np.ones(len(o), dtype=bool)
                head[1:] = sh_g[o][1:] != sh_g[o][:-1]
                first[shared] = False
                first[shared[o[head]]] = True
                first |= piece
            t_end = end_a[off_b[gp] + m * per_m]
            if len(far):  # sent home after the backward of the last consumer here
                sent = np.full(n_g, -np.inf)
                np.maximum.at(sent, ginv[far], b1[far])
                t_end[far] = sent[ginv[far]]
            k = new & first
            live(gs[k], b0[k], t_end[k], p_size[k])
            k = new & ~first
            live(gs[k], b0[k], b1[k], p_size[k])
            if len(hi):
                t1 = np.full(len(uc), -np.inf)
                f = first[hi]
                np.maximum.at(t1, h_inv[f], t_end[hi[f]])
                k = np.isfinite(t1)
                live(uc_s[k], end_a[off_b[uc[k]] + m * per_m], t1[k], uc_size[k])
    # graph inputs: from their first consumer's forward until their last use on each stage
    saved_by: dict[int, list[int]] = {}
    sel = kcode[sv_p_a] == KIND_INPUT
    for p, v in zip(sv_p_a[sel].tolist(), sv_v_a[sel].tolist(), strict=True):
        saved_by.setdefault(p, []).append(v)
    off_f_l, off_b_l, has_b_l = _Items(off_f), _Items(off_b), _Items(has_b)
    py_s: list[int] = []
    py_t0: list[float] = []
    py_t1: list[float] = []
    py_b: list[int] = []
    succs = graph.succs
    for i in np.flatnonzero(kcode == KIND_INPUT).tolist():
        users_by_stage: dict[int, list[int]] = {}
        for c in succs[i]:
            users_by_stage.setdefault(stage[c], []).append(c)
        for m in range(M):
            mo = m * per_m
            for s, users in users_by_stage.items():
                t1 = max(end[off_f_l[c] + mo] for c in users)
                for v in saved_by.get(i, ()):
                    if stage[v] == s and has_b_l[v]:
                        t1 = max(t1, end[off_b_l[v] + mo])
                t0 = min(start[off_f_l[c] + mo] for c in users)
                py_s.append(s)
                py_t0.append(t0)
                py_t1.append(t1)
                py_b.append(int(A.out_bytes[i] * tasks.batch_fraction[s]))
    if py_s:
        live(np.asarray(py_s, dtype=np.int64), np.asarray(py_t0), np.asarray(py_t1),
             np.asarray(py_b, dtype=np.int64))
    # received activations and activation gradients: from the first task that needs them on
    # the receiving stage (it receives them) until their last use there: the tasks waiting
    # for them and, for activations, the backwards of the nodes that saved the tensor. A
    # gradient for an op that also gets gradients on its own stage is added into those (one
    # buffer), and of several received for one op and micro-batch the first is kept
    rc = tasks.receives
    x_id, x_dst, x_node, x_m, x_fwd, x_nbytes = (rc.task, rc.stage, rc.node, rc.mb,
                                                 rc.activation, rc.nbytes)
    if len(x_id):
        t1 = end_a[x_id]
        t0 = np.full(len(x_id), np.inf)
        lo, hi = tasks.succ_ptr_a[x_id], tasks.succ_ptr_a[x_id + 1]
        k, idx = ranges(lo, hi)
        np.maximum.at(t1, k, end_a[tasks.succ_flat_a[idx]])
        np.minimum.at(t0, k, start_a[tasks.succ_flat_a[idx]])
        t0 = np.where(np.isfinite(t0), t0, end_a[x_id])
        sv_order = np.argsort(sv_p_any, kind="stable")
        sv_p_s, sv_v_s = sv_p_any[sv_order], sv_v_any[sv_order]
        xr = root[x_node]
        lo = np.where(x_fwd, np.searchsorted(sv_p_s, xr, side="left"), 0)
        hi = np.where(x_fwd, np.searchsorted(sv_p_s, xr, side="right"), 0)
        k, idx = ranges(lo, hi)
        v = sv_v_s[idx]
        ok = (st[v] == x_dst[k]) & has_b[v]
        k, v = k[ok], v[ok]
        np.maximum.at(t1, k, end_a[off_b[v] + x_m[k] * per_m])
        # (a stage running segments receives its segment's gradients before the segment's
        # one backward call, and holds them until it ends)
        spans = segment_backward_spans(graph, plan, tasks, timing)
        for k in np.flatnonzero(~x_fwd).tolist() if spans else ():
            span = spans.get((int(x_dst[k]), int(x_m[k]), int(x_node[k])))
            if span is not None:
                t0[k], t1[k] = span[0], max(t1[k], span[1])
        keep = x_fwd | ~local_grad[x_node]
        gk = np.flatnonzero(~x_fwd & keep)
        if len(gk):  # one received gradient per op and micro-batch
            _, at = np.unique(x_node[gk] * M + x_m[gk], return_index=True)
            keep[gk] = False
            keep[gk[at]] = True
        live(x_dst[keep], t0[keep], t1[keep],
             (x_nbytes[keep] * M * frac[x_dst[keep]]).astype(np.int64))
    # parameter gradients: from the first backward that reaches a weight until the optimizer
    # step has used it (torch frees them with zero_grad(set_to_none=True))
    opt_end = [float(end_a.max()) if len(end_a) else 0.0] * S
    for t in range(len(tasks.kind) - 1, -1, -1):
        if tasks.kind[t] == OPTIMIZER:
            opt_end[tasks.res[t]] = end[t]
        elif tasks.kind[t] not in (ALLREDUCE, REDUCE_SCATTER, ALLGATHER):
            break  # the optimizer steps are the last tasks (with the all-reduces)
    pbytes = per_device(graph, plan, A.pbytes)
    holds = (pbytes != 0) & (kcode != KIND_BUFFER) & (rg | is_op)
    own_ops = np.flatnonzero(holds & is_op)
    sel = holds[e_p] & ~is_op[e_p]
    g_node = np.concatenate([own_ops, e_p[sel]])
    g_user = np.concatenate([own_ops, e_c[sel]])
    sel = has_b[g_user]
    g_node, g_user = g_node[sel], g_user[sel]
    g_s_ = st[g_user]
    g_ev_s = g_ev_t = g_ev_b = np.zeros(0, dtype=np.int64)
    if len(g_node):
        first_b = start_a[off_b[g_user]]
        for m in range(1, M):
            first_b = np.minimum(first_b, start_a[off_b[g_user] + m * per_m])
        gk, inv = np.unique(g_node * S + g_s_, return_inverse=True)
        g0 = np.full(len(gk), np.inf)
        np.minimum.at(g0, inv, first_b)
        gs, gsize = gk % S, pbytes[gk // S]
        g_end = np.asarray(opt_end)[gs]
        if eff is not None and max(zero) >= 2:
            # ZeRO 2 and 3: the full gradient until its reduce-scatter, then the rank's shard
            gp = gk // S
            done = np.array([end[eff.grad_done[p]] if p in eff.grad_done and zero[s_] >= 2
                             and stage[p] == s_ else np.nan
                             for p, s_ in zip(gp.tolist(), gs.tolist(), strict=True)])
            k = np.flatnonzero(~np.isnan(done))
            gs = np.concatenate([gs, gs[k]])
            g0 = np.concatenate([g0, done[k]])
            g_end = np.concatenate([np.where(np.isnan(done), g_end, done), g_end[k]])
            gsize = np.concatenate([gsize, eff.shard[gp[k]]])
        a_s, a_t, a_b = _accumulations(g_node, g_user, g_s_, off_b, per_m, M, timing.arrays,
                                       pbytes, S)
        g_ev_s = np.concatenate([gs, gs, a_s])
        g_ev_t = np.concatenate([g0, g_end, a_t])
        g_ev_b = np.concatenate([gsize, -gsize, a_b])
    # each stage's peak of activations plus gradients, and what fills it
    w_s, w_t, w_b = _gathered(eff, tasks, start_a, end_a)
    es = np.concatenate([*ev_s, g_ev_s, w_s]).astype(np.int16 if S < 2**15 else np.int64)
    et = np.concatenate([*ev_t, g_ev_t, w_t]).astype(np.float64, copy=False)
    eb = np.concatenate([*ev_b, g_ev_b, w_b]).astype(np.int64, copy=False)
    n_act = len(es) - len(g_ev_s) - len(w_s)
    # each event sorts by (time, order, bytes, category) within its stage, order 0 for frees
    # and 1 for allocations; the peak is the first maximum of the running total
    if len(g_ev_s) and (g_ev_b[: len(g_ev_b) // 2] <= 0).any():
        cat = np.concatenate([np.zeros(n_act, dtype=np.int64),
                              np.ones(len(g_ev_s), dtype=np.int64),
                              np.full(len(w_s), 2, dtype=np.int64)])
        order = np.concatenate([eb[:n_act] > 0,  # (activations, gathered: bytes > 0)
                                np.arange(len(g_ev_s)) < len(g_ev_s) // 2, w_b > 0])
        peaks = _peaks_in_order(S, es.astype(np.int64), et, eb, cat, order.astype(np.int64))
    else:
        peaks = _peaks(S, es, et, eb, (n_act, n_act + len(g_ev_s)))
    out = {}
    for s in range(S):
        act, grads, gathered = peaks[s]
        mb = MemoryBreakdown(params[s], grads, opt[s], bufs[s], act, gathered)
        for d in plan.stages[s]:
            out[d] = mb
    return out


def _accumulations(node: np.ndarray, user: np.ndarray, stage: np.ndarray, off_b: np.ndarray,
                   per_m: int, M: int, task_times: tuple[np.ndarray, np.ndarray],
                   nbytes: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Memory events (stage, time, bytes) of gradient accumulation: a backward that reaches a
    weight after the first on its stage (another micro-batch, another op reading it) makes
    the weight's gradient anew, and autograd adds it into the one held when that backward
    ends: a gradient's size more for the length of the backward. ``node`` are the weights,
    ``user`` the ops whose backward reaches them, ``stage`` the stage holding each."""
    start_a, end_a = task_times
    task = (off_b[user][:, None] + np.arange(M)[None, :] * per_m).ravel()
    weight, held = np.repeat(node, M), np.repeat(stage, M)
    t0, t1 = start_a[task], end_a[task]
    key = weight * S + held
    order = np.lexsort((t0, key))
    again = np.zeros(len(order), dtype=bool)
    again[1:] = key[order][1:] == key[order][:-1]
    later = order[again]
    size = nbytes[weight[later]].astype(np.int64)
    return (np.concatenate([held[later], held[later]]), np.concatenate([t0[later], t1[later]]),
            np.concatenate([size, -size]))


def _peaks(S: int, es: np.ndarray, et: np.ndarray, eb: np.ndarray, bounds: tuple[int, int]
           ) -> list[tuple[int, int, int]]:
    """Per stage, (activation, gradient, gathered-weight bytes) live at the first peak of
    their total.

    Events (stage, time, bytes) with every allocation positive and every free negative, the
    activations' first, then the gradients' from ``bounds[0]``, the gathered weights' from
    ``bounds[1]``. Sorted by (time, frees first, bytes, category) within a stage, the running
    total falls through one time's frees and then rises through its allocations, so its first
    maximum is at the last event of some time, where what is live does not depend on how that
    time's events are ordered: sorting by time alone gives the same peak, and each category's
    bytes there are the sum of its events up to that time (integers: in any order).
    """
    by_stage = np.argsort(es, kind="stable")  # (a radix sort of small integers)
    edges = np.searchsorted(es[by_stage], np.arange(S + 1))
    out = []
    for s in range(S):
        lo, hi = int(edges[s]), int(edges[s + 1])
        got = (0, 0, 0)
        if hi > lo:
            ids = by_stage[lo:hi]
            t = et[ids]
            o = np.argsort(t)
            ids, t = ids[o], t[o]
            tot = np.cumsum(eb[ids])
            last = np.flatnonzero(np.append(t[1:] != t[:-1], True))  # each time's last event
            k = int(last[np.argmax(tot[last])])
            if tot[k] > 0:
                upto = ids[:k + 1]
                b = eb[upto]
                grads = int(b[(upto >= bounds[0]) & (upto < bounds[1])].sum())
                gathered = int(b[upto >= bounds[1]].sum())
                got = (int(tot[k]) - grads - gathered, grads, gathered)
        out.append(got)
    return out


class _Items:
    """An array read one item at a time as Python values (for a few items of a long array:
    cheaper than its ``tolist()``)."""

    def __init__(self, a: np.ndarray) -> None:
        self.item = a.item

    def __getitem__(self, k: int):
        return self.item(k)


def _peaks_in_order(S: int, es: np.ndarray, et: np.ndarray, eb: np.ndarray, cat: np.ndarray,
                    order: np.ndarray) -> list[tuple[int, int, int]]:
    """:func:`_peaks` for any signs of bytes: events in their full sort order."""
    o = np.lexsort((cat, eb, order, et, es))
    es, eb, cat = es[o], eb[o], cat[o]
    bounds = np.searchsorted(es, np.arange(S + 1))
    out = []
    for s in range(S):
        lo, hi = bounds[s], bounds[s + 1]
        got = (0, 0, 0)
        if hi > lo:
            b, c = eb[lo:hi], cat[lo:hi]
            parts = [np.cumsum(np.where(c == k, b, 0)) for k in range(3)]
            tot = parts[0] + parts[1] + parts[2]
            k = int(np.argmax(tot))
            if tot[k] > 0:
                got = tuple(int(x[k]) for x in parts)  # type: ignore[assignment]
        out.append(got)
    return out


def _recomputed(live: Callable[..., None], rc_op: np.ndarray, p: np.ndarray, v: np.ndarray,
                st: np.ndarray, off_b: np.ndarray, per_m: int, M: int, start_a: np.ndarray,
                end_a: np.ndarray, size: np.ndarray) -> None:
    """Saved outputs ``p`` that recomputation drops (saved by ``v``, pairwise): each lives
    again from the start of the backward that recomputes it until the last backward that
    saved it is done, per micro-batch."""
    if not len(p):
        return
    up, first, inv = np.unique(p, return_index=True, return_inverse=True)
    for m in range(M):
        t1 = np.full(len(up), -np.inf)
        np.maximum.at(t1, inv.reshape(-1), end_a[off_b[v] + m * per_m])
        live(st[up], start_a[off_b[rc_op[up]] + m * per_m], t1, size[first])


def _gathered(eff: StageEffects | None, tasks: TaskGraph, start_a: np.ndarray,
              end_a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ZeRO 3's full weight copies as (stage, time, bytes) events: each gathered at its
    all-gather's start and freed when the last op it was gathered for is done."""
    if eff is None or not eff.gathers:
        z = np.zeros(0, dtype=np.int64)
        return z, z.astype(np.float64), z
    per_m = tasks.fb.per_mb
    s = np.array([g.stage for g in eff.gathers], dtype=np.int64)
    t0 = np.array([start_a[g.task] for g in eff.gathers])
    t1 = np.array([max(float(end_a[g.task]), float(end_a[g.readers + g.mb * per_m].max()))
                   for g in eff.gathers])
    b = np.array([tasks.nbytes[g.task] for g in eff.gathers], dtype=np.int64)
    return np.concatenate([s, s]), np.concatenate([t0, t1]), np.concatenate([b, -b])
