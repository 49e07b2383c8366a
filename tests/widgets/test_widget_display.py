"""How an explorer is shown: BokehJS with the first explorer of each page only, the plans
table in the estimate panel's units, messages that wrap inside their box."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from IPython.core.formatters import DisplayFormatter

import explorer as ex
from explorer.core.units import GiB, MiB, format_bytes, format_seconds
from explorer.models.synthetic import roofline_costs

pytest.importorskip("jupyter_bokeh")

from widgets import Explorer, app
from widgets.panels import base
from widgets.session import PlanEntry


class FakeKernel:
    """Stands in for ipykernel: the request being run came from page ``page``."""

    def __init__(self) -> None:
        self.page = "page-1"

    def get_parent(self) -> dict:
        return {"header": {"session": self.page, "msg_type": "execute_request"}}


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


@pytest.fixture
def widget(gpt):
    cl = ex.Cluster.preset("2xH100")
    return Explorer(gpt, roofline_costs(gpt, cl), ex.Plan.single(gpt, cl.ids[0]),
                    measure="never")


@pytest.fixture
def shown(monkeypatch):
    """What the explorers' displays publish, in order."""
    out: list[dict] = []
    monkeypatch.setattr(app, "publish_display_data", out.append)
    monkeypatch.setattr(base, "PAGES_WITH_BOKEHJS", set())
    return out


def show(widget) -> None:
    """Show ``widget`` as a notebook cell's ``display(widget)`` does (IPython's formatter)."""
    assert DisplayFormatter().format(widget) == ({}, {})  # the widget published itself


def loaders(published: list[dict]) -> int:
    return sum("application/javascript" in data for data in published)


def test_bokehjs_goes_with_the_first_explorer_of_each_page(widget, shown, monkeypatch):
    kernel = FakeKernel()
    monkeypatch.setattr(base, "get_ipython", lambda: SimpleNamespace(kernel=kernel))
    for _ in range(3):
        show(widget)
    assert loaders(shown) == 1 and len(shown) == 4
    assert shown[0].keys() == {"application/javascript"}  # one copy, not one per MIME type
    assert all("application/vnd.jupyter.widget-view+json" in d for d in shown[1:])
    kernel.page = "page-2"  # the page reloaded, or another page on the same kernel
    show(widget)
    show(widget)
    assert loaders(shown) == 2 and len(shown) == 7


def test_outside_a_kernel_every_explorer_brings_bokehjs(widget, shown, monkeypatch):
    monkeypatch.setattr(base, "get_ipython", lambda: None)
    show(widget)
    show(widget)
    assert loaders(shown) == 2


def test_the_plans_table_writes_times_and_memory_as_the_estimate_panel(widget):
    w = widget
    w.plans.keep_button.click()
    p = w.session.plans[-1].prediction
    step, memory = format_seconds(p.step_s), format_bytes(max(p.peak_bytes.values()))
    assert step in w.estimate.table.value and memory in w.estimate.table.value
    assert f"<td>{step}</td>" in w.plans.table.value
    assert f"<td>{memory}</td>" in w.plans.table.value

    # a big model's numbers: seconds and GiB, as the estimate panel writes them
    big = SimpleNamespace(step_s=43.0106, peak_bytes={"gpu0": int(1_367_251.09 * MiB)},
                          fits=False, cross_device_bytes=3 * GiB, gap=0.25,
                          lower_bound_s=40.0)
    w.session.plans.append(PlanEntry("big", w.session.plan, big, solve_s=0.004))
    w.plans.update("plans")
    row = re.search(r"<tr><td>big</td>(.*?)</tr>", w.plans.table.value)[1]
    assert "<td>43.01 s</td>" in row and "<td>1,335.2 GiB</td>" in row, row
    assert "<td>3.0 GiB</td>" in row and "<td>4.00 ms</td>" in row, row
    assert "MiB" not in row


def test_a_long_message_and_its_trace_wrap_inside_their_box(widget):
    w = widget
    w.session.say("cannot write /" + "a_long_directory_name/" * 12, error=True,
                  detail="Traceback:\n  File \"/" + "site-packages/" * 20 + "x.py\"")
    box = w.status.message.value
    outer = re.match(r"<div style='([^']*)'", box)[1]
    assert "overflow-wrap:anywhere" in outer and "max-width:100%" in outer
    assert "box-sizing:border-box" in outer
    trace = re.search(r"<pre style='([^']*)'", box)[1]  # a trace keeps its lines, wrapped
    assert "white-space:pre-wrap" in trace and "overflow-wrap:anywhere" in trace
