"""The ``explorer`` command line, run in-process (and once through the installed entry point)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import pytest

import explorer as ex
import explorer.devices.cluster as cl
from explorer.cli import commands
from explorer.cli.commands import main
from explorer.core.plan import Plan
from explorer.partition.degrees import build_space, candidate_plan, enumerate_candidates
from explorer.platforms.cpu import host as cpu_host

PLAN = ["plan", "--model", "mlp", "--size", "tiny", "--quiet"]
BASELINES = ["balanced-params", "data-parallel", "even-layers", "single"]


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """A profile cache for this module, empty at its start: cpu:2 is measured once (seconds)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def isolated(module_cache, monkeypatch):
    """The module's profile cache, and nominal CPU-rank numbers instead of measuring them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(module_cache))
    monkeypatch.setattr(cpu_host, "host_profile", lambda measure: cpu_host.nominal_profile())


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(table: str) -> dict[str, list[str]]:
    """The rows of a printed table under its ``----`` line, by first cell (best mark "*" cut)."""
    lines = table.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("---")) + 1
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells[2:] if cells[1:2] == ["*"] else cells[1:]
    return rows


def _mlp_graph() -> ex.OpGraph:
    bm = ex.builtin_model("mlp", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=bm.name)


class TestListings:
    def test_models(self, capsys):
        rc, out, _ = _run(capsys, "models", "--size", "tiny")
        assert rc == 0
        rows = _rows(out)
        assert sorted(rows) == ex.model_names()
        assert rows["mlp"][:3] == ["tiny", "0.01M", "8x32"]

    def test_models_json(self, capsys):
        rc, out, _ = _run(capsys, "models", "--size", "tiny", "--json")
        assert rc == 0
        models = json.loads(out)
        assert [m["name"] for m in models] == ex.model_names()
        assert {m["size"] for m in models} == {"tiny"}

    def test_algorithms(self, capsys):
        rc, out, _ = _run(capsys, "algorithms")
        assert rc == 0
        rows = _rows(out)
        assert sorted(rows) == ex.algorithms()
        assert "k=None," in " ".join(rows["even-layers"])

    def test_devices(self, capsys):
        rc, out, _ = _run(capsys, "devices", "--devices", "4xH100")
        assert rc == 0
        lines = out.splitlines()
        assert lines[0] == "Cluster 4xH100: 4 devices"
        assert lines[1].split()[:2] == ["id", "name"]
        assert [line.split()[0] for line in lines[2:6]] == ["H100:0", "H100:1", "H100:2",
                                                             "H100:3"]
        assert "80.0 GiB" in lines[2]
        assert lines[6].startswith("links: 5.0 us + bytes / 450.0 GB/s")

    def test_presets(self, capsys):
        rc, out, _ = _run(capsys, "devices", "--presets")
        assert rc == 0
        assert out.split() == cl.Cluster.presets()


class TestPlan:
    @pytest.mark.slow
    def test_a_row_per_algorithm_with_step_ms(self, capsys):
        rc, out, err = _run(capsys, *PLAN, "--devices", "cpu:2", "--algorithm", "all")
        assert rc == 0, err
        assert out.startswith("mlp (tiny): 6 ops,")
        assert "devices: cpu:2" in out
        rows = _rows(out)
        assert sorted(rows) == ex.algorithms()
        for name in BASELINES:
            assert float(rows[name][0]) > 0
            assert rows[name][-1] == "yes"
        (best,) = [line.split()[0] for line in out.splitlines() if " * " in line]
        assert out.endswith(f"\n* fastest plan that fits: {best}\n")

    @pytest.mark.slow
    def test_json_with_a_plan_per_algorithm_and_out(self, capsys, tmp_path):
        path = tmp_path / "plan.json"
        rc, out, err = _run(capsys, *PLAN, "--devices", "cpu:2", "--algorithm", "all", "--json",
                            "--out", str(path))
        assert rc == 0, err
        d = json.loads(out)
        assert (d["model"], d["size"], d["cluster"]) == ("mlp", "tiny", "cpu:2")
        assert [p["algorithm"] for p in d["plans"]] == ex.algorithms()
        plans = {p["algorithm"]: p for p in d["plans"]}
        assert plans["single"]["stages"] == [["cpu:0"]]
        assert plans["data-parallel"]["stages"] == [["cpu:0", "cpu:1"]]
        for name in BASELINES:
            assert plans[name]["step_s"] > 0
            assert plans[name]["fits"] is True
        assert d["saved"] == str(path)
        best = min((p for p in d["plans"] if p.get("fits")), key=lambda p: p["step_s"])
        assert d["best"] == best["algorithm"]
        graph = _mlp_graph()
        assert d["graph"]["fingerprint"] == graph.fingerprint
        plan = Plan.load(path, graph, cl.Cluster.cpu(2, measure=False))
        assert plan.algorithm.startswith(d["best"])
        assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no .tmp left behind

    def test_out_says_where_it_saved(self, capsys, tmp_path):
        path = tmp_path / "p.json"
        rc, out, _ = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "single",
                          "--out", str(path))
        assert rc == 0
        assert f"* fastest plan that fits: single (saved to {path})" in out
        assert Plan.load(path, _mlp_graph()).stages == (("T4:0",),)

    def test_plan_that_does_not_fit(self, capsys, monkeypatch):
        real = commands.parse_devices

        def no_memory(spec):
            c = real(spec)
            return dataclasses.replace(c, devices=tuple(
                dataclasses.replace(d, memory_bytes=0) for d in c.devices))

        monkeypatch.setattr(commands, "parse_devices", no_memory)
        rc, out, _ = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "single")
        assert rc == 0
        line = next(line for line in out.splitlines() if line.startswith("single"))
        assert line.split("NO: ")[1] == \
            "T4:0 needs 0.1 MiB but has 0.0 MiB (over by 0.1 MiB)"
        assert "fastest plan that fits" not in out

    def test_nothing_fits_so_nothing_is_saved(self, capsys, monkeypatch, tmp_path):
        real = commands.parse_devices
        monkeypatch.setattr(commands, "parse_devices", lambda spec: dataclasses.replace(
            real(spec), devices=tuple(dataclasses.replace(d, memory_bytes=0)
                                      for d in real(spec).devices)))
        rc, _, err = _run(capsys, *PLAN, "--devices", "T4", "--algorithm", "single",
                          "--out", str(tmp_path / "p.json"))
        assert rc == 2
        assert err == "error: no plan fits the devices' memory; nothing was saved\n"
        assert not (tmp_path / "p.json").exists()

    def test_settings_reach_the_partitioner(self, capsys):
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "even-layers",
                            "--micro-batches", "2", "--schedule", "1f1b", "--json")
        assert rc == 0, err
        (p,) = json.loads(out)["plans"]
        assert (p["micro_batches"], p["schedule"]) == (2, "1f1b")

    def test_language_models_show_tokens_per_second_and_mfu(self, capsys):
        gpt = ["plan", "--model", "gpt", "--size", "tiny", "--quiet", "--devices", "2xH100",
               "--algorithm", "data-parallel"]
        rc, out, err = _run(capsys, *gpt, "--json")
        assert rc == 0, err
        (p,) = json.loads(out)["plans"]
        rate = p["throughput"]
        assert rate["tokens_per_step"] == 8 * 16
        assert rate["tokens_per_s_per_device"] == pytest.approx(8 * 16 / p["step_s"] / 2)
        assert 0 < rate["mfu"] < 1
        rc, out, err = _run(capsys, *gpt)
        assert rc == 0, err
        assert "tokens/s/device (MFU)" in out
        assert f"{rate['tokens_per_s_per_device']:,.0f} ({rate['mfu']:.1%})" in out
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xH100", "--algorithm", "single",
                            "--json")
        assert json.loads(out)["plans"][0]["throughput"] is None  # an MLP reads no tokens

    def test_presets_priced_as_compiled_kernels(self, capsys):
        llama = ["plan", "--model", "llama", "--size", "tiny", "--quiet", "--algorithm",
                 "data-parallel"]
        steps = {}
        for kernels in ("eager", "compiled"):
            rc, out, err = _run(capsys, *llama, "--devices", "2xH100", "--kernels", kernels,
                                "--json")
            assert rc == 0, err
            got = json.loads(out)
            assert got["kernels"] == kernels
            steps[kernels] = got["plans"][0]["step_s"]
        assert steps["compiled"] < steps["eager"]
        rc, out, err = _run(capsys, *llama, "--devices", "2xH100", "--kernels", "compiled")
        assert rc == 0 and "devices: 2xH100, ops priced as compiled (fused) kernels" in out
        # a measured device times what runs: refused with what to do instead
        rc, _, err = _run(capsys, *llama, "--devices", "cpu:1", "--kernels", "compiled")
        assert rc == 2 and "cpu:0 is measured" in err and "ex.run(..., compile=True)" in err

    def test_a_published_shape_plans_at_any_batch_and_peaks_read_per_stage(self, capsys):
        """A published shape is captured on fake tensors: a batch far over this machine's
        memory is fine; on 16 GPUs the peaks are each stage's highest."""
        rc, out, err = _run(capsys, "plan", "--model", "llama-7b", "--batch-size", "64",
                            "--quiet", "--devices", "16xH100", "--algorithm", "even-layers",
                            "--precision", "bf16")
        assert rc == 0, err
        row = next(line for line in out.splitlines() if line.startswith("even-layers"))
        assert "max per stage: " in row and row.count(" / ") == 15  # 16 stages

    def test_tensor_splits_the_stages_it_divides(self, capsys):
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm",
                            "data-parallel", "--tensor", "2", "--json")
        assert rc == 0, err
        (p,) = json.loads(out)["plans"]
        assert p["tensor"] == [2] and p["stages"] == [["T4:0", "T4:1"]]
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "single",
                            "--tensor", "2", "--json")
        assert rc == 1 and "--tensor 2 divides the devices of none" in err

    def test_sequence_parallel_needs_a_tensor_split_and_lowers_memory(self, capsys):
        gpt = ["plan", "--model", "gpt", "--size", "tiny", "--quiet", "--devices", "2xT4",
               "--algorithm", "data-parallel", "--tensor", "2", "--json"]
        plans = []
        for extra in ([], ["--sequence-parallel"]):
            rc, out, err = _run(capsys, *gpt, *extra)
            assert rc == 0, err
            plans += json.loads(out)["plans"]
        assert [p["memory_settings"] for p in plans] == [["tensor 2"], ["tensor 2, sequence"]]
        assert (plans[1]["peak_memory_by_category"]["T4:0"]["activations"]
                < plans[0]["peak_memory_by_category"]["T4:0"]["activations"])
        rc, _, err = _run(capsys, *gpt[:-3], "--sequence-parallel", "--json")
        assert rc == 1 and "this plan has no tensor-parallel stage: add --tensor N" in err
        # async tensor parallelism: the same memory, collectives beside the matmuls on GPUs
        rc, out, err = _run(capsys, *gpt, "--sequence-parallel", "--async-tensor")
        assert rc == 0, err
        (overlapped,) = json.loads(out)["plans"]
        assert overlapped["memory_settings"] == ["tensor 2, sequence, async tensor"]
        assert overlapped["step_s"] < plans[1]["step_s"]
        assert overlapped["peak_bytes"] == plans[1]["peak_bytes"]
        rc, _, err = _run(capsys, *gpt, "--async-tensor")
        assert rc == 1 and "--async-tensor pipelines the all-gathers" in err
        rc, out, err = _run(capsys, *gpt[:-5], "--algorithm", "degrees", "--async-tensor", "--json")
        assert rc == 0, err

    def test_context_parallelism_is_planned_and_refused_for_real_steps(self, capsys):
        llama = ["--model", "llama", "--size", "tiny", "--quiet", "--devices", "4xH100",
                 "--algorithm", "data-parallel"]
        rc, out, err = _run(capsys, "plan", *llama, "--context", "2", "--json")
        assert rc == 0, err
        (p,) = json.loads(out)["plans"]
        assert p["memory_settings"] == ["context 2"] and p["degrees"]["text"] == "2x1x1 cp 2"
        assert (p["replicas"], p["context"]) == ([2], [2])
        rc, _, err = _run(capsys, "plan", *llama, "--context", "8")
        assert rc == 1 and "--context 8 x the tensor degree divides the devices of none" in err
        rc, _, err = _run(capsys, "run", *llama[:-5], "--devices", "cpu:2", "--algorithm",
                          "data-parallel", "--context", "2")
        assert rc == 2 and "context-parallel stages do not run yet" in err

    def test_memory_settings_apply_to_every_stage_and_memory_comes_by_category(self, capsys):
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "data-parallel",
                            "--json")
        assert rc == 0, err
        (plain,) = json.loads(out)["plans"]
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "data-parallel",
                            "--zero", "3", "--recompute", "selective", "--precision", "bf16",
                            "--json")
        assert rc == 0, err
        (p,) = json.loads(out)["plans"]
        assert p["memory_settings"] == ["zero 3, recompute selective, bf16"]
        assert plain["memory_settings"] == ["default"]
        for d, m in p["peak_memory_by_category"].items():
            before = plain["peak_memory_by_category"][d]
            assert set(m) == {"parameters", "gradients", "optimizer_state", "activations",
                              "gathered", "buffers", "workspace", "total"}
            assert m["total"] == p["peak_bytes"][d] == sum(v for k, v in m.items()
                                                          if k != "total")
            assert m["parameters"] < before["parameters"]  # sharded over the two replicas
            assert m["optimizer_state"] < before["optimizer_state"]
            assert m["gathered"] > 0 == before["gathered"]

    def test_zero_on_one_device_says_it_changes_nothing(self, capsys):
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "single",
                            "--zero", "1", "--json")
        assert rc == 0, err
        (p,) = json.loads(out)["plans"]
        assert p["memory_settings"] == ["zero 1"]
        assert p["notes"][-1] == ("ZeRO 1 changes nothing on stage(s) 0: one device each, "
                                  "nothing to shard over")

    def test_memory_flags_are_checked(self, capsys):
        with pytest.raises(SystemExit):
            main([*PLAN, "--zero", "4"])
        assert "invalid choice" in capsys.readouterr().err

    def test_bad_setting_is_an_error_row(self, capsys, tmp_path):
        """Every row an error: exit 1, the errors on stderr, nothing saved."""
        rc, out, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "single",
                            "--optimizer", "lion", "--out", str(tmp_path / "p.json"))
        assert rc == 1
        line = next(line for line in out.splitlines() if line.startswith("single"))
        assert line.endswith("error: unknown optimizer 'lion'; choose one of sgd, momentum, "
                             "adam, adamw")
        assert err == ("error: no algorithm made a plan:\n  single: unknown optimizer 'lion'; "
                       "choose one of sgd, momentum, adam, adamw\n")
        assert not (tmp_path / "p.json").exists()
        rc, out, _ = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "single",
                          "--optimizer", "lion", "--json")
        assert rc == 1 and json.loads(out)["plans"][0]["error"].startswith("unknown optimizer")

    @pytest.mark.parametrize("algorithm", ["degrees", "pase"])
    def test_degrees_in_the_table_and_the_json(self, capsys, algorithm):
        rc, out, err = _run(capsys, *PLAN, "--devices", "4xT4", "--algorithm", algorithm)
        assert rc == 0, err
        header = next(line for line in out.splitlines() if line.startswith("algorithm"))
        assert "dp x tp x pp" in header and "micro-batches" in header
        rc, out, err = _run(capsys, *PLAN, "--devices", "4xT4", "--algorithm", algorithm,
                            "--json")
        (p,) = json.loads(out)["plans"]
        deg = p["degrees"]
        assert deg["pp"] == len(p["stages"]) and deg["tp"] == max(p["tensor"])
        assert deg["dp"] == max(p["replicas"])
        assert deg["text"].endswith(f"x{deg['pp']}")

    def test_degrees_takes_the_schedule_and_micro_batches_given(self, capsys, monkeypatch):
        seen = []
        real = ex.partition

        def spy(graph, cluster, costs, name, **opts):
            seen.append(opts)
            return real(graph, cluster, costs, name, **opts)

        monkeypatch.setattr(ex, "partition", spy)
        rc, _, err = _run(capsys, *PLAN, "--devices", "4xT4", "--algorithm", "degrees",
                          "--micro-batches", "2", "--schedule", "gpipe", "--json")
        assert rc == 0, err
        assert seen[0]["micro_batches"] == 2 and seen[0]["schedules"] == ["gpipe"]

    @pytest.mark.slow
    def test_run_a_tensor_parallel_degrees_plan(self, capsys, tmp_path):
        """A plan of the degrees search's space with a tensor split runs on 2 CPU ranks."""
        graph = _mlp_graph()
        cluster = cl.Cluster.cpu(2, measure=False)
        costs = ex.profile(graph, cluster, progress=False)
        space = build_space(graph, costs, cluster.ids, graph.layers(), "adam", [2], None,
                            ("1f1b",), {}, 1.0)
        cand = next(c for c in enumerate_candidates(space, costs, graph.batch_size)
                    if c.tp == 2)
        plan = candidate_plan(graph, space, cand, "adam", {}, {})
        path = tmp_path / "plan.json"
        dataclasses.replace(plan, model={"builtin": "mlp", "size": "tiny",
                                         "batch_size": graph.batch_size}).save(path)
        rc, out, err = _run(capsys, "run", "--plan", str(path), "--devices", "cpu:2",
                            "--steps", "1", "--warmup", "0", "--json", "--quiet", "--force")
        assert rc == 0, err
        d = json.loads(out)
        assert d["plan"]["options"]["tp"] == 2
        assert d["plan"]["stage_settings"][0]["tensor"] == 2
        assert d["losses"] and all(x == x for x in d["losses"])  # numbers, not NaN

    def test_the_plan_records_how_its_model_was_built(self, capsys, tmp_path):
        """A saved plan says which built-in model, size and batch it is for; export rebuilds
        that model without being told again, unless told otherwise."""
        path = tmp_path / "plan.json"
        rc, _, err = _run(capsys, *PLAN, "--devices", "2xT4", "--algorithm", "even-layers",
                          "--batch-size", "4", "--out", str(path))
        assert rc == 0, err
        plan = Plan.load(path)
        assert plan.model == {"builtin": "mlp", "size": "tiny", "batch_size": 4}
        assert json.loads(path.read_text())["model"] == plan.model
        rc, _, err = _run(capsys, "export", "--plan", str(path), "--out",
                            str(tmp_path / "train.py"))
        assert rc == 0, err
        assert (tmp_path / "train.py").exists()
        # another size than the plan's is another graph: refused, as before
        rc, _, err = _run(capsys, "export", "--plan", str(path), "--out",
                          str(tmp_path / "other.py"), "--size", "small")
        assert rc == 2 and "made for graph" in err


class TestErrors:
    @pytest.mark.parametrize(("args", "message"), [
        (["--model", "nope", "--size", "tiny"], "error: unknown model 'nope'; choose one of:"),
        (["--model", "mlp", "--size", "huge"], "error: unknown size 'huge'"),
        (["--model", "mlp", "--size", "tiny", "--algorithm", "nope"],
         "error: unknown algorithm 'nope'; choose one of:"),
        (["--model", "mlp", "--size", "tiny", "--devices", "3xFOO"],
         "error: unknown device spec '3xFOO'"),
        (["--model", "mlp", "--size", "tiny", "--devices", "cpu:x"],
         "error: bad device spec 'cpu:x'"),
        (["--model", "mlp", "--size", "tiny", "--out", "/no/such/folder/p.json"],
         "error: cannot save to /no/such/folder/p.json: folder /no/such/folder does not exist"),
    ])
    def test_exit_2_with_a_message(self, capsys, args, message):
        rc, out, err = _run(capsys, "plan", "--quiet", *args)
        assert rc == 2
        assert err.startswith(message)
        assert "Traceback" not in err
        assert out == ""

    @pytest.mark.parametrize("spec,message", [
        ("cpu:100000000", "100000000 CPU ranks are more than this machine can run: at most "),
        ("100000000xH100", "preset '100000000xH100' has 100000000 GPUs, more than the 4,096"),
    ])
    def test_devices_beyond_the_limits(self, capsys, spec, message):
        rc, out, err = _run(capsys, "devices", "--devices", spec)
        assert rc == 2 and out == ""
        assert err.startswith(f"error: {message}")

    def test_unknown_device_spec_for_devices(self, capsys):
        rc, _, err = _run(capsys, "devices", "--devices", "bogus")
        assert rc == 2
        assert err.startswith("error: unknown device spec 'bogus'")

    @pytest.mark.parametrize("value", ["0", "-3", "x"])
    def test_bad_batch_size(self, capsys, value):
        with pytest.raises(SystemExit) as exit_:
            main([*PLAN, "--batch-size", value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "error: argument --batch-size: must be a whole number >= 1" in err
        assert "Traceback" not in err


@pytest.mark.slow
class TestEntryPoint:
    def test_installed_command(self, tmp_path):
        exe = shutil.which("explorer")
        assert exe, "the `explorer` command is not on PATH: pip install -e ."
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
        done = subprocess.run(
            [exe, *PLAN, "--devices", "2xT4", "--algorithm", "single", "--json"],
            capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        (p,) = json.loads(done.stdout)["plans"]
        assert p["stages"] == [["T4:0"]]
