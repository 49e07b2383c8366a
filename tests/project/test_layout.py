"""The code's shape: small files, private names kept private, no imports hidden in functions.

Layering itself (which package may import which) is import-linter's job (``lint-imports``, with
the contracts in pyproject.toml); these are the rules it does not check.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("explorer", "widgets")
MAX_LINES = 600

#: imports inside functions that are there on purpose, not to dodge a cycle: optional or heavy
#: third-party packages loaded only where they are needed
LAZY_OK = {"pynvml", "scipy", "playwright", "ctypes", "platform", "ipywidgets", "bokeh",
           "jupyter_bokeh", "IPython"}


def _sources(*tops: str) -> list[Path]:
    return sorted(p for t in tops for p in (ROOT / t).rglob("*.py"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.mark.parametrize("path", _sources(*PACKAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{n} lines: split it by job (at most {MAX_LINES})"


def _private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Private names this file takes from another module: ``from m import _x`` and
    ``alias._x`` where ``alias`` names a module of the project."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] in PACKAGES:
            for a in node.names:
                if _private(a.name):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                elif a.name.islower() and (root / node.module.replace(".", "/") / a.name).exists():
                    modules.add(a.asname or a.name)  # a submodule imported by name
                elif (root / node.module.replace(".", "/") / f"{a.name}.py").exists():
                    modules.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", _sources(*PACKAGES, "tests", "benchmarks"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_used_outside_its_module(path):
    uses = _private_uses(path)
    assert not uses, "private names of other modules (make them public or use the API):\n" \
        + "\n".join(uses)


def _function_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in PACKAGES:
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", _sources("explorer"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_engine_imports_its_own_modules_at_the_top(path):
    """An import of the project inside a function is a cycle being dodged: the layers say
    which package may import which, and imports at the top make that visible."""
    uses = _function_imports(path)
    assert not uses, "imports inside functions:\n" + "\n".join(uses)


def test_the_checks_find_what_they_look_for(tmp_path):
    """The AST checks above are not vacuous: a file that breaks each rule is caught."""
    pkg = tmp_path / "explorer" / "core"
    pkg.mkdir(parents=True)
    (pkg / "units.py").write_text("_X = 1\n")
    bad = tmp_path / "explorer" / "bad.py"
    bad.write_text("from explorer.core import units\nfrom explorer.core.units import _X\n"
                   "def f():\n    import explorer.core\n    return units._X\n")
    assert len(_private_uses(bad, tmp_path)) == 2
    assert len(_function_imports(bad)) == 1


@pytest.mark.parametrize("path", _sources("tests/widgets"), ids=lambda p: str(p.relative_to(ROOT)))
def test_widget_tests_drive_the_public_api(path):
    """The widget tests act and read as a user's code would: through the session and the
    widget's public methods, not their private attributes."""
    tree = ast.parse(path.read_text())
    uses = [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and _private(n.attr)]
    assert not uses, "private attributes used:\n" + "\n".join(uses)
