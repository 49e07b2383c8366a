"""The command line refuses a batch too large for this machine before it builds the model at
that batch: from --batch-size, and from the batch size a plan file records."""

from __future__ import annotations

import json

import pytest
from builders import graph

import explorer as ex
from explorer.cli import bounds
from explorer.cli.commands import main
from explorer.core.plan import Plan


@pytest.fixture
def small_batches_only(monkeypatch):
    """Fail should the command line build a model at more than 64 samples."""
    real = ex.builtin_model

    def build(name, size="default", batch_size=None, *args, **kwargs):
        assert batch_size is None or batch_size <= 64, f"built {name} at {batch_size}"
        return real(name, size, batch_size, *args, **kwargs)
    monkeypatch.setattr(ex, "builtin_model", build)


def _plan_file(tmp_path, batch_size: int):
    """A plan file recording the built-in MLP (tiny) at ``batch_size``."""
    g = graph([("x", "input", [], 100), ("a", "op", ["x"], 100)])
    plan = Plan.single(g, "cpu:0")
    d = {**plan.to_dict(), "model": {"builtin": "mlp", "size": "tiny",
                                     "batch_size": batch_size}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    return path


def test_a_plans_huge_batch_is_refused_before_export_builds_it(tmp_path, capsys,
                                                               small_batches_only,
                                                               monkeypatch):
    monkeypatch.setattr(bounds, "total_memory_bytes", lambda: 2**30)  # a 1 GiB machine
    per = bounds.bytes_per_sample("mlp", "tiny")
    room = 2**29
    batch = room // per + 1  # (within the plan schema's limit)
    rc = main(["export", "--plan", str(_plan_file(tmp_path, batch)), "--out",
               str(tmp_path / "t.py")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"mlp (tiny) at a batch of {batch:,} samples needs about" in err
    assert "for the example batch and its activations" in err
    assert f"use a batch of at most {room // per:,} (--batch-size)" in err
    assert not (tmp_path / "t.py").exists()


def test_a_huge_batch_size_option_is_refused_before_the_model_is_built(capsys,
                                                                        small_batches_only,
                                                                        monkeypatch):
    monkeypatch.setattr(bounds, "total_memory_bytes", lambda: 2**30)  # a 1 GiB machine
    rc = main(["plan", "--quiet", "--model", "gpt", "--size", "tiny", "--batch-size",
               "100000", "--devices", "cpu:2", "--no-cache"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "gpt (tiny) at a batch of 100,000 samples needs about" in err
    assert "more than 50% of this machine's 1.0 GiB" in err


def test_more_samples_than_the_limit_are_refused(capsys, small_batches_only):
    rc = main(["plan", "--quiet", "--model", "mlp", "--size", "tiny", "--batch-size",
               "1000000000", "--devices", "cpu:2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "a batch of 1,000,000,000 samples is more than the 1,048,576 the explorer builds" \
        in err


def test_the_estimate_counts_the_batch_and_activations():
    """GPT (tiny): at least its token ids and next tokens, and its logits over the vocabulary
    for every position, per sample."""
    cfg = ex.models.builtin.model_config("gpt", "tiny")
    at_least = 2 * cfg.seq_len * 8 + cfg.seq_len * cfg.vocab_size * 4
    assert bounds.bytes_per_sample("gpt", "tiny") >= at_least
