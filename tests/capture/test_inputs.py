"""Capture and the caller's batch: inputs a model changes in place, and who is to blame when
the trial run fails (inputs that do not fit, or the model's own code)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import explorer as ex
from explorer.core.errors import CaptureError, InputMismatchError


class InPlace(nn.Module):
    """Changes its input in place before using it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        x.add_(2) if self.how == "add" else x.mul_(3)
        return self.lin(x)


class InPlaceUntraceable(InPlace):
    """Also branches on a value, so torch.export fails and forward hooks capture it."""

    def forward(self, x):
        x.mul_(3)
        h = self.lin(x)
        return torch.relu(h) if h.sum() > 0 else h


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin(x)
        raise RuntimeError("boom")
        return h


class DeepShapeError(nn.Module):
    """Its second layer does not fit its first: the inputs are fine."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(5, 2)

    def forward(self, x):
        return self.b(self.a(x))


class TestInputsAreNotChanged:
    @pytest.mark.parametrize("how", ["add", "mul"])
    def test_real_capture_keeps_the_callers_tensor_and_the_original_batch(self, how):
        x = torch.ones(8, 4)
        g = ex.capture(InPlace(how), x)
        assert g.source == "export"
        assert torch.equal(x, torch.ones(8, 4))
        (stored,) = g.runtime.inputs
        assert stored is not x and torch.equal(stored, torch.ones(8, 4))

    def test_fallback_capture_keeps_them_too(self):
        x = torch.ones(5, 4)
        g = ex.capture(InPlaceUntraceable("mul"), x)
        assert g.source == "hooks"
        assert torch.equal(x, torch.ones(5, 4))
        assert torch.equal(g.runtime.inputs[0], torch.ones(5, 4))

    def test_fake_capture_keeps_the_callers_tensor(self):
        x = torch.ones(8, 4)
        g = ex.capture(InPlace("mul"), x, fake=True)
        assert g.runtime is None
        assert torch.equal(x, torch.ones(8, 4))

    def test_the_graph_still_runs_on_the_original_values(self):
        x = torch.ones(8, 4)
        model = InPlace("mul")
        g = ex.capture(model, x)
        with torch.no_grad():
            expected = model.lin(torch.full((8, 4), 3.0)).mean()
        assert torch.allclose(g.runtime.values()[g.loss], expected)

    def test_targets_are_copies_too(self):
        def loss_fn(out, y):
            y.mul_(10)
            return ((out - y) ** 2).mean()

        y = torch.ones(8, 2)
        g = ex.capture(nn.Linear(4, 2), torch.ones(8, 4), loss_fn, y)
        assert torch.equal(y, torch.ones(8, 2))
        assert torch.equal(g.runtime.targets[0], torch.ones(8, 2))


@pytest.mark.parametrize("fake", [False, True])
class TestWhoIsToBlame:
    @pytest.mark.parametrize(("model", "words"), [
        (Boom, r"forward raised RuntimeError: boom at test_inputs\.py:\d+ "
               r"\(raise RuntimeError\(\"boom\"\)\)"),
        (DeepShapeError, r"forward raised RuntimeError: .* test_inputs\.py:\d+ "
                         r".*self\.b\(self\.a\(x\)\).*model's own code"),
    ])
    def test_an_error_in_the_models_code_is_the_models_with_its_line(self, fake, model,
                                                                       words):
        with pytest.raises(CaptureError, match=words) as err:
            ex.capture(model(), torch.ones(8, 4), fake=fake)
        assert not isinstance(err.value, InputMismatchError)

    def test_a_wrong_shape_at_the_first_layer_is_the_inputs(self, fake):
        with pytest.raises(InputMismatchError, match=r"do not fit the model.*\(8, 5\)"):
            ex.capture(DeepShapeError(), torch.ones(8, 5), fake=fake)

    def test_a_view_of_the_input_counts_as_the_input(self, fake):
        class Flatten(DeepShapeError):
            def forward(self, x):
                return self.a(x.flatten(1))

        with pytest.raises(InputMismatchError, match=r"do not fit the model.*\(8, 2, 3\)"):
            ex.capture(Flatten(), torch.ones(8, 2, 3), fake=fake)

    def test_too_many_inputs(self, fake):
        with pytest.raises(InputMismatchError,
                           match=r"forward, given 2 example input\(s\), cannot take 2 .*\(x\)"):
            ex.capture(DeepShapeError(), (torch.ones(8, 4), torch.ones(8, 4)), fake=fake)

    def test_too_few_targets_for_the_loss(self, fake):
        with pytest.raises(InputMismatchError, match=r"loss_fn.*with 0 target\(s\)"):
            ex.capture(nn.Linear(4, 2), torch.ones(8, 4), lambda out, y: (out - y).mean(),
                       fake=fake)


def test_a_wrong_dtype_at_the_first_layer_is_the_inputs():
    with pytest.raises(InputMismatchError, match=r"do not fit the model.*dtype"):
        ex.capture(DeepShapeError(), torch.ones(8, 4, dtype=torch.long))
