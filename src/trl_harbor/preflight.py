"""Fail fast: a backend that cannot work, a task.toml with a typo, a batch lost to the infrastructure.

One broken sandbox costs one rollout (see ``docs/concurrency.md``). A backend that cannot start
*any* sandbox is different: every rollout fails, every reward is ``None``, and a run that goes on
learns nothing while it logs one long error per rollout. This module stops such runs early:

* :func:`check_backend` runs when a :class:`~trl_harbor.HarborSpec` is built: the backend's own
  Harbor ``preflight()`` (options, credentials; for Docker, that ``docker info`` answers), plus
  loading the backend at all. A failure raises :class:`BackendUnavailableError` naming the cause
  and the fixes. ``HarborSpec(preflight=False)`` (or ``TRL_HARBOR_PREFLIGHT=0``) skips it.
* :func:`check_task_configs` refuses ``task.toml`` keys that Harbor would silently ignore but
  that are a typo of a key it knows (``timeout_secs``), and negative sizes and timeouts; other
  unknown keys are logged once.
* :func:`check_batch` runs after every batch is verified (``spec.reward_funcs``): when at least
  ``infra_stop_fraction`` of a batch's rollouts (default: all of them, in a batch of two or more)
  were lost to the infrastructure, it raises :class:`InfrastructureFailureError` with their
  causes, which stops ``trainer.train()``.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trl_harbor.backends import Backend
    from trl_harbor.suite import TaskInfo

__all__ = [
    "DEFAULT_INFRA_STOP_FRACTION",
    "BackendUnavailableError",
    "InfrastructureFailureError",
    "check_backend",
    "check_batch",
    "check_task_configs",
    "preflight_enabled",
]

logger = logging.getLogger(__name__)

#: By default a run stops when a whole batch (of two rollouts or more) is lost to the infrastructure.
DEFAULT_INFRA_STOP_FRACTION: float = 1.0
#: Smaller batches never stop a run (one lost rollout is an isolated failure).
MIN_GUARDED_BATCH = 2
#: Backends whose preflight passed in this process, by ``(environment_type, options)``.
_PASSED: set[tuple[str, str]] = set()
_WARNED: set[str] = set()


class BackendUnavailableError(RuntimeError):
    """The sandbox backend cannot start any sandbox here (no daemon, no credentials, no SDK)."""


class InfrastructureFailureError(RuntimeError):
    """A whole batch (or more than the allowed fraction of it) was lost to the infrastructure."""


def preflight_enabled(preflight: bool | None) -> bool:
    """Whether to run the backend preflight: the argument, else ``TRL_HARBOR_PREFLIGHT`` (default on).

    Args:
        preflight: ``HarborSpec(preflight=...)``; ``None`` defers to the environment variable.

    Returns:
        ``True`` when the check should run.
    """
    if preflight is not None:
        return bool(preflight)
    return os.environ.get("TRL_HARBOR_PREFLIGHT", "1").strip().lower() not in ("0", "false", "no", "off")


def check_backend(backend: Backend) -> None:
    """Check that a backend can start sandboxes on this machine, before any rollout needs one.

    Runs the backend class's Harbor ``preflight()`` (Harbor's Docker backend asks ``docker info``;
    cloud backends check their credentials; the local backend checks bubblewrap and its options).
    A success is remembered for the rest of the process.

    Args:
        backend: The resolved backend (:func:`trl_harbor.backends.resolve_backend`).

    Raises:
        BackendUnavailableError: When the backend cannot be loaded or its preflight fails; the
            message names the cause and the fixes.
    """
    from harbor.environments.factory import EnvironmentFactory

    config = backend.config
    environment_type = backend.name
    key = (environment_type, json.dumps(dict(config.kwargs), sort_keys=True, default=str))
    if key in _PASSED:
        return
    try:
        EnvironmentFactory.run_preflight(config.type, config.import_path, kwargs=dict(config.kwargs))
    except (SystemExit, Exception) as exc:  # Harbor's preflights exit (SystemExit) on a missing daemon or key
        raise BackendUnavailableError(_unavailable(environment_type, exc)) from None
    _PASSED.add(key)


def _unavailable(environment_type: str, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        cause = f"its Harbor backend cannot be loaded ({type(exc).__name__}: {exc}); install the backend's SDK"
    else:
        cause = str(exc) if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
    cause = cause.strip().rstrip(".")
    detail = _docker_info() if environment_type in ("docker", "podman") or "docker" in cause.lower() else ""
    return (
        f"environment_type={environment_type!r} cannot start sandboxes on this machine: {cause}"
        f"{detail}. Every rollout would fail to start, every reward would be None, and training "
        "would learn nothing. Fix: make the backend work here (for Docker: a running daemon whose "
        "socket this user may use), or pick a backend that does: environment_type='local' runs "
        "tasks in bubblewrap sandboxes without a daemon (docs/local-sandbox.md). To build the spec "
        "anyway (e.g. only for its dataset), pass preflight=False or set TRL_HARBOR_PREFLIGHT=0."
    )


def _docker_info() -> str:
    docker = shutil.which("docker")
    if docker is None:
        return " (no `docker` command on PATH)"
    try:
        result = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f" (`docker info`: {type(exc).__name__}: {exc})"
    lines = [line.strip() for line in (result.stderr or "").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "cannot" in line.lower()] or lines
    return f" (`docker info`: {' '.join(errors[:2])})" if result.returncode and errors else ""


# ── task.toml: keys Harbor would ignore ─────────────────────────────────────────────


def check_task_configs(tasks: Iterable[TaskInfo], suite_root: Path | None = None) -> None:
    """Refuse ``task.toml`` typos, impossible values and links out of the suite, which Harbor accepts.

    Harbor's task model ignores keys it does not know, so ``[verifier] timeout_secs = 600``
    quietly means the default timeout. A key that is close to one Harbor knows, in the same
    table, is refused with the likely fix; other unknown keys (a newer Harbor's, or the suite's
    own) are logged once. Negative CPU, memory, storage and timeout values are refused too.
    Free-form tables (``[metadata]``, ``env`` tables) are not checked. A link (in the task's
    instruction, tests, solution or environment) that leads out of the suite is refused: it
    would put a file of the trainer's machine into a prompt, a grader or a sandbox, and
    Docker's build context does not follow it either.

    Args:
        tasks: The validated tasks (:func:`trl_harbor.suite.load_suite`), whose ``task.toml`` was read once.
        suite_root: The folder the links may point into (default: each task's parent).

    Raises:
        trl_harbor.suite.TaskSuiteError: Naming every such key or value, its file and the fix.
    """
    from harbor.models.task.config import TaskConfig

    from trl_harbor.suite import TaskSuiteError

    problems: list[str] = []
    for info in tasks:
        path = info.path / "task.toml"
        for where, key, close in _unknown_keys(info.raw, TaskConfig, ""):
            if close:
                problems.append(
                    f"{path}: unknown key {where}{key!r}, which Harbor would silently ignore. "
                    f"Fix: did you mean {close!r}?"
                )
            elif (label := f"{where}{key}") not in _WARNED:
                _WARNED.add(label)
                logger.warning("trl-harbor: %s: Harbor ignores the unknown task.toml key %s%r", path, where, key)
        problems += [f"{path}: {p}" for p in _negative_values(info.raw, "")]
        problems += _outside_links(info.path, Path(suite_root or info.path.parent))
    if problems:
        raise TaskSuiteError(
            f"{len(problems)} problem(s) in task.toml files:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _unknown_keys(raw: Any, model: Any, where: str) -> list[tuple[str, str, str | None]]:
    """``(table, key, closest known key or None)`` for every key ``model`` does not declare."""
    from pydantic import BaseModel

    if not isinstance(raw, dict):
        return []
    fields = model.model_fields
    names = {}
    for name, info in fields.items():
        names[name] = info
        if info.alias:
            names[info.alias] = info
    found: list[tuple[str, str, str | None]] = []
    for key, value in raw.items():
        info = names.get(key)
        if info is None:
            if model.model_config.get("extra") == "allow" or key in _LEGACY_KEYS.get(where, ()):
                continue
            close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.8)
            found.append((f"[{where}] " if where else "", key, close[0] if close else None))
            continue
        for sub in _models_in(info.annotation, BaseModel):
            label = f"{where}.{key}" if where else key
            if isinstance(value, list):
                for item in value:
                    found += _unknown_keys(item, sub, label)
            else:
                found += _unknown_keys(value, sub, label)
            break
    return found


def _models_in(annotation: Any, base: type) -> list[type]:
    """The pydantic models an annotation may hold (``X``, ``X | None``, ``list[X]``)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, base):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg, base)
    return found


#: Keys Harbor's task model still reads although they are not fields (legacy names it migrates).
_LEGACY_KEYS = {"": {"version"}, "environment": {"memory", "storage", "allow_internet"}}


def _outside_links(task_dir: Path, suite_root: Path) -> list[str]:
    root = suite_root.resolve()
    found = []
    for folder, dirs, files in os.walk(task_dir):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            if not path.is_symlink():
                continue
            target = path.resolve()
            if not target.is_relative_to(root):
                found.append(
                    f"{path}: links to {target}, outside the suite ({root}). Fix: copy the file into the "
                    "task (a link out of the suite would hand a file of this machine to a prompt, a "
                    "grader or a sandbox)."
                )
    return found


_NON_NEGATIVE = ("cpus", "memory_mb", "storage_mb", "gpus", "timeout_sec", "build_timeout_sec")


def _negative_values(raw: Any, where: str) -> list[str]:
    found: list[str] = []
    if isinstance(raw, list):
        for item in raw:
            found += _negative_values(item, where)
    if not isinstance(raw, dict) or where.endswith(("metadata", "env")):
        return found
    for key, value in raw.items():
        label = f"{where}.{key}" if where else key
        if key in _NON_NEGATIVE and isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            found.append(f"{label} = {value} is negative. Fix: a positive value (or remove it for the default).")
        found += _negative_values(value, label)
    return found


# ── the batch guard ─────────────────────────────────────────────────────────────────


def check_batch(outcomes: Sequence[Any], infra_stop_fraction: float | None = DEFAULT_INFRA_STOP_FRACTION) -> None:
    """Stop the run when a batch is lost to the infrastructure, naming the causes.

    Args:
        outcomes: Each rollout's :class:`~trl_harbor.env.Verification` (``None`` for
            environments that are not trl-harbor's).
        infra_stop_fraction: Stop when at least this fraction of the batch (of
            :data:`MIN_GUARDED_BATCH` rollouts or more) was lost; ``None`` never stops.

    Raises:
        InfrastructureFailureError: With how many rollouts were lost and their most common causes.
    """
    if infra_stop_fraction is None or len(outcomes) < MIN_GUARDED_BATCH:
        return
    lost = [o for o in outcomes if o is not None and getattr(o, "infra", False)]
    if not lost or len(lost) / len(outcomes) < infra_stop_fraction:
        return
    causes = Counter(str(o.reason) for o in lost).most_common(3)
    listed = "\n".join(f"  - {count} x {reason}" for reason, count in causes)
    raise InfrastructureFailureError(
        f"{len(lost)} of {len(outcomes)} rollouts of this batch were lost to the infrastructure "
        f"(at least {infra_stop_fraction:.0%} stops the run): the backend is not working, and "
        f"training on what is left would learn nothing. Most common causes:\n{listed}\n"
        "Fix the backend (see the causes), or pick another one (environment_type='local'). "
        "To go on anyway, build the spec with HarborSpec(..., infra_stop_fraction=None)."
    )
