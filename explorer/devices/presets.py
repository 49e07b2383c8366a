"""GPU presets: datasheet numbers of NVIDIA GPUs, preset names, and the links between GPUs.

Numbers are dense (without structured-sparsity speedups). Bandwidths from datasheets are decimal
(1 GB/s = 1e9 bytes/s); memory sizes are the datasheet figure taken as GiB, a little more than
what the driver lets a program use.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from explorer.core.errors import ExplorerError, unknown_name
from explorer.core.limits import MAX_DEVICES
from explorer.devices.records import Device, GiB, Link
from explorer.platforms.gpu import NCCL_LATENCY_NOTE, NCCL_NOMINAL_LATENCY_S

_GB = 1e9
_T = 1e12
#: idle power of a GPU preset, as a fraction of its TDP (nominal: datasheets do not give it)
GPU_IDLE_FRACTION = 0.15


@dataclass(frozen=True)
class KindFit:
    """What one kind of op achieved on a GPU, measured one op at a time: the fractions of the
    datasheet peak (``flops_per_s`` for fp32 and tf32, ``half_flops_per_s`` for bf16/fp16)
    and of the datasheet bandwidth, and the time per kernel beyond its work (per tensor for an
    optimizer step). ``None``: no measured case was bound by that term (the roofline's single
    efficiency stands in for it)."""

    flops_fraction: float | None
    bandwidth_fraction: float | None
    overhead_s: float


@dataclass(frozen=True)
class RooflineFit:
    """Fitted roofline terms per ``"<kind>/<precision>"`` (kinds: matmul, conv2d, attention,
    add, gelu, sum, layernorm, adam; precisions: fp32, tf32, bf16), and where they come from."""

    kinds: Mapping[str, KindFit]
    source: str


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's datasheet numbers and links."""

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
    #: measured roofline terms the cost model uses instead of its single efficiency
    roofline_fit: RooflineFit | None = field(default=None, compare=False)
    #: each GPU's share of its server's network, in a cluster of more than
    #: ``SERVER_GPUS``; None: the GPU is not sold in multi-node servers here (a preset of any
    #: size is one node)
    network: Link | None = None

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
                + (f"; roofline {self.roofline_fit.source}" if self.roofline_fit else "")
            ),
        )




_LAT = NCCL_NOMINAL_LATENCY_S
_LAT_NOTE = NCCL_LATENCY_NOTE


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

#: GPUs per server (node) in a preset cluster of GPUs that have a ``network``: NVIDIA's
#: HGX and DGX servers hold 8
SERVER_GPUS = 8


def _network(gb_per_s: float, what: str, citation: str) -> Link:
    return Link(_LAT, gb_per_s * _GB,
                f"{what}: {gb_per_s:g} GB/s per GPU per direction between servers of "
                f"{SERVER_GPUS} ({citation}); " + _LAT_NOTE)


_DGX_H100 = ("NVIDIA DGX H100/H200 datasheet, https://resources.nvidia.com/en-us-dgx-systems/"
             "ai-enterprise-dgx")
_NDR_PER_GPU = _network(50, "8 x 400 Gb/s InfiniBand NDR (ConnectX-7), one per GPU", _DGX_H100)
_HDR_PER_GPU = _network(
    25, "8 x 200 Gb/s InfiniBand HDR (ConnectX-6), one per GPU",
    "NVIDIA DGX A100 datasheet, https://www.nvidia.com/en-us/data-center/dgx-a100/")
_EDR_PER_GPU = _network(
    6.25, "4 x 100 Gb/s InfiniBand EDR, one per two GPUs",
    "NVIDIA DGX-1 with V100 datasheet, https://www.nvidia.com/en-us/data-center/dgx-1/")
_PCIE3, _PCIE4, _PCIE5 = _pcie(3), _pcie(4), _pcie(5)
_A100_DS = (
    "NVIDIA A100 Tensor Core GPU datasheet, SXM column, "
    "https://www.nvidia.com/en-us/data-center/a100/"
)

GPU_SPECS: dict[str, GpuSpec] = {
    s.key: s
    for s in (
        GpuSpec(
            "V100", "Tesla V100-SXM2-32GB", 32 * GiB, 15.7 * _T, 125 * _T, 900 * _GB, 300,
            "NVIDIA Tesla V100 GPU datasheet, SXM2 column (fp16 tensor; V100 has no bf16), "
            "https://www.nvidia.com/en-us/data-center/v100/",
            _NVLINK2, _PCIE3, network=_EDR_PER_GPU,
        ),
        GpuSpec(
            "A100-40GB", "NVIDIA A100-SXM4-40GB", 40 * GiB, 19.5 * _T, 312 * _T, 1555 * _GB,
            400, _A100_DS + " (40GB HBM2)", _NVLINK3, _PCIE4, network=_HDR_PER_GPU,
        ),
        GpuSpec(
            "A100-80GB", "NVIDIA A100-SXM4-80GB", 80 * GiB, 19.5 * _T, 312 * _T, 2039 * _GB,
            400, _A100_DS + " (80GB HBM2e)", _NVLINK3, _PCIE4, network=_HDR_PER_GPU,
        ),
        GpuSpec(
            "H100", "NVIDIA H100 80GB HBM3", 80 * GiB, 67 * _T, 989 * _T, 3350 * _GB, 700,
            "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (bf16 1,979 TFLOPS is with "
            "sparsity; dense is half), https://www.nvidia.com/en-us/data-center/h100/",
            _NVLINK4, _PCIE5, network=_NDR_PER_GPU,
        ),
        GpuSpec(
            "H200", "NVIDIA H200", 141 * GiB, 67 * _T, 989 * _T, 4800 * _GB, 700,
            "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (bf16 1,979 TFLOPS is with "
            "sparsity; dense is half), https://www.nvidia.com/en-us/data-center/h200/",
            _NVLINK4, _PCIE5, network=_NDR_PER_GPU,
        ),
        GpuSpec(
            "T4", "Tesla T4", 16 * GiB, 8.1 * _T, 65 * _T, 320 * _GB, 70,
            "NVIDIA T4 Tensor Core GPU datasheet (fp16 mixed precision; T4 has no bf16), "
            "https://www.nvidia.com/en-us/data-center/tesla-t4/",
            _PCIE3, _PCIE3,
        ),
        GpuSpec(
            "L4", "NVIDIA L4", 24 * GiB, 30.3 * _T, 121 * _T, 300 * _GB, 72,
            "NVIDIA L4 Tensor Core GPU datasheet (bf16 242 TFLOPS is with sparsity; dense is "
            "half), https://www.nvidia.com/en-us/data-center/l4/",
            _PCIE4, _PCIE4,
        ),
        GpuSpec(
            "A10G", "NVIDIA A10G", 24 * GiB, 31.52 * _T, 70 * _T, 600 * _GB, 300,
            "no NVIDIA datasheet exists for AWS's A10G; figures from Baseten's A10 vs A10G "
            "comparison, https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/"
            " (power: the 300 W limit AWS g5 instances report)",
            _PCIE4, _PCIE4,
        ),
        GpuSpec(
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

#: benchmarks/gpu_presets.py on one H100 SXM: the fits of benchmarks/results/gpu_presets.json
H100_FIT = RooflineFit(
    {
        "matmul/fp32": KindFit(0.76, None, 19.9e-6),
        "matmul/tf32": KindFit(5.79, None, 47.1e-6),
        "matmul/bf16": KindFit(0.929, None, 37.2e-6),
        "conv2d/fp32": KindFit(1.01, 0.0893, 14.4e-6),
        "conv2d/tf32": KindFit(2.52, 0.155, 0.0),
        "conv2d/bf16": KindFit(0.206, 0.122, 0.0),
        "attention/fp32": KindFit(0.606, None, 58.0e-6),
        "attention/tf32": KindFit(0.607, None, 56.5e-6),
        "attention/bf16": KindFit(0.65, None, 27.9e-6),
        "add/fp32": KindFit(None, 1.11, 26.5e-6),
        "add/bf16": KindFit(None, 1.29, 22.3e-6),
        "gelu/fp32": KindFit(None, 1.13, 21.9e-6),
        "gelu/bf16": KindFit(None, 1.08, 21.0e-6),
        "sum/fp32": KindFit(None, 1.08, 28.5e-6),
        "sum/bf16": KindFit(None, 1.24, 27.7e-6),
        "layernorm/fp32": KindFit(None, 0.682, 25.1e-6),
        "layernorm/bf16": KindFit(None, 0.862, 27.5e-6),
        "adam/fp32": KindFit(None, 0.462, 20.8e-6),
        "adam/bf16": KindFit(None, 0.377, 20.5e-6),
    },
    "fitted, measured on NVIDIA H100 80GB HBM3 (driver 580.159.04, torch 2.11.0+cu130), "
    "2026-11-25, benchmarks/results/gpu_presets.json",
)
#: the H100 with its datasheet figures and the measured roofline fit (the "H100" preset keeps
#: the datasheet roofline); its own device name, so its costs never mix with the datasheet's
GPU_SPECS["H100-measured"] = replace(
    GPU_SPECS["H100"], key="H100-measured",
    device_name="NVIDIA H100 80GB HBM3 (measured roofline)", roofline_fit=H100_FIT)


def roofline_fit(device_name: str) -> RooflineFit | None:
    """The measured roofline fit of the preset GPU named ``device_name``, if it has one."""
    for spec in GPU_SPECS.values():
        if spec.device_name == device_name and spec.roofline_fit is not None:
            return spec.roofline_fit
    return None


_SPEC_LOOKUP = {re.sub(r"[-_ ]", "", k.upper()): s for k, s in GPU_SPECS.items()}


#: the most GPUs a preset cluster may have (a bound on what is built and simulated): as many
#: devices as a plan may use
MAX_PRESET_GPUS = MAX_DEVICES


def parse_preset_spec(spec: str) -> list[tuple[int, GpuSpec]]:
    if not isinstance(spec, str) or not spec.strip():
        raise unknown_name("GPU preset", str(spec), GPU_SPECS)
    out = []
    for part in spec.split("+"):
        m = re.fullmatch(r"\s*(?:([0-9]+)\s*[xX*]\s*)?([A-Za-z][\w\- ]*?)\s*", part,
                         re.ASCII)
        if not m:
            raise unknown_name("GPU preset", part.strip(), GPU_SPECS)
        digits = m.group(1) or "1"
        count = int(digits) if len(digits) <= 9 else MAX_PRESET_GPUS + 1  # (no huge ints)
        if count < 1:
            raise ExplorerError(f"preset {spec!r}: the GPU count must be >= 1, not {count}")
        gpu = _SPEC_LOOKUP.get(re.sub(r"[-_ ]", "", m.group(2).upper()))
        if gpu is None:
            raise unknown_name("GPU preset", m.group(2), GPU_SPECS)
        out.append((count, gpu))
    total = sum(c for c, _ in out)
    if total > MAX_PRESET_GPUS:
        raise ExplorerError(f"preset {spec!r} has {total} GPUs, more than the "
                            f"{MAX_PRESET_GPUS:,} a cluster may have; ask for fewer")
    return out


def gpu_links(
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


def nearest_spec(name: str, memory_bytes: int) -> tuple[GpuSpec, str]:
    """The preset for an NVML GPU name, and how it was chosen."""
    upper = name.upper()
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, upper):
            if key == "A100":
                key = "A100-80GB" if memory_bytes > 48 * GiB else "A100-40GB"
            return GPU_SPECS[key], "matched by name"
    spec = min(GPU_SPECS.values(), key=lambda s: abs(s.memory_bytes - memory_bytes))
    return spec, f"no preset for {name!r}; borrowed from the preset of closest memory size"

