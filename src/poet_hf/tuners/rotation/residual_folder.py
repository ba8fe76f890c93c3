"""The folder of the residual files (`poet_hf.tuners.rotation.residual_store`): where it is, what it may hold, and
cleaning up after killed processes.

A model's layers write their files into a folder of their own, ``poet-residuals-<pid>-*``, under the *parent
folder*: the system temp folder (``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp``) unless
`poet_hf.tuners.rotation.model.set_residual_folder` (or the training argument ``--residual_folder``) names another.
A `ResidualFolder`, which the model's `RotationStepState` owns, keeps where that is and which stores write there; the
folder is removed when the model is freed, or when the process exits. A process
killed by a signal it cannot catch (``SIGKILL``: an OOM kill, a preempted job) leaves its folder behind; the next
process that opens a folder under the same parent finds it and removes it. A live process holds an exclusive
``flock`` on the ``.lock`` file of its folder for its lifetime, so only folders whose owner has died are removed
(the kernel releases the lock with the process, whatever killed it).

Before the first file is written the free space of the parent is checked against the bytes its residual files
will take (`check_free_space`), and a parent on a ``tmpfs`` gets a warning: there the files are RAM that the
process's RSS does not show.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["ResidualFolder", "ResidualSpaceError", "check_free_space", "remove_stale_folders"]

PREFIX = "poet-residuals-"
LOCK_FILE = ".lock"
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


class ResidualSpaceError(OSError):
    """The residual folder's disk has less free space than the residual files need."""


class FileStore(Protocol):
    """A residual store as the free-space check counts it (`poet_hf.tuners.rotation.residual_store.ResidualStore`)."""

    expected_bytes: int

    @property
    def on_disk(self) -> bool: ...

    def file_bytes(self) -> int: ...


class ResidualFolder:
    """Where one model's residual files go, and the stores that write there.

    Args:
        parent: the parent folder of the ``poet-residuals-<pid>-*`` folder (``None``: the system temp folder).
    """

    def __init__(self, parent: str | os.PathLike | None = None) -> None:
        self._parent: str | None = None
        self._folder: Path | None = None  # removed, with its lock released, when this object goes or the process exits
        self._stores: weakref.WeakSet[Any] = weakref.WeakSet()
        self._checked: Path | None = None  # the parent whose free space was checked
        self.set_parent(parent)

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy writes under the same parent, into a folder of its own."""
        return ResidualFolder, (self._parent,)

    def set_parent(self, path: str | os.PathLike | None) -> None:
        """Write the files from now on under ``path`` (``None``: the system temp folder), created if missing.

        Files already written stay where they are while their stores read them.

        Raises:
            ValueError: ``path`` exists and is not a folder.
        """
        if path is not None:
            parent = Path(path).expanduser()
            if parent.exists() and not parent.is_dir():
                raise ValueError(f"`residual_folder` must be a folder, got the file {str(parent)!r}")
            parent.mkdir(parents=True, exist_ok=True)
            path = str(parent)
        if path != self._parent:
            self._parent, self._folder = path, None  # the earlier folder stays until this object goes

    @property
    def parent(self) -> Path:
        """The parent folder of the files (`set_parent`, else the system temp folder)."""
        return Path(self._parent or tempfile.gettempdir())

    def current(self) -> Path | None:
        """The folder if one is open (files were written), else ``None``."""
        return self._folder

    def path(self) -> Path:
        """The folder, created (and the parent's stale folders removed) on first use."""
        if self._folder is None:
            parent = self.parent
            parent.mkdir(parents=True, exist_ok=True)
            remove_stale_folders(parent)
            _warn_if_ram(parent)
            folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
            weakref.finalize(self, _remove_folder, folder, _hold_lock(folder))
            self._folder = folder
        return self._folder

    def register(self, store: FileStore) -> None:
        """Count ``store`` in the free-space check while it lives."""
        self._stores.add(store)

    def disk_bytes(self) -> tuple[int, int]:
        """What the files of the live stores bound for disk will take, and what their files hold now."""
        stores = [store for store in list(self._stores) if store.on_disk]
        return sum(store.expected_bytes for store in stores), sum(store.file_bytes() for store in stores)

    def check_disk_space(self, free: Callable[[Path], int] | None = None) -> None:
        """Check the parent's free space against what the files will take (`disk_bytes`, `check_free_space`).

        Where any file is to be written, removes the folders of dead processes first (`remove_stale_folders`).
        Runs before the first merge (and file), and whenever the parent changes; ``PoetTrainer`` also runs it before
        training.

        Args:
            free: the free bytes of a folder (default ``shutil.disk_usage(folder).free``).

        Raises:
            ResidualSpaceError: the disk cannot hold them (the message names the folder and the bytes).
        """
        needed, written = self.disk_bytes()
        if not needed:  # no residual file is to be written: nothing to check, nothing to clean
            return
        remove_stale_folders(self.parent)  # their space is free again
        check_free_space(self.parent, needed, written, free)
        self._checked = self.parent

    def check_disk_space_once(self) -> None:
        """`check_disk_space`, unless it passed for the current parent already."""
        if self._checked != self.parent:
            self.check_disk_space()


def _remove_folder(folder: Path, lock: int | None) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if lock is not None:
        os.close(lock)


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
    try:
        handle = os.open(lock, os.O_RDWR)
    except FileNotFoundError:  # its owner removed it since: a model was freed in that process
        return True
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
    pid runs (this process's folders among them), is left alone."""
    removed = []
    for folder in sorted(parent.glob(f"{PREFIX}*")):
        if not folder.is_dir() or not folder.name.removeprefix(PREFIX).split("-")[0].isdigit():
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


def check_free_space(
    parent: Path, needed_bytes: int, written_bytes: int = 0, free: Callable[[Path], int] | None = None
) -> None:
    """Refuse to start writing residual files that the parent folder's disk cannot hold.

    Args:
        parent: the parent folder of the files.
        needed_bytes: what the residual files of every layer will take.
        written_bytes: what of it is already on that disk (files being rewritten take no new space).
        free: the free bytes of a folder (default ``shutil.disk_usage(folder).free``).

    Raises:
        ResidualSpaceError: fewer free bytes than ``needed_bytes − written_bytes``; the message names the folder,
            both figures and the settings that change them.
    """
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
