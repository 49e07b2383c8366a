"""Real runs on CPU ranks: losses and gradients equal one device, failures end cleanly."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import explorer as ex
from explorer.core.errors import MemoryExceededError, PlanError
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool, heartbeat
from explorer.runtime.jobfiles import Job
from explorer.runtime.launch import reference
from explorer.runtime.watch import RunFailed

#: how long a fault test lets a rank stay silent, or spin while the others wait, before the
#: launcher names it (the defaults, 20 and 30 s, leave room for a busy machine)
QUICK_SILENT_S = 8.0

# every test here starts rank processes
pytestmark = pytest.mark.slow

STEPS, WARMUP = 2, 1


@pytest.fixture(scope="module")
def cpu2():
    return ex.Cluster.cpu(2, measure=False)


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's runs that need no setting of their own."""
    with RankPool() as ranks:
        yield ranks


def _case(name: str):
    bm = ex.builtin_model(name, "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    return bm, graph


def _plans(graph, cluster):
    """One plan per execution path: pipeline stages, pipelining with micro-batches (both
    schedules), data parallel, and an op-level placement that is not contiguous."""
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    interleaved = {nm: k % 2 for k, nm in enumerate(ops)}  # every other op on the other rank
    return {
        "stages": ex.partition(graph, cluster, _costs(graph, cluster), "even-layers"),
        "gpipe": ex.partition(graph, cluster, _costs(graph, cluster), "even-layers",
                              micro_batches=2, schedule="gpipe"),
        "1f1b": ex.partition(graph, cluster, _costs(graph, cluster), "even-layers",
                             micro_batches=4, schedule="1f1b"),
        "data-parallel": ex.partition(graph, cluster, _costs(graph, cluster), "data-parallel"),
        "op-level": ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1",)], interleaved,
                                            algorithm="interleaved"),
    }


_COSTS: dict = {}


def _costs(graph, cluster):
    key = graph.fingerprint
    if key not in _COSTS:
        _COSTS[key] = roofline_costs(graph, cluster)
    return _COSTS[key]


def _shards(plan) -> int:
    return max(len(s) for s in plan.stages) * plan.micro_batches


def _check(bm, graph, plan, pool, runtime=None):
    meas = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False, record=True,
                  timeout_s=120, pool=pool, runtime=runtime)
    ref = reference(ex.builtin_model(bm.name, "tiny"), STEPS + WARMUP, _shards(plan),
                    optimizer=plan.optimizer)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    assert set(meas.grads) == set(ref.grads)
    for name, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[name], g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", ex.model_names())
@pytest.mark.parametrize("path", ["stages", "gpipe", "1f1b", "data-parallel", "op-level"])
def test_losses_and_gradients_equal_one_device(name, path, cpu2, pool):
    bm, graph = _case(name)
    _check(bm, graph, _plans(graph, cpu2)[path], pool)


@pytest.mark.parametrize("name,runtime", [("gpt", "ops"), ("llama", "segments"),
                                          ("resnet", "segments")])
def test_interleaved_1f1b_equals_one_device(name, runtime, cpu2, pool):
    """Two chunks of layers on each rank, taken in turn (virtual pipeline stages): the ranks
    send activations back and forth in the interleaved order and train as one device."""
    bm, graph = _case(name)
    plan = ex.partition(graph, cpu2, _costs(graph, cpu2), "even-layers", micro_batches=4,
                        virtual_stages=2)
    assert plan.schedule == "interleaved-1f1b"
    _check(bm, graph, plan, pool, runtime)


def test_single_device_run_equals_reference(cpu2, pool):
    bm, graph = _case("mlp")
    _check(bm, graph, ex.Plan.single(graph, "cpu:0"), pool)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="pins cores on Linux only")
@pytest.mark.parametrize("pin", ["1", "0"])
def test_cpu_ranks_are_pinned_to_their_own_cores(cpu2, pin, monkeypatch):
    """Each CPU rank runs on a core of its own, the local rank's, round robin over the cores
    this process may use (with EXPLORER_PIN=0 none is pinned), and keeps the memory it
    frees (not with EXPLORER_MALLOC=0); it trains the same either way."""
    monkeypatch.setenv("EXPLORER_PIN", pin)
    monkeypatch.setenv("EXPLORER_MALLOC", pin)
    _, graph = _case("mlp")
    meas = ex.run(graph, plan=_plans(graph, cpu2)["gpipe"], steps=1, warmup=0,
                  progress=False, timeout_s=120)
    cores = sorted(os.sched_getaffinity(0))
    if pin == "1":
        assert meas.cores == {"cpu:0": (cores[0],), "cpu:1": (cores[1 % len(cores)],)}
    else:
        assert meas.cores == {"cpu:0": None, "cpu:1": None}
    held = pin == "1" and platform.libc_ver()[0] == "glibc"
    assert meas.memory_held == {"cpu:0": held, "cpu:1": held}
    assert all(math.isfinite(x) for x in meas.losses)


def test_replica_counts_that_differ_run(cpu2, pool):
    """Stage 0 replicated on two ranks, stage 1 on one: the bigger stage's shards meet."""
    bm, graph = _case("mlp")
    cl = ex.Cluster.cpu(3, measure=False)
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    half = len(ops) // 2
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1"), ("cpu:2",)],
                                   {nm: int(k >= half) for k, nm in enumerate(ops)})
    assert cl  # three CPU ranks
    _check(bm, graph, plan, pool)


class TestMeasurement:
    def test_figures_are_there(self, cpu2, pool):
        _, graph = _case("gpt")
        costs = ex.profile(graph, cpu2, progress=False)
        plan = ex.partition(graph, cpu2, costs, "even-layers")
        meas = ex.run(graph, plan=plan, costs=costs, steps=2, warmup=1, progress=False,
                      pool=pool)
        assert meas.step_s > 0 and len(meas.step_samples_s) == 2
        assert set(meas.busy_s) == {"cpu:0", "cpu:1"}
        assert all(0 < b <= meas.step_s * 1.5 for b in meas.busy_s.values())
        # busy time per measured step, of which busy_s is the median
        assert set(meas.busy_samples_s) == {"cpu:0", "cpu:1"}
        for d, samples in meas.busy_samples_s.items():
            assert len(samples) == 2 and statistics.median(samples) == meas.busy_s[d]
        assert all(p > 0 for p in meas.peak_bytes.values())
        assert meas.memory_source == "tensor accounting"
        assert meas.energy_j is None  # no NVML on CPU ranks
        report = ex.compare(ex.simulate(graph, plan, costs), meas)
        assert report.row("step time").measured == meas.step_s
        assert set(report.memory_errors) == {"cpu:0", "cpu:1"}
        assert "peak memory" in str(report)
        # calibration fits, and the fitted model still predicts the other plans
        fitted = ex.calibrate(costs, meas)
        assert fitted.compute_scale > 0
        other = ex.partition(graph, cpu2, fitted, "data-parallel")
        assert ex.simulate(graph, other, fitted).step_s > 0


    def test_memory_is_counted_in_a_warm_up_step_where_there_are_two(self, cpu2, pool):
        """A CPU rank's accounting costs step time, so it runs in the last of two warm-up
        steps, not in a timed one: the peak is the one a measured step would count."""
        _, graph = _case("gpt")
        plan = _plans(graph, cpu2)["1f1b"]
        runs = {warmup: ex.run(graph, plan=plan, steps=1, warmup=warmup, progress=False,
                               pool=pool) for warmup in (1, 2)}
        assert all(p > 0 for p in runs[1].peak_bytes.values())
        assert runs[2].peak_bytes == runs[1].peak_bytes
        assert runs[2].peak_by_category == runs[1].peak_by_category
        job = dataclasses.replace(_job_fields(), steps=3)
        assert [dataclasses.replace(job, warmup=w).memory_step for w in (0, 1, 2, 5)] == \
            [2, 3, 1, 4]


def _job_fields():
    """A job with only its step counts to go by (:attr:`Job.memory_step`)."""
    return Job(calls=[], state={}, plan=None, schedule=None, inputs=[], targets=[], steps=1,
               warmup=0, lr=0.0, record=False, timeout_s=1.0, device_map={}, requires_grad=[],
               loss="")


def _children() -> list[str]:
    """Command lines of live rank processes started by this test process."""
    out = []
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(") ", 1)[1].split()  # state, ppid, ...
        if "explorer.runtime.rank" in cmd and fields[0] != "Z" and int(fields[1]) == me:
            out.append(cmd)
    return out


class TestFailures:
    @pytest.fixture
    def mlp(self, cpu2, pool):
        pool.close()  # (these runs start ranks of their own, and no other rank may be left)
        _, graph = _case("mlp")
        return graph, ex.partition(graph, cpu2, _costs(graph, cpu2), "even-layers")

    @pytest.mark.parametrize("kind,message", [
        ("raise", r"rank 1 \(cpu:1\) failed: RuntimeError: injected failure"),
        ("oom", r"rank 1 \(cpu:1\) failed: out of memory"),
        ("kill", r"rank 1 \(cpu:1\) was killed by SIGKILL \(the system may have run out"),
    ])
    def test_a_failing_rank_ends_the_run(self, mlp, monkeypatch, kind, message):
        graph, plan = mlp
        monkeypatch.setenv("EXPLORER_FAULT", f"1:{kind}:1")
        with pytest.raises(RunFailed, match=message):
            ex.run(graph, plan=plan, steps=2, warmup=1, progress=False, timeout_s=60)
        assert _children() == []

    def test_a_hanging_rank_times_out(self, mlp, monkeypatch):
        """A rank that hangs while still alive is found by the time limit; its heartbeat says
        it was computing while the other waited."""
        graph, plan = mlp
        monkeypatch.setenv("EXPLORER_FAULT", "0:hang:0")
        with pytest.raises(RunFailed, match=r"did not finish within 20 s \(rank 0 \(cpu:0\) "
                           r"at step 1, computing; rank 1 \(cpu:1\) at step 1, waiting"):
            ex.run(graph, plan=plan, steps=1, warmup=0, progress=False, timeout_s=20)
        assert _children() == []

    @pytest.mark.slow
    def test_a_stopped_rank_is_named_within_a_minute(self, mlp, monkeypatch):
        """A rank stopped with SIGSTOP stops beating: named long before the time limit."""
        graph, plan = mlp
        monkeypatch.setenv("EXPLORER_FAULT", "1:stop:1")
        monkeypatch.setattr(heartbeat, "SILENT_S", QUICK_SILENT_S)
        t0 = time.monotonic()
        with pytest.raises(RunFailed, match=r"rank 1 \(cpu:1\) stopped responding \(its "
                           r"process is stopped: SIGSTOP"):
            ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, timeout_s=600)
        assert time.monotonic() - t0 < 60
        assert _children() == []

    @pytest.mark.slow
    def test_a_rank_in_an_endless_loop_is_named_within_a_minute(self, mlp, monkeypatch):
        """A rank spinning in its own computation still beats but stops advancing while the
        other waits on it: named long before the time limit."""
        graph, plan = mlp
        monkeypatch.setenv("EXPLORER_FAULT", "0:spin:1")
        monkeypatch.setattr(heartbeat, "STALL_MIN_S", QUICK_SILENT_S)
        t0 = time.monotonic()
        with pytest.raises(RunFailed, match=r"rank 0 \(cpu:0\) stopped making progress at "
                           r"step 2 \(its process is alive: a hang or an endless loop in its "
                           r"computation\)"):
            ex.run(graph, plan=plan, steps=3, warmup=0, progress=False, timeout_s=600)
        assert time.monotonic() - t0 < 60
        assert _children() == []

    def test_the_caller_survives_and_runs_again(self, mlp, monkeypatch):
        graph, plan = mlp
        monkeypatch.setenv("EXPLORER_FAULT", "0:raise:0")
        with pytest.raises(RunFailed):
            ex.run(graph, plan=plan, steps=1, warmup=0, progress=False, timeout_s=60)
        monkeypatch.delenv("EXPLORER_FAULT")
        assert ex.run(graph, plan=plan, steps=1, warmup=0, progress=False).step_s > 0

    def test_a_plan_that_does_not_fit_needs_force(self, mlp):
        graph, _ = mlp
        small = ex.Cluster.cpu(2, measure=False)
        small = dataclasses.replace(small, devices=tuple(
            dataclasses.replace(d, memory_bytes=1000) for d in small.devices))
        costs = roofline_costs(graph, small)
        plan = ex.partition(graph, small, costs, "even-layers")
        with pytest.raises(MemoryExceededError, match=r"cpu:0 needs .* force=True"):
            ex.run(graph, plan=plan, costs=costs, steps=1, warmup=0, progress=False)
        meas = ex.run(graph, plan=plan, costs=costs, steps=1, warmup=0, progress=False,
                      force=True)
        assert meas.step_s > 0

    def test_devices_that_are_not_here_are_refused(self, mlp):
        graph, _ = mlp
        cl = ex.Cluster.preset("2xH100")
        plan = ex.partition(graph, cl, roofline_costs(graph, cl), "even-layers")
        with pytest.raises(PlanError, match="H100:0, H100:1, which this machine does not"):
            ex.run(graph, plan=plan, steps=1, progress=False)


def test_exported_script_runs_under_torchrun(tmp_path, cpu2):
    _, graph = _case("gpt")
    costs = _costs(graph, cpu2)
    plan = ex.partition(graph, cpu2, costs, "even-layers", micro_batches=2, schedule="1f1b")
    script = ex.export_script(plan, tmp_path / "train_plan.py", costs=costs, steps=2,
                              warmup=1)
    text = script.read_text()
    assert "torchrun --standalone --nproc_per_node 2" in text
    for n in graph.nodes:  # the script is generic: no node or module names as code
        if n.kind == "op" and len(n.name) > 4:
            assert n.name not in text
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", str(script)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [float(line.split("loss ")[1].split(",")[0])
              for line in proc.stdout.splitlines() if line.startswith("step ")]
    ref = reference(ex.builtin_model("gpt", "tiny"), 3, _shards(plan), optimizer=plan.optimizer)
    assert losses == pytest.approx(ref.losses, rel=1e-5)
