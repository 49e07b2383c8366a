"""Check the plan's memory strategies on one lent GPU: recomputation and bf16/fp16 precision of
the single-device plan, predicted (from the GPU's profile and from the GPU's preset) vs run.

Run:  python benchmarks/gpu_strategies.py [--models gpt,llama,mlp,resnet] [--size default]
          [--settings fp32,bf16,...] [--steps 5] [--budget-s 420] [--fresh] [--out PATH]
      python benchmarks/gpu_strategies.py --dry-run [--out PATH]   # CPU, tiny, 2 steps
      python benchmarks/gpu_strategies.py --report                 # no GPU: the tables

Per built-in model (captured in fp32, profiled on the GPU once: the ``<model>/profile`` case)
and per setting of ``plan.with_memory`` on its single-device plan (``<model>/<setting>``):

* predicted: ``ex.simulate`` with the profiled costs, and with the roofline costs of the
  preset named like the GPU (``H100`` and ``H100-measured`` on an H100, ``H200`` on an H200;
  the datasheet peaks of the nearest preset where none is), step time and peak memory;
* measured: ``ex.run`` on the GPU (NCCL, world size 1), ``--steps`` steps after 2 warm-up
  steps: median step, peak allocated memory, and every step's loss, which the tables set
  against the fp32 run's losses of the same model (the same data and seed).

Two settings check code paths rather than figures: ZeRO 3 on the one-replica stage (the
runtime has nothing to shard there and runs it as ZeRO 0; the case records that ex.run
accepts it on NCCL), and ZeRO 3 with full recomputation and bf16 together. Tensor
parallelism needs as many ranks as its degree, which one GPU cannot give (NCCL refuses two
ranks on one device), and degree 1 is the fp32 case: it is not run.

Results go to benchmarks/results/gpu_strategies.json after every case; a later command skips
the cases already there (see benchmarks/_gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from typing import Any

import _gpu as gpu
from _common import dry_run_ranks
from gpu_check import MULTI_GPU_NOTE, one_device

import explorer as ex
from explorer.core.units import table
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool

#: the settings, by name, as ``plan.with_memory`` takes them; fp32 (no setting) is the baseline
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "recompute selective": {"recompute": "selective"},
    "recompute full": {"recompute": "full"},
    "fp16": {"precision": "fp16"},
    "zero 3": {"zero": 3},
    "zero 3 + recompute full + bf16": {"zero": 3, "recompute": "full", "precision": "bf16"},
}
#: the settings that check a code path: run on the first model only
CODE_PATH_SETTINGS = ("zero 3", "zero 3 + recompute full + bf16")
#: the models whose cases run first (transformers: where recomputation and bf16 matter most)
FIRST_MODELS = ("gpt", "llama")
#: how far a setting's losses may stray from the fp32 run's (largest relative difference over
#: every step): half precision rounds each matmul's output, and a few Adam steps carry that
#: on; recomputation and one-replica ZeRO redo the same fp32 arithmetic (GPU kernels may sum
#: in another order)
LOSS_TOLERANCE = {"bf16": 5e-2, "fp16": 2e-2, "fp32": 1e-3}
WARMUP = 2
RUN_TIMEOUT_S = 90.0
ZERO_NOTE = ("ZeRO on a stage of one replica: the runtime shards nothing (ZeRO runs as 0 with "
             "one replica, explorer/runtime/params.py), so the case checks that ex.run takes the "
             "plan on NCCL with world size 1, not ZeRO's collectives")
TENSOR_NOTE = ("Tensor parallelism is not run: a degree above 1 needs that many ranks, which "
               "one GPU cannot hold (NCCL refuses two ranks on one device); degree 1 is the "
               "fp32 case")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu.common_args(ap, default_budget_s=420.0)
    ap.add_argument("--models", default="gpt,llama,mlp,resnet",
                    help="comma-separated built-in models (gpt and llama run first)")
    ap.add_argument("--size", default=None, help="model size (default: default; dry run: tiny)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, of: {', '.join(SETTINGS)}")
    ap.add_argument("--steps", type=int, default=None, help="default 5 (dry run: 2)")
    args, out = gpu.parse(ap, "gpu_strategies", summarize_strategies, report)
    dry = args.dry_run
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or "fp32" not in settings:
        sys.exit(f"--settings: unknown {unknown} or no fp32 (the losses' reference); "
                 f"use some of {', '.join(SETTINGS)}")
    size = args.size or ("tiny" if dry else "default")
    steps = args.steps or (2 if dry else 5)
    cluster = one_device(dry)
    info = gpu.device_info()
    presets = preset_clusters(info["nvml_device_name"], cluster, dry)
    res = gpu.Results(out, args.fresh, {
        "what": "gpu_strategies: memory settings of the single-device plan, predicted vs run",
        "dry_run": dry, "device": info, "cluster": cluster.describe(), "size": size,
        "steps": steps, "warmup": WARMUP, "presets": [label for label, _ in presets],
        "loss_tolerance": LOSS_TOLERANCE})
    with dry_run_ranks(dry) as pool:
        models = Models(size, cluster, presets, dry, pool)
        cases = [(key, lambda m=m, s=s: (models.profile_case(m) if s == "profile" else
                                         setting_case(models, m, s, steps)))
                 for key, m, s in case_order(args.models.split(","), settings)]
        # a case that will capture and profile its model is timed like a profile (a model
        # whose profile case was left out for time leaves its settings out too)
        finished = res.work(cases, args.budget_s, kind=lambda key: "run" if (
            not key.endswith("/profile") and key.split("/")[0] in models.ready) else "profile")
    summarize_strategies(res.data)
    res.save()
    report(res.data)
    print(f"results: {out}" + ("" if finished else " (not finished: run again to resume)"))


def case_order(models: list[str], settings: list[str]) -> list[tuple[str, str, str]]:
    """(key, model, setting) of every case, the most telling first: gpt and llama profiled
    with fp32, bf16 and recomputation; then their fp16; then the code-path settings on the
    first model; then the other models, every setting but the code-path ones."""
    first = [m for m in models if m in FIRST_MODELS] or models[:1]
    rest = [m for m in models if m not in first]
    main_settings = [s for s in settings if s not in CODE_PATH_SETTINGS and s != "fp16"]
    order = [(m, s) for m in first for s in ["profile", *main_settings]]
    if "fp16" in settings:
        order += [(m, "fp16") for m in first]
    order += [(first[0], s) for s in settings if s in CODE_PATH_SETTINGS]
    order += [(m, s) for m in rest
              for s in ["profile", *[s for s in settings if s not in CODE_PATH_SETTINGS]]]
    return [(f"{m}/{s}", m, s) for m, s in order]


def preset_clusters(nvml_name: str, cluster: ex.Cluster, dry: bool
                    ) -> list[tuple[str, ex.Cluster]]:
    """The clusters whose roofline costs predict beside the profile, labelled: the presets
    named like the GPU (``"H100"`` and its measured fit ``"H100-measured"``), else the one-GPU
    cluster as ``Cluster.discover`` gave it (the nearest preset's datasheet peaks); in a dry
    run the ``H100`` preset, to go through the same code."""
    if dry:
        return [("H100", ex.Cluster.preset("H100"))]
    found = []
    for key in ex.Cluster.presets():
        pc = ex.Cluster.preset(key)
        name = pc.devices[0].name
        if name == nvml_name or name.startswith(f"{nvml_name} ("):
            found.append((key, pc))
    return found or [(f"datasheet of {cluster.devices[0].name}", cluster)]


class Models:
    """Each model captured and profiled once per command (on the GPU afresh, as gpu_check.py
    does; a dry run reuses cached CPU profiles), with its presets' roofline costs."""

    def __init__(self, size: str, cluster: ex.Cluster, presets: list[tuple[str, ex.Cluster]],
                 dry: bool, pool: RankPool | None = None) -> None:
        self.size, self.cluster, self.presets, self.dry = size, cluster, presets, dry
        self.ready: dict[str, dict[str, Any] | Exception] = {}
        #: the ranks a dry run's real runs share (it checks code paths, not rank start-up);
        #: on the GPU each run starts its own, as a user's does
        self.pool = pool

    def get(self, name: str) -> dict[str, Any]:
        """``graph``, ``costs`` (profiled), ``presets`` (label: (cluster, roofline costs)),
        ``capture_s`` and ``profile_s`` of model ``name``; a model that failed once fails
        again at once."""
        if name not in self.ready:
            try:
                self.ready[name] = self._prepare(name)
            except Exception as exc:
                self.ready[name] = exc
        got = self.ready[name]
        if isinstance(got, Exception):
            raise RuntimeError(f"{name} could not be captured or profiled: "
                               f"{type(got).__name__}: {got}") from got
        return got

    def _prepare(self, name: str) -> dict[str, Any]:
        bm = ex.builtin_model(name, self.size)
        t0 = time.perf_counter()
        graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                           name=f"{name}-{self.size}")
        capture_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            # the half precisions timed too, as `explorer plan --precision` does
            costs, profile_error = ex.profile(graph, self.cluster, repeats=3 if self.dry
                                              else 10, cache=self.dry, progress=False,
                                              precisions=("bf16", "fp16")), None
        except Exception as exc:  # the runs and the presets' predictions go on without it
            costs, profile_error = None, f"{type(exc).__name__}: {exc}"
        return {"graph": graph, "costs": costs, "profile_error": profile_error,
                "capture_s": capture_s, "profile_s": time.perf_counter() - t0,
                "batch": bm.batch_size, "params": bm.n_params,
                "presets": {label: (pc, roofline_costs(graph, pc))
                            for label, pc in self.presets}}

    def profile_case(self, name: str) -> dict[str, Any]:
        """The ``<model>/profile`` case: capture and profile, timed."""
        m = self.get(name)
        if m["profile_error"]:
            raise RuntimeError(f"profiling failed after {m['profile_s']:.0f} s (the settings "
                               f"run without the profiled prediction): {m['profile_error']}")
        return {"model": name, "size": self.size, "batch": m["batch"], "params": m["params"],
                "ops": sum(n.kind == "op" for n in m["graph"].nodes),
                "capture_s": m["capture_s"], "profile_s": m["profile_s"]}


def single_plan(graph: ex.OpGraph, cluster: ex.Cluster, settings: dict[str, Any]) -> ex.Plan:
    """The plan that runs the whole graph on the cluster's first device, with ``settings``
    (``plan.with_memory``)."""
    plan = ex.Plan.single(graph, cluster.ids[0])
    return plan.with_memory(**settings) if settings else plan


def setting_case(models: Models, name: str, setting: str, steps: int) -> dict[str, Any]:
    """One setting of one model: predicted from the profile and the presets, then run."""
    m = models.get(name)
    graph, costs, cluster = m["graph"], m["costs"], models.cluster
    plan = single_plan(graph, cluster, SETTINGS[setting])
    dev = cluster.ids[0]
    out: dict[str, Any] = {
        "model": name, "setting": setting, "settings": SETTINGS[setting],
        "plan_settings": plan.settings_of(0).describe() or "defaults", "presets": {}}
    if costs is None:
        out["predicted"] = {"step_s": None, "peak_bytes": None,
                            "error": f"no profile: {m['profile_error']}"}
    else:
        pred = ex.simulate(graph, plan, costs)
        out["predicted"] = {"step_s": pred.step_s, "peak_bytes": pred.peak_bytes[dev],
                            "fits": pred.fits}
        if plan.settings_of(0).precision != "fp32":  # the precision's rule on the fp32 times
            rule = dataclasses.replace(costs, per_type={
                k: dataclasses.replace(v, precision_s={}) for k, v in costs.per_type.items()})
            out["predicted"]["rule_step_s"] = ex.simulate(graph, plan, rule).step_s
    for label, (pc, pcosts) in m["presets"].items():
        pp = ex.simulate(graph, single_plan(graph, pc, SETTINGS[setting]), pcosts)
        out["presets"][label] = {"step_s": pp.step_s, "peak_bytes": pp.peak_bytes[pc.ids[0]]}
    t0 = time.perf_counter()
    meas = ex.run(graph, plan=plan, steps=steps, warmup=WARMUP, costs=costs, cluster=cluster,
                  progress=False, timeout_s=RUN_TIMEOUT_S, force=True, pool=models.pool)
    out["run_s"] = time.perf_counter() - t0
    out["measured"] = {"step_s": meas.step_s, "peak_bytes": meas.peak_bytes[dev],
                       "memory_source": meas.memory_source, "losses": list(meas.losses)}
    if setting in CODE_PATH_SETTINGS:
        out["note"] = ZERO_NOTE
    return out


def tolerance(settings: dict[str, Any]) -> float:
    """How far the setting's losses may be from the fp32 run's (relative)."""
    return LOSS_TOLERANCE[settings.get("precision", "fp32")]


def loss_difference(case: dict[str, Any], reference: dict[str, Any] | None) -> float | None:
    """The largest relative difference of the case's losses from the fp32 run's, step by step
    (NaN where a loss is not finite); None without both runs."""
    if not reference or gpu.failure(reference) or "measured" not in reference:
        return None
    ref = reference["measured"]["losses"]
    mine = case["measured"]["losses"]
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine, ref, strict=False)]
    return max(diffs, default=None) if all(map(math.isfinite, diffs)) else math.nan


def summary_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per setting case: the predicted (profiled, presets) and measured step and peak,
    their errors, and the losses against the fp32 run's."""
    rows: list[dict[str, Any]] = []
    labels = data.get("presets", [])
    for key, c in data["cases"].items():
        model, setting = key.split("/", 1)
        if setting == "profile":
            continue
        row: dict[str, Any] = {"model": model, "setting": setting}
        if gpu.failure(c):
            rows.append({**row, "pred ms (profiled)": "error: " + gpu.failure(c)[:90]})
            continue
        p, meas = c["predicted"], c["measured"]
        row["pred ms (profiled)"] = gpu.fmt_ms(p["step_s"])
        for label in labels:
            row[f"pred ms ({label})"] = gpu.fmt_ms(c["presets"].get(label, {}).get("step_s"))
        row["measured ms"] = gpu.fmt_ms(meas["step_s"])
        row["error (profiled)"] = gpu.fmt_error(p["step_s"], meas["step_s"])
        for label in labels:
            row[f"error ({label})"] = gpu.fmt_error(c["presets"].get(label, {}).get("step_s"),
                                                meas["step_s"])
        row["pred MiB"] = gpu.fmt_mib(p["peak_bytes"])
        row["measured MiB"] = gpu.fmt_mib(meas["peak_bytes"])
        row["error MiB"] = gpu.fmt_error(p["peak_bytes"], meas["peak_bytes"])
        diff = loss_difference(c, data["cases"].get(f"{model}/fp32"))
        tol = tolerance(c["settings"])
        row["loss vs fp32"] = ("-" if diff is None else "not finite" if math.isnan(diff)
                               else f"{diff * 100:.3g} %")
        row["loss within"] = (f"{tol * 100:.3g} %: " + ("-" if diff is None else
                              "yes" if diff <= tol else "no"))
        rows.append(row)
    return rows


def summarize_strategies(data: dict[str, Any]) -> None:
    """The record fields benchmarks/report.py renders (see ``summarize``)."""
    notes = gpu.not_run_notes(data)
    profiles = [c for k, c in data["cases"].items() if k.endswith("/profile")
                and not gpu.failure(c)]
    if profiles:
        notes.append("Capture and profile took " + ", ".join(
            f"{c['model']} {c['capture_s']:.0f} + {c['profile_s']:.0f} s" for c in profiles)
            + ".")
    runs = [c["run_s"] for c in data["cases"].values() if "run_s" in c]
    if runs:
        notes.append(f"One ex.run took {statistics.median(runs):.0f} s (median).")
    notes.append(
        f"Models at size {data['size']}, captured in fp32; each setting is "
        "plan.with_memory(...) on the single-device plan. Predicted: ex.simulate with the "
        f"costs profiled on this device, and with the roofline costs of the preset(s) "
        f"{', '.join(data.get('presets', []))}. Measured: ex.run, median of {data['steps']} "
        f"steps after {data['warmup']} warm-up steps; memory: torch.cuda.max_memory_allocated "
        "in the rank. Loss vs fp32: the largest relative difference of any step's loss "
        "(warm-up steps included) from the fp32 run's; tolerance "
        + ", ".join(f"{k} {v * 100:.3g} %" for k, v in data["loss_tolerance"].items()) + ".")
    gpu.summarize(data, "One GPU: memory strategies of the single-device plan, predicted vs "
              "measured", summary_rows(data), [*notes, ZERO_NOTE, TENSOR_NOTE, MULTI_GPU_NOTE])


def report(data: dict[str, Any]) -> None:
    """Print the table of every setting case, the profile cases' failures and the notes."""
    print("\n" + gpu.device_line(data["device"]))
    for key, c in data["cases"].items():
        if key.endswith("/profile") and gpu.failure(c):
            print(f"{key}: {gpu.failure(c)}")
    rows = data["rows"]
    if rows:
        cols = list(dict.fromkeys(k for r in rows for k in r))
        print(table(cols, [[r.get(k, "") for k in cols] for r in rows]))
    for note in data["notes"]:
        print("note:", note)


if __name__ == "__main__":
    main()
