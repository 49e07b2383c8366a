"""The explorer's state and widget without a browser: edits, undo/redo, pins, estimates, errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import pytest

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from widgets import Session
from widgets.graphview import MAX_CHILDREN, GraphView
from widgets.layout import ITEM_H, ITEM_W, frame_levels, layered_layout


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    return g


@pytest.fixture
def session(gpt):
    cl = ex.Cluster.preset("4xH100")
    return Session(gpt, cl, roofline_costs(gpt, cl))


@pytest.mark.parametrize(("name", "options", "words"), [
    ("even-layers", {"k": "two"}, "option 'k' needs an int or None, got str 'two'"),
    ("pipeline-dp", {"micro_batches": "x"}, "option 'micro_batches' needs an int or None"),
    ("min-comm", {"tolerance": [1]}, "option 'tolerance' needs a float, got list"),
])
def test_solve_names_an_option_of_the_wrong_type(session, name, options, words):
    plans = list(session.plans)
    with pytest.raises(ExplorerError, match=f"{name}: {words}"):
        session.solve(name, **options)
    assert session.plans == plans


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
    # (interleaved 1F1B needs chunks that go round the stages: this plan has none)
    with pytest.raises(ExplorerError, match="chunks that go round the pipeline stages"):
        session.set_schedule(micro_batches=4, schedule="interleaved-1f1b")
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
    # virtual stages from the partitioners' panel: the plan under edit is interleaved
    entry = session.solve("even-layers", k=2, micro_batches=4, virtual_stages=2)
    assert session.plan is entry.plan and entry.plan.schedule == "interleaved-1f1b"
    assert session.prediction.step_s > 0


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
    xy = v.layout().xy
    assert max(y for _, y in xy) == 0 and all(y <= 0 for _, y in xy)
    for (a, z) in v.edges():  # every edge points down the page
        assert xy[z][1] < xy[a][1]


def overlaps(x: float, y0: float, y1: float, xy, skip) -> list[int]:
    """Items whose box a vertical line at x from y0 down to y1 passes through."""
    return [k for k, (cx, cy) in enumerate(xy) if k not in skip
            and abs(x - cx) < ITEM_W / 2 and cy - ITEM_H / 2 < y0 and y1 < cy + ITEM_H / 2]


def test_layout_rows_route_long_edges_between_items_and_frame_modules(gpt):
    g = replicated(layered_dag(60, seed=1), 700)  # ~600 ops, edges skipping many rows
    v = GraphView(g)
    v.expand_all()
    edges = v.edges()
    lay = layered_layout(len(v.items), edges)
    xy = lay.xy
    for r in {y for _, y in xy}:  # no two items of a row overlap
        xs = sorted(x for x, y in xy if y == r)
        assert all(b - a >= ITEM_W for a, b in itertools.pairwise(xs))
    long = [e for e in edges if lay.span[e] > 1]
    assert len(long) > 50
    for a, z in edges:
        xs, ys = lay.routes[a, z]
        assert (xs[0], ys[0]) == (xy[a][0], xy[a][1] - ITEM_H / 2)  # from the bottom of a
        assert (xs[-1], ys[-1]) == (xy[z][0], xy[z][1] + ITEM_H / 2)  # to the top of z
        assert all(y1 <= y0 for y0, y1 in itertools.pairwise(ys))  # always down the page
        # through each row it skips, it runs between that row's items, not under one
        for k in range(1, len(xs) - 1, 2):
            assert xs[k] == xs[k + 1] and not overlaps(xs[k], ys[k], ys[k + 1], xy, {a, z})
    # the expanded modules are frames around their items, outermost first
    frames = v.frames()
    assert frames[0].nest == 0 and frames[0].label == "copy0"
    assert {f.label for f in frames if f.nest == 0} >= {"copy0", "copy1"}
    v = GraphView(gpt)
    v.expand_all()
    frames = {f.label: f for f in v.frames()}
    assert frames["blocks"].nest == 0 and frames["blocks.0"].nest == 1
    assert set(frames["blocks.0.attn"].members) < set(frames["blocks.0"].members)
    chains = [tuple(f for f, fr in enumerate(frames.values()) if k in fr.members)
              for k in range(len(v.items))]
    assert frame_levels(chains)[0] == 2  # blocks > blocks.0 > blocks.0.attn
    # ~50 ms; benchmarks/editing.py measures it. The least of three runs: a busy shared host
    # stalls one run now and then, a layout too slow is slow in all three
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        layered_layout(len(lay.xy), edges)
        took.append(time.perf_counter() - t0)
    assert min(took) < 1.0, took


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
    assert mem[ids[1]] == pytest.approx(pred.memory[ids[1]].activations_bytes
                                        / w.memory.unit_bytes)
    assert len(w.timeline.source.data["lane"]) > 0
    w.editing.undo_button.click()
    assert w.graph.nodes.data["device"][k] == ids[0]
    assert "#d62728" not in w.graph.edges.data["color"]


def test_the_estimate_of_a_language_model_shows_tokens_per_second_and_mfu(widget):
    import re

    w = widget
    s = w.session
    shown = re.search(r"class='pe-rate' data-tokens='([^']+)' data-mfu='([^']+)'",
                      w.estimate.table.value)
    tokens = 8 * 16  # the tiny gpt's batch
    assert float(shown[1]) == pytest.approx(tokens / s.prediction.step_s / len(s.plan.devices))
    peak = sum(s.costs.cluster.device(d).flops_per_s for d in s.plan.devices)
    assert float(shown[2]) == pytest.approx(s.graph.total_flops / s.prediction.step_s / peak)
    assert "tokens/s/device" in w.estimate.table.value


def test_widget_errors_become_messages(widget):
    w = widget
    w.editing.assign_button.click()  # nothing selected
    assert "select one or more nodes" in w.message
    w.plans.options.value = "{oops"
    w.plans.solve_button.click()
    assert "options must be JSON" in w.message
    w.plans.algorithm.value = "even-layers"
    w.plans.options.value = '{"k": "two"}'
    w.plans.solve_button.click()
    assert w.message.startswith("even-layers: option 'k' needs an int or None, got str 'two'")
    w.plans.algorithm.value = "pipeline-dp"
    w.plans.options.value = '{"micro_batches": "x"}'
    w.plans.solve_button.click()
    assert "pipeline-dp: option 'micro_batches' needs an int or None" in w.message
    assert "TypeError" not in w.message
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


@pytest.mark.slow
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


# -- opening, finding, labels, colors, memory, runs (the issue's list) -----------------------

def test_explorer_takes_a_plan_positionally_and_names_wrong_types(gpt):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer

    cl = ex.Cluster.preset("2xH100")
    costs = roofline_costs(gpt, cl)
    plan = ex.partition(gpt, cl, costs, "even-layers")
    assert Explorer(gpt, costs, plan).session.plan == plan  # as the README writes it
    with pytest.raises(ExplorerError, match="plan must be a Plan"):
        Explorer(gpt, costs, plan="even-layers")
    with pytest.raises(ExplorerError, match="cluster must be a Cluster"):
        Explorer(gpt, costs, "2xH100")
    with pytest.raises(ExplorerError, match="cost model"):
        Explorer(gpt, "costs.json")


def test_opening_without_a_plan_takes_the_best_quick_baseline(gpt):
    cl = ex.Cluster.preset("4xH100")
    costs = roofline_costs(gpt, cl)
    s = Session.open(gpt, costs)
    preds = {a: ex.simulate(gpt, ex.partition(gpt, cl, costs, a), costs)
             for a in ("single", "data-parallel", "even-layers", "balanced-params")}
    best = min(p.step_s for p in preds.values() if p.fits)
    assert s.prediction.step_s == best and len(s.plan.devices) > 1
    assert "fastest of the quick baselines" in s.message
    one = ex.Cluster.preset("H100")
    assert Session.open(gpt, roofline_costs(gpt, one)).plan.devices == one.ids


def test_find_by_part_of_a_name_and_expand_to_a_depth(session, gpt):
    v = session.view
    assert v.search("blocks.1") == ["blocks.1"]
    assert v.search("0.attn") == ["blocks.0.attn"]  # whole path parts
    assert v.search("attention") == ["blocks.0.attn", "blocks.1.attn"]  # by module class
    assert v.search("zzz") == []
    names = v.names_to_find()
    assert "blocks.0.attn.qkv" in names and gpt.ops[0].name in names
    assert all(n in gpt or any(m.module_path == n or m.module_path.startswith(n + ".")
                               for m in gpt.ops) for n in names)  # this model's names only
    picked = session.find("attention")
    assert sorted(session.view.label_of(k) for k in picked) == ["blocks.0.attn",
                                                                "blocks.1.attn"]
    assert "found 2 match(es)" in session.message
    with pytest.raises(ExplorerError, match="nothing in gpt matches"):
        session.find("zzz")
    session.expand_to(2)
    labels = [session.view.label_of(k) for k in range(len(session.view.items))]
    assert "blocks.0" in labels and "blocks" not in labels and "blocks.0.attn" not in labels
    session.expand_all()
    assert len(session.view.items) == len(gpt.ops)
    session.collapse_all()
    assert "blocks" in [it.label for it in session.view.items]


def test_labels_keep_the_distinguishing_end_and_the_largest_items():
    pytest.importorskip("jupyter_bokeh")
    from widgets.graphview import Item
    from widgets.panels.graph import MAX_LABELS, labelled, short_label

    parts = [short_label(f"m.transformer.h.0.{p} (X)") for p in ("attn", "mlp", "ln_1")]
    assert parts == ["h.0.attn", "h.0.mlp", "h.0.ln_1"]  # not "m.transformer.h..." thrice
    assert short_label("model.transformer.h.11") == "transformer.h.11"
    assert short_label("a_very_long_module_name_here") == "..module_name_here"
    assert short_label("23 ops: add .. mul") == "23 ops"
    items = [Item(str(k), str(k), (), tuple(range(k % 7 + 1)), 0, False, "op")
             for k in range(400)]
    chosen = labelled(items)
    assert len(chosen) == MAX_LABELS
    assert min(len(items[k].ops) for k in chosen) >= max(
        len(items[k].ops) for k in set(range(400)) - chosen)


#: Machado et al. (2009) simulations of deuteranopia and protanopia, on linear RGB
CVD = {"normal": ((1, 0, 0), (0, 1, 0), (0, 0, 1)),
       "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413),
                        (-0.011820, 0.042940, 0.968881)),
       "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216),
                      (-0.003882, -0.048116, 1.051998))}


def seen_lab(color, matrix):
    """CIE Lab of a ``#rrggbb`` color as seen with a colour vision (one of ``CVD``)."""
    lin = [(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
           for c in (int(color[k:k + 2], 16) / 255 for k in (1, 3, 5))]
    r, g, b = (min(1, max(0, sum(m * v for m, v in zip(row, lin, strict=True)))) for row in matrix)
    xyz = (0.4124 * r + 0.3576 * g + 0.1805 * b, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           0.0193 * r + 0.1192 * g + 0.9505 * b)
    fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116
                  for t in (xyz[0] / 0.9505, xyz[1], xyz[2] / 1.089))
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def delta_e(a, b):
    """The smallest CIE76 distance between two colors over normal and red-green vision."""
    return min(sum((x - y) ** 2 for x, y in zip(seen_lab(a, m), seen_lab(b, m), strict=True))
                   ** 0.5
               for m in CVD.values())


def test_device_colors_are_distinct_and_never_the_edge_red_or_mixed_grey():
    pytest.importorskip("jupyter_bokeh")
    from itertools import combinations

    from widgets.panels.graph import CROSS, DEVICE_COLORS, MIXED

    assert len(set(DEVICE_COLORS)) == len(DEVICE_COLORS) == 16
    assert min(delta_e(a, b) for a, b in combinations(DEVICE_COLORS[:8], 2)) > 15
    assert min(delta_e(a, b) for a, b in combinations(DEVICE_COLORS, 2)) > 7
    assert min(delta_e(c, o) for c in DEVICE_COLORS for o in (CROSS, MIXED)) > 10


def test_graph_hover_counts_edges_without_an_edge_tooltip(widget):
    from bokeh.models import HoverTool

    w = widget
    hovers = [t for t in w.graph.figure.tools if isinstance(t, HoverTool)]
    assert len(hovers) == 1  # the nodes' only: no edge rows over a node's text
    rows = [r[0] for r in hovers[0].tooltips]
    assert rows.count("op") == 1 and "ops" not in rows and "edges" in rows
    k = [it.label for it in w.session.view.items].index("blocks")
    assert "MFLOP" in w.graph.nodes.data["flops"][k]
    assert " in (" in w.graph.nodes.data["links"][k]
    w.select(["blocks"])
    w.assign(w.session.cluster.ids[1])
    assert w.graph.nodes.data["cross"][k] != "none"
    w.graph.expand_all_button.click()
    assert len(w.session.view.items) == len(w.session.graph.ops)
    w.graph.collapse_all_button.click()
    w.graph.depth.value = 2
    w.graph.depth_button.click()
    assert "blocks.1" in [w.session.view.label_of(k) for k in range(len(w.session.view.items))]
    w.graph.find.value = "attention"
    assert "found 2" in w.status.lines["side"].value and w.status.message.value == ""


def test_memory_bars_read_at_80_gib_and_the_timeline_has_the_used_lanes(widget):
    from widgets.panels.memory import memory_unit, scale_end

    assert memory_unit(84 * 2**30)[0] == "GiB" and memory_unit(30 * 2**20)[0] == "MiB"
    assert scale_end([60.0, 10.0], [80.0, 80.0]) == (84.0, False)  # capacity in view
    assert scale_end([1.0, 0.0], [80.0, 80.0]) == (1.35, True)  # zoomed to what is used
    w = widget
    assert w.memory.unit in ("KiB", "MiB")  # a tiny model: not 0.0002 GiB ticks
    assert w.memory.unit in w.memory.figure.title.text
    d = w.memory.source.data
    used = max(sum(d[c][k] for c in ("params", "grads", "optimizer", "buffers",
                                     "activations")) for k in range(len(d["device"])))
    end = w.memory.figure.x_range.end
    assert used / end > 0.5  # a bar, not a sliver of an 80 GiB axis
    assert all("of 80.0 GiB" in t or "unused" in t for t in d["summary"])
    assert w.memory.figure.sizing_mode == "stretch_width"
    lanes = list(w.timeline.figure.y_range.factors)
    assert lanes == [f"{w.session.cluster.ids[0]} compute"]  # one device used
    assert "issue" not in w.timeline.legend.value  # (one timeline: no host lane)
    w.select(["blocks"])
    w.assign(w.session.cluster.ids[1])
    assert len(w.timeline.figure.y_range.factors) == 4  # two devices that talk


def test_a_gpu_with_two_timelines_shows_its_host_lane_and_the_issue_swatch(gpt):
    """Costs that time a GPU's host apart from its kernels (``DeviceCosts.host_s``, as a
    traced step gives them): the timeline draws the host's issuing above the kernels."""
    pytest.importorskip("jupyter_bokeh")
    from dataclasses import replace

    from widgets import Explorer

    cl = ex.Cluster.preset("2xH100")
    costs = roofline_costs(gpt, cl)
    host = [[20e-6 if n.kind == "op" else 0.0 for n in gpt.nodes]] * 2
    costs = replace(costs, per_type={k: replace(dc, host_s=host)
                                     for k, dc in costs.per_type.items()})
    w = Explorer(gpt, costs, ex.Plan.single(gpt, cl.ids[0]))
    dev = cl.ids[0]
    assert list(w.timeline.figure.y_range.factors) == [f"{dev} compute", f"{dev} host"]
    host_bars = [k for k, lane in enumerate(w.timeline.source.data["lane"])
                 if lane == f"{dev} host"]
    assert host_bars and "issue" in w.timeline.legend.value
    assert w.session.prediction.host_busy_s[dev] > 0


def test_run_errors_are_the_real_cause_next_to_the_run_button(gpt, monkeypatch):
    pytest.importorskip("jupyter_bokeh")
    import ipywidgets.widgets.widget_output as wo

    from widgets import Explorer

    class Shell:  # as in a notebook: the output area shows and swallows errors
        def showtraceback(self, *a, **k):
            pass

    monkeypatch.setattr(wo, "get_ipython", lambda: Shell())
    cl = ex.Cluster.preset("8xH100")
    costs = roofline_costs(gpt, cl)
    plan = ex.partition(gpt, cl, costs, "data-parallel", k=7)  # 7 replicas, batch of 8
    w = Explorer(gpt, costs, plan)
    assert "does not divide" in w.runs.runnable.value
    assert "pe-cannot-run" in w.estimate.table.value
    w.runs.run_button.click()
    assert "does not divide" in w.message and "UnboundLocalError" not in w.message
    assert w.status.lines["run"].value and w.status.message.value == ""
    w.editing.micro_batches.value = 3  # flagged while editing, before applying
    assert "7 replicas x 3 micro-batches" in w.editing.runnable.value


def test_bokehjs_bundle_is_guarded_against_a_second_load(widget):
    from widgets.panels.base import bokehjs_bundle

    js = bokehjs_bundle()["application/javascript"]
    assert js.startswith("if (typeof window.Bokeh === 'undefined'") and len(js) > 1e6


def test_reset_returns_to_the_current_view_zoom_to_selection_and_module_labels(gpt):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer

    g = replicated(gpt, 1000)  # ~660 ops in ten copies of the model
    cl = ex.Cluster.preset("4xH100")
    w = Explorer(g, roofline_costs(g, cl))
    fig = w.graph.figure

    def ranges():
        return (fig.x_range.start, fig.x_range.end, fig.y_range.start, fig.y_range.end)

    def resets():
        return (fig.x_range.reset_start, fig.x_range.reset_end, fig.y_range.reset_start,
                fig.y_range.reset_end)

    assert ranges() == resets()
    w.session.expand_all()
    assert len(w.session.view.items) > 600
    assert ranges() == resets()  # re-fitted after expanding: reset comes back here
    ys = w.graph.nodes.data["y"]
    assert fig.y_range.end > max(ys) and fig.y_range.start > min(ys)  # the top rows
    fitted = ranges()
    w.graph.zoom_button.click()  # nothing selected: says what to do
    assert "select the items to zoom to" in w.message
    w.select(["copy5.blocks.1.mlp"])
    w.graph.zoom_button.click()
    x0, x1, y0, y1 = ranges()
    for k in w.session.selected:
        assert x0 < w.graph.nodes.data["x"][k] < x1 and y0 < ys[k] < y1
    assert y1 - y0 < 10 and resets() == fitted
    # every copy's frame is labelled, though only 150 items are
    frames = w.graph.frames.data
    labelled = {t for t in frames["label"] if t}
    assert {f"copy{c}" for c in range(10)} <= labelled
    assert sum(1 for t in w.graph.nodes.data["short"] if t) == 150
    long = [a for a, s in zip(w.graph.edges.data["alpha"], w.graph.edges.data["xs"],
                              strict=True) if len(s) > 4]
    assert long and min(long) < 0.5  # edges down many rows are faint


def test_the_export_panel_writes_a_plain_pytorch_script_of_a_built_in_model(tmp_path):
    """A session opened on a built-in model knows how to build it again: the panel's "plain
    PyTorch" box writes the native script, the plan's prediction in its header, also of a
    pipeline, and of a tensor split (the GPT's fused query-key-value projection reordered); a
    plan torch's parallelisms cannot make (a stage that starts inside a module) is refused,
    naming what stops it, and nothing is written."""
    from widgets.panels.plans import PlansPanel

    bm = ex.builtin_model("gpt", "tiny")
    cl = ex.Cluster.preset("2xH100")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    ops = {n.name: 0 for n in graph.nodes if n.kind == "op"}
    replicas = ex.Plan.from_assignment(graph, [tuple(cl.ids)], ops).with_memory(zero=3)
    session = Session.open(bm, cluster=cl, plan=replicas, measure="never", progress=False)
    panel = PlansPanel(session)
    panel.script_path.value = str(tmp_path / "train.py")
    panel.native.value = True
    panel.export_button.click()
    text = (tmp_path / "train.py").read_text()
    assert 'build("gpt", "tiny", 8, seed=0, weights=weights)' in text
    assert "Predicted by the explorer" in text and "fully_shard(model" in text
    assert "plain PyTorch script" in session.message
    session.load(ex.partition(graph, cl, session.costs, "even-layers"))
    session.export(tmp_path / "stages.py", native=True)
    assert 'STAGE_STARTS = ["blocks.1"]' in (tmp_path / "stages.py").read_text()
    session.load(ex.Plan.from_assignment(graph, [tuple(cl.ids)], ops).with_tensor(2))
    session.export(tmp_path / "tensor.py", native=True)
    assert '"blocks.0.attn.qkv": 3,' in (tmp_path / "tensor.py").read_text()
    names = [n.name for n in graph.nodes if n.kind == "op"]
    inside = names.index(next(n.name for n in graph.nodes
                              if n.kind == "op" and n.module_path == "blocks.0.mlp.fc"))
    session.load(ex.Plan.from_assignment(graph, [(cl.ids[0],), (cl.ids[1],)],
                                         {name: int(k >= inside) for k, name in enumerate(names)}))
    with pytest.raises(ExplorerError, match=r"inside"):
        session.export(tmp_path / "cut.py", native=True)
    assert not (tmp_path / "cut.py").exists()
