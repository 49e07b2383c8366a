"""Finding one's way in a large graph: frames that cover only their module's items, the
overview of the whole layout, and labels that appear when zoomed in."""

from __future__ import annotations

import pytest

import explorer as ex
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from widgets.graphview import GraphView
from widgets.layout import ITEM_H, ITEM_W


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


def inside(px: float, py: float, xs: list[float], ys: list[float]) -> bool:
    """Whether a point is inside a polygon (even-odd rule)."""
    hit = False
    for k in range(len(xs)):
        x0, y0, x1, y1 = xs[k - 1], ys[k - 1], xs[k], ys[k]
        if (y0 > py) != (y1 > py) and px < x0 + (py - y0) * (x1 - x0) / (y1 - y0):
            hit = not hit
    return hit


def box_points(x: float, y: float) -> list[tuple[float, float]]:
    """The corners, edge middles and centre of an item's box."""
    return [(x + dx * ITEM_W / 2, y + dy * ITEM_H / 2) for dx in (-1, 0, 1) for dy in (-1, 0, 1)]


@pytest.mark.parametrize("how", ["all", 2, 3])
@pytest.mark.parametrize("copies", [1, 1000])
def test_frames_hold_their_items_and_cover_no_other(gpt, how, copies):
    g = gpt if copies == 1 else replicated(gpt, copies)
    v = GraphView(g)
    if how == "all":
        v.expand_all()
    else:
        v.expand_to(how)
    frames = v.frames()
    lay = v.layout(frames=frames)
    assert frames and len(lay.outlines) == len(frames)
    for frame, outline in zip(frames, lay.outlines, strict=True):
        members = set(frame.members)
        for k, (x, y) in enumerate(lay.xy):
            covered = [any(inside(px, py, xs, ys) for xs, ys in outline)
                       for px, py in box_points(x, y)]
            if k in members:
                assert all(covered), f"{frame.label} cuts through its item {k}"
            else:
                assert not any(covered), f"{frame.label} covers item {k} of another module"


def test_frames_of_a_layered_graph_keep_their_items_together_in_every_row():
    g = replicated(layered_dag(60, seed=1), 700)
    v = GraphView(g)
    v.expand_all()
    frames = v.frames()
    lay = v.layout(frames=frames)
    rows: dict[float, list[int]] = {}
    for k, (_, y) in enumerate(lay.xy):
        rows.setdefault(y, []).append(k)
    for r in rows.values():
        r.sort(key=lambda k: lay.xy[k][0])
        for frame in frames:
            at = [p for p, k in enumerate(r) if k in set(frame.members)]
            assert at == list(range(at[0], at[-1] + 1)) if at else True


def edge_points(outline: list[tuple[list[float], list[float]]]) -> list[tuple[float, float]]:
    """Points just inside each vertical side of a frame's polygons."""
    out = []
    for xs, ys in outline:
        half = len(xs) // 2
        for k in range(0, len(xs), 2):
            x, mid = xs[k], (ys[k] + ys[k + 1]) / 2
            out.append((x - 0.01 if k < half else x + 0.01, mid))
    return out


@pytest.mark.parametrize("copies", [1, 1000])
def test_frames_are_inside_the_frames_they_are_in_and_apart_from_the_others(gpt, copies):
    v = GraphView(gpt if copies == 1 else replicated(gpt, copies))
    v.expand_all()
    frames = v.frames()
    lay = v.layout(frames=frames)
    boxes = 0
    for f, (frame, outline) in enumerate(zip(frames, lay.outlines, strict=True)):
        boxes += all(len(set(xs)) == 2 for xs, _ in outline)
        mine = set(frame.members)
        for g, (other, around) in enumerate(zip(frames, lay.outlines, strict=True)):
            if g == f:
                continue
            theirs = set(other.members)
            hits = [any(inside(px, py, xs, ys) for xs, ys in around)
                    for px, py in edge_points(outline)]
            if mine < theirs:
                assert all(hits), f"{frame.label} sticks out of {other.label}"
            elif not theirs < mine:
                assert not any(hits), f"{frame.label} overlaps {other.label}"
    assert boxes > len(frames) // 2  # most frames are plain boxes, not steps


def test_the_overview_shows_the_whole_layout_around_the_graphs_view(gpt):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer
    from widgets.panels.overview import OVERVIEW_FROM

    cl = ex.Cluster.preset("4xH100")
    g = replicated(gpt, 1000)
    w = Explorer(g, roofline_costs(g, cl))
    over = w.graph.overview
    assert len(w.session.view.items) < OVERVIEW_FROM and not over.figure.visible
    w.session.expand_all()
    assert over.figure.visible
    assert over.tool.x_range is w.graph.figure.x_range  # the box is the graph's view
    assert over.tool.y_range is w.graph.figure.y_range
    d = w.graph.nodes.data
    xr, yr = over.figure.x_range, over.figure.y_range
    assert xr.start < min(d["x"]) and max(d["x"]) < xr.end
    assert yr.start < min(d["y"]) and max(d["y"]) < yr.end
    # every item has a label for when it is zoomed in on; the largest 150 have one always
    assert all(d["tag"]) and sum(1 for t in d["short"] if t) == 150
    assert w.graph.zoom_labels.indices == []  # the browser fills them in
    # until the browser says whether labels fit on screen, the largest 150 have theirs
    assert w.graph.labels.indices == [k for k, t in enumerate(d["short"]) if t]
