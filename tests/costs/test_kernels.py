"""Compiled kernels: which ops a compiler fuses, and the roofline that prices them so."""

import json

import numpy as np
import pytest

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph, OpNode
from explorer.costs.kernels import compiled_graph, compiled_saves, fused_kernels, op_kind
from explorer.costs.model import CostModel, roofline
from explorer.devices.cluster import Cluster

MB = 1_000_000


def _rms_norm_graph() -> OpGraph:
    """x -> mm -> an unfused RMSNorm (pow, mean, add, rsqrt, mul, mul by its weight) -> view
    -> mm, and a residual add of the norm's input that is the graph's output."""
    def op(name, aten, inputs, nbytes=4 * MB, **kw):
        return OpNode(name, "op", aten, inputs=inputs, out_bytes=nbytes, requires_grad=True,
                      **kw)
    return OpGraph("rms", [
        OpNode("x", "input", "input", out_bytes=4 * MB),
        OpNode("w1", "param", "param", out_bytes=MB, param_bytes=MB, requires_grad=True),
        OpNode("g", "param", "param", out_bytes=4096, param_bytes=4096, requires_grad=True),
        OpNode("w2", "param", "param", out_bytes=MB, param_bytes=MB, requires_grad=True),
        op("mm1", "aten.mm.default", ("x", "w1"), fwd_flops=10**9, bwd_flops=2 * 10**9),
        op("pow", "aten.pow.Tensor_Scalar", ("mm1",), saves=("mm1",)),
        op("mean", "aten.mean.dim", ("pow",), nbytes=4096),
        op("add", "aten.add.Tensor", ("mean",), nbytes=4096),
        op("rsqrt", "aten.rsqrt.default", ("add",), nbytes=4096, saves=("rsqrt",)),
        op("mul", "aten.mul.Tensor", ("mm1", "rsqrt"), saves=("mm1", "rsqrt")),
        op("scale", "aten.mul.Tensor", ("mul", "g"), saves=("mul", "g")),
        op("flat", "aten.view.default", ("scale",), is_view=True),
        op("mm2", "aten.mm.default", ("flat", "w2"), fwd_flops=10**9, bwd_flops=2 * 10**9,
           saves=("flat", "w2")),
        op("residual", "aten.add.Tensor", ("mm2", "mm1")),
    ], batch_size=8)


@pytest.fixture
def h100():
    return Cluster.preset("H100").devices[0]


class TestFusedKernels:
    def test_a_norm_between_two_matmuls_is_one_kernel(self):
        g = _rms_norm_graph()
        runs = {tuple(g.nodes[i].name for i in r.nodes): r for r in fused_kernels(g)}
        assert set(runs) == {("pow", "mean", "add", "rsqrt", "mul", "scale", "flat"),
                             ("residual",)}
        norm = runs[("pow", "mean", "add", "rsqrt", "mul", "scale", "flat")]
        # reads mm1's output and the weight once, writes the scaled output mm2 reads
        assert norm.bytes_moved == 4 * MB + 4096 + 4 * MB
        assert norm.launches == 1
        residual = runs[("residual",)]  # the graph's output is written
        assert (residual.bytes_moved, residual.launches) == (12 * MB, 1)

    def test_a_kernel_per_tensor_read_outside_the_run(self):
        g = _rms_norm_graph()
        nodes = list(g.nodes)
        # a second reader of rsqrt outside the run: the kernels write it too
        nodes.append(OpNode("mm3", "op", "aten.mm.default", inputs=("rsqrt", "w2"),
                            out_bytes=4096, requires_grad=True))
        g2 = OpGraph("rms2", nodes, batch_size=8)
        norm = next(r for r in fused_kernels(g2) if len(r.nodes) > 1)
        assert norm.launches == 2
        assert norm.bytes_moved == 4 * MB + 4096 + 4 * MB + 4096

    def test_a_run_never_waits_for_a_kernel_it_feeds(self):
        """A residual stream: h = x + a; y = norm(h) -> mm; out = h + mm. The norm and the
        first add are one kernel; the second add waits for the matmul the norm feeds, so it
        is another, and h is written for it."""
        def op(name, aten, inputs, **kw):
            return OpNode(name, "op", aten, inputs=inputs, out_bytes=MB, requires_grad=True,
                          **kw)
        g = OpGraph("residual", [
            OpNode("x", "input", "input", out_bytes=MB),
            OpNode("a", "input", "input", out_bytes=MB),
            OpNode("w", "param", "param", out_bytes=MB, param_bytes=MB, requires_grad=True),
            op("h", "aten.add.Tensor", ("x", "a")),
            op("norm", "aten.layer_norm.default", ("h",), saves=("h",)),
            op("mm", "aten.mm.default", ("norm", "w")),
            op("out", "aten.add.Tensor", ("h", "mm")),
        ], batch_size=1)
        runs = {tuple(g.nodes[i].name for i in r.nodes): r for r in fused_kernels(g)}
        assert set(runs) == {("h", "norm"), ("out",)}
        assert runs[("h", "norm")].launches == 2  # h for the second add, norm for the matmul
        assert runs[("h", "norm")].bytes_moved == 4 * MB
        # the norm keeps h: recomputing it would keep x and a, twice its bytes
        assert compiled_saves(g)["norm"].saves == ("h",)

    def test_a_compiled_backward_keeps_the_runs_inputs_not_its_values(self):
        g = _rms_norm_graph()
        c = compiled_saves(g)
        saves = {n.name: n.saves for n in c.nodes if n.saves}
        assert saves == {"pow": ("mm1",), "rsqrt": ("mm1",), "mul": ("mm1",),
                         "scale": ("mm1", "g"),
                         # a matmul keeps its input: the run writes it for the matmul anyway
                         "mm2": ("flat", "w2")}
        assert c.fingerprint == g.fingerprint
        assert [n.name for n in c.nodes] == [n.name for n in g.nodes]
        once = compiled_graph(g)  # one object for the simulator's caches
        assert compiled_graph(g) is once and compiled_graph(once) is once

    def test_a_residual_add_fused_with_the_norm_is_all_its_backward_keeps(self):
        """h = x + a is fused with the RMSNorm that reads it; the norm's pow keeps h, so a
        minimum cut keeps h alone and recomputes x * rsqrt from it (choosing value by value,
        the product would be kept: remaking it from outside the run takes x and a)."""
        def op(name, aten, inputs, nbytes=4 * MB, **kw):
            return OpNode(name, "op", aten, inputs=inputs, out_bytes=nbytes,
                          requires_grad=True, **kw)
        g = OpGraph("residual-norm", [
            OpNode("x", "input", "input", out_bytes=4 * MB),
            OpNode("a", "input", "input", out_bytes=4 * MB),
            OpNode("g", "param", "param", out_bytes=4096, param_bytes=4096, requires_grad=True),
            OpNode("w", "param", "param", out_bytes=MB, param_bytes=MB, requires_grad=True),
            op("h", "aten.add.Tensor", ("x", "a")),
            op("pow", "aten.pow.Tensor_Scalar", ("h",), saves=("h",)),
            op("mean", "aten.mean.dim", ("pow",), nbytes=4096),
            op("eps", "aten.add.Tensor", ("mean",), nbytes=4096),
            op("rsqrt", "aten.rsqrt.default", ("eps",), nbytes=4096, saves=("rsqrt",)),
            op("mul", "aten.mul.Tensor", ("h", "rsqrt"), saves=("h", "rsqrt")),
            op("scale", "aten.mul.Tensor", ("mul", "g"), saves=("mul", "g")),
            op("mm", "aten.mm.default", ("scale", "w"), fwd_flops=10**9, saves=("scale", "w")),
            op("out", "aten.add.Tensor", ("h", "mm")),
        ], batch_size=8)
        saves = {n.name: n.saves for n in compiled_saves(g).nodes if n.saves}
        assert saves == {"pow": ("h",), "rsqrt": ("h",), "mul": ("h",), "scale": ("h", "g"),
                         "mm": ("scale", "w")}

    @pytest.mark.parametrize("half", [False, True])
    def test_a_cross_entropy_keeps_its_logits_where_they_take_fewer_bytes(self, half):
        """A cross-entropy saves its fp32 log-softmax (as many bytes as fp32 logits) and
        passes a gradient of that size inside its backward. Compiled, its backward is one
        kernel (no such gradient), and it keeps the logits instead where autocast makes them
        2-byte (a bf16 plan), its log-softmax where the two are the same size."""
        g = OpGraph("loss", [
            OpNode("x", "input", "input", out_bytes=MB),
            OpNode("t", "input", "input", dtype="int64", out_bytes=4096),
            OpNode("w", "param", "param", out_bytes=MB, param_bytes=MB, requires_grad=True),
            OpNode("logits", "op", "aten.mm.default", inputs=("x", "w"), out_bytes=8 * MB,
                   requires_grad=True, fwd_flops=10**9, saves=("x", "w")),
            OpNode("ce", "op", "aten.cross_entropy_loss.default", inputs=("logits", "t"),
                   out_bytes=4, requires_grad=True, saves=("t",), saved_extra_bytes=8 * MB,
                   backward_scratch_bytes=8 * MB),
        ], batch_size=8, loss="ce")
        ce = compiled_saves(g, half)["ce"]
        assert ce.backward_scratch_bytes == 0
        if half:
            assert (ce.saves, ce.saved_extra_bytes) == (("t", "logits"), 0)
        else:
            assert (ce.saves, ce.saved_extra_bytes) == (("t",), 8 * MB)
        eager = compiled_graph(g)
        assert compiled_graph(g, half=True) is compiled_graph(g, half=True) is not eager
        # (a rewrite asked for the other sizing is its original's)
        assert compiled_graph(eager, half=True) is compiled_graph(g, half=True)

    def test_a_stage_cut_inside_a_run_keeps_what_the_stage_holds(self):
        g = _rms_norm_graph()
        cut = {n.name: 0 if k <= g.index["mul"] else 1 for k, n in enumerate(g.nodes)}
        on_stages = compiled_graph(g, cut)
        # the scale op, past the cut, keeps the mul it receives, not mm1 from stage 0
        assert on_stages["scale"].saves == ("mul", "g")
        assert on_stages["mul"].saves == ("mm1",)  # on the stage of its run's input
        assert compiled_graph(g, dict.fromkeys(cut, 0)) is compiled_graph(g)

    def test_modules_of_a_hooks_capture_and_lone_views_are_no_fused_kernels(self):
        g = OpGraph("hooks", [
            OpNode("x", "input", "input", out_bytes=MB),
            OpNode("fc", "op", "module:Linear", inputs=("x",), out_bytes=MB),
            OpNode("act", "op", "module:ReLU", inputs=("fc",), out_bytes=MB),
            OpNode("norm", "op", "module:LayerNorm", inputs=("act",), out_bytes=MB),
            OpNode("flat", "op", "aten.view.default", inputs=("x",), out_bytes=MB,
                   is_view=True),
        ], batch_size=1)
        (views,) = fused_kernels(g)
        assert (views.nodes, views.launches, views.bytes_moved) == ((g.index["flat"],), 0, 0)

    def test_op_kinds_that_fuse(self):
        assert [op_kind(o) for o in ("aten.pow.Tensor_Scalar", "aten.silu.default",
                                     "aten.mean.dim", "aten.rms_norm.default",
                                     "aten.mm.default")] == [
            "add", "gelu", "sum", "layernorm", "matmul"]


class TestCompiledRoofline:
    def test_the_run_costs_its_launches_and_the_bytes_entering_and_leaving_it(self, h100):
        g = _rms_norm_graph()
        eager, compiled = roofline(g, h100), roofline(g, h100, kernels="compiled")
        bw = 3350e9 * 0.6
        run = [g.index[n] for n in ("pow", "mean", "add", "rsqrt", "mul", "scale", "flat")]
        assert sum(compiled.fwd_s[i] for i in run) == pytest.approx(8e-6 + (8 * MB + 4096) / bw)
        assert sum(compiled.bwd_s[i] for i in run) == pytest.approx(
            8e-6 + 2 * (8 * MB + 4096) / bw)
        assert sum(compiled.fwd_s[i] for i in run) < sum(eager.fwd_s[i] for i in run) / 3
        # the view costs nothing; the pow, which moves most alone, takes the largest share
        assert compiled.fwd_s[g.index["flat"]] == compiled.bwd_s[g.index["flat"]] == 0.0
        assert max(run, key=lambda i: compiled.fwd_s[i]) in (g.index["pow"], g.index["mul"])
        for name in ("mm1", "mm2"):  # library kernels stay as they are
            i = g.index[name]
            assert (compiled.fwd_s[i], compiled.bwd_s[i]) == (eager.fwd_s[i], eager.bwd_s[i])
        assert (eager.kernels, compiled.kernels) == ("eager", "compiled")

    def test_a_runs_launches_do_not_shrink_with_the_batch(self, h100):
        g = _rms_norm_graph()
        dc = roofline(g, h100, kernels="compiled")
        bw = 3350e9 * 0.6
        run = [g.index[n] for n in ("pow", "mean", "add", "rsqrt", "mul", "scale", "flat")]
        for fraction in (0.5, 1 / 8, 1 / 1024):
            assert sum(dc.at(dc.fwd_s, dc.fwd_at, i, fraction) for i in run) == pytest.approx(
                8e-6 + fraction * (8 * MB + 4096) / bw)
            assert sum(dc.at(dc.bwd_s, dc.bwd_at, i, fraction) for i in run) == pytest.approx(
                8e-6 + fraction * 2 * (8 * MB + 4096) / bw)
            mm = g.index["mm1"]  # a library kernel: its own launch, as eager prices it
            eager = roofline(g, h100)
            assert dc.at(dc.fwd_s, dc.fwd_at, mm, fraction) == pytest.approx(
                eager.at(eager.fwd_s, eager.fwd_at, mm, fraction))
            assert list(dc.at_many("fwd_s", np.array(run), fraction)) == pytest.approx(
                [dc.at(dc.fwd_s, dc.fwd_at, i, fraction) for i in run])

    def test_a_captured_llama_costs_less_compiled_and_its_matmuls_the_same(self, h100):
        bm = ex.builtin_model("llama", "tiny")
        g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, fake=True)
        eager, compiled = roofline(g, h100), roofline(g, h100, kernels="compiled")
        assert sum(compiled.fwd_s) < sum(eager.fwd_s)
        assert sum(compiled.bwd_s) < sum(eager.bwd_s)
        for i, n in enumerate(g.nodes):
            if n.kind == "op" and op_kind(n.op) in ("matmul", "attention"):
                assert compiled.fwd_s[i] == eager.fwd_s[i]
            if n.kind == "op" and n.is_view:
                assert compiled.fwd_s[i] == 0.0
        # every RMSNorm is one run of kernels, whatever else it joins
        runs = fused_kernels(g)
        for i, n in enumerate(g.nodes):
            if n.op == "aten.rsqrt.default":
                (run,) = [r for r in runs if i in r.nodes]
                assert {g.nodes[j].op for j in run.nodes} >= {
                    "aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor",
                    "aten.rsqrt.default", "aten.mul.Tensor"}


class TestProfile:
    def test_presets_priced_compiled_predict_a_shorter_step(self):
        bm = ex.builtin_model("llama", "tiny")
        g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, fake=True)
        cluster = Cluster.preset("2xH100")
        eager = ex.profile(g, cluster, progress=False)
        compiled = ex.profile(g, cluster, progress=False, kernels="compiled")
        assert compiled.device_costs("H100:0").kernels == "compiled"
        plan = ex.partition(g, cluster, eager, "data-parallel")
        faster, slower = ex.simulate(g, plan, compiled), ex.simulate(g, plan, eager)
        assert faster.step_s < slower.step_s
        # a compiled backward keeps fewer of the small ops' values
        assert compiled.kernels == "compiled" and eager.kernels == "eager"
        for d in cluster.ids:
            assert faster.memory[d].activations_bytes < slower.memory[d].activations_bytes
            assert faster.memory[d].params_bytes == slower.memory[d].params_bytes
        back = CostModel.from_dict(json.loads(json.dumps(compiled.to_dict())))
        assert back.device_costs("H100:1").kernels == "compiled"
        assert back.device_costs("H100:1").fwd_s == compiled.device_costs("H100:1").fwd_s

    def test_measured_devices_and_unknown_names_are_refused(self):
        bm = ex.builtin_model("mlp", "tiny")
        mlp_graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
        with pytest.raises(ExplorerError, match=r"cpu:0 is measured.*compile=True"):
            ex.profile(mlp_graph, Cluster.cpu(1, measure=False), progress=False,
                       kernels="compiled")
        with pytest.raises(ExplorerError, match="kernels must be one of 'eager', 'compiled'"):
            ex.profile(mlp_graph, Cluster.preset("H100"), progress=False, kernels="fused")
