"""The profiler: measure each node's forward and backward seconds on the devices that are here.

Each op of the captured graph is replayed on its real inputs (recorded by running the graph
once), after warm-up, as the median of several repeats; the backward is timed with
``torch.autograd.grad(..., retain_graph=True)`` on the op alone. CPU ranks are measured with
one thread, as they run. Devices that are not present get a roofline estimate. Profiles are
cached per graph fingerprint and device type.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.fx.node import map_aggregate
from tqdm.auto import tqdm

from explorer.capture import CaptureRuntime, _tensors
from explorer.cluster import Cluster, Device
from explorer.costs import OPTIMIZER_STATE, CostModel, DeviceCosts, roofline
from explorer.errors import ExplorerError
from explorer.graph import OpGraph

PROFILE_VERSION = 1


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partition-explorer" / "profiles"


def profile(graph: OpGraph, cluster: Cluster, repeats: int = 5, warmup: int = 2,
            cache: bool = True, progress: bool = True) -> CostModel:
    """Measure or estimate what every node of ``graph`` costs on every device of ``cluster``.

    Devices that are present (this machine's CPU ranks, its GPUs) are measured; others get a
    roofline estimate from their datasheet numbers. Results are cached per graph fingerprint and
    device type in ``~/.cache/partition-explorer/profiles``; ``cache=False`` measures afresh.
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
        path = cache_dir() / f"{graph.fingerprint}-{_slug(dev.type_key)}-r{repeats}.json"
        dc = _load(path) if cache else None
        if dc is None:
            dc = measure(graph, dev, repeats, warmup, progress)
            if cache:
                _store(path, dc)
        per_type[dev.type_key] = dc
    return CostModel(graph.fingerprint, cluster, per_type)


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
                                   **dc.__dict__}))
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


def measure(graph: OpGraph, dev: Device, repeats: int = 5, warmup: int = 2,
            progress: bool = True) -> DeviceCosts:
    """Time every op of ``graph`` on ``dev`` (which must be present)."""
    rt: CaptureRuntime = graph.runtime
    sync = _sync(dev)
    with device_threads(dev), torch.random.fork_rng(devices=[]):
        if graph.source == "hooks":
            fwd, bwd = _measure_modules(graph, dev, repeats, warmup)
        else:
            fwd, bwd = _measure_ops(graph, rt, dev, sync, repeats, warmup, progress)
        tiny = torch.zeros(1, device=dev.torch_device)
        overhead = _time(lambda: torch.add(tiny, 1.0), sync, max(repeats, 20), warmup)
        per_byte, per_tensor = _measure_optimizers(dev, sync)
    src = ["measured" if n.kind == "op" else "free" for n in graph.nodes]
    return DeviceCosts(dev.type_key, fwd, bwd, src, overhead, per_byte, per_tensor)


def _measure_ops(graph: OpGraph, rt: CaptureRuntime, dev: Device, sync, repeats: int,
                 warmup: int, progress: bool) -> tuple[list[float], list[float]]:
    values = rt.values(dev.torch_device)
    names = {v: k for k, v in rt.fx_nodes.items()}
    grad_of = {n.name: n.requires_grad for n in graph.nodes}
    fwd = [0.0] * len(graph)
    bwd = [0.0] * len(graph)
    ops = [i for i, n in enumerate(graph.nodes) if n.kind == "op"]
    bar = tqdm(ops, desc=f"profiling on {dev.id}", unit="op", disable=not progress,
               leave=False)
    for i in bar:
        node = graph.nodes[i]
        fx = rt.fx_nodes[node.name]
        leaves: list[torch.Tensor] = []

        def arg(a: Any, leaves=leaves) -> Any:
            if not isinstance(a, torch.fx.Node):
                return a
            nm = names[a]

            def make(v: Any) -> Any:
                if not isinstance(v, torch.Tensor):
                    return v
                t = v.detach()
                if grad_of[nm] and t.is_floating_point():
                    t = t.clone().requires_grad_(True)
                    leaves.append(t)
                return t

            return map_aggregate(values[nm], make)

        args, kwargs = map_aggregate(fx.args, arg), map_aggregate(fx.kwargs, arg)
        target = fx.target
        with torch.no_grad():
            fwd[i] = _time(lambda: target(*args, **kwargs), sync, repeats, warmup)
        if node.requires_grad and leaves:
            outs = [t for t in _tensors(target(*args, **kwargs)) if t.requires_grad]
            if outs:
                grads = [torch.ones_like(t) for t in outs]
                bwd[i] = _time(lambda outs=outs, grads=grads: torch.autograd.grad(
                    outs, leaves, grads, retain_graph=True, allow_unused=True),
                    sync, repeats, warmup)
    return fwd, bwd


def _measure_modules(graph: OpGraph, dev: Device, repeats: int,
                     warmup: int) -> tuple[list[float], list[float]]:
    """Hook-captured graphs: time each leaf-module call in real forward and backward passes."""
    rt: CaptureRuntime = graph.runtime
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
    try:
        for k in range(warmup + repeats):
            record["on"] = k >= warmup
            calls.clear()
            names_of.clear()
            loss = step(*args)
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
        step.model.zero_grad(set_to_none=True)
        rt.step.to("cpu")
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
