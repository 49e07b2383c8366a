"""Pipeline stages by dynamic programming: contiguous layer stages with replicas (PipeDream, Alpa).

The layers of the graph (runs of ops of one module, in topological order) are cut into ``S``
contiguous stages; each stage runs on a group of consecutive devices that replicate it (data
parallelism inside the stage). The split minimises the slowest stage's time per step, subject
to every stage's memory, exactly for the cost model of :class:`StageCostTable`.

Sources: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP 2019 (dynamic programming over layers and replicated stages, slowest stage as the
objective); Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism", OSDI 2022
(stage construction as a DP over (stages, layers, devices) on a cost table, separate from
profiling). The solver :func:`solve_stages` is a pure function of a :class:`StageCostTable`,
so it can be tested against brute force on random tables with no graph and no hardware.

Modules: :mod:`.table` (the cost table), :mod:`.solver` (the DP), :mod:`.build` (from a graph
to a table), :mod:`.partitioner` (the registered ``pipeline-dp``).
"""

from __future__ import annotations

from explorer.partition.pipeline_dp.build import (
    allowed_replicas,
    choose_layers,
    linear_fit,
    stage_cost_table,
)
from explorer.partition.pipeline_dp.partitioner import pipeline_dp
from explorer.partition.pipeline_dp.solver import (
           StageTables,
           dp_cells,
           solve_stages,
           stage_matrices,
)
from explorer.partition.pipeline_dp.table import (
    Stage,
    StageCostTable,
    StageNet,
    StageSolution,
    replicated_bytes,
)

__all__ = ["Stage", "StageCostTable", "StageNet", "StageSolution", "StageTables",
           "allowed_replicas", "choose_layers", "dp_cells", "linear_fit", "pipeline_dp",
           "replicated_bytes", "solve_stages", "stage_cost_table", "stage_matrices"]
