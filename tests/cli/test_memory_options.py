"""``--zero``, ``--recompute``, ``--precision`` on the command line: parsed, checked, and (slow)
carried by ``explorer run`` into the plan that runs."""

from __future__ import annotations

import argparse
import json

import pytest

from explorer.cli.commands import main
from explorer.cli.memory import add_memory_options, memory_settings
from explorer.platforms.cpu import host as cpu_host
from explorer.runtime.accounting import CATEGORIES


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_memory_options(parser)
    return parser.parse_args(list(argv))


class TestMemoryOptions:
    def test_left_out_is_no_setting(self):
        assert memory_settings(_parse()) == {}

    def test_given_ones_are_plan_keywords(self):
        args = _parse("--zero", "3", "--recompute", "selective", "--precision", "bf16")
        assert memory_settings(args) == {"zero": 3, "recompute": "selective",
                                         "precision": "bf16"}

    @pytest.mark.parametrize("argv", [("--zero", "4"), ("--recompute", "some"),
                                      ("--precision", "fp8")])
    def test_values_outside_the_choices_exit_2(self, argv, capsys):
        with pytest.raises(SystemExit) as exc:
            _parse(*argv)
        assert exc.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_run_carries_the_settings_into_the_plan(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_host, "host_profile", lambda measure: cpu_host.nominal_profile())
    rc = main(["run", "--model", "mlp", "--size", "tiny", "--devices", "cpu:2",
               "--algorithm", "data-parallel", "--zero", "3", "--recompute", "full",
               "--steps", "1", "--warmup", "0", "--json", "--quiet", "--force"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["plan"]["stage_settings"] == [{"zero": 3, "recompute": "full",
                                              "precision": "fp32"}]
    by = out["measured_peak_by_category"]["cpu:0"]
    assert set(by) == set(CATEGORIES) and sum(by.values()) > 0
