"""Tensor-parallel splits in a real JupyterLab and a real Chromium: the tiny GPT on two H100s,
data-parallel, split two ways from the plan settings tab; the page shows the split marks, the
hover says how each node is split over which devices, the stage table says "1 x 2" and the
estimate is the engine's for the split plan. What the page shows is compared with the same
explorer built and split in the test's own process.

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

NOTEBOOK = "explorer_tensor.ipynb"
#: the tiny GPT on two H100s, one stage over both (data-parallel, 2 replicas x tensor 1)
SETUP = """\
import explorer as ex
from explorer.models.synthetic import roofline_costs
from widgets import Explorer
bm = ex.builtin_model("gpt", "tiny")
g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
cl = ex.Cluster.preset("2xH100")
plan = ex.Plan.from_assignment(g, [cl.ids], {i: 0 for i in range(len(g))})
w = Explorer(g, roofline_costs(g, cl), plan, height=420)
w"""

#: the graph's hover text as the page shows it (the outermost tooltip element shown; Bokeh
#: draws it in the plot's shadow DOM)
TOOLTIP = """() => {
  const out = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) walk(el.shadowRoot);
      const cls = typeof el.className === 'string' ? el.className : '';
      if (/bk-tooltip/i.test(cls) && el.offsetParent !== null && el.textContent.trim())
        out.push(el.textContent);
    }
  };
  walk(document);
  return out.length ? out[0] : '';
}"""

#: the texts the graph's labels draw (the items the labels renderer shows, its text column)
LABELS_DRAWN = """() => {
  const v = [...Bokeh.index.all_views()].find(v => v.model && v.model.name === 'pe-graph-plot');
  const r = v.model.renderers.find(r => r.name === 'pe-labels');
  const text = r.data_source.data[r.glyph.text.field];
  return [...r.view.filter.indices].map(i => text[i]);
}"""

STEP_IS = ("(v) => { const e = document.querySelector('.pe-estimate .pe-step');"
           " return e !== null && e.dataset.value === v; }")


def columns(w) -> dict[str, list]:
    """The graph's columns that show splits, as the explorer ``w`` has them."""
    return {c: list(w.graph.nodes.data[c]) for c in ("key", "hatch", "short", "split")}


def page_columns(page) -> dict[str, list]:
    """The same columns as BokehJS has them in the page."""
    return {c: page.evaluate(tb.ITEM_COLUMN, c) for c in ("key", "hatch", "short", "split")}


def hover_text(page, key: str) -> str:
    """The hover text of the graph's item ``key``, by moving the mouse over it (rows as
    "label: value", whitespace collapsed)."""
    page.mouse.move(5, 5)  # off the graph: no hover text left from an earlier item
    page.wait_for_function(f"() => ({TOOLTIP})() === ''")
    xy = page.evaluate(tb.ITEM_XY, key)
    assert xy, f"{key} is not drawn"
    page.mouse.move(*xy, steps=4)
    page.wait_for_function(f"() => ({TOOLTIP})().length > 0")
    return " ".join(page.evaluate(TOOLTIP).split())


def test_a_split_stage_shows_its_marks_hover_degrees_and_estimate(lab):
    from playwright.sync_api import sync_playwright

    from widgets import Explorer

    url, root = lab
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, root / NOTEBOOK)

    # what the explorer shows before and after the split, computed here in the test's process
    scope: dict = {}
    exec(SETUP.rsplit("\n", 1)[0], scope)
    w, cl = scope["w"], scope["cl"]
    assert isinstance(w, Explorer)
    before, shown_before = w.session.prediction, columns(w)
    w.stages.tensor.value = 2  # all stages, as the page does
    plan, after, shown_split = w.session.plan, w.session.prediction, columns(w)
    assert (plan.replicas_of(0), plan.tensor_of(0)) == (1, 2)
    assert after.step_s != before.step_s
    w.session.expand_all()
    shown_all = columns(w)
    blocks = next(k for k, s in zip(shown_split["key"], shown_split["short"], strict=True)
                  if s.startswith("blocks"))
    fc = next(k for k, t in zip(shown_all["key"], shown_all["split"], strict=True)
              if t.startswith("column-parallel") and t.endswith("Shard(0)"))  # (not the qkv)
    over = "+".join(cl.ids)

    tb.OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = tb.launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            tb.open_and_run(page, url, NOTEBOOK)
            page.locator(".pe-estimate .pe-step").wait_for()
            page.wait_for_function(f"() => typeof Bokeh !== 'undefined' && "
                                   f"({tb.ITEM_COLUMN})('key') !== null")
            page.wait_for_function(tb.KERNEL_IDLE)
            assert float(page.locator(".pe-estimate .pe-step")
                         .get_attribute("data-value")) == before.step_s
            drawn = page_columns(page)
            assert drawn == shown_before
            assert set(drawn["hatch"]) == {"/"} and set(drawn["split"]) == {"none"}

            page.get_by_role("tab", name="plan settings").click()
            table = page.locator(".pe-stage-settings")
            table.wait_for()
            assert "2 x 1" in table.inner_text()
            page.locator(".pe-tensor select").select_option("2")
            page.wait_for_function(STEP_IS, arg=repr(after.step_s))
            page.wait_for_function(tb.KERNEL_IDLE)

            # the stage table and the estimate are the split plan's
            text = table.inner_text()
            assert "1 x 2" in text and "dp 1 x tp 2 x pp 1" in text
            for d in cl.ids:
                mem = page.locator(f".pe-estimate .pe-mem[data-device='{d}']")
                assert int(mem.get_attribute("data-value")) == after.peak_bytes[d]
            assert page.locator(".pe-message-top").inner_text().strip() == ""

            # the graph: upright stripes and a mark after the name on the split nodes
            page.wait_for_function(f"() => ({tb.ITEM_COLUMN})('hatch').includes('|')")
            drawn = page_columns(page)
            assert drawn == shown_split
            k = drawn["key"].index(blocks)
            assert drawn["hatch"][k] == "|" and drawn["short"][k] == "blocks [tp2]"
            assert any(s.endswith("[vocab]") for s in drawn["short"])
            assert any(s.endswith("[rep]") for s in drawn["short"])
            labels = page.evaluate(LABELS_DRAWN)
            assert {"blocks [tp2]", "tok_emb [vocab]"} <= set(labels), labels
            page.wait_for_timeout(500)
            page.locator(".pe-explorer").screenshot(path=str(tb.OUT / "explorer-tensor-split.png"))

            # the hover says what the devices do with the node, and over which devices
            tip = hover_text(page, blocks)
            assert f"split: {shown_split['split'][k]}" in tip, tip
            assert f"4 column-parallel, 10 replicated, 4 row-parallel, 38 split over {over}" \
                in tip

            # every op: the linears say col / row, the hover names the devices and the weight
            page.locator("button.pe-expand-all").click()
            page.wait_for_function(f"() => (({tb.ITEM_COLUMN})('key') || []).length === "
                                   f"{len(shown_all['key'])}")
            page.wait_for_function(tb.KERNEL_IDLE)
            drawn = page_columns(page)
            assert drawn == shown_all
            assert any(s.endswith("[col]") for s in drawn["short"])
            assert any(s.endswith("[row]") for s in drawn["short"])
            tip = hover_text(page, fc)
            assert f"split: column-parallel over {over}, weight Shard(0)" in tip, tip
            assert f"device: {over}" in tip
            page.wait_for_timeout(300)
            page.locator(".pe-graph").screenshot(path=str(tb.OUT / "explorer-tensor-ops.png"))
            assert not errors, errors
        finally:
            browser.close()

