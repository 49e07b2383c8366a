"""The explorer at 64 devices in a real JupyterLab and a real Chromium stays one screen: in a
1,400 x 900 window it is under 1,500 px tall (about 1,390 here; the limit leaves room for
fonts that render taller elsewhere; 8,378 px before devices were grouped), its assign
button is beside the graph, the header counts the devices instead of listing them, and a
click on an item and assign from those controls move it.

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

NOTEBOOK = "explorer_64.ipynb"
#: the tiny GPT on 64 H100s, its ops cut into 8 stages of 8 devices each
CELLS = ("""\
import explorer as ex
from explorer.models.synthetic import roofline_costs
from widgets import Explorer
bm = ex.builtin_model("gpt", "tiny")
g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
cl = ex.Cluster.preset("64xH100")
ops = [n.name for n in g.ops]
size = -(-len(ops) // 8)
plan = ex.Plan.from_assignment(g, [cl.ids[8 * k:8 * k + 8] for k in range(8)],
                               {n: j // size for j, n in enumerate(ops)})
w = Explorer(g, roofline_costs(g, cl), plan)
w""",)

#: the explorer's height, and the boxes of its graph and its assign button (left, top, right,
#: bottom)
BOXES = """() => {
  const e = document.querySelector('.pe-explorer');
  const box = (el) => { const r = el.getBoundingClientRect();
                        return [r.left, r.top, r.right, r.bottom]; };
  return {height: e.getBoundingClientRect().height,
          graph: box(e.querySelector('.pe-graph')),
          assign: box(e.querySelector('button.pe-assign'))};
}"""

#: the screen height the explorer must stay within (pixels): one screen, scrolled once at most
ONE_SCREEN_PX = 1500


def test_64_devices_stay_one_screen_with_assign_beside_the_graph(lab):
    from playwright.sync_api import sync_playwright

    url, root = lab
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code) for code in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, root / NOTEBOOK)
    tb.OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = tb.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            tb.open_and_run(page, url, NOTEBOOK)
            step = page.locator(".pe-estimate .pe-step")
            step.wait_for()
            page.wait_for_function(f"() => ({tb.ITEM_COLUMN})('key') !== null")
            page.wait_for_function(tb.KERNEL_IDLE)
            page.wait_for_timeout(1000)  # (the plots lay out after they are drawn)
            page.screenshot(path=str(tb.OUT / "explorer-64-devices.png"), full_page=True)
            boxes = page.evaluate(BOXES)
            assert boxes["height"] < ONE_SCREEN_PX, boxes
            graph, assign = boxes["graph"], boxes["assign"]
            assert assign[0] >= graph[2] - 1, f"assign is not right of the graph: {boxes}"
            assert assign[1] < graph[3], f"assign is below the graph: {boxes}"
            header = page.locator(".pe-explorer").first.inner_text()
            assert "64 devices: H100:0-63" in header and "H100:17," not in header
            assert "stage 0: H100:0-7" in header  # the legend's groups

            # click the first item and assign it from the controls beside the graph to H100:63
            # (taken out of the last stage's replicas, a stage of its own): the estimate and
            # the item's device change
            key = page.evaluate(tb.ITEM_COLUMN, "key")[0]
            before = step.get_attribute("data-value")
            page.mouse.click(*page.evaluate(tb.ITEM_XY, key))
            page.locator(".pe-selection", has_text="selected 1 item").first.wait_for()
            page.wait_for_function(tb.KERNEL_IDLE)
            page.locator(".pe-target select").select_option("H100:63")
            page.locator("button.pe-assign").click()
            page.wait_for_function(
                "(v) => { const e = document.querySelector('.pe-estimate .pe-step');"
                " return e && e.dataset.value !== v; }", arg=before)
            page.wait_for_function(f"(key) => ({tb.ITEM_COLUMN})('device')"
                                   f"[({tb.ITEM_COLUMN})('key').indexOf(key)] === 'H100:63'",
                                   arg=key)
            assert not errors, errors
        finally:
            browser.close()
