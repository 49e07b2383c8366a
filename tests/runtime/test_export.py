"""Exported scripts: fixed text that carries no plan strings, refusals to overwrite or write
where it cannot, and (slow) a script named with hostile text runs its plan and nothing else."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace

import pytest
from builders import tiny_builtin_graph

import explorer as ex
import explorer.runtime.export as export
from explorer.cli.commands import main as cli
from explorer.core.errors import ExplorerError, PlanError
from explorer.runtime.export import export_script, script_text

HOSTILE_ALGORITHM = 'x"""\nopen("PWN","w")\n"""'


@pytest.fixture(scope="module")
def mlp():
    bm = ex.builtin_model("mlp", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=bm.name)


@pytest.fixture(scope="module")
def cpu2():
    return ex.Cluster.cpu(2, measure=False)


class TestScriptText:
    def test_the_same_for_every_plan_but_the_process_count(self, mlp, cpu2, tmp_path):
        from explorer.models.synthetic import roofline_costs

        costs = roofline_costs(mlp, cpu2)
        one = export_script(ex.Plan.single(mlp, "cpu:1"), tmp_path / "alpha_script.py",
                            graph=mlp)
        two = export_script(ex.partition(mlp, cpu2, costs, "even-layers"),
                            tmp_path / "beta_script.py", graph=mlp, costs=costs)
        assert one.read_text() == script_text(1)
        assert two.read_text() == script_text(2)
        assert re.sub(r"\d+", "N", script_text(1)) == re.sub(r"\d+", "N", script_text(7))
        for text in (one.read_text(), two.read_text()):
            for s in ("cpu:0", "cpu:1", "even-layers", "single", "alpha", "beta", "mlp"):
                assert s not in text
        assert os.access(one, os.X_OK)

    def test_the_job_takes_the_runtime_a_run_would(self, mlp, tmp_path):
        """The segments, whatever the plan's settings; asked for, as asked."""
        plans = {"plain": ex.Plan.single(mlp, "cpu:0"),
                 "selective": ex.Plan.single(mlp, "cpu:0").with_memory(recompute="selective")}
        for name, runtime, expected in [("plain", None, "segments"), ("plain", "ops", "ops"),
                                        ("selective", None, "segments")]:
            export_script(plans[name], tmp_path / f"{name}.py", graph=mlp, runtime=runtime,
                          overwrite=True)
            job = json.loads((tmp_path / f"{name}_job" / "job.json").read_text())
            assert job["runtime"] == expected, (name, runtime)

    def test_the_header_says_the_job_folder_is_code(self):
        text = script_text(2)
        assert "THE JOB FOLDER IS CODE, NOT DATA" in text
        assert "pickles" in text and "torch.load(weights_only=False)" in text
        assert "as dangerous as a script" in text

    def test_process_count_is_a_number(self):
        with pytest.raises(ValueError):
            script_text('1"""\nimport os\n"""')  # type: ignore[arg-type]

    def test_a_plan_with_a_hostile_name_is_not_exported(self, mlp, tmp_path):
        plan = replace(ex.Plan.single(mlp, "cpu:0"), algorithm=HOSTILE_ALGORITHM)
        with pytest.raises(PlanError, match="plan field algorithm must be a name"):
            export_script(plan, tmp_path / "train.py", graph=mlp)
        assert list(tmp_path.iterdir()) == []


class TestWhereItWrites:
    def test_refuses_to_overwrite(self, mlp, tmp_path):
        plan = ex.Plan.single(mlp, "cpu:0")
        path = export_script(plan, tmp_path / "train.py", graph=mlp)
        with pytest.raises(ExplorerError, match=r"train\.py already exists; choose another name "
                                                r"or overwrite it"):
            export_script(plan, path, graph=mlp)
        assert export_script(plan, path, graph=mlp, overwrite=True) == path

    def test_refuses_an_existing_job_folder(self, mlp, tmp_path):
        (tmp_path / "train_job").mkdir()
        with pytest.raises(ExplorerError, match=r"train_job already exists"):
            export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "train.py", graph=mlp)

    def test_a_job_folder_that_is_a_file(self, mlp, tmp_path):
        (tmp_path / "train_job").write_text("")
        with pytest.raises(ExplorerError, match=r"cannot write .*train\.py and train_job/: "):
            export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "train.py", graph=mlp,
                          overwrite=True)

    def test_unwritable_folder(self, mlp, tmp_path, monkeypatch):
        def denied(folder, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(folder))

        monkeypatch.setattr(export, "write_job", denied)
        with pytest.raises(ExplorerError, match=r"cannot write .*: Permission denied; choose a "
                                                r"folder you can write to"):
            export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "train.py", graph=mlp)


class TestCommandLine:
    @pytest.fixture
    def plan_file(self, mlp, tmp_path):
        return ex.Plan.single(mlp, "cpu:0").save(tmp_path / "plan.json")

    def _export(self, capsys, *args):
        rc = cli(["export", "--size", "tiny", *args])
        out, err = capsys.readouterr()
        return rc, out, err

    def test_exports_and_refuses_to_overwrite_without_force(self, capsys, plan_file, tmp_path):
        out = str(tmp_path / "train.py")
        rc, text, _ = self._export(capsys, "--plan", str(plan_file), "--out", out)
        assert rc == 0 and "launch: torchrun --standalone --nproc_per_node 1" in text
        rc, _, err = self._export(capsys, "--plan", str(plan_file), "--out", out)
        assert rc == 2 and "train.py already exists" in err and "--force" in err
        rc, _, _ = self._export(capsys, "--plan", str(plan_file), "--out", out, "--force")
        assert rc == 0

    @pytest.mark.parametrize("content, match", [
        (b"[1, 2]", "not a Partition Explorer plan"),
        (b'{"format": "partition-explorer-plan", "version": 1, "graph": "mlp"}',
         "plan field graph must be an object"),
        (b'{"format": "partition-explorer-plan", "version": 1, "graph": {"name": "\xff"}}',
         "is not UTF-8 JSON"),
        (b'{"format": "partition-explorer-plan", "version": 1, "graph": {"fingerprint": "f"}, '
         b'"stages": [["cpu:0"]], "placement": {}, "algorithm": 3}',
         "plan field algorithm must be a name"),
    ])
    def test_damaged_plans_are_explained(self, capsys, tmp_path, content, match):
        path = tmp_path / "plan.json"
        path.write_bytes(content)
        rc, _, err = self._export(capsys, "--plan", str(path), "--out",
                                  str(tmp_path / "t.py"))
        assert rc == 2 and err.startswith("error: ") and match in err
        assert "Traceback" not in err
        assert not (tmp_path / "t.py").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(script, cwd):
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), "--steps", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


@pytest.mark.slow
def test_a_hostile_script_name_runs_the_plan_and_nothing_else(mlp, tmp_path):
    """Quotes and code in the script's file name stay a name: the script trains one step of
    its plan and creates nothing else."""
    name = 'a"""+open("PWN","w").name+"""\'\'\'; import os #.py'
    script = export_script(ex.Plan.single(mlp, "cpu:0", algorithm="single"), tmp_path / name,
                           graph=mlp)
    before = {p.name for p in tmp_path.iterdir()}
    proc = _run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "plan single for graph mlp on 1 devices (cpu:0)" in proc.stdout
    assert "step 1/1: loss " in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} == before  # no PWN, nothing new
    assert not os.path.exists("PWN")


@pytest.mark.slow
def test_a_hostile_plan_in_the_job_folder_is_refused_at_start(mlp, tmp_path):
    """A plan.json edited after export is checked when the script starts."""
    script = export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "train.py", graph=mlp)
    plan_json = tmp_path / "train_job" / "plan.json"
    plan_json.write_text(json.dumps({**json.loads(plan_json.read_text()),
                                     "algorithm": HOSTILE_ALGORITHM}))
    proc = _run_script(script, tmp_path)
    assert proc.returncode == 2
    assert "error: plan field algorithm must be a name" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "PWN").exists()


@pytest.mark.slow
def test_a_rank_that_fails_says_why_on_stderr(mlp, tmp_path):
    """A failure while the script runs (here its ``batches`` raises) is printed by the rank,
    not only written to error-0.txt; a job.json value out of range (or an option's) is
    refused before any step, naming the field."""
    script = export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "train.py", graph=mlp)
    text = script.read_text()
    script.write_text(text.replace("    return None\n", "    raise ValueError('no data "
                                   "for step %d' % step)\n", 1))
    proc = _run_script(script, tmp_path)
    assert proc.returncode == 1
    assert "error: rank 0 failed: ValueError: no data for step 0" in proc.stderr
    script.write_text(text)
    job_json = tmp_path / "train_job" / "job.json"
    job_json.write_text(json.dumps({**json.loads(job_json.read_text()), "lr": "fast"}))
    proc = _run_script(script, tmp_path)
    assert proc.returncode == 1
    assert "error: rank 0: " in proc.stderr and "field 'lr' is 'fast'" in proc.stderr
    assert "Traceback" not in proc.stderr and "step 1/1" not in proc.stdout
    job_json.write_text(json.dumps({**json.loads(job_json.read_text()), "lr": 0.01}))
    proc = subprocess.run(
        [sys.executable, str(script), "--steps", "1", "--warmup", "0", "--lr", "nan"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_rank_env())
    assert proc.returncode == 1 and "field 'lr' is nan" in proc.stderr


@pytest.mark.slow
def test_an_op_moved_in_plan_json_is_refused_not_a_deadlock(mlp, tmp_path):
    """Both ranks of a two-stage plan refuse a plan.json with one op moved to the other
    stage, and say so, instead of waiting on each other until the time limit."""
    cpu2 = ex.Cluster.cpu(2, measure=False)
    from explorer.models.synthetic import roofline_costs

    costs = roofline_costs(mlp, cpu2)
    plan = ex.partition(mlp, cpu2, costs, "even-layers")
    assert len(plan.stages) == 2
    script = export_script(plan, tmp_path / "train.py", graph=mlp, costs=costs)
    op = next(n.name for n in mlp.nodes if n.kind == "op" and plan.placement[n.name] == 0)
    plan_json = tmp_path / "train_job" / "plan.json"
    data = json.loads(plan_json.read_text())
    data["placement"][op] = 1
    plan_json.write_text(json.dumps(data))
    procs = _start_ranks(script, 2)
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # a deadlock: end the ranks this test started
                p.kill()
    assert [p.returncode for p in procs] == [1, 1]
    for r, (_, err) in enumerate(outs):
        assert f"error: rank {r}: " in err
        assert f"is not the plan this job was exported with (node '{op}' is on stage 1" in err


@pytest.mark.slow
def test_torchrun_shows_the_cause_of_a_failed_rank(mlp, tmp_path):
    """Under torchrun, a failed rank's cause is on stderr and in torchrun's own summary."""
    script = export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "train.py", graph=mlp)
    job_json = tmp_path / "train_job" / "job.json"
    job_json.write_text(json.dumps({**json.loads(job_json.read_text()), "warmup": -1}))
    proc = _torchrun(script, tmp_path, n=1)
    assert proc.returncode != 0
    assert "error: rank 0: " in proc.stderr and "field 'warmup' is -1" in proc.stderr
    summary = proc.stderr[proc.stderr.index("ChildFailedError"):]
    assert "field 'warmup' is -1" in summary


def _rank_env(rank=0, world=1, port=None):
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or _free_port()),
            "OMP_NUM_THREADS": "1"}


def _start_ranks(script, world):
    port = _free_port()
    return [subprocess.Popen([sys.executable, str(script), "--steps", "1", "--warmup", "0"],
                             cwd=script.parent, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=_rank_env(r, world, port)) for r in range(world)]


def _two_ranks(script) -> list[str]:
    """Run ``script`` as torchrun would on two CPU ranks for one step; their outputs."""
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, str(script), "--steps", "1", "--warmup", "0"], cwd=script.parent,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
        for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    return [o for o, _ in outs]


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["ops", "segments"])
def test_a_tensor_parallel_plan_runs_under_two_ranks(mlp, tmp_path, runtime):
    """The job carries the split weights' placements; two ranks train a step of the plan, op
    by op or in segments."""
    plan = ex.Plan.from_assignment(mlp, [("cpu:0", "cpu:1")],
                                   {n.name: 0 for n in mlp.nodes if n.kind == "op"}
                                   ).with_tensor(2)
    script = export_script(plan, tmp_path / "train.py", graph=mlp, runtime=runtime)
    job = json.loads((tmp_path / "train_job" / "job.json").read_text())
    assert job["placements"]["layers.0.weight"] == "Shard(0)"
    assert job["runtime"] == runtime
    ref = ex.reference(ex.builtin_model("mlp", "tiny"), 1)
    assert f"step 1/1: loss {ref.losses[0]:.4f}" in _two_ranks(script)[0]


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["ops", "segments"])
def test_a_sequence_parallel_gpt_runs_under_two_ranks(tmp_path, runtime):
    """The GPT split two ways with its norms and residual adds on sequence shards, op by op
    or in segments."""
    gpt = tiny_builtin_graph("gpt")
    plan = ex.Plan.from_assignment(gpt, [("cpu:0", "cpu:1")],
                                   {n.name: 0 for n in gpt.nodes if n.kind == "op"}
                                   ).with_tensor(2, sequence=True)
    script = export_script(plan, tmp_path / "train.py", graph=gpt, runtime=runtime)
    job = json.loads((tmp_path / "train_job" / "job.json").read_text())
    assert job["runtime"] == runtime
    assert job["placements"]["blocks.0.attn.qkv.weight"] == "_StridedShard(dim=0, sf=3)"
    assert "layer_norm" in job["sequence_ops"] and "embedding" in job["sequence_ops"]
    ref = ex.reference(ex.builtin_model("gpt", "tiny"), 1)
    assert f"step 1/1: loss {ref.losses[0]:.4f}" in _two_ranks(script)[0]


# -- model factories: the ranks build the model from the user's code (fixture: conftest.py) --


def _mlp_batch(device="cpu"):
    import torch

    if device == "meta":
        return (torch.empty(8, 8, device="meta"),
                torch.empty(8, dtype=torch.int64, device="meta"))
    return (torch.randn(8, 8, generator=torch.Generator().manual_seed(1)),
            torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2)))


class TestFactoryNames:
    @pytest.mark.parametrize("factory, match", [
        ("factory_models.mlp_module", "has no colon between module and function"),
        ("factory_models:", "is not of the form module:function"),
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        ("factory_models:no_such_function", "module 'factory_models' has no "
                                            "'no_such_function'"),
        ("factory_models:NOT_CALLABLE", "names a int, which cannot be called"),
    ])
    def test_bad_factories_say_what_to_do(self, factories, mlp, tmp_path, factory, match):
        import factory_models
        import torch

        from explorer.core.factory import FactoryError

        with pytest.raises(FactoryError, match=match) as err:
            ex.export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "t.py", graph=mlp,
                             factory=factory)
        assert '"module:function"' in str(err.value)
        with pytest.raises(FactoryError, match=match):
            ex.capture(factory_models.mlp_module(), *_mlp_batch()[:1], factory=factory)
        assert list(tmp_path.iterdir()) == []
        assert torch.is_tensor(_mlp_batch()[0])

    def test_a_fake_graph_needs_a_factory(self, factories, tmp_path):
        import factory_models
        import torch.nn.functional as F

        x, y = _mlp_batch("meta")
        graph = ex.capture(factory_models.mlp_on_meta(), x, F.cross_entropy, y)
        with pytest.raises(ExplorerError, match=r"captured without running .* factory="):
            export_script(ex.Plan.single(graph, "cpu:0"), tmp_path / "t.py", graph=graph)

    def test_the_job_holds_no_weights_and_the_plan_names_the_factory(self, factories,
                                                                      tmp_path):
        import factory_models
        import torch
        import torch.nn.functional as F

        graph = ex.capture(factory_models.mlp_module(), *_mlp_batch()[:1], None,
                           factory="factory_models:mlp_module")
        assert graph.factory == "factory_models:mlp_module"
        export_script(ex.Plan.single(graph, "cpu:0"), tmp_path / "t.py", graph=graph)
        job = tmp_path / "t_job"
        assert ex.Plan.load(job / "plan.json").model == {"factory": "factory_models:mlp_module"}
        program = torch.load(job / "program.pt", weights_only=False)
        assert program["state"] == {} and set(program["keys"]) == {
            "0.weight", "0.bias", "2.weight", "2.bias"}
        assert F.cross_entropy  # the same loss the slow test trains with


def _torchrun(script, cwd, n=2):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(n), str(script)], capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def _losses(stdout):
    return [float(line.split("loss ")[1].split(",")[0])
            for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow
def test_a_factory_plan_trains_like_one_device_under_torchrun(factories, cpu2, tmp_path):
    """Two CPU ranks build the model from the factory (no weights in the job folder) and
    train to the losses of the same model on one device."""
    import factory_models
    import torch.nn.functional as F

    from explorer.models.synthetic import roofline_costs

    x, y = _mlp_batch()
    graph = ex.capture(factory_models.mlp_module(), x, F.cross_entropy, y)
    costs = roofline_costs(graph, cpu2)
    plan = ex.partition(graph, cpu2, costs, "even-layers")
    script = ex.export_script(plan, tmp_path / "train.py", costs=costs, steps=3, warmup=0,
                              factory="factory_models:mlp_module")
    proc = _torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one = ex.run(graph, plan=ex.Plan.single(graph, "cpu:0"), steps=3, warmup=0,
                 progress=False)
    assert _losses(proc.stdout) == pytest.approx(one.losses, rel=1e-5)


@pytest.mark.slow
def test_a_fake_graph_of_a_meta_factory_runs_under_torchrun(factories, cpu2, tmp_path):
    """A model built on the meta device, captured on fake tensors and exported with its
    factory: each rank makes only its own parameters and trains on the placeholder batch."""
    import math

    import factory_models
    import torch.nn.functional as F

    from explorer.models.synthetic import roofline_costs

    x, y = _mlp_batch("meta")
    graph = ex.capture(factory_models.mlp_on_meta(), x, F.cross_entropy, y,
                       factory="factory_models:mlp_on_meta")
    costs = roofline_costs(graph, cpu2)
    plan = ex.partition(graph, cpu2, costs, "even-layers")
    script = ex.export_script(plan, tmp_path / "train.py", costs=costs, steps=2, warmup=0)
    proc = _torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = _losses(proc.stdout)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


class TestBuiltinSources:
    def test_a_fake_builtin_graph_exports_without_weights(self, tmp_path):
        import torch

        bm = ex.builtin_model("llama", "tiny", weights=False)
        graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=bm.name)
        record = {"builtin": "llama", "size": "tiny", "batch_size": bm.batch_size}
        plan = replace(ex.Plan.single(graph, "cpu:0"), model=record)
        export_script(plan, tmp_path / "t.py", graph=graph)
        job = tmp_path / "t_job"
        assert json.loads((job / "job.json").read_text())["model"] == record
        program = torch.load(job / "program.pt", weights_only=False)
        assert program["state"] == {} and "embed_tokens.weight" in program["keys"]
        batch = torch.load(job / "batch.pt")
        assert [tuple(t.shape) for t in batch["inputs"]] == [(8, 16)]
        assert not batch["inputs"][0].any()  # placeholder token ids

    def test_a_published_shape_is_built_on_the_rank_one_module_at_a_time(self):
        """The rank's model of llama-7b has its parameters on meta; the ones it holds are
        made (the module's own initialisation), the rotary tables keep their values."""
        import torch

        from explorer.runtime.modelsource import SourceWeights

        names = ["layers.3.attn.q_proj.weight", "layers.3.attn_norm.weight", "rope_cos"]
        src = {"builtin": "llama-7b", "size": "default", "batch_size": 1}
        one, two = (SourceWeights({}, {n: n for n in names}, src) for _ in range(2))
        q = one["layers.3.attn.q_proj.weight"]
        assert q.device.type == "cpu" and q.shape == (4096, 4096) and 0 < q.std() < 0.02
        assert torch.equal(q, two["layers.3.attn.q_proj.weight"])  # replicas agree
        assert torch.equal(one["layers.3.attn_norm.weight"], torch.ones(4096))
        assert one["rope_cos"][0].eq(1).all()
        model = one.model
        assert model is not None and model.layers[0].attn.q_proj.weight.is_meta


def test_the_command_line_exports_with_a_factory(factories, capsys, tmp_path):
    import factory_models

    bm = factory_models.tiny_gpt()
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=bm.name)
    plan_file = ex.Plan.single(graph, "cpu:0").save(tmp_path / "plan.json")
    out = tmp_path / "train.py"
    args = ["export", "--plan", str(plan_file), "--out", str(out)]
    assert cli([*args, "--factory", "factory_models:mlp_module"]) == 2
    assert "needs the model with its example batch" in capsys.readouterr().err
    assert cli([*args, "--factory", "factory_models"]) == 2
    assert "has no colon" in capsys.readouterr().err
    assert cli([*args, "--factory", "factory_models:tiny_gpt"]) == 0
    saved = ex.Plan.load(tmp_path / "train_job" / "plan.json")
    assert saved.model == {"factory": "factory_models:tiny_gpt"}
