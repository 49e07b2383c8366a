"""The command line's bound on the batch it builds a built-in model at: the example batch and
its activations estimated from the model at one sample, before anything that size exists."""

from __future__ import annotations

import torch

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.limits import MAX_BATCH_SIZE
from explorer.core.units import format_bytes
from explorer.devices.discovery import total_memory_bytes
from explorer.models.builtin import shape_names

#: the share of this machine's memory the example batch and its activations may take
BATCH_MEMORY_FRACTION = 0.5


def bytes_per_sample(model: str, size: str) -> int:
    """Bytes of one sample's inputs and targets plus every module's forward outputs (the
    activations kept for backward, roughly), from the model built at a batch of one on the
    meta device (shapes only, nothing computed)."""
    bm = ex.builtin_model(model, size, 1, weights=False)
    total = sum(t.numel() * t.element_size() for t in (*bm.example_inputs, *bm.targets))
    outputs: list[int] = []

    def count(module, args, out) -> None:
        outputs.extend(t.numel() * t.element_size() for t in _tensors(out))

    leaves = [m for m in bm.module.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            bm.module(*bm.example_inputs)
    except Exception:  # (a model the meta device cannot run: its batch bytes alone)
        outputs.clear()
    finally:
        for h in hooks:
            h.remove()
    return total + sum(outputs)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def check_batch_size(model: str, size: str, batch_size: int | None) -> None:
    """Refuse a batch whose example batch and activations would take more than
    ``BATCH_MEMORY_FRACTION`` of this machine's memory (or more than ``MAX_BATCH_SIZE``
    samples), before the model is built at it; None (the size's own batch) passes, and so
    does any batch of a published shape, which is built on the meta device and captured on
    fake tensors (nothing that size is allocated)."""
    if batch_size is None:
        return
    if batch_size > MAX_BATCH_SIZE:
        raise ExplorerError(f"a batch of {batch_size:,} samples is more than the "
                            f"{MAX_BATCH_SIZE:,} the explorer builds; use a smaller "
                            "--batch-size")
    if model in shape_names():
        return
    per = bytes_per_sample(model, size)
    room = int(total_memory_bytes() * BATCH_MEMORY_FRACTION)
    if per * batch_size > room:
        raise ExplorerError(
            f"{model} ({size}) at a batch of {batch_size:,} samples needs about "
            f"{format_bytes(per * batch_size)} for the example batch and its activations "
            f"({format_bytes(per)} a sample), more than {BATCH_MEMORY_FRACTION:.0%} of this "
            f"machine's {format_bytes(total_memory_bytes())}; use a batch of at most "
            f"{max(room // max(per, 1), 1):,} (--batch-size)")


__all__ = ["BATCH_MEMORY_FRACTION", "bytes_per_sample", "check_batch_size"]
