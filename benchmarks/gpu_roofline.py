"""The H100 presets' roofline (datasheet, and the measured fit) against the steps one H100 ran:
no GPU needed, the measured steps come from benchmarks/results/gpu_check.json.

Run: python benchmarks/gpu_roofline.py [--check PATH] [--results DIR]

For every model case that gpu_check.py measured (``<model>/<size>/<dtype>``), the model is
captured here and its single-device plan simulated with roofline costs on
``Cluster.preset("H100")`` (datasheet peaks x 0.6, 8 us per op) and on
``Cluster.preset("H100-measured")`` (the fractions and per-kernel overheads that
gpu_presets.py fitted per op kind and precision). Both are set beside the step the explorer's
runtime measured (``ex.run``, one ATen op at a time from Python, so each op carries Python
dispatch the fitted per-kernel overheads only partly stand for), the eager PyTorch step, and
the prediction from the profile taken on the GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _common import RESULTS, add_results_option, write_result

import explorer as ex
from explorer.core.units import table
from explorer.models.synthetic import roofline_costs

PRESETS = {"datasheet roofline": "H100", "measured-fit roofline": "H100-measured"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def predicted_step_s(graph: ex.OpGraph, preset: str) -> float:
    """The single-device plan's step on one GPU of ``preset``, from roofline costs."""
    cluster = ex.Cluster.preset(preset)
    costs = roofline_costs(graph, cluster)
    return ex.simulate(graph, ex.partition(graph, cluster, costs, "single"), costs).step_s


def _err(p: float, m: float) -> str:
    return f"{(p - m) / m * 100:+.0f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", type=Path, default=RESULTS / "gpu_check.json",
                    help="gpu_check.py's results file")
    add_results_option(ap)
    args = ap.parse_args()
    check = json.loads(args.check.read_text())
    rows = []
    for key, c in check["cases"].items():
        if "measured" not in c:  # the pytest case, and cases that failed or did not run
            continue
        bm = ex.builtin_model(c["model"], c["size"])
        dtype = DTYPES[c["dtype"]]
        module = bm.module.to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in bm.example_inputs)
        graph = ex.capture(module, inputs, bm.loss_fn, bm.targets, name=key)
        meas, eager = c["measured"]["step_s"], c["eager"]["step_s"]
        row = {"case": key, "ops": sum(n.kind == "op" for n in graph.nodes),
               "runtime measured ms": f"{meas * 1e3:.2f}",
               "eager ms": f"{eager * 1e3:.2f}"}
        for label, preset in PRESETS.items():
            p = predicted_step_s(graph, preset)
            row[f"{label} ms"] = f"{p * 1e3:.2f}"
            row[f"{label} error"] = _err(p, meas)
            row[f"{label} error vs eager"] = _err(p, eager)
        p = c["predicted"]["step_s"]
        row["profiled on the GPU ms"] = f"{p * 1e3:.2f}"
        row["profiled error"] = _err(p, meas)
        rows.append(row)
    cols = list(rows[0]) if rows else ["case"]
    print(table(cols, [[r[k] for k in cols] for r in rows]))
    dev = check["device"]
    write_result(
        "gpu_roofline", rows, folder=args.results,
        title="One H100's step: the preset's roofline (datasheet, measured fit) vs measured",
        notes=(f"Predictions computed here (no GPU); measured steps from "
               f"benchmarks/results/gpu_check.json ({dev['nvml_device_name']}, driver "
               f"{dev['driver']}, torch {dev['torch']}). Error = (predicted - runtime "
               "measured) / runtime measured, and against the eager step. The runtime "
               "measured is ex.run's step: one ATen op at a time from Python, whose per-op "
               "dispatch the fitted per-kernel overheads only partly stand for; eager PyTorch "
               "ran the same step 2.7-4.9x faster."))


if __name__ == "__main__":
    main()
