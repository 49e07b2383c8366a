"""The additive memory estimate under memory settings, against hand-computed sums."""

from __future__ import annotations

from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import StageSettings
from explorer.costs.memory import node_memory_bytes, stage_memory_bytes


def chain() -> OpGraph:
    """x -> mm (weight w 400 B, saves x) -> relu (saves its output, 8 B of extras) -> loss."""
    return OpGraph("c", [
        OpNode("x", "input", "input", out_bytes=80),
        OpNode("w", "param", "param", "layers.0.fc", out_bytes=400, param_bytes=400,
               requires_grad=True),
        OpNode("mm", "op", "aten.mm.default", "layers.0.fc", inputs=("x", "w"), out_bytes=160,
               requires_grad=True, saves=("x",)),
        OpNode("relu", "op", "aten.relu.default", "layers.0.act", inputs=("mm",),
               out_bytes=160, requires_grad=True, saves=("relu",), saved_extra_bytes=8),
        OpNode("loss", "op", "aten.sum.default", "", inputs=("relu",), out_bytes=4,
               requires_grad=True)], 8, "export", "loss")


def test_default_settings_charge_as_before():
    g = chain()
    # w: weight + gradient + adam's 2 x state; relu: its saved output and extras
    assert node_memory_bytes(g) == [80, 400 * 4, 0, 168, 0]
    assert node_memory_bytes(g, settings=StageSettings()) == node_memory_bytes(g)


def test_zero_divides_state_gradients_and_weights_by_the_replicas():
    g = chain()
    for zero, w in ((1, 400 + 400 + 2 * 200), (2, 400 + 200 + 2 * 200), (3, 200 * 4)):
        assert node_memory_bytes(g, settings=StageSettings(zero=zero), replicas=2)[1] == w
    assert node_memory_bytes(g, settings=StageSettings(zero=3), replicas=1)[1] == 1600


def test_recomputation_drops_what_it_recomputes():
    g = chain()
    # relu's output is recomputed; its 8 B of extras are kept from the forward, as the
    # runtime keeps them
    assert node_memory_bytes(g, settings=StageSettings(recompute="selective"))[3] == 8
    assert node_memory_bytes(g, settings=StageSettings(recompute="full"))[3] == 8
    # the input is a unit input: kept
    assert node_memory_bytes(g, settings=StageSettings(recompute="full"))[0] == 80


def test_half_precision_halves_autocast_outputs():
    g = chain()
    assert node_memory_bytes(g, settings=StageSettings(precision="bf16"))[3] == 80 + 8


def test_stages_each_under_their_settings():
    g = chain()
    stage_of = [0, 0, 0, 1, 1]
    got = stage_memory_bytes(g, stage_of, 2, settings=[StageSettings(zero=3),
                                                       StageSettings(recompute="full")],
                             replicas=[2, 1])
    assert got == [80 + 800, 8]  # (relu's extras: kept under recomputation)


def test_recomputation_keeps_what_it_recomputes_from():
    g = chain()
    # selective: relu's output is recomputed from mm's, which nothing saves otherwise: kept
    assert node_memory_bytes(g, settings=StageSettings(recompute="selective"))[2] == 160
    # full: mm is recomputed too, from x (charged as the batch already)
    assert node_memory_bytes(g, settings=StageSettings(recompute="full"))[2] == 0


def test_half_precision_charges_the_copies_matmuls_save():
    g = chain()
    # mm saves autocast's 2-byte copy of x (80 B in fp32)
    assert node_memory_bytes(g, settings=StageSettings(precision="bf16"))[2] == 40
