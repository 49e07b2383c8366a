"""Built-in models (MLP, AlexNet, VGG-16, ResNet, GPT, Llama, Inception) and published large
shapes (Llama 1B-70B, GPT-3 125M-175B) for demos, tests, labs and planning.

Every model is written in plain ``torch.nn`` (no torchvision, no downloaded weights) and comes
in four sizes: ``"tiny"`` for unit tests, ``"small"``, ``"default"`` for demos and ``"large"``
(close to the published shape, for GPU presets and planning). ``build`` returns the module in
training mode together with deterministic example inputs, valid targets and a loss function,
so that ``loss_fn(module(*example_inputs), *targets)`` is one training step's loss and
``torch.export`` can capture it. Dropout defaults to ``p=0.0`` so runs are deterministic and
comparable across devices.

The published shapes (:mod:`explorer.models.shapes`, e.g. ``"llama-70b"``) have one size and a
micro-batch of one sequence; they are built on the meta device (no weights, nothing
allocated) unless ``weights=True``, and ``capture`` then traces them on fake tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from explorer.core.errors import unknown_name
from explorer.models.common import Built
from explorer.models.dense import GPT_SIZES, MLP_SIZES, build_gpt, build_mlp
from explorer.models.llama import LLAMA_SIZES, build_llama
from explorer.models.shapes import GPT3_SHAPES, LLAMA_SHAPES
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
#: the size a built-in model gets when none is asked for (the command line's, the widget's
#: and ``build``'s; the one size of a published shape)
DEFAULT_SIZE = "default"
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
    #: False: parameters and example tensors are on the meta device (shapes only)
    weights: bool = True

    @property
    def batch_size(self) -> int:
        return int(self.example_inputs[0].shape[0])

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def record(self) -> dict[str, Any]:
        """How the model was built, as a plan records it (``Plan.model``): ranks and
        exported scripts build it again from this."""
        return {"builtin": self.name, "size": self.size, "batch_size": self.batch_size}


# -- registry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    sizes: Mapping[str, Any]
    make: Callable[[Any, int, torch.Generator | None], Built]
    #: the builder makes the model on the meta device itself when given no generator
    meta_native: bool = False


_REGISTRY: dict[str, _Entry] = {
    "mlp": _Entry(MLP_SIZES, build_mlp),
    "alexnet": _Entry(ALEXNET_SIZES, build_alexnet),
    "vgg16": _Entry(VGG_SIZES, build_vgg16),
    "resnet": _Entry(RESNET_SIZES, build_resnet),
    "gpt": _Entry(GPT_SIZES, build_gpt, meta_native=True),
    "llama": _Entry(LLAMA_SIZES, build_llama, meta_native=True),
    "inception": _Entry(INCEPTION_SIZES, build_inception),
}

#: published large shapes: one configuration each, under the architecture that builds it
_SHAPES: dict[str, _Entry] = {
    **{n: _Entry({DEFAULT_SIZE: c}, build_llama, True) for n, c in LLAMA_SHAPES.items()},
    **{n: _Entry({DEFAULT_SIZE: c}, build_gpt, True) for n, c in GPT3_SHAPES.items()},
}


def model_names() -> list[str]:
    """Names of the built-in model families (each in every size of ``SIZES``), sorted."""
    return sorted(_REGISTRY)


def shape_names() -> list[str]:
    """Names of the published large shapes (``"llama-7b"``, ``"gpt3-175b"`` ...), smallest
    first within each family."""
    return list(_SHAPES)


def _entry(name: str) -> _Entry:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _SHAPES:
        return _SHAPES[name]
    raise unknown_name("model", name, [*_REGISTRY, *_SHAPES])


def model_config(name: str, size: str = DEFAULT_SIZE) -> Any:
    """The frozen configuration dataclass behind ``build(name, size)``."""
    entry = _entry(name)
    if name in _SHAPES and size != DEFAULT_SIZE:
        raise unknown_name(f"size for {name} (a published shape has one size)", size,
                           [DEFAULT_SIZE])
    if size not in SIZES:
        raise unknown_name("size", size, SIZES)
    return entry.sizes[size]


def build(name: str, size: str = DEFAULT_SIZE, batch_size: int | None = None,
          seed: int = 0, weights: bool | None = None,
          dtype: torch.dtype | None = None) -> BuiltinModel:
    """Build model ``name`` at ``size`` in training mode, with inputs, targets and loss.

    Parameters, inputs and targets depend only on ``seed`` (and the arguments); the global RNG
    state is left as it was. ``batch_size`` overrides the size's default batch (a multiple of
    8 by default, so data-parallel and micro-batch splits divide evenly). ``weights=False``
    (the default for published shapes such as ``"llama-70b"``) puts parameters and example
    tensors on the meta device: shapes and dtypes only, for capture without running.
    ``dtype`` (e.g. ``torch.bfloat16``) converts the floating-point parameters.
    """
    cfg = model_config(name, size)
    entry = _entry(name)
    if weights is None:
        weights = name not in _SHAPES
    if batch_size is None:
        batch_size = cfg.batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # parameter initialisation uses the (forked) global RNG
        gen = torch.Generator().manual_seed(seed)
        native = not weights and entry.meta_native
        module, inputs, targets, loss_fn, description = entry.make(
            cfg, batch_size, None if native else gen)
    if not weights and not native:
        module = module.to("meta")
        inputs = tuple(t.to("meta") for t in inputs)
        targets = tuple(t.to("meta") for t in targets)
    if dtype is not None:
        module = module.to(dtype)
    module.train()
    return BuiltinModel(name=name, description=description, module=module,
                        example_inputs=inputs, targets=targets, loss_fn=loss_fn, size=size,
                        weights=weights)
