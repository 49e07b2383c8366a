"""benchmarks/published.py: published runs re-created as plans, predicted or said not
expressible, and recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import published


def test_a_published_run_is_its_parallelism_and_megatrons_flops():
    run = next(r for r in published.RUNS if r.name == "megatron-70b")
    assert (run.data, run.micro_batches) == (48, 8)  # 768 / (8 x 2); 384 / 48 of one sequence
    assert run.parallelism == "DP48 TP8 PP2 SP async TP ZeRO1 fused kernels"
    llama = next(r for r in published.RUNS if r.name == "dgxc-llama3-70b")
    assert (llama.data, llama.micro_batches) == (2, 64)  # 64 / (4 x 4 x 2); 128 / 2
    assert llama.parallelism == "DP2 TP4 PP4 CP2 VP5 SP async TP ZeRO1 fused kernels"
    mpt = next(r for r in published.RUNS if r.name == "foundry-mpt-7b")  # FSDP, eager
    assert (mpt.parallelism, mpt.kernels) == ("DP8 TP1 PP1 FSDP", "eager")
    small = next(r for r in published.RUNS if r.name == "megatron-1.7b").model
    h, s, layers, v = 2048, 4096, 24, 131072
    assert published.megatron_flops(small, 1) == pytest.approx(
        72 * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h)))


def test_runs_are_predicted_against_their_published_figure(tmp_path, capsys):
    rc = published.main(["--rows", "megatron-1.7b,dgxc-llama3-8b", "--results",
                         str(tmp_path), "--no-search"])
    assert rc == 0
    rows = {r["run"]: r for r in json.loads((tmp_path / "published.json").read_text())["rows"]}
    mega = rows["megatron-1.7b"]
    assert mega["published"] == "408.8 TFLOP/s/GPU" and mega["predicted"].endswith("TFLOP/s/GPU")
    predicted = float(mega["predicted"].split()[0].replace(",", ""))
    assert mega["error"] == f"{predicted / 408.8 - 1:+.1%}"
    assert 0 < float(mega["MFU"].rstrip("%")) < 100 and mega["fits"] == "yes"
    llama = rows["dgxc-llama3-8b"]  # (context parallelism: each sequence over 2 GPUs)
    assert llama["parallelism"] == "DP4 TP1 PP1 CP2 ZeRO1 fused kernels"
    assert llama["predicted"].endswith("tokens/s/GPU") and llama["search"].startswith("not run")
    assert "2 of 2 runs predicted" in capsys.readouterr().out


def test_unknown_rows_are_refused_with_the_known_names():
    with pytest.raises(SystemExit):
        published.main(["--rows", "gpt-5"])
