"""Scale benchmark: wall time of every partitioner and of simulating its plan on large graphs.

Run: python benchmarks/scale.py [--sizes 1k,10k,100k] [--graphs layered,gpt]
         [--algorithms all] [--repeat 1] [--timeout 0] [--reference REV] [--record scale]

Graphs: random layered DAGs (``explorer.models.synthetic.layered_dag``, seed 0) and a captured
tiny GPT whose transformer blocks are tiled to the size (``explorer.models.synthetic.replicated``),
on the ``8xH100`` preset with roofline costs (no profiling). For every graph and size, each
registered partitioner runs (those that refuse a graph, such as exact searches over their
limits, are listed with their message; with ``--timeout`` each runs in a child process and is
given up after that many seconds) and the plan it returns is simulated, each simulation cold
(the simulator's per-graph arrays are dropped first).

``--reference REV`` times a previous simulator side by side in the same run: the git revision
``REV`` of this repository (``HEAD``, a branch, a commit) is checked out into a temporary
``git worktree``; every plan is saved as JSON, and two server processes (one on this tree, one
on that worktree, each building the same graph from its kind, size and seed) simulate it
``--repeat`` times each, cold, taking turns (old and new alternate which goes first), so that
a shared machine's changing load falls on both alike. Each row then shows, for both, the best
wall time (``time.perf_counter``) and the best process CPU time (``time.process_time``) of
the simulate call, new / old for each, and whether every field of the predictions (step, busy
time, peaks, bytes, energy, critical path, bottleneck, lower bound) is exactly the same in
both servers and in this process. Without it times are the best of ``--repeat`` runs in this
process, in seconds, from ``time.perf_counter``. The machine's load average (1, 5, 15 min) is
printed with every row, since it may be shared.

Prints its table and records it under ``benchmarks/results/`` (``--results``) as
``--record`` (``scale.json``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_results_option, write_result

from explorer.core.units import table
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from explorer.partition import algorithms, partition
from explorer.simulate import simulator as SIM

ROOT = Path(__file__).resolve().parent.parent

#: a simulator server: builds the graph, then for every plan path read from stdin simulates
#: that plan once, cold, and prints its wall and process CPU seconds and prediction fields as
#: one JSON line ("ready" first, once the graph is built). It uses only names every recent
#: version has, so it runs in a reference worktree as in this one.
SERVER = r"""
import gc, json, sys, time
from explorer.core.plan import Plan
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import layered_dag, replicated, roofline_costs
from explorer.simulate import simulator as SIM
spec = json.loads(sys.argv[1])
if spec["kind"] == "layered":
    graph = layered_dag(spec["n"], seed=spec["seed"])
else:
    from explorer.capture.tracing import capture
    from explorer.models.builtin import build
    bm = build("gpt", "tiny")
    block = capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="gpt")
    graph = replicated(block, spec["n"])
cluster = Cluster.preset(spec["devices"])
costs = roofline_costs(graph, cluster)
graph.preds, graph.succs, graph.index
clear = getattr(SIM, "clear_caches", None)
print("ready", flush=True)
for line in sys.stdin:
    plan = Plan.load(line.strip(), graph)
    if clear is not None:
        clear()
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    pred = SIM.simulate(graph, plan, costs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "fields": prediction_fields(pred)}),
          flush=True)
"""


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
    arrays for the graphs it saw last, which is dropped first so runs are comparable; and the
    cycle collector's garbage is collected first, on both sides."""

    clear = getattr(module, "clear_caches", None)  # (a reference version may have none)
    gc.collect()  # (what the partitioner left, as the reference's child process starts clean)

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


#: the layered graphs' random seed (the reference builds the same graph from it)
SEED = 0


def make_graph(kind: str, n: int):
    if kind == "layered":
        return layered_dag(n, seed=SEED)
    if kind == "gpt":
        return replicated(gpt_block(), n)
    raise SystemExit(f"unknown graph kind {kind!r}; use layered or gpt")


def partition_and_simulate(graph, cluster, costs, alg: str, repeat: int) -> tuple:
    """("ok", partition s, simulate s, step s, plan JSON, prediction fields), or ("error",
    what was raised)."""
    try:
        t_part, plan = best_of(repeat, lambda: partition(graph, cluster, costs, alg))
    except Exception as e:  # report it and go on
        return ("error", f"{type(e).__name__}: {' '.join(str(e).split())}")
    t_sim, pred = timed_simulate(SIM, repeat, graph, plan, costs)
    return ("ok", t_part, t_sim, pred.step_s, json.dumps(plan.to_dict()), prediction_fields(pred))


def prediction_fields(pred) -> dict:
    """What a prediction says, as JSON values (floats kept exactly), to compare two versions."""
    return {"step_s": pred.step_s, "busy_s": pred.busy_s, "peak_bytes": pred.peak_bytes,
            "transfer_bytes": pred.transfer_bytes, "allreduce_bytes": pred.allreduce_bytes,
            "energy_j": pred.energy_j, "critical_path": list(pred.critical_path),
            "bottleneck": pred.bottleneck, "lower_bound_s": pred.lower_bound_s}


class Server:
    """A simulator server (:data:`SERVER`) running on the source tree ``tree``."""

    def __init__(self, tree: Path, spec: dict) -> None:
        code = inspect.getsource(prediction_fields) + SERVER
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], cwd=tree,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def _line(self) -> str:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit(f"a simulator server (exit code {self.proc.wait()}) died")
        return line

    def ready(self) -> None:
        if self._line().strip() != "ready":
            raise SystemExit("a simulator server did not start")

    def simulate(self, path: str) -> dict:
        """{"wall_s", "cpu_s", "fields"} of one cold simulation of the plan saved at path."""
        self.proc.stdin.write(path + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


class Reference:
    """A previous revision of this repository checked out in a temporary git worktree, whose
    simulator is timed against this tree's, each in a server process of its own, alternately
    on every plan (old and new take turns going first) so that the shared machine's load falls
    on both alike."""

    def __init__(self, rev: str) -> None:
        self.rev = rev
        self.tmp = tempfile.TemporaryDirectory(prefix="scale-reference-")
        self.tree = Path(self.tmp.name) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                        str(self.tree), rev], check=True)
        self.commit = subprocess.run(["git", "-C", str(self.tree), "rev-parse", "--short",
                                      "HEAD"], check=True, capture_output=True,
                                     text=True).stdout.strip()

    def side_by_side(self, kind: str, n: int, devices: str, plans: dict[str, str],
                     repeat: int) -> dict[str, tuple[dict, dict]]:
        """Per partitioner, (new, old): each {"wall_s", "cpu_s", "fields"}, the best wall and
        the best CPU time of ``repeat`` cold simulations of its plan (plan JSON texts by
        partitioner) on the graph ``kind`` of ``n`` nodes."""
        folder = Path(tempfile.mkdtemp(dir=self.tmp.name))
        spec = {"kind": kind, "n": n, "seed": SEED, "devices": devices}
        servers = (Server(ROOT, spec), Server(self.tree, spec))
        out = {}
        try:
            for s in servers:
                s.ready()
            for k, (name, text) in enumerate(plans.items()):
                path = folder / f"plan{k}.json"
                path.write_text(text)
                best: list[dict] = [{}, {}]
                for r in range(max(repeat, 1)):
                    for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                        got = servers[side].simulate(str(path))
                        b = best[side]
                        b["fields"] = got["fields"]
                        for key in ("wall_s", "cpu_s"):
                            b[key] = min(b.get(key, math.inf), got[key])
                out[name] = (best[0], best[1])
        finally:
            for s in servers:
                s.close()
        return out

    def close(self) -> None:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(self.tree)], check=False)
        self.tmp.cleanup()


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
    ap.add_argument("--reference", default=None, metavar="REV",
                    help="a git revision whose simulator is timed on the same plans, side by "
                         "side (e.g. HEAD~1, main)")
    ap.add_argument("--record", default="scale",
                    help="the record's name under --results (default scale)")
    add_results_option(ap)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    algs = algorithms() if args.algorithms == "all" else args.algorithms.split(",")
    ref = Reference(args.reference) if args.reference else None
    cluster = Cluster.preset(args.devices)
    print(f"cluster {cluster.name}, roofline costs, best of {args.repeat}; "
          f"load average at start {load()} ({os.cpu_count()} CPUs)"
          + (f"; reference simulator: {args.reference} ({ref.commit})" if ref else ""),
          flush=True)
    first = ("graph", "nodes", "partitioner", "partition s", "simulate s", "step ms", "load",
             "note")
    header = first if ref is None else (
        *first[:5], "cpu s", "previous s", "previous cpu s", "new/old", "cpu new/old",
        "same prediction", *first[5:])
    rows = []

    def show(row: tuple) -> None:
        print(table(first, [row]).splitlines()[-1], flush=True)

    try:
        for kind in args.graphs.split(","):
            for n in sizes:
                graph = make_graph(kind, n)
                costs = roofline_costs(graph, cluster)
                graph.preds, graph.succs, graph.index  # noqa: B018 - built once, before timing
                name = f"{kind}-{len(graph)}"
                done = []
                for alg in algs:
                    run = (graph, cluster, costs, alg, args.repeat)
                    r = (in_child(args.timeout, partition_and_simulate, *run) if args.timeout
                         else partition_and_simulate(*run))
                    done.append((alg, r))
                    if r[0] == "error":
                        row = (name, len(graph), alg, "-", "-", "-", load(), r[1][:100])
                    else:
                        row = (name, len(graph), alg, f"{r[1]:.3f}", f"{r[2]:.3f}",
                               f"{r[3] * 1e3:.3f}", load(), _note(r[4]))
                    if ref is None:
                        rows.append(row)
                    show(row)
                if ref is not None:
                    plans = {alg: r[4] for alg, r in done if r[0] == "ok"}
                    timed = ref.side_by_side(kind, n, args.devices, plans, args.repeat)
                    for alg, r in done:
                        if r[0] == "error":
                            rows.append((name, len(graph), alg, "-", "-", "-", "-", "-", "-",
                                         "-", "-", "-", load(), r[1][:100]))
                            continue
                        new, old = timed[alg]
                        here = json.loads(json.dumps(r[5]))
                        same = "yes" if old["fields"] == new["fields"] == here else "NO"
                        rows.append((name, len(graph), alg, f"{r[1]:.3f}",
                                     f"{new['wall_s']:.3f}", f"{new['cpu_s']:.3f}",
                                     f"{old['wall_s']:.3f}", f"{old['cpu_s']:.3f}",
                                     f"{new['wall_s'] / old['wall_s']:.2f}",
                                     f"{new['cpu_s'] / old['cpu_s']:.2f}", same,
                                     f"{r[3] * 1e3:.3f}", load(), _note(r[4])))
                        print("  side by side: " + table(header, rows[-1:]).splitlines()[-1],
                              flush=True)
    finally:
        if ref is not None:
            ref.close()
    print()
    print(table(header, rows))
    title = (f"Wall time of every partitioner and of one simulation of its plan on large "
             f"graphs ({cluster.name} preset, roofline costs, best of {args.repeat})")
    if ref is not None:
        title += (f"; simulate s and cpu s: this simulator, previous s and previous cpu s: "
                  f"that of {args.reference} ({ref.commit}), on the same plans, each in a "
                  "process of its own, taking turns plan by plan (wall and process CPU "
                  "seconds, the best of each)")
    write_result(args.record, rows, columns=header, title=title, folder=args.results)
    print(f"\nload average at end {load()}")


def _note(plan_json: str) -> str:
    """What the plan says of itself where it is a baseline in place of the partitioner's own
    plan (the partitioners' fallback notes), else nothing."""
    data = json.loads(plan_json)
    fallback = (data.get("options") or {}).get("fallback")
    return f"returns the {fallback} plan (faster than its own)" if fallback else ""


if __name__ == "__main__":
    main()
