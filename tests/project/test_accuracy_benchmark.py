"""benchmarks/accuracy.py's reading of a setting against its plan without settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import accuracy


def test_each_setting_is_read_against_the_same_plan_without_settings():
    rows = [("gpt", "single", "segments", "4.00", "5.00"),
            ("gpt", "single recompute=full", "segments", "6.00", "6.00"),
            ("gpt", "data-parallel zero=3", "segments", "9.00", "9.00"),  # (no plain plan)
            ("mlp", "single", "segments", "-", "-"),
            ("mlp", "single recompute=full", "segments", "1.00", "1.00")]
    # predicted 1.5 times the plain step, measured 1.2 times: the plain plan's -20 % apart
    assert accuracy.setting_ratios(rows) == [pytest.approx((1.5, 1.2))]
