"""Op timing: each node's forward and backward seconds on one device that is here, cached.

Graphs captured with torch.export run a few real training steps through the runtime
(:mod:`explorer.runtime.worker`) on one rank, at the whole batch and at a half and a quarter of it,
and each op's forward and backward is timed there, after warm-up, as it runs in a real step.
Hook-captured graphs time each leaf module in real forward and backward passes. CPU ranks
are measured with one thread, as they run. Results are cached per graph fingerprint, device
type and rank settings (:func:`measured`; files read and written through
:mod:`explorer.core.cachefile`), with the host's load while they were measured and what a
cached profile is re-checked against before it is used (:mod:`explorer.profiling.recheck`).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from explorer.capture.tracing import CaptureRuntime, batch_splits, keep_buffers, training_mode
from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE, Plan
from explorer.costs.model import DeviceCosts
from explorer.devices.cluster import Device
from explorer.platforms import platform_of
from explorer.platforms.gpu import library_workspace_bytes
from explorer.platforms.load import HostLoad, ShareMeter, load_per_core, usable_cores
from explorer.profiling import recheck, segment_fit
from explorer.profiling.profile_cache import CachedProfile, cache_path, load_entry, store
from explorer.runtime import launch
from explorer.runtime.jobfiles import Runtime
from explorer.runtime.pool import RankPool

#: steps timed in each run of the profile (after the warm-up). A run costs seconds to start
#: its processes and its steps only tens of milliseconds each on the built-in models, so more
#: steps per run are cheap; 15 rather than 5 make repeated profiles of one model agree
#: several times more closely (``python benchmarks/profile_repeat.py`` measures it), about
#: what doubling ``ROUNDS`` does for several times the cost.
REPEATS = 15
#: micro-batch counts profiled besides the whole batch (times at 1/2 and 1/4 of the batch)
FRACTION_SPLITS = (2, 4)
#: how many times each of those runs is made, in turn; an op's time is its mean over them.
#: A shared host's speed wanders by 5-10 % over seconds, and averaging runs made a few
#: seconds apart narrows the spread of the whole-batch step total.
ROUNDS = 2


#: what one timing run gives: per node its forward and backward seconds, and the optimizer
#: step's (:func:`measure_in_runtime`)
Run = tuple[list[float], list[float], float]


#: a function told how far a profile is, in words ("profiling gpt on cpu:0: 2 of 6 runs")
Report = Callable[[str], None]
#: a function given the preliminary costs of a profile's first whole-batch run
FirstRun = Callable[[DeviceCosts], None]


class ProfileRuns:
    """A profile's :data:`Report` that also counts the runs of the whole profile: how many it
    makes in all, known before the first, and how many are done. Each part's
    :class:`RunsBar` told it counts on it, so every line says the same total from the first
    run to the last ("profiling gpt on cpu:0: 3 of 14 runs", then "contention of gpt on
    cpu:0+cpu:1: 7 of 14 runs"); runs a part does not need (its results cached) are counted
    done when the part is over (:meth:`done_up_to`)."""

    def __init__(self, total: int, report: Report | None = None) -> None:
        self.total, self.done, self.report = total, 0, report

    def __call__(self, text: str) -> None:
        if self.report is not None:
            self.report(text)

    def ran(self) -> None:
        """One more run done."""
        self.done += 1
        self.total = max(self.total, self.done)  # (a part that ran more than it said)

    def done_up_to(self, done: int) -> None:
        """The runs up to ``done`` are over, made or not needed."""
        self.done = max(self.done, min(done, self.total))


class RunsBar:
    """Counts the runs of one part of a profile: a progress bar (``progress``) and a line to
    ``report`` (where given) as it starts and after each run: this part's runs, or the
    whole profile's where ``report`` is its :class:`ProfileRuns`."""

    def __init__(self, total: int, desc: str, progress: bool, report: Report | None) -> None:
        self.bar = tqdm(total=total, unit="run", desc=desc, disable=not progress, leave=False)
        self.total, self.done, self.desc, self.report = total, 0, desc, report
        self._tell()

    def update(self) -> None:
        self.bar.update()
        self.done += 1
        if isinstance(self.report, ProfileRuns):
            self.report.ran()
        self._tell()

    def close(self) -> None:
        self.bar.close()

    def _tell(self) -> None:
        if self.report is None:
            return
        done, total = ((self.report.done, self.report.total)
                       if isinstance(self.report, ProfileRuns) else (self.done, self.total))
        self.report(f"{self.desc}: {done} of {total} runs")


def measured(graph: OpGraph, dev: Device, repeats: int = REPEATS, warmup: int = 2,
             cache: bool = True, progress: bool = True, pool: RankPool | None = None,
             report: Report | None = None, first: FirstRun | None = None,
             complete: Complete | None = None, runtime: Runtime = "segments") -> DeviceCosts:
    """``graph``'s profile on ``dev`` (which must be present) for ``runtime``: read from the
    cache (an entry of each runtime apart), or
    measured (:func:`measure`, its runs on ``pool``'s ranks where given, how far it is told to
    ``report``, its first run's preliminary costs to ``first``) and cached;
    ``cache=False`` measures afresh. A cache entry that does not fit ``graph`` or holds no
    usable times is measured again and replaced, and so is one whose ops, timed again here
    (:mod:`explorer.profiling.recheck`, a fraction of a second), no longer take what it says.
    A profile measured while the host was busy (:meth:`~explorer.platforms.Platform.busy_host`)
    comes with a warning. ``complete`` (where given) may add what the profile lacks, in
    place, saying whether it did; what it adds is cached with the profile."""
    path = cache_path(graph, dev, repeats, runtime)
    got = load_entry(path, len(graph), dev.type_key, runtime) if cache else None
    if got is not None and not _still_holds(graph, dev, got, path):
        got = None
    fresh = got is None
    if got is None:
        got = measure_recorded(graph, dev, repeats, warmup, progress, pool=pool, report=report,
                               first=first, runtime=runtime)
    if got.load is not None and (busy := platform_of(dev.kind).busy_host(got.load)):
        where = "" if fresh else f" (cached in {path})"
        warnings.warn(f"the profile of {graph.name} on {dev.id}{where} was measured on a "
                      f"busy machine ({busy}): its times are likely too long for a quiet one. "
                      "Profile again when the machine is quiet, with cache=False (or "
                      "--no-cache)", stacklevel=3)
    if cache and fresh:  # (kept should what ``complete`` measures fail)
        store(path, got.costs, got.load, got.reference)
    if complete is not None and complete(got.costs) and cache:
        store(path, got.costs, got.load, got.reference)
    return got.costs


#: a function that adds what a profile lacks to it, in place, and says whether it did
Complete = Callable[[DeviceCosts], bool]


def measure_recorded(graph: OpGraph, dev: Device, repeats: int = REPEATS, warmup: int = 2,
                     progress: bool = True, pool: RankPool | None = None,
                     report: Report | None = None, first: FirstRun | None = None,
                     runtime: Runtime = "segments") -> CachedProfile:
    """:func:`measure`, with the host's load while it ran and the re-check's reference: a
    few of the graph's ops timed in this process just before and just after its runs
    (:mod:`explorer.profiling.recheck`; their processor share is the load's)."""
    nodes = recheck.reference_nodes(graph)
    meter = ShareMeter()
    start_load = load_per_core()
    before = _look(graph, dev, nodes, meter)
    dc = measure(graph, dev, repeats, warmup, progress, pool=pool, report=report, first=first,
                 runtime=runtime)
    after = _look(graph, dev, nodes, meter)
    under = HostLoad(meter.share, start_load, usable_cores())
    return CachedProfile(dc, under, recheck.reference(dc, nodes, [before, after]))


#: how long a profile whose ops cannot be timed alone samples the processor share it gets,
#: before and after its runs
LOAD_SAMPLE_S = 0.02


def _look(graph: OpGraph, dev: Device, nodes: tuple[int, ...], meter: ShareMeter
          ) -> recheck.Look | None:
    """A look at the reference ops ``nodes`` (:func:`recheck.look`), or where they cannot be
    timed a loop of ``LOAD_SAMPLE_S``, measured by ``meter``."""
    got = recheck.look(graph, dev, nodes, meter)
    if got is None:
        meter.sample(LOAD_SAMPLE_S)
    return got


def _still_holds(graph: OpGraph, dev: Device, got: CachedProfile, path: Path) -> bool:
    """Whether the cached profile ``got`` passes its re-check on ``dev`` now (a second look
    confirms a first that is off); else with a warning."""
    if got.reference is None:
        return True
    first = recheck.drift(graph, dev, got.costs, got.reference)
    if first is None or first.holds:
        return True
    again = recheck.drift(graph, dev, got.costs, got.reference)
    if again is None or again.holds:
        return True
    warnings.warn(f"the cached profile {path} no longer holds on this host: "
                  f"{len(got.reference.nodes)} of its ops, timed again, ran {again.describe()} "
                  "than it says (it was measured while the host was busier, or the host or the "
                  "file changed); measuring again and replacing it", stacklevel=4)
    return False


@contextmanager
def device_threads(dev: Device):
    """CPU ranks run with one thread each: measure them the same way."""
    if dev.kind != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _sync(dev: Device) -> Callable[[], None]:
    if dev.kind == "cuda":
        return lambda: torch.cuda.synchronize(dev.torch_device)
    return lambda: None


def _time(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(graph: OpGraph, dev: Device, repeats: int = REPEATS, warmup: int = 2,
            progress: bool = True, pool: RankPool | None = None,
            report: Report | None = None, first: FirstRun | None = None,
            runtime: Runtime = "segments") -> DeviceCosts:
    """Time every op of ``graph`` on ``dev`` (which must be present), as ``runtime`` runs it.

    Export-captured graphs run through the real runtime (:mod:`explorer.runtime.worker`) on one
    rank, so each op's forward and backward are timed exactly as a real run of the op path
    executes them, bookkeeping included; the optimizer step is timed the same way. Each of
    those runs (the whole batch, a half, a quarter) is made ``ROUNDS`` times in turn, on
    ``pool``'s ranks where given (else each on processes of its own). For the segment runtime
    (``runtime="segments"``) the op path runs each share once, and the same plan runs in
    segments ``ROUNDS`` times, each just after it in the first round: the ops' costs in a
    segment are their op-path times less what the op path adds per op, fitted so they add up
    to the segment runs' forward and backward (:func:`explorer.profiling.segment_fit.fit`),
    and the optimizer step is the segment runs'. Hook-captured graphs time each leaf-module
    call in real forward and backward passes.

    ``first`` (where given) is called with the preliminary costs of the first whole-batch
    run(s) alone (:func:`first_run_costs`) as soon as they are done, before the others; what
    this returns does not depend on it.
    """
    sync = _sync(dev)
    with device_threads(dev), torch.random.fork_rng(devices=[]):
        per_byte, per_tensor = _measure_optimizers(dev, sync)
        tiny = torch.zeros(1, device=dev.torch_device)
        floor = _time(lambda: torch.add(tiny, 1.0), sync, max(repeats, 20), warmup)
        if graph.source == "hooks":
            fwd, bwd = _measure_modules(graph, dev, repeats, warmup)
            return _device_costs(graph, dev, fwd, bwd, floor, per_byte, per_tensor,
                                 runtime=runtime)
        # the whole batch, then the same ops on a half and a quarter of it (micro-batches
        # and replicas run there, and small ops do not shrink in proportion)
        splits = batch_fractions(graph)
        bar = RunsBar(timing_runs(graph, runtime), f"profiling {graph.name} on {dev.id}",
                      progress, report)
        on_ops: dict[int, list[Run]] = {}
        in_segments: dict[int, list[Run]] = {}
        for r in range(ROUNDS):  # in turn, so a slow spell of the host hits every split
            for m in splits:
                if runtime == "ops" or r == 0:
                    on_ops.setdefault(m, []).append(measure_in_runtime(
                        graph, dev, repeats, warmup, False, micro_batches=m, pool=pool))
                    bar.update()
                if runtime == "segments":
                    in_segments.setdefault(m, []).append(measure_in_runtime(
                        graph, dev, repeats, warmup, False, micro_batches=m, pool=pool,
                        runtime="segments"))
                    bar.update()
                if first is not None and r == 0 and m == 1:
                    first(first_run_costs(graph, dev, on_ops[1][0], floor, per_byte,
                                          per_tensor, in_segments.get(1, [None])[0]))
        bar.close()
    return _from_runs(graph, dev, splits, on_ops, in_segments, floor, per_byte, per_tensor)


def _from_runs(graph: OpGraph, dev: Device, splits: list[int], on_ops: dict[int, list[Run]],
               in_segments: dict[int, list[Run]], floor_s: float,
               per_byte: dict[str, float], per_tensor: dict[str, float]) -> DeviceCosts:
    """The profile from its timing runs: per micro-batch count in ``splits``, the op path's
    runs ``on_ops`` (per op, the mean over them) and, for the segment runtime, the segment
    runs ``in_segments`` the ops' costs are fitted to (:func:`segment_fit.fit`)."""
    fwd_at: list[list[float]] = []
    bwd_at: list[list[float]] = []
    for m in splits:
        f, b, _ = _mean_of_rounds(on_ops[m])
        fwd_at.append(_at_most(f, fwd_at[-1]) if fwd_at else f)
        bwd_at.append(_at_most(b, bwd_at[-1]) if bwd_at else b)
    opt_s = _mean_of_rounds(on_ops[splits[0]])[2]  # (the whole batch's step)
    extra: list[list[float]] = []
    if in_segments:
        seg = [_mean_of_rounds(in_segments[m]) for m in splits]
        fitted = segment_fit.fit(fwd_at, bwd_at, [sum(f) for f, _, _ in seg],
                                 [sum(b) for _, b, _ in seg], floor_s)
        fwd_at, bwd_at, extra, opt_s = fitted.fwd_at, fitted.bwd_at, fitted.extra_s, seg[0][2]
    per_byte, per_tensor = _optimizer_to_step(graph, opt_s, per_byte, per_tensor)
    return _device_costs(graph, dev, fwd_at[0], bwd_at[0], floor_s, per_byte, per_tensor,
                         [1.0 / m for m in splits[1:]], fwd_at[1:], bwd_at[1:],
                         "segments" if in_segments else "ops", extra)


def batch_fractions(graph: OpGraph) -> list[int]:
    """The micro-batch counts op timing runs ``graph`` at: 1 (the whole batch), then those of
    ``FRACTION_SPLITS`` its batch splits into."""
    return [1] + [m for m in FRACTION_SPLITS if batch_splits(graph)
                  and graph.batch_size % m == 0]


def timing_runs(graph: OpGraph, runtime: Runtime = "segments") -> int:
    """How many runs the op timing of ``graph`` for ``runtime`` makes (:func:`measure`; 0 for
    hook-captured graphs, timed in this process): ``ROUNDS`` per share of the batch on the
    op path, or for the segment runtime one there and ``ROUNDS`` in segments."""
    if graph.source == "hooks":
        return 0
    return (ROUNDS if runtime == "ops" else 1 + ROUNDS) * len(batch_fractions(graph))


def first_run_costs(graph: OpGraph, dev: Device, run: Run, floor_s: float,
                    per_byte: dict[str, float], per_tensor: dict[str, float],
                    segments: Run | None = None) -> DeviceCosts:
    """Preliminary costs from one whole-batch run of the op path (per-op times and the
    optimizer step as measured there), fitted to one of the segments where ``segments`` is
    given: no fractions of the batch (smaller shares scale in proportion) and no contention,
    which later runs measure."""
    return _from_runs(graph, dev, [1], {1: [run]}, {1: [segments]} if segments else {},
                      floor_s, per_byte, per_tensor)


def _optimizer_to_step(graph: OpGraph, opt_s: float, per_byte: dict[str, float],
                       per_tensor: dict[str, float]
                       ) -> tuple[dict[str, float], dict[str, float]]:
    """The optimizer micro-benchmark scaled to what the real step measured (``opt_s``)."""
    pbytes = sum(n.param_bytes for n in graph.nodes if n.kind == "param")
    ntens = sum(1 for n in graph.nodes if n.kind == "param")
    model = per_byte["adam"] * pbytes + per_tensor["adam"] * ntens
    if model > 0 and opt_s > 0:
        k = opt_s / model
        per_byte = {o: v * k for o, v in per_byte.items()}
        per_tensor = {o: v * k for o, v in per_tensor.items()}
    return per_byte, per_tensor


def _device_costs(graph: OpGraph, dev: Device, fwd: list[float], bwd: list[float],
                  floor_s: float, per_byte: dict[str, float], per_tensor: dict[str, float],
                  fractions: list[float] | None = None, fwd_at: list[list[float]] | None = None,
                  bwd_at: list[list[float]] | None = None, runtime: Runtime = "ops",
                  op_path_extra_s: list[list[float]] | None = None) -> DeviceCosts:
    op_times = sorted(t for t, n in zip(fwd, graph.nodes, strict=True) if n.kind == "op" and t)
    overhead = max(floor_s, op_times[0]) if op_times else floor_s
    src = ["measured" if n.kind == "op" else "free" for n in graph.nodes]
    held = (library_workspace_bytes(torch.device(dev.torch_device)) if dev.kind == "cuda"
            else 0)
    return DeviceCosts(dev.type_key, fwd, bwd, src, overhead, per_byte, per_tensor,
                       fractions or [], fwd_at or [], bwd_at or [], workspace_bytes=held,
                       runtime=runtime, op_path_extra_s=op_path_extra_s or [])


def _mean_of_rounds(rounds: list[tuple[list[float], list[float], float]]
                    ) -> tuple[list[float], list[float], float]:
    """Per op, the mean over the rounds (each op's times from one run)."""
    fwd = [statistics.fmean(x) for x in zip(*(r[0] for r in rounds), strict=True)]
    bwd = [statistics.fmean(x) for x in zip(*(r[1] for r in rounds), strict=True)]
    return fwd, bwd, statistics.fmean(r[2] for r in rounds)


def _at_most(times: list[float], bigger: list[float]) -> list[float]:
    """A smaller share of the batch never takes longer: clip timing noise to that."""
    return [min(t, b) if b > 0 else t for t, b in zip(times, bigger, strict=True)]



def measure_precision(graph: OpGraph, dev: Device, precision: str, base: DeviceCosts,
                      repeats: int = REPEATS, warmup: int = 2, pool: RankPool | None = None,
                      report: Report | None = None) -> list[list[float]]:
    """``[fwd_s, bwd_s]`` per node of ``graph`` on ``dev`` with every op under
    ``torch.autocast`` in ``precision`` ("bf16" or "fp16"), as a plan's stage in that
    precision runs them (casts included); what :attr:`DeviceCosts.precision_s` holds.

    Each of ``ROUNDS`` rounds times the whole batch in fp32 and then in ``precision``, back to
    back, so both see the host alike; each op's ratio of the two (means over the rounds)
    scales its times in ``base``, the fp32 profile the result goes with, which may have been
    measured at another moment. Where ``base`` is of the segment runtime, the ratio is of the
    op-path times less what the op path adds per op (``DeviceCosts.op_path_extra_s`` at the
    whole batch; :func:`segment_fit.in_segments`), as the segments run the ops.
    """
    bar = RunsBar(2 * ROUNDS, f"profiling {graph.name} on {dev.id} in {precision}", False,
                  report)
    full, half = [], []
    for _ in range(ROUNDS):
        for p, got in (("fp32", full), (precision, half)):
            got.append(measure_in_runtime(graph, dev, repeats, warmup, False, pool=pool,
                                          precision=p))
            bar.update()
    bar.close()
    (f32, b32, _), (f16, b16, _) = _mean_of_rounds(full), _mean_of_rounds(half)
    if base.op_path_extra_s:  # (a profile of the segment runtime)
        (x_f, *_), (x_b, *_) = base.op_path_extra_s
        f32, f16 = (segment_fit.in_segments(t, x_f, base.overhead_s) for t in (f32, f16))
        b32, b16 = (segment_fit.in_segments(t, x_b, base.overhead_s) for t in (b32, b16))

    def scaled(times: list[float], new: list[float], old: list[float]) -> list[float]:
        return [t * n / o if o > 0.0 else t for t, n, o in zip(times, new, old, strict=True)]

    return [scaled(base.fwd_s, f16, f32), scaled(base.bwd_s, b16, b32)]


def measure_in_runtime(graph: OpGraph, dev: Device, repeats: int, warmup: int,
                       progress: bool, micro_batches: int = 1, pool: RankPool | None = None,
                       precision: str = "fp32", runtime: Runtime = "ops") -> Run:
    """Per-op forward/backward seconds and the optimizer step, from real steps on one rank
    (its ops in ``precision``) of ``runtime``: each op's median over steps and micro-batches,
    scaled so that together they make the median step's busy time. In segments
    (``runtime="segments"``) a segment runs a micro-batch's ops: its forward is at its first
    op's node, its backward at the node of its first backward, the others 0."""
    plan = Plan.single(graph, dev.id, optimizer="adam", micro_batches=micro_batches)
    if precision != "fp32":
        plan = plan.with_memory(precision=precision)
    meas = launch.run(graph, plan=plan, steps=repeats, warmup=warmup, progress=progress,
                      device_override={dev.id: dev.torch_device or "cpu"}, timeout_s=600.0,
                      pool=pool, runtime=runtime)
    task = meas.task_s
    fwd = [task.get(f"fwd:{i}", 0.0) for i in range(len(graph))]
    bwd = [task.get(f"bwd:{i}", 0.0) for i in range(len(graph))]
    opt = task.get("optimizer:-1", 0.0)
    # An op's median leaves out its occasional slow repeat (the processor taken away for a
    # moment, an interrupt), but every step pays for the ones that land in it: the medians
    # add up to a little less than a median step's busy time. Scale them to add up to it,
    # so a prediction of this very plan has the busy time it measured.
    total = micro_batches * (sum(fwd) + sum(bwd)) + opt
    busy = meas.busy_s.get(dev.id, 0.0)
    if total > 0.0 and busy > 0.0:
        k = busy / total
        fwd, bwd, opt = [t * k for t in fwd], [t * k for t in bwd], opt * k
    return fwd, bwd, opt


def _measure_modules(graph: OpGraph, dev: Device, repeats: int,
                     warmup: int) -> tuple[list[float], list[float]]:
    """Hook-captured graphs: time each leaf-module call in real forward and backward passes."""
    rt: CaptureRuntime = graph.runtime
    params = list(rt.step.parameters())
    home = params[0].device if params else torch.device("cpu")
    grads = [q.grad for q in params]  # the user's, given back untouched after timing
    step = rt.step.to(dev.torch_device)
    args = [t.to(dev.torch_device) for t in rt.args]
    order = [n.name for n in graph.nodes if n.kind == "op"]
    samples_f: dict[str, list[float]] = {k: [] for k in order}
    samples_b: dict[str, list[float]] = {k: [] for k in order}
    sync = _sync(dev)
    calls: list[str] = []
    starts: dict[Any, float] = {}
    bstarts: dict[Any, float] = {}
    hooks = []
    leaves = [m for _, m in step.model.named_modules() if not list(m.children())]
    record = {"on": False}

    def pre(mod, _args):
        sync()
        starts[mod] = time.perf_counter()

    def post(mod, _args, _out):
        sync()
        nm = order[len(calls)] if len(calls) < len(order) else None
        calls.append(nm)
        if record["on"] and nm:
            samples_f[nm].append(time.perf_counter() - starts[mod])
        names_of.setdefault(mod, []).append(nm)

    def bpre(mod, _g):
        sync()
        bstarts[mod] = time.perf_counter()

    def bpost(mod, _gi, _go):
        sync()
        nm = names_of.get(mod, [None]).pop() if names_of.get(mod) else None
        if record["on"] and nm:
            samples_b[nm].append(time.perf_counter() - bstarts[mod])

    names_of: dict[Any, list[str]] = {}
    for m in leaves:
        hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post),
                  m.register_full_backward_pre_hook(bpre), m.register_full_backward_hook(bpost)]
    # a training step (the user's model may be in eval mode), BatchNorm statistics and modes
    # as they were after capture
    with training_mode(step), keep_buffers(step.model):
        try:
            for q in params:  # the timed backwards accumulate into fresh tensors
                q.grad = None
            for k in range(warmup + repeats):
                record["on"] = k >= warmup
                calls.clear()
                names_of.clear()
                loss = step(*args)
                with warnings.catch_warnings():  # first module's inputs need no gradient:
                    warnings.simplefilter("ignore", UserWarning)  # expected, not news
                    loss.backward()
        finally:
            for h in hooks:
                h.remove()
            rt.step.to(home)
            for q, g in zip(params, grads, strict=True):
                q.grad = g
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    fwd = [med(samples_f.get(n.name, [])) for n in graph.nodes]
    bwd = [med(samples_b.get(n.name, [])) for n in graph.nodes]
    return fwd, bwd


def _measure_optimizers(dev: Device, sync) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per parameter byte and per parameter tensor of one optimizer step."""
    per_byte, per_tensor = {}, {}
    for opt in OPTIMIZER_STATE:
        big = [torch.zeros(1 << 18, device=dev.torch_device, requires_grad=True)]
        many = [torch.zeros(256, device=dev.torch_device, requires_grad=True)
                for _ in range(32)]
        times = []
        for ps in (big, many):
            for p in ps:
                p.grad = torch.ones_like(p)
            o = _optimizer(opt, ps)
            times.append(_time(o.step, sync, 5, 2))
        b_big, b_many = 4 * (1 << 18), 4 * 256 * 32
        # times[0] = a * b_big + c ; times[1] = a * b_many + 32 c
        a = max((32 * times[0] - times[1]) / (32 * b_big - b_many), 0.0)
        c = max(times[0] - a * b_big, 0.0)
        per_byte[opt], per_tensor[opt] = a, c
    return per_byte, per_tensor


def _optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer behind each name in OPTIMIZER_STATE (lr is irrelevant to cost)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)
