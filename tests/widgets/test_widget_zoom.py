"""Finding zoom: the wheel over the graph zooms it, zoom, reset and hover have buttons in
toolbars of their own row (bokeh hides what does not fit beside a title), the legend mentions
the overview only while it is shown, and the memory chart's title and legend are short
enough for a narrow column (the browser side is in ``test_browser_zoom.py``)."""

from __future__ import annotations

import pytest

import explorer as ex
from explorer.models.synthetic import replicated, roofline_costs

pytest.importorskip("jupyter_bokeh")
from bokeh.models import HoverTool, Legend, ResetTool, Title, WheelZoomTool

from widgets import Explorer
from widgets.panels.overview import OVERVIEW_FROM


@pytest.fixture(scope="module")
def large():
    """An explorer on ten copies of the tiny GPT on four H100s (the overview shows once
    every op is)."""
    bm = ex.builtin_model("gpt", "tiny")
    g = replicated(ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                              name="gpt"), 1000)
    cl = ex.Cluster.preset("4xH100")
    return Explorer(g, roofline_costs(g, cl))


def tool_types(fig) -> set[type]:
    return {type(t) for t in fig.toolbar.tools}


def test_the_wheel_zooms_the_graph_and_its_zoom_reset_and_hover_have_a_row(large):
    fig = large.graph.figure
    wheel = fig.toolbar.active_scroll
    assert isinstance(wheel, WheelZoomTool) and wheel in fig.toolbar.tools
    assert {WheelZoomTool, ResetTool, HoverTool} <= tool_types(fig)
    assert fig.toolbar_location == "above" and not fig.toolbar_sticky  # not beside the title


def test_the_legend_mentions_the_overview_only_while_it_is_shown(large):
    s, graph = large.session, large.graph
    assert len(s.view.items) < OVERVIEW_FROM and not graph.overview.figure.visible
    assert "overview" not in graph.legend.value
    assert "wheel" in graph.legend.value and "H100:3" in graph.legend.value
    s.expand_all()
    assert graph.overview.figure.visible
    assert "the overview on the right" in graph.legend.value
    s.collapse_all()
    assert not graph.overview.figure.visible and "overview" not in graph.legend.value


def test_the_memory_chart_has_a_toolbar_a_short_title_and_a_legend_in_two_rows(large):
    mem = large.memory
    fig = mem.figure
    assert {WheelZoomTool, ResetTool, HoverTool} <= tool_types(fig)
    assert fig.toolbar_location == "above" and not fig.toolbar_sticky
    assert fig.title.text == f"memory at the peak, {mem.unit}"
    notes = [t.text for t in fig.above if isinstance(t, Title)]
    assert notes == ["capacity beyond the right edge (said in words)"]  # 2.4 MiB of 80 GiB
    (legend,) = [x for x in fig.below if isinstance(x, Legend)]
    assert legend.nrows == 2 and len(legend.items) == 7
    xr = fig.x_range  # the reset tool goes back to the scale of the current plan
    assert (xr.reset_start, xr.reset_end) == (xr.start, xr.end) and xr.end > 0
