"""Counting an op's FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` with the fused attention
kernels it has no formula for.

``FlopCounterMode`` counts the CUDA flash, memory-efficient and cuDNN attention kernels, but on
CPU (and on fake CPU tensors, which captures of published shapes use) ``scaled_dot_product_
attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``, which it does not know: the
attention of every model written with ``F.scaled_dot_product_attention`` would count zero
FLOPs. Its forward and backward are counted here with torch's own formulas for the CUDA
kernels (``sdpa_flop_count``: the full ``T x T`` scores, a causal mask not halving them, as
FlopCounterMode counts the CUDA kernels and as Megatron-LM's FLOP formula counts attention).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_attention_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                            **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


#: formulas for the kernels FlopCounterMode leaves at zero (arguments arrive as shapes)
EXTRA_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts fused attention on CPU."""
    return FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)


def causal_fraction(queries: int, keys: int) -> float:
    """The share of a ``queries x keys`` score matrix a causal mask leaves (query ``i`` sees
    keys ``0..i``, the mask ``is_causal`` makes): what a flash attention kernel, which skips
    the blocks the mask hides, computes of the FLOPs counted for the whole matrix."""
    if queries < 1 or keys < 1:
        return 1.0
    diagonal = min(queries, keys)  # (rows 0..diagonal-1 see i + 1 keys; the rest all keys)
    seen = diagonal * (diagonal + 1) // 2 + (queries - diagonal) * keys
    return seen / (queries * keys)


def attention_fraction(target: Any, args: tuple, kwargs: dict) -> float:
    """:func:`causal_fraction` of a ``scaled_dot_product_attention`` call with ``is_causal``
    (its arguments as values: query and key tensors first), else 1: a given mask may hide
    anything, and a kernel with one computes every score."""
    if target is not aten.scaled_dot_product_attention.default:
        return 1.0
    causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    query, key = args[0], args[1]
    if causal is not True or not all(isinstance(t, torch.Tensor) for t in (query, key)):
        return 1.0
    return causal_fraction(int(query.shape[-2]), int(key.shape[-2]))

