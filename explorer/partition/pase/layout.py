"""From a PaSE strategy to a Plan: batch splits only, stages on consecutive devices."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.partition.pase.model import PaseModel
from explorer.partition.pase.problem import TIE_S, Config, PaseProblem, PaseSolution, TooDenseError
from explorer.partition.pase.solver import solve
from explorer.partition.pase.strategy import no_fit_error


@dataclass(frozen=True, eq=False)
class Layout:
    """A batch-only strategy laid out as stages: per layer ``(replicas, first position)``."""

    place: tuple[tuple[int, int], ...]
    device_order: tuple[str, ...]
    cost_s: float
    note: str = ""


def _device_orders(model: PaseModel) -> list[tuple[str, ...]]:
    """Device orders to lay stages out in. PaSE's model costs a configuration the same on any
    devices (slowest type, slowest link), so with pins the pinned devices may go first (in
    the order of their first pinned layer) or last."""
    ids = model.ids
    first_pin: dict[str, int] = {}
    for j, devs in enumerate(model.layer_pins):
        for d in sorted(devs, key=ids.index):
            first_pin.setdefault(d, j)
    if not first_pin:
        return [ids]
    pinned = sorted(first_pin, key=lambda d: (first_pin[d], ids.index(d)))
    rest = [d for d in ids if d not in first_pin]
    orders = [ids, (*pinned, *rest), (*rest, *pinned)]
    return list(dict.fromkeys(orders))


def direct_layout(model: PaseModel, configs: Sequence[Config], cost_s: float
                   ) -> Layout | None:
    """Consecutive layers sharing a configuration become a stage on the next devices."""
    p = len(model.ids)
    place: list[tuple[int, int]] = []
    nxt = 0
    for j, c in enumerate(configs):
        if j and c == configs[j - 1]:
            place.append(place[-1])
        else:
            place.append((c.batch, nxt))
            nxt += c.batch
    if nxt > p:
        return None
    for order in _device_orders(model):
        pos = {d: x for x, d in enumerate(order)}
        if all(o <= pos[d] < o + b for (b, o), devs in zip(place, model.layer_pins, strict=True)
               for d in devs):
            return Layout(tuple(place), order, cost_s)
    return None


def _expressible_problem(model: PaseModel, order: Sequence[str]
                         ) -> tuple[PaseProblem, list[list[tuple[int, int]]]]:
    """The batch-only space a Plan can express, as a PaseProblem over ``(b, offset)`` pairs.

    ``model`` offers batch splits only. Layer ``j`` at ``(b, o)`` runs on positions
    ``o..o+b-1`` of ``order``. Consecutive layers are in one stage (same ``b`` and ``o``) or
    the later one starts a new stage past the earlier one's devices (``o2 >= o1 + b1``, at
    :data:`TIE_S`): a chain of edges between consecutive layers, ``inf`` where neither holds,
    enforces that, so stages never share a device. Pinned layers' ranges must hold
    their pinned devices. Costs and memory are PaSE's for ``(b, 1)``.
    """
    pr = model.problem
    p = len(order)
    pos = {d: x for x, d in enumerate(order)}
    idx: list[list[int]] = []
    place: list[list[tuple[int, int]]] = []
    for v, cs in enumerate(pr.configs):
        want = [pos[d] for d in model.layer_pins[v]]
        ii, pl = [], []
        for i, c in enumerate(cs):
            if c.feature != 1:
                continue
            for o in range(p - c.batch + 1):
                if all(o <= x < o + c.batch for x in want):
                    ii.append(i)
                    pl.append((c.batch, o))
        if not ii:
            raise ExplorerError(
                f"pase: layer {model.infos[v].name} is pinned to "
                f"{', '.join(sorted(model.layer_pins[v]))}, which no batch split of it can "
                "hold; pin its nodes to fewer devices")
        idx.append(ii)
        place.append(pl)
    configs = tuple(tuple(pr.configs[v][i] for i in ii) for v, ii in enumerate(idx))
    unary = tuple(pr.unary_s[v][ii] for v, ii in enumerate(idx))
    memory = tuple(pr.memory_bytes[v][ii] for v, ii in enumerate(idx))
    edges = [(a, b, c[np.ix_(idx[a], idx[b])]) for a, b, c in pr.edges]
    for v in range(1, pr.n_layers):
        wall = np.array([[0.0 if x == y else TIE_S if y[1] >= x[1] + x[0] else np.inf
                          for y in place[v]] for x in place[v - 1]])
        edges.append((v - 1, v, wall))
    return PaseProblem(configs, unary, memory, tuple(edges), pr.capacity_bytes), place


def expressible_layout(model: PaseModel, max_table: float
                        ) -> tuple[Layout | None, ExplorerError | None]:
    """The cheapest strategy a Plan can express, over the device orders; (None, why) if none."""
    best: Layout | None = None
    why: ExplorerError | None = None
    for order in _device_orders(model):
        try:
            prob, place = _expressible_problem(model, order)
        except ExplorerError as exc:
            why = exc
            continue
        try:
            sol = solve(prob, max_table)
            note = "" if sol.exact else " (memory-bound: Lagrangian search, may not be optimal)"
        except TooDenseError:
            sol, note = _uniform(prob, place), (
                " (the plan-expressible search was too dense for max_table, so this is the "
                "best uniform batch split)")
        except ExplorerError:
            why = ExplorerError(
                f"pase: no batch-only layout on {len(order)} devices honours the pins "
                f"({', '.join(sorted({d for s in model.layer_pins for d in s}))}); pin to "
                "fewer devices, or pin later layers to devices after earlier layers' devices")
            continue
        if sol is None or not sol.fits:
            if sol is not None:
                why = no_fit_error(model, sol, f"the {model.problem.n_layers} layers of the "
                                    "batch-only strategy that needs least memory")
            continue
        lay = Layout(tuple(place[v][i] for v, i in enumerate(sol.choice)), tuple(order),
                      sol.cost_s, note)
        if best is None or lay.cost_s < best.cost_s - 1e-15:
            best = lay
    return best, why


def _uniform(prob: PaseProblem, place: Sequence[Sequence[tuple[int, int]]]
             ) -> PaseSolution | None:
    """The best strategy with one batch split for every layer, all in one stage."""
    found = None
    for b, o in place[0]:
        try:
            ch = tuple(pl.index((b, o)) for pl in place)
        except ValueError:
            continue
        cand = PaseSolution(ch, prob.cost_s(ch), prob.memory(ch),
                            prob.memory(ch) <= prob.capacity_bytes, False, 0, 0, ())
        if math.isfinite(cand.cost_s) and (found is None or (cand.fits, -cand.cost_s) > (
                found.fits, -found.cost_s)):
            found = cand
    return found


def layout_plan(graph: OpGraph, model: PaseModel, lay: Layout, optimizer: str,
          pins: Mapping[str, str], options: dict[str, Any], notes: Sequence[str]) -> Plan:
    stages: list[tuple[str, ...]] = []
    assign: dict[int, int] = {}
    stage_layers: list[list[int]] = []
    for j, (b, o) in enumerate(lay.place):
        if not j or (b, o) != lay.place[j - 1]:
            stages.append(tuple(lay.device_order[o:o + b]))
            stage_layers.append([j, j + 1])
        stage_layers[-1][1] = j + 1
        for i in model.layers[j]:
            assign[i] = len(stages) - 1
    opts = {**options, "stage_layers": stage_layers, "replicas": [len(s) for s in stages]}
    return Plan.from_assignment(graph, stages, assign, algorithm="pase", optimizer=optimizer,
                                options=opts, pinned=frozenset(pins), notes=tuple(notes))


__all__ = ["Layout", "direct_layout", "expressible_layout", "layout_plan"]
