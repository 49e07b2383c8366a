"""Tensor-parallel stages on 2 CPU ranks: losses and gradients equal one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.runtime.launch import reference

# every test here starts rank processes
pytestmark = pytest.mark.slow

STEPS, WARMUP = 2, 1


def _one_stage(graph, devices):
    return ex.Plan.from_assignment(graph, [devices],
                                   {n.name: 0 for n in graph.nodes if n.kind == "op"})


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_tensor_parallel_matches_one_device(name):
    bm = ex.builtin_model(name, "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    plan = _one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2)
    meas = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False, record=True,
                  timeout_s=120)
    ref = reference(ex.builtin_model(name, "tiny"), STEPS + WARMUP, 1, optimizer=plan.optimizer)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    assert set(meas.grads) == set(ref.grads)
    for k, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[k], g, rtol=1e-5, atol=1e-6, msg=k)


def test_dropout_in_and_after_a_split_block_draws_what_one_device_draws():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5),  # column, split
                          nn.Linear(64, 64), nn.Dropout(0.3),  # row, on its partial sums
                          nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    graph = ex.capture(model, (x,), nn.functional.cross_entropy, (y,), name="dropout")
    runs = [ex.run(graph, plan=plan, steps=STEPS, warmup=0, progress=False, timeout_s=120,
                   seed=3)
            for plan in (_one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2),
                         _one_stage(graph, ("cpu:0",)))]
    assert runs[0].losses == runs[1].losses


def test_pipeline_of_a_plain_and_a_tensor_parallel_stage_matches_one_device():
    """3 ranks: the first half of the GPT on one, the second split over two; 2 micro-batches
    (1F1B). Activations and gradients cross the boundary whole."""
    bm = ex.builtin_model("gpt", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    plan = ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1", "cpu:2")],
                                   {nm: int(k >= len(ops) // 2) for k, nm in enumerate(ops)},
                                   micro_batches=2, schedule="1f1b").with_tensor(2, stages=[1])
    meas = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False, record=True,
                  timeout_s=120)
    ref = reference(ex.builtin_model("gpt", "tiny"), STEPS + WARMUP, 2)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    for k, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[k], g, rtol=1e-5, atol=1e-6, msg=k)


def test_replicas_of_tensor_groups_are_refused_before_starting():
    bm = ex.builtin_model("mlp", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="mlp")
    plan = _one_stage(graph, ("cpu:0", "cpu:1", "cpu:2", "cpu:3")).with_tensor(2)
    with pytest.raises(ExplorerError, match="stage 0 has 2 replicas of 2 tensor-parallel"):
        ex.run(graph, plan=plan, steps=1, warmup=0, progress=False)
