"""Memory settings per stage in the explorer: edits of the plan, undoable, shown per stage."""

from __future__ import annotations

import dataclasses

import pytest

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.plan import StageSettings
from explorer.core.units import format_bytes
from explorer.models.synthetic import roofline_costs
from widgets import Session


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


@pytest.fixture
def session(gpt):
    cl = ex.Cluster.preset("4xH100")
    return Session(gpt, cl, roofline_costs(gpt, cl))


def test_memory_settings_are_undoable_edits_estimated_by_the_engine(session, gpt):
    cl = session.cluster
    session.assign(session.view.names([session.view.items[-1].key]), cl.ids[1])
    assert len(session.plan.stages) == 2
    session.set_memory(zero=2, precision="bf16", stages=[1])
    assert session.plan.settings_of(1) == StageSettings(2, "none", "bf16")
    assert session.plan.settings_of(0) == StageSettings()
    assert session.history[-1] == "memory: zero 2, bf16 on stage 1"
    assert session.prediction == ex.simulate(gpt, session.plan, session.costs)
    session.set_memory(recompute="full")  # every stage; what is not given stays
    assert [session.plan.settings_of(k).recompute for k in (0, 1)] == ["full", "full"]
    assert session.plan.settings_of(1).zero == 2
    before = session.history
    session.set_memory(recompute="full")  # nothing changes: no edit
    assert session.history == before
    session.undo()
    assert session.plan.settings_of(0).recompute == "none"
    session.undo()
    assert not session.plan.stage_settings
    with pytest.raises(ExplorerError, match="ZeRO stage 5"):
        session.set_memory(zero=5)
    with pytest.raises(ExplorerError, match="stage 7 does not exist"):
        session.set_memory(zero=1, stages=[7])


def test_stages_made_and_dropped_by_assign_keep_their_settings(session):
    cl = session.cluster
    session.set_memory(zero=1)
    last = session.view.names([session.view.items[-1].key])
    session.assign(last, cl.ids[2])  # a new stage: default settings
    assert session.plan.settings_of(1) == StageSettings()
    assert session.plan.settings_of(0).zero == 1
    session.assign(last, cl.ids[0])  # the new stage is empty again and dropped
    assert len(session.plan.stages) == 1 and session.plan.settings_of(0).zero == 1


def test_the_panel_applies_each_change_and_the_bars_have_a_gathered_category(gpt,
                                                                             monkeypatch):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer
    from widgets.panels import memory
    from widgets.panels.stages import ALL_STAGES

    cl = ex.Cluster.preset("2xH100")
    w = Explorer(gpt, roofline_costs(gpt, cl), ex.Plan.single(gpt, cl.ids[0]))
    panel = w.stages
    assert panel.stage.value == ALL_STAGES
    panel.zero.value = 3
    assert w.session.plan.settings_of(0).zero == 3 and w.session.can_undo
    assert "one device" in panel.note.value  # ZeRO over one replica saves nothing
    panel.precision.value = "bf16"
    assert w.session.plan.settings_of(0) == StageSettings(3, "none", "bf16")
    assert "bf16" in panel.table.value
    assert w.memory.source.data["settings"][0] == "zero 3, bf16"
    w.editing.undo_button.click()
    assert panel.precision.value == "fp32" and panel.zero.value == 3  # the controls follow
    assert len(w.session.history) == 1  # setting the controls from the plan is no edit
    assert w.memory.source.data["recompute"] == ["none", "none"]
    panel.recompute.value = "full"
    assert w.session.plan.settings_of(0).recompute == "full"
    # the hover says what recomputation saved at the peak and what it costs per step
    base = ex.simulate(gpt, w.session.plan.with_memory(recompute="none"), w.session.costs)
    saved = base.peak_bytes[cl.ids[0]] - w.session.prediction.peak_bytes[cl.ids[0]]
    assert saved > 0
    said = w.memory.source.data["recompute"][0]
    assert said.startswith(f"{format_bytes(saved)} saved at the peak, +")

    # gathered-weight buffers and library workspaces show as categories of their own
    assert w.memory.source.data["gathered"] == [0.0, 0.0]
    pred = w.session.prediction
    m = pred.memory[cl.ids[0]]
    gathered = dataclasses.replace(m, gathered_bytes=5 * 2**20, workspace_bytes=2**20)
    monkeypatch.setattr(w.session, "prediction", dataclasses.replace(
        pred, memory={**pred.memory, cl.ids[0]: gathered}))
    w.memory.update("plan")
    d = w.memory.source.data
    assert d["gathered"][0] * w.memory.unit_bytes == 5 * 2**20
    assert d["workspace"][0] * w.memory.unit_bytes == 2**20
    assert memory.CATEGORIES[-2:] == ("gathered", "workspace")


def test_a_half_precision_on_measured_devices_is_timed_in_the_background(gpt, monkeypatch):
    # the CPU rank's profile has no bf16 times: setting bf16 times the ops in it (a profile
    # with precisions=) in the background, and the estimate follows; costs otherwise kept
    cl = ex.Cluster.cpu(1, measure=False)
    costs = roofline_costs(gpt, cl)
    key = cl.devices[0].type_key
    costs.per_type[key] = dataclasses.replace(
        costs.per_type[key], source=["measured" if n.kind == "op" else "free"
                                     for n in gpt.nodes])
    calls = []

    def profile(graph, cluster, precisions=(), **kwargs):
        calls.append(precisions)
        timed = dataclasses.replace(costs, per_type=dict(costs.per_type))
        dc = costs.per_type[key]
        timed.per_type[key] = dataclasses.replace(
            dc, precision_s={"bf16": [[3 * t for t in dc.fwd_s], [3 * t for t in dc.bwd_s]]})
        return timed

    monkeypatch.setattr(ex, "profile", profile)
    session = Session(gpt, cl, costs)
    before = session.prediction.step_s
    session.set_memory(precision="bf16")
    assert session.wait_measured(60)
    assert calls == [("bf16",)]
    assert session.costs.per_type[key].precision_s["bf16"][0][gpt.index[gpt.loss]] > 0
    assert session.prediction.step_s > 2 * before
    assert session.prediction == ex.simulate(gpt, session.plan, session.costs)
    session.set_memory(precision="fp32")
    session.set_memory(precision="bf16")  # timed already: nothing measured again
    assert calls == [("bf16",)]


def test_the_panel_says_where_a_tensor_degree_splits_nothing():
    pytest.importorskip("jupyter_bokeh")
    import torch
    from torch import nn

    from widgets import Explorer

    torch.manual_seed(0)  # (a norm between the linears: no column/row pair to split)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    graph = ex.capture(model, torch.randn(4, 8), nn.functional.cross_entropy,
                       torch.randint(0, 4, (4,)))
    cl = ex.Cluster.preset("2xH100")
    w = Explorer(graph, roofline_costs(graph, cl), ex.Plan.single(graph, cl.ids[0]))
    assert "splits nothing" not in w.stages.note.value
    w.session.split([n.name for n in graph.ops], "+".join(cl.ids))
    assert w.session.plan.tensor_of(0) == 2
    assert "tensor 2 on stage 0 splits nothing" in w.stages.note.value
