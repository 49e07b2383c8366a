"""The profiler: measure each node's forward and backward seconds on the devices that are here.

Graphs captured with torch.export run a few real training steps through the runtime
(:mod:`explorer.runtime.worker`) on one rank, at the whole batch and at a half and a quarter of it,
and each op's forward and backward is timed there, after warm-up, as it runs in a real step.
Hook-captured graphs time each leaf module in real forward and backward passes. CPU ranks
are measured with one thread, as they run. Devices that are not present get a roofline
estimate. Profiles are cached per graph fingerprint and device type.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from explorer.capture.tracing import CaptureRuntime, batch_splits, keep_buffers, training_mode
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE
from explorer.costs.model import CostModel, DeviceCosts, roofline
from explorer.devices.cluster import Cluster, Device, rank_settings_tag

# 2: ops timed through the runtime; 3: also at fractions of the batch; 4: op medians scaled
# to the median step; 5: the replicas' spread measured with the contention; 6: CPU ranks
# pinned to cores; 7: ranks keep the memory they free (glibc's allocator), and the optimizer
# step's contention is measured
PROFILE_VERSION = 7
#: steps timed in each run of the profile (after the warm-up). A run costs 2-3 s to start
#: its processes, and its steps only 40-90 ms each on the built-in models: on the 2-core
#: machine this was measured on, 15 steps instead of 5 cut how far four profiles of the
#: same model apart predict one step (their coefficient of variation) from 2.6-8.9 % to
#: 0.8-5.0 % for 6-8 s more per profile (``python benchmarks/profile_repeat.py``,
#: 2026-11-25), about what doubling ``ROUNDS`` did for 27-30 s more.
REPEATS = 15
#: micro-batch counts profiled besides the whole batch (times at 1/2 and 1/4 of the batch)
FRACTION_SPLITS = (2, 4)
#: how many times each of those runs is made, in turn; an op's time is its mean over them.
#: A shared host's speed wanders by 5-10 % over seconds: on the 2-core machine this was
#: measured on, averaging two runs a few seconds apart cut the spread of the whole-batch
#: step total by a third to two-thirds (eight runs each of two models, averaged in pairs).
ROUNDS = 2
#: how many times the contention pair (one rank alone, two ranks at once) is run, in turn
CONTENTION_ROUNDS = 2


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partition-explorer" / "profiles"


def profile(graph: OpGraph, cluster: Cluster, repeats: int = REPEATS, warmup: int = 2,
            cache: bool = True, progress: bool = True, message: bool = True) -> CostModel:
    """Measure or estimate what every node of ``graph`` costs on every device of ``cluster``.

    Devices that are present (this machine's CPU ranks, its GPUs) are measured; others get a
    roofline estimate from their datasheet numbers. Results are cached per graph fingerprint and
    device type in ``~/.cache/partition-explorer/profiles``; ``cache=False`` measures afresh.
    With two or more measured CPU ranks (and ``message``), the processor time each tensor
    sent between ranks costs is measured once per host
    (:mod:`explorer.profiling.message_probe`) and set as
    ``message_s``; and how much each op slows while another rank of the host runs it too, as
    replicas do (:func:`measure_contention`, stored with the profile). Both are host
    measurements: not taken for ``Cluster.cpu(n, measure=False)``.
    """
    if repeats < 1 or warmup < 0:
        raise ExplorerError("repeats must be >= 1 and warmup >= 0")
    per_type: dict[str, DeviceCosts] = {}
    for dev in cluster.devices:
        if dev.type_key in per_type:
            continue
        if not dev.present or graph.runtime is None:
            per_type[dev.type_key] = roofline(graph, dev)
            continue
        pin = rank_settings_tag() if dev.kind == "cpu" else ""
        path = cache_dir() / f"{graph.fingerprint}-{_slug(dev.type_key)}-r{repeats}{pin}.json"
        dc = _load(path) if cache else None
        fresh = dc is None
        if dc is None:
            dc = measure(graph, dev, repeats, warmup, progress)
        ranks = [d for d in cluster.devices if d.present and d.type_key == dev.type_key]
        if not dc.contention and len(ranks) >= 2 and dev.kind == "cpu" \
                and cluster.default_link.source.startswith("measured") \
                and graph.source == "export" and batch_splits(graph) \
                and graph.batch_size % 2 == 0:
            try:
                dc.contention, dc.replica_spread, dc.optimizer_contention = \
                    measure_contention(graph, ranks[:2], repeats, warmup, progress)
                fresh = True
            except ExplorerError as exc:  # e.g. two copies do not fit: the op times stand
                warnings.warn(f"could not measure how CPU ranks of this host slow each other "
                              f"({exc}); predictions leave it out", stacklevel=2)
        if cache and fresh:
            _store(path, dc)
        per_type[dev.type_key] = dc
    message_s = 0.0
    if message and graph.runtime is not None:
        from explorer.profiling.message_probe import cpu_message_s

        message_s = cpu_message_s(cluster)
    return CostModel(graph.fingerprint, cluster, per_type, message_s=message_s)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80]


def _load(path: Path) -> DeviceCosts | None:
    try:
        d = json.loads(path.read_text())
        if d.pop("version", None) != PROFILE_VERSION or d.pop("torch") != torch.__version__:
            return None
        return DeviceCosts(**d)
    except (OSError, ValueError, TypeError, KeyError):
        return None  # a missing or damaged cache entry is simply measured again


def _store(path: Path, dc: DeviceCosts) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": PROFILE_VERSION, "torch": torch.__version__,
                                   **asdict(dc)}))  # the fields, not cached arrays
        tmp.replace(path)
    except OSError:
        pass  # caching is a convenience; a read-only home must not stop profiling


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
            progress: bool = True) -> DeviceCosts:
    """Time every op of ``graph`` on ``dev`` (which must be present).

    Export-captured graphs run through the real runtime (:mod:`explorer.runtime.worker`) on one
    rank, so each op's forward and backward are timed exactly as a real run executes them,
    bookkeeping included; the optimizer step is timed the same way. Each of those runs (the
    whole batch, a half, a quarter) is made ``ROUNDS`` times in turn. Hook-captured graphs time
    each leaf-module call in real forward and backward passes.
    """
    sync = _sync(dev)
    with device_threads(dev), torch.random.fork_rng(devices=[]):
        per_byte, per_tensor = _measure_optimizers(dev, sync)
        tiny = torch.zeros(1, device=dev.torch_device)
        floor = _time(lambda: torch.add(tiny, 1.0), sync, max(repeats, 20), warmup)
        if graph.source == "hooks":
            fwd, bwd = _measure_modules(graph, dev, repeats, warmup)
        else:
            # the whole batch, then the same ops on a half and a quarter of it (micro-batches
            # and replicas run there, and small ops do not shrink in proportion)
            splits = [1] + [m for m in FRACTION_SPLITS if batch_splits(graph)
                            and graph.batch_size % m == 0]
            bar = tqdm(total=ROUNDS * len(splits), unit="run", disable=not progress,
                       desc=f"profiling {graph.name} on {dev.id}", leave=False)
            got: dict[int, list[tuple[list[float], list[float], float]]] = {}
            for _ in range(ROUNDS):  # in turn, so a slow spell of the host hits every split
                for m in splits:
                    got.setdefault(m, []).append(_measure_in_runtime(
                        graph, dev, repeats, warmup, False, micro_batches=m))
                    bar.update()
            bar.close()
            fwd, bwd, opt_s = _mean_of_rounds(got[1])
            fractions, fwd_at, bwd_at = [], [], []
            for m in splits[1:]:
                f, b, _ = _mean_of_rounds(got[m])
                fractions.append(1.0 / m)
                fwd_at.append(_at_most(f, fwd_at[-1] if fwd_at else fwd))
                bwd_at.append(_at_most(b, bwd_at[-1] if bwd_at else bwd))
            # scale the optimizer micro-benchmark to what the real step measured
            pbytes = sum(n.param_bytes for n in graph.nodes if n.kind == "param")
            ntens = sum(1 for n in graph.nodes if n.kind == "param")
            model = per_byte["adam"] * pbytes + per_tensor["adam"] * ntens
            if model > 0 and opt_s > 0:
                k = opt_s / model
                per_byte = {o: v * k for o, v in per_byte.items()}
                per_tensor = {o: v * k for o, v in per_tensor.items()}
    op_times = sorted(t for t, n in zip(fwd, graph.nodes, strict=True) if n.kind == "op" and t)
    overhead = max(floor, op_times[0]) if op_times else floor
    src = ["measured" if n.kind == "op" else "free" for n in graph.nodes]
    if graph.source == "hooks":
        return DeviceCosts(dev.type_key, fwd, bwd, src, overhead, per_byte, per_tensor)
    return DeviceCosts(dev.type_key, fwd, bwd, src, overhead, per_byte, per_tensor,
                       fractions, fwd_at, bwd_at)


def measure_contention(graph: OpGraph, ranks: list[Device], repeats: int = REPEATS,
                       warmup: int = 2, progress: bool = True, rounds: int | None = None
                       ) -> tuple[list[float], float, float]:
    """Per node: how much slower its forward + backward ran while another rank of this host
    ran the same work at the same time, than alone (1.0: no slower); the replicas'
    spread (``DeviceCosts.replica_spread``): the mean over the two-rank steps of how far the
    busier rank's busy time was above the two ranks' mean, as a fraction of that mean; and
    how much slower the optimizer step ran beside the other replica's than alone
    (``DeviceCosts.optimizer_contention``: both step every parameter at the same moment;
    on the 2-core host this was measured on, Adam is bound by memory bandwidth and slowed
    20-40 %).

    CPU ranks of one host share its memory bandwidth and caches, and (in a virtual machine)
    often more: on some hosts two ranks computing at once each run 20-50 % slower on
    small-op work than one alone, while large matrix products do not slow at all. Measured
    back to back, on half the batch each, ``rounds`` times in turn: one rank alone with the
    batch in two micro-batches, then two ranks data-parallel; per op, the summed times. Each
    op's time is the runtime's own per-op timing, waits excluded, so the all-reduce at the end
    of the backward does not count.
    """
    from explorer.core.plan import Plan
    from explorer.runtime.launch import run

    rounds = CONTENTION_ROUNDS if rounds is None else rounds
    a, b = ranks[0], ranks[1]
    override = {a.id: a.torch_device or "cpu", b.id: b.torch_device or "cpu"}
    single = Plan.single(graph, a.id, optimizer="adam", micro_batches=2)
    pair = Plan.from_assignment(graph, [[a.id, b.id]], dict.fromkeys(range(len(graph)), 0),
                                algorithm="data-parallel", optimizer="adam")
    solos, boths = [], []
    bar = tqdm(total=2 * rounds, desc=f"contention of {graph.name} on {a.id}+{b.id}",
               unit="run", disable=not progress, leave=False)
    for _ in range(rounds):  # in turn, so a burst of load on the host hits both sides
        solos.append(run(graph, plan=single, steps=repeats, warmup=warmup, progress=False,
                         timeout_s=600.0, device_override={a.id: override[a.id]}))
        bar.update()
        boths.append(run(graph, plan=pair, steps=repeats, warmup=warmup, progress=False,
                         timeout_s=600.0, device_override=override))
        bar.update()
    bar.close()

    def total(ms: list[Any], i: int) -> float:
        return sum(m.task_s.get(f"fwd:{i}", 0.0) + m.task_s.get(f"bwd:{i}", 0.0) for m in ms)

    alone = [total(solos, i) for i in range(len(graph))]
    shared = [total(boths, i) for i in range(len(graph))]
    whole = sum(shared) / sum(alone) if sum(alone) > 0 else 1.0
    spread = [max(step) / statistics.fmean(step) - 1.0 for m in boths
              for step in zip(*m.busy_samples_s.values(), strict=True) if min(step) > 0]
    def ratio(s: float, t: float, otherwise: float) -> float:
        # a ratio of two medians of one small op is noisy: bound it
        return min(max(s / t, 0.5), 4.0) if t > 0 and s > 0 else otherwise

    opt = [sum(m.task_s.get("optimizer:-1", 0.0) for m in ms) for ms in (boths, solos)]
    # the whole model's ratio where an op took no measurable time alone
    return ([ratio(s, t, whole) for s, t in zip(shared, alone, strict=True)],
            statistics.fmean(spread) if spread else 0.0, ratio(*opt, 1.0))


def _mean_of_rounds(rounds: list[tuple[list[float], list[float], float]]
                    ) -> tuple[list[float], list[float], float]:
    """Per op, the mean over the rounds (each op's times from one run)."""
    fwd = [statistics.fmean(x) for x in zip(*(r[0] for r in rounds), strict=True)]
    bwd = [statistics.fmean(x) for x in zip(*(r[1] for r in rounds), strict=True)]
    return fwd, bwd, statistics.fmean(r[2] for r in rounds)


def _at_most(times: list[float], bigger: list[float]) -> list[float]:
    """A smaller share of the batch never takes longer: clip timing noise to that."""
    return [min(t, b) if b > 0 else t for t, b in zip(times, bigger, strict=True)]


def _measure_in_runtime(graph: OpGraph, dev: Device, repeats: int, warmup: int,
                        progress: bool, micro_batches: int = 1
                        ) -> tuple[list[float], list[float], float]:
    """Per-op forward/backward seconds and the optimizer step, from real steps on one rank:
    each op's median over steps and micro-batches, scaled so that together they make the
    median step's busy time."""
    from explorer.core.plan import Plan
    from explorer.runtime.launch import run

    plan = Plan.single(graph, dev.id, optimizer="adam", micro_batches=micro_batches)
    meas = run(graph, plan=plan, steps=repeats, warmup=warmup, progress=progress,
               device_override={dev.id: dev.torch_device or "cpu"}, timeout_s=600.0)
    task = meas.task_s
    fwd = [task.get(f"fwd:{i}", 0.0) for i in range(len(graph))]
    bwd = [task.get(f"bwd:{i}", 0.0) for i in range(len(graph))]
    opt = task.get("optimizer:-1", 0.0)
    # An op's median leaves out its occasional slow repeat (the processor taken away for a
    # moment, an interrupt), but every step pays for the ones that land in it: the medians
    # add up to 1-3 % less than a median step's busy time on this kind of host. Scale them
    # to add up to it, so a prediction of this very plan has the busy time it measured.
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
