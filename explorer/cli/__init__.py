"""The ``explorer`` command line."""

from explorer.cli.main import main

__all__ = ["main"]
