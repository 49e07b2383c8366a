"""The tensor layouts of a plan's stages: each stage's layout at its tensor degree (with
sequence parallelism or not), the placements and split ops a real run needs, and a note for
each stage a degree splits nothing of. The layout of one degree is
:func:`explorer.core.tensor_layout.megatron_layout`."""

from __future__ import annotations

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.tensor_layout import (
    CONV_OPS,
    EMBEDDING_OPS,
    LINEAR_OPS,
    TRANSPOSED_OPS,
    TensorLayout,
    megatron_layout,
)


def stage_layout(graph: OpGraph, plan: Plan, stage: int) -> TensorLayout:
    """The layout of ``plan``'s ``stage`` (its tensor degree, with sequence parallelism or
    not)."""
    return megatron_layout(graph, plan.tensor_of(stage), plan.sequence_of(stage))


def unsplit_notes(graph: OpGraph, plan: Plan) -> tuple[str, ...]:
    """A line for each tensor-parallel stage of ``plan`` whose degree splits none of its ops,
    saying why: its ops then run whole on each of its tensor devices, which only adds work;
    and for each whose sequence parallelism splits none (it runs as tensor parallelism alone).
    (A plan's notes carry them to the command line's and the widget's plan rows.)"""
    out = []
    for s in range(len(plan.stages)):
        k = plan.tensor_of(s)
        layout = stage_layout(graph, plan, s) if k > 1 else None
        if layout is not None and plan.sequence_of(s) and not layout.sequence_ops:
            out.append(f"sequence parallelism on stage {s} splits nothing along the sequence: "
                       "no norm or residual add between its split blocks reads a row-parallel "
                       "linear's or an embedding's (batch, seq, features) output; the stage "
                       "runs as tensor parallelism alone")
        if layout is None or any(plan.stage_of(n) == s for n in layout.split_ops):
            continue
        mine = [n for n in graph.ops if plan.stage_of(n.name) == s]
        kinds = sum(n.op in (*LINEAR_OPS, *TRANSPOSED_OPS, *CONV_OPS, *EMBEDDING_OPS)
                    for n in mine)
        why = ("no linear, convolution or embedding is among its ops" if not kinds else
               f"none of its {kinds} linears, convolutions or embeddings has a layout it "
               f"knows (a column- and a row-parallel pair with element-wise ops or whole heads "
               f"between, sizes {k} divides, an embedding of token ids)")
        out.append(f"tensor {k} on stage {s} splits nothing: {why}; its ops run whole on each "
                   f"of its {k} tensor devices")
    return tuple(out)


def plan_placements(graph: OpGraph, plan: Plan
                    ) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """The placement of every weight a tensor-parallel stage of ``plan`` splits, the ops
    those stages split, those of them run on local shards, and those whose output is a
    sequence shard (the sequence-parallel ops and the ops that scatter into them, and the
    transposed linears whose partial sums a view after them scatters; in graph order)."""
    out: dict[str, str] = {}
    ops: set[str] = set()
    local: set[str] = set()
    seq: set[str] = set()
    for s in range(len(plan.stages)):
        if plan.tensor_of(s) > 1:
            layout = stage_layout(graph, plan, s)
            out.update({k: v for k, v in layout.placements.items() if plan.stage_of(k) == s})
            ops.update(k for k in layout.split_ops if plan.stage_of(k) == s)
            local.update(k for k in layout.local_ops if plan.stage_of(k) == s)
            seq.update(k for k in (*layout.sequence_ops, *layout.scatter_forward,
                                   *layout.partial_rows) if plan.stage_of(k) == s)
    return (out, *([n.name for n in graph.nodes if n.name in names]
                   for names in (ops, local, seq)))
