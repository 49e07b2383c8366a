"""Size limits shared by plans, clusters and the work they ask for, each defined once here.

A plan file, a device spec and a command line are input from people (and a plan file from
anyone): every size they can ask for is bounded, and each bound is checked before the work
or the memory it bounds, with an error that names the limit.
"""

from __future__ import annotations

from explorer.core.units import GiB

#: the most devices a cluster may have and a plan may use (stage numbers run below it)
MAX_DEVICES = 4096
#: the most samples a plan's recorded model batch (``model.batch_size``) may ask for
MAX_BATCH_SIZE = 2**20
#: the most memory one simulation may build its task graph in (tasks x bytes per task)
MAX_SIMULATION_BYTES = 4 * GiB
#: the memory the simulator takes per task (a forward, backward or transfer of a micro-batch),
#: measured at 450-600 bytes on graphs of 5,000-20,000 nodes with 1-64 stages and 1-64
#: micro-batches
SIMULATION_BYTES_PER_TASK = 512

__all__ = ["MAX_BATCH_SIZE", "MAX_DEVICES", "MAX_SIMULATION_BYTES", "SIMULATION_BYTES_PER_TASK"]
