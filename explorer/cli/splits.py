"""The command line's tensor- and context-parallel options: ``--tensor``,
``--sequence-parallel``, ``--async-tensor`` and ``--context``, applied to a plan's stages
(:meth:`explorer.core.plan.Plan.with_tensor`, :meth:`explorer.core.plan.Plan.with_memory`)."""

from __future__ import annotations

import argparse

from explorer.cli.arguments import positive_int
from explorer.core.errors import ExplorerError
from explorer.core.plan_layout import unsplit_notes


def tensor_split(plan, degree: int):
    """``plan`` with every stage whose device count ``degree`` divides split that many ways
    by tensor parallelism (its other stages as they were)."""
    stages = [s for s, devs in enumerate(plan.stages) if len(devs) % degree == 0]
    if not stages:
        raise ExplorerError(f"--tensor {degree} divides the devices of none of this plan's "
                            f"stages ({', '.join(str(len(d)) for d in plan.stages)} devices); "
                            "use a degree that divides a stage's device count")
    return plan.with_tensor(degree, stages=stages)


def split_options(plan, tensor: int, sequence: bool | None, graph=None,
                  async_tensor: bool = False, context: int = 1):
    """``plan`` with the command line's ``--tensor`` (:func:`tensor_split`),
    ``--sequence-parallel`` (on every tensor-parallel stage), ``--async-tensor`` (on every
    sequence-parallel stage) and ``--context`` (on every stage whose devices it divides, with
    their tensor degree) applied; with the ``graph``, a stage the degree (or its sequence
    parallelism) splits nothing of says so first in the plan's notes."""
    if tensor > 1:
        plan = tensor_split(plan, tensor)
    if sequence:
        plan = _on_stages(plan, [s for s in range(len(plan.stages)) if plan.tensor_of(s) > 1],
                          "--sequence-parallel splits the ops between tensor-parallel blocks, "
                          "and this plan has no tensor-parallel stage: add --tensor N (N "
                          "dividing a stage's device count) or use --algorithm degrees",
                          sequence=True)
    if async_tensor:
        plan = _on_stages(plan, [s for s in range(len(plan.stages)) if plan.sequence_of(s)],
                          "--async-tensor pipelines the all-gathers and reduce-scatters of "
                          "sequence parallelism, and this plan has none: add --tensor N "
                          "--sequence-parallel, or use --algorithm degrees", async_tensor=True)
    if context > 1:
        plan = _on_stages(plan, [s for s, devs in enumerate(plan.stages)
                                 if len(devs) % (context * plan.tensor_of(s)) == 0],
                          f"--context {context} x the tensor degree divides the devices of "
                          "none of this plan's stages "
                          f"({', '.join(str(len(d)) for d in plan.stages)} devices); use a "
                          "degree that divides a stage's replicas", context=context)
    unsplit = unsplit_notes(graph, plan) if graph is not None and (tensor > 1 or sequence) else ()
    if unsplit:
        plan = plan.with_settings(notes=(*unsplit, *plan.notes))
    return plan


def _on_stages(plan, stages: list[int], refusal: str, **setting):
    """``plan`` with ``setting`` on ``stages``; :class:`ExplorerError` with ``refusal`` when
    there are none."""
    if not stages:
        raise ExplorerError(refusal)
    return plan.with_memory(stages=stages, **setting)


def add_split_options(parser: argparse.ArgumentParser) -> None:
    """``--tensor``, ``--sequence-parallel``, ``--async-tensor`` and ``--context``."""
    parser.add_argument("--tensor", type=positive_int, default=1,
                        help="split each layer of every stage whose device count it divides "
                             "this many ways (tensor parallelism, Megatron-style); default 1")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="on tensor-parallel stages, also split the norms and residual "
                             "adds between the split blocks along the sequence (Megatron-LM's "
                             "sequence parallelism)")
    parser.add_argument("--async-tensor", action="store_true",
                        help="on sequence-parallel stages, pipeline the all-gathers and "
                             "reduce-scatters with the matrix products beside them (torch's "
                             "async tensor parallelism, on GPUs; CPU ranks run them in turn)")
    parser.add_argument("--context", type=positive_int, default=1,
                        help="split each sample's sequence this many ways over a stage's "
                             "replicas (context parallelism: ring attention; --algorithm "
                             "degrees tries 1 and this); predicted, real steps do not run it "
                             "yet; default 1")
