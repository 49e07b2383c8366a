"""A plan as a PyTorch training script a person can read, keep and run without the explorer.

:func:`write_native_script` writes one Python file that builds the model from its source (a
built-in model, or the user's ``"module:function"`` factory) on the meta device, builds a
named ``DeviceMesh`` from the plan's degrees, applies torch's own parallelisms in torchtitan's
order (recomputation per block with ``torch.utils.checkpoint``, ``fully_shard`` per block and
at the root for ZeRO, ``DistributedDataParallel`` for plain replicas), materialises the
factory's initial weights, and trains with a ``batches()`` function to edit, printing the loss
and step time of every step.

A plan whose choices are not those of modules cannot be written this way:
:func:`native_plan` says which stage, op or setting stops it (:class:`NotExpressible`), and
such plans keep exporting through the explorer's runtime (:mod:`explorer.runtime.export`).

Nothing a plan file holds is pasted into the script as code: module paths, model names and
sizes are checked and written as escaped string literals, numbers as numbers, words in the
header's docstring only from a safe alphabet (:func:`_words`), and the factory is the one the
user named (checked as ``module:function``).
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from explorer.core.errors import ExplorerError
from explorer.core.factory import check_factory, load_factory
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.strategies import MATMUL_MARKERS, unit_of
from explorer.models.builtin import build
from explorer.runtime.params import FP16_LOSS_SCALE

#: a module path the script may name (``blocks.3``, ``layers.0.mlp``)
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
#: the optimizers a plan may carry, as the script builds them (as ex.run does)
_OPTIMIZERS = {"sgd": "torch.optim.SGD(model.parameters(), lr=LR)",
               "momentum": "torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)",
               "adam": "torch.optim.Adam(model.parameters(), lr=LR)",
               "adamw": "torch.optim.AdamW(model.parameters(), lr=LR)"}


class NotExpressible(ExplorerError):
    """A plan that torch's module-level parallelisms cannot express (op-level placements,
    settings a native script does not write yet): export it without ``native``."""


@dataclass(frozen=True)
class NativePlan:
    """What a plan asks, in the terms of torch's parallelisms."""

    #: the model's source: ``{"builtin": name, "size": size, "batch_size": n}`` or
    #: ``{"factory": "module:function"}``
    source: dict
    devices: tuple[str, ...]
    #: data-parallel replicas, and how their state is sharded (ZeRO 0-3)
    replicas: int
    zero: int
    recompute: str
    precision: str
    micro_batches: int
    optimizer: str
    #: the repeated blocks (recomputation units with parameters), sharded and recomputed
    #: one at a time, in the model's order
    blocks: tuple[str, ...]
    algorithm: str
    predicted_step_s: float | None = None
    predicted_peak_bytes: int | None = None


def native_plan(graph: OpGraph, plan: Plan, source: dict,
                module: torch.nn.Module | None = None) -> NativePlan:
    """``plan`` for ``graph`` as torch's parallelisms, or :class:`NotExpressible` saying
    what stops it; ``module``: the model (on the meta device, :func:`model_on_meta`), to
    see which parameters its modules share."""
    if "factory" in source:
        check_factory(source["factory"])
    if not source:
        raise NotExpressible("a native script builds the model from its source: export a "
                             "built-in model, or name the function that builds yours "
                             "(factory=\"module:function\" / --factory)")
    if len(plan.stages) > 1:
        ops = _first_ops_of_stages(graph, plan)
        raise NotExpressible(
            f"the plan has {len(plan.stages)} stages (stage 1 starts at op {ops[1]!r}); native "
            "scripts do not write pipeline stages yet: export without native to run it on "
            "the explorer's runtime")
    settings = plan.settings_of(0)
    if settings.tensor > 1:
        raise NotExpressible(
            f"the plan splits each layer {settings.tensor} ways (tensor parallel); native "
            "scripts do not write tensor parallelism yet: export without native")
    if plan.optimizer not in _OPTIMIZERS:
        raise NotExpressible(f"optimizer {plan.optimizer!r} has no native form")
    replicas = plan.replicas_of(0)
    return NativePlan(
        source=dict(source), devices=tuple(plan.devices), replicas=replicas,
        zero=settings.zero if replicas > 1 else 0, recompute=settings.recompute,
        precision=settings.precision, micro_batches=plan.micro_batches,
        optimizer=plan.optimizer, blocks=blocks_of(graph, module), algorithm=plan.algorithm)


def model_on_meta(source: dict) -> torch.nn.Module:
    """The model ``source`` builds, on the meta device (nothing allocated). A factory must
    return the model with its loss and example batch, which a native script trains with:
    :class:`NotExpressible` otherwise."""
    if "builtin" in source:
        return build(source["builtin"], source["size"], source.get("batch_size"),
                     weights=False).module
    text = source["factory"]
    with torch.device("meta"):
        made = load_factory(check_factory(text))()
    missing = [a for a in ("module", "example_inputs", "targets", "loss_fn")
               if not hasattr(made, a)]
    if missing:
        raise NotExpressible(
            f"model factory {text!r} returned a {type(made).__name__} without "
            f"{', '.join(missing)}; a native script trains with the factory's loss and "
            "example batch: return an object with module, example_inputs, targets and "
            "loss_fn (as ex.builtin_model does), or export without native")
    return made.module


def blocks_of(graph: OpGraph, module: torch.nn.Module | None = None) -> tuple[str, ...]:
    """The recomputation units (:func:`~explorer.costs.strategies.unit_of`: the repeated
    blocks, the other top-level modules) of the ops that read parameters, in the order the
    graph first reads them: what FSDP shards and checkpoint runs again one at a time. Left
    to the root module: a unit that holds another, and (given the ``module``) a unit holding
    a parameter registered outside it too (an embedding tied to the output layer)."""
    order: dict[str, None] = {}
    for n in graph.nodes:
        if n.kind != "op" or not n.module_path:
            continue
        if any(graph.nodes[graph.index[p]].kind == "param" for p in n.inputs):
            unit = unit_of(n.module_path)
            if not _MODULE_PATH.fullmatch(unit):
                raise NotExpressible(f"module path {unit!r} (of op {n.name!r}) cannot be "
                                     "named in a script")
            order.setdefault(unit)
    units = [u for u in order if not any(v.startswith(u + ".") for v in order)]
    if module is None:
        return tuple(units)
    aliases: dict[int, list[str]] = {}  # a parameter's every name
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)

    def owns_its_parameters(unit: str) -> bool:
        inside = [names for names in aliases.values()
                  if any(n.startswith(unit + ".") for n in names)]
        return all(n.startswith(unit + ".") for names in inside for n in names)

    return tuple(u for u in units if owns_its_parameters(u))


def _first_ops_of_stages(graph: OpGraph, plan: Plan) -> list[str]:
    first: dict[int, str] = {}
    for n in graph.nodes:
        if n.kind == "op":
            first.setdefault(plan.placement[n.name], n.name)
    return [first.get(s, "") for s in range(len(plan.stages))]


def render(native: NativePlan, steps: int = 10, lr: float = 1e-3) -> str:
    """The script's text."""
    sections = [_model_section(native), _recompute_section(native),
                _parallelize_section(native), _step_section(native), _main_section(native)]
    top = [_header(native), _imports(native), _constants(native, steps, lr)]
    return ("\n\n".join(p.strip("\n") for p in top) + "\n\n\n"
            + "\n\n\n".join(p.strip("\n") for p in sections if p) + "\n")


def write_native_script(native: NativePlan, path: str | Path, steps: int = 10,
                        lr: float = 1e-3, overwrite: bool = False) -> Path:
    """Write the script to ``path`` (refused over an existing file unless ``overwrite``)."""
    path = Path(path)
    if path.suffix != ".py":
        raise ExplorerError(f"{path} should end in .py: it is a Python script")
    if path.exists() and not overwrite:
        raise ExplorerError(f"{path} exists; pass overwrite=True (--force) to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(native, steps, lr))
    return path


# -- the script's sections -----------------------------------------------------------------
def _header(p: NativePlan) -> str:
    n = len(p.devices)
    what = (f"built-in model {_words(p.source['builtin'])} (size {_words(p.source['size'])})"
            if "builtin" in p.source else f"model of {_words(p.source['factory'])}")
    about = [f"The model: the {what}.", f"The plan ({_words(p.algorithm)}): {_plan_words(p)}"]
    if p.predicted_step_s is not None:
        about.append(f"Predicted by the explorer: {p.predicted_step_s * 1e3:,.2f} ms per step, "
                     f"{(p.predicted_peak_bytes or 0) / 2**20:,.1f} MiB peak memory per "
                     "device.")
    lines = [f'"""Train a model as a partition plan says, on {n} device{"s" if n > 1 else ""}.',
             "", "Written by `explorer export --native`.", ""]
    lines += [line for text in about for line in textwrap.wrap(text, 96)]
    lines += ["", "On one machine:",
              f"    torchrun --standalone --nproc_per_node {n} THIS_SCRIPT.py"]
    if n > 1 and n % 2 == 0:
        each = f"{n // 2} process{'es' if n > 2 else ''}"
        lines += [f"On 2 machines of {each} each (run on both; HOST: the first's address):",
                  f"    torchrun --nnodes 2 --nproc_per_node {n // 2} --rdzv-backend c10d "
                  "--rdzv-endpoint HOST:29500 \\", "        THIS_SCRIPT.py"]
    lines += ["", "Edit batches() to train on your data.", '"""']
    return "\n".join(lines)


def _plan_words(p: NativePlan) -> str:
    words = []
    if p.replicas > 1:
        words.append(f"{p.replicas} data-parallel replicas"
                     + ("" if not p.zero else f" with ZeRO {p.zero}"))
    else:
        words.append("one device")
    if p.recompute != "none":
        words.append(f"{p.recompute} recomputation per block")
    if p.precision != "fp32":
        words.append(f"{p.precision} autocast (fp32 weights)")
    if p.micro_batches > 1:
        words.append(f"{p.micro_batches} micro-batches per step (gradient accumulation)")
    words.append(f"{p.optimizer} optimizer")
    return "; ".join(words) + "."


def _imports(p: NativePlan) -> str:
    lines = ["from __future__ import annotations", ""]
    if p.micro_batches > 1 and p.replicas > 1 and not p.zero:
        lines.append("import contextlib")
    lines += ["import gc", "import os", "import time"]
    if p.recompute == "selective":
        lines.append("from functools import partial")
    lines += ["", "import torch", "import torch.distributed as dist",
              "from torch.distributed.checkpoint.state_dict import StateDictOptions, "
              "set_model_state_dict",
              "from torch.distributed.device_mesh import init_device_mesh"]
    if p.zero:
        lines.append("from torch.distributed.fsdp import fully_shard")
    elif p.replicas > 1:
        lines.append("from torch.nn.parallel import DistributedDataParallel")
    if p.recompute == "full":
        lines.append("from torch.utils.checkpoint import checkpoint")
    elif p.recompute == "selective":
        lines.append("from torch.utils.checkpoint import (")
        lines.append("    CheckpointPolicy,")
        lines.append("    checkpoint,")
        lines.append("    create_selective_checkpoint_contexts,")
        lines.append(")")
    lines.append("")
    if "builtin" in p.source:
        lines.append("from explorer.models.builtin import build  # the built-in models' factory")
    else:
        module, function = p.source["factory"].split(":")
        top = function.split(".")[0]
        lines.append(f"from {module} import {top}  # the model's factory")
    return "\n".join(lines)


def _constants(p: NativePlan, steps: int, lr: float) -> str:
    mesh = _mesh(p)
    lines = [f"STEPS = {int(steps)}", f"LR = {float(lr)!r}",
             f"MICRO_BATCHES = {int(p.micro_batches)}  # per step, on each replica",
             "#: the device mesh: the plan's degrees by name",
             f"MESH = {{{', '.join(f'{_py(k)}: {v}' for k, v in mesh.items())}}}"]
    if p.blocks and (p.zero or p.recompute != "none"):
        what = " and ".join(x for x in ("sharded" if p.zero else "",
                                        "recomputed" if p.recompute != "none" else "") if x)
        lines.append(f"#: the model's blocks, {what} one at a time")
        lines.append("BLOCKS = [")
        lines += [f"    {_py(b)}," for b in p.blocks]
        lines.append("]")
    if p.precision != "fp32":
        lines.append(f"#: autocast's precision (the weights stay fp32)\nPRECISION = "
                     f"torch.{'bfloat16' if p.precision == 'bf16' else 'float16'}")
    if p.precision == "fp16":
        lines.append("#: fp16: the loss is scaled up before the backward and the gradients "
                     f"down before the step\nLOSS_SCALE = {FP16_LOSS_SCALE!r}")
    if p.recompute == "selective":
        lines.append("#: selective recomputation keeps the outputs of ops whose name holds one "
                     "of these\n#: (matmul-like); the rest run again in the backward")
        lines.append(f"KEPT = ({', '.join(_py(k) for k in MATMUL_MARKERS)})")
    return "\n".join(lines)


def _words(text: str) -> str:
    """``text`` for a docstring: letters, digits and ``_.:=+-`` and spaces kept, anything else
    (quotes, backslashes, line breaks) left out."""
    return re.sub(r"[^A-Za-z0-9_.:=+ -]", "", str(text))[:80] or "-"


def _py(text: str) -> str:
    """``text`` as a Python string literal in double quotes."""
    return json.dumps(str(text))


def _mesh(p: NativePlan) -> dict[str, int]:
    if p.replicas == 1:
        return {"dp_replicate": 1}
    return {"dp_shard" if p.zero else "dp_replicate": p.replicas}


def _model_section(p: NativePlan) -> str:
    if "builtin" in p.source:
        name, size = p.source["builtin"], p.source["size"]
        batch = int(p.source.get("batch_size") or 0) or None
        call = f"build({_py(name)}, {_py(size)}, {batch!r}, seed=0, weights=weights)"
        made = f"    built = {call}"
    else:
        function = p.source["factory"].split(":")[1]
        made = ("    with torch.device(\"cpu\" if weights else \"meta\"):\n"
                f"        built = {function}()")
    return f'''
def make_model(weights: bool):
    """The model (on the meta device without ``weights``), its loss function, and an example
    batch as (inputs, targets)."""
{made}
    return built.module, built.loss_fn, (tuple(built.example_inputs), tuple(built.targets))


def batches(example):
    """The training data: one global batch (inputs, targets) per step. Edit to read yours."""
    while True:
        yield example


def load_weights(model: torch.nn.Module, initial: torch.nn.Module) -> None:
    """``initial``'s weights and buffers into the (sharded) model."""
    set_model_state_dict(model, initial.state_dict(),
                         options=StateDictOptions(full_state_dict=True))
    for name, buffer in initial.named_buffers():  # (a state dict may leave some out)
        model.get_buffer(name).copy_(buffer)
'''


def _recompute_section(p: NativePlan) -> str:
    if p.recompute == "none" or not p.blocks:
        return ""
    if p.recompute == "full":
        how = "checkpoint(forward, *args, use_reentrant=False, **kwargs)"
        policy = ""
    else:
        how = ("checkpoint(forward, *args, use_reentrant=False,\n"
               "                          context_fn=partial(create_selective_checkpoint_contexts,"
               " keep_matmuls),\n                          **kwargs)")
        policy = '''
def keep_matmuls(ctx, op, *args, **kwargs):
    """Selective recomputation's policy: keep what matmul-like ops make."""
    name = str(op).lower()
    if any(kept in name for kept in KEPT):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE

'''
    return f'''{policy}
def recompute(block: torch.nn.Module) -> None:
    """Run ``block`` again in the backward rather than keep what it saves."""
    forward = block.forward

    def recomputed(*args, **kwargs):
        return {how}

    block.forward = recomputed
'''


def _parallelize_section(p: NativePlan) -> str:
    body = []
    if p.blocks and (p.zero or p.recompute != "none"):
        body.append("    for path in BLOCKS:")
        body.append("        block = model.get_submodule(path)")
        if p.recompute != "none":
            body.append("        recompute(block)")
        if p.zero:
            body.append(f"        fully_shard(block, mesh=mesh[\"dp_shard\"]{_reshard(p)})")
    if p.zero:
        body.append(f"    fully_shard(model, mesh=mesh[\"dp_shard\"]{_reshard(p)})")
    if not body:
        body.append("    pass  # one device, or replicas wrapped once the weights are in: main()")
    notes = {1: "    # ZeRO 1 shards optimizer state only; FSDP has no such setting, so it runs "
                "as\n    # ZeRO 2 (gradients sharded too: less memory, the same traffic)\n",
             2: "    # ZeRO 2: parameters stay gathered from the forward to the backward\n",
             3: ""}
    return ('def parallelize(model: torch.nn.Module, mesh) -> None:\n'
            '    """The plan\'s parallelisms, in torchtitan\'s order: recomputation, then '
            'sharding."""\n' + notes.get(p.zero, "") + "\n".join(body) + "\n")


def _reshard(p: NativePlan) -> str:
    return ", reshard_after_forward=False" if p.zero in (1, 2) else ""


def _step_section(p: NativePlan) -> str:
    lines = ["def micro_batch(model, loss_fn, inputs, targets, rows: slice) -> torch.Tensor:",
             '    """Forward and backward of ``rows`` of the batch; their share of the step\'s '
             'loss."""']
    forward = ["loss = loss_fn(model(*[t[rows] for t in inputs]), *[t[rows] for t in targets])",
               "loss = loss / MICRO_BATCHES"]
    if p.precision != "fp32":
        lines.append("    with torch.autocast(inputs[0].device.type, dtype=PRECISION):")
        lines += ["        " + f for f in forward]
    else:
        lines += ["    " + f for f in forward]
    lines.append("    (loss * LOSS_SCALE).backward()" if p.precision == "fp16" else
                 "    loss.backward()")
    lines.append("    return loss.detach()")
    return "\n".join(lines)


def _main_section(p: NativePlan) -> str:
    dp = "dp_shard" if p.zero else "dp_replicate"
    n = len(p.devices)
    wrap = ""
    if p.replicas > 1 and not p.zero:
        wrap = "    model = DistributedDataParallel(model, device_mesh=mesh[\"dp_replicate\"])\n"
    call = "total += micro_batch(model, loss_fn, inputs, targets, rows)"
    if p.micro_batches > 1 and p.replicas > 1 and p.zero:
        accumulate = ("            # the replicas reduce gradients after the last micro-batch\n"
                      "            model.set_requires_gradient_sync(m == MICRO_BATCHES - 1)\n"
                      f"            {call}\n")
    elif p.micro_batches > 1 and p.replicas > 1:
        accumulate = ("            # the replicas reduce gradients after the last micro-batch\n"
                      "            last = m == MICRO_BATCHES - 1\n"
                      "            with contextlib.nullcontext() if last else model.no_sync():\n"
                      f"                {call}\n")
    else:
        accumulate = f"            {call}\n"
    unscale = ("        for param in model.parameters():  # (the loss was scaled up)\n"
               "            if param.grad is not None:\n"
               "                param.grad.div_(LOSS_SCALE)\n") if p.precision == "fp16" else ""
    return f'''
def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_world_size() != {n}:
        raise SystemExit(f"the plan runs on {n} processes, not {{dist.get_world_size()}}")
    mesh = init_device_mesh(device.type, tuple(MESH.values()), mesh_dim_names=tuple(MESH))
    model, loss_fn, _ = make_model(weights=False)  # shapes only: nothing allocated
    parallelize(model, mesh)
    model.to_empty(device=device)
    # the factory's initial weights, made on each rank's CPU (for a model larger than a
    # host, load a checkpoint here instead), and its example batch
    initial, _, example = make_model(weights=True)
    load_weights(model, initial)
    del initial
{wrap}    optimizer = {_OPTIMIZERS[p.optimizer]}
    replicas, replica = mesh["{dp}"].size(), mesh["{dp}"].get_local_rank()
    data = batches(example)
    for step in range(STEPS):
        start = time.perf_counter()
        inputs, targets = ([t.to(device) for t in part] for part in next(data))
        mine = inputs[0].shape[0] // replicas  # this replica's rows of the batch
        per_micro_batch = mine // MICRO_BATCHES
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for m in range(MICRO_BATCHES):
            first = replica * mine + m * per_micro_batch
            rows = slice(first, first + per_micro_batch)
{accumulate}{unscale}        optimizer.step()
        dist.all_reduce(total)  # the mean loss over the global batch
        total /= replicas
        if cuda:
            torch.cuda.synchronize()
        if dist.get_rank() == 0:
            print(f"step {{step}}: loss {{total.item():.6f}}, "
                  f"{{(time.perf_counter() - start) * 1e3:.2f}} ms", flush=True)
    # the model's hooks and the handles of collectives they keep go before the process
    # group: left to the interpreter's exit they may outlive it (and abort the process)
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
