"""Search speed of the degrees partitioner: a 70B shape on 64 H100s, and brute force beside it.

Run: python benchmarks/degrees.py [--shape llama-70b] [--batch-size 16] [--seq-len 1024]
         [--devices 64xH100] [--small gpt] [--small-devices 4xH100] [--results DIR]

- ``large``: the published shape (``--shape``, built on the meta device and captured on fake
  tensors, at ``--batch-size`` sequences of ``--seq-len`` tokens: with fp32 and no
  recomputation, which tensor-parallel plans cannot use yet, 4,096-token sequences of the 70B
  shape fit no plan), roofline costs for the ``--devices`` preset; the seconds of
  ``ex.partition(..., "degrees")`` (enumeration, estimate, the simulator on the best few and the
  baselines), the degrees it chose and the simulated step, and the size of its space counted
  in plans (every mesh, micro-batch count, schedule and contiguous cut of the layers).
  Target: at most 10 s on this machine.
- ``small``: the built-in ``--small`` model (tiny) on ``--small-devices``, its layers at depth 2:
  the same search, and brute force over the same space (every mesh, micro-batch count,
  schedule and cut made into a plan and simulated); the seconds of each, their ratio, the best
  step of each, and whether the search's estimate optimum equals brute force under the same
  estimate (it must: its cut DP is exact).

Prints a table and records it (``degrees``) under ``benchmarks/results/``, which
``python benchmarks/report.py`` renders into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time

from _common import add_results_option, load_average, write_result

import explorer as ex
from explorer.core.units import table
from explorer.models.builtin import model_config
from explorer.models.llama import build_llama
from explorer.models.synthetic import roofline_costs
from explorer.partition.degrees import (
    Candidate,
    build_space,
    candidate_plan,
    enumerate_candidates,
    mesh_costs,
)
from explorer.partition.pipeline_dp import choose_layers
from explorer.simulate.simulator import simulate

COLUMNS = ("case", "devices", "layers", "space_plans", "search_s", "brute_s", "ratio",
           "degrees", "sequence", "micro_batches", "schedule", "search_step_s", "brute_step_s",
           "estimate_exact")


def _cuts(space, batch: int):
    """Every (dp, tp, sequence parallelism?, M, schedule, bounds) of the space."""
    n_layers = len(space.layers)
    for dp, tp in space.meshes(batch):
        for m in space.micro_batch_choices(batch, dp):
            for sched in space.schedules:
                for s in range(1, min(len(space.ids) // (dp * tp), n_layers) + 1):
                    for cut in itertools.combinations(range(1, n_layers), s - 1):
                        for seq, _ in space.splits(tp):
                            yield dp, tp, seq, m, sched, (0, *cut, n_layers)


def space_size(space, batch: int) -> int:
    """Plans in the space, counted without making them."""
    n_layers = len(space.layers)
    return sum(len(space.micro_batch_choices(batch, dp)) * len(space.schedules)
               * len(space.splits(tp))
               * sum(math.comb(n_layers - 1, s - 1)
                     for s in range(1, min(len(space.ids) // (dp * tp), n_layers) + 1))
               for dp, tp in space.meshes(batch))


def large_case(args) -> dict:
    cfg = dataclasses.replace(model_config(args.shape), batch_size=args.batch_size,
                              seq_len=args.seq_len)
    module, x, y, loss, _ = build_llama(cfg, cfg.batch_size, None)  # on the meta device
    graph = ex.capture(module, x, loss, y, name=args.shape)
    cluster = ex.Cluster.preset(args.devices)
    costs = roofline_costs(graph, cluster)
    t0 = time.perf_counter()
    plan = ex.partition(graph, cluster, costs, "degrees")
    search_s = time.perf_counter() - t0
    layers, _ = choose_layers(graph, plan.options.get("depth"), 400, 1, False)
    space = build_space(graph, costs, cluster.ids, layers, "adam", None, None,
                        ("1f1b", "gpipe"), {}, 1.0)
    o = plan.options
    return {"case": f"{args.shape} (batch {args.batch_size} x {args.seq_len} tokens)",
            "devices": args.devices, "layers": len(layers),
            "space_plans": space_size(space, graph.batch_size), "search_s": search_s,
            "brute_s": None, "ratio": None, "degrees": o.get("degrees"),
            "sequence": bool(o.get("sequence")),
            "micro_batches": plan.micro_batches, "schedule": plan.schedule,
            "search_step_s": simulate(graph, plan, costs).step_s, "brute_step_s": None,
            "estimate_exact": None}


def small_case(args) -> dict:
    bm = ex.builtin_model(args.small, "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=args.small)
    cluster = ex.Cluster.preset(args.small_devices)
    costs = roofline_costs(graph, cluster)
    t0 = time.perf_counter()
    plan = ex.partition(graph, cluster, costs, "degrees", depth=2)
    search_s = time.perf_counter() - t0
    layers, _ = choose_layers(graph, 2, 400, 1, False)
    t0 = time.perf_counter()
    space = build_space(graph, costs, cluster.ids, layers, "adam", None, None,
                        ("1f1b", "gpipe"), {}, 1.0)
    best_est, best_sim, count = math.inf, math.inf, 0
    for dp, tp, seq, m, sched, bounds in _cuts(space, graph.batch_size):
        count += 1
        mesh = mesh_costs(space, costs, dp, tp, m, sched)
        best_est = min(best_est, mesh.score_s(space.layer_costs(tp, seq), bounds))
        cand = Candidate(dp, tp, len(bounds) - 1, m, sched, math.nan, bounds, seq)
        pred = simulate(graph, candidate_plan(graph, space, cand, "adam", {}, {}), costs)
        if pred.fits:
            best_sim = min(best_sim, pred.step_s)
    brute_s = time.perf_counter() - t0
    est = enumerate_candidates(space, costs, graph.batch_size)[0].estimate_s
    o = plan.options
    return {"case": f"{args.small} tiny (brute force: {count} plans)",
            "devices": args.small_devices, "layers": len(layers), "space_plans": count,
            "search_s": search_s, "brute_s": brute_s, "ratio": brute_s / search_s,
            "degrees": o.get("degrees"),
            "sequence": bool(o.get("sequence")), "micro_batches": plan.micro_batches,
            "schedule": plan.schedule, "search_step_s": simulate(graph, plan, costs).step_s,
            "brute_step_s": best_sim, "estimate_exact": math.isclose(est, best_est,
                                                                     rel_tol=1e-9)}


def _rounded(row: dict) -> dict:
    """Seconds to the millisecond, steps to 4 digits, a space too large to count in words."""
    out = dict(row)
    for k in ("search_s", "brute_s"):
        out[k] = None if row[k] is None else round(row[k], 3)
    for k in ("search_step_s", "brute_step_s"):
        out[k] = None if row[k] is None else float(f"{row[k]:.4g}")
    out["ratio"] = None if row["ratio"] is None else round(row["ratio"], 1)
    n = row["space_plans"]
    out["space_plans"] = f"{n:,}" if n < 10**9 else f"{n:.2e}"
    return {k: "-" if v is None else v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-70b")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--devices", default="64xH100")
    ap.add_argument("--small", default="gpt")
    ap.add_argument("--small-devices", default="4xH100")
    add_results_option(ap)
    args = ap.parse_args()
    rows = [_rounded(r) for r in (large_case(args), small_case(args))]
    print(table(COLUMNS, [[str(r[k]) for k in COLUMNS] for r in rows]))
    write_result("degrees", rows, title="Degrees search speed: a 70B shape on 64 H100s, and "
                 "brute force over the same space on a small case",
                 notes=load_average(), folder=args.results)


if __name__ == "__main__":
    main()
