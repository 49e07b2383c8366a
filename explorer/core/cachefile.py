"""The explorer's own JSON cache files: read without trusting the bytes, written atomically.

Every cache file (profiles, the host measurements) goes through here. :func:`read` decodes
UTF-8, refuses files larger than :data:`MAX_CACHE_BYTES` or nested deeper than
:data:`MAX_DEPTH`, and parses numbers out of range (``10**400``, ``1e999``) and the constants
``NaN`` and ``Infinity`` as :data:`REFUSED`, a value no reader takes for a number or a text;
anything else wrong raises :class:`DamagedFile`, which the readers turn into "measure again".
:func:`write` writes a whole file under a name of its own in the same folder and moves it into
place, so a reader sees the old file or the new one, never half of one, and two writers never
share a temporary file. :func:`update` changes one file's entries under a lock, merged with
what another process wrote meanwhile.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # (not on Windows: writes there are atomic but not merged under a lock)
    fcntl = None  # type: ignore[assignment]

#: a cache file larger than this is damage, not measurements
MAX_CACHE_BYTES = 64 * 2**20
#: no cache file nests deeper than this (a profile nests 4 deep)
MAX_DEPTH = 32
#: whole numbers beyond this are damage (none of ours comes near: the largest is bytes)
MAX_WHOLE = 2**63


class DamagedFile(ValueError):
    """A cache file's bytes are not a JSON value the explorer could have written; the message
    says what is wrong, for the warning its reader gives."""


class _Refused:
    """What a number out of range or a JSON constant (NaN, Infinity) parses as."""

    def __repr__(self) -> str:
        return "<a number out of range>"


#: the value of a number that is not finite or out of range in a cache file: neither a
#: number nor a text, so every check of an entry refuses it
REFUSED = _Refused()


def _whole(text: str) -> Any:
    if len(text.lstrip("-")) > 19:  # (before int(): 10**400 would parse)
        return REFUSED
    value = int(text)
    return value if abs(value) <= MAX_WHOLE else REFUSED


def _real(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else REFUSED


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def depth(data: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``data`` nest (brackets inside
    strings aside)."""
    brackets = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate((_STEP[b] for b in brackets), initial=0))


def parse(data: bytes) -> Any:
    """The JSON value of a cache file's bytes; :class:`DamagedFile` when they are not UTF-8
    JSON of at most :data:`MAX_CACHE_BYTES` and :data:`MAX_DEPTH` levels. Numbers out of
    range and NaN or Infinity parse as :data:`REFUSED`."""
    if len(data) > MAX_CACHE_BYTES:
        raise DamagedFile(f"it is larger than {MAX_CACHE_BYTES // 2**20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DamagedFile(f"it is not UTF-8: {exc.reason} at byte {exc.start}") from None
    if depth(data) > MAX_DEPTH:
        raise DamagedFile(f"it nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_int=_whole, parse_float=_real,
                          parse_constant=lambda _: REFUSED)
    except (ValueError, RecursionError) as exc:
        raise DamagedFile(f"it is not JSON: {str(exc)[:100]}") from None


def read(path: Path) -> Any:
    """The JSON value in the cache file at ``path`` (:func:`parse`); None when there is no
    file or it cannot be read (both mean: measure), :class:`DamagedFile` when it is
    damaged."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CACHE_BYTES + 1)
    except OSError:
        return None
    return parse(data)


def write(path: Path, value: Any) -> None:
    """Write ``value`` as the JSON cache file ``path``, atomically: to a file of its own in
    the same folder, flushed to disk, then moved into place (:data:`REFUSED` values are
    written as null). Raises ``OSError`` when the folder cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1, sort_keys=True, default=lambda _: None)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the lock of the cache file ``path`` (an exclusive ``flock`` on ``<path>.lock``
    beside it) while the block runs; other processes updating it wait. Where locks are not
    available the block runs unlocked. Raises ``OSError`` when the folder cannot be
    written."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def update(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the entries of the JSON object in the cache file ``path`` in place
    (``change`` gets them, as on disk now: {} when the file is missing or damaged) and write
    them back atomically, under the file's lock, so entries other processes write meanwhile
    are kept. Raises ``OSError`` when the folder cannot be written."""
    with locked(path):
        try:
            entries = read(path)
        except DamagedFile:
            entries = None
        if not isinstance(entries, dict):
            entries = {}
        change(entries)
        write(path, entries)
