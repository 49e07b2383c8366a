"""The host measurement cache: one JSON file of what was measured on this host, by key.

Keys name the host, the torch version and the rank settings (:func:`cache_key`); entries are
read and written through :mod:`explorer.core.cachefile`: read without trusting the bytes,
written atomically and merged under a lock with what other processes wrote meanwhile. An
unreadable, damaged or unwritable cache only means measuring again.
"""

from __future__ import annotations

import math
import os
import socket
import warnings
from pathlib import Path
from typing import Any

from explorer.core import cachefile
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
    try:
        data = cachefile.read(path)
    except cachefile.DamagedFile as exc:
        why = str(exc)
    else:
        if data is None or isinstance(data, dict):
            return data or {}
        why = "not a JSON object"
    warnings.warn(f"the host measurement cache {path} is damaged ({why}); measuring again "
                  "and replacing it", stacklevel=2)
    return {}


def finite_number(x: Any) -> bool:
    """Whether ``x`` is a finite number >= 0 (not a bool): what a cached measurement holds."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) \
        and abs(x) < cachefile.MAX_WHOLE and math.isfinite(x) and x >= 0


def warn_damaged(path: Path, key: str, why: str) -> None:
    """Say that the entry ``key`` of the cache at ``path`` is unusable and measured again."""
    warnings.warn(f"the host measurement cache entry {key!r} in {path} is damaged or "
                  f"incomplete ({why}); measuring again and replacing it", stacklevel=3)


def write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Set ``key`` to ``entry`` in the cache file at ``path``, keeping the other entries as
    they are on disk now (under the file's lock: entries other processes write meanwhile are
    not lost). Best effort: an unwritable cache only costs a re-measurement next time."""
    try:
        cachefile.update(path, lambda entries: entries.__setitem__(key, entry))
    except OSError:
        pass
