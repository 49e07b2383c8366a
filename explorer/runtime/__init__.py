"""The runtime: real training steps of a plan on real devices, one process per device."""

from explorer.runtime.export import export_script
from explorer.runtime.launch import Measurement, reference, run
from explorer.runtime.pool import RankPool
from explorer.runtime.watch import RunFailed

__all__ = ["Measurement", "RankPool", "RunFailed", "export_script", "reference", "run"]
