"""Damaged and hostile plan files: every mutation of a real plan either works or raises an
ExplorerError, through load, validate, simulate and export, and through the widget's load
(``Session.load`` of the file), each case in bounded time."""

from __future__ import annotations

import copy
import json
import random
import signal
import sys
from contextlib import contextmanager

import pytest
from builders import cluster, costs, graph

import explorer as ex
from explorer.core.errors import ExplorerError, PlanError
from explorer.core.plan import Plan
from explorer.models.synthetic import layered_dag, roofline_costs
from widgets import Session

CASE_LIMIT_S = 20  # one case: load, validate, simulate and export, then the widget's load

HOSTILE = ['x"""\nopen("/tmp/PWN","w")\n"""', "'); import os; os.system('true') #",
           "\x1b[2J", "a\nb", "\ud800", "é", "", " ", "x" * 5000, "../../etc/passwd",
           "{name}", "%(n)d", "cpu:0", "d:0", "cpu:1", "gpipe", "1f1b", "adam", "lion"]
VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 8, 1024, 1025, 10**6, 10**30, -(10**30), 1.5,
          float("nan"), float("inf"), [], {}, [1], [[]], [["cpu:0"]], {"a": 1}, [None],
          *HOSTILE]
#: a module on the test's path whose import leaves a mark: a factory a plan names must never
#: be imported by load, validate, simulate or export
PROBE = "plan_fuzz_factory_probe"
FACTORIES = [f"{PROBE}:build", f"{PROBE}:build.__call__", "os:system", "builtins:exec",
             "subprocess:run", "x:y; import os", "a:b\nimport os", "__import__('os'):x", 3,
             None, ["os:system"], {"factory": "os:system"}, "", "m:"]
#: the ``model`` record: how the plan's model is built (names, sizes, batch sizes, factories)
MODELS = [{"builtin": "mlp", "size": "tiny", "batch_size": 8},
          {"builtin": "gpt", "size": "tiny", "batch_size": 8},
          {"builtin": "mlp", "size": "huge", "batch_size": 8},
          {"builtin": "__import__('os').system('true')", "size": "tiny", "batch_size": 8},
          {"builtin": "mlp", "size": "tiny"}, {"builtin": "mlp"}, {}, [], "mlp", 8]
MODEL_VALUES = {"builtin": ["mlp", "gpt", "llama-70b", *HOSTILE], "size": ["tiny", *HOSTILE],
                "batch_size": [1, 8, 2**20, 2**20 + 1, 2**22, 2**31, 2**63, 10**30, 0, -1, 1.5,
                               float("inf"), "8", True, None, [8]],
                "factory": FACTORIES}


@contextmanager
def time_limit(seconds: float):
    """Fail a case that takes longer than ``seconds`` (a hang is a failure, not a wait)."""
    def expired(signum, frame):
        raise TimeoutError(f"a case took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Subject:
    """A graph, its cluster and costs, and plans for it made by real partitioners."""

    def __init__(self, g, cl, cm, algorithms, exportable: bool) -> None:
        self.graph, self.cluster, self.costs, self.exportable = g, cl, cm, exportable
        self.session = Session(g, cl, cm)  # the widget's state: its load reads plan files
        self.plans = []
        for name in algorithms:
            for mb in (1, 2):
                opts = {"micro_batches": mb} if "micro_batches" in \
                    ex.algorithm(name).options else {}
                try:
                    self.plans.append(ex.partition(g, cl, cm, name, **opts).to_dict())
                except ExplorerError:
                    pass
        assert self.plans


@pytest.fixture(scope="module")
def subjects() -> list[Subject]:
    bm = ex.builtin_model("mlp", "tiny")  # captured once: export needs a torch.export graph
    mlp = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="mlp")
    cpu2 = ex.Cluster.cpu(2, measure=False)
    chain = graph([("x", "input", [], 100), ("w", "param", [], 40), ("a", "op", ["x", "w"], 100),
                   ("b", "op", ["a"], 100), ("c", "op", ["b"], 4)])
    cl3 = cluster(3)
    dag = layered_dag(40, width=4, seed=1)
    cl4 = cluster(4)
    return [
        Subject(mlp, cpu2, roofline_costs(mlp, cpu2),
                ["single", "data-parallel", "even-layers", "pipeline-dp", "min-comm"], True),
        Subject(chain, cl3, costs(chain, cl3, {"a": 1.0, "b": 2.0, "c": 0.5},
                                  {"a": 2.0, "b": 4.0, "c": 1.0}),
                ["single", "data-parallel", "even-layers", "m-etf"], False),
        Subject(dag, cl4, roofline_costs(dag, cl4), ["even-layers", "m-topo", "pardnn"], False),
    ]


def _value(rng: random.Random):
    return copy.deepcopy(rng.choice(VALUES))  # a fresh copy: mutations must not share it


def _paths(x, prefix=()):
    """Every place in a JSON value, as a path of keys and indices."""
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*prefix, i))


def _set(d, path, value):
    *head, last = path
    for k in head:
        d = d[k]
    d[last] = value


def _delete(d, path):
    *head, last = path
    for k in head:
        d = d[k]
    del d[last]


def model_record(rng: random.Random):
    """A ``model`` record: a known one, or one with a field set to a hostile value (huge
    batches, code in names, factories of modules that must never be imported)."""
    record = copy.deepcopy(rng.choice(MODELS))
    if isinstance(record, dict) and rng.random() < 0.8:
        key = rng.choice(list(MODEL_VALUES))
        record[key] = copy.deepcopy(rng.choice(MODEL_VALUES[key]))
        if key == "factory" and rng.random() < 0.7:
            record = {"factory": record["factory"]}
    return record


def mutate(plan: dict, rng: random.Random) -> bytes:
    """One to three mutations of a plan's JSON: values, types, keys, or its bytes; often a
    ``model`` record first (mutated like the rest)."""
    d = copy.deepcopy(plan)
    if rng.random() < 0.4:
        d["model"] = model_record(rng)
        if rng.random() < 0.5:
            d["version"] = 2
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(d) if p]
        path = rng.choice(paths)
        how = rng.randrange(7)
        if how == 0:
            _set(d, path, _value(rng))
        elif how == 1:
            _delete(d, path)
        elif how == 2:  # a number nudged, or a value wrapped in a list
            value = _get(d, path)
            _set(d, path, value + rng.choice((-1, 1, 10**6)) if isinstance(value, int)
                 else [value])
        elif how == 3:
            parent = _get(d, path[:-1])
            if isinstance(parent, dict):
                parent[rng.choice(HOSTILE)] = _value(rng)
            else:
                parent.append(_value(rng))
        elif how == 4:  # a device or stage repeated
            d["stages"] = d.get("stages", []) * rng.randint(1, 3) \
                if isinstance(d.get("stages"), list) else d.get("stages")
        elif how == 5:
            _set(d, path, rng.choice(HOSTILE))
        else:
            d = rng.choice([d, [d], "plan", 1, None])
            break
    data = json.dumps(d, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    if rng.random() < 0.25:  # damage the bytes too
        data = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data) + 1)
            op = rng.randrange(3)
            if op == 0 and i < len(data):
                data[i] = rng.randrange(256)
            elif op == 1:
                data[i:i] = bytes([rng.randrange(256)])
            else:
                del data[i:]
        data = bytes(data)
    return data


def _get(d, path):
    for k in path:
        d = d[k]
    return d


def run_case(subject: Subject, data: bytes, out) -> str:
    """Load, validate, simulate and export one plan file; what happened, or raise."""
    try:
        plan = Plan.from_json(data)
        plan.validate(subject.graph, subject.cluster)
        ex.simulate(subject.graph, plan, subject.costs)
        if subject.exportable:
            ex.export_script(plan, out / "train.py", graph=subject.graph, costs=subject.costs,
                             overwrite=True)
            return "exported"
        return "simulated"
    except ExplorerError:
        return "refused"


def session_case(subject: Subject, data: bytes, out) -> str:
    """Load one plan file through the widget's state, as its "load file" button does."""
    path = out / "plan.json"
    path.write_bytes(data)
    before = subject.session.plan
    try:
        subject.session.load(path)
    except ExplorerError:
        assert subject.session.plan is before  # a refused file leaves the plan under edit
        return "refused"
    assert subject.session.prediction is not None
    return "loaded"


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """``PROBE``, importable: importing it records itself in ``sys.modules`` (checked after
    every case) and calling its ``build`` writes a file."""
    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / f"{PROBE}.py").write_text(
        "import pathlib\n"
        f"def build():\n    pathlib.Path({str(folder / 'called')!r}).write_text('x')\n")
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop(PROBE, None)
    yield folder
    sys.modules.pop(PROBE, None)


def fuzz(subjects, tmp_path, cases: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    for k in range(cases):
        subject = rng.choice(subjects)
        data = mutate(rng.choice(subject.plans), rng)
        try:
            with time_limit(CASE_LIMIT_S):
                what = run_case(subject, data, tmp_path)
                loaded = session_case(subject, data, tmp_path)
        except Exception as exc:  # not an ExplorerError: a bug
            raise AssertionError(f"case {k} (seed {seed}) raised {type(exc).__name__}: {exc}\n"
                                 f"plan file: {data[:2000]!r}") from exc
        imported = PROBE in sys.modules
        assert not imported, f"case {k} (seed {seed}) imported a plan's factory: {data[:500]!r}"
        if b'"model"' in data:
            seen["with a model record"] = seen.get("with a model record", 0) + 1
        seen[what] = seen.get(what, 0) + 1
        seen[f"session {loaded}"] = seen.get(f"session {loaded}", 0) + 1
    return seen


def test_the_unmutated_plans_work(subjects, tmp_path):
    for s in subjects:
        for p in s.plans:
            assert run_case(s, json.dumps(p).encode(), tmp_path) in ("exported", "simulated")
            assert session_case(s, json.dumps(p).encode(), tmp_path) == "loaded"


def test_mutated_plans_work_or_raise_explorer_errors(subjects, tmp_path, probe):
    seen = fuzz(subjects, tmp_path, 300, seed=0)
    assert seen.get("refused", 0) > 100  # most mutations are caught...
    assert seen.get("simulated", 0) + seen.get("exported", 0) > 10  # ...some are harmless
    assert seen["session refused"] > 100 and seen["session loaded"] > 10
    assert seen["with a model record"] > 60


def test_model_records_are_checked_and_factories_never_imported(subjects, tmp_path, probe):
    """Every kind of ``model`` record on a plan that is otherwise sound: one of a known
    built-in model loads and exports; a batch beyond the limit, a name with code, a factory
    (even one that imports) is refused or carried as a name, never imported."""
    mlp = subjects[0]
    seen = {}
    records = [*MODELS, *({"factory": f} for f in FACTORIES),
               *({**MODELS[0], key: v} for key, vs in MODEL_VALUES.items() for v in vs)]
    for k, record in enumerate(records):
        d = {**copy.deepcopy(mlp.plans[0]), "version": 2, "model": record}
        data = json.dumps(d).encode()
        with time_limit(CASE_LIMIT_S):
            what = run_case(mlp, data, tmp_path)
            session_case(mlp, data, tmp_path)
        imported = PROBE in sys.modules
        assert not imported, f"record {k} ({record!r}) imported a factory"
        assert not (probe / "called").exists()
        seen[what] = seen.get(what, 0) + 1
    assert seen["exported"] >= 2 and seen["refused"] > len(records) // 2
    huge = {**mlp.plans[0], "model": {**MODELS[0], "batch_size": 2**22}}
    with pytest.raises(PlanError, match=r"model\.batch_size must be a whole number"):
        Plan.from_json(json.dumps(huge))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_many_mutated_plans(subjects, tmp_path, seed, probe):
    fuzz(subjects, tmp_path, 5000, seed=seed)
