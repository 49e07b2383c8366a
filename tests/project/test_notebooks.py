"""The notebooks are committed clean (no outputs) and the labs keep their shape.

Running them is pytest's job too: ``--nbmake`` in pyproject's addopts collects notebooks/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ALL = sorted(NOTEBOOKS.glob("*.ipynb"))
LABS = [p for p in ALL if p.name.startswith("lab")]


def test_the_quickstart_and_four_labs_are_there():
    names = {p.name for p in ALL}
    assert "quickstart.ipynb" in names
    assert len(LABS) >= 4, f"expected four labs, found {sorted(p.name for p in LABS)}"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_notebook_is_valid_and_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [k for k, c in enumerate(nb.cells) if c.cell_type == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} have outputs; clear them before committing "
                       "(jupyter nbconvert --clear-output --inplace)")
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_lab_asks_first_and_explains_after(path):
    nb = nbformat.read(path, as_version=4)
    heads = [c.source.splitlines()[0].lstrip("# ").strip() for c in nb.cells
             if c.cell_type == "markdown" and c.source.startswith("#")]
    for want in ("Question", "Your prediction", "Explanation"):
        assert want in heads, f"{path.name} has no '## {want}' section"
    assert heads.index("Question") < heads.index("Your prediction") < heads.index("Explanation")
