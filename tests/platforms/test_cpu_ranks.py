"""Tests of the CPU platform's rank set-up: pinning ranks to cores, holding freed memory."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from explorer.platforms import cpu
from explorer.platforms.cpu import host_cache

# most of these start child processes (pinning and held memory are per process)
pytestmark = pytest.mark.slow

# ---- CPU ranks pinned to cores

_PIN_CHILD = ("import os, sys; from explorer.platforms.cpu import pin_cpu_rank; "
              "got = pin_cpu_rank(int(sys.argv[1]), int(sys.argv[2])); "
              "print(got and list(got), sorted(os.sched_getaffinity(0)), sep=';')")


def _pin_in_child(local_rank: int, pin: str, threads: int = 1) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", _PIN_CHILD, str(local_rank), str(threads)],
                         check=True, capture_output=True, text=True,
                         env=dict(os.environ, EXPLORER_PIN=pin), timeout=60).stdout
    got, affinity = out.strip().split(";")
    return got, affinity


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins cores on Linux only")
@pytest.mark.parametrize(("local_rank", "threads"), [(0, 1), (1, 1), (5, 1), (1, 2), (0, 99)])
def test_pin_cpu_rank_takes_its_block_of_allowed_cores_round_robin(local_rank, threads):
    cores = sorted(os.sched_getaffinity(0))
    k = min(threads, len(cores))  # never more cores than the process may use
    want = sorted({cores[(local_rank * k + i) % len(cores)] for i in range(k)})
    assert _pin_in_child(local_rank, "1", threads) == (str(want), str(want))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins cores on Linux only")
def test_pinning_can_be_turned_off(monkeypatch):
    assert _pin_in_child(1, "0") == ("None", str(sorted(os.sched_getaffinity(0))))
    monkeypatch.setenv("EXPLORER_PIN", "0")
    assert not cpu.pinning()


@pytest.mark.parametrize(("var", "check", "suffix"), [
    pytest.param("EXPLORER_PIN", "pinning", "|pinned", marks=pytest.mark.skipif(
        not hasattr(os, "sched_setaffinity"), reason="pins cores on Linux only")),
    pytest.param("EXPLORER_MALLOC", "holding_memory", "|held", marks=pytest.mark.skipif(
        platform.libc_ver()[0] != "glibc", reason="glibc's allocator only"))])
def test_each_rank_setting_measures_the_link_apart(monkeypatch, var, check, suffix):
    """Ranks set up differently wait and copy differently (pinned ranks wait less for a late
    receive): the host's link is cached per setting."""
    monkeypatch.setenv("EXPLORER_PIN", "0")
    monkeypatch.setenv("EXPLORER_MALLOC", "0")
    plain = host_cache.cache_key()
    monkeypatch.setenv(var, "1")
    assert getattr(cpu, check)()
    assert host_cache.cache_key() == plain + suffix


# ---- CPU ranks keep the memory they free

# A step's worth of large blocks, allocated, written and freed twenty times; prints the minor
# page faults of the last fifteen rounds and whether the setting took.
_HOLD_CHILD = """
import resource, sys, torch
from explorer.platforms.cpu import hold_freed_memory
held = hold_freed_memory()
def step():
    blocks = [torch.empty(2**20).fill_(1.0) for _ in range(3)]  # 3 x 4 MiB
    del blocks
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(15):
    step()
print(held, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _hold_in_child(setting: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _HOLD_CHILD], check=True, capture_output=True,
                         text=True, env=dict(os.environ, EXPLORER_MALLOC=setting),
                         timeout=60).stdout
    held, faults = out.split()
    return held == "True", int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_held_memory_is_reused_without_page_faults(monkeypatch):
    """Held, the rounds reuse the same pages. (With glibc's defaults, whether 12 MiB freed
    at the heap's top goes back to the kernel, and every round faults its 3,072 pages in
    again, depends on the process's earlier allocations: it did in two of six fresh
    processes here, so the defaults are not asserted.)"""
    for _ in range(3):
        held, faults = _hold_in_child("1")
        assert held and faults < 300, faults
    off, _ = _hold_in_child("0")
    assert not off
    monkeypatch.setenv("EXPLORER_MALLOC", "0")
    assert not cpu.holding_memory()
