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
import torch

import explorer as ex
from explorer.cli.commands import main as cli
from explorer.core.errors import PlanError
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool
from explorer.runtime.native_script import (
    NativePlan,
    NotExpressible,
    blocks_of,
    model_on_meta,
    native_plan,
    render,
    stage_starts,
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
def llama():
    bm = ex.builtin_model("llama", "tiny")
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


def _captured(source: str):
    """A built-in model's name (tiny) or a ``"factory_models:function"``: the graph of what it
    builds, its source as a plan records it, and how export_script is told it."""
    if ":" in source:
        pytest.importorskip("transformers")
        import factory_models

        made = getattr(factory_models, source.split(":")[1])()
        record, told = {"factory": source}, {"factory": source}
    else:
        made = ex.builtin_model(source, "tiny")
        record, told = made.record, {"model": made}
    graph = ex.capture(made.module, made.example_inputs, made.loss_fn, made.targets)
    return graph, record, told


def _ruff_clean(path: Path) -> None:
    """The script at ``path`` passes ruff's errors, warnings, imports, bugbear and upgrade
    rules at 100 columns, with no project settings."""
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select",
                           "E,F,W,I,B,UP", "--line-length", "100", str(path)],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


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
        _ruff_clean(path)
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
        # (ZeRO 3 in fp16 gathers fp16 weights from the fp32 shards, reduces in fp32)
        assert 'fully_shard(block, mesh=mesh["dp_shard"], mp_policy=MP_POLICY)' in zero3
        assert "MixedPrecisionPolicy(PRECISION, torch.float32, cast_forward_inputs=False)" in zero3
        assert "mp_policy" not in replicas
        assert "reshard_after_forward=False, mp_policy=MP_POLICY" in selective
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
        meta = model_on_meta({"factory": "factory_models:hf_gpt2"}).module
        assert next(meta.parameters()).is_meta
        # the unit of the embeddings holds the blocks; the output layer's weight is the
        # token embedding's
        assert blocks_of(graph, meta) == ("transformer.h.0", "transformer.h.1")

    def test_plan_text_is_never_code(self, gpt, cpu2):
        bm, graph = gpt
        plan = replace(_replicated(graph, cpu2.ids), algorithm=HOSTILE)
        text = render(native_plan(graph, plan, bm.record))
        tree = ast.parse(text)
        assert isinstance(tree.body[1], ast.Import)  # (the docstring, then imports)
        calls = {n.func.id for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "open" not in calls


    @pytest.mark.parametrize("replicas, zero, recompute, precision, schedule", [
        (1, 0, "none", "fp32", "1f1b"), (2, 0, "full", "bf16", "gpipe"),
        (2, 3, "selective", "fp16", "1f1b")], ids=str)
    def test_a_pipeline_cuts_the_model_where_its_stages_begin(self, gpt, replicas, zero,
                                                             recompute, precision, schedule,
                                                             tmp_path):
        native = replace(_native(gpt[1], replicas, zero, recompute, precision, 4),
                         devices=tuple(f"cpu:{k}" for k in range(2 * replicas)),
                         stage_starts=("blocks.1",), schedule=schedule)
        text = render(native)
        path = tmp_path / "train.py"
        path.write_text(text)
        _ruff_clean(path)
        # (the fullest: a pipeline of replicas with ZeRO 3, selective recomputation and fp16
        # loss scaling, its weights gathered in fp16)
        assert len(text.splitlines()) < 205
        assert 'STAGE_STARTS = ["blocks.1"]' in text
        assert f"SCHEDULE = Schedule{'1F1B' if schedule == '1f1b' else 'GPipe'}" in text
        assert "pipeline(model, mb_args=" in text and "pipe.build_stage(" in text
        assert "DistributedDataParallel" not in text  # (a traced stage is no DDP module)
        mesh = {(1, 0): '{"pp": 2, "dp_replicate": 1}',
                (2, 0): '{"pp": 2, "dp_replicate": 2, "dp_shard": 1}',
                (2, 3): '{"pp": 2, "dp_shard": 2}'}[replicas, zero]
        assert f"MESH = {mesh}" in text
        if replicas > 1:
            where = 'mesh["dp_replicate", "dp_shard"]' if not zero else 'mesh["dp_shard"]'
            policy = ", mp_policy=MP_POLICY" if zero else ""
            assert f"fully_shard(block, mesh={where}{policy})" in text
            assert "if path not in here:  # (a block of another pipeline stage)" in text


    def test_a_tensor_split_is_written_as_torch_s_parallel_styles(self, llama, cpu2,
                                                                  tmp_path):
        bm, graph = llama
        plan = _replicated(graph, cpu2.ids, micro_batches=2).with_tensor(2)
        native = native_plan(graph, plan, bm.record, model_on_meta(bm.record))
        assert (native.tensor, native.replicas) == (2, 1)
        styles = dict(native.tensor_styles)
        assert styles["embed_tokens"] == "vocab_embedding" and styles["lm_head"] == "vocab_output"
        assert [styles[f"layers.0.{m}"] for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj",
                                                  "attn.o_proj", "mlp.gate_proj",
                                                  "mlp.up_proj", "mlp.down_proj")] == [
            "colwise", "colwise", "colwise", "rowwise", "colwise", "colwise", "rowwise"]
        assert native.attention == ("layers.0.attn", "layers.1.attn")
        assert native.head_counts == ("n_heads", "n_kv_heads")
        text = render(native)
        path = tmp_path / "train.py"
        path.write_text(text)
        _ruff_clean(path)
        assert 'MESH = {"dp_replicate": 1, "tp": 2}' in text
        assert '    "layers.1.mlp.down_proj": "rowwise",' in text
        assert 'parallelize_module(model, mesh["tp"], layout)' in text
        assert "with loss_parallel():" in text and "HEAD_COUNTS = (" in text
        assert len(text.splitlines()) < 200
        # (one process per machine would split each tensor-parallel group over two)
        assert "Each tensor-parallel group is 2 consecutive ranks" in text
        assert "On 2 machines" not in text

    def test_sequence_parallelism_runs_the_norms_on_sequence_shards(self, llama, cpu2):
        bm, graph = llama
        plan = _replicated(graph, cpu2.ids).with_tensor(2, sequence=True)
        styles = dict(native_plan(graph, plan, bm.record).tensor_styles)
        assert {styles[m] for m in ("layers.0.attn_norm", "layers.1.mlp_norm", "norm")} == {
            "sequence_norm"}
        assert styles["embed_tokens"] == "vocab_embedding_to_sequence"
        assert styles["layers.0.attn.q_proj"] == "colwise_from_sequence"
        assert styles["layers.1.mlp.down_proj"] == "rowwise_to_sequence"
        assert styles["lm_head"] == "vocab_output_from_sequence"
        text = render(native_plan(graph, plan, bm.record))
        assert '"sequence_norm": SequenceParallel(),' in text
        assert "(tensor parallel, the norms between along the sequence)" in " ".join(
            text.split())
        assert "from torch.distributed.tensor import DTensor, Replicate, Shard" in text
        # the embeddings reach the first block as a DTensor of sequence shards, whose shape
        # is whole where the model's own code reads it
        assert 'SEQUENCE_ENTRY = "layers.0"' in text
        assert "register_forward_pre_hook(\n        on_positions, with_kwargs=True)" in text
        assert "_micro_pipeline_tp" not in text

    def test_async_tensor_parallelism_compiles_the_blocks_on_cuda(self, llama, cpu2):
        """torchtitan's async tensor parallelism: on CUDA ranks each block compiled with
        the compiler's micro-pipelining of collectives and matmuls, after its split and
        recomputation; CPU ranks run as plain sequence parallelism (trained below)."""
        bm, graph = llama
        plan = (_replicated(graph, cpu2.ids).with_tensor(2, sequence=True)
                .with_memory(async_tensor=True, recompute="full"))
        native = native_plan(graph, plan, bm.record)
        assert native.async_tensor
        text = render(native)
        compile(text, "train.py", "exec")
        assert "import torch._inductor.config\n" in text and "import warnings\n" in text
        assert ("from torch.distributed._symmetric_memory import enable_symm_mem_for_group\n"
                in text)
        assert ('        recompute(model.get_submodule(path))\n'
                '    if mesh["tp"].device_type == "cuda":  # (async tensor parallelism)\n'
                '        torch._inductor.config._micro_pipeline_tp = True\n'
                '        with warnings.catch_warnings():  # (deprecated, but the compiler\'s\n'
                '            warnings.simplefilter("ignore", FutureWarning)  # pass reads it)\n'
                '            enable_symm_mem_for_group(mesh["tp"].get_group().group_name)\n'
                '        for path in BLOCKS:\n'
                '            model.get_submodule(path).compile()\n') in text
        assert "async on CUDA: collectives pipelined with the matmuls" in " ".join(
            text.split())
        # the explorer's runtime runs the collectives in turn: on GPUs it refuses the plan
        h100s = ex.Cluster.preset("2xH100")
        on_gpus = (_replicated(graph, h100s.ids).with_tensor(2, sequence=True)
                   .with_memory(async_tensor=True))
        with pytest.raises(PlanError, match="explorer export --native"):
            ex.run(graph, plan=on_gpus, costs=roofline_costs(graph, h100s), progress=False)


@pytest.mark.parametrize("source", ["gpt", "llama", "factory_models:hf_gpt2"])
def test_the_partitioners_plans_on_two_ranks_are_native(factories, cpu2, source):
    """What degrees, pipeline-dp, data-parallel and pase choose for each transformer on two
    ranks: every plan has a native script (the trained tests run those plans' settings)."""
    graph, record, _ = _captured(source)
    costs = roofline_costs(graph, cpu2)
    for algorithm in ("degrees", "pipeline-dp", "data-parallel", "pase"):
        plan = ex.partition(graph, cpu2, costs, algorithm)
        native = native_plan(graph, plan, record, model_on_meta(record))
        assert (native.stages, native.tensor) == (len(plan.stages), plan.tensor_of(0))
        assert native.replicas * native.stages * native.tensor == len(plan.devices)


class TestRefused:
    def test_stages_that_begin_at_modules_are_a_pipeline(self, gpt, cpu2):
        bm, graph = gpt
        stages = ex.partition(graph, cpu2, roofline_costs(graph, cpu2), "even-layers",
                              micro_batches=2, schedule="1f1b")
        native = native_plan(graph, stages, bm.record)
        assert native.stage_starts == ("blocks.1",) == stage_starts(graph, stages)
        assert (native.stages, native.schedule, native.replicas) == (2, "1f1b", 1)

    def test_chunks_that_go_round_the_stages_are_an_interleaved_pipeline(self, gpt, cpu2):
        bm, graph = gpt
        plan = ex.partition(graph, cpu2, roofline_costs(graph, cpu2), "even-layers", depth=2,
                            micro_batches=4, virtual_stages=2)
        native = native_plan(graph, plan, bm.record)
        assert native.stage_starts == ("pos_emb", "blocks.1", "lm_head")
        assert (native.stages, native.pipeline_ranks, native.virtual_stages) == (4, 2, 2)
        text = render(native)
        assert "SCHEDULE = ScheduleInterleaved1F1B" in text and "VIRTUAL_STAGES = 2" in text
        assert 'MESH = {"pp": 2, ' in text
        # the same placement run as plain 1F1B is not a pipeline torch can cut
        with pytest.raises(NotExpressible, match="runs on stage 0 after ops of stage 1"):
            native_plan(graph, plan.with_settings(schedule="1f1b"), bm.record)

    def test_a_stage_that_starts_inside_a_module_or_out_of_order_is_named(self, gpt, cpu2):
        bm, graph = gpt
        ops = [n for n in graph.nodes if n.kind == "op"]
        aligned = _two_stages(graph, 2)
        stage = dict(aligned.placement)
        assert stage_starts(graph, aligned) == ("blocks.1",)
        first = next(n for n in ops if n.module_path.startswith("blocks.1"))
        inside = ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)],
                                         {**stage, first.name: 0})
        with pytest.raises(NotExpressible, match=r"stage 1 starts at op '.*', inside module "
                                                 r"'blocks\.1.*' .*with depth=2\)"):
            native_plan(graph, inside, bm.record)
        back = ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)],
                                       {**stage, ops[-1].name: 0})
        with pytest.raises(NotExpressible, match=rf"op '{ops[-1].name}' runs on stage 0 "
                                                 "after ops of stage 1"):
            native_plan(graph, back, bm.record)
        mixed = aligned.with_memory(recompute="full", stages=[1])
        with pytest.raises(NotExpressible, match="stage 1 runs with recompute full, stage 0 "
                                                 "with the defaults"):
            native_plan(graph, mixed, bm.record)

    @pytest.mark.parametrize("factory, stops", [
        ("hf_gpt2", r"weight '.*' is read by ops of stages 0 and 1 \('embedding', "),
        ("hf_gpt2_untied", "the model returns a CausalLMOutputWithCrossAttentions, not a "
                           "tensor")])
    def test_a_weight_two_stages_read_and_an_output_object_are_named(self, factories, cpu2,
                                                                     factory, stops, tmp_path):
        pytest.importorskip("transformers")
        import factory_models

        made = getattr(factory_models, factory)()
        graph = ex.capture(made.module, made.example_inputs, made.loss_fn, made.targets)
        plan = ex.partition(graph, cpu2, roofline_costs(graph, cpu2), "even-layers", depth=3)
        with pytest.raises(NotExpressible, match=stops):
            ex.export_script(plan, tmp_path / "t.py", graph=graph, native=True,
                             factory=f"factory_models:{factory}")

    def test_sequence_parallelism_that_splits_nothing_is_named(self, cpu2, tmp_path):
        """An MLP's linears read (batch, features) rows: there is no sequence to split."""
        graph, _, model = _captured("mlp")
        plan = _replicated(graph, cpu2.ids).with_tensor(2, sequence=True)
        with pytest.raises(NotExpressible, match=r"splits nothing of this model along the "
                                                 r"sequence.*set sequence off"):
            ex.export_script(plan, tmp_path / "t.py", graph=graph, native=True, **model)

    def test_a_fused_projection_s_rows_are_reordered_for_its_split(self, gpt, cpu2, tmp_path):
        bm, graph = gpt
        native = native_plan(graph, _replicated(graph, cpu2.ids).with_tensor(2), bm.record,
                             model_on_meta(bm.record))
        assert native.fused == (("blocks.0.attn.qkv", 3), ("blocks.1.attn.qkv", 3))
        assert dict(native.tensor_styles)["blocks.0.attn.qkv"] == "colwise"
        sequence = native_plan(graph, _replicated(graph, cpu2.ids).with_tensor(2, sequence=True),
                               bm.record, model_on_meta(bm.record))
        # the positions' (sequence, features) embedding is scattered along its rows, as the
        # token embeddings' output is along the sequence
        assert dict(sequence.tensor_styles)["pos_emb"] == "rows_to_sequence"
        assert dict(sequence.tensor_styles)["tok_emb"] == "vocab_embedding_to_sequence"

        text = render(native)
        assert '    "blocks.1.attn.qkv": 3,' in text
        assert '    interleave_fused(initial, mesh["tp"].size())  # (before the split)' in text
        path = tmp_path / "train.py"
        path.write_text(text)
        _ruff_clean(path)
        # each rank's contiguous block of the reordered rows: its heads' q, k and v, in order
        function = next(f for f in ast.parse(text).body
                        if isinstance(f, ast.FunctionDef) and f.name == "interleave_fused")
        namespace = {"torch": torch, "FUSED_PROJECTIONS": {"qkv": 3}}
        exec(compile(ast.Module([function], []), str(path), "exec"), namespace)
        qkv = torch.nn.Linear(2, 12)
        with torch.no_grad():
            qkv.weight.copy_(torch.arange(12.0).unsqueeze(1).expand(12, 2))
            qkv.bias.copy_(torch.arange(12.0))
        holder = torch.nn.Module()
        holder.qkv = qkv
        namespace["interleave_fused"](holder, 2)
        # q rows 0-3, k 4-7, v 8-11; rank 0 holds heads 0 (rows q0 q1 k4 k5 v8 v9)
        assert qkv.bias.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
        assert qkv.weight[:, 0].tolist() == qkv.bias.tolist()

    def test_hugging_face_conv1d_modules_are_made_linear_before_the_split(self, cpu2,
                                                                         factories):
        graph, record, _ = _captured("factory_models:hf_gpt2_logits")
        native = native_plan(graph, _replicated(graph, cpu2.ids).with_tensor(2), record,
                             model_on_meta(record))
        attn = "model.transformer.h.0.attn"
        assert f"{attn}.c_attn" in native.conv1d and (f"{attn}.c_attn", 3) in native.fused
        assert dict(native.tensor_styles)[f"{attn}.c_proj"] == "rowwise"
        assert native.attention == (attn, "model.transformer.h.1.attn")
        assert native.head_counts == ("num_heads", "split_size")
        text = render(native)
        assert "    conv1d_as_linear(model)\n    parallelize(model, mesh)" in text
        assert "    conv1d_as_linear(initial)\n    interleave_fused(initial" in text

    def test_tensor_splits_torch_s_styles_cannot_make_are_named(self, llama, cpu2, factories):
        graph, record, _ = _captured("alexnet")
        with pytest.raises(NotExpressible, match=r"module 'features\.6' \(Conv2d\) is split by "
                                                 r"the plan; torch's parallel styles split "
                                                 r"nn\.Linear and nn\.Embedding"):
            native_plan(graph, _replicated(graph, cpu2.ids).with_tensor(2), record,
                        model_on_meta(record))
        bm, graph = llama
        four = _replicated(graph, [f"cpu:{k}" for k in range(4)]).with_tensor(2)
        with pytest.raises(NotExpressible, match="2 replicas of its tensor-parallel devices"):
            native_plan(graph, four, bm.record)

    def test_no_source_says_what_stops_it(self, gpt, cpu2):
        graph = gpt[1]
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
           (2, 2, {"zero": 3, "precision": "bf16"}),
           (2, 1, {"zero": 2, "recompute": "selective", "precision": "bf16"}),
           (1, 1, {"precision": "fp16", "recompute": "full"})]


@pytest.mark.slow
@pytest.mark.parametrize("devices, micro_batches, settings", TRAINED, ids=str)
def test_the_script_trains_to_the_losses_of_ex_run(gpt, devices, micro_batches, settings,
                                                   pool, tmp_path):
    plan = _replicated(gpt[1], [f"cpu:{k}" for k in range(devices)], micro_batches)
    _trains_as_ex_run(gpt, plan, settings, pool, tmp_path)


def _trains_as_ex_run(gpt, plan, settings: dict, pool, tmp_path) -> None:
    """``plan`` of the built-in gpt with memory ``settings``: its native script under torchrun
    gives ex.run's losses (reduced precision: within 1e-4)."""
    bm, graph = gpt
    plan = plan.with_memory(**settings) if settings else plan
    script = ex.export_script(plan, tmp_path / "train.py", graph=graph, model=bm, steps=3,
                              native=True)
    measured = ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, pool=pool)
    half = settings.get("precision", "fp32") != "fp32"
    assert _torchrun(script, len(plan.devices)) == pytest.approx(list(measured.losses),
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
@pytest.mark.parametrize("source, zero", [("llama", 2), ("factory_models:hf_gpt2_logits", 2),
                                          ("factory_models:hf_gpt2_logits", 3)])
def test_other_transformers_train_with_memory_settings_as_ex_run(factories, cpu2, pool, source,
                                                                zero, tmp_path):
    """ZeRO 2 (and 3) with selective recomputation in bf16, two micro-batches a replica:
    FSDP2 with its MixedPrecisionPolicy and checkpoint_wrapper per block on the Llama and on
    Hugging Face's GPT-2 (its blocks found from its factory's model; an fp32 activation
    reaches its layer norms, whose weights the runtime reads in fp32)."""
    graph, _, model = _captured(source)
    plan = _replicated(graph, cpu2.ids, micro_batches=2).with_memory(
        zero=zero, recompute="selective", precision="bf16")
    script = ex.export_script(plan, tmp_path / "train.py", graph=graph, steps=3, native=True,
                              **model)
    measured = ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, pool=pool)
    assert _torchrun(script, 2) == pytest.approx(list(measured.losses), rel=1e-4)


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


def _two_stages(graph, devices: int, **settings) -> ex.Plan:
    """The model cut where its second block begins, each stage on half the ``devices``."""
    ops = [n for n in graph.nodes if n.kind == "op"]
    first = next(k for k, n in enumerate(ops) if n.module_path.startswith("blocks.1"))
    names = [f"cpu:{k}" for k in range(devices)]
    return ex.Plan.from_assignment(graph, [tuple(names[:devices // 2]),
                                           tuple(names[devices // 2:])],
                                   {n.name: int(k >= first) for k, n in enumerate(ops)},
                                   **settings)


#: pipelines: (devices, schedule, micro-batches, memory settings); stages of half the devices
PIPELINED = [(2, "1f1b", 4, {"recompute": "selective", "precision": "fp16"}),
             (4, "gpipe", 2, {"zero": 3, "recompute": "full"}), (4, "1f1b", 2, {})]


@pytest.mark.slow
@pytest.mark.parametrize("devices, schedule, micro_batches, settings", PIPELINED, ids=str)
def test_a_pipeline_trains_to_the_losses_of_ex_run(gpt, devices, schedule, micro_batches,
                                                   settings, pool, tmp_path):
    plan = _two_stages(gpt[1], devices, micro_batches=micro_batches, schedule=schedule)
    _trains_as_ex_run(gpt, plan, settings, pool, tmp_path)


@pytest.mark.slow
def test_an_interleaved_pipeline_trains_to_the_losses_of_ex_run(gpt, cpu2, pool, tmp_path):
    """Two chunks on each of two ranks under torch's ScheduleInterleaved1F1B, in bf16."""
    plan = ex.partition(gpt[1], cpu2, roofline_costs(gpt[1], cpu2), "even-layers", depth=2,
                        micro_batches=4, virtual_stages=2)
    _trains_as_ex_run(gpt, plan, {"precision": "bf16"}, pool, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("source, depth", [("llama", 2), ("factory_models:hf_gpt2_logits", 4)],
                         ids=["llama", "hf_gpt2"])
def test_even_layers_pipelines_of_other_transformers_train_as_ex_run(factories, cpu2, pool,
                                                                     source, depth, tmp_path):
    graph, _, model = _captured(source)
    plan = ex.partition(graph, cpu2, roofline_costs(graph, cpu2), "even-layers", depth=depth,
                        micro_batches=2, schedule="1f1b")
    script = ex.export_script(plan, tmp_path / "train.py", graph=graph, steps=3, native=True,
                              **model)
    assert "STAGE_STARTS = [" in script.read_text()
    measured = ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, pool=pool)
    assert _torchrun(script, 2) == pytest.approx(list(measured.losses), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("source, sequence", [("llama", True),
                                              ("factory_models:hf_llama_logits", False),
                                              ("gpt", True),
                                              ("factory_models:hf_gpt2_logits", False),
                                              ("factory_models:hf_gpt2_logits", True)],
                         ids=["llama with sequence parallel", "hf_llama",
                              "gpt fused qkv with sequence parallel", "hf_gpt2 conv1d",
                              "hf_gpt2 conv1d with sequence parallel"])
def test_a_tensor_parallel_script_trains_as_ex_run(factories, cpu2, pool, source, sequence,
                                                   tmp_path):
    """Tensor 2 on two ranks, torch's parallel styles against ex.run's own split of the same
    plan (Hugging Face's Llama: grouped-query attention)."""
    graph, _, model = _captured(source)
    plan = _replicated(graph, cpu2.ids, micro_batches=2).with_tensor(2, sequence=sequence)
    if source == "gpt":  # (async tensor parallelism: CPU ranks run it as plain sequence)
        plan = plan.with_memory(async_tensor=True)
    script = ex.export_script(plan, tmp_path / "train.py", graph=graph, steps=3, native=True,
                              **model)
    measured = ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, pool=pool)
    assert _torchrun(script, 2) == pytest.approx(list(measured.losses), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"recompute": "full"},
                                      {"recompute": "selective", "precision": "bf16"}],
                         ids=str)
def test_a_tensor_parallel_script_recomputes_and_autocasts(gpt, cpu2, pool, settings,
                                                          tmp_path):
    """Tensor 2 (sequence parallel) with recomputation and bf16, which ex.run does not run:
    recomputation changes no loss (ex.run's split in fp32, rel 1e-5); bf16 gives the losses
    of ex.run's data-parallel plan with the same settings (within 1e-4)."""
    bm, graph = gpt
    split = _replicated(graph, cpu2.ids, micro_batches=2).with_tensor(2, sequence=True)
    plan = split.with_memory(**settings)
    script = ex.export_script(plan, tmp_path / "train.py", graph=graph, model=bm, steps=3,
                              native=True)
    text = script.read_text()
    assert "recompute(model.get_submodule(path))" in text
    assert ("torch.autocast" in text) == ("precision" in settings)
    half = "precision" in settings
    reference = (_replicated(graph, cpu2.ids, micro_batches=2).with_memory(**settings) if half
                 else split)
    measured = ex.run(graph, plan=reference, steps=3, warmup=0, progress=False, pool=pool)
    assert _torchrun(script, 2) == pytest.approx(list(measured.losses),
                                                 rel=1e-4 if half else 1e-5)

