"""A graph captured without running goes through everything after capture: roofline costs for
GPU presets, every partitioner, the simulator and plan files."""

from __future__ import annotations

import pytest

import explorer as ex


@pytest.fixture(scope="module")
def llama():
    bm = ex.builtin_model("llama", "tiny", weights=False)
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="llama")


@pytest.fixture(scope="module")
def h100(llama):
    cluster = ex.Cluster.preset("4xH100")
    return cluster, ex.profile(llama, cluster)


@pytest.mark.parametrize("algorithm", ex.algorithms())
def test_every_partitioner_plans_a_fake_graph(llama, h100, algorithm):
    cluster, costs = h100
    plan = ex.partition(llama, cluster, costs, algorithm)
    plan.validate(llama)
    pred = ex.simulate(llama, plan, costs)
    assert pred.step_s > 0
    assert all(pred.peak_bytes[d] > 0 for d in plan.devices)


def test_plan_file_round_trip(llama, h100, tmp_path):
    cluster, costs = h100
    plan = ex.partition(llama, cluster, costs, "pipeline-dp")
    again = ex.Plan.load(plan.save(tmp_path / "plan.json"), graph=llama, cluster=cluster)
    assert again.to_dict() == plan.to_dict()
    assert ex.simulate(llama, again, costs).step_s == ex.simulate(llama, plan, costs).step_s


def test_costs_of_a_fake_graph_equal_those_of_the_real_one(llama, h100):
    bm = ex.builtin_model("llama", "tiny")
    real = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="llama")
    cluster, costs = h100
    assert ex.profile(real, cluster).to_dict() == costs.to_dict()
