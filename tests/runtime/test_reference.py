"""``ex.reference``: plain PyTorch training on one device, the check real runs are held to."""

from __future__ import annotations

import torch

import explorer as ex


class ScalesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(3)  # in place, on what it was given
        return self.linear(x)


def test_a_model_that_changes_its_input_leaves_the_callers_batch_alone():
    x = torch.ones(8, 4)
    torch.manual_seed(0)
    ref = ex.reference(ScalesItsInput(), 2, shards=2, example_inputs=(x,))
    assert torch.equal(x, torch.ones(8, 4))
    torch.manual_seed(0)
    again = ex.reference(ScalesItsInput(), 2, shards=2, example_inputs=(x,))
    assert ref.losses == again.losses  # each step saw the same batch, not one scaled again
