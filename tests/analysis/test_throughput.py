"""Tests of explorer.analysis.throughput: tokens per step, tokens/s and MFU per device."""

from __future__ import annotations

import pytest

import explorer as ex
from explorer.analysis.throughput import peak_flops_per_s, throughput, tokens_per_step
from tests.builders import hf_causal_lm_graph, tiny_builtin_graph


def test_a_language_models_tokens_are_its_token_ids():
    bm = ex.builtin_model("gpt", "tiny")
    assert tokens_per_step(tiny_builtin_graph("gpt")) == bm.example_inputs[0].numel() == 8 * 16
    assert tokens_per_step(tiny_builtin_graph("resnet")) is None  # images, not tokens


def test_hugging_face_token_ids_are_found_through_their_views():
    graph = hf_causal_lm_graph("hf-gpt2-tokens", lambda transformers: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=2)))
    assert tokens_per_step(graph) == 4 * 16


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_throughput_per_device_and_mfu(precision):
    graph = tiny_builtin_graph("gpt")
    cluster = ex.Cluster.preset("2xH100")
    costs = ex.profile(graph, cluster)
    plan = ex.partition(graph, cluster, costs, "data-parallel").with_memory(precision=precision)
    out = throughput(graph, plan, cluster, 0.5)
    assert out.tokens_per_s_per_device == 8 * 16 / 0.5 / 2
    assert out.model_flops_per_s_per_device == graph.total_flops / 0.5 / 2
    peak = 2 * (989e12 if precision == "bf16" else 67e12)
    assert peak_flops_per_s(cluster, plan) == peak
    assert out.mfu == pytest.approx(graph.total_flops / 0.5 / peak)
    assert "tokens/s/device" in out.describe() and "MFU" in out.describe()
    assert throughput(graph, plan, cluster, 0.0) is None
    assert throughput(tiny_builtin_graph("resnet"), plan, cluster, 0.5) is None
