"""WAP: the device-count sweep, its curve, the choice it makes and why."""

from __future__ import annotations

import pytest
from builders import cluster

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph, OpNode
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, roofline_costs
from explorer.partition import partition
from explorer.partition.wap import wap_sweep
from explorer.simulate.simulator import simulate

MiB = 2**20


def heavy(n_ops: int = 4, param_bytes: int = 256 * MiB, out_bytes: int = 256 * MiB,
          batch: int = 8) -> OpGraph:
    """Little compute, big weights and big activations: every extra device costs transfers."""
    nodes = [OpNode("x", "input", "input", out_bytes=batch * 64)]
    prev = "x"
    for i in range(n_ops):
        nodes.append(OpNode(f"w{i}", "param", "param", f"l{i}", "", (), ((param_bytes // 4,),),
                            "float32", param_bytes, param_bytes, True))
        nodes.append(OpNode(f"op{i}", "op", "synthetic", f"l{i}", "Synthetic", (prev, f"w{i}"),
                            ((out_bytes // 4,),), "float32", out_bytes, 0, True, 10**6,
                            2 * 10**6, (prev,) if prev != "x" else ()))
        prev = f"op{i}"
    return OpGraph("heavy", nodes, batch, "synthetic", prev)


@pytest.fixture(scope="module")
def light():
    g = layered_dag(200, seed=2)
    cl = Cluster.preset("4xH100")
    return g, cl, roofline_costs(g, cl)


@pytest.fixture(scope="module")
def light_sweep(light):
    return wap_sweep(*light, algorithms=("data-parallel", "even-layers", "pipeline-dp"))


class TestCurve:
    def test_one_point_per_device_count(self, light, light_sweep):
        _, cl, _ = light
        assert [p.k for p in light_sweep.points] == list(range(1, len(cl) + 1))
        assert all(p.fits for p in light_sweep.points)
        assert all(len(p.plan.devices) <= p.k for p in light_sweep.points)

    def test_points_are_what_the_simulator_says(self, light, light_sweep):
        g, _, c = light
        for p in light_sweep.points:
            pred = simulate(g, p.plan, c)
            assert p.step_s == pytest.approx(pred.step_s)
            assert p.energy_j == pytest.approx(pred.energy_j)
            assert p.throughput_per_s == pytest.approx(g.batch_size / pred.step_s)
            assert p.throughput_per_joule == pytest.approx(g.batch_size / pred.energy_j)

    def test_each_point_is_the_fastest_it_tried(self, light_sweep):
        for p in light_sweep.points:
            times = [float(r.split()[0]) for _, r in p.tried if r.endswith("s per step")]
            assert p.step_s == pytest.approx(min(times), rel=1e-5)
            assert {a for a, _ in p.tried} >= {"data-parallel", "even-layers", "pipeline-dp"}

    def test_k1_is_a_single_device(self, light_sweep):
        assert light_sweep.points[0].plan.devices == ("H100:0",)


class TestChoice:
    def test_most_samples_per_joule(self, light_sweep):
        best = max(p.throughput_per_joule for p in light_sweep.points)
        assert light_sweep.chosen.throughput_per_joule == best
        assert light_sweep.chosen_k == min(p.k for p in light_sweep.points
                                           if p.throughput_per_joule == best)
        assert "samples per joule" in light_sweep.why

    @pytest.mark.parametrize("within", [0.0, 0.05, 0.3])
    def test_fewest_devices_within_a_fraction_of_the_best_throughput(self, light, within):
        res = wap_sweep(*light, algorithms=("data-parallel", "even-layers"),
                        objective="throughput", within=within)
        best = max(p.throughput_per_s for p in res.points)
        ok = [p.k for p in res.points if p.throughput_per_s >= (1 - within) * best]
        assert res.chosen_k == min(ok)
        assert f"within {within:.0%}" in res.why

    @pytest.mark.parametrize("objective", ["throughput_per_joule", "throughput"])
    def test_communication_heavy_work_uses_fewer_devices(self, objective):
        g = heavy()
        cl = Cluster.preset("4xT4")  # PCIe 3: 16 GB/s between GPUs
        res = wap_sweep(g, cl, roofline_costs(g, cl), objective=objective)
        assert len(res.points) == 4
        assert res.chosen_k < 4
        assert str(res.chosen_k) in res.why

    def test_registered_partitioner_returns_the_chosen_plan(self):
        g = heavy()
        cl = Cluster.preset("4xT4")
        c = roofline_costs(g, cl)
        res = wap_sweep(g, cl, c)
        plan = partition(g, cl, c, "wap")
        plan.validate(g, cl)
        assert plan.algorithm == "wap"
        assert plan.options["k"] == res.chosen_k
        assert len(plan.options["curve"]) == 4
        assert plan.notes[0] == res.why
        assert simulate(g, plan, c).step_s == pytest.approx(res.chosen.step_s)
        assert res.table().count("\n") == 4 and "<-" in res.table()


class TestLimits:
    def test_pinned_device_limits_k(self, light):
        g, cl, c = light
        res = wap_sweep(g, cl, c, algorithms=("data-parallel",), pins={"op5": "H100:2"})
        assert [p.fits for p in res.points] == [False, False, True, True]
        assert res.chosen_k >= 3
        assert "H100:2" in res.points[0].tried[0][1]
        for p in res.points[2:]:
            assert "H100:2" in p.plan.devices_of("op5")

    def test_nothing_fits(self):
        g = heavy()
        cl = cluster(2, memory=MiB)
        with pytest.raises(MemoryExceededError, match="no device count"):
            wap_sweep(g, cl, roofline_costs(g, cl), algorithms=("data-parallel",))

    def test_bad_options(self, light):
        with pytest.raises(ExplorerError, match="objective"):
            wap_sweep(*light, objective="speed")
        with pytest.raises(ExplorerError, match="itself"):
            wap_sweep(*light, algorithms=("wap",))
        with pytest.raises(ExplorerError, match="unknown algorithm"):
            wap_sweep(*light, algorithms=("no-such-thing",))
