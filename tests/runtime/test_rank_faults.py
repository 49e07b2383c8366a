"""Faults of a real run's start and of its folder: a rank stopped before its first heartbeat,
and a job folder whose file system is full (before the run and during it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import tiny_builtin_graph

import explorer as ex
from explorer.core.plan import Plan
from explorer.runtime import RunFailed, folders, heartbeat
from explorer.runtime import launch as launch_module

FAST = {"steps": 1, "warmup": 0, "progress": False}


@pytest.fixture(scope="module")
def mlp():
    """The tiny MLP and a data-parallel plan on two CPU ranks."""
    graph = tiny_builtin_graph("mlp")
    pair = Plan.from_assignment(graph, [["cpu:0", "cpu:1"]], dict.fromkeys(range(len(graph)), 0),
                                algorithm="data-parallel", optimizer="adam")
    return graph, pair


@pytest.mark.slow
def test_a_rank_stopped_before_its_first_beat_is_named(mlp, monkeypatch):
    """Rank 1 stops (SIGSTOP) once started, before it ever beats, while rank 0 waits for it
    to join: rank 1 is named as stopped the way a rank stopped later is (its process state,
    within the run's time limit), and rank 0, which waits, is not blamed."""
    graph, pair = mlp
    monkeypatch.setenv("EXPLORER_FAULT", "1:stop:start")
    monkeypatch.setattr(heartbeat, "SILENT_S", 8.0)  # (20 s by default)
    with pytest.raises(RunFailed, match=r"rank 1 \(cpu:1\) stopped responding \(its process is "
                       r"stopped: SIGSTOP or a debugger\), while starting") as failed:
        ex.run(graph, plan=pair, **{**FAST, "timeout_s": 90})
    assert "rank 0" not in str(failed.value)


def test_a_full_job_folder_is_said_so_before_the_run(mlp, tmp_path):
    """The program's file cannot be written (the kernel answers ENOSPC, as on a full file
    system): an ExplorerError that says the folder is full and what to do, not torch's
    ``inline_container.cc`` error."""
    graph, pair = mlp
    (tmp_path / "program.pt").symlink_to("/dev/full")
    with pytest.raises(ex.ExplorerError, match=rf"the temporary folder is full: {tmp_path} "
                       r"could not be written \(.* free on its file system\).*set TMPDIR"):
        ex.run(graph, plan=pair, keep=tmp_path, **FAST, timeout_s=60)


@contextlib.contextmanager
def _tiny_file_system(where: Path, size: str):
    """A tmpfs of ``size`` mounted at ``where`` (needs root; the test skips elsewhere)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="mounts a tmpfs")
def test_a_full_temporary_folder_is_said_so_before_the_run(mlp, tmp_path, monkeypatch):
    """The system's temporary folder on a file system with a few KiB left: the run is refused
    with an ExplorerError naming the folder and the space left, before any rank starts."""
    graph, pair = mlp
    with _tiny_file_system(tmp_path / "tmp", "64k") as tmp:
        (tmp / "filler").write_bytes(bytes(48 * 1024))
        monkeypatch.setattr(folders.tempfile, "gettempdir", lambda: str(tmp))
        with pytest.raises(ex.ExplorerError, match=rf"the temporary folder is full: {tmp}/"
                           r"explorer-\d+/job-\d+-\w+ could not be written \(\d+(\.\d)? K?i?B "
                           r"free on its file system\).*set TMPDIR"):
            ex.run(graph, plan=pair, **FAST, timeout_s=60)
        assert list((tmp / f"explorer-{os.getuid()}").iterdir()) == []  # nothing left behind


def _fill(folder: Path) -> None:
    """Write into ``folder`` until its file system is full."""
    with open(folder / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(4096))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="mounts a tmpfs")
def test_a_full_temporary_folder_during_the_run_names_the_rank_and_says_why(
        mlp, tmp_path, monkeypatch):
    """The job is written, then its file system fills up before the ranks start: the ranks
    cannot write their progress or results, nor then their error reports. The run fails
    naming the first rank that failed and the full folder, not "rank 0 failed: no
    message"."""
    graph, pair = mlp
    started = launch_module.launch

    def fill_then_launch(folder, *args, **kwargs):
        _fill(folder)
        return started(folder, *args, **kwargs)

    monkeypatch.setattr(launch_module, "launch", fill_then_launch)
    with _tiny_file_system(tmp_path / "tmp", "1m") as tmp:
        monkeypatch.setattr(folders.tempfile, "gettempdir", lambda: str(tmp))
        with pytest.raises(RunFailed, match=r"rank (0|1) \(cpu:\1\) failed: the temporary "
                           rf"folder is full: {tmp}/explorer-\d+/job-\d+-\w+ could not be written "
                           r"\(0 B free on its file system\).*set TMPDIR"):
            ex.run(graph, plan=pair, **FAST, timeout_s=60)
