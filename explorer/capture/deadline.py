"""A time limit on capture: the model's code runs on a worker thread that capture stops waiting for.

Capture runs the user's forward (a trial run, the export trace, the module-hook fallback), and a
forward may never return (``while True: ...``, a ``queue.get()`` nothing will answer). Python
cannot kill a thread, so :func:`run_within` runs the capture on a daemon thread and waits for it
at most the limit (:func:`capture_limit_s`). When the limit passes it raises
:class:`~explorer.core.errors.CaptureTimeout` in the caller, after two things:

- it injects an exception into the worker (``PyThreadState_SetAsyncExc``). A forward that loops
  in Python code stops at its next bytecode, and capture's own clean-up runs as it unwinds (the
  exception is a ``BaseException``, so neither capture's fallbacks nor the model's ``except
  Exception`` catch it). A worker blocked inside one call that never returns (a queue, a lock, a
  socket, a C extension) cannot be interrupted: its thread stays blocked, as the message says,
  and ends with that exception as soon as the call returns;
- when the worker has not ended, it puts the model's parameters, buffers (the objects, not
  values changed in place) and train/eval modes back itself, so the model is usable again, and
  ``sys.stderr`` (capture silences torch's printing while it traces).

Torch keeps some settings per thread: the worker gets the caller's default device and current
CUDA device, and runs with gradients on, as a training step does.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from explorer.core.errors import CaptureError, CaptureTimeout

#: the environment variable that sets the limit of every capture not given ``timeout_s``
TIMEOUT_ENV = "EXPLORER_CAPTURE_TIMEOUT_S"
#: the default limit: this much for any model ...
BASE_LIMIT_S = 300.0
#: ... plus this much per module (deep models trace longer) ...
LIMIT_S_PER_MODULE = 1.0
#: ... plus this much per million elements of real parameters, buffers and example tensors
#: (a real capture runs the model several times; GPT-3 125M, 2048 tokens: about 3 min on 2 cores)
LIMIT_S_PER_MILLION_ELEMENTS = 4.0
#: how long a stopped worker is given to unwind before the caller reports it still blocked
UNWIND_S = 2.0
#: the caller waits for the worker in slices this long (see :func:`_wait`)
WAIT_SLICE_S = 0.1

#: frames in these folders are torch's, the explorer's or Python's own, never the model's code
_NOT_USER = (str(Path(torch.__file__).parent), str(Path(__file__).parent.parent),
             sysconfig.get_paths()["stdlib"])

T = TypeVar("T")


class _Stop(BaseException):
    """Injected into a capture's worker thread when its time is up."""


def capture_limit_s(model: nn.Module, tensors: tuple[torch.Tensor, ...],
                    timeout_s: float | None) -> float:
    """The time limit of capturing ``model`` on ``tensors``: ``timeout_s`` when given, else the
    environment's ``EXPLORER_CAPTURE_TIMEOUT_S``, else a default that grows with the model
    (constants above). ``math.inf`` means no limit."""
    if timeout_s is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if text:
            try:
                timeout_s = float(text)
            except ValueError:
                raise CaptureError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds; set "
                                   "it to one (e.g. 1200), or unset it") from None
            where = f"{TIMEOUT_ENV}={text}"
        else:
            state = {id(t): t for t in (*model.parameters(), *model.buffers(), *tensors)}
            elements = sum(t.numel() for t in state.values() if not t.is_meta)
            n_modules = sum(1 for _ in model.modules())
            return (BASE_LIMIT_S + LIMIT_S_PER_MODULE * n_modules
                    + LIMIT_S_PER_MILLION_ELEMENTS * elements / 1e6)
    else:
        where = f"timeout_s={timeout_s!r}"
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or math.isnan(timeout_s) or timeout_s <= 0:
        raise CaptureError(f"{where}: the time limit of a capture must be a positive number of "
                           "seconds (math.inf for none)")
    return float(timeout_s)


@dataclass
class _Outcome:
    """What the worker hands back; ``finished`` is set under ``lock`` once ``work`` returned."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    value: Any = None
    error: BaseException | None = None


def run_within(work: Callable[[], T], limit_s: float, name: str, model: nn.Module) -> T:
    """``work()`` run on a worker thread; :class:`CaptureTimeout` when it takes over
    ``limit_s`` (module docstring). The worker's own exceptions are raised here."""
    outcome = _Outcome()
    settings = _ThreadSettings.of_caller()

    def main() -> None:
        try:
            try:
                with settings.applied():
                    outcome.value = work()
            finally:
                with outcome.lock:
                    outcome.finished = True
        except BaseException as exc:  # handed to the caller, which raises it
            outcome.error = exc
        finally:
            outcome.done.set()

    restore = _model_restorer(model)
    worker = threading.Thread(target=main, name=f"capture {name}", daemon=True)
    worker.start()
    try:
        ended = _wait(outcome.done, limit_s)
    except BaseException:  # KeyboardInterrupt while waiting: stop the worker too
        if not _stop_and_wait(worker, outcome, KeyboardInterrupt):
            restore()
        raise
    if not ended:
        where = _user_frame(worker)
        if not _stop_and_wait(worker, outcome, _Stop):
            restore()
            raise CaptureTimeout(_timeout_message(name, limit_s, where, stopped=False))
        worker.join(UNWIND_S)  # (it has unwound: let the thread itself end, not just its work)
        if isinstance(outcome.error, _Stop):
            raise CaptureTimeout(_timeout_message(name, limit_s, where, stopped=True))
        # else it finished just as its time was up: its result stands
    if outcome.error is not None:
        raise outcome.error
    return outcome.value


def _wait(done: threading.Event, limit_s: float) -> bool:
    """Whether ``done`` is set within ``limit_s``; waited for in short slices, so that an
    exception another thread injects into this one (a notebook stopping its background
    measuring) is raised here within a slice, not when the capture is over."""
    end = time.monotonic() + limit_s
    while not done.wait(min(WAIT_SLICE_S, max(0.0, end - time.monotonic()))):
        if time.monotonic() >= end:
            return False
    return True


def _stop_and_wait(worker: threading.Thread, outcome: _Outcome,
                   exc_type: type[BaseException]) -> bool:
    """Stop the worker with ``exc_type``; whether its work ended within ``UNWIND_S``.

    An exception injected while the worker runs a finalizer (``__del__``, a weakref callback:
    freeing tensors in a loop runs torch's) is dropped there: Python reports it to
    ``sys.unraisablehook`` and the worker goes on. While stopping, that hook notes such a drop
    (and passes the report on), and the exception is injected again."""
    dropped = threading.Event()
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is exc_type and threading.get_ident() == worker.ident:
            dropped.set()
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        end = time.monotonic() + UNWIND_S
        _stop(worker, outcome, exc_type)
        while not outcome.done.wait(min(WAIT_SLICE_S, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                return False
            if dropped.is_set():
                dropped.clear()
                _stop(worker, outcome, exc_type)
        return True
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


def _stop(worker: threading.Thread, outcome: _Outcome, exc_type: type[BaseException]) -> bool:
    """Inject ``exc_type`` into the worker unless its work has returned; whether it was."""
    with outcome.lock:
        if outcome.finished or worker.ident is None:
            return False
        hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                         ctypes.py_object(exc_type))
        return hit == 1


def _timeout_message(name: str, limit_s: float, where: str, stopped: bool) -> str:
    head = (f"capturing {name} did not finish within {limit_s:.0f} s: the model's forward (or "
            f"its trace) was still running{where}")
    if stopped:
        what = "; it was stopped."
    else:
        what = ("; it could not be stopped (it is blocked in a call Python cannot "
                "interrupt), so its thread stays blocked until that call returns, and then "
                "ends. The model's parameters and modes were put back.")
    return (f"{head}{what} If the forward waits or loops forever (a queue, a lock, a loop "
            "whose end depends on outside state), fix that; if it is only slow, raise the "
            f"limit: ex.capture(..., timeout_s=SECONDS) or the environment variable "
            f"{TIMEOUT_ENV}, or capture without running it (fake=True)")


def _user_frame(worker: threading.Thread) -> str:
    """" at file.py:LINE (code)" of the innermost frame of the model's own code the worker is
    in now; "" when it is in torch's, the explorer's or Python's code only."""
    frame = sys._current_frames().get(worker.ident or -1)
    if frame is None:
        return ""
    frames = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(_NOT_USER)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} ({(f.line or '').strip()[:80]})"


def _model_restorer(model: nn.Module) -> Callable[[], None]:
    """A function that puts back the parameter and buffer objects and the train/eval mode of
    every submodule of ``model`` as they are now, and ``sys.stdout`` / ``sys.stderr`` (capture
    silences torch's printing while it traces)."""
    saved = [(mod, dict(mod._parameters), dict(mod._buffers), mod.training)
             for mod in model.modules()]
    streams = sys.stdout, sys.stderr

    def restore() -> None:
        for mod, params, buffers, training in saved:
            mod._parameters.update(params)
            mod._buffers.update(buffers)
            mod.training = training
        sys.stdout, sys.stderr = streams

    return restore


@dataclass(frozen=True)
class _ThreadSettings:
    """The caller's per-thread torch settings a capture depends on."""

    default_device: torch.device
    cuda_device: int | None

    @classmethod
    def of_caller(cls) -> _ThreadSettings:
        cuda = (torch.cuda.current_device()
                if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        return cls(torch.get_default_device(), cuda)

    @contextlib.contextmanager
    def applied(self):
        with contextlib.ExitStack() as stack:
            if self.cuda_device is not None:
                torch.cuda.set_device(self.cuda_device)
            if self.default_device != torch.device("cpu"):
                stack.enter_context(torch.device(self.default_device))
            stack.enter_context(torch.enable_grad())
            yield
