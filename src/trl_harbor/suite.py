"""Finding, validating and describing the tasks of a Harbor task suite.

A *suite* is a folder of Harbor task directories (``instruction.md``, ``task.toml``,
``environment/``, ``tests/test.sh``, optionally ``solution/``). It is given either as a local
path — a folder holding a ``tasks/`` subtree, or a folder whose children are task dirs — or as
the id of a Hugging Face **dataset** repo whose ``tasks/`` subtree is downloaded (only that
subtree) with :func:`huggingface_hub.snapshot_download`, which honours the hub cache and offline
mode (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``).

Every task is validated up front, with Harbor's own task model, so that a malformed suite
fails when it is loaded, naming the task, what is wrong with it and how to fix it, rather than
in the middle of training.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RESERVED_COLUMNS",
    "TaskInfo",
    "TaskSuite",
    "TaskSuiteError",
    "candidate_task_dirs",
    "find_suite_root",
    "load_suite",
    "load_task",
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


def _looks_like_path(dataset: str) -> bool:
    if dataset.startswith((".", "/", "~", "\\")) or (len(dataset) > 1 and dataset[1] == ":"):
        return True
    return dataset.count("/") > 1 or "\\" in dataset


def _is_candidate_task_dir(path: Path) -> bool:
    if not path.is_dir() or path.name.startswith((".", "_")):
        return False
    return any((path / name).exists() for name in ("task.toml", "instruction.md", "tests"))


def find_suite_root(dataset: str | Path, revision: str | None = None) -> Path:
    """Resolve a suite argument to the local folder whose children are task directories.

    A local folder with a ``tasks/`` subtree resolves to that subtree; a local folder whose
    children are task dirs resolves to itself; anything else is treated as a Hugging Face
    dataset repo id and its ``tasks/`` subtree is fetched (or read from the hub cache).

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
        if any(_is_candidate_task_dir(child) for child in local.iterdir()):
            return local.resolve()
        raise TaskSuiteError(
            f"{local}: the folder holds no Harbor tasks (neither a 'tasks/' subfolder nor child "
            "folders with task.toml / instruction.md). Fix: point `dataset` at the folder that "
            "contains the task directories or their parent 'tasks/' folder."
        )
    if isinstance(dataset, Path) or local.exists() or _looks_like_path(str(dataset)):
        raise TaskSuiteError(
            f"{dataset}: no such directory. Fix: pass an existing local folder of Harbor tasks, "
            "or a Hugging Face dataset repo id like 'org/name'."
        )
    return _download_hub_suite(str(dataset), revision)


def _download_hub_suite(repo_id: str, revision: str | None) -> Path:
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
    root = snapshot / "tasks"
    if not root.is_dir():
        raise TaskSuiteError(
            f"{repo_id}: the dataset repo (snapshot {snapshot}) has no 'tasks/' folder. Fix: "
            "Harbor suites on the Hub must keep their task directories under 'tasks/'."
        )
    return root


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


def candidate_task_dirs(dataset: str | Path, revision: str | None = None) -> list[Path]:
    """The folders of a suite that look like tasks, sorted by name, without validating them.

    Args:
        dataset: A local path or a Hugging Face dataset repo id (see :func:`find_suite_root`).
        revision: Hub revision for a repo id.

    Returns:
        The candidate task directories.

    Raises:
        TaskSuiteError: When the suite cannot be found or holds no task directory.
    """
    root = find_suite_root(dataset, revision)
    candidates = sorted((child for child in root.iterdir() if _is_candidate_task_dir(child)), key=lambda p: p.name)
    if not candidates:
        raise TaskSuiteError(
            f"{root}: no task directories found. Fix: each task is a folder with instruction.md, "
            "task.toml, environment/ and tests/test.sh."
        )
    return candidates


def load_suite(dataset: str | Path, revision: str | None = None) -> TaskSuite:
    """Find and validate every task of a suite.

    Args:
        dataset: A local path or a Hugging Face dataset repo id (see :func:`find_suite_root`).
        revision: Hub revision for a repo id.

    Returns:
        The validated suite, tasks sorted by directory name.

    Raises:
        TaskSuiteError: When the suite cannot be found, is empty, or any task is malformed
            (the message lists every malformed task).
    """
    root = find_suite_root(dataset, revision)
    candidates = candidate_task_dirs(root)
    tasks: list[TaskInfo] = []
    errors: list[str] = []
    for candidate in candidates:
        info, problems = validate_task(candidate)
        if info is None:
            errors += [f"{candidate}: {problem}" for problem in problems]
        else:
            tasks.append(info)
    if errors:
        raise TaskSuiteError(
            f"{len(errors)} problem(s) in task suite {dataset!s}:\n" + "\n".join(f"  - {e}" for e in errors)
        )
    return TaskSuite(source=str(dataset), root=root, tasks=tuple(tasks))


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
