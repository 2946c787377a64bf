"""TRL environments backed by a Harbor sandbox and Harbor's verifier.

:class:`HarborEnv` is what ``GRPOTrainer(environment_factory=...)`` instantiates: one instance
per rollout slot, reused across batches. For each rollout TRL calls
``reset(task_dir=..., **row)`` (start the task's sandbox and return its instruction), then the
tool methods the model picks (commands run in the sandbox), then reads the reward (Harbor's
verifier runs once, lazily, against the sandbox).

TRL turns every public method of the class into a tool, so besides ``reset`` and
``get_reward`` (which TRL handles itself) every lifecycle helper here is private: a model must
never be handed a tool that stops its own sandbox. Tear-down of every live sandbox is
:func:`close_all` (also run at interpreter exit).

Harbor is asynchronous; every coroutine runs on the one process-wide loop of
:mod:`trl_harbor.runtime`. Harbor is imported lazily, when the first sandbox starts.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import runtime
from trl_harbor.sandboxes import LOCAL_ENVIRONMENT_IMPORT_PATH

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.task import Task
    from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
    from harbor.models.trial.paths import TrialPaths
    from harbor.trial.network_policy import TrialNetworkPlan

__all__ = [
    "DEFAULT_COMMAND_TIMEOUT_SEC",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "LOCAL_ENVIRONMENT_IMPORT_PATH",
    "HarborBashEnv",
    "HarborEnv",
    "RewardError",
    "close_all",
    "environment_config",
    "select_reward",
]

logger = logging.getLogger(__name__)

#: Default per-command timeout, in seconds (the reference integration's hard-coded value).
DEFAULT_COMMAND_TIMEOUT_SEC: int = 180
#: Default cap on the characters of one command's output handed back to the model.
DEFAULT_MAX_OUTPUT_CHARS: int = 8000

_NOT_COMPUTED = object()


class RewardError(RuntimeError):
    """The verifier's result cannot be turned into one scalar reward."""


def close_all() -> None:
    """Stop every live sandbox of this process (all environments, concurrently).

    Environments stay usable: the next ``reset`` starts a fresh sandbox. Also runs
    automatically at interpreter exit.
    """
    runtime.close_all()


def environment_config(environment_type: str, kwargs: dict[str, Any] | None = None) -> TrialEnvironmentConfig:
    """Translate an ``environment_type`` string into Harbor's environment config.

    Delegates to :func:`trl_harbor.backends.environment_config` (imported lazily, since it
    imports Harbor).

    Args:
        environment_type: ``"local"`` (the bundled bubblewrap backend), a Harbor plug-in
            ``"module.path:ClassName"``, or a Harbor environment type (``"docker"``,
            ``"e2b"``, ``"daytona"``, ``"modal"``, ...).
        kwargs: Backend options (Harbor's environment ``kwargs``).

    Returns:
        A ``harbor.models.trial.config.EnvironmentConfig``.

    Raises:
        ValueError: When the string is neither an import path nor a Harbor environment type.
    """
    from trl_harbor.backends import environment_config as backend_config

    return backend_config(environment_type, kwargs)


def select_reward(rewards: dict[str, float | int] | None, reward_key: str | None = None) -> float:
    """Pick the scalar reward out of a verifier's rewards.

    Args:
        rewards: The verifier's rewards (``reward.json``'s keys, or ``{"reward": x}``).
        reward_key: The key to use; ``None`` takes ``"reward"``, or the only key.

    Returns:
        The reward.

    Raises:
        RewardError: When there are no rewards, ``reward_key`` is missing, or there are
            several keys, none is ``"reward"`` and no ``reward_key`` was chosen.
    """
    if not isinstance(rewards, dict) or not rewards:
        raise RewardError(f"the verifier returned no rewards ({rewards!r})")
    if reward_key is not None:
        if reward_key not in rewards:
            raise RewardError(
                f"reward_key={reward_key!r} is not among the verifier's rewards {sorted(rewards)}; pick one of them."
            )
        return float(rewards[reward_key])
    if "reward" in rewards:
        return float(rewards["reward"])
    if len(rewards) == 1:
        return float(next(iter(rewards.values())))
    raise RewardError(
        f"the verifier returned several rewards {sorted(rewards)} and none is named 'reward'; "
        "choose one with HarborEnv(reward_key=...)."
    )


class _Episode:
    """Everything one ``reset`` brings up: the task, its sandbox(es) and scratch folder."""

    def __init__(self, task: Task, paths: TrialPaths, plan: TrialNetworkPlan) -> None:
        self.task = task
        self.paths = paths
        self.plan = plan
        self.environment: BaseEnvironment | None = None
        self.cleanup_handle: int | None = None
        self.reward: Any = _NOT_COMPUTED
        self.reward_reported = False

    async def stop(self) -> None:
        environment, self.environment = self.environment, None
        if self.cleanup_handle is not None:
            runtime.unregister_cleanup(self.cleanup_handle)
            self.cleanup_handle = None
        try:
            if environment is not None:
                await environment.stop(delete=True)
        finally:
            shutil.rmtree(self.paths.trial_dir, ignore_errors=True)


class HarborEnv:
    """Base TRL environment: one Harbor task sandbox plus Harbor's verifier per rollout.

    Subclass it to build a harness: every public method of the subclass becomes a tool the
    model can call (typed signature and Google-style docstring with ``Args:`` required by
    TRL). Run commands in the sandbox with ``self._exec(command)``; prepare the sandbox in
    ``async _setup()``.

    Args:
        environment_type: Harbor sandbox backend: ``"docker"`` (default), any Harbor
            environment type (``"e2b"``, ``"daytona"``, ``"modal"``, ...), ``"local"`` for
            the bundled bubblewrap sandbox, or a plug-in ``"module.path:ClassName"``.
        command_timeout_sec: Seconds one command may run before it is stopped.
        max_output_chars: Characters of a command's output handed back to the model; the
            rest is cut and marked.
        reward_key: Which entry of the verifier's rewards is the scalar reward. ``None``
            takes ``"reward"``, or the only entry when there is just one.
        on_verifier_error: ``"zero"`` scores a rollout whose verification fails 0.0 (with a
            logged reason); ``"raise"`` propagates the error.
        environment_kwargs: Options for the backend, passed as Harbor's environment
            ``kwargs`` (e.g. ``{"auto_mounting": True}``).

    Attributes:
        PROMPT_SUFFIX: Text appended to the task instruction returned by ``reset``.
    """

    PROMPT_SUFFIX: str = ""

    def __init__(
        self,
        environment_type: str = "docker",
        *,
        command_timeout_sec: int = DEFAULT_COMMAND_TIMEOUT_SEC,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        reward_key: str | None = None,
        on_verifier_error: str = "zero",
        environment_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if on_verifier_error not in ("zero", "raise"):
            raise ValueError(f"on_verifier_error must be 'zero' or 'raise', got {on_verifier_error!r}")
        if command_timeout_sec <= 0 or max_output_chars <= 0:
            raise ValueError("command_timeout_sec and max_output_chars must be positive")
        self._environment_type = environment_type
        self._command_timeout_sec = int(command_timeout_sec)
        self._max_output_chars = int(max_output_chars)
        self._reward_key = reward_key
        self._on_verifier_error = on_verifier_error
        self._environment_kwargs = dict(environment_kwargs or {})
        self._episode: _Episode | None = None

    # ── TRL lifecycle ──────────────────────────────────────────────────────────────

    def reset(self, task_dir: str | None = None, **row: Any) -> str:
        """Start a sandbox for ``task_dir`` (stopping the previous one) and return the prompt.

        Args:
            task_dir: The task directory (the dataset's ``task_dir`` column).
            **row: The rest of the dataset row (ignored by the base class).

        Returns:
            The task's ``instruction.md`` followed by :attr:`PROMPT_SUFFIX`.

        Raises:
            ValueError: When ``task_dir`` is missing.
        """
        if task_dir is None:
            raise ValueError("HarborEnv.reset needs `task_dir` (the dataset row's task_dir column).")
        runtime.run(self._stop())
        instruction = runtime.run(self._start(Path(task_dir)))
        return instruction + self.PROMPT_SUFFIX

    @property
    def reward(self) -> float:
        """The verifier's scalar for the current episode (computed once, on first read).

        ``0.0`` for an environment that was never reset, without touching any backend.
        """
        episode = self._episode
        if episode is None:
            return 0.0
        if episode.reward is _NOT_COMPUTED:
            episode.reward = runtime.run(self._verify(episode))
        episode.reward_reported = True
        return episode.reward

    def get_reward(self) -> float | None:
        """Return the episode's reward for trainers that read it from the environment.

        TRL adds ``get_reward`` as an extra reward source next to ``reward_funcs``. When the
        reward was already handed out this episode (``spec.reward_funcs`` reads
        :attr:`reward` first), this returns ``None`` — which TRL ignores — so the same
        verifier score is never counted twice.

        Returns:
            The reward, or ``None`` when it was already reported for this episode.
        """
        episode = self._episode
        if episode is not None and episode.reward_reported:
            return None
        return self.reward

    # ── helpers for harnesses ──────────────────────────────────────────────────────

    def _exec(self, command: str, timeout: int | None = None, user: str | int | None = None) -> str:
        """Run a shell command in the sandbox; return its combined stdout and stderr as text.

        Never raises: a failure (no sandbox, timeout, backend error) comes back as text for
        the model to read. Output longer than ``max_output_chars`` is cut and marked.

        Args:
            command: The shell command.
            timeout: Seconds before the command is stopped (default: ``command_timeout_sec``).
            user: User to run as (default: the task's ``[agent] user``, else the backend's).

        Returns:
            The output, ``"(empty output, rc=N)"`` when there is none, with a trailing
            ``[exit code N]`` line when the command failed.
        """
        if self._episode is None or self._episode.environment is None:
            return "Error: no sandbox is running (the environment was not reset, or it was closed)."
        timeout = self._command_timeout_sec if timeout is None else int(timeout)
        try:
            result = runtime.run(self._aexec(command, timeout, user), timeout=timeout + 60)
        except TimeoutError:
            return f"Error: the command timed out after {timeout} s."
        except Exception as exc:  # the model gets the error, training goes on
            name = type(exc).__name__
            if "timeout" in name.lower():
                return f"Error: the command timed out after {timeout} s."
            return f"Error: {name}: {exc}"
        output = (result.stdout or "") + (result.stderr or "")
        if len(output) > self._max_output_chars:
            cut = len(output) - self._max_output_chars
            output = output[: self._max_output_chars] + f"\n... [truncated {cut} characters]"
        if not output:
            return f"(empty output, rc={result.return_code})"
        if result.return_code:
            output += f"\n[exit code {result.return_code}]"
        return output

    async def _aexec(self, command: str, timeout: int, user: str | int | None = None) -> Any:
        """Async form of :meth:`_exec` returning Harbor's ``ExecResult`` (for ``_setup`` hooks).

        Args:
            command: The shell command.
            timeout: Seconds before the command is stopped.
            user: User to run as (default: the task's ``[agent] user``).

        Returns:
            Harbor's ``ExecResult`` (``stdout``, ``stderr``, ``return_code``).

        Raises:
            RuntimeError: When no sandbox is running.
        """
        episode = self._episode
        if episode is None or episode.environment is None:
            raise RuntimeError("no sandbox is running")
        if user is None:
            user = episode.task.config.agent.user
        return await episode.environment.exec(command, timeout_sec=timeout, user=user)

    async def _setup(self) -> None:
        """Hook for harnesses: prepare the sandbox after it started (default: nothing).

        Runs on the shared event loop once per ``reset``; use ``self._environment`` (Harbor's
        ``BaseEnvironment``) or ``await self._aexec(...)``.
        """

    @property
    def _environment(self) -> BaseEnvironment | None:
        """The running Harbor environment of this episode, or ``None``."""
        return None if self._episode is None else self._episode.environment

    @property
    def _task(self) -> Task | None:
        """Harbor's ``Task`` of this episode, or ``None`` before the first reset."""
        return None if self._episode is None else self._episode.task

    # ── Harbor lifecycle (async, on the shared loop) ────────────────────────────────

    def _trial_config(self) -> TrialEnvironmentConfig:
        return environment_config(self._environment_type, self._environment_kwargs)

    def _create_environment(self, task: Task, paths: TrialPaths, role: str, **options: Any) -> BaseEnvironment:
        from trl_harbor.backends import create_environment

        return create_environment(
            task,
            self._trial_config(),
            session_id=f"{task.short_name}__{uuid.uuid4().hex[:8]}__{role}",
            trial_paths=paths,
            **options,
        )

    async def _start(self, task_dir: Path) -> str:
        from harbor.models.task.task import Task
        from harbor.models.trial.paths import TrialPaths

        task = Task(task_dir)
        if task.has_steps:
            raise ValueError(f"{task_dir}: multi-step Harbor tasks are not supported by HarborEnv.")
        from trl_harbor.backends import network_plan

        plan = network_plan(task, self._trial_config())
        paths = TrialPaths(trial_dir=Path(tempfile.mkdtemp(prefix="trl_harbor_")))
        paths.mkdir()
        episode = _Episode(task, paths, plan)
        shared = plan.verifier_env_baseline is None
        phases = [plan.agent_phase, plan.verifier_phase] if shared else [plan.agent_phase]
        try:
            environment = self._create_environment(
                task,
                paths,
                "env",
                task_env_config=task.config.environment,
                network_policy=plan.agent_env_baseline,
                phase_network_policies=phases,
            )
            episode.environment = environment
            episode.cleanup_handle = runtime.register_cleanup(episode.stop)
            self._episode = episode
            await environment.start(force_build=False)
            if plan.agent_phase != plan.agent_env_baseline:
                await environment.set_network_policy(plan.agent_phase)
            await environment.run_healthcheck()
            await self._setup()
        except BaseException:
            self._episode = None
            await episode.stop()
            raise
        return task.instruction

    async def _stop(self) -> None:
        episode, self._episode = self._episode, None
        if episode is not None:
            try:
                await episode.stop()
            except Exception as exc:
                logger.warning("trl-harbor: stopping the sandbox of %s failed: %r", episode.task.name, exc)

    async def _verify(self, episode: _Episode) -> float:
        try:
            rewards = await self._run_verifier(episode)
            return self._select_reward(rewards)
        except Exception as exc:
            if self._on_verifier_error == "raise":
                raise
            logger.warning(
                "trl-harbor: verification of %s failed, scoring 0.0: %s: %s",
                episode.task.name,
                type(exc).__name__,
                exc,
            )
            return 0.0

    async def _run_verifier(self, episode: _Episode) -> dict[str, float | int]:
        from harbor.models.trial.paths import EnvironmentPaths

        environment = episode.environment
        if environment is None:
            raise RuntimeError("the sandbox is gone (it was stopped before verification)")
        plan = episode.plan
        if plan.verifier_env_baseline is not None:
            return await self._run_separate_verifier(episode)
        with environment.with_default_user(episode.task.config.verifier.user):
            await environment.empty_dirs([EnvironmentPaths.for_os(environment.os).verifier_dir], chmod=True)
            if plan.verifier_phase != plan.agent_phase:
                await environment.set_network_policy(plan.verifier_phase)
            return await self._verifier_result(episode, environment)

    async def _verifier_result(self, episode: _Episode, environment: BaseEnvironment) -> dict[str, float | int]:
        import asyncio

        from harbor.verifier.verifier import Verifier

        verifier = Verifier(task=episode.task, trial_paths=episode.paths, environment=environment)
        result = await asyncio.wait_for(verifier.verify(), timeout=episode.task.config.verifier.timeout_sec)
        return dict(result.rewards or {})

    async def _run_separate_verifier(self, episode: _Episode) -> dict[str, float | int]:
        """Verify in a second sandbox built from the task's verifier environment.

        The agent sandbox's declared ``artifacts`` (and Harbor's ``/logs/artifacts`` folder) are
        copied into the verifier sandbox at the same paths before ``tests/test.sh`` runs.
        """
        from harbor.models.task.verifier_mode import resolve_verifier_environment_definition
        from harbor.models.trial.paths import EnvironmentPaths

        task, plan = episode.task, episode.plan
        definition = resolve_verifier_environment_definition(task.config, task.paths)
        if definition is None or plan.verifier_env_baseline is None:
            raise RuntimeError("separate verifier mode did not resolve a verifier environment")
        verifier_env = self._create_environment(
            task,
            episode.paths,
            "verifier",
            environment_dir=definition.directory,
            task_env_config=definition.config,
            network_policy=plan.verifier_env_baseline,
            phase_network_policies=[plan.verifier_phase],
            enable_environment_dir_upload=not definition.bundled_tests,
        )
        handle = runtime.register_cleanup(lambda: verifier_env.stop(delete=True))
        try:
            await verifier_env.start(force_build=False)
            with verifier_env.with_default_user(task.config.verifier.user):
                env_paths = EnvironmentPaths.for_os(verifier_env.os)
                await verifier_env.empty_dirs([env_paths.verifier_dir], chmod=True)
                await self._copy_artifacts(episode, verifier_env)
                if plan.verifier_phase != plan.verifier_env_baseline:
                    await verifier_env.set_network_policy(plan.verifier_phase)
                return await self._verifier_result(episode, verifier_env)
        finally:
            runtime.unregister_cleanup(handle)
            await verifier_env.stop(delete=True)

    async def _copy_artifacts(self, episode: _Episode, target: BaseEnvironment) -> None:
        from harbor.models.trial.paths import EnvironmentPaths

        source = episode.environment
        assert source is not None
        paths = [str(EnvironmentPaths.for_os(source.os).artifacts_dir)]
        for artifact in episode.task.config.artifacts:
            paths.append(artifact if isinstance(artifact, str) else artifact.source)
        staging = Path(tempfile.mkdtemp(prefix="artifacts_", dir=episode.paths.trial_dir))
        for index, path in enumerate(paths):
            local = staging / str(index)
            if await source.is_dir(path, user="root"):
                await source.download_dir(path, local)
                parent = path.rstrip("/").rsplit("/", 1)[0] or "/"
                await target.exec(f"mkdir -p '{parent}'", user="root")
                await target.upload_dir(local, path)
            elif (await source.exec(f"test -f '{path}'", user="root")).return_code == 0:
                await source.download_file(path, local)
                parent = path.rsplit("/", 1)[0] or "/"
                await target.exec(f"mkdir -p '{parent}'", user="root")
                await target.upload_file(local, path)

    def _select_reward(self, rewards: dict[str, float | int]) -> float:
        return select_reward(rewards, self._reward_key)

    def __del__(self) -> None:
        episode = getattr(self, "_episode", None)
        if episode is None or sys.is_finalizing():
            return
        try:
            runtime.run(self._stop(), timeout=60)
        except Exception:  # best effort; close_all() at exit is the safety net
            pass


_BASH_PROMPT_SUFFIX = (
    "\n\nYou have one tool, `bash`: it runs a shell command in the task's sandbox and returns "
    "its stdout and stderr. The shell keeps no state between calls. Explore the files "
    '(`ls`, `head`, `cat`), run Python with `python3 -c "..."`, and **submit your final '
    "answer by writing it to /workdir/answer.txt with the `bash` tool**, e.g. "
    '`echo -n "<value>" > /workdir/answer.txt`. An answer stated only in prose is not '
    "submitted. Keep the answer short, and do not end your turn before submitting."
)


class HarborBashEnv(HarborEnv):
    """Built-in harness with a single stateless ``bash`` tool; submit via ``/workdir/answer.txt``."""

    PROMPT_SUFFIX = _BASH_PROMPT_SUFFIX

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox and return its combined stdout and stderr.

        The shell keeps no state between calls. Use it to explore files (ls, head, cat), run
        Python (python3 -c "..."), and submit the answer (echo -n "<value>" > /workdir/answer.txt).

        Args:
            command: The shell command to run.

        Returns:
            The command's combined stdout and stderr.
        """
        return self._exec(command)
