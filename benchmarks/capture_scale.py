"""Capture time and peak memory for models this machine cannot run: capture without running.

Run: python benchmarks/capture_scale.py [--cases llama-7b,llama-70b,gpt2-small,depth,...]
       [--depth-shape llama-7b] [--depths 8,16,32,80] [--results DIR]

Each case runs in its own process (peak RSS is that process's ``ru_maxrss``, torch included):

- ``llama-7b``, ``llama-70b``, ... (any published shape): built on the meta device, one
  micro-batch of one sequence, captured on fake tensors. Checks the parameter, gradient and
  Adam-state bytes of the graph against 16 bytes per fp32 parameter.
- ``gpt2-small``: GPT-2 small with real random weights (Hugging Face ``GPT2LMHeadModel`` from
  its default config when transformers is installed, else the built-in GPT ``large``, the
  same shape), batch 8 x 256 tokens, captured by running it and on fake tensors side by side:
  the speed-up and whether the two graphs are identical (every node and the fingerprint).
- ``memory-gpt-small``, ``memory-llama-small`` (``memory-NAME-SIZE``): the built-in model
  captured on fake tensors (meta build) and planned on one CPU device: the parameter,
  gradient and Adam-state bytes against the formula (4 + 4 + 8 bytes per fp32 parameter),
  and the activation bytes at the simulated peak against one real step on a CPU rank (its
  measured peak less the state the simulator holds at that moment). Target: activations within 5 %.
  Its fake capture reuses GPT-2's repeated blocks, so this also checks them against a real run.
- ``depth``: one published shape (``--depth-shape``) at several depths (``--depths``), captured
  on fake tensors tracing every block and reusing repeated blocks, side by side: capture time
  with reuse should not grow with depth, and the two graphs must be identical.

Prints tables and writes JSON (``capture_scale``; ``capture_depth`` for the depth case) with the
date, machine and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import torch
from _common import add_results_option, write_result

import explorer as ex
from explorer.core.units import GiB, table
from explorer.costs.memory import node_memory_bytes
from explorer.models.builtin import model_config
from explorer.models.llama import build_llama
from explorer.models.synthetic import roofline_costs

MEMORY_COLUMNS = ("case", "params", "identical_graphs", "param_grad_adam_bytes", "formula_bytes",
                  "state_exact", "predicted_peak_bytes", "measured_peak_bytes",
                  "predicted_activations_bytes", "measured_activations_bytes",
                  "activation_error")
LIMITS = {"llama-7b": (10.0, 2.0), "llama-70b": (30.0, 3.0)}  # seconds, GiB peak RSS


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def _shape_case(name: str) -> dict:
    t0, cpu0 = time.perf_counter(), time.process_time()
    bm = ex.builtin_model(name)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    capture_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    per_node = node_memory_bytes(graph, "adam")
    state_bytes = sum(b for b, n in zip(per_node, graph.nodes, strict=True) if n.kind == "param")
    return {"case": name, "mode": "fake (meta build)", "capture_s": capture_s, "cpu_s": cpu_s,
            "reused_blocks": any("identical blocks" in n for n in graph.notes),
            "peak_rss_gib": _peak_rss_gib(), "nodes": len(graph), "params": bm.n_params,
            "tflop_per_step": graph.total_flops / 1e12,
            "param_grad_adam_bytes": state_bytes, "formula_bytes": 16 * bm.n_params,
            "formula_ok": state_bytes == 16 * bm.n_params, "fingerprint": graph.fingerprint}


def _memory_case(case: str) -> dict:
    """Predicted memory of the fake capture against one real step's measured peak."""
    name, size = case.removeprefix("memory-").rsplit("-", 1)
    t0 = time.perf_counter()
    fake_bm = ex.builtin_model(name, size, weights=False)
    fake = ex.capture(fake_bm.module, fake_bm.example_inputs, fake_bm.loss_fn,
                      fake_bm.targets, name=name)
    capture_s = time.perf_counter() - t0
    cl = ex.Cluster.cpu(1, measure=False)
    plan = ex.Plan.single(fake, "cpu:0")
    pred = ex.simulate(fake, plan, roofline_costs(fake, cl)).memory["cpu:0"]
    bm = ex.builtin_model(name, size)
    real = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    meas = ex.run(real, plan=plan, steps=1, warmup=1, progress=False, timeout_s=300)
    n = bm.n_params
    per_node = node_memory_bytes(fake, "adam")
    state = sum(b for b, nd in zip(per_node, fake.nodes, strict=True) if nd.kind == "param")
    # the gradients live at the peak are the simulator's; everything else the run measured
    # beyond the state at that moment is activations
    measured_act = meas.peak_bytes["cpu:0"] - (pred.params_bytes + pred.grads_bytes
                                               + pred.optimizer_bytes + pred.buffers_bytes)
    return {"case": case, "mode": "fake vs real run", "capture_s": capture_s,
            "peak_rss_gib": _peak_rss_gib(), "nodes": len(fake), "params": n,
            "tflop_per_step": fake.total_flops / 1e12,
            "identical_graphs": fake.fingerprint == real.fingerprint,
            "param_grad_adam_bytes": state, "formula_bytes": 16 * n,
            "state_exact": (state == 16 * n and pred.params_bytes == 4 * n
                            and pred.optimizer_bytes == 8 * n),
            "predicted_peak_bytes": pred.total_bytes,
            "measured_peak_bytes": meas.peak_bytes["cpu:0"],
            "predicted_activations_bytes": pred.activations_bytes,
            "measured_activations_bytes": measured_act,
            "activation_error": pred.activations_bytes / measured_act - 1}


def _gpt2_small() -> tuple[torch.nn.Module, tuple, tuple, object, str]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50257, (8, 257), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    try:
        import transformers
    except ImportError:
        bm = ex.builtin_model("gpt", "large")
        return bm.module, (x,), (y,), bm.loss_fn, "built-in gpt large"
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)

    def loss(out, labels):
        return torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size),
                                                 labels.reshape(-1))

    return model, (x,), (y,), loss, "HF GPT2LMHeadModel"


def _gpt2_case(fake: bool) -> dict:
    model, x, y, loss, what = _gpt2_small()
    t0 = time.perf_counter()
    graph = ex.capture(model, x, loss, y, name="gpt2-small", fake=fake)
    capture_s = time.perf_counter() - t0
    return {"case": "gpt2-small", "mode": "fake" if fake else "real run", "model": what,
            "capture_s": capture_s, "peak_rss_gib": _peak_rss_gib(), "nodes": len(graph),
            "params": sum(p.numel() for p in model.parameters()),
            "tflop_per_step": graph.total_flops / 1e12, "fingerprint": graph.fingerprint,
            "node_digest": hash(tuple(graph.nodes))}


def _depth_case(shape: str, n_layers: int, reuse: bool) -> dict:
    cfg = dataclasses.replace(model_config(shape), n_layers=n_layers)
    module, x, y, loss, _ = build_llama(cfg, cfg.batch_size, None)  # on the meta device
    t0, cpu0 = time.perf_counter(), time.process_time()
    graph = ex.capture(module, x, loss, y, name=f"{shape}-{n_layers}", reuse_blocks=reuse)
    return {"capture_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
            "peak_rss_gib": _peak_rss_gib(),
            "nodes": len(graph), "fingerprint": graph.fingerprint,
            "node_digest": hash(tuple(graph.nodes)),
            "reused": any("identical blocks" in n for n in graph.notes)}


def _child(case: str, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--child", case, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONHASHSEED": "0"})
    if out.returncode:
        raise SystemExit(f"{case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _depth_rows(shape: str, depths: list[int]) -> list[dict]:
    rows = []
    for n_layers in depths:
        every = _child("depth", "--depth-shape", shape, "--depths", str(n_layers))
        reused = _child("depth", "--depth-shape", shape, "--depths", str(n_layers), "--reuse")
        same = ((every["fingerprint"], every["node_digest"])
                == (reused["fingerprint"], reused["node_digest"]))
        rows.append({"shape": shape, "layers": n_layers, "nodes": every["nodes"],
                     "every_block_s": every["capture_s"], "reused_s": reused["capture_s"],
                     "speedup": every["capture_s"] / reused["capture_s"],
                     "every_block_cpu_s": every["cpu_s"], "reused_cpu_s": reused["cpu_s"],
                     "every_block_rss_gib": every["peak_rss_gib"],
                     "reused_rss_gib": reused["peak_rss_gib"],
                     "blocks_reused": reused["reused"], "identical_graphs": same})
    print(table(("shape", "layers", "nodes", "every block s", "reused s", "speed-up",
                 "CPU s (every / reused)", "RSS GiB (every / reused)", "graphs"),
                [(r["shape"], r["layers"], r["nodes"], f"{r['every_block_s']:.1f}",
                  f"{r['reused_s']:.1f}", f"{r['speedup']:.1f}x",
                  f"{r['every_block_cpu_s']:.1f} / {r['reused_cpu_s']:.1f}",
                  f"{r['every_block_rss_gib']:.2f} / {r['reused_rss_gib']:.2f}",
                  ("identical" if r["identical_graphs"] else "DIFFER")
                  + ("" if r["blocks_reused"] else " (not reused)")) for r in rows]))
    return rows


def _load_note() -> str:
    """The machine's load while measuring: shared machines inflate wall-clock seconds (the
    CPU seconds beside them are this process's own)."""
    load = os.getloadavg()[0]
    return f"load average {load:.1f} on {os.cpu_count()} cores when the last case ended"


def _rounded(rows: list[dict]) -> list[dict]:
    return [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
            for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama-7b,llama-70b,gpt2-small,depth,memory-gpt-small,"
                    "memory-llama-small")
    ap.add_argument("--depth-shape", default="llama-7b",
                    help="published Llama shape the depth case deepens (default llama-7b)")
    ap.add_argument("--depths", default="8,16,32,80",
                    help="numbers of layers for the depth case (default 8,16,32,80)")
    add_results_option(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reuse", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child == "depth":
            row = _depth_case(args.depth_shape, int(args.depths), args.reuse)
        elif args.child == "gpt2-small":
            row = _gpt2_case(args.fake)
        elif args.child.startswith("memory-"):
            row = _memory_case(args.child)
        else:
            row = _shape_case(args.child)
        print(json.dumps(row))
        return
    cases = args.cases.split(",")
    if "depth" in cases:
        depth = _depth_rows(args.depth_shape, [int(d) for d in args.depths.split(",")])
        write_result("capture_depth", _rounded(depth), folder=args.results, notes=_load_note(),
                     title="Capture time by depth: every block traced, or repeated blocks "
                           "reused")
    rows = []
    for case in (c for c in cases if c != "depth"):
        if case == "gpt2-small":
            real, fake = _child(case), _child(case, "--fake")
            same = (real["fingerprint"], real["node_digest"]) == (fake["fingerprint"],
                                                                  fake["node_digest"])
            for r in (real, fake):
                r["identical_graphs"] = same
            fake["speedup_vs_real"] = real["capture_s"] / fake["capture_s"]
            rows += [real, fake]
        elif case.startswith("memory-"):
            rows.append(_child(case, "--fake"))
        else:
            row = _child(case, "--fake")
            limit_s, limit_gib = LIMITS.get(case, (None, None))
            row["within_target"] = (limit_s is None or (row["capture_s"] <= limit_s
                                                        and row["peak_rss_gib"] <= limit_gib))
            rows.append(row)
    if not rows:
        return
    print(table(("case", "mode", "capture s", "peak RSS GiB", "nodes", "params", "TFLOP/step",
                 "check"),
                [(r["case"], r["mode"], f"{r['capture_s']:.1f}", f"{r['peak_rss_gib']:.2f}",
                  r["nodes"], f"{r['params'] / 1e9:.3f}B", f"{r['tflop_per_step']:.1f}",
                  _check(r)) for r in rows]))
    rows = _rounded(rows)
    memory = [r for r in rows if "activation_error" in r]
    if memory:
        write_result("capture_memory", [{k: r[k] for k in MEMORY_COLUMNS} for r in memory],
                     folder=args.results, title="Memory of a fake capture: predicted (one CPU "
                     "device) against one real step measured on a CPU rank")
    if len(memory) < len(rows):
        write_result("capture_scale", [r for r in rows if r not in memory],
                     folder=args.results, notes=_load_note(),
                     title="Capture without running: time and peak memory by model shape")


def _check(r: dict) -> str:
    if "formula_ok" in r:
        bytes_ok = "16 B/param ok" if r["formula_ok"] else "16 B/param WRONG"
        return f"{bytes_ok}; {'within' if r['within_target'] else 'OVER'} target"
    if "activation_error" in r:
        return (f"16 B/param {'exact' if r['state_exact'] else 'WRONG'}; "
                f"activations {r['activation_error'] * 100:+.1f}% vs measured "
                f"({'within' if abs(r['activation_error']) <= 0.05 else 'OVER'} 5%)")
    if "speedup_vs_real" in r:
        return (f"{r['speedup_vs_real']:.1f}x faster; graphs "
                f"{'identical' if r['identical_graphs'] else 'DIFFER'}")
    return "graphs identical" if r["identical_graphs"] else "graphs DIFFER"


if __name__ == "__main__":
    main()
