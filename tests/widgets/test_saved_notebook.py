"""A notebook with several explorers, run headless and saved, carries BokehJS once."""

from __future__ import annotations

import pytest

pytest.importorskip("jupyter_bokeh")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

from widgets.panels.base import bokehjs_bundle  # noqa: E402

SETUP = """\
import explorer as ex
from explorer.models.synthetic import roofline_costs
from widgets import Explorer
bm = ex.builtin_model("gpt", "tiny")
g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
cl = ex.Cluster.preset("2xH100")
costs = roofline_costs(g, cl)"""

SHOW = "Explorer(g, costs, ex.Plan.single(g, cl.ids[0]), measure='never')"

#: what only the BokehJS loader holds (see widgets.panels.base.bokehjs_bundle)
MARKER = "typeof window.Bokeh === 'undefined'"


def run_notebook(displays: int, tmp_path) -> tuple[int, int]:
    """Run a notebook showing ``displays`` explorers (a cell each) in one kernel, save it and
    give its size in bytes and how many copies of BokehJS its outputs hold."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP)]
    nb.cells += [nbformat.v4.new_code_cell(SHOW) for _ in range(displays)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / f"explorers-{displays}.ipynb"
    nbformat.write(nb, path)
    copies = sum(str(value).count(MARKER) for cell in nb.cells
                 for output in cell.get("outputs", []) for value in output.get("data", {}).values())
    return path.stat().st_size, copies


@pytest.mark.slow
def test_bokehjs_is_saved_once_however_many_explorers_are_shown(tmp_path):
    one_size, one_copies = run_notebook(1, tmp_path)
    three_size, three_copies = run_notebook(3, tmp_path)
    assert one_copies == 1 and three_copies == 1
    # each more explorer adds its own widgets' state (the graph's data), not another BokehJS
    bokehjs = len(bokehjs_bundle()["application/javascript"])
    assert three_size - one_size < bokehjs / 2, (one_size, three_size, bokehjs)
