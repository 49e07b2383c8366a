"""The README stays a short user's guide whose set-up commands are the ones CI runs, and the
measured tables in docs/ are what benchmarks/results/ renders."""

from __future__ import annotations

import datetime
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
MAX_README_LINES = 250


@pytest.fixture(scope="module")
def report():
    """benchmarks/report.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def setup_command(after: str) -> str:
    """The indented command of the README paragraph that starts with ``after``."""
    text = README.read_text()
    m = re.search(rf"^{re.escape(after)}[^\n]*\n\n((?:    .*\n)+)", text, re.M)
    assert m, f"README should have an indented command after '{after}'"
    lines = [line.strip() for line in m.group(1).splitlines()]
    assert len(lines) == 1, f"one command after '{after}', found {lines}"
    return lines[0]


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines (at most {MAX_README_LINES}): move measurements and details "
        "to docs/")


def test_readme_test_command_is_what_ci_runs():
    install, _, run = setup_command("Run the tests").partition(" && ")
    assert run == "python -m pytest", f"README's test command should end in python -m pytest: {run}"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert run in ci, ".ci/run should run README's test command, python -m pytest"
    wanted = shlex.split(install)[2:]  # after "pip install"
    installs = [shlex.split(line) for line in ci if re.search(r"\bpip install\b", line)]
    assert any(all(w in args for w in wanted) for args in installs), (
        f".ci/run should install what README's test command installs: {' '.join(wanted)}")


def test_readme_main_command_plans_a_builtin_model_on_cpu_ranks():
    import explorer as ex

    install, _, run = setup_command("Run the main job").partition(" && ")
    assert shlex.split(install)[:2] == ["pip", "install"]
    args = shlex.split(run)
    assert args[:2] == ["explorer", "plan"], run
    assert args[args.index("--model") + 1] in ex.model_names()
    assert args[args.index("--devices") + 1].startswith("cpu:"), "the main job needs no GPU"


def test_readme_links_to_files_that_exist():
    for target in re.findall(r"\]\(((?!https?:)[^)#\s]+)", README.read_text()):
        assert (ROOT / target).exists(), f"README links to {target}, which is missing"


def test_every_result_record_has_date_machine_command_rows():
    paths = sorted(RESULTS.glob("*.json"))
    assert paths, "benchmarks/results/ holds no records"
    for path in paths:
        rec = json.loads(path.read_text())
        for field in ("date", "machine", "command", "rows"):
            assert field in rec, f"{path.name} has no {field}"
        datetime.date.fromisoformat(rec["date"])
        assert rec["machine"] and rec["command"].startswith("python benchmarks/"), path.name
        assert rec["rows"] and all(isinstance(r, dict) for r in rec["rows"]), (
            f"{path.name}: rows should be a non-empty list of objects")


def test_docs_tables_are_what_the_records_render(report):
    assert report.main(["--check"]) == 0, (
        "docs/ tables differ from benchmarks/results: run python benchmarks/report.py")


def test_render_keeps_prose_and_filters_rows(report):
    rec = {"title": "T", "date": "2026-01-01", "machine": "m", "command": "python benchmarks/x.py",
           "rows": [{"a": "1", "b": "x|y"}, {"a": "2", "b": "z"}]}
    doc = "before\n<!-- table:x a=2 -->\nold\n<!-- /table -->\nafter\n"
    out = report.rendered(doc, {"x": rec}, "doc.md")
    assert out.startswith("before\n<!-- table:x a=2 -->\n") and out.endswith(
        "<!-- /table -->\nafter\n")
    assert "| 2 | z |" in out and "| 1 |" not in out and "old" not in out
    assert report.rendered(out, {"x": rec}, "doc.md") == out
    assert "x\\|y" in report.render(rec)
