"""The launcher reads bounded pieces of the ranks' error reports and logs."""

from __future__ import annotations

import os
from types import SimpleNamespace

from explorer.runtime.watch import REPORT_READ_BYTES, failure, first_failure, read_report


def test_an_endless_error_report_is_read_in_a_bounded_piece(tmp_path):
    os.symlink("/dev/zero", tmp_path / "error-1.txt")  # never ends: read whole, it never returns
    (tmp_path / "error-0.txt").write_text("Connection closed by peer")
    assert first_failure(tmp_path, [1, 1]) == 1
    assert len(read_report(tmp_path / "error-1.txt")) == REPORT_READ_BYTES
    msg = failure(tmp_path, 1, [1, 1], SimpleNamespace(devices=["cpu:0", "cpu:1"]))
    assert msg.startswith("rank 1 (cpu:1) failed:")


def test_a_log_is_read_from_its_end(tmp_path):
    lines = [f"line {i}" for i in range(50_000)]
    (tmp_path / "log-0.txt").write_text("\n".join(lines) + "\n")
    msg = failure(tmp_path, 0, [7], SimpleNamespace(devices=["cpu:0"]))
    assert "line 49999" in msg and "line 49997" in msg and "line 49996 " not in msg


def test_damaged_bytes_in_a_report_are_read_leniently(tmp_path):
    (tmp_path / "error-0.txt").write_bytes(b"bad \xff\xfe bytes\nmore")
    msg = failure(tmp_path, 0, [1], SimpleNamespace(devices=["cpu:0"]))
    assert "bad" in msg and "bytes" in msg
