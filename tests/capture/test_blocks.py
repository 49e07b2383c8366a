"""Repeated blocks: a fake capture traces a few of a model's identical layers and grows the graph
to all of them; the result is the graph of tracing every layer, or the whole model is traced."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from test_fake import assert_same_graph
from torch import nn

import explorer as ex
from explorer.capture.blocks import MIN_BLOCKS, NotRepeating, find_blocks
from explorer.capture.tracing import step_program
from explorer.core.errors import CaptureError
from explorer.models.dense import GPT_SIZES, build_gpt
from explorer.models.llama import LLAMA_SIZES, build_llama
from explorer.runtime.jobfiles import program_calls

REUSED = "identical blocks"
FELL_BACK = "traced every block"


def _builtin(build, sizes, n_layers: int):
    cfg = dataclasses.replace(sizes["small"], n_layers=n_layers)
    module, x, y, loss, _ = build(cfg, 4, torch.Generator().manual_seed(0))
    return module, x, loss, y


def three_ways(module, x, loss, y, real: bool) -> ex.OpGraph:
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
    graph = three_ways(module, x, loss, y, n_layers == MIN_BLOCKS)
    assert [id(m) for m in module.modules()] == layers_before  # the list is whole again
    paths = {n.module_path.split(".")[1] for n in graph.ops
             if n.module_path.startswith(("layers.", "blocks."))}
    assert paths == {str(i) for i in range(n_layers)}


def assert_falls_back(module, x, loss=None, y=None, why: str = "") -> None:
    graph = ex.capture(module, x, loss, y, fake=True)
    notes = [n for n in graph.notes if FELL_BACK in n]
    assert notes and why in notes[0], graph.notes
    assert_same_graph(ex.capture(module, x, loss, y), graph)


class _Block(nn.Module):
    def __init__(self, width: int, index: int = 0, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.index, self.scale = index, scale

    def forward(self, x: torch.Tensor, i: int | None = None) -> torch.Tensor:
        y = self.fc(x).relu() * self.scale
        last = MIN_BLOCKS in (self.index, i)
        return y.tanh() if last else y  # only the last block differs, by its index


class _Stack(nn.Module):
    """Identical blocks in a loop: plain, with a skip from two blocks back, over the first
    MIN_BLOCKS of them only, or handing each its index."""

    def __init__(self, blocks: list[nn.Module], loop: str = "plain") -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.loop = loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = x
        layers = self.layers[:MIN_BLOCKS] if self.loop == "first" else self.layers
        for i, layer in enumerate(layers):
            y = layer(x, i) if self.loop == "index" else layer(x)
            x, prev = (y + prev if self.loop == "skip" else y), x
        return x


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_plain_stack_of_identical_blocks_is_reused():
    torch.manual_seed(0)
    model = _Stack(_same())
    graph = ex.capture(model, _x(), fake=True)
    assert any(REUSED in n for n in graph.notes)
    assert_same_graph(ex.capture(model, _x()), graph)


def _same(n: int = MIN_BLOCKS + 1) -> list[_Block]:
    return [_Block(8) for _ in range(n)]


@pytest.mark.parametrize("blocks,loop,why", [
    ([*_same(MIN_BLOCKS), nn.Sequential(nn.Linear(8, 8))], "plain", ""),
    ([_Block(8, i) for i in range(MIN_BLOCKS + 1)], "plain", "own index (index)"),
    ([_Block(8, scale=1.0 + (i == 3)) for i in range(MIN_BLOCKS + 1)], "plain", "'scale'"),
    (_same(), "skip", "outside the blocks"),
    (_same(), "first", "not each once in turn"),
    (_same(), "index", "different arguments"),
], ids=["other-type", "index-attribute", "attribute", "skip-two-back", "fewer-run",
        "loop-index"])
def test_blocks_that_do_not_repeat_are_traced_in_full(blocks, loop, why, caplog):
    torch.manual_seed(0)
    model = _Stack(blocks, loop)
    if isinstance(blocks[-1], nn.Sequential):  # not a list of one block type: nothing to try
        graph = ex.capture(model, _x(), fake=True)
        assert not any(REUSED in n or FELL_BACK in n for n in graph.notes)
        assert_same_graph(ex.capture(model, _x()), graph)
        return
    with caplog.at_level(logging.DEBUG, logger="explorer.capture"):
        assert_falls_back(model, _x(), why=why)
    assert any(FELL_BACK in r.getMessage() and why in r.getMessage() for r in caplog.records)


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


def test_a_grown_graph_exports_the_program_of_every_block():
    """Planning needs only the grown graph; an export needs every block's ops, so the whole
    model is traced when the program is first asked for, and it matches the grown graph."""
    module, x, loss, y = _builtin(build_llama, LLAMA_SIZES, 5)
    grown = ex.capture(module, x, loss, y, fake=True)
    assert any(REUSED in note for note in grown.notes)
    program = step_program(grown)
    calls, _ = program_calls(program, 1)  # one input tensor, then the targets
    assert [c.name for c in calls] == [n.name for n in grown.nodes]
    assert step_program(grown) is program  # traced once
