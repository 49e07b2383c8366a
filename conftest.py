"""Collection-wide test settings.

- The notebooks run whole (under nbmake), so they count as ``slow``.
- Every test that starts processes is marked ``slow``: with ``PE_CHECK_PROCESSES=1`` a test that
  starts one (``subprocess.Popen`` or ``multiprocessing``) without the mark fails, which is how
  the marks are kept honest (``PE_CHECK_PROCESSES=1 python -m pytest -m "not slow" tests``).
  Off by default: whether a test starts processes can depend on what is cached on the machine.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

_current: dict[str, pytest.Item | None] = {"item": None}
_started: dict[str, list[str]] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


def _note(what: str) -> None:
    item = _current["item"]
    if item is not None and item.get_closest_marker("slow") is None:
        _started.setdefault(item.nodeid, []).append(what)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PE_CHECK_PROCESSES") != "1":
        return
    popen_init, mp_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def checked_popen(self, args, *a, **kw):
        _note(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))[:80]}")
        popen_init(self, args, *a, **kw)

    def checked_start(self):
        _note(f"multiprocessing {self.name}")
        mp_start(self)

    subprocess.Popen.__init__ = checked_popen
    multiprocessing.process.BaseProcess.start = checked_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _current["item"] = item
    yield
    _current["item"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and item.nodeid in _started and report.passed:
        report.outcome = "failed"
        report.longrepr = ("started processes without the slow mark: "
                           + "; ".join(_started[item.nodeid][:3]))
