"""The GPU paths on one real NVIDIA GPU: discovery, CUDA profiling, runs, memory and energy.

Skipped without CUDA (every test here is marked ``gpu``); ``benchmarks/gpu_check.py`` runs them
on a lent GPU and records the outcome. One GPU only: NCCL refuses two ranks on one device, so
plans with several devices are simulated here, not run.
"""

from __future__ import annotations

import pytest
import torch

import explorer as ex

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

STEPS, WARMUP = 3, 1
ENERGY_STEPS = 200


@pytest.fixture(scope="module")
def gpu():
    """The first GPU as ``Cluster.discover`` describes it (NVML's name and memory)."""
    cluster = ex.Cluster.discover()
    gpus = [d.id for d in cluster.devices if d.kind == "cuda" and d.present]
    assert gpus, f"CUDA is available but discovery found no usable GPU: {cluster.name}"
    return cluster.subset([gpus[0]])


@pytest.fixture(scope="module")
def mlp():
    bm = ex.builtin_model("mlp", "tiny")
    return bm, ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="mlp")


def test_discovery_names_the_gpu_from_nvml(gpu):
    dev = gpu.devices[0]
    assert dev.torch_device == "cuda:0"
    assert dev.memory_bytes == pytest.approx(torch.cuda.get_device_properties(0).total_memory,
                                             rel=0.05)
    assert dev.flops_per_s > 1e12 and dev.mem_bandwidth_bytes_per_s > 1e11


def test_profile_measures_every_op_on_the_gpu(mlp, gpu):
    _, graph = mlp
    costs = ex.profile(graph, gpu, repeats=3, warmup=1, cache=False, progress=False)
    dc = costs.device_costs(gpu.devices[0].id)
    ops = [i for i, n in enumerate(graph.nodes) if n.kind == "op"]
    assert all(dc.fwd_s[i] > 0 for i in ops), "an op with no measured time on the GPU"
    assert {dc.source[i] for i in ops} == {"measured"}


def test_a_single_gpu_run_equals_eager_pytorch(mlp, gpu):
    bm, graph = mlp
    plan = ex.partition(graph, gpu, ex.profile(graph, gpu, progress=False), "single")
    meas = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False, record=True)
    ref = ex.reference(ex.builtin_model("mlp", "tiny"), STEPS + WARMUP)
    # the GPU's kernels sum in another order than the CPU reference: equal to float tolerance
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=1e-4, atol=1e-5)
    for name, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[name].cpu(), g, rtol=1e-3, atol=1e-5)
    assert "cuda" in meas.memory_source
    peak = meas.peak_bytes[gpu.devices[0].id]
    params = sum(p.numel() * p.element_size() for p in bm.module.parameters())
    assert peak >= 4 * params  # weights, gradients and Adam's two moments at least


def test_prediction_and_measurement_compare_on_the_gpu(mlp, gpu):
    _, graph = mlp
    costs = ex.profile(graph, gpu, progress=False)
    plan = ex.partition(graph, gpu, costs, "single")
    pred = ex.simulate(graph, plan, costs)
    meas = ex.run(graph, plan=plan, costs=costs, steps=STEPS, warmup=WARMUP, progress=False)
    report = ex.compare(pred, meas)
    step = next(r for r in report.rows if r.unit == "s" and not r.device)
    assert step.predicted > 0 and step.measured > 0
    memory = [r for r in report.rows if r.unit == "bytes"]
    assert memory and all(r.measured > 0 for r in memory)


def test_the_predicted_peak_counts_the_libraries_workspaces(mlp, gpu):
    """cuBLAS keeps its workspaces in the allocator for the whole run: the profile measures
    them and the predicted peak of a one-GPU run holds them, as the allocator's peak does."""
    _, graph = mlp
    costs = ex.profile(graph, gpu, cache=False, progress=False)
    dev = gpu.devices[0].id
    assert costs.device_costs(dev).workspace_bytes > 0
    plan = ex.partition(graph, gpu, costs, "single")
    pred = ex.simulate(graph, plan, costs)
    meas = ex.run(graph, plan=plan, costs=costs, steps=STEPS, warmup=WARMUP, progress=False)
    assert pred.peak_bytes[dev] == pytest.approx(meas.peak_bytes[dev], rel=0.10)


def test_energy_from_nvml_when_the_gpu_counts_it(mlp, gpu):
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except pynvml.NVMLError:
            pytest.skip("this GPU's driver does not count energy")
    finally:
        pynvml.nvmlShutdown()
    _, graph = mlp
    plan = ex.partition(graph, gpu, ex.profile(graph, gpu, progress=False), "single")
    # the counter advances in coarse ticks: enough steps that the window spans several
    meas = ex.run(graph, plan=plan, steps=ENERGY_STEPS, warmup=WARMUP, progress=False)
    assert meas.energy_j is not None and meas.energy_j > 0
    # a whole GPU draws between tens and hundreds of watts while stepping
    watts = meas.energy_j / meas.step_s
    assert 5 < watts < 1500, watts


def test_a_plan_for_more_gpus_than_are_here_is_refused_clearly(mlp, gpu):
    """One GPU cannot stand in for two (NCCL refuses two ranks on one device): a two-GPU plan
    is an error the user understands, not a hang."""
    _, graph = mlp
    two = ex.Cluster.preset("2xH100")
    costs = ex.profile(graph, two, progress=False)
    plan = ex.partition(graph, two, costs, "data-parallel")
    with pytest.raises(ex.ExplorerError):
        ex.run(graph, plan=plan, steps=1, warmup=0, progress=False, timeout_s=120.0)
