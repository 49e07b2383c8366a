"""The simulator refuses a plan whose task graph would not fit its memory budget, before it
builds a task, and says what to lower."""

from __future__ import annotations

import re
import sys

import pytest

from explorer.core.errors import PlanError
from explorer.core.limits import MAX_SIMULATION_BYTES, SIMULATION_BYTES_PER_TASK
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition import partition
from explorer.simulate.budget import check_simulation_size, simulation_tasks
from explorer.simulate.simulator import execution_order, simulate


@pytest.fixture(scope="module")
def big():
    """20,000 nodes on 64 devices: 1,024 micro-batches make some 40 million tasks."""
    g = layered_dag(20_000, width=8, seed=1, batch_size=4096)
    cl = Cluster.preset("64xH100")
    return g, cl, roofline_costs(g, cl)


@pytest.fixture
def no_tasks(monkeypatch):
    """Fail should the simulator start building tasks (the refusal must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the simulator built tasks for a plan over its budget")
    # (``explorer.simulate`` is the function on the package, so the module is looked up)
    monkeypatch.setattr(sys.modules["explorer.simulate.simulator"], "build_tasks", refuse)


def test_a_plan_over_the_budget_is_refused_before_any_task(big, no_tasks):
    g, cl, c = big
    plan = partition(g, cl, c, "even-layers", micro_batches=1024)
    with pytest.raises(PlanError, match=r"simulating this plan would take about [0-9.]+ GiB of "
                                        rf"memory \({len(g):,} nodes, 64 stages, 1,024 "
                                        rf"micro-batches: [0-9,]+ tasks\), more than the 4\.0 GiB "
                                        r"a simulation may use; use at most \d+ micro-batches"):
        simulate(g, plan, c)
    with pytest.raises(PlanError, match="simulating this plan would take"):
        execution_order(g, plan, c)


def test_the_suggested_micro_batches_fit(big):
    g, cl, c = big
    plan = partition(g, cl, c, "even-layers", micro_batches=1024)
    with pytest.raises(PlanError) as err:
        check_simulation_size(g, plan)
    fewer = int(re.search(r"use at most (\d+) micro-batches", str(err.value)).group(1))
    assert 1 <= fewer < 1024
    check_simulation_size(g, plan.with_settings(micro_batches=fewer))
    with pytest.raises(PlanError):
        check_simulation_size(g, plan.with_settings(micro_batches=fewer + 1))
    assert simulation_tasks(g, plan.with_settings(micro_batches=fewer)) \
        * SIMULATION_BYTES_PER_TASK <= MAX_SIMULATION_BYTES


def test_plans_within_the_budget_simulate(big):
    g, cl, c = big
    plan = partition(g, cl, c, "even-layers", k=8, micro_batches=2)
    pred = simulate(g, plan, c)
    assert pred.step_s > 0


def test_the_task_count_counts_forwards_backwards_and_sends(chain3):
    """chain3: three ops with a backward each; a cut between a and b sends each way."""
    from explorer.core.plan import Plan
    plan = Plan.from_assignment(chain3, [("d:0",), ("d:1",)], {"a": 0, "b": 1, "c": 1},
                                micro_batches=3)
    assert simulation_tasks(chain3, plan) == (6 + 2) * 3 + 4 * 2
    assert simulation_tasks(chain3, plan, cut_edges=False) >= simulation_tasks(chain3, plan)
