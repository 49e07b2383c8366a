"""A cached profile re-checked before it is trusted: a few of its ops timed again, in well under
a second.

When a profile is measured, the ops of its graph with the most forward FLOPs
(:func:`reference_nodes`) are also timed in this process, one at a time on inputs of their
shapes, just before and just after its runs: their wall time over the profile's times for
them is the profile's :class:`Reference`. When the cached profile is about to be used, the
same ops are timed again (:func:`drift`), by wall time and by the processor time they get,
which other processes taking the core away do not stretch. On the same host, quiet, both
ratios are the reference's; a profile measured while other processes kept its ranks waiting
(its times and the reference's wall times stretched alike) and used on a quiet host, a host
that became slower or faster, or times changed in the file make both differ. Beyond
:data:`RECHECK_TOLERANCE` the profile is measured again
(:func:`explorer.profiling.ops.measured`). A profile measured quiet holds on a busy host (by
processor time), and one measured busy holds while the host is as busy (by wall time):
measuring it again then would be no better.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from explorer.core.graph import OpGraph
from explorer.costs.model import DeviceCosts
from explorer.devices.cluster import Device
from explorer.platforms.load import ShareMeter

#: how many ops of a graph the re-check times: those with the most forward FLOPs
RECHECK_OPS = 4
#: the wall time one look at those ops may take, all of them together
RECHECK_BUDGET_S = 0.1
#: a cached profile whose ops now take this many times more or less (relative to the profile's
#: times for them) than when it was measured is measured again. A quiet host repeats the
#: look within a few per cent; a profile taken while other processes shared the ranks' cores
#: is off by their share (the issue this guards against was 1.7x)
RECHECK_TOLERANCE = 1.5


@dataclass(frozen=True)
class Reference:
    """What a cached profile is re-checked against."""

    #: the graph's nodes timed (indices)
    nodes: tuple[int, ...]
    #: their wall seconds in this process when the profile was measured, over the profile's
    #: forward seconds for them
    ratio: float

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "ratio": self.ratio}


@dataclass(frozen=True)
class Look:
    """One timing of the reference ops: per op, wall and processor seconds per call."""

    wall_s: tuple[float, ...]
    cpu_s: tuple[float, ...]


def reference_nodes(graph: OpGraph, k: int = RECHECK_OPS) -> tuple[int, ...]:
    """The ``k`` ops of ``graph`` with the most forward FLOPs that can be timed alone (an
    export-captured graph with its runtime), in graph order; () when none can."""
    rt = graph.runtime
    if rt is None or graph.source != "export" or not rt.fx_nodes:
        return ()
    ops = [i for i, n in enumerate(graph.nodes)
           if n.kind == "op" and n.fwd_flops > 0 and n.name in rt.fx_nodes]
    return tuple(sorted(sorted(ops, key=lambda i: -graph.nodes[i].fwd_flops)[:k]))


def _value(graph: OpGraph, name: str, device: str) -> torch.Tensor:
    """A tensor standing in for node ``name``'s output: its parameter or buffer where it is
    one, else random numbers (zeros for integers: valid indices) of its shape and dtype."""
    rt = graph.runtime
    if name in rt.state:
        return rt.state[name].detach().to(device)
    n = graph[name]
    dtype = getattr(torch, n.dtype, torch.float32)
    shape = n.shapes[0] if n.shapes else ()
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _call(graph: OpGraph, i: int, device: str) -> Callable[[], Any]:
    """Node ``i``'s op as a function of no arguments, on stand-in inputs."""
    rt = graph.runtime
    fx = rt.fx_nodes[graph.nodes[i].name]
    env = {rt.names[a]: _value(graph, rt.names[a], device)
           for a in fx.all_input_nodes if a in rt.names}
    args, kwargs = rt.resolve(fx, env)
    return lambda: fx.target(*args, **kwargs)


def look(graph: OpGraph, dev: Device, nodes: tuple[int, ...],
         meter: ShareMeter | None = None, budget_s: float = RECHECK_BUDGET_S) -> Look | None:
    """Time the ops ``nodes`` of ``graph`` once each on ``dev`` (present) in this process, on
    one thread, in about ``budget_s`` in all; their wall time also goes to ``meter``. None
    when there are none, or one of them cannot run alone."""
    if not nodes:
        return None
    device = dev.torch_device or "cpu"
    sync = (lambda: torch.cuda.synchronize(device)) if dev.kind == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as CPU ranks run
    try:
        with torch.no_grad():
            calls = [_call(graph, i, device) for i in nodes]
            wall, cpu = [], []
            for fn in calls:
                t0 = time.perf_counter()
                fn()  # warm-up, and the time of one call
                sync()
                once = max(time.perf_counter() - t0, 1e-7)
                reps = max(1, min(1000, int(budget_s / len(calls) / once)))
                samples = 3 if reps >= 3 else 1  # medians of three where there is time
                walls, cpus = [], []
                for _ in range(samples):
                    with meter or ShareMeter():
                        w0, c0 = time.perf_counter(), time.thread_time()
                        for _ in range(reps // samples):
                            fn()
                        sync()
                        walls.append((time.perf_counter() - w0) / (reps // samples))
                        cpus.append((time.thread_time() - c0) / (reps // samples))
                wall.append(statistics.median(walls))
                cpu.append(statistics.median(cpus))
    except Exception:  # (an op that needs inputs of its own: no re-check, not an error)
        return None
    finally:
        torch.set_num_threads(threads)
    return Look(tuple(wall), tuple(cpu))


def reference(dc: DeviceCosts, nodes: tuple[int, ...], looks: list[Look | None]
              ) -> Reference | None:
    """The reference of the profile ``dc`` from ``looks`` at its ops ``nodes`` taken while it
    was measured (their mean wall time); None when there is none or the profile gives them
    no time."""
    got = [lk for lk in looks if lk is not None]
    profiled = sum(dc.fwd_s[i] for i in nodes)
    if not got or profiled <= 0.0:
        return None
    wall = statistics.fmean(sum(lk.wall_s) for lk in got)
    return Reference(nodes, wall / profiled)


@dataclass(frozen=True)
class Drift:
    """How many times longer a cached profile's reference ops take now than its
    :class:`Reference` says they did (1.0: as measured): by wall time, and by the processor
    time they get, which others taking the core away do not stretch."""

    wall: float
    cpu: float

    @property
    def holds(self) -> bool:
        """Whether the profile still holds: its ops take what it says, within
        :data:`RECHECK_TOLERANCE`, on this host as it is now (wall time: as busy as when it
        was measured) or on this host quiet (processor time: it was measured quiet)."""
        return any(1.0 / RECHECK_TOLERANCE <= f <= RECHECK_TOLERANCE
                   for f in (self.wall, self.cpu))

    def describe(self) -> str:
        """In words, e.g. "2.6x faster"."""
        f = self.cpu
        return f"{1 / f:.1f}x faster" if f < 1 else f"{f:.1f}x slower"


def drift(graph: OpGraph, dev: Device, dc: DeviceCosts, ref: Reference,
          budget_s: float = RECHECK_BUDGET_S) -> Drift | None:
    """How the cached profile ``dc``'s reference ops take on ``dev`` now, against its
    :class:`Reference` (:class:`Drift`); None when they cannot be timed."""
    profiled = sum(dc.fwd_s[i] for i in ref.nodes)
    now = look(graph, dev, ref.nodes, budget_s=budget_s)
    if now is None or profiled <= 0.0 or ref.ratio <= 0.0:
        return None
    return Drift(sum(now.wall_s) / profiled / ref.ratio, sum(now.cpu_s) / profiled / ref.ratio)
