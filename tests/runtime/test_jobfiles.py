"""The schedule as data and the job folder: typed actions, versioned JSON, older folders read."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from torch.utils._pytree import tree_flatten

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.schedule import (
    KINDS,
    OPTIMIZER,
    SCHEDULE_FORMAT,
    Action,
    schedule_from_json,
    schedule_to_json,
)
from explorer.models.synthetic import roofline_costs
from explorer.runtime.jobfiles import JOB_FORMAT, on_device, program_calls, read_job, write_job
from explorer.simulate.simulator import execution_order


@pytest.fixture(scope="module")
def pipeline():
    bm = ex.builtin_model("mlp", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="mlp")
    cluster = ex.Cluster.cpu(2, measure=False)
    costs = roofline_costs(graph, cluster)
    plan = ex.partition(graph, cluster, costs, "even-layers", micro_batches=2,
                        schedule="1f1b")
    return graph, plan, costs


def _write(folder, graph, plan, schedule):
    rt = graph.runtime
    write_job(folder, rt.program, plan, schedule, rt.inputs, rt.targets, 2, 1, 1e-3, False,
              60.0, {d: "cpu" for d in plan.devices}, [n.requires_grad for n in graph.nodes],
              graph.loss)


class TestSchedule:
    def test_execution_order_is_typed_actions(self, pipeline):
        graph, plan, costs = pipeline
        schedule = execution_order(graph, plan, costs)
        assert len(schedule) == len(plan.stages)
        for s, actions in enumerate(schedule):
            assert all(type(a) is Action and a.kind in KINDS for a in actions)
            assert actions[-1] == Action.optimizer_step()
            ops = {a.node for a in actions if a.kind != OPTIMIZER}
            assert all(plan.placement[graph.nodes[i].name] == s for i in ops)
            # every forward of the stage runs once per micro-batch, before its backward
            fwd = [a for a in actions if a.kind == "fwd"]
            assert len(fwd) == len(ops) * plan.micro_batches
            for a in actions:
                if a.kind == "bwd":
                    assert actions.index(Action("fwd", a.micro_batch, a.node)) < \
                        actions.index(a)

    def test_an_action_unpacks_and_equals_its_tuple(self):
        a = Action("bwd", 1, 7)
        kind, micro_batch, node = a
        assert (kind, micro_batch, node) == ("bwd", 1, 7) == a
        assert (a.kind, a.micro_batch, a.node) == ("bwd", 1, 7)

    def test_json_round_trip(self, pipeline):
        schedule = execution_order(*pipeline)
        data = json.loads(json.dumps(schedule_to_json(schedule)))
        assert data["format"] == SCHEDULE_FORMAT
        assert data["stages"][0][0] == {"kind": "fwd", "micro_batch": 0,
                                        "node": schedule[0][0].node}
        back = schedule_from_json(data)
        assert back == schedule and all(type(a) is Action for st in back for a in st)

    def test_the_unversioned_form_is_read(self):
        assert schedule_from_json([[["fwd", 0, 3], ["optimizer", -1, -1]], []]) == \
            [[Action("fwd", 0, 3), Action.optimizer_step()], []]

    def test_another_format_is_refused(self):
        with pytest.raises(ExplorerError, match=r"format 99.*export the plan again"):
            schedule_from_json({"format": 99, "stages": []})

    def test_an_unknown_action_is_refused(self):
        with pytest.raises(ExplorerError, match="unknown action 'recompute'"):
            schedule_from_json([[["recompute", 0, 3]]])


class TestJobFolder:
    def test_round_trip(self, pipeline, tmp_path):
        graph, plan, costs = pipeline
        schedule = execution_order(graph, plan, costs)
        _write(tmp_path, graph, plan, schedule)
        meta = json.loads((tmp_path / "job.json").read_text())
        assert meta["format"] == JOB_FORMAT and "order" not in meta
        job = read_job(tmp_path)
        assert job.schedule == schedule
        assert job.plan.placement == plan.placement
        assert [c.name for c in job.calls] == [n.name for n in graph.nodes]

    def test_a_folder_from_before_versioning_is_read(self, pipeline, tmp_path):
        """An exported script's folder from before: the schedule as bare lists under "order",
        and the program's node references pickled under their former module."""
        graph, plan, costs = pipeline
        schedule = execution_order(graph, plan, costs)
        _write(tmp_path / "new", graph, plan, schedule)
        _write(tmp_path / "old", graph, plan, schedule)
        old = tmp_path / "old"
        meta = json.loads((old / "job.json").read_text())
        del meta["format"], meta["schedule"]
        meta["order"] = [[list(a) for a in st] for st in schedule]
        (old / "job.json").write_text(json.dumps(meta))
        _rename_class(old / "program.pt", b"explorer.runtime.jobfiles\nRef\n",
                      b"explorer.runtime.worker\n_Ref\n")
        got, want = read_job(old), read_job(tmp_path / "new")
        assert got.schedule == want.schedule
        assert got.calls == want.calls

    def test_a_newer_folder_is_refused(self, pipeline, tmp_path):
        graph, plan, costs = pipeline
        _write(tmp_path, graph, plan, execution_order(graph, plan, costs))
        meta = json.loads((tmp_path / "job.json").read_text())
        meta["format"] = JOB_FORMAT + 1
        (tmp_path / "job.json").write_text(json.dumps(meta))
        with pytest.raises(ExplorerError, match=rf"has format {JOB_FORMAT + 1}.*ex\.export_script"):
            read_job(tmp_path)


def test_a_programs_device_constants_follow_the_rank():
    """GPT's positions come from ``arange(device=cpu)`` at capture: on a GPU rank the constant
    must be made on the GPU, or the embedding lookup mixes devices."""
    bm = ex.builtin_model("gpt", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets)
    calls, _ = program_calls(graph.runtime.program, len(graph.runtime.inputs))
    meta = torch.device("meta")

    def devices(x):
        return [v for v in tree_flatten(x)[0] if isinstance(v, torch.device)]

    before = [d for c in calls for d in devices((c.args, c.kwargs))]
    after = [d for c in calls for d in devices(on_device((c.args, c.kwargs), meta))]
    assert before and all(d.type == "cpu" for d in before)
    assert len(after) == len(before) and all(d == meta for d in after)


def _rename_class(path, old: bytes, new: bytes) -> None:
    """Rewrite a torch.save file as if a class had been pickled under another name."""
    with zipfile.ZipFile(path) as z:
        entries = [(n, z.read(n)) for n in z.namelist()]
    assert any(old in data for n, data in entries if n.endswith("data.pkl"))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, data in entries:
            z.writestr(n, data.replace(old, new) if n.endswith("data.pkl") else data)
