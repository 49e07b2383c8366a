"""Tests of the built-in models: each builds, trains a step, exports, and is deterministic."""

from __future__ import annotations

import pytest
import torch

from explorer.core.errors import UnknownNameError
from explorer.models import builtin as models

NAMES = models.model_names()


class Wrapper(torch.nn.Module):
    """One training step's loss as a module: what the explorer hands to ``torch.export``."""

    def __init__(self, module: torch.nn.Module, loss_fn, n_inputs: int) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        inputs, targets = args[: self.n_inputs], args[self.n_inputs :]
        return self.loss_fn(self.module(*inputs), *targets)


def _step_args(bm: models.BuiltinModel) -> tuple[torch.Tensor, ...]:
    return (*bm.example_inputs, *bm.targets)


def _expected_output_shape(bm: models.BuiltinModel) -> tuple[int, ...]:
    cfg = models.model_config(bm.name, bm.size)
    if bm.name in ("gpt", "llama"):
        return (bm.batch_size, cfg.seq_len, cfg.vocab_size)
    return (bm.batch_size, cfg.n_classes)


class TestRegistry:
    def test_names(self):
        assert NAMES == sorted(NAMES)
        assert set(NAMES) == {"mlp", "alexnet", "vgg16", "resnet", "gpt", "llama",
                              "inception"}
        assert models.DEFAULT_MODEL in NAMES
        assert models.SIZES == ("tiny", "small", "default", "large")

    @pytest.mark.parametrize("name", NAMES)
    def test_every_size_has_a_batch_divisible_by_8(self, name):
        for size in models.SIZES:
            assert models.model_config(name, size).batch_size % 8 == 0

    def test_unknown_name(self):
        with pytest.raises(UnknownNameError,
                           match=r"choose one of: alexnet, gpt, gpt3-1\.3b.*llama-13b"):
            models.build("lenet")
        with pytest.raises(KeyError):  # an UnknownNameError is also a KeyError
            models.build("lenet")

    def test_unknown_size(self):
        with pytest.raises(UnknownNameError, match=r"'huge'.*default, large, small, tiny"):
            models.build("mlp", size="huge")

    @pytest.mark.parametrize("batch_size", [0, -8, 2.5])
    def test_bad_batch_size(self, batch_size):
        with pytest.raises(ValueError, match="batch_size"):
            models.build("mlp", "tiny", batch_size=batch_size)


@pytest.mark.parametrize("name", NAMES)
class TestTinyModels:
    def test_builds_in_training_mode(self, name):
        bm = models.build(name, "tiny")
        assert isinstance(bm, models.BuiltinModel)
        assert (bm.name, bm.size) == (name, "tiny")
        assert bm.description
        assert bm.module.training
        assert bm.n_params > 0
        for t in _step_args(bm):
            assert t.shape[0] == bm.batch_size

    def test_forward_shape_and_loss(self, name):
        bm = models.build(name, "tiny")
        out = bm.module(*bm.example_inputs)
        assert tuple(out.shape) == _expected_output_shape(bm)
        loss = bm.loss_fn(out, *bm.targets)
        assert loss.dim() == 0
        assert torch.isfinite(loss)

    def test_targets_are_valid_class_indices(self, name):
        bm = models.build(name, "tiny")
        n_classes = _expected_output_shape(bm)[-1]
        for t in bm.targets:
            assert t.dtype == torch.int64
            assert 0 <= int(t.min()) and int(t.max()) < n_classes

    def test_backward_reaches_every_parameter(self, name):
        bm = models.build(name, "tiny")
        bm.loss_fn(bm.module(*bm.example_inputs), *bm.targets).backward()
        for pname, p in bm.module.named_parameters():
            assert p.grad is not None, pname
            assert torch.isfinite(p.grad).all(), pname

    def test_export_matches_eager(self, name):
        bm = models.build(name, "tiny")
        wrapper = Wrapper(bm.module, bm.loss_fn, len(bm.example_inputs))
        ep = torch.export.export(wrapper, _step_args(bm))
        n_ops = sum(1 for n in ep.graph.nodes if n.op == "call_function")
        assert 0 < n_ops < 150
        paths = {
            path
            for n in ep.graph.nodes
            for path, _ in n.meta.get("nn_module_stack", {}).values()
        }
        assert any(p.count(".") >= 2 for p in paths)  # ops carry nested module paths
        fresh = models.build(name, "tiny")
        expected = fresh.loss_fn(fresh.module(*fresh.example_inputs), *fresh.targets)
        torch.testing.assert_close(ep.module()(*_step_args(bm)), expected)

    def test_batch_size_override(self, name):
        bm = models.build(name, "tiny", batch_size=16)
        assert bm.batch_size == 16
        for t in _step_args(bm):
            assert t.shape[0] == 16
        out = bm.module(*bm.example_inputs)
        assert out.shape[0] == 16

    def test_same_seed_same_model(self, name):
        a, b = models.build(name, "tiny", seed=3), models.build(name, "tiny", seed=3)
        sa, sb = a.module.state_dict(), b.module.state_dict()
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
        for x, y in zip(_step_args(a), _step_args(b), strict=True):
            assert torch.equal(x, y)

    def test_other_seed_other_model(self, name):
        a, b = models.build(name, "tiny", seed=0), models.build(name, "tiny", seed=1)
        pa, pb = next(a.module.parameters()), next(b.module.parameters())
        assert not torch.equal(pa, pb)
        assert not torch.equal(a.example_inputs[0], b.example_inputs[0])

    def test_global_rng_left_alone(self, name):
        before = torch.get_rng_state()
        models.build(name, "tiny", seed=7)
        assert torch.equal(torch.get_rng_state(), before)


def test_gpt_module_paths_and_shifted_targets():
    bm = models.build("gpt", "tiny")
    names = dict(bm.module.named_modules())
    for path in ("tok_emb", "pos_emb", "blocks.0.attn.qkv", "blocks.1.mlp.fc", "ln_f", "lm_head"):
        assert path in names
    assert bm.example_inputs[0].dtype == torch.int64
    # targets are the inputs shifted by one token
    assert torch.equal(bm.example_inputs[0][:, 1:], bm.targets[0][:, :-1])


def test_gpt_attention_is_causal():
    bm = models.build("gpt", "tiny")
    bm.module.eval()
    tokens = bm.example_inputs[0]
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % models.model_config("gpt", "tiny").vocab_size
    with torch.no_grad():
        a, b = bm.module(tokens), bm.module(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])  # the last token cannot change the past
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_resnet_has_downsampling_shortcuts():
    bm = models.build("resnet", "tiny")
    names = dict(bm.module.named_modules())
    assert isinstance(names["layer2.0.downsample.0"], torch.nn.Conv2d)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in names.values())
