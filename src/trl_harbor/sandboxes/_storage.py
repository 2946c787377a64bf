"""A bound on what each local sandbox writes, with or without root (issue #13).

A sandbox's writable tree (its private root, or the upper layer of its image root) lives on the
host's ``/dev/shm`` by default. As root, its memory cgroup is charged for those pages; without
root nothing else bounds them, and one agent could fill the ``/dev/shm`` that GPU training needs
(NCCL, DataLoader workers) and every other sandbox's root. Two mechanisms bound it:

* every command in a sandbox runs with ``RLIMIT_FSIZE`` at the sandbox's bound (set by its
  supervisor): one file never outgrows it, however fast it is written (``EFBIG``);
* :class:`StorageGuard`, one thread per process for all its sandboxes, polls the state root's
  file system (one ``statvfs``) and measures the sandboxes' trees only when the file system grew
  by more than the smallest headroom left since the last measurement (or every few seconds when it
  changed at all). A sandbox that wrote more than its bound is killed with its reason; when the
  file system's free space falls under :data:`HOST_RESERVE_FRACTION` (at most
  :data:`HOST_RESERVE_MAX_BYTES`), the sandbox that wrote the most is killed too.

What a sandbox "wrote" is its tree's size (blocks in use, each inode once, plus files deleted but
still held open by its processes) minus the size it started with (the task's files), which is
what Docker's ``--storage-opt size`` bounds too (the container's writable layer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MB = 1 << 20
#: How often the file system's usage is read (one ``statvfs``: about a microsecond)...
POLL_SEC = 0.05
#: ... and while it grows: a writer on tmpfs goes at 1-2 GB/s, so each poll's delay is that many MB
#: past a bound (measured: 10-190 MB at 0.1 s, see docs/security.md).
FAST_POLL_SEC = 0.01
#: Trees are measured at least this often while the file system's usage changes at all: writes in
#: one sandbox can hide behind deletes in another between two polls.
FULL_EVERY_SEC = 5.0
#: Measuring is at most this share of the guard's time (many sandboxes with many files):
#: after a measurement that took ``t`` seconds, the next waits ``t * (1 / MAX_DUTY - 1)``.
MAX_DUTY = 0.25
#: Free space kept on the state root's file system for the host: GPU training uses ``/dev/shm``
#: (NCCL's buffers, DataLoader workers' batches: hundreds of MB to a few GB on a large node), and a
#: full tmpfs fails them with SIGBUS rather than an error. A tenth, capped for large file systems.
HOST_RESERVE_FRACTION = 0.10
HOST_RESERVE_MAX_BYTES = 4 << 30
#: Under the reserve, only a sandbox that wrote at least this much is killed: one that wrote less
#: did not fill the file system (something else of the host did), and would score 0 for nothing.
MIN_CULPRIT_BYTES = 8 * MB


def enabled() -> bool:
    """Whether the guard runs (``TRL_HARBOR_STORAGE_GUARD=0`` turns it off, for measurements only)."""
    return os.environ.get("TRL_HARBOR_STORAGE_GUARD", "1").strip().lower() not in ("0", "false", "no", "off")


def host_reserve(total_bytes: int) -> int:
    """The free space in bytes kept for the host on a file system of ``total_bytes``."""
    return min(int(total_bytes * HOST_RESERVE_FRACTION), HOST_RESERVE_MAX_BYTES)


def tree_bytes(path: Path | str) -> int:
    """Bytes in use by a directory tree: blocks of every entry, each inode once.

    Links are never followed and the walk stays on ``path``'s file system (an image root's
    overlay mount is not the sandbox's tree). A directory the sandbox made unreadable to the
    host (its root has ``CAP_DAC_OVERRIDE`` in its namespace, an unprivileged host does not) is
    opened for the walk and its mode put back.

    Args:
        path: The tree's root.

    Returns:
        The sum of ``st_blocks * 512``; 0 when ``path`` is gone.
    """
    try:
        top = os.lstat(path)
    except OSError:
        return 0
    device, seen, total = top.st_dev, set(), top.st_blocks * 512
    stack = [os.fspath(path)] if stat.S_ISDIR(top.st_mode) else []
    while stack:
        directory = stack.pop()
        for entry_path, info in _entries(directory):
            if info.st_dev != device:
                continue
            if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode):
                if info.st_ino in seen:
                    continue
                seen.add(info.st_ino)
            total += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                stack.append(entry_path)
    return total


def _entries(directory: str) -> list[tuple[str, os.stat_result]]:
    try:
        with os.scandir(directory) as it:
            found = []
            for entry in it:
                with contextlib.suppress(OSError):
                    found.append((entry.path, entry.stat(follow_symlinks=False)))
            return found
    except PermissionError:
        pass
    except OSError:
        return []
    try:
        mode = stat.S_IMODE(os.lstat(directory).st_mode)
        os.chmod(directory, mode | 0o700)
    except OSError:
        return []
    try:
        return _entries(directory) if os.access(directory, os.R_OK | os.X_OK) else []
    finally:
        with contextlib.suppress(OSError):
            os.chmod(directory, mode)


def deleted_open_bytes(pids: list[int], device: int) -> int:
    """Bytes of files on ``device`` that are deleted but still held open by ``pids``.

    A sandbox's process can write a file, delete it and keep it open: the walk no longer sees it,
    the file system still holds it. Best effort: a process that made itself non-dumpable hides its
    descriptors from an unprivileged host (the host's reserve still applies).

    Args:
        pids: Host PIDs of the sandbox's processes.
        device: The tree's file system (``st_dev``).

    Returns:
        The sum of their blocks, each inode once.
    """
    seen, total = set(), 0
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            link = f"/proc/{pid}/fd/{name}"
            try:
                if not os.readlink(link).endswith(" (deleted)"):
                    continue
                info = os.stat(link)
            except OSError:
                continue
            if info.st_dev == device and info.st_nlink == 0 and stat.S_ISREG(info.st_mode) and info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_blocks * 512
    return total


@dataclass(eq=False)
class _Watched:
    box: weakref.ReferenceType
    tree: Path
    device: int
    limit: int | None
    baseline: int = 0
    written: int = 0
    fs_root: str = ""


@dataclass(eq=False)
class _FileSystem:
    path: str
    used: int = 0
    used_at_measure: int = 0
    growth: int = 0
    growing: bool = False
    measured_at: float = 0.0
    warned_at: float = field(default=-1e9)


def _usage(path: str) -> tuple[int, int, int]:
    """``(total, used, free for unprivileged writers)`` bytes of the file system holding ``path``."""
    info = os.statvfs(path)
    total = info.f_blocks * info.f_frsize
    return total, total - info.f_bfree * info.f_frsize, info.f_bavail * info.f_frsize


class StorageGuard:
    """Kills the sandboxes that write past their storage bound or into the host's reserve.

    One per process (:data:`GUARD`); its thread runs while sandboxes are watched.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._watched: list[_Watched] = []
        self._file_systems: dict[int, _FileSystem] = {}
        self._dirty = False
        self._thread: threading.Thread | None = None

    def watch(self, box: Any, tree: Path, limit_bytes: int | None) -> None:
        """Start watching a started sandbox (blocking: measures its tree once).

        Args:
            box: The sandbox; it must have ``storage_exhausted(reason)`` (kills it) and
                ``host_pids()``.
            tree: Its writable tree on the host.
            limit_bytes: Its bound on what it writes, or ``None`` (the host's reserve only).
        """
        if not enabled():
            return
        device = os.lstat(tree).st_dev
        watched = _Watched(weakref.ref(box), tree, device, limit_bytes, baseline=tree_bytes(tree))
        fs_root = str(tree.parent)  # the state root: it outlives any one box
        with self._lock:
            system = self._file_systems.get(device)
            if system is None:
                system = self._file_systems[device] = _FileSystem(fs_root)
                with contextlib.suppress(OSError):
                    system.used = system.used_at_measure = _usage(fs_root)[1]
                system.measured_at = time.monotonic()
            watched.fs_root = system.path
            self._watched.append(watched)
            self._dirty = True  # its headroom counts from now
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="trl-harbor-storage-guard", daemon=True)
                self._thread.start()
            self._wake.notify()

    def forget(self, box: Any) -> None:
        """Stop watching a sandbox (it was stopped).

        Args:
            box: The sandbox given to :meth:`watch`.
        """
        with self._lock:
            self._watched = [w for w in self._watched if w.box() is not None and w.box() is not box]
            live = {w.device for w in self._watched}
            for device in [d for d in self._file_systems if d not in live]:
                del self._file_systems[device]

    def _run(self) -> None:
        next_measure, growing = 0.0, False
        while True:
            with self._lock:
                while not self._watched:
                    self._wake.wait()
                self._wake.wait(FAST_POLL_SEC if growing else POLL_SEC)
                watched = list(self._watched)
                systems = dict(self._file_systems)
                dirty, self._dirty = self._dirty, False
            try:
                now = time.monotonic()
                due = []
                for device, system in systems.items():
                    boxes = [w for w in watched if w.device == device]
                    if self._due(system, boxes, now, dirty) and now >= next_measure:
                        due.append((system, boxes))
                    elif dirty:
                        with self._lock:
                            self._dirty = True  # measured once the duty cycle allows
                growing = any(system.growing for system in systems.values())
                for system, boxes in due:
                    started = time.monotonic()
                    self._measure(system, boxes)
                    spent = time.monotonic() - started
                    next_measure = time.monotonic() + spent * (1 / MAX_DUTY - 1)
            except Exception:  # noqa: BLE001 - the guard must outlive any one failure
                logger.exception("the sandbox storage guard failed one round")

    @staticmethod
    def _due(system: _FileSystem, boxes: list[_Watched], now: float, dirty: bool) -> bool:
        """Whether the trees on one file system must be measured now (one ``statvfs``)."""
        try:
            total, used, free = _usage(system.path)
        except OSError:
            live = [str(w.tree.parent) for w in boxes if os.path.isdir(w.tree.parent)]
            if not live:
                return False
            system.path = live[0]
            total, used, free = _usage(system.path)
        system.growing = used > system.used
        system.growth += max(0, used - system.used)
        system.used = used
        headroom = min((w.limit - w.written for w in boxes if w.limit is not None), default=None)
        if dirty or free < host_reserve(total):
            return True
        if headroom is not None and system.growth > max(0, headroom):
            return True
        return now - system.measured_at >= FULL_EVERY_SEC and used != system.used_at_measure

    def _measure(self, system: _FileSystem, boxes: list[_Watched]) -> None:
        """Measure every tree on one file system; kill the sandboxes past their bound or the host's reserve."""
        system.used_at_measure, system.growth, system.measured_at = system.used, 0, time.monotonic()
        alive = []
        for watched in boxes:
            box = watched.box()
            if box is None or getattr(box, "closed", False):
                continue
            size = tree_bytes(watched.tree) + deleted_open_bytes(box.host_pids(), watched.device)
            watched.written = size - watched.baseline
            if watched.limit is not None and watched.written > watched.limit:
                self._kill(
                    watched,
                    box,
                    f"its storage limit: wrote {watched.written // MB} MB (limit {watched.limit // MB} MB)",
                )
            else:
                alive.append((watched, box))
        try:
            total, _, free = _usage(system.path)
        except OSError:
            return
        reserve = host_reserve(total)
        while free < reserve and alive:
            watched, box = max(alive, key=lambda pair: pair[0].written)
            if watched.written < MIN_CULPRIT_BYTES:
                if time.monotonic() - system.warned_at > 60:
                    system.warned_at = time.monotonic()
                    logger.warning(
                        "the sandboxes' file system (%s) has %d MB free, under the host's reserve of %d MB, "
                        "and no sandbox of this process wrote %d MB or more: something else fills it",
                        system.path, free // MB, reserve // MB, MIN_CULPRIT_BYTES // MB,
                    )  # fmt: skip
                return
            self._kill(
                watched,
                box,
                f"the host's storage reserve: wrote {watched.written // MB} MB when the sandboxes' file system had "
                f"{free // MB} MB free (reserve {reserve // MB} MB)",
            )
            alive.remove((watched, box))
            with contextlib.suppress(OSError):
                free = _usage(system.path)[2]

    def _kill(self, watched: _Watched, box: Any, reason: str) -> None:
        logger.warning("trl-harbor: killing sandbox %s: it ran into %s", watched.tree, reason)
        with self._lock, contextlib.suppress(ValueError):
            self._watched.remove(watched)
        try:
            box.storage_exhausted(reason)
        except Exception:  # noqa: BLE001 - one sandbox's teardown must not stop the guard
            logger.exception("killing sandbox %s failed", watched.tree)


#: The process's guard.
GUARD = StorageGuard()
