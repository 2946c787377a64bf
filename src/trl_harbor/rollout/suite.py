"""Finding, validating and describing the tasks of a Harbor task suite.

A *suite* is a folder of Harbor task directories (``instruction.md``, ``task.toml``,
``environment/``, ``tests/test.sh``, optionally ``solution/``), found at any depth (grouped
layouts such as ``tasks/<field>/<subfield>/<task>/`` included) without following links out of
it. It is given either as a local path — a folder holding a ``tasks/`` subtree, or a folder
holding task dirs — or as the id of a Hugging Face **dataset** repo whose ``tasks/`` subtree is
downloaded (only that subtree) with :func:`huggingface_hub.snapshot_download`, which honours the
hub cache and offline mode (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``), and copied out of the hub
cache as real files (the cache's snapshots are links into a blob store, which a backend's
upload would not carry). Registry names, Harbor Hub packages and git repositories are resolved
one layer up, by :mod:`trl_harbor.rollout.sources`.

Every task is validated up front, with Harbor's own task model, so that a malformed suite
fails when it is loaded, naming the task, what is wrong with it and how to fix it, rather than
in the middle of training.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

__all__ = [
    "RESERVED_COLUMNS",
    "TaskInfo",
    "TaskSuite",
    "TaskSuiteError",
    "cache_root",
    "candidate_task_dirs",
    "filter_task_dirs",
    "find_suite_root",
    "find_task_dirs",
    "hub_suite",
    "load_tasks",
    "load_suite",
    "load_task",
    "looks_like_path",
    "materialise_hub_snapshot",
    "metadata_columns",
    "select_tasks",
    "validate_task",
]

#: Dataset columns owned by the spec; a metadata key with one of these names is renamed.
RESERVED_COLUMNS: tuple[str, ...] = ("prompt", "task_dir", "task_index", "environment")

#: Columns that ``trl.experimental.harbor`` derives from ``[metadata]``, kept for drop-in
#: compatibility: column name -> metadata key.
COMPAT_COLUMNS: dict[str, str] = {
    "gold_answer": "gold_answer",
    "reward_mode": "reward_mode_initial",
    "difficulty_level": "difficulty_level",
    "kaggle_dataset": "kaggle_dataset_name",
}


class TaskSuiteError(ValueError):
    """A task suite cannot be found, downloaded, or contains a malformed task.

    The message names every offending path, what is wrong with it, and how to fix it.
    """


@dataclass(frozen=True)
class TaskInfo:
    """One validated task of a suite.

    Attributes:
        path: Absolute path of the task directory.
        name: The task's name (its directory name, or ``[task].name`` when set).
        metadata: The task's ``[metadata]`` table from ``task.toml``.
        steps: How many ``[[steps]]`` the task has (0: a single-step task).
        compose: Whether its environment is a ``docker-compose.yaml`` (sidecar services).
        task: Harbor's parsed task (the one every layer of this process reads; see :func:`load_task`).
        raw: ``task.toml`` as read, unknown keys included (for the typo check).
    """

    path: Path
    name: str
    metadata: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    compose: bool = False
    task: Any = field(default=None, repr=False, compare=False)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class TaskSuite:
    """A validated suite: where it lives and its tasks, sorted by directory name.

    Attributes:
        source: What the user passed (a path or a hub dataset id).
        root: The local folder whose children are the task directories.
        tasks: Every task of the suite, sorted by directory name.
    """

    source: str
    root: Path
    tasks: tuple[TaskInfo, ...]


def looks_like_path(dataset: str) -> bool:
    """Whether a dataset string is written as a path, whether or not anything is there.

    Args:
        dataset: The dataset string.

    Returns:
        ``True`` when it starts with ``.``, ``/``, ``~`` or a backslash, has a drive letter
        (``C:``), holds a backslash, or holds two slashes or more (``a/b/c``); ``False`` for a
        bare ``name`` or ``org/name`` (a registry name or a Hugging Face id).
    """
    if dataset.startswith((".", "/", "~", "\\")) or (len(dataset) > 1 and dataset[1] == ":"):
        return True
    return dataset.count("/") > 1 or "\\" in dataset


def _is_candidate_task_dir(path: Path) -> bool:
    if not path.is_dir() or path.name.startswith((".", "_")):
        return False
    return any((path / name).exists() for name in ("task.toml", "instruction.md", "tests"))


def _walk_task_dirs(root: Path) -> tuple[list[Path], list[str]]:
    """Task-looking folders at any depth under ``root``, and the links out of it that look like tasks.

    A task folder is a leaf (nothing under it is searched); hidden and ``_``-prefixed folders are
    skipped; links to folders are never followed (one inside the suite is found under its real
    path; one out of it is reported when it looks like a task).
    """
    found: list[Path] = []
    outside: list[str] = []
    resolved_root = root.resolve()
    for folder, dirs, _files in os.walk(root, followlinks=False):
        here = Path(folder)
        keep = []
        for name in sorted(dirs):
            child = here / name
            if name.startswith((".", "_")):
                continue
            if child.is_symlink():
                target = child.resolve()
                if not target.is_relative_to(resolved_root) and _is_candidate_task_dir(target):
                    outside.append(
                        f"{child}: links to {target}, outside the suite ({resolved_root}); links are not "
                        "followed out of a suite. Fix: copy (or move) the task into the suite."
                    )
                continue
            if _is_candidate_task_dir(child):
                found.append(child)
            else:
                keep.append(name)
        dirs[:] = keep
    return found, outside


def _holds_tasks(folder: Path) -> bool:
    return bool(_walk_task_dirs(folder)[0])


def find_suite_root(dataset: str | Path, revision: str | None = None) -> Path:
    """Resolve a suite argument to the local folder under which its task directories live.

    A local folder with a ``tasks/`` subtree resolves to that subtree; a local folder holding
    task dirs (at any depth) resolves to itself; anything else is treated as a Hugging Face
    dataset repo id and its ``tasks/`` subtree is fetched (or read from the hub cache) and
    copied out of the hub cache as real files (:func:`materialise_hub_snapshot`).

    Args:
        dataset: A local path or a Hugging Face dataset repo id.
        revision: Hub revision (branch, tag or commit) for a repo id; ignored for local paths.

    Returns:
        The folder holding the task directories.

    Raises:
        TaskSuiteError: When the path does not exist, holds no tasks, or the hub repo cannot
            be resolved (e.g. offline and not in the cache).
    """
    local = Path(dataset).expanduser()
    if local.is_dir():
        if (local / "tasks").is_dir():
            return (local / "tasks").resolve()
        if _holds_tasks(local):
            return local.resolve()
        raise TaskSuiteError(
            f"{local}: the folder holds no Harbor tasks (neither a 'tasks/' subfolder nor folders "
            "with task.toml / instruction.md, at any depth). Fix: point `dataset` at the folder that "
            "contains the task directories or their parent 'tasks/' folder."
        )
    if isinstance(dataset, Path) or local.exists() or looks_like_path(str(dataset)):
        raise TaskSuiteError(
            f"{dataset}: no such directory. Fix: pass an existing local folder of Harbor tasks, "
            "or a Hugging Face dataset repo id like 'org/name'."
        )
    return hub_suite(str(dataset), revision)[0]


def cache_root() -> Path:
    """trl-harbor's cache folder: ``$TRL_HARBOR_CACHE_DIR``, else ``~/.cache/trl-harbor``.

    Returns:
        The folder (not created).
    """
    configured = os.environ.get("TRL_HARBOR_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path("~/.cache/trl-harbor").expanduser()


def hub_suite(repo_id: str, revision: str | None) -> tuple[Path, str]:
    """Fetch a Hugging Face dataset repo's ``tasks/`` subtree and copy it out of the hub cache as real files.

    Args:
        repo_id: The dataset repo id (``org/name``).
        revision: Branch, tag or commit (``None``: ``main``).

    Returns:
        ``(folder holding the task directories, the snapshot's commit)``.

    Raises:
        TaskSuiteError: When the repo cannot be resolved (offline and not cached, unknown,
            no access), or has no ``tasks/`` folder.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - huggingface_hub ships with the train extra
        raise TaskSuiteError(
            f"{repo_id}: not a local folder, and huggingface_hub is not installed to fetch it "
            "from the Hub. Fix: pip install 'trl-harbor[train]' or pass a local path."
        ) from exc
    try:
        snapshot = Path(
            snapshot_download(
                repo_id,
                repo_type="dataset",
                allow_patterns=["tasks/**"],
                revision=revision,
            )
        )
    except Exception as exc:  # hub errors have many types (offline, 404, auth, network)
        raise TaskSuiteError(
            f"{repo_id}: not a local folder, and the Hugging Face dataset repo could not be "
            f"resolved (revision={revision or 'main'}): {type(exc).__name__}: {exc}. Fix: check "
            "the path / repo id and revision; when offline (HF_HUB_OFFLINE=1) the repo must "
            "already be in the hub cache (HF_HUB_CACHE) — download it once with network access."
        ) from exc
    if not (snapshot / "tasks").is_dir():
        raise TaskSuiteError(
            f"{repo_id}: the dataset repo (snapshot {snapshot}) has no 'tasks/' folder. Fix: "
            "Harbor suites on the Hub must keep their task directories under 'tasks/'."
        )
    commit = snapshot.name
    return materialise_hub_snapshot(snapshot, repo_id), commit


def materialise_hub_snapshot(snapshot: Path, repo_id: str) -> Path:
    """Copy a hub snapshot's ``tasks/`` out of the hub cache, its blob-store links made real files.

    The hub cache keeps each snapshot file as a link into the repo's blob store; a backend that
    uploads a task folder (a tar of it, Docker's build context) would carry the links, not the
    files. The copy lives in trl-harbor's cache (``<cache>/hub/<repo>/<commit>/tasks``), made
    once per commit: staged, then renamed into place, so a copy that exists is complete. A link
    that points elsewhere than the repo's own cache folder is kept a link (the suite check
    refuses a link out of the suite).

    Args:
        snapshot: The snapshot folder (``.../datasets--org--name/snapshots/<commit>``).
        repo_id: The repo id (names the copy).

    Returns:
        The copied ``tasks/`` folder.

    Raises:
        TaskSuiteError: When the copy cannot be made (a blob is missing, the disk is full).
    """
    source = snapshot / "tasks"
    repo_store = snapshot.parent.parent.resolve()  # datasets--org--name/
    target = cache_root() / "hub" / repo_id.replace("/", "--") / snapshot.name
    if (target / "tasks").is_dir():
        return target / "tasks"
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{snapshot.name}-", dir=target.parent))
    try:
        for folder, dirs, files in os.walk(source, followlinks=False):
            here = Path(folder)
            out = staging / "tasks" / here.relative_to(source)
            out.mkdir(parents=True, exist_ok=True)
            for name in [*dirs, *files]:
                path = here / name
                if not path.is_symlink():
                    if name in files:
                        shutil.copy2(path, out / name)
                    continue
                resolved = path.resolve()
                if resolved.is_relative_to(repo_store) and resolved.is_file():
                    shutil.copy2(resolved, out / name)  # a blob: the file itself
                else:
                    (out / name).symlink_to(os.readlink(path))
                    if name in dirs:
                        dirs.remove(name)
        try:
            os.replace(staging, target)
        except OSError:  # another process made it first: its copy is as good
            if not (target / "tasks").is_dir():
                raise
    except OSError as exc:
        raise TaskSuiteError(
            f"{repo_id}: could not copy the snapshot {snapshot} out of the hub cache into {target}: {exc}. "
            "Fix: free disk space or set TRL_HARBOR_CACHE_DIR to a writable folder; a blob missing from the "
            "hub cache is fetched again by deleting the snapshot (huggingface-cli delete-cache)."
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / "tasks"


def _read_config(task_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    config_path = task_dir / "task.toml"
    if not config_path.is_file():
        return None, ['task.toml is missing. Fix: add a task.toml (at least `version = "1.0"`) to the task.']
    try:
        return tomllib.loads(config_path.read_text(encoding="utf-8")), []
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return None, [f"task.toml is not valid TOML ({exc}). Fix: correct the syntax of {config_path}."]


def validate_task(task_dir: Path) -> tuple[TaskInfo | None, list[str]]:
    """Check one task directory with Harbor's own task model.

    Args:
        task_dir: The task directory.

    Returns:
        ``(info, problems)``: ``info`` is ``None`` when the task is unusable, and ``problems``
        lists every defect found, each with a hint on how to fix it.
    """
    raw, problems = _read_config(task_dir)
    has_steps = bool(raw and raw.get("steps"))
    if not has_steps and not (task_dir / "instruction.md").is_file():
        problems.append("instruction.md is missing. Fix: add instruction.md with the prompt the agent gets.")
    # Each step has its own tests (steps/<name>/tests/), and a separate verifier image may bundle its
    # own: Harbor's model checks those below.
    elsewhere = has_steps or bool(raw and (raw.get("verifier") or {}).get("environment"))
    tests = ("test.sh", "test.ps1", "test.cmd", "test.bat")
    if not elsewhere and not any((task_dir / "tests" / name).is_file() for name in tests):
        problems.append(
            "tests/test.sh is missing. Fix: add tests/test.sh that writes "
            "/logs/verifier/reward.txt (a number) or /logs/verifier/reward.json."
        )
    if problems:
        return None, problems

    try:
        task = load_task(task_dir)
    except Exception as exc:  # pydantic ValidationError, FileNotFoundError, ValueError, ...
        detail = " ".join(str(exc).split())
        return None, [
            f"Harbor rejects the task: {type(exc).__name__}: {detail}. Fix: make task.toml and "
            "the task layout follow Harbor's task format (see `harbor tasks check`)."
        ]
    problems = _missing_host_variables(task)
    if problems:
        return None, problems
    metadata = dict(task.config.metadata or {})
    compose = (task_dir / "environment" / "docker-compose.yaml").is_file()
    steps = len(task.config.steps or [])
    return TaskInfo(task_dir.resolve(), task.name, metadata, steps, compose, task=task, raw=raw or {}), []


_TASKS: dict[Path, Any] = {}


def load_task(task_dir: Path) -> Any:
    """Harbor's ``Task`` for a folder, parsed once per process (``reset`` runs thousands of times on a few tasks).

    Args:
        task_dir: The task directory.

    Returns:
        The ``harbor.models.task.task.Task``.

    Raises:
        Exception: Whatever Harbor's model raises for a malformed task.
    """
    from harbor.models.task.task import Task

    key = Path(task_dir).resolve()
    task = _TASKS.get(key)
    if task is None:
        task = _TASKS[key] = Task(key)
    return task


def _missing_host_variables(task: Any) -> list[str]:
    """``${VAR}`` values of the task's env tables that this host cannot fill (Harbor would fail at start)."""
    from harbor.utils.env import resolve_env_vars

    tables = {"[environment.env]": task.config.environment.env, "[verifier.env]": task.config.verifier.env}
    for step in task.config.steps or []:
        tables[f"[[steps]] {step.name!r} [verifier.env]"] = step.verifier.env
    problems = []
    for table, values in tables.items():
        for key, value in (values or {}).items():
            try:
                resolve_env_vars({key: value})
            except ValueError as exc:
                problems.append(
                    f"task.toml {table} {key} = {value!r}: {exc}. Fix: set it on this machine before "
                    f"training (export it), or give a default: '${{NAME:-value}}'."
                )
    return problems


def find_task_dirs(root: Path) -> list[Path]:
    """The task-looking folders under a suite root, at any depth, sorted by name, not validated.

    Args:
        root: The suite root (:func:`find_suite_root`).

    Returns:
        The candidate task directories, sorted by folder name.

    Raises:
        TaskSuiteError: When the root holds no task directory, two tasks share a folder name
            (both paths named), or a link out of the suite leads to a task.
    """
    found, outside = _walk_task_dirs(Path(root))
    problems = list(outside)
    by_name: dict[str, Path] = {}
    for path in found:
        if path.name in by_name:
            problems.append(
                f"two tasks are named {path.name!r}: {by_name[path.name]} and {path}. Fix: rename one "
                "folder (task names must be unique within a suite), or exclude one (exclude_task_names)."
            )
        else:
            by_name[path.name] = path
    if problems:
        raise TaskSuiteError(
            f"{len(problems)} problem(s) in task suite {root}:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    if not found:
        raise TaskSuiteError(
            f"{root}: no task directories found. Fix: each task is a folder with instruction.md, "
            "task.toml, environment/ and tests/test.sh."
        )
    return sorted(found, key=lambda p: p.name)


def filter_task_dirs(
    task_dirs: Sequence[Path],
    task_names: Sequence[str] | None = None,
    exclude_task_names: Sequence[str] | None = None,
    *,
    dataset: str = "",
) -> list[Path]:
    """Keep the tasks whose folder name matches an include glob and no exclude glob (Harbor's rule).

    Args:
        task_dirs: The task folders.
        task_names: Shell-style globs (``fnmatch``) of the task names to keep (``None``: all).
        exclude_task_names: Globs of the task names to leave out (applied after ``task_names``).
        dataset: The suite, for the error message.

    Returns:
        The kept folders, in the order given.

    Raises:
        TaskSuiteError: When ``task_names`` matches no task (some task names are listed).
    """
    kept = list(task_dirs)
    if task_names:
        kept = [d for d in kept if any(fnmatch(d.name, pattern) for pattern in task_names)]
        if not kept:
            names = sorted(d.name for d in task_dirs)
            raise TaskSuiteError(
                f"{dataset}: no task matches task_names={list(task_names)} (the suite has {len(names)} tasks, "
                f"e.g. {names[:5]}). Fix: give globs of task folder names, such as 'data-*'."
            )
    if exclude_task_names:
        kept = [d for d in kept if not any(fnmatch(d.name, pattern) for pattern in exclude_task_names)]
    return kept


def candidate_task_dirs(dataset: str | Path, revision: str | None = None) -> list[Path]:
    """The folders of a suite that look like tasks, sorted by name, without validating them.

    Args:
        dataset: A local path or a Hugging Face dataset repo id (see :func:`find_suite_root`).
        revision: Hub revision for a repo id.

    Returns:
        The candidate task directories (at any depth under the suite).

    Raises:
        TaskSuiteError: When the suite cannot be found, holds no task directory, or two tasks
            share a name.
    """
    return find_task_dirs(find_suite_root(dataset, revision))


def load_tasks(task_dirs: Sequence[Path], *, source: str, root: Path) -> TaskSuite:
    """Validate given task folders into a suite.

    Args:
        task_dirs: The task folders, in suite order.
        source: What the user passed (for messages).
        root: The folder the suite lives in.

    Returns:
        The validated suite.

    Raises:
        TaskSuiteError: When any task is malformed (the message lists every malformed task).
    """
    tasks: list[TaskInfo] = []
    errors: list[str] = []
    for candidate in task_dirs:
        info, problems = validate_task(candidate)
        if info is None:
            errors += [f"{candidate}: {problem}" for problem in problems]
        else:
            tasks.append(info)
    if errors:
        raise TaskSuiteError(
            f"{len(errors)} problem(s) in task suite {source}:\n" + "\n".join(f"  - {e}" for e in errors)
        )
    return TaskSuite(source=source, root=Path(root), tasks=tuple(tasks))


def load_suite(dataset: str | Path, revision: str | None = None) -> TaskSuite:
    """Find and validate every task of a suite (a local folder or a Hugging Face dataset id).

    Args:
        dataset: A local path or a Hugging Face dataset repo id (see :func:`find_suite_root`);
            registry names, Harbor Hub packages and git repositories go through
            :func:`trl_harbor.rollout.sources.resolve_suite`.
        revision: Hub revision for a repo id.

    Returns:
        The validated suite, tasks sorted by folder name.

    Raises:
        TaskSuiteError: When the suite cannot be found, is empty, or any task is malformed
            (the message lists every malformed task).
    """
    root = find_suite_root(dataset, revision)
    return load_tasks(find_task_dirs(root), source=str(dataset), root=root)


def select_tasks(
    tasks: Sequence[TaskInfo],
    num_tasks: int | None = None,
    indices: Sequence[int] | None = None,
) -> list[tuple[int, TaskInfo]]:
    """Pick a subset of the sorted task list.

    Args:
        tasks: The suite's tasks, sorted.
        num_tasks: Keep the first ``num_tasks`` tasks.
        indices: Keep exactly these positions (into ``tasks``), in this order.

    Returns:
        ``(index, task)`` pairs, ``index`` being the position in the full sorted list.

    Raises:
        ValueError: When both selectors are given, ``num_tasks`` is negative, or an index is
            out of range.
    """
    if num_tasks is not None and indices is not None:
        raise ValueError("Provide num_tasks or indices, not both.")
    if indices is not None:
        picked: list[tuple[int, TaskInfo]] = []
        for i in indices:
            if not -len(tasks) <= int(i) < len(tasks):
                raise ValueError(
                    f"Task index {i} is out of range: the suite has {len(tasks)} tasks "
                    f"(valid indices 0..{len(tasks) - 1})."
                )
            picked.append((int(i) % len(tasks), tasks[int(i)]))
        return picked
    if num_tasks is not None:
        if num_tasks < 0:
            raise ValueError(f"num_tasks must be >= 0, got {num_tasks}.")
        return list(enumerate(tasks))[:num_tasks]
    return list(enumerate(tasks))


def _stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float" if math.isfinite(value) else "other"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "list[str]"
    return "other"


def _consistent(values: list[Any]) -> list[Any]:
    """Make one column's values a single type that ``datasets`` accepts (``None`` stays ``None``)."""
    kinds = {_kind(v) for v in values if v is not None}
    if not kinds:
        return values
    if len(kinds) == 1 and "other" not in kinds:
        return [list(v) if isinstance(v, tuple) else v for v in values]
    if kinds == {"int", "float"}:
        return [None if v is None else float(v) for v in values]
    return [None if v is None else _stringify(v) for v in values]


def metadata_columns(tasks: Sequence[TaskInfo]) -> dict[str, list[Any]]:
    """Turn the tasks' ``[metadata]`` tables into dataset columns.

    Every key found in any task becomes a column (``None`` where a task lacks it). A column
    whose values mix types is made consistent: ints and floats become floats, anything else
    mixed (or nested) becomes strings (JSON for lists and tables). The columns that
    ``trl.experimental.harbor`` derives (``gold_answer``, ``reward_mode``, ``difficulty_level``,
    ``kaggle_dataset``) are always present. A key that collides with a spec column
    (:data:`RESERVED_COLUMNS`) is renamed ``metadata_<key>``.

    Args:
        tasks: The selected tasks, in dataset order.

    Returns:
        Column name -> one value per task.
    """
    keys: dict[str, None] = {}
    for task in tasks:
        keys.update(dict.fromkeys(task.metadata))
    columns: dict[str, list[Any]] = {}
    for column, key in COMPAT_COLUMNS.items():
        columns[column] = _consistent([task.metadata.get(key) for task in tasks])
    for key in keys:
        column = f"metadata_{key}" if key in RESERVED_COLUMNS else key
        if column in columns and COMPAT_COLUMNS.get(column) == key:
            continue
        if column in columns:  # e.g. a literal "reward_mode" key next to reward_mode_initial
            column = f"metadata_{key}"
        columns[column] = _consistent([task.metadata.get(key) for task in tasks])
    return columns
