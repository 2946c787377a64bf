"""A task folder's identity: Harbor's content hash for locks, and trl-harbor's tree digest for cached copies.

**Harbor's content hash** (:func:`content_hash`) is what Harbor's own ``lock.json`` records for a task:
``"sha256:"`` and Harbor's ``Packager.compute_content_hash`` of the folder — the SHA-256 of the files
Harbor would publish (``task.toml``, ``instruction.md``, ``environment/``, ``tests/``, ``solution/``,
``steps/`` ..., its ignore rules applied), each by path and content. The suite lock records it
(:func:`lock_digest`), so one task has one identity in Harbor's lock and in trl-harbor's. Where Harbor
has none — it refuses to hash the folder (an ignore file it will not read) — the lock records the
tree digest instead, marked as such.

**The tree digest** (:func:`task_digest`) is one SHA-256 over every entry of the folder, in sorted
order: for a file its path relative to the task, whether it is executable, and the SHA-256 of its
bytes; for a link its path and target (links are never followed); for a folder its path. Python's
byte-code caches (``__pycache__/``, ``*.pyc``) are left out: running a task's Python on the host must
not make it look altered. It sees what Harbor's hash ignores — a mode bit, a link, a file outside the
folders Harbor publishes — which is why a copy fetched into a cache (a Harbor registry task, a Hugging
Face snapshot) keeps it in a *digest note* beside it when it is complete, and is checked against that
note when it is reused: a cached task edited or truncated since is refused instead of trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

__all__ = [
    "DIGEST_PREFIX",
    "HARBOR_HASH",
    "TREE_DIGEST",
    "content_hash",
    "digest_note",
    "lock_digest",
    "read_digest_note",
    "task_digest",
    "write_digest_note",
]

#: Every digest is written ``sha256:<64 hex digits>``.
DIGEST_PREFIX = "sha256:"
#: The kinds of digest a suite lock records: Harbor's content hash, or the tree digest where Harbor has none.
HARBOR_HASH = "harbor"
TREE_DIGEST = "trl-harbor"

_SKIPPED_DIRS = frozenset({"__pycache__"})
_CHUNK = 1 << 20


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def task_digest(task_dir: Path) -> str:
    """The tree digest of a task folder (see the module's docstring).

    Args:
        task_dir: The task folder.

    Returns:
        ``"sha256:<hex>"``.

    Raises:
        OSError: When a file cannot be read.
    """
    root = Path(task_dir)
    outer = hashlib.sha256()
    entries: list[tuple[str, Path]] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        base = Path(folder)
        for name in [*dirs, *files]:
            if name.endswith(".pyc"):
                continue
            path = base / name
            entries.append((path.relative_to(root).as_posix(), path))
    for rel, path in sorted(entries):
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            line = f"L\0{rel}\0{os.readlink(path)}"
        elif stat.S_ISDIR(info.st_mode):
            line = f"D\0{rel}"
        elif stat.S_ISREG(info.st_mode):
            executable = "x" if info.st_mode & 0o111 else "-"
            line = f"F\0{rel}\0{executable}\0{_file_sha256(path)}"
        else:  # a fifo or a socket: its name is all there is
            line = f"O\0{rel}"
        outer.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return DIGEST_PREFIX + outer.hexdigest()


def content_hash(task_dir: Path) -> str:
    """Harbor's content hash of a task folder, as Harbor's ``lock.json`` records it.

    Args:
        task_dir: The task folder.

    Returns:
        ``"sha256:<hex>"``.

    Raises:
        ValueError: When Harbor refuses to hash the folder (an ignore file it will not read).
        OSError: When a file cannot be read.
    """
    from harbor.publisher.packager import Packager

    return DIGEST_PREFIX + Packager.compute_content_hash(Path(task_dir))[0]


def lock_digest(task_dir: Path, kind: str | None = None) -> tuple[str, str]:
    """A task folder's digest for a suite lock, and its kind: Harbor's content hash, else the tree digest.

    Args:
        task_dir: The task folder.
        kind: Compute this kind (:data:`HARBOR_HASH` or :data:`TREE_DIGEST`, as a lock recorded it);
            ``None``: Harbor's where Harbor can hash the folder, else the tree digest.

    Returns:
        ``(digest, kind)``.

    Raises:
        ValueError: For an unknown ``kind``, or Harbor refusing the folder when ``kind`` asks for its hash.
        OSError: When a file cannot be read.
    """
    if kind == TREE_DIGEST:
        return task_digest(task_dir), TREE_DIGEST
    if kind not in (None, HARBOR_HASH):
        raise ValueError(f"unknown digest kind {kind!r} (known: {HARBOR_HASH!r}, {TREE_DIGEST!r})")
    try:
        return content_hash(task_dir), HARBOR_HASH
    except ValueError:
        if kind == HARBOR_HASH:
            raise
        return task_digest(task_dir), TREE_DIGEST


def digest_note(task_dir: Path) -> Path:
    """Where the digest note of a cached task folder lives: a hidden file beside the folder.

    Args:
        task_dir: The cached task folder.

    Returns:
        ``<parent>/.<name>.trl-harbor.json``.
    """
    task_dir = Path(task_dir)
    return task_dir.with_name(f".{task_dir.name}.trl-harbor.json")


def write_digest_note(task_dir: Path, digest: str, source: dict[str, object]) -> None:
    """Record a complete cached copy's digest and where it came from (atomically).

    Args:
        task_dir: The cached task folder.
        digest: Its digest (:func:`task_digest`).
        source: Where it was fetched from (recorded for people; not checked).
    """
    note = digest_note(task_dir)
    staged = note.with_name(note.name + f".{os.getpid()}.tmp")
    staged.write_text(json.dumps({"digest": digest, "source": source}, indent=1, default=str))
    os.replace(staged, note)


def read_digest_note(task_dir: Path) -> str | None:
    """The digest recorded when a cached copy was made, or ``None`` when it has no (readable) note.

    Args:
        task_dir: The cached task folder.

    Returns:
        The recorded digest, or ``None``.
    """
    try:
        digest = json.loads(digest_note(task_dir).read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None
