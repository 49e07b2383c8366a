"""Built-in models (MLP, AlexNet, VGG-16, ResNet, GPT, Inception) for demos, tests and labs.

Every model is written in plain ``torch.nn`` (no torchvision, no downloaded weights) and comes
in four sizes: ``"tiny"`` for unit tests, ``"small"``, ``"default"`` for demos and ``"large"``
(close to the published shape, for GPU presets and planning). ``build`` returns the module in
training mode together with deterministic example inputs, valid targets and a loss function,
so that ``loss_fn(module(*example_inputs), *targets)`` is one training step's loss and
``torch.export`` can capture it. Dropout defaults to ``p=0.0`` so runs are deterministic and
comparable across devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from explorer.core.errors import unknown_name
from explorer.models.common import Built
from explorer.models.dense import GPT_SIZES, MLP_SIZES, build_gpt, build_mlp
from explorer.models.vision import (
    ALEXNET_SIZES,
    INCEPTION_SIZES,
    RESNET_SIZES,
    VGG_SIZES,
    build_alexnet,
    build_inception,
    build_resnet,
    build_vgg16,
)

SIZES = ("tiny", "small", "default", "large")
DEFAULT_MODEL = "gpt"


@dataclass(frozen=True)
class BuiltinModel:
    """A model ready for one training step: ``loss_fn(module(*example_inputs), *targets)``.

    Dim 0 of every input and every target is the batch dimension.
    """

    name: str
    description: str
    module: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor]
    size: str

    @property
    def batch_size(self) -> int:
        return int(self.example_inputs[0].shape[0])

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


# -- registry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    sizes: Mapping[str, Any]
    make: Callable[[Any, int, torch.Generator], Built]


_REGISTRY: dict[str, _Entry] = {
    "mlp": _Entry(MLP_SIZES, build_mlp),
    "alexnet": _Entry(ALEXNET_SIZES, build_alexnet),
    "vgg16": _Entry(VGG_SIZES, build_vgg16),
    "resnet": _Entry(RESNET_SIZES, build_resnet),
    "gpt": _Entry(GPT_SIZES, build_gpt),
    "inception": _Entry(INCEPTION_SIZES, build_inception),
}


def model_names() -> list[str]:
    """Names of the built-in models, sorted."""
    return sorted(_REGISTRY)


def model_config(name: str, size: str = "default") -> Any:
    """The frozen configuration dataclass behind ``build(name, size)``."""
    if name not in _REGISTRY:
        raise unknown_name("model", name, _REGISTRY)
    if size not in SIZES:
        raise unknown_name("size", size, SIZES)
    return _REGISTRY[name].sizes[size]


def build(name: str, size: str = "default", batch_size: int | None = None,
          seed: int = 0) -> BuiltinModel:
    """Build model ``name`` at ``size`` in training mode, with inputs, targets and loss.

    Parameters, inputs and targets depend only on ``seed`` (and the arguments); the global RNG
    state is left as it was. ``batch_size`` overrides the size's default batch (a multiple of
    8 by default, so data-parallel and micro-batch splits divide evenly).
    """
    cfg = model_config(name, size)
    if batch_size is None:
        batch_size = cfg.batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # parameter initialisation uses the (forked) global RNG
        gen = torch.Generator().manual_seed(seed)
        module, inputs, targets, loss_fn, description = _REGISTRY[name].make(cfg, batch_size, gen)
    module.train()
    return BuiltinModel(name=name, description=description, module=module,
                        example_inputs=inputs, targets=targets, loss_fn=loss_fn, size=size)
