"""Per-op host and device times from a ``torch.profiler`` (kineto) trace.

A GPU runs asynchronously: the host issues an op (its dispatch, the kernel launches), the
device runs its kernels later. A trace records both: each op the host ran (``cpu_op``
events, nested: ``aten::linear`` holds the ``aten::addmm`` it called), each launch the host
made (``cuda_runtime`` / ``cuda_driver`` events, inside the op that made it) and each kernel
or copy the device ran (``kernel``, ``gpu_memcpy``, ``gpu_memset``), a launch and its kernel
sharing a ``correlation`` id. The backward runs on autograd's threads as
``autograd::engine::evaluate_function: ...`` events whose ``Sequence number`` is that of the
forward op that made the autograd node.

:func:`op_timings` reads a trace (as :meth:`torch.profiler.profile.export_chrome_trace`
writes it) into one :class:`OpTiming` per top-level forward op of a thread, in the order the
host ran them: its host interval, its kernels' device time, and the same for its backward.
:func:`match_graph` pairs them with a captured graph's ops by name, in order: what a profile
of a real run needs to price each op on both timelines. On CPU ranks there are no kernels:
the host time is the op's time and the device time is zero.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.costs.model import DeviceCosts

__all__ = ["DEVICE_CATEGORIES", "LAUNCH_CATEGORIES", "OpTiming", "TraceError", "dispatched",
           "match_graph", "op_timings", "profiler_name", "timeline_costs"]

#: the categories of what a device runs, and of the host's launches that start them
DEVICE_CATEGORIES = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
LAUNCH_CATEGORIES = frozenset(("cuda_runtime", "cuda_driver"))
#: the prefix of the events autograd's engine records for each backward node
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
US = 1e-6  # a trace's times are in microseconds


class TraceError(ExplorerError):
    """A trace that is not a torch.profiler trace, or that does not run the graph's ops."""


@dataclass(frozen=True)
class OpTiming:
    """One top-level forward op of a trace, as the host and the device ran it."""

    #: the profiler's name (``aten::linear``)
    name: str
    #: the op's interval on the host (its dispatch and launches; on a CPU rank, its work)
    host_s: float
    #: the summed time of the kernels and copies it launched, and how many there were
    device_s: float
    kernels: int
    #: from the op's start on the host to its last kernel's end (``host_s`` without kernels)
    span_s: float
    #: its backward (every autograd node the op made): host and device time
    backward_host_s: float = 0.0
    backward_device_s: float = 0.0


@dataclass
class _Event:
    name: str
    category: str
    thread: Any
    start: float
    end: float
    args: Mapping[str, Any]

    def holds(self, other: _Event) -> bool:
        return self.start <= other.start and other.end <= self.end


def op_timings(trace: Mapping[str, Any] | str | Path) -> list[OpTiming]:
    """The top-level forward ops of ``trace`` (a trace's dict, or the path of its JSON file),
    in the order the host started them, with their kernels and backward."""
    events = _events(_load(trace))
    host = [e for e in events if e.category == "cpu_op"]
    launches = [e for e in events if e.category in LAUNCH_CATEGORIES]
    device = {e.args.get("correlation"): e for e in events if e.category in DEVICE_CATEGORIES}
    backward = [e for e in host if e.name.startswith(BACKWARD_PREFIX)]
    forward_tops = [e for e in _top_level(host) if not e.name.startswith(BACKWARD_PREFIX)]
    sequence_of = _sequence_owner(forward_tops, host)
    kernels_of = _kernels_by_holder(forward_tops + backward, launches, device)
    backward_of: dict[int, list[_Event]] = {}
    for event in backward:
        owner = sequence_of.get(event.args.get("Sequence number"))
        if owner is not None:
            backward_of.setdefault(owner, []).append(event)
    out = []
    for k, op in enumerate(forward_tops):
        kernels = kernels_of.get(id(op), [])
        back = backward_of.get(k, [])
        out.append(OpTiming(
            name=op.name, host_s=(op.end - op.start) * US,
            device_s=sum(e.end - e.start for e in kernels) * US, kernels=len(kernels),
            span_s=(max([op.end] + [e.end for e in kernels]) - op.start) * US,
            backward_host_s=sum(e.end - e.start for e in back) * US,
            backward_device_s=sum(e.end - e.start for b in back
                                  for e in kernels_of.get(id(b), [])) * US))
    return out


def profiler_name(op: str) -> str:
    """A graph op's name as the profiler records it: ``aten.linear.default`` ->
    ``aten::linear``."""
    namespace, _, rest = op.partition(".")
    return f"{namespace}::{rest.split('.')[0]}"


def dispatched(op: str) -> bool:
    """Whether a graph op runs as an ATen op the profiler records: not Python's item access
    into a tuple (``getitem``) nor a symbolic size (``aten.sym_size.int``), which an eager run
    computes without dispatching."""
    return op.startswith("aten.") and not op.startswith("aten.sym_")


def match_graph(timings: Sequence[OpTiming], graph: OpGraph) -> dict[str, OpTiming]:
    """Each op of ``graph`` the profiler records (:func:`dispatched`) with the timing of the
    trace's op it ran as, pairing them by name in order (ops the trace holds and the graph
    does not, such as the loss's gradient seed, are passed over). :class:`TraceError` names
    the first graph op the trace does not run."""
    out: dict[str, OpTiming] = {}
    k = 0
    for node in graph.nodes:
        if node.kind != "op" or not dispatched(node.op):
            continue
        want = profiler_name(node.op)
        while k < len(timings) and timings[k].name != want:
            k += 1
        if k == len(timings):
            raise TraceError(
                f"the trace runs no {want} for op {node.name!r} after the {len(out)} ops "
                "before it: profile a run of this graph (the same model, batch and plan)")
        out[node.name] = timings[k]
        k += 1
    return out


def timeline_costs(graph: OpGraph, matched: Mapping[str, OpTiming], type_key: str,
                   base: DeviceCosts | None = None) -> DeviceCosts:
    """A device's costs on two timelines from a traced step's ops (:func:`match_graph`): each
    op's kernels' device time as its ``fwd_s``/``bwd_s`` and its host interval as its
    ``host_s``, forward and backward; ops the trace does not record (views the profiler does
    not see, ``getitem``) cost nothing on either. The rest (optimizer, workspace, fractions
    of the batch) comes from ``base`` where given, whose per-fraction tables are dropped:
    the trace is of the whole batch."""
    n = len(graph)
    fwd, bwd, host_f, host_b = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    source = ["free" if node.kind != "op" else "measured" for node in graph.nodes]
    for i, node in enumerate(graph.nodes):
        t = matched.get(node.name)
        if t is None:
            continue
        fwd[i], host_f[i] = t.device_s, t.host_s
        if node.requires_grad:
            bwd[i], host_b[i] = t.backward_device_s, t.backward_host_s
    floor = min((t.device_s for t in matched.values() if t.kernels), default=0.0)
    if base is None:
        return DeviceCosts(type_key, fwd, bwd, source, floor, host_s=[host_f, host_b])
    return replace(base, type_key=type_key, fwd_s=fwd, bwd_s=bwd, source=source,
                   overhead_s=floor, fractions=[], fwd_at=[], bwd_at=[], precision_s={},
                   op_path_extra_s=[], host_s=[host_f, host_b])


# -- reading -----------------------------------------------------------------------------------
def _load(trace: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    if isinstance(trace, Mapping):
        return trace
    try:
        loaded = json.loads(Path(trace).read_text())
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read the trace {trace}: {exc}") from exc
    if not isinstance(loaded, Mapping):
        raise TraceError(f"{trace} is not a torch.profiler trace (no traceEvents)")
    return loaded


def _events(trace: Mapping[str, Any]) -> list[_Event]:
    raw = trace.get("traceEvents")
    if not isinstance(raw, list):
        raise TraceError("not a torch.profiler trace: it has no traceEvents list (write it "
                         "with prof.export_chrome_trace(path))")
    events = []
    for e in raw:
        if not isinstance(e, Mapping) or e.get("ph") != "X":
            continue
        try:
            start, length = float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        events.append(_Event(str(e.get("name", "")), str(e.get("cat", "")),
                             (e.get("pid"), e.get("tid")), start, start + length,
                             e.get("args") or {}))
    events.sort(key=lambda e: (e.start, -e.end))
    return events


def _top_level(events: Iterable[_Event]) -> list[_Event]:
    """The events no other event of their thread holds, in order of their start."""
    open_by_thread: dict[Any, _Event] = {}
    tops = []
    for e in events:  # (sorted by start, the longer first)
        holder = open_by_thread.get(e.thread)
        if holder is not None and holder.holds(e):
            continue
        open_by_thread[e.thread] = e
        tops.append(e)
    return tops


class _Holders:
    """Events of each thread that may hold others, found by time (they do not overlap)."""

    def __init__(self, events: Iterable[_Event]) -> None:
        self.by_thread: dict[Any, list[_Event]] = {}
        for e in events:
            self.by_thread.setdefault(e.thread, []).append(e)
        for held in self.by_thread.values():
            held.sort(key=lambda e: e.start)
        self.starts = {t: [e.start for e in held] for t, held in self.by_thread.items()}

    def of(self, event: _Event) -> _Event | None:
        """The event holding ``event`` on its thread, if any."""
        k = bisect_right(self.starts.get(event.thread, []), event.start) - 1
        if k < 0:
            return None
        holder = self.by_thread[event.thread][k]
        return holder if holder.holds(event) else None


def _sequence_owner(tops: Sequence[_Event], host: Sequence[_Event]) -> dict[Any, int]:
    """Sequence number -> the index of the top-level op holding the op that made that
    autograd node (the number the backward's events carry)."""
    index = {id(t): k for k, t in enumerate(tops)}
    holders = _Holders(tops)
    owner: dict[Any, int] = {}
    for e in host:
        if "Sequence number" not in e.args or e.name.startswith(BACKWARD_PREFIX):
            continue
        top = holders.of(e)
        if top is not None:
            owner.setdefault(e.args["Sequence number"], index[id(top)])
    return owner


def _kernels_by_holder(holders: Sequence[_Event], launches: Sequence[_Event],
                       device: Mapping[Any, _Event]) -> dict[int, list[_Event]]:
    """id(holder) -> the kernels and copies launched inside it."""
    found = _Holders(holders)
    out: dict[int, list[_Event]] = {}
    for launch in launches:
        kernel = device.get(launch.args.get("correlation"))
        holder = found.of(launch) if kernel is not None else None
        if holder is not None:
            out.setdefault(id(holder), []).append(kernel)
    return out
