"""A factory name the user gives is imported as named: a module in the current folder does
not stand in for an installed one of the same name."""

from __future__ import annotations

import sys
import uuid

import pytest

from explorer.core.factory import FactoryError, load_factory

MODULE = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def build():
    return {where!r}
'''


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """An installed folder on sys.path and a current folder (on sys.path first, as ``''``
    is for ``python -c`` and notebooks); a module name found in neither yet."""
    installed, here = tmp_path / "site", tmp_path / "here"
    installed.mkdir()
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", ["", str(installed), *sys.path])
    name = f"mod_{uuid.uuid4().hex[:12]}"
    yield installed, here, name, tmp_path / "MARKER"
    sys.modules.pop(name, None)


def _module(folder, name, marker, where):
    (folder / f"{name}.py").write_text(MODULE.format(marker=str(marker), where=where))


def test_the_current_folder_does_not_shadow_an_installed_module(folders):
    installed, here, name, marker = folders
    _module(installed, name, tmp := installed / "installed-ran", "installed")
    _module(here, name, marker, "here")
    with pytest.raises(FactoryError, match=rf"{name}.py in the current folder .* hides the "
                                           rf"installed module {name!r}"):
        load_factory(f"{name}:build")
    assert not marker.exists() and not tmp.exists()


def test_a_module_only_the_current_folder_has_is_imported_as_named(folders):
    _, here, name, marker = folders
    _module(here, name, marker, "here")
    assert load_factory(f"{name}:build")() == "here"


def test_an_installed_module_is_imported(folders):
    installed, _, name, marker = folders
    _module(installed, name, marker, "installed")
    assert load_factory(f"{name}:build")() == "installed"
