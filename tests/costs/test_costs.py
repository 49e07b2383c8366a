"""The cost model against numbers worked out by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from builders import cluster, costs, device, graph

from explorer.core.errors import PlanError, UnknownNameError
from explorer.core.graph import OpGraph, OpNode
from explorer.costs.kernels import op_kind
from explorer.costs.model import (
    ROOFLINE_EFFICIENCY,
    CostModel,
    DeviceCosts,
    precision_of,
    roofline,
)
from explorer.devices.cluster import Cluster, Link
from explorer.devices.presets import H100_FIT, roofline_fit


def _one_op_costs(cl: Cluster, t: float, overhead_s: float, **scales) -> CostModel:
    g = graph([("x", "input", [], 10), ("a", "op", ["x"], 10)])
    cm = costs(g, cl, {"a": t}, {"a": 2 * t}, overhead_s=overhead_s)
    for k, v in scales.items():
        setattr(cm, k, v)
    return cm


class TestTransfer:
    def test_latency_plus_bytes_over_bandwidth(self):
        cm = _one_op_costs(cluster(2, latency_s=0.5, bandwidth=100.0), 1.0, 0.0)
        assert cm.transfer_s("d:0", "d:1", 300) == pytest.approx(0.5 + 3.0)
        assert cm.transfer_s("d:1", "d:0", 300) == pytest.approx(3.5)

    def test_nothing_to_move_costs_nothing(self):
        cm = _one_op_costs(cluster(2, latency_s=0.5, bandwidth=100.0), 1.0, 0.0)
        assert cm.transfer_s("d:0", "d:0", 300) == 0.0
        assert cm.transfer_s("d:0", "d:1", 0) == 0.0

    def test_link_scale_scales_the_bandwidth_term(self):
        cm = _one_op_costs(cluster(2, latency_s=0.5, bandwidth=100.0), 1.0, 0.0, link_scale=2.0)
        assert cm.transfer_s("d:0", "d:1", 300) == pytest.approx(0.5 + 6.0)

    def test_link_override_is_used(self):
        cl = Cluster("c", (device(0), device(1), device(2)), Link(0.0, 1000.0, "t"),
                     (("d:0", "d:2", Link(1.0, 10.0, "slow")),))
        cm = _one_op_costs(cl, 1.0, 0.0)
        assert cm.transfer_s("d:2", "d:0", 100) == pytest.approx(1.0 + 10.0)
        assert cm.transfer_s("d:0", "d:1", 100) == pytest.approx(0.1)

    def test_unknown_device(self):
        cm = _one_op_costs(cluster(2), 1.0, 0.0)
        with pytest.raises(UnknownNameError, match="unknown device 'd:9'"):
            cm.transfer_s("d:0", "d:9", 10)


class TestAllReduce:
    def test_ring_formula(self):
        cm = _one_op_costs(cluster(4, latency_s=0.25, bandwidth=1000.0), 1.0, 0.0)
        # 2(k-1) latencies + 2(k-1)/k of the bytes over the link: 6 x 0.25 + 1.5 x 1 s
        assert cm.allreduce_s(["d:0", "d:1", "d:2", "d:3"], 1000) == pytest.approx(3.0)

    def test_slowest_link_of_the_ring(self):
        cl = Cluster("c", (device(0), device(1), device(2)), Link(1.0, 100.0, "t"),
                     (("d:0", "d:1", Link(2.0, 50.0, "slow")),))
        cm = _one_op_costs(cl, 1.0, 0.0)
        # k=3: 4 x the worst latency 2 s + 4/3 x 300 B / 50 B/s
        assert cm.allreduce_s(("d:0", "d:1", "d:2"), 300) == pytest.approx(8.0 + 8.0)

    def test_link_scale(self):
        cm = _one_op_costs(cluster(2, latency_s=0.25, bandwidth=1000.0), 1.0, 0.0,
                           link_scale=3.0)
        assert cm.allreduce_s(["d:0", "d:1"], 1000) == pytest.approx(0.5 + 3.0)

    def test_across_nodes_a_ring_per_network_interface(self):
        """Nodes of 2 devices (100 B/s) joined by one 10 B/s interface per device: a ring
        over both devices of 3 nodes crosses nodes on 2 interfaces at once (20 B/s); one
        device a node has its own interface's 10 B/s."""
        devices = tuple(replace(device(i), node=i // 2) for i in range(6))
        cl = Cluster("nodes", devices, Link(0.0, 100.0, "in"), network_link=Link(1.0, 10.0, "ib"))
        cm = _one_op_costs(cl, 1.0, 0.0)
        # k=6: 10 x the worst latency 1 s + 10/6 x 600 B / 20 B/s
        assert cm.allreduce_s(cl.ids, 600) == pytest.approx(10.0 + 50.0)
        # k=3, one a node: 4 x 1 s + 4/3 x 300 B / 10 B/s; inside a node: the node's link
        assert cm.allreduce_s(cl.ids[::2], 300) == pytest.approx(4.0 + 40.0)
        assert cm.allreduce_s(cl.ids[:2], 100) == pytest.approx(100 / 100)
        assert cm.transfer_s("d:1", "d:2", 10) == pytest.approx(1.0 + 1.0)

    def test_one_device_or_no_bytes_is_free(self):
        cm = _one_op_costs(cluster(2, latency_s=0.25, bandwidth=1000.0), 1.0, 0.0)
        assert cm.allreduce_s(["d:0"], 1000) == 0.0
        assert cm.allreduce_s(["d:0", "d:1"], 0) == 0.0


class TestFraction:
    def test_overhead_does_not_shrink(self):
        cm = _one_op_costs(cluster(1), 4.0, overhead_s=1.0)
        a = 1
        assert cm.fwd_s(a, "d:0") == pytest.approx(4.0)
        assert cm.fwd_s(a, "d:0", 0.25) == pytest.approx(1.0 + 3.0 * 0.25)
        assert cm.bwd_s(a, "d:0", 0.5) == pytest.approx(1.0 + 7.0 * 0.5)
        assert cm.node_s(a, "d:0") == pytest.approx(12.0)

    def test_overhead_larger_than_the_time(self):
        cm = _one_op_costs(cluster(1), 0.5, overhead_s=1.0)
        assert cm.fwd_s(1, "d:0", 0.25) == pytest.approx(0.5)

    def test_compute_scale_and_extra_op_cost(self):
        cm = _one_op_costs(cluster(1), 4.0, overhead_s=1.0, compute_scale=2.0, extra_op_s=0.1)
        assert cm.fwd_s(1, "d:0", 0.25) == pytest.approx((1.0 + 3.0 * 0.25) * 2.0 + 0.1)

    def test_free_nodes_stay_free(self):
        cm = _one_op_costs(cluster(1), 4.0, overhead_s=1.0, extra_op_s=0.1)
        assert cm.fwd_s(0, "d:0") == 0.0  # the input
        assert cm.source(0, "d:0") == "free"
        assert cm.source(1, "d:0") == "measured"


class TestOptimizer:
    def _cm(self, **scales) -> CostModel:
        cl = cluster(1)
        g = graph([("x", "input", [], 10), ("a", "op", ["x"], 10)])
        dc = DeviceCosts(cl.devices[0].type_key, [0.0, 1.0], [0.0, 1.0], ["free", "measured"],
                         0.0, {"sgd": 1e-3, "adam": 3e-3}, {"sgd": 0.5, "adam": 2.0})
        return CostModel(g.fingerprint, cl, {dc.type_key: dc}, **scales)

    def test_per_byte_plus_per_tensor(self):
        assert self._cm().optimizer_s("d:0", "adam", 1000, 4) == pytest.approx(3.0 + 8.0)

    def test_unmeasured_optimizer_falls_back_to_sgd(self):
        assert self._cm().optimizer_s("d:0", "momentum", 1000, 4) == pytest.approx(1.0 + 2.0)

    def test_compute_scale(self):
        cm = self._cm(compute_scale=2.0)
        assert cm.optimizer_s("d:0", "adam", 1000, 4) == pytest.approx(22.0)


def _matmul_graph() -> OpGraph:
    mb = 4_000_000
    return OpGraph("mm", [
        OpNode("x", "input", "input", out_bytes=mb),
        OpNode("w", "param", "param", out_bytes=mb, param_bytes=mb, requires_grad=True),
        OpNode("mm", "op", "aten.mm.default", inputs=("x", "w"), out_bytes=mb,
               requires_grad=True, fwd_flops=2_000_000_000, bwd_flops=4_000_000_000),
        OpNode("relu", "op", "aten.relu.default", inputs=("mm",), out_bytes=mb,
               requires_grad=True),
        OpNode("view", "op", "aten.view.default", inputs=("relu",), out_bytes=mb,
               requires_grad=True, is_view=True),
        OpNode("half", "op", "aten.mm.default", inputs=("x",), dtype="bfloat16",
               out_bytes=mb, fwd_flops=20_000_000_000),
    ], batch_size=8)


class TestRoofline:
    @pytest.fixture
    def h100(self):
        return Cluster.preset("H100").devices[0]

    def test_matmul_is_compute_bound(self, h100):
        g = _matmul_graph()
        dc = roofline(g, h100)
        peak = 67e12 * 0.6  # fp32 datasheet peak x efficiency
        bw = 3350e9 * 0.6
        moved = 3 * 4_000_000  # x, w and the output
        assert ROOFLINE_EFFICIENCY == 0.6
        assert moved / bw < 2e9 / peak
        assert dc.fwd_s[2] == pytest.approx(8e-6 + 2e9 / peak)
        assert dc.bwd_s[2] == pytest.approx(8e-6 + 4e9 / peak)
        assert dc.source[2] == "roofline"

    def test_elementwise_is_bandwidth_bound(self, h100):
        dc = roofline(_matmul_graph(), h100)
        bw = 3350e9 * 0.6
        assert dc.fwd_s[3] == pytest.approx(8e-6 + 8_000_000 / bw)  # read mm, write relu
        assert dc.bwd_s[3] == pytest.approx(8e-6 + 16_000_000 / bw)  # twice the bytes

    def test_views_cost_the_overhead_only(self, h100):
        dc = roofline(_matmul_graph(), h100)
        assert dc.fwd_s[4] == pytest.approx(8e-6)
        assert dc.bwd_s[4] == pytest.approx(8e-6)

    def test_half_precision_uses_the_tensor_core_peak(self, h100):
        dc = roofline(_matmul_graph(), h100)
        assert dc.fwd_s[5] == pytest.approx(8e-6 + 2e10 / (989e12 * 0.6))
        assert dc.bwd_s[5] == 0.0  # no gradient needed

    def test_a_causal_attention_costs_the_scores_its_kernel_computes(self, h100):
        # the matmul as a causal attention computing 55 % of its counted FLOPs: its time is
        # that share's (FLOPs still count them all)
        g = _matmul_graph()
        i = 2
        g.nodes[i] = replace(g.nodes[i], op="aten.scaled_dot_product_attention.default",
                             computed_fraction=0.55)
        dc = roofline(g, h100)
        assert dc.fwd_s[i] == pytest.approx(8e-6 + 0.55 * 2e9 / (67e12 * 0.6))
        assert dc.bwd_s[i] == pytest.approx(8e-6 + 0.55 * 4e9 / (67e12 * 0.6))
        assert g.nodes[i].fwd_flops == 2e9

    def test_placeholders_are_free(self, h100):
        dc = roofline(_matmul_graph(), h100)
        assert dc.fwd_s[:2] == [0.0, 0.0]
        assert dc.source[:2] == ["free", "free"]

    def test_optimizer_is_bandwidth_bound(self, h100):
        dc = roofline(_matmul_graph(), h100)
        bw = 3350e9 * 0.6
        assert dc.optimizer_s_per_byte["sgd"] == pytest.approx(3 / bw)
        assert dc.optimizer_s_per_byte["adam"] == pytest.approx(7 / bw)
        assert dc.optimizer_s_per_tensor["adam"] == pytest.approx(8e-6 / 8)
        cm = CostModel("mm", Cluster.preset("H100"), {dc.type_key: dc})
        assert cm.optimizer_s("H100:0", "adam", 1_000_000, 4) == pytest.approx(
            1_000_000 * 7 / bw + 4 * 1e-6)

    def test_cpu_overhead_and_explicit_overhead(self):
        g = _matmul_graph()
        cpu = device(0)  # 1 GFLOP/s, 1 GB/s
        assert roofline(g, cpu).fwd_s[2] == pytest.approx(4e-6 + 2e9 / (1e9 * 0.6))
        assert roofline(g, cpu, overhead_s=0.5).fwd_s[3] == pytest.approx(
            0.5 + 8_000_000 / (1e9 * 0.6))


class TestMeasuredRoofline:
    """The H100-measured preset prices ops with the fractions fitted on an H100; every other
    preset keeps the datasheet roofline."""

    @pytest.fixture
    def measured(self):
        return Cluster.preset("H100-measured").devices[0]

    def test_matmul_uses_the_fitted_fraction_and_overhead(self, measured):
        fit = H100_FIT.kinds["matmul/fp32"]
        dc = roofline(_matmul_graph(), measured)
        peak = 67e12 * fit.flops_fraction
        assert dc.fwd_s[2] == pytest.approx(fit.overhead_s + 2e9 / peak)
        assert dc.bwd_s[2] == pytest.approx(fit.overhead_s + 4e9 / peak)
        half = H100_FIT.kinds["matmul/bf16"]
        assert dc.fwd_s[5] == pytest.approx(half.overhead_s + 2e10 / (989e12 * half.flops_fraction))

    def test_elementwise_and_optimizer_use_their_kinds_fit(self, measured):
        dc = roofline(_matmul_graph(), measured)
        act, adam = H100_FIT.kinds["gelu/fp32"], H100_FIT.kinds["adam/fp32"]
        assert dc.fwd_s[3] == pytest.approx(
            act.overhead_s + 8_000_000 / (3350e9 * act.bandwidth_fraction))
        assert dc.optimizer_s_per_byte["adam"] == pytest.approx(
            7 / (3350e9 * adam.bandwidth_fraction))
        assert dc.optimizer_s_per_tensor["adam"] == adam.overhead_s

    def test_only_the_measured_preset_has_a_fit(self, measured):
        assert roofline_fit(measured.name) is H100_FIT
        assert "measured on NVIDIA H100" in measured.source
        for key in Cluster.presets():
            dev = Cluster.preset(key).devices[0]
            assert (roofline_fit(dev.name) is not None) == (key == "H100-measured")
        h100 = Cluster.preset("H100").devices[0]
        assert (measured.flops_per_s, measured.mem_bandwidth_bytes_per_s) == (
            h100.flops_per_s, h100.mem_bandwidth_bytes_per_s)
        assert measured.type_key != h100.type_key
        g = _matmul_graph()
        assert roofline(g, measured, measured_fit=False).fwd_s == roofline(g, h100).fwd_s

    def test_op_kinds_and_precisions(self):
        assert [op_kind(o) for o in ("aten.linear.default", "aten.conv2d.default",
                                     "aten._scaled_dot_product_efficient_attention.default",
                                     "aten.layer_norm.default", "aten.softmax.int",
                                     "aten.gelu.default", "aten.mul.Tensor")] == [
            "matmul", "conv2d", "attention", "layernorm", "sum", "gelu", "add"]
        assert precision_of("matmul", "float32") == "fp32"
        assert precision_of("conv2d", "float32") == "tf32"  # cuDNN allows TF32 by default
        assert precision_of("matmul", "bfloat16") == "bf16"


class TestSerialisation:
    def test_dict_round_trip_through_json(self, chain3):
        cl = cluster(2, latency_s=0.5, bandwidth=float("inf"))
        cm = costs(chain3, cl, {"a": 1.0, "b": 2.0}, {"a": 3.0}, overhead_s=0.25,
                   opt_per_byte=1e-9)
        cm.compute_scale, cm.link_scale, cm.extra_op_s, cm.message_s = 1.5, 2.5, 1e-6, 2e-5
        back = CostModel.from_dict(json.loads(json.dumps(cm.to_dict())))
        assert back == cm
        assert back.fwd_s(2, "d:1") == cm.fwd_s(2, "d:1")

    def test_save(self, chain3, tmp_path):
        cm = costs(chain3, cluster(1), {"a": 1.0}, {})
        cm.save(str(tmp_path / "c.json"))
        assert CostModel.from_dict(json.loads((tmp_path / "c.json").read_text())) == cm


class TestCheck:
    def test_same_graph_passes(self, chain3):
        costs(chain3, cluster(1), {}, {}).check(chain3)

    def test_another_graph_is_refused(self, chain3):
        cm = costs(chain3, cluster(1), {}, {})
        other = graph([("x", "input", [], 100), ("a", "op", ["x"], 100)], name="other")
        with pytest.raises(PlanError, match=rf"profiled for graph {chain3.fingerprint}, not for "
                                            rf"other \({other.fingerprint}\)"):
            cm.check(other)


class TestMeasuredAllReduce:
    def test_a_measured_two_rank_all_reduce_is_used_and_scaled_as_a_ring(self, chain3):
        from dataclasses import replace as _replace

        cl = cluster(4, latency_s=0.5, bandwidth=100.0)
        cm = costs(chain3, cl, {"a": 1.0}, {})
        ids = cl.ids
        # as a ring of the link: 2(k-1) latencies + 2(k-1)/k x bytes / bandwidth
        assert cm.allreduce_s(ids[:2], 100) == pytest.approx(2 * 0.5 + 100 / 100)
        measured = _replace(cl.default_link, allreduce_latency_s=0.25,
                            allreduce_bandwidth_bytes_per_s=50.0)
        cm.cluster = _replace(cl, default_link=measured)
        # k = 2 is the measurement itself; k = 4 scales it as a ring would
        assert cm.allreduce_s(ids[:2], 100) == pytest.approx(0.25 + 100 / 50)
        assert cm.allreduce_s(ids, 100) == pytest.approx(3 * 0.25 + 1.5 * 100 / 50)

    def test_measured_reduce_scatter_and_all_gather_price_zeros_collectives(self, chain3):
        from dataclasses import replace as _replace

        cl = cluster(4, latency_s=0.5, bandwidth=100.0)
        cm = costs(chain3, cl, {"a": 1.0}, {})
        ids = cl.ids
        ar = _replace(cl.default_link, allreduce_latency_s=0.25,
                      allreduce_bandwidth_bytes_per_s=50.0)
        cm.cluster = _replace(cl, default_link=ar)
        # without their own measurement: half the measured all-reduce
        assert cm.reduce_scatter_s(ids[:2], 100) == pytest.approx((0.25 + 100 / 50) / 2)
        both = _replace(ar, reduce_scatter_latency_s=0.1,
                        reduce_scatter_bandwidth_bytes_per_s=20.0, allgather_latency_s=0.05,
                        allgather_bandwidth_bytes_per_s=200.0)
        cm.cluster = _replace(cl, default_link=both)
        # measured: k = 2 is the measurement, k = 4 scaled as a ring; the all-reduce unchanged
        assert cm.reduce_scatter_s(ids[:2], 100) == pytest.approx(0.1 + 100 / 20)
        assert cm.reduce_scatter_s(ids, 100) == pytest.approx(3 * 0.1 + 1.5 * 100 / 20)
        assert cm.allgather_s(ids[:2], 100) == pytest.approx(0.05 + 100 / 200)
        assert cm.allreduce_s(ids[:2], 100) == pytest.approx(0.25 + 100 / 50)

    def test_cluster_json_from_before_the_field_still_loads(self):
        d = cluster(2).to_dict()
        for k in ("allreduce_latency_s", "allreduce_bandwidth_bytes_per_s", "late_receive_s",
                  "reduce_scatter_latency_s", "allgather_bandwidth_bytes_per_s"):
            del d["default_link"][k]
        back = type(cluster(2)).from_dict(d)
        assert back.default_link.allreduce_latency_s == 0.0
        assert back.default_link.late_receive_s == 0.0
