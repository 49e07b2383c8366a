"""The additive memory estimate under memory settings, against hand-computed sums."""

from __future__ import annotations

from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import StageSettings
from explorer.costs.memory import (
    node_memory_bytes,
    stage_memory_bytes,
    zero_sharded_bytes,
    zero_working_bytes,
)
from explorer.partition.pipeline_dp import replicated_bytes


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


def test_a_value_a_matmul_keeps_as_a_2_byte_copy_is_not_kept_as_it_is():
    # x -> exp (fp32 under autocast) -> mm (saves exp): under bf16 the matmul keeps
    # autocast's 2-byte copy of exp's output (80 B), not the fp32 output too; with another
    # op saving it as it is, both
    def graph(exp_saved: bool) -> OpGraph:
        return OpGraph("e", [
            OpNode("x", "input", "input", out_bytes=80),
            OpNode("w", "param", "param", out_bytes=400, param_bytes=400, requires_grad=True),
            OpNode("exp", "op", "aten.exp.default", inputs=("x",), out_bytes=160,
                   requires_grad=True, saves=("exp",) if exp_saved else ()),
            OpNode("mm", "op", "aten.mm.default", inputs=("exp", "w"), out_bytes=160,
                   requires_grad=True, saves=("exp", "w")),
            OpNode("loss", "op", "aten.sum.default", inputs=("mm",), out_bytes=4,
                   requires_grad=True)], 8, "export", "loss")

    half = StageSettings(precision="bf16")
    only_mm = node_memory_bytes(graph(False), settings=half)
    assert (only_mm[2], only_mm[3]) == (0, 80 + 200)  # (and w's copy)
    both = node_memory_bytes(graph(True), settings=half)
    assert (both[2], both[3]) == (160, 80 + 200)


def test_a_replicated_stage_holds_its_one_device_bytes_less_shards_plus_working_copies():
    # what the partitioners' tables compute for a stage of r replicas from its one-device
    # charge equals the charge on r replicas, ZeRO 1-3 in fp32 and bf16 (ZeRO 1-2 in bf16:
    # a 2-byte working copy of w, 200 B, beside the fp32 master shard)
    g = chain()
    for precision in ("fp32", "bf16"):
        for zero in (1, 2, 3):
            settings = StageSettings(zero=zero, precision=precision)
            one = node_memory_bytes(g, settings=settings, replicas=1)[1]
            sharded = zero_sharded_bytes(g, "adam", zero, precision)[1]
            working = zero_working_bytes(g, zero, precision)[1]
            assert working == (200 if precision == "bf16" and zero < 3 else 0)
            for r in (2, 4):
                assert replicated_bytes(one, sharded, working, r) == node_memory_bytes(
                    g, settings=settings, replicas=r)[1]
            assert replicated_bytes(one, sharded, working, 1) == one
