"""Sequence-parallel stages on CPU ranks, op by op and in segments: losses and gradients
equal one device."""

from __future__ import annotations

import functools

import pytest
import torch
from builders import check_matches_one_device, hf_causal_lm_graph, tiny_builtin_graph

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.plan_layout import plan_placements
from explorer.runtime import RankPool
from explorer.runtime.tensor_parallel import check_supported

# every test here starts rank processes
pytestmark = pytest.mark.slow

STEPS, WARMUP = 2, 1

#: each check runs op by op and in segments (tensor-parallel segments on DTensor)
RUNTIMES = pytest.mark.parametrize("runtime", ["ops", "segments"])


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's runs."""
    with RankPool() as ranks:
        yield ranks


def _check(name: str, plan, shards: int, runtime: str, pool: RankPool) -> None:
    check_matches_one_device(name, plan, shards, STEPS, WARMUP, runtime, pool)


def _stages(name: str, devices: list[tuple[str, ...]], micro_batches: int = 1) -> ex.Plan:
    graph = tiny_builtin_graph(name)
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    cut = len(ops) // 2 if len(devices) > 1 else len(ops)
    return ex.Plan.from_assignment(graph, devices, {nm: int(k >= cut) for k, nm in
                                                    enumerate(ops)},
                                   micro_batches=micro_batches,
                                   schedule="1f1b" if micro_batches > 1 else "gpipe")


@RUNTIMES
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_sequence_parallel_stage_matches_one_device(name, runtime, pool):
    """Norms and residual adds on each rank's half of the positions; every row-parallel
    output and the token embedding reduce-scattered, every column-parallel input gathered
    (the GPT's fused qkv, the Llama's q, k, v, gate and up, both LM heads); the norms' weights
    and the row-parallel biases all-reduced once a step."""
    plan = _stages(name, [("cpu:0", "cpu:1")]).with_tensor(2, sequence=True)
    assert plan_placements(tiny_builtin_graph(name), plan)[3]  # (sequence-split ops)
    _check(name, plan, 1, runtime, pool)


@RUNTIMES
def test_two_replicas_of_a_sequence_parallel_gpt_match_one_device(runtime, pool):
    plan = _stages("gpt", [("cpu:0", "cpu:1", "cpu:2", "cpu:3")]).with_tensor(2, sequence=True)
    _check("gpt", plan, 2, runtime, pool)


@RUNTIMES
@pytest.mark.parametrize("split_stage", [0, 1])
def test_sequence_shards_cross_a_stage_boundary_whole(split_stage, runtime, pool):
    """3 ranks, 2 micro-batches: a sequence-parallel stage sends its positions' shards
    gathered (and narrows the gradients it gets back), or reads whole values from a plain
    stage, narrowed to its positions."""
    devices = [("cpu:0",), ("cpu:1", "cpu:2")][::1 if split_stage else -1]
    plan = _stages("gpt", devices, micro_batches=2).with_tensor(2, stages=[split_stage],
                                                                sequence=True)
    _check("gpt", plan, 2, runtime, pool)


@functools.cache
def _hf_gpt2_with_dropout():
    """Hugging Face's GPT-2 (tiny, its output layer untied) with its dropouts on: Conv1D
    projections (``addmm`` on rows, viewed back to (batch, seq, features)), a dropout before
    each residual add, and an attention dropout inside the head-split core."""
    return hf_causal_lm_graph("hf-gpt2-dropout", lambda transformers: (
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, use_cache=False,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=False))))


@RUNTIMES
@pytest.mark.parametrize("sequence", [False, True], ids=["tensor", "sequence"])
def test_hf_gpt2_with_dropout_matches_one_device(runtime, sequence, pool):
    """Every dropout draws the mask one device draws: on sequence shards each rank draws the
    whole mask and applies its positions' part; the attention's dropout runs whole on every
    rank. The Conv1D row projections' partial sums are reduce-scattered at their view back to
    (batch, seq, features), each rank adding its share of the bias; the token embedding's ids
    come through a view, the output layer's logits reach the loss through a flatten."""
    graph = _hf_gpt2_with_dropout()
    ops = {n.name: 0 for n in graph.ops}
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1")], ops).with_tensor(
        2, sequence=sequence)
    placements, _, _, on_shards = plan_placements(graph, plan)
    assert placements["transformer.wte.weight"] == "Shard(0)"
    assert placements["lm_head.weight"] == "Shard(0)"
    assert bool(on_shards) == sequence
    meas = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False, record=True,
                  timeout_s=180, runtime=runtime, pool=pool)
    one = ex.run(graph, plan=ex.Plan.from_assignment(graph, [("cpu:0",)], ops), steps=STEPS,
                 warmup=WARMUP, progress=False, record=True, timeout_s=180, runtime=runtime,
                 pool=pool)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(one.losses),
                               rtol=1e-5, atol=1e-6)
    for k, g in one.grads.items():
        torch.testing.assert_close(meas.grads[k], g, rtol=1e-5, atol=1e-6, msg=k)


def test_a_stage_cut_between_a_scattered_projection_and_its_view_is_refused():
    """Under sequence parallelism a Conv1D row projection's partial sums are scattered by the
    view after it: a stage may not end between the two."""
    graph = _hf_gpt2_with_dropout()
    ops = [n.name for n in graph.ops]
    cut = ops.index("view_7")  # (block 0's attention output projection: addmm_1, view_7)
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1"), ("cpu:2", "cpu:3")],
                                   {n: int(k >= cut) for k, n in enumerate(ops)})
    check_supported(graph, plan.with_tensor(2))  # (no sequence: the sums are reduced there)
    with pytest.raises(ExplorerError, match=r"a stage ends between 'addmm_1', a row-parallel "
                                            r"projection .* 'view_7', the view that scatters"):
        check_supported(graph, plan.with_tensor(2, sequence=True))
