"""Two explorers in one notebook, in a real JupyterLab and a real Chromium: BokehJS comes with
the first only and the second draws its graph too; a long error message with a trace wraps
inside its box in a 1,280 px window.

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

NOTEBOOK = "explorer_twice.ipynb"
CELLS = (tb.SETUP,
         "w2 = Explorer(g, roofline_costs(g, cl), ex.Plan.single(g, cl.ids[0]), height=420)\nw2",
         # a message as long as a path in a notebook can make it, with a folded trace
         "w2.session.say('cannot write /' + 'a_long_directory_name/' * 12 + 'plan.json: '"
         " + 'the disk said no ' * 20, error=True, detail='Traceback (most recent call last):"
         "\\n  File \"/' + 'site-packages/' * 20 + 'x.py\", line 1\\nOSError: ' + 'no' * 120)")

#: how many graphs BokehJS drew
GRAPHS = """() => typeof Bokeh === 'undefined' ? 0 : [...Bokeh.index.all_views()].filter(
  v => v.model && v.model.name === 'pe-graph-plot' && v.canvas_view.el.offsetWidth > 0).length"""

#: the outputs of the notebook that load BokehJS (see widgets.panels.base.bokehjs_bundle)
LOADERS = """() => {
  const m = window.jupyterapp.shell.currentWidget.content.model;
  let n = 0;
  for (let i = 0; i < m.cells.length; i++) {
    const c = m.cells.get(i);
    if (c.type !== 'code') continue;
    for (const o of c.outputs.toJSON()) {
      const js = [].concat((o.data || {})['application/javascript'] || []).join('');
      if (js.startsWith("if (typeof window.Bokeh === 'undefined'")) n++;
    }
  }
  return n;
}"""


#: parts of the message lines that end right of their explorer or scroll inside their box
MESSAGE_OUT = """() => {
  const out = [];
  for (const root of document.querySelectorAll('.pe-explorer')) {
    const right = root.getBoundingClientRect().right;
    for (const el of root.querySelectorAll('.pe-message, .pe-message *')) {
      const r = el.getBoundingClientRect();
      if (r.width > 0 && r.right > right + 1)
        out.push(el.tagName + ' ends at ' + r.right + ' > ' + right);
      if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX !== 'visible')
        out.push(el.tagName + ' scrolls: ' + el.scrollWidth + ' > ' + el.clientWidth);
    }
  }
  return out;
}"""


def test_a_second_explorer_draws_without_bokehjs_and_long_messages_wrap(lab):
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
            page = browser.new_page(viewport={"width": 1280, "height": 1600})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            tb.open_and_run(page, url, NOTEBOOK)
            page.wait_for_function(f"() => ({GRAPHS})() === 2")
            page.locator(".pe-message-top", has_text="a_long_directory_name").wait_for()
            page.wait_for_function(tb.KERNEL_IDLE)
            assert page.evaluate(LOADERS) == 1  # with the first explorer only
            assert page.get_by_text("Click to show javascript error").count() == 0
            message = page.locator(".pe-message-top", has_text="a_long_directory_name")
            message.locator("summary").click()  # unfold the trace
            page.wait_for_timeout(300)
            message.screenshot(path=str(tb.OUT / "explorer-long-message.png"))
            out = page.evaluate(MESSAGE_OUT)
            assert out == [], out
            # next to the find box, in the side column
            find = page.locator(".pe-find input").nth(1)
            find.fill("no_such_module_" * 12)
            find.press("Enter")
            side = page.locator(".pe-message-side", has_text="no_such_module_")
            side.wait_for()
            side.screenshot(path=str(tb.OUT / "explorer-long-message-side.png"))
            out = page.evaluate(MESSAGE_OUT)
            assert out == [], out
            assert not errors, errors
        finally:
            browser.close()
