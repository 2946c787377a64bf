"""Which Harbor environment an ``environment_type`` string means, and opening one for a task.

Everything in trl-harbor reaches sandboxes through this module and Harbor's own
``EnvironmentFactory``, so any Harbor backend (``docker``, ``e2b``, ``daytona``,
``modal``, ...), any ``"module:Class"`` plug-in, and the bundled ``"local"``
bubblewrap backend are interchangeable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor.sandboxes import LOCAL_ENVIRONMENT_IMPORT_PATH

if TYPE_CHECKING:  # Harbor is imported when a backend is first resolved, not with trl_harbor
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import EnvironmentConfig, NetworkPolicy, StepConfig
    from harbor.models.task.task import Task
    from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
    from harbor.models.trial.paths import TrialPaths
    from harbor.trial.network_policy import TrialNetworkPlan

__all__ = [
    "BUILTIN_ALIASES",
    "Backend",
    "create_environment",
    "network_plan",
    "parse_backend_options",
    "resolve_backend",
]

#: Short names trl-harbor adds to Harbor's own environment types.
BUILTIN_ALIASES = {"local": LOCAL_ENVIRONMENT_IMPORT_PATH}


def parse_backend_options(pairs: list[str] | None) -> dict[str, Any]:
    """Backend options from ``key=value`` strings (the command line's ``--ek``, as in ``harbor run``).

    Values are read as JSON where they are JSON (``pids_max=64``, ``host_trust=false``), else kept
    as text (``cache_dir=/data/cache``).

    Args:
        pairs: The ``key=value`` strings.

    Returns:
        The options, for Harbor's environment ``kwargs``.

    Raises:
        ValueError: For a string without ``=``.
    """
    import json

    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--ek expects key=value (e.g. --ek pids_max=64), got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@dataclass(frozen=True)
class Backend:
    """An ``environment_type`` resolved once: Harbor's environment config and what follows from it.

    Built by :func:`resolve_backend` when a spec (or ``check``, or ``eval``) is built, then handed
    to every environment and episode, so the string is never looked up again.

    Attributes:
        name: The ``environment_type`` as given (``"local"``, ``"docker"``, ``"module:Class"``).
        config: Harbor's trial environment config (type or import path, and the backend's options).
    """

    name: str
    config: TrialEnvironmentConfig

    @property
    def local(self) -> bool:
        """Whether this is the bundled local sandbox (which runs one container per task, no compose)."""
        return self.config.import_path == LOCAL_ENVIRONMENT_IMPORT_PATH

    def plan(self, task: Task, step: StepConfig | None = None) -> TrialNetworkPlan:
        """The task's (or step's) network policies per phase, as Harbor's trial resolves them."""
        return network_plan(task, self.config, step)

    def create(self, task: Task, trial_paths: TrialPaths, *, session_id: str, **options: Any) -> BaseEnvironment:
        """Create (not start) a sandbox for ``task`` (see :func:`create_environment` for ``options``)."""
        return create_environment(task, self.config, session_id=session_id, trial_paths=trial_paths, **options)


def resolve_backend(environment_type: str, options: dict[str, Any] | None = None) -> Backend:
    """Resolve an ``environment_type`` string and the backend's options, once.

    Args:
        environment_type: ``"local"``, a Harbor environment type (``"docker"``,
            ``"e2b"``, ...) or a ``"module:Class"`` import path of a plug-in.
        options: Backend options (Harbor's environment ``kwargs``, the command line's ``--ek``).

    Returns:
        The resolved backend.

    Raises:
        ValueError: If the string is neither a known type nor an import path.
    """
    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig

    value = BUILTIN_ALIASES.get(environment_type, environment_type)
    if ":" in value:
        return Backend(environment_type, TrialEnvironmentConfig(import_path=value, kwargs=dict(options or {})))
    try:
        kind = EnvironmentType(value)
    except ValueError:
        known = sorted([*BUILTIN_ALIASES, *EnvironmentFactory.registered_names()])
        raise ValueError(
            f"unknown environment_type {environment_type!r}: use one of {', '.join(known)}, "
            "or a Harbor environment plug-in as 'package.module:ClassName'"
        ) from None
    return Backend(environment_type, TrialEnvironmentConfig(type=kind, kwargs=dict(options or {})))


def network_plan(task: Task, config: TrialEnvironmentConfig, step: StepConfig | None = None) -> TrialNetworkPlan:
    """Resolve a task's network policies per phase, the way Harbor's trial runner does.

    Args:
        task: The Harbor task (its ``[environment]``, ``[agent]`` and ``[verifier]`` network settings).
        config: Harbor's trial environment config (:attr:`Backend.config`).
        step: The step of a multi-step task whose phases to resolve (``None``: the task's).

    Returns:
        Harbor's plan: the sandbox's baseline policy and the agent's and verifier's phases.
    """
    from harbor.models.task.verifier_mode import resolve_step_verifier_mode, resolve_task_verifier_mode
    from harbor.models.trial.config import AgentConfig as TrialAgentConfig
    from harbor.models.trial.config import VerifierConfig as TrialVerifierConfig
    from harbor.trial.network_policy import resolve_trial_network_plan

    mode = resolve_task_verifier_mode(task.config) if step is None else resolve_step_verifier_mode(task.config, step)
    return resolve_trial_network_plan(
        task.config, TrialAgentConfig(), config, TrialVerifierConfig(), step, verifier_mode=mode
    )


def create_environment(
    task: Task,
    environment: str | TrialEnvironmentConfig,
    *,
    session_id: str,
    trial_paths: TrialPaths,
    kwargs: dict[str, Any] | None = None,
    environment_dir: Path | None = None,
    task_env_config: EnvironmentConfig | None = None,
    network_policy: NetworkPolicy | None = None,
    phase_network_policies: list[NetworkPolicy] | None = None,
    logger: logging.Logger | None = None,
    **extra: Any,
) -> BaseEnvironment:
    """Create (not start) a sandbox for a task through Harbor's ``EnvironmentFactory``.

    By default it is the task's agent sandbox, with the network policies Harbor's trials
    would give it (the backend enforces them or refuses the task); a separate verifier
    sandbox passes its own ``environment_dir``, ``task_env_config`` and policies.

    Args:
        task: The Harbor task.
        environment: An ``environment_type`` string (see :func:`resolve_backend`) or
            the config it resolves to.
        session_id: A human-readable handle for the sandbox.
        trial_paths: Where Harbor keeps the trial's host-side files.
        kwargs: Backend options (only with a string ``environment``).
        environment_dir: The folder to build from (default: the task's ``environment/``).
        task_env_config: The ``[environment]`` config (default: a copy of the task's).
        network_policy: The sandbox's baseline policy (default: from :func:`network_plan`).
        phase_network_policies: The phases' policies (default: agent, then verifier).
        logger: Logger for the backend.
        **extra: Further keyword arguments for the backend's constructor.

    Returns:
        The environment, ready for ``start()``.
    """
    from harbor.environments.factory import EnvironmentFactory

    config = resolve_backend(environment, kwargs).config if isinstance(environment, str) else environment
    if network_policy is None:
        plan = network_plan(task, config)
        network_policy = plan.agent_env_baseline
        if phase_network_policies is None:
            shared = plan.verifier_env_baseline is None
            phase_network_policies = [plan.agent_phase, plan.verifier_phase] if shared else [plan.agent_phase]
    trial_paths.mkdir()
    return EnvironmentFactory.create_environment_from_config(
        config=config,
        environment_dir=environment_dir or task.paths.environment_dir,
        environment_name=task.short_name,
        session_id=session_id,
        trial_paths=trial_paths,
        task_env_config=task_env_config or task.config.environment.model_copy(deep=True),
        logger=logger,
        network_policy=network_policy,
        phase_network_policies=phase_network_policies or [],
        **extra,
    )
