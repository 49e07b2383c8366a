"""The devices a training step can be split across: CPU ranks, local NVIDIA GPUs, GPU presets.

A :class:`Cluster` is a tuple of :class:`Device` records plus the :class:`Link` model of how fast
bytes move between two of them. Three ways to get one:

* :meth:`Cluster.cpu` -- ``n`` CPU ranks on this machine, one process with one thread each, each
  pinned to a core (:func:`pin_cpu_rank`). Their compute speed, memory bandwidth and the
  rank-to-rank link (``torch.distributed`` gloo over 127.0.0.1) are measured once and cached
  per host and torch version.
* :meth:`Cluster.discover` -- the NVIDIA GPUs that NVML sees, with datasheet peaks of the nearest
  preset; CPU ranks when there is no driver.
* :meth:`Cluster.preset` -- GPUs from vendor datasheets, e.g. ``"4xH100"``, that need not be here.

Units: bytes, seconds, FLOP/s, bytes/s, watts. Bandwidths from datasheets are decimal (1 GB/s =
1e9 bytes/s); memory sizes are the datasheet figure taken as GiB, a little more than what the
driver lets a program use. Link bandwidths are per direction.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from explorer.core.errors import ExplorerError, UnknownNameError, unknown_name

#: device kinds
KINDS = ("cpu", "cuda")

GiB = 2**30
_GB = 1e9
_T = 1e12

#: nominal power of one busy / idle CPU core running one rank (no portable way to measure it)
CPU_CORE_POWER_W = 15.0
CPU_CORE_IDLE_POWER_W = 3.0
#: nominal numbers for a CPU rank when nothing is measured
CPU_NOMINAL_FLOPS_PER_S = 50e9
CPU_NOMINAL_MEM_BANDWIDTH_BYTES_PER_S = 10e9
GLOO_NOMINAL_LATENCY_S = 50e-6
GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S = 1e9
#: idle power of a GPU preset, as a fraction of its TDP (nominal: datasheets do not give it)
GPU_IDLE_FRACTION = 0.15
#: ``discover`` falls back to at most this many CPU ranks
MAX_FALLBACK_CPU_RANKS = 8
#: hard limit on the gloo link measurement; past it the children are killed
LINK_MEASURE_TIMEOUT_S = 15.0

CPU_RANK_NAME = "CPU rank (1 thread)"
_CPU_POWER_NOTE = (
    f"power nominal {CPU_CORE_POWER_W:g} W per busy core, {CPU_CORE_IDLE_POWER_W:g} W idle"
)


# --------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class Device:
    """One device that runs part of a training step.

    ``present`` says whether the device is on this machine, so torch can profile and run on it
    through ``torch_device`` (``""`` when not present). ``source`` says where the numbers come
    from. Devices with equal :attr:`type_key` are the same hardware and share one profile.
    """

    id: str
    kind: str
    name: str
    memory_bytes: int
    flops_per_s: float
    half_flops_per_s: float
    mem_bandwidth_bytes_per_s: float
    power_w: float
    idle_power_w: float
    present: bool
    torch_device: str
    source: str

    def __post_init__(self) -> None:
        if not self.id:
            raise ExplorerError("a device needs a non-empty id")
        if self.kind not in KINDS:
            raise ExplorerError(
                f"device {self.id!r} has kind {self.kind!r}; use one of: {', '.join(KINDS)}"
            )
        if self.memory_bytes < 0:
            raise ExplorerError(f"device {self.id!r} has negative memory_bytes")
        for name in ("flops_per_s", "half_flops_per_s", "mem_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ExplorerError(f"device {self.id!r} needs {name} > 0, not {value!r}")
        if self.power_w < 0 or self.idle_power_w < 0:
            raise ExplorerError(f"device {self.id!r} has negative power")

    @property
    def type_key(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class Link:
    """How long moving bytes between two devices takes: ``latency_s + nbytes / bandwidth``.

    ``allreduce_latency_s`` and ``allreduce_bandwidth_bytes_per_s``, when set (> 0), are an
    all-reduce between two ranks measured as a whole (``latency + nbytes / bandwidth``): a
    library's collective is not two point-to-point transfers (gloo on CPU ranks reduces in
    its own threads, in chunks); 0 means "derive it from the link as a ring".

    ``late_receive_s`` is how long a message waits, beyond the transfer, when its receive is
    posted after it was sent while the sender computes: gloo moves a message only once the
    receive is posted, and then the sender's communication thread must get a core, which on
    a host whose cores all compute waits for the scheduler. Measured between CPU ranks of one
    host; 0 where there is no such wait (NCCL, a spare core) or it was not measured.
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    source: str
    allreduce_latency_s: float = 0.0
    allreduce_bandwidth_bytes_per_s: float = 0.0
    late_receive_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ExplorerError(f"link latency_s must be >= 0, not {self.latency_s!r}")
        if not self.late_receive_s >= 0:
            raise ExplorerError(f"link late_receive_s must be >= 0, not {self.late_receive_s!r}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ExplorerError(
                f"link bandwidth_bytes_per_s must be > 0, not {self.bandwidth_bytes_per_s!r}"
            )

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` one way; nothing to move costs nothing."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


SAME_DEVICE_LINK = Link(0.0, math.inf, "same device")


@dataclass(frozen=True)
class Cluster:
    """Devices in a fixed order plus the links between them.

    ``default_link`` connects every pair of distinct devices unless ``links`` overrides it for
    that (unordered) pair.
    """

    name: str
    devices: tuple[Device, ...]
    default_link: Link
    links: tuple[tuple[str, str, Link], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(tuple(x) for x in self.links))
        if not self.devices:
            raise ExplorerError(f"cluster {self.name!r} has no devices")
        seen: set[str] = set()
        for d in self.devices:
            if d.id in seen:
                raise ExplorerError(f"cluster {self.name!r} has device id {d.id!r} twice")
            seen.add(d.id)
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
        return self._link_map.get(frozenset((a, b)), self.default_link)

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
        return Cluster(f"{self.name} [{', '.join(ids)}]", devices, self.default_link, links)

    def without_late_receive(self) -> Cluster:
        """This cluster with no late-receive wait on any link (``Link.late_receive_s``): as
        if every rank had a core to spare, or to see what the wait adds to a prediction."""
        return replace(self, default_link=replace(self.default_link, late_receive_s=0.0),
                       links=tuple((a, b, replace(lk, late_receive_s=0.0))
                                   for a, b, lk in self.links))

    # ---- serialisation

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (infinite numbers become the string ``"inf"``)."""
        return {
            "name": self.name,
            "devices": [_json_safe(asdict(d)) for d in self.devices],
            "default_link": _json_safe(asdict(self.default_link)),
            "links": [[a, b, _json_safe(asdict(lk))] for a, b, lk in self.links],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(
                name=str(d["name"]),
                devices=tuple(_record(Device, x) for x in d["devices"]),
                default_link=_record(Link, d["default_link"]),
                links=tuple((str(a), str(b), _record(Link, lk)) for a, b, lk in d.get("links", ())),
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
        lines.append(f"links: {_fmt_link(self.default_link)} between any two devices")
        for a, b, lk in self.links:
            lines.append(f"  {a} <-> {b}: {_fmt_link(lk)}")
        lines.append("sources:")
        by_source: dict[str, list[str]] = {}
        for d in self.devices:
            by_source.setdefault(d.source, []).append(d.id)
        for source, ids in by_source.items():
            lines.append(f"  {', '.join(ids)}: {source}")
        for lk in dict.fromkeys([self.default_link, *(lk for _, _, lk in self.links)]):
            lines.append(f"  link {_fmt_link(lk, with_source=False)}: {lk.source}")
        return "\n".join(lines)

    # ---- constructors

    @classmethod
    def cpu(cls, n: int = 2, measure: bool = True) -> Cluster:
        """``n`` CPU ranks, each a process with one thread (``torch.set_num_threads(1)``).

        With ``measure`` the per-rank compute and copy speed and the gloo link between two local
        processes are measured (a few seconds, once per host and torch version; later calls read
        the cache). Without it, nominal numbers are used and nothing runs.
        """
        if isinstance(n, bool) or not isinstance(n, int):
            raise ExplorerError(f"the number of CPU ranks must be an integer, not {n!r}")
        if n < 1:
            raise ExplorerError(f"the number of CPU ranks n must be >= 1, not {n}")
        prof = _cpu_profile(measure)
        memory = _total_memory_bytes() // n
        devices = tuple(
            Device(
                id=f"cpu:{i}",
                kind="cpu",
                name=CPU_RANK_NAME,
                memory_bytes=memory,
                flops_per_s=prof["flops_per_s"],
                half_flops_per_s=prof["flops_per_s"],
                mem_bandwidth_bytes_per_s=prof["mem_bandwidth_bytes_per_s"],
                power_w=CPU_CORE_POWER_W,
                idle_power_w=CPU_CORE_IDLE_POWER_W,
                present=True,
                torch_device="cpu",
                source=f"{prof['compute_source']}; memory: RAM / {n} ranks; {_CPU_POWER_NOTE}",
            )
            for i in range(n)
        )
        link = Link(prof["link_latency_s"], prof["link_bandwidth_bytes_per_s"], prof["link_source"],
                    prof["allreduce_latency_s"], prof["allreduce_bandwidth_bytes_per_s"],
                    prof["late_receive_s"])
        return cls(f"cpu:{n}", devices, link)

    @classmethod
    def discover(cls) -> Cluster:
        """The NVIDIA GPUs visible on this machine, or CPU ranks when there are none.

        Memory and power limit come from NVML, peaks from the datasheet of the nearest preset.
        GPU ``i`` in NVML order is ``cuda:i`` for torch, which holds with
        ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or with identical GPUs; ``CUDA_VISIBLE_DEVICES`` is
        honoured. Without NVML or a GPU the result is
        ``cpu(min(os.cpu_count(), 8))`` with the reason in its name.
        """
        reason, gpus = _nvml_gpus()
        if not gpus:
            fallback = cls.cpu(min(os.cpu_count() or 1, MAX_FALLBACK_CPU_RANKS))
            return replace(fallback, name=f"{fallback.name} ({reason})")
        torch_ok = _torch_cuda_count() >= len(gpus)
        devices = []
        for i, g in enumerate(gpus):
            spec, how = _nearest_spec(g["name"], g["memory_bytes"])
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
                    idle_power_w=GPU_IDLE_FRACTION * power,
                    present=torch_ok,
                    torch_device=f"cuda:{i}" if torch_ok else "",
                    source=(
                        "nvml (memory, power limit) + datasheet peaks of preset "
                        f"{spec.key} ({how}): {spec.citation}; idle power nominal "
                        f"{GPU_IDLE_FRACTION:.0%} of the power limit"
                        + ("" if torch_ok else "; this torch cannot run on it (no CUDA)")
                    ),
                )
            )
        keys = [_nearest_spec(g["name"], g["memory_bytes"])[0].key for g in gpus]
        groups = [
            (key, [d.id for d, k in zip(devices, keys, strict=True) if k == key], nvlink)
            for key, nvlink in _group_nvlink(gpus)
        ]
        default, links = _gpu_links(groups)
        n = len(devices)
        name = f"{n}x{devices[0].name}" if len({d.name for d in devices}) == 1 else "local GPUs"
        return cls(name, tuple(devices), default, links)

    @classmethod
    def preset(cls, spec: str) -> Cluster:
        """GPUs from datasheets: ``"H100"``, ``"4xH100"``, ``"8xA100-40GB"``, ``"2xH100+2xT4"``.

        Names are case-insensitive (see :meth:`presets`); device ids are ``"<PRESET>:<i>"``.
        """
        parts = _parse_preset_spec(spec)
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
        default, links = _gpu_links(groups)
        name = "+".join(f"{n}x{key}" for key, n in counter.items())
        return cls(name, tuple(devices), default, links)

    @staticmethod
    def presets() -> list[str]:
        """Names of the known GPU presets."""
        return list(GPU_SPECS)


def parse_devices(spec: str) -> Cluster:
    """The cluster a command-line ``--devices`` value names.

    ``"cpu"`` or ``"cpu:N"``: N CPU ranks (2 by default); ``"gpu"`` or ``"auto"``: the GPUs on
    this machine (CPU ranks if none); ``"H100"``, ``"4xH100"``, ``"2xH100+2xT4"``: GPU presets.
    """
    forms = (
        "'cpu:N' (N CPU ranks), 'gpu' (this machine's NVIDIA GPUs), "
        "or a GPU preset like '4xH100' or '2xA100-80GB+2xT4'"
    )
    if not isinstance(spec, str) or not spec.strip():
        raise ExplorerError(f"empty device spec; use {forms}")
    s = spec.strip().lower()
    if s == "cpu":
        return Cluster.cpu()
    if s.startswith("cpu:"):
        n = s[4:].strip()
        if not n.isdigit():
            raise ExplorerError(f"bad device spec {spec!r}: in 'cpu:N', N must be an integer >= 1")
        return Cluster.cpu(int(n))
    if s in ("gpu", "gpus", "auto"):
        return Cluster.discover()
    try:
        return Cluster.preset(spec)
    except UnknownNameError as e:
        raise UnknownNameError(
            f"unknown device spec {spec!r}: {e}. Accepted forms: {forms}"
        ) from None


# --------------------------------------------------------------------------------------------
# GPU presets (datasheet numbers; dense, i.e. without structured-sparsity speedups)


@dataclass(frozen=True)
class _GpuSpec:
    key: str
    device_name: str  # as NVML reports it
    memory_bytes: int
    flops_per_s: float
    half_flops_per_s: float
    mem_bandwidth_bytes_per_s: float
    tdp_w: float
    citation: str
    link: Link  # GPU to GPU inside one server
    host_link: Link  # PCIe to the host (and between GPUs without NVLink)

    def device(self, device_id: str) -> Device:
        return Device(
            id=device_id,
            kind="cuda",
            name=self.device_name,
            memory_bytes=self.memory_bytes,
            flops_per_s=self.flops_per_s,
            half_flops_per_s=self.half_flops_per_s,
            mem_bandwidth_bytes_per_s=self.mem_bandwidth_bytes_per_s,
            power_w=self.tdp_w,
            idle_power_w=GPU_IDLE_FRACTION * self.tdp_w,
            present=False,
            torch_device="",
            source=(
                f"datasheet {self.citation}; idle power nominal {GPU_IDLE_FRACTION:.0%} of TDP"
            ),
        )


_LAT = 5e-6
_LAT_NOTE = "latency nominal 5 us"


def _nvlink(gen: int, gb_per_s: float) -> Link:
    return Link(
        _LAT,
        gb_per_s * _GB,
        f"datasheet NVLink {gen}: {gb_per_s:g} GB/s per GPU per direction "
        f"({2 * gb_per_s:g} GB/s bidirectional), an upper bound reached with NVSwitch; "
        + _LAT_NOTE,
    )


def _pcie(gen: int, note: str = "") -> Link:
    gb = {3: 16, 4: 32, 5: 64}[gen]
    return Link(
        _LAT,
        gb * _GB,
        f"PCIe {gen}.0 x16: {gb} GB/s per direction ({2 * gb} GB/s bidirectional){note}; "
        + _LAT_NOTE,
    )


_NVLINK2, _NVLINK3, _NVLINK4 = _nvlink(2, 150), _nvlink(3, 300), _nvlink(4, 450)
_PCIE3, _PCIE4, _PCIE5 = _pcie(3), _pcie(4), _pcie(5)
_A100_DS = (
    "NVIDIA A100 Tensor Core GPU datasheet, SXM column, "
    "https://www.nvidia.com/en-us/data-center/a100/"
)

GPU_SPECS: dict[str, _GpuSpec] = {
    s.key: s
    for s in (
        _GpuSpec(
            "V100", "Tesla V100-SXM2-32GB", 32 * GiB, 15.7 * _T, 125 * _T, 900 * _GB, 300,
            "NVIDIA Tesla V100 GPU datasheet, SXM2 column (fp16 tensor; V100 has no bf16), "
            "https://www.nvidia.com/en-us/data-center/v100/",
            _NVLINK2, _PCIE3,
        ),
        _GpuSpec(
            "A100-40GB", "NVIDIA A100-SXM4-40GB", 40 * GiB, 19.5 * _T, 312 * _T, 1555 * _GB,
            400, _A100_DS + " (40GB HBM2)", _NVLINK3, _PCIE4,
        ),
        _GpuSpec(
            "A100-80GB", "NVIDIA A100-SXM4-80GB", 80 * GiB, 19.5 * _T, 312 * _T, 2039 * _GB,
            400, _A100_DS + " (80GB HBM2e)", _NVLINK3, _PCIE4,
        ),
        _GpuSpec(
            "H100", "NVIDIA H100 80GB HBM3", 80 * GiB, 67 * _T, 989 * _T, 3350 * _GB, 700,
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (bf16 1,979 TFLOPS is with "
            "sparsity; dense is half), https://www.nvidia.com/en-us/data-center/h100/",
            _NVLINK4, _PCIE5,
        ),
        _GpuSpec(
            "H200", "NVIDIA H200", 141 * GiB, 67 * _T, 989 * _T, 4800 * _GB, 700,
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (bf16 1,979 TFLOPS is with "
            "sparsity; dense is half), https://www.nvidia.com/en-us/data-center/h200/",
            _NVLINK4, _PCIE5,
        ),
        _GpuSpec(
            "T4", "Tesla T4", 16 * GiB, 8.1 * _T, 65 * _T, 320 * _GB, 70,
            "NVIDIA T4 Tensor Core GPU datasheet (fp16 mixed precision; T4 has no bf16), "
            "https://www.nvidia.com/en-us/data-center/tesla-t4/",
            _PCIE3, _PCIE3,
        ),
        _GpuSpec(
            "L4", "NVIDIA L4", 24 * GiB, 30.3 * _T, 121 * _T, 300 * _GB, 72,
            "NVIDIA L4 Tensor Core GPU datasheet (bf16 242 TFLOPS is with sparsity; dense is "
            "half), https://www.nvidia.com/en-us/data-center/l4/",
            _PCIE4, _PCIE4,
        ),
        _GpuSpec(
            "A10G", "NVIDIA A10G", 24 * GiB, 31.52 * _T, 70 * _T, 600 * _GB, 300,
            "no NVIDIA datasheet exists for AWS's A10G; figures from Baseten's A10 vs A10G "
            "comparison, https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/"
            " (power: the 300 W limit AWS g5 instances report)",
            _PCIE4, _PCIE4,
        ),
        _GpuSpec(
            "RTX4090", "NVIDIA GeForce RTX 4090", 24 * GiB, 82.6 * _T, 165.2 * _T, 1008 * _GB,
            450,
            "NVIDIA Ada Lovelace GPU architecture whitepaper, RTX 4090 column (fp16/bf16 tensor "
            "with fp32 accumulate, dense), "
            "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
            "nvidia-ada-gpu-architecture.pdf",
            _pcie(4, ", no peer-to-peer: traffic goes through host memory"),
            _pcie(4, ", no peer-to-peer: traffic goes through host memory"),
        ),
    )
}

_SPEC_LOOKUP = {re.sub(r"[-_ ]", "", k.upper()): s for k, s in GPU_SPECS.items()}


def _parse_preset_spec(spec: str) -> list[tuple[int, _GpuSpec]]:
    if not isinstance(spec, str) or not spec.strip():
        raise unknown_name("GPU preset", str(spec), GPU_SPECS)
    out = []
    for part in spec.split("+"):
        m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z][\w\- ]*?)\s*", part)
        if not m:
            raise unknown_name("GPU preset", part.strip(), GPU_SPECS)
        count = int(m.group(1)) if m.group(1) is not None else 1
        if count < 1:
            raise ExplorerError(f"preset {spec!r}: the GPU count must be >= 1, not {count}")
        gpu = _SPEC_LOOKUP.get(re.sub(r"[-_ ]", "", m.group(2).upper()))
        if gpu is None:
            raise unknown_name("GPU preset", m.group(2), GPU_SPECS)
        out.append((count, gpu))
    return out


def _gpu_links(
    groups: list[tuple[str, list[str], bool]],
) -> tuple[Link, tuple[tuple[str, str, Link], ...]]:
    """Default link and overrides for GPU groups ``(preset key, ids, has NVLink)``.

    One group: its own link. Several: different GPU types meet over PCIe, so the default is the
    slowest PCIe link among them, and pairs inside a group get that group's link.
    """
    def own(key: str, nvlink: bool) -> Link:
        return GPU_SPECS[key].link if nvlink else GPU_SPECS[key].host_link

    if len(groups) == 1:
        key, _, nvlink = groups[0]
        return own(key, nvlink), ()
    hosts = [GPU_SPECS[key].host_link for key, _, _ in groups]
    slow = min(hosts, key=lambda lk: (lk.bandwidth_bytes_per_s, -lk.latency_s))
    default = Link(
        max(lk.latency_s for lk in hosts),
        slow.bandwidth_bytes_per_s,
        f"different GPU types meet over PCIe, the slowest of them: {slow.source}",
    )
    links = []
    for key, ids, nvlink in groups:
        lk = own(key, nvlink)
        if (lk.latency_s, lk.bandwidth_bytes_per_s) != (
            default.latency_s,
            default.bandwidth_bytes_per_s,
        ):
            links += [(a, b, lk) for i, a in enumerate(ids) for b in ids[i + 1 :]]
    return default, tuple(links)


# --------------------------------------------------------------------------------------------
# NVML


_NAME_PATTERNS = (
    (r"\bH200\b", "H200"),
    (r"\bH100\b", "H100"),
    (r"\bA100\b", "A100"),
    (r"\bV100\b", "V100"),
    (r"\bT4\b", "T4"),
    (r"\bL4\b", "L4"),
    (r"\bA10G?\b", "A10G"),
    (r"\b4090\b", "RTX4090"),
)


def _nearest_spec(name: str, memory_bytes: int) -> tuple[_GpuSpec, str]:
    """The preset for an NVML GPU name, and how it was chosen."""
    upper = name.upper()
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, upper):
            if key == "A100":
                key = "A100-80GB" if memory_bytes > 48 * GiB else "A100-40GB"
            return GPU_SPECS[key], "matched by name"
    spec = min(GPU_SPECS.values(), key=lambda s: abs(s.memory_bytes - memory_bytes))
    return spec, f"no preset for {name!r}; borrowed from the preset of closest memory size"


def _nvml_gpus() -> tuple[str, list[dict[str, Any]]]:
    """``(reason when empty, [{name, memory_bytes, power_w, nvlink}, ...])`` in torch order."""
    try:
        import pynvml
    except ImportError:
        return "no NVIDIA GPU found: nvidia-ml-py is not installed", []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return f"no NVIDIA GPU found: {_nvml_str(e)}", []
    try:
        count = pynvml.nvmlDeviceGetCount()
        indices = _visible_indices(pynvml, count)
        gpus = []
        for i in indices:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
            power_w = 0.0
            for get in ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"):
                try:
                    power_w = float(getattr(pynvml, get)(h)) / 1000.0
                    break
                except (pynvml.NVMLError, AttributeError):
                    continue
            try:
                nvlink = bool(pynvml.nvmlDeviceGetNvLinkState(h, 0))
            except (pynvml.NVMLError, AttributeError):
                nvlink = False
            gpus.append(
                {"name": str(name), "memory_bytes": memory, "power_w": power_w, "nvlink": nvlink}
            )
    except pynvml.NVMLError as e:
        return f"no NVIDIA GPU found: {_nvml_str(e)}", []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if not gpus:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES") is not None and count
        return ("CUDA_VISIBLE_DEVICES hides every GPU" if hidden else "no NVIDIA GPU found"), []
    return "", gpus


def _nvml_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # some pynvml versions fail to format unknown error codes
        return type(e).__name__


def _visible_indices(pynvml: Any, count: int) -> list[int]:
    """NVML indices of the GPUs CUDA will see, in CUDA's order (as CUDA_VISIBLE_DEVICES says)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    uuids: list[str] | None = None
    out: list[int] = []
    for token in (t.strip() for t in env.split(",")):
        if token.isdigit() and int(token) < count:
            idx = int(token)
        elif token.startswith("GPU-"):
            if uuids is None:
                uuids = []
                for i in range(count):
                    u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                    uuids.append(u.decode() if isinstance(u, bytes) else str(u))
            matches = [i for i, u in enumerate(uuids) if u.startswith(token)]
            if len(matches) != 1:
                break
            idx = matches[0]
        else:
            break  # CUDA ignores this entry and everything after it
        if idx in out:
            break
        out.append(idx)
    return out


def _group_nvlink(gpus: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """``(preset key, all of its GPUs have NVLink)`` per preset, in first-seen order."""
    groups: dict[str, bool] = {}
    for g in gpus:
        key = _nearest_spec(g["name"], g["memory_bytes"])[0].key
        groups[key] = groups.get(key, True) and g["nvlink"]
    return list(groups.items())


def _torch_cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA setup must not stop discovery
        return 0


# --------------------------------------------------------------------------------------------
# CPU ranks: memory, measurement, cache


def _total_memory_bytes() -> int:
    """Physical RAM, or the cgroup memory limit when that is smaller."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if total <= 0:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 * GiB  # nothing to read: a modest nominal machine
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = int(Path(path).read_text().strip())
        except (OSError, ValueError):
            continue
        if 0 < limit < total:
            total = limit
    return total


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partition-explorer" / "cpu-profile.json"


def _cache_key() -> str:
    import torch

    # ranks set up differently (pinned or not, freed memory held or not) wait and copy
    # differently: measured apart
    tag = rank_settings_tag().replace("-", "|")
    return f"{socket.gethostname()}|torch {torch.__version__}{tag}"


_PROFILE_KEYS = (
    "flops_per_s",
    "mem_bandwidth_bytes_per_s",
    "link_latency_s",
    "link_bandwidth_bytes_per_s",
    "allreduce_latency_s",
    "allreduce_bandwidth_bytes_per_s",
)
#: profiles measured in this process, by (cache file, key), including failed link measurements
_MEMO: dict[tuple[str, str], dict[str, Any]] = {}


def _nominal_profile() -> dict[str, Any]:
    return {
        "flops_per_s": CPU_NOMINAL_FLOPS_PER_S,
        "mem_bandwidth_bytes_per_s": CPU_NOMINAL_MEM_BANDWIDTH_BYTES_PER_S,
        "compute_source": (
            f"nominal, not measured: {CPU_NOMINAL_FLOPS_PER_S / 1e9:g} GFLOP/s fp32 and "
            f"{CPU_NOMINAL_MEM_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s copy per thread"
        ),
        "link_latency_s": GLOO_NOMINAL_LATENCY_S,
        "link_bandwidth_bytes_per_s": GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S,
        "allreduce_latency_s": 0.0,
        "allreduce_bandwidth_bytes_per_s": 0.0,
        "late_receive_s": 0.0,
        "link_source": _nominal_link_source("not measured"),
    }


def _nominal_link_source(why: str) -> str:
    return (
        f"nominal gloo over loopback TCP ({why}): latency {GLOO_NOMINAL_LATENCY_S * 1e6:g} us, "
        f"{GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s"
    )


def _cpu_profile(measure: bool) -> dict[str, Any]:
    """Per-rank numbers: measured (memoised and cached on disk) or nominal."""
    if not measure:
        return _nominal_profile()
    path, key = _cache_file(), _cache_key()
    memo = _MEMO.get((str(path), key))
    if memo is not None:
        return memo
    cached = _read_cache(path).get(key)
    if _valid_profile(cached):
        _MEMO[(str(path), key)] = cached
        return cached
    prof = _measure_cpu_profile()
    prof["compute_source"] += f" (cached in {path})"
    _MEMO[(str(path), key)] = prof
    if prof.pop("link_measured"):  # a failed link measurement is retried in a later process
        prof["link_source"] += f" (cached in {path})"
        _write_cache(path, key, prof)
    return prof


def _valid_profile(p: Any) -> bool:
    if not isinstance(p, dict):
        return False
    if not all(isinstance(p.get(k), str) for k in ("compute_source", "link_source")):
        return False
    probes = p.get("link_probes")  # entries from before the link was probed several times
    if not (isinstance(probes, int) and probes >= 1):  # are measured again
        return False
    late = p.get("late_receive_s")  # (0 is a measurement: no wait on this host)
    if not (isinstance(late, (int, float)) and math.isfinite(late) and late >= 0):
        return False
    return all(
        isinstance(p.get(k), (int, float)) and math.isfinite(p[k]) and p[k] > 0
        for k in _PROFILE_KEYS
    )


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, prof: dict[str, Any]) -> None:
    """Best effort: an unwritable cache only costs a re-measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = prof
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu-profile-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def _measure_cpu_profile() -> dict[str, Any]:
    import torch

    flops = _measure_matmul_flops()
    bw = _measure_copy_bandwidth()
    host = socket.gethostname()
    prof: dict[str, Any] = {
        "flops_per_s": flops,
        "mem_bandwidth_bytes_per_s": bw,
        "compute_source": (
            f"measured on {host} with torch {torch.__version__}, 1 thread: fp32 "
            f"{_MATMUL_N}x{_MATMUL_N} matmul and {_COPY_BYTES // 2**20} MiB tensor copy, medians"
        ),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        (latency, bandwidth, ar_latency, ar_bandwidth, late), probes = _median_link()
    except _LinkMeasureError as e:
        prof.update(
            link_latency_s=GLOO_NOMINAL_LATENCY_S,
            link_bandwidth_bytes_per_s=GLOO_NOMINAL_BANDWIDTH_BYTES_PER_S,
            allreduce_latency_s=0.0,
            allreduce_bandwidth_bytes_per_s=0.0,
            late_receive_s=0.0,
            link_source=_nominal_link_source(f"gloo measurement failed: {e}"),
            link_measured=False,
        )
        return prof
    prof.update(
        link_latency_s=latency,
        link_bandwidth_bytes_per_s=bandwidth,
        allreduce_latency_s=ar_latency,
        allreduce_bandwidth_bytes_per_s=ar_bandwidth,
        late_receive_s=late,
        link_probes=probes,
        link_source=(
            f"measured on {host}, each figure the median of {probes} probes (a pair of "
            "fresh processes each): torch.distributed gloo send/recv ping-pong between two local "
            f"processes over 127.0.0.1, median of {_PING_REPS} x 4 B (latency) and "
            f"{_BULK_REPS} x {_BULK_BYTES // 2**20} MiB (bandwidth); all-reduce of the same "
            f"sizes between the two, medians; late receive: {_LATE_REPS} messages sent "
            f"{_LATE_AHEAD_S * 1e3:g} ms before their receive was posted, both ranks computing, "
            "trimmed mean of the wait"
        ),
        link_measured=True,
    )
    return prof


_MATMUL_N = 256
_COPY_BYTES = 64 * 2**20


def _measure_matmul_flops() -> float:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = _MATMUL_N
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


def _measure_copy_bandwidth() -> float:
    """Bytes read plus bytes written per second by a one-thread copy of a large tensor."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(_COPY_BYTES // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        rates = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            rates.append(2 * _COPY_BYTES / (time.perf_counter() - t0))
        return float(statistics.median(rates))
    finally:
        torch.set_num_threads(threads)


class _LinkMeasureError(Exception):
    pass


def pinning() -> bool:
    """Whether CPU ranks are pinned to cores: on hosts that can (Linux), unless the
    environment variable ``EXPLORER_PIN`` is ``0``."""
    return os.environ.get("EXPLORER_PIN", "1") != "0" and hasattr(os, "sched_setaffinity")


def pin_cpu_rank(local_rank: int, threads: int = 1) -> tuple[int, ...] | None:
    """Pin the calling thread, and the threads it starts later (gloo's and torch's among
    them), to cores of their own among those this process may use: ``threads`` of them
    (one per compute thread), the ``local_rank``-th such block, round robin. Returns the
    cores, or None where ranks are not pinned (:func:`pinning`) or the host refused.

    Unpinned, two CPU ranks and their communication threads move between the cores. On the
    2-core host this was measured on (``python benchmarks/rank_settings.py``, two runs on
    2026-11-25), pinned micro-batched pipelines of GPT and ResNet (GPipe and 1F1B in four
    micro-batches) ran 4-17 % faster than unpinned, and the wait of a message sent before its
    receive was posted (``Link.late_receive_s``) fell from 1.7-3.6 ms to 0.4 ms; one-rank and
    data-parallel steps were within the noise either way.
    """
    if not pinning():
        return None
    try:
        cores = sorted(os.sched_getaffinity(0))
        k = max(1, min(threads, len(cores)))
        mine = sorted({cores[(local_rank * k + i) % len(cores)] for i in range(k)})
        os.sched_setaffinity(0, mine)
    except (OSError, IndexError):
        return None
    return tuple(mine)


#: glibc's ``mallopt`` parameters (``malloc.h``)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc accepts on 64-bit hosts (4 MiB x ``sizeof(long)``)
MMAP_THRESHOLD_BYTES = 32 * 2**20
#: free memory at the top of the heap kept rather than given back (``mallopt`` takes an int)
TRIM_THRESHOLD_BYTES = 2**31 - 1


def holding_memory() -> bool:
    """Whether rank processes keep the memory they free for their next step
    (:func:`hold_freed_memory`): on glibc hosts, unless ``EXPLORER_MALLOC`` is ``0``."""
    import platform

    return os.environ.get("EXPLORER_MALLOC", "1") != "0" and platform.libc_ver()[0] == "glibc"


def hold_freed_memory() -> bool:
    """Make glibc's allocator keep the memory this process frees, for the next step to reuse,
    instead of handing it back to the kernel and faulting it in again page by page. Returns
    whether it did (False where :func:`holding_memory` is off or the allocator refused).

    A training step on CPU allocates and frees the same large tensors every step
    (activations, gradients, the optimizer's temporaries). By default glibc serves blocks
    from a few hundred KiB up with ``mmap`` (a threshold it raises as it sees them freed)
    and trims the heap's free top beyond twice that threshold, so which of a step's tensors
    come back as fresh pages depends on the order of the process's earlier allocations: the
    same Adam step over the same 4 MiB of parameters took 5 ms in one process and 8 ms in
    another, where its temporaries were new pages each step. Blocks up to 32 MiB
    (:data:`MMAP_THRESHOLD_BYTES`, glibc's limit) now come from the heap, and the heap keeps
    up to 2 GiB of free top: what a rank holds is its peak, as on a GPU with PyTorch's caching
    allocator. Measured with ``python benchmarks/rank_settings.py --setting malloc`` (see
    README, accuracy).
    """
    if not holding_memory():
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def rank_settings_tag() -> str:
    """What the CPU ranks' process settings are (pinned, freed memory held), as a cache key
    suffix: ranks set up differently run at different speeds, so they are measured apart."""
    return ("-pinned" if pinning() else "") + ("-held" if holding_memory() else "")


_PING_REPS = 200
_BULK_REPS = 10
_BULK_BYTES = 8 * 2**20
_LATE_REPS = 60
_LATE_AHEAD_S = 0.003
_LATE_TAIL_S = 0.008

# Run as ``python -c _GLOO_CHILD rank port timeout_s``. Rank 0 prints one JSON line.
_GLOO_CHILD = f"""
import datetime, json, os, statistics, sys, threading, time
rank, port, timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
watchdog = threading.Timer(timeout_s, os._exit, (3,))
watchdog.daemon = True
watchdog.start()
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from explorer.devices.cluster import hold_freed_memory, pin_cpu_rank
pin_cpu_rank(rank)  # as the runtime sets up its CPU ranks
hold_freed_memory()
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=timeout_s),
)
def pingpong(t, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2
small = torch.zeros(1)
pingpong(small, 20)
latency = pingpong(small, {_PING_REPS})
big = torch.zeros({_BULK_BYTES // 4})
pingpong(big, 2)
one_way = pingpong(big, {_BULK_REPS})
def allreduce(t, reps):
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
allreduce(small, 10)
ar_small = allreduce(small, {_PING_REPS // 2})
allreduce(big, 2)
ar_big = allreduce(big, {_BULK_REPS})
# late receive: both ranks compute (small matrix products); rank 1 sends {_LATE_AHEAD_S * 1e3:g} ms
# before rank 0 posts the receive, and computes on until {_LATE_TAIL_S * 1e3:g} ms after it; the
# data was there, so rank 0's whole wait is lateness
a = torch.randn(256, 256)
def compute(s):
    t_end = time.perf_counter() + s
    while time.perf_counter() < t_end:
        a @ a
def late(reps):
    waits = []
    for it in range(reps):
        dist.barrier()
        if rank == 1:
            compute({_LATE_AHEAD_S})
            work = dist.isend(small, 0, tag=it)
            compute({_LATE_AHEAD_S + _LATE_TAIL_S})
            work.wait()
        else:
            compute({2 * _LATE_AHEAD_S})
            t0 = time.perf_counter()
            dist.recv(small, 1, tag=it)
            waits.append(time.perf_counter() - t0)
    return waits
late(5)
waits = sorted(late({_LATE_REPS}))
cut = len(waits) // 10
late_s = statistics.fmean(waits[cut:len(waits) - cut]) if rank == 0 else 0.0
dist.destroy_process_group()
if rank == 0:
    print(json.dumps({{"latency_s": latency, "one_way_s": one_way, "ar_small_s": ar_small,
                      "ar_big_s": ar_big, "late_s": late_s}}), flush=True)
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


#: how many times the host's link is probed (fresh processes each time); each figure is the
#: median. One probe's all-reduce bandwidth came out 0.76 GB/s where five more on the same
#: host, minutes later, gave 0.85-1.09 (2026-11-25); the link is cached for good, so one
#: unlucky probe would bias every data-parallel prediction on the host
LINK_PROBES = 3


def _median_link() -> tuple[tuple[float, float, float, float, float], int]:
    """:func:`_measure_gloo_link` :data:`LINK_PROBES` times, each figure the median of the
    probes that succeeded, and how many did; raises the last failure when none did."""
    got, failure = [], None
    for _ in range(LINK_PROBES):
        try:
            got.append(_measure_gloo_link())
        except _LinkMeasureError as e:
            failure = e
    if not got:
        raise failure or _LinkMeasureError("no probe ran")
    figures = tuple(statistics.median(x) for x in zip(*got, strict=True))
    return figures, len(got)  # type: ignore[return-value]


def _measure_gloo_link(timeout_s: float = LINK_MEASURE_TIMEOUT_S
                       ) -> tuple[float, float, float, float, float]:
    """``(latency_s, bandwidth_bytes_per_s)`` between two local gloo processes, the same
    two figures for an all-reduce between them, and the late-receive wait
    (:attr:`Link.late_receive_s`; a trimmed mean over the middle 80 % of the messages).

    The children are killed at ``timeout_s`` (and kill themselves shortly after it should the
    parent die); none outlives this call.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    lo = _loopback_ifname()
    if lo:
        env["GLOO_SOCKET_IFNAME"] = lo
    port = _free_port()
    deadline = time.monotonic() + timeout_s
    procs: list[subprocess.Popen] = []
    try:
        for rank in (0, 1):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _GLOO_CHILD, str(rank), str(port), f"{timeout_s + 2}"],
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
                raise _LinkMeasureError(f"no result within {timeout_s:g} s") from None
            if p.returncode != 0:
                tail = (err or "").strip().splitlines()[-1:] or [f"exit code {p.returncode}"]
                raise _LinkMeasureError(f"a gloo process failed: {tail[0][:200]}")
            outs.append(out)
    except OSError as e:
        raise _LinkMeasureError(f"could not start a process: {e}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.communicate(timeout=5)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                pass
    try:
        res = json.loads(outs[0].strip().splitlines()[-1])
        latency, one_way = float(res["latency_s"]), float(res["one_way_s"])
        ar_small, ar_big = float(res["ar_small_s"]), float(res["ar_big_s"])
        late = float(res["late_s"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise _LinkMeasureError("unreadable result from the gloo processes") from None
    if not (latency > 0 and one_way > 0 and ar_small > 0 and ar_big > 0
            and math.isfinite(late) and late >= 0):
        raise _LinkMeasureError(f"implausible timings {latency!r}, {one_way!r}, "
                                f"{ar_small!r}, {ar_big!r}, {late!r}")
    # one_way = latency + bytes / bandwidth; guard against noise making the difference tiny
    bandwidth = _BULK_BYTES / max(one_way - latency, one_way / 10)
    ar_bandwidth = _BULK_BYTES / max(ar_big - ar_small, ar_big / 10)
    return latency, bandwidth, ar_small, ar_bandwidth, late


# --------------------------------------------------------------------------------------------
# small helpers


def _json_safe(d: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ("inf" if v == math.inf else "-inf" if v == -math.inf else v)
        if isinstance(v, float)
        else v
        for k, v in d.items()
    }


def _record(cls: type, d: dict[str, Any]) -> Any:
    """An instance of dataclass ``cls`` from a dict written by :func:`_json_safe`."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__} must be a dict, not {type(d).__name__}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in d and f.default is not MISSING:  # written before the field existed
            continue
        v = d[f.name]
        if f.type in ("float", float):
            v = float(v)
        elif f.type in ("int", int):
            v = int(v)
        elif f.type in ("bool", bool):
            v = bool(v)
        elif f.type in ("str", str):
            v = str(v)
        kwargs[f.name] = v
    return cls(**kwargs)


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
