"""Repeated blocks: a fake capture traces a few of a model's identical layers and grows the graph
to all of them; the result is the graph of tracing every layer, or the whole model is traced."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fake import assert_same_graph
from torch import nn

import explorer as ex
from explorer.capture.blocks import MIN_BLOCKS, NotRepeating, find_blocks
from explorer.core.errors import CaptureError
from explorer.models.dense import GPT_SIZES, build_gpt
from explorer.models.llama import LLAMA_SIZES, build_llama

REUSED = "identical blocks"
FELL_BACK = "traced every block"


def _builtin(build, sizes, n_layers: int):
    cfg = dataclasses.replace(sizes["small"], n_layers=n_layers)
    module, x, y, loss, _ = build(cfg, 4, torch.Generator().manual_seed(0))
    return module, x, loss, y


def _three_ways(module, x, loss, y, real: bool) -> ex.OpGraph:
    """The grown graph, checked against tracing every block on fake tensors (and for real)."""
    grown = ex.capture(module, x, loss, y, fake=True)
    assert any(REUSED in note for note in grown.notes), grown.notes
    if real:
        assert_same_graph(ex.capture(module, x, loss, y), grown)
    full_fake = ex.capture(module, x, loss, y, fake=True, reuse_blocks=False)
    assert not any(REUSED in note or FELL_BACK in note for note in full_fake.notes)
    assert_same_graph(full_fake, grown)
    return grown


@pytest.mark.parametrize("n_layers", [MIN_BLOCKS, 6])
@pytest.mark.parametrize("build,sizes", [(build_llama, LLAMA_SIZES), (build_gpt, GPT_SIZES)],
                         ids=["llama", "gpt"])
def test_builtin_decoders_grow_to_the_full_graph(build, sizes, n_layers):
    module, x, loss, y = _builtin(build, sizes, n_layers)
    layers_before = [id(m) for m in module.modules()]
    graph = _three_ways(module, x, loss, y, n_layers == MIN_BLOCKS)
    assert [id(m) for m in module.modules()] == layers_before  # the list is whole again
    paths = {n.module_path.split(".")[1] for n in graph.ops
             if n.module_path.startswith(("layers.", "blocks."))}
    assert paths == {str(i) for i in range(n_layers)}


transformers = pytest.importorskip("transformers")


def _hf(kind: str, n_layers: int, **kw):
    from test_fake_hf import _batch, _llama_config, _lm_loss

    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=n_layers, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
            use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
            eos_token_id=0, **kw))
    else:
        model = transformers.LlamaForCausalLM(_llama_config(num_hidden_layers=n_layers, **kw))
    x, y = _batch()
    return model, x, _lm_loss, y


@pytest.mark.parametrize("n_layers", [MIN_BLOCKS, 6])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_decoders_grow_to_the_full_graph(kind, n_layers):
    model, x, loss, y = _hf(kind, n_layers)
    _three_ways(model, x, loss, y, n_layers == MIN_BLOCKS)
    attn = model.model.layers[3].self_attn if kind == "llama" else model.transformer.h[3].attn
    assert type(attn.layer_idx) is int and attn.layer_idx == 3  # its index is given back


def _assert_falls_back(module, x, loss=None, y=None, why: str = "") -> None:
    graph = ex.capture(module, x, loss, y, fake=True)
    notes = [n for n in graph.notes if FELL_BACK in n]
    assert notes and why in notes[0], graph.notes
    assert_same_graph(ex.capture(module, x, loss, y), graph)


def test_a_block_that_computes_with_its_index_is_traced_in_full():
    # GPT-2 scales attention by 1 / (layer_idx + 1) when asked: the blocks differ by index
    model, x, loss, y = _hf("gpt2", MIN_BLOCKS, scale_attn_by_inverse_layer_idx=True)
    _assert_falls_back(model, x, loss, y, "differs between blocks")


class _Block(nn.Module):
    def __init__(self, width: int, index: int = 0, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.index, self.scale = index, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).relu() * self.scale
        return y.tanh() if self.index == MIN_BLOCKS else y  # only the last block differs


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], skip: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = x
        for layer in self.layers:
            x, prev = (layer(x) + prev if self.skip else layer(x)), x
        return x


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_plain_stack_of_identical_blocks_is_reused():
    torch.manual_seed(0)
    model = _Stack([_Block(8) for _ in range(MIN_BLOCKS + 1)])
    graph = ex.capture(model, _x(), fake=True)
    assert any(REUSED in n for n in graph.notes)
    assert_same_graph(ex.capture(model, _x()), graph)


@pytest.mark.parametrize("blocks,skip,why", [
    ([_Block(8) for _ in range(MIN_BLOCKS)] + [nn.Sequential(nn.Linear(8, 8))], False, ""),
    ([_Block(8, i) for i in range(MIN_BLOCKS + 1)], False, "own index (index)"),
    ([_Block(8, scale=1.0 + (i == 3)) for i in range(MIN_BLOCKS + 1)], False, "'scale'"),
    ([_Block(8) for _ in range(MIN_BLOCKS + 1)], True, "outside the blocks"),
], ids=["other-type", "index-branch", "attribute", "skip-two-back"])
def test_blocks_that_do_not_repeat_are_traced_in_full(blocks, skip, why):
    torch.manual_seed(0)
    model = _Stack(blocks, skip)
    if isinstance(blocks[-1], nn.Sequential):  # not a list of one block type: nothing to try
        graph = ex.capture(model, _x(), fake=True)
        assert not any(REUSED in n or FELL_BACK in n for n in graph.notes)
        assert_same_graph(ex.capture(model, _x()), graph)
        return
    _assert_falls_back(model, _x(), why=why)


def test_shared_blocks_are_not_reused():
    block = _Block(8)
    with pytest.raises(NotRepeating, match="same module"):
        find_blocks(_Stack([block] * MIN_BLOCKS))
    assert find_blocks(_Stack([_Block(8) for _ in range(MIN_BLOCKS - 1)])) is None


def test_reuse_blocks_switch():
    module, x, loss, y = _builtin(build_llama, LLAMA_SIZES, MIN_BLOCKS)
    full = ex.capture(module, x, loss, y, fake=True, reuse_blocks=False)
    assert not any(REUSED in n for n in full.notes)
    with pytest.raises(CaptureError, match="fake=True"):
        ex.capture(module, x, loss, y, reuse_blocks=True)
    assert ex.capture(module, x, loss, y).notes == ()  # a real capture traces every block
