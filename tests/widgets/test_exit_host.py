"""An explorer left while its background job measures this host exits cleanly, probes ended.

``Explorer.builtin(..., devices="cpu:2")`` on a host whose CPU ranks were never measured opens
on nominal figures and measures the host in the background (two gloo processes per link
probe). A script that returns then must exit with code 0 and leave no probe process behind.
Helpers come from :mod:`test_exit`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_exit import WRITE_PID, check_clean_exit, run_and_exit

pytest.importorskip("jupyter_bokeh")

#: how long probe processes may take to go once the script has exited, seconds
PROBES_GONE_S = 30

#: open on CPU ranks, wait until the host's link is being probed, note the probe processes
#: (children of this process running the gloo probe) in "probes", then exit at once
OPEN_AND_EXIT_WHILE_PROBING = """
    import time
    from pathlib import Path
    from widgets import Explorer

    def probes():
        found = []
        for proc in Path("/proc").iterdir():
            try:
                stat = (proc / "stat").read_text()
                cmd = (proc / "cmdline").read_bytes().replace(b"\\0", b" ").decode()
            except OSError:
                continue
            if (int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid()
                    and "gloo_probe" in cmd):
                found.append(proc.name)
        return found

    w = Explorer.builtin("mlp", "tiny", devices="cpu:2", progress=False)
    assert w.session.cluster.measure_later, w.session.cluster.describe()
    t0 = time.monotonic()
    while not probes() and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    assert "measuring this host" in w.session.measure_status, w.session.measure_status
    pathlib.Path("probes").write_text(" ".join(probes()))
    print("exiting while", w.session.measure_status, flush=True)
"""


def alive(pid: str) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_exiting_while_the_host_is_measured_exits_cleanly(tmp_path):
    done = run_and_exit(WRITE_PID + OPEN_AND_EXIT_WHILE_PROBING, tmp_path, empty_cache=True)
    assert "exiting while" in done.stdout, done.stderr[-3000:]
    check_clean_exit(done, tmp_path / "pid")
    probes = (tmp_path / "probes").read_text().split()
    assert probes  # it did exit while probing
    t0 = time.monotonic()
    while any(alive(p) for p in probes) and time.monotonic() - t0 < PROBES_GONE_S:
        time.sleep(0.2)
    assert not [p for p in probes if alive(p)]
