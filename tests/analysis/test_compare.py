"""compare() lines figures up; calibrate() recovers known cost-model errors and generalises."""

from __future__ import annotations

from dataclasses import replace

import pytest

import explorer as ex
from explorer.analysis.compare import Report, Row
from explorer.core.errors import ExplorerError
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.runtime.launch import Measurement


def _fake_measurement(graph, plan, truth) -> Measurement:
    """What a run would measure if ``truth`` were the real costs."""
    p = ex.simulate(graph, plan, truth)
    return Measurement(step_s=p.step_s, step_samples_s=(p.step_s,), busy_s=p.busy_s,
                       peak_bytes=p.peak_bytes, memory_source="simulated", losses=(1.0,),
                       energy_j=None, energy_by_device_j=None, algorithm=plan.algorithm,
                       steps=1, warmup=0, plan=plan, graph=graph)


@pytest.fixture(scope="module")
def case():
    graph = layered_dag(60, width=3, seed=4)
    cluster = ex.Cluster.preset("4xT4")
    costs = roofline_costs(graph, cluster)
    truth = replace(costs, compute_scale=1.3, extra_op_s=40e-6, link_scale=3.0,
                    message_s=70e-6)
    return graph, cluster, costs, truth


class TestCalibrate:
    def test_recovers_compute_op_message_and_link_factors(self, case):
        graph, cluster, costs, truth = case
        plan = ex.partition(graph, cluster, costs, "even-layers", micro_batches=2)
        fitted = ex.calibrate(costs, _fake_measurement(graph, plan, truth))
        assert fitted.compute_scale == pytest.approx(1.3, rel=1e-3)
        assert fitted.extra_op_s == pytest.approx(40e-6, rel=1e-3)
        assert fitted.message_s == pytest.approx(70e-6, rel=1e-3)
        assert fitted.link_scale == pytest.approx(3.0, rel=0.05)

    def test_predicts_plans_it_was_not_fitted_on(self, case):
        graph, cluster, costs, truth = case
        fit_on = ex.partition(graph, cluster, costs, "even-layers", micro_batches=2)
        fitted = ex.calibrate(costs, _fake_measurement(graph, fit_on, truth))
        for other in ("data-parallel", "min-comm", "pardnn"):
            plan = ex.partition(graph, cluster, costs, other)
            real = ex.simulate(graph, plan, truth).step_s
            before = abs(ex.simulate(graph, plan, costs).step_s / real - 1)
            after = abs(ex.simulate(graph, plan, fitted).step_s / real - 1)
            assert after < 0.02, other
            assert after < before, other

    def test_needs_a_measurement_with_its_plan(self, case):
        _, _, costs, _ = case
        with pytest.raises(ExplorerError, match="at least one measurement"):
            ex.calibrate(costs, [])


class TestCompare:
    def test_rows_and_errors(self, case):
        graph, cluster, costs, truth = case
        plan = ex.partition(graph, cluster, costs, "even-layers")
        pred = ex.simulate(graph, plan, costs)
        meas = _fake_measurement(graph, plan, truth)
        rep = ex.compare(pred, meas)
        assert isinstance(rep, Report)
        step = rep.row("step time")
        assert step.predicted == pred.step_s and step.measured == meas.step_s
        assert rep.step_error == pytest.approx(pred.step_s / meas.step_s - 1)
        assert set(rep.memory_errors) == set(plan.devices)
        text = str(rep)
        assert "step time" in text and "peak memory" in text and "%" in text
        assert "<table>" in rep._repr_html_()
        assert rep.to_dict()["rows"][0]["what"] == "step time"

    def test_the_report_says_how_the_ranks_ran(self, case):
        graph, cluster, costs, truth = case
        plan = ex.partition(graph, cluster, costs, "even-layers")
        pred = ex.simulate(graph, plan, costs)
        meas = _fake_measurement(graph, plan, truth)
        assert "the ranks ran as generated segments)" in str(ex.compare(pred, meas))
        compiled = ex.compare(pred, replace(meas, compiled=True))
        assert compiled.ran_as == "as generated segments (compiled)"
        ops = ex.compare(pred, replace(meas, runtime="ops"))
        assert ops.ran_as == "one op at a time"
        assert ops.to_dict()["runtime"] == "ops" and not ops.to_dict()["compiled"]

    def test_error_sign(self):
        assert Row("x", "", "s", 1.2, 1.0).error == pytest.approx(0.2)
        assert Row("x", "", "s", 0.8, 1.0).error == pytest.approx(-0.2)

    def test_different_plans_are_refused(self, case):
        graph, cluster, costs, truth = case
        a = ex.partition(graph, cluster, costs, "even-layers")
        b = ex.partition(graph, cluster, costs, "single")
        with pytest.raises(ExplorerError, match="different plans"):
            ex.compare(ex.simulate(graph, a, costs), _fake_measurement(graph, b, truth))


class TestCalibrateAcrossModels:
    def test_fit_on_one_model_predicts_another(self, case):
        graph, cluster, costs, truth = case
        other = layered_dag(80, width=2, seed=9)
        o_costs = roofline_costs(other, cluster)
        o_truth = replace(o_costs, compute_scale=1.3, extra_op_s=40e-6, link_scale=3.0,
                          message_s=70e-6)
        runs = [_fake_measurement(other, ex.partition(other, cluster, o_costs, a, **kw),
                                  o_truth)
                for a, kw in (("even-layers", {"micro_batches": 2}), ("data-parallel", {}))]
        fitted = ex.calibrate(costs, runs, others=[o_costs])
        assert fitted.graph_fingerprint == graph.fingerprint
        assert fitted.message_s == pytest.approx(70e-6, rel=1e-3)
        for alg in ("pardnn", "min-comm"):
            plan = ex.partition(graph, cluster, costs, alg)
            real = ex.simulate(graph, plan, truth).step_s
            assert ex.simulate(graph, plan, fitted).step_s == pytest.approx(real, rel=0.02)

    def test_a_run_of_a_model_without_its_costs_is_refused(self, case):
        _, cluster, costs, _ = case
        other = layered_dag(30, width=2, seed=3)
        o_costs = roofline_costs(other, cluster)
        run = _fake_measurement(other, ex.partition(other, cluster, o_costs, "even-layers"),
                                o_costs)
        with pytest.raises(ExplorerError, match="others="):
            ex.calibrate(costs, run)
