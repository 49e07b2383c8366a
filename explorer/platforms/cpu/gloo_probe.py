"""One of the two processes that measure the gloo link between CPU ranks of this host.

Run as ``python -m explorer.platforms.cpu.gloo_probe RANK PORT TIMEOUT_S`` (two of them, ranks
0 and 1, by :func:`explorer.platforms.cpu.host.measure_gloo_link`). Each sets itself up as the
runtime sets up its CPU ranks, then both measure: send/recv ping-pong latency and bandwidth,
a two-rank all-reduce, reduce-scatter and all-gather, and the late-receive wait (a message sent
before its receive is posted while both ranks compute). Rank 0 prints one JSON line. A
watchdog ends the process at ``TIMEOUT_S`` should its parent be gone.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from explorer.platforms.cpu.ranks import hold_freed_memory, pin_cpu_rank

PING_REPS = 200
BULK_REPS = 10
BULK_BYTES = 8 * 2**20
LATE_REPS = 60
LATE_AHEAD_S = 0.003
LATE_TAIL_S = 0.008


def main(argv: list[str]) -> None:
    rank, port, timeout_s = int(argv[0]), int(argv[1]), float(argv[2])
    watchdog = threading.Timer(timeout_s, os._exit, (3,))
    watchdog.daemon = True
    watchdog.start()
    torch.set_num_threads(1)
    pin_cpu_rank(rank)  # as the runtime sets up its CPU ranks
    hold_freed_memory()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s),
    )

    def pingpong(t: torch.Tensor, reps: int) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / 2

    small = torch.zeros(1)
    pingpong(small, 20)
    latency = pingpong(small, PING_REPS)
    big = torch.zeros(BULK_BYTES // 4)
    pingpong(big, 2)
    one_way = pingpong(big, BULK_REPS)

    def timed(fn, reps: int) -> float:
        """The median of ``reps`` calls of collective ``fn``, both ranks starting together."""
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def allreduce(t: torch.Tensor, reps: int) -> float:
        return timed(lambda: dist.all_reduce(t), reps)

    allreduce(small, 10)
    ar_small = allreduce(small, PING_REPS // 2)
    allreduce(big, 2)
    ar_big = allreduce(big, BULK_REPS)

    # ZeRO's collectives: a whole tensor of the size above reduce-scattered into halves, and
    # halves all-gathered into it
    figures = {}
    for name, size in (("small", 2), ("big", big.numel())):
        whole, half = torch.zeros(size), torch.zeros(size // 2)
        reps = PING_REPS // 2 if name == "small" else BULK_REPS
        for kind, fn in (("rs", lambda h=half, w=whole: dist.reduce_scatter_tensor(h, w)),
                         ("ag", lambda h=half, w=whole: dist.all_gather_into_tensor(w, h))):
            timed(fn, 2)
            figures[f"{kind}_{name}_s"] = timed(fn, reps)
    # late receive: both ranks compute (small matrix products); rank 1 sends LATE_AHEAD_S
    # before rank 0 posts the receive, and computes on until LATE_TAIL_S after it; the data
    # was there, so rank 0's whole wait is lateness
    a = torch.randn(256, 256)

    def compute(s: float) -> None:
        t_end = time.perf_counter() + s
        while time.perf_counter() < t_end:
            a @ a

    def late(reps: int) -> list[float]:
        waits = []
        for it in range(reps):
            dist.barrier()
            if rank == 1:
                compute(LATE_AHEAD_S)
                work = dist.isend(small, 0, tag=it)
                compute(LATE_AHEAD_S + LATE_TAIL_S)
                work.wait()
            else:
                compute(2 * LATE_AHEAD_S)
                t0 = time.perf_counter()
                dist.recv(small, 1, tag=it)
                waits.append(time.perf_counter() - t0)
        return waits

    late(5)
    waits = sorted(late(LATE_REPS))
    cut = len(waits) // 10
    late_s = statistics.fmean(waits[cut:len(waits) - cut]) if rank == 0 else 0.0
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"latency_s": latency, "one_way_s": one_way, "ar_small_s": ar_small,
                          "ar_big_s": ar_big, "late_s": late_s, **figures}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
