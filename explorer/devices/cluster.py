"""The devices a training step can be split across: CPU ranks, local NVIDIA GPUs, GPU presets.

A :class:`Cluster` is a tuple of :class:`Device` records plus the :class:`Link` model of how fast
bytes move between two of them (:mod:`explorer.devices.records`). Three ways to get one:

* :meth:`Cluster.cpu` -- ``n`` CPU ranks on this machine, one process with one thread each, each
  pinned to a core (:func:`explorer.platforms.cpu.pin_cpu_rank`). Their compute speed, memory
  bandwidth and the rank-to-rank link (``torch.distributed`` gloo over 127.0.0.1) are measured
  once and cached per host and torch version (:mod:`explorer.platforms.cpu.host`). With
  ``measure="later"`` nothing is measured on construction: a host not measured yet gets
  nominal figures until :meth:`Cluster.measured` (which :func:`explorer.profile` calls) does.
* :meth:`Cluster.discover` -- the NVIDIA GPUs that NVML sees, with datasheet peaks of the nearest
  preset; CPU ranks when there is no driver.
* :meth:`Cluster.preset` -- GPUs from vendor datasheets, e.g. ``"4xH100"``, that need not be here.

Units: bytes, seconds, FLOP/s, bytes/s, watts. Bandwidths from datasheets are decimal (1 GB/s =
1e9 bytes/s); memory sizes are the datasheet figure taken as GiB, a little more than what the
driver lets a program use. Link bandwidths are per direction.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from itertools import pairwise
from typing import Any, Literal

from explorer.core.errors import ExplorerError, UnknownNameError, unknown_name
from explorer.core.limits import MAX_DEVICES
from explorer.devices import discovery, presets
from explorer.devices.records import SAME_DEVICE_LINK, Device, GiB, Link, json_safe, record
from explorer.platforms.cpu import host as cpu_host

#: ``discover`` falls back to at most this many CPU ranks
MAX_FALLBACK_CPU_RANKS = 8
#: CPU ranks are processes of this machine: at most this many per core it may use ...
MAX_CPU_RANKS_PER_CORE = 8
#: ... and each needs at least this much memory (a process with torch loaded)
MIN_CPU_RANK_MEMORY_BYTES = 256 * 2**20

#: when ``Cluster.cpu`` measures this host: True now (or read the cache), False never
#: (nominal figures), "later" read the cache or else leave it to :meth:`Cluster.measured`
HostMeasure = bool | Literal["later"]

__all__ = ["MAX_FALLBACK_CPU_RANKS", "Cluster", "Device", "HostMeasure", "Link", "max_cpu_ranks",
           "parse_devices"]


@dataclass(frozen=True)
class Cluster:
    """Devices in a fixed order plus the links between them.

    ``default_link`` connects every pair of distinct devices unless ``links`` overrides it for
    that (unordered) pair. ``measure_later``: the CPU ranks' speeds and links are nominal
    figures standing in for this host's measurements, which :meth:`measured` takes
    (``Cluster.cpu(n, measure="later")`` on a host not measured yet).

    Devices on different nodes (``Device.node``: servers) talk over ``network_link`` instead of
    ``default_link``: one network interface per device, as GPU servers with a NIC per GPU
    have (``Cluster.preset("64xH100")``: nodes of 8 over InfiniBand).
    """

    name: str
    devices: tuple[Device, ...]
    default_link: Link
    links: tuple[tuple[str, str, Link], ...] = ()
    measure_later: bool = False
    network_link: Link | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(tuple(x) for x in self.links))
        if len(self.devices) > MAX_DEVICES:
            raise ExplorerError(f"cluster {self.name!r} has {len(self.devices):,} devices, more "
                                f"than the {MAX_DEVICES:,} a cluster (and a plan) may have; "
                                "use fewer")
        if not self.devices:
            raise ExplorerError(f"cluster {self.name!r} has no devices")
        seen: set[str] = set()
        for d in self.devices:
            if d.id in seen:
                raise ExplorerError(f"cluster {self.name!r} has device id {d.id!r} twice")
            seen.add(d.id)
        if self.network_link is None and len({d.node for d in self.devices}) > 1:
            raise ExplorerError(f"cluster {self.name!r} has devices on several nodes but no "
                                "network_link between nodes; give one")
        for a, b, _ in self.links:
            for x in (a, b):
                if x not in seen:
                    raise unknown_name("device in link override", x, seen)
            if a == b:
                raise ExplorerError(f"link override from {a!r} to itself")

    # ---- lookup

    @cached_property
    def _by_id(self) -> dict[str, Device]:
        return {d.id: d for d in self.devices}

    @cached_property
    def _link_map(self) -> dict[frozenset[str], Link]:
        return {frozenset((a, b)): link for a, b, link in self.links}

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def device(self, device_id: str) -> Device:
        try:
            return self._by_id[device_id]
        except (KeyError, TypeError):
            raise unknown_name("device", device_id, self.ids) from None

    def link(self, a: str, b: str) -> Link:
        """The link between devices ``a`` and ``b`` (either order)."""
        self.device(a)
        self.device(b)
        if a == b:
            return SAME_DEVICE_LINK
        override = self._link_map.get(frozenset((a, b)))
        if override is not None:
            return override
        if self.network_link is not None and self._by_id[a].node != self._by_id[b].node:
            return self.network_link
        return self.default_link

    @property
    def nodes(self) -> int:
        """How many nodes (servers) the devices are on."""
        return len({d.node for d in self.devices})

    def ring_link(self, ids: Iterable[str]) -> Link:
        """The slowest hop of a ring over ``ids``, as a collective library builds it: in the
        given order on one node; across nodes with each node's members next to each other,
        the hops between nodes running in parallel on as many network interfaces as the node
        with the fewest members has (one per device: NCCL runs a ring per NIC), so they carry
        that many times the network link's bandwidth."""
        ids = list(ids)
        by_node: dict[int, list[str]] = {}
        for i in ids:
            by_node.setdefault(self.device(i).node, []).append(i)
        if self.network_link is not None and len(by_node) > 1:
            inside = [self.link(a, b) for members in by_node.values()
                      for a, b in pairwise(members)]
            share = min(len(members) for members in by_node.values())
            across = replace(self.network_link, bandwidth_bytes_per_s=share
                             * self.network_link.bandwidth_bytes_per_s)
            hops = [*inside, across]
        else:
            hops = [self.link(a, b) for a, b in zip(ids, [*ids[1:], *ids[:1]], strict=True)
                    if a != b]
        if not hops:
            return SAME_DEVICE_LINK
        slow = min(hops, key=lambda lk: lk.bandwidth_bytes_per_s)
        return replace(slow, latency_s=max(lk.latency_s for lk in hops))

    def subset(self, ids: Iterable[str]) -> Cluster:
        """The cluster of just ``ids``, in that order, with the links among them."""
        ids = (ids,) if isinstance(ids, str) else tuple(ids)
        devices = tuple(self.device(i) for i in ids)
        if len(set(ids)) != len(ids):
            raise ExplorerError(f"subset names a device twice: {', '.join(ids)}")
        keep = set(ids)
        links = tuple((a, b, lk) for a, b, lk in self.links if a in keep and b in keep)
        if ids == self.ids:
            return self
        return Cluster(f"{self.name} [{', '.join(ids)}]", devices, self.default_link, links,
                       self.measure_later,
                       self.network_link if len({d.node for d in devices}) > 1 else None)

    def without_late_receive(self) -> Cluster:
        """This cluster with no late-receive wait on any link (``Link.late_receive_s``): as
        if every rank had a core to spare, or to see what the wait adds to a prediction (of
        the :meth:`measured` cluster: the wait is a measurement of the host)."""
        base = self.measured()
        return replace(base, default_link=replace(base.default_link, late_receive_s=0.0),
                       links=tuple((a, b, replace(lk, late_receive_s=0.0))
                                   for a, b, lk in base.links))

    def measured(self) -> Cluster:
        """This cluster with this host's measured figures for its CPU ranks and their links in
        place of the nominal ones standing in for them (``measure_later``); any other cluster
        as it is. The host is measured once per host and torch version (a few seconds; then
        cached, see :mod:`explorer.platforms.cpu.host`). :func:`explorer.profile` calls it: a
        cost model's ``costs.cluster`` is the measured cluster."""
        if not self.measure_later:
            return self
        prof = cpu_host.host_profile(True)
        pending = cpu_host.pending_profile()["compute_source"]
        devices = tuple(
            replace(d, flops_per_s=prof["flops_per_s"], half_flops_per_s=prof["flops_per_s"],
                    mem_bandwidth_bytes_per_s=prof["mem_bandwidth_bytes_per_s"],
                    source=prof["compute_source"] + d.source.removeprefix(pending))
            if d.kind == "cpu" else d
            for d in self.devices
        )
        link = _cpu_link(prof)
        return replace(self, devices=devices, default_link=link,
                       links=tuple((a, b, link) for a, b, _ in self.links), measure_later=False)

    # ---- serialisation

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (infinite numbers become the string ``"inf"``)."""
        return {
            "name": self.name,
            "devices": [json_safe(asdict(d)) for d in self.devices],
            "default_link": json_safe(asdict(self.default_link)),
            "links": [[a, b, json_safe(asdict(lk))] for a, b, lk in self.links],
            **({"measure_later": True} if self.measure_later else {}),
            **({"network_link": json_safe(asdict(self.network_link))}
               if self.network_link is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(
                name=str(d["name"]),
                devices=tuple(record(Device, x) for x in d["devices"]),
                default_link=record(Link, d["default_link"]),
                links=tuple((str(a), str(b), record(Link, lk)) for a, b, lk in d.get("links", ())),
                measure_later=d.get("measure_later", False) is True,
                network_link=(record(Link, d["network_link"])
                              if d.get("network_link") is not None else None),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ExplorerError(f"malformed cluster description: {e!r}") from None

    # ---- display

    def describe(self) -> str:
        """A table of the devices, their links and where the numbers come from."""
        header = ("id", "name", "memory", "fp32", "bf16/fp16", "mem bw", "power (idle)", "here")
        rows = [header]
        for d in self.devices:
            rows.append(
                (
                    d.id,
                    d.name,
                    f"{d.memory_bytes / GiB:.1f} GiB",
                    _fmt_flops(d.flops_per_s),
                    _fmt_flops(d.half_flops_per_s),
                    _fmt_rate(d.mem_bandwidth_bytes_per_s),
                    f"{d.power_w:.0f} W ({d.idle_power_w:.0f} W)",
                    "yes" if d.present else "no",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [f"Cluster {self.name}: {len(self)} device{'s' if len(self) != 1 else ''}"]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
            lines[-1] = lines[-1].rstrip()
        if self.network_link is not None:
            lines.append(f"nodes: {self.nodes}; {_fmt_link(self.network_link)} between devices "
                         "on different nodes (one network interface each)")
        inside = " on one node" if self.network_link is not None else ""
        lines.append(f"links: {_fmt_link(self.default_link)} between any two devices{inside}")
        for a, b, lk in self.links:
            lines.append(f"  {a} <-> {b}: {_fmt_link(lk)}")
        lines.append("sources:")
        by_source: dict[str, list[str]] = {}
        for d in self.devices:
            by_source.setdefault(d.source, []).append(d.id)
        for source, ids in by_source.items():
            lines.append(f"  {', '.join(ids)}: {source}")
        network = [] if self.network_link is None else [self.network_link]
        for lk in dict.fromkeys([self.default_link, *network, *(lk for _, _, lk in self.links)]):
            lines.append(f"  link {_fmt_link(lk, with_source=False)}: {lk.source}")
        if self.measure_later:
            lines.append("this host's CPU ranks are not measured yet: ex.profile (or "
                         "cluster.measured()) measures them")
        return "\n".join(lines)

    # ---- constructors

    @classmethod
    def cpu(cls, n: int = 2, measure: HostMeasure = True) -> Cluster:
        """``n`` CPU ranks, each a process with one thread (``torch.set_num_threads(1)``).

        With ``measure`` the per-rank compute and copy speed and the gloo link between two local
        processes are measured (a few seconds, once per host and torch version; later calls read
        the cache). Without it, nominal numbers are used and nothing runs. With
        ``measure="later"`` nothing runs either: the cached measurements are used where there
        are some, else nominal numbers until :meth:`measured` (called by
        :func:`explorer.profile`) measures the host (the cluster's ``measure_later``).
        """
        if not (isinstance(measure, bool) or measure == "later"):
            raise ExplorerError(f"measure={measure!r} is not known; use True (measure this host "
                                "now), 'later' (when profiled) or False (nominal figures)")
        if isinstance(n, bool) or not isinstance(n, int):
            raise ExplorerError(f"the number of CPU ranks must be an integer, not {n!r}")
        if n < 1:
            raise ExplorerError(f"the number of CPU ranks n must be >= 1, not {n}")
        limit, why = max_cpu_ranks()
        if n > limit:
            raise ExplorerError(f"{n} CPU ranks are more than this machine can run: at most "
                                f"{limit} ({why}); ask for fewer, or plan for GPUs with a "
                                "preset such as '8xH100'")
        later = False
        if measure == "later":
            prof = cpu_host.cached_profile()
            if prof is None:
                prof, later = cpu_host.pending_profile(), True
        else:
            prof = cpu_host.host_profile(measure)
        memory = discovery.total_memory_bytes() // n
        devices = tuple(
            Device(
                id=f"cpu:{i}",
                kind="cpu",
                name=cpu_host.CPU_RANK_NAME,
                memory_bytes=memory,
                flops_per_s=prof["flops_per_s"],
                half_flops_per_s=prof["flops_per_s"],
                mem_bandwidth_bytes_per_s=prof["mem_bandwidth_bytes_per_s"],
                power_w=cpu_host.CPU_CORE_POWER_W,
                idle_power_w=cpu_host.CPU_CORE_IDLE_POWER_W,
                present=True,
                torch_device="cpu",
                source=(f"{prof['compute_source']}; memory: RAM / {n} ranks; "
                        f"{cpu_host.CPU_POWER_NOTE}"),
            )
            for i in range(n)
        )
        return cls(f"cpu:{n}", devices, _cpu_link(prof), measure_later=later)

    @classmethod
    def discover(cls, measure: HostMeasure = True) -> Cluster:
        """The NVIDIA GPUs visible on this machine, or CPU ranks when there are none.

        Memory and power limit come from NVML, peaks from the datasheet of the nearest preset.
        GPU ``i`` in NVML order is ``cuda:i`` for torch, which holds with
        ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or with identical GPUs; ``CUDA_VISIBLE_DEVICES`` is
        honoured. Without NVML or a GPU the result is
        ``cpu(min(os.cpu_count(), 8), measure)`` with the reason in its name.
        """
        reason, gpus = discovery.nvml_gpus()
        if not gpus:
            fallback = cls.cpu(min(os.cpu_count() or 1, MAX_FALLBACK_CPU_RANKS), measure)
            return replace(fallback, name=f"{fallback.name} ({reason})")
        torch_ok = discovery.torch_cuda_count() >= len(gpus)
        devices = []
        for i, g in enumerate(gpus):
            spec, how = presets.nearest_spec(g["name"], g["memory_bytes"])
            power = g["power_w"] if g["power_w"] > 0 else spec.tdp_w
            devices.append(
                Device(
                    id=f"cuda:{i}",
                    kind="cuda",
                    name=g["name"],
                    memory_bytes=g["memory_bytes"],
                    flops_per_s=spec.flops_per_s,
                    half_flops_per_s=spec.half_flops_per_s,
                    mem_bandwidth_bytes_per_s=spec.mem_bandwidth_bytes_per_s,
                    power_w=power,
                    idle_power_w=presets.GPU_IDLE_FRACTION * power,
                    present=torch_ok,
                    torch_device=f"cuda:{i}" if torch_ok else "",
                    source=(
                        "nvml (memory, power limit) + datasheet peaks of preset "
                        f"{spec.key} ({how}): {spec.citation}; idle power nominal "
                        f"{presets.GPU_IDLE_FRACTION:.0%} of the power limit"
                        + ("" if torch_ok else "; this torch cannot run on it (no CUDA)")
                    ),
                )
            )
        keys = [presets.nearest_spec(g["name"], g["memory_bytes"])[0].key for g in gpus]
        groups = [
            (key, [d.id for d, k in zip(devices, keys, strict=True) if k == key], nvlink)
            for key, nvlink in discovery.group_nvlink(gpus)
        ]
        default, links = presets.gpu_links(groups)
        n = len(devices)
        name = f"{n}x{devices[0].name}" if len({d.name for d in devices}) == 1 else "local GPUs"
        return cls(name, tuple(devices), default, links)

    @classmethod
    def preset(cls, spec: str) -> Cluster:
        """GPUs from datasheets: ``"H100"``, ``"4xH100"``, ``"8xA100-40GB"``, ``"2xH100+2xT4"``.

        Names are case-insensitive (see :meth:`presets`); device ids are ``"<PRESET>:<i>"``.
        More than 8 GPUs of a kind sold in servers of 8 with a network interface per GPU
        (V100, A100, H100, H200: NVIDIA's DGX and HGX) are nodes of 8, GPU ``i`` on node
        ``i // 8``, NVLink inside a node and the server's InfiniBand between nodes. Other
        presets are one node of any size.
        """
        parts = presets.parse_preset_spec(spec)
        devices: list[Device] = []
        counter: dict[str, int] = {}
        for count, gpu in parts:
            for _ in range(count):
                i = counter.get(gpu.key, 0)
                counter[gpu.key] = i + 1
                devices.append(gpu.device(f"{gpu.key}:{i}"))
        groups = [
            (key, [d.id for d in devices if d.id.rsplit(":", 1)[0] == key], True)
            for key in counter
        ]
        default, links = presets.gpu_links(groups)
        name = "+".join(f"{n}x{key}" for key, n in counter.items())
        network = parts[0][1].network if len(parts) == 1 else None
        if network is None or len(devices) <= presets.SERVER_GPUS:
            return cls(name, tuple(devices), default, links)
        devices = [replace(d, node=i // presets.SERVER_GPUS) for i, d in enumerate(devices)]
        return cls(name, tuple(devices), default, links, network_link=network)

    @staticmethod
    def presets() -> list[str]:
        """Names of the known GPU presets."""
        return list(presets.GPU_SPECS)


def max_cpu_ranks() -> tuple[int, str]:
    """How many CPU ranks this machine can run, and what bounds it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    memory = discovery.total_memory_bytes()
    by_cores = MAX_CPU_RANKS_PER_CORE * cores
    by_memory = max(1, memory // MIN_CPU_RANK_MEMORY_BYTES)
    if min(by_cores, by_memory) > MAX_DEVICES:
        return MAX_DEVICES, f"the {MAX_DEVICES:,} devices a cluster may have"
    why = (f"{MAX_CPU_RANKS_PER_CORE} per core on {cores} cores" if by_cores <= by_memory
           else f"{MIN_CPU_RANK_MEMORY_BYTES // 2**20} MiB each of {memory / GiB:.1f} GiB of "
                "memory")
    return min(by_cores, by_memory), why


def parse_devices(spec: str, measure: HostMeasure = True) -> Cluster:
    """The cluster a command-line ``--devices`` value names.

    ``"cpu"`` or ``"cpu:N"``: N CPU ranks (2 by default); ``"gpu"`` or ``"auto"``: the GPUs on
    this machine (CPU ranks if none); ``"H100"``, ``"4xH100"``, ``"2xH100+2xT4"``: GPU presets.
    ``measure``: when CPU ranks measure this host (see :meth:`Cluster.cpu`).
    """
    forms = (
        "'cpu:N' (N CPU ranks), 'gpu' (this machine's NVIDIA GPUs), "
        "or a GPU preset like '4xH100' or '2xA100-80GB+2xT4'"
    )
    if not isinstance(spec, str) or not spec.strip():
        raise ExplorerError(f"empty device spec; use {forms}")
    s = spec.strip().lower()
    if s == "cpu":
        return Cluster.cpu(measure=measure)
    if s.startswith("cpu:"):
        n = s[4:].strip()
        if not re.fullmatch(r"[0-9]+", n):  # ASCII digits only: int() reads other scripts' too
            raise ExplorerError(f"bad device spec {shown_spec(spec)}: in 'cpu:N', N must be an "
                                "integer >= 1 written in the digits 0-9")
        digits = len(n.lstrip("0"))
        if digits > 9:  # (never int() of thousands of digits)
            limit, why = max_cpu_ranks()
            raise ExplorerError(f"cpu:N with N of {digits:,} digits is more than this machine "
                                f"can run: at most {limit} ({why}); ask for fewer")
        return Cluster.cpu(int(n), measure)
    if s in ("gpu", "gpus", "auto"):
        return Cluster.discover(measure)
    try:
        return Cluster.preset(spec)
    except UnknownNameError as e:
        raise UnknownNameError(
            f"unknown device spec {spec!r}: {e}. Accepted forms: {forms}"
        ) from None


def _cpu_link(prof: dict[str, Any]) -> Link:
    """The link between two CPU ranks of a host profile (:mod:`explorer.platforms.cpu.host`)."""
    return Link(prof["link_latency_s"], prof["link_bandwidth_bytes_per_s"], prof["link_source"],
                prof["allreduce_latency_s"], prof["allreduce_bandwidth_bytes_per_s"],
                prof["late_receive_s"], prof["reduce_scatter_latency_s"],
                prof["reduce_scatter_bandwidth_bytes_per_s"], prof["allgather_latency_s"],
                prof["allgather_bandwidth_bytes_per_s"])


def shown_spec(spec: str) -> str:
    """A device spec as an error message shows it: quoted, cut short when long."""
    text = repr(spec)
    return text if len(text) <= 40 else text[:37] + "..."


def _fmt_flops(x: float) -> str:
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def _fmt_rate(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return f"{x / 1e12:.2f} TB/s" if x >= 1e12 else f"{x / 1e9:.1f} GB/s"


def _fmt_link(lk: Link, with_source: bool = False) -> str:
    s = f"{lk.latency_s * 1e6:.1f} us + bytes / {_fmt_rate(lk.bandwidth_bytes_per_s)}"
    if lk.late_receive_s > 0:
        s += f"; +{lk.late_receive_s * 1e3:.2f} ms if sent before its receive is posted"
    return f"{s} ({lk.source})" if with_source else s
