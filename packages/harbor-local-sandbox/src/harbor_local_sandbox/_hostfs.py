"""Copying files in and out of a sandbox's tree from the host (and removing it), safe against links.

The sandbox's writable root is a directory on the host that the agent controls. Any
component of a path inside it may be a symbolic link the agent planted to point at a
host file. Every copy therefore walks paths one component at a time with ``O_NOFOLLOW``
relative to an open directory descriptor (and :func:`shutil.rmtree` removes links, never
following them): nothing outside the sandbox's own tree is ever read or written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Any

logger = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


#: Bytes one download from a sandbox may hold (the data of its files; holes are free).
DOWNLOAD_CAP_BYTES = 1 << 30
#: Folders one download from a sandbox may go down, below the folder downloaded.
DOWNLOAD_MAX_DEPTH = 64
#: Entries (files, folders, the links and special files skipped) one download may hold.
DOWNLOAD_MAX_ENTRIES = 100_000
#: Bytes of an entry's path below the folder downloaded, at most (its copy's path on the host stays
#: within the host's ``PATH_MAX``).
DOWNLOAD_MAX_PATH_BYTES = 2048
#: Errors of the host itself while a download is written there (its disk, its descriptors, its
#: memory): not the sandbox's doing, raised as they are.
_HOST_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EACCES,
     errno.EPERM}
)  # fmt: skip


class DownloadTooLargeError(OSError):
    """A download from a sandbox holds more than its bounds (bytes, entries, depth, a path's length):
    what the sandbox left is not copied."""

    unsafe = True


class UncopyableTreeError(OSError):
    """A download from a sandbox failed on what the sandbox holds (an entry that vanished or changed
    while it was copied, a name the host cannot hold): the sandbox's doing, never the host's."""

    unsafe = True


class _Budget:
    """What is left of a download's cap."""

    def __init__(self, cap: int) -> None:
        self.left = cap

    def take(self, size: int, where: str) -> None:
        if size > self.left:
            raise DownloadTooLargeError(errno.EFBIG, f"{where}: the download holds more than its cap")
        self.left -= size


class UnsafePathError(OSError):
    """A sandbox path crosses a symbolic link or leaves the sandbox's tree."""

    unsafe = True


def _parts(path: str | PurePosixPath) -> list[str]:
    posix = PurePosixPath(path)
    if not posix.is_absolute():
        raise ValueError(f"sandbox paths must be absolute, got {str(path)!r}")
    parts = [p for p in posix.parts[1:] if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePathError(errno.EPERM, f"'..' is not allowed in sandbox path {str(path)!r}")
    return parts


def _open_dir(root: Path, parts: list[str], create: bool) -> int:
    """Open the directory ``root/parts...`` without following any link."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(
                        error.errno, f"{name!r} in the sandbox path is a link or not a directory"
                    ) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _copy_data(src_fd: int, dst_fd: int, budget: _Budget, where: str) -> None:
    """Copy a file's data, not its holes (a sparse file stays sparse), within ``budget``."""
    size = os.fstat(src_fd).st_size
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src_fd, offset, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = os.lseek(src_fd, start, os.SEEK_HOLE)
        budget.take(end - start, where)
        os.lseek(src_fd, start, os.SEEK_SET)
        os.lseek(dst_fd, start, os.SEEK_SET)
        left = end - start
        while left > 0:
            chunk = os.read(src_fd, min(_CHUNK, left))
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst_fd, view) :]
            left -= len(chunk)
        offset = end
    os.ftruncate(dst_fd, size)


def _write_into(dir_fd: int, name: str, source: Path) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)  # replaces a planted link instead of following it
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise
    mode = stat.S_IMODE(source.stat().st_mode)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    dst = os.open(name, flags, mode, dir_fd=dir_fd)
    try:
        src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _copy_data(src, dst, _Budget(1 << 62), str(source))  # holes stay holes in the sandbox too
        finally:
            os.close(src)
        os.fchmod(dst, mode)
    finally:
        os.close(dst)


def write_text(root: Path, target: str, text: str | bytes, mode: int = 0o644) -> None:
    """Write ``text`` (or bytes) to the sandbox path ``target`` under ``root``, replacing (never following) what
    is there."""
    parts = _parts(target)
    parent = _open_dir(root, parts[:-1], create=True)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(parts[-1], dir_fd=parent)
        fd = os.open(
            parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent
        )
        try:
            os.write(fd, text.encode() if isinstance(text, str) else text)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def upload_file(root: Path, source: Path, target: str) -> None:
    """Copy the host file ``source`` to the sandbox path ``target`` under ``root``."""
    parts = _parts(target)
    if not parts:
        raise IsADirectoryError(target)
    parent = _open_dir(root, parts[:-1], create=True)
    try:
        _write_into(parent, parts[-1], Path(source))
    finally:
        os.close(parent)


def _upload_tree(dir_fd: int, source: Path) -> None:
    for entry in os.scandir(source):
        if entry.is_symlink():
            target = os.readlink(entry.path)
            try:
                os.unlink(entry.name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            os.symlink(target, entry.name, dir_fd=dir_fd)
        elif entry.is_dir():
            try:
                os.mkdir(entry.name, stat.S_IMODE(entry.stat().st_mode) | 0o700, dir_fd=dir_fd)
            except FileExistsError:
                pass
            child = _open_dir_at(dir_fd, entry.name)
            try:
                _upload_tree(child, Path(entry.path))
            finally:
                os.close(child)
        elif entry.is_file():
            _write_into(dir_fd, entry.name, Path(entry.path))


def _open_dir_at(dir_fd: int, name: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(error.errno, f"{name!r} is a link or not a directory") from None
        raise


def upload_dir(root: Path, source: Path, target: str) -> None:
    """Copy the contents of the host directory ``source`` into the sandbox directory ``target``."""
    fd = _open_dir(root, _parts(target), create=True)
    try:
        _upload_tree(fd, Path(source))
    finally:
        os.close(fd)


def download_file(root: Path, source: str, target: Path, cap: int = DOWNLOAD_CAP_BYTES) -> None:
    """Copy the sandbox file ``source`` to the host path ``target`` (its data only, sparse files stay sparse).

    Raises:
        UnsafePathError: If any component of ``source`` is a link.
        DownloadTooLargeError: If the file holds more than ``cap`` bytes of data.
        FileNotFoundError: If ``source`` does not exist.
    """
    parts = _parts(source)
    if not parts:
        raise IsADirectoryError(source)
    parent = _open_dir(root, parts[:-1], create=False)
    try:
        try:
            src = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=parent)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafePathError(error.errno, f"{source!r} is a link") from None
            raise
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise UnsafePathError(errno.EINVAL, f"{source!r} is not a regular file")
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        with open(target, "wb") as out:
            _copy_data(src, out.fileno(), _Budget(cap), source)
    finally:
        os.close(src)


class _Tree:
    """What is left of a download's bounds (:data:`DOWNLOAD_MAX_ENTRIES`, :data:`DOWNLOAD_MAX_DEPTH`,
    :data:`DOWNLOAD_MAX_PATH_BYTES`), and the entries it skipped."""

    def __init__(self, budget: _Budget) -> None:
        self.budget = budget
        self.entries = 0
        self.skipped: list[str] = []
        self.skipped_count = 0

    def enter(self, where: str, relative: str, depth: int) -> None:
        self.entries += 1
        if self.entries > DOWNLOAD_MAX_ENTRIES:
            raise DownloadTooLargeError(
                errno.EFBIG, f"{where}: the download holds more than {DOWNLOAD_MAX_ENTRIES} entries"
            )
        if depth > DOWNLOAD_MAX_DEPTH:
            raise DownloadTooLargeError(errno.EFBIG, f"{where}: more than {DOWNLOAD_MAX_DEPTH} folders deep")
        if len(os.fsencode(relative)) > DOWNLOAD_MAX_PATH_BYTES:
            raise DownloadTooLargeError(
                errno.ENAMETOOLONG, f"{where[:200]}...: a path longer than {DOWNLOAD_MAX_PATH_BYTES} bytes"
            )


def _download_tree(dir_fd: int, target: Path, where: str, tree: _Tree, relative: str = "", depth: int = 0) -> None:
    target.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    with os.scandir(dir_fd) as listing:  # read no further than the entries left to copy
        for entry in listing:
            names.append(entry.name)
            if tree.entries + len(names) > DOWNLOAD_MAX_ENTRIES:
                raise DownloadTooLargeError(
                    errno.EFBIG, f"{where}: the download holds more than {DOWNLOAD_MAX_ENTRIES} entries"
                )
    for name in names:
        child_relative = f"{relative}/{name}"
        tree.enter(f"{where}/{name}", child_relative, depth + 1)
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # gone since it was listed
        path = target / name
        if stat.S_ISDIR(info.st_mode):
            child = _open_dir_at(dir_fd, name)
            try:
                _download_tree(child, path, f"{where}/{name}", tree, child_relative, depth + 1)
            finally:
                os.close(child)
        elif stat.S_ISREG(info.st_mode):
            # Non-blocking: a FIFO swapped in since the entry was read never makes the copy wait.
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
            try:
                if not stat.S_ISREG(os.fstat(src).st_mode):
                    raise UnsafePathError(errno.EINVAL, f"{where}/{name!r} is not a regular file any more")
                if path.is_symlink() or path.is_dir():
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                with open(path, "wb") as out:
                    _copy_data(src, out.fileno(), tree.budget, f"{where}/{name}")
            finally:
                os.close(src)
        else:
            # Links, FIFOs, sockets and devices carry no content we may follow.
            tree.skipped_count += 1
            if len(tree.skipped) < 5:
                tree.skipped.append(f"{where}/{name}")


def download_dir(root: Path, source: str, target: Path, cap: int = DOWNLOAD_CAP_BYTES) -> None:
    """Copy the contents of the sandbox directory ``source`` into the host directory ``target``.

    Regular files and directories are copied, their data only (sparse files stay sparse), within
    bounds: ``cap`` bytes in all, :data:`DOWNLOAD_MAX_ENTRIES` entries, :data:`DOWNLOAD_MAX_DEPTH`
    folders deep, paths of :data:`DOWNLOAD_MAX_PATH_BYTES` bytes below ``source``
    (``DownloadTooLargeError``). Links and special files are skipped, so a link the agent planted
    never makes the host read its own files.

    Every failure that what the sandbox holds causes is marked as the sandbox's (``unsafe``: a
    trainer's grading scores it as the rollout's doing, never the infrastructure's): past a bound,
    a link (``UnsafePathError``), and any other error on the sandbox's entries or on the names they
    give their copies (``UncopyableTreeError``: an entry that vanished, a name the host's file system
    cannot hold). The host's own errors (its disk full, out of descriptors or memory) are raised as
    they are.
    """
    fd = _open_dir(root, _parts(source), create=False)
    tree = _Tree(_Budget(cap))
    where = source.rstrip("/")
    try:
        _download_tree(fd, Path(target), where, tree)
    except (UnsafePathError, DownloadTooLargeError, UncopyableTreeError):
        raise
    except OSError as error:
        if error.errno in _HOST_ERRNOS:
            raise
        raise UncopyableTreeError(
            error.errno or errno.EIO, f"{where}: the sandbox's tree cannot be copied: {error}"
        ) from error
    except (ValueError, UnicodeError, RecursionError) as error:
        raise UncopyableTreeError(errno.EINVAL, f"{where}: the sandbox's tree cannot be copied: {error!r}") from error
    finally:
        os.close(fd)
    if tree.skipped_count:
        logger.warning(
            "skipped %d entries of %s that are not regular files or folders (%s%s)", tree.skipped_count, where,
            ", ".join(repr(p) for p in tree.skipped), ", ..." if tree.skipped_count > len(tree.skipped) else "",
        )  # fmt: skip


def hash_tree(digest: Any, directory: Path) -> None:
    """Feed a folder's files (relative names, modes, contents; links as their targets) to ``digest``.

    Args:
        digest: A ``hashlib`` hash object.
        directory: The folder (a build context).
    """
    for path in sorted(p for p in directory.rglob("*") if p.is_file() or p.is_symlink()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        if path.is_symlink():
            digest.update(b"link:" + os.readlink(path).encode())
        else:
            digest.update(oct(path.stat().st_mode & 0o777).encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())


def remove_tree(path: Path) -> None:
    """Remove a sandbox's private tree, even parts the agent made read-only."""

    def _retry(func, target, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(target)

    if path.exists():
        shutil.rmtree(path, onexc=_retry)
