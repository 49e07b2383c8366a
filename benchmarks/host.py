"""How much two CPU ranks of this host slow each other, for two kinds of work.

Run: python benchmarks/host.py [--seconds 2] [--rounds 2]

Each kind of work runs in one process pinned to the first core this process may use, then in
two processes pinned to the first two at the same time, ``--rounds`` times in turn; the table
gives the work done per second per process. Arithmetic on registers shows whether the two
cores are truly separate (hyper-threads of one core slow each other); copying a 16 MiB
array (beyond the caches) shows whether they share memory bandwidth. The second is why, on a
host where it slows, ops that stream memory (element-wise ops, small layers) slow while
another rank computes and large matrix products do not: the profile measures that per op
(``measure_contention``) and the simulator applies it.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
from _common import add_results_option, write_result

from explorer.core.units import table


def _arith(seconds: float) -> float:
    x, n, t_end = 0, 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(1000):
            x += 1
        n += 1
    return n / seconds


def _copy(seconds: float) -> float:
    a = np.ones(16 * 2**20 // 8)
    b = np.empty_like(a)
    n, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        np.copyto(b, a)
        n += 1
    return n * a.nbytes / seconds / 2**30  # GiB/s copied


def _worker(kind: str, core: int, seconds: float, start, out) -> None:
    os.sched_setaffinity(0, {core})
    start.wait()  # both processes start together
    out.put((core, (_arith if kind == "arith" else _copy)(seconds)))


def _run(kind: str, cores: list[int], seconds: float) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(cores)), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(kind, c, seconds, start, out)) for c in cores]
    for p in procs:
        p.start()
    got = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    add_results_option(ap)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("this needs two cores")
    pair = cores[:2]
    rows = []
    for kind, unit in (("arith", "M adds/s"), ("copy", "GiB/s")):
        alone, both = [], []
        for _ in range(args.rounds):  # in turn, so a slow spell of the host hits both
            alone.append(_run(kind, pair[:1], args.seconds)[pair[0]])
            both.extend(_run(kind, pair, args.seconds).values())
        scale = 1e-6 * 1000 if kind == "arith" else 1.0
        a, b = statistics.median(alone), statistics.median(both)
        rows.append((kind, unit, f"{a * scale:.2f}", f"{b * scale:.2f}",
                     f"{(a / b - 1) * 100:+.0f}%"))
    title = f"Two pinned processes against one: cores {pair[0]} and {pair[1]}, " \
            f"{args.rounds} rounds of {args.seconds:g} s"
    head = ("work", "unit", "one process", "each of two", "slower with two")
    print(title)
    print(table(head, rows))
    write_result("host", rows, columns=head, title=title, folder=args.results)


if __name__ == "__main__":
    main()
