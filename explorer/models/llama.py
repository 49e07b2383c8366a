"""Built-in Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from explorer.models.common import Built, ModelConfigError, next_token_batch, next_token_loss


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    batch_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads",
                      "ffn_dim", "batch_size"):
            if getattr(self, field) < 1:
                raise ModelConfigError(f"llama: {field} must be positive, got "
                                       f"{getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ModelConfigError(f"llama: hidden size {self.d_model} is not divisible by "
                                   f"{self.n_heads} heads; choose heads that divide it")
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(f"llama: {self.n_heads} heads cannot be shared evenly by "
                                   f"{self.n_kv_heads} key/value heads; choose a divisor")
        if self.head_dim % 2:
            raise ModelConfigError(f"llama: rotary positions need an even head size, got "
                                   f"{self.head_dim} (hidden {self.d_model} / "
                                   f"{self.n_heads} heads)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_params(self) -> int:
        """Parameters by formula: embeddings, per-layer attention, MLP and norms, head."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.d_model * (2 * self.d_model + 2 * kv)
        mlp = 3 * self.d_model * self.ffn_dim
        layer = attn + mlp + 2 * self.d_model
        return 2 * self.vocab_size * self.d_model + self.n_layers * layer + self.d_model


class RMSNorm(nn.Module):
    """x / rms(x) * weight (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Scale 1 everywhere (also what makes a meta-built norm real on a rank)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rms * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (B, H, T, D) by per-position angles (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_kv_heads`` key/value heads shared by the queries."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # x: (B, T, C)
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # (B, H, T, D) and (B, KV, T, D)
        group = self.n_heads // self.n_kv_heads
        if group > 1:  # each key/value head serves ``group`` query heads
            k = k.repeat_interleave(group, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token embedding, decoder layers, final RMSNorm, LM head (its own weight, untied)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        half = cfg.head_dim // 2
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T) int64
        t = tokens.shape[1]
        cos = self.rope_cos[:t].to(self.embed_tokens.weight.dtype)
        sin = self.rope_sin[:t].to(self.embed_tokens.weight.dtype)
        x = self.embed_tokens(tokens)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, T, V)


LLAMA_SIZES = {
    "tiny": LlamaConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4,
                        n_kv_heads=2, ffn_dim=64, batch_size=8),
    "small": LlamaConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4,
                         n_kv_heads=2, ffn_dim=160, batch_size=8),
    "default": LlamaConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=4, n_heads=4,
                           n_kv_heads=2, ffn_dim=344, batch_size=8),
    "large": LlamaConfig(vocab_size=32000, seq_len=1024, d_model=768, n_layers=12,
                         n_heads=12, n_kv_heads=4, ffn_dim=2048, batch_size=8),
}


def build_llama(cfg: LlamaConfig, batch_size: int, gen: torch.Generator | None) -> Built:
    """Llama and a next-token batch; on the meta device (no weights) when ``gen`` is None."""
    with torch.device("meta" if gen is None else "cpu"):
        module = Llama(cfg)
    inputs, next_tokens = next_token_batch(gen, batch_size, cfg.seq_len, cfg.vocab_size)
    kv = f" ({cfg.n_kv_heads} key/value)" if cfg.n_kv_heads != cfg.n_heads else ""
    desc = (f"Llama-style decoder: {cfg.n_layers} layers, hidden {cfg.d_model}, "
            f"{cfg.n_heads} heads{kv}, FFN {cfg.ffn_dim}, seq {cfg.seq_len}, "
            f"vocab {cfg.vocab_size}")
    return module, (inputs,), (next_tokens,), next_token_loss, desc
