"""Capture without running: fake tensors stand in for parameters, buffers and the batch.

Under ``FakeTensorMode`` every op computes output shapes, dtypes and strides but no values, so
a model of any size is traced, FLOP-counted and replayed without allocating its memory. Models
built on the meta device (``with torch.device("meta")``) are captured this way automatically:
their parameters are turned into fake CPU tensors, which (unlike meta tensors) also trace code
that reads sizes back with ``.item()``: torch.export makes such values symbolic.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from explorer.core.errors import CaptureError, MemoryExceededError
from explorer.core.units import format_bytes

#: the first note of every graph captured on fake tensors (runtime and profiling read it)
FAKE_NOTE = ("captured without running the model (fake tensors: shapes, dtypes and FLOPs, no "
             "values): it can be planned and simulated but not run or measured; to run it, "
             "build it with real weights and capture with fake=False")

#: frames in these folders are torch's or capture's own, never the model's code
_NOT_USER = (str(Path(torch.__file__).parent), str(Path(__file__).parent))


def is_fake_graph(notes: tuple[str, ...]) -> bool:
    """Whether a graph with these notes was captured on fake tensors."""
    return FAKE_NOTE in notes


def on_meta(model: nn.Module, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether any parameter, buffer or example tensor lives on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers(), *tensors))


class FakeWorld:
    """One ``FakeTensorMode`` and the fake copies of a model's state and example batch."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor of ``t``'s shape, strides and dtype (on the CPU when ``t`` is meta)."""
        device = "cpu" if t.is_meta else t.device
        with self.mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                       device=device)

    def faked(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` if it is one of this world's fake tensors, else a fake copy of it: a
        constant the forward made as a real tensor (``torch.tensor([])`` in a Hugging Face
        cache) meets the fake ones only as a fake tensor itself."""
        if isinstance(t, FakeTensor) and t.fake_mode is self.mode:
            return t
        return self.tensor(t)

    @contextlib.contextmanager
    def swapped(self, model: nn.Module) -> Iterator[None]:
        """Inside, ``model``'s parameters and buffers are fake (tied ones stay tied); the real
        (or meta) ones are back after."""
        made: dict[int, torch.Tensor] = {}
        undo: list[tuple[dict, str, torch.Tensor]] = []
        try:
            for mod in model.modules():
                for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
                    for key, t in list(table.items()):
                        if t is None:
                            continue
                        if id(t) not in made:
                            f = self.tensor(t.detach())
                            made[id(t)] = nn.Parameter(f, t.requires_grad) if is_param else f
                        undo.append((table, key, t))
                        table[key] = made[id(t)]
            yield
        finally:
            for table, key, t in reversed(undo):
                table[key] = t


def needs_real_data(exc: BaseException) -> CaptureError | None:
    """The error to raise when tracing on fake tensors failed because the model reads values
    (``.item()``, ``.tolist()``, ``nonzero`` ...) and branches on them; None for other errors."""
    kinds = (DataDependentOutputException, DynamicOutputShapeException,
             GuardOnDataDependentSymNode)
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen and not isinstance(e, kinds):
        seen.append(e)
        e = e.__cause__ or e.__context__
    if e is None or not isinstance(e, kinds):
        return None
    op = getattr(e, "func", None)
    if op is not None:
        what = f"op {op}"
    else:
        lines = str(e).strip().splitlines()
        what = f"a Python branch on a tensor's value ({lines[0][:120] if lines else ''})"
    where = user_frame(e)
    return CaptureError(
        f"the model needs real data to trace: {what}{where} reads a tensor's value, which "
        f"fake tensors do not have ({type(e).__name__}). Capture it with real weights "
        "(fake=False), or make that code value-free: use sizes (x.shape) instead of values, "
        "torch._check(...) to state what a value satisfies, or torch.cond for a branch")


def check_sizes_known(fx: Any, shapes: tuple[tuple[Any, ...], ...]) -> None:
    """Refuse an op whose output size depends on tensor values (``nonzero``, indexing with a
    mask, ``bincount`` ...): on fake tensors that size is a symbol with no value, and nothing
    after it (memory, costs, the plan) can be counted."""
    if all(isinstance(d, int) for shape in shapes for d in shape):
        return
    shown = next(s for s in shapes if not all(isinstance(d, int) for d in s))
    raise CaptureError(
        f"the model needs real data to trace: op {fx.target}{_stack_frame(fx)} makes an "
        f"output whose size depends on tensor values ({tuple(str(d) for d in shown)}), "
        "which fake tensors do not have. Capture it with real weights (fake=False), or make "
        "that size value-free (multiply by a mask instead of indexing with it)")


def _stack_frame(fx: Any) -> str:
    """" at file.py:LINE" of the innermost frame of the user's code that made ``fx``."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', fx.meta.get("stack_trace") or "")
    users = [(f, n) for f, n in frames if not f.startswith(_NOT_USER)]
    if not users:
        return ""
    f, n = users[-1]
    return f" at {os.path.basename(f)}:{n}"


def user_frame(exc: BaseException) -> str:
    """" at file.py:LINE (code)" of the innermost frame of the model's (or loss's) own code in
    the traceback of ``exc``; "" when it passed through torch's and capture's code only."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_NOT_USER)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} ({(f.line or '').strip()[:80]})"


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device``; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(model: nn.Module) -> None:
    """A real capture copies every parameter and buffer once more: fail early, pointing at the
    fake path, when that copy cannot fit in the memory left."""
    state = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    by_device: dict[torch.device, int] = {}
    for t in state:
        by_device[t.device] = by_device.get(t.device, 0) + t.numel() * t.element_size()
    for device, need in by_device.items():
        free = available_bytes(device)
        if free is not None and need > free:
            raise MemoryExceededError(
                f"capturing by running the model copies its {format_bytes(need)} of parameters "
                f"and buffers on {device}, which has {format_bytes(free)} free; capture it "
                "without running: ex.capture(..., fake=True), or build it on the meta device")
