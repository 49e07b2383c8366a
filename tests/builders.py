"""Builders for tests: hand-built graphs, clusters and cost tables with exact numbers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import explorer as ex
from explorer.core.graph import OpGraph, OpNode
from explorer.costs.model import CostModel, DeviceCosts
from explorer.devices.cluster import Cluster, Device, Link
from explorer.platforms.cpu import host_cache
from explorer.runtime.launch import Reference
from explorer.runtime.pool import RankPool

GiB = 2**30


def device(i: int, memory: int = GiB, kind: str = "cpu", name: str = "test dev") -> Device:
    return Device(id=f"d:{i}", kind=kind, name=name, memory_bytes=memory, flops_per_s=1e9,
                  half_flops_per_s=1e9, mem_bandwidth_bytes_per_s=1e9, power_w=100.0,
                  idle_power_w=10.0, present=False, torch_device="", source="test")


def cluster(n: int, latency_s: float = 0.0, bandwidth: float = float("inf"),
            memory: int = GiB) -> Cluster:
    return Cluster(name=f"test:{n}", devices=tuple(device(i, memory) for i in range(n)),
                   default_link=Link(latency_s, bandwidth, "test"))


def graph(spec: list[tuple], batch: int = 8, name: str = "g") -> OpGraph:
    """spec rows: (name, kind, inputs, out_bytes[, param_bytes[, saves]])."""
    nodes = []
    for row in spec:
        nm, kind, inputs, out = row[:4]
        pb = row[4] if len(row) > 4 else (out if kind in ("param", "buffer") else 0)
        saves = row[5] if len(row) > 5 else ()
        nodes.append(OpNode(nm, kind, kind if kind != "op" else "test.op", inputs=tuple(inputs),
                            out_bytes=out, param_bytes=pb,
                            requires_grad=kind in ("op", "param"), saves=tuple(saves)))
    return OpGraph(name, nodes, batch)


def costs(g: OpGraph, cl: Cluster, fwd: dict[str, float], bwd: dict[str, float],
          overhead_s: float = 0.0, opt_per_byte: float = 0.0) -> CostModel:
    f = [fwd.get(n.name, 0.0) for n in g.nodes]
    b = [bwd.get(n.name, 0.0) for n in g.nodes]
    src = ["measured" if n.kind == "op" else "free" for n in g.nodes]
    keys = {d.type_key for d in cl.devices}
    per = {k: DeviceCosts(k, f, b, src, overhead_s, {"adam": opt_per_byte, "sgd": opt_per_byte},
                          {"adam": 0.0, "sgd": 0.0}) for k in keys}
    return CostModel(g.fingerprint, cl, per)


@functools.cache
def tiny_builtin_graph(name: str) -> OpGraph:
    """A built-in model's tiny size, captured once per test process (runs only read it)."""
    bm = ex.builtin_model(name, "tiny")
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)


@functools.cache
def dropout_mlp_graph() -> OpGraph:
    """A small MLP with two dropouts (p 0.5 and 0.3), seeded weights and batch, captured once
    per test process (runs only read it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(32, 32), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    return ex.capture(model, x, torch.nn.MSELoss(), y, name="dropout-mlp")


def hf_causal_lm_graph(name: str, build: Callable[[Any], torch.nn.Module]) -> OpGraph:
    """A tiny Hugging Face causal LM, ``build(transformers)`` made after seeding torch,
    captured with a batch of 4 sequences of 16 token ids (vocabulary 128) and the
    cross-entropy of its logits (skipped without transformers)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build(transformers)
    gen = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 128, (4, 16), generator=gen) for _ in range(2))

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    return ex.capture(model, ids, loss_fn, labels, name=name)


@functools.cache
def builtin_reference(name: str, steps: int, shards: int, optimizer: str) -> Reference:
    """One device's steps of a built-in model's tiny size (shared by the tests that compare
    runs of it with one device; only read)."""
    return ex.reference(ex.builtin_model(name, "tiny"), steps, shards, optimizer=optimizer)


def check_matches_one_device(name: str, plan: ex.Plan, shards: int, steps: int = 2,
                             warmup: int = 1, runtime: str | None = None,
                             pool: RankPool | None = None) -> ex.Measurement:
    """Run ``plan`` on the built-in ``name`` (tiny) and assert its losses and first step's
    gradients equal one device's over the same ``shards`` of each batch (rtol 1e-5);
    ``runtime`` and ``pool`` as in ``ex.run``."""
    meas = ex.run(tiny_builtin_graph(name), plan=plan, steps=steps, warmup=warmup,
                  progress=False, record=True, timeout_s=180, runtime=runtime, pool=pool)
    if runtime is not None:
        assert meas.runtime == runtime
    ref = builtin_reference(name, steps + warmup, shards, plan.optimizer)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    assert set(meas.grads) == set(ref.grads)
    for k, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[k], g, rtol=1e-5, atol=1e-6, msg=k)
    return meas


def host_cache_without(folder: Path, monkeypatch, *probe_keys: str) -> None:
    """Point ``XDG_CACHE_HOME`` at ``folder`` (an empty profile cache) with this user's host
    measurements copied in, but the entries of the host probes named by ``probe_keys`` (their
    keys after the host's, as a prefix): a test of one probe measures that probe afresh, not
    every other host figure a profile reads (the link, the contention, the other probes)."""
    entries = host_cache.read_cache(host_cache.cache_file())
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    host = host_cache.cache_key()
    for key, entry in entries.items():
        probe = key[len(host) + 1:] if key.startswith(host + "|") else ""
        if key == host or (probe and not probe.startswith(probe_keys)):
            host_cache.write_cache(host_cache.cache_file(), key, entry)
