"""Hugging Face models as their default configs build them: GPT-2 and Llama keep a key/value
cache (``use_cache=True``) whose empty tensors the forward makes outside the trace, and they,
BERT, the T5 encoder and ViT capture on fake tensors, nothing allocated; a bare tensor is a
one-tensor batch."""

from __future__ import annotations

import pytest
import torch
from test_blocks import three_ways
from test_fake import assert_same_graph
from test_fake_hf import _lm_loss

import explorer as ex
from explorer.capture.blocks import MIN_BLOCKS
from explorer.capture.fake import FAKE_NOTE

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16


def _cached_gpt2(n_layer: int = 2):
    """A tiny GPT-2 with the default config's key/value cache on."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _batch():
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (4, SEQ), generator=gen),
            torch.randint(0, VOCAB, (4, SEQ), generator=gen))


def test_gpt2_with_its_cache_captures_on_fake_tensors_as_it_does_for_real():
    torch.manual_seed(0)
    model = _cached_gpt2()
    assert model.config.use_cache
    x, y = _batch()
    faked = ex.capture(model, x, _lm_loss, y, fake=True)
    assert_same_graph(ex.capture(model, x, _lm_loss, y), faked)
    assert any("lifted_tensor" in n.name for n in faked.nodes)  # the cache's empty tensors


def test_gpt2_with_its_cache_reuses_its_repeated_blocks():
    torch.manual_seed(0)
    model = _cached_gpt2(MIN_BLOCKS + 1)
    x, y = _batch()
    grown = three_ways(model, x, _lm_loss, y, real=False)
    lifted = [n.name for n in grown.nodes if "lifted_tensor" in n.name]
    assert len(lifted) == 2 * (MIN_BLOCKS + 1)  # numbered across blocks as export does
    assert len(set(lifted)) == len(lifted)


def test_a_bare_tensor_is_a_one_tensor_batch_and_target():
    torch.manual_seed(0)
    model = _cached_gpt2()
    x, y = _batch()
    bare = ex.capture(model, x, _lm_loss, y, fake=True)
    assert_same_graph(ex.capture(model, (x,), _lm_loss, [y], fake=True), bare)


def _image_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits, labels)


#: default configs (every size as published), built on the meta device
DEFAULTS = {
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()), "tokens",
             _lm_loss),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig()), "tokens",
              _lm_loss),
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig()), "tokens",
             _lm_loss),
    "t5-encoder": (lambda: transformers.T5EncoderModel(transformers.T5Config()), "tokens",
                   None),
    "vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig()),
            "images", _image_loss),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEFAULTS))
def test_default_configs_capture_without_running(name):
    make, kind, loss = DEFAULTS[name]
    with torch.device("meta"):
        model = make()
    if kind == "tokens":
        x = torch.randint(0, 1000, (2, 32))
        y = x if loss is not None else None
    else:
        x = torch.randn(2, 3, 224, 224)
        y = torch.zeros(2, dtype=torch.long)
    graph = ex.capture(model, x, loss, y)
    assert graph.notes[0] == FAKE_NOTE
    # (a tied weight is counted under each name, as export lists it)
    every = model.named_parameters(remove_duplicate=False)
    assert graph.param_bytes == 4 * sum(p.numel() for _, p in every)
    assert all(p.is_meta for p in model.parameters())
