"""Hugging Face GPT-2, BERT and Llama (built from small configs, never downloaded): real and
fake captures give the same graph, a Llama built on the meta device captures at all, and
their repeated layers are traced once and grown to the full graph."""

from __future__ import annotations

import pytest
import torch
from test_blocks import assert_falls_back, three_ways
from test_fake import assert_same_graph

import explorer as ex
from explorer.capture.blocks import MIN_BLOCKS

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16


def _lm_loss(out, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))


def _gpt2(n_layer: int = 2, **kw):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
        eos_token_id=0, **kw))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _llama_config(**kw):
    shape = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB,
             "max_position_embeddings": SEQ, **kw}
    return transformers.LlamaConfig(use_cache=False, bos_token_id=0, eos_token_id=0, **shape)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (4, SEQ), generator=gen),
            torch.randint(0, VOCAB, (4, SEQ), generator=gen))


@pytest.mark.parametrize("make", [_gpt2, _bert, lambda: transformers.LlamaForCausalLM(
    _llama_config())], ids=["gpt2", "bert", "llama"])
def test_real_and_fake_capture_give_the_same_graph(make):
    torch.manual_seed(0)
    model = make()
    x, y = _batch()
    real = ex.capture(model, x, _lm_loss, y)
    faked = ex.capture(model, x, _lm_loss, y, fake=True)
    assert real.source == "export"
    assert_same_graph(real, faked)


def test_llama_built_on_the_meta_device_captures_without_running():
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(_llama_config())
    torch.manual_seed(0)
    real_model = transformers.LlamaForCausalLM(_llama_config())
    x, y = _batch()
    faked = ex.capture(meta, x, _lm_loss, y)
    assert_same_graph(ex.capture(real_model, x, _lm_loss, y), faked)
    assert all(p.is_meta for p in meta.parameters())


def test_bf16_llama_keeps_its_dtype():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).to(torch.bfloat16)
    x, y = _batch()
    faked = ex.capture(model, x, _lm_loss, y, fake=True)
    assert_same_graph(ex.capture(model, x, _lm_loss, y), faked)
    n_params = sum(p.numel() for p in model.parameters())
    assert faked.param_bytes == 2 * n_params


@pytest.mark.parametrize("n_layers", [MIN_BLOCKS, 6])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_repeated_layers_grow_to_the_full_graph(kind, n_layers):
    torch.manual_seed(0)
    model = (_gpt2(n_layers) if kind == "gpt2"
             else transformers.LlamaForCausalLM(_llama_config(num_hidden_layers=n_layers)))
    x, y = _batch()
    three_ways(model, x, _lm_loss, y, n_layers == MIN_BLOCKS)
    attn = model.model.layers[3].self_attn if kind == "llama" else model.transformer.h[3].attn
    assert type(attn.layer_idx) is int and attn.layer_idx == 3  # its own index given back


def test_layers_that_differ_by_index_are_traced_in_full():
    torch.manual_seed(0)  # attention scaled by 1 / (layer index + 1): the layers differ
    model = _gpt2(MIN_BLOCKS, scale_attn_by_inverse_layer_idx=True)
    x, y = _batch()
    assert_falls_back(model, x, _lm_loss, y, "differs between blocks")
