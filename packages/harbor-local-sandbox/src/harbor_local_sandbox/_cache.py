"""What this process keeps of task images (:data:`CACHE`): its image stores (``oci.py``), the
fingerprint listings of trees that cannot change while sandboxes run, and facts about images; and
:class:`KeyedLocks`, the per-loop locks that let builds outlive event loops."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def replace_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` whole: under a name of this writer's own (its process and thread:
    builds run in threads of one process, and two writers of one name lost the file between them),
    then renamed into place, so a reader never sees half a file. Raises ``OSError``; nothing is left
    under the writer's name then."""
    partial = path.with_name(f".{path.name}-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


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

    def image_facts(self, folder: Path, build: str) -> ImageFacts:
        """The facts kept with the image in ``folder`` (built as ``build``: its key and id), read once per process."""
        stamp = hashlib.sha256(f"{build};{code_stamp()}".encode()).hexdigest()[:24]
        key = ("image facts", str(folder), stamp)
        facts = self._facts.get(key)
        if facts is None:
            facts = self._facts.setdefault(key, ImageFacts(folder, stamp))
        return facts

    def clear(self) -> None:
        """Forget everything, as a new process starts (what is built stays on disk)."""
        self._builders.clear()
        self._listings.clear()
        self._facts.clear()


#: This process's image cache.
CACHE = ImageCache()


# -- facts about an image, kept with it on disk ---------------------------------------

#: The file in an image's folder (beside ``image.json``) that keeps what was found out about the
#: image once (its search paths, its link hazards), for every later process. A rebuilt image is a
#: new folder (``oci.ImageStore`` publishes a build by renaming it into place), so its facts go with it.
FACTS_FILE = "facts.json"


#: The modules whose code decides the facts kept (the probe and its reading, the search paths, the link
#: hazards, the guard's compilation), and so their validity.
FACT_MODULES = (
    "_cache.py", "_roots.py", "_view.py", "_links.py", "_guard.py", "_derive.py", "_imports.py", "_viewfs.py",
    "_userns.py", "code_places.py",
)  # fmt: skip


@functools.cache
def code_stamp() -> str:
    """A hash of the code that finds the facts (:data:`FACT_MODULES`): facts found by other code (another
    version of the package, a change being made) are not trusted."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in FACT_MODULES:
        with contextlib.suppress(OSError):
            digest.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return digest.hexdigest()[:24]


class ImageFacts:
    """The facts kept in one image's :data:`FACTS_FILE`, valid for ``stamp`` (the image's build and
    :func:`code_stamp`); a file made for another stamp, or unreadable, holds nothing."""

    def __init__(self, folder: Path, stamp: str):
        self.path = folder / FACTS_FILE
        self.stamp = stamp
        self._lock = threading.Lock()
        self._facts: dict[str, Any] | None = None

    def _loaded(self) -> dict[str, Any]:
        if self._facts is None:
            facts: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                stored = json.loads(self.path.read_text())
                if isinstance(stored, dict) and stored.get("stamp") == self.stamp:
                    facts = dict(stored.get("facts") or {})
            self._facts = facts
        return self._facts

    def get(self, name: str) -> Any:
        """The fact ``name``, or ``None``."""
        with self._lock:
            return self._loaded().get(name)

    def put(self, name: str, value: Any) -> None:
        """Keep ``value`` (JSON) as ``name``, merged with what another process kept meanwhile; written
        whole under a new name and renamed into place (a reader never sees half a file). Best effort:
        a fact that cannot be kept is found again by the next process."""
        with self._lock:
            self._facts = None  # another process's facts, kept meanwhile, are kept too
            facts = {**self._loaded(), name: value}
            self._facts = facts
            try:
                replace_text(self.path, json.dumps({"stamp": self.stamp, "facts": facts}), 0o600)
            except OSError as error:
                logger.debug("could not keep facts about the image in %s: %r", self.path, error)
