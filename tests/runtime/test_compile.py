"""Compiled segments (``ex.run(..., compile=True)``): the pass that cuts a segment's code into
compiled pieces at its reseeds, the job's ``compile`` field, the refusals of what does not
compile, and (slow) compiled runs equal to one device, drawing the op path's dropout masks,
through ``explorer run --compile`` and through an exported script's ``--compile``."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from builders import dropout_mlp_graph, tiny_builtin_graph

import explorer as ex
from explorer.cli.commands import build_parser
from explorer.cli.commands import main as cli
from explorer.core.errors import ExplorerError
from explorer.core.segments import group_segments
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool
from explorer.runtime.jobfiles import Job, job_problem, program_parts, read_job, write_job
from explorer.runtime.launch import reference
from explorer.runtime.layout import RankLayout
from explorer.runtime.segment_compile import compile_segment
from explorer.runtime.segments import segment_code
from explorer.simulate.simulator import execution_order

STEPS, WARMUP = 2, 1
#: compiled numerics (fused kernels) against eager PyTorch on one device
RTOL = 1e-4


@pytest.fixture(scope="module")
def mlp():
    return tiny_builtin_graph("mlp")


@pytest.fixture(scope="module")
def dropout_graph():
    return dropout_mlp_graph()


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's real runs (each run compiles its own segments)."""
    with RankPool() as ranks:
        yield ranks


def _job(graph, plan, **settings) -> Job:
    rt = graph.runtime
    calls, state = program_parts(rt.program, len(rt.inputs))
    return Job(calls=calls, state=state, plan=plan, schedule=execution_order(graph, plan),
               inputs=list(rt.inputs), targets=list(rt.targets), steps=1, warmup=0, lr=1e-3,
               record=False, timeout_s=60.0, device_map={d: "cpu" for d in plan.devices},
               requires_grad=[n.requires_grad for n in graph.nodes], loss=graph.loss,
               **settings)


def _one_segment(graph):
    """The single-device plan's one segment of ``graph``, its code, and the values of its
    inputs (weights as leaves that need a gradient)."""
    plan = ex.Plan.single(graph, "cpu:0")
    job = _job(graph, plan)
    L = RankLayout(job, 0, 1, 0)
    (seg,) = group_segments(execution_order(graph, plan)[0], 0, L.stage, L.kind, L.preds,
                            L.requires_grad, L.names.index(L.loss_name))
    code = segment_code(seg, L.calls, L.targets, L.random)
    rt = graph.runtime
    batch = {**{f"input_{k}": t for k, t in enumerate(rt.inputs)},
             **{f"target_{k}": t for k, t in enumerate(rt.targets)}}

    def inputs():
        return [job.state[L.names[p]].detach().clone().requires_grad_(L.kind[p] == "param")
                if L.kind[p] in ("param", "buffer") else batch[L.names[p]]
                for p in seg.inputs]

    return code, inputs


class TestPieces:
    def test_a_segment_is_cut_before_each_reseed(self, dropout_graph):
        """Three pieces: the ops before the first dropout, and one from each dropout on; the
        reseeds are called between them, outside the compiled modules, with the seeds as
        the segment's own code passes them."""
        code, _ = _one_segment(dropout_graph)
        compiled = compile_segment(code)
        assert compiled.random == code.random and len(code.random) == 2
        lines = [ln.strip() for ln in compiled.module.code.splitlines() if "=" in ln]
        calls = [ln.split(" = ")[1].split("(")[0] for ln in lines]
        assert [c for c in calls if c.startswith("self.piece") or "reseed" in c] == [
            "self.piece_0", "explorer_runtime_segments_reseed", "self.piece_1",
            "explorer_runtime_segments_reseed", "self.piece_2"]
        first_ops = []
        for k in range(3):
            piece = getattr(compiled.module, f"piece_{k}")
            assert isinstance(piece, torch._dynamo.eval_frame.OptimizedModule)
            text = piece._orig_mod.code
            assert "reseed" not in text and "generator" not in text
            first_ops.append(next(n.target for n in piece._orig_mod.graph.nodes
                                  if n.op == "call_function"))
            assert text.count("aten.dropout") == (k > 0)
        assert [str(t) for t in first_ops[1:]] == ["aten.dropout.default"] * 2

    def test_a_segment_without_random_ops_is_one_piece(self, mlp):
        code, _ = _one_segment(mlp)
        compiled = compile_segment(code)
        assert not code.random
        assert [n.target for n in compiled.module.graph.nodes if n.op == "call_module"] == [
            "piece_0"]
        placeholders = [n.name for n in compiled.module.graph.nodes if n.op == "placeholder"]
        assert placeholders == [n.name for n in code.module.graph.nodes
                                if n.op == "placeholder"]

    @pytest.mark.slow
    def test_compiled_pieces_draw_the_eager_masks_without_recompiling(self, dropout_graph):
        """Called with new seeds each time, the compiled code gives the eager code's loss
        and gradients (the same masks), and dynamo compiles each piece once: it never sees
        a seed."""
        code, inputs = _one_segment(dropout_graph)
        compiled = compile_segment(code)
        torch._dynamo.utils.counters.clear()
        for seeds in ([11, 12], [2**62 + 3, 5], [7, 2**40]):
            got = []
            for forward in (code.forward, compiled.forward):
                args = inputs()
                (loss,) = forward(*args, torch.default_generator, *seeds)
                loss.backward()
                got.append((loss.detach(), [a.grad for a in args if a.grad is not None]))
            (eager, eager_grads), (comp, comp_grads) = got
            torch.testing.assert_close(comp, eager, rtol=1e-6, atol=0)
            for g, e in zip(comp_grads, eager_grads, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
        assert not torch._dynamo.utils.counters["graph_break"]


class TestSettings:
    def test_the_job_records_compile(self, mlp, tmp_path):
        """job.json carries compile, checked on read; a folder without it does not
        compile; compiling needs the segment runtime."""
        job = _job(mlp, ex.Plan.single(mlp, "cpu:0"), runtime="segments", compile=True)
        assert job_problem(job) is None
        assert "field 'compile' is 'yes', but it must be true or false" in \
            job_problem(dataclasses.replace(job, compile="yes"))
        assert ("field 'compile' is true, but field 'runtime' is 'ops': only runtime "
                "'segments' compiles") in job_problem(dataclasses.replace(job, runtime="ops"))
        write_job(tmp_path, job)
        assert json.loads((tmp_path / "job.json").read_text())["compile"] is True
        assert read_job(tmp_path).compile is True
        meta = json.loads((tmp_path / "job.json").read_text())
        del meta["compile"]
        (tmp_path / "job.json").write_text(json.dumps(meta))
        assert read_job(tmp_path).compile is False

    def test_compile_with_the_op_path_is_refused(self, mlp):
        plan = ex.Plan.single(mlp, "cpu:0")
        with pytest.raises(ExplorerError, match="compile=True compiles the segments' code, "
                                                "and runtime='ops' runs one op at a time: "
                                                "use runtime='segments'"):
            ex.run(mlp, plan=plan, runtime="ops", compile=True, progress=False)
        with pytest.raises(ExplorerError, match="compile must be True or False, not 'yes'"):
            ex.run(mlp, plan=plan, runtime="segments", compile="yes", progress=False)

    def test_the_command_line_takes_compile(self, capsys):
        parser = build_parser()
        assert parser.parse_args(["run"]).compile is False
        assert parser.parse_args(["run", "--compile"]).compile is True
        args = parser.parse_args(["export", "--plan", "p.json", "--out", "t.py", "--compile",
                                  "--runtime", "segments"])
        assert (args.compile, args.runtime) == (True, "segments")
        assert cli(["run", "--compile", "--runtime", "ops"]) == 2
        err = capsys.readouterr().err
        assert "error: --compile runs the segments' code through torch.compile, and " \
               "--runtime ops runs one op at a time: use --runtime segments" in err

    def test_export_records_runtime_and_compile(self, mlp, tmp_path, monkeypatch):
        plan = ex.Plan.single(mlp, "cpu:0")
        ex.export_script(plan, tmp_path / "a.py", graph=mlp, compile=True)
        job = json.loads((tmp_path / "a_job" / "job.json").read_text())
        assert (job["runtime"], job["compile"]) == ("segments", True)
        ex.export_script(plan, tmp_path / "b.py", graph=mlp, runtime="segments")
        job = json.loads((tmp_path / "b_job" / "job.json").read_text())
        assert (job["runtime"], job["compile"]) == ("segments", False)
        ex.export_script(plan, tmp_path / "c.py", graph=mlp)
        job = json.loads((tmp_path / "c_job" / "job.json").read_text())
        assert (job["runtime"], job["compile"]) == ("segments", False)  # (as ex.run)
        with pytest.raises(ExplorerError, match="compile=True compiles the segments' code, "
                                                "and runtime='ops' runs one op at a time"):
            ex.export_script(plan, tmp_path / "d.py", graph=mlp, runtime="ops", compile=True)
        with pytest.raises(ExplorerError, match="runtime must be one of 'ops', 'segments'"):
            ex.export_script(plan, tmp_path / "e.py", graph=mlp, runtime="fast")
        assert not (tmp_path / "d.py").exists()


# -- real runs (slow) -----------------------------------------------------------------------
_RUNS: dict = {}


def _plan(graph, path: str) -> ex.Plan:
    """One device (also recomputing, "single-full" or "single-selective": its blocks
    checkpointed inside the compiled segment); two pipeline stages over two micro-batches
    (GPipe); two data-parallel replicas."""
    if path == "single":
        return ex.Plan.single(graph, "cpu:0")
    if path.startswith("single-"):  # (recomputing)
        return ex.Plan.single(graph, "cpu:0").with_memory(recompute=path.split("-")[1])
    cluster = ex.Cluster.cpu(2, measure=False)
    costs = roofline_costs(graph, cluster)
    if path == "gpipe":
        return ex.partition(graph, cluster, costs, "even-layers", micro_batches=2,
                            schedule="gpipe")
    assert path == "data-parallel"
    return ex.partition(graph, cluster, costs, "data-parallel")


def _run(graph, plan, key, pool: RankPool, compile: bool = True, runtime: str = "segments",
         seed: int = 0) -> ex.Measurement:
    full = (key, compile, runtime, seed)
    if full not in _RUNS:
        _RUNS[full] = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False,
                             record=True, timeout_s=300, runtime=runtime, compile=compile,
                             seed=seed, pool=pool)
        assert (_RUNS[full].runtime, _RUNS[full].compiled) == (runtime, compile)
    return _RUNS[full]


@pytest.mark.slow
@pytest.mark.parametrize("name,path", [("mlp", "single"), ("mlp", "gpipe"),
                                       ("mlp", "data-parallel"), ("gpt", "single"),
                                       ("gpt", "single-full"), ("gpt", "single-selective")])
def test_compiled_segments_train_like_one_device(name, path, pool):
    """One CPU rank, two pipeline stages and two data-parallel replicas: the compiled
    segments' losses and first gradients are one device's in eager PyTorch, within the
    rounding of fused kernels."""
    graph = tiny_builtin_graph(name)
    plan = _plan(graph, path)
    meas = _run(graph, plan, (name, path), pool)
    shards = max(len(s) for s in plan.stages) * plan.micro_batches
    ref = reference(ex.builtin_model(name, "tiny"), STEPS + WARMUP, shards,
                    optimizer=plan.optimizer)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=1e-6)
    assert set(meas.grads) == set(ref.grads)
    for k, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[k], g, rtol=RTOL, atol=1e-6, msg=k)


@pytest.mark.slow
def test_compiled_dropout_draws_the_op_path_masks(dropout_graph, pool):
    """A compiled segment with dropout draws the op path's masks (losses within float
    rounding, where other masks would move them by several per cent), repeats its losses
    bit for bit, and another seed draws otherwise."""
    plan = ex.Plan.single(dropout_graph, "cpu:0")
    comp = _run(dropout_graph, plan, "dropout", pool)
    ops = _run(dropout_graph, plan, "dropout", pool, compile=False, runtime="ops")
    torch.testing.assert_close(torch.tensor(comp.losses), torch.tensor(ops.losses),
                               rtol=1e-6, atol=0)
    again = ex.run(dropout_graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False,
                   timeout_s=300, runtime="segments", compile=True, pool=pool)
    assert again.losses == comp.losses
    other = _run(dropout_graph, plan, "dropout", pool, seed=1)
    assert all(abs(a - b) > 1e-3 * abs(b) for a, b in zip(other.losses, comp.losses,
                                                          strict=True))


@pytest.mark.slow
def test_compiled_segments_count_what_the_compiled_forward_saves(pool):
    """On CPU ranks the tensor accounting counts what each piece's compiled forward saves
    for its backward: on the GPT, whose peak is mostly those activations, the compiled
    peak is within 8 % of the eager segments', its activations within 10 % (uncounted, the
    activations would be a few inputs and outputs). A compiled piece's backward is one
    autograd node, so the gradients passed inside it are not seen, as the eager segments'
    are (about 6 % of this peak, 9 % of its activations)."""
    graph = tiny_builtin_graph("gpt")
    plan = _plan(graph, "single")
    comp = _run(graph, plan, ("gpt", "single"), pool)
    eager = _run(graph, plan, ("gpt", "single"), pool, compile=False)
    assert comp.memory_source == eager.memory_source == "tensor accounting"
    peak, eager_peak = comp.peak_bytes["cpu:0"], eager.peak_bytes["cpu:0"]
    assert abs(peak - eager_peak) <= 0.08 * eager_peak, (peak, eager_peak)
    acts = comp.peak_by_category["cpu:0"]["activations"]
    eager_acts = eager.peak_by_category["cpu:0"]["activations"]
    assert eager_acts > 0.5 * eager_peak
    assert abs(acts - eager_acts) <= 0.10 * eager_acts, (acts, eager_acts)


@pytest.mark.slow
def test_explorer_run_compiles(capsys, monkeypatch, tmp_path):
    from explorer.platforms.cpu import host as cpu_host

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_host, "host_profile", lambda measure: cpu_host.nominal_profile())
    rc = cli(["run", "--model", "mlp", "--size", "tiny", "--devices", "cpu:1",
              "--algorithm", "single", "--compile", "--steps", "1", "--warmup", "1",
              "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "the ranks ran as generated segments (compiled))" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(script, *options, cache=None):
    """Run an exported script as one rank for one step; with ``cache``, inductor's cache
    folder (it writes there only what it compiles)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           **({"TORCHINDUCTOR_CACHE_DIR": str(cache)} if cache else {})}
    return subprocess.run([sys.executable, str(script), "--steps", "1", "--warmup", "0",
                           *options], capture_output=True, text=True, timeout=300,
                          cwd=script.parent, env=env)


def _files(folder):
    """The files under ``folder`` (inductor's cache: none until it compiles something)."""
    return [f for f in folder.rglob("*") if f.is_file()]


@pytest.mark.slow
def test_an_exported_script_runs_segments_and_compiles_on_request(mlp, tmp_path):
    """A script exported with the segment runtime trains one device's step; its
    ``--compile`` compiles them (inductor writes code to its cache, which stays empty
    without),
    to the same loss; ``--runtime ops --compile`` is refused before any step."""
    script = ex.export_script(ex.Plan.single(mlp, "cpu:0"), tmp_path / "train.py",
                              graph=mlp, runtime="segments")
    ref = ex.reference(ex.builtin_model("mlp", "tiny"), 1)
    plain = _script(script, cache=tmp_path / "plain-cache")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert f"step 1/1: loss {ref.losses[0]:.4f}" in plain.stdout
    assert not _files(tmp_path / "plain-cache")
    compiled = _script(script, "--compile", cache=tmp_path / "cache")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert f"step 1/1: loss {ref.losses[0]:.4f}" in compiled.stdout
    assert any(f.suffix == ".py" for f in _files(tmp_path / "cache"))
    refused = _script(script, "--compile", "--runtime", "ops")
    assert refused.returncode == 1
    assert "field 'compile' is true, but field 'runtime' is 'ops'" in refused.stderr
    assert "step 1/1" not in refused.stdout


@pytest.mark.slow
def test_an_exported_compiled_script_runs_eager_on_request(mlp, tmp_path):
    """``explorer export --compile`` writes a compiled segments job; the script's
    ``--no-compile`` runs it eager (nothing in inductor's cache), to the same loss."""
    plan_file = tmp_path / "plan.json"
    ex.Plan.single(mlp, "cpu:0").save(plan_file)
    assert cli(["export", "--plan", str(plan_file), "--out", str(tmp_path / "train.py"),
                "--model", "mlp", "--size", "tiny", "--compile"]) == 0
    job = json.loads((tmp_path / "train_job" / "job.json").read_text())
    assert (job["runtime"], job["compile"]) == ("segments", True)
    ref = ex.reference(ex.builtin_model("mlp", "tiny"), 1)
    eager = _script(tmp_path / "train.py", "--no-compile", cache=tmp_path / "cache")
    assert eager.returncode == 0, eager.stderr[-2000:]
    assert f"step 1/1: loss {ref.losses[0]:.4f}" in eager.stdout
    assert not _files(tmp_path / "cache")
