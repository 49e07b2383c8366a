"""Host probes that run real training steps: how CPU ranks of this host slow each other, and what
a message between them costs their processors.

They run steps through the runtime, which sits above the platforms package, so they live here;
what they return is the CPU platform's effects data (:class:`explorer.platforms.cpu.
ReplicaEffects`, ``CostModel.message_s``), which :class:`explorer.platforms.cpu.CpuPlatform`
applies. The profiler calls them for measured CPU ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from explorer.capture.tracing import capture
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster, Device
from explorer.models.builtin import build
from explorer.partition import partition
from explorer.platforms.cpu import ReplicaEffects
from explorer.platforms.cpu.host_cache import (
    cache_file,
    cache_key,
    finite_number,
    read_cache,
    warn_damaged,
    write_cache,
)
from explorer.profiling import ops
from explorer.runtime import launch
from explorer.runtime.jobfiles import Runtime
from explorer.runtime.pool import RankPool
from explorer.simulate.simulator import simulate

#: how many times the contention pair (one rank alone, two ranks at once) is run, in turn
CONTENTION_ROUNDS = 2
#: the message probe's entry in the host measurement cache (the op path's; the segment
#: runtime's has :data:`SEGMENTS_KEY` after it)
PROBE_KEY = "runtime message cost, stages not slowing each other"
SEGMENTS_KEY = ", segment runtime"


def measured_once(cluster: Cluster, cache: bool, probe_key: str, fields: tuple[str, ...],
                  measure: Callable[[], dict[str, float]], saying: str, how: str,
                  report: ops.Report | None = None, ranks: int = 2
                  ) -> dict[str, float] | None:
    """A host probe's figures (``fields``, seconds) for this host's CPU ranks: from the host
    measurement cache under ``probe_key``, or ``measure()``d and cached with ``how`` it was
    measured (``cache=False`` measures afresh and replaces the entry; ``report`` is told
    ``saying`` first). None with fewer than ``ranks`` measured CPU ranks, or when the probe
    fails: a probe that cannot run leaves its costs unknown, not an error."""
    cpus = [d for d in cluster.devices if d.kind == "cpu" and d.present]
    if len(cpus) < ranks or not cluster.default_link.source.startswith("measured"):
        return None
    path, key = cache_file(), f"{cache_key()}|{probe_key}"
    if cache:
        cached = read_cache(path).get(key)
        if isinstance(cached, dict) and all(finite_number(cached.get(k)) for k in fields):
            return {k: float(cached[k]) for k in fields}
    if report is not None:
        report(saying)
    try:
        value = measure()
    except Exception:
        return None
    write_cache(path, key, {**value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            "how": how})
    return value


def measure_contention(graph: OpGraph, ranks: list[Device], repeats: int = ops.REPEATS,
                       warmup: int = 2, progress: bool = True, rounds: int | None = None,
                       pool: RankPool | None = None, report: ops.Report | None = None,
                       runtime: Runtime = "segments") -> ReplicaEffects:
    """How two replicas of ``graph`` on CPU ranks of this host slow each other.

    Per node: how much slower its forward + backward ran while another rank of this host
    ran the same work at the same time, than alone (1.0: no slower); the replicas'
    spread: the mean over the two-rank steps of how far the busier rank's busy time was
    above the two ranks' mean, as a fraction of that mean; and how much slower the optimizer
    step ran beside the other replica's than alone (both step every parameter at the same
    moment, and a step like Adam's is bound by memory bandwidth).

    CPU ranks of one host share its memory bandwidth and caches, and (in a virtual machine)
    often more: two ranks computing at once may each run tens of percent slower on small-op
    work than one alone, while large matrix products hardly slow. Measured back to back, on
    half the batch each, ``rounds`` times in turn: one rank alone with the batch in two
    micro-batches, then two ranks data-parallel; per op, the summed times. Each op's time is
    the runtime's own per-op timing, waits excluded, so the all-reduce at the end of the
    backward does not count. The runs are made in ``runtime``, the one the profile predicts:
    in segments an op's own time is not measured apart, so every op slows as the model's
    forward and backward together did. The runs are made on ``pool``'s ranks where given;
    how far they are is told to ``report``.
    """
    rounds = CONTENTION_ROUNDS if rounds is None else rounds
    a, b = ranks[0], ranks[1]
    override = {a.id: a.torch_device or "cpu", b.id: b.torch_device or "cpu"}
    single = Plan.single(graph, a.id, optimizer="adam", micro_batches=2)
    pair = Plan.from_assignment(graph, [[a.id, b.id]], dict.fromkeys(range(len(graph)), 0),
                                algorithm="data-parallel", optimizer="adam")
    solos, boths = [], []
    bar = ops.RunsBar(2 * rounds, f"contention of {graph.name} on {a.id}+{b.id}", progress,
                      report)
    for _ in range(rounds):  # in turn, so a burst of load on the host hits both sides
        solos.append(launch.run(graph, plan=single, steps=repeats, warmup=warmup,
                                progress=False, timeout_s=600.0,
                                device_override={a.id: override[a.id]}, pool=pool,
                                runtime=runtime))
        bar.update()
        boths.append(launch.run(graph, plan=pair, steps=repeats, warmup=warmup,
                                progress=False, timeout_s=600.0, device_override=override,
                                pool=pool, runtime=runtime))
        bar.update()
    bar.close()

    def total(ms: list[Any], i: int) -> float:
        return sum(m.task_s.get(f"fwd:{i}", 0.0) + m.task_s.get(f"bwd:{i}", 0.0) for m in ms)

    alone = [total(solos, i) for i in range(len(graph))]
    shared = [total(boths, i) for i in range(len(graph))]
    spread = [max(step) / statistics.fmean(step) - 1.0 for m in boths
              for step in zip(*m.busy_samples_s.values(), strict=True) if min(step) > 0]

    def ratio(s: float, t: float, otherwise: float) -> float:
        # a ratio of two medians of one small op is noisy: bound it
        return min(max(s / t, 0.5), 4.0) if t > 0 and s > 0 else otherwise

    opt = [sum(m.task_s.get("optimizer:-1", 0.0) for m in ms) for ms in (boths, solos)]
    # the whole model's ratio (bounded the same way) where an op took no measurable time alone
    whole = ratio(sum(shared), sum(alone), 1.0)
    if runtime == "segments":
        shared = [0.0] * len(graph)
    return ReplicaEffects([ratio(s, t, whole) for s, t in zip(shared, alone, strict=True)],
                          statistics.fmean(spread) if spread else 0.0, ratio(*opt, 1.0))


def cpu_message_s(cluster: Cluster, pool: RankPool | None = None,
                  report: ops.Report | None = None, runtime: Runtime = "segments") -> float:
    """Seconds of processor time per message at each end between CPU ranks of this host
    (0.0 when ``cluster`` has fewer than two measured CPU ranks, or the probe fails).

    Profiling times each op on one rank; what a step on several ranks adds is the work of
    moving tensors between them: posting the send, matching and allocating the receive, and
    waking a rank that blocked waiting (on a virtual machine this grows with how long it
    slept). Measured once per host and torch version (:func:`measure_message_s`) and kept in
    the host measurement cache; calibration refines it from your own runs. The probe's profile
    is made on ``pool``'s ranks where given, and ``report`` is told when it starts.

    Each ``runtime`` has its own: the probe profiles and runs in it. In segments, the probe's
    two stages make two segments of each micro-batch where its profile's one device made
    one, so what a segment call costs beyond its ops is counted with the messages that cross
    a cut between stages, as it is paid where such a cut makes more segments.
    """
    cpus = [d for d in cluster.devices if d.kind == "cpu" and d.present]
    if len(cpus) < 2 or not cluster.default_link.source.startswith("measured"):
        return 0.0
    path = cache_file()
    key = f"{cache_key()}|{PROBE_KEY}{SEGMENTS_KEY if runtime == 'segments' else ''}"
    memo = _MEMO.get((str(path), key))
    if memo is not None:
        return memo
    cached = read_cache(path).get(key)
    if isinstance(cached, dict) and finite_number(cached.get("message_s")):
        _MEMO[(str(path), key)] = float(cached["message_s"])
        return float(cached["message_s"])
    if cached is not None:
        warn_damaged(path, key, "message_s is not a finite number >= 0")
    if report is not None:
        report("measuring what a message between CPU ranks costs (once per host)")
    try:
        value = measure_message_s(pool=pool, runtime=runtime)
    except Exception:  # a probe that cannot run leaves the cost unknown (0), not an error
        _MEMO[(str(path), key)] = 0.0
        return 0.0
    _MEMO[(str(path), key)] = value
    write_cache(path, key, {"message_s": value,
                            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            "how": f"tiny MLP, 2 stages x 4 micro-batches on 2 CPU ranks "
                                   f"({runtime} runtime), busy time beyond the profile / "
                                   "messages"})
    return value


_MEMO: dict[tuple[str, str], float] = {}


def forget_message_s() -> None:
    """Forget the per-message costs this process found, so the next :func:`cpu_message_s`
    reads the cache file again (or measures)."""
    _MEMO.clear()


def measure_message_s(steps: int = 8, warmup: int = 3, pool: RankPool | None = None,
                      runtime: Runtime = "segments") -> float:
    """Run the probe (a few seconds) and return seconds per message per end: the extra busy
    time of :func:`message_probe` per message, at least 0."""
    messages, extra_busy_s = message_probe(steps, warmup, pool, runtime)
    return max(0.0, extra_busy_s / messages) if messages > 0 else 0.0


def message_probe(steps: int = 8, warmup: int = 3, pool: RankPool | None = None,
                  runtime: Runtime = "segments") -> tuple[float, float]:
    """The probe's two figures: how many message ends the plan has, and how much busy time
    the ranks spent beyond the profile's prediction (seconds, summed over the ranks; noise can
    make it negative).

    The built-in tiny MLP split in two stages with four micro-batches runs on two real CPU
    ranks; the two stages run different ops, which do not slow each other measurably, so the
    extra busy time is the work of moving tensors. Its profile is made on ``pool``'s ranks
    where given, as profiles are; its real run on ranks started for it, as ``ex.run`` makes
    the runs that predictions are compared with.
    """
    bm = build("mlp", "tiny")
    graph = capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="probe")
    two = Cluster.cpu(2)
    dev = two.devices[0]
    costs = CostModel(graph.fingerprint, two,
                      {dev.type_key: ops.measured(graph, dev, progress=False, pool=pool,
                                                  runtime=runtime)})
    plan = partition(graph, two, costs, "even-layers", micro_batches=4)
    meas = launch.run(graph, plan=plan, costs=costs, steps=steps, warmup=warmup,
                      progress=False, runtime=runtime)
    base = simulate(graph, plan, costs).busy_s
    probe = simulate(graph, plan, replace(costs, message_s=1e-3)).busy_s
    # a whole number of message ends, read back from seconds: round off the float error
    messages = float(round(sum((probe[d] - base[d]) / 1e-3 for d in base)))
    extra = sum(meas.busy_s[d] - base[d] for d in base)
    return messages, extra
