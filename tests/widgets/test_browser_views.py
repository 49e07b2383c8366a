"""Every view of an explorer shows its current state, in a real JupyterLab and a real Chromium:
one displayed again after kernel-side edits, and every view after a page reload (the kernel
still running); a click on a graph item in any view selects that item, and the next assign
moves it.

Uses the JupyterLab server and the helpers of ``test_browser.py`` (Debian's Chromium through
``executable_path``, never a downloaded browser; skipped like those tests without one).
"""

from __future__ import annotations

import nbformat
import pytest
import test_browser as tb

pytestmark = [pytest.mark.browser, pytest.mark.slow]

#: the JupyterLab server (with its notebooks) of the browser tests
lab = tb.lab

NOTEBOOK = "explorer_views.ipynb"
#: the explorer opened on one device, edited from code (every op shown, lm_head moved to
#: the second device), then displayed again
CELLS = (tb.SETUP,
         "w.session.expand_all()\nw.select(['lm_head'])\nw.assign(cl.ids[1])\nw.select([])",
         "w")

#: per drawn view of the plot named ``name`` (in page order): the columns ``cols`` of the
#: data source that has column ``cols[0]``
COLUMNS = """([name, cols]) => {
  if (typeof Bokeh === 'undefined') return [];
  const views = [...Bokeh.index.all_views()].filter(v => v.model && v.model.name === name
    && v.canvas_view && v.canvas_view.el.isConnected && v.canvas_view.el.offsetWidth > 0);
  views.sort((a, b) => a.el.getBoundingClientRect().top - b.el.getBoundingClientRect().top);
  return views.map(v => {
    const src = v.model.renderers.map(r => r.data_source).find(s => s && s.data[cols[0]]);
    return src ? cols.map(c => [...src.data[c]]) : null;
  });
}"""

#: screen position of the graph item ``key`` in the ``n``-th drawn graph view (page order);
#: "moved" when the item was outside the view, which is then centred on it
ITEM_XY = """([key, n]) => {
  const views = [...Bokeh.index.all_views()].filter(v => v.model
    && v.model.name === 'pe-graph-plot' && v.canvas_view && v.canvas_view.el.isConnected
    && v.canvas_view.el.offsetWidth > 0);
  views.sort((a, b) => a.el.getBoundingClientRect().top - b.el.getBoundingClientRect().top);
  const v = views[n];
  if (!v) return null;
  v.el.scrollIntoView({block: 'center'});
  const src = v.model.renderers.map(r => r.data_source).find(s => s && s.data.key);
  const i = src.data.key.indexOf(key);
  if (i < 0) return null;
  const x = src.data.x[i], y = src.data.y[i], xr = v.model.x_range, yr = v.model.y_range;
  if (x < xr.start + 1 || x > xr.end - 1 || y < yr.start + 1 || y > yr.end - 1) {
    const w = (xr.end - xr.start) / 2, h = (yr.end - yr.start) / 2;
    xr.setv({start: x - w, end: x + w});
    yr.setv({start: y - h, end: y + h});
    return "moved";
  }
  const box = v.canvas_view.el.getBoundingClientRect();
  return [box.left + v.frame.x_scale.compute(x), box.top + v.frame.y_scale.compute(y)];
}"""


def expected_pictures(g, cl, moves):
    """(keys, devices) of the graph's items, the memory bars' summaries and the step time, as
    the explorer draws them with every op shown, after moving each (module, device) of
    ``moves`` in turn (all on the first device before)."""
    from explorer.models.synthetic import roofline_costs
    from widgets.panels.graph import GraphPanel
    from widgets.panels.memory import MemoryPanel
    from widgets.session import Session

    s = Session(g, cl, roofline_costs(g, cl))
    s.expand_all()
    for module, target in moves:
        s.select([module])
        s.assign(s.selected_names, target)
    graph, memory = GraphPanel(s), MemoryPanel(s)
    return ([list(graph.nodes.data["key"]), list(graph.nodes.data["device"])],
            list(memory.source.data["summary"]), s.prediction.step_s)


def check_views(page, views: int, graph, memory) -> None:
    """Every one of the ``views`` drawn graphs and memory charts shows ``graph`` and
    ``memory``."""
    arg = ["pe-graph-plot", ["key", "device"]]
    page.wait_for_function(f"(a) => ({COLUMNS})(a).length === {views}", arg=arg)
    shown = page.evaluate(COLUMNS, arg)
    for k, cols in enumerate(shown):
        assert cols is not None, f"graph view {k} has no items"
        assert cols[0] == graph[0], f"graph view {k} shows other items"
        assert cols[1] == graph[1], f"graph view {k} shows another placement"
    bars = page.evaluate(COLUMNS, ["pe-memory-plot", ["summary"]])
    assert len(bars) == views
    for k, cols in enumerate(bars):
        assert cols == [memory], f"memory view {k} shows another plan: {cols} != {memory}"


#: per drawn graph view (page order): the keys of the items it shows selected
SELECTED = """() => [...Bokeh.index.all_views()].filter(v => v.model
    && v.model.name === 'pe-graph-plot' && v.canvas_view && v.canvas_view.el.isConnected
    && v.canvas_view.el.offsetWidth > 0)
  .sort((a, b) => a.el.getBoundingClientRect().top - b.el.getBoundingClientRect().top)
  .map(v => {
    const src = v.model.renderers.map(r => r.data_source).find(s => s && s.data.key);
    return [...src.selected.indices].map(i => src.data.key[i]);
  })"""


def click_and_assign(page, key: str, name: str, view: int, target: str) -> None:
    """Click item ``key`` (module ``name``) in graph view ``view``, check the kernel selected
    it (the selection line says so), and assign it to ``target`` with the first view's
    controls."""
    xy = page.evaluate(ITEM_XY, [key, view])
    if xy == "moved":  # (drawn below the rows in view)
        page.wait_for_timeout(500)
        xy = page.evaluate(ITEM_XY, [key, view])
    assert xy, f"{key} is not drawn in view {view}"
    page.mouse.click(*xy)
    selection = page.locator(".pe-selection").first
    page.locator(".pe-selection", has_text=f"{name} (").first.wait_for(timeout=15_000)
    assert "1</b> item(s)" in selection.inner_html(), selection.inner_text()
    # every view shows it selected, not only the one clicked
    page.wait_for_function(f"(key) => ({SELECTED})().every(k => k.length === 1 && k[0] === key)",
                           arg=key, timeout=15_000)
    page.wait_for_function(tb.KERNEL_IDLE)
    page.locator(".pe-target select").first.select_option(target)
    page.locator("button.pe-assign").first.click()


def test_a_second_display_and_a_reload_show_the_current_plan_and_clicks_select_it(lab):
    from playwright.sync_api import sync_playwright

    import explorer as ex

    url, root = lab
    bm = ex.builtin_model("gpt", "tiny")
    g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    cl = ex.Cluster.preset("2xH100")
    moved, moved_bars, _ = expected_pictures(g, cl, [("lm_head", cl.ids[1])])
    back, back_bars, back_step = expected_pictures(g, cl, [("lm_head", cl.ids[0])])
    last, last_bars, _ = expected_pictures(g, cl, [("ln_f", cl.ids[1])])
    assert moved[1] != back[1] != last[1] and moved_bars != back_bars != last_bars
    lm_head, ln_f = (next(k for k in moved[0] if k.split("/")[-1].startswith(f"m:{name}@"))
                     for name in ("lm_head", "ln_f"))

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code) for code in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, root / NOTEBOOK)
    tb.OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = tb.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            # models the page could not restore from the kernel after the reload
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" and (
                "not found" in m.text or "did not respond" in m.text) else None)
            tb.open_and_run(page, url, NOTEBOOK)
            page.wait_for_function(tb.KERNEL_IDLE)
            # (a) the explorer as opened, then displayed again: both show lm_head moved
            check_views(page, 2, moved, moved_bars)
            page.screenshot(path=str(tb.OUT / "explorer-two-views.png"), full_page=True)
            # a click in the second view selects what it shows; assign moves that
            click_and_assign(page, lm_head, "lm_head", 1, cl.ids[0])
            page.wait_for_function(
                "(v) => { const e = document.querySelector('.pe-estimate .pe-step');"
                " return e && e.dataset.value === v; }", arg=repr(back_step))
            page.wait_for_function(tb.KERNEL_IDLE)
            check_views(page, 2, back, back_bars)

            # (b) a reload: the kernel's widgets drawn again in a new page, no cell run
            page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
            page.wait_for_timeout(1000)
            page.reload()
            page.wait_for_function(tb.KERNEL_IDLE)
            page.wait_for_function(f"(a) => ({COLUMNS})(a).length === 2",
                                   arg=["pe-graph-plot", ["key"]])
            page.wait_for_timeout(500)
            check_views(page, 2, back, back_bars)
            assert page.get_by_text("model not found").count() == 0
            page.get_by_role("tab", name="run for real").first.click()
            page.wait_for_timeout(300)
            assert page.get_by_text("model not found").count() == 0
            assert page.get_by_text("Error displaying widget").count() == 0
            # (lm_head is still selected: a click on it would unselect it)
            click_and_assign(page, ln_f, "ln_f", 0, cl.ids[1])
            page.wait_for_function(
                f"([a, want]) => JSON.stringify(({COLUMNS})(a).map(c => c[1])) === "
                "JSON.stringify(want)",
                arg=[["pe-graph-plot", ["key", "device"]], [last[1], last[1]]], timeout=15_000)
            page.wait_for_function(tb.KERNEL_IDLE)
            check_views(page, 2, last, last_bars)
            page.screenshot(path=str(tb.OUT / "explorer-views-reloaded.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
