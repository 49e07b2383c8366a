"""The explorer in a real JupyterLab and a real Chromium: run a notebook, click a node, assign it.

Needs Debian's Chromium (``apt-get install -y chromium``) and the ``playwright`` package (never
its own browser download). Skipped when either is missing, unless ``PE_REQUIRE_BROWSER=1``
(set by ``.ci/run``), where a missing browser fails. Screenshots go to ``test-output/``
(or ``$PE_TEST_OUTPUT``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
OUT = Path(os.environ.get("PE_TEST_OUTPUT", Path(__file__).resolve().parents[2] / "test-output"))

SETUP = """\
import explorer as ex
from explorer.models.synthetic import roofline_costs
from widgets import Explorer
bm = ex.builtin_model("gpt", "tiny")
g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
cl = ex.Cluster.preset("2xH100")
w = Explorer(g, roofline_costs(g, cl), ex.Plan.single(g, cl.ids[0]), height=420)
w"""

#: a 660-op model (ten copies of the tiny GPT, module paths kept) on four H100s, opened with
#: the plan the explorer picks
LARGE = """\
import explorer as ex
from explorer.models.synthetic import replicated, roofline_costs
from widgets import Explorer
bm = ex.builtin_model("gpt", "tiny")
g = replicated(ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt"),
               1000)
cl = ex.Cluster.preset("4xH100")
w = Explorer(g, roofline_costs(g, cl), height=640)
w"""

KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session
            && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""

#: screen position of a graph item, from BokehJS's own scales (the graph is a canvas)
ITEM_XY = """(key) => {
  const v = [...Bokeh.index.all_views()].find(v => v.model && v.model.name === 'pe-graph-plot');
  if (!v) return null;
  v.el.scrollIntoView({block: 'center'});
  const src = v.model.renderers.map(r => r.data_source).find(s => s && s.data.key);
  const i = src.data.key.indexOf(key);
  if (i < 0) return null;
  const sx = v.frame.x_scale.compute(src.data.x[i]);
  const sy = v.frame.y_scale.compute(src.data.y[i]);
  const box = v.canvas_view.el.getBoundingClientRect();
  return [box.left + sx, box.top + sy];
}"""


#: a column of the graph's items as BokehJS has it (what the picture draws)
ITEM_COLUMN = """(col) => {
  const v = [...Bokeh.index.all_views()].find(v => v.model && v.model.name === 'pe-graph-plot');
  if (!v) return null;
  const src = v.model.renderers.map(r => r.data_source).find(s => s && s.data.key);
  return [...src.data[col]];
}"""


def launch(playwright):
    """Debian's Chromium, headless, offline."""
    return playwright.chromium.launch(
        executable_path=CHROMIUM, headless=True,
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync"])


def open_and_run(page, url: str, notebook: str = "explorer_test.ipynb") -> None:
    """Open a test notebook in JupyterLab and run its cells."""
    page.set_default_timeout(120_000)
    page.goto(f"{url}/lab/tree/{notebook}?reset")
    page.wait_for_function(KERNEL_IDLE)
    no_news = page.get_by_role("button", name="No")  # JupyterLab's news question
    if no_news.count():
        no_news.first.click()
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")


def _browser_ready() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if not Path(CHROMIUM).exists():
        return "Chromium is not installed (apt-get install -y chromium)"
    return ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    why = _browser_ready()
    if why:
        if os.environ.get("PE_REQUIRE_BROWSER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    import nbformat

    root = tmp_path_factory.mktemp("lab")
    for name, code in (("explorer_test.ipynb", SETUP), ("explorer_large.ipynb", LARGE)):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(code)]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, root / name)
    try:
        with _page().jupyterlab(root) as url:  # (the server the benchmarks measure pages on)
            yield url, root
    except RuntimeError as e:  # (it did not start: its log's end)
        pytest.fail(str(e))


def _page():
    """benchmarks/_page.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "_page", Path(__file__).resolve().parents[2] / "benchmarks" / "_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_click_a_node_assign_it_and_see_the_engines_numbers(lab):
    from playwright.sync_api import sync_playwright

    import explorer as ex
    from explorer.models.synthetic import roofline_costs
    from widgets import Session
    from widgets.graphview import GraphView

    url, _root = lab
    # what the engine says the edit gives, computed here in the test's own process
    bm = ex.builtin_model("gpt", "tiny")
    g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    cl = ex.Cluster.preset("2xH100")
    view = GraphView(g)
    item = next(it for it in view.items if it.label == "blocks")
    expected = Session(g, cl, roofline_costs(g, cl))
    before = expected.prediction
    expected.assign(view.names([item.key]), cl.ids[1])
    after = expected.prediction
    assert after.step_s != before.step_s

    OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            open_and_run(page, url)
            step = page.locator(".pe-estimate .pe-step")
            step.wait_for()
            assert float(step.get_attribute("data-value")) == before.step_s
            page.wait_for_function("() => typeof Bokeh !== 'undefined' && "
                                   "[...Bokeh.index.all_views()].some(v => v.model && "
                                   "v.model.name === 'pe-graph-plot')")
            page.wait_for_timeout(500)
            page.screenshot(path=str(OUT / "explorer-opened.png"), full_page=True)

            xy = page.evaluate(ITEM_XY, item.key)
            assert xy, "the 'blocks' node is not drawn"
            page.mouse.click(*xy)
            page.locator(".pe-selection", has_text="56 ops").wait_for()
            page.locator(".pe-target select").select_option(cl.ids[1])
            page.locator("button.pe-assign").click()
            page.wait_for_function(
                "(v) => { const e = document.querySelector('.pe-estimate .pe-step');"
                " return e && e.dataset.value !== v; }", arg=repr(before.step_s))
            page.wait_for_timeout(500)
            page.screenshot(path=str(OUT / "explorer-after-assign.png"), full_page=True)

            assert float(step.get_attribute("data-value")) == after.step_s
            for d in cl.ids:
                shown = page.locator(f".pe-estimate .pe-mem[data-device='{d}']")
                assert int(shown.get_attribute("data-value")) == after.peak_bytes[d]
            cross = page.locator(".pe-estimate .pe-cross")
            assert int(cross.get_attribute("data-value")) == after.cross_device_bytes > 0
            assert page.locator(".pe-message-top").inner_text().strip() == ""

            # the selected module opens into its parts, drawn where the engine's view puts them
            view.expand([item.key])
            part = next(it for it in view.items if it.label == "blocks.1")
            page.locator("button.pe-expand").click()
            page.wait_for_function(f"() => ({ITEM_XY})({part.key!r}) !== null")
            page.wait_for_timeout(500)
            page.screenshot(path=str(OUT / "explorer-expanded.png"), full_page=True)
            page.locator(".pe-explorer").screenshot(path=str(OUT / "explorer-widget.png"))

            # a request that cannot be met shows a message in the widget; the kernel stays alive
            page.locator("button.pe-expand").click()  # nothing is selected after expanding
            page.locator(".pe-message-side", has_text="select a module").wait_for()
            page.locator("button.pe-undo").click()
            page.wait_for_function(
                "(v) => document.querySelector('.pe-estimate .pe-step').dataset.value === v",
                arg=repr(before.step_s))
            page.wait_for_function(KERNEL_IDLE)

            # box-select the two embeddings with Bokeh's box select tool
            tok = next(it for it in view.items if it.label.startswith("tok_emb"))
            pos = next(it for it in view.items if it.label.startswith("pos_emb"))
            page.locator(".pe-graph [title='Box Select']").first.click()
            (x0, y0), (x1, y1) = (page.evaluate(ITEM_XY, k) for k in (tok.key, pos.key))
            page.mouse.move(min(x0, x1) - 60, min(y0, y1) - 15)
            page.mouse.down()
            page.mouse.move(max(x0, x1) + 60, max(y0, y1) + 15, steps=8)
            page.mouse.up()
            page.locator(".pe-selection", has_text="selected 2 item(s)").wait_for()
            page.wait_for_function(KERNEL_IDLE)
        finally:
            browser.close()


#: elements of the explorer that stick out on the right of it, and checkbox labels cut short
CUT_OFF = """() => {
  const root = document.querySelector('.pe-explorer');
  const right = root.getBoundingClientRect().right;
  const out = [];
  for (const el of root.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.height > 0 && r.right > right + 1)
      out.push((el.className || el.tagName) + ' ends at ' + r.right + ' > ' + right);
  }
  for (const el of root.querySelectorAll('.widget-checkbox label, .widget-checkbox span'))
    if (el.scrollWidth > el.clientWidth + 1) out.push('cut label: ' + el.textContent);
  return out;
}"""


def test_reloaded_page_narrow_window_find_and_messages_next_to_controls(lab):
    """After a browser reload (the kernel still running) a new explorer draws (BokehJS comes
    with it); in a 1,000 px window with the file browser open nothing is cut off; the find
    box finds "attention" and says so next to it; run errors show under the run button."""
    from playwright.sync_api import sync_playwright

    url, _root = lab
    OUT.mkdir(parents=True, exist_ok=True)
    graph_drawn = ("() => typeof Bokeh !== 'undefined' && [...Bokeh.index.all_views()].some("
                   "v => v.model && v.model.name === 'pe-graph-plot')")
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            open_and_run(page, url)  # the kernel may have drawn explorers in earlier pages
            page.wait_for_function(graph_drawn)
            page.reload()
            open_and_run(page, url)
            page.locator(".pe-estimate .pe-step").wait_for()
            page.wait_for_function(graph_drawn)
            page.wait_for_function(KERNEL_IDLE)
            assert page.get_by_text("Click to show javascript error").count() == 0
            assert not [e for e in errors if "require" in e], errors

            page.evaluate("window.jupyterapp.shell.activateById('filebrowser')")
            page.wait_for_timeout(800)
            page.get_by_role("tab", name="plan settings").click()  # memory settings per stage
            page.locator(".pe-stage-settings").wait_for()
            assert page.evaluate(CUT_OFF) == []
            page.locator(".pe-explorer").screenshot(path=str(OUT / "explorer-settings.png"))
            page.get_by_role("tab", name="run for real").click()
            page.wait_for_timeout(500)
            page.screenshot(path=str(OUT / "explorer-1000px-sidebar.png"), full_page=True)
            assert page.evaluate(CUT_OFF) == []

            find = page.locator(".pe-find input")
            find.fill("attention")
            find.press("Enter")
            page.locator(".pe-message-side", has_text="found 2 match(es)").wait_for()
            assert page.locator(".pe-message-top").inner_text().strip() == ""
            page.locator("button.pe-run").click()  # H100s this machine does not have
            page.locator(".pe-message-run").filter(has_text=" ").wait_for()
            assert "UnboundLocalError" not in page.locator(".pe-message-run").inner_text()
            page.wait_for_function(KERNEL_IDLE)
            page.locator(".pe-explorer").screenshot(path=str(OUT / "explorer-narrow.png"))
        finally:
            browser.close()


def test_a_660_op_model_opens_expands_all_and_an_assignment_recolours_it(lab):
    """Ten copies of the tiny GPT (660 ops) on four H100s: the explorer opens with its
    automatic plan, every op is drawn after "expand all", and moving a module to another
    device recolours it in the page. explorer-large-all.png is the README's screenshot
(docs/explorer.png)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    import explorer as ex
    from explorer.models.synthetic import replicated, roofline_costs
    from widgets import Session
    from widgets.graphview import GraphView

    url, _root = lab
    bm = ex.builtin_model("gpt", "tiny")
    g = replicated(ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                              name="gpt"), 1000)
    cl = ex.Cluster.preset("4xH100")
    expected = Session.open(g, roofline_costs(g, cl))
    assert len(g.ops) > 500 and len(expected.plan.stages) > 1
    module = "copy0.blocks.1.mlp"
    target = next(d for d in cl.ids
                  if d != expected.device_label(expected.view.names(expected.select([module]))[0]))
    expected.assign(expected.selected_names, target)
    every_op = GraphView(g)  # what the page shows after "expand all"
    every_op.expand_all()

    OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1500})
            open_and_run(page, url, "explorer_large.ipynb")
            page.locator(".pe-estimate .pe-step").wait_for()
            page.wait_for_function("() => typeof Bokeh !== 'undefined' && "
                                   "[...Bokeh.index.all_views()].some(v => v.model && "
                                   "v.model.name === 'pe-graph-plot')")
            page.locator(".pe-message-top", has_text="opened with the").wait_for()
            page.locator("button.pe-expand-all").click()
            page.wait_for_function(f"() => (({ITEM_COLUMN})('key') || []).length === "
                                   f"{len(g.ops)}")
            page.wait_for_function(KERNEL_IDLE)
            frame_labels = """() => {
              const v = [...Bokeh.index.all_views()].find(
                v => v.model && v.model.name === 'pe-graph-plot');
              const src = v && v.model.renderers.map(r => r.data_source).find(
                s => s && s.data.label && s.data.left);
              return src ? [...src.data.label].filter(t => t) : [];
            }"""
            with contextlib.suppress(PlaywrightTimeout):  # (the frames' source comes last)
                page.wait_for_function(f"() => new Set(({frame_labels})().filter(t => "
                                       "/^copy[0-9]$/.test(t))).size === 10", timeout=30_000)
            frames = page.evaluate(frame_labels)
            assert {f"copy{c}" for c in range(10)} <= set(frames)
            page.wait_for_timeout(500)
            page.locator(".pe-explorer").screenshot(path=str(OUT / "explorer-large-all.png"))

            find = page.locator(".pe-find input")
            find.fill(module)
            find.press("Enter")
            page.locator(".pe-message-side", has_text="found 1 match").wait_for()
            page.locator(".pe-selection", has_text="3 ops").wait_for()
            page.locator("button.pe-zoom").click()
            page.locator(".pe-target select").select_option(target)
            page.locator("button.pe-assign").click()
            page.wait_for_function(
                "(v) => { const e = document.querySelector('.pe-estimate .pe-step');"
                " return e && e.dataset.value === v; }", arg=repr(expected.prediction.step_s))
            keys = page.evaluate(ITEM_COLUMN, "key")
            devices = page.evaluate(ITEM_COLUMN, "device")
            moved = [devices[keys.index(it.key)] for it in every_op.items
                     if g.nodes[it.ops[0]].module_path.startswith(module)]
            assert len(moved) == 3 and set(moved) == {target}
            page.wait_for_timeout(500)
            page.locator(".pe-graph").screenshot(path=str(OUT / "explorer-large-zoomed.png"))
            page.wait_for_function(KERNEL_IDLE)
            page.locator("button.pe-expand-to").click()  # depth 2: the copies' blocks
            page.wait_for_function(f"() => (({ITEM_COLUMN})('key') || []).length < 200")
            page.wait_for_timeout(800)
            page.locator(".pe-explorer").screenshot(path=str(OUT / "explorer-large-depth2.png"))
        finally:
            browser.close()


#: the graph's view (its ranges), the overview's box and the items labelled (always, where
#: labels fit, and on zoom), as BokehJS has them
NAVIGATION = """() => {
  const find = (name) => [...Bokeh.index.all_views()].find(v => v.model && v.model.name === name);
  const main = find('pe-graph-plot'), over = find('pe-overview');
  if (!main || !over) return null;
  const xr = main.model.x_range, yr = main.model.y_range;
  const box = over.model.toolbar.tools.find(t => t.overlay).overlay;
  const labels = main.model.renderers.find(r => r.name === 'pe-zoom-labels');
  const always = main.model.renderers.find(r => r.name === 'pe-labels');
  return {view: [xr.start, xr.end, yr.start, yr.end],
          box: [box.left, box.right, box.bottom, box.top],
          labelled: [...labels.view.filter.indices], visible: over.model.visible,
          always: [...always.view.filter.indices],
          width: main.model.inner_width};
}"""


def labels_fit(view, width_px) -> bool:
    """Whether neighbouring items are LABEL_PX apart on screen in ``view``."""
    from widgets.layout import GAP, ITEM_W
    from widgets.panels.overview import LABEL_PX

    return (ITEM_W + GAP) * width_px / (view[1] - view[0]) >= LABEL_PX


def labels_always(short, view, width_px) -> list[int]:
    """The items the graph labels in ``view`` whatever is in it: the largest 150 (a short
    label), when neighbouring labels fit; none when they would run into each other."""
    return [k for k, t in enumerate(short) if t] if labels_fit(view, width_px) else []


def labels_on_zoom(xs, ys, short, view, width_px) -> list[int]:
    """The items the graph should label on zoom: those in ``view`` without a label, when at
    most 150 are in view and neighbouring labels fit (LABEL_PX apart)."""
    from widgets.panels.graph import MAX_LABELS

    x0, x1, y0, y1 = view
    if not labels_fit(view, width_px):
        return []
    inside = [k for k, (x, y) in enumerate(zip(xs, ys, strict=True))
              if x0 <= x <= x1 and y0 <= y <= y1]
    return [k for k in inside if not short[k]] if len(inside) <= MAX_LABELS else []

#: whether the overview's box is where the graph's view is
BOX_IS_VIEW = f"""() => {{
  const n = ({NAVIGATION})();
  return n !== null && n.box.every((b, k) => Math.abs(b - n.view[k]) < 1e-6);
}}"""

#: set the graph's view, as a wheel zoom or a pan does
SET_VIEW = """([x0, x1, y0, y1]) => {
  const v = [...Bokeh.index.all_views()].find(v => v.model && v.model.name === 'pe-graph-plot');
  v.model.x_range.setv({start: x0, end: x1});
  v.model.y_range.setv({start: y0, end: y1});
}"""


def test_the_overview_box_follows_the_view_and_labels_appear_on_zoom(lab):
    """On the 660-op model with every op shown: the overview's box is the graph's view
    after "zoom to selection" and after a zoom in the page; a click on the overview moves the
    view there; zoomed in on a few items every one of them is labelled, further out only the
    largest 150 are, and zoomed out (items too close for their labels) none."""
    from playwright.sync_api import sync_playwright

    url, _root = lab
    OUT.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []

    def near(a, b):
        return all(abs(p - q) < 1e-6 for p, q in zip(a, b, strict=True))

    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1500})
            page.on("pageerror", lambda e: errors.append(str(e)))
            open_and_run(page, url, "explorer_large.ipynb")
            page.wait_for_function(f"() => ({NAVIGATION})() !== null")
            page.wait_for_function(KERNEL_IDLE)
            page.locator("button.pe-expand-all").click()
            page.wait_for_function(f"() => (({ITEM_COLUMN})('key') || []).length > 600")
            page.wait_for_function(KERNEL_IDLE)
            # shown from 40 items on; the box follows the view in the next frame drawn
            page.wait_for_function(f"() => ({BOX_IS_VIEW})() && ({NAVIGATION})().visible")
            nav = page.evaluate(NAVIGATION)
            assert not errors, errors
            assert nav["labelled"] == []  # the fitted view holds more than 150 items
            short = page.evaluate(ITEM_COLUMN, "short")
            assert sum(1 for t in short if t) == 150
            assert nav["always"] == labels_always(short, nav["view"], nav["width"])

            find = page.locator(".pe-find input")
            find.fill("copy3.blocks.1.mlp")
            find.press("Enter")
            page.locator(".pe-selection", has_text="3 ops").wait_for()
            page.locator("button.pe-zoom").click()
            page.wait_for_function(f"() => ({NAVIGATION})().labelled.length > 0")
            page.wait_for_function(BOX_IS_VIEW)
            nav = page.evaluate(NAVIGATION)
            xs, ys, short = (page.evaluate(ITEM_COLUMN, c) for c in ("x", "y", "short"))
            assert nav["labelled"] == labels_on_zoom(xs, ys, short, nav["view"], nav["width"])
            assert len(nav["always"]) == 150
            page.wait_for_timeout(500)
            page.locator(".pe-graph").screenshot(path=str(OUT / "explorer-zoom-labels.png"))

            # a zoom in the page (no kernel involved): the box and the labels follow
            cx, cy = (xs[0] + xs[-1]) / 2, (ys[0] + ys[-1]) / 2
            view = [cx - 3, cx + 3, cy - 3, cy + 3]
            page.evaluate(SET_VIEW, view)
            page.wait_for_function(BOX_IS_VIEW)
            nav = page.evaluate(NAVIGATION)
            assert near(nav["view"], view)
            expected = labels_on_zoom(xs, ys, short, view, nav["width"])
            assert expected and nav["labelled"] == expected
            assert len(nav["always"]) == 150
            page.evaluate(SET_VIEW, [cx - 30, cx + 30, cy - 3, cy + 3])  # labels would overlap
            nav = page.evaluate(NAVIGATION)
            assert nav["labelled"] == [] and nav["always"] == []
            page.evaluate(SET_VIEW, [min(xs) - 1, max(xs) + 1, min(ys) - 1, max(ys) + 1])
            nav = page.evaluate(NAVIGATION)
            assert nav["labelled"] == [] and nav["always"] == []  # all 660 in view

            # a click on the overview centres the view on the point clicked
            page.evaluate(SET_VIEW, view)
            k = len(xs) * 2 // 3  # an item far from the view
            target = page.evaluate("""([x, y]) => {
              const v = [...Bokeh.index.all_views()].find(
                v => v.model && v.model.name === 'pe-overview');
              v.el.scrollIntoView({block: 'center'});
              const box = v.canvas_view.el.getBoundingClientRect();
              return [box.left + v.frame.x_scale.compute(x),
                      box.top + v.frame.y_scale.compute(y), x, y];
            }""", [xs[k], ys[k]])
            page.mouse.click(target[0], target[1])
            page.wait_for_function(
                f"(x) => {{ const n = ({NAVIGATION})(); "
                "return Math.abs((n.view[0] + n.view[1]) / 2 - x) < 0.5; }", arg=target[2])
            nav = page.evaluate(NAVIGATION)
            assert abs((nav["view"][2] + nav["view"][3]) / 2 - target[3]) < 0.5
            assert abs(nav["view"][1] - nav["view"][0] - 6) < 1e-6  # the zoom stays
            page.wait_for_function(BOX_IS_VIEW)
            assert not errors, errors
            page.wait_for_timeout(500)
            page.locator(".pe-graph").screenshot(path=str(OUT / "explorer-overview.png"))
        finally:
            browser.close()
