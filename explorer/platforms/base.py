"""The platform interface: what a kind of host adds to the general model of devices and links.

The cost model and the simulator describe devices by their speeds and links by latency and
bandwidth. A platform adds what a particular way of running ranks does beyond that: ranks of
one host slowing each other, the runtime's processor time per message, a receive that waits
for a busy core, how a rank process is set up. :class:`Platform` itself is neutral (every hook
adds nothing): the profiler, cost model and simulator consult the platform of each device
(:func:`explorer.platforms.platform_of`) and need no branch of their own per kind of device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from explorer.platforms.load import HostLoad


class Platform:
    """A platform whose hooks are all neutral; subclasses override what their host adds."""

    #: short name, for messages
    name = "none"
    #: whether replicas of one stage share a host and may slow each other, so the profiler
    #: measures it (:attr:`explorer.costs.model.DeviceCosts.contention` and its companions)
    replicas_share_host = False
    #: whether the collectives of a sequence-parallel tensor split can run piece by piece
    #: beside the matrix products that read or make them (async tensor parallelism: torch's
    #: needs symmetric memory between the devices); where not, a plan that asks for it runs
    #: them before or after the product, as plain sequence parallelism does
    pipelines_tensor_collectives = False

    def op_slowdown(self, contention: np.ndarray, beside: float) -> np.ndarray | None:
        """Factors on the ops' seconds of a device with ``beside`` other replicas of its stage
        computing the same ops at the same moment, given the profile's per-op ``contention``
        (how much slower each ran beside one other replica); None: no slowdown."""
        return None

    def optimizer_slowdown(self, optimizer_contention: float, beside: float) -> float:
        """Factor on the optimizer step's seconds of a device with ``beside`` other replicas
        stepping the same parameters at the same moment."""
        return 1.0

    def replica_lag_s(self, replica_spread: float, busy_s: float, replicas: int) -> float:
        """How long a replicated stage's gradient all-reduce waits, on average, for its slowest
        replica, given the profile's ``replica_spread`` and the stage's busy seconds."""
        return 0.0

    def message_s(self, fitted_s: float) -> float:
        """Processor seconds a device spends on each tensor it sends or receives between
        devices, given the cost model's fitted ``CostModel.message_s``."""
        return 0.0

    def late_receive_s(self, link_late_receive_s: float) -> float:
        """How long a message waits beyond its transfer when its receive is posted after it
        was sent while the sender computes, given the link's ``Link.late_receive_s``."""
        return 0.0

    def pin_rank(self, local_rank: int, threads: int = 1) -> tuple[int, ...] | None:
        """Set up the calling rank process's cores; the cores, or None where not pinned."""
        return None

    def hold_freed_memory(self) -> bool:
        """Set up the rank process's allocator to keep what it frees; whether it did."""
        return False

    def busy_host(self, load: HostLoad) -> str | None:
        """Why the host, under ``load`` while a profile was measured, was too busy for the
        profile of this platform's devices to hold once it is quiet (words for a warning), or
        None when it was not."""
        return None

    def rank_settings_tag(self) -> str:
        """How this platform's rank processes are set up, as a cache key suffix ("" when
        there is nothing to tell apart)."""
        return ""


#: the neutral platform
NO_PLATFORM = Platform()
