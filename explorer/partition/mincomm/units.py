"""min-comm's finest level: node weights, units (an op with what it reads first), pins, order."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.costs.model import CostModel
from explorer.partition.mincomm.level import Level


def node_weights_s(graph: OpGraph, costs: CostModel, device: str) -> list[float]:
    """Compute seconds (forward + backward) of every node on ``device``; 0 for non-ops."""
    out = []
    for i, n in enumerate(graph.nodes):
        if n.kind != "op":
            out.append(0.0)
            continue
        t = costs.fwd_s(i, device)
        if n.requires_grad:
            t += costs.bwd_s(i, device)
        out.append(t)
    return out


def net_weights_s(graph: OpGraph, costs: CostModel, devices: Sequence[str],
                  micro_batches: int = 1) -> list[float]:
    """Seconds to send every node's output to one other device, per step; 0 for inputs.

    Activations go once per micro-batch, weights once per step; both have a gradient coming
    back when they require one. The link is the average over pairs of ``devices`` (latency
    and seconds per byte), as in ``CostModel.transfer_s``.
    """
    cluster = costs.cluster
    pairs = [(a, b) for i, a in enumerate(devices) for b in devices[i + 1:]]
    if pairs:
        lat = sum(cluster.link(a, b).latency_s for a, b in pairs) / len(pairs)
        spb = costs.link_scale * sum(1.0 / cluster.link(a, b).bandwidth_bytes_per_s
                                     for a, b in pairs) / len(pairs)
    else:
        lat = spb = 0.0
    out = []
    for n in graph.nodes:
        if n.kind == "input" or n.out_bytes <= 0:
            out.append(0.0)
            continue
        times = micro_batches if n.kind == "op" else 1
        one = times * lat + n.out_bytes * spb
        out.append(one * (2 if n.requires_grad else 1))
    return out


def cut_seconds(graph: OpGraph, part: Sequence[int], weights: Sequence[float]) -> float:
    """Communication of a placement: per producer, (parts among it and its readers - 1) x
    its weight. Inputs are not sent (every rank loads its own batch)."""
    total = 0.0
    for p, n in enumerate(graph.nodes):
        if n.kind == "input" or not weights[p]:
            continue
        parts = {part[p]} | {part[c] for c in graph.succs[p]}
        total += (len(parts) - 1) * weights[p]
    return total


def hosts(graph: OpGraph) -> list[int]:
    """The op each node lives with: itself for ops; for parameters, buffers and inputs the
    op that reads them first (the first op overall when none does)."""
    nodes, succs = graph.nodes, graph.succs
    first_op = next((i for i, nd in enumerate(nodes) if nd.kind == "op"), 0)
    host = list(range(len(nodes)))
    for i, nd in enumerate(nodes):
        if nd.kind == "op":
            continue
        o, steps = i, 0
        while nodes[o].kind != "op" and succs[o] and steps < 64:
            o, steps = succs[o][0], steps + 1
        host[i] = o if nodes[o].kind == "op" else first_op
    return host


def effective_pins(graph: OpGraph, host: list[int], pins: Mapping[str, str]
                    ) -> tuple[dict[int, str], set[int]]:
    """Pins by node index, with every op that hosts a pinned parameter pinned with it (the
    first such parameter decides when the op itself is not pinned), and the set of pinned
    non-op nodes that cannot join their host (pinned elsewhere) and stand alone."""
    eff: dict[int, str] = {}
    for nm, dev in pins.items():
        i = graph.index[nm]
        if graph.nodes[i].kind == "op":
            eff[i] = dev
    alone: set[int] = set()
    for i in sorted(graph.index[nm] for nm in pins):
        if graph.nodes[i].kind == "op":
            continue
        dev = pins[graph.nodes[i].name]
        eff[i] = dev
        h = host[i]
        if h == i:
            alone.add(i)
        elif h not in eff:
            eff[h] = dev
        elif eff[h] != dev:
            alone.add(i)
    return eff, alone


def device_order(lv: Level, ids: Sequence[str], names: Sequence[str]) -> list[str]:
    """Devices in part order. ``lv.pin`` holds device indices into ``ids``.

    Pinned devices come in an order their pins allow (a unit pinned to A that feeds, through
    any path, one pinned to B puts A before B), each near the share of compute before its
    first pinned unit; the other devices fill the remaining places in cluster order. Raises
    :class:`ExplorerError` when the pins force a cycle between devices. ``names`` name the
    units in messages.
    """
    k = len(ids)
    if not (lv.pin >= 0).any():
        return list(ids)
    pin = lv.pin_list
    anc = [0] * lv.n  # bitmask of the devices pinned upstream of each unit
    after: dict[int, set[int]] = {}
    witness: dict[tuple[int, int], int] = {}
    first: dict[int, int] = {}
    for v in range(lv.n):
        m = 0
        for u in lv.preds[v]:
            m |= anc[u] | (1 << pin[u] if pin[u] >= 0 else 0)
        anc[v] = m
        b = pin[v]
        if b < 0:
            continue
        first.setdefault(b, v)
        a = 0
        while m >> a:
            if m >> a & 1 and a != b:
                after.setdefault(a, set()).add(b)
                witness.setdefault((a, b), v)
            a += 1
    devs = sorted(first, key=lambda d: first[d])
    indeg = dict.fromkeys(devs, 0)
    for a in devs:
        for b in after.get(a, ()):
            indeg[b] += 1
    ready = [(first[d], d) for d in devs if indeg[d] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, a = heapq.heappop(ready)
        order.append(a)
        for b in sorted(after.get(a, ())):
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, (first[b], b))
    if len(order) < len(devs):
        stuck = [d for d in devs if d not in set(order)]
        a = stuck[0]
        b = next(b for b in sorted(after.get(a, ())) if b in stuck)
        raise ExplorerError(
            f"the pins force a cycle between devices {', '.join(ids[d] for d in stuck)}: e.g. "
            f"{names[witness[(a, b)]]!r} (pinned to {ids[b]}) depends on work pinned to "
            f"{ids[a]}, and work pinned to {ids[b]} feeds work pinned to {ids[a]}; stages in "
            "a cycle could deadlock, and min-comm keeps the stage graph acyclic. Change the "
            "pins, or use an algorithm that places ops freely")
    before = np.concatenate([[0.0], np.cumsum(lv.w)]).tolist()
    total = before[-1] or 1.0
    slots: list[int] = []
    for j, a in enumerate(order):
        want = int(k * before[first[a]] / total)
        lo = slots[-1] + 1 if slots else 0
        hi = k - (len(order) - j)
        slots.append(min(max(want, lo), hi))
    out: list[str | None] = [None] * k
    for a, slot in zip(order, slots, strict=True):
        out[slot] = ids[a]
    placed = set(order)
    rest = iter(d for j, d in enumerate(ids) if j not in placed)
    return [d if d is not None else next(rest) for d in out]


def finest_level(graph: OpGraph, host: list[int], pin_part: dict[int, int],
                  alone: set[int], w_node: list[float], net_w: list[float],
                  mfix_node: list[int], mact_node: list[int]
                  ) -> tuple[Level, list[int], list[str]]:
    """Units (an op with the parameters, buffers and inputs it reads first) in topological
    order, and the unit of every node. A pinned node that cannot join its op stands alone,
    just before it."""
    nodes, succs = graph.nodes, graph.succs
    n = len(nodes)
    keys = {i: (h, 0, i) if i in alone else (h, 1, h) for i, h in enumerate(host)}
    order = sorted(set(keys.values()))
    unit_id = {key: u for u, key in enumerate(order)}
    unit_of = np.array([unit_id[keys[i]] for i in range(n)], dtype=np.int64)
    nu = len(order)
    pin = np.full(nu, -1, dtype=np.int64)
    for u, key in enumerate(order):
        pin[u] = pin_part.get(key[2], -1)
    producers = [p for p, nd in enumerate(nodes) if nd.kind != "input" and succs[p]]
    # inputs are not sent (every rank loads its own batch): no dependency between parts
    src = unit_of[np.asarray(producers, dtype=np.int64)] if producers else np.zeros(0, int)
    net_of = np.repeat(np.arange(len(producers)), [len(succs[p]) for p in producers])
    readers = np.fromiter((c for p in producers for c in succs[p]), dtype=np.int64,
                          count=len(net_of))
    lv = Level(np.bincount(unit_of, weights=np.asarray(w_node), minlength=nu),
                np.bincount(unit_of, weights=np.asarray(mfix_node, dtype=float), minlength=nu),
                np.bincount(unit_of, weights=np.asarray(mact_node, dtype=float), minlength=nu),
                pin, src, net_of, unit_of[readers],
                np.asarray([net_w[p] for p in producers], dtype=float))
    return lv, unit_of.tolist(), [nodes[key[2]].name for key in order]


__all__ = ["cut_seconds", "device_order", "effective_pins", "finest_level", "hosts",
           "net_weights_s", "node_weights_s"]
