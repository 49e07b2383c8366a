"""PaSE's dependent-set dynamic program: a visiting order, the DP along it, the memory search."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from explorer.core.errors import ExplorerError
from explorer.partition.pase.problem import (
    DEFAULT_MAX_TABLE,
    PaseProblem,
    PaseSolution,
    Shape,
    TooDenseError,
)

#: bisection steps of the Lagrangian memory search
_LAMBDA_STEPS = 24


def dependent_order(problem: PaseProblem | Shape, limit: float = math.inf
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
    >>> from explorer.partition.pase.problem import Config
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


__all__ = ["dependent_order", "solve"]
