"""The CPU platform: CPU ranks of one host (set-up, measurement, cache, mutual slowdown)."""

from explorer.platforms.cpu.effects import CPU_PLATFORM, NO_EFFECTS, CpuPlatform, ReplicaEffects
from explorer.platforms.cpu.ranks import (
    hold_freed_memory,
    holding_memory,
    pin_cpu_rank,
    pinning,
    rank_settings_tag,
)

__all__ = ["CPU_PLATFORM", "NO_EFFECTS", "CpuPlatform", "ReplicaEffects", "hold_freed_memory",
           "holding_memory", "pin_cpu_rank", "pinning", "rank_settings_tag"]
