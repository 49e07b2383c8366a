"""How far a profile is, as a widget's status line reads it: one count of runs for the whole
profile, its total known before the first run, and every part that runs counting on it."""

from __future__ import annotations

import dataclasses
import importlib
import re
import types

import pytest

import explorer as ex
from explorer.devices.cluster import Cluster

ops = importlib.import_module("explorer.profiling.ops")
host = importlib.import_module("explorer.profiling.host")
dtensor_probe = importlib.import_module("explorer.profiling.dtensor_probe")
collective_probe = importlib.import_module("explorer.profiling.collective_probe")
checkpoint_probe = importlib.import_module("explorer.profiling.checkpoint_probe")
FAST = {"repeats": 2, "warmup": 1, "progress": False}
COUNT = re.compile(r"^(?P<part>.+): (?P<done>\d+) of (?P<total>\d+) runs$")


@pytest.fixture(scope="module")
def gpt() -> ex.OpGraph:
    bm = ex.builtin_model("gpt", "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")


@pytest.fixture
def runs(monkeypatch, tmp_path):
    """Stand-in runs (nothing started), counted; the host probes stood in for, the model's
    own split runs not; a fresh profile cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    got = []

    def run(graph, plan, pool=None, **kwargs):
        got.append(plan)
        return types.SimpleNamespace(task_s={"fwd:1": 1e-3}, busy_s={}, step_s=1e-2,
                                     busy_samples_s={d: (1e-3,) for d in plan.devices})

    monkeypatch.setattr("explorer.runtime.launch.run", run)
    monkeypatch.setattr(host, "cpu_message_s",
                        lambda cl, pool=None, report=None, runtime=None: 0.0)
    monkeypatch.setattr(dtensor_probe, "dtensor_costs", lambda *a, **kw: {})
    monkeypatch.setattr(collective_probe, "collective_costs", lambda *a, **kw: 0.0)
    monkeypatch.setattr(checkpoint_probe, "checkpoint_costs", lambda *a, **kw: {})
    # (the split runs' two ranks with nominal figures: this host's link is not measured)
    monkeypatch.setattr(dtensor_probe, "Cluster", types.SimpleNamespace(
        cpu=lambda n: Cluster.cpu(n, measure=False)))
    return got


@pytest.fixture
def host2():
    """Two CPU ranks as if this host's link were measured (nothing is)."""
    two = Cluster.cpu(2, measure=False)
    return dataclasses.replace(two, default_link=dataclasses.replace(
        two.default_link, source="measured (stand-in)"))


def counts(said: list[str]) -> list[tuple[str, int, int]]:
    """(part, done, total) of each line that counts runs."""
    return [(m["part"], int(m["done"]), int(m["total"])) for line in said
            if (m := COUNT.match(line))]


def test_every_part_counts_on_one_total_known_from_the_start(gpt, runs, host2):
    said, early = [], []
    ex.profile(gpt, host2, report=said.append, precisions=("bf16",),
               partial=early.append, **FAST)
    got = counts(said)
    totals = {total for _, _, total in got}
    assert totals == {len(runs)}  # one total, from the first line on: every run counted
    done = [d for _, d, _ in got]
    assert done[0] == 0 and done[-1] == len(runs) and done == sorted(done)
    parts = list(dict.fromkeys(p for p, _, _ in got))
    assert [p.split(" ")[0] for p in parts] == ["profiling", "profiling", "contention",
                                                "timing"]
    assert "in bf16" in parts[1] and "split 2 ways" in parts[3]
    for part in parts:  # each part counts its own runs on the shared count
        steps = [d for p, d, _ in got if p == part]
        assert steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 1
    (pre,) = early  # after the whole batch's runs: on the op path, then in segments
    assert (pre.runs_done, pre.runs_total) == (2, len(runs))


def test_runs_a_cache_makes_unnecessary_count_as_done(gpt, runs, host2):
    ex.profile(gpt, host2, **FAST)
    made = len(runs)
    said = []
    ex.profile(gpt, host2, report=said.append, precisions=("bf16",), **FAST)
    got = counts(said)
    # only the bf16 runs are made, counted after the cached ones, on the whole profile's
    # total from the first line
    assert len(runs) == made + 2 * ops.ROUNDS
    assert {t for _, _, t in got} == {made + 2 * ops.ROUNDS}
    assert all(p.endswith("in bf16") for p, _, _ in got)
    timed = ops.timing_runs(gpt)
    assert [d for _, d, _ in got] == list(range(timed, timed + 2 * ops.ROUNDS + 1))
