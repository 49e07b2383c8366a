"""Tensor parallelism in the explorer: split edits, what each node shows, the degrees of plans."""

from __future__ import annotations

import pytest
from builders import tiny_builtin_graph

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.models.synthetic import roofline_costs
from widgets import Explorer, Session
from widgets.edits import split_targets
from widgets.panels.stages import tensor_degrees
from widgets.splits import SplitView, degrees_text, over


@pytest.fixture(scope="module")
def gpt():
    return tiny_builtin_graph("gpt")


@pytest.fixture
def session(gpt):
    """The tiny GPT on one of four H100s, roofline costs."""
    four = ex.Cluster.preset("4xH100")
    return Session(gpt, four, roofline_costs(gpt, four))


def op_named(graph, param: str) -> int:
    """The op that reads parameter ``param``."""
    return next(i for i, n in enumerate(graph.nodes) if n.kind == "op" and param in n.inputs)


def test_split_moves_the_selection_to_a_tensor_parallel_stage_and_undo_takes_it_back(session,
                                                                                   gpt):
    blocks = session.view.names(["/m:blocks@38"])
    session.split(blocks, "H100:2+H100:3")
    plan = session.plan
    k = plan.stage_of(blocks[0])
    assert plan.stages[k] == ("H100:2", "H100:3") and plan.tensor_of(k) == 2
    assert plan.replicas_of(k) == 1 and len(plan.stages) == 2
    assert session.history[-1] == f"split {len([n for n in blocks if gpt[n].kind == 'op'])} " \
                                  "ops over H100:2+H100:3 (tensor 2)"
    assert session.prediction == ex.simulate(gpt, plan, session.costs)  # estimated at once
    session.undo()
    assert not session.plan.uses_tensor_parallel and len(session.plan.stages) == 1


def test_a_split_over_a_stage_of_the_plan_sets_its_degree_and_the_rest_keep_theirs(session):
    everything = [n.name for n in session.graph.nodes]
    session.assign(everything, "H100:0")
    session.split(everything, ["H100:0", "H100:1", "H100:2", "H100:3"], degree=2)
    plan = session.plan
    assert plan.stages == (("H100:0", "H100:1", "H100:2", "H100:3"),)
    assert (plan.replicas_of(0), plan.tensor_of(0)) == (2, 2)
    assert degrees_text(plan) == "dp 2 x tp 2 x pp 1"
    assert over(plan, 0) == "H100:0+H100:1, H100:2+H100:3 (2 replicas)"
    # the devices of a new split leave their stage; its degree falls back to what divides
    session.split(session.view.names(["/m:lm_head@95"]), "H100:3+H100:2")
    plan = session.plan
    assert plan.stages[0] == ("H100:0", "H100:1") and plan.tensor_of(0) == 2
    assert plan.stages[1] == ("H100:3", "H100:2") and plan.tensor_of(1) == 2
    # taking one device out of a split stage leaves a stage of one device, unsplit
    session.assign(session.view.names(["/m:lm_head@95"]), "H100:3")
    assert session.plan.stages[0] == ("H100:0", "H100:1")
    assert session.plan.tensor_of(session.plan.stage_of_device("H100:3")) == 1


def test_splits_the_plan_cannot_make_are_refused_with_what_to_do(session):
    names = session.view.names(["/m:blocks@38"])
    with pytest.raises(ExplorerError, match="does not divide the 2 devices"):
        session.split(names, "H100:0+H100:1", degree=4)
    with pytest.raises(ExplorerError, match="degree of 2 or more"):
        session.split(names, "H100:0", degree=1)
    with pytest.raises(ExplorerError, match="twice"):
        session.split(names, "H100:0+H100:0")
    with pytest.raises(ExplorerError, match="select one or more nodes"):
        session.split([], "H100:0+H100:1")
    session.set_memory(zero=1)
    session.split(names, "H100:2+H100:3")  # predicted; real steps refused, said why
    assert session.plan.uses_tensor_parallel and session.plan.uses_memory_strategies
    assert "do not run yet" in session.run_problem
    session.undo()
    session.undo()
    with pytest.raises(ExplorerError, match="does not divide"):
        session.set_memory(tensor=2)  # one device in the stage
    assert split_targets(session.plan, session.cluster) == [
        "H100:0+H100:1", "H100:2+H100:3", "H100:0+H100:1+H100:2+H100:3"]
    assert tensor_degrees(4) == [1, 2, 4] and tensor_degrees(6) == [1, 2, 4, 6]


def test_each_node_says_its_part_in_the_split(session, gpt):
    view = SplitView(gpt)
    plan = session.plan
    assert view.of(plan, [op_named(gpt, "blocks.0.mlp.fc.weight")]).text == ""
    session.split([n.name for n in gpt.nodes], "H100:0+H100:1")
    plan = session.plan
    fc = view.of(plan, [op_named(gpt, "blocks.0.mlp.fc.weight")])
    assert (fc.role, fc.mark) == ("column-parallel", "col")
    assert fc.text == "column-parallel over H100:0+H100:1, weight Shard(0)"
    proj = view.of(plan, [op_named(gpt, "blocks.0.mlp.proj.weight")])
    assert proj.text == "row-parallel over H100:0+H100:1, weight Shard(1)"
    emb = view.of(plan, [op_named(gpt, "tok_emb.weight")])
    assert emb.text == "vocab-parallel over H100:0+H100:1, weight Shard(0)"
    qkv = view.of(plan, [op_named(gpt, "blocks.0.attn.qkv.weight")])
    assert qkv.text == ("column-parallel over H100:0+H100:1, weight "
                        "_StridedShard(dim=0, sf=3)")
    norm = view.of(plan, [op_named(gpt, "blocks.0.ln1.weight")])
    assert norm.mark == "rep" and norm.text.startswith("replicated: each of H100:0+H100:1")
    mlp = view.of(plan, [i for i, n in enumerate(gpt.nodes) if n.kind == "op"
                         and n.module_path.startswith("blocks.0.mlp")])
    assert mlp.mark == "tp2" and "1 column-parallel" in mlp.role and "1 row-parallel" in mlp.role
    assert mlp.text.endswith("over H100:0+H100:1")


def test_the_widget_shows_splits_and_the_table_shows_degrees(gpt):
    pytest.importorskip("jupyter_bokeh")
    from widgets import Explorer

    cl = ex.Cluster.preset("4xH100")
    w = Explorer(gpt, roofline_costs(gpt, cl), ex.Plan.single(gpt, cl.ids[0]))
    assert w.editing.split_over.options[0] == "H100:0+H100:1"
    w.select(["/m:blocks@38"])
    w.split("H100:2+H100:3")
    data = w.graph.nodes.data
    k = data["key"].index("/m:blocks@38")
    assert data["hatch"][k] == "|" and data["short"][k].endswith("[tp2]")
    assert "column-parallel" in data["split"][k] and data["split"][0] == "none"
    assert w.editing.split_over.options[0] == "H100:2+H100:3"  # the new stage first
    w.stages.stage.value = w.session.plan.stage_of(w.session.view.names(["/m:blocks@38"])[0])
    assert w.stages.tensor.value == 2 and "1 x 2" in w.stages.table.value
    w.stages.zero.value = 1  # predicted; the estimate says real steps cannot run yet
    assert w.session.plan.settings_of(w.stages.stage.value).zero == 1
    assert "do not run yet" in w.estimate.table.value
    w.editing.undo_button.click()
    assert w.stages.zero.value == 0
    stage = w.stages.stage.value
    assert not w.stages.sequence.value and not w.stages.sequence.disabled
    before = w.session.prediction.memory["H100:2"].activations_bytes
    w.stages.sequence.value = True  # norms and residual adds split along the sequence
    assert w.session.plan.sequence_of(stage) and "1 x 2 (sequence)" in w.stages.table.value
    assert w.session.prediction.memory["H100:2"].activations_bytes < before
    assert w.stages.async_tensor.disabled is False and not w.stages.async_tensor.value
    sequential_s = w.session.prediction.step_s
    w.stages.async_tensor.value = True  # its collectives beside the matmuls (GPUs)
    assert w.session.plan.settings_of(stage).async_tensor
    assert "1 x 2 (sequence, async)" in w.stages.table.value
    assert w.session.prediction.step_s < sequential_s
    w.session.undo()
    w.session.undo()
    assert not w.session.plan.sequence_of(stage) and not w.stages.sequence.value
    assert w.stages.async_tensor.disabled and not w.stages.async_tensor.value
    w.session.keep("split")
    assert "dp 1 x tp 2 x pp 2" in w.plans.table.value


def test_split_convolutions_say_column_and_row_parallel():
    alexnet = tiny_builtin_graph("alexnet")
    ops = {n.name: 0 for n in alexnet.nodes if n.kind == "op"}
    plan = ex.Plan.from_assignment(alexnet, [("cpu:0", "cpu:1")], ops).with_tensor(2)
    view = SplitView(alexnet)
    assert view.of(plan, [op_named(alexnet, "features.6.weight")]).role == "column-parallel"
    assert view.of(plan, [op_named(alexnet, "features.8.weight")]).role == "row-parallel"
    assert view.of(plan, [op_named(alexnet, "features.0.weight")]).role == "replicated"


def test_context_parallel_degree_splits_samples_and_is_predicted_only(gpt):
    """A stage of two replicas whose samples the context degree splits by sequence: the
    table and the degrees read it, attention's ring adds to the step on GPUs, and the
    estimate says real steps do not run it."""
    llama, cl = tiny_builtin_graph("llama"), ex.Cluster.preset("2xH100")
    costs = roofline_costs(llama, cl)
    w = Explorer(llama, costs, ex.partition(llama, cl, costs, "data-parallel"))
    replicated_s = w.session.prediction.step_s
    assert w.stages.context.value == 1
    w.stages.context.value = 2
    assert w.session.plan.context_of(0) == 2
    assert "1 x 2 x 1" in w.stages.table.value
    assert "dp 1 x cp 2 x tp 1 x pp 1" in w.stages.table.value
    assert w.session.prediction.step_s > replicated_s
    assert "context-parallel stages do not run yet" in w.estimate.table.value
    w.session.undo()
    assert w.stages.context.value == 1 and w.session.plan.context_of(0) == 1
    # a stage edited down to devices the degree no longer divides falls back to whole samples
    w.stages.context.value = 2
    w.session.assign([n.name for n in llama.nodes if n.kind == "op"][-3:], "H100:1")
    assert [w.session.plan.context_of(s) for s in range(len(w.session.plan.stages))] == [1, 1]
    w.session.undo()
    w.session.undo()
    # the tiny GPT writes its attention out of matmuls: no ring to split it by
    gpt_w = Explorer(gpt, roofline_costs(gpt, cl), ex.partition(gpt, cl, roofline_costs(gpt, cl),
                                                              "data-parallel"))
    gpt_w.stages.context.value = 2
    assert gpt_w.session.plan.context_of(0) == 1 and gpt_w.stages.context.value == 1
    assert "F.scaled_dot_product_attention" in gpt_w.session.message
    assert gpt_w.session.message_where == "settings"
