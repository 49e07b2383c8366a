"""One trial run of the training step before capture, and what its failure means.

Inputs that do not fit the model (wrong number of them, a wrong shape or dtype where the model
first uses them) are the caller's to fix: :class:`InputMismatchError`. An error raised by the
model's own code on values it computed itself (a ``raise`` in its forward, a shape error deep
inside) is the model's: a :class:`CaptureError` naming the exception and where in the model's
code it was raised. The two are told apart by watching torch functions during the trial run:
the one that raised either was handed an example tensor (or a view of one) or was not.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from explorer.capture.fake import needs_real_data, user_frame
from explorer.capture.step import TrainStep, tensors_of
from explorer.core.errors import CaptureError, InputMismatchError


def first_line(exc: BaseException) -> str:
    """"TypeName: first line of the message", at most 300 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class _BatchWatch(TorchFunctionMode):
    """Remembers, for each exception a torch function raised, whether that function was given
    one of the example tensors (or a view of one)."""

    def __init__(self, batch: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.batch = batch
        self.raised: list[tuple[BaseException, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except Exception as exc:
            if not any(e is exc for e, _ in self.raised):
                self.raised.append((exc, self._given_batch(args, kwargs)))
            raise

    def _given_batch(self, args: Any, kwargs: Any) -> bool:
        for t in tensors_of([args, kwargs or {}]):
            if any(t is b or getattr(t, "_base", None) is b for b in self.batch):
                return True
        return False

    def at_boundary(self, exc: BaseException) -> bool:
        """Whether ``exc`` came from a torch function handed the example batch."""
        return any(e is exc and given for e, given in self.raised)


#: why a forward that enters ``torch.inference_mode()`` is refused
INFERENCE_MODE = (
    "the model's forward enters torch.inference_mode(), which torch.export does not record: "
    "the captured step would train through the ops inside it, unlike the model run eagerly. "
    "Use torch.no_grad() there instead (captured as it runs: those ops take no gradient)")


class _InferenceWatch(TorchFunctionMode):
    """Notes whether a torch function ran in inference mode."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.seen and torch.is_inference_mode_enabled():
            self.seen = True
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def refuse_inference_mode() -> Iterator[None]:
    """Raise :class:`CaptureError` after the body when code in it entered inference mode."""
    if torch.is_inference_mode_enabled():  # already on outside: nothing to tell apart
        yield
        return
    watch = _InferenceWatch()
    with watch:
        yield
    if watch.seen:
        raise CaptureError(INFERENCE_MODE)


def _check_arity(fn: Callable, n: int, what: str) -> None:
    try:
        sig = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
    except (TypeError, ValueError):  # a builtin without a signature: the run will tell
        return
    try:
        sig.bind(*range(n))
    except TypeError as exc:
        raise InputMismatchError(f"{what} cannot take {n} positional argument(s): {exc} "
                                 f"(its signature is {sig})") from None


def check_runs(step: TrainStep, inputs: tuple, targets: tuple) -> None:
    """Run the step once without gradients; raise what its failure means (module docstring)."""
    shapes = ", ".join(str(tuple(t.shape)) for t in (*inputs, *targets))
    _check_arity(step.model, len(inputs), f"the model's forward, given {len(inputs)} example "
                 "input(s),")
    if step.loss_fn is not None:
        _check_arity(step.loss_fn, 1 + len(targets),
                     f"loss_fn, called as loss_fn(output, *targets) with {len(targets)} "
                     "target(s),")
    watch = _BatchWatch((*inputs, *targets))
    try:
        with torch.no_grad(), watch, refuse_inference_mode():
            loss = step(*inputs, *targets)
    except CaptureError:
        raise
    except Exception as exc:
        data = needs_real_data(exc)
        if data is not None:
            raise data from exc
        if watch.at_boundary(exc):
            raise InputMismatchError(
                f"the example inputs do not fit the model: {first_line(exc)} (inputs and "
                f"targets had shapes {shapes}; dim 0 must be the batch)") from exc
        raise CaptureError(
            f"the model's forward raised {first_line(exc)}{user_frame(exc)}; the example "
            f"inputs (shapes {shapes}) were accepted where the model first used them, so the "
            "error is in the model's own code: fix it there (check it runs in plain PyTorch "
            "on this batch)") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InputMismatchError("the loss must be a single number; loss_fn returned "
                                 f"{type(loss).__name__} of shape "
                                 f"{tuple(getattr(loss, 'shape', ()))}")
