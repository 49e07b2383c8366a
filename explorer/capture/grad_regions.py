"""Inline the grad-mode regions torch.export wraps in higher-order ops, so a step is plain ATen ops.

``torch.export`` records a ``with torch.no_grad():`` block (and ``torch.set_grad_enabled(False)``,
a ``@torch.no_grad()`` method, a ``torch.enable_grad()`` block inside one) as a call of
``torch.ops.higher_order.wrap_with_set_grad_enabled`` on a submodule of the program. The explorer
replays, profiles, cuts and runs a graph one ATen op at a time, so :func:`inline_grad_regions`
moves each region's ops into the main graph and keeps their meaning with ``aten.detach``: every
tensor that may carry gradients (a parameter, an input, an op computed with gradients on)
passes through a ``detach`` node before an op of a no-grad region uses it. The region's outputs then
do not require grad and no gradient flows back through them, as in eager PyTorch, so a step of
the captured graph computes the losses and gradients of the model run eagerly.

Other higher-order ops (``torch.autocast`` inside the forward: ``wrap_with_autocast``;
``torch.cond``; ...) have no op-by-op form here: :func:`inline_grad_regions` raises
:class:`~explorer.core.errors.CaptureError` naming them, and a real capture falls back to one
node per module (:mod:`explorer.capture.hooks`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx.node import map_arg

from explorer.core.errors import CaptureError

#: the higher-order op torch.export wraps a grad-mode region in
SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled

#: ``node.meta`` key: whether an inlined op ran with gradients on (absent: on, as the step)
GRAD_ENABLED = "explorer_grad_enabled"

#: ``node.meta`` key: the name an inlined op had inside its region (torch.export's own)
_TRACED_NAME = "explorer_traced_name"

#: what a higher-order op is, for the message that refuses one (by its name in torch)
_KNOWN_HOPS = {
    "wrap_with_autocast": "a torch.autocast block in the forward",
    "cond": "torch.cond",
    "map_impl": "torch.map",
    "while_loop": "torch.while_loop",
}


def inline_grad_regions(program: Any) -> bool:
    """Inline every grad-mode region of an exported program in place; whether it had any.

    Raises :class:`CaptureError` for any other higher-order op, which cannot be run op by op.
    """
    gm = program.graph_module
    graph = gm.graph
    changed = False
    while (hop := next((n for n in graph.nodes
                        if n.op == "call_function" and n.target is SET_GRAD), None)) is not None:
        _inline(gm, hop)
        changed = True
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            name = getattr(n.target, "_name", str(n.target))
            raise CaptureError(
                f"{_KNOWN_HOPS.get(name, name)} (torch.ops.higher_order.{name}) cannot be run "
                "op by op: write that part of the forward without it (mixed precision: "
                "plan.with_memory(precision='bf16') runs the whole step in it)")
    if not changed:
        return False
    sig = program.graph_signature
    _detach_entries(graph, {*sig.inputs_to_buffers,
                            *getattr(sig, "inputs_to_lifted_tensor_constants", {})})
    _drop_unused_submodules(gm)
    gm.graph = _with_traced_names(graph)  # (recompiles)
    gm.graph.lint()
    return True


def _with_traced_names(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose inlined ops have the names torch.export gave them as it
    traced (``add``, ``add_1``, ... in the order the forward ran them), not names numbered
    after the rest of the graph: so a model's repeated blocks are numbered block by block
    (:mod:`explorer.capture.blocks`) whether or not they hold a no-grad region."""
    new = torch.fx.Graph(tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    new._codegen = graph._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in graph.nodes:
        c = new.create_node(n.op, n.target, map_arg(n.args, env.__getitem__),
                            map_arg(n.kwargs, env.__getitem__),
                            n.meta.get(_TRACED_NAME, n.name), n.type)
        c.meta = {k: v for k, v in n.meta.items() if k != _TRACED_NAME}
        env[n] = c
    return new


def _inline(gm: torch.fx.GraphModule, hop: torch.fx.Node) -> None:
    """Copy the region of ``hop`` into the main graph before it, then drop ``hop``.
    A region nested in it becomes a call of its own, inlined by the caller's next round."""
    graph = gm.graph
    enabled, sub_ref, *args = hop.args
    sub = getattr(gm, sub_ref.target)
    env: dict[torch.fx.Node, Any] = dict(zip(
        (n for n in sub.graph.nodes if n.op == "placeholder"), args, strict=True))
    out: Any = None
    with graph.inserting_before(hop):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = map_arg(n.args[0], env.__getitem__)
                continue
            if n.op == "get_attr":  # the submodule of a nested region
                attr = _free_attr(gm, n.target)
                setattr(gm, attr, getattr(sub, n.target))
                new = graph.get_attr(attr)
                new.meta = dict(n.meta)
            else:
                new = graph.node_copy(n, env.__getitem__)
                new.meta[_TRACED_NAME] = n.meta.get(_TRACED_NAME, n.name)
                if new.op == "call_function" and new.target is not SET_GRAD:
                    new.meta[GRAD_ENABLED] = bool(enabled)
            env[n] = new
    if isinstance(out, (tuple, list)):
        for user in list(hop.users):
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                raise CaptureError(f"torch.export used a grad-mode region's outputs as "
                                   f"{user.target}; please report it")
            _replace(graph, user, out[user.args[1]])
            graph.erase_node(user)
    else:
        _replace(graph, hop, out)
    graph.erase_node(hop)


def _replace(graph: torch.fx.Graph, old: torch.fx.Node, new: Any) -> None:
    if any(u.op == "output" for u in old.users):  # the program's signature names its outputs
        raise CaptureError("the step's loss is computed with gradients off (inside torch."
                           "no_grad()), so there is nothing to train: compute the loss with "
                           "gradients on")
    old.replace_all_uses_with(new)


def _free_attr(gm: torch.fx.GraphModule, name: str) -> str:
    k, attr = 0, name
    while hasattr(gm, attr):
        k += 1
        attr = f"{name}_{k}"
    return attr


def _drop_unused_submodules(gm: torch.fx.GraphModule) -> None:
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            target = n.target
            gm.graph.erase_node(n)
            if not any(m.op == "get_attr" and m.target == target for m in gm.graph.nodes):
                delattr(gm, target)


def _detach_entries(graph: torch.fx.Graph, plain: set[str]) -> None:
    """Put a ``detach`` between every op of a no-grad region and each tensor it reads from
    outside such regions: a parameter, an input, an op computed with gradients on. The
    ``plain`` placeholders (buffers, constants: they never carry gradients) are read as they
    are, so an update in place (a running mean) still writes to them. Detaching what needs it
    and no more would make a model's first block differ from the next when it reads the
    input: its repeated blocks could not be captured once."""
    outside: dict[torch.fx.Node, bool] = {}
    detached: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in list(graph.nodes):
        if n.op == "placeholder":
            outside[n] = n.name not in plain
            continue
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:  # picks an output: made where its op was
            outside[n] = any(outside.get(a, False) for a in n.all_input_nodes)
            continue
        outside[n] = n.meta.get(GRAD_ENABLED, True)
        if outside[n]:
            continue

        def entry(a: torch.fx.Node, user: torch.fx.Node = n) -> torch.fx.Node:
            if not outside.get(a, False) or not isinstance(a.meta.get("val"), torch.Tensor):
                return a
            if a not in detached:
                with graph.inserting_before(user):
                    d = graph.call_function(torch.ops.aten.detach.default, (a,))
                d.meta = {k: user.meta[k] for k in ("nn_module_stack", "stack_trace")
                          if k in user.meta}
                d.meta["val"] = a.meta["val"].detach()
                d.meta[GRAD_ENABLED] = False
                detached[a] = d
            return detached[a]

        n.args = map_arg(n.args, entry)
        n.kwargs = map_arg(n.kwargs, entry)
