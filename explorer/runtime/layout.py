"""Where one rank stands in a plan: its stage, replica and shards, the graph's structure, and
which ranks it exchanges tensors with. Static for the whole run."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import treespec_loads

from explorer.core.errors import ExplorerError
from explorer.runtime.comm import message_tag
from explorer.runtime.jobfiles import Job, on_device, resolve_target


class RankLayout:
    """The facts every step of one rank needs, checked against the job once.

    Nodes are indices into the job's program. A stage with ``r`` replicas splits each
    micro-batch into ``shards`` (the largest replica count) shards, ``shards / r`` per replica:
    ``units`` are this rank's shards, ``rows`` the rows of one shard.
    """

    def __init__(self, job: Job, rank: int, world: int, local_rank: int) -> None:
        plan = job.plan
        self.plan = plan
        if world != len(plan.devices):
            raise ExplorerError(f"the plan uses {len(plan.devices)} devices but "
                                f"{world} processes were started: launch "
                                f"--nproc_per_node {len(plan.devices)}")
        self.rank = rank
        self.device_id = plan.devices[rank]
        tdev = job.device_map.get(self.device_id, "")
        if tdev.startswith("cuda"):
            tdev = f"cuda:{local_rank}" if tdev == "cuda" else tdev
            torch.cuda.set_device(tdev)
        self.tdev = torch.device(tdev or "cpu")
        # the graph
        calls = [dataclasses.replace(c, args=on_device(c.args, self.tdev),
                                     kwargs=on_device(c.kwargs, self.tdev)) for c in job.calls]
        self.calls = calls
        self.names = [c.name for c in calls]
        index = {n: i for i, n in enumerate(self.names)}
        self.targets = [resolve_target(c.target) if c.kind == "op" else None for c in calls]
        #: per node, whether it draws random numbers (dropout, ...): seeded before each call
        self.random = [isinstance(t, torch._ops.OpOverload)
                       and torch.Tag.nondeterministic_seeded in t.tags for t in self.targets]
        missing = [n for n in self.names if n not in plan.placement]
        if missing:
            raise ExplorerError(f"the plan does not place nodes {missing[:3]}: it was made for "
                                "another model")
        if len(job.requires_grad) != len(self.names):
            raise ExplorerError("the job's graph does not match the exported program")
        self.requires_grad = list(job.requires_grad)
        self.loss_name = job.loss
        self.kind = [c.kind for c in calls]
        self.stage = [plan.placement[n] for n in self.names]
        self.preds = [[index[p] for p in c.inputs] for c in calls]
        self.succs: list[list[int]] = [[] for _ in self.names]
        for i, ps in enumerate(self.preds):
            for p in ps:
                self.succs[p].append(i)
        self.spec = [treespec_loads(c.spec) if c.spec else None for c in calls]
        #: per node, the other stages with a consumer of it, and its consumers on this stage
        #: (asked for every value of every step: worked out once)
        self._remote: list[list[int]] = []
        self._local: list[int] = []
        self.nflat = [c.nflat for c in calls]
        # this rank's stage, replica and shards
        self.s = plan.stage_of_device(self.device_id)
        reps = [plan.replicas_of(k) for k in range(len(plan.stages))]
        self.shards = max(reps)
        #: this stage's tensor-parallel degree: its ranks split each layer that many ways
        self.tensor = plan.tensor_of(self.s)
        for k, r in enumerate(reps):
            if self.shards % r:
                raise ExplorerError(f"stage {k} has {r} replicas, which does not divide the "
                                    f"largest replica count {self.shards}; use replica counts "
                                    "that divide each other (1, 2, 4, 8)")
        # replica index in the stage (its devices are replicas x tensor, row-major)
        at = plan.stages[self.s].index(self.device_id)
        self.j = at // self.tensor
        #: this rank's place in its replica's tensor group
        self.tj = at % self.tensor
        per = self.shards // reps[self.s]
        self.units = list(range(self.j * per, (self.j + 1) * per))
        self.micro_batches = plan.micro_batches
        batch = int(job.inputs[0].shape[0])
        plan.check_batch(batch)
        if batch % (self.micro_batches * self.shards):
            raise ExplorerError(f"batch {batch} does not split into {self.micro_batches} "
                                f"micro-batches x {self.shards} shards; change the batch size "
                                "or the plan")
        self.rows = batch // (self.micro_batches * self.shards)
        #: per node, what its backward holds beyond its inputs' gradients on one shard of a
        #: micro-batch (a split op's share on a tensor-parallel rank): the op path counts it
        split = set(job.split_ops)
        self.backward_scratch = [
            b * self.rows // batch // (self.tensor if n in split else 1)
            for b, n in zip(job.backward_scratch or [0] * len(self.names), self.names,
                            strict=True)]
        self._remote = [sorted({self.stage[c] for c in cs} - {self.s}) for cs in self.succs]
        self._local = [sum(1 for c in cs if self.stage[c] == self.s) for cs in self.succs]

    def tag(self, kind: int, micro_batch: int, shard: int, node: int) -> int:
        """The tag of a message about ``node`` (see :func:`message_tag`)."""
        return message_tag(kind, micro_batch, shard, node, self.shards, len(self.names))

    def replica_ranks(self, stage: int, shard: int) -> list[int]:
        """The ranks of ``stage``'s replica that holds shard ``shard`` (its tensor group)."""
        st, k = self.plan.stages[stage], self.plan.tensor_of(stage)
        r = shard // (self.shards // (len(st) // k))
        return [self.plan.devices.index(d) for d in st[r * k:(r + 1) * k]]

    def peers_to(self, stage: int, shard: int) -> list[int]:
        """The ranks of ``stage`` this rank sends shard ``shard``'s tensors to: those of the
        holding replica whose place in its tensor group is this rank's, modulo this stage's
        degree (each rank of a tensor group holds the whole tensor it sends)."""
        return [r for b, r in enumerate(self.replica_ranks(stage, shard))
                if b % self.tensor == self.tj]

    def peer_from(self, stage: int, shard: int) -> int:
        """The rank of ``stage`` this rank receives shard ``shard``'s tensors from (the
        counterpart of :meth:`peers_to`)."""
        ranks = self.replica_ranks(stage, shard)
        return ranks[self.tj % len(ranks)]

    def local_consumers(self, i: int) -> int:
        """How many consumers of node ``i`` are on this rank's stage."""
        return self._local[i]

    def remote_stages(self, i: int) -> list[int]:
        """The other stages with a consumer of node ``i``, in order (a list not to change)."""
        return self._remote[i]

    def weight_home(self, i: int) -> int:
        """The rank that owns weight ``i`` (of another stage) for this replica."""
        st = self.plan.stages[self.stage[i]]
        return self.plan.devices.index(st[self.j % len(st)])

    def weight_users(self, i: int) -> list[tuple[int, int]]:
        """(replica index, rank) of every rank of another stage that uses this rank's copy of
        weight ``i``."""
        mine = len(self.plan.stages[self.s])
        return [(jt, self.plan.devices.index(dev)) for t in self.remote_stages(i)
                for jt, dev in enumerate(self.plan.stages[t]) if jt % mine == self.j]
