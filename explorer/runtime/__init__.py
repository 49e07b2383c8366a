"""The runtime: real training steps of a plan on real devices, one process per device."""

from explorer.runtime.export import export_script
from explorer.runtime.launch import Measurement, RunFailed, reference, run

__all__ = ["Measurement", "RunFailed", "export_script", "reference", "run"]
