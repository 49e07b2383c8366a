"""How late a gloo message between two busy CPU ranks arrives, by when its receive is posted.

Run: python benchmarks/gloo_send.py [--iters 30] [--sizes 4096,1048576]

Two ranks (one thread each, gloo over loopback, as ``ex.run`` starts them) each compute
(256x256 matrix products) in every iteration. Rank 0 sends a tensor 10 ms in and computes on
for 20 ms; rank 1 asks for it (waits on its receive) at a set time. The table gives how long
rank 1 waited, three ways:

* ``receiver waiting``: rank 1 asks at 5 ms, before the send, and waits for it;
* ``sent first``: rank 1 asks at 15 ms, 5 ms after the send, and posts its receive then
  (what the runtime does: a blocking receive when the task that needs it starts);
* ``sent first, sender idle``: as ``sent first``, but rank 0 sleeps instead of computing
  after its send (as a rank blocked on a receive of its own does);
* ``posted ahead``: the same as ``sent first``, with the receive posted at the start of the
  iteration.

For ``receiver waiting`` the wait is the time until the send (about 5 ms) plus the transfer;
for the other two the data was sent 5 ms before it was needed, so any wait is lateness.
Gloo moves a message only once its receive is posted: a send made before that completes
only when the receiver's request reaches the sender's communication thread, which, while
both ranks compute on a host with no spare core, waits for the scheduler.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import add_results_option, write_result

from explorer.core.units import table
from explorer.platforms.net import free_port

CASES = ("receiver waiting", "sent first", "sent first, sender idle", "posted ahead")




def _compute(a: torch.Tensor, ms: float) -> None:
    t_end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < t_end:
        a @ a


def _rank(rank: int, port: int, iters: int, sizes: list[int], out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    a = torch.randn(256, 256)
    got = {}
    for case in CASES:
        ask_ms = 5.0 if case == "receiver waiting" else 15.0
        for size in sizes:
            waits = []
            for it in range(iters):
                dist.barrier()
                if rank == 0:
                    x = torch.ones(size // 4)
                    _compute(a, 10.0)
                    work = dist.isend(x, 1, tag=it)
                    if case == "sent first, sender idle":
                        time.sleep(0.02)
                    else:
                        _compute(a, 20.0)
                    work.wait()
                    continue
                y = torch.empty(size // 4)
                work = dist.irecv(y, 0, tag=it) if case == "posted ahead" else None
                _compute(a, ask_ms)
                t0 = time.perf_counter()
                if work is None:
                    dist.recv(y, 0, tag=it)
                else:
                    work.wait()
                waits.append(time.perf_counter() - t0)
            if rank == 1:
                got[case, size] = waits[3:]  # the first few warm the connection up
    if rank == 1:
        out.put(got)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sizes", default="4096,1048576", help="message sizes in bytes")
    add_results_option(ap)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.iters, sizes, out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = out.get()
    for p in procs:
        p.join()
    rows = []
    for case in CASES:
        for size in sizes:
            w = sorted(got[case, size])
            rows.append((case, f"{size / 1024:g} KiB", f"{statistics.median(w) * 1e3:.2f}",
                         f"{w[int(0.9 * (len(w) - 1))] * 1e3:.2f}", f"{w[-1] * 1e3:.2f}"))
    title = (f"2 gloo ranks on {os.cpu_count()} cores, {args.iters} iterations each "
             "(rank 1's wait on its receive, ms)")
    head = ("receive", "message", "median", "p90", "max")
    print(title)
    print(table(head, rows))
    write_result("gloo-send", rows, columns=head, title=title, folder=args.results)


if __name__ == "__main__":
    main()
