"""The host measurement cache: one JSON file of what was measured on this host, by key.

Keys name the host, the torch version and the rank settings (:func:`cache_key`); entries are
written atomically and read back by later processes. An unreadable or unwritable cache only
means measuring again.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

from explorer.platforms.cpu.ranks import rank_settings_tag


def cache_file() -> Path:
    """Where this user's host measurements are kept (under ``$XDG_CACHE_HOME`` or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partition-explorer" / "cpu-profile.json"


def cache_key() -> str:
    """The key of this host's measurements: host name, torch version, rank settings."""
    import torch  # (a second's import, only when a measurement is looked up)

    # ranks set up differently (pinned or not, freed memory held or not) wait and copy
    # differently: measured apart
    tag = rank_settings_tag().replace("-", "|")
    return f"{socket.gethostname()}|torch {torch.__version__}{tag}"


def read_cache(path: Path) -> dict[str, Any]:
    """Every entry of the cache file at ``path`` ({} when there is none or it is unreadable:
    then with a warning, as what it held is measured again). Each entry is checked by its
    reader."""
    data = _read(path)
    if data is None:
        warnings.warn(f"the host measurement cache {path} is damaged (not a JSON object); "
                      "measuring again and replacing it", stacklevel=2)
    return data or {}


def finite_number(x: Any) -> bool:
    """Whether ``x`` is a finite number >= 0 (not a bool): what a cached measurement holds."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
        and x >= 0


def warn_damaged(path: Path, key: str, why: str) -> None:
    """Say that the entry ``key`` of the cache at ``path`` is unusable and measured again."""
    warnings.warn(f"the host measurement cache entry {key!r} in {path} is damaged or "
                  f"incomplete ({why}); measuring again and replacing it", stacklevel=3)


def _read(path: Path) -> dict[str, Any] | None:
    """The cache file's entries: {} when there is no file, None when it is damaged."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Set ``key`` to ``entry`` in the cache file at ``path``. Best effort: an unwritable
    cache only costs a re-measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path) or {}
        data[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu-profile-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
