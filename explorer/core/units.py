"""Units and how the explorer writes numbers for people: bytes, seconds, rates and tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KiB = 2**10
MiB = 2**20
GiB = 2**30


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; the largest binary unit that keeps the number >= 1.

    >>> format_bytes(3 * MiB)
    '3.0 MiB'
    >>> format_bytes(12)
    '12 B'
    """
    return _in_largest_unit(nbytes, (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)), "B")


def format_seconds(s: float) -> str:
    """Seconds in the unit a person reads best.

    >>> format_seconds(0.0123)
    '12.30 ms'
    >>> format_seconds(2.5)
    '2.50 s'
    """
    if abs(s) >= 1:
        return f"{s:,.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    return f"{s * 1e6:,.1f} us"


def format_flops(x: float) -> str:
    """A FLOP count in the largest decimal unit that keeps the number >= 1.

    >>> format_flops(5.45e7)
    '54.5 MFLOP'
    >>> format_flops(512)
    '512 FLOP'
    """
    return _in_largest_unit(x, (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9),
                                ("MFLOP", 1e6), ("kFLOP", 1e3)), "FLOP")


def _in_largest_unit(x: float, units: tuple[tuple[str, float], ...], base: str) -> str:
    """``x`` in the first of ``units`` (largest first) it reaches, else whole ``base`` units."""
    for unit, k in units:
        if abs(x) >= k:
            return f"{x / k:,.1f} {unit}"
    return f"{x:,.0f} {base}"


def format_flops_rate(x: float) -> str:
    """``2e12`` -> ``'2.0 TFLOP/s'``."""
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def format_bandwidth(x: float) -> str:
    """Bytes per second in decimal units, as datasheets give them: ``'1.5 GB/s'``."""
    return f"{x / 1e12:.2f} TB/s" if x >= 1e12 else f"{x / 1e9:.1f} GB/s"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: columns padded to their widest cell, a rule under the headers.

    >>> print(table(["a", "bb"], [[1, 2], [333, 4]]))
    a    bb
    ---  --
    1    2
    333  4
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
