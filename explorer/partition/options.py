"""The options several partitioners share: their defaults and meaning, written once.

Partitioners keep these as keyword arguments (the CLI, widgets and tests pass them by name,
and the registry reads each partitioner's options off its signature); inside, they gather
them into one :class:`Options` and hand that to the shared helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from explorer.core.errors import ExplorerError
from explorer.core.plan import SCHEDULES
from explorer.devices.cluster import Cluster

#: the options of the op-level list-scheduling partitioners (ParDNN, m-TOPO, m-ETF, m-SCT),
#: in the order they appear in those partitioners' signatures and plan options
SEARCH_OPTIONS = ("k", "optimizer", "memory_fraction", "baselines", "sweep_devices",
                  "simulate_max_nodes")


@dataclass(frozen=True)
class Options:
    """Options shared by several partitioners; each partitioner takes the fields it uses.

    Attributes
    ----------
    k : int, optional
        Number of devices to use: the cluster's first ``k`` (default: all).
    optimizer : str
        Optimizer whose state counts towards memory and whose step counts towards time
        (default ``"adam"``: 2 extra bytes of state per parameter byte).
    compare_baselines : bool
        Simulate the plan against ``single`` and ``data-parallel`` (at any graph size) and
        return the fastest that fits (a note says when it is a baseline): the registry's
        final check, :mod:`explorer.partition.guard`, and a baseline when no split fits.
        Default True; False returns the partitioner's own plan unchecked.
        (pipeline-dp, min-comm, pase)
    memory_fraction : float
        Fraction of each device's memory a plan may fill (default 1.0: all of it).
    baselines : bool
        Also consider the ``single`` and ``data-parallel`` plans and return the best (among
        the search's candidates, and by the registry's final check at any graph size); False
        returns the search's own plan unchecked.
    sweep_devices : bool
        On graphs scored by simulation, also try the fastest 2, 4, ... devices.
    simulate_max_nodes : int
        Largest graph whose candidates are compared with the simulator (default 5,000);
        larger graphs are compared by a list-scheduling estimate and additive memory, and
        only the plan chosen is simulated, against the baselines, by the final check.
    """

    k: int | None = None
    optimizer: str = "adam"
    compare_baselines: bool = True
    memory_fraction: float = 1.0
    baselines: bool = True
    sweep_devices: bool = True
    simulate_max_nodes: int = 5000

    def devices(self, cluster: Cluster) -> tuple[str, ...]:
        """The cluster's first ``k`` device ids (all when ``k`` is None)."""
        return first_devices(cluster, self.k)

    def pick(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The options ``names`` as a plain dict, in that order (for ``plan.options``)."""
        return {nm: getattr(self, nm) for nm in names}


def first_devices(cluster: Cluster, k: int | None) -> tuple[str, ...]:
    """The cluster's first ``k`` device ids (all when ``k`` is None); raises for a bad ``k``."""
    n = len(cluster) if k is None else k
    if not 1 <= n <= len(cluster):
        raise ExplorerError(f"k={k} devices asked for, but the cluster has {len(cluster)}")
    return cluster.ids[:n]


def check_schedule(schedule: str) -> None:
    """Raise for a pipeline schedule the simulator and runtime do not know."""
    if schedule not in SCHEDULES:
        raise ExplorerError(f"unknown schedule {schedule!r}; choose one of "
                            f"{', '.join(SCHEDULES)}")


def check_micro_batches(micro_batches: int | None) -> None:
    """Raise for a micro-batch count below 1 (None: the partitioner chooses)."""
    if micro_batches is not None and int(micro_batches) < 1:
        raise ExplorerError(f"micro_batches must be >= 1, not {micro_batches}")


def whole_numbers(values: Sequence[int], refusal: str) -> tuple[int, ...]:
    """``values`` as a tuple, at least one, each a whole number 1 or more:
    :class:`ExplorerError` with ``refusal`` followed by the values, if not."""
    out = tuple(values)
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise ExplorerError(f"{refusal}, not {list(out)!r}")
    return out


__all__ = ["SEARCH_OPTIONS", "Options", "check_micro_batches", "check_schedule",
           "first_devices", "whole_numbers"]
