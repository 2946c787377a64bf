"""Where a suite comes from: every dataset form Harbor's own CLI accepts, resolved, fetched and pinned.

One string names a suite, as ``harbor run -d`` / ``--repo`` / ``-p`` and Hugging Face do:

========================================  =====================================================
``path/to/suite`` (exists, or looks like  a local folder (tasks at any depth, ``tasks/`` first)
a path: ``./x``, ``/x``, ``~/x``, ``a/b/c``)
``org/name``, ``org/name@revision``,      a Hugging Face **dataset** repo (its ``tasks/``), as
``hf:org/name[@revision]``                trl-harbor always read ``org/name``
``name``, ``name@version``,               a dataset of a Harbor registry (Harbor's default, or
``registry:name[@version]``               ``registry_url`` / ``registry_path``), as ``-d``
``hub:org/name[@ref]``                    a Harbor Hub package, as ``-d org/name`` (``ref``: a
                                          tag, a revision or ``sha256:<digest>``)
``repo:SOURCE``, ``https://...``,         a git repository at a ref, as ``--repo``: ``SOURCE``
``git://...``, ``ssh://...``,             is anything Harbor's ``--repo`` takes
``git@host:org/name``, ``file://...``     (``org/name@ref``, ``.../tree/<ref>/<subdir>``), or a
                                          ``file://`` repository on disk
``run/suite.lock.json[#suite]``           a run's pinned suite (:mod:`trl_harbor.rollout.suite_lock`)
========================================  =====================================================

``org/name`` stays a Hugging Face id, as it always was here; a Harbor Hub package is asked for
with ``hub:``. Registry, package and repository datasets are resolved by Harbor's own registry
clients and downloaded by Harbor's task client into Harbor's task cache (or ``download_dir``),
each task pinned to a commit or a content hash; Hugging Face snapshots are copied out of the hub
cache as real files. Every fetched task's tree digest is recorded beside it and checked on
reuse, so an altered cached task is refused, naming it; a lock records Harbor's content hash
(:mod:`trl_harbor.rollout.digests`). Harbor is asynchronous: its coroutines
run on the process-wide loop (:func:`trl_harbor.runtime.run`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from trl_harbor import runtime
from trl_harbor.rollout.digests import HARBOR_HASH, lock_digest, read_digest_note, task_digest, write_digest_note
from trl_harbor.rollout.suite import (
    TaskInfo,
    TaskSuiteError,
    filter_task_dirs,
    find_suite_root,
    find_task_dirs,
    hub_suite,
    looks_like_path,
)
from trl_harbor.rollout.suite_lock import LockedSuite, LockedTask, is_lock_file, read_lock

__all__ = [
    "FETCHED_KINDS",
    "KINDS",
    "DatasetSource",
    "ResolvedSuite",
    "SuiteSelection",
    "parse_dataset",
    "resolve_lock",
    "resolve_suite",
]

logger = logging.getLogger(__name__)

#: The forms a dataset string takes.
KINDS = ("local", "huggingface", "registry", "package", "git", "lock")

#: The forms whose tasks Harbor's task client downloads, one by one (only those a run uses).
FETCHED_KINDS = ("registry", "package", "git")

_PREFIXES = {"hf:": "huggingface", "hub:": "package", "registry:": "registry", "repo:": "git"}
_GIT_SCHEMES = ("https://", "http://", "ssh://", "git://", "git@", "file://")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DatasetSource:
    """A dataset string, parsed.

    Attributes:
        given: The string as the user gave it.
        kind: One of :data:`KINDS`.
        location: The folder (local, lock), repo id (Hugging Face), dataset name (registry),
            ``org/name`` (package) or repository source (git).
        version: The revision (Hugging Face), version (registry) or ref (package) after ``@``
            (for git the ref stays in ``location``, where Harbor parses it).
    """

    given: str
    kind: str
    location: str
    version: str | None = None

    @property
    def label(self) -> str:
        """``location@version`` (or ``location``)."""
        return f"{self.location}@{self.version}" if self.version else self.location

    @property
    def fetched(self) -> bool:
        """Whether its tasks are downloaded one by one (:data:`FETCHED_KINDS`), not listed from a folder or a lock."""
        return self.kind in FETCHED_KINDS


@dataclass(frozen=True)
class SuiteSelection:
    """Where a dataset comes from and which of its tasks to keep: how a suite is asked for, besides its name.

    Built once from what the user gave (:class:`~trl_harbor.HarborSpec`'s keywords, the
    ``trl-harbor`` flags, a config's fields) and passed to :func:`resolve_suite`. Each field is
    named as :class:`~trl_harbor.HarborSpec`'s keyword of the same meaning (:meth:`as_kwargs`).

    Attributes:
        revision: The Hugging Face revision (branch, tag or commit) of an ``org/name`` id, given
            apart from the dataset string (``None``: the one after ``@``, else ``main``); any
            other form refuses it.
        registry_url: A Harbor registry's URL (a ``registry.json`` served over HTTP), for a
            ``name@version`` dataset (``None``: Harbor's default registry). A Hugging Face id
            refuses it as a likely mistake.
        registry_path: A ``registry.json`` on disk, for a ``name@version`` dataset (likewise;
            not with ``registry_url``).
        task_names: Globs of the task names to keep (Harbor's ``--include-task-name``; ``None``:
            every task), kept as a tuple. A lock refuses it (it pins its tasks).
        exclude_task_names: Globs of the task names to leave out (``--exclude-task-name``),
            applied after ``task_names``; kept as a tuple.
        download_dir: Where fetched tasks are cached (``None``: Harbor's task cache,
            ``~/.cache/harbor/tasks``); for a lock, where a task whose copy is gone is fetched again.
        overwrite: Fetch registry, package and repository tasks again even when cached.
    """

    revision: str | None = None
    registry_url: str | None = None
    registry_path: str | Path | None = None
    task_names: Sequence[str] | None = None
    exclude_task_names: Sequence[str] | None = None
    # Where the tasks are cached, and whether afresh: not part of what a lock records.
    download_dir: str | Path | None = field(default=None, metadata={"recorded": False})
    overwrite: bool = field(default=False, metadata={"recorded": False})

    def __post_init__(self) -> None:
        for name in ("task_names", "exclude_task_names"):
            globs = getattr(self, name)
            if globs is not None:
                object.__setattr__(self, name, tuple(globs))

    @classmethod
    def of(cls, given: Any) -> SuiteSelection:
        """The selection an object's same-named attributes give (parsed flags, a config); a field it
        lacks keeps its default.

        Args:
            given: An ``argparse.Namespace``, an eval or train config: anything with attributes named
                as the fields.

        Returns:
            The selection.
        """
        return cls(**{f.name: getattr(given, f.name, f.default) for f in fields(cls)})

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments, named as :class:`~trl_harbor.HarborSpec` takes them.

        Returns:
            ``{field name: value}`` for every field.
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def lock_options(self) -> dict[str, Any]:
        """How the suite was asked for, as a suite lock records it (JSON values).

        Returns:
            ``{field name: value}`` for every field but ``download_dir`` and ``overwrite`` (where
            tasks are cached is no part of what was asked for): a path as a string, globs as a
            list (``None`` when none was given).
        """
        options: dict[str, Any] = {}
        for f in fields(self):
            if not f.metadata.get("recorded", True):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value) or None
            elif isinstance(value, os.PathLike):
                value = os.fspath(value)
            options[f.name] = value
        return options


def parse_dataset(dataset: str | Path, *, revision: str | None = None) -> DatasetSource:
    """Tell which form a dataset string is (see the module's table).

    Args:
        dataset: The dataset string (or a path).
        revision: The Hugging Face revision given apart (``HarborSpec(revision=...)``).

    Returns:
        The parsed source.

    Raises:
        TaskSuiteError: For an empty string, a malformed name, or a revision given twice.
    """
    given = str(dataset).strip()
    if not given:
        raise TaskSuiteError("dataset is empty. Fix: a folder, 'org/name' (Hugging Face), 'name@version' (registry)...")
    if isinstance(dataset, Path) or is_lock_file(given):
        return DatasetSource(given, "lock" if is_lock_file(given) else "local", given)
    for prefix, kind in _PREFIXES.items():
        if given.startswith(prefix):
            return _named(given, kind, given[len(prefix) :], revision)
    if given.startswith(_GIT_SCHEMES):
        return DatasetSource(given, "git", given)
    if Path(given).expanduser().exists() or looks_like_path(given):
        return DatasetSource(given, "local", given)
    if "/" in given.split("@", 1)[0]:
        return _named(given, "huggingface", given, revision)
    return _named(given, "registry", given, revision)


def _named(given: str, kind: str, rest: str, revision: str | None) -> DatasetSource:
    if kind == "git":
        return DatasetSource(given, kind, rest)
    name, _, version = rest.partition("@")
    slashes = name.count("/")
    if not name or (kind in ("huggingface", "package") and slashes != 1) or (kind == "registry" and slashes):
        shapes = {"huggingface": "org/name[@revision]", "package": "org/name[@ref]", "registry": "name[@version]"}
        raise TaskSuiteError(f"{given}: a {kind} dataset is written {shapes[kind]}. Fix: correct the name.")
    if revision is not None and kind != "huggingface":
        raise TaskSuiteError(
            f"{given}: revision= is a Hugging Face revision. Fix: write the {kind} version as {name}@VERSION."
        )
    if revision is not None and version and revision != version:
        raise TaskSuiteError(f"{given}: revision given twice ({version!r} and revision={revision!r}). Fix: give one.")
    return DatasetSource(given, kind, name, version or revision)


@dataclass
class ResolvedSuite:
    """A suite found (and fetched): its task folders, where each came from, and their lock digests.

    Attributes:
        source: The parsed dataset.
        name: The dataset's name.
        version: What it resolved to (a registry version, a content hash, a commit; ``None``: a folder).
        root: The folder the task folders live under (the download folder for fetched tasks).
        task_dirs: The task folders, sorted by name (a lock's: in its order), filters applied.
        names: Each task folder's task name (a package task's ``org/name``; else the folder's name).
        origins: Each task folder's source record (:class:`~trl_harbor.rollout.suite_lock.LockedTask`'s ``source``).
        digests: The lock digests computed so far, with their kind (``(digest, kind)``,
            :func:`~trl_harbor.rollout.digests.lock_digest`: Harbor's content hash where Harbor has one).
        indices: A lock's recorded ``task_index`` of each folder (``None``: positions in ``task_dirs``).
        lock_of: The lock it was read from (``None``: resolved afresh).
    """

    source: DatasetSource
    name: str
    version: str | None
    root: Path
    task_dirs: list[Path]
    names: dict[Path, str] = field(default_factory=dict)
    origins: dict[Path, dict[str, Any]] = field(default_factory=dict)
    digests: dict[Path, tuple[str, str]] = field(default_factory=dict)
    indices: dict[Path, int] | None = None
    lock_of: LockedSuite | None = None

    def digest(self, task_dir: Path) -> str:
        """A task folder's lock digest: Harbor's content hash, as Harbor's ``lock.json`` has it (computed once).

        Args:
            task_dir: One of :attr:`task_dirs`.

        Returns:
            ``sha256:<hex>``.
        """
        return self._lock_digest(task_dir)[0]

    def _lock_digest(self, task_dir: Path) -> tuple[str, str]:
        if task_dir not in self.digests:
            self.digests[task_dir] = lock_digest(task_dir)
        return self.digests[task_dir]

    def lock(self, selected: Sequence[tuple[int, TaskInfo]], options: dict[str, Any]) -> LockedSuite:
        """The pinned record of the tasks a run uses.

        Args:
            selected: ``(task_index, task)`` pairs, in dataset order.
            options: How the suite was asked for (recorded as given: :meth:`SuiteSelection.lock_options`
                and the run's own selection, ``num_tasks`` / ``indices``).

        Returns:
            The locked suite.
        """
        by_path = {path.resolve(): path for path in self.task_dirs}
        tasks = []
        for index, info in selected:
            path = by_path.get(info.path, info.path)
            digest, kind = self._lock_digest(path)
            tasks.append(
                LockedTask(
                    name=self.names.get(path, path.name),
                    index=index,
                    path=info.path,
                    digest=digest,
                    source=self.origins.get(path, {"path": str(info.path)}),
                    digest_kind=kind,
                )
            )
        if self.lock_of is not None:  # a rerun records what the first run asked for
            dataset, kind, options = self.lock_of.dataset, self.lock_of.kind, {**self.lock_of.options, **options}
        else:
            dataset, kind = self.source.given, self.source.kind
        return LockedSuite(dataset, kind, self.name, self.version, self.root, tuple(tasks), dict(options))


def _stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def resolve_suite(
    dataset: str | Path | DatasetSource,
    selection: SuiteSelection | None = None,
    *,
    limit: int | None = None,
    progress: Progress | None = None,
) -> ResolvedSuite:
    """Find a suite's task folders, fetching and pinning them when it is not a local folder.

    Args:
        dataset: Any form of the module's table, or what :func:`parse_dataset` made of it (with
            ``selection.revision``).
        selection: Where the dataset comes from and which of its tasks to keep (``None``: every
            task, from the default registry into Harbor's task cache).
        limit: Keep only the first ``limit`` tasks of the sorted, filtered list (a lock's: in its
            order; ``None``: all; a negative count: none). A registry, package or repository
            dataset fetches only those; a folder, a Hugging Face snapshot or a lock is listed
            (and checked) whole, then cut.
        progress: Called with one line when a fetch starts and one when it ends (default: stderr).

    Returns:
        The resolved suite.

    Raises:
        TaskSuiteError: Naming the dataset, the source and the fix, when it cannot be parsed,
            found, fetched, or a cached task's digest differs from the one recorded with it.
    """
    selection = selection or SuiteSelection()
    source = dataset if isinstance(dataset, DatasetSource) else parse_dataset(dataset, revision=selection.revision)
    registry_url, registry_path = selection.registry_url, selection.registry_path
    if (registry_url is not None or registry_path is not None) and source.kind == "huggingface":
        raise TaskSuiteError(
            f"{source.given}: registry_url / registry_path name the registry of a dataset name (name@version), "
            "and 'org/name' is a Hugging Face dataset id. Fix: drop them, write a registry dataset as "
            "NAME@VERSION, or a Harbor Hub package as hub:org/name."
        )
    if registry_url is not None and registry_path is not None:
        raise TaskSuiteError(f"{source.given}: give registry_url or registry_path, not both.")
    if source.fetched:
        return _resolve_harbor(source, selection, limit=limit, progress=progress or _stderr)
    if source.kind == "lock":
        if selection.task_names or selection.exclude_task_names:
            raise TaskSuiteError(
                f"{source.given}: a lock pins its tasks; task_names / exclude_task_names do not apply. "
                "Fix: drop them (num_tasks / indices still select among the locked tasks)."
            )
        resolved = resolve_lock(source.given, download_dir=selection.download_dir, progress=progress)
    else:
        resolved = _resolve_folder(source, selection, progress or _stderr)
    if limit is not None:
        resolved.task_dirs = resolved.task_dirs[: max(limit, 0)]
    return resolved


def _resolve_folder(source: DatasetSource, selection: SuiteSelection, progress: Progress) -> ResolvedSuite:
    if source.kind == "local":
        root = find_suite_root(Path(source.location).expanduser())
        name, version = root.parent.name if root.name == "tasks" else root.name, None
    else:
        start = time.monotonic()
        root, version = hub_suite(source.location, source.version)
        name = source.location
        progress(
            f"trl-harbor: {source.given}: Hugging Face dataset at commit {version} ({time.monotonic() - start:.1f} s)"
        )
    task_dirs = filter_task_dirs(
        find_task_dirs(root), selection.task_names, selection.exclude_task_names, dataset=source.given
    )
    resolved = ResolvedSuite(source, name, version, root, task_dirs)
    for task_dir in task_dirs:
        if source.kind == "huggingface":
            rel = task_dir.relative_to(root.parent).as_posix()
            origin = {"repo_id": source.location, "revision": version, "path": rel}
            resolved.origins[task_dir] = origin
            _check_cached_copy(task_dir, task_dir.name, origin, source.given, fresh=False)
        else:
            resolved.origins[task_dir] = {"path": str(task_dir.resolve())}
    return resolved


def _check_cached_copy(task_dir: Path, name: str, origin: dict[str, Any], dataset: str, *, fresh: bool) -> None:
    """A fetched task's tree digest: recorded beside it when it was fetched, checked against that when reused.

    The tree digest, not Harbor's content hash (which the lock records): it also sees what Harbor's hash
    ignores in a cached copy — a mode bit, a link, a file outside the folders Harbor publishes.
    """
    digest = task_digest(task_dir)
    recorded = None if fresh else read_digest_note(task_dir)
    if recorded is None:
        write_digest_note(task_dir, digest, origin)
    elif recorded != digest:
        raise TaskSuiteError(
            f"{dataset}: task {name!r}: the cached copy {task_dir} has changed since it was fetched "
            f"(digest {digest}, recorded {recorded}). Fix: delete {task_dir} (or pass overwrite=True / "
            "--overwrite) to fetch the pinned version again; edit a task in a local copy of the suite instead."
        )


# ── registries, Harbor Hub packages and git repositories: Harbor's clients ────────────────


def _client_and_name(source: DatasetSource, registry_url: str | None, registry_path: Path | None) -> tuple[Any, str]:
    """Harbor's registry client for the dataset, and the name string it resolves (validated by ``DatasetConfig``)."""
    from harbor.models.job.config import DatasetConfig
    from harbor.registry.client.factory import RegistryClientFactory

    if source.kind == "registry":
        DatasetConfig(name=source.location, version=source.version, registry_url=registry_url,
                      registry_path=registry_path)  # fmt: skip
        client = RegistryClientFactory.create(registry_url=registry_url, registry_path=registry_path)
        return client, source.label
    if source.kind == "package":
        from harbor.registry.client.package import PackageDatasetClient

        DatasetConfig(name=source.location, ref=source.version)
        return PackageDatasetClient(), f"{source.location}@{source.version or 'latest'}"
    if source.location.startswith("file://"):
        from harbor.registry.client.git_repo import GitRepoRegistryClient

        return GitRepoRegistryClient(_file_repo(source.location)), ""
    DatasetConfig(repo=source.location)
    return RegistryClientFactory.create(repo=source.location), ""


def _file_repo(location: str) -> Any:
    """Harbor's ``ResolvedRepo`` for a ``file://`` repository (Harbor's ``--repo`` parser takes network URLs only)."""
    from harbor.registry.client.git_repo import ResolvedRepo

    base, ref = location, None
    at = location.rfind("@")
    if at > 0 and "/" not in location[at + 1 :]:
        base, ref = location[:at], location[at + 1 :] or None
    repo_path, _, subdir = base.removeprefix("file://").partition("/tree/")
    if subdir:  # file:///srv/repo/tree/<ref>/<subdir>, as Harbor's URLs
        tree_ref, _, subdir = subdir.partition("/")
        ref = ref or tree_ref
    path = Path(repo_path)
    return ResolvedRepo(
        host="localhost", org=path.parent.name or "local", name=path.name.removesuffix(".git"),
        git_url=f"file://{repo_path}", ref=ref, subdir=subdir or None,
    )  # fmt: skip


def _where(source: DatasetSource, registry_url: str | None, registry_path: Path | None) -> str:
    if source.kind == "registry":
        if registry_path is not None:
            return f"the registry file {registry_path}"
        return f"the registry {registry_url or 'harbor (the default registry)'}"
    if source.kind == "package":
        return "the Harbor Hub"
    return f"the git repository {source.location}"


def _detail(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_detail(inner) for inner in exc.exceptions)
    if isinstance(exc, subprocess.CalledProcessError):
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        command = " ".join(str(a) for a in exc.cmd[:3]) if isinstance(exc.cmd, list) else str(exc.cmd)
        return f"`{command} ...` failed (exit {exc.returncode}): {' '.join(stderr.split())[:500]}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:800]}"


def _fix(source: DatasetSource) -> str:
    offline = (
        "offline, rerun from the suite.lock.json of a run that resolved it (it reads the cache), or pass a "
        "local copy of the suite"
    )
    if source.kind == "registry":
        return (
            "check the name and version (`harbor datasets list`, or the registry file), the registry "
            f"(registry_path= / --registry-path, registry_url= / --registry-url) and network access; {offline}"
        )
    if source.kind == "package":
        return f"check org/name@ref, your Harbor Hub login (`harbor auth login`) and network access; {offline}"
    return (
        f"check the repository URL, the ref after '@', that it holds task folders under tasks/, and access; {offline}"
    )


def _resolve_harbor(
    source: DatasetSource, selection: SuiteSelection, *, limit: int | None, progress: Progress
) -> ResolvedSuite:
    from harbor.constants import TASK_CACHE_DIR

    registry_url = selection.registry_url
    registry_path = None if selection.registry_path is None else Path(selection.registry_path).expanduser()
    download_dir = None if selection.download_dir is None else Path(selection.download_dir).expanduser()
    overwrite = selection.overwrite

    where = _where(source, registry_url, registry_path)
    start = time.monotonic()
    try:
        client, name_string = _client_and_name(source, registry_url, registry_path)
        metadata = runtime.run(client.get_dataset_metadata(name_string))
    except TaskSuiteError:
        raise
    except Exception as exc:  # Harbor's clients raise ValueError, pydantic, git, HTTP and DB errors
        raise TaskSuiteError(
            f"{source.given}: could not resolve the {source.kind} dataset from {where}: {_detail(exc)}. "
            f"Fix: {_fix(source)}."
        ) from exc
    task_ids = _select_task_ids(
        source, list(metadata.task_ids), selection.task_names, selection.exclude_task_names, limit
    )
    root = download_dir or TASK_CACHE_DIR
    pinned = f"{metadata.name}@{metadata.version}"
    label = source.given if pinned == source.given else f"{source.given} ({pinned})"
    progress(f"trl-harbor: {label}: {len(task_ids)} task(s) from {where}")
    try:
        from harbor.tasks.client import TaskClient

        batch = runtime.run(TaskClient().download_tasks(task_ids, overwrite=overwrite, output_dir=download_dir))
    except Exception as exc:
        raise TaskSuiteError(
            f"{source.given}: could not download the tasks of {metadata.name}@{metadata.version} from {where} "
            f"into {root}: {_detail(exc)}. Fix: {_fix(source)}."
        ) from exc
    results = list(batch.results)
    # A cached copy without its digest note was never completed by us (a download cut short, or a
    # cache another tool filled): fetched again, not trusted as it is.
    unrecorded = [i for i, r in enumerate(results) if r.cached and read_digest_note(Path(r.path)) is None]
    if unrecorded:
        try:
            again = runtime.run(
                TaskClient().download_tasks([task_ids[i] for i in unrecorded], overwrite=True, output_dir=download_dir)
            )
        except Exception as exc:
            raise TaskSuiteError(
                f"{source.given}: {len(unrecorded)} cached task(s) of {metadata.name}@{metadata.version} have no "
                f"record of a complete download, and fetching them again from {where} failed: {_detail(exc)}. "
                f"Fix: {_fix(source)}."
            ) from exc
        for i, result in zip(unrecorded, again.results, strict=True):
            results[i] = result
    resolved = ResolvedSuite(source, metadata.name, metadata.version, root, [])
    fetched = 0
    for task_id, result in zip(task_ids, results, strict=True):
        path = Path(result.path)
        origin = _origin(task_id, result)
        resolved.task_dirs.append(path)
        resolved.names[path] = task_id.get_name()
        resolved.origins[path] = origin
        fresh = not result.cached
        fetched += fresh
        _check_cached_copy(path, task_id.get_name(), origin, source.given, fresh=fresh)
    progress(
        f"trl-harbor: {source.given}: {len(task_ids)} task(s) ready in {time.monotonic() - start:.1f} s "
        f"({fetched} fetched, {len(task_ids) - fetched} from the cache {root})"
    )
    return resolved


def _select_task_ids(
    source: DatasetSource,
    task_ids: list[Any],
    task_names: Sequence[str] | None,
    exclude_task_names: Sequence[str] | None,
    limit: int | None,
) -> list[Any]:
    """Harbor's filters (include globs, then exclude globs), sorted by name, then the first ``limit``; names unique."""
    kept = task_ids
    if task_names:
        kept = [t for t in kept if any(fnmatch(t.get_name(), pattern) for pattern in task_names)]
        if not kept:
            names = sorted(t.get_name() for t in task_ids)
            raise TaskSuiteError(
                f"{source.given}: no task matches task_names={list(task_names)} (the dataset has {len(names)} "
                f"tasks, e.g. {names[:5]}). Fix: give globs of its task names."
            )
    if exclude_task_names:
        kept = [t for t in kept if not any(fnmatch(t.get_name(), pattern) for pattern in exclude_task_names)]
    if not kept:
        raise TaskSuiteError(f"{source.given}: the dataset lists no task (after the filters). Fix: check the filters.")
    seen: dict[str, Any] = {}
    problems = []
    for task_id in kept:
        if task_id.get_name() in seen:
            problems.append(
                f"two tasks are named {task_id.get_name()!r}: {_show(seen[task_id.get_name()])} and {_show(task_id)}"
            )
        seen[task_id.get_name()] = task_id
    if problems:
        raise TaskSuiteError(
            f"{source.given}: " + "; ".join(problems) + ". Fix: exclude one (exclude_task_names), or fix the dataset."
        )
    kept = sorted(kept, key=lambda t: t.get_name())
    return kept if limit is None else kept[: max(limit, 0)]


def _show(task_id: Any) -> str:
    if hasattr(task_id, "git_url"):
        return f"{task_id.git_url}@{(task_id.git_commit_id or 'HEAD')[:12]}:{task_id.path}"
    if hasattr(task_id, "org"):
        return f"{task_id.org}/{task_id.name}@{task_id.ref}"
    return str(task_id.path)


def _origin(task_id: Any, result: Any) -> dict[str, Any]:
    if hasattr(task_id, "git_url"):
        commit = result.resolved_git_commit_id or task_id.git_commit_id
        return {"git_url": task_id.git_url, "git_commit_id": commit, "path": task_id.path.as_posix()}
    if hasattr(task_id, "org"):
        ref = f"sha256:{result.content_hash}" if result.content_hash else task_id.ref
        return {"package": f"{task_id.org}/{task_id.name}", "ref": ref}
    return {"path": str(Path(task_id.path).expanduser().resolve())}


# ── a run's lock, read back ──────────────────────────────────────────────────────────────


def resolve_lock(
    lock: str | Path,
    *,
    download_dir: str | Path | None = None,
    progress: Progress | None = None,
) -> ResolvedSuite:
    """The tasks a suite lock pins, each checked against its digest (and fetched again when its copy is gone).

    Each digest is recomputed by the kind the lock records (Harbor's content hash; the tree digest in a
    version 1 lock, or where Harbor had none), so an older lock is checked, never mismatched.

    Args:
        lock: ``path/suite.lock.json``, with ``#N`` or ``#DATASET`` when it holds several suites.
        download_dir: Where a task whose cached copy is gone is fetched again (default: where
            the lock says it was).
        progress: Called with a line per task fetched again (default: stderr).

    Returns:
        The suite, its tasks in the lock's order, with their recorded ``task_index``.

    Raises:
        TaskSuiteError: Naming every task whose copy differs from its digest or cannot be had
            again, the lock holding several suites without a selector, or a malformed lock.
    """
    suites = read_lock(lock)
    if len(suites) > 1:
        listing = ", ".join(f"'{lock}#{i}' ({suite.dataset})" for i, suite in enumerate(suites))
        raise TaskSuiteError(f"{lock}: the lock holds {len(suites)} suites. Fix: pick one: {listing}.")
    locked = suites[0]
    say = progress or _stderr
    source = DatasetSource(str(lock), "lock", str(lock))
    resolved = ResolvedSuite(source, locked.name, locked.version, locked.root, [], indices={}, lock_of=locked)
    problems = []
    for task in locked.tasks:
        path = task.path
        try:
            if not path.is_dir():
                path = _fetch_again(locked, task, download_dir, say)
            digest, kind = lock_digest(path, task.digest_kind)
        except (TaskSuiteError, OSError, ValueError) as exc:
            problems.append(f"task {task.name!r}: {exc}")
            continue
        if digest != task.digest:
            what = "Harbor's content hash" if kind == HARBOR_HASH else "tree digest"
            problems.append(
                f"task {task.name!r} ({path}): its content differs from the lock ({what} {digest}, locked "
                f"{task.digest}). Fix: restore the task (delete a cached copy to fetch the pinned version "
                "again), or resolve the dataset afresh instead of rerunning from this lock."
            )
            continue
        resolved.task_dirs.append(path)
        resolved.names[path] = task.name
        resolved.origins[path] = task.source
        if kind == HARBOR_HASH:  # not a tree digest (an older lock's): the rerun's lock gets Harbor's hash
            resolved.digests[path] = (digest, kind)
        assert resolved.indices is not None
        resolved.indices[path] = task.index
    if problems:
        raise TaskSuiteError(
            f"{lock}: {len(problems)} locked task(s) cannot be used:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return resolved


def _fetch_again(locked: LockedSuite, task: LockedTask, download_dir: str | Path | None, say: Progress) -> Path:
    """A locked task whose copy is gone, fetched from its pinned source."""
    source = task.source
    where = f"{task.path} is gone"
    if "git_url" in source and source.get("git_commit_id"):
        from harbor.models.task.id import GitTaskId
        from harbor.tasks.client import TaskClient

        task_id = GitTaskId(git_url=source["git_url"], git_commit_id=source["git_commit_id"], path=source["path"])
        output = Path(download_dir) if download_dir else locked.root
        say(f"trl-harbor: {task.name}: {where}; fetching {_show(task_id)} again")
        try:
            batch = runtime.run(TaskClient().download_tasks([task_id], output_dir=output))
        except Exception as exc:
            raise TaskSuiteError(f"{where}, and fetching it again failed: {_detail(exc)}. Fix: network access to "
                                 f"{source['git_url']}, or restore the cache") from exc  # fmt: skip
        return Path(batch.results[0].path)
    if "package" in source and source.get("ref"):
        from harbor.models.task.id import PackageTaskId
        from harbor.tasks.client import TaskClient

        org, name = str(source["package"]).split("/", 1)
        task_id = PackageTaskId(org=org, name=name, ref=source["ref"])
        say(f"trl-harbor: {task.name}: {where}; fetching {_show(task_id)} again")
        try:
            batch = runtime.run(TaskClient().download_tasks([task_id], output_dir=download_dir))
        except Exception as exc:
            raise TaskSuiteError(f"{where}, and fetching it again failed: {_detail(exc)}. Fix: network access "
                                 "to the Harbor Hub, or restore the cache") from exc  # fmt: skip
        return Path(batch.results[0].path)
    if "repo_id" in source:
        say(f"trl-harbor: {task.name}: {where}; fetching {source['repo_id']}@{source['revision']} again")
        root, _ = hub_suite(str(source["repo_id"]), str(source["revision"]))
        return root.parent / str(source["path"])
    raise TaskSuiteError(f"{where} (a local task). Fix: restore the folder, or resolve the suite afresh")
