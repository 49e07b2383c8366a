"""Prediction accuracy: run plans for real on CPU ranks and compare with the simulator.

Run: python benchmarks/accuracy.py [--size default] [--models mlp,gpt,...|all] [--steps 5]
       [--passes 4] [--partitioners all|none|NAME,...] [--devices 2] [--cached]
       [--strategies | --tensor] [--runtime segments|ops]
For every model it profiles afresh (through the runtime, one thread per rank) for the runtime
the plans run on (``--runtime``: ``ex.run``'s, the segments by default), then makes the
baseline plans and one plan per registered partitioner. Partitioners that arrive at a plan
already made (the same placement, stages, micro-batches and schedule) share its row, so every
distinct plan is run once per pass. Each plan is predicted, then run for real with ``ex.run``
``--passes`` times, in turn over the model's plans; its measured step is the median over all
its steps. The table gives predicted vs measured step time and peak memory with the error per
plan, their mean and max, and Kendall's tau between predicted and measured step times across
all plans. Two columns give the same prediction without one effect each, to show what it
adds: ``no-contention err`` without what the profile measured of two ranks computing at
once (their slowing each other, and their busy times wandering apart), ``no-late err`` without
the wait of receives posted after their message was sent (``Link.late_receive_s``). Three
references beside it:

* the measurement against itself: per plan, the median of the odd passes' steps against
  the median of the even passes' steps, summarized the same way (error mean and max, tau).
  Each half has half the steps of the measurement the predictions are compared with, so
  (with an even number of passes, and independent noise) the whole measurement's own error
  is about half of the halves' disagreement;
* the profile against itself: after a model's runs it is profiled again, and every plan
  predicted from that second profile; the summary compares the two profiles' predictions
  (how far a profile taken minutes later moves them), and the second profile's predictions
  with the measurement;
* a cost model calibrated (``ex.calibrate``) on the runs of the *other* models only, so no
  plan is predicted by a fit that saw it.

``--strategies`` runs the memory-strategy plans instead (:data:`STRATEGIES`: ZeRO 1-3 and full
recomputation on the data-parallel plan, selective and full recomputation on the even-layers
pipeline and on one device, bf16 on the pipeline), recorded apart
(``accuracy-strategies*.json``), by default on every built-in model (``ex.model_names()``).

``--tensor`` runs the tensor-parallel plans instead (:data:`TENSOR`: the whole model as one
stage split two ways, with 1, 2 and 4 micro-batches, and with sequence parallelism where it
splits more), recorded apart (``accuracy-tensor*.json``).

Both say whether the plans meet the accuracy targets (:data:`TARGETS`).

``--runtime`` says which runtime the plans run on (and are profiled for): the segments by
default, as ``ex.run``; the records say which, in their titles.

Run it on a quiet machine: the ranks share its cores.

Prints its tables and records them under ``benchmarks/results/`` (``--results``), which
``python benchmarks/report.py`` renders into docs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from _common import add_results_option, load_average, write_result
from scipy.stats import kendalltau

import explorer as ex
from explorer.core.tensor_layout import megatron_layout
from explorer.core.units import table

PLANS = [
    ("single", {}),
    ("data-parallel", {}),
    ("even-layers", {}),
    ("balanced-params", {}),
    ("even-layers", {"micro_batches": 4, "schedule": "gpipe"}),
    ("even-layers", {"micro_batches": 4, "schedule": "1f1b"}),
]
#: the memory-strategy plans (``--strategies``): (algorithm, options, memory settings)
STRATEGIES = [
    # each plan without settings too, measured beside them: what the settings add
    ("data-parallel", {}, {}),
    ("even-layers", {}, {}),
    ("single", {}, {}),
    ("data-parallel", {}, {"zero": 1}),
    ("data-parallel", {}, {"zero": 2}),
    ("data-parallel", {}, {"zero": 3}),
    ("data-parallel", {}, {"recompute": "full"}),
    ("even-layers", {}, {"recompute": "selective"}),
    ("even-layers", {}, {"recompute": "full"}),
    ("single", {}, {"recompute": "selective"}),
    ("single", {}, {"recompute": "full"}),
    ("even-layers", {}, {"precision": "bf16"}),
]

#: the tensor-parallel plans (``--tensor``): the whole model on one stage of ``--devices``
#: devices split that many ways, as (micro-batches, schedule, sequence parallelism)
TENSOR = [(1, "gpipe", False), (2, "gpipe", False), (4, "1f1b", False), (1, "gpipe", True),
          (2, "gpipe", True)]
#: the accuracy targets: step-time error mean and max over the plans, worst memory error
TARGETS = {"step-time error mean": 0.10, "step-time error max": 0.20, "memory error": 0.05}


def tensor_plan(graph, cluster: ex.Cluster, micro_batches: int, schedule: str,
                sequence: bool = False) -> ex.Plan:
    """The whole model as one stage over every device of ``cluster``, split that many ways
    (``sequence``: with sequence parallelism, where that splits anything more)."""
    k = len(cluster.ids)
    if sequence and not megatron_layout(graph, k, True).sequence_ops:
        raise ex.ExplorerError("nothing splits along the sequence")
    ops = {n.name: 0 for n in graph.nodes if n.kind == "op"}
    return ex.Plan.from_assignment(graph, [tuple(cluster.ids)], ops, algorithm="tensor",
                                   micro_batches=micro_batches, schedule=schedule
                                   ).with_tensor(k, sequence=sequence)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="default")
    ap.add_argument("--models", default=None,
                    help="comma-separated built-in models, or all (default: mlp,alexnet,resnet,"
                         "gpt; with --strategies all)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--partitioners", default="all",
                    help="registered partitioners to run besides the baselines: all, none, "
                         "or a comma-separated list")
    ap.add_argument("--passes", type=int, default=4,
                    help="run every plan this many times, in turn over all of a model's "
                         "plans; a plan's measured step is the median over all its steps")
    ap.add_argument("--cached", action="store_true",
                    help="use cached profiles (default: profile afresh just before the runs, "
                         "as a user profiles and then runs in one session)")
    ap.add_argument("--strategies", action="store_true",
                    help="run only the memory-strategy plans (ZeRO 1-3, recomputation, bf16; "
                         "recorded as accuracy-strategies*.json)")
    ap.add_argument("--tensor", action="store_true",
                    help="run only the tensor-parallel plans (recorded as "
                         "accuracy-tensor*.json)")
    ap.add_argument("--runtime", choices=("segments", "ops"), default="segments",
                    help="how the ranks run their ops (ex.run's runtime) and what the profile "
                         "predicts: segments (default) or one op at a time (ops)")
    add_results_option(ap)
    args = ap.parse_args()
    if args.models is None:
        args.models = "all" if args.strategies else "mlp,alexnet,resnet,gpt"
    if args.models == "all":
        args.models = ",".join(ex.model_names())
    baselines = {a for a, _ in PLANS}
    record = ("accuracy-strategies" if args.strategies else
              "accuracy-tensor" if args.tensor else "accuracy")
    if args.strategies or args.tensor:
        extra = []
    elif args.partitioners == "all":
        extra = [a for a in ex.algorithms() if a not in baselines]
    elif args.partitioners == "none":
        extra = []
    else:
        extra = [a for a in args.partitioners.split(",") if a]
    plans = ([(a, o, {}) for a, o in PLANS] + [(a, {}, {}) for a in extra]
             if not args.strategies else STRATEGIES)
    if args.tensor:
        plans = [("tensor", {"micro_batches": m, "schedule": sch,
                             **({"sequence": True} if seq else {})}, {})
                 for m, sch, seq in TENSOR]
    cluster = ex.Cluster.cpu(args.devices)
    # (model, label, graph, costs, plan, pred, meas, per-pass measurements, same plan from,
    #  prediction from the second profile, runtime)
    runs = []
    skipped = []
    t_all = time.perf_counter()
    load_start = load_average()  # (shared machines inflate the measured steps)
    for name in args.models.split(","):
        bm = ex.builtin_model(name, args.size)
        graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
        # the half precisions the plans compute in are timed too, as `explorer plan
        # --precision` does
        half = tuple(sorted({m["precision"] for _, _, m in plans
                             if m.get("precision", "fp32") != "fp32"}))
        profiles = {args.runtime: ex.profile(graph, cluster, progress=False, cache=args.cached,
                                             precisions=half, runtime=args.runtime)}
        costs = profiles[args.runtime]
        todo = []
        seen: dict[tuple, int] = {}  # a plan's signature -> its row in todo
        for alg, opts, memory in plans:
            label = alg + "".join(f" {k}={v}" for k, v in {**opts, **memory}.items())
            try:
                plan = (tensor_plan(graph, cluster, **opts) if alg == "tensor" else
                        ex.partition(graph, cluster, costs, alg, **opts))
                plan = plan.with_memory(**memory) if memory else plan
            except ex.ExplorerError as exc:
                skipped.append((name, label, f"skipped: {exc}"[:60]))
                continue
            key = _signature(plan)
            if key in seen:  # the same plan again: one row, every algorithm that made it
                row = todo[seen[key]]
                todo[seen[key]] = (row[0], row[1], row[2], row[3] + [label], row[4])
                continue
            seen[key] = len(todo)
            rt = args.runtime
            if rt not in profiles:
                profiles[rt] = ex.profile(graph, cluster, progress=False, cache=args.cached,
                                          precisions=half, runtime=rt)
            todo.append((label, plan, [], [], rt))
        # passes in turn over the plans: a burst of load on the host lands on one pass of
        # several plans, not on every step of one plan
        for _ in range(args.passes):
            for _, plan, got, _, rt in todo:
                got.append(ex.run(graph, plan=plan, costs=profiles[rt], steps=args.steps,
                                  warmup=args.warmup, progress=False, runtime=rt))
        # the profile again, a few minutes later: how much a prediction moves with it
        again = {rt: ex.profile(graph, cluster, progress=False, cache=False, precisions=half,
                                runtime=rt) for rt in profiles}
        for label, plan, got, same, rt in todo:
            runs.append((name, label, graph, profiles[rt], plan,
                         ex.simulate(graph, plan, profiles[rt]), _pooled(got), got, same,
                         ex.simulate(graph, plan, again[rt]), rt))
    # calibrated: fitted on the runs of the *other* models only, then predicting this one
    # (the runs of the runtime asked for: a profile of each runtime has its own fit)
    calibrated = {}
    fits = []
    models = sorted({r[0] for r in runs})
    for name in models:
        mine = [r for r in runs if r[0] == name and r[10] == args.runtime]
        rest = [r for r in runs if r[0] != name and r[10] == args.runtime]
        if not mine or not rest:
            continue
        others = {r[3].graph_fingerprint: r[3] for r in rest}
        fitted = ex.calibrate(mine[0][3], [r[6] for r in rest], others=others.values())
        for r in mine:
            calibrated[id(r)] = ex.simulate(r[2], r[4], fitted)
        fits.append(f"calibrated for {name} on the other models: compute "
                    f"x{fitted.compute_scale:.2f}, {fitted.extra_op_s * 1e6:.1f} us per op, "
                    f"{fitted.message_s * 1e6:.1f} us per message, link x{fitted.link_scale:.2f}")
        print(fits[-1])

    # (predicted, measured) per plan for each summary; errors are (p - m) / m as in ex.compare
    rows, mem_err, pairs, flat_pairs, cal_pairs, self_pairs = [], [], [], [], [], []
    again_pairs, profile_pairs, on_time_pairs, plain_pairs = [], [], [], []
    for r in runs:
        name, label, graph, costs, plan, pred, meas, got, same, pred2, rt = r
        per_pass = [m.step_s for m in got]
        spread = max(per_pass) / min(per_pass) - 1
        if len(got) >= 2:  # the measurement against itself: odd passes against even ones
            self_pairs.append((_pooled(got[0::2]).step_s, _pooled(got[1::2]).step_s))
        again_pairs.append((pred2.step_s, meas.step_s))
        profile_pairs.append((pred2.step_s, pred.step_s))
        rep = ex.compare(pred, meas)
        # the same prediction without the measured contention between ranks of this host
        flat = ex.simulate(graph, plan, costs.without_contention())
        e_flat = flat.step_s / meas.step_s - 1
        flat_pairs.append((flat.step_s, meas.step_s))
        # ... and without the wait of receives posted after their message was sent
        on_time = ex.simulate(graph, plan, dataclasses.replace(
            costs, cluster=costs.cluster.without_late_receive()))
        e_on_time = on_time.step_s / meas.step_s - 1
        on_time_pairs.append((on_time.step_s, meas.step_s))
        if plan.uses_tensor_parallel:  # ... and without what DTensor adds to the ops
            plain = ex.simulate(graph, plan, dataclasses.replace(costs, per_type={
                k: dataclasses.replace(v, dtensor={}) for k, v in costs.per_type.items()}))
            plain_pairs.append((plain.step_s, meas.step_s))
        e_step = rep.step_error
        e_mem = max(rep.memory_errors.values(), key=abs)
        mem_err.append(abs(e_mem))
        pairs.append((pred.step_s, meas.step_s))
        cal = calibrated.get(id(r))
        if cal is not None:
            e_cal = cal.step_s / meas.step_s - 1
            cal_pairs.append((cal.step_s, meas.step_s))
        rows.append((name, label, rt, f"{pred.step_s * 1e3:.2f}", f"{meas.step_s * 1e3:.2f}",
                     f"{e_step * 100:+.1f}%", f"{e_flat * 100:+.1f}%",
                     f"{e_on_time * 100:+.1f}%",
                     f"{(pred2.step_s / meas.step_s - 1) * 100:+.1f}%",
                     f"{cal.step_s * 1e3:.2f}" if cal else "-",
                     f"{e_cal * 100:+.1f}%" if cal else "-",
                     f"{max(pred.peak_bytes.values()) / 2**20:.2f}",
                     f"{max(meas.peak_bytes.values()) / 2**20:.2f}",
                     f"{e_mem * 100:+.1f}%", f"{spread * 100:.1f}%",
                     "same plan from " + ", ".join(same) if same else ""))
    for name, label, note in skipped:
        rows.append((name, label, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                     "-", note))
    title = (f"Predicted vs measured on {cluster.name} ({args.runtime} runtime, {args.size} "
             f"models, {args.passes} x {args.steps} steps after {args.warmup} warm-up, median "
             "of the slowest rank)")
    header = ("model", "plan", "runtime", "pred ms", "meas ms", "step err", "no-contention err",
              "no-late err", "2nd profile err", "calib ms", "calib err",
              "pred MiB", "meas MiB", "mem err (worst device)", "pass spread", "note")
    print(title)
    print(table(header, rows))
    write_result(record, rows, columns=header, title=title, notes=" ".join(fits),
                 folder=args.results)

    summaries = []

    def summary(what: str, prs: list[tuple[float, float]]) -> None:
        errs = [abs(p / m - 1) for p, m in prs]
        tau = kendalltau([p for p, _ in prs], [m for _, m in prs]).statistic
        summaries.append((what, f"{statistics.mean(errs) * 100:.1f}%",
                          f"{max(errs) * 100:.1f}%", f"{tau:.2f}"))
        print(f"{what}: step-time error mean {summaries[-1][1]}, max {summaries[-1][2]}, "
              f"Kendall tau {summaries[-1][3]}")

    totals = ""
    if pairs:
        fallback = sum(r[10] != args.runtime for r in runs)
        totals = (f"runtime {args.runtime}"
                  + (f" ({fallback} plans it does not run yet on the op path)" if fallback
                     else "")
                  + f"; plans: {len(pairs)}; memory error mean "
                  f"{statistics.mean(mem_err) * 100:.1f}%,"
                  f" max {max(mem_err) * 100:.1f}%; wall {time.perf_counter() - t_all:.0f} s;"
                  f" {load_start} at the start, {load_average()} at the end")
        print("\n" + totals)
        summary("as profiled", pairs)
        errs = [abs(p / m - 1) for p, m in pairs]
        got = {"step-time error mean": statistics.mean(errs), "step-time error max": max(errs),
               "memory error": max(mem_err)}
        met = all(got[k] <= v for k, v in TARGETS.items())
        targets = ("targets (" + ", ".join(f"{k} <= {v * 100:.0f}%: {got[k] * 100:.1f}%"
                                           for k, v in TARGETS.items())
                   + ("): met" if met else "): NOT met"))
        print(targets)
        totals += "; " + targets
        if ratios := setting_ratios(rows):
            summary(SETTING_RATIOS, ratios)
        summary("as profiled, without contention", flat_pairs)
        summary("as profiled, without late receives", on_time_pairs)
        if plain_pairs:
            summary("as profiled, without the DTensor costs", plain_pairs)
        summary("from a second profile after the runs", again_pairs)
        summary("profile against itself (second profile's prediction vs first's)",
                profile_pairs)
    if self_pairs:
        summary("measured against itself (odd passes vs even passes; the measurement's "
                "own error is about half)", self_pairs)
    if cal_pairs:
        summary("calibrated on the other models' runs", cal_pairs)
    write_result(f"{record}-summary", summaries,
                 columns=("prediction", "error mean", "error max", "Kendall tau"),
                 title=f"Step-time error over all plans ({args.runtime} runtime)", notes=totals,
                 folder=args.results)


#: the summary line of :func:`setting_ratios`
SETTING_RATIOS = ("each setting against its plan without settings (predicted step ratio vs "
                  "measured step ratio: what the setting costs, the plain plan's error aside)")


def setting_ratios(rows: list[tuple]) -> list[tuple[float, float]]:
    """Per plan with memory settings (its label the plain plan's and the settings, as
    "even-layers recompute=full"), its step over the same plan's without settings, predicted
    and measured: how well the simulator prices what a setting adds or saves, apart from how
    well it predicts the plain plan (on a noisy host, the two runs' shared slowness cancels).
    ``rows``: the accuracy table's (model, label, runtime, pred ms, meas ms, ...)."""
    by = {(r[0], r[1]): r for r in rows if r[3] != "-" and r[4] != "-"}
    out = []
    for (model, label), r in by.items():
        plain = by.get((model, label.split(" ")[0]))
        if plain is None or plain is r:
            continue
        out.append((float(r[3]) / float(plain[3]), float(r[4]) / float(plain[4])))
    return out


def _signature(plan: ex.Plan) -> tuple:
    """What makes two plans run the same way (the algorithm that made them aside)."""
    return (plan.stages, tuple(sorted(plan.placement.items())), plan.micro_batches,
            plan.schedule if plan.micro_batches > 1 else "", plan.optimizer,
            tuple(plan.settings_of(s) for s in range(len(plan.stages))))


def _pooled(ms: list) -> ex.Measurement:
    """One measurement of a plan from several runs of it: medians over all their steps."""
    if len(ms) == 1:
        return ms[0]
    steps = tuple(x for m in ms for x in m.step_samples_s)
    return dataclasses.replace(
        ms[0], step_s=statistics.median(steps), step_samples_s=steps,
        busy_s={d: statistics.median(m.busy_s[d] for m in ms) for d in ms[0].busy_s},
        peak_bytes={d: max(m.peak_bytes[d] for m in ms) for d in ms[0].peak_bytes},
        steps=len(steps))


if __name__ == "__main__":
    main()
