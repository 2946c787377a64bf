"""TRL environments backed by a Harbor sandbox and Harbor's verifier.

:class:`HarborEnv` is what ``GRPOTrainer(environment_factory=...)`` instantiates: one instance per
rollout slot, reused across batches. For each rollout TRL calls ``reset(task_dir=..., **row)``
(start the task's sandbox, return its instruction), then the tool methods the model picks
(commands run in the sandbox), then reads the reward (Harbor's verifier runs once, lazily).
The state of a rollout is its :class:`~trl_harbor.rollout.Episode`.

TRL turns every public method of the class into a tool (:mod:`trl_harbor.training.tools`), so besides
``reset`` every helper here is private: a model must never be handed a tool that stops its own
sandbox. The reward comes from ``reward_funcs``, as in ``trl.experimental.harbor``; a harness owns
it (``get_reward``, which TRL reads from the environment) only with :class:`EnvironmentReward`.
A harness runs commands with ``self._exec(command)`` (text for the model) or ``await
self._aexec(...)`` (Harbor's ``ExecResult``) and prepares its sandbox in ``async _setup()``;
``self._environment``, ``self._task`` and the reference integration's ``self._env``,
``self._paths``, ``self._run`` and ``self._loop`` are there too. The reference's lifecycle hooks
(:data:`REFERENCE_HOOKS`: ``_start``, ``_upload_build_files``, ``_setup``, ``_verify``, ``_stop``)
are this class's too: a harness that overrides one gets it called at the reference's moment, with
its arguments and effect (``_start``'s instruction, ``_verify``'s reward). Stopping environments is :func:`release` and
:func:`close_all` (also run at interpreter exit).

Harbor is asynchronous: every coroutine runs on the one process-wide loop of
:mod:`trl_harbor.runtime`. Harbor is imported lazily, when the first sandbox starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import progress, runtime
from trl_harbor.options import HarborOptions, merge_loose_options
from trl_harbor.rollout import backends, grading
from trl_harbor.rollout.episode import CommandTimeoutError, Episode, Phase
from trl_harbor.rollout.outcome import Cause, Verification

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

    from trl_harbor.rollout.backends import Backend

__all__ = [
    "REFERENCE_HOOKS",
    "EnvironmentReward",
    "HarborBashEnv",
    "HarborBashStepsEnv",
    "HarborEnv",
    "StepsMixin",
    "check_hooks",
    "close_all",
    "overrides",
    "release",
    "verify_all",
    "with_environment_reward",
]

#: The episode whose hook is running (``_setup``, ``_upload_build_files``, ``_verify``, ``_stop``):
#: hooks run on the shared loop, some in the background (setup after ``reset`` returned, ``_stop``
#: after the next one began), so ``self._episode`` may already belong to a newer episode. Set only
#: by :func:`_hooked`; read only by :attr:`HarborEnv._current` and :meth:`HarborEnv._aexec`.
_HOOKED: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("hooked_episode", default=None)


@contextlib.contextmanager
def _hooked(episode: Episode) -> Iterator[None]:
    """Run a hook for ``episode``: within it, ``self._env``, ``self._task``, ... are that episode's."""
    token = _HOOKED.set(episode)
    try:
        yield
    finally:
        _HOOKED.reset(token)


#: The reference integration's lifecycle hooks (``trl.experimental.harbor.HarborEnv``): coroutines a
#: harness may override, each called at the reference's moment with the reference's arguments.
REFERENCE_HOOKS: tuple[str, ...] = ("_start", "_upload_build_files", "_setup", "_verify", "_stop")

logger = logging.getLogger(__name__)


def overrides(env: HarborEnv | type[HarborEnv], hook: str) -> bool:
    """Whether a harness (class or instance) overrides one of :class:`HarborEnv`'s hooks.

    Args:
        env: The harness.
        hook: The hook's name (one of :data:`REFERENCE_HOOKS`).

    Returns:
        ``True`` when the harness's own code runs for it.
    """
    cls = env if isinstance(env, type) else type(env)
    return getattr(cls, hook, None) is not getattr(HarborEnv, hook)


def check_hooks(cls: type[HarborEnv]) -> None:
    """Refuse, when the spec is built, a harness whose hooks cannot be called as the reference calls them.

    Args:
        cls: The harness.

    Raises:
        TypeError: When an overridden hook is not a coroutine function (``async def``), or
            ``_start`` does not take ``task_dir``; the message names the hook and the fix.
    """
    for hook in REFERENCE_HOOKS:
        if not overrides(cls, hook):
            continue
        function = getattr(cls, hook)
        if not inspect.iscoroutinefunction(function):
            raise TypeError(
                f"{cls.__qualname__}.{hook} is not a coroutine function: the lifecycle awaits it on the shared "
                f"event loop, as trl.experimental.harbor does. Fix: define it as `async def {hook}(self...)`."
            )
        arguments = ("task_dir",) if hook == "_start" else ()
        try:
            inspect.signature(function).bind(None, *arguments)
        except TypeError as exc:
            wanted = f"(self, {', '.join(arguments)})" if arguments else "(self)"
            raise TypeError(
                f"{cls.__qualname__}.{hook} cannot be called as {hook}{wanted}: {exc}. Fix: give it that signature."
            ) from None


def close_all() -> None:
    """Stop every live sandbox of this process (all environments, concurrently).

    Environments stay usable: the next ``reset`` starts a fresh sandbox. Also runs at exit. What
    backends keep warm between sandboxes goes too (the local sandbox's parked launcher: the next
    start parks another).
    """
    runtime.close_all()
    backends.release_idle()


def release(env: HarborEnv) -> None:
    """Stop an environment's current sandbox in the background (the environment stays usable).

    Args:
        env: The environment (its next ``reset`` starts a fresh sandbox).
    """
    episode, env._episode = env._episode, None
    if episode is not None:
        runtime.submit(env._ended(episode))


class HarborEnv:
    """Base TRL environment: one Harbor task sandbox plus Harbor's verifier per rollout.

    Subclass it to build a harness: every public method of the subclass becomes a tool the model
    can call (typed signature and Google-style docstring with ``Args:``, as TRL requires).

    ``reset`` returns the instruction at once and starts the sandbox in the background, so the
    sandboxes of a whole generation batch start together while the model generates; the first
    tool call waits for its sandbox only if it is not ready yet.

    One rollout, what TRL calls and what runs (hooks are coroutines on the shared loop; override any)::

        reset(task_dir, **row)    the previous episode ends in the background: _stop
                                  _start(task_dir): the sandbox starts, then _upload_build_files,
                                    the task's healthcheck, _setup; the instruction comes back
                                    (at once, or once started where a harness overrides _start,
                                    as the reference awaits it)
        tools                     self._exec / await self._aexec in the sandbox (wait for the start)
        reward / reward_funcs     _verify, once: Harbor's verifier, graded (rollout/grading.py)
        release(env) / close_all  _stop

    Within a hook, ``self._env``, ``self._task`` and ``self._paths`` are the hook's episode's, even
    when it runs in the background after the next ``reset``.

    Args:
        environment_type: Harbor sandbox backend: ``"docker"`` (default), any Harbor environment
            type (``"e2b"``, ``"daytona"``, ``"modal"``, ...), ``"local"`` for the bundled
            bubblewrap sandbox, or a plug-in ``"module.path:ClassName"``.
        options: How rollouts run and are graded (:class:`~trl_harbor.HarborOptions`): the one way
            in for rollout options.
        **overrides: Deprecated: fields of :class:`~trl_harbor.HarborOptions` (``command_timeout_sec=60``)
            replacing those of ``options``, with a ``FutureWarning`` that shows the ``options=`` to
            write (:func:`~trl_harbor.options.merge_loose_options`).

    Attributes:
        PROMPT_SUFFIX: Text appended to the task instruction returned by ``reset``.
    """

    PROMPT_SUFFIX: str = ""

    def __init__(self, environment_type: str = "docker", *, options: HarborOptions | None = None, **overrides: Any):
        runtime.arm()  # sandboxes stop at exit and on SIGTERM (installed here, on the trainer's thread)
        self._environment_type = environment_type
        self._options = merge_loose_options(options, overrides, f"{type(self).__name__}(...)")
        self._backend: Backend | None = None
        self._episode: Episode | None = None
        self._reward_reported = False
        self._verifying: tuple[Episode, asyncio.Future[float | None]] | None = None

    @property
    def options(self) -> HarborOptions:
        """How this environment's rollouts run and are graded."""
        return self._options

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
            ValueError: When ``task_dir`` is missing, the backend is unknown, or the task has
                several steps and the harness has no ``submit_step`` tool.
        """
        if task_dir is None:
            raise ValueError("HarborEnv.reset needs `task_dir` (the dataset row's task_dir column).")
        if overrides(self, "_start"):
            # The reference's order: the harness's `_start` starts the sandbox (ours, through super())
            # and returns the instruction; reset waits for it.
            instruction = self._run(self._start(str(task_dir)))
            episode = self._episode
            return instruction + self.PROMPT_SUFFIX + ("" if episode is None else _steps_note(episode.task))
        episode = self._launch(task_dir)  # what _start does, without waiting for the sandbox
        return episode.instruction + self.PROMPT_SUFFIX + _steps_note(episode.task)

    @property
    def reward(self) -> float | None:
        """The verifier's scalar for the current episode (computed once, on first read).

        ``0.0`` for an environment that was never reset, without touching any backend. After an
        infrastructure failure: ``None`` or ``0.0``, as ``on_infra_error`` says.
        """
        return 0.0 if self._episode is None else runtime.run(self._verified_reward())

    async def _verified_reward(self) -> float | None:
        """The current episode's reward, graded once (``0.0`` without an episode), marked as reported.

        From the harness's ``_verify`` when it overrides it (called once per episode), else from
        Harbor's verifier.
        """
        episode = self._episode
        if episode is None:
            return 0.0
        if overrides(self, "_verify"):
            if self._verifying is None or self._verifying[0] is not episode:
                self._verifying = (episode, asyncio.ensure_future(self._hooked_verify(episode)))
            value = await asyncio.shield(self._verifying[1])
        else:
            value = (await episode.grade()).reward
        self._reward_reported = True
        return value

    async def _hooked_verify(self, episode: Episode) -> float | None:
        await episode.wait_ready()
        with _hooked(episode):
            value = await self._verify()
        return None if value is None else float(value)

    @property
    def verification(self) -> Verification | None:
        """How the current episode was graded (``None`` before its reward was read)."""
        return None if self._episode is None else self._episode.verification

    @property
    def infra_error(self) -> str | None:
        """Why the current episode was lost to the infrastructure, or ``None`` (not the policy's fault)."""
        failure = None if self._episode is None else self._episode.failure
        return failure.reason if failure is not None and failure.cause.infra else None

    # ── the harness's helpers (private: TRL makes every public method a tool) ─────────

    def _exec(self, command: str, timeout: int | None = None, user: str | int | None = None) -> str:
        """Run a shell command in the sandbox; return its combined stdout and stderr as text for the model.

        Waits for the sandbox if it is still starting. Never raises: a failure (the sandbox did
        not start, a timeout, a backend error) comes back as text. Output longer than
        ``max_output_chars`` keeps its start and its end (where a failing command's error is).

        Args:
            command: The shell command.
            timeout: Seconds before the command is stopped (default: ``command_timeout_sec``).
            user: User to run as (default: the task's ``[agent] user``).

        Returns:
            The output, ``"(empty output, rc=N)"`` when there is none, with a trailing
            ``[exit code N]`` line when the command failed.
        """
        episode = self._episode
        if episode is None or episode.phase is Phase.STOPPED:
            return "Error: no sandbox is running (the environment was not reset, or it was closed)."
        timeout = self._options.command_timeout_sec if timeout is None else int(timeout)
        try:
            result = runtime.run(self._aexec(command, timeout, user), timeout=None)
        except Exception as exc:  # the model gets the error, training goes on
            return _error_text(episode, exc, timeout)
        output = cut_output((result.stdout or "") + (result.stderr or ""), self._options.max_output_chars)
        if not output:
            return f"(empty output, rc={result.return_code})"
        return output + (f"\n[exit code {result.return_code}]" if result.return_code else "")

    async def _aexec(self, command: str, timeout: int | None = None, user: str | int | None = None) -> Any:
        """Async form of :meth:`_exec` returning Harbor's ``ExecResult`` (for ``_setup`` hooks).

        Args:
            command: The shell command.
            timeout: Seconds before the command is stopped (default: ``command_timeout_sec``).
            user: User to run as (default: the task's ``[agent] user``).

        Returns:
            Harbor's ``ExecResult`` (``stdout``, ``stderr``, ``return_code``).

        Raises:
            RuntimeError: When no sandbox is running, or it could not be started.
        """
        provisioning = _HOOKED.get()
        episode = provisioning or self._episode
        if episode is None:
            raise RuntimeError("no sandbox is running")
        timeout = self._options.command_timeout_sec if timeout is None else int(timeout)
        return await episode.exec(command, timeout, user, wait=provisioning is None)

    # ── the reference's lifecycle hooks (coroutines on the shared loop; override any) ──────

    async def _start(self, task_dir: str) -> str:
        """Hook: stop the previous episode's sandbox, start ``task_dir``'s, return its instruction.

        ``reset`` calls it, and waits for it, only when a harness overrides it (an override calls
        ``await super()._start(task_dir)`` to start the sandbox); otherwise ``reset`` starts the
        sandbox in the background and returns at once. Starting runs :meth:`_upload_build_files`,
        the task's healthcheck and :meth:`_setup`, as in the reference. A sandbox that fails to
        start does not raise here: the rollout's tools say so, and it is not scored.

        Args:
            task_dir: The task directory.

        Returns:
            The task's instruction (``reset`` appends :attr:`PROMPT_SUFFIX`).
        """
        episode = self._launch(task_dir)
        await episode.wait_ready()
        return episode.instruction

    async def _upload_build_files(self) -> None:
        """Hook: put files into a freshly started sandbox, before its healthcheck (default: nothing).

        The reference replays the Dockerfile's ``COPY`` lines here for a cloud backend that drops
        them; the backends this library runs build the image with its files, so the default does
        nothing. Runs once per episode; ``self._env`` and ``self._task`` are the episode's.
        """

    async def _setup(self) -> None:
        """Hook for harnesses: prepare the sandbox after it started (default: nothing).

        Runs on the shared event loop once per ``reset``, in the background: use
        ``self._environment`` or ``await self._aexec(...)``, which refer to the episode being set
        up. An exception fails the episode's start.
        """

    async def _verify(self) -> float | None:
        """Hook: the episode's reward (default: Harbor's verifier, graded as :mod:`trl_harbor.rollout.grading` says).

        Called once per episode, when its reward is first read (``reward``, ``reward_funcs``). An
        override's value is the reward (``await super()._verify()`` grades with the verifier).

        Returns:
            The reward (``None``: an infrastructure failure, left out of the batch).
        """
        episode = self._current
        return 0.0 if episode is None else (await episode.grade()).reward

    async def _stop(self) -> None:
        """Hook: stop the episode's sandbox (when the episode ends: the next ``reset``, :func:`release`,
        the environment's deletion).

        An override runs in the background with ``self._env`` still the ending episode's; the
        sandbox is stopped after it whether or not it calls ``await super()._stop()``.
        """
        episode = self._current
        if episode is not None:
            await episode.stop()

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the hooks run on (the process's shared loop; the reference's ``self._loop``)."""
        return runtime.get_loop()

    @property
    def _current(self) -> Episode | None:
        return _HOOKED.get() or self._episode

    @property
    def _environment(self) -> BaseEnvironment | None:
        """The running Harbor environment of this episode (the one being set up, in ``_setup``)."""
        return None if self._current is None else self._current.environment

    @property
    def _task(self) -> Task | None:
        """Harbor's ``Task`` of this episode, or ``None`` before the first reset."""
        return None if self._current is None else self._current.task

    @property
    def _env(self) -> BaseEnvironment | None:
        """The reference's name for :attr:`_environment`; from a tool, it waits for the sandbox to start."""
        episode = self._episode
        if episode is not None and not runtime.on_loop_thread():  # a tool's read (hooks run on the loop)
            runtime.run(episode.wait_ready())
        return self._environment

    @property
    def _paths(self) -> TrialPaths | None:
        """Harbor's trial folders of this episode (the reference's ``self._paths``)."""
        return None if self._current is None else self._current.paths

    def _run(self, coro: Any) -> Any:
        """Run a coroutine on the shared loop and wait for it (the reference's ``self._run``)."""
        return runtime.run(coro)

    # ── plumbing ───────────────────────────────────────────────────────────────────

    def _resolved_backend(self) -> Backend:
        if self._backend is None:
            from trl_harbor.rollout.backends import resolve_backend

            self._backend = resolve_backend(self._environment_type, dict(self._options.backend_options))
        return self._backend

    def _launch(self, task_dir: str | Path) -> Episode:
        """End the current episode and start the next one's sandbox, for ``task_dir``, both in the background."""
        from trl_harbor.rollout.suite import load_task

        release(self)
        task = load_task(Path(task_dir))
        if task.has_steps and not callable(getattr(self, "submit_step", None)):
            raise ValueError(
                f"{task_dir}: a multi-step task needs a harness with a `submit_step` tool; use "
                "agent='bash_steps', or add trl_harbor.StepsMixin to your harness."
            )
        episode = Episode(task, self._resolved_backend(), self._options)
        self._episode, self._reward_reported = episode, False
        episode.ready = runtime.submit(self._provision(episode))
        return episode

    async def _provision(self, episode: Episode) -> None:
        async def prepare() -> None:
            # The folders the reference integration makes before its harness's setup (harnesses rely on them).
            await self._aexec("mkdir -p /workdir /home/user/input", timeout=60)
            await self._setup()

        with _hooked(episode):
            await episode.provision(
                prepare, self._upload_build_files if overrides(self, "_upload_build_files") else None
            )

    async def _ended(self, episode: Episode) -> None:
        """Stop an episode that ended, through the harness's ``_stop`` when it overrides it."""
        if overrides(self, "_stop"):
            with _hooked(episode):
                try:
                    await self._stop()
                except Exception:
                    logger.warning("trl-harbor: %s._stop failed", type(self).__qualname__, exc_info=True)
        await episode.stop()

    def __del__(self) -> None:
        # Best effort, and silent: close_all() at exit is the safety net. At interpreter exit this
        # module's globals may already be gone (None), so even the guard must not raise.
        try:
            if self.__dict__.get("_episode") is not None and not sys.is_finalizing():
                release(self)
        except Exception:  # noqa: BLE001
            pass


def _error_text(episode: Episode, exc: BaseException, timeout: int) -> str:
    """What the model reads when a command did not run to an answer."""
    failure = episode.failure
    if failure is not None:
        ending = "This rollout will not be scored." if failure.cause.infra else "The rollout is over."
        return f"Error: {failure.reason}. {ending}"
    if isinstance(exc, CommandTimeoutError):
        return f"Error: the command timed out after {timeout} s."
    if "being graded" in str(exc):
        return "Error: the rollout is over; its sandbox is being graded."
    if runtime.run(grading.alive(episode.environment)):
        # The backend runs the sandbox: the command itself was killed (e.g. by the agent's own `kill -9 -1`).
        return f"Error: the command ended without an answer ({type(exc).__name__}: {exc})."
    if runtime.run(episode.check_exhausted()):
        return f"Error: {episode.failure.reason}. The rollout is over."  # type: ignore[union-attr]
    return f"Error: {episode.fail('exec', exc).reason}. This rollout will not be scored."


def cut_output(text: str, limit: int) -> str:
    """Cut ``text`` to about ``limit`` characters, keeping its start and its end, one marker between.

    Args:
        text: The output.
        limit: The most characters kept.

    Returns:
        ``text``, or its first and last halves around ``[... N characters omitted ...]``.
    """
    if len(text) <= limit:
        return text
    head, tail = limit // 2, limit - limit // 2
    return f"{text[:head]}\n[... {len(text) - head - tail} characters omitted ...]\n{text[-tail:]}"


def verify_all(environments: Sequence[HarborEnv]) -> list[float | None]:
    """Verify a batch of rollouts concurrently and return each one's reward.

    What ``spec.reward_funcs`` does with a generation batch: every verifier runs at once, so a
    batch of N rollouts costs about one verification. Each environment's ``reward`` then returns
    the same value without verifying again.

    Args:
        environments: The rollouts' environments, in completion order.

    Returns:
        One reward per environment (``None`` for a skipped infrastructure failure; ``0.0`` for an
        environment never reset).
    """
    return runtime.run(progress.gather("verification", [env._verified_reward() for env in environments]))


# ── the built-in harnesses ──────────────────────────────────────────────────────────


class EnvironmentReward:
    """Makes a harness own its reward: adds ``get_reward``, which TRL reads from the environment.

    Without it (the default, as in ``trl.experimental.harbor``), the reward comes from
    ``reward_funcs``: ``spec.reward_funcs`` verifies a whole batch at once, and a custom reward
    function passed alone replaces the verifier. With it, TRL (``GRPOTrainer``, and
    ``AsyncGRPOTrainer``, whose rollout worker reads rewards from its environments) adds the
    verifier's score as a reward source of its own, named after the harness class, with weight 1.
    ``HarborSpec(..., reward_source="environment")`` builds the harness with this mixin.
    """

    def get_reward(self) -> float | None:
        """The episode's reward, read by trainers from the environment (TRL calls it; not a tool).

        When the reward was already handed out this episode (a ``reward_funcs`` that read
        :attr:`HarborEnv.reward`), this returns ``None`` — which TRL ignores — so the verifier is
        never counted twice.

        Returns:
            The reward, or ``None`` when it was already reported for this episode.
        """
        if self._episode is not None and self._reward_reported:  # type: ignore[attr-defined]
            return None
        return self.reward  # type: ignore[attr-defined]


@functools.cache
def with_environment_reward(cls: type[HarborEnv]) -> type[HarborEnv]:
    """The harness ``cls`` owning its reward (:class:`EnvironmentReward` mixed in; same name, same tools).

    Args:
        cls: The harness.

    Returns:
        The subclass (one per harness class; ``cls`` itself when it already has ``get_reward``).
    """
    if callable(getattr(cls, "get_reward", None)):
        return cls
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (EnvironmentReward, cls), namespace)


#: The reference integration's prompt suffix and ``bash`` tool description, kept word for word (a
#: model trained with ``trl.experimental.harbor`` sees the same prompt and the same tool schema;
#: ``tests/test_reference_parity.py`` compares them with the installed reference). A harness that
#: wants other words sets its own ``PROMPT_SUFFIX`` and docstring.
_BASH_PROMPT_SUFFIX = (
    "\n\nYou have a single `bash` tool: run a shell command in the sandbox and get its stdout+stderr. "
    "The dataset files are in /home/user/input/. Python 3 + pandas + numpy + scikit-learn are "
    "preinstalled. **Submit your final answer by writing it to /workdir/answer.txt via the `bash` "
    'tool**, e.g. `echo -n "<value>" > /workdir/answer.txt`. Stating the answer in prose does NOT submit '
    "it; only writing the file counts. Keep the answer short, and do not end your turn without submitting."
)


class HarborBashEnv(HarborEnv):
    """Built-in harness with a single stateless ``bash`` tool; submit via ``/workdir/answer.txt``."""

    PROMPT_SUFFIX = _BASH_PROMPT_SUFFIX

    def bash(self, command: str) -> str:
        """
        Run a shell command in the sandbox and return its combined stdout+stderr. The shell is non-stateful between
        calls. Use it to explore files (ls, head, cat), run Python (`python3 -c "..."`), and submit the answer (`echo
        -n "<value>" > /workdir/answer.txt`).

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
    and returns the next step's instruction. The rollout's reward combines the steps by the task's
    ``multi_step_reward_strategy``; a step below its ``min_reward`` ends the rollout, as in Harbor.
    Put it before the harness class: ``class MyEnv(StepsMixin, HarborBashEnv)``.
    """

    _episode: Episode | None

    def submit_step(self) -> str:
        """Submit your work on the current step: it is graded, and the next step's instruction is returned.

        Call it once the current step's instruction is fully done; you cannot go back.

        Returns:
            The next step's instruction, or a note that the task is over.
        """
        episode = self._episode
        if episode is None:
            return "Error: no task is running."
        if not episode.steps:
            return "This task has a single step: just finish your turn when you are done."
        index = episode.step_index
        following = runtime.run(episode.submit_step())
        if following is None:
            if episode.failure is not None and episode.failure.cause is Cause.INFRASTRUCTURE:
                return f"Error: {episode.failure.reason}. The task is over: finish your turn."
            return f"Step {index + 1} submitted. The task is over: finish your turn."
        return f"Step {index + 1} submitted. Step {index + 2} of {len(episode.steps)}:\n\n{following}"


class HarborBashStepsEnv(StepsMixin, HarborBashEnv):
    """The ``bash`` harness plus ``submit_step``, for suites with multi-step tasks (``agent="bash_steps"``)."""
