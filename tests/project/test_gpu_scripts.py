"""benchmarks/gpu_check.py, gpu_presets.py and gpu_strategies.py: their dry runs on CPU write
the results file a lent GPU would, and a second run resumes it without doing any case again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
TIMEOUT_S = 900


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _twice(script: str, out: Path, *args: str) -> dict:
    """Run the dry run twice into ``out``: the second run must skip every case."""
    _run(script, "--dry-run", "--out", str(out), *args)
    first = json.loads(out.read_text())
    assert first["dry_run"] is True
    assert first["runs"][0]["done"] and not first["runs"][0]["not_reached"]
    _run(script, "--dry-run", "--out", str(out), *args)
    second = json.loads(out.read_text())
    assert second["cases"] == first["cases"]
    last = second["runs"][-1]
    assert last["done"] == [] and last["not_reached"] == []
    assert sorted(last["skipped"]) == sorted(first["cases"])
    for case in second["cases"].values():
        assert script in case["command"] and "--dry-run" in case["command"]
        assert "error" not in case, case
    for key in ("nvml_device_name", "driver", "cuda_driver", "torch"):
        assert second["device"][key]
    return second


@pytest.mark.slow
def test_gpu_check_dry_run_writes_results_and_resumes(tmp_path):
    data = _twice("gpu_check.py", tmp_path / "x.json")
    assert data["energy_counter"]
    assert any("NCCL refuses two ranks on one device" in n for n in data["notes"])
    py = data["cases"]["pytest -m gpu"]
    assert py["figure_command"].startswith("python -m pytest -m gpu")
    assert py["returncode"] == 0 and not py["counts"].get("failed")
    if not torch.cuda.is_available():
        assert py["counts"]["skipped"] >= 1
    models = {k: c for k, c in data["cases"].items() if k != "pytest -m gpu"}
    assert {c["dtype"] for c in models.values()} == {"fp32", "bf16"}
    for c in models.values():
        assert c["predicted"]["step_s"] > 0 and c["measured"]["step_s"] > 0
        assert c["measured"]["peak_allocated_bytes"] > 0
        assert c["eager"]["step_s"] > 0
        assert {r["what"] for r in c["compare"]["rows"]} >= {"step time", "peak memory"}
        if not torch.cuda.is_available():  # a CPU rank: NVML measures GPUs only
            assert str(c["measured"]["energy_j"]).startswith("not available")
        # one eager step traced: every graph op found in the trace, host time on the CPU
        trace = c["eager"]["trace"]
        assert "error" not in trace, trace
        assert trace["ops_matched"] > 0 and trace["host_s"] > 0
        if not torch.cuda.is_available():
            assert trace["device_s"] == 0 and trace["kernels"] == 0
        # the step simulated from the trace on two timelines: no shorter than its host's
        # issuing (on the CPU, all of it: no kernels), and set beside the eager step
        assert trace["predicted_step_s"] >= trace["host_s"] > 0
        assert Path(trace["kept"]).is_file()
    figures = {r["figure"] for r in data["rows"]}
    assert "step time from the traced eager step (ms)" in figures


@pytest.mark.slow
def test_gpu_presets_dry_run_writes_results_and_resumes(tmp_path):
    data = _twice("gpu_presets.py", tmp_path / "x.json")
    assert data["datasheet"]["flops_per_s"] > 0
    kinds = {c["kind"] for c in data["cases"].values()}
    assert kinds == {"matmul", "conv2d", "attention", "add", "gelu", "sum", "layernorm",
                     "adam"}
    assert {c["precision"] for c in data["cases"].values()} == {"fp32", "tf32", "bf16"}
    for c in data["cases"].values():
        assert c["predicted_s"] > 0 and c["measured_s"] > 0
        assert c["precision"] != "tf32" or c["kind"] in ("matmul", "conv2d", "attention")
    matmuls = [c for c in data["cases"].values() if c["kind"] == "matmul"]
    assert all(c["flops"] == 2 * c["shape"][0] * c["shape"][1] * c["shape"][2]
               for c in matmuls)
    assert set(data["fits"]) == {f"{c['kind']}/{c['precision']}"
                                 for c in data["cases"].values()}
    for fit in data["fits"].values():
        assert fit["source"].startswith("fitted, measured on ")
        assert fit["overhead_s"] >= 0


@pytest.mark.slow
def test_gpu_strategies_dry_run_writes_results_and_resumes(tmp_path):
    out = tmp_path / "x.json"
    data = _twice("gpu_strategies.py", out, "--models", "mlp,gpt")
    keys = list(data["cases"])
    assert keys[:2] == ["gpt/profile", "gpt/fp32"]  # gpt runs first, its fp32 run before the rest
    settings = {k.split("/", 1)[1] for k in keys if k.startswith("gpt/")}
    assert settings >= {"fp32", "bf16", "fp16", "recompute selective", "recompute full",
                        "zero 3", "zero 3 + recompute full + bf16"}
    assert "mlp/zero 3" not in keys  # the code-path settings run on the first model only
    for key, c in data["cases"].items():
        if key.endswith("/profile"):
            assert c["ops"] > 0 and c["profile_s"] >= 0
            continue
        assert c["predicted"]["step_s"] > 0 and c["presets"]["H100"]["step_s"] > 0
        assert c["measured"]["step_s"] > 0 and c["measured"]["peak_bytes"] > 0
        assert len(c["measured"]["losses"]) == data["warmup"] + data["steps"]
    assert data["cases"]["gpt/bf16"]["plan_settings"] == "bf16"
    assert len(data["rows"]) == len(keys) - 2
    assert all(r["loss within"].endswith("yes") for r in data["rows"]), data["rows"]
    assert any("NCCL refuses two ranks on one device" in n for n in data["notes"])
    _run("gpu_strategies.py", "--report", "--out", str(out))
    assert json.loads(out.read_text())["rows"] == data["rows"]


@pytest.mark.slow
def test_dry_run_never_writes_the_real_results(tmp_path):
    """Without --out a dry run writes a temporary file, not benchmarks/results/."""
    real = BENCH / "results" / "gpu_presets.json"
    before = real.read_bytes() if real.exists() else None
    p = _run("gpu_presets.py", "--dry-run", "--kinds", "add", "--precisions", "fp32")
    written = Path(p.stdout.strip().splitlines()[-1].removeprefix("results: "))
    try:
        assert written.parent != real.parent and written.exists()
    finally:
        written.unlink(missing_ok=True)
    assert (real.read_bytes() if real.exists() else None) == before


@pytest.mark.slow
def test_a_case_killed_midway_is_not_retried_forever(tmp_path):
    """A case marked as started but never finished (its command was killed) becomes an
    error on the next run instead of being run again; --fresh runs everything again."""
    out = tmp_path / "x.json"
    quick = ("--dry-run", "--kinds", "add", "--precisions", "fp32", "--out", str(out))
    _run("gpu_presets.py", *quick)
    data = json.loads(out.read_text())
    killed = next(iter(data["cases"]))
    data["cases"][killed] = {"unfinished": True, "command": "python x", "measured_at": "x"}
    out.write_text(json.dumps(data))
    _run("gpu_presets.py", *quick)
    again = json.loads(out.read_text())
    assert again["runs"][-1]["done"] == []
    assert "did not finish" in again["cases"][killed]["error"]
    assert again["fits"]["add/fp32"]["points"] == len(again["cases"]) - 1
    _run("gpu_presets.py", *quick, "--fresh")
    fresh = json.loads(out.read_text())
    assert len(fresh["runs"]) == 1 and killed in fresh["runs"][0]["done"]
    assert "error" not in fresh["cases"][killed]


@pytest.mark.gpu
def test_presets_measure_on_the_gpu(tmp_path):
    """On a GPU: one op kind measured as its kernels' device time (and with CUDA events),
    the device named by NVML."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "x.json"
    _run("gpu_presets.py", "--kinds", "add", "--precisions", "fp32", "--out", str(out))
    data = json.loads(out.read_text())
    assert not data["device"]["nvml_device_name"].startswith("not available")
    cases = data["cases"].values()
    assert cases and all(c["measured_s"] > 0 for c in cases)
    assert all(c["kernels_s"] == c["measured_s"] and c["events_s"] > 0 for c in cases)
    name = data["device"]["nvml_device_name"]
    assert data["fits"]["add/fp32"]["source"].startswith(f"fitted, measured on {name}, ")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["gpu_check", "gpu_presets"])
def test_report_rewrites_the_committed_summary_unchanged(tmp_path, script):
    """``--report`` needs no GPU: on the committed results it prints the tables and writes
    the same record (the rows docs/gpu.md renders are what the script makes of its cases)."""
    committed = BENCH / "results" / f"{script}.json"
    out = tmp_path / "x.json"
    out.write_text(committed.read_text())
    p = _run(f"{script}.py", "--report", "--out", str(out))
    assert json.loads(out.read_text()) == json.loads(committed.read_text())
    assert "device: " in p.stdout
    rec = json.loads(out.read_text())
    assert rec["rows"] and rec["command"].startswith(f"python benchmarks/{script}.py")
