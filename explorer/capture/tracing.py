"""Capture: turn a PyTorch model and an example batch into an OpGraph with FLOPs and saved tensors.

The main path is ``torch.export`` (ATen ops, module hierarchy from ``nn_module_stack``). Each
node is then replayed once (:mod:`explorer.capture.replay`) to count its forward and backward
FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` and to see which tensors autograd keeps
for its backward (``torch.autograd.graph.saved_tensors_hooks``). A real capture replays on the
example's real values; a fake one (``fake=True``, or any parameter or input on the meta device)
traces and replays on fake tensors (:mod:`explorer.capture.fake`): same graph, nothing run, no
memory allocated, and repeated layers replayed once. A fake capture of a model with a list of
identical blocks traces only a few of them and grows the graph to all
(:mod:`explorer.capture.blocks`), so its time does not grow with depth. When export fails on
a real capture, a coarser graph with one node per leaf-module call is built from forward hooks
(:mod:`explorer.capture.hooks`), and the graph says so in ``notes``.

A ``no_grad`` block in the forward is inlined as plain ops that take no gradient
(:mod:`explorer.capture.grad_regions`). The capture runs on a worker thread under a time limit
(:mod:`explorer.capture.deadline`): a forward that never returns ends in ``CaptureTimeout``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from explorer.capture.blocks import (
    CUT_BLOCKS,
    BlockList,
    NotRepeating,
    find_blocks,
    grow_graph,
)
from explorer.capture.deadline import TIMEOUT_ENV, capture_limit_s, run_within
from explorer.capture.fake import (
    FAKE_NOTE,
    FakeWorld,
    check_fits,
    check_sizes_known,
    is_fake_graph,
    needs_real_data,
    on_meta,
)
from explorer.capture.flops import attention_fraction
from explorer.capture.grad_regions import inline_grad_regions
from explorer.capture.hooks import capture_hooks
from explorer.capture.replay import ReplayCache, replay
from explorer.capture.step import (
    CaptureRuntime,
    TrainStep,
    copies,
    dtype_name,
    keep_buffers,
    nbytes,
    strip_wrapper,
    surrogate_loss,
    tensors_of,
    training_mode,
)
from explorer.capture.trial import check_runs, first_line, refuse_inference_mode
from explorer.core.errors import CaptureError, CaptureTimeout, ExplorerError, InputMismatchError
from explorer.core.factory import load_factory
from explorer.core.graph import OpGraph, OpNode

__all__ = ["CaptureRuntime", "TrainStep", "batch_splits", "capture", "captured_graph",
           "example_of", "keep_buffers", "program_state", "program_structure", "step_program",
           "surrogate_loss", "training_mode"]


#: held by a capture while it runs
_ONE_AT_A_TIME = threading.Lock()

_log = logging.getLogger(__name__)


def capture(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
            targets: Any = None, name: str | None = None, fake: bool | None = None,
            factory: str | None = None, reuse_blocks: bool | None = None,
            timeout_s: float | None = None) -> OpGraph:
    """Capture one training step of ``model`` on ``example_inputs`` as an :class:`OpGraph`.

    ``example_inputs`` is a tensor or a tuple of tensors whose dim 0 is the batch. ``loss_fn``
    (optional) is called as ``loss_fn(model(*inputs), *targets)``; without one, the mean of the
    output stands in for a loss so that the backward pass is still captured.

    ``fake=True`` captures without running the model: fake tensors carry shapes and dtypes
    only, so models far larger than this machine's memory can be planned (not run). It is
    chosen automatically (``fake=None``) when a parameter, buffer or example tensor is on the
    meta device. Real and fake captures of one model give the same graph.

    ``factory`` (``"module:function"``) names the user's function that builds this model; it is
    checked now (importable, callable), kept as ``graph.factory`` and recorded in exported
    scripts, which call it on every rank instead of carrying weights.

    ``reuse_blocks`` (fake captures; on unless ``False``): a model with a list of at least
    four identical blocks (transformer layers) is traced with three of them and its graph grown
    to all, the same graph as tracing every block, in a time that does not grow with depth.
    Where the blocks cannot be shown to repeat, every block is traced and ``notes`` says why.

    ``timeout_s`` limits how long the capture may take (a forward may never return): past it,
    :class:`~explorer.core.errors.CaptureTimeout` says where the forward was. Without it the
    environment variable ``EXPLORER_CAPTURE_TIMEOUT_S`` sets the limit, else it is 5 minutes
    and more for larger models (:mod:`explorer.capture.deadline`); ``math.inf`` waits for ever.

    A ``torch.no_grad()`` block in the forward (also ``set_grad_enabled(False)``, a
    ``@torch.no_grad()`` method, ``enable_grad()`` inside one) is captured as it runs eagerly:
    its ops are in the graph and do not take gradient (:mod:`explorer.capture.grad_regions`).

    >>> import torch
    >>> g = capture(torch.nn.Linear(4, 2), torch.randn(8, 4))
    >>> g.batch_size, g.source
    (8, 'export')
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
    if factory is not None:
        load_factory(factory)
    inputs = _as_tuple(example_inputs, "example_inputs")
    tgts = _as_tuple(targets, "targets") if targets is not None else ()
    if not inputs:
        raise InputMismatchError("example_inputs is empty: pass at least one tensor whose "
                                 "dim 0 is the batch")
    if inputs[0].dim() == 0:
        raise InputMismatchError("the first example input is a scalar: it needs a batch "
                                 "dimension (dim 0)")
    limit_s = capture_limit_s(model, (*inputs, *tgts), timeout_s)
    name = name or type(model).__name__
    # one capture at a time: torch.export keeps global state, and a fake capture swaps the
    # model's parameters while it runs (a notebook may capture in a background thread)
    if not _ONE_AT_A_TIME.acquire(timeout=-1 if math.isinf(limit_s) else limit_s):
        raise CaptureTimeout(f"capturing {name} waited {limit_s:.0f} s for another capture in "
                             "this process to finish; wait for it, or raise the limit with "
                             f"timeout_s=... or {TIMEOUT_ENV}")
    try:
        graph = run_within(lambda: _capture_one(model, inputs, tgts, loss_fn, name, fake,
                                                reuse_blocks), limit_s, name, model)
    finally:
        _ONE_AT_A_TIME.release()
    graph.factory = factory or ""
    return graph


def _capture_one(model: nn.Module, inputs: tuple, tgts: tuple, loss_fn: Callable | None,
                 name: str, fake: bool | None, reuse_blocks: bool | None) -> OpGraph:
    """The capture itself (on the worker thread of :func:`run_within`)."""
    meta = on_meta(model, (*inputs, *tgts))
    if fake is False and meta:
        raise CaptureError("the model or its example tensors are on the meta device (no "
                           "values): capture with fake=True, or build it with real weights")
    if reuse_blocks and not (fake or meta):
        raise CaptureError("reuse_blocks=True applies to captures on fake tensors: a real "
                           "capture keeps the whole program to run and measure it; pass "
                           "fake=True as well, or leave reuse_blocks unset")
    step = TrainStep(model, loss_fn, len(inputs))
    with training_mode(step):  # the caller's model keeps its own train/eval modes after
        if fake or meta:
            return _capture_fake(step, model, inputs, tgts, name, reuse_blocks is not False)
        check_fits(model)
        # the example batch kept with the graph is a copy: the caller's tensors stay theirs
        return _capture(step, model, copies(inputs), copies(tgts), name)


def _capture(step: TrainStep, model: nn.Module, inputs: tuple, tgts: tuple,
             name: str) -> OpGraph:
    with keep_buffers(model):  # runs on copies: the recorded batch keeps its values
        check_runs(step, copies(inputs), copies(tgts))
    notes: tuple[str, ...] = ()
    try:
        with _quiet_torch():
            program = _export(step, copies((*inputs, *tgts)))
        notes = _batch_notes(program)
    except Exception as exc:
        reason = first_line(exc)
        try:
            with keep_buffers(model):
                graph = capture_hooks(step, inputs, tgts, name)
        except Exception as exc2:
            raise CaptureError(
                f"could not capture {name}: torch.export failed ({reason}) and the module-level "
                f"fallback failed too ({first_line(exc2)}). Make the forward pass traceable "
                "(no data-dependent Python control flow) or wrap the untraceable part in a "
                "submodule.") from exc2
        graph.notes = (f"torch.export failed ({reason}); captured one node per leaf-module "
                       "call from forward hooks instead",)
        return graph
    runtime = CaptureRuntime(step, inputs, tgts)
    graph = _from_export(program, runtime, name, lambda fx, v, g: replay(fx, runtime, v, g))
    graph.notes = notes
    _CAPTURED[graph.fingerprint] = graph
    return graph


def _capture_fake(step: TrainStep, model: nn.Module, inputs: tuple, tgts: tuple, name: str,
                  reuse_blocks: bool) -> OpGraph:
    """Capture on fake tensors; with ``reuse_blocks``, a list of identical blocks is traced
    cut short and the graph grown to all of them (the whole model when that is not safe)."""
    cache = ReplayCache()  # shared: the cut captures replay the same ops
    why_not = ""
    if reuse_blocks:
        try:
            blocks = find_blocks(model)
            if blocks is not None:
                graph = _grown(step, model, inputs, tgts, name, cache, blocks)
                # no program covers every block: an export traces the whole model then
                _FAKE_PROGRAMS[id(graph)] = _WholeProgram(step, model, inputs, tgts, name,
                                                          graph.fingerprint)
                weakref.finalize(graph, _FAKE_PROGRAMS.pop, id(graph), None)
                return graph
        except NotRepeating as exc:
            why_not = str(exc)
        except ExplorerError as exc:  # the cut model does not trace: the whole one will say
            why_not = first_line(exc)
    graph = _fake_graph(step, model, inputs, tgts, name, cache, False)
    if why_not:
        graph.notes = (*graph.notes, "traced every block: the repeated blocks could not be "
                       f"reused ({why_not})")
        _log.debug("%s: %s", name, graph.notes[-1])
    return graph


def _grown(step: TrainStep, model: nn.Module, inputs: tuple, tgts: tuple, name: str,
           cache: ReplayCache, blocks: BlockList) -> OpGraph:
    """The graph of every block, grown from captures with the block list cut short."""
    n_blocks = len(blocks.container)
    world = FakeWorld()
    args = tuple(world.tensor(t) for t in (*inputs, *tgts))
    try:
        with world.swapped(model), blocks.stubbed() as calls, world.mode, torch.no_grad(), \
                _quiet_torch(), refuse_inference_mode():
            step(*args)
    except CaptureError:
        raise
    except Exception as exc:
        raise NotRepeating(f"the model did not run with one block computed for all "
                           f"({first_line(exc)})") from exc
    blocks.check_calls(calls)
    cuts = []
    with blocks.watched() as reads:
        for k in CUT_BLOCKS:
            with blocks.cut(k):
                cuts.append(_fake_graph(step, model, inputs, tgts, name, cache, True))
    if reads:
        raise NotRepeating(f"the blocks compute with their own index ({reads[0]})")
    graph = grow_graph(*cuts, blocks, n_blocks)
    graph.notes = (*graph.notes, f"traced {CUT_BLOCKS[-1]} of the {n_blocks} identical "
                   f"blocks of {blocks.path} and repeated the last one (reuse_blocks=False "
                   "traces every block)")
    _log.debug("%s: %s", name, graph.notes[-1])
    return graph


def _fake_graph(step: TrainStep, model: nn.Module, inputs: tuple, tgts: tuple, name: str,
                cache: ReplayCache, cut: bool) -> OpGraph:
    """Trace, export and replay on fake tensors: the model's own state is never touched.
    A ``cut`` model (block list cut short) skips the trial run: if it fails, the whole model
    is captured next and its trial run says why."""
    world = FakeWorld()
    f_inputs = tuple(world.tensor(t) for t in inputs)
    f_tgts = tuple(world.tensor(t) for t in tgts)
    with world.swapped(model):
        if not cut:
            with world.mode, _quiet_torch():  # fake kernels log the errors they raise
                check_runs(step, f_inputs, f_tgts)
        try:
            with _quiet_torch():
                program = _export(step, (*f_inputs, *f_tgts))
        except Exception as exc:
            raise needs_real_data(exc) or CaptureError(
                f"could not capture {name} without running it: torch.export failed "
                f"({first_line(exc)}); make the forward pass traceable (no data-dependent "
                "Python control flow), or capture it with real weights (fake=False), which "
                "can fall back to one node per module") from exc
    runtime = CaptureRuntime(step, f_inputs, f_tgts)
    with world.mode:
        graph = _from_export(program, runtime, name,
                             lambda fx, v, g: cache.replay(fx, runtime, v, g), world.faked)
    if cut and any(fx.op != "placeholder" and fx.name != nm
                   for nm, fx in runtime.fx_nodes.items()):
        raise NotRepeating("an op is renamed where it meets a parameter's name")
    graph.notes = (FAKE_NOTE, *_batch_notes(program))
    graph.runtime = None  # a fake graph has no values to run or measure
    _FAKE_PROGRAMS[id(graph)] = program  # but its program can be exported with a factory
    weakref.finalize(graph, _FAKE_PROGRAMS.pop, id(graph), None)
    _CAPTURED[graph.fingerprint] = graph
    return graph


def _batch_notes(program: Any) -> tuple[str, ...]:
    if _batch_is_dynamic(program):
        return ()
    return ("exported with a fixed batch size (the batch dimension could not be made "
            "dynamic): plans that split the batch (data parallel, micro-batches) can "
            "be simulated but not run",)


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
    a model that forces a fixed batch is exported with static shapes instead. A batch of one
    is always static (export specialises sizes 0 and 1), so it is not tried dynamic.

    Export runs with gradients on, as a training step does (it records a ``no_grad`` block
    only where the mode differs from the one it runs in), and the grad-mode regions it records
    are inlined as plain ops (:mod:`explorer.capture.grad_regions`)."""
    with torch.enable_grad():
        program = _export_program(step, args)
    inline_grad_regions(program)
    return program


def _export_program(step: TrainStep, args: tuple) -> Any:
    batch = torch.export.Dim("batch")
    if any(t.dim() and t.shape[0] == 1 for t in args):
        return torch.export.export(step, args)
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



def _computed_fraction(fx: Any, values: dict[str, Any], ours: dict[Any, str]) -> float:
    """:attr:`OpNode.computed_fraction` of an exported node, from its argument values."""
    def value(a: Any) -> Any:
        return values.get(ours[a]) if isinstance(a, torch.fx.Node) and a in ours else a
    return attention_fraction(fx.target, tuple(value(a) for a in fx.args),
                              {k: value(v) for k, v in fx.kwargs.items()})


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
    return strip_wrapper(path), typ


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
                nm = strip_wrapper(state_names[fx.name])
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



def _from_export(program: Any, runtime: CaptureRuntime, name: str,
                 replay_node: Callable,
                 state_as: Callable[[torch.Tensor], torch.Tensor] | None = None) -> OpGraph:
    """The graph of an exported program, each node replayed by ``replay_node``; ``state_as``
    (a fake capture's) turns the program's parameters, buffers and constants into the tensors
    the replay runs on."""
    fx_nodes, state_keys, params = program_structure(program, len(runtime.inputs))
    runtime.program, runtime.fx_nodes = program, fx_nodes
    runtime.state = program_state(program, state_keys)
    if state_as is not None:
        runtime.state = {nm: state_as(t) for nm, t in runtime.state.items()}
    ours = {fx: nm for nm, fx in fx_nodes.items()}
    loss_fx = program.graph.output_node().args[0][0]
    values = runtime.values()
    grad_of: dict[str, bool] = {}
    nodes: list[OpNode] = []
    for fx, nm in ours.items():
        val = values[nm]
        outs = tensors_of(val)
        out_bytes = sum(nbytes(t) for t in outs)
        shapes = tuple(tuple(t.shape) for t in outs)
        check_sizes_known(fx, shapes)
        dtype = dtype_name(outs[0]) if outs else "none"
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
        prof, slots = replay_node(fx, values, grad_of)
        grad_of[nm] = prof.requires_grad
        nodes.append(OpNode(
            nm, "op", _op_name(fx.target), mpath, mtype, tuple(preds), shapes, dtype,
            out_bytes, 0, prof.requires_grad, prof.fwd_flops, prof.bwd_flops,
            prof.saved_names(slots, nm), prof.saved_extra_bytes, prof.is_view,
            prof.backward_scratch_bytes, _computed_fraction(fx, values, ours)))
    bs = int(runtime.inputs[0].shape[0])
    graph = OpGraph(name, nodes, bs, "export", ours[loss_fx])
    graph.runtime = runtime
    return graph


#: graphs captured in this process, by fingerprint, while the user holds them (export finds a
#: plan's graph here)
_CAPTURED: weakref.WeakValueDictionary[str, OpGraph] = weakref.WeakValueDictionary()


def captured_graph(fingerprint: str) -> OpGraph | None:
    """The graph with this fingerprint, if it was captured in this process and is still held."""
    return _CAPTURED.get(fingerprint)


#: the exported programs of fake graphs (whose runtime is None), by ``id`` of the live graph
_FAKE_PROGRAMS: dict[int, Any] = {}


class _WholeProgram:
    """The program of a graph grown from repeated blocks, traced when first asked for (an
    export needs every block's ops; planning never does)."""

    def __init__(self, step: TrainStep, model: nn.Module, inputs: tuple, tgts: tuple,
                 name: str, fingerprint: str) -> None:
        self.args = (step, model, inputs, tgts, name)
        self.fingerprint = fingerprint

    def build(self) -> Any:
        step, model, inputs, tgts, name = self.args
        with _ONE_AT_A_TIME, training_mode(step):
            whole = _fake_graph(step, model, inputs, tgts, name, ReplayCache(), False)
        if whole.fingerprint != self.fingerprint:
            raise CaptureError(f"{name} traced in full differs from the graph grown from its "
                               "repeated blocks; capture it with reuse_blocks=False")
        return _FAKE_PROGRAMS[id(whole)]


def step_program(graph: OpGraph) -> Any:
    """The ``torch.export`` program of a graph's training step, real or fake; None for a graph
    captured from hooks or loaded without its model."""
    if graph.runtime is not None:
        return graph.runtime.program
    found = _FAKE_PROGRAMS.get(id(graph))
    if isinstance(found, _WholeProgram):
        found = _FAKE_PROGRAMS[id(graph)] = found.build()
    return found


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    return str(target)


def example_of(graph: OpGraph) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """The example inputs and targets a graph was captured with."""
    if is_fake_graph(graph.notes):
        raise CaptureError("this graph was captured without running the model (fake "
                           "tensors): it has no example values; capture it with real "
                           "weights and fake=False to run or measure it")
    if graph.runtime is None:
        raise CaptureError("this graph was loaded without its model; capture it again")
    return graph.runtime.inputs, graph.runtime.targets
