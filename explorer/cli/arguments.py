"""The command line's number arguments: whole numbers within bounds, refused by argparse with
what they must be."""

from __future__ import annotations

import argparse


def whole_from(lo: int, text: str) -> int:
    """``text`` as a whole number from ``lo`` to 10**9, or argparse's refusal."""
    try:
        value = int(text)
    except ValueError:
        value = lo - 1
    if not lo <= value <= 10**9:
        raise argparse.ArgumentTypeError(f"must be a whole number >= {lo} (at most 10**9), "
                                         f"not {text!r}")
    return value


def positive_int(text: str) -> int:
    return whole_from(1, text)


def whole(text: str) -> int:
    return whole_from(0, text)
