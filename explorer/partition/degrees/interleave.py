"""Virtual pipeline stages for the degrees search: its best pipeline re-cut into more, smaller
chunks that go round the same stages in turn, run under interleaved 1F1B (Megatron-LM's
interleaved schedule), which shortens the pipeline's fill and drain by the chunks per stage."""

from __future__ import annotations

from collections.abc import Sequence

from explorer.core.graph import OpGraph
from explorer.core.plan import INTERLEAVED, Plan
from explorer.costs.model import CostModel
from explorer.partition.options import whole_numbers
from explorer.partition.search.layers import in_turn
from explorer.simulate.simulator import Prediction, simulate

#: chunks per stage the search tries on its best pipeline by default (1: as it is)
VIRTUAL_STAGES = (1, 2, 4)
#: why the search has no plan when asked for interleaved ones only and none could be made
NOT_INTERLEAVED = ("degrees: the fastest pipeline found cannot be interleaved (one stage, "
                   "micro-batches not a multiple of the stages, fewer layers than chunks, or "
                   "ZeRO 3), or no re-cut of it fits")


def check_virtual_stages(virtual_stages: Sequence[int]) -> tuple[int, ...]:
    """The chunk counts, each a whole number 1 or more: :class:`ExplorerError` if not."""
    return whole_numbers(virtual_stages, "virtual_stages are whole numbers of chunks per "
                         "stage, 1 or more (1: one chunk, plain 1F1B)")


def interleaved(graph: OpGraph, plan: Plan, costs: CostModel,
                layers: Sequence[Sequence[int]], chunks: int) -> Plan | None:
    """``plan``'s stages (their devices and settings) with ``layers`` cut into ``chunks``
    per stage of near-equal compute, chunk ``j`` on stage ``j mod pp``, under interleaved
    1F1B; None where that cannot be: one stage, micro-batches not a multiple of the
    stages, fewer layers than chunks, or ZeRO 3."""
    pp = len(plan.stages)
    total = pp * chunks
    if (pp < 2 or plan.micro_batches % pp or len(layers) < total
            or any(plan.settings_of(s).zero == 3 for s in range(pp))):
        return None
    device = costs.device_costs(plan.stages[0][0])
    weight = [sum(device.fwd_s[i] + device.bwd_s[i] for i in layer) for layer in layers]
    assign = {i: s for layer, s in zip(layers, in_turn(weight, pp, chunks), strict=True)
              for i in layer}
    return Plan.from_assignment(
        graph, plan.stages, assign, micro_batches=plan.micro_batches, schedule=INTERLEAVED,
        optimizer=plan.optimizer, algorithm=plan.algorithm,
        options={**plan.options, "schedule": INTERLEAVED, "virtual_stages": chunks},
        notes=plan.notes, stage_settings=plan.stage_settings)


def best_interleaved(graph: OpGraph, costs: CostModel, layers: Sequence[Sequence[int]],
                     best: tuple[Plan, Prediction], virtual_stages: Sequence[int],
                     only_interleaved: bool = False,
                     deepest: bool = False) -> tuple[Plan, Prediction] | None:
    """``best`` (a 1F1B pipeline) or its interleaved re-cut with each of ``virtual_stages``
    chunks per stage (``deepest``: and with one layer a chunk, as many as the layers allow),
    whichever the simulator finds fastest and fitting (a note says what interleaving
    changed); with ``only_interleaved`` one of the re-cuts, or None."""
    plan, pred = best
    if plan.schedule != "1f1b":
        return None if only_interleaved else best
    chosen: tuple[Plan, Prediction] | None = None if only_interleaved else best
    most = len(layers) // len(plan.stages)
    for v in sorted((set(virtual_stages) | ({most} if deepest else set())) - {1}):
        other = interleaved(graph, plan, costs, layers, v)
        if other is None:
            continue
        other_pred = simulate(graph, other, costs)
        if other_pred.fits and (chosen is None
                                or other_pred.step_s < chosen[1].step_s * (1 - 1e-9)):
            chosen = other, other_pred
    if chosen is None or chosen[0] is plan:
        return chosen
    v = chosen[0].options["virtual_stages"]
    note = (f"degrees: {v} chunks of layers per stage under interleaved 1F1B: "
            f"{chosen[1].step_s:.4g} s per step, against {pred.step_s:.4g} s with one "
            "(1F1B)")
    return chosen[0].with_settings(notes=(*chosen[0].notes, note)), chosen[1]
