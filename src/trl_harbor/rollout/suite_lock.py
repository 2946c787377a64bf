"""The suite lock: what a run trained or evaluated on, pinned, so that it can be run again offline.

A run writes ``suite.lock.json`` into its output folder. For each suite it records what the user
asked for (the dataset string, registry, filters, selection), what that resolved to (the
dataset's name and version, the Hugging Face commit, the git commit of each task) and, per task,
its name, its position in the suite, the folder it was read from (a cache folder for fetched
suites) and its digest: Harbor's content hash (:func:`trl_harbor.rollout.digests.content_hash`),
the same ``sha256:...`` string Harbor's own ``lock.json`` records for that task
(``"digest_kind": "harbor"``); only where Harbor cannot hash the folder, trl-harbor's tree digest
(:func:`trl_harbor.rollout.digests.task_digest`, ``"digest_kind": "trl-harbor"``).

Passing the lock back as the dataset (``HarborSpec("run/suite.lock.json")``, ``trl-harbor train
--dataset run/suite.lock.json``) reruns on exactly those tasks: each is read from its recorded
folder, fetched again from its pinned source when that folder is gone, and refused when its
digest differs (:func:`trl_harbor.rollout.sources.resolve_lock`), each digest recomputed by its kind.

**Locks of earlier versions.** A lock of format version 1 (trl-harbor before Harbor's content hash)
holds tree digests and no ``digest_kind``: it is read as such, every task checked against its tree
digest, recomputed; it never meets Harbor's hash, so it cannot mismatch silently, and a run from it
writes a version 2 lock with Harbor's hashes. A ``digest_kind`` this version does not know is
refused, naming the lock, the field and the fix.

.. code-block:: json

    {"format": "trl-harbor-suite-lock", "format_version": 1, "created": "2026-12-02T10:00:00+00:00",
     "suites": [{"dataset": "terminal-bench@2.0", "kind": "registry", "name": "terminal-bench",
                 "version": "2.0", "root": "/home/me/.cache/harbor/tasks", "options": {...},
                 "tasks": [{"name": "hello-world", "index": 0, "path": "/home/me/.cache/harbor/tasks/Ab3/hello-world",
                            "digest": "sha256:...", "digest_kind": "harbor",
                            "source": {"git_url": "...", "git_commit_id": "...", "path": "tasks/hello-world"}}]}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trl_harbor.rollout.digests import DIGEST_PREFIX, HARBOR_HASH, TREE_DIGEST
from trl_harbor.rollout.suite import TaskSuiteError

__all__ = [
    "LOCK_FILENAME",
    "LOCK_FORMAT",
    "LockedSuite",
    "LockedTask",
    "is_lock_file",
    "read_lock",
    "split_lock_selector",
    "write_lock",
]

#: The file a run writes into its output folder.
LOCK_FILENAME = "suite.lock.json"
#: The ``format`` key every lock carries (and by which a lock is told from other JSON files).
LOCK_FORMAT = "trl-harbor-suite-lock"
_VERSION = 2
#: The versions read: 1 holds tree digests only (no ``digest_kind``).
_READABLE = (1, 2)


@dataclass(frozen=True)
class LockedTask:
    """One pinned task.

    Attributes:
        name: The task's folder name.
        index: Its position in the suite as resolved (the dataset's ``task_index``).
        path: The folder it was read from.
        digest: Its digest (``sha256:...``), of kind ``digest_kind``.
        source: Where it came from: ``{"path"}`` (a local suite), ``{"repo_id", "revision",
            "path"}`` (Hugging Face), ``{"git_url", "git_commit_id", "path"}`` (a git task of a
            registry or repository), ``{"package", "ref"}`` (a Harbor Hub package).
        digest_kind: ``"harbor"``: Harbor's content hash, as in Harbor's ``lock.json``;
            ``"trl-harbor"``: the tree digest (where Harbor has none, and in version 1 locks).
    """

    name: str
    index: int
    path: Path
    digest: str
    source: dict[str, Any] = field(default_factory=dict)
    digest_kind: str = HARBOR_HASH

    def to_dict(self) -> dict[str, Any]:
        """The JSON form.

        Returns:
            The task's fields, the path as a string.
        """
        return {"name": self.name, "index": self.index, "path": str(self.path), "digest": self.digest,
                "digest_kind": self.digest_kind, "source": self.source}  # fmt: skip


@dataclass(frozen=True)
class LockedSuite:
    """One pinned suite.

    Attributes:
        dataset: The dataset as the user gave it.
        kind: ``"local"``, ``"huggingface"``, ``"registry"``, ``"package"`` or ``"git"``.
        name: The dataset's name (a registry or package name, a repo id, a folder's name).
        version: What the name resolved to (a registry version, a package content hash, a
            Hugging Face or git commit; ``None`` for a local folder).
        root: The folder the tasks were found under (the download folder for fetched tasks).
        tasks: The tasks the run used, in dataset order.
        options: How it was asked for (registry, revision, filters, selection).
    """

    dataset: str
    kind: str
    name: str
    version: str | None
    root: Path
    tasks: tuple[LockedTask, ...]
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form.

        Returns:
            The suite's fields, tasks as dictionaries.
        """
        return {
            "dataset": self.dataset,
            "kind": self.kind,
            "name": self.name,
            "version": self.version,
            "root": str(self.root),
            "options": self.options,
            "tasks": [task.to_dict() for task in self.tasks],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str, format_version: int = _VERSION) -> LockedSuite:
        """Read one suite of a lock, checking every field.

        Args:
            data: The suite's JSON object.
            where: The lock and the suite's position, for messages.
            format_version: The lock's format version (1: every digest is a tree digest).

        Returns:
            The suite.

        Raises:
            TaskSuiteError: Naming the missing or malformed field.
        """
        if not isinstance(data, dict):
            raise TaskSuiteError(f"{where}: a suite must be a JSON object. Fix: write the lock with trl-harbor.")
        try:
            tasks = []
            for i, task in enumerate(data["tasks"]):
                digest = str(task["digest"])
                if not digest.startswith(DIGEST_PREFIX):
                    raise ValueError(f"tasks[{i}].digest {digest!r} is not 'sha256:<hex>'")
                kind = TREE_DIGEST if format_version == 1 else str(task.get("digest_kind", HARBOR_HASH))
                if kind not in (HARBOR_HASH, TREE_DIGEST):
                    raise ValueError(
                        f"tasks[{i}].digest_kind {kind!r} is not {HARBOR_HASH!r} or {TREE_DIGEST!r} "
                        "(written by a newer trl-harbor?)"
                    )
                source = task.get("source") or {}
                if not isinstance(source, dict):
                    raise ValueError(f"tasks[{i}].source must be an object")
                tasks.append(
                    LockedTask(str(task["name"]), int(task["index"]), Path(task["path"]), digest, source, kind)
                )
            options = data.get("options") or {}
            if not isinstance(options, dict):
                raise ValueError("options must be an object")
            return cls(
                dataset=str(data["dataset"]),
                kind=str(data["kind"]),
                name=str(data["name"]),
                version=None if data.get("version") is None else str(data["version"]),
                root=Path(data["root"]),
                tasks=tuple(tasks),
                options=options,
            )
        except (KeyError, TypeError, ValueError) as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise TaskSuiteError(
                f"{where}: {detail}. Fix: use the suite.lock.json a trl-harbor run wrote, unedited, with that "
                "trl-harbor version; or resolve the dataset again."
            ) from exc


def is_lock_file(dataset: str | Path) -> bool:
    """Whether a dataset argument names a suite lock (``*.json`` holding ``"format": "trl-harbor-suite-lock"``).

    Args:
        dataset: The dataset argument, with or without a ``#suite`` selector.

    Returns:
        ``True`` for a lock file.
    """
    path, _ = split_lock_selector(dataset)
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        with path.open("rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return LOCK_FORMAT.encode() in head


def split_lock_selector(dataset: str | Path) -> tuple[Path, str | None]:
    """Split ``path/suite.lock.json#SELECTOR`` into the path and the selector (a suite's position or dataset).

    Args:
        dataset: The dataset argument.

    Returns:
        ``(path, selector or None)``.
    """
    text = str(dataset)
    if "#" in text and text.split("#", 1)[0].endswith(".json"):
        path, selector = text.split("#", 1)
        return Path(path).expanduser(), selector
    return Path(text).expanduser(), None


def read_lock(dataset: str | Path) -> list[LockedSuite]:
    """Read a suite lock; with a ``#SELECTOR``, only the suite it names.

    Args:
        dataset: ``path/suite.lock.json``, optionally followed by ``#0`` (a position) or
            ``#terminal-bench@2.0`` (a suite's dataset as given).

    Returns:
        The locked suites (one with a selector).

    Raises:
        TaskSuiteError: When the file cannot be read, is not a lock, or the selector names no suite.
    """
    path, selector = split_lock_selector(dataset)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TaskSuiteError(
            f"{path}: cannot read the suite lock: {exc}. Fix: pass the suite.lock.json a trl-harbor run wrote."
        ) from exc
    if not isinstance(data, dict) or data.get("format") != LOCK_FORMAT:
        raise TaskSuiteError(f'{path}: not a trl-harbor suite lock (no "format": "{LOCK_FORMAT}").')
    version = data.get("format_version")
    if version not in _READABLE:
        raise TaskSuiteError(
            f"{path}: lock format version {version!r}; this trl-harbor reads versions {list(_READABLE)}. "
            "Fix: use the trl-harbor version that wrote it, or resolve the dataset again."
        )
    raw = data.get("suites")
    if not isinstance(raw, list) or not raw:
        raise TaskSuiteError(f"{path}: the lock holds no suite. Fix: pass the suite.lock.json a trl-harbor run wrote.")
    suites = [LockedSuite.from_dict(item, f"{path} suites[{i}]", version) for i, item in enumerate(raw)]
    if selector is None:
        return suites
    if selector.isdigit() and int(selector) < len(suites):
        return [suites[int(selector)]]
    named = [suite for suite in suites if selector in (suite.dataset, suite.name)]
    if len(named) != 1:
        listing = ", ".join(f"#{i} ({suite.dataset})" for i, suite in enumerate(suites))
        raise TaskSuiteError(f"{path}#{selector}: names no single suite of the lock. Fix: one of {listing}.")
    return named


def write_lock(path: str | Path, suites: Sequence[LockedSuite]) -> Path:
    """Write a suite lock (atomically: a reader never sees half a file).

    Args:
        path: The file (``*.json``), or a folder (made if need be): ``<folder>/suite.lock.json``.
        suites: The suites, in the run's order.

    Returns:
        The file written.
    """
    from importlib.metadata import PackageNotFoundError, version

    target = Path(path)
    if target.is_dir() or target.suffix != ".json":
        target = target / LOCK_FILENAME
    target.parent.mkdir(parents=True, exist_ok=True)
    versions = {}
    for package in ("trl-harbor", "harbor"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    data = {
        "format": LOCK_FORMAT,
        "format_version": _VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": versions,
        "suites": [suite.to_dict() for suite in suites],
    }
    staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    staged.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(staged, target)
    return target
