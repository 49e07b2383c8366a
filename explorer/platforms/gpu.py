"""The GPU platform: NVIDIA GPUs, one rank each, talking over NCCL.

A GPU computes its ops by itself, beside any other rank: replicas do not slow each other's
kernels (each has its own GPU), and NCCL moves a message with the GPUs' copy engines and its own
progress thread, so a receive posted late waits for nothing but the transfer. What remains is
the runtime's processor time per tensor it posts (fitted by calibration, as on any platform)
and the latency of launching a collective, which the GPU links' nominal latency stands for.
"""

from __future__ import annotations

import torch

from explorer.platforms.base import Platform
from explorer.platforms.cpu.ranks import hold_freed_memory

#: nominal latency of one NCCL operation between two GPUs of a server (launching the kernel
#: and the first handshake): a few microseconds. Nominal, not measured: NVIDIA publishes no
#: figure that fits every GPU and topology; it is the latency of the GPU presets' links.
NCCL_NOMINAL_LATENCY_S = 5e-6
NCCL_LATENCY_NOTE = f"latency nominal {NCCL_NOMINAL_LATENCY_S * 1e6:g} us"


class GpuPlatform(Platform):
    """NVIDIA GPUs over NCCL: no contention between replicas, no late-receive wait."""

    name = "cuda"

    def message_s(self, fitted_s: float) -> float:
        return fitted_s

    def hold_freed_memory(self) -> bool:
        # a GPU rank's host tensors (inputs, pinned copies) are reused step after step too
        return hold_freed_memory()


GPU_PLATFORM = GpuPlatform()


def library_workspace_bytes(device: torch.device) -> int:
    """Bytes the CUDA math libraries keep allocated once a process has used them.

    cuBLAS and cuBLASLt take their workspaces from PyTorch's caching allocator at the first
    matrix product on a stream and keep them for the life of the process, so every peak the
    allocator reports includes them, whatever the model. Measured by running products in the
    precisions a step uses, then releasing the workspaces and reading the allocator before and
    after. 0 where this torch cannot release them (nothing then to tell apart).
    """
    release = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if release is None or device.type != "cuda":
        return 0
    a = torch.ones(128, 128, device=device)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        b = a.to(dtype)
        (b @ b).sum().item()
        torch.nn.functional.linear(b, b, b[0]).sum().item()  # the cuBLASLt path
    del a, b
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    release()
    torch.cuda.synchronize(device)
    return max(before - torch.cuda.memory_allocated(device), 0)
