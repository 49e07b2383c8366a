"""What a CPU rank of this host can do: compute and copy speed, the gloo link between two ranks.

Measured once per host, torch version and rank settings, and kept in the host measurement cache
(:mod:`explorer.platforms.cpu.host_cache`); nominal numbers stand in when nothing is measured.
:func:`host_profile` gives the figures :meth:`explorer.devices.Cluster.cpu` builds its devices
and link from.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

from explorer.platforms.cpu import gloo_probe
from explorer.platforms.cpu.host_cache import (
    cache_file,
    cache_key,
    finite_number,
    read_cache,
    warn_damaged,
    write_cache,
)
from explorer.platforms.load import HostLoad
from explorer.platforms.net import free_port, loopback_ifname

#: nominal power of one busy / idle CPU core running one rank (no portable way to measure it)
CPU_CORE_POWER_W = 15.0
CPU_CORE_IDLE_POWER_W = 3.0
#: nominal numbers for a CPU rank when nothing is measured
CPU_NOMINAL_FLOPS_PER_S = 50e9
CPU_NOMINAL_MEM_BANDWIDTH_BYTES_PER_S = 10e9
GLOO_NOMINAL_LATENCY_S = 50e-6
GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S = 1e9
#: hard limit on the gloo link measurement; past it the children are killed
LINK_MEASURE_TIMEOUT_S = 15.0
#: how many times the host's link is probed (fresh processes each time); each figure is the
#: median. The link is cached for good, and a single probe on a shared host can come out
#: well off the host's usual figures, which would bias every data-parallel prediction there
LINK_PROBES = 3

#: a profile whose timing loops got less of a core than this was kept waiting by other
#: processes: CPU ranks, one per core, then shared their cores too (a loop that computes
#: without pause gets all of its core when no other process wants it)
BUSY_CPU_SHARE = 0.8

CPU_RANK_NAME = "CPU rank (1 thread)"
CPU_POWER_NOTE = (
    f"power nominal {CPU_CORE_POWER_W:g} W per busy core, {CPU_CORE_IDLE_POWER_W:g} W idle"
)

#: the figures a host profile holds, each a positive number
PROFILE_KEYS = (
    "flops_per_s",
    "mem_bandwidth_bytes_per_s",
    "link_latency_s",
    "link_bandwidth_bytes_per_s",
    "allreduce_latency_s",
    "allreduce_bandwidth_bytes_per_s",
    "reduce_scatter_latency_s",
    "reduce_scatter_bandwidth_bytes_per_s",
    "allgather_latency_s",
    "allgather_bandwidth_bytes_per_s",
)
#: the collectives the link probe times as a whole besides send/recv (a host profile's
#: ``<name>_latency_s`` and ``<name>_bandwidth_bytes_per_s``; the probe's keys)
COLLECTIVES = (("allreduce", "ar"), ("reduce_scatter", "rs"), ("allgather", "ag"))
#: profiles measured in this process, by (cache file, key), including failed link measurements
_MEMO: dict[tuple[str, str], dict[str, Any]] = {}

MATMUL_N = 256
COPY_BYTES = 64 * 2**20


class LinkMeasureError(Exception):
    """The gloo link could not be measured (the processes failed, timed out or misreported)."""


def forget_measurements() -> None:
    """Forget what this process measured, so the next :func:`host_profile` reads the cache
    file again (or measures)."""
    _MEMO.clear()


def nominal_profile() -> dict[str, Any]:
    """The figures of a CPU rank when nothing is measured."""
    return {
        "flops_per_s": CPU_NOMINAL_FLOPS_PER_S,
        "mem_bandwidth_bytes_per_s": CPU_NOMINAL_MEM_BANDWIDTH_BYTES_PER_S,
        "compute_source": (
            f"nominal, not measured: {CPU_NOMINAL_FLOPS_PER_S / 1e9:g} GFLOP/s fp32 and "
            f"{CPU_NOMINAL_MEM_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s copy per thread"
        ),
        "link_latency_s": GLOO_NOMINAL_LATENCY_S,
        "link_bandwidth_bytes_per_s": GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S,
        **unmeasured_collectives(),
        "late_receive_s": 0.0,
        "link_source": _nominal_link_source("not measured"),
    }


def pending_profile() -> dict[str, Any]:
    """The nominal figures that stand in until this host is measured
    (``Cluster.cpu(n, measure="later")``), their sources saying so."""
    prof = nominal_profile()
    until = "not measured yet (ex.profile or Cluster.measured() measures this host)"
    prof["compute_source"] = prof["compute_source"].replace("not measured", until, 1)
    prof["link_source"] = _nominal_link_source(until)
    return prof


def unmeasured_collectives() -> dict[str, float]:
    """A host profile's collective figures when the link is not measured: 0 (derived from the
    link as a ring)."""
    return {f"{name}_{fig}": 0.0 for name, _ in COLLECTIVES
            for fig in ("latency_s", "bandwidth_bytes_per_s")}


def _nominal_link_source(why: str) -> str:
    return (
        f"nominal gloo over loopback TCP ({why}): latency {GLOO_NOMINAL_LATENCY_S * 1e6:g} us, "
        f"{GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s"
    )


def host_profile(measure: bool) -> dict[str, Any]:
    """Per-rank figures: measured (memoised and cached on disk) or, without ``measure``,
    nominal."""
    if not measure:
        return nominal_profile()
    path, key = cache_file(), cache_key()
    got = cached_profile()
    if got is not None:
        return got
    cached = read_cache(path).get(key)
    if cached is not None:
        warn_damaged(path, key, profile_problem(cached) or "")
    prof = measure_host_profile()
    prof["compute_source"] += f" (cached in {path})"
    _MEMO[(str(path), key)] = prof
    if prof.pop("link_measured"):  # a failed link measurement is retried in a later process
        prof["link_source"] += f" (cached in {path})"
        write_cache(path, key, prof)
    return prof


def cached_profile() -> dict[str, Any] | None:
    """This host's figures where they were measured before (in this process, or a valid
    entry of the cache file); None where they were not. Measures nothing."""
    path, key = cache_file(), cache_key()
    memo = _MEMO.get((str(path), key))
    if memo is not None:
        return memo
    with warnings.catch_warnings():  # (a damaged cache is said when it is measured again)
        warnings.simplefilter("ignore")
        cached = read_cache(path).get(key)
    if valid_profile(cached):
        _MEMO[(str(path), key)] = cached
        return cached
    return None


def valid_profile(p: Any) -> bool:
    """Whether a cached entry is a complete host profile of the current format."""
    return profile_problem(p) is None


def profile_problem(p: Any) -> str | None:
    """What makes a cached entry no complete host profile of the current format, or None."""
    if not isinstance(p, dict):
        return "not a JSON object"
    if not all(isinstance(p.get(k), str) for k in ("compute_source", "link_source")):
        return "no text for compute_source or link_source"
    probes = p.get("link_probes")  # entries from before the link was probed several times
    if not (finite_number(probes) and isinstance(probes, int) and probes >= 1):  # measured again
        return "link_probes is not a whole number >= 1"
    if not finite_number(p.get("late_receive_s")):  # (0 is a measurement: no wait on this host)
        return "late_receive_s is not a finite number >= 0"
    for k in PROFILE_KEYS:
        if not (finite_number(p.get(k)) and p[k] > 0):
            return f"{k} is not a finite number > 0"
    return None



def busy_problem(load: HostLoad) -> str | None:
    """Why CPU ranks measured under ``load`` ran slower than they will on a quiet host (other
    processes competing for the ranks' cores), in words; None when they did not.

    Judged by the processor share alone: the load average, recorded beside it, lags by a
    minute and counts the explorer's own ranks of the run just before (a profile whose loops
    got all of their core was not kept waiting, whatever it says)."""
    if load.cpu_share < BUSY_CPU_SHARE:
        return f"other processes competed for its cores: {load.describe()}"
    return None


def measure_host_profile() -> dict[str, Any]:
    """Measure a rank's compute and copy speed and the link (a few seconds)."""
    import torch  # (only to name its version in the source)

    flops = measure_matmul_flops()
    bw = measure_copy_bandwidth()
    host = socket.gethostname()
    prof: dict[str, Any] = {
        "flops_per_s": flops,
        "mem_bandwidth_bytes_per_s": bw,
        "compute_source": (
            f"measured on {host} with torch {torch.__version__}, 1 thread: fp32 "
            f"{MATMUL_N}x{MATMUL_N} matmul and {COPY_BYTES // 2**20} MiB tensor copy, medians"
        ),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        (latency, bandwidth, late, *collectives), probes = median_link()
    except LinkMeasureError as e:
        prof.update(
            link_latency_s=GLOO_NOMINAL_LATENCY_S,
            link_bandwidth_bytes_per_s=GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S,
            **unmeasured_collectives(),
            late_receive_s=0.0,
            link_source=_nominal_link_source(f"gloo measurement failed: {e}"),
            link_measured=False,
        )
        return prof
    g = gloo_probe
    prof.update(
        link_latency_s=latency,
        link_bandwidth_bytes_per_s=bandwidth,
        **{f"{name}_{fig}": v for (name, _), pair in zip(COLLECTIVES, zip(
            collectives[::2], collectives[1::2], strict=True), strict=True)
           for fig, v in zip(("latency_s", "bandwidth_bytes_per_s"), pair, strict=True)},
        late_receive_s=late,
        link_probes=probes,
        link_source=(
            f"measured on {host}, each figure the median of {probes} probes (a pair of "
            "fresh processes each): torch.distributed gloo send/recv ping-pong between two local "
            f"processes over 127.0.0.1, median of {g.PING_REPS} x 4 B (latency) and "
            f"{g.BULK_REPS} x {g.BULK_BYTES // 2**20} MiB (bandwidth); all-reduce, "
            "reduce-scatter and all-gather of the same sizes between the two, medians; late "
            f"receive: {g.LATE_REPS} messages sent {g.LATE_AHEAD_S * 1e3:g} ms before their "
            "receive was posted, both ranks computing, trimmed mean of the wait"
        ),
        link_measured=True,
    )
    return prof


def measure_matmul_flops() -> float:
    """FLOP/s of a one-thread fp32 matrix product (median of seven ~20 ms trials)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = MATMUL_N
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        for _ in range(3):
            torch.mm(a, b, out=out)
        t0 = time.perf_counter()  # size a trial to ~20 ms
        torch.mm(a, b, out=out)
        reps = max(1, min(1000, int(0.02 / max(time.perf_counter() - t0, 1e-7))))
        rates = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            rates.append(2 * n**3 * reps / (time.perf_counter() - t0))
        return float(statistics.median(rates))
    finally:
        torch.set_num_threads(threads)


def measure_copy_bandwidth() -> float:
    """Bytes read plus bytes written per second by a one-thread copy of a large tensor."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        rates = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            rates.append(2 * COPY_BYTES / (time.perf_counter() - t0))
        return float(statistics.median(rates))
    finally:
        torch.set_num_threads(threads)


def median_link() -> tuple[tuple[float, ...], int]:
    """:func:`measure_gloo_link` :data:`LINK_PROBES` times, each figure the median of the
    probes that succeeded, and how many did; raises the last failure when none did."""
    got, failure = [], None
    for _ in range(LINK_PROBES):
        try:
            got.append(measure_gloo_link())
        except LinkMeasureError as e:
            failure = e
    if not got:
        raise failure or LinkMeasureError("no probe ran")
    figures = tuple(statistics.median(x) for x in zip(*got, strict=True))
    return figures, len(got)  # type: ignore[return-value]


def measure_gloo_link(timeout_s: float = LINK_MEASURE_TIMEOUT_S) -> tuple[float, ...]:
    """``(latency_s, bandwidth_bytes_per_s)`` between two local gloo processes, the
    late-receive wait (``Link.late_receive_s``; a trimmed mean over the middle 80 % of the
    messages), then latency and bandwidth of each of :data:`COLLECTIVES` between them.

    The children (:mod:`explorer.platforms.cpu.gloo_probe`) are killed at ``timeout_s`` (and
    kill themselves shortly after it should the parent die); none outlives this call.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    lo = loopback_ifname()
    if lo:
        env["GLOO_SOCKET_IFNAME"] = lo
    port = free_port()
    deadline = time.monotonic() + timeout_s
    procs: list[subprocess.Popen] = []
    try:
        for rank in (0, 1):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", gloo_probe.__name__, str(rank), str(port),
                     f"{timeout_s + 2}"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    text=True,
                )
            )
        outs = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise LinkMeasureError(f"no result within {timeout_s:g} s") from None
            if p.returncode != 0:
                tail = (err or "").strip().splitlines()[-1:] or [f"exit code {p.returncode}"]
                raise LinkMeasureError(f"a gloo process failed: {tail[0][:200]}")
            outs.append(out)
    except OSError as e:
        raise LinkMeasureError(f"could not start a process: {e}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.communicate(timeout=5)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                pass
    return _link_figures(outs[0])


def _link_figures(out: str) -> tuple[float, ...]:
    """The link figures (:func:`measure_gloo_link`) from rank 0's JSON line."""
    try:
        res = json.loads(out.strip().splitlines()[-1])
        latency, one_way, late = (float(res[k]) for k in ("latency_s", "one_way_s", "late_s"))
        timings = [(float(res[f"{key}_small_s"]), float(res[f"{key}_big_s"]))
                   for _, key in COLLECTIVES]
    except (ValueError, KeyError, IndexError, TypeError):
        raise LinkMeasureError("unreadable result from the gloo processes") from None
    if not (latency > 0 and one_way > 0 and all(a > 0 and b > 0 for a, b in timings)
            and math.isfinite(late) and late >= 0):
        raise LinkMeasureError(f"implausible timings {latency!r}, {one_way!r}, {late!r}, "
                               f"{timings!r}")
    # one_way = latency + bytes / bandwidth; guard against noise making the difference tiny
    bulk = gloo_probe.BULK_BYTES
    figures = [latency, bulk / max(one_way - latency, one_way / 10), late]
    for small, big in timings:
        figures += [small, bulk / max(big - small, big / 10)]
    return tuple(figures)
