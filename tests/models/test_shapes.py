"""Published large shapes: their numbers, built on the meta device, and configs that do not fit."""

from __future__ import annotations

import pytest
import torch

from explorer.core.errors import ExplorerError, UnknownNameError
from explorer.models import ModelConfigError, shape_names
from explorer.models import builtin as models
from explorer.models.dense import GPT, GPTConfig
from explorer.models.llama import LlamaConfig

#: (hidden, layers, heads, key/value heads, FFN, vocab, sequence, parameters)
PUBLISHED = {
    "llama-7b": (4096, 32, 32, 32, 11008, 32000, 4096, 6_738_415_616),
    "llama-13b": (5120, 40, 40, 40, 13824, 32000, 4096, 13_015_864_320),
    "llama-70b": (8192, 80, 64, 8, 28672, 32000, 4096, 68_976_648_192),
}


def test_names():
    names = shape_names()
    assert {"llama-1b", "llama-7b", "llama-13b", "llama-70b", "gpt3-125m",
            "gpt3-175b"} <= set(names)
    assert not set(names) & set(models.model_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama_shapes_are_the_published_ones(name):
    cfg = models.model_config(name)
    hidden, layers, heads, kv, ffn, vocab, seq, n_params = PUBLISHED[name]
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim,
            cfg.vocab_size, cfg.seq_len) == (hidden, layers, heads, kv, ffn, vocab, seq)
    bm = models.build(name)
    assert bm.n_params == cfg.n_params == n_params


@pytest.mark.parametrize("name", shape_names())
def test_shapes_build_on_the_meta_device(name):
    bm = models.build(name)
    assert not bm.weights
    assert all(t.is_meta for t in (*bm.module.parameters(), *bm.module.buffers(),
                                   *bm.example_inputs, *bm.targets))
    assert bm.batch_size == 1
    assert bm.example_inputs[0].shape[1] == models.model_config(name).seq_len


def test_gpt3_175b():
    bm = models.build("gpt3-175b")
    assert 174e9 < bm.n_params < 176e9


def test_a_shape_has_one_size():
    with pytest.raises(UnknownNameError, match="one size"):
        models.build("llama-7b", size="tiny")


def test_bf16_shape():
    bm = models.build("llama-1b", dtype=torch.bfloat16)
    assert {p.dtype for p in bm.module.parameters()} == {torch.bfloat16}


def test_families_on_the_meta_device_when_asked():
    for name in ("mlp", "gpt", "llama"):
        bm = models.build(name, "tiny", weights=False)
        assert all(p.is_meta for p in bm.module.parameters())
        assert bm.n_params == models.build(name, "tiny").n_params


@pytest.mark.parametrize("kwargs, match", [
    ({"d_model": 100, "n_heads": 3}, "not divisible by 3 heads"),
    ({"n_heads": 4, "n_kv_heads": 3}, "key/value heads"),
    ({"d_model": 36, "n_heads": 4}, "even head size"),
    ({"n_layers": 0}, "n_layers must be positive"),
])
def test_llama_config_that_does_not_fit(kwargs, match):
    base = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4,
            "n_kv_heads": 2, "ffn_dim": 64, "batch_size": 8}
    with pytest.raises(ModelConfigError, match=match) as info:
        LlamaConfig(**{**base, **kwargs})
    assert isinstance(info.value, ExplorerError)


def test_gpt_config_that_does_not_fit():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=30, n_heads=4, n_layers=1, batch_size=8)
    with pytest.raises(ModelConfigError, match="not divisible by n_heads 4"):
        GPT(cfg)
