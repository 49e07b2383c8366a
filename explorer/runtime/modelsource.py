"""Where a rank's weights come from when a job carries none: the model's own code.

A job folder written with a model source (the user's ``"module:function"`` factory, or a
built-in model by name) holds the program's ops but no parameters or buffers. Each rank builds
the model from that source and takes the tensors it holds by name. Parameters the source left
on the meta device are made on the rank, only those it holds, by their module's
``reset_parameters()`` under a seed drawn from the module's path, so replicas of a stage start
equal whichever rank makes them.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from explorer.core.errors import ExplorerError
from explorer.core.factory import check_factory, load_factory, untrusted_factory
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.models.builtin import build, model_config, shape_names


def model_source(plan: Plan, graph: OpGraph, factory: str | None = None) -> dict[str, Any]:
    """How ranks build the model of ``plan``: ``{"factory": ...}`` (the user's: the argument,
    else the one the graph was captured with) or the plan's built-in model; empty when there
    is none. A factory that only the plan names is never imported: :class:`FactoryError`
    saying how to name it. A built-in model of an unknown name or size is refused here, not
    on every rank at launch."""
    text = factory or graph.factory
    if text:
        load_factory(text)  # a bad name fails at export, not on every rank at launch
        return {"factory": check_factory(text)}
    asked = (plan.model or {}).get("factory")
    if asked:
        raise untrusted_factory(
            asked, f"ex.export_script(..., factory={asked!r}) or ex.capture(..., "
            "factory=...); to export the captured weights instead, drop it from the plan "
            "(dataclasses.replace(plan, model=None))")
    if plan.model and "builtin" in plan.model:
        check_builtin(plan.model)
        return dict(plan.model)
    return {}


def check_builtin(record: Mapping[str, Any]) -> None:
    """:class:`ExplorerError` unless ``record`` names a built-in model and size the ranks can
    build (the known names and sizes in the message)."""
    name, size = record.get("builtin"), record.get("size")
    try:
        model_config(name, size)  # type: ignore[arg-type]
    except ExplorerError as exc:
        raise type(exc)(f"the plan's model record (built-in {name!r}, size {size!r}) is "
                        f"not a model this explorer builds: {exc}") from None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers goes to the meta device (buffers keep their
    values): a model of any size is built without allocating its weights."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_model(source: Mapping[str, Any]) -> nn.Module:
    """The model ``source`` names, built as its code decides (a published built-in shape with
    its parameters on the meta device)."""
    if "factory" in source:
        made = load_factory(source["factory"])()
        model = getattr(made, "module", made)  # a built model (module + batch) or a module
        if not isinstance(model, nn.Module):
            raise ExplorerError(f"model factory {source['factory']!r} returned a "
                                f"{type(made).__name__}, not a torch.nn.Module; return the "
                                "model")
        return model
    large = source["builtin"] in shape_names()
    with parameters_on_meta() if large else contextlib.nullcontext():
        return build(source["builtin"], source["size"], source["batch_size"],
                     weights=True).module


class SourceWeights(Mapping[str, torch.Tensor]):
    """Tensors by node name: the job's own constants, and the model's parameters and buffers
    (``keys`` maps node names to the model's names), built on first use."""

    def __init__(self, constants: dict[str, torch.Tensor], keys: dict[str, str],
                 source: Mapping[str, Any], seed: int = 0) -> None:
        self.constants, self.keys, self.source, self.seed = constants, keys, source, seed
        self._model: nn.Module | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    @property
    def model(self) -> nn.Module | None:
        """The model built from the source, once a tensor of it was asked for."""
        return self._model

    def __iter__(self) -> Iterator[str]:
        yield from self.constants
        yield from self.keys

    def __len__(self) -> int:
        return len(self.constants) + len(self.keys)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.constants:
            return self.constants[name]
        key = self.keys[name]
        if self._model is None:
            self._model = build_model(self.source)
            self._tensors = {**dict(self._model.named_parameters(remove_duplicate=False)),
                             **dict(self._model.named_buffers(remove_duplicate=False))}
        if key not in self._tensors:
            raise ExplorerError(f"the model built by {_label(self.source)} has no parameter or "
                                f"buffer {key!r}, which the plan's graph has: build the same "
                                "model that was captured")
        t = self._tensors[key]
        if t.device.type == "meta":
            t = self._materialise(key)
        return t

    def _materialise(self, key: str) -> torch.Tensor:
        """Give the module owning ``key`` real tensors and initialise them the module's way."""
        assert self._model is not None
        path, _, leaf = key.rpartition(".")
        module = self._model.get_submodule(path)
        if leaf in dict(module.named_buffers(recurse=False)):
            raise ExplorerError(f"buffer {key!r} of the model built by {_label(self.source)} is "
                                "on the meta device: its values cannot be made up; build "
                                "buffers with values (put only parameters on meta)")
        reset = getattr(module, "reset_parameters", None)
        if reset is None:
            raise ExplorerError(f"parameter {key!r} of the model built by "
                                f"{_label(self.source)} is on the meta device and its module "
                                f"({type(module).__name__}) has no reset_parameters() to "
                                "initialise it: give it one, or build the model with weights")
        module.to_empty(device="cpu", recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + zlib.crc32(path.encode()))
            with torch.no_grad():
                reset()
        self._tensors.update({f"{path}.{n}" if path else n: t for n, t in
                              [*module.named_parameters(recurse=False),
                               *module.named_buffers(recurse=False)]})
        return self._tensors[key]


def _label(source: Mapping[str, Any]) -> str:
    if "factory" in source:
        return f"factory {source['factory']!r}"
    return f"built-in model {source['builtin']!r}"
