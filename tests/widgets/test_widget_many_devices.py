"""The explorer on 64 and 256 devices, without a browser: devices in groups (by stage) with
their spread and the worst device named, a colour hue per stage and a shade per device, "mixed"
items that say their mix, a header that counts the devices, and the controls beside the graph
(the browser side is in ``test_browser_many.py``)."""

from __future__ import annotations

import itertools
import re

import pytest

import explorer as ex
from explorer.models.synthetic import roofline_costs
from widgets.device_groups import (
    STAGE_HUES,
    device_groups,
    device_span,
    grouped,
    mix_text,
    spread_text,
    stage_colors,
    stage_hue,
)


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


def staged(graph: ex.OpGraph, ids, n_stages: int, per_stage: int) -> ex.Plan:
    """The graph's ops cut into ``n_stages`` runs in order, stage k on ``per_stage`` devices
    from ``ids[k * per_stage]`` on (replicated)."""
    ops = [n.name for n in graph.ops]
    size = -(-len(ops) // n_stages)
    stages = [ids[k * per_stage:(k + 1) * per_stage] for k in range(n_stages)]
    return ex.Plan.from_assignment(graph, stages, {n: j // size for j, n in enumerate(ops)})


def test_device_lists_are_said_as_ranges():
    ids = [f"H100:{k}" for k in range(8)] + ["H100:12", "cpu:0", "cpu:1", "gpu"]
    assert device_span(ids) == "H100:0-7, H100:12, cpu:0-1, gpu"
    assert device_span(["H100:3"]) == "H100:3"
    assert not grouped(7) and grouped(8)


def test_groups_are_stages_then_runs_of_stages_then_the_unused(gpt):
    ids = ex.Cluster.preset("64xH100").ids
    plan = staged(gpt, ids, 8, 4)  # 32 devices used
    groups = device_groups(plan, ids)
    assert [g.label for g in groups] == [f"stage {k}" for k in range(8)] + ["unused"]
    assert groups[1].devices == ids[4:8] and groups[-1].devices == ids[32:]
    many = device_groups(staged(gpt, ids, 64, 1), ids)
    assert [g.label for g in many] == [f"stages {k}-{k + 7}" for k in range(0, 64, 8)]
    assert sum(len(g.devices) for g in many) == 64


def test_spread_names_the_worst_device():
    values = {"a:0": 1.0, "a:1": 3.0, "a:2": 2.0, "a:3": 9.0}
    text = spread_text(values, ["a:0", "a:1", "a:2"], lambda v: f"{v:g} s")
    assert text == "1 s .. 3 s, median 2 s, most on a:1"
    assert spread_text(values, ["a:3"], str) == "9.0 on a:3"
    assert spread_text({"a:0": 1.0, "a:1": 1.0}, ["a:0", "a:1"], str) == "1.0 on each"
    assert spread_text(values, ["b:0"], str) == "none"


@pytest.mark.parametrize(("n", "stages"), [(64, 8), (256, 32), (64, 64)])
def test_colours_are_a_hue_per_stage_and_a_shade_per_device_without_repeats(gpt, n, stages):
    ids = ex.Cluster.preset(f"{n}xH100").ids
    plan = staged(gpt, ids, stages, n // stages)
    colors = stage_colors(plan, ids)
    assert len(set(colors.values())) == n  # no repeats, not every 16 devices
    firsts = [colors[devs[0]] for devs in plan.stages]
    assert len(set(firsts)) == stages and firsts[:8] == list(STAGE_HUES[:min(8, stages)])
    # a stage's shades are nearer its own hue than any other stage's hue
    for k, devs in enumerate(plan.stages[:8]):
        for d in devs:
            dist = [lab_distance(colors[d], h) for h in firsts[:8]]
            assert dist.index(min(dist)) == k, (d, colors[d])


def test_stage_hues_are_never_the_edge_red_or_the_mixed_grey():
    pytest.importorskip("jupyter_bokeh")
    from widgets.panels.graph import CROSS, MIXED

    hues = [stage_hue(k) for k in range(64)]
    assert len(set(hues)) == 64
    assert min(lab_distance(a, b) for a, b in itertools.combinations(STAGE_HUES, 2)) > 20
    assert min(lab_distance(h, o) for h in STAGE_HUES for o in (CROSS, MIXED)) > 30


def lab_distance(a: str, b: str) -> float:
    """The CIE76 distance between two ``#rrggbb`` colours (normal vision)."""
    from test_widgets import CVD, seen_lab

    return sum((x - y) ** 2 for x, y in zip(seen_lab(a, CVD["normal"]),
                                            seen_lab(b, CVD["normal"]), strict=True)) ** 0.5


def test_a_mixed_item_says_its_mix(gpt):
    ids = ex.Cluster.preset("64xH100").ids
    plan = staged(gpt, ids, 8, 8)
    stage_of = [plan.placement[n.name] for n in gpt.ops[:40]]
    text = mix_text(plan, stage_of)
    k = len(set(stage_of))
    assert text.startswith(f"mixed: {k} stages, {8 * k} devices: stage 0 (H100:0-7) ")
    assert text.endswith("%") and text.count("%") == k


@pytest.fixture(scope="module")
def wide(gpt):
    """The explorer on 64 H100s with 8 stages of 8 devices."""
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer

    cl = ex.Cluster.preset("64xH100")
    return Explorer(gpt, roofline_costs(gpt, cl), staged(gpt, cl.ids, 8, 8))


def test_64_devices_are_shown_in_groups_with_the_worst_named(wide):
    w = wide
    ids = w.session.cluster.ids
    header = w.status.header.value
    assert "64 devices: H100:0-63" in header and "H100:17," not in header
    table = w.estimate.table.value
    assert table.count("class='pe-mem'") == 1  # the highest peak only, not 64
    assert table.count("class='pe-group'") == 16  # busy and peak: 8 stages each
    assert "stage 3 (H100:24-31): " in table and "most on H100:" in table
    assert "per stage" in table
    bars = w.memory.source.data
    assert list(bars["row"]) == [f"stage {k}" for k in range(8)]
    assert all(s.startswith(f"stage {k} (H100:{8 * k}-{8 * k + 7}): highest H100:")
               for k, s in enumerate(bars["summary"]))
    assert w.memory.figure.height <= 150 + 30 * 8
    lanes = list(w.timeline.figure.y_range.factors)
    assert 8 <= len(lanes) <= 16  # the busiest device of each stage
    assert len({lane.split()[0] for lane in lanes}) == 8
    legend = w.graph.legend.value
    assert "stage 0: H100:0-7" in legend and "H100:9<" not in legend
    assert len(set(ids)) == 64


def test_items_take_their_stage_hue_and_mixed_ones_say_their_mix(wide):
    w = wide
    d = w.graph.nodes.data
    plan = w.session.plan
    mixed = [k for k, dev in enumerate(d["device"]) if dev.startswith("mixed")]
    assert mixed, "8 runs of ops cut through some top-level module"
    for k, dev in enumerate(d["device"]):
        if k in mixed:
            assert re.match(r"mixed: \d+ stages, \d+ devices: stage \d+ \(H100:", dev), dev
            assert d["short"][k].endswith(" stages]")
        else:
            stage = plan.stage_of_device(dev.split("+")[0])
            assert d["color"][k] == STAGE_HUES[stage]
    # an edit re-colours what moves, by the stage it moves to
    name = w.session.view.label_of(mixed[0])
    w.select([name])
    w.assign("H100:56+H100:57+H100:58+H100:59+H100:60+H100:61+H100:62+H100:63")
    k = w.session.view.matching(name)[0]
    assert not w.graph.nodes.data["device"][k].startswith("mixed")
    stage = w.session.plan.stage_of_device("H100:56")  # (empty stages are dropped)
    assert w.graph.nodes.data["color"][k] == stage_hue(stage) == w.graph.colors["H100:56"]
    w.session.undo()


def test_the_controls_come_first_beside_the_graph(wide):
    w = wide
    row = next(c for c in w.children if any(w.graph.widget in getattr(k, "children", ())
                                            for k in getattr(c, "children", ())))
    graph, side = row.children
    assert list(graph.children) == [w.graph.widget, w.graph.controls]
    assert side.children[0] is w.editing.widget
    assert list(side.children).index(w.memory.widget) > 1


def test_small_clusters_keep_a_number_bar_and_colour_per_device(gpt):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer
    from widgets.panels.graph import DEVICE_COLORS

    cl = ex.Cluster.preset("4xH100")
    w = Explorer(gpt, roofline_costs(gpt, cl), staged(gpt, cl.ids, 2, 2))
    assert ", ".join(cl.ids) in w.status.header.value
    assert w.estimate.table.value.count("class='pe-mem'") == 4
    assert list(w.memory.source.data["row"]) == list(cl.ids)
    assert w.graph.colors == dict(zip(cl.ids, DEVICE_COLORS[:4], strict=True))
    assert all(a != b for a, b in itertools.pairwise(w.graph.colors.values()))


def test_the_editing_benchmark_records_each_device_count(tmp_path, monkeypatch):
    """``benchmarks/editing.py --device-counts``, without the page (no browser): a row per
    count with the first picture and the edit times, recorded as ``editing_devices``."""
    pytest.importorskip("jupyter_bokeh")
    import importlib.util
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location("editing_bench", folder / "editing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cells = bench.page_cells("gpt:tiny", [8, 64])
    assert len(cells) == 3 and "builtin_model('gpt', 'tiny')" in cells[0]
    for cell in cells:
        compile(cell, "cell", "exec")
    bench.device_counts("gpt:tiny", [8, 64], 2, False, str(tmp_path))
    record = json.loads((tmp_path / "editing_devices.json").read_text())
    rows = record["rows"]
    assert [r["devices"] for r in rows] == [8, 64]
    assert all(float(r["first picture (s)"]) > 0 and float(r["widget ms"]) > 0 for r in rows)
    assert rows[0]["page height (px)"] == "-" and "No page: not asked" in record["notes"]
