"""Finding zoom in a 1,280 px window, in a real JupyterLab and a real Chromium: the wheel over
the graph zooms the graph and leaves the notebook where it is; the graph's and the memory
chart's zoom, reset and hover buttons are in their toolbars (not behind bokeh's overflow
menu), with the overview shown; the memory chart's title and legend fit inside it.

Uses the JupyterLab server and the helpers of ``test_browser.py`` (Debian's Chromium through
``executable_path``, never a downloaded browser; skipped like those tests without one).
"""

from __future__ import annotations

import pytest
import test_browser as tb

pytestmark = [pytest.mark.browser, pytest.mark.slow]

#: the JupyterLab server (with its notebooks) of the browser tests
lab = tb.lab

#: the BokehJS view of the plot named ``name`` (in a function body, as ``find``)
FIND = """const find = (name) => [...Bokeh.index.all_views()].find(
  v => v.model && v.model.name === name);"""

#: the tools whose buttons show in the toolbar of the plot named ``name`` (inside the
#: toolbar's box, not moved to the overflow menu)
TOOLS_SHOWN = f"""(name) => {{
  {FIND}
  const v = find(name);
  if (!v || !v.toolbar_panel) return null;
  const tv = v.toolbar_panel.toolbar_view;
  const bar = tv.el.getBoundingClientRect();
  const shown = [];
  for (const b of tv.tool_button_views) {{
    const tool = b.model.tool.tools ? b.model.tool.tools[0] : b.model.tool;
    const r = b.el.getBoundingClientRect();
    if (tv.shadow_el.contains(b.el) && r.width > 0 && r.left >= bar.left - 1
        && r.right <= bar.right + 1)
      shown.push(tool.constructor.__name__);
  }}
  return shown;
}}"""

#: the graph's x range and the scroll positions of the page and of every element around the
#: graph (the notebook scrolls inside JupyterLab's panels)
GRAPH_AND_SCROLL = f"""() => {{
  {FIND}
  const v = find('pe-graph-plot');
  const scroll = [window.scrollY];
  for (let el = v.el; el; ) {{
    scroll.push(el.scrollTop || 0);
    el = el.parentNode;
    if (el instanceof ShadowRoot) el = el.host;
  }}
  return {{x: [v.model.x_range.start, v.model.x_range.end], scroll}};
}}"""

#: the graph's canvas centre on screen, once the graph is in the middle of the window
GRAPH_CENTRE = f"""() => {{
  {FIND}
  const v = find('pe-graph-plot');
  v.el.scrollIntoView({{block: 'center'}});
  const r = v.canvas_view.el.getBoundingClientRect();
  return [r.left + r.width / 2, r.top + r.height / 2];
}}"""

#: the parts of the memory chart's titles and legend that are outside its canvas, in pixels
MEMORY_CLIPPED = f"""() => {{
  {FIND}
  const v = find('pe-memory-plot');
  if (!v) return null;
  const width = v.bbox.width, out = [];
  for (const m of [...v.model.above, ...v.model.below, v.model.title]) {{
    const a = m && v.views.find_one(m);
    if (!a) continue;
    const kind = m.constructor.__name__;
    if (kind === 'Title' && m.text) {{
      const left = a._get_position().sx, right = left + a._get_size().width;
      if (left < 0 || right > width)
        out.push(`title '${{m.text}}': ${{left}}..${{right}} of ${{width}}`);
    }} else if (kind === 'Legend') {{
      const b = a.bbox;
      if (b.left < 0 || b.right > width)
        out.push(`legend: ${{b.left}}..${{b.right}} of ${{width}}`);
    }}
  }}
  return out;
}}"""


def test_the_wheel_zooms_the_graph_and_zoom_reset_and_hover_show_at_1280_px(lab):
    """On the 660-op model with every op shown (so the overview takes its room beside the
    graph), in a 1,280 x 800 window."""
    from playwright.sync_api import sync_playwright

    url, _root = lab
    tb.OUT.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = tb.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("pageerror", lambda e: errors.append(str(e)))
            tb.open_and_run(page, url, "explorer_large.ipynb")
            page.wait_for_function(f"() => ({tb.NAVIGATION})() !== null")
            page.wait_for_function(tb.KERNEL_IDLE)
            page.locator("button.pe-expand-all").click()
            page.wait_for_function(f"() => (({tb.ITEM_COLUMN})('key') || []).length > 600")
            page.wait_for_function(tb.KERNEL_IDLE)
            page.wait_for_function(f"() => ({tb.NAVIGATION})().visible")  # the overview
            page.wait_for_timeout(500)  # (the toolbars lay out after the plots resize)

            for name in ("pe-graph-plot", "pe-memory-plot"):
                shown = page.evaluate(TOOLS_SHOWN, name)
                assert shown is not None, f"{name} has no toolbar"
                for tool in ("WheelZoomTool", "ResetTool", "HoverTool"):
                    assert tool in shown, (name, shown)
            clipped = page.evaluate(MEMORY_CLIPPED)
            assert clipped == [], clipped

            centre = page.evaluate(GRAPH_CENTRE)
            page.wait_for_timeout(300)
            before = page.evaluate(GRAPH_AND_SCROLL)
            assert max(before["scroll"]) > 100  # the notebook could scroll up
            page.mouse.move(*centre)
            page.mouse.wheel(0, -240)
            page.wait_for_timeout(500)
            after = page.evaluate(GRAPH_AND_SCROLL)
            assert after["scroll"] == before["scroll"]
            assert after["x"][1] - after["x"][0] < before["x"][1] - before["x"][0]  # zoomed in
            page.locator(".pe-graph").screenshot(path=str(tb.OUT / "explorer-wheel-zoom.png"))
            page.locator(".pe-memory").screenshot(path=str(tb.OUT / "explorer-memory-1280.png"))
            assert not errors, errors
        finally:
            browser.close()
