"""Where real runs keep their job folders: one folder per user under the system's temporary
folder, one job folder per run inside it, named after the launching process.

A launcher that is killed outright (SIGKILL) cannot remove its job folder; the next run of
the same user removes every job folder whose launcher is gone (:func:`clean_stale`). A folder
that cannot be written because its file system is full is said so, with the space left and
where else to go (:func:`full_message`), before a run (:func:`space_errors`) and by the
launcher when a rank meets it during one (:data:`FULL_EXIT`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from explorer.core.errors import ExplorerError
from explorer.core.units import format_bytes

#: the exit code of a rank that could not even report its failure because its folder is full
#: (ENOSPC's number on Linux): the launcher reads it where no file can say more
FULL_EXIT = 28


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
    name), removed by its ``cleanup``; stale ones of earlier launchers are removed first. A
    full file system raises an :class:`ExplorerError` that says so (:func:`full_message`)."""
    root = jobs_root()
    clean_stale(root)
    prefix = f"job-{os.getpid()}-" if root.name.startswith("explorer-") else "explorer-"
    with space_errors(root):
        return tempfile.TemporaryDirectory(prefix=prefix + tag, dir=root)


def job_folder(stack: contextlib.ExitStack) -> Path:
    """A fresh job folder for this run, removed when ``stack`` closes; stale ones of earlier
    launchers are removed first."""
    return Path(stack.enter_context(temporary_folder()))


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says a file could not be written for want of space: the file system or
    the user's quota is full (ENOSPC, EDQUOT), or torch's archive writer wrote short (its
    ``inline_container.cc`` errors, which carry no errno)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return isinstance(exc, RuntimeError) and "inline_container.cc" in text and (
        "unexpected pos" in text or "failed writing" in text)


def space_left_bytes(folder: Path) -> int | None:
    """Bytes free on the file system that holds ``folder`` (or its nearest existing parent);
    None where that cannot be read."""
    for p in (folder, *folder.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(p).free
    return None


def full_message(folder: Path) -> str:
    """What to tell a user whose run could not write ``folder`` for want of space."""
    free = space_left_bytes(folder)
    room = f"{format_bytes(free)} free" if free is not None else "free space unknown"
    return (f"the temporary folder is full: {folder} could not be written ({room} on its "
            "file system); real runs write their job folder there. Free some space, or set "
            "TMPDIR to a folder with more room before Python starts (in a running notebook: "
            "import tempfile; tempfile.tempdir = '/other/folder')")


@contextlib.contextmanager
def space_errors(folder: Path) -> Iterator[None]:
    """Raise an :class:`ExplorerError` saying ``folder`` is full (:func:`full_message`) where
    writing in it fails for want of space (:func:`no_space`), not the system's or torch's
    own error."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if not no_space(exc):
            raise
        raise ExplorerError(full_message(folder)) from exc
