"""Analysis: predicted against measured, and calibration of the cost model from real runs."""

from explorer.analysis.compare import Report, calibrate, compare

__all__ = ["Report", "calibrate", "compare"]
