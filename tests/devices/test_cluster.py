"""Tests of explorer.devices.cluster: presets, links, round trips, CLI specs, discovery."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
import time
import types
from dataclasses import replace

import pytest

from explorer.core.errors import ExplorerError, UnknownNameError
from explorer.core.limits import MAX_DEVICES
from explorer.devices import discovery
from explorer.devices.cluster import (
    MAX_CPU_RANKS_PER_CORE,
    Cluster,
    Device,
    Link,
    max_cpu_ranks,
    parse_devices,
)
from explorer.platforms.cpu import host as cpu_host
from explorer.platforms.cpu import host_cache

GiB = 2**30


@pytest.fixture
def nominal_cpu(monkeypatch):
    """Make every ``Cluster.cpu`` call use nominal numbers, so nothing is measured."""
    monkeypatch.setattr(cpu_host, "host_profile", lambda measure: cpu_host.nominal_profile())


def _children() -> list[int]:
    """Pids of this process's live or zombie children, read from /proc."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            out.append(int(entry))
    return out


# ---- presets


def test_presets_have_sane_datasheet_values():
    names = Cluster.presets()
    for required in ("A100-40GB", "A100-80GB", "H100", "H200", "V100", "T4", "L4", "A10G"):
        assert required in names
    assert "RTX4090" in names
    for name in names:
        c = Cluster.preset(name)
        assert len(c) == 1 and c.ids == (f"{name}:0",)
        d = c.devices[0]
        assert d.kind == "cuda" and not d.present and d.torch_device == ""
        assert 8 * GiB <= d.memory_bytes <= 200 * GiB
        assert 5e12 <= d.flops_per_s < d.half_flops_per_s <= 1.0e15
        assert 2e11 <= d.mem_bandwidth_bytes_per_s <= 6e12
        assert 50 <= d.power_w <= 1000
        assert 0.1 * d.power_w <= d.idle_power_w <= 0.25 * d.power_w
        assert "https://" in d.source and "nominal" in d.source
        assert d.type_key == f"cuda:{d.name}"
        assert 1e10 <= c.default_link.bandwidth_bytes_per_s <= 1e12
        assert 0 < c.default_link.latency_s < 1e-4
    h100 = Cluster.preset("H100").devices[0]
    assert h100.half_flops_per_s == pytest.approx(989e12)  # dense, not the 1,979 sparsity figure
    assert h100.memory_bytes == 80 * GiB
    assert Cluster.preset("A100-40GB").devices[0].mem_bandwidth_bytes_per_s == 1555e9
    assert Cluster.preset("2xV100").default_link.bandwidth_bytes_per_s == 150e9
    assert Cluster.preset("2xA100-80GB").default_link.bandwidth_bytes_per_s == 300e9
    assert Cluster.preset("2xH100").default_link.bandwidth_bytes_per_s == 450e9
    assert "per direction" in Cluster.preset("2xH100").default_link.source


@pytest.mark.parametrize(
    ("spec", "ids"),
    [
        ("4xH100", ("H100:0", "H100:1", "H100:2", "H100:3")),
        ("4xh100", ("H100:0", "H100:1", "H100:2", "H100:3")),
        ("H100", ("H100:0",)),
        ("2 x t4", ("T4:0", "T4:1")),
        ("8xA100-40GB", tuple(f"A100-40GB:{i}" for i in range(8))),
        ("a100_80gb", ("A100-80GB:0",)),
        ("2XRTX-4090", ("RTX4090:0", "RTX4090:1")),
    ],
)
def test_preset_forms(spec, ids):
    c = Cluster.preset(spec)
    assert c.ids == ids
    assert len({d.type_key for d in c.devices}) == 1


def test_mixed_preset_links():
    c = Cluster.preset("2xH100+2xT4")
    assert c.ids == ("H100:0", "H100:1", "T4:0", "T4:1")
    assert c.link("H100:0", "H100:1").bandwidth_bytes_per_s == 450e9
    assert c.link("H100:1", "T4:0").bandwidth_bytes_per_s == 16e9  # T4's PCIe 3.0 is slowest
    assert c.link("T4:1", "T4:0").bandwidth_bytes_per_s == 16e9


def test_presets_of_more_than_a_server_are_nodes_of_eight_over_infiniband():
    c = Cluster.preset("20xH100")
    assert [d.node for d in c.devices] == [0] * 8 + [1] * 8 + [2] * 4
    assert c.nodes == 3
    assert c.link("H100:0", "H100:7").bandwidth_bytes_per_s == 450e9  # NVLink in a server
    assert c.link("H100:7", "H100:8").bandwidth_bytes_per_s == 50e9  # one 400 Gb/s NIC
    assert "InfiniBand" in c.network_link.source and "nodes: 3" in c.describe()
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert Cluster.preset("8xH100").nodes == 1 and Cluster.preset("8xH100").network_link is None
    assert Cluster.preset("16xA100-80GB").network_link.bandwidth_bytes_per_s == 25e9
    assert Cluster.preset("16xT4").nodes == 1  # (not sold in servers with a NIC per GPU)
    sub = c.subset(["H100:0", "H100:1"])
    assert sub.network_link is None and sub.link("H100:0", "H100:1") == c.default_link


def test_a_ring_across_nodes_runs_one_ring_per_network_interface():
    c = Cluster.preset("24xH100")
    ids = c.ids
    assert c.ring_link(ids[:8]).bandwidth_bytes_per_s == 450e9
    assert c.ring_link(ids).bandwidth_bytes_per_s == 8 * 50e9  # 8 NICs a node, in parallel
    assert c.ring_link(ids[::8]).bandwidth_bytes_per_s == 50e9  # one GPU (and NIC) a node
    assert c.ring_link([*ids[:8], *ids[8:10]]).bandwidth_bytes_per_s == 2 * 50e9
    # the order the group is given in does not change the ring a collective library builds
    assert c.ring_link(ids[::-1]) == c.ring_link(ids)
    assert c.ring_link(ids[::8]).latency_s == c.network_link.latency_s


def test_a_cluster_on_several_nodes_needs_a_network_link():
    dev = Cluster.preset("2xH100").devices
    with pytest.raises(ExplorerError, match="network_link"):
        Cluster("two", (dev[0], replace(dev[1], node=1)), Cluster.preset("2xH100").default_link)
    with pytest.raises(ExplorerError, match="node number"):
        replace(dev[0], node=-1)


def test_unknown_preset_lists_names():
    with pytest.raises(UnknownNameError) as e:
        Cluster.preset("4xB300")
    msg = str(e.value)
    assert "B300" in msg
    for name in Cluster.presets():
        assert name in msg
    assert isinstance(e.value, ExplorerError)
    with pytest.raises(ExplorerError, match=">= 1"):
        Cluster.preset("0xH100")


# ---- links, lookup, subset, round trip


def test_link_transfer_time():
    lk = Link(5e-6, 100e9, "test")
    assert lk.transfer_s(0) == 0.0
    assert lk.transfer_s(10**9) == pytest.approx(5e-6 + 0.01)
    assert lk.transfer_s(1) == pytest.approx(5e-6 + 1e-11)
    with pytest.raises(ExplorerError):
        Link(-1.0, 1e9, "bad")
    with pytest.raises(ExplorerError):
        Link(0.0, 0.0, "bad")
    with pytest.raises(ExplorerError, match="late_receive_s"):
        Link(0.0, 1e9, "bad", late_receive_s=-1e-3)


def test_without_late_receive_clears_every_link():
    late = Link(1e-4, 1e9, "gloo", late_receive_s=2e-3)
    base = Cluster.cpu(3, measure=False)
    c = Cluster(base.name, base.devices, late, (("cpu:0", "cpu:2", late),))
    assert "+2.00 ms if sent before its receive is posted" in c.describe()
    on_time = c.without_late_receive()
    assert on_time.link("cpu:0", "cpu:1").late_receive_s == 0.0
    assert on_time.link("cpu:2", "cpu:0").late_receive_s == 0.0
    assert on_time.link("cpu:0", "cpu:2").latency_s == 1e-4  # the rest is kept
    assert "if sent before" not in on_time.describe()


def test_link_lookup_and_overrides():
    base = Cluster.preset("3xT4")
    fast = Link(1e-6, 1e12, "override")
    c = Cluster(base.name, base.devices, base.default_link, (("T4:2", "T4:0", fast),))
    assert c.link("T4:0", "T4:2") is fast and c.link("T4:2", "T4:0") is fast
    assert c.link("T4:0", "T4:1") == base.default_link
    same = c.link("T4:1", "T4:1")
    assert same.latency_s == 0 and math.isinf(same.bandwidth_bytes_per_s)
    assert same.transfer_s(10**9) == 0.0
    with pytest.raises(UnknownNameError, match="T4:0, T4:1, T4:2"):
        c.link("T4:0", "T4:9")
    with pytest.raises(UnknownNameError, match="T4:0"):
        c.device("cuda:0")
    assert c.device("T4:1").id == "T4:1"
    with pytest.raises(ExplorerError):
        Cluster("bad", base.devices, base.default_link, (("T4:0", "nope", fast),))
    with pytest.raises(ExplorerError, match="twice"):
        Cluster("bad", base.devices * 2, base.default_link)


def test_subset_keeps_order_and_links():
    base = Cluster.preset("4xH100")
    fast = Link(1e-6, 1e12, "override")
    c = Cluster(base.name, base.devices, base.default_link, (("H100:1", "H100:3", fast),))
    s = c.subset(["H100:3", "H100:1"])
    assert s.ids == ("H100:3", "H100:1")
    assert s.link("H100:1", "H100:3") is fast
    s2 = c.subset(["H100:2", "H100:0"])
    assert s2.links == () and len(s2) == 2
    assert c.subset("H100:2").ids == ("H100:2",)
    with pytest.raises(UnknownNameError):
        c.subset(["H100:7"])
    with pytest.raises(ExplorerError, match="twice"):
        c.subset(["H100:0", "H100:0"])


def test_round_trip_through_json(nominal_cpu):
    base = Cluster.preset("2xA100-80GB+2xL4")
    inf = Link(0.0, math.inf, "infinitely fast")
    c = Cluster(base.name, base.devices, base.default_link, (*base.links, ("L4:0", "L4:1", inf)))
    text = json.dumps(c.to_dict(), allow_nan=False)
    back = Cluster.from_dict(json.loads(text))
    assert back == c
    cpu = Cluster.cpu(2, measure=False)
    assert Cluster.from_dict(json.loads(json.dumps(cpu.to_dict()))) == cpu
    with pytest.raises(ExplorerError, match="malformed"):
        Cluster.from_dict({"name": "x", "devices": [{"id": "a"}], "default_link": {}})


def test_device_validation():
    d = Cluster.preset("T4").devices[0]
    with pytest.raises(ExplorerError, match="kind"):
        Device(**{**d.__dict__, "kind": "tpu"})
    with pytest.raises(ExplorerError, match="flops_per_s"):
        Device(**{**d.__dict__, "flops_per_s": 0.0})


def test_describe_mentions_devices_links_and_sources():
    text = Cluster.preset("2xH100").describe()
    assert "H100:0" in text and "H100:1" in text
    assert "989.0 TFLOP/s" in text and "450.0 GB/s" in text
    assert "sources:" in text and "datasheet" in text
    assert len(text.splitlines()) >= 6


# ---- CPU ranks


def test_cpu_nominal_is_instant():
    t0 = time.perf_counter()
    c = Cluster.cpu(2, measure=False)
    assert time.perf_counter() - t0 < 0.5
    assert c.ids == ("cpu:0", "cpu:1") and c.name == "cpu:2"
    for d in c.devices:
        assert d.kind == "cpu" and d.present and d.torch_device == "cpu"
        assert d.name == "CPU rank (1 thread)" and d.type_key == "cpu:CPU rank (1 thread)"
        assert d.half_flops_per_s == d.flops_per_s
        assert d.memory_bytes > 0
        assert "nominal" in d.source and "W per busy core" in d.source
    assert "nominal" in c.default_link.source
    ram = discovery.total_memory_bytes()
    assert Cluster.cpu(4, measure=False).devices[0].memory_bytes * 4 <= ram


@pytest.mark.parametrize("n", [0, -3])
def test_cpu_needs_at_least_one_rank(n):
    with pytest.raises(ExplorerError, match=">= 1"):
        Cluster.cpu(n, measure=False)


@pytest.mark.parametrize("spec", ["cpu:100000000", "cpu:" + "9" * 5000])
def test_more_cpu_ranks_than_the_machine_can_run_are_refused(spec):
    limit, why = max_cpu_ranks()
    assert 1 <= limit <= MAX_CPU_RANKS_PER_CORE * (os.cpu_count() or 1)
    with pytest.raises(ExplorerError, match=f"more than this machine can run: at most {limit} "
                                            rf"\({why}\)"):
        parse_devices(spec)
    assert len(Cluster.cpu(limit, measure=False).devices) == limit
    with pytest.raises(ExplorerError, match=f"at most {limit}"):
        Cluster.cpu(limit + 1, measure=False)


@pytest.mark.parametrize("spec", ["100000000xH100", "65536xH100+1xT4", "9" * 5000 + "xH100",
                                  "4097xH100", "4096xH100+1xT4"])
def test_presets_with_too_many_gpus_are_refused(spec):
    """A cluster may have as many devices as a plan may use (one limit for both)."""
    with pytest.raises(ExplorerError, match="more than the 4,096 a cluster may have"):
        Cluster.preset(spec)


def test_a_cluster_has_at_most_the_devices_a_plan_may_use():
    assert len(Cluster.preset("4096xH100")) == MAX_DEVICES
    one = Cluster.preset("H100").devices[0]
    devices = tuple(replace(one, id=f"H100:{i}") for i in range(MAX_DEVICES + 1))
    with pytest.raises(ExplorerError, match=r"cluster 'big' has 4,097 devices, more than the "
                                            r"4,096 a cluster \(and a plan\) may have"):
        Cluster("big", devices, Cluster.preset("H100").default_link)


@pytest.mark.parametrize("spec", ["cpu:\u0661\u0662", "cpu:\uff12", "cpu:\u00b2", "cpu:1_0",
                                  "cpu:+2", "cpu: 2 2"])
def test_cpu_ranks_are_written_in_ascii_digits(spec):
    with pytest.raises(ExplorerError, match=r"in 'cpu:N', N must be an integer >= 1 "
                                            r"written in the digits 0-9"):
        parse_devices(spec)


def test_a_cpu_count_of_thousands_of_digits_says_the_real_limit():
    limit, why = max_cpu_ranks()
    with pytest.raises(ExplorerError) as err:
        parse_devices("cpu:" + "9" * 5000)
    assert str(err.value) == (f"cpu:N with N of 5,000 digits is more than this machine can "
                              f"run: at most {limit} ({why}); ask for fewer")


@pytest.mark.parametrize("spec", ["\u0664xH100", "\uff14xH100"])
def test_preset_counts_are_written_in_ascii_digits(spec):
    with pytest.raises(ExplorerError, match="unknown GPU preset"):
        Cluster.preset(spec)


def test_failed_link_measurement_falls_back_to_nominal(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_host.forget_measurements()
    monkeypatch.setattr(cpu_host, "measure_matmul_flops", lambda: 1e10)
    monkeypatch.setattr(cpu_host, "measure_copy_bandwidth", lambda: 2e9)

    def broken():
        raise cpu_host.LinkMeasureError("boom")

    monkeypatch.setattr(cpu_host, "measure_gloo_link", broken)
    c = Cluster.cpu(2)
    assert c.devices[0].flops_per_s == 1e10 and "measured" in c.devices[0].source
    assert "nominal" in c.default_link.source and "boom" in c.default_link.source
    assert not (tmp_path / "partition-explorer" / "cpu-profile.json").exists()


@pytest.mark.parametrize("missing", ["late_receive_s", "link_probes"])
def test_a_cached_profile_from_before_the_late_receive_wait_is_measured_again(
        monkeypatch, tmp_path, missing):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_host.forget_measurements()
    monkeypatch.setattr(cpu_host, "measure_matmul_flops", lambda: 1e10)
    monkeypatch.setattr(cpu_host, "measure_copy_bandwidth", lambda: 2e9)
    calls = []

    def link():
        calls.append(1)
        return 1e-4, 1e9, 3e-3, 2e-4, 5e8, 3e-4, 4e8, 1e-4, 6e8

    monkeypatch.setattr(cpu_host, "measure_gloo_link", link)
    old = {k: 1.0 for k in cpu_host.PROFILE_KEYS} | {"compute_source": "old", "link_source": "old",
                                                "late_receive_s": 1e-3, "link_probes": 1}
    del old[missing]  # from before the late-receive wait; from when one probe measured it
    host_cache.write_cache(host_cache.cache_file(), host_cache.cache_key(), old)
    with pytest.warns(UserWarning, match=f"damaged or incomplete \\({missing} is not"):
        c = Cluster.cpu(2)
    assert calls == [1] * cpu_host.LINK_PROBES and c.default_link.late_receive_s == 3e-3
    cpu_host.forget_measurements()  # the new entry is read back, not measured again
    assert Cluster.cpu(2).default_link.late_receive_s == 3e-3
    assert calls == [1] * cpu_host.LINK_PROBES


def test_the_link_is_the_median_of_its_probes(monkeypatch, tmp_path):
    """One unlucky probe (here the second: slow all-reduce, long late wait) does not set the
    host's link for good; a failed probe is left out."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_host.forget_measurements()
    monkeypatch.setattr(cpu_host, "measure_matmul_flops", lambda: 1e10)
    monkeypatch.setattr(cpu_host, "measure_copy_bandwidth", lambda: 2e9)
    monkeypatch.setattr(cpu_host, "LINK_PROBES", 4)
    # (latency, bandwidth, late wait, then latency and bandwidth of the all-reduce,
    # reduce-scatter and all-gather)
    probes = iter([(1e-4, 2e9, 3e-4, 2e-4, 1.0e9, 5e-4, 3e8, 1e-4, 2e9),
                   (3e-4, 1e9, 9e-3, 9e-4, 0.5e9, 9e-4, 1e8, 8e-4, 1e9),
                   None, (2e-4, 3e9, 4e-4, 1e-4, 1.1e9, 4e-4, 4e8, 2e-4, 3e9)])

    def link():
        got = next(probes)
        if got is None:
            raise cpu_host.LinkMeasureError("boom")
        return got

    monkeypatch.setattr(cpu_host, "measure_gloo_link", link)
    lk = Cluster.cpu(2).default_link
    assert (lk.latency_s, lk.bandwidth_bytes_per_s) == (2e-4, 2e9)
    assert (lk.allreduce_latency_s, lk.allreduce_bandwidth_bytes_per_s) == (2e-4, 1.0e9)
    assert lk.late_receive_s == 4e-4
    assert (lk.reduce_scatter_latency_s, lk.reduce_scatter_bandwidth_bytes_per_s) == (5e-4, 3e8)
    assert (lk.allgather_latency_s, lk.allgather_bandwidth_bytes_per_s) == (2e-4, 2e9)
    assert "median of 3 probes" in lk.source  # the three that ran


@pytest.mark.slow
def test_link_measurement_time_limit_kills_children():
    t0 = time.perf_counter()
    with pytest.raises(cpu_host.LinkMeasureError, match="within"):
        cpu_host.measure_gloo_link(timeout_s=0.3)
    assert time.perf_counter() - t0 < 5
    assert multiprocessing.active_children() == []
    assert _children() == []


@pytest.mark.slow
def test_cpu_ranks_really_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_host.forget_measurements()
    t0 = time.perf_counter()
    c = Cluster.cpu(2)
    took = time.perf_counter() - t0
    lk, d = c.default_link, c.devices[0]
    numbers = (
        f"took {took:.1f} s: {d.flops_per_s / 1e9:.1f} GFLOP/s, "
        f"{d.mem_bandwidth_bytes_per_s / 1e9:.1f} GB/s copy, link {lk.latency_s * 1e6:.1f} us, "
        f"{lk.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
    )
    assert "measured" in lk.source and "gloo" in lk.source, lk.source
    assert 0 < lk.latency_s < 0.1, numbers
    assert 0 < lk.late_receive_s < 0.05, numbers + f", late receive {lk.late_receive_s}"
    assert "late receive" in lk.source, lk.source
    assert lk.bandwidth_bytes_per_s > 10e6, numbers
    assert d.flops_per_s > 1e8 and d.mem_bandwidth_bytes_per_s > 1e8, numbers
    assert "measured" in d.source
    # ~1 s for compute and 5 s per link probe on 2 idle cores; each probe is killed at 15 s
    assert took < 45, numbers
    assert multiprocessing.active_children() == []
    assert _children() == []
    assert (tmp_path / "partition-explorer" / "cpu-profile.json").exists()
    cpu_host.forget_measurements()  # read back from the disk cache: instant and equal
    t0 = time.perf_counter()
    again = Cluster.cpu(2)
    assert time.perf_counter() - t0 < 0.5
    assert again == c



@pytest.fixture
def host_measured(monkeypatch, tmp_path):
    """An empty host measurement cache, and a stand-in for measuring the host (instant, its
    figures unlike the nominal ones) that counts its calls in the list returned."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_host.forget_measurements()
    monkeypatch.setattr(cpu_host, "measure_matmul_flops", lambda: 1e10)
    monkeypatch.setattr(cpu_host, "measure_copy_bandwidth", lambda: 2e9)
    monkeypatch.setattr(cpu_host, "LINK_PROBES", 1)
    calls = []

    def link():
        calls.append("link")
        return 1e-4, 2e9, 3e-4, 2e-4, 1.0e9, 5e-4, 3e8, 1e-4, 2e9
    monkeypatch.setattr(cpu_host, "measure_gloo_link", link)
    yield calls
    cpu_host.forget_measurements()


def test_cpu_ranks_measured_later_measure_nothing_until_asked(host_measured):
    later = Cluster.cpu(2, measure="later")
    assert host_measured == [] and later.measure_later
    assert later.ids == ("cpu:0", "cpu:1") and later.name == "cpu:2"
    assert later.devices[0].flops_per_s == cpu_host.CPU_NOMINAL_FLOPS_PER_S
    assert all("not measured yet" in d.source for d in later.devices)
    assert "not measured yet" in later.default_link.source
    assert "ex.profile (or cluster.measured()) measures them" in later.describe()
    assert Cluster.from_dict(json.loads(json.dumps(later.to_dict()))) == later
    assert later.subset(["cpu:1"]).measure_later
    measured = later.measured()
    assert host_measured == ["link"] and not measured.measure_later
    # the same cluster as measuring at once (which now reads what was measured)
    assert measured == Cluster.cpu(2) and host_measured == ["link"]
    assert measured.devices[0].flops_per_s == 1e10 and measured.default_link.latency_s == 1e-4
    assert measured.measured() is measured
    # once measured (and cached), a cluster measured later is measured from the start
    assert Cluster.cpu(2, measure="later") == measured
    assert parse_devices("cpu:2", measure="later") == measured
    cpu_host.forget_measurements()  # (read from the cache file, not measured again)
    assert Cluster.cpu(2, measure="later") == measured and host_measured == ["link"]


def test_without_late_receive_of_a_cluster_measured_later_is_of_the_measured_one(
        host_measured):
    later = Cluster.cpu(3, measure="later")
    quick = later.without_late_receive()
    assert host_measured == ["link"] and not quick.measure_later
    assert quick == Cluster.cpu(3).without_late_receive()
    assert quick.devices[0].flops_per_s == 1e10 and quick.default_link.late_receive_s == 0


def test_discover_without_gpus_measures_the_host_later(host_measured, monkeypatch):
    monkeypatch.setattr(discovery, "nvml_gpus", lambda: ("no NVIDIA GPU found", []))
    later = Cluster.discover(measure="later")
    assert later.measure_later and "no NVIDIA GPU found" in later.name
    assert host_measured == []
    measured = later.measured()
    assert measured.name == later.name and measured == Cluster.discover()
    assert host_measured == ["link"]


def test_profiling_a_cluster_measured_later_measures_the_host_first(host_measured, chain3):
    import explorer as ex

    later = Cluster.cpu(2, measure="later")
    assert host_measured == []
    costs = ex.profile(chain3, later, progress=False)
    assert host_measured == ["link"] and costs.cluster == Cluster.cpu(2)
    assert not costs.cluster.measure_later and host_measured == ["link"]


@pytest.mark.parametrize("measure", ["soon", "now", None, 1])
def test_cpu_measure_is_true_false_or_later(measure):
    with pytest.raises(ExplorerError, match=r"measure=.* is not known"):
        Cluster.cpu(2, measure=measure)


# ---- discovery


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(gpus, *, fail_init=False):
    """A stand-in for the ``pynvml`` module that reports ``gpus`` (name, MiB, mW, nvlink)."""
    calls = []

    def init():
        calls.append("init")
        if fail_init:
            raise _FakeNVMLError("Driver Not Loaded")

    def handle(i):
        return gpus[i]

    def nvlink(h, link):
        if not h[3]:
            raise _FakeNVMLError("Not Supported")
        return 1

    mod = types.SimpleNamespace(
        NVMLError=_FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: h[0],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=h[1] * 2**20),
        nvmlDeviceGetEnforcedPowerLimit=lambda h: h[2],
        nvmlDeviceGetNvLinkState=nvlink,
        nvmlDeviceGetUUID=lambda h: f"GPU-{gpus.index(h):04d}-uuid",
    )
    return mod, calls


def _fallback_name():
    return f"cpu:{min(os.cpu_count() or 1, 8)} (no NVIDIA GPU found"


def test_discover_without_driver_falls_back_to_cpu_ranks(monkeypatch, nominal_cpu):
    fake, calls = _fake_pynvml([], fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    c = Cluster.discover()
    assert c.name.startswith(_fallback_name()) and "Driver Not Loaded" in c.name
    assert len(c) == min(os.cpu_count() or 1, 8)
    assert all(d.kind == "cpu" and d.present for d in c.devices)
    assert calls == ["init"]


def test_discover_without_nvidia_ml_py(monkeypatch, nominal_cpu):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes ``import pynvml`` fail
    c = Cluster.discover()
    assert c.name.startswith(_fallback_name()) and "not installed" in c.name


def test_discover_on_this_machine_never_fails(nominal_cpu):
    c = Cluster.discover()
    assert len(c) >= 1
    assert all(d.kind in ("cpu", "cuda") for d in c.devices)


def test_discover_maps_nvml_gpus_to_presets(monkeypatch, nominal_cpu):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = [("NVIDIA H100 80GB HBM3", 81559, 700_000, True)] * 2
    fake, calls = _fake_pynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    c = Cluster.discover()
    assert calls == ["init", "shutdown"]
    assert c.ids == ("cuda:0", "cuda:1")
    d = c.devices[0]
    assert d.name == "NVIDIA H100 80GB HBM3" and d.kind == "cuda"
    assert d.memory_bytes == 81559 * 2**20
    assert d.half_flops_per_s == pytest.approx(989e12) and d.power_w == 700
    assert d.source.startswith("nvml") and "datasheet" in d.source
    assert c.link("cuda:0", "cuda:1").bandwidth_bytes_per_s == 450e9
    torch_cuda = discovery.torch_cuda_count() >= 2
    assert d.present == torch_cuda and d.torch_device == ("cuda:0" if torch_cuda else "")


def test_discover_honours_visible_devices_and_odd_gpus(monkeypatch, nominal_cpu):
    gpus = [
        ("NVIDIA A100-SXM4-80GB", 81920, 400_000, False),  # no NVLink: PCIe numbers
        ("NVIDIA A100-SXM4-80GB", 81920, 400_000, False),
        ("Some Future GPU", 16 * 1024, 0, False),  # no preset, no power reading
    ]
    fake, _ = _fake_pynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    c = Cluster.discover()
    assert c.ids == ("cuda:0", "cuda:1")
    assert c.devices[0].mem_bandwidth_bytes_per_s == 2039e9  # the 80GB A100 by memory
    assert c.default_link.bandwidth_bytes_per_s == 32e9
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0002")
    odd = Cluster.discover()
    assert odd.ids == ("cuda:0",) and odd.devices[0].name == "Some Future GPU"
    assert "no preset" in odd.devices[0].source and odd.devices[0].power_w > 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    hidden = Cluster.discover()
    assert hidden.devices[0].kind == "cpu" and "CUDA_VISIBLE_DEVICES" in hidden.name


# ---- CLI specs


def test_parse_devices_forms(monkeypatch, nominal_cpu):
    assert parse_devices("cpu:3").ids == ("cpu:0", "cpu:1", "cpu:2")
    assert parse_devices(" CPU:1 ").ids == ("cpu:0",)
    assert len(parse_devices("cpu")) == 2
    assert parse_devices("4xH100").ids == tuple(f"H100:{i}" for i in range(4))
    assert parse_devices("2xh100+t4").ids == ("H100:0", "H100:1", "T4:0")
    fake, _ = _fake_pynvml([], fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert parse_devices("gpu").devices[0].kind == "cpu"


@pytest.mark.parametrize(
    ("spec", "error", "text"),
    [
        ("cpu:0", ExplorerError, ">= 1"),
        ("cpu:two", ExplorerError, "integer"),
        ("", ExplorerError, "cpu:N"),
        ("tpu:4", UnknownNameError, "cpu:N"),
        ("3xB300", UnknownNameError, "H100"),
    ],
)
def test_parse_devices_errors(spec, error, text, nominal_cpu):
    with pytest.raises(error, match=text):
        parse_devices(spec)
