"""How far a GPU preset's datasheet roofline is from one op measured on the device, per op kind,
size and precision, with a fit of what the device achieves.

Run:  python benchmarks/gpu_presets.py [--preset H100] [--kinds matmul,conv2d,...]
          [--precisions fp32,tf32,bf16] [--budget-s 480] [--fresh] [--out PATH]
      python benchmarks/gpu_presets.py --dry-run [--out PATH]   # CPU, tiny sizes

Op kinds: matmuls of several shapes, conv2d, attention (scaled_dot_product_attention),
elementwise add and gelu, reductions (sum, layer_norm), and one Adam step over several tensors.
Each is measured in fp32 (TF32 off), tf32 (TF32 on; only matmul, conv2d and attention use it)
and bf16 as the device's own time: its kernels' time in a torch.profiler trace of the repeats
(``measured_s``; CUDA events around each call, ``events_s``, also hold the gap a host slower
than a small kernel leaves before it, which training hides by issuing ahead), and predicted
the way the cost model's ``roofline`` (explorer/costs/model.py) predicts an op it has not
measured, from the preset's datasheet figures (``ex.Cluster.preset(...)``: flops_per_s,
half_flops_per_s, mem_bandwidth_bytes_per_s)::

    time = overhead + max(FLOPs / (peak x efficiency), bytes moved / (bandwidth x efficiency))

with peak = half_flops_per_s for bf16 and flops_per_s otherwise (the cost model has no TF32
peak, so tf32 is predicted like fp32), bytes moved = inputs + output, FLOPs counted by
``torch.utils.flop_counter`` as capture counts them; an Adam step is bandwidth bound:
param bytes x (3 + 2 x 2 states) / (bandwidth x efficiency) + tensors x overhead / 8.

Per op kind and precision a least-squares fit (relative error) of
``time = overhead x launches + max(FLOPs / (peak x f_flops), bytes / (bandwidth x f_bw))``
gives the achievable fractions of peak FLOP/s and bandwidth and the overhead per kernel (per
tensor for Adam), stored as "fitted, measured on <device>, <date>". A fraction no case was
bound by is left undetermined. Resumable like gpu_check.py (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _gpu import (
    Results,
    common_args,
    device_info,
    device_line,
    failure,
    kernel_time_s,
    median_time_s,
    parse,
    summarize,
)
from scipy.optimize import least_squares, nnls
from torch.utils.flop_counter import FlopCounterMode

import explorer as ex
from explorer.core.plan import OPTIMIZER_STATE
from explorer.core.units import table
from explorer.costs.model import NOMINAL_OVERHEAD_S, ROOFLINE_EFFICIENCY

PRECISIONS = ("fp32", "tf32", "bf16")
#: kinds whose kernels use TF32 when it is allowed
TF32_KINDS = ("matmul", "conv2d", "attention")
GPU_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "matmul": [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (8192, 768, 3072),
               (16384, 4096, 1024), (64, 4096, 4096)],                        # M, K, N
    "conv2d": [(64, 64, 56, 64, 3), (64, 128, 28, 128, 3), (64, 256, 14, 256, 3),
               (64, 512, 7, 512, 3), (32, 3, 224, 64, 7)],                    # N, C, HW, K, R
    "attention": [(8, 12, 512, 64), (8, 12, 1024, 64), (8, 12, 2048, 64),
                  (4, 16, 4096, 128)],                                        # B, heads, T, D
    "add": [(2**16,), (2**20,), (2**24,), (2**27,)],                          # elements
    "gelu": [(2**16,), (2**20,), (2**24,), (2**27,)],
    "sum": [(2**16,), (2**20,), (2**24,), (2**27,)],
    "layernorm": [(1024, 1024), (8192, 768), (8192, 4096), (32768, 4096)],    # rows, features
    "adam": [(10, 2**16), (10, 2**20), (100, 2**20), (10, 2**24)],            # tensors, elems
}
DRY_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "matmul": [(32, 32, 32), (128, 128, 128), (256, 64, 128)],
    "conv2d": [(2, 3, 16, 8, 3), (4, 8, 8, 8, 3), (2, 8, 16, 16, 3)],
    "attention": [(1, 2, 16, 8), (2, 2, 32, 16), (1, 4, 64, 16)],
    "add": [(2**10,), (2**14,), (2**16,)],
    "gelu": [(2**10,), (2**14,), (2**16,)],
    "sum": [(2**10,), (2**14,), (2**16,)],
    "layernorm": [(16, 32), (64, 64), (256, 128)],
    "adam": [(4, 2**8), (4, 2**12), (16, 2**12)],
}

#: a term decides a case when it is at least this share of the case's modelled time
MIN_SHARE = 0.2
#: what an op case builds: the call to time, FLOPs, bytes moved, launches (kernels or tensors)
Op = tuple[Callable[[], Any], int, int, int]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, default_budget_s=480.0)
    ap.add_argument("--preset", default=None,
                    help="preset whose datasheet predicts (default: the one named like the GPU)")
    ap.add_argument("--kinds", default=",".join(GPU_SHAPES))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    args, out = parse(ap, "gpu_presets", summarize_presets, report)
    dry = args.dry_run
    cuda = torch.cuda.is_available() and not dry
    kinds = args.kinds.split(",")
    precisions = args.precisions.split(",")
    for name, got, known in (("kind", kinds, GPU_SHAPES), ("precision", precisions, PRECISIONS)):
        bad = [k for k in got if k not in known]
        if bad:
            sys.exit(f"unknown {name} {', '.join(bad)}: use {', '.join(known)}")
    info = device_info()
    dev = datasheet_device(args.preset, info["nvml_device_name"], dry)
    res = Results(out, args.fresh, {
        "what": "gpu_presets: datasheet roofline vs one op measured, and fitted fractions",
        "dry_run": dry, "device": info,
        "datasheet": {"name": dev.name, "flops_per_s": dev.flops_per_s,
                      "half_flops_per_s": dev.half_flops_per_s,
                      "mem_bandwidth_bytes_per_s": dev.mem_bandwidth_bytes_per_s,
                      "source": dev.source},
        "roofline": {"efficiency": ROOFLINE_EFFICIENCY,
                     "overhead_s": NOMINAL_OVERHEAD_S.get(dev.kind, 5e-6),
                     "formula": "explorer/costs/model.py roofline; tf32 predicted as fp32"}})
    shapes = DRY_SHAPES if dry else GPU_SHAPES
    tdev = torch.device("cuda" if cuda else "cpu")
    repeats, warmup = (5, 1) if dry else (30, 5)
    if dry:
        torch.set_num_threads(1)  # tiny ops on a shared CPU: one thread times steadier
    cases = [(f"{kind}/{prec}/{'x'.join(map(str, shape))}",
              lambda k=kind, p=prec, s=shape: op_case(k, p, s, tdev, dev, repeats, warmup))
             for kind in kinds for prec in precisions for shape in shapes[kind]
             if prec != "tf32" or kind in TF32_KINDS]
    finished = res.work(cases, args.budget_s)
    res.data["fits"] = fit_all(res.cases, info["nvml_device_name"] if cuda else dev.name)
    summarize_presets(res.data)
    res.save()
    report(res.data)
    print(f"results: {out}" + ("" if finished else " (not finished: run again to resume)"))


def datasheet_device(preset: str | None, nvml_name: str, dry: bool) -> ex.Device:
    """The device whose figures predict: a nominal CPU rank in a dry run, else ``preset``,
    else the preset with the GPU's NVML name, else what ``Cluster.discover`` gives the GPU
    (the datasheet peaks of the nearest preset)."""
    if dry:
        return ex.Cluster.cpu(1, measure=False).devices[0]
    if preset:
        return ex.Cluster.preset(preset).devices[0]
    for key in ex.Cluster.presets():
        d = ex.Cluster.preset(key).devices[0]
        if d.name == nvml_name:
            return d
    return next(d for d in ex.Cluster.discover().devices if d.kind == "cuda")


def set_precision(prec: str) -> torch.dtype:
    """TF32 on only for "tf32" (matmuls and cuDNN convolutions); the tensors' dtype."""
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    torch.backends.cudnn.allow_tf32 = prec == "tf32"
    return torch.bfloat16 if prec == "bf16" else torch.float32


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def build_op(kind: str, shape: tuple[int, ...], dtype: torch.dtype, tdev: torch.device) -> Op:
    """The call to time for one case, with its FLOPs (counted as capture counts them), bytes
    moved (inputs + output, as the roofline counts them) and launches."""
    gen = torch.Generator(device=tdev).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=tdev, dtype=dtype)

    if kind == "adam":
        n_tensors, numel = shape
        params = [torch.nn.Parameter(rand(numel)) for _ in range(n_tensors)]
        for p in params:
            p.grad = rand(numel)
        opt = torch.optim.Adam(params, lr=1e-3)
        opt.step()  # creates the state
        moved = _nbytes(*params) * (3 + 2 * OPTIMIZER_STATE["adam"])
        return opt.step, 0, moved, n_tensors
    if kind == "matmul":
        m, k, n = shape
        args: tuple[torch.Tensor, ...] = (rand(m, k), rand(k, n))
        fn: Callable[..., torch.Tensor] = torch.matmul
    elif kind == "conv2d":
        n, c, hw, k, r = shape
        args = (rand(n, c, hw, hw), rand(k, c, r, r))

        def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return F.conv2d(x, w, padding=r // 2)
    elif kind == "attention":
        b, h, t, d = shape
        args = (rand(b, h, t, d), rand(b, h, t, d), rand(b, h, t, d))
        fn = F.scaled_dot_product_attention
    elif kind == "layernorm":
        rows, feat = shape
        args = (rand(rows, feat), rand(feat), rand(feat))

        def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x, (feat,), w, b)
    else:
        args = (rand(*shape), rand(*shape)) if kind == "add" else (rand(*shape),)
        fn = {"add": torch.add, "gelu": F.gelu, "sum": torch.sum}[kind]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = fn(*args)
    return (lambda: fn(*args)), int(counter.get_total_flops()), _nbytes(*args, out), 1


def roofline_s(flops: int, moved: int, launches: int, kind: str, prec: str,
               dev: ex.Device) -> float:
    """The cost model's roofline estimate (explorer/costs/model.py ``roofline``)."""
    ovh = NOMINAL_OVERHEAD_S.get(dev.kind, 5e-6)
    bw = dev.mem_bandwidth_bytes_per_s * ROOFLINE_EFFICIENCY
    if kind == "adam":  # per byte of parameters and per tensor, as the optimizer step
        return moved / bw + launches * ovh / 8
    peak = (dev.half_flops_per_s if prec == "bf16" else dev.flops_per_s) * ROOFLINE_EFFICIENCY
    return ovh + max(flops / peak, moved / bw)


def op_case(kind: str, prec: str, shape: tuple[int, ...], tdev: torch.device, dev: ex.Device,
            repeats: int, warmup: int) -> dict[str, Any]:
    """Predict and measure one op."""
    dtype = set_precision(prec)
    fn, flops, moved, launches = build_op(kind, shape, dtype, tdev)
    cuda = tdev.type == "cuda"
    measured = median_time_s(fn, cuda, repeats, warmup)
    kernels = kernel_time_s(fn, repeats, warmup) if cuda else None
    device = kernels or measured  # (the fit and the ratios: the device's own time)
    predicted = roofline_s(flops, moved, launches, kind, prec, dev)
    del fn
    if tdev.type == "cuda":
        torch.cuda.empty_cache()
    return {"kind": kind, "precision": prec, "shape": list(shape), "flops": flops,
            "bytes": moved, "launches": launches, "predicted_s": predicted,
            "events_s": measured, "kernels_s": kernels, "measured_s": device,
            "predicted_over_measured": predicted / device,
            "achieved_flops_per_s": flops / device,
            "achieved_bytes_per_s": moved / device,
            "peak_used": "half_flops_per_s" if prec == "bf16" else "flops_per_s",
            "peak_flops_per_s": dev.half_flops_per_s if prec == "bf16" else dev.flops_per_s,
            "datasheet_bandwidth_bytes_per_s": dev.mem_bandwidth_bytes_per_s,
            "repeats": repeats}


def fit_kind(rows: list[dict[str, Any]], peak: float, bw: float) -> dict[str, Any]:
    """Least squares (relative error) of time = c x launches + max(F / (peak f_flops),
    B / (bw f_bw)) over one kind's cases, started from the linear fit with a sum in place of
    the max (nonnegative least squares)."""
    t = np.array([r["measured_s"] for r in rows])
    launches = np.array([r["launches"] for r in rows], dtype=float)
    f_norm = np.array([r["flops"] for r in rows]) / peak  # seconds at the full peak
    b_norm = np.array([r["bytes"] for r in rows]) / bw
    use_flops = bool(f_norm.any())
    cols = [launches, b_norm] + ([f_norm] if use_flops else [])
    if len(rows) < len(cols):
        return {"points": len(rows), "note": "too few points to fit"}
    a = np.stack(cols, axis=1) / t[:, None]  # relative: each row divided by its time
    x0, _ = nnls(a, np.ones_like(t))
    x0 = np.maximum(x0, 1e-12)

    def model(x: np.ndarray) -> np.ndarray:
        work = x[1] * b_norm if not use_flops else np.maximum(x[1] * b_norm, x[2] * f_norm)
        return x[0] * launches + work

    sol = least_squares(lambda x: model(x) / t - 1.0, x0, bounds=(0.0, np.inf))
    x = sol.x
    fit = model(x)
    # a fraction is determined by the cases whose time its term dominates (the larger of the
    # two, and at least MIN_SHARE of the modelled time); overhead-bound cases say nothing
    t_bw = x[1] * b_norm
    t_fl = x[2] * f_norm if use_flops else np.zeros_like(t)
    by_bw = int(np.sum((t_bw >= t_fl) & (t_bw >= MIN_SHARE * fit) & (t_bw > 0)))
    by_fl = int(np.sum((t_fl > t_bw) & (t_fl >= MIN_SHARE * fit)))
    out: dict[str, Any] = {
        "points": len(rows), "overhead_s": float(x[0]),
        "overhead_per": "tensor" if rows[0]["kind"] == "adam" else "kernel",
        "bandwidth_fraction": float(1.0 / x[1]) if by_bw else None,
        "flops_fraction": float(1.0 / x[2]) if by_fl else None,
        "bound_by_bandwidth": by_bw, "bound_by_flops": by_fl,
        "rms_relative_error": float(math.sqrt(np.mean((fit / t - 1.0) ** 2)))}
    notes = [] if use_flops else ["the FLOP counter counts none for this op"]
    undetermined = [w for w, n in (("FLOP/s", by_fl and use_flops), ("bandwidth", by_bw))
                    if not n and (w != "FLOP/s" or use_flops)]
    if undetermined:
        notes.append(f"fraction of {' and '.join(undetermined)} undetermined: no case was "
                     "bound by it")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def fit_all(cases: dict[str, Any], device_name: str) -> dict[str, Any]:
    """One fit per op kind and precision over the measured cases."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in cases.values():
        if not failure(c):
            groups.setdefault(f"{c['kind']}/{c['precision']}", []).append(c)
    fits = {}
    for key, rows in groups.items():
        when = max(r["measured_at"] for r in rows)[:10]
        # fractions of the datasheet peak the prediction used (tf32: of the fp32 peak)
        fits[key] = {**fit_kind(rows, rows[0]["peak_flops_per_s"],
                                rows[0]["datasheet_bandwidth_bytes_per_s"]),
                     "source": f"fitted, measured on {device_name}, {when}"}
    return fits


def _pct(v: Any) -> str:
    return f"{v * 100:.0f} %" if isinstance(v, float) else "-"


def summary_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per op kind and precision: how the datasheet roofline's prediction compares with the
    measured cases (median and range of predicted / measured), and the fit."""
    groups: dict[str, list[float]] = {}
    for c in data["cases"].values():
        if not failure(c):
            groups.setdefault(f"{c['kind']}/{c['precision']}", []).append(
                c["predicted_over_measured"])
    rows = []
    for key, ratios in groups.items():
        f = data.get("fits", {}).get(key, {})
        rows.append({
            "kind/precision": key, "cases": len(ratios),
            "datasheet roofline / measured, median": f"{float(np.median(ratios)):.2f}",
            "range": f"{min(ratios):.2f}-{max(ratios):.2f}",
            "fitted: of peak FLOP/s": _pct(f.get("flops_fraction")),
            "of bandwidth": _pct(f.get("bandwidth_fraction")),
            "overhead us": (f"{f['overhead_s'] * 1e6:.1f} per {f['overhead_per']}"
                            if "overhead_s" in f else "-"),
            "fit rms error": _pct(f.get("rms_relative_error"))})
    return rows


def summarize_presets(data: dict[str, Any]) -> None:
    """The record fields benchmarks/report.py renders (see ``summarize``)."""
    ds, rl = data["datasheet"], data["roofline"]
    notes = [f"Datasheet roofline of {ds['name']}: fp32 {ds['flops_per_s'] / 1e12:.0f} "
             f"TFLOP/s, bf16 {ds['half_flops_per_s'] / 1e12:.0f} TFLOP/s, "
             f"{ds['mem_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, efficiency "
             f"{rl['efficiency']}, {rl['overhead_s'] * 1e6:.0f} us per op; tf32 is predicted "
             "as fp32, so its fitted fraction is of the fp32 peak. Above 1: the roofline is "
             "slower than measured. Fractions are of the datasheet figures; - where no case "
             "was bound by that term (or the FLOP counter counts none)."]
    summarize(data, "One op at a time: datasheet roofline vs measured, and the fitted "
              "fractions", summary_rows(data), notes)


def report(data: dict[str, Any]) -> None:
    """The per-op table and the fits."""
    print(f"\n{device_line(data['device'])}; predicted from {data['datasheet']['name']}")
    rows = [(key, f"{c['flops'] / 1e9:.3g}", f"{c['bytes'] / 2**20:.3g}",
             f"{c['predicted_s'] * 1e6:.1f}", f"{c['measured_s'] * 1e6:.1f}",
             f"{c['predicted_over_measured']:.2f}",
             f"{c['achieved_flops_per_s'] / 1e12:.3g}",
             f"{c['achieved_bytes_per_s'] / 1e9:.3g}") if not failure(c)
            else (key, f"error: {failure(c)}"[:70], "", "", "", "", "", "")
            for key, c in data["cases"].items()]
    print(table(("case", "GFLOP", "MiB moved", "pred us", "meas us", "pred/meas", "TFLOP/s",
                 "GB/s"), rows))

    fits = [(k, _pct(f.get("flops_fraction")), _pct(f.get("bandwidth_fraction")),
             f"{f['overhead_s'] * 1e6:.2f} per {f['overhead_per']}" if "overhead_s" in f
             else "-", _pct(f.get("rms_relative_error")), f.get("note", ""))
            for k, f in data.get("fits", {}).items()]
    print(table(("kind/precision", "of peak FLOP/s", "of bandwidth", "overhead us",
                 "fit rms err", "note"), fits))


if __name__ == "__main__":
    main()
