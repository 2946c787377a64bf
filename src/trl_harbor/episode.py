"""One rollout's sandbox, from provisioning to grading: the state behind ``HarborEnv``.

An :class:`Episode` is what one ``reset`` brings up: the task, its sandbox, Harbor's trial
folder, and — once the rollout ends — its :class:`Verification`. Grading follows Harbor's
verifier semantics and adds what RL needs (see ``docs/rewards.md``):

1. **Seal**: every process the agent left is killed, and the files the verifier runs are
   compared with their state before the agent's first command (:mod:`trl_harbor.integrity`).
   A change that replaces or shadows what the verifier runs scores 0 without running it.
2. **Verify** with Harbor's own ``Verifier`` (in the agent's sandbox, or in a fresh verifier
   sandbox with the declared artifacts copied across).
3. **Classify** a failure: if the sandbox still answers, the rollout broke its own
   verification (no reward file, a malformed one, a timeout) and scores 0; only a sandbox
   that no longer answers — a backend fault — is an infrastructure failure, skipped or scored
   as ``on_infra_error`` says.

Every coroutine here runs on the shared loop of :mod:`trl_harbor.runtime`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import integrity, runtime

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task
    from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
    from harbor.models.trial.paths import TrialPaths
    from harbor.trial.network_policy import TrialNetworkPlan

__all__ = [
    "CommandTimeoutError",
    "Episode",
    "RewardError",
    "Verification",
    "infra_failures",
    "select_reward",
    "verification_failures",
]

logger = logging.getLogger(__name__)

INFRA_MODES = ("skip", "zero", "raise")
_STAGE_LABELS = {"start": "sandbox start", "exec": "a tool call", "verify": "verification"}
#: Infrastructure failures of this process, by stage (``start``, ``exec``, ``verify``).
_INFRA_FAILURES: collections.Counter[str] = collections.Counter()
#: Rollouts scored 0 because their verification failed in a healthy sandbox, by cause.
_AGENT_FAILURES: collections.Counter[str] = collections.Counter()
#: Seconds a health probe (``true`` in the sandbox) may take before the sandbox counts as broken.
PROBE_TIMEOUT_SEC = 30


class RewardError(RuntimeError):
    """The verifier's result cannot be turned into one scalar reward."""


def select_reward(
    rewards: dict[str, float | int] | None,
    reward_key: str | None = None,
    weights: dict[str, float] | None = None,
) -> float:
    """Reduce a verifier's rewards to the scalar that trains the policy.

    In order: ``reward_key`` when given; else ``weights`` (a weighted sum) when given; else the
    ``"reward"`` entry; else the only entry; else the mean of every entry (a multi-reward task
    such as ``{"correctness": 1, "performance": 0.5}`` with no declared weighting).

    Args:
        rewards: The verifier's rewards (``reward.json``'s keys, or ``{"reward": x}``).
        reward_key: The entry to use.
        weights: ``{entry: weight}``: the reward is ``sum(weight * value)``.

    Returns:
        The reward.

    Raises:
        RewardError: When there are no rewards, or ``reward_key`` or a weighted entry is missing.
    """
    if not isinstance(rewards, dict) or not rewards:
        raise RewardError(f"the verifier returned no rewards ({rewards!r})")
    if reward_key is not None:
        if reward_key not in rewards:
            raise RewardError(
                f"reward_key={reward_key!r} is not among the verifier's rewards {sorted(rewards)}; pick one of them."
            )
        return float(rewards[reward_key])
    if weights:
        missing = sorted(set(weights) - set(rewards))
        if missing:
            raise RewardError(f"reward weights name {missing}, which the verifier did not return ({sorted(rewards)}).")
        return float(sum(float(weight) * float(rewards[key]) for key, weight in weights.items()))
    if "reward" in rewards:
        return float(rewards["reward"])
    return float(sum(float(value) for value in rewards.values()) / len(rewards))


def infra_failures() -> dict[str, int]:
    """Count this process's infrastructure failures so far, by stage.

    A failure is a sandbox that did not start, or a sandbox that stopped answering (during a
    tool call or verification). What the policy can cause in a healthy sandbox — a command
    that fails or times out, a verifier it broke — is not one (see :func:`verification_failures`).

    Returns:
        ``{"start": n, "exec": n, "verify": n}``.
    """
    return {stage: _INFRA_FAILURES[stage] for stage in ("start", "exec", "verify")}


def verification_failures() -> dict[str, int]:
    """Count this process's rollouts scored 0 because the rollout broke its own verification.

    Returns:
        ``{"tampered": n, "failed": n}``: rollouts that changed what the verifier runs, and
        rollouts whose verifier wrote no usable reward or timed out in a healthy sandbox.
    """
    return {cause: _AGENT_FAILURES[cause] for cause in ("tampered", "failed")}


@dataclass(frozen=True)
class Verification:
    """How one rollout was graded.

    Attributes:
        reward: The scalar reward for training; ``None`` when the rollout is skipped (an
            infrastructure failure under ``on_infra_error="skip"``).
        rewards: Every value the verifier wrote (``reward.json``'s keys, or ``{"reward": x}``).
        reason: Why the rollout was not graded normally (empty when it was).
        infra: Whether that reason is an infrastructure failure (not the policy's doing).
        tampered: The changes the agent made to what the verifier runs (then ``reward`` is 0).
        changes: Every change the agent made in the watched locations (allowed ones too).
        killed: How many processes the agent left running were stopped before grading.
        steps: For a multi-step task, each graded step's name and rewards, in order.
    """

    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    infra: bool = False
    tampered: tuple[str, ...] = ()
    changes: tuple[str, ...] = ()
    killed: int = 0
    steps: tuple[tuple[str, dict[str, float]], ...] = ()


class CommandTimeoutError(TimeoutError):
    """A command ran past its timeout (the backend stopped it). The policy's doing, not the infrastructure's."""


def _is_timeout(error: BaseException) -> bool:
    # Harbor's backends report a command timeout as TimeoutError, their own "...Timeout..." types,
    # or RuntimeError("Command timed out after N seconds"): this is the one place that knows.
    return isinstance(error, TimeoutError) or "timeout" in type(error).__name__.lower() or "timed out" in str(error)


class _BackendFault(RuntimeError):
    """A failure that is the backend's by construction (e.g. a verifier sandbox that did not start)."""


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
        self._processes_before: list[str] | None = None
        self._watches: list[integrity.Watch] = []
        self._files_before: dict[str, str] | None = None
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
            _INFRA_FAILURES[stage] += 1
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
        """Remember the sandbox's own processes, which grading keeps (the agent's it kills).

        Call it once the sandbox started (and its healthcheck passed), before anything of the
        agent's — a harness's ``_setup`` included — runs: a service the image's ``ENTRYPOINT``
        or a setup script started is kept; a kernel the harness starts for the agent is not.
        """
        environment = self.environment
        if environment is None:
            return
        native = getattr(environment, "list_processes", None)
        if callable(native):
            self._processes_before = list(await native())
            return
        result = await environment.exec(integrity.PROCESS_SNAPSHOT_SCRIPT, user="root", timeout_sec=60)
        self._processes_before = (result.stdout or "").split()

    async def snapshot_files(self) -> None:
        """Fingerprint what the verifier runs, before the agent's first command (shared-sandbox verification only)."""
        environment = self.environment
        if environment is None or self.plan is None or self.plan.verifier_env_baseline is not None:
            return
        path_dirs, python_dirs = await self._verifier_search_paths(environment)
        self._watches = integrity.watches(path_dirs, python_dirs)
        self._files_before = await self._fingerprint(environment)

    async def _verifier_search_paths(self, environment: BaseEnvironment) -> tuple[list[str], list[str]]:
        probe = (
            'printf "%s\\0" "$PATH"; command -v python3 >/dev/null 2>&1 && python3 -c '
            '\'import site, sys; print("\\0".join([p for p in sys.path if p] + [site.getusersitepackages()]), end="")\''
        )
        with environment.with_default_user(self.task.config.verifier.user):
            result = await environment.exec(probe, timeout_sec=60)
        parts = (result.stdout or "").split("\0")
        return parts[0].split(":"), [p for p in parts[1:] if p]

    async def _fingerprint(self, environment: BaseEnvironment) -> dict[str, str]:
        native = getattr(environment, "file_fingerprints", None)
        if callable(native):
            return await native([(w.pattern, w.depth) for w in self._watches])
        command = integrity.fingerprint_command(self._watches)
        result = await environment.exec(command, user="root", timeout_sec=300)
        return integrity.parse_fingerprints(result.stdout or "")

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
            self.verification = await self._grade_step(None)
            return self.verification
        if not self.finished:
            await self._finish_step()
        self.verification = self._combine_steps()
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
        outcome = await self._grade_step(step)
        self.step_outcomes.append(outcome)
        last = self.step_index + 1 >= len(self.steps)
        if last or outcome.infra or outcome.tampered or not _meets(outcome.rewards, step.min_reward):
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

    def _combine_steps(self) -> Verification:
        """One verification from the steps', by ``multi_step_reward_strategy`` (unreached steps: 0)."""
        from harbor.models.task.config import MultiStepRewardStrategy

        outcomes = self.step_outcomes
        infra = next((o for o in outcomes if o.infra), None)
        if infra is not None:
            return infra
        names = [step.name for step in self.steps]
        per_step = tuple((name, dict(o.rewards)) for name, o in zip(names, outcomes, strict=False))
        if self.task.config.multi_step_reward_strategy is MultiStepRewardStrategy.FINAL:
            reached = len(outcomes) == len(self.steps)
            combined = dict(outcomes[-1].rewards) if reached and outcomes else {}
        else:
            keys = {key for o in outcomes for key in o.rewards}
            combined = {key: sum(o.rewards.get(key, 0.0) for o in outcomes) / len(self.steps) for key in keys}
        reasons = [f"step {name!r}: {o.reason}" for name, o in zip(names, outcomes, strict=False) if o.reason]
        if len(outcomes) < len(self.steps):
            reasons.append(f"{len(self.steps) - len(outcomes)} of {len(self.steps)} steps never reached (scored 0)")
        details = {
            "reason": "; ".join(reasons),
            "tampered": tuple(c for o in outcomes for c in o.tampered),
            "changes": tuple(c for o in outcomes for c in o.changes),
            "killed": sum(o.killed for o in outcomes),
            "steps": per_step,
        }
        if not combined:
            return Verification(0.0, **details)
        try:
            reward = select_reward(combined, self.reward_key, self.reward_weights)
        except RewardError as exc:
            return self._infra(self.fail("verify", exc), exc)
        return Verification(reward, rewards=combined, **details)

    async def _grade_step(self, step: StepConfig | None) -> Verification:
        """Seal the sandbox and verify the task (or one step of it), classifying any failure."""
        from harbor.models.task.verifier_mode import VerifierEnvironmentMode, resolve_step_verifier_mode

        if self.infra_error is None and self.environment is None:
            self.fail("verify", "the sandbox is gone (it was stopped before verification)")
        if self.infra_error is not None:
            return self._infra(self.infra_error)
        if step is None:
            separate = self.plan is not None and self.plan.verifier_env_baseline is not None
        else:
            separate = resolve_step_verifier_mode(self.task.config, step) == VerifierEnvironmentMode.SEPARATE
        try:
            if separate:
                return await self._grade_separately(step)
            return await self._grade_in_place(step)
        except _BackendFault as fault:
            return self._infra(self.fail("verify", str(fault)))

    def _infra(self, reason: str, error: BaseException | None = None) -> Verification:
        if self.on_infra_error == "raise":
            raise error if error is not None else RuntimeError(reason)
        return Verification(None if self.on_infra_error == "skip" else 0.0, reason=reason, infra=True)

    async def _seal(self, environment: BaseEnvironment) -> int:
        """Stop every process the agent left, so nothing runs beside the verifier."""
        self.sealed = True
        native = getattr(environment, "kill_processes", None)
        keep = self._processes_before or []
        try:
            if callable(native):
                return int(await native(keep))
            result = await environment.exec(integrity.kill_command(keep), user="root", timeout_sec=120)
            return int((result.stdout or "0").strip().splitlines()[-1] or 0)
        except Exception as exc:
            raise _BackendFault(f"stopping the agent's processes failed: {type(exc).__name__}: {exc}") from exc

    def _verifier_user(self, step: StepConfig | None) -> str | int | None:
        if step is not None and step.verifier.user is not None:
            return step.verifier.user
        return self.task.config.verifier.user

    async def _grade_in_place(self, step: StepConfig | None) -> Verification:
        from harbor.models.trial.paths import EnvironmentPaths

        environment = self.environment
        plan = self.plan
        assert environment is not None and plan is not None
        killed = await self._seal(environment)
        changes: list[integrity.Change] = []
        tampered: list[integrity.Change] = []
        if self._files_before is not None:
            try:
                after = await self._fingerprint(environment)
            except Exception as exc:
                raise _BackendFault(f"reading the sandbox's files failed: {type(exc).__name__}: {exc}") from exc
            changes = integrity.diff(self._files_before, after)
            tampered = integrity.violations(changes, self._files_before, self._watches, self.allowed_changes)
        listed = tuple(str(c) for c in changes)
        if tampered:
            _AGENT_FAILURES["tampered"] += 1
            shown = ", ".join(str(c) for c in tampered[:5])
            if len(tampered) > 5:
                shown += f" and {len(tampered) - 5} more"
            reason = (
                f"the rollout changed what the verifier runs ({shown}); scored 0 without verifying. "
                "If the task legitimately changes these, declare them in task.toml [metadata] allowed_changes."
            )
            logger.info("trl-harbor: task %s: %s", self.task.name, reason)
            tampered_paths = tuple(str(c) for c in tampered)
            return Verification(0.0, reason=reason, tampered=tampered_paths, changes=listed, killed=killed)
        try:
            with environment.with_default_user(self._verifier_user(step)):
                await environment.empty_dirs([EnvironmentPaths.for_os(environment.os).verifier_dir], chmod=True)
                if plan.verifier_phase != plan.agent_phase:
                    await environment.set_network_policy(plan.verifier_phase)
                rewards = await self._run_verifier(environment, step)
        except Exception as exc:
            return await self._verifier_failed(exc, environment, changes=listed, killed=killed)
        return self._scored(rewards, changes=listed, killed=killed)

    async def _grade_separately(self, step: StepConfig | None) -> Verification:
        """Verify in a fresh sandbox built from the task's (or step's) verifier environment.

        The agent sandbox's declared ``artifacts`` (and Harbor's ``/logs/artifacts`` folder) are
        copied into the verifier sandbox at the same paths (as files, never executed on the
        host) before the tests run.
        """
        from harbor.models.task.verifier_mode import resolve_verifier_environment_definition
        from harbor.models.trial.paths import EnvironmentPaths

        task, source, plan = self.task, self.environment, self.plan
        assert self.paths is not None and source is not None and plan is not None
        killed = await self._seal(source)
        definition = resolve_verifier_environment_definition(task.config, task.paths, step)
        if definition is None or plan.verifier_env_baseline is None:
            raise _BackendFault("separate verifier mode did not resolve a verifier environment")
        baseline, phase = plan.verifier_env_baseline, plan.verifier_phase
        verifier_env = self.create_environment(
            task,
            self.paths,
            "verifier",
            environment_dir=definition.directory,
            task_env_config=definition.config,
            network_policy=baseline,
            phase_network_policies=[phase],
            enable_environment_dir_upload=not definition.bundled_tests,
        )
        handle = runtime.register_cleanup(lambda: verifier_env.stop(delete=True))
        try:
            try:
                await verifier_env.start(force_build=False)
                with verifier_env.with_default_user(self._verifier_user(step)):
                    await verifier_env.empty_dirs([EnvironmentPaths.for_os(verifier_env.os).verifier_dir], chmod=True)
                await self._copy_artifacts(source, verifier_env, step)
                if phase != baseline:
                    await verifier_env.set_network_policy(phase)
            except Exception as exc:
                raise _BackendFault(f"preparing the verifier sandbox failed: {type(exc).__name__}: {exc}") from exc
            try:
                with verifier_env.with_default_user(self._verifier_user(step)):
                    rewards = await self._run_verifier(verifier_env, step, bundled=definition.bundled_tests)
            except Exception as exc:
                return await self._verifier_failed(exc, verifier_env, killed=killed)
            return self._scored(rewards, killed=killed)
        finally:
            runtime.unregister_cleanup(handle)
            await verifier_env.stop(delete=True)

    async def _run_verifier(
        self, environment: BaseEnvironment, step: StepConfig | None, *, bundled: bool = False
    ) -> dict[str, float | int]:
        from harbor.verifier.verifier import Verifier

        assert self.paths is not None
        timeout = self.task.config.verifier.timeout_sec
        env = None
        if step is not None:
            timeout = step.verifier.timeout_sec if step.verifier.timeout_sec is not None else timeout
            env = step.verifier.env or None
        verifier = Verifier(
            task=self.task,
            trial_paths=self.paths,
            environment=environment,
            verifier_env=env,
            step_name=None if step is None else step.name,
            skip_tests_upload=bundled,
        )
        try:
            result = await asyncio.wait_for(verifier.verify(), timeout=timeout)
        except TimeoutError:
            raise TimeoutError(f"the verifier ran past its timeout ({timeout:g} s)") from None
        return dict(result.rewards or {})

    def _scored(self, rewards: dict[str, float | int], **details: Any) -> Verification:
        if self.steps:  # a step's scalar is decided when the steps are combined
            return Verification(None, rewards={k: float(v) for k, v in rewards.items()}, **details)
        try:
            reward = select_reward(rewards, self.reward_key, self.reward_weights)
        except RewardError as exc:  # the task's or the user's configuration, never the policy's
            return self._infra(self.fail("verify", exc), exc)
        return Verification(reward, rewards={k: float(v) for k, v in rewards.items()}, **details)

    async def _verifier_failed(self, exc: BaseException, environment: BaseEnvironment, **details: Any) -> Verification:
        """Score 0 when the sandbox is healthy (the rollout broke its verification), else an infra failure."""
        cause = f"{type(exc).__name__}: {exc}"
        if not await self.healthy(environment):
            return self._infra(self.fail("verify", cause))
        _AGENT_FAILURES["failed"] += 1
        reason = f"verification failed in a healthy sandbox ({cause}); scored 0"
        logger.info("trl-harbor: task %s: %s", self.task.name, reason)
        return Verification(0.0, reason=reason, **details)

    async def _copy_artifacts(self, source: BaseEnvironment, target: BaseEnvironment, step: StepConfig | None) -> None:
        from harbor.models.trial.paths import EnvironmentPaths

        assert self.paths is not None
        paths = [str(EnvironmentPaths.for_os(source.os).artifacts_dir)]
        declared = [*self.task.config.artifacts, *(step.artifacts if step is not None else [])]
        for artifact in declared:
            paths.append(artifact if isinstance(artifact, str) else artifact.source)
        staging = Path(tempfile.mkdtemp(prefix="artifacts_", dir=self.paths.trial_dir))
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


def _meets(rewards: dict[str, float], threshold: float | dict[str, float] | None) -> bool:
    """Harbor's ``min_reward`` gate: a float gates ``reward``; a dict each key (missing: fails)."""
    if threshold is None:
        return True
    gates = {"reward": threshold} if isinstance(threshold, (int, float)) else threshold
    return all(rewards.get(key, float("-inf")) >= value for key, value in gates.items())
