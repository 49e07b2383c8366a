"""A plan as a PyTorch training script a person can read, keep and run without the explorer.

:func:`write_native_script` writes one Python file that builds the model from its source (a
built-in model, or the user's ``"module:function"`` factory) on the meta device, builds a
named ``DeviceMesh`` from the plan's degrees, applies torch's own parallelisms in torchtitan's
order (tensor parallelism with ``parallelize_module``, each split module's style written out
in a dict; pipeline stages cut at the modules where the plan's stages begin, run by
``torch.distributed.pipelining`` with the plan's GPipe or 1F1B schedule; recomputation per
block with ``torch.utils.checkpoint``; ``fully_shard`` per block and at the root for ZeRO and
for replicas of pipeline stages, ``DistributedDataParallel`` for plain replicas), materialises
the factory's initial weights, and trains with a ``batches()`` function to edit, printing the
loss and step time of every step.

A plan whose choices are not those of modules cannot be written this way:
:func:`~explorer.runtime.native_mapping.native_plan` says which stage, op or setting stops it
(:class:`~explorer.runtime.native_mapping.NotExpressible`), and such plans keep exporting
through the explorer's runtime (:mod:`explorer.runtime.export`).

Nothing a plan file holds is pasted into the script as code: module paths, model names and
sizes are checked and written as escaped string literals, numbers as numbers, words in the
header's docstring only from a safe alphabet (:func:`~explorer.runtime.native_text.words`),
and the factory is the one the user named (checked as ``module:function``). The
tensor-parallel parts are :mod:`explorer.runtime.native_tensor`'s.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from explorer.core.errors import ExplorerError
from explorer.costs.strategies import MATMUL_MARKERS
from explorer.runtime.native_mapping import (
    OPTIMIZERS,
    NativePlan,
    NotExpressible,
    blocks_of,
    model_on_meta,
    native_plan,
    stage_starts,
)
from explorer.runtime.native_tensor import (
    async_tensor_body,
    loss_holders,
    loss_parallel,
    split_weights_section,
    tensor_body,
    tensor_constants,
    tensor_imports,
)
from explorer.runtime.native_text import listed, literal, words
from explorer.runtime.params import FP16_LOSS_SCALE

#: the plan's schedules, as torch.distributed.pipelining names them
_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
              "interleaved-1f1b": "ScheduleInterleaved1F1B"}

__all__ = ["NativePlan", "NotExpressible", "blocks_of", "model_on_meta", "native_plan",
           "render", "stage_starts", "write_native_script"]

def render(native: NativePlan, steps: int = 10, lr: float = 1e-3) -> str:
    """The script's text."""
    sections = [_model_section(native), split_weights_section(native), _recompute_section(native),
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
    what = (f"built-in model {words(p.source['builtin'])} (size {words(p.source['size'])})"
            if "builtin" in p.source else f"model of {words(p.source['factory'])}")
    about = [f"The model: the {what}.", f"The plan ({words(p.algorithm)}): {_plan_words(p)}"]
    if p.predicted_step_s is not None:
        about.append(f"Predicted by the explorer: {p.predicted_step_s * 1e3:,.2f} ms per step, "
                     f"{(p.predicted_peak_bytes or 0) / 2**20:,.1f} MiB peak memory per "
                     "device.")
    lines = [f'"""Train a model as a partition plan says, on {n} device{"s" if n > 1 else ""}.',
             "", "Written by `explorer export --native`.", ""]
    lines += [line for text in about for line in textwrap.wrap(text, 96)]
    lines += ["", "On one machine:",
              f"    torchrun --standalone --nproc_per_node {n} THIS_SCRIPT.py"]
    if n > 1 and n % 2 == 0 and (n // 2) % p.tensor == 0:
        each = f"{n // 2} process{'es' if n > 2 else ''}"
        lines += [f"On 2 machines of {each} each (run on both; HOST: the first's address):",
                  f"    torchrun --nnodes 2 --nproc_per_node {n // 2} --rdzv-backend c10d "
                  "--rdzv-endpoint HOST:29500 \\", "        THIS_SCRIPT.py"]
    if p.tensor > 1:
        lines += [f"Each tensor-parallel group is {p.tensor} consecutive ranks: with a multiple "
                  f"of {p.tensor} processes", "per machine, each group stays inside a machine."]
    lines += ["", "Edit batches() to train on your data.", '"""']
    return "\n".join(lines)


def _plan_words(p: NativePlan) -> str:
    parts = []
    if p.virtual_stages > 1:
        parts.append(f"{p.pipeline_ranks} pipeline stages of {p.virtual_stages} chunks each "
                     f"(virtual stages, taken in turn; interleaved 1F1B schedule), the chunks "
                     f"starting at {', '.join(words(m) for m in p.stage_starts)}")
    elif p.stages > 1:
        parts.append(f"{p.stages} pipeline stages ({words(p.schedule)} schedule), starting "
                     f"at {', '.join(words(m) for m in p.stage_starts)}")
    if p.tensor > 1:
        sequence = any(style == "sequence_norm" for _, style in p.tensor_styles)
        parts.append(f"each layer split {p.tensor} ways (tensor parallel"
                     + (", the norms between along the sequence" if sequence else "")
                     + ("; async on CUDA: collectives pipelined with the matmuls"
                        if p.async_tensor else "") + ")")
    if p.replicas > 1:
        parts.append(f"{p.replicas} data-parallel replicas"
                     + ("" if not p.zero else f" with ZeRO {p.zero}"))
    elif p.stages == 1 and p.tensor == 1:
        parts.append("one device")
    if p.recompute != "none":
        parts.append(f"{p.recompute} recomputation per block")
    if _gathers_half(p):
        parts.append(f"{p.precision} autocast (fp32 weights, gathered in {p.precision})")
    elif p.precision != "fp32":
        parts.append(f"{p.precision} autocast (fp32 weights)")
    if p.micro_batches > 1:
        parts.append(f"{p.micro_batches} micro-batches per step (gradient accumulation)")
    parts.append(f"{p.optimizer} optimizer")
    return "; ".join(parts) + "."


def _imports(p: NativePlan) -> str:
    lines = []
    if p.micro_batches > 1 and p.replicas > 1 and not p.zero and p.stages == 1:
        lines.append("import contextlib")
    lines += ["import gc", "import os", "import time"] + ["import warnings"] * p.async_tensor
    if p.recompute == "selective":
        lines.append("from functools import partial")
    lines += ["", "import torch"] + ["import torch._inductor.config"] * p.async_tensor + [
              "import torch.distributed as dist",
              "from torch.distributed.checkpoint.state_dict import StateDictOptions, "
              "set_model_state_dict",
              "from torch.distributed.device_mesh import init_device_mesh"]
    if p.async_tensor:
        lines.append("from torch.distributed._symmetric_memory import "
                     "enable_symm_mem_for_group")
    if _fsdp(p) and _gathers_half(p):
        lines.append("from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard")
    elif _fsdp(p):
        lines.append("from torch.distributed.fsdp import fully_shard")
    elif p.replicas > 1:
        lines.append("from torch.nn.parallel import DistributedDataParallel")
    if p.tensor > 1:
        lines += tensor_imports(p)
    if p.stages > 1:
        lines.append("from torch.distributed.pipelining import "
                     f"{_SCHEDULES[p.schedule]}, SplitPoint, pipeline")
        lines.append("from torch.export.unflatten import InterpreterModule")
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
             f"MESH = {{{', '.join(f'{literal(k)}: {v}' for k, v in mesh.items())}}}"]
    if p.stages > 1:
        lines.append("#: the modules where pipeline stages 1, 2, ... begin; their micro-batches' "
                     "schedule")
        lines.append(f"STAGE_STARTS = [{', '.join(literal(m) for m in p.stage_starts)}]")
        lines.append(f"SCHEDULE = {_SCHEDULES[p.schedule]}")
        if p.virtual_stages > 1:
            lines.append("#: the chunks (virtual stages) each pipeline rank holds: rank r the "
                         "stages r, r + pp, ...")
            lines.append(f"VIRTUAL_STAGES = {p.virtual_stages}")
    if p.tensor > 1:
        lines += tensor_constants(p)
    if p.blocks and (_fsdp(p) or p.recompute != "none" or p.async_tensor):
        what = " and ".join(x for x in ("sharded" if _fsdp(p) else "",
                                        "recomputed" if p.recompute != "none" else "",
                                        "compiled (on CUDA)" if p.async_tensor else "") if x)
        lines.append(f"#: the model's blocks, {what} one at a time")
        lines += listed("BLOCKS", p.blocks)
    if p.precision != "fp32":
        kept = "; FSDP gathers them in it" if _gathers_half(p) else ""
        lines.append(f"#: autocast's precision (the weights stay fp32{kept})\nPRECISION = "
                     f"torch.{'bfloat16' if p.precision == 'bf16' else 'float16'}")
    if _gathers_half(p):
        lines.append("MP_POLICY = MixedPrecisionPolicy(PRECISION, torch.float32, "
                     "cast_forward_inputs=False)")
    if p.precision == "fp16":
        lines.append("#: fp16: the loss is scaled up before the backward and the gradients "
                     f"down before the step\nLOSS_SCALE = {FP16_LOSS_SCALE!r}")
    if p.recompute == "selective":
        lines.append("#: selective recomputation keeps the outputs of ops whose name holds one "
                     "of these\n#: (matmul-like); the rest run again in the backward")
        lines.append(f"KEPT = ({', '.join(literal(k) for k in MATMUL_MARKERS)})")
    return "\n".join(lines)


def _mesh(p: NativePlan) -> dict[str, int]:
    """The mesh's dimensions, outermost first: pipeline stages, then replicas (a rank's
    neighbours are replicas of its stage, as torchtitan's ``ParallelDims`` places them)."""
    pipeline = {"pp": p.pipeline_ranks} if p.stages > 1 else {}
    if p.tensor > 1:
        return {"dp_replicate": p.replicas, "tp": p.tensor}
    if _replicated_stages(p):
        return pipeline | {"dp_replicate": p.replicas, "dp_shard": 1}
    return pipeline | {_replica_dim(p): p.replicas}


def _replicated_stages(p: NativePlan) -> bool:
    """Whether the plan replicates pipeline stages without sharding them: FSDP over a mesh
    of replicas x 1 shard then keeps whole weights and all-reduces gradients as DDP would
    (torch's pipeline stages hold gradients back between micro-batches of FSDP modules;
    DDP's wrapper does not fit a traced stage)."""
    return p.stages > 1 and p.replicas > 1 and not p.zero


def _fsdp(p: NativePlan) -> bool:
    return bool(p.zero) or _replicated_stages(p)


def _fsdp_mesh(p: NativePlan) -> str:
    return 'mesh["dp_replicate", "dp_shard"]' if _replicated_stages(p) else 'mesh["dp_shard"]'



def _replica_dim(p: NativePlan) -> str:
    return "dp_shard" if p.zero else "dp_replicate"


def _model_section(p: NativePlan) -> str:
    if "builtin" in p.source:
        name, size = p.source["builtin"], p.source["size"]
        batch = int(p.source.get("batch_size") or 0) or None
        call = f"build({literal(name)}, {literal(size)}, {batch!r}, seed=0, weights=weights)"
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
    """``initial``'s weights and buffers into the model, or the part of it this rank holds."""
    mine = dict(model.named_parameters())
    weights = {{name: w for name, w in initial.state_dict().items() if name in mine}}
    if weights.keys() != mine.keys():
        raise SystemExit(f"no initial weights for {{sorted(mine.keys() - weights.keys())}}")
    set_model_state_dict(model, weights,
                         options=StateDictOptions(full_state_dict=True, strict=False))
    for name, buffer in model.named_buffers():  # (a state dict may leave some out)
        buffer.copy_(initial.get_buffer(name))
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
    if p.blocks and (_fsdp(p) or p.recompute != "none"):
        body.append("    for path in BLOCKS:")
        if p.stages > 1:
            body.append("        if path not in here:  # (a block of another pipeline stage)")
            body.append("            continue")
            body.insert(0, "    here = dict(model.named_modules())")
        body.append("        block = here[path]" if p.stages > 1 else
                    "        block = model.get_submodule(path)")
        if p.recompute != "none":
            body.append("        recompute(block)")
        if _fsdp(p):
            body.append(f"        fully_shard(block, mesh={_fsdp_mesh(p)}{_reshard(p)})")
    if _fsdp(p):
        body.append(f"    fully_shard(model, mesh={_fsdp_mesh(p)}{_reshard(p)})")
    if not body:
        body.append("    pass  # one device, or replicas wrapped once the weights are in: main()")
    notes = {1: "    # ZeRO 1 shards optimizer state only; FSDP has no such setting, so it runs "
                "as\n    # ZeRO 2 (gradients sharded too: less memory, the same traffic)\n",
             2: "    # ZeRO 2: parameters stay gathered from the forward to the backward\n",
             3: "",
             0: "    # stage replicas: FSDP over replicas x 1 shard keeps whole weights, as DDP "
                "does\n"}
    if p.tensor > 1:  # (torchtitan's order: the split, then recomputation; no replicas)
        body = tensor_body(p)
        if p.blocks and p.recompute != "none":
            body += ["    for path in BLOCKS:", "        recompute(model.get_submodule(path))"]
        body += async_tensor_body(p)
    note = notes[p.zero] if _fsdp(p) else ""
    what = ("each module split as TENSOR_LAYOUT says" if p.tensor > 1 else
            "in torchtitan's order: recomputation, then sharding")
    return ('def parallelize(model: torch.nn.Module, mesh) -> None:\n'
            f'    """The plan\'s parallelisms, {what}."""\n' + note + "\n".join(body) + "\n")


def _reshard(p: NativePlan) -> str:
    keep = ", reshard_after_forward=False" if p.zero in (1, 2) else ""
    return keep + (", mp_policy=MP_POLICY" if _gathers_half(p) else "")


def _gathers_half(p: NativePlan) -> bool:
    """ZeRO under bf16/fp16 gathers 2-byte weights from fp32 shards (FSDP2's mixed-precision
    policy), as the explorer's runtime and simulator do."""
    return p.zero > 0 and p.precision != "fp32"


def _step_section(p: NativePlan) -> str:
    if p.stages > 1:
        return _pipeline_step_section(p)
    lines = ["def micro_batch(model, loss_fn, inputs, targets, rows: slice) -> torch.Tensor:",
             '    """Forward and backward of ``rows`` of the batch; their share of the step\'s '
             'loss."""']
    forward = ["loss = loss_fn(model(*[t[rows] for t in inputs]), *[t[rows] for t in targets])",
               "loss = loss / MICRO_BATCHES"]
    backward = ("(loss * LOSS_SCALE).backward()" if p.precision == "fp16" else
                "loss.backward()")
    if loss_parallel(p):
        lines.append("    with loss_parallel():  # (the loss of the output layer's class shards)")
        if p.precision != "fp32":
            lines.append("        with torch.autocast(inputs[0].device.type, dtype=PRECISION):")
            lines += ["            " + f for f in forward]
        else:
            lines += ["        " + f for f in forward]
        lines += ["        " + backward, "    return loss.detach().full_tensor()"]
        return "\n".join(lines)
    if p.precision != "fp32":
        lines.append("    with torch.autocast(inputs[0].device.type, dtype=PRECISION):")
        lines += ["        " + f for f in forward]
    else:
        lines += ["    " + f for f in forward]
    lines.append("    " + backward)
    lines.append("    return loss.detach()")
    return "\n".join(lines)


_AS_CODE = '''def as_code(stage: torch.nn.Module) -> None:
    """Run the stage's traced submodules (their graphs) as code, not op by op in torch.fx."""
    for path, part in reversed(list(stage.named_modules())):  # innermost first
        if isinstance(part, InterpreterModule) and any(n.op.startswith("call")
                                                       for n in part.graph.nodes):
            stage.set_submodule(path, torch.fx.GraphModule(part, part.graph))


'''


def _pipeline_step_section(p: NativePlan) -> str:
    autocast = p.precision != "fp32"
    pad = "    " * (2 if autocast else 1)
    lines = [_AS_CODE + "def pipeline_step(schedule, stage_index: int, inputs, targets, device) -> "
             "torch.Tensor:",
             '    """One step through the pipeline: the first stage feeds the micro-batches in, '
             "the last\n    computes their losses; the step's mean loss on the last stage "
             '(zero on the others)."""',
             "    losses = []"]
    if autocast:
        lines.append("    with torch.autocast(device.type, dtype=PRECISION):")
    lines += [f"{pad}if stage_index == 0:", f"{pad}    schedule.step(*inputs)",
              f"{pad}elif stage_index == MESH[\"pp\"] - 1:",
              f"{pad}    schedule.step(target=targets[0], losses=losses)",
              f"{pad}else:", f"{pad}    schedule.step()"]
    scale = " / LOSS_SCALE" if p.precision == "fp16" else ""
    lines += ["    if not losses:", "        return torch.zeros((), device=device)",
              f"    return torch.stack(losses).mean().detach(){scale}"]
    return "\n".join(lines)


def _main_section(p: NativePlan) -> str:
    n = len(p.devices)
    body = _pipeline_body(p) if p.stages > 1 else _data_parallel_body(p)
    return f"""
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
    replicas = mesh["{_replica_dim(p)}"].size()
    replica = mesh["{_replica_dim(p)}"].get_local_rank()
{body}        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start  # the step's work, not the logging after it
        dist.all_reduce(total)  # the mean loss over the global batch
        total /= {loss_holders(p)}
        if dist.get_rank() == 0:
            print(f"step {{step}}: loss {{total.item():.6f}}, {{seconds * 1e3:.2f}} ms",
                  flush=True)
    # the model's hooks and collectives' handles go before the process group (at exit: abort)
    del {_pipeline_names(p)}model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _pipeline_names(p: NativePlan) -> str:
    if p.stages == 1:
        return ""
    return "schedule, stages, " if p.virtual_stages > 1 else "schedule, stage, "


def _materialise(p: NativePlan) -> str:
    fused = ("    conv1d_as_linear(initial)\n" if p.conv1d else "") + (
        '    interleave_fused(initial, mesh["tp"].size())  # (before the split)\n'
        if p.fused else "")
    load = ("    for chunk in model:\n        load_weights(chunk, initial)\n"
            if p.virtual_stages > 1 else "    load_weights(model, initial)\n")
    return f"""    model.to_empty(device=device)
    # the factory's initial weights, made on each rank's CPU (for a model larger than a
    # host, load a checkpoint here instead), and its example batch
    initial, _, example = make_model(weights=True)
{fused}{load}    del initial
"""
_UNSCALE = """        for param in model.parameters():  # (the loss was scaled up)
            if param.grad is not None:
                param.grad.div_(LOSS_SCALE)
"""


def _data_parallel_body(p: NativePlan) -> str:
    wrap = ""
    if p.replicas > 1 and not p.zero:
        wrap = ("    # each replica keeps its own running statistics (BatchNorm's), as the plan's\n"
                "    # runtime does: no broadcast of rank 0's before every forward\n"
                "    model = DistributedDataParallel(model, device_mesh=mesh[\"dp_replicate\"],\n"
                "                                    broadcast_buffers=False)\n")
    call = "total += micro_batch(model, loss_fn, inputs, targets, rows)"
    if p.micro_batches > 1 and p.replicas > 1 and p.zero == 1:
        accumulate = ("            # ZeRO 1: gradients reduced after the last micro-batch\n"
                      "            model.set_requires_gradient_sync(m == MICRO_BATCHES - 1)\n"
                      f"            {call}\n")
    elif p.micro_batches > 1 and p.replicas > 1 and p.zero:
        accumulate = ("            # FSDP reduce-scatters each micro-batch's gradients: only the\n"
                      "            # shards accumulate\n"
                      f"            {call}\n")
    elif p.micro_batches > 1 and p.replicas > 1:
        accumulate = ("            # the replicas reduce gradients after the last micro-batch\n"
                      "            last = m == MICRO_BATCHES - 1\n"
                      "            with contextlib.nullcontext() if last else model.no_sync():\n"
                      f"                {call}\n")
    else:
        accumulate = f"            {call}\n"
    unscale = _UNSCALE if p.precision == "fp16" else ""
    conv1d = "    conv1d_as_linear(model)\n" if p.conv1d else ""
    return f"""    model, loss_fn, _ = make_model(weights=False)  # shapes only: nothing allocated
{conv1d}    parallelize(model, mesh)
{_materialise(p)}{wrap}    optimizer = {OPTIMIZERS[p.optimizer]}
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
"""


def _build_stages(p: NativePlan) -> str:
    if p.virtual_stages == 1:
        return """    stage = pipe.build_stage(stage_index, device, group=mesh["pp"].get_group())
    model = stage.submod
    as_code(model)
    parallelize(model, mesh)
"""
    return """    # this rank's chunks of the model: stages stage_index, stage_index + pp, ...
    stages = [pipe.build_stage(stage_index + k * MESH["pp"], device,
                               group=mesh["pp"].get_group()) for k in range(VIRTUAL_STAGES)]
    model = torch.nn.ModuleList(stage.submod for stage in stages)
    for chunk in model:
        as_code(chunk)
        parallelize(chunk, mesh)
"""


def _pipeline_body(p: NativePlan) -> str:
    loss = " loss_fn=loss_fn"
    if p.precision == "fp16":  # (the loss scaled up, as in the backward)
        loss = ("\n                        loss_fn=lambda output, target: loss_fn(output, "
                "target) * LOSS_SCALE")
    unscale = _UNSCALE if p.precision == "fp16" else ""
    held = "stages" if p.virtual_stages > 1 else "stage"  # (what the schedule runs)
    setup = _build_stages(p) + _materialise(p)
    return f"""    stage_index = mesh["pp"].get_local_rank()
    model, loss_fn, example = make_model(weights=False)  # shapes only: nothing allocated
    # torch's pipeline traces one micro-batch of this replica's rows and cuts the model
    # where each stage begins; this rank keeps its stage's part
    rows = example[0][0].shape[0] // replicas // MICRO_BATCHES
    split = {{path: SplitPoint.BEGINNING for path in STAGE_STARTS}}
    pipe = pipeline(model, mb_args=tuple(t[:rows] for t in example[0]), split_spec=split)
{setup}    schedule = SCHEDULE({held}, n_microbatches=MICRO_BATCHES,{loss})
    optimizer = {OPTIMIZERS[p.optimizer]}
    data = batches(example)
    for step in range(STEPS):
        start = time.perf_counter()
        inputs, targets = ([t.to(device) for t in part] for part in next(data))
        mine = inputs[0].shape[0] // replicas  # this replica's rows of the batch
        rows = slice(replica * mine, (replica + 1) * mine)
        optimizer.zero_grad(set_to_none=True)
        total = pipeline_step(schedule, stage_index, [t[rows] for t in inputs],
                              [t[rows] for t in targets], device)
{unscale}        optimizer.step()
"""
