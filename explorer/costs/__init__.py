"""Costs: what each node takes on each device (measured or roofline), and memory per node."""

from explorer.costs.model import CostModel, DeviceCosts, roofline

__all__ = ["CostModel", "DeviceCosts", "roofline"]
