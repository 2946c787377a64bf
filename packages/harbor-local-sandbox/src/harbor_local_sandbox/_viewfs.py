"""Mounts made from descriptors: how the verifier's view is assembled without the host ever resolving
a path inside the agent's tree.

The agent's processes keep running while the view is made, so any path of theirs may change between
two system calls. Everything below the agent's root is therefore reached from a descriptor, one
level at a time, with ``openat2``'s ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``
(a link, or a ``..`` that climbs out, fails instead of leading anywhere), and mounted from that
descriptor (``open_tree``/``move_mount``): what was opened is what is mounted, whatever the path
says a moment later.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from functools import cache

__all__ = [
    "IN_ROOT", "STRICT", "attach", "attach_at", "clone_entry", "clone_tree", "detach", "open_beneath", "overlay",
    "read_only",
]  # fmt: skip

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT, _SYS_OPENAT2 = 428, 429, 430, 431, 432, 437
_OPEN_TREE_CLONE, _AT_RECURSIVE, _AT_EMPTY_PATH, _AT_SYMLINK_NOFOLLOW = 1, 0x8000, 0x1000, 0x100
_MOVE_MOUNT_F_EMPTY_PATH, _MOVE_MOUNT_T_EMPTY_PATH = 0x4, 0x40
_FSCONFIG_SET_FLAG, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 0, 1, 6
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x01, 0x02, 0x04, 0x08
_MNT_DETACH = 2
_SYS_MOUNT_SETATTR, _MOUNT_ATTR_RDONLY = 442, 0x1
#: How every path below the agent's root is resolved: never through a link, never out of the start.
STRICT = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
#: How a path of an image's (the task author's tree) is resolved: its links followed, absolute ones from
#: the image's root, never out of it.
IN_ROOT = 0x10 | _RESOLVE_NO_MAGICLINKS


@cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


_OPEN_HOW_SIZE = ctypes.c_size_t(24)


@cache
def _open_how(flags: int, resolve: int) -> ctypes.Array:
    """``openat2``'s ``struct open_how`` for these flags, made once (a view makes hundreds of opens)."""
    how = struct.pack("QQQ", flags | os.O_CLOEXEC, 0, resolve)
    return ctypes.create_string_buffer(how, len(how))


def open_beneath(dir_fd: int, path: str, flags: int = os.O_PATH | os.O_DIRECTORY, resolve: int = STRICT) -> int:
    """Open ``path`` below the folder ``dir_fd`` without following any link (``OSError`` otherwise:
    ``ELOOP`` for a link on the way, ``EXDEV`` for a way out, ``ENOENT``, ``ENOTDIR``).

    Args:
        dir_fd: Where the path starts.
        path: A relative path (a leading ``/`` is dropped: it is below ``dir_fd`` all the same).
        flags: ``open`` flags (``O_CLOEXEC`` is added).
        resolve: ``openat2`` resolve flags.

    Returns:
        The descriptor.
    """
    relative = path.lstrip("/") or "."
    fd = _libc().syscall(_SYS_OPENAT2, dir_fd, os.fsencode(relative), _open_how(flags, resolve), _OPEN_HOW_SIZE)
    return _check(fd, f"opening {path!r} beneath the view")


def clone_tree(fd: int, *, recursive: bool = False) -> int:
    """A detached copy of the mount at the folder or file ``fd`` (with what is mounted below it when
    ``recursive``), to attach elsewhere: its descriptor."""
    flags = _OPEN_TREE_CLONE | _AT_EMPTY_PATH | os.O_CLOEXEC | (_AT_RECURSIVE if recursive else 0)
    return _check(_libc().syscall(_SYS_OPEN_TREE, fd, b"", flags), "cloning a mount")


def clone_entry(dir_fd: int, name: str) -> int:
    """A detached copy of the mount at the entry ``name`` of the folder ``dir_fd`` (one component, a link
    never followed): its descriptor. For many entries of one folder, cheaper than opening each beneath a root."""
    if "/" in name or name in (".", ".."):
        raise OSError(errno.EINVAL, f"not one entry: {name!r}")
    flags = _OPEN_TREE_CLONE | _AT_SYMLINK_NOFOLLOW | os.O_CLOEXEC
    return _check(_libc().syscall(_SYS_OPEN_TREE, dir_fd, os.fsencode(name), flags), f"cloning {name!r}")


def attach_at(tree_fd: int, dir_fd: int, name: str) -> None:
    """Mount the detached tree ``tree_fd`` on the entry ``name`` of the folder ``dir_fd`` (one component, a link
    never followed)."""
    if "/" in name or name in (".", ".."):
        raise OSError(errno.EINVAL, f"not one entry: {name!r}")
    _check(
        _libc().syscall(_SYS_MOVE_MOUNT, tree_fd, b"", dir_fd, os.fsencode(name), _MOVE_MOUNT_F_EMPTY_PATH),
        f"attaching a mount on {name!r}",
    )


def attach(tree_fd: int, target_fd: int) -> None:
    """Mount the detached tree ``tree_fd`` on the folder or file ``target_fd`` (both descriptors)."""
    flags = _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH
    _check(_libc().syscall(_SYS_MOVE_MOUNT, tree_fd, b"", target_fd, b"", flags), "attaching a mount")


def overlay(lowers: list[str], upper: str, work: str, *, userxattr: bool) -> int:
    """A detached overlay (``lowers`` first on top; a layer may be ``/proc/self/fd/N``): its descriptor.

    ``redirect_dir`` and ``metacopy`` are off, as for every overlay of the local sandbox, and so is
    ``xino``: a file then reports the device of the layer it is in (the import guard tells the
    verifier's files from the agent's by it, ``_guard.py``).
    """
    libc = _libc()
    fs = _check(libc.syscall(_SYS_FSOPEN, b"overlay", 1), "opening an overlay")  # FSOPEN_CLOEXEC
    try:
        options = [("lowerdir", ":".join(lowers)), ("upperdir", upper), ("workdir", work), ("metacopy", "off")]
        options.append(("xino", "off"))
        options.append(("redirect_dir", "nofollow" if userxattr else "off"))
        if userxattr:
            options.append(("userxattr", None))
        for key, value in options:
            code = _FSCONFIG_SET_FLAG if value is None else _FSCONFIG_SET_STRING
            raw = None if value is None else os.fsencode(value)
            _check(libc.syscall(_SYS_FSCONFIG, fs, code, key.encode(), raw, 0), f"the overlay's {key}")
        _check(libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0), "making an overlay")
        return _check(libc.syscall(_SYS_FSMOUNT, fs, 1, 0), "mounting an overlay")  # FSMOUNT_CLOEXEC
    finally:
        os.close(fs)


def read_only(tree_fd: int) -> None:
    """Make the detached mount ``tree_fd`` read-only (``mount_setattr``)."""
    attr = struct.pack("QQQQ", _MOUNT_ATTR_RDONLY, 0, 0, 0)
    buffer = ctypes.create_string_buffer(attr, len(attr))
    _check(
        _libc().syscall(_SYS_MOUNT_SETATTR, tree_fd, b"", _AT_EMPTY_PATH, buffer, ctypes.c_size_t(len(attr))),
        "making a mount read-only",
    )


def detach(path: str) -> None:
    """Detach the mount at ``path`` (a host path of this package's) and everything below it, lazily."""
    if _libc().umount2(os.fsencode(path), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):
            raise OSError(code, os.strerror(code), path)
