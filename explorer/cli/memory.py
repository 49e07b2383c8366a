"""The command line's memory settings: ``--zero``, ``--recompute``, ``--precision``, applied to a
plan with :meth:`explorer.core.plan.Plan.with_memory`."""

from __future__ import annotations

import argparse
from typing import Any

from explorer.core.plan import PRECISIONS, RECOMPUTE, ZERO_STAGES


def add_memory_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--zero``, ``--recompute`` and ``--precision`` to ``parser`` (left out: the plan's
    own settings, the defaults for a new plan)."""
    parser.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None,
                        help="ZeRO stage over each stage's replicas: 0 none, 1 optimizer state, "
                             "2 and gradients, 3 and weights (FSDP's full sharding)")
    parser.add_argument("--recompute", choices=RECOMPUTE, default=None,
                        help="activation recomputation in the backward: none, selective "
                             "(all but matmul-like ops) or full (per repeated block)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="compute precision: fp32, or bf16 / fp16 autocast with fp32 "
                             "master weights (fp16 with loss scaling)")


def memory_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The memory settings given on the command line, as keywords for ``plan.with_memory``."""
    return {k: getattr(args, k) for k in ("zero", "recompute", "precision")
            if getattr(args, k, None) is not None}
