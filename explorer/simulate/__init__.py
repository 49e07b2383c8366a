"""The simulator: one training step of a plan, scheduled on a cost model, as a Prediction."""

from explorer.simulate.simulator import Prediction, execution_order, lower_bound_s, simulate

__all__ = ["Prediction", "execution_order", "lower_bound_s", "simulate"]
