"""Messages between ranks: tensors point to point, process groups of replicas, and the
all-reduce of replicas' gradients in buckets.

Tensors crossing stages go through ``torch.distributed`` point-to-point (gloo on CPU, NCCL on
GPU): non-blocking sends, blocking receives. A message is a header (how many parts, each part's
dtype and shape, or a Python number) then each tensor; shapes repeat every step, so a header is
sent once per (peer, tag). Replicas of a stage all-reduce their gradients in 25 MB buckets as
soon as a bucket is complete, as DDP does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from explorer.core.errors import ExplorerError
from explorer.core.plan import Plan
from explorer.runtime.heartbeat import EVERYONE
from explorer.runtime.tensor_parallel import local

BUCKET_BYTES = 25 * 1024 * 1024
HEADER_WORDS = 256  # int64 words of a message header
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]

# what a message carries (the low bits of its tag)
ACTIVATION, GRADIENT, WEIGHT, WEIGHT_GRADIENT = range(4)
NO_GRADIENT = torch.zeros(0)  # stands for "no gradient" in a message


def message_tag(kind: int, micro_batch: int, shard: int, node: int, shards: int,
                nodes: int) -> int:
    """A message's tag: what it carries (:data:`ACTIVATION` ... :data:`WEIGHT_GRADIENT`) for
    which micro-batch, shard and node; receivers match on it."""
    return ((micro_batch * shards + shard) * nodes + node) * 4 + kind


class Messenger:
    """Point-to-point messages of one rank, and the time it spent waiting for them."""

    def __init__(self, tdev: torch.device) -> None:
        self.tdev = tdev
        self.pending: list[tuple[Any, torch.Tensor, int]] = []
        self.headers_sent: set[tuple[int, int]] = set()
        self.headers_seen: dict[tuple[int, int], list[int]] = {}
        self.waited = 0.0  # seconds blocked in receives and all-reduce waits this step
        #: the rank this one is blocked on now (:data:`EVERYONE`: a collective), else None
        self.waiting_for: int | None = None

    def start_step(self) -> None:
        self.waited = 0.0

    def send(self, value: Any, dst: int, tag: int) -> None:
        """Send a tensor, a list of tensors or a Python number: a header, then each tensor."""
        flat, _ = tree_flatten(value)
        header = [len(flat)]
        tensors = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                header += [0, DTYPES.index(x.dtype), x.dim(), *x.shape]
                tensors.append(x)
            elif isinstance(x, (bool, int)):
                header += [1, int(x)]
            else:
                raise ExplorerError(f"cannot send a {type(x).__name__} between ranks")
        if len(header) + 1 > HEADER_WORDS:
            raise ExplorerError("an op output has too many parts to send between ranks")
        if (dst, tag) not in self.headers_sent:  # shapes repeat every step: send them once
            self.headers_sent.add((dst, tag))
            pad = torch.zeros(HEADER_WORDS, dtype=torch.int64)
            pad[: len(header) + 1] = torch.tensor([len(header), *header], dtype=torch.int64)
            pad = pad.to(self.tdev)
            self.pending.append((dist.isend(pad, dst, tag=tag), pad, dst))
            numbers = []
        else:  # Python numbers travelled in the header; now they follow the tensors
            numbers = [torch.tensor([int(x)], dtype=torch.int64, device=self.tdev)
                       for x in flat if not isinstance(x, torch.Tensor)]
        for t in [*(t.detach().to(self.tdev).contiguous() for t in tensors), *numbers]:
            self.pending.append((dist.isend(t, dst, tag=tag), t, dst))

    def recv(self, src: int, tag: int) -> list[Any]:
        """The parts of the message ``src`` sent with ``tag`` (blocks until it is here)."""
        t0 = time.perf_counter()
        self.waiting_for = src
        try:
            return self._recv(src, tag)
        finally:
            self.waiting_for = None
            self.waited += time.perf_counter() - t0

    @contextmanager
    def waiting(self, peer: int = EVERYONE) -> Iterator[None]:
        """Mark a blocking wait on ``peer`` (default: a collective) for the heartbeat."""
        self.waiting_for = peer
        try:
            yield
        finally:
            self.waiting_for = None

    def _recv(self, src: int, tag: int) -> list[Any]:
        h = self.headers_seen.get((src, tag))
        first = h is None
        if first:
            pad = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.tdev)
            dist.recv(pad, src, tag=tag)
            h = self.headers_seen[(src, tag)] = pad.tolist()
        n, pos, out = h[1], 2, []
        numbers = []
        for _ in range(n):
            if h[pos] == 1:
                out.append(h[pos + 1])
                numbers.append(len(out) - 1)
                pos += 2
                continue
            dtype, nd = DTYPES[h[pos + 1]], h[pos + 2]
            shape = h[pos + 3: pos + 3 + nd]
            pos += 3 + nd
            t = torch.empty(shape, dtype=dtype, device=self.tdev)
            dist.recv(t, src, tag=tag)
            out.append(t)
        if not first:
            for k in numbers:  # sent after the header-less tensors, in order
                n = torch.zeros(1, dtype=torch.int64, device=self.tdev)
                dist.recv(n, src, tag=tag)
                out[k] = int(n.item())
        return out

    def flush(self) -> None:
        """Wait until every send has gone."""
        for work, _, dst in self.pending:
            with self.waiting(dst):
                work.wait()
        self.pending.clear()


def replica_group(plan: Plan, stage: int, rank: int) -> Any:
    """The process group of ``stage``'s replicas that ``rank`` all-reduces its gradients with
    (None if the stage has one replica): in a tensor-parallel stage, the ranks that hold the
    same shards, one per replica.

    Every rank creates every replicated stage's groups, in the same order, as
    ``dist.new_group`` requires.
    """
    mine = None
    for k, st in enumerate(plan.stages):
        if plan.replicas_of(k) == 1:
            continue
        degree = plan.tensor_of(k)
        for a in range(degree):
            ranks = [plan.devices.index(d) for d in st[a::degree]]
            g = dist.new_group(ranks)
            if k == stage and rank in ranks:
                mine = g
    return mine


class GradBuckets:
    """All-reduce of replicas' gradients in buckets of about :data:`BUCKET_BYTES`, each started
    as soon as all its parameters' gradients are complete, as DDP does.

    ``params`` are the replicated parameters in the order their gradients are expected to be
    complete (the reverse of the forward's); without a ``group`` there is nothing to reduce.
    """

    def __init__(self, params: list[tuple[int, torch.Tensor]], group: Any) -> None:
        self.group = group
        self.tensor = dict(params)
        self.buckets: list[list[int]] = []
        if group is not None:
            cur: list[int] = []
            size = 0
            for i, p in params:
                cur.append(i)
                size += local(p).numel() * p.element_size()
                if size >= BUCKET_BYTES:
                    self.buckets.append(cur)
                    cur, size = [], 0
            if cur:
                self.buckets.append(cur)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.start_step()

    def start_step(self) -> None:
        self.left = [len(b) for b in self.buckets]
        self.started: list[tuple[Any, torch.Tensor, list[int]]] = []

    def ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is complete: reduce its bucket if that was the last."""
        b = self.bucket_of.get(i)
        if b is None:
            return
        self.left[b] -= 1
        if self.left[b] == 0:
            self._reduce(self.buckets[b])

    def _reduce(self, bucket: list[int]) -> None:
        grads = [local(self.tensor[i].grad) if self.tensor[i].grad is not None
                 else torch.zeros_like(local(self.tensor[i])) for i in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.started.append((work, flat, bucket))

    def wait_all(self, messenger: Messenger) -> Iterator[tuple[int, torch.Tensor]]:
        """Each parameter with its reduced gradient, once every bucket is reduced (buckets no
        op completed, of parameters no op used, are reduced too); waits count as
        ``messenger``'s."""
        done = {i for _, _, b in self.started for i in b}
        for bucket in self.buckets:
            if not done.intersection(bucket):
                self._reduce(bucket)
        for work, flat, bucket in self.started:
            t0 = time.perf_counter()
            with messenger.waiting():
                work.wait()
            messenger.waited += time.perf_counter() - t0
            pos = 0
            for i in bucket:
                held = local(self.tensor[i])  # (a DTensor's shard: what was reduced)
                n = held.numel()
                yield i, flat[pos: pos + n].view_as(held)
                pos += n
        self.started.clear()
