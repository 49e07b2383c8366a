"""A model factory that a plan file names is never imported unless the user names it: the
API's export, the command line's export and ``run --plan``; the user's own name wins."""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import replace

import pytest
import torch

import explorer as ex
from explorer.cli.commands import main as cli
from explorer.core.factory import FactoryError
from explorer.platforms.cpu import host as cpu_host

HOSTILE = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def build():
    pathlib.Path({marker!r}).write_text("called")
'''

FACTORIES = os.path.dirname(__file__)  # factory_models.py: factories a user names


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A module in the current folder (and on sys.path) that writes a marker file when it is
    imported or its ``build`` is called: the factory name a plan names, and the marker."""
    name = f"hostile_{uuid.uuid4().hex[:12]}"
    marker = tmp_path / "PWNED"
    (tmp_path / f"{name}.py").write_text(HOSTILE.format(marker=str(marker)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}:build", marker
    sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def isolated(tmp_path_factory, monkeypatch):
    """A profile cache of this test's own, and nominal CPU-rank numbers (no measuring)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setattr(cpu_host, "host_profile", lambda measure: cpu_host.nominal_profile())


@pytest.fixture(scope="module")
def mlp():
    bm = ex.builtin_model("mlp", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=bm.name)


def _plan_file(graph, factory: str, path, **fields):
    plan = replace(ex.Plan.single(graph, "cpu:0"), model={"factory": factory}, **fields)
    return plan.save(path)


class TestTheApi:
    def test_export_of_a_loaded_plan_does_not_import_its_factory(self, hostile, mlp,
                                                                 tmp_path):
        factory, marker = hostile
        plan = ex.Plan.load(_plan_file(mlp, factory, tmp_path / "evil.json"))
        with pytest.raises(FactoryError, match=rf"plan asks for model factory '{factory}'"
                                               rf".*factory='{factory}'"):
            ex.export_script(plan, tmp_path / "t.py", graph=mlp)
        assert not marker.exists()
        assert not (tmp_path / "t.py").exists() and not (tmp_path / "t_job").exists()

    def test_the_users_factory_wins_over_the_plans(self, hostile, tmp_path, monkeypatch):
        monkeypatch.syspath_prepend(FACTORIES)
        import factory_models

        factory, marker = hostile
        x = torch.randn(8, 8)
        graph = ex.capture(factory_models.mlp_module(), (x,), None)
        plan = ex.Plan.load(_plan_file(graph, factory, tmp_path / "evil.json"))
        ex.export_script(plan, tmp_path / "a.py", graph=graph,
                         factory="factory_models:mlp_module")
        saved = ex.Plan.load(tmp_path / "a_job" / "plan.json")
        assert saved.model == {"factory": "factory_models:mlp_module"}
        # named at capture (ex.capture(..., factory=...)) is the user's too
        named = ex.capture(factory_models.mlp_module(), (x,), None,
                           factory="factory_models:mlp_module")
        ex.export_script(plan, tmp_path / "b.py", graph=named)
        assert ex.Plan.load(tmp_path / "b_job" / "plan.json").model == saved.model
        assert not marker.exists()

    def test_a_built_in_model_record_of_an_unknown_name_or_size_is_refused(self, mlp,
                                                                           tmp_path):
        plan = ex.Plan.single(mlp, "cpu:0")
        for record, match in [({"builtin": "nope", "size": "tiny", "batch_size": 8},
                               r"unknown model 'nope'; choose one of: .*gpt.*mlp"),
                              ({"builtin": "mlp", "size": "huge", "batch_size": 8},
                               r"unknown size 'huge'; choose one of: default, large")]:
            with pytest.raises(ex.ExplorerError, match=match):
                ex.export_script(replace(plan, model=record), tmp_path / "t.py", graph=mlp)
            assert not (tmp_path / "t_job").exists()

    @pytest.mark.slow
    def test_a_real_run_of_a_loaded_plan_does_not_import_its_factory(self, hostile, mlp,
                                                                     tmp_path):
        factory, marker = hostile
        plan = ex.Plan.load(_plan_file(mlp, factory, tmp_path / "evil.json"))
        meas = ex.run(mlp, plan=plan, steps=1, warmup=0, progress=False)
        assert len(meas.losses) == 1 and not marker.exists()


class TestTheCommandLine:
    def test_export_refuses_a_factory_only_the_plan_names(self, hostile, mlp, tmp_path,
                                                          capsys):
        factory, marker = hostile
        path = _plan_file(mlp, factory, tmp_path / "evil.json")
        assert cli(["export", "--plan", str(path), "--out", str(tmp_path / "t.py")]) == 2
        err = capsys.readouterr().err
        assert f"plan asks for model factory '{factory}'" in err
        assert f"--factory {factory}" in err and "Traceback" not in err
        assert not marker.exists() and not (tmp_path / "t.py").exists()

    def test_export_with_the_users_factory_or_model(self, hostile, mlp, tmp_path, capsys,
                                                    monkeypatch):
        """--factory (the user's) wins over the plan's; so does --model, which exports the
        captured built-in model's weights."""
        monkeypatch.syspath_prepend(FACTORIES)
        factory, marker = hostile
        tiny_gpt = ex.builtin_model("gpt", "tiny")
        gpt = ex.capture(tiny_gpt.module, tiny_gpt.example_inputs, tiny_gpt.loss_fn,
                         tiny_gpt.targets, name="gpt")
        path = _plan_file(gpt, factory, tmp_path / "evil.json")
        args = ["export", "--plan", str(path), "--out"]
        assert cli([*args, str(tmp_path / "a.py"), "--factory",
                    "factory_models:tiny_gpt"]) == 0, capsys.readouterr().err
        assert ex.Plan.load(tmp_path / "a_job" / "plan.json").model == {
            "factory": "factory_models:tiny_gpt"}
        assert cli([*args, str(tmp_path / "b.py"), "--model", "gpt", "--size", "tiny"]) == 0, \
            capsys.readouterr().err
        assert ex.Plan.load(tmp_path / "b_job" / "plan.json").model is None
        assert not marker.exists()

    def test_run_plan_refuses_a_factory_only_the_plan_names(self, hostile, mlp, tmp_path,
                                                            capsys):
        factory, marker = hostile
        path = _plan_file(mlp, factory, tmp_path / "evil.json")
        assert cli(["run", "--plan", str(path), "--devices", "cpu:1", "--steps", "1",
                    "--warmup", "0", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"plan asks for model factory '{factory}'" in err
        assert f"--factory {factory}" in err and "Traceback" not in err
        assert not marker.exists()

    @pytest.mark.slow
    def test_run_plan_with_the_users_factory(self, hostile, tmp_path, capsys, monkeypatch):
        monkeypatch.syspath_prepend(FACTORIES)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (FACTORIES, os.environ.get("PYTHONPATH", "")) if p))
        factory, marker = hostile
        tiny_gpt = ex.builtin_model("gpt", "tiny")
        gpt = ex.capture(tiny_gpt.module, tiny_gpt.example_inputs, tiny_gpt.loss_fn,
                         tiny_gpt.targets, name="gpt")
        path = _plan_file(gpt, factory, tmp_path / "evil.json")
        rc = cli(["run", "--plan", str(path), "--factory", "factory_models:tiny_gpt",
                  "--devices", "cpu:1", "--steps", "1", "--warmup", "0", "--quiet",
                  "--force"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert "losses: " in out and not marker.exists()
