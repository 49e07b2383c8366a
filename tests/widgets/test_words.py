"""What the explorer says stays true: after measured numbers come in, after an edit that takes
a device out of a replicated stage, after the plan changes under a run's report, and for a
model captured without weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import explorer as ex
from explorer.capture.fake import FAKE_NOTE
from explorer.devices.cluster import Link
from explorer.models.synthetic import roofline_costs
from explorer.runtime.launch import Measurement
from widgets import Session


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


def block_ops(g, prefix):
    return [n.name for n in g.ops if n.module_path.startswith(prefix)]


def test_the_opening_line_is_said_again_when_measured_numbers_change_the_fastest(gpt):
    cl = ex.Cluster.preset("4xH100")
    s = Session.open(gpt, roofline_costs(gpt, cl))
    opened = s.plan.algorithm
    assert opened != "single" and "fastest of the quick baselines" in s.message
    # measured: a link so slow that anything spread over devices loses to one device
    slow = dataclasses.replace(cl, default_link=Link(1.0, 1e3, "measured (stand-in)"))
    s.measure_in_background(lambda report, early: (gpt, roofline_costs(gpt, slow)))
    assert s.wait_measured(60)
    assert s.plan.algorithm == opened  # the plan under edit stays
    assert f"opened with the {opened} plan" in s.message
    assert "on roofline estimates; on the measured numbers the single plan is faster" \
        in s.message and "solve single" in s.message
    # numbers that keep the order say so, and a message said since is left alone
    t = Session.open(gpt, roofline_costs(gpt, cl))
    t.measure_in_background(lambda report, early: (gpt, roofline_costs(gpt, cl)))
    assert t.wait_measured(60)
    assert "on the measured numbers too" in t.message
    u = Session.open(gpt, roofline_costs(gpt, cl))
    u.say("something else")
    u.measure_in_background(lambda report, early: (gpt, roofline_costs(gpt, slow)))
    assert u.wait_measured(60) and u.message == "something else"


def test_a_device_taken_from_a_replicated_stage_says_what_it_leaves(gpt):
    for n in (4, 2):
        cl = ex.Cluster.preset(f"{n}xH100")
        s = Session(gpt, cl, roofline_costs(gpt, cl))
        s.load(ex.partition(gpt, cl, s.costs, "data-parallel"))
        ids = cl.ids
        head = block_ops(gpt, "lm_head")
        others = [o.name for o in gpt.ops if o.name not in head]
        s.assign(head, ids[-1])
        assert s.plan.devices_of(head[0]) == (ids[-1],)
        assert f"{ids[-1]} left the replicated stage {'+'.join(ids)}" in s.message
        assert f"the other {len(others):,} op(s) of that stage" in s.message
        if n == 2:  # one device left: said, with the way back
            assert all(s.plan.devices_of(o) == (ids[0],) for o in others)
            assert f"now run on {ids[0]} alone, not replicated" in s.message
            assert "undo" in s.message and f"assign the selection to {ids[0]}+{ids[1]}" \
                in s.message
        else:  # the others keep a replicated stage, of the devices left
            assert all(s.plan.devices_of(o) == tuple(ids[:-1]) for o in others)
            assert f"stay replicated on {'+'.join(ids[:-1])}" in s.message
    s.say("")
    s.assign(head, ids[0])  # (2 devices) no replicated stage left to leave: nothing said
    assert s.message == ""


def test_a_run_report_of_an_earlier_plan_is_marked_stale(gpt, monkeypatch):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer
    from widgets.panels.run import STALE

    def run(graph, model, plan, **kw):  # a stand-in run: measured as predicted
        p = ex.simulate(graph, plan, kw["costs"])
        return Measurement(step_s=p.step_s, step_samples_s=(p.step_s,), busy_s=p.busy_s,
                           peak_bytes=p.peak_bytes, memory_source="stand-in",
                           losses=(1.0,), energy_j=None, energy_by_device_j=None,
                           algorithm=plan.algorithm, steps=1, warmup=0)

    monkeypatch.setattr(ex, "run", run)
    cl = ex.Cluster.preset("2xH100")
    w = Explorer(gpt, roofline_costs(gpt, cl), ex.Plan.single(gpt, cl.ids[0]))
    w.session.run(steps=1)
    assert "predicted" in w.runs.report.value and STALE not in w.runs.report.value
    assert not w.session.report_is_stale
    w.session.assign(block_ops(gpt, "lm_head"), cl.ids[1])
    assert w.session.report_is_stale and STALE in w.runs.report.value
    assert "predicted" in w.runs.report.value  # kept, to compare with
    w.session.undo()  # the plan it ran: current again
    assert not w.session.report_is_stale and STALE not in w.runs.report.value


def test_a_model_without_weights_is_not_said_ready_to_run_or_export():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    cl = ex.Cluster.preset("2xH100")
    s = Session.open(model, torch.randn(16, 32), cl)
    assert s.wait_measured(120)
    assert FAKE_NOTE in s.graph.notes
    assert "real steps" not in s.measure_status and "ready" not in s.measure_status
    assert "captured on fake tensors" in s.measure_status
    assert "not run" in s.measure_status and "factory=" in s.measure_status
    with pytest.raises(ex.ExplorerError, match="no weights to export"):
        s.export("unused.py")
    # the header keeps the graph's note once the measuring is over
    pytest.importorskip("jupyter_bokeh")
    from widgets.panels.status import StatusPanel

    assert "captured without running the model" in StatusPanel(s).render_header()
    # a model with weights: export is ready, real steps only where the devices are
    real = Session.open(nn.Sequential(nn.Linear(32, 8)), torch.randn(16, 32), cl)
    assert real.wait_measured(120)
    assert "export is ready, real steps run where the devices are" in real.measure_status
