"""What the built-in models share: losses, sizing helpers, random example data."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from explorer.core.errors import ExplorerError


# -- losses ----------------------------------------------------------------------------------
def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, classes) against class indices ``labels`` (B,)."""
    return F.cross_entropy(logits, labels)


def next_token_loss(logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, T, V) against the next token ids (B, T)."""
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)  # (B*T, V)
    flat_targets = next_tokens.reshape(-1)  # (B*T,)
    return F.cross_entropy(flat_logits, flat_targets)


# -- helpers ---------------------------------------------------------------------------------
def scaled(channels: int, width: float, minimum: int = 4) -> int:
    """``channels`` times the width multiplier, rounded, at least ``minimum``."""
    return max(minimum, round(channels * width))


def conv_out_px(size_px: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size_px + 2 * padding - kernel) // stride + 1


def check_px(model: str, size_px: int) -> None:
    if size_px < 1:
        raise ValueError(f"{model}: input resolution too small for the network's downsampling")


def random_images(gen: torch.Generator, batch_size: int, resolution_px: int) -> torch.Tensor:
    return torch.randn(batch_size, 3, resolution_px, resolution_px, generator=gen)


def random_labels(gen: torch.Generator, batch_size: int, n_classes: int) -> torch.Tensor:
    return torch.randint(0, n_classes, (batch_size,), generator=gen, dtype=torch.int64)


#: what a model builder returns: module, example inputs, targets, loss function, description
Built = tuple[nn.Module, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...],
               Callable[..., torch.Tensor], str]


def image_classification(module: nn.Module, resolution_px: int, n_classes: int,
                         batch_size: int, gen: torch.Generator, description: str) -> Built:
    """A CNN's training step: random images (B, 3, px, px), class labels (B,), cross-entropy."""
    x = random_images(gen, batch_size, resolution_px)
    y = random_labels(gen, batch_size, n_classes)
    return module, (x,), (y,), classification_loss, description


class ModelConfigError(ExplorerError, ValueError):
    """A model configuration whose numbers do not fit together (heads not dividing hidden)."""


def next_token_batch(gen: torch.Generator | None, batch_size: int, seq_len: int,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) and each position's following token (B, T); on the meta device (no
    values, nothing allocated) when ``gen`` is None."""
    if gen is None:
        empty = torch.empty((batch_size, seq_len), dtype=torch.int64, device="meta")
        return empty, torch.empty_like(empty)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
