"""What several benchmarks share. Imported by the scripts beside it (``python benchmarks/X.py``
puts this folder on the import path)."""

from __future__ import annotations

from typing import Any

import explorer as ex


def builtin_plans(name: str, size: str, cluster: ex.Cluster,
                  plans: list[tuple[str, str, dict[str, Any]]]
                  ) -> tuple[ex.OpGraph, list[tuple[str, ex.Plan]]]:
    """Built-in model ``name`` captured, and one plan per ``(label, algorithm, options)`` of
    ``plans`` on ``cluster``, labelled. The profile behind the plans comes from the cache
    where it can: it only makes the plans, the benchmark measures what it compares."""
    bm = ex.builtin_model(name, size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    costs = ex.profile(graph, cluster, progress=False)
    return graph, [(label, ex.partition(graph, cluster, costs, alg, **opts))
                   for label, alg, opts in plans]
