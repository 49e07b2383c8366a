"""How far the partitioners search on large clusters: the bounds, and the refusal past them.

A cluster may have up to :data:`~explorer.core.limits.MAX_DEVICES` devices, and a search that
tries every device count, every device subset or every pair of devices grows with it. On a
cluster of at most :data:`FULL_SEARCH_DEVICES` devices every partitioner searches as it always
has. Beyond that, each bounds its search where a person would, and says so in a note:

* the op-level placers (ParDNN, m-TOPO, m-ETF, m-SCT) place ops on at most as many devices as
  the graph has ops, at most :data:`MAX_OP_DEVICES`, and at most :data:`OP_WORK_BUDGET` divided
  by the graph's nodes (the fastest devices, pinned ones always among them): a plan over more
  devices than ops never uses them all, and the list scheduler's work is ops x devices;
* min-comm cuts as many parts as those placers have devices (its refinement keeps a count per
  tensor and part, and the links' average is over every pair);
* pipeline-dp tries replica counts that are powers of two, leaves out the device positions no
  plan of its stages can reach, and keeps its DP under ``WIDE_DP_CELLS`` by coarser layers;
* WAP sweeps every device count up to :data:`FULL_SEARCH_DEVICES`, then the powers of two and
  the cluster's size;
* pase and pipeline-dp read the links among the devices once per distinct link, not per pair.

Where a bound cannot hold (the graph's memory needs more devices than the work budget
allows), the partitioner refuses before it starts with :class:`SearchTooLarge`, saying the
work it would need and what to use instead. The work is estimated from the graph's and the
cluster's sizes, never timed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan import StageSettings
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.devices.records import Link

#: clusters of at most this many devices are searched in full by every partitioner
FULL_SEARCH_DEVICES = 64
#: the most devices the op-level placers place ops on (their link tables are devices^2)
MAX_OP_DEVICES = 1024
#: the most (node x device) steps an op-level placement, or (tensor x part) counts min-comm's
#: refinement, may take: about ten seconds of Python on a shared core
OP_WORK_BUDGET = 20_000_000


class SearchTooLarge(PlanError):
    """A partitioner's search would need more work than it may take on this graph and
    cluster; the message says how much, and what to use instead."""


def too_large(name: str, work: str, instead: str) -> SearchTooLarge:
    """The refusal of ``name``: the ``work`` it would need, and what to use ``instead``."""
    return SearchTooLarge(f"{name}: not run: {work}; {instead}")


def distinct_links(cluster: Cluster, ids: Sequence[str]) -> list[Link]:
    """The distinct links between the devices ``ids`` (as :meth:`Cluster.link` gives them),
    found from the cluster's overrides instead of every pair: work in devices + overrides."""
    keep = set(ids)
    over: dict[frozenset[str], Link] = {}
    for a, b, link in cluster.links:  # the last override of a pair wins, as in Cluster.link
        if a in keep and b in keep and a != b:
            over[frozenset((a, b))] = link
    per_node = Counter(cluster.device(i).node for i in keep)
    same_node = sum(c * (c - 1) // 2 for c in per_node.values())  # pairs on default_link
    over_same = sum(1 for pair in over if len({cluster.device(i).node for i in pair}) == 1)
    found = list(dict.fromkeys(over.values()))
    if over_same < same_node and cluster.default_link not in found:
        found.append(cluster.default_link)
    across = len(keep) * (len(keep) - 1) // 2 - same_node  # pairs on network_link
    if across > len(over) - over_same and cluster.network_link not in found:
        found.append(cluster.network_link)
    return found


def uniform(cluster: Cluster, ids: Sequence[str]) -> bool:
    """Whether the devices ``ids`` are of one type with one kind of link between every two."""
    return (len({cluster.device(i).type_key for i in ids}) <= 1
            and len(distinct_links(cluster, ids)) <= 1)


def op_count(graph: OpGraph) -> int:
    """How many ops the graph has (at least 1)."""
    return max(1, sum(1 for n in graph.nodes if n.kind == "op"))


def op_devices(name: str, graph: OpGraph, costs: CostModel, ids: Sequence[str],
               pins: Mapping[str, str], optimizer: str, memory_fraction: float,
               memory: StageSettings | None = None) -> tuple[list[str], str]:
    """The devices an op-level placer considers among ``ids``, and a note ("" for all).

    All of them on a cluster of at most :data:`FULL_SEARCH_DEVICES`. Otherwise at most the
    graph's op count, :data:`MAX_OP_DEVICES` and :data:`OP_WORK_BUDGET` / nodes of them
    (never fewer than :data:`FULL_SEARCH_DEVICES`), but as many as the graph's additive
    memory needs: the pinned devices, then the fastest device types first, in cluster order.
    Raises :class:`SearchTooLarge` when the memory needs more devices than the budget allows.
    """
    ids = list(ids)
    k = len(ids)
    if k <= FULL_SEARCH_DEVICES:
        return ids, ""
    cluster = costs.cluster
    n_nodes = max(1, len(graph))
    by_work = OP_WORK_BUDGET // n_nodes
    limit = min(k, MAX_OP_DEVICES, max(FULL_SEARCH_DEVICES, op_count(graph)),
                max(FULL_SEARCH_DEVICES, by_work))
    # fastest device types first (least total compute), then cluster order; pins first of all
    total_s: dict[str, float] = {}
    for dev in ids:
        key = cluster.device(dev).type_key
        if key not in total_s:
            total_s[key] = 0.0 if not total_s and all(
                cluster.device(d).type_key == key for d in ids) else sum(
                costs.node_s(i, dev) for i in range(len(graph)))
    pinned = list(dict.fromkeys(d for d in pins.values() if d in ids))
    taken = set(pinned)
    rest = sorted((d for d in ids if d not in taken),
                  key=lambda d: total_s[cluster.device(d).type_key])
    order = pinned + rest
    kind = cluster.device(ids[0]).kind
    need_bytes = sum(node_memory_bytes(graph, optimizer, settings=memory, device_kind=kind))
    held = 0.0
    need = 0  # (0 when even every device cannot hold it: the search then says by how much)
    for j, dev in enumerate(order):
        held += cluster.device(dev).memory_bytes * memory_fraction
        if held >= need_bytes:
            need = j + 1
            break
    limit = max(limit, len(pinned))
    if need > limit:
        if need * n_nodes > OP_WORK_BUDGET or need > MAX_OP_DEVICES:
            raise too_large(
                name, f"{graph.name or 'the graph'} needs at least {need:,} devices to hold its "
                f"memory, and placing its {n_nodes:,} nodes op by op on that many "
                f"({need * n_nodes:,} node-device steps) is over what this search may take "
                f"({OP_WORK_BUDGET:,} steps, on at most {MAX_OP_DEVICES:,} devices)",
                "use degrees or pipeline-dp, which place layers, or fewer nodes (a coarser "
                "graph)")
        limit = need
    if limit >= k:
        return ids, ""
    keep = set(order[:limit])
    chosen = [d for d in ids if d in keep]
    return chosen, (f"{name}: placed ops on {limit:,} of the {k:,} devices, the fastest (at "
                    f"most the graph's {op_count(graph):,} ops, {MAX_OP_DEVICES:,} devices and "
                    f"{OP_WORK_BUDGET:,} node-device steps, as many as its memory needs)")


def powers_of_two(top: int) -> list[int]:
    """1, 2, 4, ... up to ``top``."""
    out, x = [], 1
    while x <= top:
        out.append(x)
        x *= 2
    return out


__all__ = ["FULL_SEARCH_DEVICES", "MAX_OP_DEVICES", "OP_WORK_BUDGET", "SearchTooLarge",
           "distinct_links", "op_count", "op_devices", "powers_of_two", "too_large", "uniform"]
