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
from explorer.runtime.jobfiles import (
    JOB_FORMAT,
    Job,
    JobError,
    on_device,
    program_calls,
    program_parts,
    read_job,
    write_job,
)
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


def _job(graph, plan, schedule, **fields) -> Job:
    """The job of ``plan`` over ``graph``, built by name; ``fields`` replace its values."""
    rt = graph.runtime
    calls, state = program_parts(rt.program, len(rt.inputs))
    values = dict(calls=calls, state=state, plan=plan, schedule=schedule,
                  inputs=list(rt.inputs), targets=list(rt.targets), steps=2, warmup=1,
                  lr=1e-3, record=False, timeout_s=60.0,
                  device_map={d: "cpu" for d in plan.devices},
                  requires_grad=[n.requires_grad for n in graph.nodes], loss=graph.loss)
    return Job(**{**values, **fields})


def _write(folder, graph, plan, schedule):
    write_job(folder, _job(graph, plan, schedule))


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


class TestAnEditedFolderIsRefused:
    """What a rank reads is checked before it computes: plan.json must be the plan the
    program was exported for, and every value of job.json must be in range."""

    @pytest.fixture
    def folder(self, pipeline, tmp_path):
        graph, plan, costs = pipeline
        _write(tmp_path, graph, plan, execution_order(graph, plan, costs))
        return tmp_path

    def _edit(self, path, **changes):
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))

    def test_a_plan_of_another_graph(self, folder):
        plan = json.loads((folder / "plan.json").read_text())
        self._edit(folder / "plan.json", graph={**plan["graph"], "fingerprint": "0123abcd"})
        with pytest.raises(JobError, match=r"plan.json is a plan for graph 0123abcd, but "
                                           r".*program.pt holds the program of graph "):
            read_job(folder)

    def test_an_op_moved_to_the_other_stage(self, pipeline, folder):
        graph, plan, _ = pipeline
        op = next(n.name for n in graph.nodes if n.kind == "op" and plan.placement[n.name] == 0)
        self._edit(folder / "plan.json", placement={**plan.placement, op: 1})
        with pytest.raises(JobError, match=rf"not the plan this job was exported with \(node "
                                           rf"'{op}' is on stage 1 instead of 0\)"):
            read_job(folder)

    def test_another_setting_of_the_plan(self, folder):
        self._edit(folder / "plan.json", micro_batches=4)
        with pytest.raises(JobError, match=r"\(its micro_batches changed\)"):
            read_job(folder)

    def test_a_schedule_of_another_plan(self, pipeline, folder):
        """A job.json whose schedule runs a node on a stage the plan does not place it on
        (the ranks would wait on each other until the time limit) is refused."""
        graph, plan, costs = pipeline
        schedule = execution_order(graph, plan, costs)
        self._edit(folder / "job.json", schedule=schedule_to_json(schedule[::-1]))
        with pytest.raises(JobError, match=r"the schedule runs node '.*' on stage 0, but "
                                           r"plan.json places it on stage 1"):
            read_job(folder)

    @pytest.mark.parametrize(("field", "value", "words"), [
        ("lr", "0.001", "field 'lr' is '0.001', but it must be a finite number > 0"),
        ("lr", float("nan"), "field 'lr' is nan, but it must be a finite number > 0"),
        ("timeout_s", float("inf"), "field 'timeout_s' is inf"),
        ("steps", 0, "field 'steps' is 0, but it must be a whole number from 1"),
        ("steps", True, "field 'steps' is True"),
        ("warmup", 2.5, "field 'warmup' is 2.5"),
        ("record", "no", "field 'record' is 'no', but it must be true or false"),
        ("seed", -1, "field 'seed' is -1"),
        ("device_map", {"cpu:0": "cpu"}, "field 'device_map' .* each of the plan's devices"),
        ("device_map", {"cpu:0": "cpu", "cpu:1": "tpu"}, "field 'device_map'"),
        ("requires_grad", [True], "field 'requires_grad' is \\[True\\], but it must be one "
                                  "true or false per node"),
        ("loss", "no_such_node", "field 'loss' is 'no_such_node', but it must be the name"),
        ("units", ["a"], "field 'units'"),
        ("placements", {"w": 0}, "field 'placements'"),
        ("split_ops", "linear", "field 'split_ops'"),
        ("model", {"builtin": "nope", "size": "tiny", "batch_size": 8},
         "field 'model' names built-in model 'nope'; known models: .*mlp"),
        ("model", {"builtin": "mlp", "size": "huge", "batch_size": 8},
         "field 'model' names size 'huge' of mlp; known sizes: tiny, small"),
        ("model", {"factory": "os.system"}, "field 'model' names factory 'os.system', not"),
    ])
    def test_a_value_out_of_range_names_its_field(self, folder, field, value, words):
        self._edit(folder / "job.json", **{field: value})
        with pytest.raises(JobError, match=rf"job.json: {words}"):
            read_job(folder)

    def test_a_missing_field_or_damaged_file(self, folder):
        meta = json.loads((folder / "job.json").read_text())
        del meta["steps"]
        (folder / "job.json").write_text(json.dumps(meta))
        with pytest.raises(JobError, match=r"job\.json has no field 'steps'"):
            read_job(folder)
        (folder / "job.json").write_text("{not json")
        with pytest.raises(JobError, match=r"job\.json is not JSON"):
            read_job(folder)

    def test_a_job_out_of_range_is_not_written(self, pipeline, tmp_path):
        graph, plan, costs = pipeline
        job = _job(graph, plan, execution_order(graph, plan, costs), lr=float("nan"))
        with pytest.raises(JobError, match="cannot write this job: field 'lr' is nan"):
            write_job(tmp_path / "job", job)
        assert not (tmp_path / "job").exists()

    def test_the_job_read_is_the_job_written(self, pipeline, tmp_path):
        graph, plan, costs = pipeline
        job = _job(graph, plan, execution_order(graph, plan, costs), seed=3,
                   units=["u"] * len(graph.nodes), placements={"w": "Shard(0)"})
        write_job(tmp_path, job)
        back = read_job(tmp_path)
        for name in ("steps", "warmup", "lr", "record", "timeout_s", "device_map",
                     "requires_grad", "loss", "seed", "units", "kept_outputs", "placements",
                     "split_ops", "local_ops", "sequence_ops", "model", "schedule"):
            assert getattr(back, name) == getattr(job, name), name
        assert back.plan == plan and back.calls == job.calls


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
