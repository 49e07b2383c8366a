"""Platforms: what each kind of host adds to the general model of devices and links.

:func:`platform_of` gives the platform of a device kind: :class:`~explorer.platforms.cpu.
CpuPlatform` for ``"cpu"`` ranks, :class:`~explorer.platforms.gpu.GpuPlatform` for ``"cuda"``,
the neutral :data:`NO_PLATFORM` otherwise.
"""

from explorer.platforms.base import NO_PLATFORM, Platform
from explorer.platforms.cpu import CPU_PLATFORM, CpuPlatform
from explorer.platforms.gpu import GPU_PLATFORM, GpuPlatform

_BY_KIND: dict[str, Platform] = {"cpu": CPU_PLATFORM, "cuda": GPU_PLATFORM}


def platform_of(kind: str) -> Platform:
    """The platform of devices of ``kind`` (``Device.kind``)."""
    return _BY_KIND.get(kind, NO_PLATFORM)


__all__ = ["CPU_PLATFORM", "GPU_PLATFORM", "NO_PLATFORM", "CpuPlatform", "GpuPlatform",
           "Platform", "platform_of"]
