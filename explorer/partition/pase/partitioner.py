"""The pase partitioner: PaSE's strategy laid out as a plan, checked by the simulator."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.options import Options
from explorer.partition.pase.layout import direct_layout, expressible_layout, layout_plan
from explorer.partition.pase.model import PaseModel, build_model, check_pins
from explorer.partition.pase.problem import DEFAULT_MAX_CONFIGS, DEFAULT_MAX_TABLE, TIE_S
from explorer.partition.pase.strategy import (
    PaseResult,
    model_and_solution,
    no_fit_error,
    pase_result,
)
from explorer.partition.pase.tensor import tensor_mapping, tensor_plan
from explorer.partition.registry import register
from explorer.partition.search.fallback import fit_headrooms, settle
from explorer.simulate.simulator import simulate


def _tolerance(model: PaseModel, cost_s: float) -> float:
    """Cost differences below this are tie-breaks (:data:`TIE_S`) or rounding."""
    return 2 * TIE_S * model.problem.n_layers * len(model.ids) + 1e-9 * abs(cost_s)


def _fmt(x: float) -> str:
    return f"{x:.4g} s" if math.isfinite(x) else "does not fit"


def _pase_plan(graph: OpGraph, costs: CostModel, ids: Sequence[str], pins: Mapping[str, str],
               depth: int | None, max_configs: int, max_table: float, optimizer: str,
               headroom: float) -> Plan:
    model, sol = model_and_solution(graph, costs, ids, depth, max_configs, max_table,
                                     optimizer, pins, headroom)
    if not sol.fits:
        raise no_fit_error(model, sol)
    res = pase_result(model, sol)
    notes = [f"PaSE over {model.problem.n_layers} layers (depth {model.depth}): dependent set "
             f"{res.dependent_set}, largest DP table {res.table_entries:,} entries; PaSE-model "
             f"cost {_fmt(res.cost_s)} per step (data-parallel {_fmt(res.data_parallel_s)}, one "
             f"weird trick {_fmt(res.one_weird_trick_s)})"]
    if not res.exact:
        notes.append("memory-bound: the cheapest strategy did not fit, so this is the "
                     "cheapest one a Lagrangian search found that fits (may not be optimal)")
    options: dict[str, Any] = {"k": len(ids), "depth": model.depth,
                               "layers": model.problem.n_layers, "max_configs": max_configs,
                               "dependent_set": res.dependent_set}
    lay = None if res.feature_split else direct_layout(model, res.configs, res.cost_s)
    if lay is None:
        batch_model = build_model(graph, costs, ids, model.depth, max_configs, optimizer, pins,
                             headroom, batch_only=True, like=model)
        lay, why = expressible_layout(batch_model, max_table)
        if lay is None:
            raise why or ExplorerError("pase: no batch-only strategy found")
        if res.feature_split:
            options["pase_strategy"] = res.to_dict()
            options["pase_cost_s"] = lay.cost_s if math.isfinite(lay.cost_s) else None
            batch_plan = layout_plan(graph, model, lay, optimizer, pins, options, notes)
            return _with_features(graph, costs, model, res, ids, optimizer, pins, batch_plan,
                                  lay.cost_s)
        else:
            same = lay.cost_s <= res.cost_s + _tolerance(model, res.cost_s)
            notes.append(
                f"PaSE's best strategy ({_fmt(res.cost_s)}) splits the batch only but cannot "
                "be laid out as stages (consecutive layers with one configuration form a "
                "stage; every device serves one stage"
                + (", pinned layers hold their devices" if pins else "")
                + "); searched again among the strategies a plan can express: "
                + ("an equally cheap one" if same else _fmt(lay.cost_s)) + lay.note)
    options["pase_cost_s"] = lay.cost_s if math.isfinite(lay.cost_s) else None
    return layout_plan(graph, model, lay, optimizer, pins, options, notes)


def _with_features(graph: OpGraph, costs: CostModel, model: PaseModel, res: PaseResult,
                   ids: Sequence[str], optimizer: str, pins: Mapping[str, str],
                   batch_plan: Plan, batch_cost_s: float) -> Plan:
    """PaSE's feature-splitting strategy as a tensor-parallel plan (:mod:`.tensor`), or
    ``batch_plan`` (its best batch-only strategy) when that cannot be expressed or the
    simulator finds it slower or over memory; notes say which and what was left out."""
    split = [name for name, c in zip(res.layer_names, res.configs, strict=True)
             if c.feature > 1]
    head = (f"PaSE's best strategy splits the features of {len(split)} layers ("
            f"{', '.join(split[:4])}{', ...' if len(split) > 4 else ''}) for "
            f"{_fmt(res.cost_s)} per step under its model (in options['pase_strategy'])")
    batch_note = (f"the best batch-only strategy, {_fmt(batch_cost_s)} under PaSE's model")
    mapping = tensor_mapping(graph, model, res, len(ids))
    why = "the Megatron layout splits none of the layers it splits"
    tplan = None
    if mapping is not None:
        why = "a pinned device lies outside its devices"
        tplan = tensor_plan(graph, mapping, ids, optimizer, pins, batch_plan.options, ())
    if mapping is None or tplan is None:
        return batch_plan.with_settings(notes=(*batch_plan.notes, (
            f"{head}; it cannot be run as a tensor-parallel stage ({why}), so this plan is "
            f"{batch_note}")))
    t_pred, b_pred = simulate(graph, tplan, costs), simulate(graph, batch_plan, costs)
    mesh = (f"one stage of {mapping.replicas} replicas x tensor {mapping.tensor} (Megatron "
            f"layout); not expressed: {mapping.note()}")
    if t_pred.fits and (not b_pred.fits or t_pred.step_s <= b_pred.step_s):
        exact = not (mapping.not_split or mapping.extra_split or mapping.other_batch)
        return tplan.with_settings(notes=(*batch_plan.notes[:1], (
            f"{head}; this plan runs it as {mesh}: simulated {t_pred.step_s:.4g} s per step "
            f"against {_fmt(b_pred.step_s) if b_pred.fits else 'over memory'} for "
            f"{batch_note}")), options={**tplan.options,  # (its PaSE cost: known when exact)
                                        "pase_cost_s": res.cost_s if exact else None})
    return batch_plan.with_settings(notes=(*batch_plan.notes, (
        f"{head}; as a plan, {mesh}, it simulates "
        f"{f'{t_pred.step_s:.4g} s per step' if t_pred.fits else 'over memory'}, so this "
        f"plan is {batch_note} ({b_pred.step_s:.4g} s simulated)")))


@register("pase", exact=True)
def pase(graph: OpGraph, cluster: Cluster, costs: CostModel,
         pins: Mapping[str, str] | None = None, k: int | None = None,
         depth: int | None = None, max_configs: int = DEFAULT_MAX_CONFIGS,
         max_table: float = DEFAULT_MAX_TABLE, optimizer: str = "adam",
         compare_baselines: bool = True) -> Plan:
    """Per-layer batch and feature splits by PaSE's dependent-set dynamic program.

    Every layer chooses a configuration ``(b, f)``: a batch split over ``b`` and an
    output-feature split over ``f`` of the ``p`` devices; the DP over an order that keeps the
    dependent sets small finds the strategy with the least summed layer and re-distribution
    cost (module docstring), exactly for that model. Data parallelism and "one weird trick"
    are points of its space, so under its model it never does worse than them. Source:
    Elango, "PaSE: Parallelization Strategies for Efficient DNN Training", IPDPS 2021;
    Krizhevsky, "One weird trick for parallelizing convolutional neural networks", 2014.

    When the best strategy splits the batch only, consecutive layers sharing a configuration
    become a stage with that many replicas on consecutive devices; when that needs more
    devices than there are (every device serves one stage) or cannot honour the pins, the DP
    runs again over the strategies a plan can express, and a note says so and what that
    costs. When feature splits win, the strategy becomes one stage of ``replicas x tensor``
    devices split by the Megatron tensor layout (:mod:`.tensor`: the feature degree and batch
    split most of its layers use), and a note lists what of the strategy that does not
    express; the simulator compares it with the best batch-only strategy laid out as above
    and the faster that fits is returned. The full strategy and its PaSE cost are in
    ``plan.options["pase_strategy"]``.

    Parameters
    ----------
    depth : int, optional
        Module depth of the layers (``None``: leaf modules, or the finest coarser depth whose
        DP table fits under ``max_table``).
    max_configs : int
        Configurations kept per layer, ``K`` (default 8). Always kept: the largest batch
        split, the largest feature split and no split.
    max_table : float
        Largest DP table, in entries (default 2,000,000).
    k, optimizer, compare_baselines
        As in :class:`explorer.partition.options.Options`.

    Returns
    -------
    Plan
        ``options["stage_layers"]`` and ``options["replicas"]`` describe the stages,
        ``options["pase_cost_s"]`` the plan's strategy under PaSE's model,
        ``options["dependent_set"]`` the DP's ``M``; ``notes`` the PaSE, data-parallel and
        one-weird-trick costs.

    Raises
    ------
    ExplorerError
        ``graph too dense for PaSE`` when the DP tables would exceed ``max_table``.
    MemoryExceededError
        When nothing fits, naming the device.

    Limits
    ------
    Work and memory grow as ``K^(M+1)`` per layer for ``K`` configurations and a largest
    dependent set of ``M`` layers. On the built-in models at leaf depth ``M`` is 1 (MLP,
    AlexNet, VGG), 2 (ResNet, GPT) or 3 (Inception), a few milliseconds of search; dense
    random DAGs reach ``M`` > 10 and need a coarser ``depth``. Memory is PaSE's estimate for
    the busiest device (every layer's parameters over ``f`` and activations over ``b``); when
    the cheapest strategy does not fit, the strategy comes from a Lagrangian search and is
    not guaranteed optimal. Pins restrict their layers to batch splits whose stage holds the
    pinned device. PaSE's model assumes the layers run one after another on identical
    devices (it takes the slowest device type and the slowest link) and does not overlap
    communication with compute; the simulator then scores the plan.
    """
    opts = Options(k=k, optimizer=optimizer, compare_baselines=compare_baselines)
    ids = opts.devices(cluster)
    pins = dict(pins or {})
    check_pins(pins, graph, ids)

    def make(headroom: float) -> Plan:
        return _pase_plan(graph, costs, ids, pins, depth, max_configs, max_table, optimizer,
                          headroom)

    plan, pred, failures = fit_headrooms(graph, costs, make, "pase: its plan",
                                         compare_baselines)
    return settle(graph, cluster, costs, "pase", plan, pred,
                  failures[-1] if failures else "", pins, opts)


__all__ = ["pase"]
