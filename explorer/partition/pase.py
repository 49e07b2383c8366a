"""PaSE: per-layer parallelization strategies (batch and feature splits) by dynamic programming.

Seed: Elango, "PaSE: Parallelization Strategies for Efficient DNN Training", IPDPS 2021. Each
layer (a vertex of the layer graph built from ``graph.layers(depth)``) picks a *configuration*
``(b, f)``: its batch split over ``b`` devices and its output-feature (output-channel) split
over ``f`` devices, ``b x f <= p``. The cost of a strategy is the sum over layers of the
layer's cost under its configuration plus, for every edge between layers, the cost of moving
the bytes that are not already where the consumer needs them. Vertices are visited in an
order that keeps each step's *dependent set* (visited vertices with edges to unvisited ones)
small, and a dynamic program over that order keeps one table entry per configuration
assignment of the dependent set; it is exact for the cost model and costs about
``K^(M+1)`` for ``K`` configurations per layer and a largest dependent set of ``M`` layers.

The cost model (all seconds, from the :class:`~explorer.costs.model.CostModel`; ``p`` devices at
positions ``0..p-1``; a configuration ``(b, f)`` uses positions ``0..b*f-1``, position
``d`` holding batch slice ``d // f`` of ``b`` and feature shard ``d % f`` of ``f``):

* compute: the layer's forward and backward at batch fraction ``1 / (b*f)`` (the per-op
  overhead does not shrink, as everywhere in the cost model: a feature split shrinks the work
  of an op like a batch split does) plus the optimizer step of ``1/f`` of its parameters, on
  the slowest device type;
* the ring all-reduce of the weight gradients (``grad_bytes / f`` per shard) across the ``b``
  replicas of each weight shard. Gradients are all-reduced in 25 MB buckets, as PyTorch DDP
  and the simulator do (:data:`explorer.simulate.simulator.BUCKET_BYTES`), so a layer pays the
  bandwidth term of its bytes and its bytes' share of a bucket's latency;
* for ``f > 1``, the all-gather of the outputs across the ``f`` shards of each batch slice
  (``out_bytes / b``: half of a ring all-reduce) and, in the backward, the all-reduce of the
  input gradient, which every feature shard holds as a partial sum (``in_bytes / b``);
* for every tensor between two layers, a *re-distribution* in each direction: a layer's
  output lies on positions ``0..b*f-1``, batch slice ``d // f`` at full features on position
  ``d`` (after the all-gather), and a consumer ``(b2, f2)`` needs on each of its positions its
  batch slice at full features (linear and convolution layers split output channels, so each
  shard reads every input feature). The forward moves, to each position ``d``, the part of
  its needed slice it does not hold already; positions receive in parallel, so the time is
  ``latency + max_d missing_d x bytes / bandwidth`` over the slowest link, per tensor. The
  backward moves the gradient the other way with the same formula (consumer layout to
  producer need). See :func:`missing_fraction`.

Equally cheap strategies are told apart by :data:`TIE_S` (a nanosecond) per extra device a
configuration uses, so free layers (views, shape arithmetic) take no extra devices and splits
that save less than that are not made.

Memory per device: a device at position ``d`` holds, for every layer with ``d < b*f``,
``(params + grads + optimizer state) / f + saved activations / b``
(:func:`explorer.costs.memory.node_memory_bytes`). Position 0 takes part in every layer, so it holds
the most; that sum must fit the smallest device. When the cheapest strategy does not fit, a
Lagrangian search (cost + lambda x memory, lambda bisected) finds a strategy that fits; it is
then no longer guaranteed optimal (``PaseSolution.exact`` says so).

Only layers that own trainable weights are offered feature splits (the split divides the
weight; at most its first dimension, the output features or channels); the others split the
batch only. Batch splits divide the batch; split factors are the divisors of ``p`` and the
powers of two up to it. Weights shared between layers (tied embeddings) are not charged
across layers. Data parallelism (every layer at its largest batch split, ``(p, 1)`` when
``p`` divides the batch) and Krizhevsky's "one weird trick" (fully connected layers, those
with a ``Linear`` module or a linear/addmm/mm/matmul op and weights, at ``(1, p)``; every
other layer data parallel) are points in the space, always kept among a layer's candidates,
so the search is never worse than them under its own cost model.

Plans: a :class:`~explorer.core.plan.Plan` can express batch splits (a stage with several devices
holds replicas) but not feature splits, and the runtime cannot execute them. The registered
partitioner ``pase`` therefore returns the best strategy that a Plan can express (consecutive
layers sharing a configuration form a stage on consecutive devices, every device in at most
one stage); when feature splits win, the full strategy and its PaSE cost go to
``plan.options["pase_strategy"]`` with a note saying it is simulated by PaSE's own cost model
only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition import register
from explorer.partition.pipeline import (
    HEADROOMS,
    best_of_baselines,
    memory_error,
    simulate_if_small,
)
from explorer.simulate.simulator import BUCKET_BYTES

#: configurations kept per layer (the DP costs about max_configs^(M+1))
DEFAULT_MAX_CONFIGS = 8
#: the DP refuses steps whose table (dependent set plus the new layer) has more entries
DEFAULT_MAX_TABLE = 2_000_000
#: bisection steps of the Lagrangian memory search
_LAMBDA_STEPS = 24
#: seconds added per extra device a configuration uses (and per extra stage of a plan's
#: layout): breaks ties between equally cheap strategies towards fewer devices and stages
TIE_S = 1e-9
#: ops whose layer is "fully connected" for the one-weird-trick reference
_LINEAR_OPS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default",
               "aten.matmul.default")


class Config(NamedTuple):
    """How one layer is split: ``batch`` ways over the batch, ``feature`` ways over outputs."""

    batch: int
    feature: int

    @property
    def devices(self) -> int:
        return self.batch * self.feature


class TooDenseError(ExplorerError):
    """The layer graph's dependent sets make the DP table larger than ``max_table``."""

    def __init__(self, message: str, dependent_set: int, table_entries: int) -> None:
        super().__init__(message)
        self.dependent_set = dependent_set
        self.table_entries = table_entries


# ------------------------------------------------------------------------------------------
# the cost table: everything the solver needs, no graph, no cost model


@dataclass(frozen=True, eq=False)
class PaseProblem:
    """PaSE's cost table over ``n`` layers: unary costs per configuration, pairwise per edge.

    ``unary_s[v][i]`` is layer ``v``'s cost under ``configs[v][i]``; ``memory_bytes[v][i]``
    what it adds to the busiest device (position 0); ``edges`` are ``(a, b, cost_s)`` with
    ``cost_s[i, j]`` the cost of the edge when ``a`` takes its ``i``-th and ``b`` its ``j``-th
    configuration (``inf`` forbids the pair). A strategy's cost is the sum of its unary and
    edge costs (:meth:`cost_s`); it fits when its memory (:meth:`memory`) is at most
    ``capacity_bytes``.
    """

    configs: tuple[tuple[Config, ...], ...]
    unary_s: tuple[np.ndarray, ...]
    memory_bytes: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    capacity_bytes: float = math.inf

    def __post_init__(self) -> None:
        n = len(self.configs)
        if len(self.unary_s) != n or len(self.memory_bytes) != n:
            raise ExplorerError("PaseProblem: configs, unary_s and memory_bytes differ in length")
        for v in range(n):
            k = len(self.configs[v])
            if k == 0:
                raise ExplorerError(f"PaseProblem: layer {v} has no configuration")
            if np.shape(self.unary_s[v]) != (k,) or np.shape(self.memory_bytes[v]) != (k,):
                raise ExplorerError(f"PaseProblem: layer {v} needs {k} unary costs and sizes")
        for a, b, c in self.edges:
            if not (0 <= a < n and 0 <= b < n and a != b):
                raise ExplorerError(f"PaseProblem: edge ({a}, {b}) is not between two layers")
            if np.shape(c) != (len(self.configs[a]), len(self.configs[b])):
                raise ExplorerError(f"PaseProblem: edge ({a}, {b}) has the wrong shape")

    @property
    def n_layers(self) -> int:
        return len(self.configs)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Configurations per layer (``K_v``)."""
        return tuple(len(c) for c in self.configs)

    def cost_s(self, choice: Sequence[int]) -> float:
        """The cost of one strategy (a configuration index per layer)."""
        total = sum(float(self.unary_s[v][i]) for v, i in enumerate(choice))
        return total + sum(float(c[choice[a], choice[b]]) for a, b, c in self.edges)

    def memory(self, choice: Sequence[int]) -> float:
        """Bytes on the busiest device (position 0) under one strategy."""
        return sum(float(self.memory_bytes[v][i]) for v, i in enumerate(choice))

    def index(self, v: int, config: Config) -> int:
        """Position of ``config`` among layer ``v``'s configurations (ValueError if absent)."""
        return self.configs[v].index(config)

    def neighbours(self) -> list[set[int]]:
        out: list[set[int]] = [set() for _ in range(self.n_layers)]
        for a, b, _ in self.edges:
            out[a].add(b)
            out[b].add(a)
        return out


@dataclass(frozen=True)
class PaseSolution:
    """The DP's answer: a configuration index per layer, its cost, memory and the DP's size.

    ``exact`` is False when memory forced the Lagrangian search (the strategy fits but may not
    be the cheapest that fits). ``fits`` is False when even the strategy needing the least
    memory does not fit; ``choice`` is then that strategy. ``dependent_set`` is the largest
    dependent set ``M`` along ``order`` and ``table_entries`` the largest table the DP built.
    """

    choice: tuple[int, ...]
    cost_s: float
    memory_bytes: float
    fits: bool
    exact: bool
    dependent_set: int
    table_entries: int
    order: tuple[int, ...]


def dependent_order(problem: PaseProblem | _Shape, limit: float = math.inf
                    ) -> tuple[list[int], int, int]:
    """A visiting order with small dependent sets: ``(order, M, largest table entries)``.

    Greedy, as in PaSE: the next vertex is the one that leaves the smallest dependent set
    (visited vertices with edges to unvisited ones), ties broken by that set's table size,
    then by index (the layers' topological order). Only vertices adjacent to the dependent
    set and the first other unvisited vertex can be best, so each step looks at those.

    With ``limit``, stops as soon as a table would exceed ``limit`` entries: the order is then
    partial and ``M`` and the entries are those met so far (enough to refuse the graph).
    """
    n = problem.n_layers
    nbrs = problem.neighbours()
    sizes = problem.sizes
    logk = [math.log(k) for k in sizes]
    rem = [len(s) for s in nbrs]  # unvisited neighbours
    visited = [False] * n
    dep: set[int] = set()
    frontier: set[int] = set()
    order: list[int] = []
    worst_m, worst_entries = 0, 1
    dep_log, dep_entries = 0.0, 1
    first_free = 0
    for _ in range(n):
        cands = sorted(frontier)
        while first_free < n and visited[first_free]:
            first_free += 1
        other = next((v for v in range(first_free, n)
                      if not visited[v] and v not in frontier), None)
        if other is not None:
            cands.append(other)
        best = None
        for v in cands:
            leaving = [w for w in nbrs[v] if w in dep and rem[w] == 1]
            new = len(dep) - len(leaving) + (1 if rem[v] > 0 else 0)
            new_log = dep_log - sum(logk[w] for w in leaving) + (logk[v] if rem[v] > 0 else 0)
            key = (new, round(new_log, 9), v)
            if best is None or key < best[0]:
                best = (key, v)
        assert best is not None
        v = best[1]
        worst_entries = max(worst_entries, dep_entries * sizes[v])
        if worst_entries > limit:
            return [*order, v], max(worst_m, len(dep) + 1), worst_entries
        visited[v] = True
        order.append(v)
        frontier.discard(v)
        for w in nbrs[v]:
            rem[w] -= 1
            if not visited[w]:
                frontier.add(w)
        dep.add(v)
        dep -= {w for w in dep if rem[w] == 0}
        dep_log = sum(logk[w] for w in dep)
        dep_entries = math.prod(sizes[w] for w in dep)
        worst_m = max(worst_m, len(dep))
    return order, worst_m, worst_entries


def _table_plan(problem: PaseProblem, order: Sequence[int]) -> tuple[int, int]:
    """(M, largest table entries) of the DP along ``order``."""
    nbrs = problem.neighbours()
    sizes = problem.sizes
    rem = [len(s) for s in nbrs]
    dep: set[int] = set()
    worst_m, worst_entries = 0, 1
    for v in order:
        worst_entries = max(worst_entries, math.prod(sizes[w] for w in dep) * sizes[v])
        for w in nbrs[v]:
            rem[w] -= 1
        dep.add(v)
        dep = {w for w in dep if rem[w] > 0}
        worst_m = max(worst_m, len(dep))
    return worst_m, worst_entries


def _dp(problem: PaseProblem, order: Sequence[int], unary: Sequence[np.ndarray],
        pairwise: Sequence[tuple[int, int, np.ndarray]]) -> tuple[float, tuple[int, ...]]:
    """Minimise sum(unary) + sum(pairwise) by dynamic programming along ``order``.

    ``table`` has one axis per vertex of the dependent set ``dvars``: ``table[i1, .., im]``
    is the cheapest cost of the visited vertices given the dependent set's configurations
    ``i1..im``. Adding vertex ``v`` broadcasts a new axis for it, adds its unary cost and its
    edges to visited vertices (all in the dependent set), then minimises out the vertices
    that have no unvisited neighbour left, recording the argmin for the way back.
    """
    n = problem.n_layers
    adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]  # (other, cost[v, other])
    merged: dict[tuple[int, int], np.ndarray] = {}
    for a, b, c in pairwise:
        key, mat = ((a, b), c) if a < b else ((b, a), c.T)
        merged[key] = merged[key] + mat if key in merged else np.asarray(mat, dtype=float)
    for (a, b), c in merged.items():
        adj[a].append((b, c))
        adj[b].append((a, c.T))
    rem = [len(x) for x in adj]
    visited = [False] * n
    table = np.zeros(())
    dvars: list[int] = []
    records: list[tuple[list[int], list[int], tuple[int, ...], np.ndarray]] = []
    for v in order:
        k_v = len(problem.configs[v])
        t = table[..., None] + np.asarray(unary[v], dtype=float).reshape(
            (1,) * len(dvars) + (k_v,))
        for w, c in adj[v]:
            if visited[w]:
                shape = [1] * (len(dvars) + 1)
                shape[dvars.index(w)] = c.shape[1]
                shape[-1] = k_v
                t = t + c.T.reshape(shape)
        visited[v] = True
        for w, _ in adj[v]:
            rem[w] -= 1
        vars_ = [*dvars, v]
        elim = [x for x in vars_ if rem[x] == 0]
        keep = [x for x in vars_ if rem[x] > 0]
        if elim:
            t = t.transpose([vars_.index(x) for x in keep + elim])
            keep_shape = t.shape[:len(keep)]
            elim_shape = t.shape[len(keep):]
            flat = t.reshape((*keep_shape, -1))
            arg = flat.argmin(axis=-1)
            table = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
            small = arg.astype(np.min_scalar_type(flat.shape[-1] - 1))  # back-pointers
            records.append((keep, elim, elim_shape, small))
        else:
            table = t
        dvars = keep
    value = float(table)
    choice = [0] * n
    for keep, elim, elim_shape, arg in reversed(records):
        flat_i = int(arg[tuple(choice[x] for x in keep)])
        for x, i in zip(elim, np.unravel_index(flat_i, elim_shape), strict=True):
            choice[x] = int(i)
    return value, tuple(choice)


def solve(problem: PaseProblem, max_table: float = DEFAULT_MAX_TABLE,
          order: Sequence[int] | None = None) -> PaseSolution:
    """The cheapest strategy of ``problem`` that fits its memory, by PaSE's DP.

    Exact (the minimum of :meth:`PaseProblem.cost_s` over all strategies) when that minimum
    fits ``capacity_bytes``. Otherwise a Lagrangian search minimises ``cost + lambda x
    memory``, bisecting ``lambda``, and returns the cheapest strategy that fits among those
    it met (``exact=False``); when even the least-memory strategy does not fit it is returned
    with ``fits=False``.

    Raises
    ------
    TooDenseError
        When a DP table along the order would exceed ``max_table`` entries.
    ExplorerError
        When every strategy has infinite cost (constraints no strategy meets).

    Examples
    --------
    Two layers with two configurations each; the edge costs 5 when they differ:

    >>> import numpy as np
    >>> p = PaseProblem(((Config(1, 1), Config(2, 1)),) * 2,
    ...                 (np.array([4.0, 1.0]), np.array([1.0, 3.0])), (np.zeros(2),) * 2,
    ...                 ((0, 1, np.array([[0.0, 5.0], [5.0, 0.0]])),))
    >>> s = solve(p)
    >>> s.choice, s.cost_s
    ((1, 1), 4.0)
    """
    if order is None:
        order, m, entries = dependent_order(problem)
    else:
        order = list(order)
        if sorted(order) != list(range(problem.n_layers)):
            raise ExplorerError("the order must visit every layer exactly once")
        m, entries = _table_plan(problem, order)
    if entries > max_table:
        k = max(problem.sizes, default=1)
        raise TooDenseError(
            f"graph too dense for PaSE: dependent set of {m} layers needs {entries:,} table "
            f"entries (about K^(M+1) = {k}^{m + 1}), over max_table={max_table:,.0f}; use "
            "depth=... (coarser layers) or max_configs=... (fewer configurations per layer)",
            m, entries)
    pairwise = problem.edges
    value, choice = _dp(problem, order, problem.unary_s, pairwise)
    if not math.isfinite(value):
        raise ExplorerError("no strategy meets the constraints (every one has infinite cost)")

    def solution(ch: tuple[int, ...], fits: bool, exact: bool) -> PaseSolution:
        return PaseSolution(ch, problem.cost_s(ch), problem.memory(ch), fits, exact, m,
                            entries, tuple(order))

    cap = problem.capacity_bytes
    if problem.memory(choice) <= cap:
        return solution(choice, True, True)
    # least memory first: does anything fit at all? (constraints kept, costs dropped)
    walls = tuple((a, b, np.where(np.isinf(c), np.inf, 0.0)) for a, b, c in pairwise)
    mem = [np.where(np.isinf(u), np.inf, mb) for u, mb in zip(problem.unary_s,
                                                             problem.memory_bytes, strict=True)]
    _, least = _dp(problem, order, mem, walls)
    if problem.memory(least) > cap:
        return solution(least, False, False)
    best = least
    scale = max(abs(value), 1e-12) / max(cap, 1.0)

    def lagrange(lam: float) -> tuple[int, ...]:
        unary = [u + lam * scale * mb for u, mb in zip(problem.unary_s, problem.memory_bytes,
                                                         strict=True)]
        return _dp(problem, order, unary, pairwise)[1]

    def consider(ch: tuple[int, ...]) -> None:
        nonlocal best
        if problem.memory(ch) <= cap and problem.cost_s(ch) < problem.cost_s(best):
            best = ch

    lo, hi = 0.0, 1.0
    for _ in range(60):  # find a lambda whose strategy fits
        ch = lagrange(hi)
        if problem.memory(ch) <= cap:
            consider(ch)
            break
        lo, hi = hi, hi * 4
    else:
        return solution(best, True, False)
    for _ in range(_LAMBDA_STEPS):
        mid = (lo + hi) / 2
        ch = lagrange(mid)
        if problem.memory(ch) <= cap:
            consider(ch)
            hi = mid
        else:
            lo = mid
    return solution(best, True, False)


# ------------------------------------------------------------------------------------------
# the cost model: from a graph and a cost model to a PaseProblem


def split_factors(p: int) -> tuple[int, ...]:
    """Split factors offered on ``p`` devices: the divisors of ``p`` and the powers of two.

    >>> split_factors(6)
    (1, 2, 3, 4, 6)
    """
    out = {d for d in range(1, p + 1) if p % d == 0}
    out |= {2**i for i in range(p.bit_length()) if 2**i <= p}
    return tuple(sorted(out))


def missing_fraction(src: Config, dst: Config) -> float:
    """The largest fraction of a tensor any device must receive to go from ``src`` to ``dst``.

    Under ``src`` position ``d < b*f`` holds batch slice ``d // f`` of ``b`` (full features);
    under ``dst`` it needs batch slice ``d // f2`` of ``b2``. The fraction for ``d`` is the
    part of its needed slice it does not hold; positions receive in parallel, so the result
    is the largest over positions.

    >>> missing_fraction(Config(4, 1), Config(4, 1))
    0.0
    >>> missing_fraction(Config(1, 1), Config(4, 1))  # scatter: each receives a quarter
    0.25
    >>> missing_fraction(Config(4, 1), Config(1, 1))  # gather: position 0 receives 3/4
    0.75
    >>> missing_fraction(Config(1, 4), Config(4, 1))  # outputs already gathered everywhere
    0.0
    """
    worst = 0.0
    for d in range(dst.devices):
        k2 = d // dst.feature
        lo2, hi2 = k2 / dst.batch, (k2 + 1) / dst.batch
        overlap = 0.0
        if d < src.devices:
            k1 = d // src.feature
            lo1, hi1 = k1 / src.batch, (k1 + 1) / src.batch
            overlap = max(0.0, min(hi1, hi2) - max(lo1, lo2))
        worst = max(worst, (hi2 - lo2) - overlap)
    return worst if worst > 1e-12 else 0.0


@dataclass(frozen=True)
class LayerInfo:
    """One vertex of the layer graph: its nodes and what the cost model needs of it."""

    nodes: tuple[int, ...]
    name: str
    fixed_s: tuple[float, ...]  # per device type: per-op costs that do not shrink
    var_s: tuple[float, ...]  # per device type: the part that shrinks with the split
    opt_fixed_s: tuple[float, ...]  # per device type: optimizer cost per tensor (all tensors)
    opt_per_byte_s: tuple[float, ...]  # per device type
    param_bytes: int  # what the optimizer steps
    grad_bytes: int  # what is all-reduced across batch replicas
    out_bytes: int  # outputs other layers read (all-gathered under a feature split)
    grad_in_bytes: int  # inputs from other layers that receive a gradient
    fixed_mem_bytes: int  # params, grads, optimizer state, buffers
    act_mem_bytes: int  # saved activations at the whole batch
    max_feature: int  # largest feature split (output channels); 1: batch splits only
    fully_connected: bool


@dataclass(frozen=True)
class _Edge:
    a: int
    b: int
    nbytes: int
    tensors: int
    grad: bool


def _layer_of(graph: OpGraph, layers: Sequence[Sequence[int]]) -> list[int]:
    """The layer of every node (nodes outside every layer: their owner's, else layer 0)."""
    nodes = graph.nodes
    layer_of = [-1] * len(nodes)
    for j, layer in enumerate(layers):
        for i in layer:
            layer_of[i] = j
    for i in range(len(nodes)):
        if layer_of[i] < 0:
            layer_of[i] = layer_of[graph.owner(i)] if layer_of[graph.owner(i)] >= 0 else 0
    return layer_of


def _layer_edges(graph: OpGraph, layer_of: Sequence[int], n_layers: int
                 ) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], bool],
                            list[int], list[int]]:
    """Tensors between layers: ``(bytes and tensors per edge, whether a gradient flows back,
    output bytes per layer, gradient input bytes per layer)``."""
    nodes = graph.nodes
    edges: dict[tuple[int, int], list[int]] = {}
    edge_grad: dict[tuple[int, int], bool] = {}
    out_bytes = [0] * n_layers
    grad_in = [0] * n_layers
    for p, nd in enumerate(nodes):
        if nd.kind != "op" or nd.out_bytes <= 0:
            continue  # graph inputs: every device loads its own slice; weights: see Limits
        a = layer_of[p]
        cons = sorted({layer_of[c] for c in graph.succs[p]} - {a})
        if cons:
            out_bytes[a] += nd.out_bytes
        for b in cons:
            key = (a, b)
            grad = nd.requires_grad and any(nodes[c].requires_grad for c in graph.succs[p]
                                            if layer_of[c] == b)
            e = edges.setdefault(key, [0, 0])
            e[0] += nd.out_bytes
            e[1] += 1
            edge_grad[key] = edge_grad.get(key, False) or grad
            if grad:
                grad_in[b] += nd.out_bytes
    return edges, edge_grad, out_bytes, grad_in


def _feature_limit(graph: OpGraph, layer: Sequence[int]) -> int:
    """The largest feature split a layer is offered: the first dimension of its trainable
    weights (1 for a layer without any)."""
    gbytes = max_feature = 0
    for i in layer:
        nd = graph.nodes[i]
        if nd.kind == "param" and nd.requires_grad:
            gbytes += nd.out_bytes
            shape = nd.shapes[0] if nd.shapes and nd.shapes[0] else (1,)
            max_feature = max(max_feature, int(shape[0]))
    return max(max_feature, 1) if gbytes else 1


def _layer_infos(graph: OpGraph, costs: CostModel, ids: Sequence[str],
                 layers: Sequence[Sequence[int]], optimizer: str
                 ) -> tuple[list[LayerInfo], list[_Edge]]:
    nodes = graph.nodes
    layer_of = _layer_of(graph, layers)
    reps: dict[str, str] = {}
    for dev in ids:
        reps.setdefault(costs.cluster.device(dev).type_key, dev)
    fixed_mem = node_memory_bytes(graph, optimizer, 1, 0.0)
    full_mem = node_memory_bytes(graph, optimizer, 1, 1.0)
    edges, edge_grad, out_bytes, grad_in = _layer_edges(graph, layer_of, len(layers))
    infos = []
    for j, layer in enumerate(layers):
        fixed, var, opt_fixed, opt_byte = [], [], [], []
        pbytes = gbytes = ntensors = 0
        fc = False
        for i in layer:
            nd = nodes[i]
            if nd.param_bytes and nd.kind != "buffer":
                pbytes += nd.param_bytes
                ntensors += 1
            if nd.kind == "param" and nd.requires_grad:
                gbytes += nd.out_bytes
            if nd.kind == "op" and (nd.module_type == "Linear" or nd.op in _LINEAR_OPS):
                fc = True
        for dev in reps.values():
            f0 = f1 = 0.0
            for i in layer:
                nd = nodes[i]
                if nd.kind != "op":
                    continue
                f0 += costs.fwd_s(i, dev, 0.0)
                f1 += costs.fwd_s(i, dev, 1.0)
                if nd.requires_grad:
                    f0 += costs.bwd_s(i, dev, 0.0)
                    f1 += costs.bwd_s(i, dev, 1.0)
            fixed.append(f0)
            var.append(f1 - f0)
            opt_fixed.append(costs.optimizer_s(dev, optimizer, 0, ntensors))
            opt_byte.append(costs.optimizer_s(dev, optimizer, 1, 0))
        ops = [i for i in layer if nodes[i].kind == "op"]
        name = (nodes[ops[-1]].module_path or nodes[ops[-1]].name) if ops else f"layer {j}"
        infos.append(LayerInfo(
            tuple(layer), name, tuple(fixed), tuple(var), tuple(opt_fixed), tuple(opt_byte),
            pbytes, gbytes, out_bytes[j], grad_in[j],
            int(sum(fixed_mem[i] for i in layer)),
            int(sum(full_mem[i] - fixed_mem[i] for i in layer)),
            _feature_limit(graph, layer), fc and gbytes > 0))
    return infos, [_Edge(a, b, nb, cnt, edge_grad[(a, b)])
                   for (a, b), (nb, cnt) in sorted(edges.items())]


def layer_configs(p: int, batch_size: int, max_feature: int, max_configs: int,
                  batch_only: bool = False) -> tuple[Config, ...]:
    """The configurations offered to a layer, most important first, at most ``max_configs``.

    Batch splits divide the batch; feature splits are at most ``max_feature``. Always first:
    the largest batch split (data parallelism), the largest feature split (one weird trick's
    fully connected layers), no split; then the splits that use every device (more batch
    first), then the rest (more devices, then more batch first).

    >>> layer_configs(4, 8, 64, 8)
    (Config(batch=4, feature=1), Config(batch=1, feature=4), Config(batch=1, feature=1), \
Config(batch=2, feature=2), Config(batch=2, feature=1), Config(batch=1, feature=2))
    """
    factors = split_factors(p)
    bs = [b for b in factors if batch_size <= 0 or batch_size % b == 0]
    fs = [1] if batch_only else [f for f in factors if f <= max_feature]
    every = [Config(b, f) for b in bs for f in fs if b * f <= p]
    first = [Config(max(bs), 1), Config(1, max(fs)), Config(1, 1)]
    rest = sorted(every, key=lambda c: (c.devices != p, -c.devices, -c.batch))
    out = list(dict.fromkeys([*first, *rest]))
    return tuple(out[:max(1, max_configs)])


@functools.lru_cache(maxsize=1024)
def _configs(p: int, batch_size: int, max_feature: int, max_configs: int,
             batch_only: bool) -> tuple[Config, ...]:
    """:func:`layer_configs`, remembered: many layers ask for the same few."""
    return layer_configs(p, batch_size, max_feature, max_configs, batch_only)


def _links(costs: CostModel, ids: Sequence[str]) -> tuple[float, float]:
    """(latency, seconds per byte) of the slowest link among ``ids`` (0, 0 for one device)."""
    lat = spb = 0.0
    for x, a in enumerate(ids):
        for b in ids[x + 1:]:
            link = costs.cluster.link(a, b)
            lat = max(lat, link.latency_s)
            spb = max(spb, costs.link_scale / link.bandwidth_bytes_per_s)
    return lat, spb


def ring_allreduce_s(k: int, nbytes: float, latency_s: float, s_per_byte: float) -> float:
    """Ring all-reduce over ``k`` devices, as :meth:`CostModel.allreduce_s`: ``2(k-1)``
    latencies and ``2(k-1)/k`` of the bytes over the link (here: the slowest)."""
    if k <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (k - 1) * latency_s + 2 * (k - 1) / k * nbytes * s_per_byte


def unary_cost_s(info: LayerInfo, c: Config, latency_s: float, s_per_byte: float) -> float:
    """A layer's own cost under configuration ``c`` (see the module docstring).

    ``latency_s`` and ``s_per_byte`` describe the slowest link among the devices, so the cost
    does not depend on which devices a configuration uses.
    """
    frac = 1.0 / c.devices
    compute = max(fx + vr * frac + of + ob * info.param_bytes / c.feature
                  for fx, vr, of, ob in zip(info.fixed_s, info.var_s, info.opt_fixed_s,
                                            info.opt_per_byte_s, strict=True))
    link = (latency_s, s_per_byte)
    grads = info.grad_bytes / c.feature  # bucketed like DDP: a share of a bucket's latency
    comm = ring_allreduce_s(c.batch, grads, latency_s * grads / BUCKET_BYTES, s_per_byte)
    if c.feature > 1:  # all-gather = half a ring all-reduce
        comm += 0.5 * ring_allreduce_s(c.feature, info.out_bytes / c.batch, *link)
        comm += ring_allreduce_s(c.feature, info.grad_in_bytes / c.batch, *link)
    return compute + comm


def _edge_matrix(e: _Edge, fwd: np.ndarray, bwd: np.ndarray, lat: float,
                 spb: float) -> np.ndarray:
    """An edge's cost per configuration pair from the missing fractions each way."""
    def move(frac: np.ndarray) -> np.ndarray:
        return np.where(frac > 0, e.tensors * lat + frac * (e.nbytes * spb), 0.0)

    return move(fwd) + move(bwd) if e.grad else move(fwd)


@dataclass(frozen=True, eq=False)
class _Model:
    """A graph's PaSE problem with the layer facts behind it."""

    problem: PaseProblem
    layers: tuple[tuple[int, ...], ...]
    infos: tuple[LayerInfo, ...]
    ids: tuple[str, ...]
    depth: int | None
    layer_pins: tuple[frozenset[str], ...]  # device ids pinned per layer
    memory_by_device: tuple[int, ...]  # each device's memory, in the order of ids
    edge_list: tuple[_Edge, ...] = ()  # the tensors between layers behind problem.edges


class _Shape(NamedTuple):
    """What :func:`dependent_order` needs of a problem (no costs): configurations per layer
    and the layers each layer shares tensors with."""

    n_layers: int
    sizes: tuple[int, ...]
    nbrs: tuple[frozenset[int], ...]

    def neighbours(self) -> list[set[int]]:
        return [set(x) for x in self.nbrs]


def _pinned_layers(graph: OpGraph, layers: Sequence[Sequence[int]],
                   pins: Mapping[str, str]) -> list[set[str]]:
    """The devices pinned in each layer."""
    layer_of = {i: j for j, layer in enumerate(layers) for i in layer}
    pinned: list[set[str]] = [set() for _ in layers]
    for nm, dev in pins.items():
        i = graph.index[nm]
        j = layer_of.get(i, layer_of.get(graph.owner(i), 0))
        pinned[j].add(dev)
    return pinned


def _shape(graph: OpGraph, p: int, layers: Sequence[Sequence[int]], max_configs: int,
           pins: Mapping[str, str]) -> _Shape:
    """The layer graph's shape as :func:`_build` would make it, without costing anything:
    enough to tell whether the DP tables fit before paying for the cost table."""
    pinned = _pinned_layers(graph, layers, pins)
    sizes = tuple(len(_configs(p, graph.batch_size, _feature_limit(graph, layer), max_configs,
                               bool(pinned[j])))
                  for j, layer in enumerate(layers))
    edges = _layer_edges(graph, _layer_of(graph, layers), len(layers))[0]
    nbrs: list[set[int]] = [set() for _ in layers]
    for a, b in edges:
        nbrs[a].add(b)
        nbrs[b].add(a)
    return _Shape(len(layers), sizes, tuple(frozenset(x) for x in nbrs))


def _build(graph: OpGraph, costs: CostModel, ids: Sequence[str], depth: int | None,
           max_configs: int, optimizer: str, pins: Mapping[str, str],
           headroom: float, batch_only: bool = False,
           layers: Sequence[tuple[int, ...]] | None = None, like: _Model | None = None
           ) -> _Model:
    """PaSE's problem over ``graph.layers(depth)`` (or ``layers``, when already made).

    ``like``: a model built from the same graph, costs, devices, depth and optimizer, whose
    layer facts are reused (only the configurations offered differ).
    """
    if like is not None:
        layers, infos, edges = like.layers, list(like.infos), list(like.edge_list)
    else:
        if layers is None:
            layers = [tuple(x) for x in graph.layers(depth)]
        infos, edges = _layer_infos(graph, costs, ids, layers, optimizer)
    p = len(ids)
    pinned = _pinned_layers(graph, layers, pins)
    configs = tuple(_configs(p, graph.batch_size, info.max_feature, max_configs,
                             batch_only or bool(pinned[j]))
                    for j, info in enumerate(infos))
    lat, spb = _links(costs, ids)
    unary = tuple(np.array([unary_cost_s(info, c, lat, spb) + TIE_S * (c.devices - 1)
                            for c in cs])
                  for info, cs in zip(infos, configs, strict=True))
    memory = tuple(np.array([info.fixed_mem_bytes / c.feature + info.act_mem_bytes / c.batch
                             for c in cs]) for info, cs in zip(infos, configs, strict=True))
    fractions: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # by (configs a, configs b)
    mats = []
    for e in edges:
        ca, cb = configs[e.a], configs[e.b]
        if (ca, cb) not in fractions:
            fractions[ca, cb] = (
                np.array([[missing_fraction(x, y) for y in cb] for x in ca]),
                np.array([[missing_fraction(y, x) for y in cb] for x in ca]))
        mats.append((e.a, e.b, _edge_matrix(e, *fractions[ca, cb], lat, spb)))
    mem_dev = tuple(costs.cluster.device(d).memory_bytes for d in ids)
    problem = PaseProblem(configs, unary, memory, tuple(mats), min(mem_dev) * headroom)
    return _Model(problem, tuple(layers), tuple(infos), tuple(ids), depth,
                  tuple(frozenset(s) for s in pinned), mem_dev, tuple(edges))


def pase_problem(graph: OpGraph, costs: CostModel, *, k: int | None = None,
                 depth: int | None = None, max_configs: int = DEFAULT_MAX_CONFIGS,
                 optimizer: str = "adam", pins: Mapping[str, str] | None = None
                 ) -> PaseProblem:
    """PaSE's cost table for ``graph.layers(depth)`` on the cluster's first ``k`` devices.

    Layer ``j`` of the problem is ``graph.layers(depth)[j]``; its configurations come from
    :func:`layer_configs`, its unary costs from :func:`unary_cost_s`, its memory is what it
    adds to the busiest device, and every pair of layers joined by tensors has an edge whose
    cost is the re-distribution of :func:`missing_fraction` in both directions.
    """
    ids = _devices(costs.cluster, k)
    pins = dict(pins or {})
    _check_pins(pins, graph, ids)
    if max_configs < 1:
        raise ExplorerError(f"pase: max_configs must be >= 1, not {max_configs}")
    return _build(graph, costs, ids, depth, max_configs, optimizer, pins, 1.0).problem


def data_parallel_choice(problem: PaseProblem) -> tuple[int, ...]:
    """Every layer at its largest batch split (data parallelism as the space allows)."""
    return tuple(max(range(len(cs)), key=lambda i: (cs[i].feature == 1, cs[i].batch))
                 for cs in problem.configs)


def one_weird_trick_choice(problem: PaseProblem, fully_connected: Sequence[bool]
                           ) -> tuple[int, ...]:
    """Krizhevsky's "one weird trick": fully connected layers at their largest feature split
    (model parallelism), every other layer at its largest batch split (data parallelism).

    A fully connected layer offered no feature split (pinned, or ``max_configs`` too small)
    stays data parallel.
    """
    out = list(data_parallel_choice(problem))
    for v, cs in enumerate(problem.configs):
        model_parallel = [i for i, c in enumerate(cs) if c.batch == 1 and c.feature > 1]
        if fully_connected[v] and model_parallel:
            out[v] = max(model_parallel, key=lambda i: cs[i].feature)
    return tuple(out)


# ------------------------------------------------------------------------------------------
# the search on a graph


@dataclass(frozen=True)
class PaseResult:
    """PaSE's strategy for a graph: a configuration per layer, its cost and the references.

    ``configs[j]`` is layer ``j``'s ``(batch, feature)`` split (layers as in
    ``layer_names``, from ``graph.layers(depth)``); ``cost_s`` its cost under PaSE's model,
    ``data_parallel_s`` and ``one_weird_trick_s`` the cost of those two strategies under the
    same model (inf when they do not fit). ``dependent_set`` is the DP's largest dependent set
    ``M``, ``table_entries`` its largest table; ``memory_bytes`` what the busiest device holds
    (of ``capacity_bytes``). ``exact`` is False when memory forced the Lagrangian search.
    """

    configs: tuple[Config, ...]
    layer_names: tuple[str, ...]
    cost_s: float
    data_parallel_s: float
    one_weird_trick_s: float
    dependent_set: int
    table_entries: int
    memory_bytes: float
    capacity_bytes: float
    exact: bool
    depth: int | None
    devices: tuple[str, ...]
    order: tuple[int, ...] = field(repr=False, default=())

    @property
    def feature_split(self) -> bool:
        """Whether any layer splits its features (which a Plan cannot express)."""
        return any(c.feature > 1 for c in self.configs)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: what ``plan.options["pase_strategy"]`` holds."""
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {"configs": [[c.batch, c.feature] for c in self.configs],
                "layers": list(self.layer_names), "cost_s": num(self.cost_s),
                "data_parallel_s": num(self.data_parallel_s),
                "one_weird_trick_s": num(self.one_weird_trick_s),
                "dependent_set": self.dependent_set, "table_entries": self.table_entries,
                "exact": self.exact, "depth": self.depth, "devices": list(self.devices)}


def _devices(cluster: Cluster, k: int | None) -> tuple[str, ...]:
    n = len(cluster) if k is None else k
    if not 1 <= n <= len(cluster):
        raise ExplorerError(f"pase: k={k} devices asked for, but the cluster has "
                            f"{len(cluster)}")
    return cluster.ids[:n]


def _check_pins(pins: Mapping[str, str], graph: OpGraph, ids: Sequence[str]) -> None:
    for nm, dev in pins.items():
        if nm not in graph:
            raise ExplorerError(f"pase: pinned node {nm!r} is not in the graph")
        if dev not in ids:
            raise ExplorerError(f"pase: node {nm!r} is pinned to {dev}, which is not among the "
                                f"devices this plan may use ({', '.join(ids)})")


def _depths(graph: OpGraph, depth: int | None) -> list[int | None]:
    if depth is not None:
        return [depth]
    return [None, *range(graph.module_depth() - 1, 0, -1)]


def _model_and_solution(graph: OpGraph, costs: CostModel, ids: Sequence[str],
                        depth: int | None, max_configs: int, max_table: float,
                        optimizer: str, pins: Mapping[str, str], headroom: float
                        ) -> tuple[_Model, PaseSolution]:
    """Build and solve at ``depth``; with ``depth=None`` the finest depth whose table fits."""
    if max_configs < 1:
        raise ExplorerError(f"pase: max_configs must be >= 1, not {max_configs}")
    refused: list[tuple[int | None, _Shape | TooDenseError]] = []  # depths too dense
    seen: set[int] = set()
    for dp in _depths(graph, depth):
        layers = [tuple(x) for x in graph.layers(dp)]
        if len(layers) in seen:  # the same layers as a finer depth already tried
            continue
        seen.add(len(layers))
        # the order needs only the layer graph's shape: refuse a dense depth before costing it
        shape = _shape(graph, len(ids), layers, max_configs, pins)
        order, _, entries = dependent_order(shape, limit=max_table)
        if entries > max_table:
            refused.append((dp, shape))
            continue
        model = _build(graph, costs, ids, dp, max_configs, optimizer, pins, headroom,
                       layers=layers)
        try:
            return model, solve(model.problem, max_table, order=order)
        except TooDenseError as exc:
            refused.append((dp, exc))
    tried: list[str] = []
    first: TooDenseError | None = None
    for dp, what in refused:  # say how large each depth's tables are, finest first
        if isinstance(what, TooDenseError):
            m, entries = what.dependent_set, what.table_entries
        else:
            _, m, entries = dependent_order(what)  # the whole order, for the message
        first = first or TooDenseError("", m, entries)
        tried.append(f"depth={dp}: M={m}, {entries:,} entries")
    assert first is not None
    coarser = "..."
    if depth is not None:  # a coarser depth whose table fits, if any
        for dp in range(min(depth, graph.module_depth() + 1) - 1, 0, -1):
            layers = [tuple(x) for x in graph.layers(dp)]
            shape = _shape(graph, len(ids), layers, max_configs, pins)
            if dependent_order(shape, limit=max_table)[2] <= max_table:
                coarser = str(dp)
                break
    k = max(1, int(max_table ** (1 / (first.dependent_set + 1))))
    raise TooDenseError(
        f"graph too dense for PaSE: dependent set of {first.dependent_set} layers needs "
        f"{first.table_entries:,} table entries, over max_table={max_table:,.0f} "
        f"({'; '.join(tried)}); use depth={coarser} (coarser layers: fewer, bigger vertices) "
        f"or max_configs={min(k, max_configs - 1) if max_configs > 1 else 1} (fewer "
        "configurations per layer), or raise max_table", first.dependent_set,
        first.table_entries)


def _result(model: _Model, sol: PaseSolution) -> PaseResult:
    pr = model.problem
    fc = [info.fully_connected for info in model.infos]

    def ref(choice: tuple[int, ...]) -> float:
        return pr.cost_s(choice) if pr.memory(choice) <= pr.capacity_bytes else math.inf

    return PaseResult(
        tuple(pr.configs[v][i] for v, i in enumerate(sol.choice)),
        tuple(info.name for info in model.infos), sol.cost_s,
        ref(data_parallel_choice(pr)), ref(one_weird_trick_choice(pr, fc)), sol.dependent_set,
        sol.table_entries, sol.memory_bytes, pr.capacity_bytes, sol.exact, model.depth,
        model.ids, sol.order)


def pase_search(graph: OpGraph, costs: CostModel, *, k: int | None = None,
                depth: int | None = None, max_configs: int = DEFAULT_MAX_CONFIGS,
                max_table: float = DEFAULT_MAX_TABLE, optimizer: str = "adam",
                pins: Mapping[str, str] | None = None) -> PaseResult:
    """PaSE's best per-layer strategy for ``graph`` on the first ``k`` devices of the cluster.

    Builds the layer graph from ``graph.layers(depth)``, offers each layer up to
    ``max_configs`` configurations (:func:`layer_configs`), costs them as the module docstring
    says and runs the DP (:func:`solve`). Layers holding a pinned node split the batch only.

    Parameters
    ----------
    k : int, optional
        Devices ``p``: the cluster's first ``k`` (default: all).
    depth : int, optional
        Module depth of the layers; ``None``: the leaf modules, or the finest coarser depth
        whose DP table fits under ``max_table``.
    max_configs : int
        Configurations kept per layer (default 8).
    max_table : float
        Largest DP table allowed, in entries (default 2,000,000).
    optimizer : str
        Optimizer whose state counts towards memory and whose step counts towards time.
    pins : mapping, optional
        Node name -> device id; the pinned nodes' layers are restricted to batch splits.

    Returns
    -------
    PaseResult
        The strategy, its cost and the data-parallel and one-weird-trick references.

    Raises
    ------
    TooDenseError
        (an :class:`ExplorerError`) when the dependent sets need tables over ``max_table``.
    MemoryExceededError
        When no strategy fits the smallest device, naming it.
    """
    ids = _devices(costs.cluster, k)
    pins = dict(pins or {})
    _check_pins(pins, graph, ids)
    model, sol = _model_and_solution(graph, costs, ids, depth, max_configs, max_table,
                                     optimizer, pins, 1.0)
    if not sol.fits:
        raise _memory_error(model, sol)
    return _result(model, sol)


def _memory_error(model: _Model, sol: PaseSolution, what: str = "") -> MemoryExceededError:
    """Nothing fits: name the smallest device (any device may take position 0)."""
    d = min(range(len(model.ids)), key=lambda x: (model.memory_by_device[x], x))
    if not what:
        cfg = sorted({f"({c.batch}, {c.feature})" for c in
                      (model.problem.configs[v][i] for v, i in enumerate(sol.choice))})
        what = (f"the {model.problem.n_layers} layers of the strategy that needs least memory "
                f"(configurations {', '.join(cfg)}; position 0 takes part in every layer)")
    return memory_error(
        "pase", what, model.ids[d], sol.memory_bytes, model.problem.capacity_bytes,
        "use more or larger devices, a smaller batch, or SGD")


# ------------------------------------------------------------------------------------------
# from a strategy to a Plan: batch splits only, stages on consecutive devices


@dataclass(frozen=True, eq=False)
class _Layout:
    """A batch-only strategy laid out as stages: per layer ``(replicas, first position)``."""

    place: tuple[tuple[int, int], ...]
    device_order: tuple[str, ...]
    cost_s: float
    note: str = ""


def _device_orders(model: _Model) -> list[tuple[str, ...]]:
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


def _direct_layout(model: _Model, configs: Sequence[Config], cost_s: float
                   ) -> _Layout | None:
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
            return _Layout(tuple(place), order, cost_s)
    return None


def _expressible_problem(model: _Model, order: Sequence[str]
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


def _expressible_layout(model: _Model, max_table: float
                        ) -> tuple[_Layout | None, ExplorerError | None]:
    """The cheapest strategy a Plan can express, over the device orders; (None, why) if none."""
    best: _Layout | None = None
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
                why = _memory_error(model, sol, f"the {model.problem.n_layers} layers of the "
                                    "batch-only strategy that needs least memory")
            continue
        lay = _Layout(tuple(place[v][i] for v, i in enumerate(sol.choice)), tuple(order),
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


def _plan(graph: OpGraph, model: _Model, lay: _Layout, optimizer: str,
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


def _tolerance(model: _Model, cost_s: float) -> float:
    """Cost differences below this are tie-breaks (:data:`TIE_S`) or rounding."""
    return 2 * TIE_S * model.problem.n_layers * len(model.ids) + 1e-9 * abs(cost_s)


def _fmt(x: float) -> str:
    return f"{x:.4g} s" if math.isfinite(x) else "does not fit"


def _pase_plan(graph: OpGraph, costs: CostModel, ids: Sequence[str], pins: Mapping[str, str],
               depth: int | None, max_configs: int, max_table: float, optimizer: str,
               headroom: float) -> Plan:
    model, sol = _model_and_solution(graph, costs, ids, depth, max_configs, max_table,
                                     optimizer, pins, headroom)
    if not sol.fits:
        raise _memory_error(model, sol)
    res = _result(model, sol)
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
    lay = None if res.feature_split else _direct_layout(model, res.configs, res.cost_s)
    if lay is None:
        batch_model = _build(graph, costs, ids, model.depth, max_configs, optimizer, pins,
                             headroom, batch_only=True, like=model)
        lay, why = _expressible_layout(batch_model, max_table)
        if lay is None:
            raise why or ExplorerError("pase: no batch-only strategy found")
        if res.feature_split:
            split = [name for name, c in zip(res.layer_names, res.configs, strict=True)
                     if c.feature > 1]
            options["pase_strategy"] = res.to_dict()
            notes.append(
                f"PaSE's best strategy splits the features of {len(split)} layers ("
                f"{', '.join(split[:4])}{', ...' if len(split) > 4 else ''}) for "
                f"{_fmt(res.cost_s)} per step: simulated by PaSE's own cost model only, it "
                "cannot run yet (plans and the runtime split the batch only); it is in "
                "options['pase_strategy']. This plan is the best batch-only strategy, "
                f"{_fmt(lay.cost_s)} under PaSE's model{lay.note}")
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
    return _plan(graph, model, lay, optimizer, pins, options, notes)


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

    A plan can hold batch splits (replicated stages) but not feature splits. When the best
    strategy splits the batch only, consecutive layers sharing a configuration become a stage
    with that many replicas on consecutive devices; when that needs more devices than there
    are (every device serves one stage) or cannot honour the pins, the DP runs again over
    the strategies a plan can express, and a note says so and what that costs. When feature
    splits win, the plan is the best batch-only strategy, and the full strategy with its PaSE
    cost is in ``plan.options["pase_strategy"]`` with a note: it is simulated by PaSE's own
    cost model only and cannot run yet.

    Parameters
    ----------
    k : int, optional
        Number of devices to use, the cluster's first ``k`` (default: all).
    depth : int, optional
        Module depth of the layers (``None``: leaf modules, or the finest coarser depth whose
        DP table fits under ``max_table``).
    max_configs : int
        Configurations kept per layer, ``K`` (default 8). Always kept: the largest batch
        split, the largest feature split and no split.
    max_table : float
        Largest DP table, in entries (default 2,000,000).
    optimizer : str
        Optimizer whose state counts towards memory (default ``"adam"``).
    compare_baselines : bool
        On graphs up to 5,000 nodes, simulate the plan against ``single`` and
        ``data-parallel`` and return the fastest that fits (a note says when it is a
        baseline). Default True.

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
    ids = _devices(cluster, k)
    pins = dict(pins or {})
    _check_pins(pins, graph, ids)
    plan = pred = None
    failure = ""
    for headroom in HEADROOMS:
        try:
            plan = _pase_plan(graph, costs, ids, pins, depth, max_configs, max_table,
                              optimizer, headroom)
        except MemoryExceededError as exc:
            if not compare_baselines:
                raise
            failure = str(exc)
            break
        pred = simulate_if_small(graph, plan, costs) if compare_baselines else None
        if pred is None or pred.fits:
            break
        failure = (f"pase: its plan does not fit the simulator's memory accounting "
                   f"({pred.memory_report()})")
    if not compare_baselines:
        if plan is None:
            raise MemoryExceededError(failure)
        return plan
    return best_of_baselines(graph, cluster, costs, plan, pins, optimizer, "pase", ids,
                             failure, pred)


__all__ = ["Config", "LayerInfo", "PaseProblem", "PaseResult", "PaseSolution", "TooDenseError",
           "data_parallel_choice", "dependent_order", "layer_configs", "missing_fraction",
           "one_weird_trick_choice", "pase", "pase_problem", "pase_search", "ring_allreduce_s",
           "solve", "split_factors", "unary_cost_s"]
