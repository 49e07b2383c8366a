"""Contiguous runs of weighted layers of near-equal weight, the cut layer-based splits share."""

from __future__ import annotations


def contiguous(weights: list[float], k: int) -> list[int]:
    """Cut a sequence of weighted layers into ``k`` contiguous runs of near-equal weight.

    Returns the stage of each layer. A new stage starts when the middle of a layer passes the
    next ``j/k`` share of the total; every stage gets at least one layer when there are enough.

    >>> contiguous([1, 1, 1, 1], 2)
    [0, 0, 1, 1]
    >>> contiguous([3, 1, 1, 1], 2)
    [0, 1, 1, 1]
    """
    n = len(weights)
    k = max(1, min(k, n))
    w = [float(x) for x in weights] if any(weights) else [1.0] * n
    total = sum(w)
    out: list[int] = []
    acc, s = 0.0, 0
    for j, x in enumerate(w):
        if s < k - 1 and out and out[-1] == s:
            must_move = n - j <= k - 1 - s  # later stages would otherwise stay empty
            if must_move or acc + x / 2 > total * (s + 1) / k:
                s += 1
        out.append(s)
        acc += x
    return out


__all__ = ["contiguous"]


def in_turn(weights: list[float], stages: int, chunks: int) -> list[int]:
    """Cut weighted layers into ``stages x chunks`` contiguous runs of near-equal weight
    (:func:`contiguous`), run ``j`` on stage ``j mod stages``: the stage of each layer, the
    chunks going round the stages in turn (virtual pipeline stages; one chunk each: a plain
    contiguous cut).

    >>> in_turn([1, 1, 1, 1], 2, 2)
    [0, 1, 0, 1]
    """
    return [c % stages for c in contiguous(weights, stages * chunks)]
