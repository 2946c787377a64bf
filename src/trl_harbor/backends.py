"""Which Harbor environment an ``environment_type`` string means, and opening one for a task.

Everything in trl-harbor reaches sandboxes through this module and Harbor's own
``EnvironmentFactory``, so any Harbor backend (``docker``, ``e2b``, ``daytona``,
``modal``, ...), any ``"module:Class"`` plug-in, and the bundled ``"local"``
bubblewrap backend are interchangeable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment
from harbor.environments.factory import EnvironmentFactory
from harbor.models.environment_type import EnvironmentType
from harbor.models.task.config import VerifierEnvironmentMode
from harbor.models.task.task import Task
from harbor.models.trial.config import AgentConfig as TrialAgentConfig
from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
from harbor.models.trial.config import VerifierConfig as TrialVerifierConfig
from harbor.models.trial.paths import TrialPaths
from harbor.trial.network_policy import resolve_trial_network_plan

from trl_harbor.sandboxes import LOCAL_ENVIRONMENT_IMPORT_PATH

__all__ = ["BUILTIN_ALIASES", "create_environment", "environment_config"]

#: Short names trl-harbor adds to Harbor's own environment types.
BUILTIN_ALIASES = {"local": LOCAL_ENVIRONMENT_IMPORT_PATH}


def environment_config(environment_type: str, kwargs: dict[str, Any] | None = None) -> TrialEnvironmentConfig:
    """Turn an ``environment_type`` string into Harbor's trial environment config.

    Args:
        environment_type: ``"local"``, a Harbor environment type (``"docker"``,
            ``"e2b"``, ...) or a ``"module:Class"`` import path of a plug-in.
        kwargs: Backend options (Harbor's ``--ek``).

    Returns:
        The config Harbor's ``EnvironmentFactory`` takes.

    Raises:
        ValueError: If the string is neither a known type nor an import path.
    """
    value = BUILTIN_ALIASES.get(environment_type, environment_type)
    if ":" in value:
        return TrialEnvironmentConfig(import_path=value, kwargs=dict(kwargs or {}))
    try:
        kind = EnvironmentType(value)
    except ValueError:
        known = sorted([*BUILTIN_ALIASES, *EnvironmentFactory.registered_names()])
        raise ValueError(
            f"unknown environment_type {environment_type!r}: use one of {', '.join(known)}, "
            "or a Harbor environment plug-in as 'package.module:ClassName'"
        ) from None
    return TrialEnvironmentConfig(type=kind, kwargs=dict(kwargs or {}))


def create_environment(
    task: Task,
    environment_type: str,
    *,
    session_id: str,
    trial_paths: TrialPaths,
    kwargs: dict[str, Any] | None = None,
    logger: logging.Logger | None = None,
) -> BaseEnvironment:
    """Create (not start) the environment for one task, as Harbor's trial runner does.

    The task's network policy is resolved from its ``task.toml`` the way Harbor's
    trials do it and handed to the backend, which enforces it or refuses the task.

    Args:
        task: The Harbor task.
        environment_type: See :func:`environment_config`.
        session_id: A human-readable handle for the sandbox.
        trial_paths: Where Harbor keeps the trial's host-side files.
        kwargs: Backend options.
        logger: Logger for the backend.

    Returns:
        The environment, ready for ``start()``.
    """
    config = environment_config(environment_type, kwargs)
    verifier_mode = VerifierEnvironmentMode.SHARED
    plan = resolve_trial_network_plan(
        task.config,
        TrialAgentConfig(),
        config,
        TrialVerifierConfig(),
        None,
        verifier_mode=verifier_mode,
    )
    Path(trial_paths.trial_dir).mkdir(parents=True, exist_ok=True)
    trial_paths.mkdir()
    return EnvironmentFactory.create_environment_from_config(
        config=config,
        environment_dir=task.paths.environment_dir,
        environment_name=task.short_name if hasattr(task, "short_name") else task.name,
        session_id=session_id,
        trial_paths=trial_paths,
        task_env_config=task.config.environment.model_copy(deep=True),
        logger=logger,
        network_policy=plan.agent_env_baseline,
        phase_network_policies=[plan.agent_phase, plan.verifier_phase],
    )
