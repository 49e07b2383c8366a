"""Render the benchmark records (``benchmarks/results/*.json``) into the docs' tables.

Run: python benchmarks/report.py [--check]

Every Markdown file in docs/ (and README.md) may hold tables between markers::

    <!-- table:NAME -->
    ...generated...
    <!-- /table -->

``NAME`` is a record's file name without ``.json``; ``<!-- table:NAME column=value -->``
keeps only the rows whose ``column`` is ``value`` (several filters separated by ``;``). What
lies between the markers is regenerated from the record (a line with its title, date,
machine and command, then the rows as a Markdown table); the prose around them is written by
hand. ``--check`` changes nothing and exits 1 when a file differs from what the records
render (a table edited by hand, or a record not yet rendered).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: the fields every record has
FIELDS = ("date", "machine", "command", "rows")
MARKER = re.compile(r"(<!-- table:([\w.-]+)((?: [^>]*?)?) -->\n)(.*?)(<!-- /table -->)", re.S)


def load_records(folder: Path = RESULTS) -> dict[str, dict]:
    """Every record under ``folder`` by name; a record without one of :data:`FIELDS` is an
    error that names the file."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text())
        missing = [f for f in FIELDS if f not in rec]
        if missing:
            raise SystemExit(f"{path}: missing {', '.join(missing)}")
        out[path.stem] = rec
    return out


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render(rec: dict, filters: str = "") -> str:
    """The record as a caption line and a Markdown table (rows kept by ``filters``)."""
    rows = rec["rows"]
    for f in (f.strip() for f in filters.split(";") if f.strip()):
        key, _, value = f.partition("=")
        rows = [r for r in rows if str(r.get(key.strip())) == value.strip()]
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    title = f"**{rec['title']}.** " if rec.get("title") else ""
    caption = f"{title}Measured {rec['date']}; {rec['machine']}; `{rec['command']}`."
    notes = rec.get("notes")
    if notes:  # one string, or a list of sentences
        caption += " " + (" ".join(notes) if isinstance(notes, list) else notes)
    lines = [caption, ""]
    if cols:
        lines.append("| " + " | ".join(_cell(c) for c in cols) + " |")
        lines.append("|" + "|".join(" --- " for _ in cols) + "|")
        lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    else:
        lines.append("(no rows)")
    return "\n".join(lines) + "\n"


def rendered(text: str, records: dict[str, dict], where: str) -> str:
    """``text`` with every marked table regenerated from ``records``."""

    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in records:
            raise SystemExit(f"{where}: no record benchmarks/results/{name}.json for "
                             f"'{m.group(1).strip()}'")
        return m.group(1) + render(records[name], m.group(3)) + m.group(5)

    return MARKER.sub(one, text)


def documents() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a document differs from the records")
    args = ap.parse_args(argv)
    records = load_records()
    stale = []
    for path in documents():
        if not path.is_file():
            continue
        old = path.read_text()
        new = rendered(old, records, str(path.relative_to(ROOT)))
        if new == old:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")
    if args.check and stale:
        print("tables differ from benchmarks/results (run python benchmarks/report.py): "
              + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
