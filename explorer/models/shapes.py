"""Published shapes of large models (Llama and GPT-3) for planning models nobody here can run.

Each shape is a configuration of a built-in architecture (:mod:`explorer.models.llama`,
:mod:`explorer.models.dense`) with the hidden size, layers, heads, key/value heads, FFN width,
vocabulary and training sequence length of the published model, and a micro-batch of one
sequence. ``explorer.models.build`` makes them on the meta device (no weights, nothing
allocated) unless weights are asked for; capture then runs on fake tensors.
"""

from __future__ import annotations

from explorer.models.dense import GPTConfig
from explorer.models.llama import LlamaConfig

#: Llama 3.2 1B (its LM head untied here), Llama 2 7B / 13B / 70B
LLAMA_SHAPES = {
    "llama-1b": LlamaConfig(vocab_size=128256, seq_len=8192, d_model=2048, n_layers=16,
                            n_heads=32, n_kv_heads=8, ffn_dim=8192, batch_size=1,
                            rope_theta=500000.0),
    "llama-7b": LlamaConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_layers=32,
                            n_heads=32, n_kv_heads=32, ffn_dim=11008, batch_size=1),
    "llama-13b": LlamaConfig(vocab_size=32000, seq_len=4096, d_model=5120, n_layers=40,
                             n_heads=40, n_kv_heads=40, ffn_dim=13824, batch_size=1),
    "llama-70b": LlamaConfig(vocab_size=32000, seq_len=4096, d_model=8192, n_layers=80,
                             n_heads=64, n_kv_heads=8, ffn_dim=28672, batch_size=1),
}


def _gpt3(d_model: int, n_layers: int, n_heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=50257, seq_len=2048, d_model=d_model, n_heads=n_heads,
                     n_layers=n_layers, batch_size=1)


#: GPT-3 (Brown et al. 2020, table 2.1); 1.3B takes 16 heads of 128 (the table's 24 heads of
#: 128 do not make its hidden size 2048) and 13B hidden 5120 = 40 x 128 (the table says 5140)
GPT3_SHAPES = {
    "gpt3-125m": _gpt3(768, 12, 12),
    "gpt3-350m": _gpt3(1024, 24, 16),
    "gpt3-1.3b": _gpt3(2048, 24, 16),
    "gpt3-2.7b": _gpt3(2560, 32, 32),
    "gpt3-6.7b": _gpt3(4096, 32, 32),
    "gpt3-13b": _gpt3(5120, 40, 40),
    "gpt3-175b": _gpt3(12288, 96, 96),
}
