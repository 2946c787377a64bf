"""Content digests of task folders, and the digest kept beside a cached copy.

A task's digest is one SHA-256 over every entry of its folder, in sorted order: for a file its
path relative to the task, whether it is executable, and the SHA-256 of its bytes; for a link its
path and target (links are never followed); for a folder its path. Byte-identical folders have the
same digest wherever they live, and any change to a file, a mode bit that matters, a name or a
link changes it. Python's byte-code caches (``__pycache__/``, ``*.pyc``) are left out: running a
task's Python on the host must not make it look altered.

A copy fetched into a cache (a Harbor registry task, a Hugging Face snapshot) gets a *digest
note* beside it when it is complete, and is checked against that note when it is reused, so a
cached task edited or truncated since is refused instead of trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

__all__ = ["DIGEST_PREFIX", "digest_note", "read_digest_note", "task_digest", "write_digest_note"]

#: Every digest is written ``sha256:<64 hex digits>``.
DIGEST_PREFIX = "sha256:"

_SKIPPED_DIRS = frozenset({"__pycache__"})
_CHUNK = 1 << 20


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def task_digest(task_dir: Path) -> str:
    """The content digest of a task folder (see the module's docstring).

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
