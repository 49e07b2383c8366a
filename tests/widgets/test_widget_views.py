"""Every view of an explorer's plots shows the current state, and a click selects what its view
shows: kernel-side, without a browser (the browser side is in ``test_browser_views.py``).

A view of a jupyter_bokeh plot is drawn from the widget's ``render_bundle``: what a page
reloaded (which asks the kernel for the widgets' state) or a second display draws must be the
document as it is now; a selecting gesture in a view sends the keys of the items it picked,
which must select those items even when the kernel's items changed since the view was drawn.
"""

from __future__ import annotations

import json

import pytest
from IPython.core.formatters import DisplayFormatter

import explorer as ex
from explorer.models.synthetic import roofline_costs

pytest.importorskip("jupyter_bokeh")

from bokeh.core.json_encoder import serialize_json
from bokeh.document import Document
from bokeh.models import ColumnDataSource

from widgets import Explorer, app
from widgets.graphview import GraphView, name_in_key
from widgets.panels.base import CurrentBokehModel, renew_bokeh_views


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


@pytest.fixture
def widget(gpt):
    cl = ex.Cluster.preset("2xH100")
    return Explorer(gpt, roofline_costs(gpt, cl), ex.Plan.single(gpt, cl.ids[0]),
                    measure="never")


def drawn(bundle, *columns: str) -> dict[str, list]:
    """The data of the source with ``columns`` in a view drawn from ``bundle`` (a widget's
    ``render_bundle``, as a trait or as the JSON state the front end gets)."""
    bundle = json.loads(bundle if isinstance(bundle, str) else serialize_json(bundle))
    (doc_json,) = bundle["docs_json"].values()
    doc = Document.from_json(doc_json)
    return next(dict(m.data) for m in doc.models
                if isinstance(m, ColumnDataSource) and set(columns) <= set(m.data))


def graph_model(w) -> CurrentBokehModel:
    return next(c for c in w.graph.widget.children if isinstance(c, CurrentBokehModel))


def devices_drawn(bundle) -> dict[str, str]:
    data = drawn(bundle, "key", "device")
    return dict(zip(data["key"], data["device"], strict=True))


def test_a_page_reloaded_after_edits_draws_the_current_plan_and_items(widget):
    w = widget
    second = w.session.cluster.ids[1]
    w.session.expand_all()
    w.select(["lm_head"])
    w.assign(second)
    lm_head = w.session.view.items[w.session.selected[0]].key
    # what a reloaded page asks the kernel for: every widget's state
    state = graph_model(w).get_state()
    shown = devices_drawn(state["render_bundle"])
    assert list(shown) == list(w.graph.nodes.data["key"])  # every op, not the opening view
    assert shown[lm_head] == second
    assert set(shown.values()) == {w.session.cluster.ids[0], second}
    bars = drawn(w.memory.widget.get_state()["render_bundle"], "summary")
    assert bars["summary"] == list(w.memory.source.data["summary"])
    assert not bars["summary"][1].endswith("unused")


def test_displaying_an_explorer_again_renews_its_plots_once(widget, monkeypatch):
    w = widget
    monkeypatch.setattr(app, "publish_display_data", lambda data: None)
    model = graph_model(w)
    opened = model.render_bundle
    w.select(["lm_head"])
    w.assign(w.session.cluster.ids[1])
    assert DisplayFormatter().format(w) == ({}, {})  # display(w) in a cell
    assert model.render_bundle is not opened
    assert devices_drawn(model.render_bundle)["/m:lm_head@95"] == w.session.cluster.ids[1]
    shown = model.render_bundle
    assert renew_bokeh_views(w) == 0  # nothing changed since: the bundle is kept
    assert model.render_bundle is shown

    # a panel's plots displayed on their own
    w.select(["ln_f"])
    w.assign(w.session.cluster.ids[1])
    assert "application/vnd.jupyter.widget-view+json" in DisplayFormatter().format(
        w.graph.widget)[0]
    assert devices_drawn(model.render_bundle)["/m:ln_f@94"] == w.session.cluster.ids[1]


def send_pick(w, keys: list[str], gesture: int) -> None:
    """What a click, box or lasso in a view of the graph that picked the items ``keys`` sets
    in the kernel (see ``widgets.panels.graph.PICK_JS``; jupyter_bokeh sets it from the
    browser's message and calls the callbacks)."""
    w.graph.picked.data = {"keys": [keys], "gesture": [gesture]}


def test_a_click_selects_the_item_its_view_draws_after_the_items_changed(widget):
    w = widget
    opened = GraphView(w.session.graph)  # the items a view drawn at opening shows
    lm_head = next(it for it in opened.items if it.label.startswith("lm_head"))
    w.session.expand_all()  # kernel-side: the item at lm_head's position is another one now
    assert w.session.view.items[opened.items.index(lm_head)].key != lm_head.key
    send_pick(w, [lm_head.key], 1)
    assert [w.session.view.items[k].key for k in w.session.selected] == [lm_head.key]
    assert list(w.graph.nodes.selected.indices) == w.session.selected
    assert "lm_head" in w.editing.selection.value
    w.assign(w.session.cluster.ids[1])
    assert set(w.session.plan.devices_of("lm_head.weight")) == {w.session.cluster.ids[1]}

    # a module drawn folded in that view, shown by its parts now: the parts are selected
    blocks = next(it for it in opened.items if it.label == "blocks")
    send_pick(w, [blocks.key], 2)
    assert sorted(w.session.selected_names) == sorted(opened.names([blocks.key]))
    assert w.session.message == ""

    # the keys of the selection picked again (the browser reports a change twice): the
    # selection stays
    before = list(w.session.selected)
    assert w.graph.pick([w.session.view.items[k].key for k in before]) == before
    send_pick(w, [], 3)  # a click on no item
    assert w.session.selected == []


def test_every_view_is_sent_a_selection_picked_in_one(widget):
    w = widget
    events = []
    model = graph_model(w)
    w.graph.nodes.selected.indices = [3]  # as the view the click came from set it
    w.graph.nodes.selected.on_change("indices", lambda attr, old, new: events.append(new))
    sent = []
    model.send = lambda content, buffers=None: sent.append(content)
    send_pick(w, [w.session.view.items[3].key], 1)
    assert w.session.selected == [3]
    assert events and events[-1] == [3]
    assert sent, "the selection was not sent to the views"


def test_a_key_names_the_op_or_module_it_shows():
    assert name_in_key("/m:ops@33/op:arange") == "arange"
    assert name_in_key("/m:blocks@38/m:blocks.0@38") == "blocks.0"
    assert name_in_key("/m:lm_head@95") == "lm_head"
    assert name_in_key("/m:ops@96") == ""
    assert name_in_key("/b:3-40") == ""
