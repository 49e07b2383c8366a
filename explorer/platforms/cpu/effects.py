"""The CPU platform: what CPU ranks sharing one host add to the general model, and how it applies.

Ranks of one host share its cores, memory bandwidth and caches. What the profiler measures of
that (:class:`ReplicaEffects`, kept with each device type's profile), what the runtime spends
per message and how long a late-posted receive waits (kept with the cost model and the link)
are applied here: :class:`CpuPlatform` is what the simulator asks for CPU ranks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from scipy.special import ndtr

from explorer.platforms.base import Platform
from explorer.platforms.cpu.host import busy_problem
from explorer.platforms.cpu.ranks import hold_freed_memory, pin_cpu_rank, rank_settings_tag
from explorer.platforms.load import HostLoad


class ReplicaEffects(NamedTuple):
    """How two replicas computing side by side on one host slow each other, as measured by
    :func:`explorer.profiling.host.measure_contention` (stored in ``DeviceCosts``).

    ``contention``: per node, how much slower its forward + backward ran beside the other
    replica than alone (1.0: no slower); ``replica_spread``: how far the busier replica's busy
    time ran past the two replicas' mean, as a fraction of it; ``optimizer_contention``: how
    much slower the optimizer step ran beside the other replica's.
    """

    contention: list[float]
    replica_spread: float
    optimizer_contention: float


#: nothing measured: no effect
NO_EFFECTS = ReplicaEffects([], 0.0, 1.0)


@functools.cache
def expected_max_normal(k: int) -> float:
    """E[max of k independent standard normal samples] (0.564 for 2, 1.029 for 4, 1.424 for
    8): the integral of x k phi(x) Phi(x)^(k-1) over x."""
    x = np.linspace(-10.0, 10.0, 20001)
    density = k * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi) * ndtr(x) ** (k - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))


class CpuPlatform(Platform):
    """CPU ranks, one process each, talking over gloo on one host.

    Replicas of a stage run the same op at the same moment, the case the profile measures:
    each op is slowed by ``1 + (ratio - 1) x others`` for ``others`` replicas beside it, and
    so is the optimizer step. Different stages computing at once run different ops, and are
    not slowed (each rank's measured busy time in pipelines matched one rank's op times; see
    docs/accuracy.md). The gradient all-reduce waits for the slowest replica: the measured
    spread of two replicas' busy time, scaled to ``k`` replicas as the expected largest of
    ``k`` normal samples is to the largest of two. gloo moves a message only once its receive
    is posted, and then needs the sender's communication thread to get a core: a receive
    posted late while the sender computes waits the link's measured ``late_receive_s``.
    """

    name = "cpu"
    replicas_share_host = True

    def op_slowdown(self, contention: np.ndarray, beside: float) -> np.ndarray | None:
        if not beside or not len(contention):
            return None
        return 1.0 + (contention - 1.0) * beside

    def optimizer_slowdown(self, optimizer_contention: float, beside: float) -> float:
        if not beside:
            return 1.0
        return 1.0 + (optimizer_contention - 1.0) * beside

    def replica_lag_s(self, replica_spread: float, busy_s: float, replicas: int) -> float:
        if replica_spread <= 0.0:
            return 0.0
        return replica_spread * busy_s * expected_max_normal(replicas) / expected_max_normal(2)

    def message_s(self, fitted_s: float) -> float:
        return fitted_s

    def late_receive_s(self, link_late_receive_s: float) -> float:
        return link_late_receive_s

    def pin_rank(self, local_rank: int, threads: int = 1) -> tuple[int, ...] | None:
        return pin_cpu_rank(local_rank, threads)

    def hold_freed_memory(self) -> bool:
        return hold_freed_memory()

    def rank_settings_tag(self) -> str:
        return rank_settings_tag()

    def busy_host(self, load: HostLoad) -> str | None:
        return busy_problem(load)


CPU_PLATFORM = CpuPlatform()
