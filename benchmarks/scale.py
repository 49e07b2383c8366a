"""Scale benchmark: wall time of every partitioner and of the simulator on large graphs.

Run: python benchmarks/scale.py [--sizes 1k,10k,100k] [--graphs layered,gpt]
         [--algorithms all] [--repeat 1] [--timeout 0] [--reference OLD_SIMULATE.py]

Graphs: random layered DAGs (``explorer.models.synthetic.layered_dag``) and a captured tiny GPT
whose transformer blocks are tiled to the size (``explorer.models.synthetic.replicated``), on the
``8xH100`` preset with roofline costs (no profiling). For every graph and size, each registered
partitioner runs (those that refuse a graph, such as exact searches over their limits, are
listed with their message; with ``--timeout`` each runs in a child process and is given up
after that many seconds) and the plan it returns is simulated once. The ``simulate`` row times
one simulation of the ``even-layers`` plan; with ``--reference`` it also times the simulator in
that file on the same plan (for example the previous version:
``git show HEAD:explorer/simulate/simulator.py > /tmp/simulate_old.py``) and checks that both
predict the same. Every simulation is timed cold (the simulator's per-graph arrays are dropped
first). Times are the best of ``--repeat`` runs, in seconds, from ``time.perf_counter``; the
machine's load average (1, 5, 15 min) is printed with every row, since it may be shared.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_results_option, write_result

from explorer.core.units import table
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from explorer.partition import algorithms, partition

SIM = importlib.import_module("explorer.simulate.simulator")


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def best_of(repeat: int, fn):
    """(best wall seconds, last result) of ``repeat`` calls."""
    best, out = math.inf, None
    for _ in range(max(repeat, 1)):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def timed_simulate(module, repeat: int, graph, plan, costs):
    """Best wall time of ``module.simulate``, each run cold: the simulator keeps per-graph
    arrays for the graphs it saw last, which is dropped first so runs are comparable."""

    clear = getattr(module, "clear_caches", None)  # (a reference version may have none)

    def run():
        if clear is not None:
            clear()
        return module.simulate(graph, plan, costs)

    return best_of(repeat, run)


_GPT = None


def gpt_block():
    """The captured tiny GPT (captured once)."""
    global _GPT
    if _GPT is None:
        from explorer.capture.tracing import capture
        from explorer.models.builtin import build

        bm = build("gpt", "tiny")
        _GPT = capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    return _GPT


def make_graph(kind: str, n: int):
    if kind == "layered":
        return layered_dag(n)
    if kind == "gpt":
        return replicated(gpt_block(), n)
    raise SystemExit(f"unknown graph kind {kind!r}; use layered or gpt")


def load_reference(path: str):
    spec = importlib.util.spec_from_file_location("simulate_reference", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def partition_and_simulate(graph, cluster, costs, alg: str, repeat: int) -> tuple:
    """("ok", partition s, simulate s, step s), or ("error", what was raised)."""
    try:
        t_part, plan = best_of(repeat, lambda: partition(graph, cluster, costs, alg))
    except Exception as e:  # report it and go on
        return ("error", f"{type(e).__name__}: {' '.join(str(e).split())}")
    t_sim, pred = timed_simulate(SIM, repeat, graph, plan, costs)
    return ("ok", t_part, t_sim, pred.step_s)


def in_child(timeout: float, fn, *args) -> tuple:
    """``fn(*args)`` in a forked process, given up after ``timeout`` seconds."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def target() -> None:
        send.send(fn(*args))

    proc = ctx.Process(target=target, daemon=True)
    proc.start()
    try:
        if recv.poll(timeout):
            return recv.recv()
        return ("error", f"gave up after {timeout:g} s (--timeout)")
    except EOFError:
        return ("error", f"the run died (exit code {proc.exitcode})")
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join()


def same_prediction(a, b) -> bool:
    close = lambda x, y: math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15)  # noqa: E731
    return (close(a.step_s, b.step_s) and a.busy_s.keys() == b.busy_s.keys()
            and all(close(a.busy_s[d], b.busy_s[d]) for d in a.busy_s)
            and a.peak_bytes == b.peak_bytes and a.transfer_bytes == b.transfer_bytes
            and a.allreduce_bytes == b.allreduce_bytes and a.critical_path == b.critical_path
            and a.bottleneck == b.bottleneck and close(a.lower_bound_s, b.lower_bound_s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1k,10k,100k", help="node counts, e.g. 1k,10k,100k")
    ap.add_argument("--graphs", default="layered,gpt", help="layered and/or gpt")
    ap.add_argument("--algorithms", default="all", help="partitioner names, or all")
    ap.add_argument("--repeat", type=int, default=1, help="runs per timing (the best counts)")
    ap.add_argument("--devices", default="8xH100", help="a cluster preset")
    ap.add_argument("--timeout", type=float, default=0,
                    help="give a partitioner (with its simulation) at most this many seconds, "
                         "run in a child process (0: no limit, in this process)")
    ap.add_argument("--reference", default=None,
                    help="a simulate.py to time against (e.g. the previous version)")
    add_results_option(ap)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    algs = algorithms() if args.algorithms == "all" else args.algorithms.split(",")
    ref = load_reference(args.reference) if args.reference else None
    cluster = Cluster.preset(args.devices)
    print(f"cluster {cluster.name}, roofline costs, best of {args.repeat}; "
          f"load average at start {load()} ({os.cpu_count()} CPUs)", flush=True)
    header = ("graph", "nodes", "what", "partition s", "simulate s", "step ms", "load",
              "note")
    rows = []
    speedups = []

    def add(row: tuple) -> None:
        rows.append(row)
        print(table(header, rows[-1:]).splitlines()[-1], flush=True)

    for kind in args.graphs.split(","):
        for n in sizes:
            graph = make_graph(kind, n)
            costs = roofline_costs(graph, cluster)
            graph.preds, graph.succs, graph.index  # noqa: B018 - built once, before timing
            name = f"{kind}-{len(graph)}"
            for alg in algs:
                run = (graph, cluster, costs, alg, args.repeat)
                r = (in_child(args.timeout, partition_and_simulate, *run) if args.timeout
                     else partition_and_simulate(*run))
                if r[0] == "error":
                    add((name, len(graph), alg, "-", "-", "-", load(), r[1][:100]))
                else:
                    add((name, len(graph), alg, f"{r[1]:.3f}", f"{r[2]:.3f}",
                         f"{r[3] * 1e3:.3f}", load(), ""))
            plan = partition(graph, cluster, costs, "even-layers")
            t_new, pred = timed_simulate(SIM, args.repeat, graph, plan, costs)
            note = "one simulation of the even-layers plan"
            if ref is not None:
                t_old, old = timed_simulate(ref, args.repeat, graph, plan, costs)
                same = same_prediction(old, pred)
                note += (f"; reference {t_old:.3f} s, speed-up {t_old / t_new:.1f}x"
                         f"{'' if same else ', PREDICTIONS DIFFER'}")
                speedups.append((name, len(graph), f"{t_old:.3f}", f"{t_new:.3f}",
                                 f"{t_old / t_new:.1f}x", "yes" if same else "NO", load()))
            add((name, len(graph), "simulate", "-", f"{t_new:.3f}", f"{pred.step_s * 1e3:.3f}",
                 load(), note))
    print()
    print(table(header, rows))
    title = (f"Wall time of every partitioner and of one simulation on large graphs "
             f"({cluster.name} preset, roofline costs, best of {args.repeat})")
    write_result("scale", rows, columns=header, title=title, folder=args.results)
    if speedups:
        head = ("graph", "nodes", "reference s", "now s", "speed-up", "same prediction", "load")
        print("\nsimulate(): reference vs this version, same run, same plan")
        print(table(head, speedups))
        write_result("scale-reference", speedups, columns=head,
                     title="simulate(): a reference version against this one, same plan",
                     folder=args.results)
    print(f"\nload average at end {load()}")


if __name__ == "__main__":
    main()
