"""Heartbeats of ranks and the per-user folder of job folders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from explorer.runtime import folders, heartbeat, watch


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


def test_a_rank_stopped_before_its_first_beat_is_silent_as_one_stopped_after(tmp_path):
    """A rank that never beat is silent once its process has been seen stopped for
    SILENT_S, long before the start-up grace; a rank that beats (waiting for it) is not."""
    now = time.time()
    _beat(tmp_path, 0, 1.0, step=0, waiting_for=heartbeat.EVERYONE)
    started = now - heartbeat.SILENT_S - 5
    held = {1: now - heartbeat.SILENT_S - 1, 2: now - heartbeat.SILENT_S + 1}
    assert heartbeat.silent_ranks(tmp_path, [0, 1, 2, 3], started, now, held) == [1]


def test_only_stopped_processes_that_never_beat_are_held(tmp_path):
    """The launcher's view of start-up: a stopped process that never beat is held from when
    it was first seen so; a running one, or one that beat, is not."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(3)]
    try:
        for p in procs[1:]:
            os.kill(p.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while time.time() < deadline and \
                any(watch.process_state(p.pid) not in watch.STOPPED for p in procs[1:]):
            time.sleep(0.05)
        _beat(tmp_path, 2, 0, step=0, waiting_for=None)
        first = watch.stopped_unbeaten(tmp_path, procs, [0, 1, 2], {}, 100.0)
        assert first == {1: 100.0}
        assert watch.stopped_unbeaten(tmp_path, procs, [0, 1, 2], first, 105.0) == {1: 100.0}
        os.kill(procs[1].pid, signal.SIGCONT)
        deadline = time.time() + 10
        while time.time() < deadline and watch.process_state(procs[1].pid) in watch.STOPPED:
            time.sleep(0.05)
        assert watch.stopped_unbeaten(tmp_path, procs, [0, 1, 2], first, 110.0) == {}
    finally:
        for p in procs:
            p.kill()
            p.wait()


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


def test_a_heartbeat_times_the_steps_it_is_told_of(tmp_path):
    hb = heartbeat.Heartbeat(tmp_path, 0)
    hb.step = 0
    assert hb.longest_step_s == 0.0
    time.sleep(0.05)
    hb.step = 1
    hb.step = 2
    assert hb.step == 2 and 0.05 <= hb.longest_step_s < 5


class TestStallWatch:
    """A rank computing at one step while every other waits on it, for long enough."""

    def watch(self, tmp_path, beats: dict[int, dict]):
        for r, said in beats.items():
            _beat(tmp_path, r, 0, **said)
        return heartbeat.StallWatch(tmp_path)

    def test_a_rank_all_others_wait_on_is_named_after_the_limit(self, tmp_path):
        w = self.watch(tmp_path, {0: {"step": 2, "waiting_for": None, "longest_step_s": 0.5},
                                  1: {"step": 2, "waiting_for": 0, "longest_step_s": 0.5},
                                  2: {"step": 1, "waiting_for": 1},  # through rank 1
                                  3: {"step": 2, "waiting_for": heartbeat.EVERYONE}})
        t = time.time()
        assert w.stalled([0, 1, 2, 3], t) is None
        assert w.stalled([0, 1, 2, 3], t + heartbeat.STALL_MIN_S - 1) is None
        assert w.stalled([0, 1, 2, 3], t + heartbeat.STALL_MIN_S + 1) == (
            0, 2, heartbeat.STALL_MIN_S + 1)

    def test_the_limit_grows_with_the_longest_step(self, tmp_path):
        w = self.watch(tmp_path, {0: {"step": 3, "waiting_for": None, "longest_step_s": 4.0},
                                  1: {"step": 3, "waiting_for": 0, "longest_step_s": 2.0}})
        t = time.time()
        limit = heartbeat.STALL_STEPS * 4.0
        assert w.stalled([0, 1], t) is None
        assert w.stalled([0, 1], t + limit - 1) is None
        assert w.stalled([0, 1], t + limit + 1)[0] == 0

    def test_before_any_step_finished_the_start_up_grace_applies(self, tmp_path):
        w = self.watch(tmp_path, {0: {"step": 0, "waiting_for": None},
                                  1: {"step": 0, "waiting_for": 0}})
        t = time.time()
        assert w.stalled([0, 1], t) is None
        assert w.stalled([0, 1], t + heartbeat.STALL_MIN_S + 1) is None
        assert w.stalled([0, 1], t + heartbeat.STARTUP_S + 1)[:2] == (0, 0)

    def test_progress_resets_the_clock(self, tmp_path):
        w = self.watch(tmp_path, {0: {"step": 2, "waiting_for": None},
                                  1: {"step": 2, "waiting_for": 0}})
        t = time.time()
        assert w.stalled([0, 1], t) is None
        _beat(tmp_path, 0, 0, step=3, waiting_for=None)
        assert w.stalled([0, 1], t + 20) is None
        assert w.stalled([0, 1], t + heartbeat.STALL_MIN_S + 5) is None  # 25 s at step 3
        assert w.stalled([0, 1], t + heartbeat.STALL_MIN_S + 21)[:2] == (0, 3)

    @pytest.mark.parametrize("beats", [
        {0: {"step": 2, "waiting_for": None}, 1: {"step": 2, "waiting_for": None}},  # both busy
        {0: {"step": 2, "waiting_for": 1}, 1: {"step": 2, "waiting_for": 0}},  # a deadlock of
        {0: {"step": 2, "waiting_for": None}, 1: {"step": 2, "waiting_for": 2}},  # waits, or on
        {0: {"step": 2, "waiting_for": None}},  # a rank alone          # a rank not running
    ])
    def test_no_rank_is_named_unless_all_others_wait_on_it(self, tmp_path, beats):
        w = self.watch(tmp_path, beats)
        t = time.time()
        running = sorted(beats)
        assert w.stalled(running, t) is None
        assert w.stalled(running, t + 10 * heartbeat.STARTUP_S) is None

    def test_nothing_is_named_while_a_rank_has_not_beaten(self, tmp_path):
        w = self.watch(tmp_path, {0: {"step": 2, "waiting_for": None}})
        t = time.time()
        assert w.stalled([0, 1], t) is None
        assert w.stalled([0, 1], t + 10 * heartbeat.STARTUP_S) is None


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
