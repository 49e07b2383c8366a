"""Capture without running: fake tensors give the same graph as a real run, allocate nothing."""

from __future__ import annotations

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
def test_llama_7b_shape_captures_on_fake_tensors():
    bm = ex.builtin_model("llama-7b")
    graph = _capture(bm)
    cfg = ex.models.builtin.model_config("llama-7b")
    assert bm.n_params == cfg.n_params == 6_738_415_616
    assert graph.param_bytes == 4 * cfg.n_params
    tokens = cfg.seq_len * bm.batch_size
    matmul = 6 * (cfg.n_params - cfg.vocab_size * cfg.d_model) * tokens  # 6 N T, no embedding
    assert 0.95 < graph.total_flops / matmul < 1.1  # plus attention scores
    assert graph[graph.loss].shapes == ((),)
