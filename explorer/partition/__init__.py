"""Partitioners: plain functions ``(graph, cluster, costs, **options) -> Plan``, registered by name.

Every partitioner's plan goes through the same simulator, so they compare fairly. ``pins``
(node name -> device id) fix nodes to devices; every partitioner honours them.

Layout: :mod:`.registry` (register, look up, run), :mod:`.options` (the options several
partitioners share), :mod:`.search` (helpers the algorithms share), then one module or
subpackage per algorithm; no algorithm imports another (WAP and degrees look the others up by
name), but degrees builds its estimate on pipeline-dp's per-layer cost table and cut DP tables.
"""

from __future__ import annotations

from explorer.partition.registry import Algorithm, algorithm, algorithms, partition, register

__all__ = ["Algorithm", "algorithm", "algorithms", "partition", "register"]
