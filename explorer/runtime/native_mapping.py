"""What a plan asks, in the terms of torch's own parallelisms: the part of a native script
(:mod:`explorer.runtime.native_script`) that reads the plan.

:func:`native_plan` maps a plan onto a :class:`NativePlan`: data-parallel replicas and their
ZeRO stage, recomputation and precision, micro-batches, and pipeline stages that begin at
modules (``torch.distributed.pipelining`` cuts a model there). A plan whose choices are not
those of modules (an op-level placement, a stage that starts inside a module, settings that
differ between stages) raises :class:`NotExpressible`, naming the op, stage or setting that
stops it; such plans keep exporting through the explorer's runtime.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from explorer.core.errors import ExplorerError
from explorer.core.factory import check_factory, load_factory
from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import INTERLEAVED, Plan, StageSettings
from explorer.core.plan_layout import stage_layout
from explorer.core.tensor_layout import (
    CONV_OPS,
    EMBEDDING_OPS,
    LINEAR_OPS,
    LOSS_OPS,
    TRANSPOSED_OPS,
    VOCAB_OPS,
    TensorLayout,
    out_dim,
    shard_dim,
    shard_parts,
)
from explorer.costs.strategies import unit_of
from explorer.models.builtin import build

__all__ = ["OPTIMIZERS", "NativePlan", "NotExpressible", "blocks_of", "model_on_meta",
           "native_plan", "stage_starts"]

#: a module path the script may name (``blocks.3``, ``layers.0.mlp``)
MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
#: the optimizers a plan may carry, as the script builds them (as ex.run does)
OPTIMIZERS = {"sgd": "torch.optim.SGD(model.parameters(), lr=LR)",
              "momentum": "torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)",
              "adam": "torch.optim.Adam(model.parameters(), lr=LR)",
              "adamw": "torch.optim.AdamW(model.parameters(), lr=LR)"}
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
#: how a module is split over the tensor-parallel devices, as torch's parallel styles do it:
#: a linear's outputs (``ColwiseParallel``) or inputs (``RowwiseParallel``), an embedding's
#: rows (vocabulary-parallel), the output layer's classes (its loss on the shards); under
#: sequence parallelism a norm runs on sequence shards (``SequenceParallel``), the column
#: styles gather their input from them and the row styles scatter their output into them;
#: an unsplit module whose whole output joins a sequence shard has it scattered too, along its
#: dimension 1, or 0 for a (sequence, features) output such as positions' embeddings
Style = Literal["colwise", "rowwise", "vocab_embedding", "vocab_output", "sequence_norm",
                "colwise_from_sequence", "rowwise_to_sequence", "vocab_embedding_to_sequence",
                "vocab_output_from_sequence", "output_to_sequence", "rows_to_sequence"]
#: the names of head counts an attention module may keep (``n_heads``, ``num_kv_heads``), and
#: Hugging Face GPT-2's width its fused projection's output splits by (``split_size``): each
#: tensor-parallel device divides them, running its own heads
HEAD_COUNT = re.compile(r"(n|num)_(\w+_)?heads|split_size")
#: the class name of Hugging Face's linear with its weight stored (in, out) (GPT-2's)
CONV1D = "Conv1D"


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
    #: data-parallel replicas (of each pipeline stage), and how their state is sharded
    #: (ZeRO 0-3)
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
    #: the modules that begin pipeline stages 1, 2, ... (none: one stage); with virtual
    #: stages, the chunks 1, 2, ... that go round the ranks in turn
    stage_starts: tuple[str, ...] = ()
    schedule: Schedule = "gpipe"
    #: the chunks each pipeline rank holds (interleaved 1F1B; 1: one stage per rank)
    virtual_stages: int = 1
    #: the tensor-parallel degree, and each split module's style (module path, style)
    tensor: int = 1
    tensor_styles: tuple[tuple[str, Style], ...] = ()
    #: the attention modules split by heads, and their head counts' names
    attention: tuple[str, ...] = ()
    head_counts: tuple[str, ...] = ()
    #: fused projections split by heads within each of their parts (a query-key-value
    #: projection): (module path, parts); the script reorders their rows so that each
    #: device's contiguous block (torch's ColwiseParallel) holds its share of every part
    fused: tuple[tuple[str, int], ...] = ()
    #: Hugging Face Conv1D modules the plan splits: the script makes each an nn.Linear (its
    #: weight transposed) for torch's styles
    conv1d: tuple[str, ...] = ()
    #: under sequence parallelism, the first block: the embeddings reach it as a DTensor on
    #: sequence shards (its shape whole, as the model's own code reads it), and it works on
    #: this device's positions as a plain tensor, as the blocks hand them on
    sequence_entry: str = ""
    #: async tensor parallelism: on CUDA, the compiler pipelines the sequence-parallel
    #: all-gathers and reduce-scatters with the matmuls beside them
    async_tensor: bool = False

    @property
    def stages(self) -> int:
        """The pipeline's stages (chunks, with virtual stages)."""
        return len(self.stage_starts) + 1

    @property
    def pipeline_ranks(self) -> int:
        """The ranks along the pipeline (each holds ``virtual_stages`` stages)."""
        return self.stages // self.virtual_stages


def native_plan(graph: OpGraph, plan: Plan, source: dict, made: Any = None) -> NativePlan:
    """``plan`` for ``graph`` as torch's parallelisms, or :class:`NotExpressible` saying
    what stops it; ``made``: what the source builds (on the meta device,
    :func:`model_on_meta`), to see which parameters its modules share and how many targets
    its loss reads."""
    if "factory" in source:
        check_factory(source["factory"])
    if not source:
        raise NotExpressible("a native script builds the model from its source: export a "
                             "built-in model, or name the function that builds yours "
                             "(factory=\"module:function\" / --factory)")
    settings = _one_setting_for_all_stages(plan)
    if plan.optimizer not in OPTIMIZERS:
        raise NotExpressible(f"optimizer {plan.optimizer!r} has no native form")
    replicas = _replicas(plan)
    tensor = {}
    if settings.tensor > 1:
        tensor = _tensor_parallel(graph, plan, None if made is None else made.module)
    starts = stage_starts(graph, plan)
    if starts and made is not None:
        _check_pipeline_ends(made)
    return NativePlan(
        source=dict(source), devices=tuple(plan.devices), replicas=replicas,
        zero=settings.zero if replicas > 1 else 0, recompute=settings.recompute,
        precision=settings.precision, micro_batches=plan.micro_batches,
        optimizer=plan.optimizer,
        blocks=blocks_of(graph, None if made is None else made.module),
        algorithm=plan.algorithm,
        stage_starts=starts, schedule=plan.schedule,  # type: ignore[arg-type]
        virtual_stages=(len(starts) + 1) // len(plan.stages) if starts else 1,
        async_tensor=settings.async_tensor, **tensor)


def _check_pipeline_ends(made: Any) -> None:
    """A pipeline's schedule passes its last stage one target and the model's output as a
    tensor (the stages send tensors): :class:`NotExpressible` for a loss with several
    targets or a model that returns anything else (an output object, a tuple)."""
    if len(made.targets) != 1:
        raise NotExpressible(
            f"the loss reads {len(made.targets)} targets; torch's pipeline schedules give "
            "the last stage one: export without native")
    # traced on the meta device, as the script's pipeline() traces it
    exported = torch.export.export(made.module, tuple(made.example_inputs), strict=False)
    output = exported.call_spec.out_spec
    if not output.is_leaf():
        raise NotExpressible(
            f"the model returns a {_spec_name(output)}, not a tensor; torch's pipeline "
            "stages pass tensors, and the last one gives its output to the loss as one: "
            "have the factory's module return the tensor the loss reads (the logits), or "
            "export without native")


def _tensor_parallel(graph: OpGraph, plan: Plan,
                     module: torch.nn.Module | None) -> dict[str, Any]:
    """The plan's tensor split as torch's parallel styles, module by module: the
    :class:`NativePlan` fields ``tensor``, ``tensor_styles``, ``attention``, ``head_counts``."""
    degree = plan.tensor_of(0)
    if len(plan.stages) > 1:
        raise NotExpressible("the plan splits layers over tensor-parallel devices in a "
                             "pipeline; native scripts write one or the other: export without "
                             "native")
    if plan.replicas_of(0) > 1:
        raise NotExpressible(
            f"the plan has {plan.replicas_of(0)} replicas of its tensor-parallel "
            "devices; native scripts write tensor parallelism on one replica: export "
            "without native")
    layout = stage_layout(graph, plan, 0)
    styles = _styles(graph, layout, module)
    fused = tuple((name.rpartition(".")[0], shard_parts(placement))
                  for name, placement in layout.placements.items()
                  if shard_parts(placement) > 1 and name.endswith(".weight"))
    conv1d = tuple(path for path, _ in styles if module is not None
                   and type(module.get_submodule(path)).__name__ == CONV1D)
    entry = ""
    if plan.sequence_of(0):
        styles = _sequence_styles(graph, layout, styles)
        entry = _sequence_entry(graph, styles)
    attention = tuple(dict.fromkeys(n.module_path for n in graph.nodes
                                    if n.name in layout.local_ops and n.module_path))
    counts: dict[str, None] = {}
    if module is not None:
        kept = []
        for path in attention:
            names = [name for name, value in vars(module.get_submodule(path)).items()
                     if HEAD_COUNT.fullmatch(name) and isinstance(value, int)]
            counts.update(dict.fromkeys(names))
            kept += [path] if names else []
        attention = tuple(kept)  # (the modules that keep head counts)
    for path in (*(p for p, _ in styles), *attention):
        if not MODULE_PATH.fullmatch(path):
            raise NotExpressible(f"module path {path!r} cannot be named in a script")
    return {"tensor": degree, "tensor_styles": styles, "attention": attention,
            "head_counts": tuple(counts), "fused": fused, "conv1d": conv1d,
            "sequence_entry": entry}


def _styles(graph: OpGraph, layout: TensorLayout,
            module: torch.nn.Module | None) -> tuple[tuple[str, Style], ...]:
    """Each split weight's module and how torch's parallel styles split it; a weight they
    cannot split as the layout does is :class:`NotExpressible`."""
    output = _vocab_output(graph, layout)
    styles: dict[str, Style] = {}
    for name, placement in layout.placements.items():
        path, _, attribute = name.rpartition(".")
        op = graph.nodes[graph.succs[graph.index[name]][0]]
        kind = type(module.get_submodule(path)).__name__ if module is not None else ""
        # (Hugging Face's Conv1D is a linear whose weight is stored (in, out))
        linear = ((op.op in LINEAR_OPS and kind in ("", "Linear"))
                  or (op.op in TRANSPOSED_OPS and kind == CONV1D))
        column = shard_dim(placement) == (out_dim(op.op) if attribute == "weight" else 0)
        if shard_parts(placement) > 1 and not (linear and column):
            raise NotExpressible(
                f"module {path!r} ({kind or op.op}) is one projection split by heads within "
                f"each of its {shard_parts(placement)} parts (a fused query-key-value "
                "projection); native scripts split one only where it is a linear split by its "
                "outputs: build the model with separate query, key and value projections, or "
                "export without native")
        if not linear and (op.op in (*TRANSPOSED_OPS, *CONV_OPS)
                           or kind not in ("", "Linear", "Embedding")):
            raise NotExpressible(
                f"module {path!r} ({kind or op.op}) is split by the plan; torch's parallel "
                "styles split nn.Linear and nn.Embedding modules (and Hugging Face's Conv1D, "
                "made an nn.Linear) only: export without native")
        if attribute == "bias":
            continue
        if op.op in EMBEDDING_OPS:
            styles[path] = "vocab_embedding"
        elif linear:
            styles[path] = ("vocab_output" if op.name == output else
                            "colwise" if column else "rowwise")
    return tuple(styles.items())


def _sequence_styles(graph: OpGraph, layout: TensorLayout,
                     styles: tuple[tuple[str, Style], ...]) -> tuple[tuple[str, Style], ...]:
    """``styles`` under sequence parallelism: the norms between blocks on sequence shards,
    the column styles reading them, the row styles (and the embedding) writing them.
    :class:`NotExpressible` where a column style's input is no sequence shard, or the output
    layer is not split (it would read the shards whole)."""
    sequence = set(layout.sequence_ops) | set(layout.scatter_forward)
    if not layout.sequence_ops:
        raise NotExpressible(
            "the plan asks for sequence parallelism, but it splits nothing of this model "
            "along the sequence: no norm or residual add between its tensor-parallel blocks "
            "reads a row-parallel linear's or an embedding's (batch, seq, features) output, "
            "so the explorer runs the plan as tensor parallelism alone: set sequence off")
    out: dict[str, Style] = _whole_inputs(graph, layout.sequence_ops, sequence)
    for name in sorted(layout.sequence_params, key=graph.index.__getitem__):
        out[name.rpartition(".")[0]] = "sequence_norm"
    reader = {graph.nodes[graph.succs[graph.index[f"{path}.weight"]][0]].name: path
              for path, _ in styles}
    for op, path in reader.items():
        style = dict(styles)[path]
        node = graph.nodes[graph.index[op]]
        if style in ("colwise", "vocab_output"):
            source = _same_shape_source(graph, _module_input(graph, node, path), sequence)
            if source not in sequence:
                raise NotExpressible(
                    f"module {path!r} reads {source!r}, which sequence parallelism leaves "
                    "whole; torch's styles gather a column split's input from sequence "
                    "shards: set sequence off, or export without native")
            out[path] = f"{style}_from_sequence"
        else:
            out[path] = f"{style}_to_sequence"
    if "vocab_output_from_sequence" not in out.values():
        raise NotExpressible("the plan splits the sequence but not the output layer's classes; "
                             "native scripts write sequence parallelism with the output "
                             "layer split: set sequence off, or export without native")
    return tuple(out.items())


#: shape ops that may give their input's shape back unchanged
SAME_SHAPE_OPS = frozenset(("aten.view.default", "aten.reshape.default", "aten.slice.Tensor",
                            "aten.contiguous.default", "aten.alias.default"))
#: ops that move a value to a device or an identical copy: an output torch's styles scatter
#: is read through them as it is
MOVES = frozenset(("aten.to.dtype_layout", "aten.to.device", "aten.alias.default"))


def _module_input(graph: OpGraph, node: OpNode, path: str) -> str | None:
    """The op output that module ``path`` reads, ``node`` being its projection: the first op
    input, looked through to outside the module (Hugging Face's Conv1D flattens its input
    with a view of its own first)."""
    while True:
        source = next((i for i in node.inputs if graph.nodes[graph.index[i]].kind == "op"),
                      None)
        if source is None or graph.nodes[graph.index[source]].module_path != path:
            return source
        node = graph.nodes[graph.index[source]]


def _sequence_entry(graph: OpGraph, styles: tuple[tuple[str, Style], ...]) -> str:
    """The first block under sequence parallelism: the module holding the first norm on
    sequence shards. The embeddings reach it as DTensors, so every unsplit module whose
    output is scattered must be read before it; :class:`NotExpressible` where it is not, or
    where no norm runs on sequence shards inside a block."""
    first = {}
    for k, n in enumerate(graph.nodes):
        if n.kind == "op":
            first.setdefault(n.module_path, k)
    norms = [path for path, style in styles if style == "sequence_norm"]
    entry = min(norms, key=lambda path: first.get(path, len(graph.nodes)),
                default="").rpartition(".")[0]
    if not entry:
        raise NotExpressible("the plan splits the sequence, but no norm on sequence shards "
                             "lies inside a block of the model; native scripts hand the "
                             "blocks their positions: set sequence off, or export without "
                             "native")
    starts = min(k for path, k in first.items() if path == entry or path.startswith(entry + "."))
    for path, style in styles:
        if style in ("output_to_sequence", "rows_to_sequence"):
            made = max(k for k, n in enumerate(graph.nodes)
                       if n.kind == "op" and n.module_path == path)
            if any(c >= starts for c in graph.succs[made]):
                raise NotExpressible(
                    f"module {path!r}'s output, scattered along the sequence, is read inside "
                    f"or after {entry!r}, the first block; native scripts scatter such "
                    "outputs before it: set sequence off, or export without native")
    return entry


def _same_shape_source(graph: OpGraph, source: str | None, sequence: set[str]) -> str | None:
    """``source``, looked through the shape ops that give their input's shape back (a view to
    the same shape, a slice of everything) to a sequence shard they read, if any: a DTensor
    on sequence shards goes through them as it is."""
    name = source
    while name is not None and name not in sequence:
        node = graph.nodes[graph.index[name]]
        preds = [graph.nodes[k] for k in graph.preds[graph.index[name]]
                 if graph.nodes[k].kind == "op"]
        if (node.op not in SAME_SHAPE_OPS or len(preds) != 1 or not node.shapes
                or node.shapes[:1] != preds[0].shapes[:1]):
            return source
        name = preds[0].name
    return source if name is None else name


def _whole_inputs(graph: OpGraph, ops: Iterable[str], sequence: set[str]
                  ) -> dict[str, Style]:
    """The unsplit modules whose whole output an op on sequence shards reads (a positional
    embedding added to the token embeddings' shard), each with the style that scatters its
    output along the sequence; :class:`NotExpressible` where such an output is not a
    module's, or is read whole elsewhere too."""
    out: dict[str, Style] = {}
    for name in ops:
        node = graph.nodes[graph.index[name]]
        for source in node.inputs:
            made = graph.nodes[graph.index[source]]
            if made.kind != "op" or source in sequence:
                continue
            readers = [graph.nodes[k].name for k in graph.succs[graph.index[source]]]
            while made.op in MOVES and len(graph.preds[graph.index[made.name]]) == 1:
                # (a module's output moved to the device it already is on)
                made = graph.nodes[graph.preds[graph.index[made.name]][0]]
                readers += [graph.nodes[k].name for k in graph.succs[graph.index[made.name]]
                            if graph.nodes[k].op not in MOVES]
                source = made.name
            path = made.module_path
            last = max((k for k, n in enumerate(graph.nodes)
                        if n.kind == "op" and n.module_path == path), default=-1)
            dim = 1 - (len(node.shapes[0]) - len(made.shapes[0])) if (
                node.shapes and made.shapes) else -1
            if (not path or last != graph.index[source] or dim not in (0, 1)
                    or any(r not in sequence for r in readers)):
                where = f" (module {path!r})" if path else ""
                raise NotExpressible(
                    f"op {name!r} joins a sequence shard with {source!r}{where}, which "
                    "torch's styles cannot split along the sequence; set sequence off, or "
                    "export without native")
            out[path] = "output_to_sequence" if dim == 1 else "rows_to_sequence"
    return out


def _vocab_output(graph: OpGraph, layout: TensorLayout) -> str | None:
    """The linear whose classes the layout splits with their loss (its op's name), if any."""
    for name in layout.split_ops:
        node = graph.nodes[graph.index[name]]
        if node.op not in LOSS_OPS:
            continue
        k = graph.index[node.inputs[0]]
        while graph.nodes[k].op in VOCAB_OPS:
            k = graph.index[graph.nodes[k].inputs[0]]
        if graph.nodes[k].op in LINEAR_OPS:
            return graph.nodes[k].name
    return None


def _spec_name(spec: Any) -> str:
    kind = getattr(spec, "type", None)
    return getattr(kind, "__name__", "structure of tensors")


def _one_setting_for_all_stages(plan: Plan) -> StageSettings:
    settings = [plan.settings_of(s) for s in range(len(plan.stages))]
    for s, other in enumerate(settings[1:], start=1):
        if other != settings[0]:
            raise NotExpressible(
                f"stage {s} runs with {other.describe() or 'the defaults'}, stage 0 with "
                f"{settings[0].describe() or 'the defaults'}; a native script applies one "
                "setting to every stage: set the same memory settings on all, or export "
                "without native")
    return settings[0]


def _replicas(plan: Plan) -> int:
    replicas = [plan.replicas_of(s) for s in range(len(plan.stages))]
    for s, n in enumerate(replicas[1:], start=1):
        if n != replicas[0]:
            raise NotExpressible(
                f"stage {s} has {n} data-parallel replicas, stage 0 {replicas[0]}; a native "
                "script's device mesh gives every pipeline stage as many: give each stage "
                "as many devices, or export without native")
    return replicas[0]


def stage_starts(graph: OpGraph, plan: Plan) -> tuple[str, ...]:
    """The modules (recomputation units, :func:`~explorer.costs.strategies.unit_of`) that
    begin stages 1, 2, ... of ``plan``: where ``torch.distributed.pipelining`` cuts the
    model. :class:`NotExpressible` unless the stages run in order, each a run of consecutive
    ops in the model's order that starts at the first op of a module; under interleaved 1F1B
    the runs (chunks) go round the stages in turn, as many on each, and every chunk start is
    listed."""
    ops = [n for n in graph.nodes if n.kind == "op"]
    rounds = plan.schedule == INTERLEAVED
    first_of_unit: dict[str, int] = {}
    for i, n in enumerate(ops):
        if n.module_path:
            first_of_unit.setdefault(unit_of(n.module_path), i)
    starts: list[str] = []
    stage = plan.placement[ops[0].name] if ops else 0
    if stage != 0:
        raise NotExpressible(f"the model's first op, {ops[0].name!r}, runs on stage {stage}; "
                             "a native pipeline starts on stage 0: export without native")
    for i, n in enumerate(ops):
        s = plan.placement[n.name]
        if s == stage:
            continue
        following = (stage + 1) % len(plan.stages) if rounds else stage + 1
        if s != following:
            raise NotExpressible(
                f"op {n.name!r} runs on stage {s} after ops of stage {stage}; a native "
                "pipeline runs its stages in order, each a run of the model's modules: "
                "export without native to run this placement")
        unit = unit_of(n.module_path) if n.module_path else ""
        if not unit or first_of_unit[unit] != i:
            where = f"inside module {n.module_path!r}" if n.module_path else "outside modules"
            hint = (f" (even-layers and balanced-params cut at blocks such as {unit!r} "
                    f"with depth={unit.count('.') + 1})" if unit else "")
            raise NotExpressible(
                f"stage {s} starts at op {n.name!r}, {where}; torch's pipeline cuts a "
                "model where a module begins: move the stage's start to a module's first "
                f"op{hint}, or export without native")
        if not MODULE_PATH.fullmatch(unit):
            raise NotExpressible(f"module path {unit!r} (of op {n.name!r}) cannot be named "
                                 "in a script")
        starts.append(unit)
        stage = s
    if stage != len(plan.stages) - 1:
        raise NotExpressible(f"stages {stage + 1} and later run no ops: export without "
                             "native")
    if rounds and (len(starts) + 1) % len(plan.stages):
        raise NotExpressible("interleaved 1F1B needs as many chunks on every stage: export "
                             "without native")
    if starts:
        _check_weights_stay_in_a_stage(graph, plan)
    return tuple(starts)


def _check_weights_stay_in_a_stage(graph: OpGraph, plan: Plan) -> None:
    """A weight that ops of two stages read (an embedding tied to the output layer) would be
    two weights in torch's pipeline, each stage training its own copy."""
    for i, n in enumerate(graph.nodes):
        if n.kind != "param":
            continue
        readers = [graph.nodes[j].name for j in graph.succs[i]]
        stages = sorted({plan.placement[r] for r in readers})
        if len(stages) > 1:
            raise NotExpressible(
                f"weight {n.name!r} is read by ops of stages {stages[0]} and {stages[-1]} "
                f"({readers[0]!r}, {readers[-1]!r}); torch's pipeline stages would each "
                "train a copy of it: put its readers on one stage, or export without native")


def model_on_meta(source: dict) -> Any:
    """What ``source`` builds (``module``, ``example_inputs``, ``targets``, ``loss_fn``), on
    the meta device (nothing allocated). A factory must return the model with its loss and
    example batch, which a native script trains with: :class:`NotExpressible` otherwise."""
    if "builtin" in source:
        return build(source["builtin"], source["size"], source.get("batch_size"),
                     weights=False)
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
    return made


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
            if not MODULE_PATH.fullmatch(unit):
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
