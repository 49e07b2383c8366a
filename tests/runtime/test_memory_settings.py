"""Real runs with memory settings (ZeRO 1-3, recomputation, precision) on CPU ranks: losses and
gradients equal one device, and the measured peak goes down where the setting saves memory."""

from __future__ import annotations

import pytest
import torch

import explorer as ex
from explorer.models.synthetic import roofline_costs
from explorer.runtime.launch import reference

# every test here starts rank processes
pytestmark = pytest.mark.slow

STEPS, WARMUP = 2, 1
_GRAPHS: dict = {}
_RUNS: dict = {}


def _graph(name: str):
    if name not in _GRAPHS:
        bm = ex.builtin_model(name, "tiny")
        _GRAPHS[name] = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                                   name=name)
    return _GRAPHS[name]


def _plan(name: str, path: str, **memory):
    """The model's data-parallel plan (two replicas, two micro-batches for gpt: gradients
    accumulate before they are reduced) or two pipeline stages, with ``memory`` settings."""
    graph = _graph(name)
    cluster = ex.Cluster.cpu(2, measure=False)
    costs = roofline_costs(graph, cluster)
    if path == "data-parallel":
        plan = ex.partition(graph, cluster, costs, "data-parallel")
        plan = plan.with_settings(micro_batches=2 if name == "gpt" else 1)
    else:
        plan = ex.partition(graph, cluster, costs, "even-layers")
    return plan.with_memory(**memory)


def _run(name: str, path: str, **memory):
    key = (name, path, tuple(sorted(memory.items())))
    if key not in _RUNS:
        _RUNS[key] = ex.run(_graph(name), plan=_plan(name, path, **memory), steps=STEPS,
                            warmup=WARMUP, progress=False, record=True, timeout_s=180)
    return _RUNS[key]


def _reference(name: str, plan):
    shards = max(len(s) for s in plan.stages) * plan.micro_batches
    return reference(ex.builtin_model(name, "tiny"), STEPS + WARMUP, shards,
                     optimizer=plan.optimizer)


def _assert_equal(meas, ref, rtol: float, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=rtol, atol=atol)
    assert set(meas.grads) == set(ref.grads)
    for name, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[name], g, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_equals_one_device(name, zero):
    """Sharded optimizer state, gradients and weights train as one device does (the losses
    of every step: the updated weights of the step before; the first step's gradients)."""
    meas = _run(name, "data-parallel", zero=zero)
    _assert_equal(meas, _reference(name, meas.plan), rtol=1e-5, atol=1e-6)


def test_zero_lowers_the_measured_peak():
    """Each ZeRO stage holds less at its peak than the one before on the same plan; ZeRO 3
    holds the gathered copies of the weights, and only a few at a time."""
    base = _run("gpt", "data-parallel")
    peaks = [base.peak_bytes["cpu:0"]] + [_run("gpt", "data-parallel", zero=z).peak_bytes["cpu:0"]
                                          for z in (1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True) and peaks[3] < peaks[0]
    by = {z: _run("gpt", "data-parallel", **({"zero": z} if z else {})).peak_by_category["cpu:0"]
          for z in (0, 1, 3)}
    assert by[1]["optimizer state"] * 2 == by[0]["optimizer state"]
    assert by[3]["parameters"] * 2 <= by[0]["parameters"] + 2 * 64
    assert 0 < by[3]["gathered"] < by[0]["parameters"] / 2
