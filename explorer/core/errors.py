"""Errors a user of the explorer can meet, each with a message that says what to do."""

from __future__ import annotations


class ExplorerError(Exception):
    """Base class of every error the explorer raises on purpose."""


class CaptureError(ExplorerError):
    """The model could not be turned into a graph."""


class CaptureTimeout(ExplorerError):
    """Capturing the model took longer than its time limit (its forward may never return).
    Not a :class:`CaptureError`: another way of capturing would run the same forward and wait
    as long again."""


class InputMismatchError(ExplorerError):
    """The example inputs do not fit the model."""


class PlanError(ExplorerError):
    """A plan is malformed, made for another graph, or names unknown devices."""


class MemoryExceededError(ExplorerError):
    """A plan needs more memory than a device has."""


class UnknownNameError(ExplorerError, KeyError):
    """An unknown model, algorithm, preset or device name."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


def unknown_name(kind: str, name: str, known) -> UnknownNameError:
    """Build the error for an unknown ``name`` of ``kind``, listing what is known."""
    known = sorted(known)
    return UnknownNameError(f"unknown {kind} {name!r}; choose one of: {', '.join(known)}")
