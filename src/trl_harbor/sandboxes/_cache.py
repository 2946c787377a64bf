"""One image cache: how images are built once, and what this process keeps of them.

:class:`BuildCache`, the base of the task image store (``oci.py``), names a build by a content
key of its context, shares one build per key between coroutines and processes, and publishes it by a
rename. :data:`CACHE` holds this process's builders and the fingerprint listings of trees that cannot
change while sandboxes run.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trl_harbor.sandboxes import _hostfs


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


class BuildCache[T]:
    """Builds of build contexts, made once per content (``build_args``: ``ARG`` values, part of every key).

    A subclass defines what a key depends on besides the context (``_salt()``), where a key's build
    lives (``_folder(key)``), how to build into a staging folder (``_build(environment_dir, out, key,
    task_name)``) and load a published one (``_load(environment_dir, final, task_name)``).
    """

    def __init__(self, build_args: dict[str, str] | None = None):
        self.build_args = dict(build_args or {})
        self._memo: dict[tuple, T] = {}
        self._locks = KeyedLocks()

    def content_key(self, environment_dir: Path) -> str:
        """A 24-hex-digit hash of what a build depends on: the builder, its arguments, the context's files."""
        digest = hashlib.sha256()
        digest.update(self._salt().encode())
        digest.update(json.dumps(sorted(self.build_args.items())).encode())
        _hostfs.hash_tree(digest, environment_dir)
        return digest.hexdigest()[:24]

    async def get(self, environment_dir: Path, task_name: str = "task", force: bool = False) -> T:
        """Return the build of ``environment_dir``, building it on first use; concurrent callers share one build.

        ``task_name`` is for error messages; ``force`` rebuilds even if a cached build exists.

        Raises:
            ImageBuildError: If the build fails; the message says where, and the builder's output.
            BaseImageUnavailableError: If a ``FROM`` image cannot be pulled (task images).
        """
        environment_dir = Path(environment_dir)
        signature = self._signature(environment_dir)
        if not force and signature in self._memo:
            return self._memo[signature]
        key = await asyncio.to_thread(self.content_key, environment_dir)
        async with self._locks(key):
            if not force and signature in self._memo:
                return self._memo[signature]
            final = self._folder(key)
            await self._build_locked(environment_dir, final, task_name, force)
            self._memo[signature] = built = await self._load(environment_dir, final, task_name)
            return built

    def _signature(self, environment_dir: Path) -> tuple:
        """What changes with the context's files: a cheap check before hashing them."""
        entries = []
        for path in sorted(environment_dir.rglob("*")):
            with contextlib.suppress(OSError):
                st = path.lstat()
                entries.append((str(path), st.st_size, st.st_mtime_ns, st.st_mode))
        return (str(environment_dir.resolve()), tuple(entries), tuple(sorted(self.build_args.items())))

    async def _build_locked(self, environment_dir: Path, final: Path, task_name: str, force: bool) -> None:
        """Build into ``final`` unless it is published (or ``force``), one process at a time."""
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(final.parent / f"{final.name}.lock", "w") as lock_file:
            await asyncio.to_thread(fcntl.flock, lock_file, fcntl.LOCK_EX)
            if (final / "image.json").exists() and not force:  # built meanwhile, perhaps by another process
                return
            staging = final.parent / f".build-{final.name}-{os.getpid()}"
            await asyncio.to_thread(_hostfs.remove_tree, staging)
            try:
                await self._build(environment_dir, staging, final.name, task_name)
                old = final.parent / f".old-{final.name}-{os.getpid()}"
                if final.exists():
                    final.rename(old)
                staging.rename(final)
                await asyncio.to_thread(_hostfs.remove_tree, old)
            finally:
                await asyncio.to_thread(_hostfs.remove_tree, staging)


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
