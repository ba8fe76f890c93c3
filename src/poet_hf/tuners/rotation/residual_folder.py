"""The folder of the residual files (`poet_hf.tuners.rotation.residual_store`): where it is, what it may hold, and
cleaning up after killed processes.

Each process writes its files into a folder of its own, ``poet-residuals-<pid>-*``, under the *parent folder*: the
system temp folder (``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp``) unless `set_residual_folder` (or the
training argument ``--residual_folder``) names another. The folder is removed when the process exits. A process
killed by a signal it cannot catch (``SIGKILL``: an OOM kill, a preempted job) leaves its folder behind; the next
process that opens a folder under the same parent finds it and removes it. A live process holds an exclusive
``flock`` on the ``.lock`` file of its folder for its lifetime, so only folders whose owner has died are removed
(the kernel releases the lock with the process, whatever killed it).

Before the first file is written the process checks the parent's free space against the bytes its residual files
will take (`check_free_space`), and a parent on a ``tmpfs`` gets a warning: there the files are RAM that the
process's RSS does not show.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "ResidualSpaceError",
    "check_free_space",
    "current_folder",
    "process_folder",
    "remove_stale_folders",
    "residual_parent",
    "set_residual_folder",
]

PREFIX = "poet-residuals-"
LOCK_FILE = ".lock"
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


class ResidualSpaceError(OSError):
    """The residual folder's disk has less free space than the residual files need."""


_STATE: dict = {"parent": None, "folder": None, "lock": None, "earlier": []}


def set_residual_folder(path: str | os.PathLike | None) -> None:
    """Write this process's residual files under ``path`` (``None``: the system temp folder).

    Takes effect for the files written from now on (files already written stay where they are, until the process
    exits); the folder is created if missing.

    Args:
        path: the parent folder of this process's ``poet-residuals-<pid>-*`` folder, or ``None``.

    Raises:
        ValueError: ``path`` exists and is not a folder.
    """
    if path is not None:
        parent = Path(path).expanduser()
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"`residual_folder` must be a folder, got the file {str(parent)!r}")
        parent.mkdir(parents=True, exist_ok=True)
        path = str(parent)
    if path != _STATE["parent"]:
        _STATE["parent"] = path
        _close()


def residual_parent() -> Path:
    """The parent folder of the residual files (`set_residual_folder`, else the system temp folder)."""
    return Path(_STATE["parent"] or tempfile.gettempdir())


def current_folder() -> Path | None:
    """This process's residual folder if one is open (files were written), else ``None``."""
    return Path(_STATE["folder"].name) if _STATE["folder"] is not None else None


def process_folder() -> Path:
    """This process's residual folder, created (and the parent's stale folders removed) on first use."""
    if _STATE["folder"] is None:
        parent = residual_parent()
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_folders(parent)
        _warn_if_ram(parent)
        folder = tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)
        _STATE.update(folder=folder, lock=_hold_lock(Path(folder.name)))
    return Path(_STATE["folder"].name)


def _close() -> None:
    """Open a new folder on next use. The current one stays, with its lock, until the process exits: the stores
    that wrote files there read them from there."""
    if _STATE["folder"] is not None:
        _STATE["earlier"].append((_STATE["folder"], _STATE["lock"]))
    _STATE.update(folder=None, lock=None)


def _hold_lock(folder: Path) -> int | None:
    """Take the exclusive lock of ``folder`` for this process's lifetime (no lock where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: stale folders are left alone
        return None
    handle = os.open(folder / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def _owner_alive(folder: Path) -> bool:
    """Whether the process that made ``folder`` still runs: it holds the lock, or (no lock file yet) its pid runs."""
    try:
        import fcntl
    except ImportError:
        return True
    lock = folder / LOCK_FILE
    if not lock.exists():  # between the folder's creation and its lock, or not one of ours: judge by the pid
        pid = folder.name.removeprefix(PREFIX).split("-")[0]
        if not pid.isdigit():
            return True
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    handle = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(handle)
    return False


def remove_stale_folders(parent: Path) -> list[Path]:
    """Remove the residual folders under ``parent`` whose process has died; returns them.

    A folder is this package's if its name is ``poet-residuals-<pid>-*``; one whose owner holds its lock, or whose
    pid runs, is left alone."""
    removed = []
    for folder in sorted(parent.glob(f"{PREFIX}*")):
        own = _STATE["folder"] is not None and folder == Path(_STATE["folder"].name)
        if own or not folder.is_dir() or not folder.name.removeprefix(PREFIX).split("-")[0].isdigit():
            continue
        if not _owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        logger.info("removed %d residual folder(s) of dead processes under %s", len(removed), parent)
    return removed


def filesystem_type(path: Path) -> str | None:
    """The type of the file system ``path`` is on (``/proc/self/mounts``), or ``None`` where it is unknown."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved, best, kind = str(path.resolve()), "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def _warn_if_ram(parent: Path) -> None:
    kind = filesystem_type(parent)
    if kind in RAM_FILESYSTEMS:
        warnings.warn(
            f"the residual files go to {str(parent)!r}, a {kind}: they take RAM that the process's RSS does not "
            "show. Point `residual_folder` (--residual_folder) or TMPDIR at a disk to keep them out of memory.",
            stacklevel=3,
        )


def check_free_space(needed_bytes: int, written_bytes: int = 0, free: Callable[[Path], int] | None = None) -> None:
    """Refuse to start writing residual files that the parent folder's disk cannot hold.

    Args:
        needed_bytes: what the residual files of every layer will take.
        written_bytes: what of it is already on that disk (files being rewritten take no new space).
        free: the free bytes of a folder (default ``shutil.disk_usage(folder).free``).

    Raises:
        ResidualSpaceError: fewer free bytes than ``needed_bytes − written_bytes``; the message names the folder,
            both figures and the settings that change them.
    """
    parent = residual_parent()
    parent.mkdir(parents=True, exist_ok=True)
    available = (free or (lambda folder: shutil.disk_usage(folder).free))(parent)
    missing = needed_bytes - written_bytes
    if missing > available:
        raise ResidualSpaceError(
            f"the residual files need {missing / 2**20:,.0f} MiB under {str(parent)!r}, which has "
            f"{available / 2**20:,.0f} MiB free. Set `residual_folder` (--residual_folder) or TMPDIR to a folder with "
            'room, or keep the residual elsewhere: residual_storage="layer" (in memory, 1.06 B per 4-bit W0 entry) '
            'or requantize="nearest" (no residual, more drift).'
        )
