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
   crossings. Items of one expanded module (a frame, given as each item's ``chains``) stay
   side by side in every row: a row is sorted by its frames' mean positions first.
4. Positions: each row's items are placed as close as they can to the mean x of their
   neighbours without overlapping (an isotonic regression per row), in alternating passes,
   with room for the frames' margins between items of different frames.
5. Frames: each frame is outlined row by row around its own items only (a staircase, see
   :func:`frame_outline`), so it never covers an item of another module, in its rows or in
   the rows above and below.

Everything is plain Python over lists: a few milliseconds for hundreds of items.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

#: item box size in data units (the graph draws rects of this size)
ITEM_W, ITEM_H = 1.6, 0.6
#: width a virtual point takes in its row, and the gap between neighbours in a row
POINT_W, GAP = 0.2, 0.35
#: barycenter sweeps (down and up) ordering the rows
SWEEPS = 4
#: positioning passes (alternately from the row above and from the row below)
PASSES = 4
#: a frame's margin around its items, per level of frames it holds (outer frames are wider)
FRAME_PAD = 0.12
#: its margin above and below, per level, and at most (under half the gap between rows, so a
#: frame never reaches the items of the rows above and below)
FRAME_PAD_Y, FRAME_PAD_Y_MAX = 0.04, 0.18


@dataclass
class Layout:
    """Where the items and edges of the picture go."""

    #: (x, y) of each item's centre; y = -row
    xy: list[tuple[float, float]]
    #: each edge's polyline, (xs, ys), from the bottom of its source to the top of its target
    routes: dict[tuple[int, int], tuple[list[float], list[float]]]
    #: rows each edge goes down (1: to the next row)
    span: dict[tuple[int, int], int]
    #: each frame's outline: polygons (xs, ys), one per run of consecutive rows it has items in
    outlines: list[list[tuple[list[float], list[float]]]] = field(default_factory=list)


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


def frame_levels(chains: list[tuple[int, ...]]) -> dict[int, int]:
    """How many levels of frames each frame holds (0: none), from each item's frames
    (outermost first)."""
    below: dict[int, int] = {}
    for ch in chains:
        for k, f in enumerate(ch):
            below[f] = max(below.get(f, 0), len(ch) - k - 1)
    return below


def layered_layout(n: int, edges, max_points: int | None = None,
                   chains: list[tuple[int, ...]] | None = None) -> Layout:
    """The layout of ``n`` items (in topological order) joined by ``edges`` ((a, z) pairs);
    ``chains[k]`` are the frames item ``k`` is in, outermost first (ids from 0; none: no
    frames)."""
    row = rows_of(n, edges)
    chains = list(chains) if chains is not None else [()] * n
    below = frame_levels(chains)
    pad = {f: FRAME_PAD * (1 + b) for f, b in below.items()}
    budget = 4 * n + 2000 if max_points is None else max_points
    # -- chains of virtual points, one per source, down to its deepest target ------------------
    deepest: dict[int, int] = {}
    far: dict[int, list[int]] = defaultdict(list)
    for a, z in edges:
        if a < z and row[z] - row[a] > 1:
            deepest[a] = max(deepest.get(a, 0), row[z])
            far[a].append(z)
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
        # an edge bundle runs inside the frames its source and all its far targets share
        common = chains[a]
        for z in far[a]:
            common = shared(common, chains[z])
        chains.extend([common] * len(ids))
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
    for r in rows:
        r.sort(key=grouped_key(r, {v: start[v] for v in r}, chains))
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
                r.sort(key=grouped_key(r, key, chains))
                for k, v in enumerate(r):
                    pos[v] = float(k)

    # -- x positions -----------------------------------------------------------------------
    width = [ITEM_W if v < n else POINT_W for v in range(len(node_row))]
    x = [0.0] * len(node_row)
    for r in rows:
        place_row(r, [0.0] * len(r), width, weight, x, gaps(r, chains, pad))
    for p in range(PASSES):
        order, nbrs = ((range(1, n_rows), up) if p % 2 == 0
                       else (range(n_rows - 2, -1, -1), down))
        for i in order:
            r = rows[i]
            want = [sum(x[u] for u in nbrs[v]) / len(nbrs[v]) if nbrs[v] else x[v] for v in r]
            place_row(r, want, width, weight, x, gaps(r, chains, pad))
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
    rows_of_frames = frame_rows(xy, chains, pad)
    outlines = [frame_outline(rows_of_frames[f],
                              min(FRAME_PAD_Y * (1 + below[f]), FRAME_PAD_Y_MAX))
                for f in range(len(rows_of_frames))]
    return Layout(xy, routes, span, outlines)


def shared(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The frames two chains share (their common start)."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return a[:k]


def grouped_key(r: list[int], key: dict[int, float], chains: list[tuple[int, ...]]):
    """A sort key for row ``r`` by ``key`` that keeps the nodes of each frame together: a
    frame sorts at the mean key of its nodes in the row, then its nodes among themselves."""
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for v in r:
        for f in chains[v]:
            total[f] += key[v]
            count[f] += 1

    def sort_key(v: int) -> tuple[float, ...]:
        out: list[float] = []
        for f in chains[v]:
            out += [total[f] / count[f], f]
        return (*out, key[v], -1)
    return sort_key


def gaps(r: list[int], chains: list[tuple[int, ...]], pad: dict[int, float]) -> list[float]:
    """Room between each node of row ``r`` and the one before it for the margins of the
    frames one is in and the other is not."""
    out = [0.0]
    for u, v in itertools.pairwise(r):
        common = len(shared(chains[u], chains[v]))
        out.append(sum(pad[f] for f in chains[u][common:])
                   + sum(pad[f] for f in chains[v][common:]))
    return out


def runs_of(ys: list[float]) -> list[list[float]]:
    """Row positions (y = -row) split into runs of consecutive rows, top first."""
    runs: list[list[float]] = []
    for y in sorted(ys, reverse=True):
        if runs and runs[-1][-1] - y <= 1.0 + 1e-9:
            runs[-1].append(y)
        else:
            runs.append([y])
    return runs


def frame_rows(xy: list[tuple[float, float]], chains: list[tuple[int, ...]],
               pad: dict[int, float]) -> list[dict[float, tuple[float, float]]]:
    """Each frame's extent (left, right) in each row it has items in: its items there plus
    its margin, widened towards the widest row of its run of rows as far as the row allows
    (the items of other modules and the frames already placed stay outside it, and a frame
    stays inside the frame it is in), so frames are boxes where they can be and steps only
    where another module's item is in the way. Outer frames are placed first."""
    members: dict[int, dict[float, list[float]]] = defaultdict(dict)
    parent: dict[int, int | None] = {}
    for k, (x, y) in enumerate(xy):
        for level, f in enumerate(chains[k]):
            lo, hi = members[f].get(y, (x, x))
            members[f][y] = [min(lo, x), max(hi, x)]
            parent[f] = chains[k][level - 1] if level else None
    by_row: dict[float, list[float]] = defaultdict(list)
    for x, y in xy:
        by_row[y].append(x)
    placed: dict[float, list[tuple[float, float, int]]] = defaultdict(list)
    out: list[dict[float, tuple[float, float]]] = [{} for _ in range(len(pad))]
    around = {f: frames_around(f, parent) for f in members}
    for f in sorted(members, key=lambda f: (len(around[f]), f)):
        w = ITEM_W / 2 + pad[f]
        outer = set(around[f])
        for run in runs_of(list(members[f])):
            left = min(members[f][y][0] for y in run) - w
            right = max(members[f][y][1] for y in run) + w
            for y in run:
                a0, b0 = members[f][y][0] - w, members[f][y][1] + w
                lo, hi = left, right
                up = parent[f]
                if up is not None:  # inside the frame it is in, by the margins' difference
                    inset = pad[up] - pad[f]
                    lo, hi = max(lo, out[up][y][0] + inset), min(hi, out[up][y][1] - inset)
                mine = members[f][y]
                for x in by_row[y]:
                    if x < mine[0]:
                        lo = max(lo, x + ITEM_W / 2 + GAP / 2)
                    elif x > mine[1]:
                        hi = min(hi, x - ITEM_W / 2 - GAP / 2)
                for ga, gb, g in placed[y]:
                    if g not in outer:
                        if gb <= a0:
                            lo = max(lo, gb + GAP / 2)
                        elif ga >= b0:
                            hi = min(hi, ga - GAP / 2)
                out[f][y] = (min(a0, lo), max(b0, hi))
                placed[y].append((*out[f][y], f))
    return out


def frames_around(f: int, parent: dict[int, int | None]) -> list[int]:
    """The frames ``f`` is in, innermost first."""
    out = []
    up = parent[f]
    while up is not None:
        out.append(up)
        up = parent[up]
    return out


def frame_outline(rows: dict[float, tuple[float, float]], pad_y: float
                  ) -> list[tuple[list[float], list[float]]]:
    """Polygons around a frame's extent in each row (:func:`frame_rows`): rows one apart are
    joined halfway between them into one polygon (a box, or steps where the extents differ),
    a row further away starts another. ``pad_y`` is the margin above the top row and below
    the bottom one."""
    out = []
    h = ITEM_H / 2 + pad_y
    for run in runs_of(list(rows)):
        # each row's band: from halfway to the row above (or the margin) to halfway below
        bands = [(rows[y], run[0] + h if k == 0 else y + 0.5,
                  run[-1] - h if k == len(run) - 1 else y - 0.5) for k, y in enumerate(run)]
        xs: list[float] = []
        ys: list[float] = []
        for (_, right), top, bottom in bands:  # down the right side
            xs += [right, right]
            ys += [top, bottom]
        for (left, _), top, bottom in reversed(bands):  # up the left side
            xs += [left, left]
            ys += [bottom, top]
        out.append((xs, ys))
    return out


def place_row(r: list[int], want: list[float], width: list[float], weight: list[float],
              x: list[float], extra: list[float] | None = None) -> None:
    """Set ``x`` of the row's nodes ``r`` (in order) as near ``want`` as they can be without
    overlapping: least squares under "each at least a gap (plus ``extra[k]``) right of the
    one before" (pool-adjacent-violators on the positions less their minimal offsets)."""
    off = [0.0] * len(r)
    for k in range(1, len(r)):
        off[k] = (off[k - 1] + (width[r[k - 1]] + width[r[k]]) / 2 + GAP
                  + (extra[k] if extra else 0.0))
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
