"""One rank running its stage's actions: the forward and backward of each op placed on its
stage, for each micro-batch and shard, in the order the schedule gives.

As every stage's action list is a piece of one global topological order, blocking receives and
non-blocking sends cannot deadlock whatever the placement. Backward runs op by op: each op's
inputs enter through a small autograd function that hands their gradient to a slot (saving
nothing), and each op's backward starts from the gradient edge of its output, so outputs are
freed as soon as the forward no longer needs them and only what autograd saves stays alive.

With ``runtime="segments"`` (the job's :attr:`~explorer.runtime.jobfiles.Job.runtime`) the
rank runs its forward actions a segment at a time instead (:mod:`explorer.runtime.segments`):
the segment's generated code on the same weights, one autograd backward per segment and
micro-batch at the first backward action of its ops, the others skipped. Its inputs enter
through the same identity function as an op's. The memory it counts differs from the op
path's only in an intermediate of a segment's forward, counted only where autograd saves it.
A CPU rank counts what autograd holds in one step (:attr:`Job.memory_step`, untimed where it
can be) and reports its peak from it. With the job's ``compile`` each segment's code runs
through ``torch.compile`` (:mod:`explorer.runtime.segment_compile`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from explorer.core.errors import ExplorerError
from explorer.core.schedule import BWD, FWD, OPTIMIZER
from explorer.core.segments import Segment, group_segments
from explorer.runtime.accounting import MemTracker
from explorer.runtime.comm import ACTIVATION, GRADIENT, NO_GRADIENT, Messenger, replica_group
from explorer.runtime.jobfiles import Job, fill_refs
from explorer.runtime.layout import RankLayout
from explorer.runtime.params import AUTOCAST_DTYPES, Weights, cast_once
from explorer.runtime.recompute import Recomputer
from explorer.runtime.segment_compile import compile_segment
from explorer.runtime.segment_steps import SegmentSteps, release_slots
from explorer.runtime.segments import SegmentCode
from explorer.runtime.tensor_parallel import TensorMesh, local


class _Entry(torch.autograd.Function):
    """Identity on a tensor entering an op; its gradient goes to ``slot`` (nothing is saved;
    :func:`release_slots` empties it)."""

    @staticmethod
    def forward(ctx, anchor, x, slot):  # type: ignore[override]
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.slot.append(g)
        return None, None, None


def draw_seed(seed: int, step: int, block: int, node: int) -> int:
    """The seed random op ``node`` (dropout, ...) draws from at ``step`` on ``block`` of the
    batch (micro-batch x shards + shard: which rows).

    A function of the run's seed and of what is computed, never of where: the replicas of a
    data-parallel stage draw different masks (their rows differ), the stages of a pipeline
    draw what one device would, and a plan draws as any other plan cutting the batch into as
    many blocks, so seeded runs repeat bit for bit and plans stay comparable.
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{block}:{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1



class _ReleasedType:
    """Marks a received tensor whose last local use is done."""


_Released = _ReleasedType()

# (micro-batch, shard, node): the key of a value or gradient within a step
Key = tuple[int, int, int]


class StageRunner(SegmentSteps):
    """One device's share of the plan: its stage's actions, one training step at a time."""

    def __init__(self, job: Job, rank: int, world: int, local_rank: int) -> None:
        self.job, self.world = job, world
        L = self.layout = RankLayout(job, rank, world, local_rank)
        self.tracker = MemTracker()
        self.messenger = Messenger(L.tdev)
        group = replica_group(L.plan, L.s, rank)
        #: the mesh of this rank's tensor group (None unless its stage is tensor-parallel)
        self.mesh = TensorMesh.of_rank(L.plan, L.s, rank, L.tdev.type, job.placements)
        self.weights = Weights(L, job.state, job.lr, self.messenger, self.tracker, group,
                               job.record, self.mesh, job.units)
        #: the ops the layout splits (run on local shards), those of them whose outputs are
        #: local shards (known after their first forward), and per output the dimension it
        #: is split along, from the end (None: whole)
        self.split = {L.names.index(n) for n in job.split_ops}
        self.local = {L.names.index(n) for n in job.local_ops}
        self.sequence = {L.names.index(n) for n in job.sequence_ops}
        self.shard_out: set[int] = set()
        self.shard_dims: dict[Key, list[int | None]] = {}
        #: the partial sums of the gradients of whole values split ops read, until the last
        #: of those ops' backward on the micro-batch (then all-reduced once), and how many
        #: of those backwards are left
        self.partial: dict[Key, list] = {}
        self.partial_left: dict[Key, int] = {}
        self.actions = job.schedule[L.s]
        self.anchor = torch.zeros((), requires_grad=True, device=L.tdev)
        self.slots: dict[Key, list] = {}
        self.task_times: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.steps_done = 0  # steps run so far, warm-up included (random ops' draws use it)
        settings = L.plan.settings_of(L.s)
        self.autocast_dtype = AUTOCAST_DTYPES.get(settings.precision)
        self.recompute: Recomputer | None = None
        #: the segments recompute: a run of a unit's ops is checkpointed (if it runs an op again)
        self.checkpointed = settings.recompute != "none" and job.runtime == "segments"
        self.recompute_mode = settings.recompute
        self.recompute_held: dict[tuple[int, int], Any] = {}
        if settings.recompute != "none" and job.units is None:
            raise ExplorerError("this job folder was written without recomputation units; "
                                "export the plan again (ex.export_script)")
        if settings.recompute != "none" and not self.checkpointed:
            per_unit = {kind: dict(Counter(job.units[a.node] for a in self.actions
                                           if a.kind == kind and a.micro_batch == 0))
                        for kind in (FWD, BWD)}
            self.recompute = Recomputer(L, settings.recompute, job.units, per_unit[FWD],
                                        per_unit[BWD], self.tracker, self._call,
                                        self.weights.for_recompute,
                                        job.kept_outputs or [False] * len(job.units))
        self.generator = (torch.cuda.default_generators[L.tdev.index or 0]
                          if L.tdev.type == "cuda" else torch.default_generator)
        #: with the segment runtime, per action position, the segment that runs there (the
        #: other actions of its ops are skipped), and each segment's code by its ops
        self.segment_at: dict[int, Segment] | None = None
        self.codes: dict[tuple[int, ...], SegmentCode] = {}
        self._code_reads = {}
        if job.runtime == "segments":
            segments = group_segments(self.actions, L.s, L.stage, L.kind, L.preds,
                                      L.requires_grad, L.names.index(L.loss_name),
                                      job.units if self.weights.shards.ghost else None)
            self.segment_at = {seg.forward_at: seg for seg in segments}
            self.segment_at.update({seg.backward_at: seg for seg in segments
                                    if seg.backward_at is not None})
            for seg in segments:
                if seg.nodes not in self.codes:
                    code = self._segment_code(seg)
                    self.codes[seg.nodes] = compile_segment(code) if job.compile else code
            #: per (micro-batch, op), its segment
            self.segment_of = {(seg.micro_batch, i): seg for seg in segments
                               for i in seg.nodes}
            self.param_uses = {}  # (a stage of one device has no reduction to start)
            for i, t in self.weights.value.items():
                if L.kind[i] == "param" and t.requires_grad and len(L.plan.stages[L.s]) > 1:
                    t.register_post_accumulate_grad_hook(
                        lambda _, i=i: self.param_grad_made(i))
        #: per action position, the op whose weights start gathering (ZeRO 3) before it runs
        self.prefetch_before = self._prefetches()
        #: the action positions a step runs something at (not a segment's other ops')
        self.runs_at = [k for k, a in enumerate(self.actions) if self.segment_at is None
                        or a.kind == OPTIMIZER or k in self.segment_at]
        self.steps_optimizer = any(a.kind == OPTIMIZER for a in self.actions)
        #: the dtype of a step's one autocast context (:func:`cast_once`; none where the
        #: stage recomputes: it saves no copy) and the step's last forward, after which it ends
        self.cast_dtype = self.autocast_dtype if self.recompute_mode == "none" else None
        self.last_forward = max([k for k in self.runs_at if self.actions[k].kind == FWD] or [-1])

    def _prefetches(self) -> list[int | None]:
        """Per action position, the op whose sharded weights to start gathering (ZeRO 3) as
        the action starts: the next action's op, so its gather overlaps this one's compute;
        with segments, at a segment's run the first op of the next segment to run (the actions
        of its other ops run nothing)."""
        acts = self.actions
        if self.segment_at is None:
            return [acts[k + 1].node if k + 1 < len(acts) and acts[k + 1].kind != OPTIMIZER
                    else None for k in range(len(acts))]
        runs = [k for k in range(len(acts)) if k in self.segment_at]
        out: list[int | None] = [None] * len(acts)
        for k, after in itertools.pairwise(runs):
            out[k] = acts[after].node
        return out

    def feed(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Use this batch from the next step on (same shapes as the example batch)."""
        for new, old in zip([*inputs, *targets], [*self.job.inputs, *self.job.targets],
                            strict=True):
            if new.shape != old.shape:
                raise ExplorerError(f"batches() gave a tensor of shape {tuple(new.shape)} "
                                    f"where the plan expects {tuple(old.shape)}")
        self.job.inputs, self.job.targets = list(inputs), list(targets)

    # -- one step ------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """Run one training step; its time, busy time, peak memory and loss."""
        L = self.layout
        self.messenger.start_step()
        self.task_times = defaultdict(list)
        self.env: dict[tuple[int, int], dict[int, Any]] = defaultdict(dict)
        self.fwd_left: dict[Key, int] = {}
        self.grad: dict[Key, list] = {}
        self.bwd_left: dict[Key, int] = {}
        self.edges: dict[Key, list] = {}
        self.received: dict[Key, Any] = {}
        self.losses: list[float] = []
        self._start_segments()
        busy = 0.0
        #: a CPU rank counts what autograd holds in one step only: the hooks that count it cost
        #: time eager PyTorch does not spend, and every step after the first holds the same
        self.memory_step = (L.tdev.type != "cuda"
                            and self.steps_done == self.job.memory_step)
        self.weights.counting = self.memory_step
        self.hooked: set = set()  # (the autograd nodes counting their gradients, this step)
        self.tracker.reset_peak()
        if L.tdev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(L.tdev)
        if self.world > 1:  # (every rank starts the step together)
            with self.messenger.waiting():
                dist.barrier()
        t0 = time.perf_counter()
        self.weights.start_step()
        times = self.task_times
        with cast_once(L.tdev.type, self.cast_dtype) as casts:
            for k in self.runs_at:
                a = self.actions[k]
                if self.prefetch_before[k] is not None:
                    self.weights.prefetch(self.prefetch_before[k])
                if k > self.last_forward:  # (from here autograd alone holds the copies)
                    casts.close()
                if a.kind == OPTIMIZER:
                    dt = self._timed(self.weights.finish)
                    busy += dt
                    times[OPTIMIZER, -1].append(dt)
                    continue
                if self.segment_at is not None:
                    seg = self.segment_at[k]
                    run_segment = self._segment_forward if a.kind == FWD else self._segment_backward
                    for u in L.units:
                        dt = self._timed(run_segment, seg, u)
                        busy += dt
                        times[a.kind, a.node].append(dt)
                    continue
                run = self._forward if a.kind == FWD else self._backward
                for u in L.units:
                    dt = self._timed(run, a.micro_batch, u, a.node)
                    busy += dt
                    times[a.kind, a.node].append(dt)
        if not self.steps_optimizer:
            busy += self._timed(self.weights.finish)
        self.messenger.flush()
        self._sync()
        t1 = time.perf_counter()
        peak = (torch.cuda.max_memory_allocated(L.tdev) if L.tdev.type == "cuda"
                else self.tracker.peak if self.memory_step else None)
        loss = sum(self.losses) / len(self.losses) if self.losses else None
        self.env.clear()
        self.hooked.clear()
        self.steps_done += 1
        return {"step_s": t1 - t0, "busy_s": busy, "peak_bytes": peak, "loss": loss,
                "memory_step": self.memory_step,
                "peak_by_category": self.tracker.peak_by if self.memory_step else None}

    def _timed(self, fn: Callable[..., None], *args: Any) -> float:
        """Seconds ``fn(*args)`` took, the device synchronized, waits for messages excluded."""
        w0, t_start = self.messenger.waited, time.perf_counter()
        fn(*args)
        self._sync()
        return time.perf_counter() - t_start - (self.messenger.waited - w0)

    def _sync(self) -> None:
        if self.layout.tdev.type == "cuda":
            torch.cuda.synchronize(self.layout.tdev)

    # -- forward -------------------------------------------------------------------------
    def _arg(self, m: int, u: int, p: int, slots: list) -> Any:
        L = self.layout
        kind = L.kind[p]
        if kind == "input":  # this stage's copy of its micro-batch's rows, until its last use
            env = self.env[(m, u)]
            if p not in env:
                env[p] = self._batch(m, u, p)
                self.tracker.add(env[p])
                self.fwd_left[(m, u, p)] = L.local_consumers(p)
            return env[p]
        if kind in ("param", "buffer"):
            return self.weights.use(p, m, u)
        return self._enter(p, self._value(m, u, p), slots)

    def _value(self, m: int, u: int, p: int) -> Any:
        """The value of op ``p`` on micro-batch ``m``, shard ``u``: this stage's, or received
        from ``p``'s stage at its first local use."""
        L = self.layout
        if L.stage[p] == L.s:
            val = self.env[(m, u)][p]
        else:
            rk = (m, u, p)
            if rk not in self.received:
                flat = self.messenger.recv(L.peer_from(L.stage[p], u),
                                           L.tag(ACTIVATION, m, u, p))
                spec = L.spec[p]
                val = tree_unflatten(flat, spec) if spec is not None else flat[0]
                for t in flat:
                    if isinstance(t, torch.Tensor):
                        self.tracker.add(t)
                self.received[rk] = val
                self.fwd_left[rk] = L.local_consumers(p)
            val = self.received[rk]
        return val

    def _enter(self, p: int, val: Any, slots: list) -> Any:
        """``val`` (node ``p``'s) as an op reads it: each floating tensor that needs a
        gradient through an identity whose gradient goes to a slot in ``slots``."""
        L = self.layout
        flat, spec = tree_flatten(val)
        wrapped = []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and L.requires_grad[p]:
                slot: list = []
                slots.append((p, len(wrapped), slot))
                wrapped.append(_Entry.apply(self.anchor, t.detach(), slot))
                if self.mesh is not None:
                    self.mesh.carried(t, wrapped[-1])
            else:
                wrapped.append(t)
        return tree_unflatten(wrapped, spec)

    def _batch(self, m: int, u: int, p: int) -> torch.Tensor:
        """The rows of input ``p`` for micro-batch ``m``, shard ``u``, as a tensor of their own
        on the device (a copy on CPU too, as on a GPU: the batch itself is host data; but the
        whole batch on CPU is read where it is, as eager training on CPU reads it)."""
        L = self.layout
        k = int(L.names[p].split("_")[1])
        src = self.job.inputs[k] if L.names[p].startswith("input_") else self.job.targets[k]
        if L.rows == src.shape[0] and L.tdev.type == "cpu":  # (the whole batch, where it is)
            return src
        start = (m * L.shards + u) * L.rows
        return src[start: start + L.rows].to(L.tdev, copy=True)

    def _call(self, m: int, u: int, i: int, lookup: dict[str, Any]) -> Any:
        """Op ``i`` on micro-batch ``m``, shard ``u``, its inputs by name in ``lookup``: the
        same random draws and precision whenever it runs (again)."""
        L = self.layout
        call = L.calls[i]
        if L.random[i]:
            self.generator.manual_seed(self._draw(m, u, i))
        with self._autocast():
            args, kwargs = fill_refs(call.args, lookup), fill_refs(call.kwargs, lookup)
            if self.mesh is None:
                return L.targets[i](*args, **kwargs)
            return self.mesh.run_op(L.targets[i], args, kwargs, i in self.split,
                                    i in self.local, i in self.sequence,
                                    L.names[i] == L.loss_name)

    def _draw(self, m: int, u: int, i: int) -> int:
        """The seed random op ``i`` draws from on micro-batch ``m``, shard ``u`` this step."""
        return draw_seed(self.job.seed, self.steps_done, m * self.layout.shards + u, i)

    @staticmethod
    def _gradient_boundary(node: Any) -> bool:
        """Where the autograd nodes of a segment's forward end: a weight's gradient
        accumulation, or an input's entry (whose gradient the rank counts itself)."""
        return type(node).__name__ == "AccumulateGrad" or \
            getattr(node, "_forward_cls", None) is _Entry

    def _stand_in(self, t: torch.Tensor) -> Any:
        """What autograd keeps instead of ``t``: a reference to a gathered weight (ZeRO 3) or
        to a recomputable value, or None (``t`` itself)."""
        kept = self.weights.stand_in(t)
        if kept is None and self.recompute is not None:
            kept = self.recompute.stand_in(t)
        return kept

    def _forward(self, m: int, u: int, i: int) -> None:
        """Run op ``i`` forward on micro-batch ``m``, shard ``u``."""
        L = self.layout
        slots: list = []
        lookup = {L.names[p]: self._arg(m, u, p, slots) for p in L.preds[i]}
        rec = self.recompute
        if rec is not None:
            rec.before_op(m, u, i, {p: self._raw(m, u, p) for p in L.preds[i]
                                    if L.kind[p] not in ("param", "buffer")})
        tracker = self.tracker
        with tracker.saving(self._stand_in):
            out = self._call(m, u, i, lookup)
        if rec is not None:
            rec.after_op(m, u, i, out)
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                tracker.add(t)
        self.env[(m, u)][i] = out
        self.edges[(m, u, i)] = [get_gradient_edge(t) if isinstance(t, torch.Tensor)
                                 and t.requires_grad else None for t in flat]
        self.slots[(m, u, i)] = slots
        if self.mesh is not None:
            self.shard_dims[(m, u, i)] = [self.mesh.split_dim(t) for t in flat]
            if any(d is not None for d in self.shard_dims[(m, u, i)]):
                self.shard_out.add(i)
        self.fwd_left[(m, u, i)] = L.local_consumers(i)
        remote = L.remote_stages(i)
        sent = self.mesh.plain(out) if remote and self.mesh is not None else out
        for t in remote:
            for dst in L.peers_to(t, u):
                self.messenger.send(sent, dst, L.tag(ACTIVATION, m, u, i))
        if L.names[i] == L.loss_name:
            self.losses.append(float(local(out.detach())))
        # inputs whose last local forward use this was can go
        for p in L.preds[i]:
            if L.kind[p] == "param":
                self.weights.forward_done(p, m, u)
            k = (m, u, p)
            if k in self.fwd_left:
                self.fwd_left[k] -= 1
                if self.fwd_left[k] == 0:
                    self._release_output(m, u, p)
        if self.fwd_left[(m, u, i)] == 0 and L.names[i] != L.loss_name:
            self._release_output(m, u, i)

    def _raw(self, m: int, u: int, p: int) -> Any:
        """The value of node ``p`` an op of micro-batch ``m``, shard ``u`` reads (before it
        enters the op)."""
        L = self.layout
        if L.kind[p] == "input" or L.stage[p] == L.s:
            return self.env[(m, u)][p]
        return self.received[(m, u, p)]

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The stage's precision around an op: autocast to bf16 or fp16 (weights stay fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.layout.tdev.type, dtype=self.autocast_dtype)

    def _release_output(self, m: int, u: int, p: int) -> None:
        L = self.layout
        here = L.stage[p] == L.s or L.kind[p] == "input"  # (each stage has its rows)
        val = self.env[(m, u)].pop(p, None) if here else self.received.get((m, u, p))
        if val is None:
            return
        for t in tree_flatten(val)[0]:
            if isinstance(t, torch.Tensor):
                self.tracker.drop(t)
        if self.recompute is not None and L.kind[p] == "op" and L.stage[p] == L.s:
            self.recompute.released(m, u, p)
        if not here:
            self.received[(m, u, p)] = _Released

    # -- backward ------------------------------------------------------------------------
    def _backward(self, m: int, u: int, i: int) -> None:
        """Run op ``i`` backward on micro-batch ``m``, shard ``u``."""
        L = self.layout
        key = (m, u, i)
        edges = self.edges.pop(key, None) or []
        slots = self.slots.pop(key, [])
        # gradients from consumers on other stages
        for t in sorted({L.stage[c] for c in L.succs[i] if L.requires_grad[c]} - {L.s}):
            got = self.messenger.recv(L.peer_from(t, u), L.tag(GRADIENT, m, u, i))
            if self.mesh is not None:
                got = self.mesh.matching(got, self.shard_dims.get(key, []))
            self._store_grad(key, got)
        grads = self.grad.pop(key, None)
        if L.names[i] == L.loss_name:
            grads = [torch.full_like(self.env[(m, u)][i], self.weights.loss_scale
                                     / (L.micro_batches * L.shards))]
            self._release_output(m, u, i)
        pairs = [(e, g) for e, g in zip(edges, grads or [], strict=False)
                 if e is not None and g is not None]
        # autograd frees what the op saved (and its output's gradient) only after computing
        # the gradients of its inputs: count those first (on CPU; a GPU's allocator measures
        # itself, and holding the freed tensors a little longer would only raise its peak)
        self.weights.shards.current = (m, u)
        counting = L.tdev.type != "cuda"
        # (and what autograd makes and frees inside the call: a weight's gradient made anew
        # before it is added in, the gradients passed between the op's own autograd nodes)
        inside = (self.weights.accumulated_bytes(L.preds[i]) + L.backward_scratch[i]
                  if counting else 0)
        with (self.tracker.deferred() if counting else contextlib.nullcontext()), \
                self.tracker.transient(inside):
            if pairs:
                torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
            made = [g for _, _, slot in slots for g in slot]
            for g in made:
                self.tracker.add(g)
            for g in grads or []:
                if g is not None:
                    self.tracker.drop(g)
        self._route_input_grads(m, u, i, slots)
        for g in made:
            self.tracker.drop(g)
        if self.recompute is not None:
            self.recompute.backward_done(m, u, i)

    def _route_input_grads(self, m: int, u: int, i: int, slots: list) -> None:
        """Hand the gradients of op ``i``'s inputs on: to parameters, to the producer on this
        stage, or (after its last local consumer) to the producer's stage; even when none
        flowed, so every counter moves."""
        L = self.layout
        per_pred: dict[int, list] = {}
        for p, pos, slot in slots:
            if slot:
                lst = per_pred.setdefault(p, [None] * L.nflat[p])
                lst[pos] = slot[0] if lst[pos] is None else lst[pos] + slot[0]
        release_slots(slots)
        for p in L.preds[i]:
            if L.kind[p] == "param":
                self.weights.used(p, (m, u))
                continue
            if L.kind[p] != "op" or not L.requires_grad[p]:
                continue
            gk = (m, u, p)
            if self._partial(i, p):
                self._hold_partial(gk, per_pred.pop(p, None))
            if p in per_pred:
                self._store_grad(gk, per_pred[p])
            if L.stage[p] != L.s:
                self._readers_done(m, u, p, 1)

    def _readers_done(self, m: int, u: int, p: int, n: int) -> None:
        """``n`` more of this stage's readers of ``p`` (made on another stage) are done with
        their backward on micro-batch ``m``, shard ``u``: after the last, send ``p``'s
        gradient to its stage (a missing one as :data:`NO_GRADIENT`) and drop it here."""
        L = self.layout
        gk = (m, u, p)
        left = self.bwd_left.get(gk)
        if left is None:
            left = sum(1 for c in L.succs[p] if L.stage[c] == L.s and L.requires_grad[c])
        self.bwd_left[gk] = left - n
        if left >= 1 and left - n <= 0:
            g = self.grad.pop(gk, None) or [None] * L.nflat[p]
            sent = [x if x is not None else NO_GRADIENT for x in g]
            if self.mesh is not None:
                sent = self.mesh.plain(sent)
            for dst in L.peers_to(L.stage[p], u):
                self.messenger.send(sent, dst, L.tag(GRADIENT, m, u, p))
            for x in g:
                if x is not None:
                    self.tracker.drop(x)

    def _partial(self, i: int, p: int) -> bool:
        """Whether op ``i``'s gradient of its input ``p`` is this rank's partial sum: ``i``
        ran on local shards (:meth:`_reads_partially`) and ``p`` is whole."""
        return self._reads_partially(i) and p not in self.shard_out

    def _partial_readers(self, m: int, p: int) -> int:
        """How many of this stage's ops hand a partial sum of whole ``p``'s gradient on
        micro-batch ``m`` to :meth:`_hold_partial`: every split op that reads it, but those
        of ``p``'s own segment (their sum is all-reduced inside it)."""
        L = self.layout
        own = self.segment_of.get((m, p)) if self.segment_at is not None else None
        return sum(1 for c in L.succs[p] if L.stage[c] == L.s and L.requires_grad[c]
                   and self._reads_partially(c) and (own is None or c not in own.nodes))

    def _hold_partial(self, key: Key, new: list | None, n: int = 1) -> None:
        """Add a partial sum of ``key``'s gradient (from ``n`` split ops) to those held;
        after the last split op that reads ``key`` on this micro-batch, all-reduce their sum
        once and add it to ``key``'s gradient."""
        if key not in self.partial_left:
            self.partial_left[key] = self._partial_readers(key[0], key[2])
        if new is not None:
            self._store_grad(key, new, self.partial)
        self.partial_left[key] -= n
        if self.partial_left[key] == 0:
            del self.partial_left[key]
            held = self.partial.pop(key, None)
            if held is not None:
                assert self.mesh is not None
                for x in held:
                    if x is not None:
                        self.tracker.drop(x)
                self._store_grad(key, self.mesh.reduced_sum(held))

    def _store_grad(self, key: Key, new: list, into: dict[Key, list] | None = None) -> None:
        """Add gradients to what is held for ``key`` (in ``into``: the gradients by default),
        keeping the memory accounting exact."""
        into = self.grad if into is None else into
        old = into.get(key)
        total = _add(old, new, self.layout.nflat[key[2]])
        for x in old or []:
            if x is not None:
                self.tracker.drop(x)
        for x in total:
            if x is not None:
                self.tracker.add(x)
        into[key] = total


def _add(acc: list | None, new: list, n: int) -> list:
    """Element-wise sum of two gradient lists; None (or an empty tensor) is no gradient."""
    new = [None if x is None or (x.dim() == 1 and x.numel() == 0) else x for x in new]
    new = new + [None] * (n - len(new))
    if acc is None:
        return new
    return [a if b is None else (b if a is None else a + b) for a, b in zip(acc, new,
                                                                         strict=True)]
