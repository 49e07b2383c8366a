"""Capture: built-in models become OpGraphs with module paths, FLOPs and saved tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import explorer as ex
from explorer.capture.flops import causal_fraction, flop_counter
from explorer.core.errors import CaptureError, ExplorerError, InputMismatchError

NAMES = ex.model_names()
MATMUL_OPS = {"aten.linear.default", "aten.conv2d.default", "aten.matmul.default",
              "aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


def _capture_builtin(name: str, batch_size: int | None = None) -> ex.OpGraph:
    bm = ex.builtin_model(name, "tiny", batch_size)
    return ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)


@pytest.fixture(scope="module")
def captured() -> dict[str, ex.OpGraph]:
    return {name: _capture_builtin(name) for name in NAMES}


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class TestBuiltinModels:
    @pytest.mark.parametrize("name", NAMES)
    def test_exported_with_module_paths(self, captured, name):
        g = captured[name]
        assert g.source == "export"
        assert g.notes == ()
        assert g.batch_size == ex.builtin_model(name, "tiny").batch_size
        assert all(n.module_path for n in g.ops if n.op in MATMUL_OPS)

    def test_gpt_ops_live_under_their_blocks(self, captured):
        paths = {n.module_path for n in captured["gpt"].ops}
        assert "blocks.0.attn" in paths  # q @ k^T and the softmax belong to the attention
        assert "blocks.1.mlp.fc" in paths
        attn = [n.op for n in captured["gpt"].ops if n.module_path == "blocks.0.attn"]
        assert "aten.matmul.default" in attn

    @pytest.mark.parametrize("name", NAMES)
    def test_matmuls_have_forward_and_backward_flops(self, captured, name):
        mm = [n for n in captured[name].ops if n.op in MATMUL_OPS]
        assert mm, f"{name} has no linear/conv/matmul op"
        assert [n.name for n in mm if n.fwd_flops <= 0 or n.bwd_flops <= 0] == []

    @pytest.mark.parametrize("name", NAMES)
    def test_forward_flops_match_flop_counter_on_the_whole_step(self, captured, name):
        bm = ex.builtin_model(name, "tiny")  # a fresh copy: this forward updates BN stats
        with flop_counter() as counter, torch.no_grad():  # (fused attention counted too)
            bm.loss_fn(bm.module(*bm.example_inputs), *bm.targets)
        assert sum(n.fwd_flops for n in captured[name].nodes) == counter.get_total_flops()

    @pytest.mark.parametrize("name", NAMES)
    def test_loss_is_the_last_op_and_a_scalar(self, captured, name):
        g = captured[name]
        assert g.loss == g.ops[-1].name
        assert g[g.loss].op == "aten.cross_entropy_loss.default"
        assert g[g.loss].shapes == ((),)

    @pytest.mark.parametrize("name", NAMES)
    def test_param_bytes_equal_the_models(self, captured, name):
        assert captured[name].param_bytes == _param_bytes(ex.builtin_model(name, "tiny").module)

    def test_fingerprint_stable_and_batch_sensitive(self, captured):
        again = _capture_builtin("mlp")
        assert again.fingerprint == captured["mlp"].fingerprint
        assert _capture_builtin("mlp", batch_size=16).fingerprint != again.fingerprint

    def test_capture_keeps_the_models_train_and_eval_modes(self):
        bm = ex.builtin_model("resnet", "tiny")
        bm.module.eval()
        bm.module.fc.train()  # a mix, as a user may leave it
        modes = {n: m.training for n, m in bm.module.named_modules()}
        g = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
        assert {n: m.training for n, m in bm.module.named_modules()} == modes
        # the graph is still the training step, the same as from a model in train mode
        bm.module.train()
        assert ex.capture(bm.module, bm.example_inputs, bm.loss_fn,
                          bm.targets).fingerprint == g.fingerprint

    def test_capture_leaves_batchnorm_statistics_alone(self):
        bm = ex.builtin_model("resnet", "tiny")
        before = {k: v.clone() for k, v in bm.module.state_dict().items()}
        ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
        after = bm.module.state_dict()
        assert [k for k in before if not torch.equal(before[k], after[k])] == []


class TestLayers:
    @pytest.mark.parametrize("name", NAMES)
    @pytest.mark.parametrize("depth", [None, 1, 2])
    def test_cover_every_node_once_in_topological_order(self, captured, name, depth):
        g = captured[name]
        order = [i for layer in g.layers(depth) for i in layer]
        assert sorted(order) == list(range(len(g)))
        pos = {i: k for k, i in enumerate(order)}
        assert all(pos[p] < pos[i] for i, ps in enumerate(g.preds) for p in ps)

    def test_params_join_their_first_consumer(self, captured):
        g = captured["mlp"]
        layer = next(lay for lay in g.layers() if g.index["head.weight"] in lay)
        assert {g.nodes[i].name for i in layer} == {"head.weight", "head.bias", "linear_2"}

    def test_inputs_join_their_first_consumer(self, captured):
        g = captured["mlp"]
        first, last = g.layers()[0], g.layers()[-1]
        assert {g.nodes[i].name for i in first} == {"input_0", "layers.0.weight",
                                                     "layers.0.bias", "linear"}
        assert {g.nodes[i].name for i in last} == {"target_0", "cross_entropy_loss"}


class TestToyGraph:
    @pytest.fixture(scope="class")
    def toy(self) -> ex.OpGraph:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        return ex.capture(model, torch.randn(2, 2, 2))

    def test_nodes_and_edges(self, toy):
        assert [(n.name, n.op, n.module_path, n.inputs) for n in toy.ops] == [
            ("flatten", "aten.flatten.using_ints", "0", ("input_0",)),
            ("linear", "aten.linear.default", "1", ("flatten", "1.weight", "1.bias")),
            ("relu", "aten.relu.default", "2", ("linear",)),
            ("linear_1", "aten.linear.default", "3", ("relu", "3.weight", "3.bias")),
            ("mean", "aten.mean.default", "", ("linear_1",)),
        ]
        assert toy.loss == "mean"
        assert toy["linear"].shapes == ((2, 3),)
        assert toy["linear"].out_bytes == 2 * 3 * 4

    def test_flops_by_hand(self, toy):
        # forward 2·B·in·out; backward: weight grad 2·B·in·out, input grad the same when the
        # input needs a gradient (not for the first layer, whose input is the batch)
        assert (toy["linear"].fwd_flops, toy["linear"].bwd_flops) == (48, 48)
        assert (toy["linear_1"].fwd_flops, toy["linear_1"].bwd_flops) == (24, 48)
        assert toy["relu"].flops == 0

    def test_saved_tensors(self, toy):
        assert toy["relu"].saves == ("relu",)  # relu's backward needs its own output
        assert toy["linear"].saves == ("flatten",)  # the weight gradient needs the input
        assert set(toy["linear_1"].saves) == {"relu", "3.weight"}  # and the input gradient W
        assert toy["linear"].saved_extra_bytes == 0
        assert toy["relu"].saved_extra_bytes == 0

    def test_views_are_marked(self, toy):
        assert toy["flatten"].is_view
        assert not toy["linear"].is_view

    def test_requires_grad(self, toy):
        assert not toy["input_0"].requires_grad
        assert toy["1.weight"].requires_grad
        assert toy["relu"].requires_grad

    def test_backward_scratch(self, toy):
        # one autograd node per op, or a linear's matmul and transpose whose inner gradient
        # is the weight's: nothing held beyond the inputs' gradients
        assert all(n.backward_scratch_bytes == 0 for n in toy.nodes)

    @pytest.mark.parametrize("fake", [False, True])
    def test_a_cross_entropy_holds_its_log_softmax_gradient(self, fake):
        # its backward passes a gradient the size of the logits from the negative
        # log-likelihood's node to the log-softmax's, held while the latter makes the
        # logits' gradient; a 3-D linear's reshapes are views of the gradients around them
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 50))
        x, y = torch.randn(4, 6, 8), torch.randint(0, 50, (4, 6))
        g = ex.capture(model, x, lambda out, t: nn.functional.cross_entropy(
            out.flatten(0, 1), t.flatten()), [y], fake=fake)
        assert g[g.loss].backward_scratch_bytes == 4 * 6 * 50 * 4
        assert [n.name for n in g.nodes if n.backward_scratch_bytes] == [g.loss]

    def test_linear_then_relu_saves(self):
        g = ex.capture(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), torch.randn(2, 4))
        assert g["relu"].saves == ("relu",)
        assert g["linear"].saves == ("input_0",)

    def test_top_level_parameter_named_like_an_op(self):
        class Scaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Parameter(torch.ones(3, 4))  # an fx node is also "linear"

            def forward(self, x):
                return nn.functional.linear(x, self.linear)

        g = ex.capture(Scaled(), torch.ones(2, 4))
        assert g["linear"].kind == "param"
        op = g.ops[0]
        assert op.op == "aten.linear.default"
        assert op.inputs == ("input_0", "linear")
        assert op.fwd_flops == 2 * 2 * 4 * 3
        assert op.saves == ("input_0",)


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):  # x: (batch, seq, 16), two heads of 8
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("fake", [False, True])
def test_fused_attention_counts_its_flops(fake):
    """CPU runs scaled_dot_product_attention as a kernel FlopCounterMode has no formula for:
    its FLOPs are those of the CUDA kernels, 4 B H T^2 D forward and 2.5 times that backward."""
    g = ex.capture(FusedAttention(), torch.randn(3, 10, 16), fake=fake)
    (op,) = [n for n in g.ops if "attention" in n.op]
    assert (op.fwd_flops, op.bwd_flops) == (4 * 3 * 2 * 10 * 10 * 8, 10 * 3 * 2 * 10 * 10 * 8)


class MaskedAttention(FusedAttention):
    """The same attention under an explicit mask (its kernel computes every score)."""

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fake", [False, True])
def test_a_causal_attention_computes_the_scores_its_mask_leaves(fake):
    """is_causal: query i sees keys 0..i, 55 of the 10 x 10 scores, the share a flash kernel
    computes; an explicit mask, whatever it hides, leaves the kernel computing them all."""
    (causal,) = [n for n in ex.capture(FusedAttention(), torch.randn(3, 10, 16), fake=fake).ops
                 if "attention" in n.op]
    assert causal.computed_fraction == 55 / 100
    (masked,) = [n for n in ex.capture(MaskedAttention(), torch.randn(3, 10, 16),
                                       fake=fake).ops if "attention" in n.op]
    assert masked.computed_fraction == 1.0
    assert (masked.fwd_flops, masked.bwd_flops) == (causal.fwd_flops, causal.bwd_flops)


def test_causal_fraction_of_unequal_query_and_key_lengths():
    # (the mask is_causal makes: query i sees keys 0..i)
    assert causal_fraction(4, 8) == (1 + 2 + 3 + 4) / 32
    assert causal_fraction(8, 4) == (1 + 2 + 3 + 4 + 4 * 4) / 32
    assert causal_fraction(1, 1) == 1.0


class DataDependent(nn.Module):
    """Python control flow on a tensor value: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = torch.relu(h)
        return self.b(h)


class TestHooksFallback:
    @pytest.fixture(scope="class")
    def hooked(self) -> ex.OpGraph:
        torch.manual_seed(0)
        return ex.capture(DataDependent(), torch.randn(5, 4))

    def test_source_and_note(self, hooked):
        assert hooked.source == "hooks"
        assert len(hooked.notes) == 1
        assert "torch.export failed" in hooked.notes[0]
        assert "forward hooks" in hooked.notes[0]

    def test_one_node_per_leaf_module_call(self, hooked):
        assert [(n.name, n.kind, n.module_path, n.inputs) for n in hooked.nodes] == [
            ("input_0", "input", "", ()), ("a", "op", "a", ("input_0",)),
            ("b", "op", "b", ("a",))]
        assert hooked.loss == "b"
        assert hooked["a"].param_bytes == (4 * 8 + 8) * 4
        assert hooked.param_bytes == (4 * 8 + 8 + 8 * 2 + 2) * 4

    def test_flops_by_hand(self, hooked):
        # a: 2·5·4·8 forward, only the weight gradient backward; b: 2·5·8·2, both gradients
        assert (hooked["a"].fwd_flops, hooked["a"].bwd_flops) == (320, 320)
        assert (hooked["b"].fwd_flops, hooked["b"].bwd_flops) == (160, 320)

    def test_profiled_with_measured_numbers(self, hooked, tmp_path, monkeypatch):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        costs = ex.profile(hooked, ex.Cluster.cpu(1, measure=False), repeats=2, warmup=1,
                           progress=False)
        for name in ("a", "b"):
            i = hooked.index[name]
            assert costs.source(i, "cpu:0") == "measured"
            assert costs.fwd_s(i, "cpu:0") > 0
        assert costs.bwd_s(hooked.index["b"], "cpu:0") > 0

    def test_fallback_leaves_batchnorm_statistics_alone(self, tmp_path, monkeypatch):
        model = nn.Sequential(DataDependent(), nn.BatchNorm1d(2))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        g = ex.capture(model, torch.randn(5, 4))
        assert g.source == "hooks"
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        ex.profile(g, ex.Cluster.cpu(1, measure=False), repeats=1, warmup=0, progress=False)
        after = model.state_dict()
        assert [k for k in before if not torch.equal(before[k], after[k])] == []


class TestErrors:
    def test_not_a_module(self):
        with pytest.raises(CaptureError, match=r"needs a torch\.nn\.Module, got function"):
            ex.capture(lambda x: x, torch.ones(2, 4))

    def test_wrong_input_shape_names_the_shapes(self):
        with pytest.raises(InputMismatchError, match=r"do not fit the model.*\(8, 5\)"):
            ex.capture(nn.Linear(4, 2), torch.ones(8, 5))

    def test_wrong_target_shape_names_all_shapes(self):
        with pytest.raises(InputMismatchError, match=r"\(8, 4\), \(3,\)"):
            ex.capture(nn.Linear(4, 2), torch.ones(8, 4), nn.functional.cross_entropy,
                       torch.zeros(3, dtype=torch.long))

    def test_non_tensor_input(self):
        with pytest.raises(InputMismatchError, match=r"example_inputs\[1\] is a list, not a"):
            ex.capture(nn.Linear(4, 2), (torch.ones(8, 4), [1, 2]))

    def test_non_tensor_target(self):
        with pytest.raises(InputMismatchError, match=r"targets\[0\] is a int"):
            ex.capture(nn.Linear(4, 2), torch.ones(8, 4), targets=3)

    def test_scalar_input(self):
        with pytest.raises(InputMismatchError, match="scalar: it needs a batch dimension"):
            ex.capture(nn.Linear(4, 2), torch.tensor(1.0))

    def test_no_input(self):
        with pytest.raises(InputMismatchError, match="example_inputs is empty"):
            ex.capture(nn.Linear(4, 2), ())

    def test_loss_that_is_not_a_scalar(self):
        with pytest.raises(InputMismatchError,
                           match=r"loss must be a single number.*Tensor of shape \(8, 2\)"):
            ex.capture(nn.Linear(4, 2), torch.ones(8, 4), loss_fn=lambda out: out * 2)

    def test_loss_that_is_not_a_tensor(self):
        with pytest.raises(InputMismatchError, match="loss_fn returned float"):
            ex.capture(nn.Linear(4, 2), torch.ones(8, 4), loss_fn=lambda out: 1.0)

    def test_output_without_floats_and_no_loss(self):
        class Argmax(nn.Module):
            def forward(self, x):
                return x.argmax(dim=1)

        with pytest.raises(CaptureError, match=r"no floating-point tensor.*loss_fn"):
            ex.capture(Argmax(), torch.ones(8, 4))

    def test_export_and_fallback_both_fail(self):
        class Untrainable(nn.Module):  # data-dependent, and nothing to differentiate
            def forward(self, x):
                return x * 2 if x.sum() > 0 else x

        with pytest.raises(CaptureError,
                           match=r"could not capture Untrainable: torch.export failed.*"
                                 r"fallback failed too"):
            ex.capture(Untrainable(), torch.ones(8, 4))

    def test_every_capture_error_is_an_explorer_error(self):
        assert issubclass(CaptureError, ExplorerError)
        assert issubclass(InputMismatchError, ExplorerError)

    def test_fallback_profiles_a_training_step_of_a_model_in_eval_mode(self, tmp_path,
                                                                        monkeypatch):
        seen = []

        class Spy(nn.Module):
            def forward(self, x):
                seen.append(self.training)
                return x

        model = nn.Sequential(DataDependent(), Spy())
        model.eval()
        g = ex.capture(model, torch.randn(5, 4))
        assert g.source == "hooks" and not model.training
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        seen.clear()
        ex.profile(g, ex.Cluster.cpu(1, measure=False), repeats=1, warmup=0, progress=False)
        assert seen and all(seen)  # timed as a training step
        assert not any(m.training for m in model.modules())  # and given back as it was
        # the model's own gradients are as they were: kept, or still none
        model[0].a.weight.grad = torch.ones_like(model[0].a.weight)
        ex.profile(g, ex.Cluster.cpu(1, measure=False), repeats=1, warmup=0, progress=False,
                   cache=False)
        assert torch.equal(model[0].a.weight.grad, torch.ones_like(model[0].a.weight))
        assert model[0].b.weight.grad is None
