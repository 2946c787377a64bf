"""What a box mounts: its own ``/proc`` and ``/dev``, hardened as Docker does; and what the host mounts
for it: the overlay over its image root, and the bounded tmpfs its tree is on."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from functools import cache
from pathlib import Path

from harbor_local_sandbox._userns import in_user_namespace
from harbor_local_sandbox.errors import SandboxStartError

#: Box paths that are the kernel's, not files of any root.
KERNEL_MOUNTS = ("/proc", "/dev", "/sys")
#: Size of ``/dev/shm`` in a box with a storage bound (Docker's default ``--shm-size``).
DEV_SHM_BYTES = 64 << 20
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
_PROC_MASKED = ("kcore", "keys", "latency_stats", "timer_list", "timer_stats", "sched_debug", "acpi", "scsi")


def kernel_fs_args(storage_bound: bool) -> list[str]:
    """bubblewrap arguments for the box's ``/proc`` and ``/dev`` (``storage_bound``: read-only, but ``/dev/shm``).

    This ``/proc`` is the keel's alone (bubblewrap makes its global ``sys``, ``irq`` and ``bus``
    read-only): the agent's supervisor and each verifier's mount a ``/proc`` of their own and harden
    it (:func:`proc_hardening_items`) before any of their commands run, so hardening this one too
    cost every start a mount and a read of the whole mount table per entry for nothing."""
    args = ["--proc", "/proc", "--dev", "/dev"]
    if storage_bound:
        # bubblewrap's /dev is a tmpfs of its own, outside the box's tree and any bound but the
        # memory cgroup's (as root): writable, its files would bypass the storage bound. So
        # /dev is read-only, and /dev/shm a bounded tmpfs of Docker's default --shm-size.
        args += ["--perms", "1777", "--size", str(DEV_SHM_BYTES), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    return args


@cache
def proc_hardening_items() -> tuple[str, ...]:
    """The hardening of a ``/proc`` the supervisor mounts itself (the agent's, the verifier's), as
    Docker does: the kernel's global knobs read-only, its leaky files masked. The box's root is the
    host's uid 0 (in its own user namespace), which the kernel lets write ``/proc/sys`` and
    ``/proc/sysrq-trigger`` unless they are read-only. Items ``ro:NAME`` (read-only), ``file:NAME``
    and ``dir:NAME`` (masked), as ``_supervisor.c`` takes them."""
    items = [f"ro:{name}" for name in _PROC_READ_ONLY if os.path.exists(f"/proc/{name}")]
    for name in _PROC_MASKED:
        if os.path.isdir(f"/proc/{name}"):
            items.append(f"dir:{name}")
        elif os.path.exists(f"/proc/{name}"):
            items.append(f"file:{name}")
    return tuple(items)


def is_kernel_path(path: str) -> bool:
    """Whether a sandbox path is the kernel's (``/proc``, ``/dev``, ``/sys``), not a file of its root."""
    return any(path == mount or path.startswith(mount + "/") for mount in KERNEL_MOUNTS)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_overlay(lower: Path | list[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount a copy-on-write view of ``lower`` (or of layers stacked, the first on top) at ``target``
    (root only): writes go to ``upper``.

    Raises:
        SandboxStartError: If the kernel refuses the mount.
    """
    lowers = lower if isinstance(lower, list) else [lower]
    for path in (*lowers, upper, work, target):
        if any(ch in str(path) for ch in ",:\\"):
            raise SandboxStartError(f"{path}: paths with ',', ':' or '\\' cannot be overlay layers")
    lower = ":".join(str(path) for path in lowers)
    # redirect_dir and metacopy off (the defaults of most kernels, said here for all): every change
    # the sandbox makes is then a plain entry, a whiteout or an opaque folder in ``upper``, which is
    # what the seal's fingerprints read (``_fingerprints.py``).
    options = f"lowerdir={lower},upperdir={upper},workdir={work},metacopy=off"
    # In a user namespace (task images without root: this user's holder, _userns.py) the overlay keeps
    # its xattrs in user.overlay.*, and redirects must not be followed either.
    options += ",userxattr,redirect_dir=nofollow" if in_user_namespace() else ",redirect_dir=off"
    if _libc().mount(b"overlay", str(target).encode(), b"overlay", 0, options.encode()) != 0:
        code = ctypes.get_errno()
        raise SandboxStartError(f"mounting the sandbox's copy-on-write root failed: {os.strerror(code)}")


def inode_bound(storage_mb: int) -> int:
    """The files and folders a sandbox with ``storage_mb`` may make (one per 16 KiB; at least 65,536)."""
    return max(65536, storage_mb * 64)


def mount_bounded_tmpfs(target: Path, size_bytes: int, inodes: int) -> None:
    """Mount a tmpfs of its own at ``target`` (root only): the kernel bounds its bytes and its inodes.

    A sandbox's tree on it cannot fill the host's ``/dev/shm`` or its inode table, however fast
    it writes; sparse files cost only what they hold.

    Raises:
        SandboxStartError: If the kernel refuses the mount.
    """
    options = f"size={size_bytes},nr_inodes={inodes},mode=0700".encode()
    if _libc().mount(b"tmpfs", str(target).encode(), b"tmpfs", _MS_NOSUID, options) != 0:
        code = ctypes.get_errno()
        raise SandboxStartError(f"mounting the sandbox's bounded tree failed: {os.strerror(code)}")


_MS_NOSUID = 2


def unmount(target: Path) -> None:
    """Detach a mount (lazily: it goes once nothing uses it)."""
    if _libc().umount2(str(target).encode(), 2) != 0:  # MNT_DETACH
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):
            raise OSError(code, os.strerror(code), str(target))


def unmount_under(path: Path) -> None:
    """Detach every mount at or below ``path`` (the leftovers of a dead owner's boxes, buildah's storage)."""
    prefix = str(path).rstrip("/")
    with contextlib.suppress(OSError):
        targets = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for target in sorted(targets, key=len, reverse=True):
            target = target.replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                with contextlib.suppress(OSError):
                    unmount(Path(target))
