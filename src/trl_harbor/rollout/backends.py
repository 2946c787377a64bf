"""Which Harbor environment an ``environment_type`` string means, and opening one for a task.

Everything in trl-harbor reaches sandboxes through this module and Harbor's own
``EnvironmentFactory``, so any Harbor backend (``docker``, ``e2b``, ``daytona``,
``modal``, ...), any ``"module:Class"`` plug-in, the ``"local"`` bubblewrap backend (the
``harbor-local-sandbox`` package, ``pip install 'trl-harbor[local]'``) and ``"ray"``, the local
sandbox on the nodes of a Ray cluster (``pip install 'trl-harbor[ray]'``), are interchangeable. What
a backend offers beyond Harbor's interface is read from its class, structurally
(:mod:`trl_harbor.rollout.contract`), never from its name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor.rollout.contract import ComposeCheck, ComposeDeclaration, IdleResources, ImageCache

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
    "VerifierPlacement",
    "create_environment",
    "local_sandbox_cli",
    "network_plan",
    "parse_backend_options",
    "release_idle",
    "resolve_backend",
]

#: The local sandbox: the ``harbor-local-sandbox`` package's environment (its ``IMPORT_PATH``).
#: Written here, not imported: trl-harbor loads without the package, and only this alias names it.
LOCAL_ENVIRONMENT_IMPORT_PATH = "harbor_local_sandbox.local:LocalEnvironment"

#: The local sandbox on a Ray cluster's nodes (the same package's ``ray_cluster`` module; Ray an extra of it).
RAY_ENVIRONMENT_IMPORT_PATH = "harbor_local_sandbox.ray_cluster:RayEnvironment"

#: Short names trl-harbor adds to Harbor's own environment types.
BUILTIN_ALIASES = {"local": LOCAL_ENVIRONMENT_IMPORT_PATH, "ray": RAY_ENVIRONMENT_IMPORT_PATH}

#: The same package's command line for its image cache (``harbor-local-sandbox images``), which
#: ``trl-harbor images`` runs (:func:`local_sandbox_cli`).
LOCAL_SANDBOX_CLI = "harbor_local_sandbox.cli"

#: How to install each alias's package (its import path's top module), for the error when it is missing.
_ALIAS_INSTALL = {"local": "pip install 'trl-harbor[local]'", "ray": "pip install 'trl-harbor[ray]'"}
#: The modules each alias needs besides its import path's top module (checked with it, never imported here).
_ALIAS_NEEDS = {"ray": ("ray",)}

#: The backend classes this process created sandboxes of (what :func:`release_idle` asks).
_RESOLVED_CLASSES: dict[str, type] = {}


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
    to every environment and episode, so the string is never looked up again. What the backend is
    and offers comes from its class (loaded once, by Harbor's factory, on first use).

    Attributes:
        name: The ``environment_type`` as given (``"local"``, ``"docker"``, ``"module:Class"``).
        config: Harbor's trial environment config (type or import path, and the backend's options).
    """

    name: str
    config: TrialEnvironmentConfig

    @cached_property
    def environment_class(self) -> type[BaseEnvironment]:
        """The backend's ``BaseEnvironment`` subclass, as Harbor's ``EnvironmentFactory`` loads it.

        Raises:
            ImportError: If a Harbor backend's SDK is not installed.
            ValueError: If a plug-in's module cannot be imported.
        """
        from harbor.environments.factory import EnvironmentFactory

        return EnvironmentFactory.get_environment_class(self.config.type, self.config.import_path)

    @cached_property
    def kind(self) -> str:
        """What the backend is, by its class's ``type()`` (``"docker"``, ``"local"``, ...), whatever it was called."""
        kind = self.environment_class.type()  # Harbor's: an EnvironmentType (a str Enum); a plug-in's: a str
        return kind.value if isinstance(kind, Enum) else str(kind)

    @property
    def supports_compose(self) -> bool:
        """Whether it runs a task's ``docker-compose.yaml`` services (a backend that does not say: yes)."""
        cls = self.environment_class
        return bool(cls.supports_compose) if isinstance(cls, ComposeDeclaration) else True

    def compose_problems(self, environment_dir: Path) -> list[str]:
        """What of a task's ``docker-compose.yaml`` (in ``environment_dir``) the backend does not run, by field
        and fix (:class:`~trl_harbor.rollout.contract.ComposeCheck`; a backend that does not say: nothing)."""
        cls = self.environment_class
        return list(cls.compose_problems(environment_dir)) if isinstance(cls, ComposeCheck) else []

    def image_store(self) -> Any | None:
        """The backend's image cache for its options (:class:`~trl_harbor.rollout.contract.ImageCache`),
        or ``None`` for a backend that builds its own way."""
        cls = self.environment_class
        if not isinstance(cls, ImageCache):
            return None
        options = self.config.kwargs
        return cls.image_store(options.get("cache_dir"), host_trust=bool(options.get("host_trust", True)))

    def plan(self, task: Task, step: StepConfig | None = None) -> TrialNetworkPlan:
        """The task's (or step's) network policies per phase, as Harbor's trial resolves them."""
        return network_plan(task, self.config, step)

    def placement(self, task: Task, step: StepConfig | None = None) -> VerifierPlacement:
        """Where the task's (or step's) verifier runs, as whom, with the network plan (resolved once a step)."""
        return VerifierPlacement.of(task, step, self.plan(task, step))

    def create(self, task: Task, trial_paths: TrialPaths, *, session_id: str, **options: Any) -> BaseEnvironment:
        """Create (not start) a sandbox for ``task`` (see :func:`create_environment` for ``options``)."""
        return create_environment(task, self.config, session_id=session_id, trial_paths=trial_paths, **options)


@dataclass(frozen=True)
class VerifierPlacement:
    """Where a step's (or a single-step task's) verifier runs, as whom, on which network: resolved once a step.

    Attributes:
        plan: Harbor's network plan of the step: the sandbox's baseline and the agent's and verifier's phases.
        separate: Whether the verifier runs in a sandbox of its own (``[verifier] environment_mode =
            "separate"``); else it shares the agent's sandbox (Harbor's default).
        user: The user the verifier runs as: the step's ``[verifier] user``, else the task's.
    """

    plan: TrialNetworkPlan
    separate: bool
    user: str | int | None

    @classmethod
    def of(cls, task: Task, step: StepConfig | None, plan: TrialNetworkPlan) -> VerifierPlacement:
        """The placement of ``task``'s (or its ``step``'s) verifier under ``plan`` (:func:`network_plan`)."""
        user = step.verifier.user if step is not None and step.verifier.user is not None else task.config.verifier.user
        return cls(plan=plan, separate=plan.verifier_env_baseline is not None, user=user)

    @property
    def sandbox_phases(self) -> list[NetworkPolicy]:
        """The agent's sandbox's network phases: the agent's, then the verifier's where it shares the sandbox."""
        plan = self.plan
        return [plan.agent_phase] if self.separate else [plan.agent_phase, plan.verifier_phase]


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
    if environment_type in _ALIAS_INSTALL:
        import importlib.util

        install = _ALIAS_INSTALL[environment_type]
        for module in (value.split(".", 1)[0], *_ALIAS_NEEDS.get(environment_type, ())):
            try:
                installed = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a finder that refuses it, a broken install
                installed = False
            if not installed:
                raise ValueError(
                    f"environment_type={environment_type!r} needs the {module.replace('_', '-')} package, which is "
                    f"not installed: {install}. Or pick another backend (environment_type='docker', ...)."
                )
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


def local_sandbox_cli() -> Any | None:
    """The local sandbox's image-cache command line (:data:`LOCAL_SANDBOX_CLI`: ``ImagesCommand``,
    ``build_images``, ``ImagesBuilt``), or ``None`` when its package is not installed."""
    import importlib

    try:
        return importlib.import_module(LOCAL_SANDBOX_CLI)
    except ModuleNotFoundError as error:
        if error.name != LOCAL_SANDBOX_CLI.split(".", 1)[0]:
            raise  # the package is there, something it needs is not: say so
        return None


def release_idle() -> None:
    """Let every backend this process created sandboxes of release what it keeps warm between sandboxes
    (:class:`~trl_harbor.rollout.contract.IdleResources`: the local sandbox's parked launcher)."""
    for cls in list(_RESOLVED_CLASSES.values()):
        if isinstance(cls, IdleResources):
            cls.release_idle()


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
        placement = VerifierPlacement.of(task, None, network_plan(task, config))
        network_policy = placement.plan.agent_env_baseline
        if phase_network_policies is None:
            phase_network_policies = placement.sandbox_phases
    trial_paths.mkdir()
    environment = EnvironmentFactory.create_environment_from_config(
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
    cls = type(environment)
    _RESOLVED_CLASSES.setdefault(f"{cls.__module__}:{cls.__qualname__}", cls)
    return environment
