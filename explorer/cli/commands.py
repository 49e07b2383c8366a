"""The ``explorer`` command line: list models and algorithms, describe devices, plan a model."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import explorer as ex
from explorer.analysis.throughput import throughput, tokens_per_step
from explorer.cli.arguments import positive_int, whole
from explorer.cli.bounds import check_batch_size
from explorer.cli.memory import add_memory_options, memory_settings
from explorer.cli.splits import add_split_options, split_options
from explorer.core.errors import ExplorerError
from explorer.core.factory import load_factory, untrusted_factory
from explorer.core.plan import SCHEDULES
from explorer.core.units import MiB, table
from explorer.costs.kernels import KERNELS
from explorer.devices.cluster import Cluster, parse_devices
from explorer.models.builtin import build, model_names, shape_names
from explorer.partition import algorithm, algorithms
from explorer.partition.bounds import SearchTooLarge
from explorer.runtime.jobfiles import RUNTIMES


def cmd_models(args: argparse.Namespace) -> int:
    rows = []
    names = shape_names() if args.shapes else model_names()
    for name in names:
        m = build(name, "default" if args.shapes else args.size)
        n_params = sum(p.numel() for p in m.module.parameters())
        shapes = " ".join("x".join(map(str, t.shape)) for t in m.example_inputs)
        rows.append((name, m.size, f"{n_params / 1e6:.2f}M", shapes, m.description))
    if args.json:
        print(json.dumps([dict(zip(("name", "size", "params", "input", "description"), r,
                                   strict=True)) for r in rows], indent=1))
    else:
        print(table(("model", "size", "params", "input", "description"), rows))
    return 0


def cmd_algorithms(args: argparse.Namespace) -> int:
    rows = [(n, algorithm(n).summary,
             ", ".join(f"{k}={v!r}" for k, v in algorithm(n).options.items()))
            for n in algorithms()]
    print(table(("algorithm", "what it does", "options"), rows))
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    if args.presets:
        print("\n".join(Cluster.presets()))
        return 0
    print(parse_devices(args.devices).describe())
    return 0


def _prepare(args: argparse.Namespace, made: Any = None):
    """Build the model (unless ``made``: one built already), capture, choose the cluster and
    profile: shared by plan and friends."""
    cluster = parse_devices(args.devices)  # a bad device spec fails before any work
    t0 = time.perf_counter()
    if made is None:
        check_batch_size(args.model, args.size, args.batch_size)  # before it is built
    bm = made if made is not None else ex.builtin_model(args.model, args.size, args.batch_size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                       name=getattr(bm, "name", None))
    t_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    half = getattr(args, "precision", None)  # timed too, so that stages in it are measured
    costs = ex.profile(graph, cluster, cache=not args.no_cache, progress=not args.quiet,
                       precisions=(half,) if half not in (None, "fp32") else (),
                       # (the runtime the run asks for: its profile predicts it)
                       runtime="ops" if getattr(args, "runtime", None) == "ops" else "segments",
                       kernels=getattr(args, "kernels", "eager"))
    t_profile = time.perf_counter() - t0
    return bm, graph, cluster, costs, t_capture, t_profile


def plan_rows(graph, cluster, costs, names: Sequence[str], settings: dict[str, Any],
              memory: dict[str, Any] | None = None):
    """Run each algorithm and simulate its plan, with the ``memory`` settings
    (``Plan.with_memory``) on all its stages; (name, plan, prediction or error text)."""
    out = []
    for name in names:
        alg = ex.algorithm(name)
        opts = {k: v for k, v in settings.items() if k in alg.options and v is not None}
        if "schedules" in alg.options and settings.get("schedule"):  # (degrees tries several)
            opts["schedules"] = [settings["schedule"]]
        # (degrees ranks its plans with them, async tensor parallelism where it splits
        # by sequence)
        searched_async = "memory" in alg.options and bool(settings.get("async_tensor"))
        context = settings.get("context") or 1
        searched_context = "context_degrees" in alg.options and context > 1
        if searched_context:  # (degrees tries it beside no context split)
            opts["context_degrees"] = [1, context]
        if "memory" in alg.options and (memory or searched_async):
            opts["memory"] = {**(memory or {}),
                              **({"async_tensor": True} if searched_async else {})}
        try:
            plan = ex.partition(graph, cluster, costs, name, **opts)
            if memory:
                plan = _with_memory(plan, memory)
            # (a split the command line asks for is made again here: async goes with it)
            resplit = (settings.get("tensor") or 1) > 1 or bool(settings.get("sequence"))
            plan = split_options(plan, settings.get("tensor") or 1, settings.get("sequence"),
                                 graph, bool(settings.get("async_tensor"))
                                 and (resplit or not searched_async),
                                 1 if searched_context else context)
            out.append((name, plan, ex.simulate(graph, plan, costs)))
        except SearchTooLarge as exc:  # refused before its search: too large for it
            out.append((name, None, f"skipped: {exc}"))
        except ExplorerError as exc:
            out.append((name, None, str(exc)))
    return out


def _with_memory(plan, memory: dict[str, Any]):
    """``plan`` with the command line's memory settings on every stage, noting where ZeRO
    changes nothing (a stage of one device has nothing to shard over)."""
    plan = plan.with_memory(**memory)
    single = [s for s, devs in enumerate(plan.stages) if len(devs) == 1]
    if memory.get("zero") and single:
        plan = plan.with_settings(notes=(*plan.notes, (
            f"ZeRO {memory['zero']} changes nothing on stage(s) "
            f"{', '.join(map(str, single))}: one device each, nothing to shard over")))
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    names = ex.algorithms() if args.algorithm == "all" else [args.algorithm]
    for n in names:
        ex.algorithm(n)  # unknown names fail before any work is done
    bm, graph, cluster, costs, t_cap, t_prof = _prepare(args)
    settings = {"micro_batches": args.micro_batches, "schedule": args.schedule,
                "optimizer": args.optimizer, "virtual_stages": args.virtual_stages,
                "tensor": args.tensor,
                "sequence": args.sequence_parallel, "async_tensor": args.async_tensor,
                "context": args.context}
    results = plan_rows(graph, cluster, costs, names, settings, memory_settings(args))
    ok = [(n, p, r) for n, p, r in results if p is not None]
    best = min((x for x in ok if x[2].fits), key=lambda x: x[2].step_s, default=None)
    if args.out and ok:
        if best is None:
            raise ExplorerError("no plan fits the devices' memory; nothing was saved")
        replace(best[1], model=bm.record).save(args.out)
    if args.json:
        print(json.dumps({
            "model": bm.name, "size": bm.size, "graph": graph.summary(),
            "cluster": cluster.name, "kernels": args.kernels, "capture_s": t_cap,
            "profile_s": t_prof,
            "plans": [_plan_json(n, p, r, graph, costs.cluster) for n, p, r in results],
            "best": best[0] if best else None, "saved": args.out if ok else None}, indent=1))
        return _all_failed(results)
    s = graph.summary()
    print(f"{bm.name} ({bm.size}): {s['ops']} ops, {s['params_bytes'] / MiB:.1f} MiB params, "
          f"{s['gflops_per_step']:.2f} GFLOP/step, batch {s['batch_size']}, captured in "
          f"{t_cap:.1f} s, profiled in {t_prof:.1f} s")
    print(f"devices: {cluster.name}"
          + (", ops priced as compiled (fused) kernels" if args.kernels == "compiled" else "")
          + "\n")
    language = tokens_per_step(graph) is not None
    rows = []
    for n, p, r in results:
        if p is None:
            rows.append((n, "-", *["-"] * language, "-", "-", "-", "-", "-", "-", "-",
                         r if r.startswith("skipped: ") else "error: " + r))
            continue
        rate = throughput(graph, p, costs.cluster, r.step_s)
        mem = peak_text(p, r.peak_bytes)
        note = p.notes[0] if p.notes else ""
        if p.uses_memory_settings:  # which settings, before anything else
            note = f"[{_settings_text(p)}] {note}"
        deg = plan_degrees(p)
        rows.append((n + (" *" if best and n == best[0] else ""), f"{r.step_s * 1e3:.2f}",
                     *([f"{rate.tokens_per_s_per_device:,.0f} ({rate.mfu:.1%})"
                        if rate else "-"] * language),
                     deg["text"], str(p.micro_batches) + (f" {p.schedule}" if deg["pp"] > 1
                                                          else ""),
                     f"{r.lower_bound_s * 1e3:.2f}", f"{r.gap * 100:.0f}%", mem,
                     f"{r.cross_device_bytes / MiB:.2f}",
                     "yes" if r.fits else "NO: " + r.memory_report(),
                     note if len(note) <= 70 else note[:67] + "..."))
    print(table(("algorithm", "step ms", *["tokens/s/device (MFU)"] * language,
                 "dp x tp x pp", "micro-batches", "lower bound ms",
                 "gap to bound",
                  "peak MiB per device", "MiB across devices", "fits", "notes"), rows))
    print("\nlower bound: total compute on the fastest device type / "
          f"{len(cluster)} devices; no plan can beat it")
    if best:
        print(f"\n* fastest plan that fits: {best[0]}"
              + (f" (saved to {args.out})" if args.out else ""))
    return _all_failed(results)


#: beyond this many devices a plan's peak memory is shown per stage, not per device
PEAKS_SHOWN = 8


def peak_text(plan, peak_bytes: dict[str, int]) -> str:
    """The plan's peak memory per device in MiB, in device order; beyond :data:`PEAKS_SHOWN`
    devices, each stage's highest (``"max per stage: a / b"``)."""
    if len(plan.devices) <= PEAKS_SHOWN:
        return " ".join(f"{peak_bytes[d] / MiB:.1f}" for d in plan.devices)
    return "max per stage: " + " / ".join(
        f"{max(peak_bytes[d] for d in devices) / MiB:.1f}" for devices in plan.stages)


def _all_failed(results: list) -> int:
    """1, with the errors on stderr, when no algorithm made a plan; else 0."""
    if any(p is not None for _, p, _ in results):
        return 0
    print("error: no algorithm made a plan:\n" + "\n".join(f"  {n}: {r}" for n, _, r in results),
          file=sys.stderr)
    return 1


def _model_from_plan(args: argparse.Namespace, plan) -> None:
    """Fill the model options the user left out from what the plan recorded (else the
    defaults): the plan's model is rebuilt as it was planned."""
    rec = plan.model or {}
    if args.model is None:
        args.model = rec.get("builtin") or plan.graph_name or "gpt"
    same = rec.get("builtin") == args.model
    if args.size is None:
        args.size = rec["size"] if same else "default"
    if args.batch_size is None and same and args.size == rec["size"]:
        args.batch_size = rec["batch_size"]


def cmd_run(args: argparse.Namespace) -> int:
    _check_compile(args)
    if args.plan is None:
        ex.algorithm(args.algorithm)  # an unknown name fails before any work is done
        args.model, args.size = args.model or "gpt", args.size or "default"
        made = _from_factory(args.factory) if args.factory else None
    else:  # the plan is checked before any work is done; its factory is never imported
        made, _ = _plan_model(args, ex.Plan.load(args.plan))
    bm, graph, cluster, costs, _, _ = _prepare(args, made)
    if args.plan:
        plan = ex.Plan.load(args.plan, graph, cluster)
    else:
        opts = {"micro_batches": args.micro_batches, "schedule": args.schedule,
                "optimizer": args.optimizer, "virtual_stages": args.virtual_stages}
        alg = ex.algorithm(args.algorithm)
        plan = ex.partition(graph, cluster, costs, args.algorithm,
                            **{k: v for k, v in opts.items()
                               if v is not None and k in alg.options})
    memory = memory_settings(args)
    if memory:
        plan = plan.with_memory(**memory)
    plan = split_options(plan, args.tensor, args.sequence_parallel, graph, args.async_tensor,
                         args.context)
    pred = ex.simulate(graph, plan, costs)
    meas = ex.run(graph, plan=plan, costs=costs, steps=args.steps, warmup=args.warmup,
                  force=args.force, timeout_s=args.timeout, progress=not args.quiet,
                  runtime=args.runtime, compile=args.compile)
    report = ex.compare(pred, meas)
    if args.json:
        print(json.dumps({"model": getattr(bm, "name", args.factory),
                          "size": getattr(bm, "size", None), "plan": plan.to_dict(),
                          "runtime": meas.runtime, "compiled": meas.compiled,
                          "losses": list(meas.losses), **report.to_dict(),
                          "measured_peak_by_category": meas.peak_by_category}, indent=1))
        return 0
    settings = "; ".join(f"stage {k}: {st.describe()}" for k, st in enumerate(
        plan.settings_of(s) for s in range(len(plan.stages))) if not st.is_default)
    print(f"{getattr(bm, 'name', args.factory)} ({getattr(bm, 'size', 'factory')}) under "
          f"{plan.algorithm} on {', '.join(plan.devices)}: "
          f"{args.steps} steps after {args.warmup} warm-up"
          + (f" ({settings})" if settings else ""))
    print(f"losses: {' '.join(f'{x:.4f}' for x in meas.losses)}\n")
    print(report)
    return 0


def _plan_model(args: argparse.Namespace, plan) -> Any:
    """The model to capture for ``plan``: the user's ``--factory``, else the built-in model
    (``--model`` or the plan's record). A factory the plan names is never imported: unless
    the user names one (or a ``--model``), it is refused, saying how to allow it; with
    ``--model`` the plan's factory is dropped (the captured weights are exported)."""
    if args.factory:
        return _from_factory(args.factory), plan
    asked = (plan.model or {}).get("factory")
    if asked and args.model is None:
        raise untrusted_factory(asked, f"pass --factory {asked} (or --model to rebuild a "
                                "built-in model instead)")
    if asked:
        plan = replace(plan, model=None)
    _model_from_plan(args, plan)
    check_batch_size(args.model, args.size, args.batch_size)  # (the plan's, perhaps)
    return ex.builtin_model(args.model, args.size, args.batch_size), plan


def cmd_export(args: argparse.Namespace) -> int:
    _check_compile(args)
    if args.native and args.compile:
        raise ExplorerError("--compile is the explorer runtime's; a --native script runs plain "
                            "PyTorch: leave one of them out")
    plan = ex.Plan.load(args.plan)  # checked before anything else reads it
    bm, plan = _plan_model(args, plan)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets,
                       name=getattr(bm, "name", None), factory=args.factory)
    plan.validate(graph)
    if args.native:
        costs = _plan_costs(plan, graph, args)
        script = ex.export_script(plan, args.out, graph=graph, costs=costs, steps=args.steps,
                                  overwrite=args.force, factory=args.factory, native=True,
                                  model=None if args.factory else bm)
        print(f"wrote {script}\n"
              f"launch: torchrun --standalone --nproc_per_node {len(plan.devices)} {script}")
        return 0
    script = ex.export_script(plan, args.out, graph=graph, steps=args.steps,
                              overwrite=args.force, factory=args.factory,
                              runtime=args.runtime, compile=args.compile)
    print(f"wrote {script} and {script.with_name(script.stem + '_job')}/\n"
          f"launch: torchrun --standalone --nproc_per_node {len(plan.devices)} {script}")
    return 0


def _plan_costs(plan, graph, args: argparse.Namespace):
    """The costs that price ``plan`` for its script's header: the plan's CPU ranks profiled
    (from the cache when this host profiled them), or the GPU presets its devices name;
    None where its devices name neither."""
    kinds: dict[str, int] = {}
    for d in plan.devices:
        kind = d.rsplit(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    spec = (f"cpu:{len(plan.devices)}" if set(kinds) == {"cpu"} else
            "+".join(f"{n}x{kind}" for kind, n in kinds.items()))
    try:
        cluster = parse_devices(spec)
    except ExplorerError:
        return None
    if set(cluster.ids) != set(plan.devices):
        return None
    return ex.profile(graph, cluster, progress=not args.quiet, precisions=tuple(
        {plan.settings_of(s).precision for s in range(len(plan.stages))} - {"fp32"}))


def _check_compile(args: argparse.Namespace) -> None:
    """``--compile`` runs the segments: refused with ``--runtime ops``, before any work."""
    if args.compile and args.runtime == "ops":
        raise ExplorerError("--compile runs the segments' code through torch.compile, and "
                            "--runtime ops runs one op at a time: use --runtime segments (or "
                            "leave --runtime out)")


def _from_factory(factory: str) -> Any:
    """What a factory built, when it carries its example batch (as ``ex.builtin_model`` does):
    the command line captures that to check the plan against."""
    made = load_factory(factory)()
    if not all(hasattr(made, a) for a in ("module", "example_inputs", "targets", "loss_fn")):
        raise ExplorerError(
            f"model factory {factory!r} returned a {type(made).__name__}; the command line "
            "needs the model with its example batch (an object with module, example_inputs, "
            "targets and loss_fn, as ex.builtin_model returns). From Python, export with "
            "ex.export_script(plan, path, graph=ex.capture(model, ...), factory=...)")
    return made


def _plan_json(name: str, plan, r, graph, cluster) -> dict[str, Any]:
    if plan is None:
        return {"algorithm": name, "error": r}
    rate = throughput(graph, plan, cluster, r.step_s)
    return {"algorithm": name, "step_s": r.step_s, "lower_bound_s": r.lower_bound_s,
            "throughput": rate.as_dict() if rate else None,
            "gap": r.gap, "peak_bytes": r.peak_bytes, "fits": r.fits,
            "over_memory_bytes": r.over_memory_bytes,
            "cross_device_bytes": r.cross_device_bytes, "energy_j": r.energy_j,
            "bottleneck": r.bottleneck, "stages": [list(s) for s in plan.stages],
            "micro_batches": plan.micro_batches, "schedule": plan.schedule,
            "tensor": [plan.tensor_of(s) for s in range(len(plan.stages))],
            "replicas": [plan.data_replicas_of(s) for s in range(len(plan.stages))],
            "context": [plan.context_of(s) for s in range(len(plan.stages))],
            "degrees": plan_degrees(plan),
            "notes": list(plan.notes),
            "memory_settings": [plan.settings_of(s).describe() or "default"
                                for s in range(len(plan.stages))],
            "peak_memory_by_category": {d: _categories(m) for d, m in r.memory.items()}}


def plan_degrees(plan) -> dict[str, Any]:
    """A plan's data x tensor x pipeline degrees: the largest replica count (of whole
    samples) and tensor degree of any stage, the stage count, and ``"2x4x8"`` (a degree that
    differs between stages reads ``"1/2"``, stage by stage), with ``" cp 2"`` after it where
    a stage splits samples by context parallelism (``"cp"``: the largest degree)."""
    stages = range(len(plan.stages))
    dps = [plan.data_replicas_of(s) for s in stages]
    tps = [plan.tensor_of(s) for s in stages]
    cps = [plan.context_of(s) for s in stages]

    def text(xs: list[int]) -> str:
        return str(xs[0]) if len(set(xs)) == 1 else "/".join(map(str, xs))

    context = f" cp {text(cps)}" if max(cps) > 1 else ""
    return {"dp": max(dps), "tp": max(tps), "pp": len(plan.stages), "cp": max(cps),
            "text": f"{text(dps)}x{text(tps)}x{len(plan.stages)}{context}"}


def _settings_text(plan) -> str:
    """The plan's memory settings in words, each distinct setting once ("default" for none)."""
    return "; ".join(dict.fromkeys(plan.settings_of(s).describe() or "default"
                                   for s in range(len(plan.stages))))


def _categories(m) -> dict[str, int]:
    """A device's predicted memory at its peak, by category (bytes)."""
    return {"parameters": m.params_bytes, "gradients": m.grads_bytes,
            "optimizer_state": m.optimizer_bytes, "activations": m.activations_bytes,
            "gathered": m.gathered_bytes, "buffers": m.buffers_bytes,
            "workspace": m.workspace_bytes, "total": m.total_bytes}


def add_virtual_stages_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--virtual-stages", type=positive_int, default=None,
                   help="chunks of layers per device, taken in turn around the devices "
                        "(even-layers, balanced-params); the schedule: interleaved-1f1b")


def add_runtime_options(p: argparse.ArgumentParser, after: str = "") -> None:
    """``--runtime`` and ``--compile``, as ``ex.run`` takes them (run and export)."""
    p.add_argument("--runtime", choices=RUNTIMES, default=None,
                   help="how ranks run their ops: as generated segments with one backward "
                        "each (segments, the default: the work "
                        f"eager PyTorch does) or one at a time (ops){after}")
    p.add_argument("--compile", action="store_true",
                   help="run each segment's code through torch.compile (inductor; compiled "
                        f"in the warm-up steps; segments only){after}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="explorer", description="Plan how a model's training step is split across devices.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("models", help="list the built-in models")
    m.add_argument("--size", default="default", help="tiny, small, default or large")
    m.add_argument("--shapes", action="store_true",
                   help="list the published large shapes instead (llama-7b, gpt3-175b ...): "
                        "planned from shapes alone, never run")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_models)
    a = sub.add_parser("algorithms", help="list the partitioners and their options")
    a.set_defaults(fn=cmd_algorithms)
    d = sub.add_parser("devices", help="describe a cluster")
    d.add_argument("--devices", default="gpu", help="cpu:N, gpu (discover) or a preset like 4xH100")
    d.add_argument("--presets", action="store_true", help="list the GPU presets")
    d.set_defaults(fn=cmd_devices)
    pl = sub.add_parser("plan", help="capture a built-in model, profile it, partition, simulate")
    pl.add_argument("--model", default="gpt",
                    help="a built-in model (see `explorer models`) or a published shape "
                         "such as llama-70b (`explorer models --shapes`), captured without "
                         "running")
    pl.add_argument("--size", default="default", help="tiny, small, default or large")
    pl.add_argument("--batch-size", type=positive_int, default=None)
    pl.add_argument("--devices", default="cpu:2",
                    help="cpu:N (CPU ranks), gpu (this machine's GPUs) or a preset like 4xH100")
    pl.add_argument("--algorithm", default="all", help="a partitioner name, or all")
    pl.add_argument("--micro-batches", type=positive_int, default=None)
    pl.add_argument("--schedule", choices=SCHEDULES, default=None)
    add_virtual_stages_option(pl)
    pl.add_argument("--optimizer", default=None, help="sgd, momentum, adam (default) or adamw")
    add_split_options(pl)
    pl.add_argument("--kernels", choices=KERNELS, default="eager",
                    help="how GPU presets run the ops: eager (one kernel per op, as eager "
                         "PyTorch; default) or compiled (pointwise and norm ops fused, as "
                         "torch.compile and fused-kernel frameworks run them)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.add_argument("--out", help="save the fastest plan that fits to this JSON file")
    pl.add_argument("--no-cache", action="store_true", help="profile again, ignoring the cache")
    pl.add_argument("--quiet", action="store_true", help="no progress bars")
    add_memory_options(pl)
    pl.set_defaults(fn=cmd_plan)
    r = sub.add_parser("run", help="run real steps of a plan on this machine's devices and "
                                   "compare with the prediction")
    r.add_argument("--model", default=None,
                   help="a built-in model (see `explorer models`; default: the plan's, or gpt)")
    r.add_argument("--size", default=None,
                   help="tiny, small, default or large (default: the plan's, or default)")
    r.add_argument("--batch-size", type=positive_int, default=None)
    r.add_argument("--devices", default="cpu:2", help="cpu:N (CPU ranks) or gpu")
    r.add_argument("--algorithm", default="even-layers", help="a partitioner name")
    r.add_argument("--plan", help="run this plan JSON instead of partitioning")
    r.add_argument("--factory", default=None,
                   help="module:function that builds the model with its example batch (like "
                        "ex.builtin_model) instead of a built-in model; a factory a plan "
                        "names is used only when you name it here")
    r.add_argument("--steps", type=positive_int, default=5)
    r.add_argument("--warmup", type=whole, default=2)
    r.add_argument("--micro-batches", type=positive_int, default=None)
    r.add_argument("--schedule", choices=SCHEDULES, default=None)
    add_virtual_stages_option(r)
    r.add_argument("--optimizer", default=None, help="sgd, momentum, adam (default) or adamw")
    add_split_options(r)
    add_memory_options(r)
    add_runtime_options(r)
    r.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    r.add_argument("--force", action="store_true", help="run even if predicted not to fit")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.add_argument("--no-cache", action="store_true", help="profile again, ignoring the cache")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.set_defaults(fn=cmd_run)
    e = sub.add_parser("export", help="write a torchrun training script for a plan")
    e.add_argument("--plan", required=True, help="a plan JSON (from `explorer plan --out`)")
    e.add_argument("--out", required=True, help="the script to write, e.g. train_plan.py")
    e.add_argument("--model", help="the built-in model the plan is for (default: the plan's)")
    e.add_argument("--size", default=None,
                   help="tiny, small, default or large (default: the plan's, or default)")
    e.add_argument("--batch-size", type=positive_int, default=None)
    e.add_argument("--factory", default=None,
                   help="module:function that builds the model on every rank instead of "
                        "weights in the job folder; it returns the model with its example "
                        "batch, like ex.builtin_model (a factory the plan names is used only "
                        "when you name it here)")
    e.add_argument("--steps", type=positive_int, default=10, help="steps the script runs")
    e.add_argument("--native", action="store_true",
                   help="write one PyTorch script to read and keep (DeviceMesh, DDP, FSDP2, "
                        "checkpoint, autocast; no job folder, no explorer runtime) for a plan "
                        "of whole modules, with the plan's prediction in its header")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    add_runtime_options(e, "; the script's own --runtime and --compile / --no-compile "
                           "override them")
    e.add_argument("--force", action="store_true",
                   help="overwrite an existing script and job folder")
    e.set_defaults(fn=cmd_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "out", None):
        parent = Path(args.out).resolve().parent
        if not parent.is_dir():
            print(f"error: cannot save to {args.out}: folder {parent} does not exist",
                  file=sys.stderr)
            return 2
    try:
        return args.fn(args)
    except ExplorerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into head & co.: stop quietly
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
