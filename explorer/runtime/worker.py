"""The rank side of real training steps: one process per device executing its part of a plan.

Every rank loads the captured program (the ops of ``torch.export``'s graph with their
arguments, and the weights), the plan and a per-stage task order taken from the simulated
schedule, and runs its tasks in that order: the forward and backward of each op placed on its
stage, for each micro-batch. Tensors crossing stages go through
``torch.distributed`` point-to-point (gloo on CPU, NCCL on GPU): non-blocking sends, blocking
receives. As every stage's order is a piece of one global topological order, this cannot
deadlock whatever the placement. Backward runs op by op: each op's inputs enter through a small
autograd function that hands their gradient to a slot (saving nothing), and each op's backward
starts from the gradient edge of its output, so outputs are freed as soon as the forward no
longer needs them and only what autograd saves stays alive. Replicas of a stage all-reduce their
gradients in 25 MB buckets as soon as a bucket is complete, as DDP does.

The same module is what an exported training script runs under ``torchrun``: launch it with
``python -m explorer.runtime.rank JOB_DIR`` and the usual RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT environment.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from explorer.core.errors import ExplorerError
from explorer.core.plan import Plan
from explorer.platforms.cpu import hold_freed_memory, pin_cpu_rank

BUCKET_BYTES = 25 * 1024 * 1024
_HEADER = 256  # int64 words of a message header
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def make_optimizer(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The optimizer behind each name a plan may carry."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ExplorerError(f"unknown optimizer {name!r}")


class _Entry(torch.autograd.Function):
    """Identity on a tensor entering an op; its gradient goes to ``slot`` (nothing is saved)."""

    @staticmethod
    def forward(ctx, anchor, x, slot):  # type: ignore[override]
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.slot.append(g)
        return None, None, None


class MemTracker:
    """Tensor accounting on CPU: bytes of the storages the rank holds or autograd saved.

    While :meth:`deferred` is active, frees wait until it ends: autograd computes a node's input
    gradients before it releases what the node saved, so an op's backward is accounted as all its
    allocations first, then its frees (the order the memory is really held in).
    """

    def __init__(self) -> None:
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0
        self._held: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Frees (``drop``) inside the block take effect when it ends."""
        outer, self._held = self._held, []
        try:
            yield
        finally:
            held, self._held = self._held, outer
            for t in held:
                self.drop(t)

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key == 0:
            return
        ref = self.refs.get(key)
        if ref is None:
            self.refs[key] = [1, st.nbytes()]
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1

    def drop(self, t: torch.Tensor) -> None:
        if self._held is not None:
            self._held.append(t)  # (keeps the storage, so its address is not reused meanwhile)
            return
        key = t.untyped_storage().data_ptr()
        ref = self.refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]

    def reset_peak(self) -> None:
        self.peak = self.live


class _Saved:
    """What autograd keeps for a saved tensor: the tensor, counted while it is held."""

    __slots__ = ("t", "tracker")

    def __init__(self, t: torch.Tensor, tracker: MemTracker) -> None:
        self.t, self.tracker = t, tracker
        tracker.add(t)

    def __del__(self) -> None:
        self.tracker.drop(self.t)


@dataclass(frozen=True)
class _Ref:
    """A reference to another node's value inside an op's arguments."""

    name: str


@dataclass
class OpCall:
    """One node of the program a rank runs: enough to call it, nothing of torch.fx."""

    name: str
    kind: str  # input, param, buffer, op
    target: str  # "aten.linear.default", "operator.getitem"; "" for placeholders
    args: Any
    kwargs: Any
    inputs: list[str]
    spec: str | None  # pytree spec of the output when it is not a single tensor
    nflat: int


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    mod = getattr(target, "__module__", "")
    if mod in ("_operator", "operator"):
        return f"operator.{target.__name__}"
    raise ExplorerError(f"cannot run op {target!r} across processes; please report it")


def _resolve(name: str) -> Any:
    if name.startswith("operator."):
        import operator

        return getattr(operator, name.split(".", 1)[1])
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def program_calls(program: Any, n_inputs: int, requires_grad: dict[str, bool]
                  ) -> tuple[list[OpCall], dict[str, torch.Tensor]]:
    """The exported program as a list of :class:`OpCall` plus its parameters and buffers."""
    from torch.utils._pytree import treespec_dumps

    from explorer.capture.tracing import program_state, program_structure

    fx_nodes, state_keys, trainable = program_structure(program, n_inputs)
    names = {fx: n for n, fx in fx_nodes.items()}
    calls = []
    for nm, fx in fx_nodes.items():
        ref = lambda a: _Ref(names[a])  # noqa: E731
        val = fx.meta.get("val")
        flat, spec = tree_flatten(val)
        if fx.op == "placeholder":
            kind = ("param" if nm in trainable else "buffer") if nm in state_keys else "input"
            calls.append(OpCall(nm, kind, "", (), {}, [], None, 1))
            continue
        calls.append(OpCall(
            nm, "op", _target_name(fx.target), _plain(torch.fx.node.map_arg(fx.args, ref)),
            _plain(torch.fx.node.map_arg(fx.kwargs, ref)),
            list(dict.fromkeys(names[a] for a in fx.all_input_nodes)),
            None if isinstance(val, torch.Tensor) else treespec_dumps(spec), len(flat)))
    return calls, program_state(program, state_keys)


@dataclass
class Job:
    """Everything a rank needs, as written to a job folder."""

    calls: list[OpCall]
    state: dict[str, torch.Tensor]
    plan: Plan
    order: list[list[tuple[str, int, int]]]
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    steps: int
    warmup: int
    lr: float
    record: bool
    timeout_s: float
    device_map: dict[str, str]
    requires_grad: list[bool]
    loss: str


def write_job(folder: Path, program: Any, plan: Plan, order, inputs, targets, steps: int,
              warmup: int, lr: float, record: bool, timeout_s: float,
              device_map: dict[str, str], requires_grad: list[bool], loss: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    calls, state = program_calls(program, len(inputs), {})
    torch.save({"calls": [c.__dict__ for c in calls], "state": state}, folder / "program.pt")
    plan.save(folder / "plan.json")
    torch.save({"inputs": list(inputs), "targets": list(targets)}, folder / "batch.pt")
    (folder / "job.json").write_text(json.dumps({
        "order": order, "steps": steps, "warmup": warmup, "lr": lr, "record": record,
        "timeout_s": timeout_s, "device_map": device_map, "requires_grad": requires_grad,
        "loss": loss}))


def read_job(folder: Path) -> Job:
    meta = json.loads((folder / "job.json").read_text())
    batch = torch.load(folder / "batch.pt", weights_only=False)
    prog = torch.load(folder / "program.pt", weights_only=False)  # our own file, written above
    return Job([OpCall(**c) for c in prog["calls"]], prog["state"],
               Plan.load(folder / "plan.json"),
               [[tuple(t) for t in st] for st in meta["order"]], batch["inputs"],
               batch["targets"], meta["steps"], meta["warmup"], meta["lr"], meta["record"],
               meta["timeout_s"], meta["device_map"], meta["requires_grad"], meta["loss"])


class Rank:
    """One device's share of the plan."""

    def __init__(self, job: Job, rank: int, world: int, local_rank: int) -> None:
        self.job, self.rank, self.world = job, rank, world
        plan = job.plan
        self.plan = plan
        if world != len(plan.devices):
            raise ExplorerError(f"the plan uses {len(plan.devices)} devices but "
                                f"{world} processes were started: launch "
                                f"--nproc_per_node {len(plan.devices)}")
        self.device_id = plan.devices[rank]
        tdev = job.device_map.get(self.device_id, "")
        if tdev.startswith("cuda"):
            tdev = f"cuda:{local_rank}" if tdev == "cuda" else tdev
            torch.cuda.set_device(tdev)
        self.tdev = torch.device(tdev or "cpu")
        calls = job.calls
        self.calls = calls
        self.names = [c.name for c in calls]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.targets = [_resolve(c.target) if c.kind == "op" else None for c in calls]
        missing = [n for n in self.names if n not in plan.placement]
        if missing:
            raise ExplorerError(f"the plan does not place nodes {missing[:3]}: it was made for "
                                "another model")
        self.stage = [plan.placement[n] for n in self.names]
        self.preds = [[self.index[p] for p in c.inputs] for c in calls]
        self.succs: list[list[int]] = [[] for _ in self.names]
        for i, ps in enumerate(self.preds):
            for p in ps:
                self.succs[p].append(i)
        self.kind = [c.kind for c in calls]
        self.s = plan.stage_of_device(self.device_id)
        reps = [len(st) for st in plan.stages]
        self.U = max(reps)
        for k, r in enumerate(reps):
            if self.U % r:
                raise ExplorerError(f"stage {k} has {r} replicas, which does not divide the "
                                    f"largest replica count {self.U}; use replica counts that "
                                    "divide each other (1, 2, 4, 8)")
        self.j = plan.stages[self.s].index(self.device_id)
        per = self.U // reps[self.s]
        self.units = list(range(self.j * per, (self.j + 1) * per))
        M = plan.micro_batches
        B = int(job.inputs[0].shape[0])
        plan.check_batch(B)
        if B % (M * self.U):
            raise ExplorerError(f"batch {B} does not split into {M} micro-batches x {self.U} "
                                "shards; change the batch size or the plan")
        self.rows = B // (M * self.U)
        self.M = M
        self.tracker = MemTracker()
        self.anchor = torch.zeros((), requires_grad=True, device=self.tdev)
        self.headers_sent: set[tuple[int, int]] = set()
        self.headers_seen: dict[tuple[int, int], list[int]] = {}
        self.devs = list(plan.devices)
        # state: params and buffers this stage owns or uses
        state = job.state
        self.owned = [i for i, n in enumerate(self.names)
                      if self.kind[i] in ("param", "buffer") and self.stage[i] == self.s]
        self.used_remote = [i for i, n in enumerate(self.names)
                            if self.kind[i] in ("param", "buffer") and self.stage[i] != self.s
                            and any(self.stage[c] == self.s for c in self.succs[i])]
        self.value: dict[int, torch.Tensor] = {}
        for i in self.owned + self.used_remote:
            t = state[self.names[i]].detach().to(self.tdev).clone()
            if self.kind[i] == "param" and t.is_floating_point():
                t.requires_grad_(True)
            self.value[i] = t
            self.tracker.add(t)
        params = [self.value[i] for i in self.owned if self.kind[i] == "param"]
        self.optimizer = make_optimizer(plan.optimizer, params, job.lr) if params else None
        # remaining local backward uses of each param per step (for DDP-style buckets)
        self.param_uses = {
            i: sum(1 for c in self.succs[i] if self.stage[c] == self.s) * self.M
            * len(self.units) + any(self.stage[c] != self.s for c in self.succs[i])
            for i in self.value if self.kind[i] == "param"}
        self._groups()
        self.buckets = self._buckets()

    # -- process groups and peers --------------------------------------------------------
    def _groups(self) -> None:
        self.stage_group = None
        for k, st in enumerate(self.plan.stages):
            ranks = [self.devs.index(d) for d in st]
            if len(ranks) > 1:
                g = dist.new_group(ranks)
                if k == self.s:
                    self.stage_group = g

    def peer(self, stage: int, unit: int) -> int:
        st = self.plan.stages[stage]
        return self.devs.index(st[unit // (self.U // len(st))])

    def _buckets(self) -> list[list[int]]:
        if self.stage_group is None:
            return []
        own = [i for i in reversed(self.owned) if self.kind[i] == "param"
               and self.value[i].requires_grad]
        out, cur, size = [], [], 0
        for i in own:
            cur.append(i)
            size += self.value[i].numel() * self.value[i].element_size()
            if size >= BUCKET_BYTES:
                out.append(cur)
                cur, size = [], 0
        if cur:
            out.append(cur)
        return out

    # -- communication -------------------------------------------------------------------
    def tag(self, kind: int, m: int, u: int, node: int) -> int:
        """A message's tag: what it carries (activation 0, gradient 1, weight 2, weight
        gradient 3) for which micro-batch, shard and node; receivers match on it."""
        return ((m * self.U + u) * len(self.names) + node) * 4 + kind

    def send(self, value: Any, dst: int, tag: int) -> None:
        """Send a tensor, a list of tensors or a Python number: a header, then each tensor."""
        flat, _ = tree_flatten(value)
        header = [len(flat)]
        tensors = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                header += [0, _DTYPES.index(x.dtype), x.dim(), *x.shape]
                tensors.append(x)
            elif isinstance(x, (bool, int)):
                header += [1, int(x)]
            else:
                raise ExplorerError(f"cannot send a {type(x).__name__} between ranks")
        if len(header) + 1 > _HEADER:
            raise ExplorerError("an op output has too many parts to send between ranks")
        if (dst, tag) not in self.headers_sent:  # shapes repeat every step: send them once
            self.headers_sent.add((dst, tag))
            pad = torch.zeros(_HEADER, dtype=torch.int64)
            pad[: len(header) + 1] = torch.tensor([len(header), *header], dtype=torch.int64)
            pad = pad.to(self.tdev)
            self.pending.append((dist.isend(pad, dst, tag=tag), pad))
            numbers = []
        else:  # Python numbers travelled in the header; now they follow the tensors
            numbers = [torch.tensor([int(x)], dtype=torch.int64, device=self.tdev)
                       for x in flat if not isinstance(x, torch.Tensor)]
        for t in [*(t.detach().to(self.tdev).contiguous() for t in tensors), *numbers]:
            self.pending.append((dist.isend(t, dst, tag=tag), t))

    def recv(self, src: int, tag: int) -> list[Any]:
        t0 = time.perf_counter()
        try:
            return self._recv(src, tag)
        finally:
            self.waited += time.perf_counter() - t0

    def _recv(self, src: int, tag: int) -> list[Any]:
        h = self.headers_seen.get((src, tag))
        first = h is None
        if first:
            pad = torch.zeros(_HEADER, dtype=torch.int64, device=self.tdev)
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
            dtype, nd = _DTYPES[h[pos + 1]], h[pos + 2]
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
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    # -- one step ------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.waited = 0.0
        self.task_times: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.env: dict[tuple[int, int], dict[int, Any]] = defaultdict(dict)
        self.fwd_left: dict[tuple[int, int, int], int] = {}
        self.grad: dict[tuple[int, int, int], list] = {}
        self.bwd_left: dict[tuple[int, int, int], int] = {}
        self.edges: dict[tuple[int, int, int], list] = {}
        self.received: dict[tuple[int, int, int], Any] = {}
        self.sent_grad: set = set()
        self.losses: list[float] = []
        self.uses_left = dict(self.param_uses)
        self.reduces: list[tuple[Any, torch.Tensor, list[int]]] = []
        self.bucket_left = [len(b) for b in self.buckets]
        self.grads_tracked: set[int] = getattr(self, "grads_tracked", set())
        busy = 0.0
        self.tracker.reset_peak()
        if self.tdev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.tdev)
        dist.barrier()
        t0 = time.perf_counter()
        self._exchange_params()
        times = self.task_times
        for kind, m, i in self.job.order[self.s]:
            for u in self.units:
                if kind == "fwd":
                    dt = self.forward(m, u, i)
                elif kind == "bwd":
                    dt = self.backward(m, u, i)
                else:
                    continue
                busy += dt
                times[kind, i].append(dt)
            if kind == "optimizer":
                dt = self.finish()
                busy += dt
                times["optimizer", -1].append(dt)
        if not any(k == "optimizer" for k, _, _ in self.job.order[self.s]):
            busy += self.finish()
        self.flush()
        self._sync()
        t1 = time.perf_counter()
        peak = (torch.cuda.max_memory_allocated(self.tdev) if self.tdev.type == "cuda"
                else self.tracker.peak)
        loss = sum(self.losses) / len(self.losses) if self.losses else None
        self.env.clear()
        return {"step_s": t1 - t0, "busy_s": busy, "peak_bytes": peak, "loss": loss}

    def _sync(self) -> None:
        if self.tdev.type == "cuda":
            torch.cuda.synchronize(self.tdev)

    def _exchange_params(self) -> None:
        for i in self.owned:
            for t in {self.stage[c] for c in self.succs[i]} - {self.s}:
                for jt, dev in enumerate(self.plan.stages[t]):
                    if jt % len(self.plan.stages[self.s]) == self.j:
                        self.send(self.value[i].detach(), self.devs.index(dev),
                                  self.tag(2, 0, 0, i))
        for i in self.used_remote:
            src_stage = self.stage[i]
            src = self.devs.index(self.plan.stages[src_stage][
                self.j % len(self.plan.stages[src_stage])])
            (t,) = self.recv(src, self.tag(2, 0, 0, i))
            with torch.no_grad():
                self.value[i].copy_(t)

    def _arg(self, m: int, u: int, p: int, slots: list) -> Any:
        kind = self.kind[p]
        if kind == "input":  # this stage's copy of its micro-batch's rows, until its last use
            env = self.env[(m, u)]
            if p not in env:
                env[p] = self._batch(m, u, p)
                self.tracker.add(env[p])
                self.fwd_left[(m, u, p)] = sum(1 for c in self.succs[p]
                                               if self.stage[c] == self.s)
            return env[p]
        if kind in ("param", "buffer"):
            return self.value[p]
        key = (m, u)
        if self.stage[p] == self.s:
            val = self.env[key][p]
        else:
            rk = (m, u, p)
            if rk not in self.received:
                flat = self.recv(self.peer(self.stage[p], u), self.tag(0, m, u, p))
                spec = self._spec[p]
                val = tree_unflatten(flat, spec) if spec is not None else flat[0]
                for t in flat:
                    if isinstance(t, torch.Tensor):
                        self.tracker.add(t)
                self.received[rk] = val
                self.fwd_left[(m, u, p)] = sum(1 for c in self.succs[p]
                                               if self.stage[c] == self.s)
            val = self.received[rk]
        flat, spec = tree_flatten(val)
        wrapped = []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and self.requires_grad[p]:
                slot: list = []
                slots.append((p, len(wrapped), slot))
                wrapped.append(_Entry.apply(self.anchor, t.detach(), slot))
            else:
                wrapped.append(t)
        return tree_unflatten(wrapped, spec)

    def feed(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Use this batch from the next step on (same shapes as the example batch)."""
        for new, old in zip([*inputs, *targets], [*self.job.inputs, *self.job.targets],
                            strict=True):
            if new.shape != old.shape:
                raise ExplorerError(f"batches() gave a tensor of shape {tuple(new.shape)} "
                                    f"where the plan expects {tuple(old.shape)}")
        self.job.inputs, self.job.targets = list(inputs), list(targets)

    def _batch(self, m: int, u: int, p: int) -> torch.Tensor:
        """The rows of input ``p`` for micro-batch ``m``, shard ``u``, as a tensor of their own
        on the device (a copy on CPU too, as on a GPU: the batch itself is host data)."""
        k = int(self.names[p].split("_")[1])
        src = self.job.inputs[k] if self.names[p].startswith("input_") else self.job.targets[k]
        start = (m * self.U + u) * self.rows
        return src[start: start + self.rows].to(self.tdev, copy=True)

    def forward(self, m: int, u: int, i: int) -> float:
        """Run op ``i`` forward on micro-batch ``m``, shard ``u``; seconds spent, waits excluded."""
        w0, t_start = self.waited, time.perf_counter()
        self._forward(m, u, i)
        self._sync()
        return time.perf_counter() - t_start - (self.waited - w0)

    def _forward(self, m: int, u: int, i: int) -> None:
        call = self.calls[i]
        slots: list = []
        lookup = {self.names[p]: self._arg(m, u, p, slots) for p in self.preds[i]}
        args = _fill(call.args, lookup)
        kwargs = _fill(call.kwargs, lookup)
        tracker = self.tracker
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, tracker),
                                                      lambda s: s.t):
            out = self.targets[i](*args, **kwargs)
        key = (m, u)
        flat, _ = tree_flatten(out)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        for t in tensors:
            tracker.add(t)
        self.env[key][i] = out
        self.edges[(m, u, i)] = [get_gradient_edge(t) if isinstance(t, torch.Tensor)
                                 and t.requires_grad else None for t in flat]
        self.slots[(m, u, i)] = slots
        self.fwd_left[(m, u, i)] = sum(1 for c in self.succs[i] if self.stage[c] == self.s)
        for t in sorted({self.stage[c] for c in self.succs[i]} - {self.s}):
            self.send(out, self.peer(t, u), self.tag(0, m, u, i))
        if self.names[i] == self.loss_name:
            self.losses.append(float(out.detach()))
        # inputs whose last local forward use this was can go
        for p in self.preds[i]:
            k = (m, u, p)
            if k in self.fwd_left:
                self.fwd_left[k] -= 1
                if self.fwd_left[k] == 0:
                    self._release_output(m, u, p)
        if self.fwd_left[(m, u, i)] == 0 and self.names[i] != self.loss_name:
            self._release_output(m, u, i)

    def _release_output(self, m: int, u: int, p: int) -> None:
        here = self.stage[p] == self.s or self.kind[p] == "input"  # (each stage has its rows)
        val = self.env[(m, u)].pop(p, None) if here else self.received.get((m, u, p))
        if val is None:
            return
        for t in tree_flatten(val)[0]:
            if isinstance(t, torch.Tensor):
                self.tracker.drop(t)
        if not here:
            self.received[(m, u, p)] = _Released

    def backward(self, m: int, u: int, i: int) -> float:
        """Run op ``i`` backward on micro-batch ``m``, shard ``u``; seconds, waits excluded."""
        w0, t_start = self.waited, time.perf_counter()
        self._backward(m, u, i)
        self._sync()
        return time.perf_counter() - t_start - (self.waited - w0)

    def _backward(self, m: int, u: int, i: int) -> None:
        key = (m, u, i)
        edges = self.edges.pop(key, None) or []
        slots = self.slots.pop(key, [])
        n = self._nflat[i]
        # gradients from consumers on other stages
        for t in sorted({self.stage[c] for c in self.succs[i] if self.requires_grad[c]}
                        - {self.s}):
            self._store_grad(key, self.recv(self.peer(t, u), self.tag(1, m, u, i)), n)
        grads = self.grad.pop(key, None)
        if self.names[i] == self.loss_name:
            grads = [torch.full_like(self.env[(m, u)][i], 1.0 / (self.M * self.U))]
            self._release_output(m, u, i)
        pairs = [(e, g) for e, g in zip(edges, grads or [], strict=False)
                 if e is not None and g is not None]
        # autograd frees what the op saved (and its output's gradient) only after computing
        # the gradients of its inputs: count those first (on CPU; a GPU's allocator measures
        # itself, and holding the freed tensors a little longer would only raise its peak)
        with (self.tracker.deferred() if self.tdev.type != "cuda" else contextlib.nullcontext()):
            if pairs:
                torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
            made = [g for _, _, slot in slots for g in slot]
            for g in made:
                self.tracker.add(g)
            for g in grads or []:
                if g is not None:
                    self.tracker.drop(g)
        # route the gradients of this op's inputs, even when none flowed
        per_pred: dict[int, list] = {}
        for p, pos, slot in slots:
            if slot:
                lst = per_pred.setdefault(p, [None] * self._nflat[p])
                lst[pos] = slot[0] if lst[pos] is None else lst[pos] + slot[0]
        for p in self.preds[i]:
            if self.kind[p] == "param":
                self._param_used(p)
                continue
            if self.kind[p] != "op" or not self.requires_grad[p]:
                continue
            gk = (m, u, p)
            if p in per_pred:
                self._store_grad(gk, per_pred[p], self._nflat[p])
            if self.stage[p] != self.s:
                left = self.bwd_left.get(gk)
                if left is None:
                    left = sum(1 for c in self.succs[p]
                               if self.stage[c] == self.s and self.requires_grad[c])
                self.bwd_left[gk] = left - 1
                if left - 1 == 0:
                    g = self.grad.pop(gk, None) or [None] * self._nflat[p]
                    self.send([x if x is not None else _EMPTY for x in g],
                              self.peer(self.stage[p], u), self.tag(1, m, u, p))
                    for x in g:
                        if x is not None:
                            self.tracker.drop(x)
        for g in made:
            self.tracker.drop(g)

    def _store_grad(self, key: tuple[int, int, int], new: list, n: int) -> None:
        """Add gradients to what is held for ``key``, keeping the memory accounting exact."""
        old = self.grad.get(key)
        total = _add(old, new, n)
        for x in old or []:
            if x is not None:
                self.tracker.drop(x)
        for x in total:
            if x is not None:
                self.tracker.add(x)
        self.grad[key] = total

    def _param_used(self, p: int) -> None:
        self.uses_left[p] -= 1
        if self.uses_left[p] or self.stage[p] != self.s:
            return
        for b, bucket in enumerate(self.buckets):
            if p in bucket:
                self.bucket_left[b] -= 1
                if self.bucket_left[b] == 0:
                    self._reduce(bucket)

    def _reduce(self, bucket: list[int]) -> None:
        grads = [self.value[i].grad if self.value[i].grad is not None
                 else torch.zeros_like(self.value[i]) for i in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.stage_group, async_op=True)
        self.reduces.append((work, flat, bucket))

    def finish(self) -> float:
        """Gradients home, all-reduce, optimizer step; seconds spent, waits excluded."""
        w0, t_start = self.waited, time.perf_counter()
        self._finish()
        self._sync()
        return time.perf_counter() - t_start - (self.waited - w0)

    def _finish(self) -> None:
        # remote param copies send their gradient to the owner; owners add what they receive
        for i in self.used_remote:
            if self.kind[i] != "param" or not self.value[i].requires_grad:
                continue
            g = self.value[i].grad
            dst = self.devs.index(self.plan.stages[self.stage[i]][
                self.j % len(self.plan.stages[self.stage[i]])])
            self.send(g if g is not None else torch.zeros_like(self.value[i]), dst,
                      self.tag(3, 0, self.j, i))
            self._drop_grad(self.value[i])
        for i in self.owned:
            if self.kind[i] != "param" or not self.value[i].requires_grad:
                continue
            remote = sorted({self.stage[c] for c in self.succs[i]} - {self.s})
            for t in remote:
                for jt, dev in enumerate(self.plan.stages[t]):
                    if jt % len(self.plan.stages[self.s]) == self.j:
                        (g,) = self.recv(self.devs.index(dev), self.tag(3, 0, jt, i))
                        p = self.value[i]
                        with torch.no_grad():
                            if p.grad is None:
                                p.grad = g
                                self._grad_born(p)
                            else:
                                p.grad += g
            if remote:
                self._param_used(i)
        done = {i for _, _, b in self.reduces for i in b}
        for bucket in self.buckets:  # params no op used: reduce their (zero) gradients too
            if not done.intersection(bucket):
                self._reduce(bucket)
        for work, flat, bucket in self.reduces:
            t0 = time.perf_counter()
            work.wait()
            self.waited += time.perf_counter() - t0
            pos = 0
            for i in bucket:
                p = self.value[i]
                n = p.numel()
                if p.grad is None:
                    p.grad = flat[pos: pos + n].view_as(p).clone()
                    self._grad_born(p)
                else:
                    p.grad.copy_(flat[pos: pos + n].view_as(p))
                pos += n
        self.reduces.clear()
        if self.job.record and self.record_grads is None:
            self.record_grads = {self.names[i]: self.value[i].grad.detach().cpu().clone()
                                 for i in self.owned if self.kind[i] == "param"
                                 and self.value[i].grad is not None}
        if self.optimizer is not None:
            self.optimizer.step()
            for st in self.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and \
                            id(v) not in self.state_tracked:
                        self.state_tracked.add(id(v))
                        self.tracker.add(v)
        for t in self.value.values():
            self._drop_grad(t)

    def _drop_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            if id(p) in self.grads_tracked:
                self.grads_tracked.discard(id(p))
                self.tracker.drop(p.grad)
            p.grad = None

    # -- setup helpers filled in by prepare() --------------------------------------------
    def prepare(self) -> None:
        """Static facts every step needs: output structure, grad flags, the loss node."""
        if len(self.job.requires_grad) != len(self.names):
            raise ExplorerError("the job's graph does not match the exported program")
        self.requires_grad = list(self.job.requires_grad)
        self.loss_name = self.job.loss
        from torch.utils._pytree import treespec_loads

        self._spec = {i: treespec_loads(c.spec) if c.spec else None
                      for i, c in enumerate(self.calls)}
        self._nflat = {i: c.nflat for i, c in enumerate(self.calls)}
        self.slots: dict[tuple[int, int, int], list] = {}
        self.record_grads: dict[str, torch.Tensor] | None = None
        self.state_tracked: set[int] = set()
        for i, t in self.value.items():
            if self.kind[i] == "param" and t.requires_grad:
                t.register_post_accumulate_grad_hook(self._grad_born)

    def _grad_born(self, p: torch.Tensor) -> None:
        if p.grad is None:  # autograd may call the hook for an undefined gradient
            return
        if id(p) not in self.grads_tracked:
            self.grads_tracked.add(id(p))
            self.tracker.add(p.grad)

class _ReleasedType:
    """Marks a received tensor whose last local use is done."""


_Released = _ReleasedType()
_EMPTY = torch.zeros(0)  # stands for "no gradient" in a message


def _fill(x: Any, lookup: dict[str, Any]) -> Any:
    """Arguments with every node reference replaced by its value."""
    if isinstance(x, _Ref):
        return lookup[x.name]
    if isinstance(x, list):
        return [_fill(v, lookup) for v in x]
    if isinstance(x, tuple):
        return tuple(_fill(v, lookup) for v in x)
    if isinstance(x, dict):
        return {k: _fill(v, lookup) for k, v in x.items()}
    return x


def _plain(x: Any) -> Any:
    """fx's immutable containers as plain lists and dicts (some ATen schemas insist)."""
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _add(acc: list | None, new: list, n: int) -> list:
    """Element-wise sum of two gradient lists; None (or an empty tensor) is no gradient."""
    new = [None if x is None or (x.dim() == 1 and x.numel() == 0) else x for x in new]
    new = new + [None] * (n - len(new))
    if acc is None:
        return new
    return [a if b is None else (b if a is None else a + b) for a, b in zip(acc, new,
                                                                         strict=True)]


def _watch_parent() -> None:
    """Exit when the launching process dies, so no rank outlives it."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=loop, daemon=True).start()


def main(argv: list[str] | None = None, batches: Any = None, verbose: bool = False) -> int:
    """Rank entry point: ``JOB_DIR [--steps N] [--warmup N] [--lr X]``.

    ``batches(step)`` (optional) returns (inputs, targets) for each step, or None to reuse the
    job's example batch. With ``verbose``, the rank holding the loss prints each step.
    """
    import argparse

    ap = argparse.ArgumentParser(prog="explorer.runtime.worker")
    ap.add_argument("job")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--lr", type=float)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    folder = Path(args.job)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    out = Path(os.environ.get("EXPLORER_OUT", folder))
    _watch_parent()
    try:
        threads = int(os.environ.get("EXPLORER_THREADS", "1"))
        torch.set_num_threads(threads)
        job = read_job(folder)
        for k in ("steps", "warmup", "lr"):
            if getattr(args, k) is not None:
                setattr(job, k, getattr(args, k))
        cuda = any(v.startswith("cuda") for v in job.device_map.values())
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(local_rank)
        # a CPU rank gets a core of its own per compute thread, before gloo starts its
        # threads (they inherit them)
        cores = pin_cpu_rank(local_rank, threads) if not cuda else None
        # freed memory kept for the next step rather than faulted in again (any rank: host
        # tensors of GPU ranks too)
        held = hold_freed_memory()
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=job.timeout_s))
        r = Rank(job, rank, world, local_rank)
        r.prepare()
        r.all_times = defaultdict(list)
        energy = _Energy(r.tdev)
        results = []
        fault = _fault(rank)
        for k in range(job.warmup + job.steps):
            if fault and k == fault[1]:
                _inject(fault[0])
            fed = batches(k) if batches is not None else None
            if fed is not None:
                r.feed(*fed)
            e0 = energy.read()
            res = r.step()
            e1 = energy.read()
            for key, v in r.task_times.items():
                r.all_times[key].extend(v)
            res["energy_j"] = (e1 - e0) if e0 is not None and e1 is not None else None
            res["measured"] = k >= job.warmup
            results.append(res)
            if verbose and res["loss"] is not None and r.j == 0:
                print(f"step {k + 1}/{job.warmup + job.steps}: loss {res['loss']:.6f}, "
                      f"{res['step_s'] * 1e3:.1f} ms", flush=True)
            if rank == 0:
                (out / "progress").write_text(str(k + 1))
        record = {"rank": rank, "device": r.device_id, "cores": cores, "held": held,
                  "steps": results,
                  "task_s": {f"{k}:{i}": statistics.median(v[job.warmup * len(v)
                                                              // (job.warmup + job.steps):])
                             for (k, i), v in r.all_times.items()},
                  "memory_source": "cuda allocator (max_memory_allocated)"
                  if r.tdev.type == "cuda" else "tensor accounting"}
        if job.record and r.record_grads is not None:
            torch.save(r.record_grads, out / f"grads-{rank}.pt")
        (out / f"result-{rank}.json").write_text(json.dumps(record))
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # results are on disk: skip the interpreter's slow teardown
    except BaseException as exc:
        kind = "out of memory" if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) \
            else type(exc).__name__
        (out / f"error-{rank}.txt").write_text(
            f"{kind}: {exc}\n\n{''.join(traceback.format_exception(exc)[-6:])}")
        os._exit(1)


def _fault(rank: int) -> tuple[str, int] | None:
    """Test hook: EXPLORER_FAULT="RANK:KIND[:STEP]" makes that rank fail (raise, oom, hang,
    kill) at that step, so the launcher's clean-up can be tested for real."""
    spec = os.environ.get("EXPLORER_FAULT", "")
    if not spec:
        return None
    parts = spec.split(":")
    if int(parts[0]) != rank:
        return None
    return parts[1], int(parts[2]) if len(parts) > 2 else 0


def _inject(kind: str) -> None:
    if kind == "raise":
        raise RuntimeError("injected failure (EXPLORER_FAULT)")
    if kind == "oom":
        raise MemoryError("injected out-of-memory (EXPLORER_FAULT)")
    if kind == "hang":
        time.sleep(3600)
    if kind == "kill":
        os.kill(os.getpid(), 9)


class _Energy:
    """NVML energy counter of a CUDA device, in joules (None where unsupported)."""

    def __init__(self, dev: torch.device) -> None:
        self.handle = None
        if dev.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:
            self.handle = None

    def read(self) -> float | None:
        if self.handle is None:
            return None
        torch.cuda.synchronize()
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0


if __name__ == "__main__":
    sys.exit(main())
