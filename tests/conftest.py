"""Shared fixtures; the builders they use are in ``builders.py`` (tests/ is on sys.path)."""

from __future__ import annotations

import pytest
from builders import graph


@pytest.fixture
def chain3():
    return graph([("x", "input", [], 100), ("a", "op", ["x"], 100), ("b", "op", ["a"], 100),
                  ("c", "op", ["b"], 4)])
