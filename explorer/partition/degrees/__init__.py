"""Degrees search: data x tensor x pipeline degrees, micro-batches and schedule (Alpa, Galvatron).

For ``N`` devices, every mesh of ``pp`` stages of ``dp x tp`` devices (``dp x tp x pp <= N``),
every micro-batch count and schedule, with the stage cuts an exact DP finds on the layer
graph under an estimate built on pipeline-dp's per-layer cost table and the Megatron tensor
layout; memory first (what does not fit is never simulated), then the simulator for the best
few, never slower than pipeline-dp's plan and the baselines. Sources: Zheng et al., "Alpa:
Automating Inter- and Intra-Operator Parallelism", OSDI 2022 (stage DP over meshes); Miao et
al., "Galvatron: Efficient Transformer Training over Multiple GPUs Using Automatic
Parallelism", VLDB 2023 (DP x TP x PP degrees by search); Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021 (tensor
within a node, pipeline across).

Modules: :mod:`.estimate` (per-layer costs of a mesh, the cut DP), :mod:`.search` (the space
and its enumeration), :mod:`.partitioner` (the registered ``degrees``).
"""

from __future__ import annotations

from explorer.partition.degrees.estimate import Cuts, LayerCosts, MeshCosts, best_cuts, layer_costs
from explorer.partition.degrees.partitioner import candidate_plan, degrees
from explorer.partition.degrees.search import (
    Candidate,
    Space,
    build_space,
    enumerate_candidates,
    mesh_costs,
)

__all__ = ["Candidate", "Cuts", "LayerCosts", "MeshCosts", "Space", "best_cuts", "build_space",
           "candidate_plan", "degrees", "enumerate_candidates", "layer_costs", "mesh_costs"]
