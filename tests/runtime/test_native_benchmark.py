"""benchmarks/native.py's GPU table: its dry run (the same code path on CPU) end to end, so the
GPU benchmark keeps running as the runtime changes, and ``--gpu`` without a GPU says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "benchmarks" / "native.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_gpu_table_without_a_gpu_says_so(tmp_path):
    proc = subprocess.run([sys.executable, str(NATIVE), "--gpu", "--results", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert "--gpu needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_dry_run_measures_every_column_on_cpu(tmp_path):
    """gpt (tiny) in fp32 and bf16: ex.run's segments and compiled segments, eager and
    torch.compile, one round of two steps each, recorded where --results says; the memory
    columns are empty on CPU (no allocator to ask on the eager side)."""
    proc = subprocess.run([sys.executable, str(NATIVE), "--dry-run", "--results",
                           str(tmp_path)], capture_output=True, text=True, timeout=1500,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "One CPU rank (dry run), single-device plan" in proc.stdout
    rows = json.loads((tmp_path / "native_gpu.json").read_text())["rows"]
    assert [(r["model"], r["size"], r["precision"]) for r in rows] == [
        ("gpt", "tiny", "fp32"), ("gpt", "tiny", "bf16")]
    for r in rows:
        assert r["steps each"] == 2
        for k in ("segments ms", "compiled ms", "eager ms", "torch.compile ms",
                  "segments / eager", "compiled / torch.compile"):
            assert r[k] > 0, k
        assert r["segments MiB"] is None and r["compiled / torch.compile memory"] is None
