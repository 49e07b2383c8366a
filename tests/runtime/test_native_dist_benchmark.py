"""benchmarks/native_dist.py: its pieces (the model cut in two, the plans, the same-start check)
and a ``--quick`` run end to end, so the benchmark keeps running as the runtime changes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import explorer as ex

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def nd():
    """benchmarks/native_dist.py as a module (benchmarks/ is not a package; its scripts
    import _common from beside them)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("native_dist", BENCH / "native_dist.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["native_dist"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    yield module
    sys.modules.pop("native_dist", None)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_two_halves_compute_the_whole_model(nd, name):
    bm = ex.builtin_model(name, "small")
    cut = nd.cut_in_two(name, bm.module)
    x = bm.example_inputs[0]
    with torch.no_grad():
        bm.module.eval()  # BatchNorm's running statistics: the same for both
        whole = bm.module(x)
        halves = cut.back(cut.front(x))
    assert torch.equal(whole, halves)
    params = {id(p) for p in bm.module.parameters()}
    split = [p for h in (cut.front, cut.back) for p in h.parameters()]
    assert len(split) == len(params) and {id(p) for p in split} == params


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_plans_cut_where_the_reference_does(nd, name):
    bm = ex.builtin_model(name, "small")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    start = nd.cut_in_two(name, bm.module).back_starts_at
    pipe = nd.plan_for("1F1B pipeline", graph, name, bm.module)
    assert (pipe.micro_batches, pipe.schedule, len(pipe.stages)) == (4, "1f1b", 2)
    ops = [n for n in graph.nodes if n.kind == "op"]
    stages = [pipe.stage_of(n.name) for n in ops]
    first_back = next(k for k, n in enumerate(ops)
                      if n.module_path == start or n.module_path.startswith(start + "."))
    assert stages == [0] * first_back + [1] * (len(ops) - first_back)
    assert pipe.stage_of(graph.loss) == 1
    zero = nd.plan_for("ZeRO-3", graph, name, bm.module)
    assert zero.stages == (nd.DEVICES,) and zero.settings_of(0).zero == 3
    dp = nd.plan_for("data parallel", graph, name, bm.module)
    assert dp.stages == (nd.DEVICES,) and dp.settings_of(0).zero == 0
    assert nd.chosen_runtime("auto") == "segments"
    assert nd.chosen_runtime("ops") == "ops"


def test_the_same_start_check_catches_other_weights_or_losses(nd):
    bm = ex.builtin_model("gpt", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    batch = [*bm.example_inputs, *bm.targets]
    rebuilt = ex.builtin_model("gpt", "tiny")
    same = nd.start_fingerprint(rebuilt.module.named_parameters(), batch)
    assert nd.graph_fingerprint(graph) == same
    assert nd.check_same_start("c", same, same, 2.5, 2.5) == 0.0
    with torch.no_grad():
        rebuilt.module.lm_head.weight[0, 0] += 1e-3
    other = nd.start_fingerprint(rebuilt.module.named_parameters(), batch)
    with pytest.raises(nd.NotSameWork, match="weights or batch differ"):
        nd.check_same_start("c", same, other, 2.5, 2.5)
    with pytest.raises(nd.NotSameWork, match="first losses differ"):
        nd.check_same_start("c", same, same, 2.5, 2.5001)
    with pytest.raises(nd.NotSameWork, match="first losses differ"):
        nd.check_same_start("c", same, same, float("nan"), 2.5)


@pytest.mark.slow
def test_a_quick_run_writes_every_case(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # (gpt only: resnet's halves and plans are checked above without running them)
    p = subprocess.run([sys.executable, str(BENCH / "native_dist.py"), "--quick",
                        "--models", "gpt", "--results", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((tmp_path / "native_dist.json").read_text())
    assert rec["command"].startswith("python benchmarks/native_dist.py --quick")
    rows = rec["rows"]
    assert [(r["model"], r["case"]) for r in rows] == [
        ("gpt", c) for c in ("data parallel", "1F1B pipeline", "ZeRO-3",
                             "native script, data parallel", "native script, 1F1B pipeline",
                             "native script, ZeRO-3")]
    for r in rows:
        assert r["size"] == "small" and r["steps each"] == 2
        assert r["runtime"] in ("ops", "segments")
        assert r["explorer ms"] > 0 and r["reference ms"] > 0
        within = r["ratio"] <= r["target"] and (
            not r["case"].startswith("native script") or 1 / r["ratio"] <= r["target"])
        assert r["met"] == ("yes" if within else "no")
        assert float(r["loss gap"]) <= 1e-5
    assert {r["runtime"] for r in rows} == {"segments"}
