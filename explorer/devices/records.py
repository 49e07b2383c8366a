"""Device and link records: what one device is, how long moving bytes between two takes.

Units: bytes, seconds, FLOP/s, bytes/s, watts. Link bandwidths are per direction.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any

from explorer.core.errors import ExplorerError

#: device kinds
KINDS = ("cpu", "cuda")

GiB = 2**30



@dataclass(frozen=True)
class Device:
    """One device that runs part of a training step.

    ``present`` says whether the device is on this machine, so torch can profile and run on it
    through ``torch_device`` (``""`` when not present). ``source`` says where the numbers come
    from. Devices with equal :attr:`type_key` are the same hardware and share one profile.
    ``node``: the server the device is in (devices on different nodes of a cluster talk over
    its ``network_link``).
    """

    id: str
    kind: str
    name: str
    memory_bytes: int
    flops_per_s: float
    half_flops_per_s: float
    mem_bandwidth_bytes_per_s: float
    power_w: float
    idle_power_w: float
    present: bool
    torch_device: str
    source: str
    node: int = 0

    def __post_init__(self) -> None:
        if not self.id:
            raise ExplorerError("a device needs a non-empty id")
        if self.kind not in KINDS:
            raise ExplorerError(
                f"device {self.id!r} has kind {self.kind!r}; use one of: {', '.join(KINDS)}"
            )
        if self.memory_bytes < 0:
            raise ExplorerError(f"device {self.id!r} has negative memory_bytes")
        for name in ("flops_per_s", "half_flops_per_s", "mem_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ExplorerError(f"device {self.id!r} needs {name} > 0, not {value!r}")
        if self.power_w < 0 or self.idle_power_w < 0:
            raise ExplorerError(f"device {self.id!r} has negative power")
        if isinstance(self.node, bool) or not isinstance(self.node, int) or self.node < 0:
            raise ExplorerError(f"device {self.id!r} needs a node number >= 0, not "
                                f"{self.node!r}")

    @property
    def type_key(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class Link:
    """How long moving bytes between two devices takes: ``latency_s + nbytes / bandwidth``.

    ``allreduce_latency_s`` and ``allreduce_bandwidth_bytes_per_s``, when set (> 0), are an
    all-reduce between two ranks measured as a whole (``latency + nbytes / bandwidth``): a
    library's collective is not two point-to-point transfers (gloo on CPU ranks reduces in
    its own threads, in chunks); 0 means "derive it from the link as a ring".

    ``reduce_scatter_*`` and ``allgather_*`` are the same for a two-rank reduce-scatter and
    all-gather (ZeRO's collectives), where the library's own differ from half an all-reduce
    (gloo's reduce-scatter reduces whole tensors and then scatters); 0 means "half the
    all-reduce".

    ``late_receive_s`` is how long a message waits, beyond the transfer, when its receive is
    posted after it was sent while the sender computes: gloo moves a message only once the
    receive is posted, and then the sender's communication thread must get a core, which on
    a host whose cores all compute waits for the scheduler. Measured between CPU ranks of one
    host; 0 where there is no such wait (NCCL, a spare core) or it was not measured.
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    source: str
    allreduce_latency_s: float = 0.0
    allreduce_bandwidth_bytes_per_s: float = 0.0
    late_receive_s: float = 0.0
    reduce_scatter_latency_s: float = 0.0
    reduce_scatter_bandwidth_bytes_per_s: float = 0.0
    allgather_latency_s: float = 0.0
    allgather_bandwidth_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ExplorerError(f"link latency_s must be >= 0, not {self.latency_s!r}")
        if not self.late_receive_s >= 0:
            raise ExplorerError(f"link late_receive_s must be >= 0, not {self.late_receive_s!r}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ExplorerError(
                f"link bandwidth_bytes_per_s must be > 0, not {self.bandwidth_bytes_per_s!r}"
            )

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` one way; nothing to move costs nothing."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


SAME_DEVICE_LINK = Link(0.0, math.inf, "same device")


def json_safe(d: dict[str, Any]) -> dict[str, Any]:
    """A record's fields as JSON-safe values (infinite numbers become ``"inf"``)."""
    return {
        k: ("inf" if v == math.inf else "-inf" if v == -math.inf else v)
        if isinstance(v, float)
        else v
        for k, v in d.items()
    }


def record(cls: type, d: dict[str, Any]) -> Any:
    """An instance of dataclass ``cls`` from a dict written by :func:`json_safe`."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__} must be a dict, not {type(d).__name__}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in d and f.default is not MISSING:  # written before the field existed
            continue
        v = d[f.name]
        if f.type in ("float", float):
            v = float(v)
        elif f.type in ("int", int):
            v = int(v)
        elif f.type in ("bool", bool):
            v = bool(v)
        elif f.type in ("str", str):
            v = str(v)
        kwargs[f.name] = v
    return cls(**kwargs)
