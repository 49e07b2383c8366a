"""The simulator: one training step of a plan, scheduled on a cost model, as a Prediction."""

from explorer.simulate.simulator import (
    BUCKET_BYTES,
    Prediction,
    clear_caches,
    execution_order,
    lower_bound_s,
    simulate,
    unit_costs,
)

__all__ = ["BUCKET_BYTES", "Prediction", "clear_caches", "execution_order", "lower_bound_s",
           "simulate", "unit_costs"]
