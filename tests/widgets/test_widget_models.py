"""Opening the explorer on models as a new user gives them: a built-in model without a size
(the command line's default, a published shape's one size), and Hugging Face GPT-2 from its
default config's cache setting with a bare tensor for its batch and targets."""

from __future__ import annotations

import pytest
import torch

import explorer as ex
from explorer.capture.fake import FAKE_NOTE
from explorer.cli.commands import build_parser

pytest.importorskip("jupyter_bokeh")
from widgets import Explorer


def test_a_builtin_without_a_size_gets_the_command_lines_default():
    w = Explorer.builtin("mlp", devices="cpu:1", progress=False, measure="never")
    cli_size = build_parser().parse_args(["models"]).size
    sizes = {size: 4 * ex.builtin_model("mlp", size).n_params for size in ("small", cli_size)}
    assert sizes["small"] != sizes[cli_size]
    assert w.session.graph.param_bytes == sizes[cli_size]


def test_a_published_shape_opens_without_a_size():
    w = Explorer.builtin("llama-70b", devices="64xH100", progress=False, measure="never")
    assert w.session.graph.name == "llama-70b"
    assert len(w.session.costs.cluster.ids) == 64


def test_a_shape_asked_for_at_another_size_says_it_has_one():
    with pytest.raises(ex.ExplorerError, match="a published shape has one size"):
        Explorer.builtin("llama-70b", size="small", devices="64xH100", progress=False,
                         measure="never")


def test_hf_gpt2_with_its_cache_opens_on_a_bare_batch_without_running():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0))
    ids = torch.randint(0, 64, (4, 16))

    def loss(out, labels):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    w = Explorer(model, ids, cluster=ex.Cluster.preset("8xH100"), loss_fn=loss, targets=ids,
                 progress=False, measure="never")
    assert w.session.graph.notes[0] == FAKE_NOTE  # opened at once, nothing run
    assert [n.name for n in w.session.graph.nodes if n.kind == "input"] == ["input_0",
                                                                           "target_0"]
