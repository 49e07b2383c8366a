"""The widget's load-then-export: a plan file's model factory is imported only once the user
types it in the export's factory box."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import replace

import pytest

import explorer as ex
from explorer.core.factory import FactoryError
from explorer.models.synthetic import roofline_costs
from widgets import Session

FACTORIES = os.path.join(os.path.dirname(__file__), "..", "runtime")  # factory_models.py

HOSTILE = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def build():
    pathlib.Path({marker!r}).write_text("called")
'''


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


@pytest.fixture
def evil(gpt, tmp_path, monkeypatch):
    """A plan file for ``gpt`` naming a factory in the current folder that writes a marker
    when imported or called; the file, the factory and the marker."""
    name = f"hostile_{uuid.uuid4().hex[:12]}"
    marker = tmp_path / "PWNED"
    (tmp_path / f"{name}.py").write_text(HOSTILE.format(marker=str(marker)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(FACTORIES)
    factory = f"{name}:build"
    path = replace(ex.Plan.single(gpt, "cpu:0"), model={"factory": factory}).save(
        tmp_path / "evil.json")
    yield path, factory, marker
    sys.modules.pop(name, None)


def test_session_load_then_export_asks_for_the_factory(gpt, evil, tmp_path):
    path, factory, marker = evil
    cl = ex.Cluster.cpu(2, measure=False)
    session = Session(gpt, cl, roofline_costs(gpt, cl))
    session.load(path)
    with pytest.raises(FactoryError, match=f"plan asks for model factory '{factory}'"):
        session.export(tmp_path / "t.py")
    assert not marker.exists() and not (tmp_path / "t.py").exists()
    script = session.export(tmp_path / "t.py", factory="factory_models:tiny_gpt")
    assert ex.Plan.load(tmp_path / "t_job" / "plan.json").model == {
        "factory": "factory_models:tiny_gpt"}
    assert script.exists() and not marker.exists()


def test_the_panel_names_the_factory_and_exports_once_the_user_types_it(gpt, evil, tmp_path):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer

    path, factory, marker = evil
    cl = ex.Cluster.cpu(2, measure=False)
    w = Explorer(gpt, roofline_costs(gpt, cl), ex.Plan.single(gpt, "cpu:0"))
    w.plans.path.value = str(path)
    w.plans.load_file_button.click()
    assert factory in w.message and "factory box" in w.message
    w.plans.script_path.value = str(tmp_path / "t.py")
    w.plans.export_button.click()
    assert f"plan asks for model factory '{factory}'" in w.message
    assert "Traceback" not in w.message
    assert not marker.exists() and not (tmp_path / "t.py").exists()
    w.plans.factory.value = "factory_models:tiny_gpt"
    w.plans.export_button.click()
    assert (tmp_path / "t.py").exists(), w.message
    assert not marker.exists()
