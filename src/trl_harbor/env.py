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

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import progress, runtime
from trl_harbor.episode import (
    INFRA_MODES,
    Episode,
    RewardError,
    Verification,
    infra_failures,
    select_reward,
    verification_failures,
)
from trl_harbor.harness_api import _PROVISIONING, HarnessAPI
from trl_harbor.sandboxes import LOCAL_ENVIRONMENT_IMPORT_PATH

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.task import Task
    from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

__all__ = [
    "DEFAULT_COMMAND_TIMEOUT_SEC",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "LOCAL_ENVIRONMENT_IMPORT_PATH",
    "HarborBashEnv",
    "HarborBashStepsEnv",
    "HarborEnv",
    "RewardError",
    "StepsMixin",
    "Verification",
    "close_all",
    "environment_config",
    "infra_failures",
    "select_reward",
    "verification_failures",
    "verify_all",
]

logger = logging.getLogger(__name__)

#: Default per-command timeout, in seconds (the reference integration's hard-coded value).
DEFAULT_COMMAND_TIMEOUT_SEC: int = 180
#: Default cap on the characters of one command's output handed back to the model.
DEFAULT_MAX_OUTPUT_CHARS: int = 8000


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


_TASKS: dict[Path, Task] = {}


def _load_task(task_dir: Path) -> Task:
    """Parse a task once per process (``reset`` runs thousands of times on a few hundred tasks)."""
    from harbor.models.task.task import Task

    key = task_dir.resolve()
    if key not in _TASKS:
        _TASKS[key] = Task(key)
    return _TASKS[key]


def _trial_root() -> Path:
    """This process's folder for Harbor's per-episode files; stale ones of dead processes are swept."""
    global _TRIAL_ROOT
    if _TRIAL_ROOT is None:
        base = Path(tempfile.gettempdir()) / f"trl-harbor-trials-{os.getuid()}"
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        for entry in base.iterdir():
            owner = entry.name.split("-", 1)[0]
            if owner.isdigit() and not _alive(int(owner)):
                shutil.rmtree(entry, ignore_errors=True)
        _TRIAL_ROOT = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
        atexit.register(_remove_trial_root, _TRIAL_ROOT)
    return _TRIAL_ROOT


def _remove_trial_root(root: Path) -> None:
    # Registered after runtime's own exit hook, so it runs first: stop the sandboxes (episodes
    # still starting write into the folder) before removing it.
    runtime.close_all()
    shutil.rmtree(root, ignore_errors=True)


_TRIAL_ROOT: Path | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HarborEnv(HarnessAPI):
    """Base TRL environment: one Harbor task sandbox plus Harbor's verifier per rollout.

    Subclass it to build a harness: every public method of the subclass becomes a tool the
    model can call (typed signature and Google-style docstring with ``Args:`` required by
    TRL). Run commands in the sandbox with ``self._exec(command)``; prepare the sandbox in
    ``async _setup()``.

    ``reset`` returns the instruction at once and starts the sandbox in the background, so
    the sandboxes of a whole generation batch start together while the model generates;
    the first tool call waits for its sandbox only if it is not ready yet.

    Args:
        environment_type: Harbor sandbox backend: ``"docker"`` (default), any Harbor
            environment type (``"e2b"``, ``"daytona"``, ``"modal"``, ...), ``"local"`` for
            the bundled bubblewrap sandbox, or a plug-in ``"module.path:ClassName"``.
        command_timeout_sec: Seconds one command may run before it is stopped.
        max_output_chars: Characters of a command's output handed back to the model; the
            rest is cut and marked.
        reward_key: Which entry of the verifier's rewards is the scalar reward. ``None``
            takes ``reward_weights`` when set, else ``"reward"``, else the mean of every
            entry (see ``docs/rewards.md``).
        reward_weights: ``{entry: weight}``: the reward is the weighted sum of the verifier's
            entries (default: the task's ``[metadata] reward_weights``, if any).
        on_infra_error: What an infrastructure failure (the sandbox did not start, or
            stopped answering) makes of the rollout's reward: ``"skip"`` (default) gives
            ``None``, which ``GRPOTrainer`` leaves out of the batch (it is not the policy's
            fault); ``"zero"`` gives ``0.0``; ``"raise"`` propagates the error (for
            debugging). Either way the failure is logged once and counted
            (:func:`infra_failures`). A verification the rollout broke in a healthy sandbox
            (no reward file, a malformed one, a timeout, tampering) always scores ``0.0``.
        max_concurrent_starts: How many sandboxes this process starts at once (across all
            environments with the same value), to respect cloud quotas; ``None``: no limit.
        environment_kwargs: Options for the backend, passed as Harbor's environment
            ``kwargs`` (e.g. ``{"auto_mounting": True}``).
        allowed_changes: Globs of sandbox paths the agent may change although the verifier
            runs them (see ``docs/rewards.md``); tasks can declare their own in
            ``[metadata] allowed_changes``.

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
        reward_weights: dict[str, float] | None = None,
        on_infra_error: str = "skip",
        max_concurrent_starts: int | None = 64,
        environment_kwargs: dict[str, Any] | None = None,
        allowed_changes: Sequence[str] = (),
    ) -> None:
        if on_infra_error not in INFRA_MODES:
            raise ValueError(f"on_infra_error must be one of {', '.join(INFRA_MODES)}; got {on_infra_error!r}")
        if command_timeout_sec <= 0 or max_output_chars <= 0:
            raise ValueError("command_timeout_sec and max_output_chars must be positive")
        if max_concurrent_starts is not None and max_concurrent_starts < 1:
            raise ValueError("max_concurrent_starts must be at least 1 (or None for no limit)")
        self._environment_type = environment_type
        self._command_timeout_sec = int(command_timeout_sec)
        self._max_output_chars = int(max_output_chars)
        self._reward_key = reward_key
        self._reward_weights = dict(reward_weights) if reward_weights else None
        self._on_infra_error = on_infra_error
        self._max_concurrent_starts = max_concurrent_starts
        self._environment_kwargs = dict(environment_kwargs or {})
        self._allowed_changes = [allowed_changes] if isinstance(allowed_changes, str) else list(allowed_changes)
        self._config: TrialEnvironmentConfig | None = None
        self._episode: Episode | None = None

    # ── TRL lifecycle ──────────────────────────────────────────────────────────────

    def reset(self, task_dir: str | None = None, **row: Any) -> str:
        """Start a sandbox for ``task_dir`` in the background and return the prompt at once.

        The previous episode's sandbox is stopped in the background.

        Args:
            task_dir: The task directory (the dataset's ``task_dir`` column).
            **row: The rest of the dataset row (ignored by the base class).

        Returns:
            The task's ``instruction.md`` followed by :attr:`PROMPT_SUFFIX`.

        Raises:
            ValueError: When ``task_dir`` is missing, or the task has several steps and the
                harness has no ``submit_step`` tool.
        """
        if task_dir is None:
            raise ValueError("HarborEnv.reset needs `task_dir` (the dataset row's task_dir column).")
        self._retire()
        self._trial_config()  # an unknown environment_type fails here, not as a skipped rollout
        task = _load_task(Path(task_dir))
        if task.has_steps and not callable(getattr(self, "submit_step", None)):
            raise ValueError(
                f"{task_dir}: a multi-step task needs a harness with a `submit_step` tool; use "
                "agent='bash_steps', or add trl_harbor.StepsMixin to your harness."
            )
        episode = Episode(
            task,
            Path(tempfile.mkdtemp(prefix="episode-", dir=_trial_root())),
            create_environment=self._create_environment,
            trial_config=self._trial_config(),
            reward_key=self._reward_key,
            reward_weights=self._reward_weights,
            on_infra_error=self._on_infra_error,
            allowed_changes=self._allowed_changes,
        )
        self._episode = episode
        episode.ready = runtime.submit(self._provision(episode))
        return episode.instruction + self.PROMPT_SUFFIX + _steps_note(task)

    @property
    def reward(self) -> float | None:
        """The verifier's scalar for the current episode (computed once, on first read).

        ``0.0`` for an environment that was never reset, without touching any backend. After
        an infrastructure failure: ``None`` or ``0.0``, as ``on_infra_error`` says.
        """
        episode = self._episode
        if episode is None:
            return 0.0
        value = runtime.run(episode.grade()).reward
        episode.reward_reported = True
        return value

    @property
    def verification(self) -> Verification | None:
        """How the current episode was graded (``None`` before its reward was read).

        Holds every reward component, the reason a rollout scored 0 or was skipped, whether
        that was an infrastructure failure, and what the agent changed.
        """
        episode = self._episode
        return None if episode is None else episode.verification

    @property
    def infra_error(self) -> str | None:
        """The current episode's infrastructure failure, or ``None`` (it is not the policy's fault)."""
        episode = self._episode
        return None if episode is None else episode.infra_error

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

    # ── Harbor lifecycle (async, on the shared loop) ────────────────────────────────

    def _trial_config(self) -> TrialEnvironmentConfig:
        if self._config is None:
            self._config = environment_config(self._environment_type, self._environment_kwargs)
        return self._config

    def _create_environment(self, task: Task, paths: TrialPaths, role: str, **options: Any) -> BaseEnvironment:
        from trl_harbor.backends import create_environment

        return create_environment(
            task,
            self._trial_config(),
            session_id=f"{task.short_name}__{uuid.uuid4().hex[:8]}__{role}",
            trial_paths=paths,
            **options,
        )

    async def _provision(self, episode: Episode) -> None:
        """Start the episode's sandbox and run the harness's ``_setup`` (in the background of ``reset``)."""

        async def prepare() -> None:
            # The folders the reference integration makes before its harness's setup (harnesses rely on them).
            await self._aexec("mkdir -p /workdir /home/user/input", timeout=60)
            await self._setup()

        token = _PROVISIONING.set(episode)
        try:
            await episode.provision(prepare, max_concurrent_starts=self._max_concurrent_starts)
        finally:
            _PROVISIONING.reset(token)

    def _retire(self) -> None:
        """Stop the current episode's sandbox in the background (without waiting)."""
        episode, self._episode = self._episode, None
        if episode is not None:
            runtime.submit(_stop_episode(episode))

    async def _reward_of(self, episode: Episode) -> float | None:
        """The episode's reward, graded at most once however many callers ask concurrently."""
        return (await episode.grade()).reward

    def __del__(self) -> None:
        episode = getattr(self, "_episode", None)
        if episode is None or sys.is_finalizing():
            return
        with contextlib.suppress(Exception):  # best effort; close_all() at exit is the safety net
            runtime.submit(_stop_episode(episode))


async def _stop_episode(episode: Episode) -> None:
    await episode.stop()


def verify_all(environments: Sequence[HarborEnv]) -> list[float | None]:
    """Verify a batch of rollouts concurrently and return each one's reward.

    What ``spec.reward_funcs`` does with a generation batch: every verifier runs at once, so
    a batch of N rollouts costs about one verification. Each environment's ``reward`` (and
    ``get_reward()``) then returns the same value without verifying again.

    Args:
        environments: The rollouts' environments, in completion order.

    Returns:
        One reward per environment (``None`` for a skipped infrastructure failure; ``0.0``
        for an environment never reset).
    """

    async def one(env: HarborEnv) -> float | None:
        episode = env._episode
        if episode is None:
            return 0.0
        value = await env._reward_of(episode)
        episode.reward_reported = True
        return value

    async def every() -> list[float | None]:
        done = 0

        async def counted(env: HarborEnv) -> float | None:
            nonlocal done
            try:
                return await one(env)
            finally:
                done += 1
                progress.report("verification", done, len(environments))

        return list(await asyncio.gather(*(counted(env) for env in environments)))

    return runtime.run(every())


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


def _steps_note(task: Task) -> str:
    count = len(task.config.steps or [])
    if not count:
        return ""
    return (
        f"\n\nThis task has {count} steps; this is step 1. When you are done with a step, call "
        "`submit_step`: it is graded, and the next step's instruction comes back."
    )


class StepsMixin:
    """Adds the ``submit_step`` tool, which multi-step Harbor tasks (``[[steps]]``) need.

    A multi-step task is one rollout: ``reset`` returns the first step's instruction; the model
    calls ``submit_step`` when a step is done, which grades it (exactly as a whole task is graded)
    and returns the next step's instruction. The rollout's reward combines the steps by the
    task's ``multi_step_reward_strategy`` (``mean`` by default, ``final``); a step the model never
    reached scores 0, and a step below its ``min_reward`` ends the rollout, as in Harbor.
    Put it before the harness class: ``class MyEnv(StepsMixin, HarborBashEnv)``.
    """

    def submit_step(self) -> str:
        """Submit your work on the current step: it is graded, and the next step's instruction is returned.

        Call it once the current step's instruction is fully done; you cannot go back.

        Returns:
            The next step's instruction, or a note that the task is over.
        """
        episode = getattr(self, "_episode", None)
        if episode is None or episode.stopped:
            return "Error: no task is running."
        if not episode.steps:
            return "This task has a single step: just finish your turn when you are done."
        if episode.finished:
            return "The task is over: every step was submitted. Finish your turn."
        index = episode.step_index
        following = runtime.run(episode.submit_step())
        if following is None:
            return f"Step {index + 1} submitted. The task is over: finish your turn."
        return f"Step {index + 1} submitted. Step {index + 2} of {len(episode.steps)}:\n\n{following}"


class HarborBashStepsEnv(StepsMixin, HarborBashEnv):
    """The ``bash`` harness plus ``submit_step``, for suites with multi-step tasks (``agent="bash_steps"``)."""
