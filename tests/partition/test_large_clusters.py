"""Every partitioner on clusters at the device limit: a plan or a clear refusal, bounded work.

The work is counted, never timed: the look-ups of links and collectives a search makes
(``Cluster.link``, ``CostModel.transfer_s``, ``CostModel.allreduce_s``) on 512 and on 4,096
identical GPUs, and the devices the op-level placers build their tables over.
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import pytest
from builders import cluster, costs, graph

from explorer.cli.commands import plan_rows
from explorer.core.errors import PlanError
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition import algorithms, bounds, partition
from explorer.partition.pipeline_dp import stage_cost_table
from explorer.partition.pipeline_dp.build import allowed_replicas, dp_positions
from explorer.partition.pipeline_dp.solver import solve_stages
from explorer.partition.search import driver
from explorer.partition.wap import swept_counts

NAMES = algorithms()
SMALL, LARGE = 512, 4096
OP_LEVEL = ("m-etf", "m-sct", "m-topo", "pardnn")


@functools.cache
def setup(n_devices: int):
    """A 40-op layered graph (batch 8) on ``n_devices`` H100s, with roofline costs."""
    g = layered_dag(40, width=2, seed=1, batch_size=8)
    cl = Cluster.preset(f"{n_devices}xH100")
    return g, cl, roofline_costs(g, cl)


def counted_work(monkeypatch, fn) -> int:
    """How many link and collective look-ups ``fn()`` makes (a plan or a PlanError)."""
    counts: collections.Counter = collections.Counter()
    for cls, name in ((Cluster, "link"), (CostModel, "transfer_s"),
                      (CostModel, "allreduce_s")):
        orig = getattr(cls, name)

        def counting(*args, _orig=orig, _name=name, **kwargs):
            counts[_name] += 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(cls, name, counting)
    try:
        fn()
    except PlanError:
        pass
    monkeypatch.undo()
    return sum(counts.values())


class TestAtTheDeviceLimit:
    @pytest.mark.parametrize("name", NAMES)
    def test_a_valid_plan_or_a_refusal_saying_what_to_use(self, name):
        g, cl, c = setup(LARGE)
        try:
            plan = partition(g, cl, c, name)
        except PlanError as exc:
            assert "use " in str(exc), str(exc)
            return
        plan.validate(g, cl)
        assert 1 <= len(plan.devices) <= len(cl)

    @pytest.mark.parametrize("name", NAMES)
    def test_work_grows_at_most_with_the_device_count(self, name, monkeypatch):
        """8 x the devices, at most 8 x the look-ups (the old searches grew as the square
        of the device count, or its cube); most do the same work on both."""
        small, large = (counted_work(monkeypatch, lambda n=n: partition(*setup(n), name))
                        for n in (SMALL, LARGE))
        assert large <= (LARGE // SMALL) * max(small, 1), (small, large)

    @pytest.mark.parametrize("name", OP_LEVEL)
    def test_op_level_placers_use_as_many_devices_on_both(self, name, monkeypatch):
        """Their tables (devices^2 links) are built over the same devices on 512 and 4,096
        GPUs: at most as many as the graph has ops."""
        seen: list[int] = []
        build = driver.op_problem

        def recording(graph_, cluster_, costs_, device_ids, *args, **kwargs):
            seen.append(len(device_ids))
            return build(graph_, cluster_, costs_, device_ids, *args, **kwargs)

        monkeypatch.setattr(driver, "op_problem", recording)
        sizes = []
        for n in (SMALL, LARGE):
            seen.clear()
            partition(*setup(n), name)
            sizes.append(max(seen))
        g = setup(LARGE)[0]
        assert sizes[0] == sizes[1] <= max(bounds.FULL_SEARCH_DEVICES, bounds.op_count(g))

    def test_wap_sweeps_powers_of_two_beyond_64_devices(self):
        assert swept_counts(8) == list(range(1, 9))
        assert swept_counts(64) == list(range(1, 65))
        assert swept_counts(4096) == [2**i for i in range(13)]
        assert swept_counts(100) == [1, 2, 4, 8, 16, 32, 64, 100]
        g, cl, c = setup(LARGE)
        plan = partition(g, cl, c, "wap", algorithms=("data-parallel", "even-layers"))
        assert [p["k"] for p in plan.options["curve"]] == swept_counts(LARGE)


def _memory_hungry():
    """300 devices of 300 KiB and a 100-op chain whose every op holds 64 KiB of weights
    (256 KiB with gradient and Adam state): its memory needs more than 80 of the devices."""
    spec = []
    for i in range(100):
        spec.append((f"w{i}", "param", [], 1 << 16))
        spec.append((f"op{i}", "op", [f"w{i}"] + ([f"op{i - 1}"] if i else []), 1024))
    g = graph(spec)
    cl = cluster(300, latency_s=1e-6, bandwidth=1e10, memory=300 << 10)
    return g, cl, costs(g, cl, {f"op{i}": 1e-3 for i in range(100)},
                        {f"op{i}": 2e-3 for i in range(100)})


class TestRefusedBeforeTheWork:
    @pytest.mark.parametrize("name", [*OP_LEVEL, "min-comm"])
    def test_memory_beyond_the_budget_is_refused_naming_what_to_use(self, name, monkeypatch):
        g, cl, c = _memory_hungry()
        monkeypatch.setattr(bounds, "OP_WORK_BUDGET", 1000)  # 200 nodes x 5 devices at most
        placed: list[int] = []
        monkeypatch.setattr(driver, "op_problem", lambda *a, **k: placed.append(1))
        with pytest.raises(bounds.SearchTooLarge, match="use degrees or pipeline-dp"):
            partition(g, cl, c, name)
        assert not placed  # refused before any placement was built

    def test_plan_all_shows_a_refused_algorithm_as_skipped(self, monkeypatch):
        g, cl, c = _memory_hungry()
        monkeypatch.setattr(bounds, "OP_WORK_BUDGET", 1000)
        rows = plan_rows(g, cl, c, ["m-etf"], {})
        assert rows[0][1] is None and rows[0][2].startswith("skipped: m-etf: not run:")


class TestPipelineDpPositions:
    def test_the_reachable_positions_give_the_same_split_as_all(self):
        """The DP over the positions its stages can reach finds what it finds over all."""
        g, _, _ = setup(SMALL)
        cl = Cluster.preset("200xH100")
        c = roofline_costs(g, cl)
        ops = g.layers(None)
        layers = [[i for layer in ops[j:j + 8] for i in layer] for j in range(0, len(ops), 8)]
        reps = allowed_replicas(g.batch_size, len(cl), 1, True, True)
        reach = dp_positions(len(layers), len(cl), reps)
        assert reach == 5 * 8 < len(cl)
        full = stage_cost_table(g, c, cl.ids, layers, 1, "1f1b", "adam", wide=True)
        part = stage_cost_table(g, c, cl.ids[:reach], layers, 1, "1f1b", "adam", wide=True)
        a, b = solve_stages(full), solve_stages(part)
        assert a.stages == b.stages and a.score_s == b.score_s
        assert np.isfinite(a.score_s)
