"""Reading torch.profiler traces into per-op host and device times: a trace recorded here on
the CPU (no kernels), and a trace of a GPU step written out by hand in kineto's format (host
ops, launches, kernels sharing correlation ids, the backward on autograd's thread), whose
times are worked out below."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import explorer as ex
from explorer.core.graph import OpGraph, OpNode
from explorer.profiling.kineto import (
    TraceError,
    dispatched,
    match_graph,
    op_timings,
    profiler_name,
    timeline_costs,
)

US = 1e-6


def _x(name: str, cat: str, tid: int, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": 1 if cat != "kernel" else 0,
            "tid": tid, "ts": ts, "dur": dur, "args": args}


#: a GPU step of linear then relu: the host (thread 1) issues the ops and their launches, the
#: device (stream 7) runs the kernels later; autograd's thread (2) runs the backward
GPU_TRACE = {"traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
    _x("aten::linear", "cpu_op", 1, 0, 100, **{"Sequence number": 0}),
    _x("aten::addmm", "cpu_op", 1, 10, 80, **{"Sequence number": 1}),
    _x("cudaLaunchKernel", "cuda_runtime", 1, 20, 10, correlation=5),
    _x("aten::relu", "cpu_op", 1, 100, 30, **{"Sequence number": 2}),
    _x("cudaLaunchKernel", "cuda_runtime", 1, 110, 5, correlation=6),
    _x("cudaDeviceSynchronize", "cuda_runtime", 1, 131, 20, correlation=10),  # (no kernel)
    _x("gemm", "kernel", 7, 40, 100, correlation=5),
    _x("relu_kernel", "kernel", 7, 140, 20, correlation=6),
    _x(f"{'autograd::engine::evaluate_function: '}ReluBackward0", "cpu_op", 2, 200, 20,
       **{"Sequence number": 2, "Fwd thread id": 1}),
    _x("ReluBackward0", "cpu_op", 2, 201, 18, **{"Sequence number": 2}),
    _x("cudaLaunchKernel", "cuda_runtime", 2, 205, 5, correlation=7),
    _x(f"{'autograd::engine::evaluate_function: '}AddmmBackward0", "cpu_op", 2, 220, 40,
       **{"Sequence number": 1, "Fwd thread id": 1}),
    _x("cudaLaunchKernel", "cuda_runtime", 2, 225, 3, correlation=8),
    _x("cudaLaunchKernel", "cuda_runtime", 2, 230, 3, correlation=9),
    _x("relu_backward_kernel", "kernel", 7, 215, 30, correlation=7),
    _x("gemm_dgrad", "kernel", 7, 245, 40, correlation=8),
    _x("gemm_wgrad", "kernel", 7, 285, 20, correlation=9),
    _x("stray_kernel", "kernel", 7, 400, 50, correlation=99),  # (no launch in the trace)
]}


def test_a_gpu_trace_gives_each_op_its_host_and_device_time_forward_and_backward():
    linear, relu = op_timings(GPU_TRACE)
    assert (linear.name, relu.name) == ("aten::linear", "aten::relu")
    # linear: host 0-100 us; its gemm 40-140 us on the device, launched from inside addmm
    assert linear.host_s == pytest.approx(100 * US)
    assert (linear.device_s, linear.kernels) == (pytest.approx(100 * US), 1)
    assert linear.span_s == pytest.approx(140 * US)
    # its backward: AddmmBackward0 (sequence number 1, made by the addmm inside it), 40 us of
    # host, two kernels of 40 and 20 us
    assert linear.backward_host_s == pytest.approx(40 * US)
    assert linear.backward_device_s == pytest.approx(60 * US)
    # relu: host 100-130, its kernel 140-160; the synchronisation launches no kernel
    assert (relu.host_s, relu.device_s) == (pytest.approx(30 * US), pytest.approx(20 * US))
    assert relu.span_s == pytest.approx(60 * US)
    assert relu.backward_host_s == pytest.approx(20 * US)
    assert relu.backward_device_s == pytest.approx(30 * US)


@pytest.fixture(scope="module")
def mlp_trace(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    graph = ex.capture(model, x, nn.functional.cross_entropy, y)
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        nn.functional.cross_entropy(model(x), y).backward()
    prof.export_chrome_trace(str(path))
    return graph, path


def test_a_cpu_trace_matches_the_graph_s_ops_with_their_backward(mlp_trace):
    graph, path = mlp_trace
    timings = op_timings(path)
    matched = match_graph(timings, graph)
    ops = [n for n in graph.nodes if n.kind == "op"]
    assert list(matched) == [n.name for n in ops]
    assert [matched[n.name].name for n in ops] == [profiler_name(n.op) for n in ops]
    assert all(t.host_s > 0 and t.device_s == 0 and t.kernels == 0 for t in matched.values())
    linears = [matched[n.name] for n in ops if n.op == "aten.linear.default"]
    assert len(linears) == 2 and all(t.backward_host_s > 0 for t in linears)
    events = json.loads(path.read_text())["traceEvents"]
    recorded = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    first = min(e["ts"] for e in recorded)
    last = max(e["ts"] + e["dur"] for e in recorded)
    total = sum(t.host_s + t.backward_host_s for t in timings)
    assert total <= (last - first) * US * (1 + 1e-9)


def test_a_trace_of_another_graph_or_no_trace_is_named(mlp_trace, tmp_path):
    graph, path = mlp_trace
    timings = op_timings(path)
    without_relu = [t for t in timings if t.name != "aten::relu"]
    relu = next(n for n in graph.nodes if n.op == "aten.relu.default")
    with pytest.raises(TraceError, match=f"runs no aten::relu for op '{relu.name}'"):
        match_graph(without_relu, graph)
    (tmp_path / "not.json").write_text('{"rows": []}')
    with pytest.raises(TraceError, match="no traceEvents list"):
        op_timings(tmp_path / "not.json")
    with pytest.raises(TraceError, match="cannot read the trace"):
        op_timings(tmp_path / "missing.json")


def test_what_an_eager_run_computes_without_dispatching_is_not_looked_for():
    assert dispatched("aten.linear.default") and dispatched("aten.alias.default")
    assert not dispatched("getitem") and not dispatched("aten.sym_size.int")
    assert profiler_name("aten.scaled_dot_product_attention.default") == (
        "aten::scaled_dot_product_attention")


def test_a_traced_gpu_step_prices_each_op_on_the_host_and_the_device():
    """The GPU trace's linear and relu as a graph's two ops: their costs on two timelines,
    and the step they simulate to, worked out by hand."""
    g = OpGraph("traced", [
        OpNode("x", "input", "input", out_bytes=64),
        OpNode("w", "param", "param", out_bytes=64, param_bytes=64, requires_grad=True),
        OpNode("lin", "op", "aten.linear.default", inputs=("x", "w"), out_bytes=64,
               requires_grad=True, saves=("x",)),
        OpNode("act", "op", "aten.relu.default", inputs=("lin",), out_bytes=64,
               requires_grad=True, saves=("act",))], 4, "export", "act")
    dc = timeline_costs(g, match_graph(op_timings(GPU_TRACE), g), "cuda:H100")
    assert dc.fwd_s == pytest.approx([0, 0, 100 * US, 20 * US])
    assert dc.bwd_s == pytest.approx([0, 0, 60 * US, 30 * US])
    assert dc.host_s == [pytest.approx([0, 0, 100 * US, 30 * US]),
                         pytest.approx([0, 0, 40 * US, 20 * US])]
    assert dc.overhead_s == pytest.approx(20 * US) and dc.source[2:] == ["measured"] * 2
    cluster = ex.Cluster.preset("1xH100")
    dc = replace(dc, type_key=cluster.devices[0].type_key)
    costs = ex.CostModel(g.fingerprint, cluster, {dc.type_key: dc})
    pred = ex.simulate(g, ex.Plan.single(g, cluster.devices[0].id, optimizer="sgd"), costs)
    # the host issues lin 0-100, act 100-130, act's backward 130-150, lin's 150-190 us; the
    # device runs lin 100-200, act 200-220, act's backward 220-250, lin's 250-310
    kernels = [(iv.kind, iv.label, iv.start_s / US, iv.end_s / US) for iv in pred.timeline
               if iv.lane == "compute" and iv.kind in ("fwd", "bwd")]
    assert kernels == [("fwd", "lin", pytest.approx(100), pytest.approx(200)),
                       ("fwd", "act", pytest.approx(200), pytest.approx(220)),
                       ("bwd", "act", pytest.approx(220), pytest.approx(250)),
                       ("bwd", "lin", pytest.approx(250), pytest.approx(310))]
    assert pred.host_busy_s[cluster.devices[0].id] == pytest.approx(190 * US)
