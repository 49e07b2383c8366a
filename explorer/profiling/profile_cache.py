"""The profile cache: one file per graph fingerprint, device type and rank settings, holding a
device's measured op times, the host's load while they were measured and what the profile is
re-checked against before it is used again (:mod:`explorer.profiling.recheck`).

Files are read and written through :mod:`explorer.core.cachefile` (bytes not trusted, written
atomically); an entry that does not fit the graph it is read for, or holds no usable times, is
damaged: a warning, and the caller measures again (:func:`explorer.profiling.ops.measured`).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from explorer.core import cachefile
from explorer.core.graph import OpGraph
from explorer.costs.model import PROFILED_RUNTIMES, DeviceCosts
from explorer.devices.cluster import Device
from explorer.platforms import platform_of
from explorer.platforms.cpu.host_cache import finite_number
from explorer.platforms.load import HostLoad
from explorer.profiling import recheck

# 2: ops timed through the runtime; 3: also at fractions of the batch; 4: op medians scaled
# to the median step; 5: the replicas' spread measured with the contention; 6: CPU ranks
# pinned to cores; 7: ranks keep the memory they free (glibc's allocator), and the optimizer
# step's contention is measured; 9: a tensor-parallel split's costs fitted on the graph's own
# split run (kept with the profile, as the contention is); 10: the host's load while it was
# measured and the re-check's reference kept with it; 11: the runtime the times are of, the
# segment runtime's fitted on segment runs (what the op path adds per op kept with them);
# 12: the contention measured in the profile's runtime
PROFILE_VERSION = 12


def cache_dir() -> Path:
    """Where profiles are cached (under ``$XDG_CACHE_HOME`` or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partition-explorer" / "profiles"



def cache_path(graph: OpGraph, dev: Device, repeats: int, runtime: str = "segments") -> Path:
    """The cache file of ``graph``'s profile on ``dev``'s type for ``runtime``, measured with
    ``repeats``."""
    tag = platform_of(dev.kind).rank_settings_tag()
    return (cache_dir()
            / f"{graph.fingerprint}-{_slug(dev.type_key)}-r{repeats}{tag}-{runtime}.json")


@dataclass(frozen=True)
class CachedProfile:
    """A profile as the cache keeps it: the costs, and what they were measured under."""

    costs: DeviceCosts
    #: the host's load while it was measured (None: not recorded, e.g. an older entry)
    load: HostLoad | None = None
    #: what it is re-checked against before it is used again (None: it cannot be)
    reference: recheck.Reference | None = None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80]



def load(path: Path, nodes: int | None = None, type_key: str | None = None,
         runtime: str | None = None) -> DeviceCosts | None:
    """The profile cached at ``path`` for a graph of ``nodes`` nodes on devices of
    ``type_key`` and of ``runtime`` (None: any); None when there is none,
    it is of another format or torch, or it is damaged (then with a warning: the caller
    measures again and replaces it)."""
    got = load_entry(path, nodes, type_key, runtime)
    return None if got is None else got.costs


def load_entry(path: Path, nodes: int | None = None, type_key: str | None = None,
               runtime: str | None = None) -> CachedProfile | None:
    """:func:`load`, with what the profile was measured under."""
    try:
        d = cachefile.read(path)
    except cachefile.DamagedFile as exc:
        return _damaged(path, str(exc))
    if d is None:
        return None
    if not isinstance(d, dict):
        return _damaged(path, "it is not a JSON object")
    if d.get("version") != PROFILE_VERSION or d.get("torch") != torch.__version__:
        return None  # an older format or another torch: measured again, nothing is wrong
    under, reference = d.get("load"), d.get("reference")
    d = {k: v for k, v in d.items() if k not in ("version", "torch", "load", "reference")}
    problem = costs_problem(d, nodes)
    if not problem and type_key is not None and d["type_key"] != type_key:
        problem = f"it is for {d['type_key']!r}, not {type_key!r}"
    if not problem and runtime is not None and d.get("runtime", "ops") != runtime:
        problem = f"it is of runtime {d.get('runtime', 'ops')!r}, not {runtime!r}"
    if not problem:
        problem = _load_problem(under) or _reference_problem(reference, len(d["fwd_s"]))
    if problem:
        return _damaged(path, problem)
    return CachedProfile(
        DeviceCosts(**d),
        None if under is None else HostLoad(float(under["cpu_share"]),
                                            float(under["load_per_core"]), int(under["cores"])),
        None if reference is None else recheck.Reference(tuple(reference["nodes"]),
                                                         float(reference["ratio"])))


def _load_problem(load: Any) -> str | None:
    """What is wrong with an entry's record of the host's load, or None (also when absent)."""
    if load is None:
        return None
    if not (isinstance(load, dict) and set(load) == {"cpu_share", "load_per_core", "cores"}
            and finite_number(load["cpu_share"]) and load["cpu_share"] <= 1
            and _bounded(load["load_per_core"])
            and isinstance(load["cores"], int) and 1 <= load["cores"] <= 2**20):
        return ("load is not a record of cpu_share (0 to 1), load_per_core (0 to 1e6) and "
                "cores (a whole number >= 1)")
    return None


def _reference_problem(ref: Any, n: int) -> str | None:
    """What is wrong with an entry's re-check reference for a graph of ``n`` nodes, or None
    (also when absent)."""
    if ref is None:
        return None
    nodes = ref.get("nodes") if isinstance(ref, dict) else None
    if not (isinstance(ref, dict) and set(ref) == {"nodes", "ratio"}
            and isinstance(nodes, list) and 1 <= len(nodes) <= recheck.RECHECK_OPS
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                    for i in nodes)
            and _bounded(ref["ratio"]) and ref["ratio"] > 0):
        return (f"reference is not a record of 1 to {recheck.RECHECK_OPS} node indices and a "
                "ratio above 0")
    return None


def _damaged(path: Path, why: str) -> None:
    warnings.warn(f"the profile cache entry {path} is damaged ({why}); measuring again and "
                  "replacing it", stacklevel=3)
    return None


_REQUIRED = ("type_key", "fwd_s", "bwd_s", "source", "overhead_s")


def costs_problem(d: dict[str, Any], nodes: int | None = None) -> str | None:
    """What is wrong with the fields of a cached :class:`DeviceCosts` for a graph of ``nodes``
    nodes (types, lengths, finite times >= 0), or None when nothing is."""
    known = {f.name for f in fields(DeviceCosts)}
    if set(d) - known:
        return f"unknown fields {sorted(set(d) - known)[:3]}"
    if missing := [k for k in _REQUIRED if k not in d]:
        return f"no {missing[0]}"
    n = nodes if nodes is not None else (len(d["fwd_s"]) if isinstance(d["fwd_s"], list)
                                         else -1)
    if not isinstance(d["type_key"], str):
        return "type_key is not text"
    checks = [("fwd_s", _times(d["fwd_s"], n)), ("bwd_s", _times(d["bwd_s"], n)),
              ("source", isinstance(d["source"], list) and len(d["source"]) == n
               and all(isinstance(x, str) for x in d["source"])),
              ("overhead_s", _bounded(d["overhead_s"]))]
    for k in ("optimizer_s_per_byte", "optimizer_s_per_tensor", "dtensor", "checkpoint"):
        v = d.get(k, {})
        checks.append((k, isinstance(v, dict) and all(isinstance(o, str) and _bounded(x)
                                                      for o, x in v.items())))
    fractions = d.get("fractions", [])
    checks.append(("fractions", isinstance(fractions, list)
                   and all(finite_number(f) and 0 < f < 1 for f in fractions)
                   and all(a > b for a, b in itertools.pairwise(fractions))))
    timed = d.get("precision_s", {})
    checks.append(("precision_s", isinstance(timed, dict) and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2
        and all(_times(t, n) for t in v) for k, v in timed.items())))
    for k in ("fwd_at", "bwd_at"):
        v = d.get(k, [])
        checks.append((k, isinstance(v, list) and isinstance(fractions, list)
                       and len(v) == len(fractions) and all(_times(t, n) for t in v)))
    contention = d.get("contention", [])
    checks.append(("contention", contention == [] or (
        _times(contention, n) and all(x > 0 for x in contention))))
    checks.append(("replica_spread", _bounded(d.get("replica_spread", 0.0))))
    checks.append(("collective_s", _bounded(d.get("collective_s", 0.0))))
    opt = d.get("optimizer_contention", 1.0)
    checks.append(("optimizer_contention", _bounded(opt) and opt > 0))
    checks.append(("runtime", d.get("runtime", "ops") in PROFILED_RUNTIMES))
    extra = d.get("op_path_extra_s", [])
    checks.append(("op_path_extra_s", extra == [] or (
        isinstance(extra, list) and len(extra) == 2 and isinstance(fractions, list)
        and all(isinstance(row, list) and len(row) == len(fractions) + 1
                and all(_signed(x) for x in row) for row in extra))))
    host = d.get("host_s", [])
    checks.append(("host_s", host == [] or (
        isinstance(host, list) and len(host) == 2 and all(_times(t, n) for t in host))))
    held = d.get("workspace_bytes", 0)
    checks.append(("workspace_bytes", isinstance(held, int) and not isinstance(held, bool)
                   and 0 <= held < 2**50))
    for k, ok in checks:
        if not ok:
            per_node = f"a list of {n} times of 0 to {MAX_OP_S:g} s, one per node"
            return f"{k} is not {_WHAT.get(k, per_node)}"
    return None


_WHAT = {"source": "a list of texts, one per node",
         "overhead_s": "a number of 0 to 1e6", "replica_spread": "a number of 0 to 1e6",
         "collective_s": "a number of 0 to 1e6",
         "optimizer_contention": "a number above 0, at most 1e6",
         "workspace_bytes": "a whole number of bytes >= 0",
         "runtime": " or ".join(repr(r) for r in PROFILED_RUNTIMES),
         "op_path_extra_s": "two lists (forward, backward) of a number of -1e6 to 1e6 for the "
                            "whole batch and for each fraction",
         "optimizer_s_per_byte": "a table of numbers of 0 to 1e6",
         "optimizer_s_per_tensor": "a table of numbers of 0 to 1e6",
         "dtensor": "a table of numbers of 0 to 1e6",
         "checkpoint": "a table of numbers of 0 to 1e6",
         "fractions": "a decreasing list of fractions of the batch in (0, 1)",
         "precision_s": "a table of [forward, backward] times per node for each precision",
         "host_s": "two lists (forward, backward) of a time per node",
         "fwd_at": "one list of times per node for each fraction",
         "bwd_at": "one list of times per node for each fraction"}


#: no op of a training step takes longer than this: a larger cached time is damage
MAX_OP_S = 1e6


def _bounded(x: Any) -> bool:
    """A finite number of 0 to ``MAX_OP_S``: larger costs or factors are damage (and would
    overflow the simulator's sums)."""
    return finite_number(x) and x <= MAX_OP_S


def _signed(x: Any) -> bool:
    """A finite number of -``MAX_OP_S`` to ``MAX_OP_S`` (not a bool)."""
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and abs(x) <= MAX_OP_S)


def _times(xs: Any, n: int) -> bool:
    return isinstance(xs, list) and len(xs) == n and all(_bounded(x) for x in xs)


def store(path: Path, dc: DeviceCosts, load: HostLoad | None = None,
          reference: recheck.Reference | None = None) -> None:
    """Cache the profile ``dc`` at ``path`` (written atomically) with the host's ``load``
    while it was measured and its re-check ``reference``, where known."""
    entry = {"version": PROFILE_VERSION, "torch": torch.__version__,
             **asdict(dc)}  # the fields, not cached arrays
    if load is not None:
        entry["load"] = load.to_dict()
    if reference is not None:
        entry["reference"] = reference.to_dict()
    try:
        cachefile.write(path, entry)
    except OSError:
        pass  # caching is a convenience; a read-only home must not stop profiling
