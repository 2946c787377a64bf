"""Fail fast: a backend that cannot work, a task.toml with a typo, a batch lost to the infrastructure.

One broken sandbox costs one rollout (see ``docs/concurrency.md``). A backend that cannot start
*any* sandbox is different: every rollout fails, every reward is ``None``, and a run that goes on
learns nothing while it logs one long error per rollout. This module stops such runs early:

* :func:`check_backend` runs when a spec's environment factory (or rollout function) is first
  used — the trainer's construction, ``trl-harbor check``/``eval`` — not when the spec is built
  (:class:`~trl_harbor.training.spec.BackendCheck`): the backend's own
  Harbor ``preflight()`` (options, credentials; for Docker, that ``docker info`` answers), plus
  loading the backend at all. A failure raises :class:`BackendUnavailableError` naming the cause
  and the fixes. ``HarborSpec(preflight=False)`` (or ``TRL_HARBOR_PREFLIGHT=0``) skips it.
  For Docker it also checks what the suite's tasks need of the daemon
  (:func:`docker_network_problem`): a task whose network is not public (``no-network``, an
  allowlist) runs only where Harbor's egress-control images can run, and Harbor refuses it
  otherwise only when its sandbox is created, i.e. mid-run.
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
    from trl_harbor.rollout.backends import Backend
    from trl_harbor.rollout.suite import TaskInfo

__all__ = [
    "DEFAULT_INFRA_STOP_FRACTION",
    "BackendUnavailableError",
    "InfrastructureFailureError",
    "check_backend",
    "check_batch",
    "check_task_configs",
    "docker_network_problem",
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


def check_backend(backend: Backend, task_dirs: Sequence[Path] | None = None) -> None:
    """Check that a backend can start sandboxes on this machine, before any rollout needs one.

    Runs the backend class's Harbor ``preflight()`` (Harbor's Docker backend asks ``docker info``;
    cloud backends check their credentials; the local backend checks bubblewrap and its options).
    A success is remembered for the rest of the process. With ``task_dirs``, Docker is also
    checked against what those tasks need (:func:`docker_network_problem`).

    Args:
        backend: The resolved backend (:func:`trl_harbor.rollout.backends.resolve_backend`).
        task_dirs: The tasks that will run on it (``HarborSpec``'s selection).

    Raises:
        BackendUnavailableError: When the backend cannot be loaded or its preflight fails, or
            when Docker cannot enforce a task's network policy; the message names the cause
            and the fixes.
    """
    from harbor.environments.factory import EnvironmentFactory

    config = backend.config
    environment_type = backend.name
    key = (environment_type, json.dumps(dict(config.kwargs), sort_keys=True, default=str))
    if key not in _PASSED:
        try:
            EnvironmentFactory.run_preflight(config.type, config.import_path, kwargs=dict(config.kwargs))
        except (SystemExit, Exception) as exc:  # Harbor's preflights exit (SystemExit) on a missing daemon or key
            raise BackendUnavailableError(_unavailable(backend, exc)) from None
        _PASSED.add(key)
    if task_dirs:
        problem = docker_network_problem(backend, task_dirs)
        if problem:
            raise BackendUnavailableError(problem)


def _unavailable(backend: Backend, exc: BaseException) -> str:
    environment_type = backend.name
    try:
        kind = backend.kind  # what it is by its class, whatever it was called
    except Exception:  # noqa: BLE001 - a class that cannot load: the error below says so
        kind = environment_type
    if isinstance(exc, ImportError):
        cause = f"its Harbor backend cannot be loaded ({type(exc).__name__}: {exc}); install the backend's SDK"
    else:
        cause = str(exc) if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
    cause = cause.strip().rstrip(".")
    if kind == "local":  # the local sandbox's own message names the cause and the fixes
        return (
            f"environment_type={environment_type!r} cannot start sandboxes on this machine: {cause}. Every rollout "
            "would fail to start. To skip this check, build the spec with HarborSpec(..., preflight=False) or set "
            "TRL_HARBOR_PREFLIGHT=0."
        )
    detail = _docker_info() if kind in ("docker", "podman") or "docker" in cause.lower() else ""
    return (
        f"environment_type={environment_type!r} cannot start sandboxes on this machine: {cause}"
        f"{detail}. Every rollout would fail to start, every reward would be None, and training "
        "would learn nothing. Fix: make the backend work here (for Docker: a running daemon whose "
        "socket this user may use), or pick a backend that does: environment_type='local' runs "
        "tasks in bubblewrap sandboxes without a daemon (docs/local-sandbox.md). To skip this "
        "check, build the spec with HarborSpec(..., preflight=False) or set TRL_HARBOR_PREFLIGHT=0."
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


# ── Docker: what tasks that are not on the public network need ──────────────────────

#: Shown for at most this many task names in a message.
_NAMES_SHOWN = 8


def docker_network_problem(backend: Backend, task_dirs: Sequence[Path]) -> str | None:
    """Why Harbor's Docker backend would refuse some of these tasks for their network policy, if it would.

    Harbor's ``docker`` backend enforces ``network_mode = "no-network"`` (and allowlists, and a
    policy that changes between the agent and verifier phases) with an egress-control sidecar.
    It turns that on only when a kernel probe container runs (an ``alpine`` image pinned by
    digest) and builds the sidecar (``docker buildx build`` from a ``gogost/gost`` image pinned
    by digest, or the built image already in the daemon). Where either is missing (an offline
    host, a Docker without the buildx plug-in) it refuses every such task when its sandbox is
    created or started, one rollout at a time. This finds that out at once, with Harbor's own
    probe (whose answer Harbor keeps for the process), and names the images and how to provide
    them. The image names are read from the installed Harbor.

    Args:
        backend: The resolved backend; only Docker is checked.
        task_dirs: The tasks.

    Returns:
        The explanation, or ``None`` when every task can run (or the backend is not Docker).
    """
    from harbor.models.environment_type import EnvironmentType

    config = backend.config
    if config.import_path or config.type != EnvironmentType.DOCKER:
        return None
    closed = _closed_networks(backend, task_dirs)
    if not closed:
        return None
    needing = [name for name, _ in closed]
    modes = set().union(*(modes for _, modes in closed))
    from harbor.environments.docker.docker import DockerEnvironment

    probe_ok = DockerEnvironment._egress_control_kernel_support()  # Harbor's own decision, cached by Harbor
    missing = _egress_images_missing(DockerEnvironment, probe_ok)
    if probe_ok and not missing:
        return None
    shown = ", ".join(sorted(needing)[:_NAMES_SHOWN]) + (", ..." if len(needing) > _NAMES_SHOWN else "")
    listed = "\n".join(f"  - {line}" for line in missing)
    mode_text = " or ".join(f"network_mode={m!r}" for m in sorted(modes))
    return (
        f"environment_type='docker' cannot run {len(needing)} of these {len(task_dirs)} tasks on this machine "
        f"({shown}): they need {mode_text}, which Harbor's Docker backend enforces with an egress-control "
        f"sidecar that it can use only when the daemon runs these images:\n{listed}\n"
        f'Without them Harbor refuses each such task when its sandbox is created ("network_mode=... is not '
        'supported by EnvironmentType.DOCKER environment") or started, so every rollout of theirs would be lost. '
        "Fixes: provide the images to this daemon (`docker pull` them where Docker Hub is reachable; on an "
        'offline host, serve them from a registry mirror the daemon uses: daemon.json "registry-mirrors", '
        "filled with `skopeo copy --all --preserve-digests` on a connected machine; a digest-pinned reference "
        "is recorded only by a pull, so `docker load` or `docker tag` cannot stand in for the probe image, "
        "while the sidecar's content-addressed name can be loaded or tagged); or leave these tasks out "
        '(HarborSpec(indices=...)); or set their network_mode to "public" where they need no isolation; or '
        "run them on environment_type='local', which enforces no-network without images (docs/backends.md)."
    )


def _closed_networks(backend: Backend, task_dirs: Sequence[Path]) -> list[tuple[str, set[str]]]:
    """``(task name, its network modes but public)`` over every phase of every step, for the tasks with any."""
    from harbor.models.task.config import NetworkMode

    from trl_harbor.rollout.suite import load_task

    closed: list[tuple[str, set[str]]] = []
    for task_dir in task_dirs:
        try:
            task = load_task(Path(task_dir))
            plans = [backend.plan(task)] + [backend.plan(task, s) for s in task.config.steps or []]
        except Exception:  # noqa: BLE001 - a task Harbor cannot read is reported by the suite checks
            continue
        policies = [p for plan in plans for p in (plan.agent_env_baseline, plan.agent_phase,
                                                  plan.verifier_env_baseline, plan.verifier_phase) if p]  # fmt: skip
        modes = {p.network_mode.value for p in policies if p.network_mode != NetworkMode.PUBLIC}
        if modes:
            closed.append((task.short_name, modes))
    return closed


def _egress_images_missing(docker_env: type, probe_ok: bool) -> list[str]:
    """One line per egress-control image the daemon lacks, with why Harbor cannot get it."""
    lines = []
    probe = getattr(docker_env, "_EGRESS_CONTROL_KERNEL_PROBE_IMAGE", None)
    if not probe_ok:
        if probe and not _docker_image_present(probe):
            lines.append(f"{probe} (Harbor's kernel probe, run by digest): not in the daemon, and pulling it failed")
        else:
            lines.append(
                f"{probe or 'the kernel probe'} ran, but this kernel lacks nftables' fib expression "
                "(CONFIG_NFT_FIB_INET), which the sidecar's rules need: no image can fix that"
            )
    sidecar, base = _sidecar_image(docker_env)
    if sidecar and not _docker_image_present(sidecar):
        if _docker("buildx", "version") is not None:
            if base and not _docker_image_present(base):
                lines.append(
                    f"{sidecar} (the sidecar): not in the daemon; Harbor builds it with `docker buildx build` "
                    f"FROM {base}, which is not in the daemon either and must be pulled at the first start"
                )
        else:
            lines.append(
                f"{sidecar} (the sidecar): not in the daemon, and Harbor builds it with `docker buildx build` "
                f"FROM {base or 'its base image'}: this Docker has no buildx plug-in"
            )
    return lines


def _sidecar_image(docker_env: type) -> tuple[str | None, str | None]:
    """Harbor's content-addressed name of its egress sidecar image, and the image it is built ``FROM``."""
    try:
        from harbor.utils.container_cache import docker_build_context_hash

        context = Path(docker_env._EGRESS_CONTROL_SIDECAR_CONTEXT_PATH)
        dockerfile = Path(docker_env._egress_control_sidecar_dockerfile_path())
        name = str(docker_env._EGRESS_CONTROL_SIDECAR_DOCKER_NAME)
        froms = [line.split()[1] for line in dockerfile.read_text().splitlines() if line.upper().startswith("FROM ")]
        platform = _docker("version", "--format", "{{.Server.Os}}/{{.Server.Arch}}")
        if not platform:
            return None, froms[0] if froms else None
        digest = docker_build_context_hash(
            context=context, dockerfile_path=dockerfile, build_args={}, platform=platform
        )
        # Harbor names it f"{name}--{hash}" (harbor.environments.docker.utils._compute_image_name).
        return f"{name}--{digest}", froms[0] if froms else None
    except (AttributeError, OSError, ImportError, IndexError):  # another Harbor: name what can be named
        return None, None


def _docker(*args: str) -> str | None:
    """What the docker CLI prints when it succeeds; ``None`` when it fails, is missing or does not answer."""
    try:
        result = subprocess.run(["docker", *args], capture_output=True, text=True, errors="replace", timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _docker_image_present(reference: str) -> bool:
    return _docker("image", "inspect", reference) is not None


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
        tasks: The validated tasks (:func:`trl_harbor.rollout.suite.load_suite`), whose ``task.toml`` was read once.
        suite_root: The folder the links may point into (default: each task's parent).

    Raises:
        trl_harbor.rollout.suite.TaskSuiteError: Naming every such key or value, its file and the fix.
    """
    from harbor.models.task.config import TaskConfig

    from trl_harbor.rollout.suite import TaskSuiteError

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
    names = {**fields, **{info.alias: info for info in fields.values() if info.alias}}
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
        outcomes: Each rollout's :class:`~trl_harbor.training.env.Verification` (``None`` for
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
        "To go on anyway, build the spec with HarborSpec(..., options=HarborOptions(infra_stop_fraction=None))."
    )
