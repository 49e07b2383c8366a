"""A process that opens an explorer exits cleanly, whatever its background measuring is doing.

Each test runs a short script in a fresh Python process: it opens ``Explorer(...)`` on CPU
ranks (so the background job captures with real weights and profiles, starting rank
processes) and returns, at once or in the middle of measuring. The process must exit with
code 0, print nothing like ``terminate called`` (a C++ abort when a thread is still inside
torch as the interpreter finalizes), and leave no rank process of its own behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("jupyter_bokeh")

#: how long the script may take in all (imports, capture, exit), seconds
SCRIPT_LIMIT_S = 300
#: how long ranks may take to go once their launcher is gone, seconds
RANKS_GONE_S = 30

OPEN_MLP = """
    import explorer as ex
    from widgets import Explorer
    w = Explorer(ex.builtin_model("mlp", "tiny"), cluster=ex.Cluster.cpu(2))
"""

OPEN_GPT2 = """
    import torch
    import explorer as ex
    from transformers import GPT2Config, GPT2LMHeadModel
    from widgets import Explorer
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=2))
    ids = torch.randint(0, 1000, (4, 32))
    w = Explorer(m, (ids,), cluster=ex.Cluster.cpu(2))
"""

#: the same on nominal host figures (no host probes), to profile in an empty cache
OPEN_MLP_NOMINAL = OPEN_MLP.replace("ex.Cluster.cpu(2)", "ex.Cluster.cpu(2, measure=False)")

#: wait until the background measuring is profiling on rank processes (then exit at once)
WHILE_PROFILING = """
    import time
    t0 = time.monotonic()
    while "profiling" not in w.session.measure_status and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    assert "profiling" in w.session.measure_status, w.session.measure_status
    assert w.session.measuring.running
    time.sleep(0.5)
    print("exiting while", w.session.measure_status, flush=True)
"""


def ranks_of(pid: int) -> list[str]:
    """Command lines of the rank processes launched by process ``pid`` that are still alive
    (their job folders are named ``job-PID-...``, see :mod:`explorer.runtime.folders`)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "explorer.runtime.rank" in cmd and f"job-{pid}-" in cmd and state != "Z":
            found.append(cmd)
    return found


def run_and_exit(body: str, tmp_path: Path, empty_cache: bool = False
                 ) -> subprocess.CompletedProcess:
    """Run ``body`` as a script in a fresh process (with an empty cache folder of its own
    where ``empty_cache``: every profile is measured)."""
    script = tmp_path / "open_and_exit.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    if empty_cache:
        env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=SCRIPT_LIMIT_S, env=env, cwd=tmp_path)
    return done


def check_clean_exit(done: subprocess.CompletedProcess, pid_file: Path) -> None:
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    assert "Fatal Python error" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int(pid_file.read_text())
    t0 = time.monotonic()
    while ranks_of(pid) and time.monotonic() - t0 < RANKS_GONE_S:
        time.sleep(0.2)
    assert not ranks_of(pid), ranks_of(pid)


WRITE_PID = """
    import os, pathlib
    pathlib.Path("pid").write_text(str(os.getpid()))
"""


@pytest.mark.slow
def test_opening_an_explorer_and_returning_at_once_exits_cleanly(tmp_path):
    done = run_and_exit(WRITE_PID + OPEN_MLP, tmp_path)
    check_clean_exit(done, tmp_path / "pid")


@pytest.mark.slow
def test_exiting_while_the_profile_measures_on_ranks_exits_cleanly(tmp_path):
    done = run_and_exit(WRITE_PID + OPEN_MLP_NOMINAL + WHILE_PROFILING, tmp_path,
                        empty_cache=True)
    assert "exiting while" in done.stdout, done.stderr[-3000:]
    check_clean_exit(done, tmp_path / "pid")


@pytest.mark.slow
def test_a_hugging_face_gpt2_opened_and_left_at_once_exits_cleanly(tmp_path):
    pytest.importorskip("transformers")
    done = run_and_exit(WRITE_PID + OPEN_GPT2, tmp_path)
    check_clean_exit(done, tmp_path / "pid")


def job_of(work):
    """A started :class:`BackgroundJob` on ``work``, with what it told its callbacks."""
    from widgets.measure import BackgroundJob

    told: list[str] = []
    job = BackgroundJob(work, lambda text: None, lambda graph, pre: None,
                        lambda result: told.append("finish"),
                        lambda error, trace: told.append(f"fail {error!r}"))
    return job.start(), told


def test_stop_ends_work_at_its_next_report():
    import threading

    going = threading.Event()

    def work(report, early):
        while True:
            report("one more step")
            going.set()

    job, told = job_of(work)
    assert going.wait(60)
    assert job.stop() and not job.running and job.stopped
    assert told == [] and job.error is None  # a stop is no failure, and nothing is finished


def test_stop_ends_work_that_never_reports():
    import threading

    going = threading.Event()

    def work(report, early):
        going.set()
        n = 0
        while True:  # Python code that never reports: the stop is raised where it is
            n += 1

    job, told = job_of(work)
    assert going.wait(60)
    assert job.stop() and job.stopped and told == []
