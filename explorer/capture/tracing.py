"""Capture: turn a PyTorch model and an example batch into an OpGraph with FLOPs and saved tensors.

The main path is ``torch.export`` (ATen ops, module hierarchy from ``nn_module_stack``). Each
node is then replayed once on the real example values to count its forward and backward FLOPs
with ``torch.utils.flop_counter.FlopCounterMode`` and to see which tensors autograd keeps for its
backward (``torch.autograd.graph.saved_tensors_hooks``). When export fails, a coarser graph with
one node per leaf-module call is built from forward hooks, and the graph says so in ``notes``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx.node import map_aggregate
from torch.utils.flop_counter import FlopCounterMode

from explorer.core.errors import CaptureError, InputMismatchError
from explorer.core.graph import OpGraph, OpNode

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
    leaves = [t for t in _tensors(out) if t.is_floating_point()]
    if not leaves:
        raise CaptureError("the model returned no floating-point tensor to train on; "
                           "pass loss_fn=... that turns its output into a scalar loss")
    out = leaves[0] if leaves[0].dtype == torch.float32 else leaves[0].float()
    return out.mean()


def _tensors(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_aggregate(x, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


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
        """Run the captured graph once on real tensors; the value of every node by name."""
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


def capture(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
            targets: Any = None, name: str | None = None) -> OpGraph:
    """Capture one training step of ``model`` on ``example_inputs`` as an :class:`OpGraph`.

    ``example_inputs`` is a tensor or a tuple of tensors whose dim 0 is the batch. ``loss_fn``
    (optional) is called as ``loss_fn(model(*inputs), *targets)``; without one, the mean of the
    output stands in for a loss so that the backward pass is still captured.

    >>> import torch
    >>> g = capture(torch.nn.Linear(4, 2), torch.randn(8, 4))
    >>> g.batch_size, g.source
    (8, 'export')
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    inputs = _as_tuple(example_inputs, "example_inputs")
    tgts = _as_tuple(targets, "targets") if targets is not None else ()
    if not inputs:
        raise InputMismatchError("example_inputs is empty: pass at least one tensor whose "
                                 "dim 0 is the batch")
    if inputs[0].dim() == 0:
        raise InputMismatchError("the first example input is a scalar: it needs a batch "
                                 "dimension (dim 0)")
    step = TrainStep(model, loss_fn, len(inputs))
    with training_mode(step):  # the caller's model keeps its own train/eval modes after
        return _capture(step, model, inputs, tgts, name)


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


def _capture(step: TrainStep, model: nn.Module, inputs: tuple, tgts: tuple,
             name: str | None) -> OpGraph:
    with keep_buffers(model):
        _check_runs(step, inputs, tgts)
    name = name or type(model).__name__
    notes: tuple[str, ...] = ()
    try:
        with _quiet_torch():
            program = _export(step, (*inputs, *tgts))
        if not _batch_is_dynamic(program):
            notes = ("exported with a fixed batch size (the batch dimension could not be made "
                     "dynamic): plans that split the batch (data parallel, micro-batches) can "
                     "be simulated but not run",)
    except Exception as exc:
        reason = _first_line(exc)
        try:
            with keep_buffers(model):
                graph = _capture_hooks(step, inputs, tgts, name)
        except Exception as exc2:
            raise CaptureError(
                f"could not capture {name}: torch.export failed ({reason}) and the module-level "
                f"fallback failed too ({_first_line(exc2)}). Make the forward pass traceable "
                "(no data-dependent Python control flow) or wrap the untraceable part in a "
                "submodule.") from exc2
        graph.notes = (f"torch.export failed ({reason}); captured one node per leaf-module "
                       "call from forward hooks instead",)
        return graph
    graph = _from_export(program, step, inputs, tgts, name)
    graph.notes = notes
    return graph


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


@contextlib.contextmanager
def _quiet_torch():
    """Silence torch's own logging while export runs: its failures come back as our errors."""
    loggers = [logging.getLogger(n) for n in ["torch", *logging.root.manager.loggerDict]
               if n.startswith("torch")]
    drop = logging.Filter("\0")  # matches no logger name: drops every record
    for log in loggers:
        log.addFilter(drop)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # export prints failing graphs there
            yield
    finally:
        for log in loggers:
            log.removeFilter(drop)


def _export(step: TrainStep, args: tuple) -> Any:
    """Export with dim 0 of every input dynamic, so shards of the batch run the same program;
    a model that forces a fixed batch is exported with static shapes instead."""
    batch = torch.export.Dim("batch")
    try:
        return torch.export.export(step, args, dynamic_shapes=(tuple({0: batch} for _ in args),))
    except Exception:
        return torch.export.export(step, args)


def _batch_is_dynamic(program: Any) -> bool:
    for fx in program.graph.nodes:
        if fx.op == "placeholder" and fx.name in program.graph_signature.user_inputs:
            val = fx.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() and not isinstance(val.shape[0], int):
                return True
    return False


def batch_splits(graph: OpGraph) -> bool:
    """Whether real runs of this graph may split the batch (dynamic batch dimension)."""
    rt = graph.runtime
    return rt is not None and rt.program is not None and _batch_is_dynamic(rt.program)


def _as_tuple(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    items = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise InputMismatchError(f"{what}[{i}] is a {type(t).__name__}, not a tensor: "
                                     "pass tensors (dim 0 the batch)")
    return items


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _check_runs(step: TrainStep, inputs: tuple, targets: tuple) -> None:
    shapes = ", ".join(str(tuple(t.shape)) for t in (*inputs, *targets))
    try:
        with torch.no_grad():
            loss = step(*inputs, *targets)
    except CaptureError:
        raise
    except Exception as exc:
        raise InputMismatchError(
            f"the example inputs do not fit the model: {_first_line(exc)} "
            f"(inputs and targets had shapes {shapes}; dim 0 must be the batch)") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InputMismatchError("the loss must be a single number; loss_fn returned "
                                 f"{type(loss).__name__} of shape "
                                 f"{tuple(getattr(loss, 'shape', ()))}")


def _strip(path: str) -> str:
    if path == WRAPPED:
        return ""
    return path[len(WRAPPED) + 1:] if path.startswith(WRAPPED + ".") else path


def _module_of(fx: Any) -> tuple[str, str]:
    stack = fx.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    # entries torch.export adds for nodes it made itself (no module of the user's) are skipped
    real = [v for v in stack.values() if not str(v[0]).startswith("_empty_nn_module_stack")]
    if not real:
        return "", ""
    path, typ = real[-1]
    typ = typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1]
    return _strip(path), typ


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def program_structure(program: Any, n_inputs: int) -> tuple[dict[str, Any], dict[str, str],
                                                             set[str]]:
    """Our node names for an exported program's nodes, in graph order.

    Returns (name -> fx node, name -> state-dict key for parameters/buffers/constants,
    names of trainable parameters). User inputs are named ``input_K`` then ``target_K``.
    """
    sig = program.graph_signature
    state_names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                   **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
    fx_nodes: dict[str, Any] = {}
    state_keys: dict[str, str] = {}
    params: set[str] = set()
    n_user = 0
    for fx in program.graph.nodes:
        if fx.op == "placeholder":
            if fx.name in state_names:
                nm = _strip(state_names[fx.name])
                state_keys[nm] = state_names[fx.name]
                if fx.name in sig.inputs_to_parameters:
                    params.add(nm)
            else:
                nm = f"input_{n_user}" if n_user < n_inputs else f"target_{n_user - n_inputs}"
                n_user += 1
        elif fx.op == "call_function" and not str(fx.target).startswith("aten._assert"):
            nm = fx.name
            while nm in fx_nodes:  # a top-level parameter may bear an op's name ("linear")
                nm += "_"
        else:
            continue
        fx_nodes[nm] = fx
    return fx_nodes, state_keys, params


def program_state(program: Any, state_keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """Parameter, buffer and constant tensors of an exported program, by our node name."""
    table = {**program.state_dict, **program.constants}
    return {nm: table[key] for nm, key in state_keys.items()}


def _from_export(program: Any, step: TrainStep, inputs: tuple, targets: tuple,
                 name: str) -> OpGraph:
    fx_nodes, state_keys, params = program_structure(program, len(inputs))
    runtime = CaptureRuntime(step, inputs, targets, program, fx_nodes,
                             program_state(program, state_keys))
    ours = {fx: nm for nm, fx in fx_nodes.items()}
    loss_fx = program.graph.output_node().args[0][0]
    values = runtime.values()
    grad_of: dict[str, bool] = {}
    nodes: list[OpNode] = []
    for fx, nm in ours.items():
        val = values[nm]
        outs = _tensors(val)
        out_bytes = sum(_nbytes(t) for t in outs)
        shapes = tuple(tuple(t.shape) for t in outs)
        dtype = str(outs[0].dtype).replace("torch.", "") if outs else "none"
        if fx.op == "placeholder":
            if nm in runtime.state:
                is_param = nm in params
                kind = "param" if is_param else "buffer"
                rg = is_param and val.is_floating_point()
                mpath = nm.rsplit(".", 1)[0] if "." in nm else ""
                nodes.append(OpNode(nm, kind, kind, mpath, "", (), shapes, dtype, out_bytes,
                                    out_bytes, rg))
            else:
                rg = False
                nodes.append(OpNode(nm, "input", "input", "", "", (), shapes, dtype, out_bytes))
            grad_of[nm] = rg
            continue
        preds = []
        for a in fx.all_input_nodes:
            if ours[a] not in preds:
                preds.append(ours[a])
        mpath, mtype = _module_of(fx)
        prof = _replay(fx, runtime, values, grad_of)
        grad_of[nm] = prof.requires_grad
        nodes.append(OpNode(
            nm, "op", _op_name(fx.target), mpath, mtype, tuple(preds), shapes, dtype,
            out_bytes, 0, prof.requires_grad, prof.fwd_flops, prof.bwd_flops,
            prof.saves, prof.saved_extra_bytes, prof.is_view))
    bs = int(inputs[0].shape[0])
    graph = OpGraph(name, nodes, bs, "export", ours[loss_fx])
    graph.runtime = runtime
    _CAPTURED[graph.fingerprint] = graph
    return graph


#: graphs captured in this process, by fingerprint, while the user holds them (export finds a
#: plan's graph here)
_CAPTURED: weakref.WeakValueDictionary[str, OpGraph] = weakref.WeakValueDictionary()


def captured_graph(fingerprint: str) -> OpGraph | None:
    """The graph with this fingerprint, if it was captured in this process and is still held."""
    return _CAPTURED.get(fingerprint)


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    return str(target)


@dataclass
class _Replay:
    fwd_flops: int
    bwd_flops: int
    requires_grad: bool
    saves: tuple[str, ...]
    saved_extra_bytes: int
    is_view: bool


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _replay(fx: Any, runtime: CaptureRuntime, values: dict, grad_of: dict) -> _Replay:
    """Run one node on its real inputs: FLOPs forward and backward, saved tensors, aliasing."""
    names = runtime.names
    leaves: list[torch.Tensor] = []
    leaf_owner: dict[int, str] = {}

    def fresh(a: Any) -> Any:
        if not isinstance(a, torch.fx.Node):
            return a
        nm = names[a]

        def make(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            t = v.detach().clone()  # clone: in-place ops must not touch the recorded values
            if grad_of.get(nm) and t.is_floating_point():
                t.requires_grad_(True)
                leaves.append(t)
            leaf_owner[_storage_key(t)] = nm
            return t

        return map_aggregate(values[nm], make)

    args = map_aggregate(fx.args, fresh)
    kwargs = map_aggregate(fx.kwargs, fresh)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with FlopCounterMode(display=False) as fwd_counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fx.target(*args, **kwargs)
    outs = _tensors(out)
    out_keys = {_storage_key(t) for t in outs}
    in_keys = set(leaf_owner)
    is_view = bool(outs) and all(k in in_keys for k in out_keys)
    grads_needed = [t for t in outs if t.requires_grad]
    bwd_flops = 0
    if grads_needed and leaves:
        with FlopCounterMode(display=False) as bwd_counter:
            torch.autograd.grad(grads_needed, leaves,
                                grad_outputs=[torch.ones_like(t) for t in grads_needed],
                                allow_unused=True)
        bwd_flops = bwd_counter.get_total_flops()
    me = names[fx]  # our name, which differs from fx's when it was taken
    saves: list[str] = []
    extra, seen = 0, set()
    for t in saved:
        k = _storage_key(t)
        if k in seen:
            continue
        seen.add(k)
        if k in leaf_owner:
            owner = leaf_owner[k]
        elif k in out_keys:
            owner = me
        else:
            extra += t.untyped_storage().nbytes()
            continue
        if owner not in saves:
            saves.append(owner)
    return _Replay(fwd_counter.get_total_flops(), bwd_flops, bool(grads_needed),
                   tuple(saves), extra, is_view)


# -- fallback: one node per leaf-module call -------------------------------------------------

def _capture_hooks(step: TrainStep, inputs: tuple, targets: tuple, name: str) -> OpGraph:
    """A module-level graph from forward hooks: leaf-module calls linked by tensor identity."""
    model = step.model
    leaves = {m: _strip(f"{WRAPPED}.{p}" if p else WRAPPED)
              for p, m in model.named_modules() if not list(m.children())}
    calls: list[dict[str, Any]] = []
    producer: dict[int, str] = {}
    hooks = []

    def hook(mod: nn.Module, args: tuple, out: Any) -> None:
        path = leaves[mod]
        idx = sum(1 for c in calls if c["path"] == path)
        nm = f"{path or 'model'}#{idx}" if idx else (path or "model")
        preds, unknown = [], False
        for t in _tensors(args):
            src = producer.get(id(t))
            if src is None and id(t) not in input_ids:
                unknown = True
            elif src is not None and src not in preds:
                preds.append(src)
        if unknown and calls and calls[-1]["name"] not in preds:
            preds.append(calls[-1]["name"])  # made by code between modules: assume a chain
        if any(id(t) in input_ids for t in _tensors(args)) and "input_0" not in preds:
            preds.append("input_0")
        outs = _tensors(out)
        for t in outs:
            producer[id(t)] = nm
        calls.append({"name": nm, "path": path, "type": type(mod).__name__, "preds": preds,
                      "shapes": tuple(tuple(t.shape) for t in outs),
                      "out_bytes": sum(_nbytes(t) for t in outs),
                      "dtype": str(outs[0].dtype).replace("torch.", "") if outs else "none",
                      "param_bytes": sum(_nbytes(p) for p in mod.parameters(recurse=False)),
                      "module": mod, "keep": outs})

    input_ids = {id(t) for t in inputs}
    for m in leaves:
        hooks.append(m.register_forward_hook(hook))
    try:
        with FlopCounterMode(display=False) as both:  # backward is attributed to modules
            loss = step(*inputs, *targets)            # only when forward ran in the same mode
            loss.backward()
        hooks_off = [h.remove() for h in hooks]
        with torch.no_grad(), FlopCounterMode(display=False) as fwd:
            step(*inputs, *targets)
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
                    dtype=str(x.dtype).replace("torch.", ""),
                    out_bytes=sum(_nbytes(t) for t in inputs))]
    for c in calls:
        nodes.append(OpNode(
            c["name"], "op", f"module:{c['type']}", c["path"], c["type"], tuple(c["preds"]),
            c["shapes"], c["dtype"], c["out_bytes"], c["param_bytes"], True,
            flops(fwd_counts, c["path"]),
            flops(both_counts, c["path"]) - flops(fwd_counts, c["path"]), (c["name"],)))
    graph = OpGraph(name, nodes, int(x.shape[0]), "hooks", nodes[-1].name)
    graph.runtime = CaptureRuntime(step, inputs, targets)
    return graph


def example_of(graph: OpGraph) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """The example inputs and targets a graph was captured with."""
    if graph.runtime is None:
        raise CaptureError("this graph was loaded without its model; capture it again")
    return graph.runtime.inputs, graph.runtime.targets
