"""Capture's fallback when torch.export fails: one node per leaf-module call, from forward hooks.

The graph links leaf-module calls by tensor identity and counts FLOPs per module with
``FlopCounterMode`` (:func:`explorer.capture.flops.flop_counter`); it runs the model for real,
so it is not available for fake captures.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from explorer.capture.flops import flop_counter
from explorer.capture.step import (
    WRAPPED,
    CaptureRuntime,
    TrainStep,
    copies,
    dtype_name,
    nbytes,
    strip_wrapper,
    tensors_of,
)
from explorer.core.errors import CaptureError
from explorer.core.graph import OpGraph, OpNode


def capture_hooks(step: TrainStep, inputs: tuple, targets: tuple, name: str) -> OpGraph:
    """A module-level graph from forward hooks: leaf-module calls linked by tensor identity."""
    model = step.model
    leaves = {m: strip_wrapper(f"{WRAPPED}.{p}" if p else WRAPPED)
              for p, m in model.named_modules() if not list(m.children())}
    calls: list[dict[str, Any]] = []
    producer: dict[int, str] = {}
    hooks = []

    def hook(mod: nn.Module, args: tuple, out: Any) -> None:
        path = leaves[mod]
        idx = sum(1 for c in calls if c["path"] == path)
        nm = f"{path or 'model'}#{idx}" if idx else (path or "model")
        preds, unknown = [], False
        for t in tensors_of(args):
            src = producer.get(id(t))
            if src is None and id(t) not in input_ids:
                unknown = True
            elif src is not None and src not in preds:
                preds.append(src)
        if unknown and calls and calls[-1]["name"] not in preds:
            preds.append(calls[-1]["name"])  # made by code between modules: assume a chain
        if any(id(t) in input_ids for t in tensors_of(args)) and "input_0" not in preds:
            preds.append("input_0")
        outs = tensors_of(out)
        for t in outs:
            producer[id(t)] = nm
        calls.append({"name": nm, "path": path, "type": type(mod).__name__, "preds": preds,
                      "shapes": tuple(tuple(t.shape) for t in outs),
                      "out_bytes": sum(nbytes(t) for t in outs),
                      "dtype": dtype_name(outs[0]) if outs else "none",
                      "param_bytes": sum(nbytes(p) for p in mod.parameters(recurse=False)),
                      "module": mod, "keep": outs})

    run = copies((*inputs, *targets))  # a model may change its inputs in place: run on copies
    input_ids = {id(t) for t in run[:len(inputs)]}
    for m in leaves:
        hooks.append(m.register_forward_hook(hook))
    try:
        with flop_counter() as both:  # backward is attributed to modules
            loss = step(*run)                         # only when forward ran in the same mode
            loss.backward()
        hooks_off = [h.remove() for h in hooks]
        with torch.no_grad(), flop_counter() as fwd:
            step(*copies((*inputs, *targets)))
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    if not calls:
        raise CaptureError("the model has no submodules to hook")
    del hooks_off
    fwd_counts, both_counts = fwd.get_flop_counts(), both.get_flop_counts()
    ncalls: dict[str, int] = {}
    for c in calls:
        ncalls[c["path"]] = ncalls.get(c["path"], 0) + 1

    def flops(counts: dict, path: str) -> int:
        key = f"{WRAPPED}.{path}" if path else WRAPPED
        for k in (f"TrainStep.{key}", key):
            if k in counts:
                return sum(counts[k].values()) // ncalls[path]
        return 0

    x = inputs[0]
    nodes = [OpNode("input_0", "input", "input", shapes=tuple(tuple(t.shape) for t in inputs),
                    dtype=dtype_name(x),
                    out_bytes=sum(nbytes(t) for t in inputs))]
    for c in calls:
        nodes.append(OpNode(
            c["name"], "op", f"module:{c['type']}", c["path"], c["type"], tuple(c["preds"]),
            c["shapes"], c["dtype"], c["out_bytes"], c["param_bytes"], True,
            flops(fwd_counts, c["path"]),
            flops(both_counts, c["path"]) - flops(fwd_counts, c["path"]), (c["name"],)))
    graph = OpGraph(name, nodes, int(x.shape[0]), "hooks", nodes[-1].name)
    graph.runtime = CaptureRuntime(step, inputs, targets)
    return graph


