"""asyncio locks by key that work from any event loop."""

from __future__ import annotations

import asyncio
import weakref


class KeyedLocks:
    """One ``asyncio.Lock`` per key and per event loop.

    The image stores are process-wide and outlive event loops (``asyncio.run`` per call, Harbor's
    own loop, trl-harbor's loop thread). An ``asyncio.Lock`` belongs to the first loop that waits on
    it, and one left held by a loop that was closed would block every later caller; so each loop
    gets its own locks. Work on one key from different loops (or processes) is still serialised
    by the stores' file locks.
    """

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, key: str) -> asyncio.Lock:
        """The lock for ``key`` on the running loop.

        Args:
            key: What the lock guards (e.g. an image's content key).

        Returns:
            The lock, created on first use.
        """
        locks = self._by_loop.setdefault(asyncio.get_running_loop(), {})
        return locks.setdefault(key, asyncio.Lock())
