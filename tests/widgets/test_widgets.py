"""The explorer's state and widget without a browser: edits, undo/redo, pins, estimates, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.models.synthetic import layered_dag, roofline_costs
from widgets import Session
from widgets.graphview import MAX_CHILDREN, GraphView


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    return g


@pytest.fixture
def session(gpt):
    cl = ex.Cluster.preset("4xH100")
    return Session(gpt, cl, roofline_costs(gpt, cl))


def block_ops(g, prefix):
    return [n.name for n in g.ops if n.module_path.startswith(prefix)]


# -- the session ------------------------------------------------------------------------------

def test_every_edit_is_estimated_by_the_engine(session, gpt):
    ids = session.cluster.ids
    ops = block_ops(gpt, "blocks.1")
    before = session.prediction
    session.assign(ops, ids[1])
    assert all(session.plan.devices_of(n) == (ids[1],) for n in ops)
    # the weights used by the moved ops move with them
    owned = [gpt.nodes[i].name for i, n in enumerate(gpt.nodes)
             if n.kind == "param" and gpt.nodes[gpt.owner(i)].name in ops]
    assert owned and all(session.plan.devices_of(n) == (ids[1],) for n in owned)
    assert session.prediction == ex.simulate(gpt, session.plan, session.costs)
    assert session.prediction.cross_device_bytes > 0 == before.cross_device_bytes
    assert session.plan.algorithm == "manual"


def test_undo_redo_restore_plans_and_estimates(session):
    ids = session.cluster.ids
    g = session.graph
    plans = [session.plan]
    for k, prefix in enumerate(["blocks.0", "blocks.1", "lm_head"]):
        session.assign(block_ops(g, prefix), ids[k + 1])
        plans.append(session.plan)
    assert len(session.history) == 3 and session.history[0].endswith(f"to {ids[1]}")
    for want in reversed(plans[:-1]):
        session.undo()
        assert session.plan == want
        assert session.prediction == ex.simulate(g, want, session.costs)
    assert not session.can_undo
    with pytest.raises(ExplorerError, match="nothing to undo"):
        session.undo()
    for want in plans[1:]:
        session.redo()
        assert session.plan == want
    with pytest.raises(ExplorerError, match="nothing to redo"):
        session.redo()
    session.undo()
    session.assign(block_ops(g, "ln_f"), ids[3])  # a new edit clears what redo had
    assert not session.can_redo


def test_a_device_taken_from_a_replicated_stage_becomes_its_own_stage(session):
    g = session.graph
    ids = session.cluster.ids
    dp = ex.partition(g, session.cluster, session.costs, "data-parallel")
    session.load(dp)
    assert session.targets()[-1] == "+".join(ids)
    session.assign(block_ops(g, "lm_head"), ids[3])
    stages = session.plan.stages
    assert (ids[3],) in stages and tuple(ids[:3]) in stages
    assert session.plan.devices_of(block_ops(g, "lm_head")[0]) == (ids[3],)
    session.assign(block_ops(g, "lm_head"), "+".join(ids[:3]))  # back onto the replicas
    assert session.plan.stages == (tuple(ids[:3]),)  # the emptied stage is dropped


def test_pins_follow_edits_and_partitioners_solve_around_them(session):
    g = session.graph
    ids = session.cluster.ids
    ops = block_ops(g, "blocks.0.mlp")
    session.assign(ops, ids[2])
    session.pin(ops)
    assert session.pins == dict.fromkeys(ops, ids[2])
    assert session.plan.pinned == frozenset(ops)
    entry = session.solve("pardnn")
    assert entry.name == "pardnn (pinned)" and session.plan is entry.plan
    assert all(session.plan.devices_of(n)[0] == ids[2] for n in ops)
    free = session.solve("single", around_pins=False, load=False)
    assert {free.plan.devices_of(n) for n in ops} == {(ids[0],)}
    session.assign(ops[:1], ids[3])  # a pinned node moved by hand keeps its pin there
    assert session.pins[ops[0]] == ids[3]
    session.unpin(ops[:1])
    assert ops[0] not in session.pins
    session.unpin()
    assert session.pins == {} and session.plan.pinned == frozenset()
    assert [e.name for e in session.plans] == ["pardnn (pinned)", "single"]
    session.undo()
    assert set(session.pins) == set(ops[1:])


def test_bad_edits_raise_and_change_nothing(session, gpt, tmp_path):
    plan, pred = session.plan, session.prediction
    with pytest.raises(ExplorerError, match="no node named 'nope'"):
        session.assign(["nope"], session.cluster.ids[1])
    with pytest.raises(ExplorerError, match="H100:9"):
        session.assign([gpt.ops[3].name], "H100:9")
    with pytest.raises(ExplorerError, match="select one or more nodes"):
        session.assign([], session.cluster.ids[1])
    with pytest.raises(ExplorerError, match="not a replicated stage"):
        session.assign([gpt.ops[3].name], "H100:0+H100:1")
    with pytest.raises(ExplorerError):
        session.solve("no-such-algorithm")
    other = layered_dag(20, seed=1)
    foreign = ex.Plan.single(other, session.cluster.ids[0])
    with pytest.raises(ExplorerError, match="made for graph"):
        session.load(foreign)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ExplorerError):
        session.load(bad)
    with pytest.raises(ExplorerError, match="run real steps first"):
        session.calibrate()
    with pytest.raises(ExplorerError):
        session.set_schedule(schedule="zigzag")
    assert session.plan is plan and session.prediction is pred and not session.can_undo


def test_settings_save_load_and_export(session, tmp_path):
    g = session.graph
    session.assign(block_ops(g, "blocks.1"), session.cluster.ids[1])
    session.set_schedule(micro_batches=2, schedule="1f1b", optimizer="sgd")
    assert (session.plan.micro_batches, session.plan.schedule, session.plan.optimizer) == \
        (2, "1f1b", "sgd")
    path = session.save(tmp_path / "p.json")
    saved = session.plan
    session.undo()
    session.load(path)
    assert session.plan.placement == saved.placement and session.plan.micro_batches == 2
    script = session.export(tmp_path / "train.py")
    assert script.exists() and "torchrun" in script.read_text()
    job = tmp_path / "train_job"
    plans = list(job.glob("*.json"))
    assert plans and any(json.loads(p.read_text()).get("placement") == dict(session.plan.placement)
                         for p in plans)
    with pytest.raises(ExplorerError, match="exists"):  # a second export asks first
        session.export(tmp_path / "train.py")
    assert session.export(tmp_path / "train.py", overwrite=True) == script


def test_selection_items_shown_and_messages_live_in_the_session(session):
    seen = []
    session.observe(lambda s, what: seen.append(what))
    picked = session.select(["blocks.1"])  # inside the folded "blocks": opened to show it
    assert [session.view.items[k].label for k in picked] == ["blocks.1"]
    assert seen == ["view", "selection"] and session.selected == picked
    assert set(block_ops(session.graph, "blocks.1")) <= set(session.selected_names)
    session.expand()
    assert session.selected == [] and "blocks.1" not in [it.label for it in session.view.items]
    session.collapse()  # nothing selected: back to the top-level modules
    assert "blocks" in [it.label for it in session.view.items]
    with pytest.raises(ExplorerError, match="select a module to expand"):
        session.expand()
    session.guarded(session.undo)()
    assert session.message == "nothing to undo" and session.message_is_error
    session.guarded(lambda: 1 / 0)()
    assert session.message.startswith("ZeroDivisionError") and "Traceback" in \
        session.message_detail
    session.guarded(lambda: None)()
    assert session.message == "" and seen[-1] == "message"


# -- the graph view ---------------------------------------------------------------------------

def test_view_groups_by_module_and_expands_to_ops(gpt):
    v = GraphView(gpt)
    top = [it.label for it in v.items]
    assert "blocks" in top and len(v.items) < 12
    shown = sorted(i for it in v.items for i in it.nodes)
    assert shown == list(range(len(gpt.nodes)))  # every node drawn exactly once
    blocks = next(it for it in v.items if it.label == "blocks")
    v.expand([blocks.key])
    labels = [it.label for it in v.items]
    assert "blocks.0" in labels and "blocks.1" in labels and "blocks" not in labels
    v.expand_all()
    assert len(v.items) == len(gpt.ops) and all(len(it.ops) == 1 for it in v.items)
    v.collapse([v.items[10].key])
    assert len(v.items) < len(gpt.ops)
    v.collapse_all()
    assert [it.label for it in v.items] == top
    xy = v.layout()
    assert xy[0][1] == 0 and all(y <= 0 for _, y in xy)
    for (a, z) in v.edges():  # every edge points down the page
        assert xy[z][1] < xy[a][1]


def test_large_graphs_are_drawn_in_blocks():
    g = layered_dag(10_000, seed=0)
    assert len(GraphView(g).items) <= MAX_CHILDREN  # grouped by its modules
    flat = ex.OpGraph("flat", [dataclasses.replace(n, module_path="") for n in g.nodes],
                      g.batch_size)  # no modules at all: blocks of consecutive ops
    v = GraphView(flat)
    assert len(v.items) <= MAX_CHILDREN and {it.kind for it in v.items} == {"block"}
    assert sum(len(it.ops) for it in v.items) == len(g.ops)
    v.expand([v.items[0].key])
    assert len(v.items) <= 2 * MAX_CHILDREN


# -- the widget, without a browser --------------------------------------------------------------

@pytest.fixture
def widget(gpt):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer

    cl = ex.Cluster.preset("2xH100")
    return Explorer(gpt, roofline_costs(gpt, cl), ex.Plan.single(gpt, cl.ids[0]))


def shown_step(w) -> float:
    import re

    return float(re.search(r"class='pe-step' data-value='([^']+)'", w.estimate.table.value)[1])


def test_widget_edit_updates_numbers_colors_and_edges(widget):
    w = widget
    ids = w.session.cluster.ids
    assert shown_step(w) == w.session.prediction.step_s
    w.select(["blocks"])
    assert "56 ops" in w.editing.selection.value
    w.assign(ids[1])
    assert w.message == ""
    pred = ex.simulate(w.session.graph, w.session.plan, w.session.costs)
    assert shown_step(w) == pred.step_s
    k = [it.label for it in w.session.view.items].index("blocks")
    assert w.graph.nodes.data["device"][k] == ids[1]
    assert w.graph.nodes.data["color"][k] != w.graph.nodes.data["color"][0]
    assert "#d62728" in w.graph.edges.data["color"]  # edges across devices are marked
    assert "dashed" in w.graph.edges.data["dash"]
    assert any("across devices" in t for t in w.graph.edges.data["label"])
    bars = w.memory.source.data
    mem = dict(zip(bars["device"], bars["activations"], strict=True))
    assert w.memory.unit == "GiB"
    assert mem[ids[1]] == pytest.approx(pred.memory[ids[1]].activations_bytes / 2**30)
    assert len(w.timeline.source.data["lane"]) > 0
    w.editing.undo_button.click()
    assert w.graph.nodes.data["device"][k] == ids[0]
    assert "#d62728" not in w.graph.edges.data["color"]


def test_widget_errors_become_messages(widget):
    w = widget
    w.editing.assign_button.click()  # nothing selected
    assert "select one or more nodes" in w.message
    w.plans.options.value = "{oops"
    w.plans.solve_button.click()
    assert "options must be JSON" in w.message
    w.plans.path.value = "/nonexistent/dir/plan.json"
    w.plans.load_file_button.click()
    assert w.message and "Traceback" not in w.message
    w.runs.run_button.click()  # H100s this process does not have: a message, not a crash
    assert w.message


def test_widget_partitioners_table_and_loading(widget, tmp_path):
    w = widget
    w.plans.algorithm.value = "even-layers"
    w.plans.solve_button.click()
    assert "even-layers" in w.message and "even-layers" in w.plans.table.value
    w.plans.keep_button.click()
    assert w.plans.pick.options[-1].startswith("even-layers")
    w.plans.pick.value = w.plans.pick.options[0]
    w.plans.load_button.click()
    assert w.session.plan == w.session.plans[0].plan
    w.plans.path.value = str(tmp_path / "plan.json")
    w.plans.save_button.click()
    assert (tmp_path / "plan.json").exists(), w.message
    w.select(["blocks"])
    w.graph.expand_button.click()
    assert "blocks.0" in [it.label for it in w.session.view.items]
    w.graph.collapse_button.click()
    assert "blocks" in [it.label for it in w.session.view.items]


def test_widget_runs_real_steps_on_cpu_ranks_and_compares():
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer

    bm = ex.builtin_model("mlp", "tiny")
    w = Explorer(bm, cluster=ex.Cluster.cpu(2), progress=False)
    w.plans.algorithm.value = "even-layers"
    w.plans.solve_button.click()
    w.runs.steps.value = 2
    w.runs.run_button.click()
    assert "step time error" in w.message, w.message
    assert "busy time" in w.runs.report.value and "peak memory" in w.runs.report.value
    w.runs.calibrate_button.click()
    assert "calibrated" in w.message


def test_explorer_needs_an_example_batch():
    pytest.importorskip("jupyter_bokeh")
    import torch

    from widgets import Explorer

    with pytest.raises(ExplorerError, match="example batch"):
        Explorer(torch.nn.Linear(3, 3))


def test_select_opens_folded_modules_and_names_what_is_unknown(widget, gpt):
    w, g = widget, gpt
    assert "blocks.1" not in [it.label for it in w.session.view.items]  # folded into "blocks"
    w.select(["blocks.1"])
    labels = [w.session.view.items[k].label for k in w.session.selected]
    assert labels == ["blocks.1"]
    assert "blocks.1" in w.editing.selection.value
    # an op's name opens the modules it is in, down to an item that is just that op
    op = next(n.name for n in g.nodes if n.kind == "op" and n.module_path.startswith("blocks.0."))
    w.session.collapse_all()
    w.select([op])
    items = w.session.view.items
    assert [[g.nodes[i].name for i in items[k].ops] for k in w.session.selected] == [[op]]
    # several at once, an item key among them: each is selected, the plot matches the view
    w.session.collapse_all()
    first = w.session.view.items[0]
    w.select([first.key, "blocks.1", op])
    items, picked = w.session.view.items, w.session.selected
    got = [[g.nodes[i].name for i in items[k].ops] for k in picked]
    assert picked[0] == 0 and items[0].key == first.key
    assert [op] in got and any(items[k].label == "blocks.1" for k in picked)
    assert len(got) == 3
    assert list(w.graph.nodes.data["key"]) == [it.key for it in w.session.view.items]
    assert list(w.graph.nodes.selected.indices) == picked
    before = w.session.plan
    w.session.guarded(lambda: w.select(["no_such_layer"]))()
    assert "no node or module named 'no_such_layer'" in w.message
    assert w.session.plan == before


def test_assign_from_code_to_an_unknown_device_says_which_devices_exist(widget):
    w = widget
    w.select(["blocks"])
    before = w.session.plan
    w.session.guarded(lambda: w.assign("H100:7"))()
    assert "H100:7" in w.message and "H100:1" in w.message
    assert w.session.plan == before
    w.assign("H100:1")
    assert w.session.plan != before and w.editing.target.value == "H100:1"
