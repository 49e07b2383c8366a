"""Quality benchmark: step time, peak memory and gap to the lower bound of every partitioner.

Run: python benchmarks/quality.py [--size default] [--models all] [--devices 2,4,8]
         [--clusters cpu,H100] [--algorithms all] [--cpu-costs profiled|roofline] [--no-cache]
         [--tensor with-tensor]

For every built-in model and device count ``k`` it plans for ``k`` CPU ranks
(``Cluster.cpu(k)``) and for the ``kxH100`` preset. CPU costs are measured by
``explorer.profiling.profiler`` on one CPU rank (one thread) and shared by the ``k`` identical ranks
(``--cpu-costs roofline`` estimates them from FLOPs and bytes instead); H100 costs are the
roofline estimate (no GPU is needed). Every registered partitioner, the baselines included,
plans; each plan is simulated once. One table per (cluster, model):

- ``step ms``: simulated step time; ``*`` marks the fastest plan that fits;
- ``gap``: how far the step is above the lower bound (total compute on the fastest device
  type / devices; given in the table's title);
- ``max peak MiB``: the largest peak memory over the plan's devices;
- ``MiB moved``: bytes across devices per step (activations and gradients between stages
  plus gradient all-reduces), with the all-reduce part in brackets;
- ``used``: devices the plan uses; ``idle``: the share of device-time (all ``k`` devices over
  the step) spent not computing;
- ``notes``: why data-parallel is faster, when it is, from the numbers of the two plans
  (devices used, the busiest device's compute, idle time, bytes moved); which baseline an
  algorithm returned; a step under the lower bound (possible with measured costs, see the
  note there); or the message of an algorithm that refused.

A summary table follows: per (cluster, model) the best plan and how much faster it is than
``single`` and ``data-parallel``, then per algorithm the number of groups it wins (ties
included) and its mean step time over the best (geometric mean).

Tensor parallelism: per (cluster, model), the best plan with tensor-parallel stages beside the
best without. ``--tensor`` names where plans with tensor splits come from (comma-separated):
``with-tensor`` splits the stages of every partitioner's plan 2, 4 ... ways
(``plan.with_tensor`` on each stage whose devices the degree divides: a data-parallel stage of
8 devices becomes 4 replicas x 2, 2 x 4 or 1 x 8); any other name is a registered partitioner
(a search over data x tensor x pipeline degrees, say) whose plan counts where it splits layers.
A partitioner among ``--algorithms`` whose plan splits layers counts there too.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_results_option, write_result

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.units import table
from explorer.models.synthetic import roofline_costs

MiB = 2**20
#: differences in step time below this fraction are ties
TIE = 1e-3


@dataclass(frozen=True)
class Row:
    """One algorithm's plan on one (cluster, model), or why it has none."""

    algorithm: str
    plan: ex.Plan | None
    pred: ex.Prediction | None
    error: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.pred is not None

    @property
    def fits(self) -> bool:
        return self.pred is not None and self.pred.fits


def idle_share(pred: ex.Prediction, n_devices: int) -> float:
    """Share of the cluster's device-time (``n_devices`` x step) spent not computing."""
    if pred.step_s <= 0:
        return 0.0
    return 1.0 - sum(pred.busy_s.values()) / (n_devices * pred.step_s)


def comm_s(pred: ex.Prediction) -> float:
    """The longest time any device spends communicating (sending, all-reducing) in a step."""
    per: dict[str, float] = defaultdict(float)
    for iv in pred.timeline:
        if iv.lane == "comm":
            per[iv.device] += iv.end_s - iv.start_s
    return max(per.values(), default=0.0)


def why_data_parallel_wins(r: Row, dp: Row, n: int) -> str:
    """Why the data-parallel plan is faster than ``r``'s, from the two predictions."""
    a, d = r.pred, dp.pred
    assert a is not None and d is not None and r.plan is not None
    faster = a.step_s / d.step_s - 1
    parts = []
    if d.fits:
        parts.append(f"model fits on each device (data-parallel peak "
                     f"{max(d.peak_bytes.values()) / MiB:.1f} MiB)")
    used = len(r.plan.devices)
    if r.algorithm == "wap" and "k" in r.plan.options:
        parts.append(f"wap picks k={r.plan.options['k']} for {r.plan.options.get('objective')}, "
                     "not for speed")
    elif used < n:
        parts.append(f"uses {used} of {n} devices")
    bn_a, bn_d = max(a.busy_s.values()), max(d.busy_s.values())
    if bn_a > 1.05 * bn_d:
        parts.append(f"its busiest device computes {bn_a * 1e3:.3g} ms vs {bn_d * 1e3:.3g} ms "
                     "(each data-parallel replica does 1/k of every op)")
    idle_a, idle_d = idle_share(a, n), idle_share(d, n)
    if idle_a > idle_d + 0.05 and len(r.plan.stages) > 1:
        parts.append(f"devices idle {idle_a:.0%} of the step vs {idle_d:.0%} (stages wait for "
                     f"each other: pipeline bubble, {r.plan.micro_batches} micro-batch"
                     f"{'es' if r.plan.micro_batches > 1 else ''})")
    c_a, c_d = comm_s(a), comm_s(d)
    if a.transfer_bytes and c_a > c_d:
        parts.append(f"moves {a.cross_device_bytes / MiB:.2f} MiB across stages "
                     f"({c_a * 1e3:.3g} ms on a link) vs a {d.allreduce_bytes / MiB:.2f} MiB "
                     f"all-reduce ({c_d * 1e3:.3g} ms, overlapping the backward)")
    elif a.transfer_bytes and a.cross_device_bytes < d.cross_device_bytes:
        parts.append(f"moves fewer bytes ({a.cross_device_bytes / MiB:.2f} vs "
                     f"{d.cross_device_bytes / MiB:.2f} MiB), but that does not make up for it")
    return f"data-parallel {faster:.0%} faster: " + "; ".join(parts)


def note(r: Row, dp: Row | None, n: int) -> str:
    if not r.ok:
        return "refused: " + r.error
    assert r.plan is not None and r.pred is not None
    out = []
    if r.pred.gap < 0:
        out.append(f"{-r.pred.gap:.0%} under the lower bound: the bound counts every op at the "
                   "whole batch, but measured ops cost less per sample at a fraction of it")
    if not r.pred.fits:
        out.append("does not fit: " + r.pred.memory_report())
    fallback = r.plan.options.get("fallback")
    if fallback:
        out.append(f"returns the {fallback} plan (its own was slower)")
    if (r.algorithm != "data-parallel" and dp is not None and dp.ok and dp.fits
            and r.pred.step_s > dp.pred.step_s * (1 + TIE)):
        out.append(why_data_parallel_wins(r, dp, n))
    return "; ".join(out)


def run_group(graph, cluster, costs, names: list[str]) -> list[Row]:
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            plan = ex.partition(graph, cluster, costs, name)
            pred = ex.simulate(graph, plan, costs)
            rows.append(Row(name, plan, pred, "", time.perf_counter() - t0))
        except ExplorerError as exc:
            rows.append(Row(name, None, None, " ".join(str(exc).split()),
                            time.perf_counter() - t0))
    return rows


#: where plans with tensor splits come from, besides registered partitioners: the name, and
#: a function of (graph, cluster, costs, the partitioners' rows) giving rows of such plans
TENSOR_SOURCES: dict[str, Callable[..., list[Row]]] = {}


def tensor_source(name: str) -> Callable[[Callable[..., list[Row]]], Callable[..., list[Row]]]:
    def register(fn: Callable[..., list[Row]]) -> Callable[..., list[Row]]:
        TENSOR_SOURCES[name] = fn
        return fn
    return register


@tensor_source("with-tensor")
def with_tensor(graph, cluster, costs, rows: list[Row]) -> list[Row]:
    """Every partitioner's plan with its stages split 2, 4 ... ways, where the degree divides
    a stage's devices (plans with memory settings cannot take a split and are skipped)."""
    out = []
    for r in rows:
        if r.plan is None or r.plan.uses_tensor_parallel:
            continue
        degree = 2
        while degree <= len(r.plan.devices):
            chosen = [k for k, devs in enumerate(r.plan.stages) if len(devs) % degree == 0]
            t0 = time.perf_counter()
            try:
                plan = r.plan.with_tensor(degree, stages=chosen) if chosen else None
                if plan is not None:
                    out.append(Row(f"{r.algorithm} + tensor {degree}", plan,
                                   ex.simulate(graph, plan, costs), "",
                                   r.wall_s + time.perf_counter() - t0))
            except ExplorerError:
                pass  # memory settings: no split on top of them
            degree *= 2
    return out


def tensor_rows(graph, cluster, costs, rows: list[Row], sources: list[str]) -> list[Row]:
    """The plans with tensor-parallel stages: the partitioners' own and those of ``sources``
    (names of :data:`TENSOR_SOURCES`, or registered partitioners)."""
    out = [r for r in rows if r.plan is not None and r.plan.uses_tensor_parallel]
    for name in sources:
        made = (TENSOR_SOURCES[name](graph, cluster, costs, rows) if name in TENSOR_SOURCES
                else run_group(graph, cluster, costs, [name]))
        out += [r for r in made if r.plan is not None and r.plan.uses_tensor_parallel]
    return out


def degrees(plan: ex.Plan) -> str:
    """``"2 x 2 x 1"``: the plan's most replicas, highest tensor degree and stage count."""
    tp = max(plan.tensor_of(k) for k in range(len(plan.stages)))
    return f"{plan.data_parallel} x {tp} x {len(plan.stages)}"


TENSOR_HEADER = ("model", "devices", "best without splits", "its dp x tp x pp", "its step ms",
                 "best with tensor splits", "dp x tp x pp", "step ms", "without / with")


def tensor_row(model: str, label: str, rows: list[Row], split: list[Row]) -> tuple:
    """One (model, cluster)'s best plan without tensor splits and the best with, as
    :data:`TENSOR_HEADER` names them (a tie goes to the plan without)."""
    def best(rs: list[Row]) -> Row | None:
        fit = [r for r in rs if r.fits]
        return min(fit, key=lambda r: r.pred.step_s) if fit else None

    plain = best([r for r in rows if r.plan is not None and not r.plan.uses_tensor_parallel])
    tp = best(split)
    cells = []
    for r in (plain, tp):
        cells += (["-", "-", "-"] if r is None else
                  [r.algorithm, degrees(r.plan), f"{r.pred.step_s * 1e3:.3f}"])
    ratio = (f"{plain.pred.step_s / tp.pred.step_s:.2f}x" if plain is not None and tp is not None
             else "-")
    return (model, label, *cells, ratio)


GROUP_HEADER = ("algorithm", "step ms", "gap", "max peak MiB", "MiB moved (all-reduce)", "used",
                "idle", "plan s", "notes")


def group_rows(rows: list[Row], n: int, width: int) -> list[tuple]:
    """One (model, cluster)'s table rows, as :data:`GROUP_HEADER` names them."""
    best = min((r.pred.step_s for r in rows if r.fits), default=math.inf)
    dp = next((r for r in rows if r.algorithm == "data-parallel"), None)
    out = []
    for r in rows:
        nt = note(r, dp, n)
        nt = nt if len(nt) <= width else nt[:width - 3] + "..."
        if not r.ok:
            out.append((r.algorithm, "-", "-", "-", "-", "-", "-", f"{r.wall_s:.2f}", nt))
            continue
        p, pl = r.pred, r.plan
        mark = " *" if r.fits and p.step_s <= best * (1 + TIE) else ""
        out.append((r.algorithm, f"{p.step_s * 1e3:.3f}{mark}", f"{p.gap:.0%}",
                    f"{max(p.peak_bytes.values()) / MiB:.1f}",
                    f"{p.cross_device_bytes / MiB:.2f} ({p.allreduce_bytes / MiB:.2f})",
                    str(len(pl.devices)), f"{idle_share(p, n):.0%}", f"{r.wall_s:.2f}", nt))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="default", help="model size (tiny, small, default)")
    ap.add_argument("--models", default="all", help="built-in models, comma-separated")
    ap.add_argument("--devices", default="2,4,8", help="device counts")
    ap.add_argument("--clusters", default="cpu,H100", help="cpu and/or a GPU preset type")
    ap.add_argument("--algorithms", default="all", help="partitioners, or all")
    ap.add_argument("--cpu-costs", default="profiled", choices=("profiled", "roofline"))
    ap.add_argument("--no-cache", action="store_true", help="profile afresh")
    ap.add_argument("--width", type=int, default=400, help="longest note printed")
    ap.add_argument("--tensor", default="with-tensor",
                    help="where plans with tensor splits come from: with-tensor (the "
                         "partitioners' plans split 2, 4 ... ways) and/or registered "
                         "partitioners, comma-separated; none: no tensor table")
    add_results_option(ap)
    args = ap.parse_args()
    models = ex.model_names() if args.models == "all" else args.models.split(",")
    names = ex.algorithms() if args.algorithms == "all" else args.algorithms.split(",")
    counts = [int(k) for k in args.devices.split(",")]
    kinds = args.clusters.split(",")
    t_start = time.perf_counter()
    print(f"quality: {args.size} models, {', '.join(names)}; CPU ranks: "
          + ("costs measured on one CPU rank (one thread), shared by all ranks"
             if args.cpu_costs == "profiled" else "roofline costs")
          + "; GPU presets: roofline costs; load average "
          + "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    sources = [] if args.tensor == "none" else args.tensor.split(",")
    for name in sources:
        if name not in TENSOR_SOURCES:
            ex.algorithm(name)  # unknown names raise with the list of known ones
    summary, groups, tensor, ratio = [], [], [], defaultdict(list)
    wins: dict[str, int] = defaultdict(int)
    for model in models:
        bm = ex.builtin_model(model, args.size)
        graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=model)
        cpu_costs = None
        if "cpu" in kinds and args.cpu_costs == "profiled":
            cpu_costs = ex.profile(graph, ex.Cluster.cpu(1), cache=not args.no_cache,
                                   progress=False)
        s = graph.summary()
        for kind in kinds:
            for k in counts:
                if kind == "cpu":
                    # one rank's op times, shared by k identical ranks; without the
                    # contention a cached two-rank profile may carry and the link's
                    # late-receive wait (measured for two ranks of this host, they say
                    # nothing of k hypothetical ones)
                    cluster = ex.Cluster.cpu(k).without_late_receive()
                    costs = (ex.CostModel(graph.fingerprint, cluster,
                                          cpu_costs.without_contention().per_type)
                             if cpu_costs is not None else roofline_costs(graph, cluster))
                    label = f"cpu:{k} ({args.cpu_costs})"
                else:
                    cluster = ex.Cluster.preset(f"{k}x{kind}")
                    costs = roofline_costs(graph, cluster)
                    label = f"{k}x{kind} (roofline)"
                rows = run_group(graph, cluster, costs, names)
                bound = next((r.pred.lower_bound_s for r in rows if r.ok), math.nan)
                print(f"\n{model} ({args.size}: {s['ops']} ops, "
                      f"{s['params_bytes'] / MiB:.1f} MiB params, batch {s['batch_size']}) on "
                      f"{label}: lower bound {bound * 1e3:.3f} ms (total compute / {k} devices)")
                out = group_rows(rows, k, args.width)
                print(table(GROUP_HEADER, out), flush=True)
                groups += [(model, label, *r) for r in out]
                if sources:
                    tensor.append(tensor_row(model, label, rows, tensor_rows(
                        graph, cluster, costs, rows, sources)))
                fit = [r for r in rows if r.fits]
                if not fit:
                    summary.append((model, label, "-", "-", "-", "-", "-"))
                    continue
                best = min(r.pred.step_s for r in fit)
                tops = [r.algorithm for r in fit if r.pred.step_s <= best * (1 + TIE)]
                for r in fit:
                    ratio[r.algorithm].append(r.pred.step_s / best)
                for a in tops:
                    wins[a] += 1
                step = {r.algorithm: r.pred.step_s for r in fit}
                summary.append((
                    model, label, ", ".join(tops), f"{best * 1e3:.3f}",
                    f"{best / bound - 1:.0%}" if bound > 0 else "-",
                    f"{step['single'] / best:.2f}x" if "single" in step else "-",
                    f"{step['data-parallel'] / best:.2f}x" if "data-parallel" in step else "-"))
    head = ("model", "devices", "best (ties)", "step ms", "gap", "single / best",
            "data-parallel / best")
    print("\nBest plan per (model, cluster)")
    print(table(head, summary))
    agg = []
    for a in names:
        xs = ratio.get(a, [])
        gm = math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan
        agg.append((a, str(len(xs)), str(wins.get(a, 0)), f"{gm:.3f}x",
                    f"{max(xs):.2f}x" if xs else "-"))
    agg_head = ("algorithm", "plans that fit", "best (ties)", "mean step / best",
                "worst step / best")
    print("\nPer algorithm, over the groups where its plan fits")
    print(table(agg_head, agg))
    if sources:
        print("\nBest plan with tensor-parallel stages beside the best without")
        print(table(TENSOR_HEADER, tensor))
    wall = (f"wall {time.perf_counter() - t_start:.0f} s; load average "
            + "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print("\n" + wall)
    write_result("quality", summary, columns=head, title="Best plan per (model, cluster)",
                 notes=wall + ".", folder=args.results)
    write_result("quality-algorithms", agg, columns=agg_head,
                 title="Per algorithm, over the groups where its plan fits", folder=args.results)
    if sources:
        write_result("quality-tensor", tensor, columns=TENSOR_HEADER,
                     title="Best plan with tensor-parallel stages beside the best without",
                     notes=f"Tensor splits from {', '.join(sources)}; {wall}.",
                     folder=args.results)
    write_result("quality-groups", groups, columns=("model", "devices", *GROUP_HEADER),
                 title="Every partitioner on one (model, cluster)", folder=args.results)


if __name__ == "__main__":
    main()
