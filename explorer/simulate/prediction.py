"""What the simulator predicts: the Prediction record, timeline intervals, memory breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Interval:
    """One task on the timeline. ``lane`` is "compute", "comm" or, on a device with two
    timelines (a GPU), "host": its host issuing a task (``kind`` "issue")."""

    device: str
    lane: str
    kind: str
    start_s: float
    end_s: float
    label: str
    micro_batch: int = -1


@dataclass(frozen=True)
class MemoryBreakdown:
    """A device's memory at its peak moment, by what fills it."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    buffers_bytes: int
    activations_bytes: int  # live activations and activation gradients at the peak
    gathered_bytes: int = 0  # full copies of ZeRO-3 sharded weights live at the peak
    #: held by the device's math libraries for the whole run (cuBLAS workspaces on a GPU)
    workspace_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.buffers_bytes + self.activations_bytes + self.gathered_bytes
                + self.workspace_bytes)


class Deferred:
    """A :class:`Prediction` field's value, computed when the field is first read."""

    def build(self) -> Any:
        raise NotImplementedError


class BuiltOnRead:
    """A dataclass field that may be given as a :class:`Deferred`: the first read builds the
    value and keeps it. Any other value is stored and read back as is."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            raise AttributeError(self.name)  # no default value for the dataclass field
        value = obj.__dict__[self.name]
        if isinstance(value, Deferred):
            value = obj.__dict__[self.name] = value.build()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


#: how many devices over their memory :meth:`Prediction.memory_report` names one by one
REPORTED_DEVICES = 3


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one step of a plan.

    ``timeline`` is a tuple of :class:`Interval` sorted by device and start, and
    ``critical_path`` a tuple of task labels; for large graphs these are big, so the simulator
    builds them when they are first read.
    """

    step_s: float
    busy_s: dict[str, float]
    timeline: tuple[Interval, ...] = BuiltOnRead()  # type: ignore[assignment]
    memory: dict[str, MemoryBreakdown]
    capacity_bytes: dict[str, int]
    transfer_bytes: int
    allreduce_bytes: int
    energy_j: float
    energy_by_device_j: dict[str, float]
    critical_path: tuple[str, ...] = BuiltOnRead()  # type: ignore[assignment]
    bottleneck: str
    lower_bound_s: float
    algorithm: str
    #: per device with two timelines (a GPU), the seconds its host spends issuing the step's
    #: ops; a step no shorter than this is host-bound (empty where every device has one)
    host_busy_s: dict[str, float] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> dict[str, int]:
        return {d: m.total_bytes for d, m in self.memory.items()}

    @property
    def cross_device_bytes(self) -> int:
        return self.transfer_bytes + self.allreduce_bytes

    @property
    def over_memory_bytes(self) -> dict[str, int]:
        """Devices whose peak exceeds their memory, and by how many bytes."""
        return {d: self.peak_bytes[d] - c for d, c in self.capacity_bytes.items()
                if self.peak_bytes[d] > c}

    @property
    def fits(self) -> bool:
        return not self.over_memory_bytes

    @property
    def gap(self) -> float:
        """How far the step is above the lower bound, as a fraction (0.25 = 25 % slower)."""
        return self.step_s / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else 0.0

    @property
    def throughput_per_s(self) -> float:
        return 1.0 / self.step_s if self.step_s > 0 else 0.0

    def memory_report(self) -> str:
        """Which devices do not fit and by how much, in words ("" when all fit); beyond
        :data:`REPORTED_DEVICES` devices, how many and the one over by the most."""
        over = self.over_memory_bytes
        if len(over) > REPORTED_DEVICES:
            worst = max(over, key=over.__getitem__)
            return (f"{len(over)} devices do not fit; the most, {worst}, needs "
                    f"{self.peak_bytes[worst] / 2**20:,.1f} MiB but has "
                    f"{self.capacity_bytes[worst] / 2**20:,.1f} MiB (over by "
                    f"{over[worst] / 2**20:,.1f} MiB)")
        return "; ".join(
            f"{d} needs {self.peak_bytes[d] / 2**20:,.1f} MiB but has "
            f"{self.capacity_bytes[d] / 2**20:,.1f} MiB (over by {b / 2**20:,.1f} MiB)"
            for d, b in over.items())
