"""A layered (Sugiyama-style) layout of the graph picture: items in rows, edges routed around them.

1. Rows: an item's row is one more than the deepest row of the items it reads (the longest
   path from the top), so every edge points down the page.
2. Edges that skip rows are routed through "virtual" points, one per row they pass, so they
   run between the items of that row instead of under them. The edges leaving one item share
   one chain of points (a bundle: a mask or a view read by every block is one line down the
   side, with a branch to each reader). When the chains would pass more than ``max_points``
   rows in all, the longest are left out and drawn straight (faint, see :attr:`Layout.span`).
3. Order within a row: a few barycenter sweeps down and up (each item moves towards the
   mean position of its neighbours in the row above, then below), which removes most
   crossings.
4. Positions: each row's items are placed as close as they can to the mean x of their
   neighbours without overlapping (an isotonic regression per row), in alternating passes.

Everything is plain Python over lists: a few milliseconds for hundreds of items.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

#: item box size in data units (the graph draws rects of this size)
ITEM_W, ITEM_H = 1.6, 0.6
#: width a virtual point takes in its row, and the gap between neighbours in a row
POINT_W, GAP = 0.2, 0.35
#: barycenter sweeps (down and up) ordering the rows
SWEEPS = 4
#: positioning passes (alternately from the row above and from the row below)
PASSES = 4


@dataclass
class Layout:
    """Where the items and edges of the picture go."""

    #: (x, y) of each item's centre; y = -row
    xy: list[tuple[float, float]]
    #: each edge's polyline, (xs, ys), from the bottom of its source to the top of its target
    routes: dict[tuple[int, int], tuple[list[float], list[float]]]
    #: rows each edge goes down (1: to the next row)
    span: dict[tuple[int, int], int]


def rows_of(n: int, edges) -> list[int]:
    """Each item's row: one more than the deepest row of the items it reads (items are in
    topological order; an edge that points back is ignored). An item that reads nothing (a
    constant, an alias of an input) goes just above its first reader, not to the top."""
    preds: dict[int, list[int]] = defaultdict(list)
    succs: dict[int, list[int]] = defaultdict(list)
    for a, z in edges:
        if a < z:
            preds[z].append(a)
            succs[a].append(z)
    row = [0] * n
    for k in range(n):
        ps = preds.get(k)
        if ps:
            row[k] = max(row[a] for a in ps) + 1
    for k in range(n):
        if k not in preds and k in succs:
            row[k] = max(min(row[z] for z in succs[k]) - 1, 0)
    return row


def layered_layout(n: int, edges, max_points: int | None = None) -> Layout:
    """The layout of ``n`` items (in topological order) joined by ``edges`` ((a, z) pairs)."""
    row = rows_of(n, edges)
    budget = 4 * n + 2000 if max_points is None else max_points
    # -- chains of virtual points, one per source, down to its deepest target ------------------
    deepest: dict[int, int] = {}
    for a, z in edges:
        if a < z and row[z] - row[a] > 1:
            deepest[a] = max(deepest.get(a, 0), row[z])
    chain: dict[int, dict[int, int]] = {}  # source -> row -> virtual node id
    up: list[list[int]] = [[] for _ in range(n)]
    node_row = list(row)
    weight = [1.0] * n
    for a in sorted(deepest, key=lambda a: deepest[a] - row[a]):
        need = deepest[a] - row[a] - 1
        if need > budget:
            break
        budget -= need
        prev, ids = a, {}
        for r in range(row[a] + 1, deepest[a]):
            v = len(node_row)
            node_row.append(r)
            up.append([prev])
            weight.append(2.0)  # straight bundles read better than straight items
            ids[r] = prev = v
        chain[a] = ids
    down: list[list[int]] = [[] for _ in node_row]
    for v, us in enumerate(up):
        for u in us:
            down[u].append(v)
    for a, z in edges:
        if a >= z:
            continue
        u = chain[a][row[z] - 1] if row[z] - row[a] > 1 and a in chain else a
        if row[z] - row[a] == 1 or a in chain:
            up[z].append(u)
            down[u].append(z)

    # -- order within rows -----------------------------------------------------------------
    n_rows = max(node_row, default=-1) + 1
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    start = [float(v) for v in range(n)] + [float(up[v][0]) + 0.5 for v in range(n, len(up))]
    for v in sorted(range(len(node_row)), key=start.__getitem__):
        rows[node_row[v]].append(v)
    pos = [0.0] * len(node_row)
    for r in rows:
        for k, v in enumerate(r):
            pos[v] = float(k)
    for _ in range(SWEEPS):
        for order, nbrs in ((range(1, n_rows), up), (range(n_rows - 2, -1, -1), down)):
            for i in order:
                r = rows[i]
                key = {v: (sum(pos[u] for u in nbrs[v]) / len(nbrs[v]) if nbrs[v] else pos[v])
                       for v in r}
                r.sort(key=key.__getitem__)
                for k, v in enumerate(r):
                    pos[v] = float(k)

    # -- x positions -----------------------------------------------------------------------
    width = [ITEM_W if v < n else POINT_W for v in range(len(node_row))]
    x = [0.0] * len(node_row)
    for r in rows:
        place_row(r, [0.0] * len(r), width, weight, x)
    for p in range(PASSES):
        order, nbrs = ((range(1, n_rows), up) if p % 2 == 0
                       else (range(n_rows - 2, -1, -1), down))
        for i in order:
            r = rows[i]
            want = [sum(x[u] for u in nbrs[v]) / len(nbrs[v]) if nbrs[v] else x[v] for v in r]
            place_row(r, want, width, weight, x)
    xy = [(x[k], -float(row[k])) for k in range(n)]

    # -- routes ----------------------------------------------------------------------------
    h = ITEM_H / 2
    routes: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    span: dict[tuple[int, int], int] = {}
    for a, z in edges:
        xs, ys = [x[a]], [-row[a] - h]
        ids = chain.get(a)
        if ids and row[z] - row[a] > 1:
            for r in range(row[a] + 1, row[z]):
                xs += [x[ids[r]], x[ids[r]]]
                ys += [-r + h, -r - h]
        xs.append(x[z])
        ys.append(-row[z] + h)
        routes[a, z] = (xs, ys)
        span[a, z] = row[z] - row[a]
    return Layout(xy, routes, span)


def place_row(r: list[int], want: list[float], width: list[float], weight: list[float],
              x: list[float]) -> None:
    """Set ``x`` of the row's nodes ``r`` (in order) as near ``want`` as they can be without
    overlapping: least squares under "each at least a gap right of the one before"
    (pool-adjacent-violators on the positions less their minimal offsets)."""
    off = [0.0] * len(r)
    for k in range(1, len(r)):
        off[k] = off[k - 1] + (width[r[k - 1]] + width[r[k]]) / 2 + GAP
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for k, v in enumerate(r):
        w = weight[v]
        blocks.append([w * (want[k] - off[k]), w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += c
    k = 0
    for s, w, c in blocks:
        for _ in range(c):
            x[r[k]] = s / w + off[k]
            k += 1
