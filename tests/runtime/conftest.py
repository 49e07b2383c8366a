"""Fixtures of the runtime tests."""

from __future__ import annotations

import os

import pytest

#: this folder: factory_models.py, the factories tests name as "module:function"
FACTORIES = os.path.dirname(__file__)


@pytest.fixture
def factories(monkeypatch):
    """factory_models importable here and on the ranks (their PYTHONPATH)."""
    monkeypatch.syspath_prepend(FACTORIES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (FACTORIES, os.environ.get("PYTHONPATH", "")) if p))
