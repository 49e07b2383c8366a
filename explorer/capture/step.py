"""The training-step wrapper that capture exports, and the runtime objects a capture keeps."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx.node import map_aggregate

from explorer.core.errors import CaptureError

WRAPPED = "model"  # attribute name of the user's model inside the train-step wrapper


class TrainStep(nn.Module):
    """The model plus its loss: what one training step runs forward."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, n_inputs: int) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        inputs, targets = args[: self.n_inputs], args[self.n_inputs:]
        out = self.model(*inputs)
        if self.loss_fn is not None:
            return self.loss_fn(out, *targets)
        return surrogate_loss(out)


def surrogate_loss(out: Any) -> torch.Tensor:
    """Mean of the first floating output: stands in for a loss when none is given."""
    leaves = [t for t in tensors_of(out) if t.is_floating_point()]
    if not leaves:
        raise CaptureError("the model returned no floating-point tensor to train on; "
                           "pass loss_fn=... that turns its output into a scalar loss")
    out = leaves[0] if leaves[0].dtype == torch.float32 else leaves[0].float()
    return out.mean()


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors inside a (nested) tuple/list/dict value, in order."""
    out: list[torch.Tensor] = []
    map_aggregate(x, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def copies(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Detached copies (same requires_grad) of a batch: a model that changes its inputs in
    place (``x.mul_(3)``) changes these, never the caller's tensors or the recorded batch."""
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def strip_wrapper(path: str) -> str:
    """A module path inside the train-step wrapper as a path inside the user's model."""
    if path == WRAPPED:
        return ""
    return path[len(WRAPPED) + 1:] if path.startswith(WRAPPED + ".") else path


@contextlib.contextmanager
def training_mode(module: nn.Module):
    """Train mode inside (a training step: dropout on, batch statistics in BatchNorm); every
    submodule's own mode back after."""
    modes = {m: m.training for m in module.modules()}
    try:
        module.train()
        yield
    finally:
        for m, training in modes.items():
            m.training = training


@contextlib.contextmanager
def keep_buffers(model: nn.Module):
    """Running the model updates buffers in place (BatchNorm's running statistics): undo it."""
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in saved:
                    b.copy_(saved[k])


@dataclass
class CaptureRuntime:
    """What profiling and execution need from a capture: never saved to disk."""

    step: TrainStep
    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    program: Any = None  # torch.export.ExportedProgram when source == "export"
    fx_nodes: dict[str, Any] = field(default_factory=dict)  # our node name -> fx node
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # param/buffer name -> tensor

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (*self.inputs, *self.targets)

    def values(self, device: str | torch.device = "cpu") -> dict[str, Any]:
        """Run the captured graph once on its tensors; the value of every node by name."""
        env: dict[str, Any] = {}
        user = iter(self.args)
        for name, fx in self.fx_nodes.items():
            if fx.op == "placeholder":
                v = self.state[name] if name in self.state else next(user)
                env[name] = v.detach().to(device).clone()
            else:
                args, kwargs = self.resolve(fx, env)
                with torch.no_grad():
                    env[name] = fx.target(*args, **kwargs)
        return env

    @property
    def names(self) -> dict[Any, str]:
        """fx node -> our node name (built once)."""
        if getattr(self, "_names", None) is None or len(self._names) != len(self.fx_nodes):
            self._names = {v: k for k, v in self.fx_nodes.items()}
        return self._names

    def resolve(self, fx: Any, env: dict[str, Any]) -> tuple[tuple, dict]:
        """The positional and keyword arguments of an fx node, looked up in ``env``."""
        names = self.names
        lookup = lambda a: env[names[a]] if isinstance(a, torch.fx.Node) else a  # noqa: E731
        return map_aggregate(fx.args, lookup), map_aggregate(fx.kwargs, lookup)
