"""Profiling: measure what every op costs on the devices that are here, through real steps."""

from explorer.profiling.profiler import profile

__all__ = ["profile"]
