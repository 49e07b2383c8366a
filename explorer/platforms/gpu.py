"""The GPU platform: NVIDIA GPUs, one rank each, talking over NCCL.

A GPU computes its ops by itself, beside any other rank: replicas do not slow each other's
kernels (each has its own GPU), and NCCL moves a message with the GPUs' copy engines and its own
progress thread, so a receive posted late waits for nothing but the transfer. What remains is
the runtime's processor time per tensor it posts (fitted by calibration, as on any platform)
and the latency of launching a collective, which the GPU links' nominal latency stands for.
GPUs share memory with the others of their group (symmetric memory over NVLink), so async
tensor parallelism can pipeline a split's collectives with the matrix products beside them.
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
    pipelines_tensor_collectives = True

    def message_s(self, fitted_s: float) -> float:
        return fitted_s

    def hold_freed_memory(self) -> bool:
        # a GPU rank's host tensors (inputs, pinned copies) are reused step after step too
        return hold_freed_memory()


GPU_PLATFORM = GpuPlatform()


def library_workspace_bytes(device: torch.device) -> int:
    """Bytes the CUDA math libraries keep allocated once a training step has used them.

    cuBLAS and cuBLASLt take a workspace from PyTorch's caching allocator per handle and stream
    at the first matrix product, and keep it for the life of the process, so every peak the
    allocator reports includes them, whatever the model. Handles are per thread, and a step
    runs products on two: the forward on the calling thread, the backward on autograd's thread
    for the device, so both hold one. Measured by running a forward and backward of products in
    each precision, then releasing the workspaces and reading the allocator before and after.
    0 where this torch cannot release them (nothing then to tell apart).
    """
    release = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if release is None or device.type != "cuda":
        return 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = torch.ones(128, 128, device=device, dtype=dtype, requires_grad=True)
        x = torch.ones(64, 128, device=device, dtype=dtype)
        torch.nn.functional.linear(x @ w, w, w[0]).sum().backward()  # cuBLAS and cuBLASLt
        del w, x
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    release()
    torch.cuda.synchronize(device)
    return max(before - torch.cuda.memory_allocated(device), 0)
