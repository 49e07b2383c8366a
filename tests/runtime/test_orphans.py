"""No rank outlives its launcher: a launcher killed at any moment of its ranks' start-up (while
they import, join the process group or train) takes them with it, and the next run's clean-up
removes its job folder."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from explorer.runtime import folders

pytestmark = pytest.mark.slow

#: a launcher: the tiny MLP on two CPU ranks, for far more steps than the test lasts
LAUNCHER = textwrap.dedent("""
    import explorer as ex
    from explorer.core.plan import Plan

    bm = ex.builtin_model("mlp", "tiny")
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name="mlp")
    pair = Plan.from_assignment(graph, [["cpu:0", "cpu:1"]],
                                dict.fromkeys(range(len(graph)), 0),
                                algorithm="data-parallel", optimizer="adam")
    ex.run(graph, plan=pair, steps=100000, warmup=0, progress=False, timeout_s=600)
""")


def _stat(pid: int) -> list[str] | None:
    """State, parent id, ... of a process (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def _ranks_of(parent: int) -> list[int]:
    """The live rank processes whose parent is ``parent``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            fields = _stat(int(name))
            if b"explorer.runtime.rank" in cmd and fields and fields[0] != "Z" \
                    and int(fields[1]) == parent:
                out.append(int(name))
    return out


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig,delay_s", [
    (signal.SIGKILL, 0.1), (signal.SIGTERM, 0.3), (signal.SIGKILL, 0.5), (signal.SIGTERM, 1.0),
], ids=lambda v: v.name if isinstance(v, signal.Signals) else f"{v}s")
def test_ranks_end_with_a_launcher_killed_during_their_start(tmp_path, sig, delay_s):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("EXPLORER_FAULT", None)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(ranks) < 2 and launcher.poll() is None and time.monotonic() < deadline:
            ranks = sorted(set(ranks) | set(_ranks_of(launcher.pid)))
            time.sleep(0.01)
        assert len(ranks) == 2, "the launcher started no ranks"
        time.sleep(delay_s)
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        gone_by = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert [p for p in ranks if _alive(p)] == [], \
            f"ranks outlived a launcher ended by {sig.name} {delay_s} s after they started"
        # the next run's clean-up removes the dead launcher's job folder
        root = tmp_path / f"explorer-{os.getuid()}"
        folders.clean_stale(root)
        assert list(root.glob("job-*")) == []
    finally:
        for p in ranks:  # orphans left by a failure: this test started them
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
