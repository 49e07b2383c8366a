"""The profiler: measure each node's forward and backward seconds on the devices that are here.

Devices that are present are timed op by op (:mod:`explorer.profiling.ops`); devices that are
not get a roofline estimate. Where the devices' platform has ranks sharing a host (CPU ranks),
how replicas slow each other and what a message costs are measured too
(:mod:`explorer.profiling.host`). Profiles are cached per graph fingerprint and device type.
All the runs of one profile on a device type share rank processes started once
(:class:`explorer.runtime.pool.RankPool`), ended when the profile is done or fails.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from explorer.capture.tracing import batch_splits
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import PRECISIONS
from explorer.costs.kernels import Kernels, check_kernels_name
from explorer.costs.model import CostModel, DeviceCosts, roofline
from explorer.devices.cluster import Cluster, Device
from explorer.platforms import platform_of
from explorer.profiling import (
    checkpoint_probe,
    collective_probe,
    dtensor_probe,
    host,
    ops,
    segment_fit,
)
from explorer.profiling.ops import REPEATS
from explorer.runtime.jobfiles import RUNTIMES, Runtime
from explorer.runtime.pool import RankPool

#: the precisions a profile can also time devices at (besides fp32)
HALF_PRECISIONS = tuple(p for p in PRECISIONS if p != "fp32")
#: whether a profile's runs share rank processes (:class:`RankPool`) rather than each start
#: its own, which costs seconds per run
REUSE_RANKS = True


@dataclass(frozen=True)
class Preliminary:
    """A profile's first usable numbers, while it goes on: every measured device type's costs
    so far (where its op timing is not done, those of its first whole-batch run alone: per-op
    times, no batch fractions or contention) and rooflines for the types not reached yet."""

    costs: CostModel
    #: the runs these numbers come from, of all the runs the profile makes
    runs_done: int
    runs_total: int

    @property
    def label(self) -> str:
        """How a status line names them, e.g. "preliminary: 1 of 8 runs"."""
        return f"preliminary: {self.runs_done} of {self.runs_total} runs"


#: a function given a profile's preliminary numbers (:class:`Preliminary`)
Partial = Callable[[Preliminary], None]


def profile(graph: OpGraph, cluster: Cluster, repeats: int = REPEATS, warmup: int = 2,
            cache: bool = True, progress: bool = True, message: bool = True,
            report: ops.Report | None = None, partial: Partial | None = None,
            precisions: tuple[str, ...] = (), runtime: Runtime = "segments",
            kernels: Kernels = "eager") -> CostModel:
    """Measure or estimate what every node of ``graph`` costs on every device of ``cluster``.

    Devices that are present (this machine's CPU ranks, its GPUs) are measured; others get a
    roofline estimate from their datasheet numbers. Results are cached per graph fingerprint and
    device type in ``~/.cache/partition-explorer/profiles``; ``cache=False`` measures afresh.
    With two or more measured CPU ranks (and ``message``), the processor time each tensor
    sent between ranks costs is measured once per host (:func:`host.cpu_message_s`) and set
    as ``message_s``; what DTensor adds to tensor-parallel stages' ops
    (:func:`dtensor_probe.dtensor_costs`, ``cache=False`` measures it afresh too, as the
    host's load at the time moves it), fitted on ``graph``'s own run split two ways where
    a split splits it (:func:`dtensor_probe.model_dtensor_costs`, stored with the profile);
    with one or more, what checkpointing adds to a recomputing stage of the segment runtime
    (:func:`checkpoint_probe.checkpoint_costs`, once per host);
    and how much each op slows while another rank of the
    host runs it too, as replicas do (:func:`host.measure_contention`, stored with the
    profile). All are host measurements: not taken for ``Cluster.cpu(n, measure=False)``.
    A cluster whose host is measured later (``Cluster.cpu(n, measure="later")``) is measured
    first (:meth:`Cluster.measured`): the cost model's ``cluster`` is the measured one.
    ``report`` (where given) is told how far the measuring is, in words, before and after
    each run (a widget shows it). ``partial`` (where given) gets usable numbers early: a
    :class:`Preliminary` as soon as the first whole-batch op timing run of a device type that
    is measured is done. It changes nothing of what is measured or returned, and only the
    final profile is cached. ``precisions`` (e.g. ``("bf16",)``): measured devices are also
    timed with their ops in those precisions (:func:`ops.measure_precision`, kept with the
    profile), so stages set to compute in them are predicted from what they cost here rather
    than from a rule (which on CPUs leaves the fp32 times).

    ``runtime`` is the runtime whose steps the costs predict (``ex.run``'s ``runtime``):
    "segments" (a rank's consecutive ops as one piece of generated code with one backward),
    the ops timed one at a time and fitted to segment runs of the same plan
    (:func:`ops.measure`), and the message cost probed in segments; or "ops" (one op at a
    time), the op timing alone. Each is cached apart.

    ``kernels`` is how devices that are estimated (not present: GPU presets) run the ops
    (:data:`explorer.costs.kernels.Kernels`): "eager", one kernel per op, as eager PyTorch
    and ``ex.run`` run them; "compiled", their pointwise and normalisation ops fused, as
    ``torch.compile`` or a training framework's fused kernels run them. Measured devices are
    timed as they run, so "compiled" is refused where the cluster has one.
    """
    if runtime not in RUNTIMES:
        raise ExplorerError(f"runtime must be one of {', '.join(map(repr, RUNTIMES))}, not "
                            f"{runtime!r}")
    if bad := sorted(set(precisions) - set(HALF_PRECISIONS)):
        raise ExplorerError(f"precision {bad[0]!r} is not one a profile can time: "
                            f"use {' or '.join(HALF_PRECISIONS)}")
    check_kernels(graph, cluster, kernels)
    if repeats < 1 or warmup < 0:
        raise ExplorerError("repeats must be >= 1 and warmup >= 0")
    if cluster.measure_later and report is not None:
        report("measuring this host's CPU ranks (once per host)")
    cluster = cluster.measured()
    per_type: dict[str, DeviceCosts] = {}
    # every part's runs counted before the first (so a status line's total never changes)
    runs = ops.ProfileRuns(_runs_total(graph, cluster, precisions, runtime), report)
    with contextlib.ExitStack() as stack:
        pools: dict[str, RankPool | None] = {}
        for dev in cluster.devices:
            if dev.type_key in per_type:
                continue
            if not dev.present or graph.runtime is None:
                per_type[dev.type_key] = roofline(graph, dev, kernels=kernels)
                continue
            ranks = [d for d in cluster.devices if d.present and d.type_key == dev.type_key]
            contention = _measures_contention(graph, cluster, ranks)
            if dev.kind not in pools:
                pools[dev.kind] = stack.enter_context(RankPool(2 if contention else 1)) \
                    if REUSE_RANKS else None
            pool = pools[dev.kind]
            first = None if partial is None else _first_run(
                graph, cluster, per_type, dev.type_key, partial, runs)
            start = runs.done
            dc = ops.measured(graph, dev, repeats, warmup, cache, progress, pool=pool,
                              report=runs, first=first, runtime=runtime,
                              complete=functools.partial(
                                  _complete, graph=graph, dev=dev, ranks=ranks,
                                  contention=contention, precisions=precisions,
                                  repeats=repeats, warmup=warmup, progress=progress,
                                  pool=pool, runs=runs, start=start))
            # (the runs its cache entry made unnecessary, or a part that failed did not make)
            runs.done_up_to(start + _type_runs(graph, contention, precisions, runtime))
            per_type[dev.type_key] = dc
        message_s = 0.0
        if message and graph.runtime is not None:
            message_s = host.cpu_message_s(cluster, pool=pools.get("cpu"), report=runs,
                                           runtime=runtime)
            cpus = [per_type[d.type_key] for d in cluster.devices
                    if d.kind == "cpu" and d.present]
            # the host probe's costs where the model's own split run gave none
            if lacking := [dc for dc in cpus if not dc.dtensor]:
                dtensor = dtensor_probe.dtensor_costs(cluster, cache, pools.get("cpu"), runs)
                for dc in lacking:
                    dc.dtensor = dtensor
            collective_s = collective_probe.collective_costs(cluster, cache, pools.get("cpu"),
                                                             runs)
            for dc in cpus:
                dc.collective_s = collective_s
            if runtime == "segments":  # (the op path recomputes op by op, unchecked)
                checkpoint = checkpoint_probe.checkpoint_costs(cluster, cache,
                                                               pools.get("cpu"), runs)
                for dc in cpus:
                    dc.checkpoint = checkpoint
    return CostModel(graph.fingerprint, cluster, per_type, message_s=message_s)


def _complete(dc: DeviceCosts, graph: OpGraph, dev: Device, ranks: list[Device],
              contention: bool, precisions: tuple[str, ...], repeats: int, warmup: int,
              progress: bool, pool: RankPool | None, runs: ops.ProfileRuns,
              start: int) -> bool:
    """Measure what the op timing ``dc`` of ``dev`` (cached or new) lacks, into it: the
    ``precisions`` not timed yet, how ``ranks`` slow each other (where it ``contention`` is
    measured) and the model's own split costs; whether anything was added (then
    :func:`ops.measured` caches it with the op timing). ``runs`` counts the profile's runs
    (this device type's from ``start``): each part not needed counts as done before the
    next begins."""
    added = False
    at = start + ops.timing_runs(graph, dc.runtime)
    runs.done_up_to(at)
    for p in precisions:
        if graph.source != "export":
            continue
        if p not in dc.precision_s:
            dc.precision_s[p] = ops.measure_precision(graph, dev, p, dc, repeats, warmup,
                                                      pool=pool, report=runs)
            added = True
        at += 2 * ops.ROUNDS
        runs.done_up_to(at)
    if not contention:
        return added
    if not dc.contention:
        try:
            dc.contention, dc.replica_spread, dc.optimizer_contention = \
                host.measure_contention(graph, ranks[:2], repeats, warmup, progress,
                                        pool=pool, report=runs, runtime=dc.runtime)
            added = True
        except ExplorerError as exc:  # e.g. two copies do not fit: the op times stand
            warnings.warn(f"could not measure how CPU ranks of this host slow each "
                          f"other ({exc}); predictions leave it out", stacklevel=4)
    runs.done_up_to(at + 2 * host.CONTENTION_ROUNDS)
    if not dc.dtensor:  # (the host probe's costs where this finds none; its split runs go
        # one op at a time, compared with the op path's times)
        dc.dtensor = dtensor_probe.model_dtensor_costs(graph, segment_fit.op_path_costs(dc),
                                                       runs)
        added = added or bool(dc.dtensor)
    return added


def _runs_total(graph: OpGraph, cluster: Cluster, precisions: tuple[str, ...] = (),
                runtime: Runtime = "segments") -> int:
    """How many runs profiling ``graph`` on ``cluster`` for ``runtime`` makes, the cache
    aside: per measured device type, its op timing, precisions, contention and split runs
    (:func:`_type_runs`)."""
    if graph.runtime is None:
        return 0
    total = 0
    for type_key in dict.fromkeys(d.type_key for d in cluster.devices if d.present):
        ranks = [d for d in cluster.devices if d.present and d.type_key == type_key]
        total += _type_runs(graph, _measures_contention(graph, cluster, ranks), precisions,
                            runtime)
    return total


def _type_runs(graph: OpGraph, contention: bool, precisions: tuple[str, ...],
               runtime: Runtime = "segments") -> int:
    """The runs of one measured device type, the cache aside: the op timing (for
    ``runtime``, :func:`ops.timing_runs`), each of
    ``precisions`` (:func:`ops.measure_precision`), and where ``contention`` is measured,
    the contention pairs and the model split two ways (:func:`_complete`)."""
    return (ops.timing_runs(graph, runtime)
            + (2 * ops.ROUNDS * len(precisions) if graph.source == "export" else 0)
            + (2 * host.CONTENTION_ROUNDS + dtensor_probe.split_runs(graph) if contention
               else 0))


def check_kernels(graph: OpGraph, cluster: Cluster, kernels: str) -> None:
    """Refuse a ``kernels`` that is not one, or "compiled" on a cluster with measured
    devices, before any work."""
    check_kernels_name(kernels)
    measured = [d.id for d in cluster.devices if d.present and graph.runtime is not None]
    if kernels == "compiled" and measured:
        raise ExplorerError(
            f"kernels='compiled' prices estimated devices (GPU presets such as 8xH100); "
            f"{measured[0]} is measured, and a measurement times the ops as they run: "
            "profile it with kernels='eager' and time compiled steps with "
            "ex.run(..., compile=True)")


def _first_run(graph: OpGraph, cluster: Cluster, per_type: dict[str, DeviceCosts],
               type_key: str, partial: Partial, runs: ops.ProfileRuns) -> ops.FirstRun:
    """What the op timing of ``type_key`` calls with its first run's costs: ``partial``
    told the whole cluster's preliminary numbers (rooflines for types not reached yet)."""
    def first(dc: DeviceCosts) -> None:
        now = dict(per_type)
        now[type_key] = dc
        for dev in cluster.devices:
            if dev.type_key not in now:
                now[dev.type_key] = roofline(graph, dev)
        partial(Preliminary(CostModel(graph.fingerprint, cluster, now), runs.done,
                            runs.total))
    return first


def _measures_contention(graph: OpGraph, cluster: Cluster, ranks: list[Device]) -> bool:
    """Whether the profile measures how ``ranks`` (present, of one type) slow each other: two
    or more of them on a platform whose replicas share a host, host measurements wanted, and a
    graph whose batch splits in two for two replicas."""
    return (len(ranks) >= 2 and platform_of(ranks[0].kind).replicas_share_host
            and cluster.default_link.source.startswith("measured")
            and graph.source == "export" and batch_splits(graph)
            and graph.batch_size % 2 == 0)
