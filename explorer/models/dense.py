"""Built-in MLP and GPT (a decoder-only transformer in the nanoGPT style)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from explorer.models.common import (
    Built,
    ModelConfigError,
    classification_loss,
    next_token_batch,
    next_token_loss,
    random_labels,
)


# -- MLP -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLPConfig:
    in_features: int
    hidden_features: int
    n_hidden_layers: int
    n_classes: int
    batch_size: int


class MLP(nn.Module):
    """``n_hidden_layers`` Linear+ReLU layers followed by a linear classifier head."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        features = cfg.in_features
        for _ in range(cfg.n_hidden_layers):
            layers += [nn.Linear(features, cfg.hidden_features), nn.ReLU()]
            features = cfg.hidden_features
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(features, cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, in_features)
        return self.head(self.layers(x))  # (B, n_classes)


MLP_SIZES = {
    "tiny": MLPConfig(in_features=32, hidden_features=64, n_hidden_layers=2, n_classes=10,
                      batch_size=8),
    "small": MLPConfig(in_features=64, hidden_features=128, n_hidden_layers=3, n_classes=10,
                       batch_size=16),
    "default": MLPConfig(in_features=784, hidden_features=1024, n_hidden_layers=4, n_classes=10,
                         batch_size=64),
    "large": MLPConfig(in_features=3072, hidden_features=4096, n_hidden_layers=8,
                       n_classes=1000, batch_size=256),
}


def build_mlp(cfg: MLPConfig, batch_size: int, gen: torch.Generator) -> Built:
    module = MLP(cfg)
    x = torch.randn(batch_size, cfg.in_features, generator=gen)
    y = random_labels(gen, batch_size, cfg.n_classes)
    desc = (f"MLP: {cfg.n_hidden_layers} Linear+ReLU layers of {cfg.hidden_features}, "
            f"{cfg.in_features} inputs, {cfg.n_classes} classes")
    return module, (x,), (y,), classification_loss, desc


# -- GPT -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    batch_size: int
    mlp_ratio: int = 4
    #: attention as one fused kernel (``F.scaled_dot_product_attention``, flash attention on a
    #: GPU: no ``T x T`` scores kept) instead of explicit matmuls and softmax
    fused_attention: bool = False


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written with explicit matmuls and softmax."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ModelConfigError(f"gpt: d_model {cfg.d_model} is not divisible by n_heads "
                                   f"{cfg.n_heads}; choose heads that divide the hidden size")
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.scale = self.head_dim ** -0.5
        self.fused = cfg.fused_attention
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # True above the diagonal: the future positions a token must not attend to
        if not cfg.fused_attention:
            future = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(diagonal=1)
            self.register_buffer("future_mask", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        b, t, _ = x.shape
        c = self.n_heads * self.head_dim  # (C, or a tensor-parallel rank's share of its heads)
        q, k, v = self.qkv(x).split(c, dim=2)  # each (B, T, C)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        else:
            scores = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, T, T)
            scores = scores.masked_fill(self.future_mask[:t, :t], float("-inf"))
            weights = scores.softmax(dim=-1)  # (B, H, T, T)
            y = weights @ v  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(b, t, c)  # (B, T, C)
        return self.proj(y)


class FeedForward(nn.Module):
    """Position-wise MLP: Linear, GELU, Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        return self.proj(self.act(self.fc(x)))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm decoder block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style decoder: token + position embeddings, blocks, final LayerNorm, LM head.

    The LM head has its own weight (not tied to the token embedding) so that every parameter
    belongs to exactly one module, which keeps partitions simple.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.Sequential(*(TransformerBlock(cfg) for _ in range(cfg.n_layers)))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T) int64
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)  # (T,)
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, T, C)
        x = self.blocks(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


GPT_SIZES = {
    "tiny": GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2,
                      batch_size=8),
    "small": GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2,
                       batch_size=8),
    "default": GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_heads=4, n_layers=4,
                         batch_size=8),
    "large": GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_heads=12, n_layers=12,
                       batch_size=8),
}


def build_gpt(cfg: GPTConfig, batch_size: int, gen: torch.Generator | None) -> Built:
    """GPT and a next-token batch; on the meta device (no weights) when ``gen`` is None."""
    with torch.device("meta" if gen is None else "cpu"):
        module = GPT(cfg)
    inputs, next_tokens = next_token_batch(gen, batch_size, cfg.seq_len, cfg.vocab_size)
    desc = (f"GPT-style decoder: {cfg.n_layers} layers, d_model {cfg.d_model}, "
            f"{cfg.n_heads} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}")
    return module, (inputs,), (next_tokens,), next_token_loss, desc


