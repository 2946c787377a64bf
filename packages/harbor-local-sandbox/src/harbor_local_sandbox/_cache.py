"""What this process keeps of task images (:data:`CACHE`): its image stores (``oci.py``), the
fingerprint listings of trees that cannot change while sandboxes run, and facts about images; and
:class:`KeyedLocks`, the per-loop locks that let builds outlive event loops."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any


class KeyedLocks:
    """One ``asyncio.Lock`` per key and per event loop.

    The builders outlive event loops, and a lock left held by a closed loop would block every later
    caller; file locks serialise one key across loops and processes."""

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, key: str) -> asyncio.Lock:
        """The lock for ``key`` (e.g. an image's content key) on the running loop, created on first use."""
        locks = self._by_loop.setdefault(asyncio.get_running_loop(), {})
        return locks.setdefault(key, asyncio.Lock())


class ImageCache:
    """What this process keeps in memory of images (one instance: :data:`CACHE`)."""

    def __init__(self) -> None:
        self._builders: dict[tuple, Any] = {}
        self._listings: dict[tuple, dict[str, str]] = {}
        self._facts: dict[tuple, Any] = {}

    def builder[B](self, kind: type[B], cache_dir: str | None, **settings: Any) -> B:
        """The builder of ``kind`` for ``cache_dir`` (``None``: the default cache) and ``settings``, made once."""
        key = (kind, cache_dir, tuple(sorted(settings.items())))
        if key not in self._builders:
            self._builders[key] = kind(Path(cache_dir) if cache_dir else None, **settings)
        return self._builders[key]

    def listing(self, key: tuple, make: Callable[[], dict[str, str]]) -> dict[str, str]:
        """The fingerprints of a tree that never changes (``key``: the tree, the sandbox path, how deep), made once."""
        listed = self._listings.get(key)
        if listed is None:  # published once complete: sandboxes fingerprint in several threads at once
            listed = self._listings[key] = make()
        return listed

    def known(self, key: tuple) -> bool:
        """Whether a fact about an image (``key``) was remembered (see :meth:`remember`)."""
        return key in self._facts

    def remember(self, key: tuple, value: Any) -> None:
        """Keep a fact about an image that never changes (e.g. where its verifier looks code up)."""
        self._facts[key] = value

    def recall(self, key: tuple) -> Any:
        """A fact remembered with :meth:`remember`, or ``None``."""
        return self._facts.get(key)

    def clear(self) -> None:
        """Forget everything, as a new process starts (what is built stays on disk)."""
        self._builders.clear()
        self._listings.clear()
        self._facts.clear()


#: This process's image cache.
CACHE = ImageCache()
