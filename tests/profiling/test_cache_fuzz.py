"""Fuzzing the measurement caches: an entry that parses but is wrong (short lists, text where a
number belongs, NaN or Infinity) is measured again and replaced, never used and never a crash.

A seeded mutator damages valid entries of the profile cache (:mod:`explorer.profiling.ops`),
the host profile and the message cost in the host measurement cache; the measuring functions
are cheap fakes, so no process starts. Every case either uses the entry (it is valid: the
prediction from it is finite) or measures again, with a warning, and replaces the entry.
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing
import os
import random
import warnings
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch
from builders import graph

import explorer as ex
from explorer.costs.model import CostModel, DeviceCosts
from explorer.devices.cluster import Cluster
from explorer.platforms.cpu import host as cpu_host
from explorer.platforms.cpu.host_cache import cache_file, cache_key, read_cache, write_cache

ops = importlib.import_module("explorer.profiling.ops")
profile_cache = importlib.import_module("explorer.profiling.profile_cache")
probe = importlib.import_module("explorer.profiling.host")

CASES = 300
SLOW_CASES = 10_000
BAD = [None, True, False, "1e-3", "", [], {}, float("nan"), float("inf"), -float("inf"), -1.0,
       -1, 0, 0.0, 1e308, 2**70, [1.0], {"a": 1}, "NaN"]


def mutate(value, rng: random.Random):
    """A damaged copy of a JSON value: a key dropped, added or changed, a list cut short,
    lengthened or with an element changed, or the value replaced."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        v = dict(value)
        k = rng.choice(sorted(v))
        op = rng.randrange(4)
        if op == 0:
            del v[k]
        elif op == 1:
            v[k] = mutate(v[k], rng)
        elif op == 2:
            v[rng.choice(["extra", k + "_", "fwd"])] = rng.choice(BAD)
        else:
            v[k] = rng.choice(BAD)
        return v
    if isinstance(value, list) and value and rng.random() < 0.7:
        v = list(value)
        op = rng.randrange(4)
        if op == 0:
            del v[rng.randrange(len(v))]
        elif op == 1:
            v.append(rng.choice([*BAD, v[0]]))
        elif op == 2:
            i = rng.randrange(len(v))
            v[i] = mutate(v[i], rng)
        else:
            v = v[: rng.randrange(len(v))]
        return v
    return rng.choice(BAD)


def damaged_text(entry, rng: random.Random) -> str:
    """The text of a damaged cache file: mutated one to three times, sometimes cut off."""
    for _ in range(rng.randint(1, 3)):
        entry = mutate(entry, rng)
    text = json.dumps(entry)
    if rng.random() < 0.05:
        text = text[: rng.randrange(len(text) + 1)]
    return text


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    yield tmp_path
    cpu_host.forget_measurements()  # nothing of the fakes stays in this process's memos
    probe.forget_message_s()


# ---- the profile cache

G = graph([("x", "input", [], 100), ("w", "param", [], 400), ("a", "op", ["x", "w"], 100),
           ("b", "op", ["a"], 100), ("c", "op", ["b"], 4)], batch=8)
CL = Cluster.cpu(1, measure=False)
DEV = CL.devices[0]


@pytest.fixture(autouse=True)
def no_load_sample(monkeypatch):
    """The measurement is stubbed: so is the processor-share sample taken around it (a real
    profile's few hundredths of a second, thousands of times over here)."""
    monkeypatch.setattr(ops, "LOAD_SAMPLE_S", 0.0)


def _fresh(graph_, dev, repeats, warmup, progress, pool=None, report=None, first=None,
           runtime="segments"):
    n = len(graph_)
    return DeviceCosts(dev.type_key, [1e-3] * n, [2e-3] * n, ["measured"] * n, 1e-6,
                       {"adam": 1e-9}, {"adam": 1e-6}, [0.5], [[5e-4] * n], [[1e-3] * n],
                       [1.2] * n, 0.05, 1.3, runtime=runtime,
                       op_path_extra_s=[[3e-5, 2e-5], [4e-5, -1e-6]]
                       if runtime == "segments" else [])


def _valid_entry() -> dict:
    return {"version": profile_cache.PROFILE_VERSION, "torch": torch.__version__,
            **asdict(replace(_fresh(G, DEV, 1, 0, False), fwd_s=[2e-3] * len(G)))}


def _profile_cases(n: int, seed: int) -> None:
    rng = random.Random(seed)
    path = profile_cache.cache_path(G, DEV, ops.REPEATS)
    path.parent.mkdir(parents=True, exist_ok=True)
    plans = [ex.Plan.single(G, DEV.id), ex.Plan.single(G, DEV.id, micro_batches=2)]
    used = remeasured = 0
    simulated: set[str] = set()  # (the simulator is deterministic: once per cost figures)
    for _ in range(n):
        path.write_text(damaged_text(_valid_entry(), rng))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dc = ops.measured(G, DEV, progress=False)
        if dc == _fresh(G, DEV, 1, 0, False):
            remeasured += 1
            # replaced by the fresh measurement, which reads back as it was stored
            assert profile_cache.load(path, len(G), DEV.type_key) == dc
        else:
            used += 1
            assert not caught
        if repr(dc) in simulated:  # (a float's repr reads back as the same number)
            continue
        simulated.add(repr(dc))
        costs = CostModel(G.fingerprint, CL, {DEV.type_key: dc})
        for plan in plans:
            with np.errstate(all="raise"):  # no division by zero, no NaN on the way
                pred = ex.simulate(G, plan, costs)
            assert math.isfinite(pred.step_s) and pred.step_s >= 0
    assert remeasured > n // 2  # the mutator mostly damages


def test_the_valid_entry_is_used(cache_home, monkeypatch):
    monkeypatch.setattr(ops, "measure", _fresh)
    path = profile_cache.cache_path(G, DEV, ops.REPEATS)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_valid_entry()))
    assert ops.measured(G, DEV).fwd_s == [2e-3] * len(G)


@pytest.mark.parametrize("damage,why", [
    ({"fwd_s": [1e-3]}, r"fwd_s is not a list of 5 times of 0 to 1e\+06 s"),
    ({"fwd_s": [1e300] * 5}, r"fwd_s is not a list of 5 times of 0 to 1e\+06 s"),
    ({"workspace_bytes": -1}, r"workspace_bytes is not a whole number of bytes"),
    ({"workspace_bytes": "32 MiB"}, r"workspace_bytes is not a whole number of bytes"),
    ({"bwd_s": ["1e-3"] * 5}, r"bwd_s is not a list of 5"),
    ({"overhead_s": float("nan")}, r"overhead_s is not a number of 0 to 1e6"),
    ({"optimizer_s_per_byte": {"adam": 1e308}}, r"optimizer_s_per_byte is not a table of "
                                                  r"numbers of 0 to 1e6"),
    ({"fwd_at": [[float("inf")] * 5]}, r"fwd_at is not one list of times per node"),
    ({"fractions": [1.0]}, r"fractions is not a decreasing list"),
    ({"type_key": "T4"}, r"it is for 'T4'"),
    ({"runtime": "ops", "op_path_extra_s": []}, r"it is of runtime 'ops', not 'segments'"),
    ({"runtime": "compiled"}, r"runtime is not 'ops' or 'segments'"),
    ({"op_path_extra_s": [[3e-5], [4e-5]]}, r"op_path_extra_s is not two lists"),
    ({"op_path_extra_s": [[3e-5, float("nan")], [4e-5, 0.0]]}, r"op_path_extra_s is not"),
])
def test_a_wrong_entry_is_measured_again_with_a_warning(cache_home, monkeypatch, damage, why):
    monkeypatch.setattr(ops, "measure", _fresh)
    path = profile_cache.cache_path(G, DEV, ops.REPEATS)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**_valid_entry(), **damage}))
    with pytest.warns(UserWarning, match=f"profile cache entry .* is damaged \\({why}"):
        assert ops.measured(G, DEV) == _fresh(G, DEV, 1, 0, False)
    assert json.loads(path.read_text())["fwd_s"] == [1e-3] * len(G)


def test_profile_cache_fuzz(cache_home, monkeypatch):
    monkeypatch.setattr(ops, "measure", _fresh)
    _profile_cases(CASES, seed=0)


@pytest.mark.slow
def test_profile_cache_fuzz_long(cache_home, monkeypatch):
    monkeypatch.setattr(ops, "measure", _fresh)
    _profile_cases(SLOW_CASES, seed=1)


# ---- the host measurement cache: the host profile and the message cost

def _host_measured() -> dict:
    return {**cpu_host.nominal_profile(), "compute_source": "measured (fake)",
            "link_source": "measured (fake)", "link_probes": 3, "link_measured": True,
            "late_receive_s": 1e-4,
            **{f"{name}_{fig}": v for name, _ in cpu_host.COLLECTIVES
               for fig, v in (("latency_s", 1e-4), ("bandwidth_bytes_per_s", 1e9))}}


def _host_cases(n: int, seed: int, monkeypatch) -> None:
    monkeypatch.setattr(cpu_host, "measure_host_profile", _host_measured)
    monkeypatch.setattr(probe, "measure_message_s", lambda pool=None, runtime=None: 2e-5)
    rng = random.Random(seed)
    path, key = cache_file(), cache_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    two = Cluster.cpu(2, measure=False)
    two = replace(two, default_link=replace(two.default_link, source="measured (fake)"))
    good = {k: v for k, v in _host_measured().items() if k != "link_measured"}
    message_key = f"{key}|{probe.PROBE_KEY}{probe.SEGMENTS_KEY}"
    for _ in range(n):
        whole = {key: good, message_key: {"message_s": 1e-5, "how": "fake"}}
        path.write_text(damaged_text(whole, rng))
        cpu_host.forget_measurements()
        probe.forget_message_s()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof = cpu_host.host_profile(True)
            message_s = probe.cpu_message_s(two)
        assert cpu_host.valid_profile(prof)
        assert math.isfinite(message_s) and message_s >= 0
        cl = Cluster.cpu(2)  # builds from the (memoised) profile
        assert all(d.flops_per_s > 0 for d in cl.devices)
        # what is on disk now is valid for both
        stored = json.loads(path.read_text())
        assert cpu_host.valid_profile(stored[key])
        assert probe.cpu_message_s(two) == message_s


def test_host_cache_fuzz(cache_home, monkeypatch):
    _host_cases(CASES, 2, monkeypatch)


@pytest.mark.slow
def test_host_cache_fuzz_long(cache_home, monkeypatch):
    _host_cases(SLOW_CASES, 3, monkeypatch)


def test_a_wrong_host_entry_is_measured_again_with_a_warning(cache_home, monkeypatch):
    monkeypatch.setattr(cpu_host, "measure_host_profile", _host_measured)
    path, key = cache_file(), cache_key()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({key: {**_host_measured(), "flops_per_s": float("inf")}}))
    cpu_host.forget_measurements()
    with pytest.warns(UserWarning, match=r"damaged or incomplete \(flops_per_s is not a finite"):
        assert cpu_host.host_profile(True)["compute_source"].startswith("measured (fake)")
    assert json.loads(path.read_text())[key]["flops_per_s"] > 0


# ---- damaged bytes, and several processes at once

#: damage that parses as no JSON value of ours: bytes that are not UTF-8, nesting deeper than
#: any parser's stack, a number no float holds (as 10**400 would be written)
DAMAGED_BYTES = {
    "bad UTF-8": (b'{"version": \xff\xfe}', "not UTF-8"),
    "100k-deep [": (b"[" * 100_000, "nests deeper than"),
}
HUGE = 10**400


def _with_huge(text: str, field: str) -> bytes:
    """``text`` (JSON) with the number of ``field`` replaced by 10**400, digit by digit."""
    d = json.loads(text)
    d[field] = "HUGE"
    return json.dumps(d).replace('"HUGE"', str(HUGE)).encode()


@pytest.mark.parametrize("kind", [*DAMAGED_BYTES, "10**400"])
def test_damaged_bytes_in_a_profile_entry_are_measured_again(cache_home, monkeypatch, kind):
    monkeypatch.setattr(ops, "measure", _fresh)
    path = profile_cache.cache_path(G, DEV, ops.REPEATS)
    path.parent.mkdir(parents=True)
    if kind == "10**400":
        data, why = _with_huge(json.dumps(_valid_entry()), "overhead_s"), "overhead_s is not"
    else:
        data, why = DAMAGED_BYTES[kind]
    path.write_bytes(data)
    for attempt in range(2):  # not only once: the entry is replaced
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ops.measured(G, DEV, progress=False) == _fresh(G, DEV, 1, 0, False)
        said = [str(w.message) for w in caught if " is damaged" in str(w.message)]
        if attempt == 0:
            assert len(said) == 1 and why in said[0], said
        else:
            assert said == []  # read back as measured
    assert profile_cache.load(path, len(G), DEV.type_key) == _fresh(G, DEV, 1, 0, False)


def _host_file_damaged(kind: str, good: dict, key: str, message_key: str) -> bytes:
    if kind == "10**400 in the host profile":
        whole = {key: {**good, "flops_per_s": "HUGE"}, message_key: {"message_s": 1e-5}}
    elif kind == "10**400 in the message cost":
        whole = {key: good, message_key: {"message_s": "HUGE"}}
    else:
        return DAMAGED_BYTES[kind][0]
    return json.dumps(whole).replace('"HUGE"', str(HUGE)).encode()


@pytest.mark.parametrize("kind", [*DAMAGED_BYTES, "10**400 in the host profile",
                                  "10**400 in the message cost"])
def test_damaged_bytes_in_the_host_cache_are_measured_again(cache_home, monkeypatch, kind):
    monkeypatch.setattr(cpu_host, "measure_host_profile", _host_measured)
    monkeypatch.setattr(probe, "measure_message_s", lambda pool=None, runtime=None: 2e-5)
    path, key = cache_file(), cache_key()
    message_key = f"{key}|{probe.PROBE_KEY}{probe.SEGMENTS_KEY}"
    path.parent.mkdir(parents=True)
    good = {k: v for k, v in _host_measured().items() if k != "link_measured"}
    path.write_bytes(_host_file_damaged(kind, good, key, message_key))
    two = Cluster.cpu(2, measure=False)
    two = replace(two, default_link=replace(two.default_link, source="measured (fake)"))
    cpu_host.forget_measurements()
    probe.forget_message_s()
    with pytest.warns(UserWarning, match="damaged"):
        prof = cpu_host.host_profile(True)
        message_s = probe.cpu_message_s(two)
    assert cpu_host.valid_profile(prof)
    assert message_s in (1e-5, 2e-5)  # (kept where only the host profile was damaged)
    stored = json.loads(path.read_text())  # replaced by what was measured: valid again
    assert cpu_host.valid_profile(stored[key])
    assert stored[message_key]["message_s"] == message_s


def _writer(args) -> tuple[int, int]:
    """One of several processes sharing one cache folder: stores its own host cache entries
    and the profile entry, reading both back after each write; how many reads it found
    damaged (or a profile not whole) and how many host entries it wrote."""
    root, me, rounds = args
    os.environ["XDG_CACHE_HOME"] = root
    damaged = 0
    path = profile_cache.cache_path(G, DEV, ops.REPEATS)
    mine = _fresh(G, DEV, 1, 0, False)
    for i in range(rounds):
        write_cache(cache_file(), f"{me}|{i}", {"message_s": float(i)})
        profile_cache.store(path, replace(mine, overhead_s=1e-6 * (me + 1)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = profile_cache.load(path, len(G), DEV.type_key)
            entries = read_cache(cache_file())
        damaged += bool(caught) or got is None or f"{me}|{i}" not in entries
    return damaged, rounds


def test_concurrent_writers_neither_damage_nor_lose_entries(tmp_path):
    writers, rounds = 4, 40
    with multiprocessing.get_context("fork").Pool(writers) as pool:
        results = pool.map(_writer, [(str(tmp_path), me, rounds) for me in range(writers)])
    assert [damaged for damaged, _ in results] == [0] * writers
    entries = json.loads((tmp_path / "partition-explorer" / cache_file().name).read_text())
    assert sorted(entries) == sorted(f"{me}|{i}" for me in range(writers) for i in range(rounds))
    # no temporary file left behind beside the caches
    assert [p.name for p in (tmp_path / "partition-explorer" / "profiles").iterdir()] == [
        profile_cache.cache_path(G, DEV, ops.REPEATS).name]
