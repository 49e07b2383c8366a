"""Capture without running: fake tensors give the same graph as a real run, allocate nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import explorer as ex
from explorer.capture import fake
from explorer.capture.tracing import example_of
from explorer.core.errors import CaptureError, MemoryExceededError

NAMES = ex.model_names()


def _capture(bm: ex.models.BuiltinModel, **kw) -> ex.OpGraph:
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=bm.name, **kw)


def assert_same_graph(real: ex.OpGraph, faked: ex.OpGraph) -> None:
    """Same nodes (names, ops, shapes, dtypes, bytes, FLOPs, saved tensors), same fingerprint."""
    assert [n.name for n in real.nodes] == [n.name for n in faked.nodes]
    for a, b in zip(real.nodes, faked.nodes, strict=True):
        assert a == b, a.name
    assert real.fingerprint == faked.fingerprint
    assert (real.batch_size, real.loss, real.source) == (faked.batch_size, faked.loss,
                                                         faked.source)


@pytest.mark.parametrize("name", NAMES)
def test_real_and_fake_capture_give_the_same_graph(name):
    bm = ex.builtin_model(name, "tiny")
    real = _capture(bm)
    faked = _capture(bm, fake=True)
    assert_same_graph(real, faked)
    assert faked.notes[0] == fake.FAKE_NOTE and real.notes == ()


def test_a_model_on_the_meta_device_is_captured_without_running():
    meta = ex.builtin_model("gpt", "tiny", weights=False)
    assert all(p.is_meta for p in meta.module.parameters())
    graph = _capture(meta)
    assert fake.is_fake_graph(graph.notes)
    assert_same_graph(_capture(ex.builtin_model("gpt", "tiny")), graph)
    assert all(p.is_meta for p in meta.module.parameters())  # left as it was


def test_fake_capture_leaves_the_models_parameters_alone():
    bm = ex.builtin_model("resnet", "tiny")
    before = {k: (v, v.clone()) for k, v in bm.module.state_dict(keep_vars=True).items()}
    _capture(bm, fake=True)
    after = bm.module.state_dict(keep_vars=True)
    for k, (obj, value) in before.items():
        assert after[k] is obj, k
        assert torch.equal(after[k], value), k
    assert all(p.grad is None for p in bm.module.parameters())


def test_tied_weights_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    m, x = Tied(), torch.randint(0, 16, (4, 3))
    real, faked = ex.capture(m, x), ex.capture(m, x, fake=True)
    assert_same_graph(real, faked)
    assert faked.param_bytes == real.param_bytes


def test_fake_graph_cannot_run_and_says_how():
    graph = _capture(ex.builtin_model("mlp", "tiny"), fake=True)
    assert graph.runtime is None
    with pytest.raises(CaptureError, match="fake=False"):
        example_of(graph)
    cluster = ex.Cluster.cpu(2, measure=False)
    plan = ex.partition(graph, cluster, ex.profile(graph, cluster), "even-layers")
    with pytest.raises(ex.ExplorerError, match="without running the model"):
        ex.run(graph, None, plan)


def test_meta_model_with_fake_false_is_refused():
    meta = ex.builtin_model("mlp", "tiny", weights=False)
    with pytest.raises(CaptureError, match="meta device"):
        _capture(meta, fake=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_keep_their_dtypes(dtype):
    bm = ex.builtin_model("llama", "tiny", dtype=dtype)
    real, faked = _capture(bm), _capture(bm, fake=True)
    assert_same_graph(real, faked)
    params = [n for n in faked.nodes if n.kind == "param"]
    assert {n.dtype for n in params} == {str(dtype).replace("torch.", "")}
    assert faked.param_bytes == 2 * bm.n_params
    mm = [n for n in faked.ops if n.op == "aten.linear.default"]
    assert mm and all(n.dtype == params[0].dtype for n in mm)


def test_data_dependent_branch_names_the_op_and_the_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum().item() > 0:  # needs a value: fake tensors have none
                return self.fc(x)
            return self.fc(-x)

    with pytest.raises(CaptureError,
                       match=r"needs real data.*branch on a tensor's value.*test_fake.py:"):
        ex.capture(Branchy(), torch.randn(2, 4), fake=True)


class _ValueSized(nn.Module):
    """A linear layer after a step whose output size depends on the input's values."""

    def __init__(self, step):
        super().__init__()
        self.fc, self.step = nn.Linear(4, 4), step

    def forward(self, x):
        return self.fc(self.step(x))


@pytest.mark.parametrize("step, op", [
    (lambda x: x[x > 0].sum() + x, "aten.index.Tensor"),  # indexing with a mask
    (lambda x: x + torch.nonzero(x).shape[0], "aten.nonzero.default"),
])
def test_an_output_sized_by_values_names_the_op_and_the_line(step, op):
    model, x = _ValueSized(step), torch.randn(2, 4)
    with pytest.raises(CaptureError, match=rf"needs real data to trace: op {op} at "
                                           rf"test_fake.py:\d+ makes an output whose size "
                                           r"depends on tensor values .*fake=False"):
        ex.capture(model, x, fake=True)
    assert ex.capture(model, x).ops  # with real weights it is captured


def test_item_on_a_size_traces_on_fake_tensors():
    class SizeItem(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            n = torch.tensor(x.shape[1]).item()  # a size read back as a number
            torch._check(n == 4)
            return self.fc(x[:, :n])

    m, x = SizeItem(), torch.randn(2, 4)
    assert_same_graph(ex.capture(m, x), ex.capture(m, x, fake=True))


def test_real_capture_checks_memory_first(monkeypatch):
    monkeypatch.setattr(fake, "available_bytes", lambda device: 10)
    bm = ex.builtin_model("mlp", "tiny")
    with pytest.raises(MemoryExceededError, match=r"fake=True"):
        _capture(bm)
    assert _capture(bm, fake=True).ops  # the fake path needs no memory


@pytest.mark.slow
def test_planning_a_large_shape_allocates_nothing_for_its_weights():
    """Llama-1B (4.9 GB of fp32 weights) built, captured and simulated in a fresh process whose
    peak memory stays far below its weights: nothing is allocated without asking."""
    script = (
        "import resource, explorer as ex\n"
        "from explorer.models.synthetic import roofline_costs\n"
        "bm = ex.builtin_model('llama-1b')\n"
        "g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)\n"
        "cl = ex.Cluster.preset('8xH100')\n"
        "pred = ex.simulate(g, ex.Plan.single(g, cl.ids[0]), roofline_costs(g, cl))\n"
        "assert pred.peak_bytes[cl.ids[0]] > 16 * bm.n_params\n"
        "print(bm.n_params * 4, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, check=True)
    weights_bytes, peak_rss_bytes = map(int, out.stdout.split()[-2:])
    assert weights_bytes > 4.9e9 and peak_rss_bytes < 2 * 2**30


@pytest.mark.slow
def test_llama_7b_shape_captures_on_fake_tensors():
    bm = ex.builtin_model("llama-7b")
    graph = _capture(bm)
    cfg = ex.models.builtin.model_config("llama-7b")
    assert bm.n_params == cfg.n_params == 6_738_415_616
    assert graph.param_bytes == 4 * cfg.n_params
    tokens = cfg.seq_len * bm.batch_size
    matmul = 6 * (cfg.n_params - cfg.vocab_size * cfg.d_model) * tokens  # 6 N T, no embedding
    # fused attention: 4 T^2 d per layer forward, 2.5 times that backward (torch's formulas)
    attention = 3.5 * 4 * bm.batch_size * cfg.seq_len**2 * cfg.d_model * cfg.n_layers
    assert 0.99 < graph.total_flops / (matmul + attention) < 1.02
    assert graph[graph.loss].shapes == ((),)
