"""Model factories that exported-script tests name as "module:function" (this folder is on
the ranks' PYTHONPATH)."""

from __future__ import annotations

import torch
from torch import nn

import explorer as ex

NOT_CALLABLE = 42


def tiny_gpt():
    """The built-in tiny GPT with its example batch (what the command line needs)."""
    return ex.builtin_model("gpt", "tiny")


def mlp_module() -> nn.Module:
    """A small MLP, the same weights on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mlp_on_meta() -> nn.Module:
    """The same MLP with its parameters on the meta device: ranks initialise their own."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
