"""The command line's --tensor on a plan whose stage it splits nothing of: the plan's first
note (the plan table's notes column) says so and why."""

from __future__ import annotations

import torch
from torch import nn

import explorer as ex
from explorer.cli.splits import split_options


def test_tensor_that_splits_nothing_is_the_plans_first_note():
    torch.manual_seed(0)  # (a norm between the linears: no pair splits)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    graph = ex.capture(model, torch.randn(4, 8), nn.functional.cross_entropy,
                       torch.randint(0, 4, (4,)))
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1")], {n.name: 0 for n in graph.ops})
    plan = plan.with_settings(notes=("chosen by hand",))
    noted = split_options(plan, 2, None, graph)
    assert noted.notes[0].startswith("tensor 2 on stage 0 splits nothing: none of its 2 "
                                     "linears, convolutions or embeddings has a layout")
    assert noted.notes[1:] == ("chosen by hand",)
    assert split_options(plan, 2, None).notes == ("chosen by hand",)  # (no graph: no note)


def test_sequence_parallel_that_splits_nothing_is_noted():
    """A pair of linears on (batch, features) rows splits, but has no sequence to split."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    graph = ex.capture(model, torch.randn(4, 8), nn.functional.cross_entropy,
                       torch.randint(0, 4, (4,)))
    plan = ex.Plan.from_assignment(graph, [("cpu:0", "cpu:1")], {n.name: 0 for n in graph.ops})
    assert split_options(plan, 2, None, graph).notes == ()
    noted = split_options(plan, 2, True, graph)
    assert noted.sequence_of(0)
    assert noted.notes[0].startswith("sequence parallelism on stage 0 splits nothing along "
                                     "the sequence")
