"""Where boxes live on the host, and what makes sure none outlives its owner.

A box's state is a folder of :func:`state_root` named after its owner's PID. This process's
live boxes are killed when it exits; what a process that died without that left (trees,
overlay mounts, cgroups, bubblewraps) is removed by the next one's :func:`sweep_stale`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harbor_local_sandbox import _cgroups, _userns
from harbor_local_sandbox._binaries import state_root
from harbor_local_sandbox._hostfs import remove_tree
from harbor_local_sandbox._mounts import unmount_under


def new_box_name(prefix: str) -> str:
    """A unique, sweepable name: the owner's PID first, so stale boxes can be found."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in prefix)[:40]
    return f"{os.getpid()}-{safe}-{uuid.uuid4().hex[:8]}"


def _owner_dead(name: str) -> bool:
    owner = name.split("-", 1)[0]
    if not owner.isdigit() or int(owner) == os.getpid():
        return False
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


#: This process's started boxes: each one's ``kill_now()`` runs at exit (a box leaves when it is torn down).
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
#: Set when this process exits: no box starts after that (the loop thread may still be starting some).
EXITING = False


def _kill_all_at_exit() -> None:
    global EXITING
    EXITING = True
    for box in list(LIVE):
        box.kill_now()  # or waits for a teardown of it under way in another thread
    # Boxes started but not yet registered, and bubblewraps whose sandbox-side half has not yet
    # armed --die-with-parent (it runs in its own session, out of reach of the box's killpg).
    owner = f"{os.getpid()}-"
    _kill_bubblewraps(lambda box: box.startswith(owner))
    # Whatever of this process's is still in the state root (a tree whose owner object is gone, one a
    # failed teardown left): every tree is named after its owner, so this process's are found by name.
    with contextlib.suppress(OSError):
        for entry in os.scandir(state_root()):
            if entry.name.startswith(owner):
                unmount_under(Path(entry.path))
                with contextlib.suppress(OSError):
                    _remove_stale(Path(entry.path))


atexit.register(_kill_all_at_exit)


_SWEPT = False


async def sweep_stale_once() -> None:
    """Run :func:`sweep_stale` once per process (in a thread), at its first sandbox start."""
    global _SWEPT
    if not _SWEPT:
        _SWEPT = True
        await asyncio.to_thread(sweep_stale)


def sweep_stale() -> int:
    """Remove the trees, mounts, cgroups and bubblewraps of boxes whose owning process is dead.

    Returns:
        The number of trees removed.
    """
    removed = 0
    _kill_bubblewraps(_owner_dead)
    with contextlib.suppress(OSError):
        for entry in os.scandir(state_root()):
            if _owner_dead(entry.name):
                unmount_under(Path(entry.path))
                _remove_stale(Path(entry.path))
                removed += 1
    _cgroups.remove_stale(_owner_dead)
    with contextlib.suppress(OSError):
        for entry in os.scandir(state_root() / "workers"):  # sockets of view workers killed with their owner
            if _owner_dead(entry.name):
                Path(entry.path).unlink(missing_ok=True)
    return removed


def _remove_stale(path: Path) -> None:
    """Remove a dead owner's tree; one of a task image without root holds its users' files, which
    only a holder (``_userns.py``) may remove."""
    if not path.is_dir() or path.is_symlink():  # a holder's socket
        path.unlink(missing_ok=True)
        return
    try:
        remove_tree(path)
    except PermissionError:
        if os.geteuid() == 0:
            raise
        _userns.host().call(remove_tree, path)


def _bubblewraps() -> Iterator[tuple[int, str]]:
    """``(pid, box name)`` of the bubblewrap processes on this machine that hold a box folder.

    Also the launcher or ``setpriv`` about to become one, and bubblewrap's own sandbox-side half
    before it runs the supervisor (all have bubblewrap's command line; a parked launcher, which has
    not, dies with its owner).
    """
    marker = f"{state_root()}/".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if Path(f"/proc/{name}/comm").read_text().strip() not in ("bwrap", "launcher", "setpriv"):
                continue
            args = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(marker):
                yield int(name), arg[len(marker) :].split(b"/", 1)[0].decode(errors="replace")
                break


def _kill_bubblewraps(of_box) -> None:
    for pid, box in _bubblewraps():
        if of_box(box):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def kill_bubblewraps_of(box_name: str) -> None:
    """Kill what is left of the bubblewrap of one box (its sandbox-side half, in its own session)."""
    _kill_bubblewraps(lambda box: box == box_name)
