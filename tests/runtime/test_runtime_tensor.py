"""Tensor-parallel stages on 2 CPU ranks, op by op and in segments: losses and gradients
equal one device."""

from __future__ import annotations

import functools

import pytest
import torch
from builders import check_matches_one_device, hf_causal_lm_graph, tiny_builtin_graph
from torch import nn

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.plan_layout import plan_placements
from explorer.core.segments import group_segments
from explorer.runtime import RankPool
from explorer.runtime.tensor_parallel import check_supported
from explorer.simulate.simulator import execution_order

# every test here starts rank processes
pytestmark = pytest.mark.slow

STEPS, WARMUP = 2, 1

#: each run check runs op by op and in segments (tensor-parallel segments on DTensor)
RUNTIMES = pytest.mark.parametrize("runtime", ["ops", "segments"])


@pytest.fixture(scope="module")
def pool():
    """Rank processes shared by the module's runs."""
    with RankPool() as ranks:
        yield ranks


def _one_stage(graph, devices):
    return ex.Plan.from_assignment(graph, [devices],
                                   {n.name: 0 for n in graph.nodes if n.kind == "op"})


def _check(name: str, plan, shards: int, runtime: str, pool: RankPool) -> None:
    check_matches_one_device(name, plan, shards, STEPS, WARMUP, runtime, pool)


@RUNTIMES
@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "alexnet", "vgg16", "inception"])
def test_tensor_parallel_stage_matches_one_device(name, runtime, pool):
    """The Llama's SwiGLU splits (gate and up column-, down row-parallel), and its attention by
    heads (query, key and value column-, output row-parallel; rotary embedding, grouped keys and
    values and the attention itself on each rank's own heads). The GPT's and the Llama's LM
    heads split by classes, their cross-entropy vocabulary-parallel. Convolutions with a ReLU
    between split by channels: the AlexNet's third and fourth (the others have a pool after),
    each VGG block's first two, the Inception's 1x1 reductions (their shared input's gradient
    all-reduced once) and the convolutions after them."""
    _check(name, _one_stage(tiny_builtin_graph(name), ("cpu:0", "cpu:1")).with_tensor(2), 1,
           runtime, pool)


@RUNTIMES
def test_a_fused_qkv_split_by_heads_matches_one_device(runtime, pool):
    """The GPT's fused query-key-value projection: each rank holds its head's rows of the
    query, the key and the value (a strided shard), splits its output in three of a third of
    the width and runs the matmuls, the causal mask and the softmax on its own head."""
    plan = _one_stage(tiny_builtin_graph("gpt"), ("cpu:0", "cpu:1")).with_tensor(2)
    placements = plan_placements(tiny_builtin_graph("gpt"), plan)[0]
    assert placements["blocks.1.attn.qkv.weight"] == "_StridedShard(dim=0, sf=3)"
    _check("gpt", plan, 1, runtime, pool)


@RUNTIMES
def test_two_replicas_of_a_tensor_parallel_gpt_match_one_device(runtime, pool):
    """4 ranks: 2 replicas x 2 tensor devices. The split embedding's gradient comes out of the
    backward whole; each rank keeps its shard, all-reduced with the other replica's."""
    devices = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
    plan = _one_stage(tiny_builtin_graph("gpt"), devices).with_tensor(2)
    _check("gpt", plan, 2, runtime, pool)


@functools.cache
def _conv_graph():
    """conv (whole: a pool follows) -> pool -> conv (column) -> relu -> conv (row) -> linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2),
                          nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(6 * 4 * 4, 10))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    return ex.capture(model, (x,), nn.functional.cross_entropy, (y,), name="convs")


_ONE_DEVICE: dict = {}


def _one_device(graph, seed: int = 0, pool: RankPool | None = None,
                record: bool = True) -> ex.Measurement:
    """``graph`` on one device (run once per graph and seed, for both runtimes' checks)."""
    key = (id(graph), seed, record)  # (the graphs are captured once: functools.cache)
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = ex.run(graph, plan=_one_stage(graph, ("cpu:0",)), steps=STEPS,
                                  warmup=WARMUP if record else 0, progress=False,
                                  record=record, timeout_s=180, seed=seed, pool=pool,
                                  runtime="ops")
    return _ONE_DEVICE[key]


def _same_as_one_device(graph, plan, runtime: str, pool: RankPool) -> None:
    meas = ex.run(graph, plan=plan, steps=STEPS, warmup=WARMUP, progress=False, record=True,
                  timeout_s=180, runtime=runtime, pool=pool)
    one = _one_device(graph, pool=pool)
    assert meas.runtime == runtime
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(one.losses),
                               rtol=1e-5, atol=1e-6)
    assert set(meas.grads) == set(one.grads)
    for k, g in one.grads.items():
        torch.testing.assert_close(meas.grads[k], g, rtol=1e-5, atol=1e-6, msg=k)


@RUNTIMES
def test_convolutions_split_by_channels_match_one_device(runtime, pool):
    """The second convolution column-, the third row-parallel: the ReLU between on each
    rank's channels, the pooled input's gradient all-reduced, the row's bias added once."""
    graph = _conv_graph()
    plan = _one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2)
    assert set(plan_placements(graph, plan)[0]) == {"2.weight", "2.bias", "4.weight"}
    _same_as_one_device(graph, plan, runtime, pool)


@RUNTIMES
def test_a_stage_boundary_after_split_channels_matches_one_device(runtime, pool):
    """3 ranks: the convolutions up to the ReLU split over two, the rest on one: the ReLU's
    channels are gathered whole to the next stage, its gradient narrowed back to them."""
    graph = _conv_graph()
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    cut = ops.index("relu")
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1"), ("cpu:2",)],
                                   {**{nm: int(k > cut) for k, nm in enumerate(ops)},
                                    "4.weight": 1, "4.bias": 1}).with_tensor(2, stages=[0])
    assert plan_placements(graph, plan)[1] == ["conv2d_1", "relu"]
    _same_as_one_device(graph, plan, runtime, pool)


class _Skip(nn.Module):
    """inp (column) -> tanh, gathered by a cat (whole) on this stage; side on another; up
    (column) of side's output -> relu x the cat (on each rank's half) -> down (row)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.side = nn.Linear(8, 16), nn.Linear(16, 16)
        self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        wide = torch.cat([h, h], -1)  # (batch, 32), whole
        return self.head(self.down(torch.relu(self.up(self.side(h))) * wide))


@RUNTIMES
def test_a_whole_value_read_by_split_ops_of_a_later_segment_matches_one_device(runtime, pool):
    """3 ranks: the split stage sends tanh's output to the other stage and waits for side's,
    so its forward runs as two segments; the cat the first makes is read by the second's
    split multiply, whose partial gradient of it is all-reduced before the first's
    backward reads it."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    graph = ex.capture(_Skip(), (x,), nn.functional.cross_entropy, (y,), name="skip")
    side = ("linear_1", "side.weight", "side.bias")
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1"), ("cpu:2",)],
                                   {n.name: int(n.name in side) for n in graph.nodes
                                    if n.kind in ("op", "param")}).with_tensor(2, stages=[0])
    assert "mul" in plan_placements(graph, plan)[1]
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    segments = group_segments(execution_order(graph, plan)[0], 0,
                              [plan.placement[n.name] for n in graph.nodes],
                              [n.kind for n in graph.nodes],
                              [[index[p] for p in n.inputs] for n in graph.nodes],
                              [n.requires_grad for n in graph.nodes], index[graph.loss])
    assert [graph.nodes[i].name for i in segments[1].inputs if i in segments[0].nodes] == [
        "cat"]
    _same_as_one_device(graph, plan, runtime, pool)


@functools.cache
def _dropout_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5),  # column, split
                          nn.Linear(64, 64), nn.Dropout(0.3),  # row, on its partial sums
                          nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    return ex.capture(model, (x,), nn.functional.cross_entropy, (y,), name="dropout")


@RUNTIMES
def test_dropout_in_and_after_a_split_block_draws_what_one_device_draws(runtime, pool):
    graph = _dropout_graph()
    split = ex.run(graph, plan=_one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2),
                   steps=STEPS, warmup=0, progress=False, timeout_s=120, seed=3,
                   runtime=runtime, pool=pool)
    assert split.losses == _one_device(graph, seed=3, pool=pool, record=False).losses


@RUNTIMES
def test_pipeline_of_a_plain_and_a_tensor_parallel_stage_matches_one_device(runtime, pool):
    """3 ranks: the first half of the GPT on one, the second split over two; 2 micro-batches
    (1F1B). Activations and gradients cross the boundary whole."""
    graph = tiny_builtin_graph("gpt")
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    plan = ex.Plan.from_assignment(graph, [("cpu:0",), ("cpu:1", "cpu:2")],
                                   {nm: int(k >= len(ops) // 2) for k, nm in enumerate(ops)},
                                   micro_batches=2, schedule="1f1b").with_tensor(2, stages=[1])
    _check("gpt", plan, 2, runtime, pool)


def test_a_weight_read_across_a_tensor_parallel_stage_is_refused_before_starting():
    graph = tiny_builtin_graph("mlp")
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1"), ("cpu:2",)],
                                   {**{nm: int(nm == ops[-1]) for nm in ops}, "head.weight": 1}
                                   ).with_tensor(2, stages=[0])
    with pytest.raises(ExplorerError, match=r"weight 'head\.weight' is read on another stage"):
        ex.run(graph, plan=plan, steps=1, warmup=0, progress=False)


def test_a_stage_boundary_inside_a_head_split_attention_is_refused():
    graph = tiny_builtin_graph("llama")
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    cut = ops.index("view")  # the query's view into heads: the first op on local heads
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1"), ("cpu:2",)],
                                   {nm: int(k > cut) for k, nm in enumerate(ops)}
                                   ).with_tensor(2, stages=[0])
    with pytest.raises(ExplorerError, match=r"'view' of a head-split attention"):
        check_supported(graph, plan)


_LOSS_OPTIONS = {"mean": {}, "sum": {"reduction": "sum"},
                 "label_smoothing": {"label_smoothing": 0.1}}


@functools.cache
def _ignored_graph(options: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 24))
    x, y = torch.randn(4, 5, 8), torch.randint(0, 24, (4, 5))
    y[0, 2], y[1, :] = -100, -100

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 24),
                                           target[:, 1:].reshape(-1), **_LOSS_OPTIONS[options])

    return ex.capture(model, (x,), loss_fn, (y,), name="ignored")


@RUNTIMES
@pytest.mark.parametrize("options", list(_LOSS_OPTIONS))
def test_a_vocabulary_parallel_loss_ignores_targets_as_one_device(options, runtime, pool):
    """Logits (batch, seq, 24) split by classes, shifted along the sequence and reshaped on each
    rank's 12 classes; targets of -100 count for nothing (nor in the mean's count). With label
    smoothing (which the graph does not show) the loss runs whole on gathered logits."""
    graph = _ignored_graph(options)
    plan = _one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2)
    assert set(plan_placements(graph, plan)[0]) == {"2.weight", "2.bias"}
    _same_as_one_device(graph, plan, runtime, pool)


class _ScaledBlock(nn.Module):
    """conv (column) -> relu -> x per-channel scale, + a whole value -> conv (row)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Conv2d(3, 2, 3, padding=1), nn.Conv2d(2, 3, 1)
        self.scale = nn.Parameter(torch.rand(2, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = x[:, :2] * 0.5  # (read on every rank's channels: narrowed, 1 each)
        return self.down(torch.relu(self.up(x)) * self.scale + whole) + x


@functools.cache
def _scaled_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), _ScaledBlock(), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 5))
    x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 5, (4,))
    return ex.capture(model, (x,), nn.functional.cross_entropy, (y,), name="scaled")


@RUNTIMES
def test_whole_values_inside_a_split_conv_block_are_narrowed_to_the_channels(runtime, pool):
    graph = _scaled_graph()
    plan = _one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2)
    assert set(plan_placements(graph, plan)[0]) == {"1.up.weight", "1.up.bias",
                                                    "1.down.weight"}
    _same_as_one_device(graph, plan, runtime, pool)


@functools.cache
def _hf_gpt2_graph():
    """Hugging Face's GPT-2 (tiny): its ``Conv1D`` layers are linears with an ``(in, out)``
    weight, run as ``addmm`` on the rows of their input."""
    return hf_causal_lm_graph("hf-gpt2", lambda transformers: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)))


@RUNTIMES
def test_hf_gpt2_conv1d_layers_split_and_match_one_device(runtime, pool):
    """Each block's fused c_attn column-parallel by heads within the query, key and value
    (weight dim 1, bias dim 0), c_proj row-parallel (weight dim 0, bias added once); the MLP's
    c_fc column-, c_proj row-parallel, the rows' views on each rank's features."""
    graph = _hf_gpt2_graph()
    plan = _one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2)
    placements = plan_placements(graph, plan)[0]
    assert placements["transformer.h.1.attn.c_attn.weight"] == "_StridedShard(dim=1, sf=3)"
    assert placements["transformer.h.1.attn.c_attn.bias"] == "_StridedShard(dim=0, sf=3)"
    assert placements["transformer.h.1.attn.c_proj.weight"] == "Shard(0)"
    assert placements["transformer.h.1.mlp.c_fc.weight"] == "Shard(1)"
    assert placements["transformer.h.1.mlp.c_proj.weight"] == "Shard(0)"
    _same_as_one_device(graph, plan, runtime, pool)


@functools.cache
def _hf_llama_graph():
    """Hugging Face's Llama (tiny) with grouped-query attention: 4 query heads, 2 key-value
    heads, each repeated for 2 query heads (unsqueeze, expand, reshape)."""
    return hf_causal_lm_graph("hf-llama", lambda transformers: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=32,
                                 use_cache=False, tie_word_embeddings=False)))


@RUNTIMES
def test_hf_llama_grouped_query_attention_splits_by_heads_and_matches_one_device(runtime,
                                                                                 pool):
    """Each rank holds one of the two key-value heads and the two query heads that read it:
    the key-value heads' repetition runs on the rank's own head, its sizes followed from
    where the heads lie (not read off a shape convention)."""
    graph = _hf_llama_graph()
    plan = _one_stage(graph, ("cpu:0", "cpu:1")).with_tensor(2)
    placements = plan_placements(graph, plan)[0]
    assert placements["model.layers.1.self_attn.k_proj.weight"] == "Shard(0)"
    assert placements["model.layers.1.self_attn.o_proj.weight"] == "Shard(1)"
    _same_as_one_device(graph, plan, runtime, pool)

