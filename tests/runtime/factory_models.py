"""Model factories that exported-script tests name as "module:function" (this folder is on
the ranks' PYTHONPATH)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

import explorer as ex

NOT_CALLABLE = 42


def tiny_gpt():
    """The built-in tiny GPT with its example batch (what the command line needs)."""
    return ex.builtin_model("gpt", "tiny")


def mlp_module() -> nn.Module:
    """A small MLP, the same weights on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mlp_on_meta() -> nn.Module:
    """The same MLP with its parameters on the meta device: ranks initialise their own."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def hf_gpt2():
    """Hugging Face's GPT-2 built from a config (tiny, no download), with its example batch
    and loss, as ex.builtin_model gives them (what a native script trains with)."""
    return _hf_gpt2(tie_word_embeddings=True)


def _hf_gpt2(tie_word_embeddings: bool):
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tie_word_embeddings)
    return _causal_lm(transformers.GPT2LMHeadModel, config, logits_loss)


def _causal_lm(kind, config, loss_fn, wrap=lambda model: model):
    """A Hugging Face causal LM of ``kind`` from ``config`` (vocabulary 128), the same weights
    on every call, with a batch of 8 sequences of 16 token ids and their next tokens."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = kind(config)
    gen = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 128, (8, 16), generator=gen, device="cpu")
                   for _ in range(2))
    return SimpleNamespace(module=wrap(model), example_inputs=(ids,), targets=(labels,),
                           loss_fn=loss_fn)


def logits_loss(out, y):
    """Cross-entropy of a Hugging Face causal LM's logits."""
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM that returns its logits tensor (what a pipeline's stages
    pass on), not its output object."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def hf_gpt2_untied():
    """hf_gpt2 with an output layer of its own (not tied to the token embedding)."""
    return _hf_gpt2(tie_word_embeddings=False)


def hf_gpt2_logits():
    """hf_gpt2 with an output layer of its own (not tied to the token embedding), its
    module returning the logits and its loss reading them: what torch's pipeline splits."""
    made = hf_gpt2_untied()
    return SimpleNamespace(module=LogitsOnly(made.module), example_inputs=made.example_inputs,
                           targets=made.targets, loss_fn=tensor_loss)


def tensor_loss(logits, y):
    """Cross-entropy of (batch, sequence, classes) logits."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def hf_llama_logits():
    """Hugging Face's Llama built from a config (tiny, grouped-query attention, no
    download), its module returning the logits: what torch's tensor-parallel styles split."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False, tie_word_embeddings=False)
    return _causal_lm(transformers.LlamaForCausalLM, config, tensor_loss, LogitsOnly)
