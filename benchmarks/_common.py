"""What several benchmarks share: the built-in model's labelled plans, and the JSON record of a
result under ``benchmarks/results/`` that ``python benchmarks/report.py`` renders into docs/.
Imported by the scripts beside it (``python benchmarks/X.py`` puts this folder on the import
path)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import explorer as ex
from explorer.runtime import RankPool

#: where the benchmarks write their records and where ``report.py`` reads them
RESULTS = Path(__file__).resolve().parent / "results"


def builtin_plans(name: str, size: str, cluster: ex.Cluster,
                  plans: list[tuple[str, str, dict[str, Any]]]
                  ) -> tuple[ex.OpGraph, list[tuple[str, ex.Plan]]]:
    """Built-in model ``name`` captured, and one plan per ``(label, algorithm, options)`` of
    ``plans`` on ``cluster``, labelled. The profile behind the plans comes from the cache
    where it can: it only makes the plans, the benchmark measures what it compares."""
    bm = ex.builtin_model(name, size)
    graph = ex.capture(bm.module, bm.example_inputs, bm.loss_fn, bm.targets, name=name)
    costs = ex.profile(graph, cluster, progress=False)
    return graph, [(label, ex.partition(graph, cluster, costs, alg, **opts))
                   for label, alg, opts in plans]


def add_results_option(ap: argparse.ArgumentParser) -> None:
    """``--results DIR``: where :func:`write_result` writes (``none``: nowhere)."""
    ap.add_argument("--results", default=str(RESULTS),
                    help="folder for the JSON records (default benchmarks/results; 'none' "
                         "writes none); python benchmarks/report.py renders them into docs/")


def load_average() -> str:
    """``"load average 1.23 0.98 0.75"``: how busy the machine was, for a record's notes
    (shared machines inflate wall-clock seconds)."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    """This machine in words, without its name: cores, processor, torch, GPU."""
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()}-core CPU machine ({cpu}, {platform.system()}), "
            f"torch {torch.__version__}, {gpu}")


def write_result(name: str, rows: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                 columns: Sequence[str] | None = None, command: str | None = None,
                 title: str = "", notes: str = "", folder: str | Path = RESULTS
                 ) -> Path | None:
    """Write ``rows`` (mappings, or sequences named by ``columns``) as the record
    ``folder/name.json`` with today's date, this machine and the command line; nothing when
    ``folder`` is ``'none'``. Returns the path written."""
    if str(folder).lower() == "none":
        return None
    if columns is not None:
        rows = [dict(zip(columns, r, strict=True)) for r in rows]
    record = {
        "title": title,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": command or "python " + shlex.join(
            [os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "notes": notes,
        "rows": [dict(r) for r in rows],
    }
    path = Path(folder) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


@contextlib.contextmanager
def dry_run_ranks(dry: bool) -> Iterator[RankPool | None]:
    """Rank processes a dry run's real runs share (it checks code paths, not rank start-up);
    None for a measured run, whose runs each start their own, as a user's ``ex.run`` does."""
    if not dry:
        yield None
        return
    with RankPool() as pool:
        yield pool
