"""binder/ (what mybinder builds) stays in step with pyproject.toml and CI."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
BINDER = ROOT / "binder"


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> tuple[list[str], list[Requirement]]:
    """binder/requirements.txt as (pip options, requirements)."""
    options, reqs = [], []
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        (options if line.startswith("-") else reqs).append(line)
    return options, [Requirement(r) for r in reqs]


def _commands(path: Path) -> list[str]:
    """A shell script's lines without the shebang, comments and blank lines."""
    return [ln.strip() for ln in path.read_text().splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def test_binder_has_what_repo2docker_reads():
    for name in ("requirements.txt", "runtime.txt", "postBuild"):
        assert (BINDER / name).is_file(), f"binder/{name} is missing"
    assert os.access(BINDER / "postBuild", os.X_OK), "binder/postBuild must be executable"


def test_runtime_is_a_python_the_project_supports(project):
    text = (BINDER / "runtime.txt").read_text().strip()
    m = re.fullmatch(r"python-(\d+\.\d+)", text)
    assert m, f"binder/runtime.txt should read like 'python-3.12', not {text!r}"
    assert Version(m.group(1) + ".0") in SpecifierSet(project["requires-python"]), (
        f"binder runs Python {m.group(1)}, outside requires-python "
        f"{project['requires-python']!r}")


def test_binder_installs_cpu_torch_the_project_accepts(project):
    options, reqs = _requirements()
    torch = [r for r in reqs if r.name == "torch"]
    assert len(torch) == 1, "binder/requirements.txt should pin torch once"
    pins = [s for s in torch[0].specifier if s.operator == "=="]
    assert pins, "pin torch with == in binder/requirements.txt (the CPU build, e.g. 2.13.0+cpu)"
    version = Version(pins[0].version)
    assert version.local == "cpu", "binder should install the CPU-only torch build (+cpu)"
    assert any("download.pytorch.org/whl/cpu" in o for o in options), (
        "binder/requirements.txt needs --extra-index-url https://download.pytorch.org/whl/cpu")
    wanted = [Requirement(d) for d in project["dependencies"]]
    spec = next(r.specifier for r in wanted if r.name == "torch")
    assert version in spec, f"binder's torch {version} is outside pyproject's torch{spec}"
    # every other pinned package must satisfy pyproject too
    by_name = {r.name.lower(): r.specifier for r in wanted}
    for r in reqs:
        if r.name.lower() in by_name:
            for s in r.specifier:
                if s.operator == "==":
                    assert Version(s.version) in by_name[r.name.lower()], (
                        f"binder pins {r}, outside pyproject's {r.name}{by_name[r.name.lower()]}")


def test_binder_torch_is_the_one_ci_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"torch==([0-9][0-9a-z.]*)", ci)
    if not m:
        pytest.skip(".ci/run pins no torch version")
    _, reqs = _requirements()
    pin = next(s for r in reqs if r.name == "torch" for s in r.specifier if s.operator == "==")
    assert Version(pin.version).public == Version(m.group(1)).public, (
        f"binder installs torch {pin.version} but CI tests torch {m.group(1)}")


def test_postbuild_installs_the_project_with_the_notebook_extra(project):
    cmds = _commands(BINDER / "postBuild")
    assert cmds and re.fullmatch(r"set -e\w*( .*)?", cmds[0]), \
        "binder/postBuild should start with set -e (a failed install must fail the build)"
    installs = [c for c in cmds if re.search(r"\bpip install\b", c)]
    assert any(re.search(r"-e\s+[\"']?\.\[([^\]]*\b)?notebook\b", c) for c in installs), (
        "binder/postBuild should install the project with its extra: "
        "pip install --no-cache-dir -e \".[notebook]\"")
    extra = [Requirement(r).name.lower()
             for r in project["optional-dependencies"]["notebook"]]
    assert "jupyterlab" in extra, "the notebook extra must bring JupyterLab (binder opens it)"


def test_readme_binder_link_opens_an_existing_notebook():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"https://mybinder\.org/v2/gh/[^\s)\"']+", text)
    if not links:
        pytest.skip("README has no binder link")
    for link in links:
        m = re.search(r"urlpath=lab/tree/([^\s&)]+\.ipynb)", link)
        assert m, f"the binder link should open a notebook in JupyterLab: {link}"
        assert (ROOT / m.group(1)).is_file(), f"{m.group(1)} (from the binder link) is missing"
