"""The ``explorer`` command line."""

from explorer.cli.commands import main

__all__ = ["main"]
