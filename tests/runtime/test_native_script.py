"""Native scripts (``explorer export --native``): plain PyTorch a person can read, with no plan
text run as code; refusals that name what stops a plan; and (slow) under torchrun on two CPU
ranks, the losses ``ex.run`` measures for the same plan."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import explorer as ex
from explorer.cli.commands import main as cli
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool
from explorer.runtime.native_script import (
    NativePlan,
    NotExpressible,
    blocks_of,
    model_on_meta,
    native_plan,
    render,
)

HOSTILE = 'x"""\nopen("PWN","w")\n"""'
#: settings whose scripts the text tests read: (replicas, ZeRO, recompute, precision,
#: micro-batches)
SETTINGS = [(1, 0, "none", "fp32", 1), (2, 0, "none", "fp32", 2), (2, 1, "full", "bf16", 1),
            (2, 2, "selective", "fp32", 1), (2, 3, "full", "fp16", 4),
            (4, 3, "selective", "bf16", 2)]


@pytest.fixture(scope="module")
def gpt():
    bm = ex.builtin_model("gpt", "tiny")
    return bm, ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=bm.name)


@pytest.fixture(scope="module")
def cpu2():
    return ex.Cluster.cpu(2, measure=False)


def _native(graph, replicas, zero, recompute, precision, micro_batches, **extra):
    return NativePlan(source={"builtin": "gpt", "size": "tiny", "batch_size": 8},
                      devices=tuple(f"cpu:{k}" for k in range(replicas)), replicas=replicas,
                      zero=zero, recompute=recompute, precision=precision,
                      micro_batches=micro_batches, optimizer="adam", blocks=blocks_of(graph),
                      algorithm="data-parallel", **extra)


def _replicated(graph, devices, micro_batches=1):
    """One stage over ``devices``: every op on it, the batch split between them."""
    ops = {n.name: 0 for n in graph.nodes if n.kind == "op"}
    return ex.Plan.from_assignment(graph, [tuple(devices)], ops, algorithm="data-parallel",
                                   micro_batches=micro_batches)


class TestText:
    @pytest.mark.parametrize("settings", SETTINGS, ids=str)
    def test_a_script_of_public_pytorch_that_compiles_and_passes_ruff(self, gpt, settings,
                                                                      tmp_path):
        text = render(_native(gpt[1], *settings, predicted_step_s=0.0123,
                              predicted_peak_bytes=5 * 2**20))
        compile(text, "train.py", "exec")
        path = tmp_path / "train.py"
        path.write_text(text)
        lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select",
                               "E,F,W,I,B,UP", "--line-length", "100", str(path)],
                              capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        imports = [n for n in ast.walk(ast.parse(text))
                   if isinstance(n, (ast.Import, ast.ImportFrom))]
        modules = {n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                   for n in imports}
        assert modules - {"__future__", "gc", "os", "time", "contextlib", "functools"} <= {
            "torch", "torch.distributed", "torch.distributed.checkpoint.state_dict",
            "torch.distributed.device_mesh", "torch.distributed.fsdp", "torch.nn.parallel",
            "torch.utils.checkpoint", "explorer.models.builtin"}
        assert "pickle" not in text and "_job" not in text
        assert len(text.splitlines()) < 200
        assert "12.30 ms per step, 5.0 MiB peak memory" in text

    def test_each_setting_is_written_as_torch_names_it(self, gpt):
        replicas, zero3, selective = (render(_native(gpt[1], *s)) for s in (
            (2, 0, "none", "fp32", 2), (2, 3, "full", "fp16", 1),
            (2, 2, "selective", "bf16", 1)))
        assert "DistributedDataParallel(model" in replicas and "no_sync()" in replicas
        assert "fully_shard" not in replicas
        assert 'fully_shard(block, mesh=mesh["dp_shard"])' in zero3
        assert "checkpoint(forward, *args, use_reentrant=False" in zero3
        assert "LOSS_SCALE = 1024.0" in zero3 and "torch.float16" in zero3
        assert "reshard_after_forward=False" in selective
        assert "create_selective_checkpoint_contexts" in selective
        assert "torch.bfloat16" in selective
        blocks = ast.literal_eval(zero3.split("BLOCKS = ")[1].split("]")[0] + "]")
        assert blocks == list(blocks_of(gpt[1]))
        assert "blocks.0" in blocks and "blocks.1" in blocks

    def test_a_weight_another_module_reads_stays_with_the_root(self, factories):
        transformers = pytest.importorskip("transformers")
        import factory_models

        made = factory_models.hf_gpt2()
        graph = ex.capture(made.module, made.example_inputs, made.loss_fn, made.targets)
        assert isinstance(made.module, transformers.GPT2LMHeadModel)
        assert "lm_head" in blocks_of(graph)
        meta = model_on_meta({"factory": "factory_models:hf_gpt2"})
        assert next(meta.parameters()).is_meta
        # the unit of the embeddings holds the blocks; the output layer's weight is the
        # token embedding's
        assert blocks_of(graph, meta) == ("transformer.h.0", "transformer.h.1")

    def test_plan_text_is_never_code(self, gpt, cpu2):
        bm, graph = gpt
        plan = replace(_replicated(graph, cpu2.ids), algorithm=HOSTILE)
        text = render(native_plan(graph, plan, bm.record))
        tree = ast.parse(text)
        assert isinstance(tree.body[1], ast.ImportFrom)  # (the docstring, then imports)
        calls = {n.func.id for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "open" not in calls


class TestRefused:
    def test_stages_tensor_parallelism_and_no_source_say_what_stops_them(self, gpt, cpu2):
        bm, graph = gpt
        costs = roofline_costs(graph, cpu2)
        stages = ex.partition(graph, cpu2, costs, "even-layers")
        with pytest.raises(NotExpressible, match=r"2 stages \(stage 1 starts at op '"):
            native_plan(graph, stages, bm.record)
        tensor = _replicated(graph, cpu2.ids).with_tensor(2)
        with pytest.raises(NotExpressible, match="splits each layer 2 ways"):
            native_plan(graph, tensor, bm.record)
        with pytest.raises(NotExpressible, match="builds the model from its source"):
            native_plan(graph, _replicated(graph, cpu2.ids), {})

    def test_a_factory_without_its_batch_and_loss_is_refused(self, factories, cpu2,
                                                              tmp_path):
        import factory_models
        import torch.nn.functional as F

        x = factory_models.torch.randn(8, 8)
        y = factory_models.torch.randint(0, 4, (8,))
        graph = ex.capture(factory_models.mlp_module(), x, F.cross_entropy, y)
        with pytest.raises(NotExpressible, match="returned a Sequential without module, "
                                                 "example_inputs, targets, loss_fn"):
            ex.export_script(_replicated(graph, cpu2.ids), tmp_path / "t.py", graph=graph,
                             factory="factory_models:mlp_module", native=True)
        assert not (tmp_path / "t.py").exists()

    def test_compile_and_an_existing_file(self, gpt, cpu2, tmp_path):
        bm, graph = gpt
        plan = _replicated(graph, cpu2.ids)
        with pytest.raises(ex.ExplorerError, match="compile=True is the explorer runtime's"):
            ex.export_script(plan, tmp_path / "t.py", graph=graph, model=bm, native=True,
                             compile=True)
        (tmp_path / "t.py").write_text("mine")
        with pytest.raises(ex.ExplorerError, match="exists; pass overwrite=True"):
            ex.export_script(plan, tmp_path / "t.py", graph=graph, model=bm, native=True)
        assert (tmp_path / "t.py").read_text() == "mine"


@pytest.fixture(scope="module")
def pool():
    with RankPool() as ranks:
        yield ranks


def _torchrun(script: Path, n: int) -> list[float]:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(n), str(script)], capture_output=True, text=True, timeout=300, cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[:3000]
    return [float(line.split("loss ")[1].split(",")[0])
            for line in proc.stdout.splitlines() if line.startswith("step ")]


#: (devices, micro-batches, memory settings): every branch of the script's text
TRAINED = [(2, 2, {}), (2, 1, {"zero": 1}), (2, 2, {"zero": 3, "recompute": "full"}),
           (2, 1, {"zero": 2, "recompute": "selective", "precision": "bf16"}),
           (1, 1, {"precision": "fp16", "recompute": "full"})]


@pytest.mark.slow
@pytest.mark.parametrize("devices, micro_batches, settings", TRAINED, ids=str)
def test_the_script_trains_to_the_losses_of_ex_run(gpt, devices, micro_batches, settings,
                                                   pool, tmp_path):
    bm, graph = gpt
    plan = _replicated(graph, [f"cpu:{k}" for k in range(devices)], micro_batches)
    plan = plan.with_memory(**settings) if settings else plan
    script = ex.export_script(plan, tmp_path / "train.py", graph=graph, model=bm, steps=3,
                              native=True)
    measured = ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, pool=pool)
    half = settings.get("precision", "fp32") != "fp32"
    assert _torchrun(script, devices) == pytest.approx(list(measured.losses),
                                                       rel=1e-4 if half else 1e-5)


@pytest.mark.slow
def test_a_hugging_face_model_from_its_factory_trains_as_ex_run(factories, cpu2, pool,
                                                               tmp_path):
    import factory_models

    made = factory_models.hf_gpt2()
    graph = ex.capture(made.module, made.example_inputs, made.loss_fn, made.targets)
    plan = _replicated(graph, cpu2.ids).with_memory(zero=3, recompute="full")
    script = ex.export_script(plan, tmp_path / "train.py", graph=graph, steps=3,
                              factory="factory_models:hf_gpt2", native=True)
    assert "from factory_models import hf_gpt2" in script.read_text()
    measured = ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, pool=pool)
    assert _torchrun(script, 2) == pytest.approx(list(measured.losses), rel=1e-5)


@pytest.mark.slow
def test_the_command_line_writes_it_with_the_plan_s_prediction(gpt, cpu2, tmp_path, capsys):
    bm, graph = gpt
    plan = replace(_replicated(graph, cpu2.ids).with_memory(zero=3), model=bm.record)
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "train.py"
    assert cli(["export", "--plan", str(tmp_path / "plan.json"), "--out", str(out),
                "--native", "--quiet"]) == 0
    text = out.read_text()
    assert f"launch: torchrun --standalone --nproc_per_node 2 {out}" in capsys.readouterr().out
    assert "Predicted by the explorer: " in text and 'MESH = {"dp_shard": 2}' in text
    assert 'build("gpt", "tiny", 8, seed=0, weights=weights)' in text
