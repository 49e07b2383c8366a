"""The cost model: seconds per node on each device, transfer seconds, optimizer time, memory sizes.

Numbers come from the profiler (``"measured"``) or from a roofline estimate (``"roofline"``)
when a device is not present; every entry says which. A node's time at a fraction ``f`` of the
batch (micro-batches, data-parallel shards) is ``overhead + (t - overhead) * f``: the fixed
per-op cost (dispatch, kernel launch) does not shrink with the batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE
from explorer.costs.kernels import (
    Kernels,
    compiled_graph,
    fused_kernels,
    launches_no_kernel,
    op_kind,
)
from explorer.costs.strategies import HALF_DTYPES, precision_time_factors
from explorer.devices.cluster import Cluster, Device
from explorer.devices.presets import KindFit, RooflineFit, roofline_fit
from explorer.platforms import Platform, platform_of
from explorer.platforms.cpu import ReplicaEffects

#: fraction of a device's peak reached by real kernels in the roofline estimate
ROOFLINE_EFFICIENCY = 0.6
#: the batch fraction a compiled roofline tabulates its times at (``DeviceCosts.fractions``):
#: its times are linear in the batch down to there, each op's fixed part the launches it
#: stands for (a share of its fused run's)
COMPILED_FRACTION = 2.0**-20
#: fixed cost per op when nothing was measured: eager PyTorch dispatch + kernel launch
NOMINAL_OVERHEAD_S = {"cuda": 8e-6, "cpu": 4e-6}
#: the runtimes a profile's times can be of (``DeviceCosts.runtime``): the names of
#: ``explorer.runtime.jobfiles.RUNTIMES``, which this layer cannot import
ProfiledRuntime = Literal["ops", "segments"]
PROFILED_RUNTIMES: tuple[ProfiledRuntime, ...] = ("ops", "segments")
#: what running a tensor-parallel stage adds to the plain ops the profile times
#: (``DeviceCosts.dtensor``, seconds): per split op that reads a split weight (a DTensor), in
#: its forward and backward, per collective a split op waits for (beyond the link's time),
#: per split weight an unsplit op reads in its forward and backward, per parameter tensor the
#: optimizer steps, and per step of a tensor-parallel stage
DTENSOR_KEYS = ("op_fwd_s", "op_bwd_s", "collective_s", "read_fwd_s", "read_bwd_s",
                "optimizer_tensor_s", "step_s")
#: what ``torch.utils.checkpoint`` adds to a recomputing stage beyond the ops it runs again
#: (``DeviceCosts.checkpoint``, seconds): per checkpointed span of ops and micro-batch, in its
#: forward and in its backward (the call, the recomputation's set-up), per tensor its ops
#: save (its saved-tensor hooks: packed in the forward, packed again in the recomputation and
#: unpacked), and per op of a span under a policy (torch's selective checkpointing), in the
#: forward and in the recomputation
CHECKPOINT_KEYS = ("span_fwd_s", "span_bwd_s", "saved_fwd_s", "saved_bwd_s", "policy_op_fwd_s",
                   "policy_op_bwd_s")


@dataclass
class DeviceCosts:
    """Costs of every node on one type of device (all devices with the same ``type_key``)."""

    type_key: str
    fwd_s: list[float]
    bwd_s: list[float]
    source: list[str]  # per node: "measured" | "roofline" | "free" (placeholders)
    #: the fixed cost of an op, which does not shrink with the batch (dispatch, kernel launch;
    #: measured: the least an op took, at least a tiny op's time)
    overhead_s: float
    optimizer_s_per_byte: dict[str, float] = field(default_factory=dict)
    optimizer_s_per_tensor: dict[str, float] = field(default_factory=dict)
    #: fractions of the batch also measured (e.g. [0.5, 0.25]) and the times there, per node
    fractions: list[float] = field(default_factory=list)
    fwd_at: list[list[float]] = field(default_factory=list)
    bwd_at: list[list[float]] = field(default_factory=list)
    #: per node, how much slower (forward + backward) it ran while another rank of the same
    #: host ran the same work at the same time, e.g. 1.3; empty where not measured (GPUs,
    #: one rank). The device's platform says how it slows a replicated stage's ops
    #: (:meth:`explorer.platforms.Platform.op_slowdown`).
    contention: list[float] = field(default_factory=list)
    #: measured with the contention (two ranks data-parallel): per step, how far the slower
    #: replica's busy time ran past the two replicas' mean, as a fraction of that mean (their
    #: compute wanders apart, and the gradient all-reduce waits for the slower one); 0 where
    #: not measured
    replica_spread: float = 0.0
    #: measured with the contention: how much slower the optimizer step ran while another
    #: rank of the host stepped the same parameters at the same time (two replicas), e.g.
    #: 1.3; 1.0 where not measured. The device's platform says how it slows a replicated
    #: stage's step (:meth:`explorer.platforms.Platform.optimizer_slowdown`).
    optimizer_contention: float = 1.0
    #: memory the device's math libraries hold for the whole run (cuBLAS workspaces on a GPU),
    #: measured at profile time; 0 on CPU ranks and where not measured
    workspace_bytes: int = 0
    #: what DTensor adds to a tensor-parallel stage's ops (:data:`DTENSOR_KEYS`), measured by
    #: a host probe; empty where not measured (then nothing is added)
    dtensor: dict[str, float] = field(default_factory=dict)
    #: per precision other than fp32 ("bf16", "fp16") the device was also timed at (the same
    #: steps under ``torch.autocast``, casts included): ``[fwd_s, bwd_s]``, per node; empty
    #: where not measured (then :func:`~explorer.costs.strategies.precision_time_factors`'
    #: rule prices that precision)
    precision_s: dict[str, list[list[float]]] = field(default_factory=dict)
    #: what checkpointing adds to a recomputing stage (:data:`CHECKPOINT_KEYS`), measured by
    #: a host probe on CPU ranks; empty where not measured (then nothing is added)
    checkpoint: dict[str, float] = field(default_factory=dict)
    #: processor seconds each of ZeRO's collectives costs a rank of this type beyond the
    #: link's time (issuing it, a communication thread taking the rank's core, waking the
    #: rank that waits for it), measured by a host probe on CPU ranks; 0 where not measured
    collective_s: float = 0.0
    #: the runtime whose steps these times are of (:data:`PROFILED_RUNTIMES`): "ops", one op
    #: at a time, each with a backward of its own, or "segments", a rank's consecutive ops
    #: as one piece of generated code with one backward (``explorer.runtime.segments``)
    runtime: ProfiledRuntime = "ops"
    #: a profile of the segment runtime: what the op path added to each op beyond its cost in
    #: a segment, fitted on segment runs per direction (forward, backward) at the whole batch
    #: and at each of ``fractions``: ``[[fwd at 1, at fractions...], [bwd ...]]``; empty
    #: where the times are the op path's own. An op's cost in a segment is its op-path time
    #: less this, never under the per-op dispatch cost ``overhead_s``
    op_path_extra_s: list[list[float]] = field(default_factory=list)
    #: a device whose kernels run apart from the host that issues them (a GPU: the host's
    #: thread dispatches each op and launches its kernels, the device's stream runs them in
    #: that order): per node, the host's seconds to issue its forward and its backward,
    #: ``[fwd, bwd]``, while ``fwd_s``/``bwd_s`` are its kernels' time on the device. The
    #: host's seconds do not shrink with the batch. Empty where the device has one timeline
    #: (CPU ranks: an op's time holds both)
    host_s: list[list[float]] = field(default_factory=list)
    #: how the ops are priced to run (:data:`explorer.costs.kernels.Kernels`): "eager", one
    #: kernel per op (measured devices always: they time what the runtime runs), or
    #: "compiled", fused as ``torch.compile`` runs them (roofline estimates only)
    kernels: Kernels = "eager"

    @property
    def two_timelines(self) -> bool:
        """Whether the host's issuing and the device's kernels are timed apart (``host_s``)."""
        return bool(self.host_s)

    def host_times(self, backward: bool) -> np.ndarray:
        """``host_s``' forward or backward seconds per node as a float array."""
        return self._as_array(("_host", backward), self.host_s[1 if backward else 0])

    @property
    def replica_effects(self) -> ReplicaEffects:
        """The three measurements of replicas sharing a host, as one record."""
        return ReplicaEffects(self.contention, self.replica_spread, self.optimizer_contention)

    def at(self, times: list[float], table: list[list[float]], i: int, fraction: float,
           ) -> float:
        """Seconds of node ``i`` at ``fraction`` of the batch, before calibration factors.

        Between measured fractions, linear interpolation; below the smallest, the last
        segment's slope, never under the fixed per-op cost; without measured fractions,
        ``overhead + (t - overhead) * fraction``.
        """
        t = times[i]
        if t <= 0.0 or fraction >= 1.0:
            return max(t, 0.0)
        if not self.fractions:
            ovh = min(self.overhead_s, t)
            return ovh + (t - ovh) * fraction
        xs = [1.0, *self.fractions]
        ys = [t, *(row[i] for row in table)]
        for k in range(1, len(xs)):
            if fraction >= xs[k]:
                w = (fraction - xs[k]) / (xs[k - 1] - xs[k])
                return ys[k] + w * (ys[k - 1] - ys[k])
        slope = (ys[-2] - ys[-1]) / (xs[-2] - xs[-1])
        return max(ys[-1] - slope * (xs[-1] - fraction), min(self.overhead_s, ys[-1]))

    def at_many(self, which: str, idx: np.ndarray, fraction: float) -> np.ndarray:
        """:meth:`at` for the nodes ``idx`` at once (``which`` is "fwd_s" or "bwd_s")."""
        times = self.array(which)[idx]
        if fraction >= 1.0:
            return np.maximum(times, 0.0)
        if not self.fractions:
            ovh = np.minimum(self.overhead_s, times)
            out = ovh + (times - ovh) * fraction
        else:
            xs = [1.0, *self.fractions]
            ys = [times, *(row[idx] for row in self._rows(which))]
            for k in range(1, len(xs)):
                if fraction >= xs[k]:
                    w = (fraction - xs[k]) / (xs[k - 1] - xs[k])
                    out = ys[k] + w * (ys[k - 1] - ys[k])
                    break
            else:
                slope = (ys[-2] - ys[-1]) / (xs[-2] - xs[-1])
                out = np.maximum(ys[-1] - slope * (xs[-1] - fraction),
                                 np.minimum(self.overhead_s, ys[-1]))
        return np.where(times <= 0.0, 0.0, out)

    def array(self, which: str) -> np.ndarray:
        """The list field ``which`` ("fwd_s", "bwd_s", "contention") as a float array."""
        return self._as_array(("_arr", which), getattr(self, which))

    def _as_array(self, name: tuple, src: list[float]) -> np.ndarray:
        """``src`` as a float array, kept per list object: replace the lists rather than
        editing them in place."""
        key = (*name, id(src), len(src))
        cache = self.__dict__.setdefault("_np_cache", {})
        a = cache.get(key)
        if a is None:
            a = cache[key] = np.asarray(src, dtype=np.float64)
        return a

    def _rows(self, which: str) -> list[np.ndarray]:
        table = self.fwd_at if which == "fwd_s" else self.bwd_at
        key = ("_rows", which, id(table), len(table))
        cache = self.__dict__.setdefault("_np_cache", {})
        r = cache.get(key)
        if r is None:
            r = cache[key] = [np.asarray(row, dtype=np.float64) for row in table]
        return r


@dataclass
class CostModel:
    """Per-node, per-device costs for one graph on one cluster.

    The ``*_scale`` factors are what calibration fits from measured runs; 1.0 means "as
    profiled". ``extra_op_s`` is a per-op cost added by calibration for effects the isolated
    profile misses (the runtime's own bookkeeping per op). ``message_s`` is the processor time
    a device spends on each tensor it sends or receives between devices (posting the
    transfer, allocating and matching the receive), on its compute lane, on top of the link's
    latency and bandwidth; calibration fits it.
    """

    graph_fingerprint: str
    cluster: Cluster
    per_type: dict[str, DeviceCosts]
    compute_scale: float = 1.0
    link_scale: float = 1.0
    extra_op_s: float = 0.0
    message_s: float = 0.0

    def _dc(self, device_id: str) -> DeviceCosts:
        return self.per_type[self.cluster.device(device_id).type_key]

    def device_costs(self, device_id: str) -> DeviceCosts:
        """The costs of ``device_id``'s type."""
        return self._dc(device_id)

    def platform(self, device_id: str) -> Platform:
        """What ``device_id``'s kind of host adds to these costs (:mod:`explorer.platforms`)."""
        return platform_of(self.cluster.device(device_id).kind)

    def fwd_s(self, i: int, device_id: str, fraction: float = 1.0) -> float:
        dc = self._dc(device_id)
        return self._scaled(dc.at(dc.fwd_s, dc.fwd_at, i, fraction))

    def bwd_s(self, i: int, device_id: str, fraction: float = 1.0) -> float:
        dc = self._dc(device_id)
        return self._scaled(dc.at(dc.bwd_s, dc.bwd_at, i, fraction))

    def precision_factors(self, graph: OpGraph, device_id: str, precision: str
                          ) -> tuple[np.ndarray, np.ndarray]:
        """[node] factors on each op's forward and backward seconds when its stage computes in
        ``precision`` on ``device_id``: the ratio of the times measured at that precision to the
        fp32 ones where the device was timed at it (``DeviceCosts.precision_s``), else
        :func:`~explorer.costs.strategies.precision_time_factors`' rule for both."""
        dc = self._dc(device_id)
        timed = dc.precision_s.get(precision) if precision != "fp32" else None
        if not timed:
            dev = self.cluster.device(device_id)
            f = precision_time_factors(graph, precision, dev.kind, dev.flops_per_s,
                                       dev.half_flops_per_s)
            return f, f

        def ratio(half: list[float], full: np.ndarray) -> np.ndarray:
            h = np.asarray(half, dtype=np.float64)
            return np.divide(h, full, out=np.ones(len(full)), where=full > 0.0)

        return ratio(timed[0], dc.array("fwd_s")), ratio(timed[1], dc.array("bwd_s"))

    def _scaled(self, t: float) -> float:
        """Apply the calibration factors to a profiled time."""
        if t <= 0.0:
            return 0.0
        return t * self.compute_scale + self.extra_op_s

    def without_contention(self) -> CostModel:
        """These costs as if ranks sharing a host did not slow each other nor wander apart
        (one rank's op times for ranks elsewhere, or to see what contention adds to a
        prediction)."""
        return replace(self, per_type={k: replace(v, contention=[], replica_spread=0.0,
                                                  optimizer_contention=1.0)
                                       for k, v in self.per_type.items()})

    def source(self, i: int, device_id: str) -> str:
        return self._dc(device_id).source[i]

    def transfer_s(self, src: str, dst: str, nbytes: int) -> float:
        if src == dst or nbytes <= 0:
            return 0.0
        link = self.cluster.link(src, dst)
        return link.latency_s + nbytes / link.bandwidth_bytes_per_s * self.link_scale

    def allreduce_s(self, device_ids: list[str] | tuple[str, ...], nbytes: int) -> float:
        """Ring all-reduce: 2(k-1)/k of the bytes over the slowest link, 2(k-1) latencies.

        Where the links carry a measured two-rank all-reduce (``Link.allreduce_*``), that
        measurement is the k = 2 case and the ring's terms scale it: (k-1) x its latency plus
        2(k-1)/k x bytes / its bandwidth.
        """
        return self._ring_s(device_ids, nbytes, 2)

    def reduce_scatter_s(self, device_ids: list[str] | tuple[str, ...], nbytes: int) -> float:
        """Ring reduce-scatter of ``nbytes`` (each rank keeps 1/k): half a ring all-reduce,
        (k-1)/k of the bytes over the slowest link and k-1 latencies; where the links carry a
        measured two-rank reduce-scatter (``Link.reduce_scatter_*``), that scaled as a ring."""
        return self._ring_s(device_ids, nbytes, 1, "reduce_scatter")

    def allgather_s(self, device_ids: list[str] | tuple[str, ...], nbytes: int) -> float:
        """Ring all-gather of a tensor of ``nbytes`` from 1/k shards: the other half of a ring
        all-reduce, priced as :meth:`reduce_scatter_s` (from ``Link.allgather_*`` where
        measured)."""
        return self._ring_s(device_ids, nbytes, 1, "allgather")

    def _ring_s(self, device_ids: list[str] | tuple[str, ...], nbytes: int,
                passes: int, kind: str = "allreduce") -> float:
        """``passes`` ring passes (2: all-reduce, 1: reduce-scatter or all-gather); ``kind``
        names the links' measured two-rank collective that is the k = 2 case, where they all
        have it (else the all-reduce's, for half its time per pass, else the ring's terms)."""
        k = len(device_ids)
        if k <= 1 or nbytes <= 0:
            return 0.0
        links = [self.cluster.link(a, b) for a, b in
                 zip(device_ids, [*list(device_ids[1:]), device_ids[0]], strict=True)]
        for name, share in ((kind, 1.0), ("allreduce", passes / 2)):
            lat = [getattr(lk, f"{name}_latency_s") for lk in links]
            bw = [getattr(lk, f"{name}_bandwidth_bytes_per_s") for lk in links]
            if all(x > 0 for x in lat + bw):
                # the measured k = 2 case (latency + bytes / bandwidth), scaled as a ring
                return share * ((k - 1) * max(lat) + 2 * (k - 1) / k * nbytes / min(bw)
                                * self.link_scale)
        ring = self.cluster.ring_link(device_ids)  # (across nodes: a ring per NIC)
        return passes * (k - 1) * ring.latency_s + passes * (k - 1) / k * nbytes \
            / ring.bandwidth_bytes_per_s * self.link_scale

    def optimizer_s(self, device_id: str, optimizer: str, param_bytes: int,
                    n_tensors: int) -> float:
        dc = self._dc(device_id)
        per_byte = dc.optimizer_s_per_byte.get(optimizer, dc.optimizer_s_per_byte.get("sgd", 0))
        per_t = dc.optimizer_s_per_tensor.get(optimizer, dc.optimizer_s_per_tensor.get("sgd", 0))
        return (param_bytes * per_byte + n_tensors * per_t) * self.compute_scale

    @property
    def kernels(self) -> Kernels:
        """How the devices run the ops: "compiled" where every device type is priced so
        (:func:`roofline`'s ``kernels``), else "eager"."""
        compiled = all(dc.kernels == "compiled" for dc in self.per_type.values())
        return "compiled" if compiled and self.per_type else "eager"

    def as_run(self, graph: OpGraph, stage_of: Mapping[str, int] | None = None,
               half: bool = False) -> OpGraph:
        """``graph`` as these costs run it: with what a compiled backward keeps
        (:func:`explorer.costs.kernels.compiled_graph`, on the stages ``stage_of`` gives
        where known, its values sized in bf16/fp16 where ``half``) where the ops are priced
        compiled, else ``graph`` itself."""
        return (compiled_graph(graph, stage_of, half) if self.kernels == "compiled"
                else graph)

    def check(self, graph: OpGraph) -> None:
        if graph.fingerprint != self.graph_fingerprint:
            raise PlanError(f"these costs were profiled for graph {self.graph_fingerprint}, not "
                            f"for {graph.name} ({graph.fingerprint}): run ex.profile(graph, "
                            "cluster) again")

    def node_s(self, i: int, device_id: str) -> float:
        return self.fwd_s(i, device_id) + self.bwd_s(i, device_id)

    def to_dict(self) -> dict[str, Any]:
        return {"graph_fingerprint": self.graph_fingerprint, "cluster": self.cluster.to_dict(),
                "per_type": {k: asdict(v) for k, v in self.per_type.items()},
                "compute_scale": self.compute_scale, "link_scale": self.link_scale,
                "extra_op_s": self.extra_op_s, "message_s": self.message_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(d["graph_fingerprint"], Cluster.from_dict(d["cluster"]),
                   {k: DeviceCosts(**v) for k, v in d["per_type"].items()},
                   d.get("compute_scale", 1.0), d.get("link_scale", 1.0),
                   d.get("extra_op_s", 0.0), d.get("message_s", 0.0))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)


def _io_bytes(graph: OpGraph, i: int) -> int:
    n = graph.nodes[i]
    return n.out_bytes + sum(graph.nodes[p].out_bytes for p in graph.preds[i])


def precision_of(kind: str, dtype: str) -> str:
    """The precision an op of ``kind`` computes in, with PyTorch's default settings: bf16 for
    half dtypes; fp32 tensors run convolutions in tf32 (``torch.backends.cudnn.allow_tf32`` is
    on by default) and matmuls in fp32 (``torch.backends.cuda.matmul.allow_tf32`` is off)."""
    if dtype in ("float16", "bfloat16"):
        return "bf16"
    return "tf32" if kind == "conv2d" else "fp32"


def _fitted(fit: KindFit | None, efficiency: float,
            overhead_s: float) -> tuple[float, float, float]:
    """(overhead, fraction of peak FLOP/s, fraction of bandwidth): the fitted ones where the
    fit has them, else the single efficiency and nominal overhead."""
    if fit is None:
        return overhead_s, efficiency, efficiency
    return (fit.overhead_s, fit.flops_fraction or efficiency,
            fit.bandwidth_fraction or efficiency)


def roofline(graph: OpGraph, device: Device, overhead_s: float | None = None,
             efficiency: float = ROOFLINE_EFFICIENCY, measured_fit: bool = True,
             kernels: Kernels = "eager") -> DeviceCosts:
    """Estimate every node's time on ``device`` from its FLOPs and bytes (a roofline).

    time = overhead + max(FLOPs / (peak x efficiency), bytes moved / (bandwidth x efficiency));
    backward reads and writes about twice the bytes of the forward. Views cost nothing.
    Reference: Williams, Waterman, Patterson, "Roofline", CACM 2009.

    A preset with a measured roofline fit (``Cluster.preset("H100-measured")``; see
    :func:`explorer.devices.presets.roofline_fit`) uses, per op, the fitted fractions and
    overhead of its kind (:func:`op_kind`) and precision (:func:`precision_of`) instead of
    ``efficiency`` and the nominal overhead, unless ``measured_fit`` is False or
    ``overhead_s`` is given.

    ``kernels="compiled"`` prices the ops as ``torch.compile`` or a framework's fused kernels
    run them (:func:`explorer.costs.kernels.fused_kernels`): each connected run of pointwise,
    normalisation and reduction ops one kernel per tensor it writes, moving only the bytes
    that enter and leave the run; views cost nothing.
    """
    ovh = NOMINAL_OVERHEAD_S.get(device.kind, 5e-6) if overhead_s is None else overhead_s
    fit = roofline_fit(device.name) if measured_fit and overhead_s is None else None
    fwd, bwd, src = [], [], []
    for i, n in enumerate(graph.nodes):
        if n.kind != "op":
            fwd.append(0.0)
            bwd.append(0.0)
            src.append("free")
            continue
        half = n.dtype in ("float16", "bfloat16")
        kind = op_kind(n.op)
        o, f_flops, f_bw = _fitted(
            fit.kinds.get(f"{kind}/{precision_of(kind, n.dtype)}") if fit else None,
            efficiency, ovh)
        peak = (device.half_flops_per_s if half else device.flops_per_s) * f_flops
        bw = device.mem_bandwidth_bytes_per_s * f_bw
        moved = 0 if n.is_view else _io_bytes(graph, i)
        work = n.computed_fraction / peak  # (seconds per counted FLOP)
        fwd.append(o + max(n.fwd_flops * work, moved / bw))
        bwd.append(o + max(n.bwd_flops * work, 2 * moved / bw) if n.requires_grad else 0.0)
        src.append("roofline")
    base_ovh = fit.kinds["add/fp32"].overhead_s if fit else ovh
    tables: dict[str, Any] = {}
    if kernels == "compiled":
        # a run's launches are one fixed cost shared by its ops: tabulated, so that a
        # fraction of the batch scales the rest of each op's time only
        fixed = _price_fused(graph, device, fwd, bwd, _RooflineTerms(fit, efficiency, ovh))
        tables = {"fractions": [COMPILED_FRACTION],
                  "fwd_at": [_at_fraction(fwd, fixed[0], base_ovh, COMPILED_FRACTION)],
                  "bwd_at": [_at_fraction(bwd, fixed[1], base_ovh, COMPILED_FRACTION)]}
    # optimizer: read param, grad and state, write param and state (bandwidth bound); torch's
    # multi-tensor (foreach) kernels update many tensors per launch, so a tensor costs little
    # (a measured fit has its own time per tensor)
    half_params = any(n.kind == "param" and n.dtype in ("float16", "bfloat16")
                      for n in graph.nodes)
    o, _, f_bw = _fitted(fit.kinds.get("adam/bf16" if half_params else "adam/fp32")
                         if fit else None, efficiency, ovh / 8)
    per_byte = {opt: (3 + 2 * st) / (device.mem_bandwidth_bytes_per_s * f_bw)
                for opt, st in OPTIMIZER_STATE.items()}
    return DeviceCosts(device.type_key, fwd, bwd, src, base_ovh, per_byte,
                       dict.fromkeys(OPTIMIZER_STATE, o), kernels=kernels, **tables)


@dataclass(frozen=True)
class _RooflineTerms:
    """What a roofline prices with: the measured fit (if any), else the single efficiency and
    the nominal overhead."""

    fit: RooflineFit | None
    efficiency: float
    overhead_s: float


def _price_fused(graph: OpGraph, device: Device, fwd: list[float], bwd: list[float],
                 terms: _RooflineTerms) -> tuple[dict[int, float], dict[int, float]]:
    """Price the fusible ops (in ``fwd``/``bwd``, in place) as a compiler's kernels: each
    run's launches and the bytes entering and leaving it at the bandwidth (twice the bytes in
    the backward), its FLOPs at the peak, shared out among its ops that make a tensor by the
    bytes each would move on its own; views and size queries cost nothing. Returns, per op
    of a run, the part of its forward and of its backward that does not shrink with the
    batch: its share of the run's launches."""
    fixed: tuple[dict[int, float], dict[int, float]] = ({}, {})
    for run in fused_kernels(graph):
        nodes = [graph.nodes[i] for i in run.nodes]
        precision = "bf16" if any(n.dtype in HALF_DTYPES for n in nodes) else "fp32"
        o, f_flops, f_bw = _fitted(terms.fit.kinds.get(f"add/{precision}") if terms.fit
                                   else None, terms.efficiency, terms.overhead_s)
        peak = (device.half_flops_per_s if precision == "bf16" else device.flops_per_s) * f_flops
        bw = device.mem_bandwidth_bytes_per_s * f_bw
        launch_s = run.launches * o
        fwd_s = launch_s + max(sum(n.fwd_flops for n in nodes) / peak, run.bytes_moved / bw)
        bwd_s = launch_s + max(sum(n.bwd_flops for n in nodes) / peak,
                               2 * run.bytes_moved / bw)
        makers = [i for i, n in zip(run.nodes, nodes, strict=True) if not launches_no_kernel(n)]
        for i in run.nodes:
            fwd[i] = bwd[i] = 0.0
        for times, fixed_part, total_s, ops in (
                (fwd, fixed[0], fwd_s, makers),
                (bwd, fixed[1], bwd_s, [i for i in makers if graph.nodes[i].requires_grad])):
            shares = [max(_io_bytes(graph, i), 1) for i in ops]
            for i, share in zip(ops, shares, strict=True):
                times[i] = total_s * share / sum(shares)
                fixed_part[i] = launch_s * share / sum(shares)
    return fixed


def _at_fraction(times: list[float], fixed: dict[int, float], overhead_s: float,
                 fraction: float) -> list[float]:
    """Each node's seconds at ``fraction`` of the batch: its fixed part (``fixed``, else the
    per-op overhead, as :meth:`DeviceCosts.at` takes it without tables) and the rest scaled."""
    out = []
    for i, t in enumerate(times):
        f = fixed.get(i, min(overhead_s, t))
        out.append(f + (t - f) * fraction if t > 0.0 else 0.0)
    return out
