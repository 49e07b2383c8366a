"""Real runs with memory settings (ZeRO 1-3, recomputation, precision) on CPU ranks: losses and
gradients equal one device, and the measured peak goes down where the setting saves memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from builders import tiny_builtin_graph

import explorer as ex
from explorer.models.synthetic import roofline_costs
from explorer.runtime import RankPool
from explorer.runtime.launch import reference

# every test here starts rank processes
pytestmark = pytest.mark.slow

STEPS, WARMUP = 2, 1
_RUNS: dict = {}



def _plan(name: str, path: str, **memory):
    """The model's data-parallel plan (two replicas, two micro-batches for gpt: gradients
    accumulate before they are reduced) or two pipeline stages (gpt: 1F1B over two
    micro-batches, so micro-batches' forwards and backwards interleave), with ``memory``
    settings."""
    graph = tiny_builtin_graph(name)
    cluster = ex.Cluster.cpu(2, measure=False)
    costs = roofline_costs(graph, cluster)
    if path == "data-parallel":
        plan = ex.partition(graph, cluster, costs, "data-parallel")
        plan = plan.with_settings(micro_batches=2 if name == "gpt" else 1)
    else:
        plan = ex.partition(graph, cluster, costs, "even-layers")
        if name == "gpt":
            plan = plan.with_settings(micro_batches=2, schedule="1f1b")
    return plan.with_memory(**memory)


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's runs."""
    with RankPool() as ranks:
        yield ranks


def _run(pool: RankPool, name: str, path: str, runtime: str = "segments", **memory):
    key = (name, path, runtime, tuple(sorted(memory.items())))
    if key not in _RUNS:
        _RUNS[key] = ex.run(tiny_builtin_graph(name), plan=_plan(name, path, **memory), steps=STEPS,
                            warmup=WARMUP, progress=False, record=True, timeout_s=180,
                            pool=pool, runtime=runtime)
    return _RUNS[key]


def _reference(name: str, plan):
    shards = max(len(s) for s in plan.stages) * plan.micro_batches
    return reference(ex.builtin_model(name, "tiny"), STEPS + WARMUP, shards,
                     optimizer=plan.optimizer)


def _assert_equal(meas, ref, rtol: float, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=rtol, atol=atol)
    assert set(meas.grads) == set(ref.grads)
    for name, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[name], g, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_equals_one_device(name, zero, pool):
    """Sharded optimizer state, gradients and weights train as one device does (the losses
    of every step: the updated weights of the step before; the first step's gradients)."""
    meas = _run(pool, name, "data-parallel", zero=zero)
    _assert_equal(meas, _reference(name, meas.plan), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero,chunks", [(1, 1), (2, 1), (1, 2)],
                         ids=["zero1", "zero2", "zero1-interleaved"])
def test_zero_on_a_replicated_pipeline_stage_equals_one_device(zero, chunks, pool):
    """A pipeline stage gathers its updated shards after its optimizer step, a stage of its
    own during the next step's forward: both train as one device does; so do two chunks per
    stage under interleaved 1F1B, the replicated stage's gradients reduced over both."""
    graph = tiny_builtin_graph("gpt")
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    cut = {nm: (k * 2 * chunks // len(ops)) % 2 for k, nm in enumerate(ops)}
    plan = ex.Plan.from_assignment(
        graph, [("cpu:0", "cpu:1"), ("cpu:2",)], cut, micro_batches=2,
        schedule="1f1b" if chunks == 1 else "interleaved-1f1b").with_memory(zero=zero)
    meas = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False,
                  record=True, timeout_s=180, pool=pool)
    _assert_equal(meas, _reference("gpt", plan), rtol=1e-5, atol=1e-6)


def test_zero_lowers_the_measured_peak(pool):
    """Each ZeRO stage holds less at its peak than none; ZeRO 1 less than none and 2 no more
    than 1, ZeRO 1 and 2 as the simulator predicts. ZeRO 3 holds the gathered copies of the
    weights, and only a few at a time: on this tiny model they outweigh the half of the
    weights it saves over ZeRO 2, as the simulator predicts (its peak within 5 % of the
    prediction)."""
    base = _run(pool, "gpt", "data-parallel")
    peaks = [base.peak_bytes["cpu:0"]] + [
        _run(pool, "gpt", "data-parallel", zero=z).peak_bytes["cpu:0"] for z in (1, 2, 3)]
    assert peaks[1] < peaks[0] and peaks[2] <= peaks[1] and peaks[3] < peaks[0]
    graph = tiny_builtin_graph("gpt")
    costs = roofline_costs(graph, ex.Cluster.cpu(2, measure=False))
    for z in (1, 2, 3):  # (ZeRO 1: the full gradients kept beside the reduce-scattered shards;
        # 2 and 3: reduce-scattered a micro-batch at a time)
        predicted = ex.simulate(graph, _plan("gpt", "data-parallel", zero=z),
                                costs).peak_bytes["cpu:0"]
        assert abs(peaks[z] / predicted - 1) < 0.05, (z, peaks[z], predicted)
    by = {z: _run(pool, "gpt", "data-parallel", **({"zero": z} if z else {}))
          .peak_by_category["cpu:0"] for z in (0, 1, 3)}
    assert by[1]["optimizer state"] * 2 == by[0]["optimizer state"]
    assert by[3]["parameters"] * 2 <= by[0]["parameters"] + 2 * 64
    assert 0 < by[3]["gathered"] < by[0]["parameters"] / 2


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_is_exact(name, mode, pool):
    """Recomputed values are the values the forward made: losses and gradients equal the
    run without recomputation bit for bit (and one device as closely as that run does)."""
    meas = _run(pool, name, "stages", recompute=mode)
    plain = _run(pool, name, "stages")
    assert meas.losses == plain.losses
    for k, g in plain.grads.items():
        assert torch.equal(meas.grads[k], g), k
    _assert_equal(meas, _reference(name, meas.plan), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_under_bf16_casts_again_what_it_recomputes(mode, pool):
    """Under bf16 the op path keeps no autocast copy of a value it recomputes (a norm's fp32
    output a matmul reads): the backward casts the recomputed value again. The copies are the
    ones the forward made: losses and gradients equal the bf16 run without recomputation bit
    for bit."""
    meas = _run(pool, "gpt", "stages", runtime="ops", recompute=mode, precision="bf16")
    plain = _run(pool, "gpt", "stages", runtime="ops", precision="bf16")
    assert meas.losses == plain.losses
    for k, g in plain.grads.items():
        assert torch.equal(meas.grads[k], g), k


def test_recomputation_lowers_the_measured_peak(pool):
    """Fewer activations are held on the fuller rank, and at the plan's peak full
    recomputation keeps no more than selective, selective less than none (on the last stage,
    checkpointing the unit of the head and loss runs it again whole at the start of its
    backward, which holds about what it saves)."""
    peak = {mode: _run(pool, "gpt", "stages", **({"recompute": mode} if mode else {})).peak_bytes
            for mode in (None, "selective", "full")}
    fuller = max(peak[None], key=peak[None].get)
    assert peak["full"][fuller] < peak[None][fuller]
    assert peak["selective"][fuller] < peak[None][fuller]
    assert max(peak["full"].values()) <= max(peak["selective"].values()) \
        < max(peak[None].values())


# bf16 keeps 8 bits of mantissa (a relative rounding of 2**-9 per value), fp16 11 bits (2**-12);
# over a tiny model's few layers the loss moves by far less than that times the number of
# rounded values, and each gradient element stays within a fraction of its tensor's largest
PRECISION_TOLERANCE = {"bf16": (1e-3, 6e-2), "fp16": (1e-4, 5e-3)}  # (loss rtol, grad share)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lower_precision_stays_within_its_tolerance(name, precision, pool):
    """Autocast compute with fp32 master weights (fp16 with loss scaling) against the fp32
    single-device run: losses within ``loss rtol``, each gradient element within ``grad
    share`` times its tensor's largest absolute value; gradients are fp32."""
    meas = _run(pool, name, "stages", precision=precision)
    _assert_within_tolerance(meas, _reference(name, meas.plan), precision)


def test_zero_3_under_bf16_gathers_two_byte_weights(pool):
    """ZeRO 3 under bf16 gathers each weight in bf16 from its fp32 shard (FSDP2's
    mixed-precision policy): it trains as one device does within bf16's tolerance, the
    gradients and shards stay fp32, and the gathered copies hold half the bytes."""
    half = _run(pool, "gpt", "data-parallel", zero=3, precision="bf16")
    full = _run(pool, "gpt", "data-parallel", zero=3)
    _assert_within_tolerance(half, _reference("gpt", half.plan), "bf16")
    for d in half.plan.devices:
        assert half.peak_by_category[d]["gathered"] <= full.peak_by_category[d]["gathered"] / 2


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_under_bf16_train_as_one_device(zero, pool):
    """ZeRO 1-2 under bf16 keep the weights in bf16 and the optimizer's fp32 master copy
    sharded (Megatron's distributed optimizer, DeepSpeed), the updated shards gathered into
    the bf16 copy: it trains as one device does within bf16's tolerance, on the op path and
    on segments (the memory: tests/costs/test_memory_accuracy.py)."""
    for runtime in ("ops", "segments"):
        half = _run(pool, "gpt", "data-parallel", runtime=runtime, zero=zero, precision="bf16")
        _assert_within_tolerance(half, _reference("gpt", half.plan), "bf16")


def _assert_within_tolerance(meas, ref, precision: str) -> None:
    """Losses within the precision's ``loss rtol`` of ``ref``'s, each gradient element within
    ``grad share`` times its tensor's largest absolute value; gradients are fp32."""
    loss_rtol, share = PRECISION_TOLERANCE[precision]
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=loss_rtol, atol=0)
    for k, g in ref.grads.items():
        assert meas.grads[k].dtype == torch.float32
        torch.testing.assert_close(meas.grads[k], g, rtol=0, atol=share * float(g.abs().max()),
                                   msg=lambda m, k=k: f"{k}: {m}")



def _script_losses(plan, folder) -> list[float]:
    """The losses an exported script of ``plan`` prints under torchrun (its first replica's)."""
    folder.mkdir()
    script = ex.export_script(plan, folder / "train_plan.py", graph=tiny_builtin_graph("gpt"),
                              steps=2, warmup=1)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", str(script)], capture_output=True, text=True, timeout=300,
        cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [float(line.split("loss ")[1].split(",")[0])
            for line in proc.stdout.splitlines() if line.startswith("step ")]


def test_exported_script_runs_the_memory_settings(tmp_path):
    """The torchrun script of a plan with ZeRO 3, selective recomputation and bf16 trains as
    the script of the same plan without them, within bf16's loss tolerance, and not bit for
    bit (the settings ran): the job folder carries them (in the plan) and the units."""
    plain = _script_losses(_plan("gpt", "data-parallel"), tmp_path / "plain")
    sharded = _script_losses(_plan("gpt", "data-parallel", zero=3, recompute="selective",
                                   precision="bf16"), tmp_path / "sharded")
    assert len(plain) == 3 and sharded != plain
    assert sharded == pytest.approx(plain, rel=PRECISION_TOLERANCE["bf16"][0])
