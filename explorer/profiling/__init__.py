"""Profiling: measure what every op costs on the devices that are here, through real steps."""

from explorer.profiling.profiler import Preliminary, profile

__all__ = ["Preliminary", "profile"]
