"""A small stand-in for a large graph: runs of ops merged into one node each, with their costs.

Used where a search must simulate many plans of a graph with 100,000 ops (WAP's sweep over
device counts): the search runs on the merged graph, and the plan it settles on is made again
and simulated on the real graph. Groups are runs of consecutive ops in topological order
(module-level layers where the model has modules, cut further where a layer is large), so the
merged graph is a DAG and every contiguous split of it is a contiguous split of the graph.

What is kept exactly: forward and backward seconds per group on every device type at every
fraction of the batch the costs describe (sums of the members', calibration factors
included), FLOPs, parameter bytes, and the bytes that leave a group. What is approximated:
activation memory (what members save for the backward is counted on the group's node) and
the optimizer's per-tensor cost (one tensor per group's parameters).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from explorer.core.graph import OpGraph, OpNode, computed_share
from explorer.core.plan import Plan
from explorer.costs.model import CostModel, DeviceCosts

#: fractions of the batch at which merged costs are tabulated (besides the whole batch)
FRACTIONS = (0.5, 0.25, 0.125, 0.0625)


@dataclass(frozen=True)
class Coarse:
    """The merged graph, its costs, and which node of the original each merged node holds."""

    graph: OpGraph
    costs: CostModel
    #: merged node name -> indices of the original graph's nodes it stands for
    members: dict[str, tuple[int, ...]]
    #: original node name -> merged node name
    of: dict[str, str]

    def expand(self, plan: Plan, graph: OpGraph) -> Plan:
        """``plan`` (for the merged graph) for the original ``graph``: every node on the stage
        of the merged node that holds it, with the same settings."""
        placement = {name: plan.placement[m] for name, m in self.of.items()}
        pinned = frozenset(n for n, m in self.of.items() if m in plan.pinned)
        return Plan(graph.fingerprint, plan.stages, placement, plan.micro_batches,
                    plan.schedule, plan.optimizer, plan.algorithm, dict(plan.options),
                    pinned & frozenset(placement), plan.notes, graph.name)

    def pins(self, pins: Mapping[str, str]) -> dict[str, str] | None:
        """Pins on the merged graph, or None when two pinned nodes of one group disagree."""
        out: dict[str, str] = {}
        for name, dev in pins.items():
            m = self.of.get(name)
            if m is not None and out.setdefault(m, dev) != dev:
                return None
        return out


def groups_of(graph: OpGraph, target: int = 2000) -> list[list[int]]:
    """At most about ``target`` runs of consecutive ops, each with the parameters, buffers and
    inputs it owns (their first consumer's run): the finest module depth with at most
    ``target`` layers, and large layers cut into runs of about ``ops / target`` ops."""
    nodes = graph.nodes
    ops = [i for i, n in enumerate(nodes) if n.kind == "op"]
    if not ops:
        return [list(range(len(nodes)))] if nodes else []
    paths = [nodes[i].module_path.split(".") if nodes[i].module_path else [] for i in ops]
    # per neighbouring pair of ops: components in common, and the longer path's length;
    # they are in different layers at depth d when common < min(d, longer)
    common, longer = [], []
    for a, b in itertools.pairwise(paths):
        c = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            c += 1
        common.append(c)
        longer.append(max(len(a), len(b)))
    cm, lg = np.asarray(common, dtype=np.int64), np.asarray(longer, dtype=np.int64)
    depth = 0
    for d in range(1, max(map(len, paths), default=0) + 1):
        if 1 + int(np.count_nonzero(cm < np.minimum(d, lg))) > target:
            break
        depth = d
    cut = np.flatnonzero(cm < np.minimum(depth, lg)) + 1  # positions in `ops` starting a run
    size = 4 * max(1, -(-len(ops) // target))  # (a layer of up to 4x its share stays whole)
    starts = []
    for lo, hi in zip([0, *cut.tolist()], [*cut.tolist(), len(ops)], strict=True):
        starts.extend(range(lo, hi, size))  # long runs cut into pieces of `size` ops
    run_of_op = np.zeros(len(ops), dtype=np.int64)
    run_of_op[starts[1:]] = 1
    run_of_op = np.cumsum(run_of_op)
    groups: list[list[int]] = [[] for _ in starts]
    owned: dict[int, list[int]] = {}
    orphans = []
    for i, n in enumerate(nodes):
        if n.kind != "op":
            o = graph.owner(i)
            (orphans if o == i else owned.setdefault(o, [])).append(i)
    for k, i in enumerate(ops):
        grp = groups[run_of_op[k]]
        grp.extend(owned.get(i, ()))
        grp.append(i)
    groups[0][:0] = orphans
    return groups


def coarsen(graph: OpGraph, costs: CostModel, target: int = 2000) -> Coarse:
    """Merge ``graph`` into about ``target`` op nodes (see the module docstring)."""
    nodes, index, succs = graph.nodes, graph.index, graph.succs
    of: dict[int, str] = {}
    members: dict[str, tuple[int, ...]] = {}
    out: list[OpNode] = []
    # group by group: a group's parameters, buffers and inputs are first read by its own ops
    # and its ops read only earlier groups, so this order is topological
    for g, grp in enumerate(groups_of(graph, target)):
        for kind in ("input", "buffer", "param"):
            ids = [i for i in grp if nodes[i].kind == kind]
            if not ids:
                continue
            if kind == "input":  # inputs stay themselves (the runtime feeds them by name)
                for i in ids:
                    out.append(nodes[i])
                    of[i] = nodes[i].name
                    members[nodes[i].name] = (i,)
                continue
            name = f"g{g}.{kind}s"
            out.append(OpNode(name, kind, kind, nodes[ids[0]].module_path,
                              out_bytes=sum(nodes[i].out_bytes for i in ids),
                              param_bytes=sum(nodes[i].param_bytes for i in ids),
                              requires_grad=any(nodes[i].requires_grad for i in ids),
                              dtype=nodes[ids[0]].dtype))
            for i in ids:
                of[i] = name
            members[name] = tuple(ids)
        ops = [i for i in grp if nodes[i].kind == "op"]
        if not ops:
            continue
        name = f"g{g}"
        inside = set(ops)
        ins: list[str] = []
        saves: list[str] = []
        extra = 0
        counted: set[int] = set()
        for i in ops:
            n = nodes[i]
            for q in n.inputs:
                j = index[q]
                if j not in inside and of[j] not in ins:
                    ins.append(of[j])
            for q in n.saves:
                j = index[q]
                if j in inside:
                    if j not in counted:  # kept for the backward inside the group
                        counted.add(j)
                        extra += nodes[j].out_bytes
                elif of[j] not in saves:
                    saves.append(of[j])
            extra += n.saved_extra_bytes
        leaving = sum(nodes[i].out_bytes for i in ops
                      if nodes[i].name == graph.loss or any(c not in inside for c in succs[i]))
        out.append(OpNode(
            name, "op", f"{len(ops)} ops", nodes[ops[0]].module_path,
            inputs=tuple(ins), dtype=nodes[ops[-1]].dtype, out_bytes=leaving,
            requires_grad=any(nodes[i].requires_grad for i in ops),
            fwd_flops=sum(nodes[i].fwd_flops for i in ops),
            bwd_flops=sum(nodes[i].bwd_flops for i in ops),
            saves=tuple(saves), saved_extra_bytes=extra,
            # (its members' backwards run one after another)
            backward_scratch_bytes=max(nodes[i].backward_scratch_bytes for i in ops),
            computed_fraction=computed_share([nodes[i] for i in ops])))
        for i in ops:
            of[i] = name
        members[name] = tuple(grp)
    n_ops = sum(1 for n in out if n.kind == "op")
    loss = of.get(index[graph.loss], "") if graph.loss in index else ""
    small = OpGraph(f"{graph.name} ({n_ops} groups)", out, graph.batch_size,
                    source=graph.source, loss=loss,
                    notes=(f"{len(nodes)} nodes merged into {n_ops} runs of ops",))
    return Coarse(small, _merged_costs(graph, small, costs, members), members,
                  {nodes[i].name: m for i, m in of.items()})


def _merged_costs(graph: OpGraph, small: OpGraph, costs: CostModel,
                  members: dict[str, tuple[int, ...]]) -> CostModel:
    """Each merged op's seconds = the sum of its members' (with the per-op calibration cost of
    every member but one folded in, since the simulator charges it once per node)."""
    idx = {n.name: k for k, n in enumerate(small.nodes)}
    n_small = len(small.nodes)
    owner = np.full(len(graph.nodes), -1, dtype=np.int64)
    for name, ids in members.items():
        if small.nodes[idx[name]].kind == "op":
            owner[list(ids)] = idx[name]
    op_ids = np.flatnonzero((owner >= 0) & np.array([n.kind == "op" for n in graph.nodes]))
    grp = owner[op_ids]
    count = np.bincount(grp, minlength=n_small).astype(np.float64)
    fold = (costs.extra_op_s / costs.compute_scale
            if costs.compute_scale > 0 else 0.0) * np.maximum(count - 1, 0)
    per_type = {}
    for key, dc in costs.per_type.items():
        fracs = sorted(set(FRACTIONS) | set(dc.fractions), reverse=True)

        def total(which: str, f: float, dc: DeviceCosts = dc) -> list[float]:
            t = dc.at_many(which, op_ids, f)
            s = np.bincount(grp, weights=t, minlength=n_small)
            s = np.where(s > 0, s + fold, 0.0)
            return s.tolist()

        src = ["free"] * n_small
        for k, n in enumerate(small.nodes):
            if n.kind == "op":
                ms = {dc.source[i] for i in members[n.name] if graph.nodes[i].kind == "op"}
                src[k] = "measured" if "measured" in ms else (sorted(ms)[0] if ms else "free")
        # (eager kernels, whatever ``dc.kernels``: the graph coarsened is the one the costs
        # run, compiled saves and all, and a merged node is no op to fuse again)
        per_type[key] = DeviceCosts(
            key, total("fwd_s", 1.0), total("bwd_s", 1.0), src, dc.overhead_s,
            dict(dc.optimizer_s_per_byte), dict(dc.optimizer_s_per_tensor),
            list(fracs), [total("fwd_s", f) for f in fracs], [total("bwd_s", f) for f in fracs])
    return replace(costs, graph_fingerprint=small.fingerprint, per_type=per_type)


__all__ = ["FRACTIONS", "Coarse", "coarsen", "groups_of"]
