"""One rollout's sandbox, from provisioning to grading: the state behind ``HarborEnv``.

An :class:`Episode` is what one ``reset`` brings up: the task, its sandbox, Harbor's trial
folder, the :class:`~trl_harbor.sealing.Seal` taken before the agent's first command, and —
once the rollout ends — its :class:`~trl_harbor.grading.Verification`. It starts the sandbox
the way Harbor's trials do (network plan, healthcheck, multi-step staging), runs the agent's
commands, moves a multi-step task from step to step, and grades it
(:mod:`trl_harbor.grading`). ``HarborEnv`` is its TRL surface; ``trl-harbor check`` uses it
directly, so training and checking grade identically.

Every coroutine here runs on the shared loop of :mod:`trl_harbor.runtime`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trl_harbor import grading, progress, runtime
from trl_harbor.grading import (
    INFRA_FAILURES,
    INFRA_MODES,
    RewardError,
    Verification,
    infra_failures,
    select_reward,
    verification_failures,
)
from trl_harbor.sealing import Seal

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task
    from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
    from harbor.models.trial.paths import TrialPaths
    from harbor.trial.network_policy import TrialNetworkPlan

__all__ = [
    "INFRA_MODES",
    "CommandTimeoutError",
    "Episode",
    "RewardError",
    "Verification",
    "infra_failures",
    "select_reward",
    "verification_failures",
]

logger = logging.getLogger(__name__)

_STAGE_LABELS = {"start": "sandbox start", "exec": "a tool call", "verify": "verification"}
#: Seconds a health probe (``true`` in the sandbox) may take before the sandbox counts as broken.
PROBE_TIMEOUT_SEC = 30


class CommandTimeoutError(TimeoutError):
    """A command ran past its timeout (the backend stopped it). The policy's doing, not the infrastructure's."""


def _is_timeout(error: BaseException) -> bool:
    # Harbor's backends report a command timeout as TimeoutError, their own "...Timeout..." types,
    # or RuntimeError("Command timed out after N seconds"): this is the one place that knows.
    return isinstance(error, TimeoutError) or "timeout" in type(error).__name__.lower() or "timed out" in str(error)


class Episode:
    """Everything one ``reset`` brings up: the task, its sandbox(es) and scratch folder.

    Provisioning runs in the background on the shared loop (``ready``); the first tool call
    waits for it. Every coroutine here runs on that one loop, so no locking is needed.

    Args:
        task: Harbor's task.
        trial_dir: A fresh folder for Harbor's trial files (removed at :meth:`stop`).
        create_environment: Builds a Harbor environment: ``(task, paths, role, **options)``.
        trial_config: Harbor's environment config (the backend), for the task's network plan.
        reward_key: Which of the verifier's rewards is the scalar (see :func:`select_reward`).
        reward_weights: A weighting of the verifier's rewards (default: the task's
            ``[metadata] reward_weights``, if any).
        on_infra_error: ``"skip"``, ``"zero"`` or ``"raise"`` for an infrastructure failure.
        allowed_changes: Globs of sandbox paths the agent may change although the verifier
            runs them (added to the task's ``[metadata] allowed_changes``).
    """

    def __init__(
        self,
        task: Task,
        trial_dir: Path,
        *,
        create_environment: Callable[..., BaseEnvironment],
        trial_config: TrialEnvironmentConfig | None = None,
        reward_key: str | None = None,
        reward_weights: dict[str, float] | None = None,
        on_infra_error: str = "skip",
        allowed_changes: Sequence[str] = (),
    ) -> None:
        self.task = task
        self.trial_dir = trial_dir
        self.create_environment = create_environment
        self.trial_config = trial_config
        self.reward_key = reward_key
        declared_weights = task.config.metadata.get("reward_weights")
        self.reward_weights = reward_weights or (declared_weights if isinstance(declared_weights, dict) else None)
        self.on_infra_error = on_infra_error
        declared = task.config.metadata.get("allowed_changes") or []
        self.allowed_changes = [*allowed_changes, *([declared] if isinstance(declared, str) else declared)]
        self.paths: TrialPaths | None = None
        self.plan: TrialNetworkPlan | None = None
        self.environment: BaseEnvironment | None = None
        self.ready: concurrent.futures.Future[None] | None = None
        self.infra_error: str | None = None
        self.verification: Verification | None = None
        self.reward_reported = False
        self.stopped = False
        self.sealed = False
        self.cleanup_handle = runtime.register_cleanup(self.stop)
        self._grading: asyncio.Future[Verification] | None = None
        self._stopping: asyncio.Future[None] | None = None
        self.seal = Seal()
        #: Why the sandbox died of its own limits (memory, processes, disk) that the agent exhausted.
        self.exhausted: str | None = None
        #: The task's ``[[steps]]`` (empty for a single-step task), the current one, and each
        #: graded step's outcome.
        self.steps: list[StepConfig] = list(task.config.steps or [])
        self.step_index = 0
        self.step_outcomes: list[Verification] = []
        self.finished = False

    # ── failures ───────────────────────────────────────────────────────────────────

    def fail(self, stage: str, error: BaseException | str) -> str:
        """Record an infrastructure failure of this episode (once) and return its message.

        Args:
            stage: ``"start"``, ``"exec"`` or ``"verify"``.
            error: What went wrong.

        Returns:
            The recorded message (the first failure's, when there were several).
        """
        if self.infra_error is None:
            cause = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.infra_error = f"{_STAGE_LABELS[stage]} failed for task {self.task.name!r}: {cause}"
            INFRA_FAILURES[stage] += 1
            logger.warning("trl-harbor: %s (the rollout is not the policy's fault)", self.infra_error)
        return self.infra_error

    async def healthy(self, environment: BaseEnvironment | None = None) -> bool:
        """Whether a sandbox still runs commands (``true`` as root, within :data:`PROBE_TIMEOUT_SEC`).

        Args:
            environment: The sandbox to probe (default: the agent's).

        Returns:
            ``True`` when it answered with exit code 0.
        """
        environment = environment or self.environment
        if environment is None:
            return False
        try:
            result = await asyncio.wait_for(
                environment.exec("true", user="root", timeout_sec=PROBE_TIMEOUT_SEC), PROBE_TIMEOUT_SEC + 5
            )
        except Exception:  # noqa: BLE001 - any failure to answer is the answer
            return False
        return result.return_code == 0

    async def check_exhausted(self, environment: BaseEnvironment | None) -> bool:
        """Ask a sandbox that stopped answering whether the agent exhausted its limits.

        A backend that can tell provides ``async resource_exhaustion() -> str | None`` (the
        local sandbox reads its cgroups). A sandbox the agent filled up (memory, processes) is
        the policy's doing: the rollout scores 0 instead of being skipped, or breaking the
        sandbox would be a way out of a low score.

        Args:
            environment: The sandbox that failed.

        Returns:
            Whether the agent exhausted it (then :attr:`exhausted` says how).
        """
        probe = getattr(environment, "resource_exhaustion", None)
        if self.exhausted is None and callable(probe):
            try:
                found = await probe()
            except Exception:  # noqa: BLE001 - no answer is no evidence
                found = None
            if found:
                self.exhausted = f"the rollout exhausted its sandbox ({found}), which stopped answering"
                logger.info("trl-harbor: task %s: %s", self.task.name, self.exhausted)
        return self.exhausted is not None

    # ── lifecycle ──────────────────────────────────────────────────────────────────

    @property
    def step(self) -> StepConfig | None:
        """The current step of a multi-step task (``None`` for a single-step task)."""
        return self.steps[self.step_index] if self.steps else None

    @property
    def instruction(self) -> str:
        """The instruction of the current step (the task's, for a single-step task)."""
        step = self.step
        return self.task.instruction if step is None else self.task.step_instruction(step.name)

    async def provision(
        self,
        setup: Callable[[], Awaitable[None]] | None = None,
        *,
        max_concurrent_starts: int | None = None,
    ) -> None:
        """Start the sandbox the way Harbor's trials do, then prepare it for the agent; never raises.

        Builds and starts the agent's sandbox with the task's network plan, runs its
        healthcheck, remembers its own processes, prepares the first step of a multi-step
        task (its ``workdir/``, ``setup.sh`` and healthcheck), runs ``setup`` (a harness's
        preparation) and fingerprints what the verifier runs. A failure is recorded as the
        episode's infrastructure failure (:attr:`infra_error`).

        Args:
            setup: The harness's preparation, run last (its processes count as the agent's).
            max_concurrent_starts: How many sandboxes of this process start at once.
        """
        from harbor.models.trial.paths import TrialPaths

        from trl_harbor.backends import network_plan

        progress.SANDBOX_STARTS.started()
        try:
            async with runtime.limit("harbor-sandbox-starts", max_concurrent_starts):
                self.paths = TrialPaths(trial_dir=self.trial_dir)
                assert self.trial_config is not None, "an Episode needs trial_config to provision"
                self.plan = plan = network_plan(self.task, self.trial_config, self.step)
                shared = plan.verifier_env_baseline is None
                environment = self.create_environment(
                    self.task,
                    self.paths,
                    "env",
                    network_policy=plan.agent_env_baseline,
                    phase_network_policies=[plan.agent_phase, plan.verifier_phase] if shared else [plan.agent_phase],
                )
                self.environment = environment
                timeout = self.task.config.environment.build_timeout_sec
                await asyncio.wait_for(environment.start(force_build=False), timeout=timeout)
                if plan.agent_phase != plan.agent_env_baseline:
                    await environment.set_network_policy(plan.agent_phase)
                await environment.run_healthcheck()
                await self._prepare_step()
                await self.snapshot_processes()  # before the harness: its kernels are the agent's
            if setup is not None:
                await setup()
            await self.snapshot_files()  # after the harness: its files are not the agent's
        except asyncio.CancelledError:
            self.infra_error = self.infra_error or "the episode was replaced before its sandbox started"
            raise
        except Exception as exc:
            self.fail("start", exc)
        finally:
            progress.SANDBOX_STARTS.finished()

    async def _prepare_step(self) -> None:
        """Stage the current step as Harbor does: its ``workdir/`` files, ``setup.sh``, healthcheck."""
        step, environment = self.step, self.environment
        if step is None or environment is None:
            return
        with environment.with_default_user(step.agent.user or self.task.config.agent.user):
            workdir = ((await environment.exec("pwd")).stdout or "/").strip() or "/"
            staged = self.task.paths.step_workdir_dir(step.name)
            if staged.exists():
                await environment.upload_dir(source_dir=staged, target_dir=workdir)
            if self.task.paths.step_setup_path(step.name).exists():
                script = f"{workdir.rstrip('/')}/setup.sh"
                result = await environment.exec(f"bash '{script}'")
                if result.return_code != 0:
                    raise RuntimeError(
                        f"step {step.name!r}: setup.sh exited with {result.return_code}: "
                        f"{(result.stderr or result.stdout or '').strip()[-500:]}"
                    )
            if step.healthcheck is not None:
                await environment.run_healthcheck(step.healthcheck)

    async def wait_ready(self) -> None:
        """Wait until provisioning ended, however it ended; a cancellation of the caller propagates."""
        if self.ready is not None:
            await asyncio.wait([asyncio.wrap_future(self.ready)])

    async def snapshot_processes(self) -> None:
        """Remember the sandbox's own processes (kept at grading): before anything of the agent's runs."""
        if self.environment is not None:
            await self.seal.take_processes(self.environment)

    async def snapshot_files(self) -> None:
        """Fingerprint what the verifier runs, before the agent's first command (shared verification only)."""
        if self.environment is None or self.plan is None or self.plan.verifier_env_baseline is not None:
            return
        user = self.step.verifier.user if self.step and self.step.verifier.user is not None else None
        await self.seal.take_files(self.environment, user if user is not None else self.task.config.verifier.user)

    def stop(self) -> asyncio.Future[None]:
        """Stop the sandbox(es) and remove the scratch folder; idempotent, safe to call concurrently.

        Must be called on the shared loop (it is what ``close_all`` and the next ``reset`` schedule).

        Returns:
            A future that is done once everything is stopped.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        return self._stopping

    async def _stop(self) -> None:
        self.stopped = True
        if self.ready is not None and not self.ready.done():
            self.ready.cancel()  # a start in progress is abandoned, then cleaned up below
        await self.wait_ready()
        environment, self.environment = self.environment, None
        try:
            if environment is not None:
                await environment.stop(delete=True)
        except Exception as exc:
            logger.warning("trl-harbor: stopping the sandbox of %s failed: %r", self.task.name, exc)
        finally:
            shutil.rmtree(self.trial_dir, ignore_errors=True)
            runtime.unregister_cleanup(self.cleanup_handle)

    # ── commands ───────────────────────────────────────────────────────────────────

    async def exec(self, command: str, timeout: int, user: str | int | None = None, *, wait: bool = True) -> ExecResult:
        """Run a shell command in the agent's sandbox.

        Args:
            command: The shell command.
            timeout: Seconds before the command is stopped.
            user: User to run as (default: the task's ``[agent] user``).
            wait: Wait for provisioning first (``False`` inside provisioning itself).

        Returns:
            Harbor's ``ExecResult``.

        Raises:
            CommandTimeoutError: When the command ran past ``timeout`` (the backend's deadline;
                a guard 60 s later catches a backend that never answers).
            RuntimeError: When the sandbox did not start, was stopped, or the rollout is
                being graded.
        """
        if wait:
            await self.wait_ready()
        if self.infra_error is not None:
            raise RuntimeError(self.infra_error)
        if self.exhausted is not None:
            raise RuntimeError(self.exhausted)
        if self.sealed or self.finished:
            raise RuntimeError("the rollout is over: its sandbox is being graded")
        if self.environment is None:
            raise RuntimeError("no sandbox is running (it was stopped)")
        if user is None:
            user = self.task.config.agent.user
        try:
            return await asyncio.wait_for(
                self.environment.exec(command, timeout_sec=timeout, user=user), timeout=timeout + 60
            )
        except Exception as exc:
            if _is_timeout(exc):
                raise CommandTimeoutError(f"the command timed out after {timeout} s") from exc
            raise

    # ── grading ────────────────────────────────────────────────────────────────────

    async def grade(self) -> Verification:
        """Grade the rollout once, however many callers ask concurrently.

        For a multi-step task, the step in progress is graded as if submitted, steps never
        reached score 0, and the steps' rewards are combined by the task's
        ``multi_step_reward_strategy`` (see :meth:`submit_step`).

        Returns:
            The :class:`Verification` (also kept as :attr:`verification`).

        Raises:
            Exception: An infrastructure failure, when ``on_infra_error="raise"``.
        """
        if self._grading is None:
            self._grading = asyncio.ensure_future(self._grade())
        return await asyncio.shield(self._grading)

    async def _grade(self) -> Verification:
        await self.wait_ready()
        if not self.steps:
            self.verification = await grading.grade_step(self, None)
            return self.verification
        if not self.finished:
            await self._finish_step()
        self.verification = grading.combine_steps(self)
        return self.verification

    async def submit_step(self) -> str | None:
        """Grade the current step of a multi-step task and move to the next one.

        The step is graded exactly like a whole single-step task (the agent's processes
        killed, tampering refused, Harbor's verifier with the step's tests). Then, as in
        Harbor's multi-step trials, a step below its ``min_reward`` ends the episode;
        otherwise the verifier's folders are emptied and the next step is staged.

        Returns:
            The next step's instruction, or ``None`` when the episode is over (the last step
            was graded, a step missed its ``min_reward``, or grading failed).
        """
        await self.wait_ready()
        if self.finished or not self.steps:
            return None
        if self._grading is not None:  # the rollout's reward was already read
            self.finished = True
            return None
        outcome = await self._finish_step()
        if self.finished:
            return None
        try:
            await self._next_step()
        except Exception as exc:
            self.fail("start", f"staging step {self.step.name!r} failed: {type(exc).__name__}: {exc}")
            self.finished = True
            return None
        logger.debug("trl-harbor: task %s: step %d graded %r", self.task.name, self.step_index, outcome.reward)
        return self.instruction

    async def _finish_step(self) -> Verification:
        step = self.step
        assert step is not None
        outcome = await grading.grade_step(self, step)
        self.step_outcomes.append(outcome)
        last = self.step_index + 1 >= len(self.steps)
        if last or outcome.infra or outcome.tampered or not grading.meets_min_reward(outcome.rewards, step.min_reward):
            self.finished = True
        return outcome

    async def _next_step(self) -> None:
        from harbor.models.trial.paths import EnvironmentPaths

        environment = self.environment
        assert environment is not None
        paths = EnvironmentPaths.for_os(environment.os)
        # What the previous step's verifier left (its tests, its outputs) goes before the agent returns.
        await environment.empty_dirs([paths.verifier_dir], chmod=True)
        await environment.empty_dirs([paths.tests_dir], chmod=False)
        from trl_harbor.backends import network_plan

        self.step_index += 1
        self.sealed = False
        assert self.trial_config is not None
        previous, self.plan = self.plan, network_plan(self.task, self.trial_config, self.step)
        if previous is None or self.plan.agent_phase != previous.verifier_phase:
            await environment.set_network_policy(self.plan.agent_phase)
        await self._prepare_step()
        await self.snapshot_processes()
        await self.snapshot_files()
