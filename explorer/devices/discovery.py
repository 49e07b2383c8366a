"""What is on this machine: NVIDIA GPUs through NVML, how many torch can use, how much RAM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from explorer.devices.presets import nearest_spec
from explorer.devices.records import GiB


def nvml_gpus() -> tuple[str, list[dict[str, Any]]]:
    """``(reason when empty, [{name, memory_bytes, power_w, nvlink}, ...])`` in torch order."""
    try:
        import pynvml
    except ImportError:
        return "no NVIDIA GPU found: nvidia-ml-py is not installed", []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return f"no NVIDIA GPU found: {nvml_str(e)}", []
    try:
        count = pynvml.nvmlDeviceGetCount()
        indices = visible_indices(pynvml, count)
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
        return f"no NVIDIA GPU found: {nvml_str(e)}", []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if not gpus:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES") is not None and count
        return ("CUDA_VISIBLE_DEVICES hides every GPU" if hidden else "no NVIDIA GPU found"), []
    return "", gpus


def nvml_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # some pynvml versions fail to format unknown error codes
        return type(e).__name__


def visible_indices(pynvml: Any, count: int) -> list[int]:
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


def group_nvlink(gpus: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """``(preset key, all of its GPUs have NVLink)`` per preset, in first-seen order."""
    groups: dict[str, bool] = {}
    for g in gpus:
        key = nearest_spec(g["name"], g["memory_bytes"])[0].key
        groups[key] = groups.get(key, True) and g["nvlink"]
    return list(groups.items())


def torch_cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA setup must not stop discovery
        return 0



def total_memory_bytes() -> int:
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
