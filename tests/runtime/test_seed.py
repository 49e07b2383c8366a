"""Seeded real runs: dropout draws from the run's seed, by rows and op, not by placement."""

from __future__ import annotations

import pytest
import torch
from builders import dropout_mlp_graph

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.runtime import RankPool
from explorer.runtime.stage import draw_seed

STEPS, WARMUP = 2, 1


@pytest.fixture(scope="module")
def dropout_graph():
    return dropout_mlp_graph()


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's runs (a rank that ran one seed and plan runs the
    next: what it draws must come from the run's seed, not from what ran before)."""
    with RankPool() as ranks:
        yield ranks


def _plans(graph):
    cl = ex.Cluster.cpu(2, measure=False)
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    half = {nm: int(k >= len(ops) // 2) for k, nm in enumerate(ops)}
    one = dict.fromkeys(ops, 0)
    return {
        "single": ex.Plan.single(graph, "cpu:0"),
        "single-2mb": ex.Plan.single(graph, "cpu:0", micro_batches=2),
        "data-parallel": ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1")], one),
        "pipeline": ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)], half),
        "pipeline-2mb": ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)], half,
                                                micro_batches=2),
    }, cl


def _losses(graph, plan, pool, seed=0):
    m = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False, timeout_s=120,
               seed=seed, pool=pool)
    assert m.seed == seed
    return m.losses


def test_draws_depend_on_rows_and_op_only():
    seeds = {draw_seed(0, s, b, n) for s in range(3) for b in range(4) for n in range(5)}
    assert len(seeds) == 60 and all(0 <= x < 2**63 for x in seeds)
    assert draw_seed(0, 1, 2, 3) == draw_seed(0, 1, 2, 3) != draw_seed(1, 1, 2, 3)


def test_a_bad_seed_is_refused(dropout_graph):
    with pytest.raises(ExplorerError, match="seed must be a whole number"):
        ex.run(dropout_graph, plan=ex.Plan.single(dropout_graph, "cpu:0"), seed=-1)


@pytest.mark.slow
def test_seeded_runs_repeat_bit_for_bit(dropout_graph, pool):
    """Every plan repeats its losses exactly under the same seed; a placement draws what one
    device cutting the batch into as many blocks draws (replicas differ, as their rows do)."""
    plans, _ = _plans(dropout_graph)
    got = {}
    for name, plan in plans.items():
        got[name] = _losses(dropout_graph, plan, pool)
        assert _losses(dropout_graph, plan, pool) == got[name], name  # bit for bit
    assert _losses(dropout_graph, plans["single"], pool, seed=1) != got["single"]
    torch.testing.assert_close(torch.tensor(got["pipeline"]), torch.tensor(got["single"]))
    for name in ("data-parallel", "pipeline-2mb"):
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(got["single-2mb"]))
    # two blocks draw different masks: the loss differs from one block of the whole batch
    assert got["single-2mb"] != got["single"]
