"""PaSE's cost model: layer facts, the configurations offered, unary and re-distribution costs."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from explorer.core.graph import OpGraph
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.partition.bounds import distinct_links
from explorer.partition.pase.problem import Config
from explorer.simulate.simulator import BUCKET_BYTES

#: ops whose layer is "fully connected" for the one-weird-trick reference
_LINEAR_OPS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default",
               "aten.matmul.default")


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
class LayerEdge:
    a: int
    b: int
    nbytes: int
    tensors: int
    grad: bool


def node_layers(graph: OpGraph, layers: Sequence[Sequence[int]]) -> list[int]:
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


def layer_edges(graph: OpGraph, layer_of: Sequence[int], n_layers: int
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


def feature_limit(graph: OpGraph, layer: Sequence[int]) -> int:
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


def layer_infos(graph: OpGraph, costs: CostModel, ids: Sequence[str],
                 layers: Sequence[Sequence[int]], optimizer: str
                 ) -> tuple[list[LayerInfo], list[LayerEdge]]:
    nodes = graph.nodes
    layer_of = node_layers(graph, layers)
    reps: dict[str, str] = {}
    for dev in ids:
        reps.setdefault(costs.cluster.device(dev).type_key, dev)
    fixed_mem = node_memory_bytes(graph, optimizer, 1, 0.0)
    full_mem = node_memory_bytes(graph, optimizer, 1, 1.0)
    edges, edge_grad, out_bytes, grad_in = layer_edges(graph, layer_of, len(layers))
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
            feature_limit(graph, layer), fc and gbytes > 0))
    return infos, [LayerEdge(a, b, nb, cnt, edge_grad[(a, b)])
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
def cached_configs(p: int, batch_size: int, max_feature: int, max_configs: int,
             batch_only: bool) -> tuple[Config, ...]:
    """:func:`layer_configs`, remembered: many layers ask for the same few."""
    return layer_configs(p, batch_size, max_feature, max_configs, batch_only)


def slowest_link(costs: CostModel, ids: Sequence[str]) -> tuple[float, float]:
    """(latency, seconds per byte) of the slowest link among ``ids`` (0, 0 for one device)."""
    lat = spb = 0.0
    for link in distinct_links(costs.cluster, ids):  # (not every pair: 8M at 4,096 devices)
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


def edge_matrix(e: LayerEdge, fwd: np.ndarray, bwd: np.ndarray, lat: float,
                 spb: float) -> np.ndarray:
    """An edge's cost per configuration pair from the missing fractions each way."""
    def move(frac: np.ndarray) -> np.ndarray:
        return np.where(frac > 0, e.tensors * lat + frac * (e.nbytes * spb), 0.0)

    return move(fwd) + move(bwd) if e.grad else move(fwd)


__all__ = ["LayerEdge", "LayerInfo", "cached_configs", "edge_matrix", "feature_limit",
           "layer_configs", "layer_edges", "layer_infos", "missing_fraction", "node_layers",
           "ring_allreduce_s", "slowest_link", "split_factors", "unary_cost_s"]
