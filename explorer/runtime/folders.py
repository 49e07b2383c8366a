"""Where real runs keep their job folders: one folder per user under the system's temporary
folder, one job folder per run inside it, named after the launching process.

A launcher that is killed outright (SIGKILL) cannot remove its job folder; the next run of
the same user removes every job folder whose launcher is gone (:func:`clean_stale`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def jobs_root() -> Path:
    """This user's folder of job folders (made private on first use). Where the name is taken
    by another user's folder, the system's temporary folder itself."""
    base = Path(tempfile.gettempdir())
    uid = os.getuid() if hasattr(os, "getuid") else 0
    root = base / f"explorer-{uid}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        st = root.lstat()
        if root.is_symlink() or (hasattr(os, "getuid") and st.st_uid != uid):
            return base
    except OSError:
        return base
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(root: Path) -> list[Path]:
    """Remove the job folders in ``root`` whose launcher (the process id their name starts
    with) no longer runs; the folders removed."""
    removed = []
    if not root.name.startswith("explorer-"):
        return removed  # the shared temporary folder: only our own names, never others'
    for p in root.glob("job-*"):
        pid = p.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                shutil.rmtree(p)
                removed.append(p)
    return removed


def temporary_folder(tag: str = "") -> tempfile.TemporaryDirectory:
    """A fresh folder under :func:`jobs_root` named after this process (``tag`` added to the
    name), removed by its ``cleanup``; stale ones of earlier launchers are removed first."""
    root = jobs_root()
    clean_stale(root)
    prefix = f"job-{os.getpid()}-" if root.name.startswith("explorer-") else "explorer-"
    return tempfile.TemporaryDirectory(prefix=prefix + tag, dir=root)


def job_folder(stack: contextlib.ExitStack) -> Path:
    """A fresh job folder for this run, removed when ``stack`` closes; stale ones of earlier
    launchers are removed first."""
    return Path(stack.enter_context(temporary_folder()))
