"""PaSE's feature splits as a runnable plan: one stage of ``replicas x tensor`` devices split by
the Megatron tensor layout, and what of the strategy that leaves out.

A plan splits layers only as a stage's tensor degree with the layout of
:func:`explorer.core.tensor_layout.megatron_layout` (column- then row-parallel linears,
vocabulary-parallel embeddings), the same degree for every layer of the stage. So PaSE's
strategy maps onto one stage holding every layer, its tensor degree the feature split that
most of PaSE's split layers use and the layout splits, its replica count the batch split most
layers use with it (dividing the batch, and fitting the devices). What PaSE does differently is
listed: layers it splits that the layout keeps whole (attention, a lone linear) or splits at
another degree, layers the layout splits that PaSE keeps whole, layers at another batch split.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.tensor_layout import megatron_layout
from explorer.partition.guard import replicated
from explorer.partition.pase.model import PaseModel
from explorer.partition.pase.strategy import PaseResult


@dataclass(frozen=True)
class TensorMapping:
    """PaSE's strategy as ``replicas x tensor`` devices, and the layers that differ."""

    replicas: int
    tensor: int
    #: layers PaSE splits by features that the layout keeps whole or splits otherwise
    not_split: tuple[str, ...]
    #: layers the layout splits that PaSE keeps whole
    extra_split: tuple[str, ...]
    #: layers whose batch split PaSE chose differently from ``replicas``
    other_batch: tuple[str, ...]

    @property
    def devices(self) -> int:
        return self.replicas * self.tensor

    def note(self) -> str:
        parts = []
        for what, names in (("split by PaSE but kept whole or split another way by the "
                             "Megatron layout", self.not_split),
                            ("split by the layout but kept whole by PaSE", self.extra_split),
                            (f"at another batch split than {self.replicas}", self.other_batch)):
            if names:
                parts.append(f"{len(names)} layers {what} ({', '.join(names[:3])}"
                             f"{', ...' if len(names) > 3 else ''})")
        return "; ".join(parts) if parts else "nothing"


def tensor_mapping(graph: OpGraph, model: PaseModel, res: PaseResult, n_devices: int
                   ) -> TensorMapping | None:
    """The stage mesh closest to ``res``'s strategy (module docstring); None when no feature
    degree PaSE uses splits a weight the layout can split, or no replica count fits."""
    split_ops: dict[int, frozenset[str]] = {}
    votes: Counter[int] = Counter()
    for f in sorted({c.feature for c in res.configs if c.feature > 1}):
        if n_devices % f:
            continue
        layout = megatron_layout(graph, f)
        split_ops[f] = layout.split_ops
        votes[f] = sum(1 for j, c in enumerate(res.configs) if c.feature == f
                       and _splits(graph, model, j, layout.split_ops))
    if not votes or max(votes.values()) == 0:
        return None
    tensor = max(votes, key=lambda f: (votes[f], f))
    batch = graph.batch_size
    counts = Counter(c.batch for c in res.configs if c.feature == tensor)
    fits = [b for b in counts if b * tensor <= n_devices and (batch <= 0 or batch % b == 0)]
    if not fits:
        fits = [1]
    replicas = max(fits, key=lambda b: (counts[b], b))
    split = split_ops[tensor]
    not_split, extra, other = [], [], []
    for j, (name, c) in enumerate(zip(res.layer_names, res.configs, strict=True)):
        by_layout = _splits(graph, model, j, split)
        if c.feature > 1 and (c.feature != tensor or not by_layout):
            not_split.append(name)
        elif c.feature == 1 and by_layout:
            extra.append(name)
        if c.batch != replicas and _has_work(graph, model, j):
            other.append(name)
    return TensorMapping(replicas, tensor, tuple(not_split), tuple(extra), tuple(other))


def _splits(graph: OpGraph, model: PaseModel, j: int, split_ops: frozenset[str]) -> bool:
    return any(graph.nodes[i].name in split_ops for i in model.layers[j])


def _has_work(graph: OpGraph, model: PaseModel, j: int) -> bool:
    return any(graph.nodes[i].kind == "op" for i in model.layers[j])


def tensor_plan(graph: OpGraph, mapping: TensorMapping, ids: Sequence[str], optimizer: str,
                pins: Mapping[str, str], options: Mapping, notes: Sequence[str]) -> Plan | None:
    """One stage on the first ``replicas x tensor`` devices split ``tensor`` ways; None when
    a pinned device is not among them."""
    devices = tuple(ids[:mapping.devices])
    if any(dev not in devices for dev in pins.values()):
        return None
    opts = {**options, "stage_layers": [[0, options.get("layers", 0)]],
            "replicas": [mapping.replicas], "dp": mapping.replicas, "tp": mapping.tensor,
            "pp": 1, "degrees": f"{mapping.replicas}x{mapping.tensor}x1"}
    plan = replicated(graph, devices, algorithm="pase", optimizer=optimizer, options=opts,
                      pinned=frozenset(pins), notes=tuple(notes))
    return plan.with_tensor(mapping.tensor)


__all__ = ["TensorMapping", "tensor_mapping", "tensor_plan"]
