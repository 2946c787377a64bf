"""What a harness calls from its tools: the sandbox of the current rollout, as text or as Harbor objects.

:class:`HarnessAPI` is the base of :class:`~trl_harbor.env.HarborEnv`. Everything here is
private (``_``-prefixed), because TRL turns every public method of an environment class into a
tool: ``_exec`` (a command, its output as text for the model), ``_aexec`` (the same, async,
Harbor's ``ExecResult``), the ``_setup`` hook, ``_environment`` and ``_task`` (Harbor's objects),
and the reference integration's ``_env``, ``_paths`` and ``_run``, so that harnesses written for
``trl.experimental.harbor`` run unchanged.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from trl_harbor import runtime
from trl_harbor.episode import CommandTimeoutError, Episode

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

__all__ = ["HarnessAPI"]

#: The episode whose ``_setup`` is running (setup runs in the background, after ``reset``
#: returned, so ``self._episode`` may already belong to a newer episode).
_PROVISIONING: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("provisioning", default=None)


class HarnessAPI:
    """The sandbox helpers of a harness (see the module docstring); state lives in ``HarborEnv``."""

    _episode: Episode | None
    _command_timeout_sec: int
    _max_output_chars: int

    def _exec(self, command: str, timeout: int | None = None, user: str | int | None = None) -> str:
        """Run a shell command in the sandbox; return its combined stdout and stderr as text.

        Waits for the sandbox if it is still starting. Never raises: a failure (sandbox did
        not start, timeout, backend error) comes back as text for the model to read. Output
        longer than ``max_output_chars`` keeps its first and last halves, with a marker between
        (the end of a failing command's output is where its error is).

        Args:
            command: The shell command.
            timeout: Seconds before the command is stopped (default: ``command_timeout_sec``).
            user: User to run as (default: the task's ``[agent] user``, else the backend's).

        Returns:
            The output, ``"(empty output, rc=N)"`` when there is none, with a trailing
            ``[exit code N]`` line when the command failed.
        """
        episode = self._episode
        if episode is None or episode.stopped:
            return "Error: no sandbox is running (the environment was not reset, or it was closed)."
        timeout = self._command_timeout_sec if timeout is None else int(timeout)
        try:
            result = runtime.run(self._aexec(command, timeout, user), timeout=None)
        except Exception as exc:  # the model gets the error, training goes on
            if episode.infra_error is not None:
                return f"Error: {episode.infra_error}. This rollout will not be scored."
            if episode.exhausted is not None:
                return f"Error: {episode.exhausted}. The rollout is over."
            if episode.sealed:
                return "Error: the rollout is over; its sandbox is being graded."
            if isinstance(exc, CommandTimeoutError):
                return f"Error: the command timed out after {timeout} s."
            if runtime.run(episode.healthy()):
                # The sandbox answers: the command itself was killed (e.g. by the agent's own `kill -9 -1`).
                return f"Error: the command ended without an answer ({type(exc).__name__}: {exc})."
            if runtime.run(episode.check_exhausted(episode.environment)):
                return f"Error: {episode.exhausted}. The rollout is over."
            return f"Error: {episode.fail('exec', exc)}. This rollout will not be scored."
        output = _head_and_tail((result.stdout or "") + (result.stderr or ""), self._max_output_chars)
        if not output:
            return f"(empty output, rc={result.return_code})"
        if result.return_code:
            output += f"\n[exit code {result.return_code}]"
        return output

    async def _aexec(self, command: str, timeout: int, user: str | int | None = None) -> Any:
        """Async form of :meth:`_exec` returning Harbor's ``ExecResult`` (for ``_setup`` hooks).

        Waits for the sandbox if it is still starting (except inside ``_setup``, which runs
        once it has started).

        Args:
            command: The shell command.
            timeout: Seconds before the command is stopped.
            user: User to run as (default: the task's ``[agent] user``).

        Returns:
            Harbor's ``ExecResult`` (``stdout``, ``stderr``, ``return_code``).

        Raises:
            RuntimeError: When no sandbox is running, or it could not be started.
        """
        provisioning = _PROVISIONING.get()
        episode = provisioning or self._episode
        if episode is None:
            raise RuntimeError("no sandbox is running")
        return await episode.exec(command, timeout, user, wait=provisioning is None)

    async def _setup(self) -> None:
        """Hook for harnesses: prepare the sandbox after it started (default: nothing).

        Runs on the shared event loop once per ``reset``, in the background: use
        ``self._environment`` (Harbor's ``BaseEnvironment``) or ``await self._aexec(...)``,
        which refer to the episode being set up. An exception fails the episode's start.
        """

    @property
    def _environment(self) -> BaseEnvironment | None:
        """The running Harbor environment of this episode (the one being set up, in ``_setup``)."""
        episode = _PROVISIONING.get() or self._episode
        return None if episode is None else episode.environment

    @property
    def _task(self) -> Task | None:
        """Harbor's ``Task`` of this episode, or ``None`` before the first reset."""
        episode = _PROVISIONING.get() or self._episode
        return None if episode is None else episode.task

    # The reference integration's names, which harnesses written for it use.

    @property
    def _env(self) -> BaseEnvironment | None:
        """The reference's name for :attr:`_environment`; from a tool, it waits for the sandbox to start.

        (The reference starts the sandbox inside ``reset``; here it starts in the background.)
        """
        episode = self._episode
        if _PROVISIONING.get() is None and episode is not None and not runtime.on_loop_thread():
            runtime.run(episode.wait_ready())
        return self._environment

    @property
    def _paths(self) -> TrialPaths | None:
        """Harbor's trial folders of this episode (the reference's ``self._paths``)."""
        episode = _PROVISIONING.get() or self._episode
        return None if episode is None else episode.paths

    def _run(self, coro: Any) -> Any:
        """Run a coroutine on the shared loop and wait for it (the reference's ``self._run``).

        Args:
            coro: A coroutine, e.g. ``self._env.exec(...)``.

        Returns:
            Its result.
        """
        return runtime.run(coro)


def _head_and_tail(text: str, limit: int) -> str:
    """Cut ``text`` to about ``limit`` characters, keeping its start and its end (where errors are)."""
    if len(text) <= limit:
        return text
    head, tail = limit // 2, limit - limit // 2
    return f"{text[:head]}\n... [truncated: {len(text) - head - tail} characters omitted] ...\n{text[-tail:]}"
