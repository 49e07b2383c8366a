"""Rank processes kept for many runs: reused while runs succeed, all ended on a failure or an
interrupt, started afresh for the next run."""

from __future__ import annotations

import pytest

import explorer as ex
from explorer.core.plan import Plan
from explorer.runtime import RankPool, RunFailed
from explorer.runtime import pool as pool_module

# every test here starts rank processes
pytestmark = pytest.mark.slow

FAST = {"steps": 2, "warmup": 1, "progress": False, "timeout_s": 120}


@pytest.fixture(scope="module")
def mlp():
    """The tiny MLP, a plan on one rank and a data-parallel plan on two."""
    bm = ex.builtin_model("mlp", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="mlp")
    pair = Plan.from_assignment(graph, [["cpu:0", "cpu:1"]], dict.fromkeys(range(len(graph)), 0),
                                algorithm="data-parallel", optimizer="adam")
    return graph, Plan.single(graph, "cpu:0", optimizer="adam"), pair


def test_runs_share_the_ranks_until_an_interrupt_ends_them(mlp, monkeypatch):
    graph, single, pair = mlp
    cluster = ex.Cluster.cpu(2, measure=False)
    with RankPool() as pool:
        alone = ex.run(graph, plan=single, cluster=cluster, pool=pool, **FAST)
        both = ex.run(graph, plan=pair, cluster=cluster, pool=pool, **FAST)
        procs = list(pool.procs)
        again = ex.run(graph, plan=single, cluster=cluster, pool=pool, **FAST)
        assert pool.starts == 2 and pool.procs == procs  # rank 1 started when first needed
        fresh = ex.run(graph, plan=single, cluster=cluster, **FAST)
        # as a rank started for the run: same steps, losses, pinning and allocator set-up
        for m in (alone, again):
            assert m.losses == fresh.losses
            assert m.cores == fresh.cores and m.memory_held == fresh.memory_held
            assert set(m.task_s) == set(fresh.task_s)
        assert set(both.busy_s) == {"cpu:0", "cpu:1"}
        assert both.cores["cpu:1"] != both.cores["cpu:0"] or both.cores["cpu:0"] is None

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(pool_module, "watch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ex.run(graph, plan=pair, cluster=cluster, pool=pool, **FAST)
        assert pool.procs == [] and all(p.poll() is not None for p in procs)
        monkeypatch.undo()
        assert ex.run(graph, plan=single, cluster=cluster, pool=pool, **FAST).losses \
            == fresh.losses
        assert pool.starts == 3
        procs = list(pool.procs)
    assert all(p.poll() is not None for p in procs)  # closed with the pool


def test_a_failing_rank_ends_every_rank_of_the_pool(mlp, monkeypatch):
    graph, _, pair = mlp
    monkeypatch.setenv("EXPLORER_FAULT", "1:raise:1")
    with RankPool() as pool:
        with pytest.raises(RunFailed, match=r"rank 1 \(cpu:1\) failed: RuntimeError: "
                                            r"injected failure"):
            ex.run(graph, plan=pair, pool=pool, **FAST)
        assert pool.procs == [] and pool.folder is None
