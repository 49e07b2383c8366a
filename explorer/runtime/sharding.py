"""ZeRO 1-3 on a stage's replicas: parameters, their gradients and optimizer state cut in shards.

Each trainable parameter of the stage is flattened and padded to a multiple of the replica
count R; replica j holds elements ``[j*k, (j+1)*k)`` (``k`` = padded size / R) of it, of its
gradient (ZeRO 2, 3) and of its optimizer state (ZeRO 1-3), as the plan's memory settings
describe them:

- ZeRO 1 (Megatron's distributed optimizer): the full parameter stays, as one padded flat
  tensor whose shard the optimizer steps (a view of it; under bf16/fp16 a 2-byte working copy,
  the optimizer stepping an fp32 master copy of the shard, as Megatron and DeepSpeed keep
  them); gradients are reduce-scattered in
  buckets (:class:`ScatterBuckets`): one ``reduce_scatter_tensor`` per bucket, started
  without waiting as soon as the last of its gradients is final (its last use in the step's
  backward); the full gradients stay until the optimizer step (as the distributed optimizer
  keeps its gradient buffer); the updated shards are all-gathered back into the flat tensors
  during the next step's forward (:class:`UpdatedShards`), several parameters' in one
  collective. An all-reduce's traffic in all.
- ZeRO 2: as 1, but the full gradients are freed once their reduce-scatter is done, as DDP
  and FSDP do and as the simulator prices it. Over several micro-batches, each micro-batch's
  gradients are reduce-scattered apart as soon as its backward has made them (as FSDP and
  DeepSpeed do), copied out and freed as their collective starts, and only the shards add
  up: a reduce-scatter per micro-batch, no whole gradient held across micro-batches (unless
  a weight of the stage is read on another stage: its gradient comes home at the step's end,
  and the stage reduces once, at the end).
- ZeRO 3: only the shard is stored. The parameters are gathered in groups, one
  ``all_gather_into_tensor`` per group as FSDP2 gathers a wrapped module's parameters: those
  first read in the same recomputation unit (a repeated block, or a top-level module;
  :func:`~explorer.costs.strategies.gather_groups`, as the simulator prices them). A
  micro-batch's forward gathers a group before its first op and frees it after the last op
  that reads one of its parameters; the backward gathers it again when an op's backward needs
  one and frees it once the micro-batch's gradients of its parameters are made. Autograd
  never keeps a gathered copy: what it saves of one is a reference (:class:`GatheredRef`)
  that gathers again. Prefetch depth 1: when an op starts, the gather of the next op's
  groups is started (``async_op=True``) so it overlaps the op's compute; a prefetched copy
  nobody took is freed when the micro-batch's backward is done with the group. Gradients go
  as in ZeRO 2. Under bf16/fp16 the shards are cast before they are gathered, as FSDP2's
  ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32)`` does: the ops read
  2-byte weights (autocast makes no copy of them, and what a weight makes directly, an
  embedding's lookup, comes out in 2 bytes), the gathers move half the bytes, and each
  weight's gradient reaches its fp32 parameter (and the reduce-scatter) in fp32.

Why not FSDP2's ``fully_shard`` or DTensor: ``fully_shard`` shards ``nn.Module`` parameters and
gathers them in module forward and backward hooks, but this runtime calls the ATen ops of a
captured graph one at a time in a schedule's order, with no module around them; a ``DTensor``
with ``Shard(0)`` placement would route every op through DTensor dispatch to get what one
``redistribute`` per use gives. So the runtime uses FSDP2's building blocks directly: flat padded
shards and the ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` collectives (both present
on gloo and NCCL), issued where the schedule needs them, and keeps gathered weights out of
autograd's saved tensors with saved-tensor hooks where FSDP2 frees their storage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from explorer.costs.strategies import PARAM_ELEMENT_BYTES, buckets, gather_groups
from explorer.runtime.accounting import GATHERED, GRADIENTS, PARAMETERS, MemTracker
from explorer.runtime.comm import Messenger

# (micro-batch, shard) of a step
At = tuple[int, int]


class _Gathered(torch.autograd.Function):
    """A gathered weight entering an op; its gradient goes to the parameter ``ghost`` (a
    tensor of the parameter's shape without storage, which only receives gradients), in the
    parameter's dtype (the gradient of a weight gathered in 2 bytes is cast here, so the
    gradient the parameter takes is the one this node makes)."""

    @staticmethod
    def forward(ctx, ghost, full):  # type: ignore[override]
        ctx.dtype = ghost.dtype
        return full.view_as(full)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g.to(ctx.dtype), None


def _receiver(like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s shape and dtype without storage, which only receives
    gradients (a parameter whose values are read elsewhere: gathered, or a working copy)."""
    t = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    t.untyped_storage().resize_(0)
    return t.requires_grad_(True)


class GatheredRef:
    """What autograd keeps of a saved gathered weight (or a view of it): which gather group
    and where in its buffer; unpacked in the backward by gathering the group again."""

    __slots__ = ("g", "offset", "p", "shards", "size", "stride")

    def __init__(self, shards: Shards, g: int, t: torch.Tensor) -> None:
        self.shards, self.g, self.p = shards, g, shards.members[g][0]
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        self.shards.for_backward(self.p)
        buf = self.shards.gathered[self.g]
        return buf.as_strided(self.size, self.stride, self.offset)


class Shards:
    """The shards one replica holds of its stage's trainable parameters (ZeRO ``zero`` over
    ``replicas`` replicas, this one number ``index``), and the collectives that move them."""

    def __init__(self, zero: int, group: Any, replicas: int, index: int, tracker: MemTracker,
                 messenger: Messenger, uses: Callable[[int], int],
                 gather_dtype: torch.dtype | None = None) -> None:
        self.zero, self.group, self.replicas, self.index = zero, group, replicas, index
        #: under bf16/fp16: the dtype fp32 shards are cast to before they are gathered (ZeRO
        #: 3 as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``, ZeRO 1-2 into the working
        #: copy), so the ops read 2-byte weights and the gathers move half the bytes; None:
        #: gathered as stored
        self.gather_dtype = gather_dtype
        #: ZeRO 1, 2 under bf16/fp16: each parameter's 2-byte working copy (a view of its flat
        #: tensor, which the updated shards are gathered into), and the tensor without storage
        #: its gradients go to (in fp32, as the fp32 shard the optimizer steps)
        self.working: dict[int, torch.Tensor] = {}
        self.receiver: dict[int, torch.Tensor] = {}
        self.tracker, self.messenger = tracker, messenger
        self.uses = uses  # an op of a micro-batch using parameter p: how many per micro-batch
        #: per parameter, the tensor the optimizer steps: this replica's shard
        self.shard: dict[int, torch.Tensor] = {}
        self.flat: dict[int, torch.Tensor] = {}  # ZeRO 1, 2: the padded full parameter
        self.ghost: dict[int, torch.Tensor] = {}  # ZeRO 3: receives the full gradient
        self.shape: dict[int, torch.Size] = {}
        #: ZeRO 3: each sharded parameter's gather group (:func:`gather_groups`) and its members
        self.group_of: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        self.gathered: dict[int, torch.Tensor] = {}  # group -> its gathered buffer
        self.views: dict[int, torch.Tensor] = {}  # parameter -> its full copy (in the buffer)
        self.in_flight: dict[int, tuple[Any, torch.Tensor]] = {}  # group -> (work, buffer)
        self.by_storage: dict[int, int] = {}  # storage address of a gathered buffer: group
        #: group -> (why, members whose uses for it are not done yet) while it is held
        self.holders: dict[int, dict[tuple[str, int, int], set[int]]] = {}
        self.fwd_left: dict[tuple[int, int, int], int] = {}
        self.bwd_left: dict[tuple[int, int, int], int] = {}
        self.bwd_done: set[tuple[int, int, int]] = set()  # (p, m, u) whose backward is done
        #: the (micro-batch, shard) whose backward runs now
        self.current: At = (0, 0)

    def size(self, p: int) -> int:
        """Elements of one shard of ``p``."""
        return -(-self.shape[p].numel() // self.replicas)

    def place(self, p: int, full: torch.Tensor) -> torch.Tensor:
        """Keep this replica's share of parameter ``p`` (``full``, all of it); the tensor the
        ops of the stage see as the parameter (ZeRO 3: the ghost that gets the gradients)."""
        self.shape[p] = full.shape
        k, n = self.size(p), full.numel()
        j = self.index
        flat = torch.zeros(k * self.replicas, dtype=full.dtype, device=full.device)
        flat[:n] = full.reshape(-1)
        if self.zero < 3 and self.gather_dtype is not None and full.dtype == torch.float32:
            return self._place_working(p, full, flat)
        if self.zero < 3:
            self.flat[p] = flat
            self.tracker.add(flat, PARAMETERS)
            self.shard[p] = flat[j * k: (j + 1) * k].requires_grad_(True)
            return flat[:n].view(full.shape).requires_grad_(True)
        self.shard[p] = flat[j * k: (j + 1) * k].clone().requires_grad_(True)
        self.tracker.add(self.shard[p], PARAMETERS)
        self.ghost[p] = _receiver(full)
        return self.ghost[p]

    def _place_working(self, p: int, full: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """ZeRO 1, 2 under bf16/fp16, as Megatron's distributed optimizer and DeepSpeed keep
        them: the fp32 master copy of this replica's shard (what the optimizer steps) and a
        2-byte working copy of the whole parameter (what the ops read, the updated shards
        gathered into it); returns the tensor without storage that takes the gradients."""
        k, j, shape = self.size(p), self.index, self.shape[p]
        self.shard[p] = flat[j * k: (j + 1) * k].clone().requires_grad_(True)
        self.tracker.add(self.shard[p], PARAMETERS)
        self.flat[p] = flat.to(self.gather_dtype)
        self.tracker.add(self.flat[p], PARAMETERS)
        self.working[p] = self.flat[p][: shape.numel()].view(shape)
        self.receiver[p] = _receiver(full)
        return self.receiver[p]

    def read(self, p: int) -> torch.Tensor:
        """ZeRO 1, 2 under bf16/fp16: parameter ``p``'s working copy for an op, its gradient
        going to the receiver in fp32."""
        return _Gathered.apply(self.receiver[p], self.working[p])

    def collective(self, fn: Callable[[], Any]) -> None:
        """Run a blocking collective of the replicas, its time counted as waiting."""
        t0 = time.perf_counter()
        with self.messenger.waiting():
            fn()
        self.messenger.waited += time.perf_counter() - t0

    def gather_full(self, p: int) -> torch.Tensor:
        """All of parameter ``p`` from every replica's shard (not counted here)."""
        shard = self.shard[p].detach()
        out = torch.empty(shard.numel() * self.replicas, dtype=shard.dtype, device=shard.device)
        self.collective(lambda: dist.all_gather_into_tensor(out, shard, group=self.group))
        return out[: self.shape[p].numel()].view(self.shape[p])

    # -- ZeRO 3: gathered copies -----------------------------------------------------------
    def set_groups(self, first_reader: dict[int, int], units: list[str] | None) -> None:
        """Cut the sharded parameters into gather groups (``first_reader``: parameter -> the
        first op of the stage that reads it; ``units``: each node's recomputation unit, None:
        a group per op), each gathered by one collective."""
        unit = units.__getitem__ if units is not None else None
        for ps in gather_groups({p: first_reader[p] for p in self.ghost if p in first_reader},
                                unit):
            self.members[ps[0]] = ps
            for p in ps:
                self.group_of[p] = ps[0]
        for p in self.ghost:  # (parameters no op of the stage reads: alone)
            if p not in self.group_of:
                self.members[p], self.group_of[p] = [p], p

    def start_step(self) -> None:
        self.bwd_done.clear()

    def _start_gather(self, g: int) -> tuple[Any, torch.Tensor]:
        """Start the all-gather of group ``g``'s shards into one buffer (counted from now)."""
        mine = torch.cat([self.as_gathered(self.shard[p].detach()) for p in self.members[g]])
        out = mine.new_empty(mine.numel() * self.replicas)
        work = dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True)
        self.tracker.add(out, GATHERED)
        return work, out

    def as_gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """A shard as it is gathered (ZeRO 3 for a use, ZeRO 1-2 into the working copy): in
        :attr:`gather_dtype` where it is fp32."""
        if self.gather_dtype is None or shard.dtype != torch.float32:
            return shard
        return shard.to(self.gather_dtype)

    def prefetch(self, p: int) -> None:
        """Start gathering parameter ``p``'s group (if it is sharded here and not gathered or
        on its way): an op about to run reads it."""
        g = self.group_of.get(p)
        if g is None or g in self.gathered or g in self.in_flight:
            return
        self.in_flight[g] = self._start_gather(g)

    def _arrived(self, g: int) -> torch.Tensor:
        """The gathered buffer of group ``g``, once its gather is done (waiting counted)."""
        work, out = self.in_flight.pop(g)
        self.collective(work.wait)
        return out

    def cancel_prefetches(self, only: int | None = None) -> None:
        """Free prefetched buffers nobody took (of group ``only``, or all)."""
        for g in [only] if only is not None else list(self.in_flight):
            if g in self.in_flight:
                self.tracker.drop(self._arrived(g))

    def _unpack(self, g: int, out: torch.Tensor) -> torch.Tensor:
        """Group ``g``'s gathered buffer (replica by replica, each replica's shards of the
        members side by side) laid out member by member, and each member's full copy a view
        of it. One member: the buffer itself; else copied out (as FSDP2 does), the copy
        counted in place of the gathered buffer, which is freed once copied."""
        ps = self.members[g]
        if len(ps) == 1:
            buf = out
        else:
            rows, R = out.view(self.replicas, -1), self.replicas
            buf, at = out.new_empty(out.numel()), 0
            for p in ps:
                k = self.size(p)
                buf[R * at: R * (at + k)].view(R, k).copy_(rows[:, at: at + k])
                at += k
            self.tracker.move(out, buf)
        at = 0
        for p in ps:
            k = self.size(p) * self.replicas
            self.views[p] = buf[at: at + self.shape[p].numel()].view(self.shape[p])
            at += k
        return buf

    def _hold(self, p: int, why: tuple[str, int, int]) -> torch.Tensor:
        g = self.group_of[p]
        if g not in self.gathered:
            if g not in self.in_flight:
                self.in_flight[g] = self._start_gather(g)
            buf = self._unpack(g, self._arrived(g))
            self.gathered[g] = buf
            self.by_storage[buf.untyped_storage().data_ptr()] = g
            self.holders[g] = {}
        held = self.holders[g]
        if why not in held:
            _, m, u = why
            held[why] = {q for q in self.members[g]
                         if why[0] == "f" or (q, m, u) not in self.bwd_done}
        return self.views[p]

    def _let_go(self, p: int, why: tuple[str, int, int]) -> None:
        g = self.group_of[p]
        held = self.holders.get(g)
        if held is None or why not in held:
            return
        held[why].discard(p)
        if held[why]:
            return
        del held[why]
        if not held:
            buf = self.gathered.pop(g)
            del self.holders[g]
            del self.by_storage[buf.untyped_storage().data_ptr()]
            for q in self.members[g]:
                del self.views[q]
            self.tracker.drop(buf)

    def use(self, p: int, m: int, u: int) -> torch.Tensor:
        """Parameter ``p`` for an op's forward on micro-batch ``m``, shard ``u``: gathered
        before the micro-batch's first op that reads it."""
        key = (p, m, u)
        if key not in self.fwd_left:
            self.fwd_left[key] = self.uses(p)
        full = self._hold(p, ("f", m, u))
        return _Gathered.apply(self.ghost[p], full.detach())

    def forward_done(self, p: int, m: int, u: int) -> None:
        """An op's forward that read ``p`` is done: after the micro-batch's last, free it."""
        key = (p, m, u)
        self.fwd_left[key] -= 1
        if self.fwd_left[key] == 0:
            del self.fwd_left[key]
            self._let_go(p, ("f", m, u))

    def for_backward(self, p: int) -> torch.Tensor:
        """Parameter ``p`` for the backward running now, gathered again if it was freed."""
        m, u = self.current
        return self._hold(p, ("b", m, u))

    def backward_done(self, p: int, m: int, u: int) -> None:
        """An op's backward that used ``p`` is done: after the micro-batch's last (its gradient
        of ``p`` is made), free the copy gathered for it."""
        key = (p, m, u)
        left = self.bwd_left.get(key, self.uses(p)) - 1
        self.bwd_left[key] = left
        if left == 0:
            del self.bwd_left[key]
            self.bwd_done.add(key)
            self._let_go(p, ("b", m, u))
            if self.group_of[p] not in self.gathered:
                self.cancel_prefetches(self.group_of[p])

    def stand_in(self, t: torch.Tensor) -> GatheredRef | None:
        """What autograd keeps instead of ``t`` when it is (a view of) a gathered copy."""
        if not self.by_storage:
            return None
        g = self.by_storage.get(t.untyped_storage().data_ptr())
        return None if g is None else GatheredRef(self, g, t)

    # -- gradients and the step --------------------------------------------------------
    def padded(self, p: int, full: torch.Tensor) -> torch.Tensor:
        flat = full.detach().reshape(-1)
        extra = self.size(p) * self.replicas - flat.numel()
        return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat.contiguous()

    def full_grad(self, p: int) -> torch.Tensor:
        """The whole gradient of ``p`` from every replica's gradient shard."""
        g = self.shard[p].grad
        g = g.detach() if g is not None else torch.zeros_like(self.shard[p])
        out = g.new_empty(g.numel() * self.replicas)
        self.collective(lambda: dist.all_gather_into_tensor(out, g, group=self.group))
        return out[: self.shape[p].numel()].view(self.shape[p])

class UpdatedShards:
    """ZeRO 1, 2: the updated shards gathered back into the full parameters, on a stage that
    exchanges no activations with another (``deferred``) during the next step's forward, as
    Megatron's distributed optimizer overlaps its parameter all-gathers with it; on a pipeline
    stage right after its optimizer step (the stages before it still run their last
    backwards then, and deferred gathers would hold back its first forward, which starts only
    once the stage before it sends).

    The optimizer step leaves every bucket of parameters stale: each replica's flat parameter
    holds its own updated shard and the others' old ones. Deferred, the next step starts the
    gather of the first stale bucket; the first op that reads a parameter of a stale bucket
    waits for its gather, copies it in and starts the next bucket's (prefetch depth 1: at most
    two buckets' buffers exist at a time); what no op of the step read is gathered before the
    optimizer step. Buckets of :data:`~explorer.costs.strategies.BUCKET_BYTES` over the
    parameters in graph order, as the simulator cuts them.
    """

    def __init__(self, shards: Shards, deferred: bool) -> None:
        self.shards, self.deferred = shards, deferred
        order = list(shards.flat)
        sizes = [shards.shape[p].numel() * PARAM_ELEMENT_BYTES for p in order]
        self.buckets = [[order[k] for k in b] for b in buckets(sizes)] if order else []
        self.bucket_of = {p: b for b, ps in enumerate(self.buckets) for p in ps}
        self.stale: list[int] = []  # buckets whose gather has not landed, in order
        self.in_flight: dict[int, tuple[Any, torch.Tensor]] = {}

    def optimizer_stepped(self) -> None:
        self.stale = list(range(len(self.buckets)))
        if not self.deferred:
            self.land_all()

    def start_step(self) -> None:
        if self.stale:
            self._start(self.stale[0])

    def _start(self, b: int) -> None:
        if b in self.in_flight:
            return
        sh = self.shards
        mine = torch.cat([sh.as_gathered(sh.shard[p].detach()) for p in self.buckets[b]])
        out = mine.new_empty(mine.numel() * sh.replicas)
        work = dist.all_gather_into_tensor(out, mine, group=self.shards.group, async_op=True)
        self.in_flight[b] = (work, out)

    def fresh(self, p: int) -> None:
        """Parameter ``p`` is about to be read: its bucket's gather landed."""
        if self.stale:
            b = self.bucket_of.get(p)
            if b is not None and b in self.stale:
                self._land(b)

    def land_all(self) -> None:
        while self.stale:
            self._land(self.stale[0])

    def _land(self, b: int) -> None:
        self._start(b)
        work, out = self.in_flight.pop(b)
        self.shards.collective(work.wait)
        self.stale.remove(b)
        if self.stale:
            self._start(self.stale[0])
        rows, at = out.view(self.shards.replicas, -1), 0
        for p in self.buckets[b]:
            k = self.shards.size(p)
            self.shards.flat[p].view(self.shards.replicas, k).copy_(rows[:, at: at + k])
            at += k


class ScatterBuckets:
    """ZeRO 1-3: the replicas' gradients reduce-scattered in buckets.

    ``params`` are the sharded parameters in the order their gradients are expected to be
    final (the reverse of the forward's), cut into buckets as the simulator cuts them
    (:func:`~explorer.costs.strategies.buckets` over the full gradients' bytes). When the
    last gradient of a bucket is final, its gradients are laid out replica by replica (each
    replica's shards of them side by side) in one flat tensor and one
    ``reduce_scatter_tensor`` of it is started without waiting. The full gradients stay
    until it is done (:meth:`done` reports finished buckets, :meth:`flush` waits for all).
    """

    def __init__(self, shards: Shards, params: list[int]) -> None:
        self.shards = shards
        sizes = [shards.shape[p].numel() * PARAM_ELEMENT_BYTES for p in params]
        self.buckets = [[params[k] for k in b] for b in buckets(sizes)]
        self.bucket_of = {p: b for b, ps in enumerate(self.buckets) for p in ps}
        self.start_step()

    def start_step(self) -> None:
        #: per micro-batch (None: the step's), the gradients each bucket waits for
        self.left: dict[int | None, list[int]] = {}
        self.started: list[tuple[Any, torch.Tensor, list[int], torch.Tensor | None]] = []
        self.begun: set[int] = set()

    def ready(self, p: int, grad_of: Callable[[int], torch.Tensor],
              micro_batch: int | None = None,
              release: Callable[[int], None] | None = None) -> None:
        """Parameter ``p``'s gradient is final (``grad_of``: a parameter's full gradient),
        for the step or for ``micro_batch`` (reduced a micro-batch at a time): start its
        bucket's reduce-scatter if that was the last, and ``release`` each of the bucket's
        full gradients once it is copied out (the next micro-batch makes them anew)."""
        b = self.bucket_of.get(p)
        if b is None:
            return
        left = self.left.setdefault(micro_batch, [len(ps) for ps in self.buckets])
        left[b] -= 1
        if left[b] == 0:
            self._start(b, grad_of, release)

    def _start(self, b: int, grad_of: Callable[[int], torch.Tensor],
               release: Callable[[int], None] | None = None) -> None:
        sh, R = self.shards, self.shards.replicas
        ps = self.buckets[b]
        flat = torch.cat([sh.padded(p, grad_of(p)).view(R, sh.size(p)) for p in ps], dim=1)
        out = flat.new_empty(flat.shape[1])
        work = dist.reduce_scatter_tensor(out, flat.reshape(-1), group=sh.group, async_op=True)
        if release is not None:  # (the copy, counted as the gradients it holds, until done)
            for p in ps:
                release(p)
            sh.tracker.add(flat, GRADIENTS)
        self.started.append((work, out, ps, flat if release is not None else None))
        self.begun.add(b)

    def done(self, wait: bool = False) -> list[tuple[int, torch.Tensor]]:
        """Each parameter of the buckets whose reduce-scatter is done (all of them, waiting,
        with ``wait``), with this replica's shard of its summed gradient (a view of the
        bucket's output)."""
        out: list[tuple[int, torch.Tensor]] = []
        while self.started and (wait or self.started[0][0].is_completed()):
            work, got, ps, copy = self.started.pop(0)
            self.shards.collective(work.wait)
            if copy is not None:
                self.shards.tracker.drop(copy)
            at = 0
            for p in ps:
                k = self.shards.size(p)
                out.append((p, got[at: at + k]))
                at += k
        return out

    def flush(self, grad_of: Callable[[int], torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        """Start the buckets not started (parameters no op of the step used), then wait for
        every bucket: :meth:`done`'s pairs."""
        for b in range(len(self.buckets)):
            if b not in self.begun:
                self._start(b, grad_of)
        return self.done(wait=True)
