"""One rollout's sandbox, from provisioning to its grade: :class:`Episode`.

An episode is what one ``reset`` brings up: the task, its sandbox and Harbor's trial folder.
It starts the sandbox the way Harbor's trials do (the network plan, the healthcheck, the first
step's staging), runs the agent's commands, moves a multi-step task from step to step, and has
it graded (:func:`trl_harbor.rollout.grading.grade`) once (``trl-harbor check`` may have it graded
once more in place, :meth:`Episode.grade_in_place`). Its state is one :class:`Phase` and, when the
rollout cannot go on, one :class:`Failure`.

Every coroutine here runs on the shared loop of :mod:`trl_harbor.runtime`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import enum
import functools
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trl_harbor import progress, runtime
from trl_harbor.options import HarborOptions
from trl_harbor.rollout import grading, steps
from trl_harbor.rollout.contract import isolating
from trl_harbor.rollout.outcome import COUNTERS, Cause, Failure, Verification
from trl_harbor.rollout.policy import GradingPolicy
from trl_harbor.rollout.seal import Baseline

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

    from trl_harbor.rollout.backends import Backend, VerifierPlacement

__all__ = ["COMMAND_GRACE_SEC", "CommandTimeoutError", "Episode", "Phase"]

logger = logging.getLogger(__name__)

#: Seconds past a command's own timeout before a backend that never answers counts as gone.
COMMAND_GRACE_SEC = 30


class CommandTimeoutError(TimeoutError):
    """A command ran past its timeout (the backend stopped it): the policy's doing, not the infrastructure's."""


class Phase(enum.Enum):
    """Where an episode is: ``STARTING`` (provisioning in the background), ``READY`` (the agent's
    commands run), ``GRADING`` (a step or the rollout is being graded), ``OVER`` (graded, or it
    cannot go on), ``STOPPED`` (its sandbox is gone)."""

    STARTING = "starting"
    READY = "ready"
    GRADING = "grading"
    OVER = "over"
    STOPPED = "stopped"


def _is_timeout(error: BaseException) -> bool:
    # Harbor's backends report a command timeout as TimeoutError, their own "...Timeout..." types,
    # or RuntimeError("Command timed out after N seconds"): this is the one place that knows.
    return isinstance(error, TimeoutError) or "timeout" in type(error).__name__.lower() or "timed out" in str(error)


class Episode:
    """Everything one ``reset`` brings up: the task, its sandbox, its trial folder.

    Args:
        task: Harbor's task.
        backend: Where its sandboxes run.
        options: How it runs and is graded.
        trial_dir: A fresh folder for Harbor's trial files, removed at :meth:`stop` (default: a new one).
        label: A human-readable part of the sandboxes' session ids.
    """

    def __init__(
        self, task: Task, backend: Backend, options: HarborOptions, trial_dir: Path | None = None, label: str = ""
    ) -> None:
        from harbor.models.trial.paths import TrialPaths

        self.task = task
        self.backend = backend
        self.options = options
        self.paths: TrialPaths = TrialPaths(trial_dir=trial_dir or Path(tempfile.mkdtemp(dir=_trial_root())))
        self.label = label or task.short_name
        self.phase = Phase.STARTING
        self.failure: Failure | None = None
        self.environment: BaseEnvironment | None = None
        #: What grading takes from the options and the task's ``[metadata]``, read once.
        self.policy = GradingPolicy.resolve(task, options)
        #: Where the current step's verifier runs, as whom, on which network (resolved when the step starts).
        self.placement: VerifierPlacement | None = None
        #: The provisioning future, set by whoever submitted :meth:`provision` to the shared loop.
        self.ready: concurrent.futures.Future[None] | None = None
        self.verification: Verification | None = None
        self.baseline = Baseline()
        self.steps: list[StepConfig] = list(task.config.steps or [])
        self.step_index = 0
        self.step_outcomes: list[Verification] = []
        self._grading: asyncio.Future[Verification] | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._cleanup = runtime.register_cleanup(self.stop)

    # ── state ──────────────────────────────────────────────────────────────────────

    @property
    def step(self) -> StepConfig | None:
        """The current step of a multi-step task (``None`` for a single-step task)."""
        return self.steps[self.step_index] if self.steps else None

    @property
    def instruction(self) -> str:
        """The instruction of the current step (the task's, for a single-step task)."""
        return self.task.instruction if self.step is None else self.task.step_instruction(self.step.name)

    def fail(self, stage: str, error: BaseException | str, cause: Cause = Cause.INFRASTRUCTURE) -> Failure:
        """End the rollout: record why (the first failure wins; ``stage`` is ``start``, ``exec`` or
        ``verify``, for the log and the counters; ``cause`` ``INFRASTRUCTURE`` or ``EXHAUSTED``)."""
        if self.failure is None:
            what = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            if cause is Cause.INFRASTRUCTURE:
                COUNTERS.infra_failure(stage)
                what = f"{_STAGES[stage]} failed for task {self.task.name!r}: {what}"
                # At exit every sandbox is stopped, those still starting too: nothing to warn about then.
                log = logger.info if runtime.exiting() else logger.warning
                log("trl-harbor: %s (the rollout is not the policy's fault)", what)
            else:
                logger.info("trl-harbor: task %s: %s", self.task.name, what)
            self.failure = Failure(cause, what, None if isinstance(error, str) else error)
        if self.phase is not Phase.STOPPED:
            self.phase = Phase.OVER
        return self.failure

    async def check_exhausted(self) -> bool:
        """After the sandbox stopped answering: whether the agent exhausted its limits (then it is over)."""
        found = await grading.exhaustion(self.environment)
        if found:
            self.fail("exec", f"the rollout exhausted its sandbox ({found}), which stopped answering", Cause.EXHAUSTED)
        return self.failure is not None and self.failure.cause is Cause.EXHAUSTED

    # ── lifecycle ──────────────────────────────────────────────────────────────────

    async def provision(
        self,
        setup: Callable[[], Awaitable[None]] | None = None,
        started: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start the sandbox as Harbor's trials do (network plan, healthcheck, first step's staging), take
        the baseline of a backend without an isolated view, run ``setup`` (the harness's); never raises:
        a failure ends the episode (:attr:`failure`). ``started`` runs once the sandbox is up, before
        its healthcheck (the reference's ``_upload_build_files`` hook)."""
        progress.SANDBOX_STARTS.started()
        try:
            async with runtime.limit("harbor-sandbox-starts", self.options.max_concurrent_starts):
                self.placement = placement = self.backend.placement(self.task, self.step)
                plan = placement.plan
                self.paths.mkdir()
                self.environment = environment = self.backend.create(
                    self.task,
                    self.paths,
                    session_id=f"{self.label}__{uuid.uuid4().hex[:8]}__env",
                    network_policy=plan.agent_env_baseline,
                    phase_network_policies=placement.sandbox_phases,
                )
                await asyncio.wait_for(
                    environment.start(force_build=False), timeout=self.task.config.environment.build_timeout_sec
                )
                if plan.agent_phase != plan.agent_env_baseline:
                    await environment.set_network_policy(plan.agent_phase)
                if started is not None:
                    await started()
                await environment.run_healthcheck()
                if self.step is not None:
                    await steps.stage(environment, self.task, self.step)
                await self.baseline.take_processes(environment)
            if setup is not None:
                await setup()
            if not placement.separate:
                await self.baseline.take_files(environment, placement.user)
            if self.phase is Phase.STARTING:
                self.phase = Phase.READY
        except asyncio.CancelledError:
            if self._stopping is None:  # cancelled from outside: a lost start
                self.fail("start", "the episode's start was cancelled")
            elif self.failure is None:  # stopped before it was used (replaced, or the process exits): nothing lost
                self.failure = Failure(Cause.INFRASTRUCTURE, "the episode was stopped before its sandbox started")
            raise
        except Exception as exc:
            self.fail("start", exc)
        finally:
            progress.SANDBOX_STARTS.finished()

    async def wait_ready(self) -> None:
        """Wait until provisioning ended, however it ended (a cancellation of the caller propagates)."""
        if self.ready is not None:
            await asyncio.wait([asyncio.wrap_future(self.ready)])

    async def stop(self) -> None:
        """Stop the sandbox and remove the trial folder (idempotent: every caller waits for the one stop)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await self._stopping

    async def _stop(self) -> None:
        if self.ready is not None and not self.ready.done():
            self.ready.cancel()  # a start in progress is abandoned, then cleaned up below
        await self.wait_ready()
        self.phase = Phase.STOPPED
        environment, self.environment = self.environment, None
        try:
            if environment is not None:
                await environment.stop(delete=True)
        except Exception as exc:
            logger.warning("trl-harbor: stopping the sandbox of %s failed: %r", self.task.name, exc)
        finally:
            shutil.rmtree(self.paths.trial_dir, ignore_errors=True)
            runtime.unregister_cleanup(self._cleanup)

    # ── commands ───────────────────────────────────────────────────────────────────

    async def exec(self, command: str, timeout: int, user: str | int | None = None, *, wait: bool = True) -> ExecResult:
        """Run a shell command in the agent's sandbox.

        Args:
            command: The shell command.
            timeout: Seconds before the backend stops it.
            user: User to run as (default: the task's, or the step's, ``[agent] user``).
            wait: Wait for provisioning first (``False`` inside provisioning itself).

        Returns:
            Harbor's ``ExecResult``.

        Raises:
            CommandTimeoutError: When the command ran past ``timeout`` (a backend that does not
                answer :data:`COMMAND_GRACE_SEC` later is taken as one that stopped it).
            RuntimeError: When the rollout cannot go on, is being graded, or its sandbox is gone.
        """
        if wait:
            await self.wait_ready()
        if self.failure is not None:
            raise RuntimeError(self.failure.reason)
        if self.phase in (Phase.GRADING, Phase.OVER):
            raise RuntimeError("the rollout is over: its sandbox is being graded")
        if self.environment is None or self.phase is Phase.STOPPED:
            raise RuntimeError("no sandbox is running (it was stopped)")
        if user is None:
            user = steps.agent_user(self.task, self.step)
        try:
            return await asyncio.wait_for(
                self.environment.exec(command, timeout_sec=timeout, user=user), timeout=timeout + COMMAND_GRACE_SEC
            )
        except Exception as exc:
            if _is_timeout(exc):
                raise CommandTimeoutError(f"the command timed out after {timeout} s") from exc
            raise

    # ── grading ────────────────────────────────────────────────────────────────────

    async def grade(self) -> Verification:
        """Grade the rollout once, however many callers ask concurrently (kept as :attr:`verification`).

        A multi-step task's step in progress is graded as if submitted, and the steps are combined
        (:func:`steps.combine`). Raises an infrastructure failure under ``on_infra_error="raise"``.
        """
        if self._grading is None:
            self._grading = asyncio.ensure_future(self._grade())
        return await asyncio.shield(self._grading)

    async def _grade(self) -> Verification:
        await self.wait_ready()
        if self.steps and self.phase is Phase.READY:
            await self._grade_step()  # the step in progress, as if submitted
        if self.steps and self.step_outcomes:
            verification = steps.combine(
                self.task, self.steps, self.step_outcomes, self.options, self.failure, self.policy.reward_weights
            )
        else:
            verification = await self._grade_step()
        if self.phase is not Phase.STOPPED:
            self.phase = Phase.OVER
        self.verification = verification = grading.settle(verification, self.options)
        COUNTERS.outcome(verification)
        return verification

    async def _grade_step(self) -> Verification:
        """Grade the current step (or the single-step task), recording a failure it reveals."""
        if self.failure is None and (self.environment is None or self.phase is Phase.STOPPED):
            self.fail("verify", "the sandbox is gone (it was stopped before verification)")
        if self.failure is not None:
            outcome = grading.failed(self.failure.cause, self.failure.reason, error=self.failure.error)
        else:
            assert self.environment is not None and self.placement is not None
            self.phase = Phase.GRADING
            context = grading.Context(
                self.task, self.step, self.placement, self.policy, self.paths, self.backend, self.options
            )
            outcome = await grading.grade(self.environment, context, self.baseline)
            if outcome.cause is Cause.INFRASTRUCTURE or outcome.cause is Cause.EXHAUSTED:
                failure = self.fail("verify", outcome.error or outcome.reason, outcome.cause)
                outcome = grading.failed(failure.cause, failure.reason, error=failure.error)
        if self.steps:
            self.step_outcomes.append(outcome)
        return outcome

    async def grade_in_place(self) -> Verification | None:
        """Grade the rollout once more, in its sandbox itself, as Harbor's trial grades it (after :meth:`grade`).

        For ``trl-harbor check``, never for training: on a backend that grades in an isolated view
        (:func:`~trl_harbor.rollout.contract.isolating`), what the same rollout scores graded in place
        (:func:`grading.grade_in_place`, unsealed), which tells a reference solution that the view
        fails from a wrong one. :attr:`verification` and the counters stay the view's. A multi-step
        task's last graded step is graded again and the steps are combined anew (steps that a step
        failed in the view kept the rollout from reaching stay unreached).

        Returns:
            The verification in place (not settled for ``on_infra_error``), or ``None`` where there is
            nothing to compare: the sandbox is graded in place anyway (no isolated view), its verifier
            runs in a sandbox of its own, or the rollout cannot be graded again (it failed or its
            sandbox is gone).
        """
        await self.grade()
        environment, placement = self.environment, self.placement
        if (
            environment is None
            or placement is None
            or placement.separate
            or not isolating(environment)
            or self.failure is not None
            or self.phase is Phase.STOPPED
            or (self.steps and len(self.step_outcomes) != self.step_index + 1)
        ):
            return None
        context = grading.Context(self.task, self.step, placement, self.policy, self.paths, self.backend, self.options)
        outcome = await grading.grade_in_place(environment, context)
        if not self.steps:
            return outcome
        outcomes = [*self.step_outcomes[:-1], outcome]
        return steps.combine(self.task, self.steps, outcomes, self.options, None, self.policy.reward_weights)

    async def submit_step(self) -> str | None:
        """Grade the current step and stage the next (``None`` when the rollout is over).

        As in Harbor's multi-step trials, a step below its ``min_reward`` ends the rollout.
        """
        await self.wait_ready()
        if not self.steps or self.phase is not Phase.READY or self._grading is not None:
            return None
        step = self.step
        assert step is not None and self.environment is not None
        outcome = await self._grade_step()
        if (
            self.step_index + 1 >= len(self.steps)
            or outcome.cause is not None
            or not steps.meets_min_reward(outcome.rewards, step.min_reward)
        ):
            self.phase = Phase.OVER
            return None
        try:
            self.step_index += 1
            self.placement = await steps.advance(self.environment, self.task, self.step, self.backend, self.placement)
            await self.baseline.take_processes(self.environment)
            if not self.placement.separate:
                await self.baseline.take_files(self.environment, self.placement.user)
        except Exception as exc:
            self.fail("start", f"staging step {self.step.name!r} failed: {type(exc).__name__}: {exc}")
            return None
        self.phase = Phase.READY
        return self.instruction


_STAGES = {"start": "sandbox start", "exec": "a tool call", "verify": "verification"}


@functools.cache
def _trial_root() -> Path:
    """This process's folder for Harbor's per-episode files; those of dead processes are swept."""
    base = Path(tempfile.gettempdir()) / f"trl-harbor-trials-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry in base.iterdir():
        owner = entry.name.split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(entry, ignore_errors=True)
    root = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
    atexit.register(_remove_trial_root, root)
    return root


def _remove_trial_root(root: Path) -> None:
    # Registered after runtime's own exit hook, so it runs first: stop the sandboxes (episodes
    # still starting write into the folder) before removing it.
    runtime.close_all()
    shutil.rmtree(root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
