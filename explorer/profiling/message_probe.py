"""What a tensor sent between two CPU ranks costs their processors, measured through the runtime.

Profiling times each op on one rank; what a step on several ranks adds is the work of moving
tensors between them: posting the send, matching and allocating the receive, and waking a rank
that blocked waiting (on a virtual machine this grows with how long it slept). The probe runs
the built-in tiny MLP split in two stages with four micro-batches on two real CPU ranks, and
divides the busy time the ranks spent beyond the profile's prediction by the messages they
exchanged (the two stages run different ops, which do not slow each other measurably). The
result (``CostModel.message_s``) is measured once per host and torch version and cached
beside the CPU rank profile; calibration refines it from your own runs.
"""

from __future__ import annotations

import time
from dataclasses import replace

from explorer.devices import cluster as _cl

PROBE_KEY = "runtime message cost, stages not slowing each other"


def cpu_message_s(cluster: _cl.Cluster) -> float:
    """Seconds of processor time per message at each end between CPU ranks of this host
    (0.0 when ``cluster`` has fewer than two measured CPU ranks, or the probe fails)."""
    cpus = [d for d in cluster.devices if d.kind == "cpu" and d.present]
    if len(cpus) < 2 or not cluster.default_link.source.startswith("measured"):
        return 0.0
    path, key = _cl._cache_file(), f"{_cl._cache_key()}|{PROBE_KEY}"
    memo = _MEMO.get((str(path), key))
    if memo is not None:
        return memo
    cached = _cl._read_cache(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("message_s"), (int, float)) \
            and cached["message_s"] >= 0:
        _MEMO[(str(path), key)] = float(cached["message_s"])
        return float(cached["message_s"])
    try:
        value = measure_message_s()
    except Exception:  # a probe that cannot run leaves the cost unknown (0), not an error
        _MEMO[(str(path), key)] = 0.0
        return 0.0
    _MEMO[(str(path), key)] = value
    _cl._write_cache(path, key, {"message_s": value,
                                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "how": "tiny MLP, 2 stages x 4 micro-batches on 2 CPU ranks, "
                                        "busy time beyond the profile / messages"})
    return value


_MEMO: dict[tuple[str, str], float] = {}


def measure_message_s(steps: int = 8, warmup: int = 3) -> float:
    """Run the probe (a few seconds) and return seconds per message per end."""
    from explorer.capture.tracing import capture
    from explorer.models.builtin import build
    from explorer.partition import partition
    from explorer.profiling.profiler import profile
    from explorer.runtime.launch import run
    from explorer.simulate.simulator import simulate

    bm = build("mlp", "tiny")
    graph = capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="probe")
    two = _cl.Cluster.cpu(2)
    costs = profile(graph, two, progress=False, message=False)
    plan = partition(graph, two, costs, "even-layers", micro_batches=4)
    meas = run(graph, plan=plan, costs=costs, steps=steps, warmup=warmup, progress=False)
    base = simulate(graph, plan, costs).busy_s
    probe = simulate(graph, plan, replace(costs, message_s=1e-3)).busy_s
    messages = sum((probe[d] - base[d]) / 1e-3 for d in base)
    extra = sum(meas.busy_s[d] - base[d] for d in base)
    return max(0.0, extra / messages) if messages > 0 else 0.0


__all__ = ["cpu_message_s", "measure_message_s"]
