"""The command line's memory settings: ``--zero``, ``--recompute``, ``--precision``, applied to a
plan with :meth:`explorer.core.plan.Plan.with_memory`."""

from __future__ import annotations

import argparse
from typing import Any

from explorer.core.plan import PRECISIONS, RECOMPUTE, ZERO_STAGES


def add_memory_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--zero``, ``--recompute`` and ``--precision`` to ``parser`` (each left out: the
    plan's own setting)."""
    g = parser.add_argument_group("memory settings (applied to every stage of the plan)")
    g.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None,
                   help="ZeRO stage over a stage's replicas: 1 shards the optimizer state, 2 "
                        "also the gradients, 3 also the weights (FSDP)")
    g.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="activation recomputation: selective (cheap ops) or full (per block)")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="compute precision; bf16 and fp16 keep fp32 master weights (with "
                        "--zero, sharded beside a bf16/fp16 working copy, as Megatron and "
                        "FSDP2 keep them)")


def memory_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The memory settings given on the command line, as keywords for ``Plan.with_memory``
    (empty when none was given)."""
    return {k: getattr(args, k) for k in ("zero", "recompute", "precision")
            if getattr(args, k, None) is not None}
