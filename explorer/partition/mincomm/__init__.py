"""Min-communication partitioning: balanced k-way cuts of the op graph whose stage graph is acyclic.

The idea of compiler-driven model parallelism (arXiv 1906.08168): treat the dataflow graph
as a weighted graph, nodes weighted by compute seconds and edges by transfer seconds, and
split it into ``k`` parts of balanced compute with the least communication, keeping the
quotient graph (parts as nodes) acyclic so the parts can run as stages without deadlock.

The recipe is the multilevel scheme of METIS (Karypis and Kumar, SIAM J. Sci. Comput. 1998)
made acyclic as in Herrmann, Özkaya, Uçar, Kaya and Çatalyürek, "Multilevel algorithms for
acyclic partitioning of directed acyclic graphs" (SIAM J. Sci. Comput. 2019). It works on
units (an op with the parameters, buffers and inputs it reads first):

1. Coarsen by heavy-edge matching along a topological order: only nodes next to each other in
   that order merge, so every coarse node is an interval of it and every coarse graph is a DAG.
2. Partition the coarsest graph by topological-order growth: cut the order into ``k``
   intervals, the cut points chosen by dynamic programming to cross the least weight under
   the compute and memory limits.
3. Uncoarsen, refining boundary nodes at every level Fiduccia-Mattheyses style (Fiduccia and
   Mattheyses, DAC 1982): moves by best gain with a priority queue, locked once moved, with
   roll-back to the best prefix. Parts are kept in execution order and a move is legal only if
   it keeps every edge going from a part to the same or a later part, so no move can create a
   cycle between parts.

Pinned units keep their part; the parts take an order the pins allow, and only nodes with the
same pin bounds merge, so every level stays consistent with the pins. The even-layers split,
refined the same way, competes as a second start: when it is balanced, the result never cuts
more than it. Communication is counted per tensor and destination (connectivity - 1 of the
hyperedge of a tensor and its readers), as the simulator sends it.

Modules: :mod:`.units` (weights and the finest level), :mod:`.level` (the multilevel graph),
:mod:`.refine` (interval split and FM refinement), :mod:`.parts` (the whole k-way split),
:mod:`.partitioner` (the registered ``min-comm``).
"""

from __future__ import annotations

from explorer.partition.mincomm.partitioner import min_comm
from explorer.partition.mincomm.parts import MinCommResult, min_comm_parts
from explorer.partition.mincomm.units import cut_seconds, net_weights_s, node_weights_s

__all__ = ["MinCommResult", "cut_seconds", "min_comm", "min_comm_parts", "net_weights_s",
           "node_weights_s"]
