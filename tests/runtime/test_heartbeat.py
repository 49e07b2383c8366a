"""Heartbeats of ranks and the per-user folder of job folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from explorer.runtime import folders, heartbeat


def _beat(folder, rank, age_s, **said):
    p = heartbeat.beat_path(folder, rank)
    p.write_text(json.dumps(said))
    t = time.time() - age_s
    os.utime(p, (t, t))


def test_silent_ranks_are_those_whose_beat_stopped(tmp_path):
    now = time.time()
    _beat(tmp_path, 0, 1.0, step=3, waiting_for=1)
    _beat(tmp_path, 1, heartbeat.SILENT_S + 5, step=3, waiting_for=None)
    assert heartbeat.silent_ranks(tmp_path, [0, 1, 2], now - 10, now) == [1]
    # a rank that never beat is silent only after the start-up grace
    assert heartbeat.silent_ranks(tmp_path, [2], now - heartbeat.STARTUP_S - 1, now) == [2]
    assert heartbeat.describe(tmp_path, 0) == "at step 4, waiting for rank 1"
    assert heartbeat.describe(tmp_path, 1) == "at step 4, computing"
    assert heartbeat.describe(tmp_path, 2) == "not started"
    _beat(tmp_path, 3, 0, step=0, waiting_for=heartbeat.EVERYONE)
    assert heartbeat.describe(tmp_path, 3) == "at step 1, waiting for all ranks"
    heartbeat.beat_path(tmp_path, 4).write_text("{not json")
    assert heartbeat.describe(tmp_path, 4) == "not started"


def test_a_heartbeat_thread_beats(tmp_path):
    class Waiting:
        waiting_for = 2

    hb = heartbeat.Heartbeat(tmp_path, 5, period_s=0.05)
    hb.messenger = Waiting()
    hb.step = 7
    hb.start()
    deadline = time.time() + 10
    while heartbeat.last_beat(tmp_path, 5)[0] is None and time.time() < deadline:
        time.sleep(0.05)
    assert heartbeat.describe(tmp_path, 5) == "at step 8, waiting for rank 2"


@pytest.mark.slow
def test_job_folders_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(folders.tempfile, "gettempdir", lambda: str(tmp_path))
    root = folders.jobs_root()
    assert root.name == f"explorer-{os.getuid()}" and (root.stat().st_mode & 0o777) == 0o700
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f"job-{dead.pid}-abc"
    stale.mkdir()
    (stale / "program.pt").write_bytes(b"x")
    live = root / f"job-{os.getppid()}-abc"
    live.mkdir()
    other = root / "not-a-job"
    other.mkdir()
    assert folders.clean_stale(root) == [stale]
    assert not stale.exists() and live.exists() and other.exists()
