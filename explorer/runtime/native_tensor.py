"""The tensor-parallel parts of the native script (:mod:`explorer.runtime.native_script`):
torch's parallel styles per split module, the constants that name them, and the functions that
make a weight splittable first (Hugging Face's Conv1D as an nn.Linear, a fused projection's
rows reordered)."""

from __future__ import annotations

from explorer.runtime.native_mapping import NativePlan
from explorer.runtime.native_text import listed, literal

__all__ = ["loss_holders", "loss_parallel", "split_weights_section", "tensor_body",
           "tensor_constants", "tensor_imports"]

#: each style, as the script builds it
_STYLES = {"colwise": "ColwiseParallel()", "rowwise": "RowwiseParallel()",
           "vocab_embedding": "RowwiseParallel(input_layouts=Replicate())",
           "vocab_output": "ColwiseParallel(use_local_output=False)",
           "sequence_norm": "SequenceParallel()",
           "colwise_from_sequence": "ColwiseParallel(input_layouts=Shard(1))",
           "rowwise_to_sequence": "RowwiseParallel(output_layouts=Shard(1))",
           "vocab_embedding_to_sequence": "RowwiseParallel(input_layouts=Replicate(), "
                                          "output_layouts=Shard(1), use_local_output=False)",
           "vocab_output_from_sequence":
               "ColwiseParallel(input_layouts=Shard(1), use_local_output=False)",
           "output_to_sequence": "PrepareModuleOutput(output_layouts=Replicate(), "
                                 "desired_output_layouts=Shard(1), use_local_output=False)",
           "rows_to_sequence": "PrepareModuleOutput(output_layouts=Replicate(), "
                               "desired_output_layouts=Shard(0), use_local_output=False)"}


def loss_parallel(p: NativePlan) -> bool:
    return any(style.startswith("vocab_output") for _, style in p.tensor_styles)


def loss_holders(p: NativePlan) -> str:
    """How many ranks hold each replica's loss (it is summed over all)."""
    if p.tensor > 1:
        return 'replicas * mesh["tp"].size()  # (every tensor-parallel rank holds it)'
    return "replicas"


def tensor_imports(p: NativePlan) -> list[str]:
    used = {style for _, style in p.tensor_styles}
    names = sorted({_STYLES[style].split("(")[0] for style in used} | {"parallelize_module"}
                   | ({"loss_parallel"} if loss_parallel(p) else set()))
    placements = sorted({name for style in used for name in ("Replicate", "Shard")
                         if f"{name}(" in _STYLES[style]} | ({"DTensor"} if p.sequence_entry
                                                             else set()))
    lines = ([f"from torch.distributed.tensor import {', '.join(placements)}"]
             if placements else [])
    return lines + ["from torch.distributed.tensor.parallel import ("] + [
        f"    {name}," for name in names] + [")"]


def tensor_constants(p: NativePlan) -> list[str]:
    lines = ["#: how each layer is split over the tensor-parallel devices (Megatron-LM's pairs): "
             '"colwise"', "#: splits a linear's outputs, \"rowwise\" its inputs (each pair "
             "all-reduces once), \"vocab_*\"", "#: an embedding's rows or the output layer's "
             "classes (its loss runs on the shards)", "TENSOR_LAYOUT = {"]
    lines += [f"    {literal(path)}: {literal(style)}," for path, style in p.tensor_styles]
    lines.append("}")
    if p.sequence_entry:
        lines += ["#: the first block: the embeddings reach it as a DTensor on sequence shards "
                  "(its shape", "#: whole, as the model's own code reads it); it works on this "
                  "device's positions", f"SEQUENCE_ENTRY = {literal(p.sequence_entry)}"]
    if p.attention and p.head_counts:
        lines.append("#: attention modules split by heads: each device runs its own, so their "
                     "head counts are divided")
        lines += listed("ATTENTION", p.attention)
        lines.append(f"HEAD_COUNTS = ({', '.join(literal(h) for h in p.head_counts)},)")
    if p.conv1d:
        lines.append("#: Hugging Face Conv1D modules (linears with (in, out) weights) made "
                     "nn.Linear for the split")
        lines += listed("CONV1D", p.conv1d)
    if p.fused:
        lines += ["#: projections that compute several parts at once (queries, keys and values), "
                  "split by", "#: heads within each part: their rows are reordered before "
                  "the split (interleave_fused),", "#: so a checkpoint of the split model "
                  "holds them in that order", "FUSED_PROJECTIONS = {"]
        lines += [f"    {literal(path)}: {parts}," for path, parts in p.fused]
        lines.append("}")
    return lines


def tensor_body(p: NativePlan) -> list[str]:
    used = dict.fromkeys(style for _, style in p.tensor_styles)
    body = ["    styles = {"]
    for style in used:
        entry = f"        {literal(style)}: {_STYLES[style]},"
        body += [entry] if len(entry) <= 100 else [f"        {literal(style)}:",
                                                   *_wrapped(f"{_STYLES[style]},", 12)]
    body += ["    }", "    layout = {path: styles[style] for path, style in "
             "TENSOR_LAYOUT.items()}", '    parallelize_module(model, mesh["tp"], layout)']
    if p.sequence_entry:
        body += ["    model.get_submodule(SEQUENCE_ENTRY).register_forward_pre_hook(",
                 "        on_positions, with_kwargs=True)"]
    if p.attention and p.head_counts:
        body += ["    for path in ATTENTION:", "        attention = model.get_submodule(path)",
                 "        for name in HEAD_COUNTS:",
                 '            setattr(attention, name, getattr(attention, name) // '
                 'mesh["tp"].size())']
    return body


def _wrapped(call: str, indent: int, width: int = 100) -> list[str]:
    """``call`` (``Name(a, b, ...)``) on lines of at most ``width`` characters, indented by
    ``indent``, its arguments continued under the first."""
    head, _, rest = call.partition("(")
    lines, line = [], " " * indent + head + "("
    for i, part in enumerate(rest.split(", ")):
        piece = part if i == 0 else " " + part
        if i and len(line) + len(piece) + 1 > width:
            lines.append(line + ",")
            line = " " * (indent + len(head) + 1) + part
        else:
            line += ("," if i else "") + piece
    return [*lines, line]


def split_weights_section(p: NativePlan) -> str:
    positions = '''
def on_positions(module, args, kwargs):
    """What a block reads, each DTensor as this device's part of it (a plain tensor)."""
    def local(value):
        return value.to_local() if isinstance(value, DTensor) else value
    return tuple(local(a) for a in args), {name: local(v) for name, v in kwargs.items()}
''' if p.sequence_entry else ""
    conv1d = '''
def conv1d_as_linear(model: torch.nn.Module) -> None:
    """Hugging Face's Conv1D modules of CONV1D as the nn.Linear torch's styles split: the
    same outputs, its (in, out) weight transposed."""
    for path in CONV1D:
        conv = model.get_submodule(path)
        linear = torch.nn.Linear(*conv.weight.shape, device=conv.weight.device)
        with torch.no_grad():
            linear.weight.copy_(conv.weight.t())
            linear.bias.copy_(conv.bias)
        model.set_submodule(path, linear)
''' if p.conv1d else ""
    if not p.fused:
        return positions + conv1d
    return positions + conv1d + '''
def interleave_fused(initial: torch.nn.Module, ranks: int) -> None:
    """Reorder each fused projection's output rows (and bias) so that each rank's contiguous
    block, the one ColwiseParallel gives it, holds its heads' share of every part: parts of
    ranks x rows become ranks x parts x rows."""
    with torch.no_grad():
        for path, parts in FUSED_PROJECTIONS.items():
            projection = initial.get_submodule(path)
            for tensor in (projection.weight, projection.bias):
                if tensor is not None:
                    rows = tensor.unflatten(0, (parts, ranks, -1))
                    tensor.copy_(rows.transpose(0, 1).flatten(0, 2))
'''


def async_tensor_body(p: NativePlan) -> list[str]:
    """On CUDA ranks, torch's async tensor parallelism: each split block compiled, with the
    compiler's micro-pipelining of an all-gather or reduce-scatter with the matmul beside it
    (torchtitan's ``enable_async_tensor_parallel``); CPU ranks have no symmetric memory and
    run the collectives in turn."""
    if not p.async_tensor:
        return []
    blocks = ["        for path in BLOCKS:", "            model.get_submodule(path).compile()"]
    return ['    if mesh["tp"].device_type == "cuda":  # (async tensor parallelism)',
            "        torch._inductor.config._micro_pipeline_tp = True",
            "        with warnings.catch_warnings():  # (deprecated, but the compiler's",
            "            warnings.simplefilter(\"ignore\", FutureWarning)  # pass reads it)",
            '            enable_symm_mem_for_group(mesh["tp"].get_group().group_name)',
            *(blocks if p.blocks else ["        model.compile()"])]

