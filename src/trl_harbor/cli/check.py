"""Suite QA: every task's oracle must score 1, and doing nothing must score 0.

For each task, two episodes run in fresh sandboxes and are graded exactly as training grades them
(:class:`trl_harbor.rollout.Episode` and :func:`trl_harbor.rollout.grading.grade`: the same
provisioning, healthchecks, multi-step staging, verifier view, verifier modes and reward
reduction): Harbor's oracle agent runs the reference solution (``solution/solve.sh``, or each
step's) as the task's ``[agent] user``, and must score 1; an untouched sandbox must score the
task's floor (0 unless ``[metadata] reward_floor`` says otherwise). A task whose graders accept an
empty answer, or whose reference solution fails, would silently poison training; this catches
both before a GPU hour is spent.

One task never stops the check: a task that is malformed, that the backend cannot run, or whose
sandbox fails, is a failed row with its reason. Episodes run on the shared loop of
:mod:`trl_harbor.runtime`, as in training.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import runtime
from trl_harbor.options import HarborOptions
from trl_harbor.rollout import steps
from trl_harbor.rollout.episode import Episode

if TYPE_CHECKING:
    from trl_harbor.rollout.backends import Backend

__all__ = ["CheckResult", "TrialOutcome", "check_suite", "check_task"]

logger = logging.getLogger(__name__)


@dataclass
class TrialOutcome:
    """One episode of a check.

    Attributes:
        reward: The reward, or ``None`` if the episode could not be graded.
        error: Why it could not be graded, or why it scored what it did (empty when graded normally).
        seconds: Wall time of the episode.
        rewards: Every value the verifier wrote.
    """

    reward: float | None
    error: str | None
    seconds: float
    rewards: dict[str, float] = field(default_factory=dict)


@dataclass
class CheckResult:
    """The check of one task.

    Attributes:
        task: The task's name.
        task_dir: The task's folder.
        oracle: The oracle episode (expected reward 1).
        nop: The do-nothing episode (expected reward ``floor``).
        floor: The reward an untouched sandbox must get.
        problem: Why the task could not be checked at all (malformed, or not runnable here).
    """

    task: str
    task_dir: Path
    oracle: TrialOutcome
    nop: TrialOutcome
    floor: float = 0.0
    problem: str | None = None

    @property
    def passed(self) -> bool:
        """Whether the oracle scored 1 and doing nothing scored the floor."""
        return (
            self.problem is None
            and self.oracle.reward is not None
            and math.isclose(self.oracle.reward, 1.0)
            and self.nop.reward is not None
            and math.isclose(self.nop.reward, self.floor)
        )

    @property
    def why(self) -> str:
        """A one-line reason for a failed check (empty when it passed)."""
        if self.passed:
            return ""
        if self.problem:
            return self.problem
        if self.oracle.reward is None or not math.isclose(self.oracle.reward, 1.0):
            return f"oracle scored {_show(self.oracle.reward)}: {self.oracle.error or 'its solution is wrong'}"
        why = self.nop.error or "the verifier accepts an untouched sandbox"
        return f"doing nothing scored {_show(self.nop.reward)}, expected {self.floor:g}: {why}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``trl-harbor check --json``).

        Returns:
            The result's fields, with ``passed`` and ``why``.
        """
        data = asdict(self)
        data["task_dir"] = str(self.task_dir)
        data.update(passed=self.passed, why=self.why)
        return data


def _show(reward: float | None) -> str:
    return "nothing (error)" if reward is None else f"{reward:g}"


async def _episode(task: Any, backend: Backend, options: HarborOptions, workdir: Path, *, oracle: bool) -> TrialOutcome:
    from harbor.agents.oracle import OracleAgent
    from harbor.models.agent.context import AgentContext

    started = time.perf_counter()
    role = "oracle" if oracle else "nop"
    trial = Path(tempfile.mkdtemp(prefix=f"{role}-", dir=workdir))
    episode = Episode(task, backend, options, trial, label=f"{task.short_name}__check-{role}")
    try:
        await episode.provision()
        if oracle and episode.failure is None:
            assert episode.environment is not None
            agent = OracleAgent(logs_dir=episode.paths.agent_dir, task_dir=task.task_dir, trial_paths=episode.paths)
            for _ in episode.steps or [None]:
                try:
                    with episode.environment.with_default_user(steps.agent_user(task, episode.step)):
                        await asyncio.wait_for(
                            agent.run(episode.instruction, episode.environment, AgentContext()),
                            timeout=task.config.agent.timeout_sec,
                        )
                except Exception as error:  # noqa: BLE001 - the grade says what it left
                    logger.info("check: the oracle of %s failed: %s", task.name, error)
                if episode.steps and await episode.submit_step() is None:
                    break
        verification = await episode.grade()
        seconds = time.perf_counter() - started
        return TrialOutcome(verification.reward, verification.reason or None, seconds, dict(verification.rewards))
    except Exception as error:  # noqa: BLE001 - a failed episode is a result, not a crash
        return TrialOutcome(None, f"{type(error).__name__}: {error}".strip(), time.perf_counter() - started)
    finally:
        await episode.stop()


async def check_task(
    task_dir: Path,
    environment_type: str | Backend = "local",
    *,
    options: HarborOptions | None = None,
    workdir: Path | None = None,
) -> CheckResult:
    """Check one task: its oracle episode and its do-nothing episode, concurrently (on the shared loop).

    Args:
        task_dir: The task folder.
        environment_type: Where the sandboxes run (see :mod:`trl_harbor.rollout.backends`), or the
            backend it resolved to (:func:`check_suite` resolves it once for every task).
        options: How the episodes run and are graded (reward reduction, backend options, ...).
        workdir: Where the episodes keep their files (default: a temporary folder).

    Returns:
        The result; never raises for a problem of the task or of its sandboxes.
    """
    from trl_harbor.rollout.backends import resolve_backend
    from trl_harbor.rollout.preflight import docker_network_problem
    from trl_harbor.rollout.suite import TaskSuiteError, validate_task
    from trl_harbor.training.env import HarborBashStepsEnv
    from trl_harbor.training.spec import check_runnable

    options = options or HarborOptions()
    task_dir = Path(task_dir)
    failed = TrialOutcome(None, None, 0.0)
    info, problems = validate_task(task_dir)
    if info is None:
        return CheckResult(task_dir.name, task_dir, failed, failed, problem="; ".join(problems))
    try:
        backend = (
            resolve_backend(environment_type, dict(options.backend_options))
            if isinstance(environment_type, str)
            else environment_type
        )
        check_runnable([info], HarborBashStepsEnv, backend)
        problem = docker_network_problem(backend, [task_dir])  # Docker that cannot enforce its network
    except (TaskSuiteError, ValueError) as error:
        return CheckResult(info.name, task_dir, failed, failed, problem=" ".join(str(error).split()))
    if problem:
        return CheckResult(info.name, task_dir, failed, failed, problem=" ".join(problem.split()))
    floor = float((info.metadata or {}).get("reward_floor", 0.0))
    own = workdir is None
    folder = Path(tempfile.mkdtemp(prefix="trl-harbor-check-")) if own else workdir
    try:
        oracle, nop = await asyncio.gather(
            _episode(info.task, backend, options, folder, oracle=True),
            _episode(info.task, backend, options, folder, oracle=False),
        )
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    return CheckResult(info.name, task_dir, oracle, nop, floor)


def check_suite(
    task_dirs: Sequence[Path],
    environment_type: str | Backend = "local",
    *,
    concurrency: int = 8,
    options: HarborOptions | None = None,
    on_done: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Check every task (oracle → 1, nothing → floor), ``concurrency`` tasks at a time.

    Args:
        task_dirs: The task folders.
        environment_type: Where the sandboxes run (see :mod:`trl_harbor.rollout.backends`), or the
            backend it resolved to; resolved once for every task.
        concurrency: How many tasks are checked at once.
        options: How the episodes run and are graded.
        on_done: Called with each task's result as it finishes (e.g. a progress bar).

    Returns:
        One result per task, in the order given; a broken task is a failed result.
    """
    from trl_harbor.rollout.backends import resolve_backend

    semaphore = asyncio.Semaphore(max(1, concurrency))
    if isinstance(environment_type, str):
        try:
            environment_type = resolve_backend(environment_type, dict((options or HarborOptions()).backend_options))
        except ValueError:
            pass  # an unknown backend: each task's row says why

    async def one(task_dir: Path, workdir: Path) -> CheckResult:
        async with semaphore:
            try:
                result = await check_task(task_dir, environment_type, options=options, workdir=workdir)
            except Exception as error:  # noqa: BLE001 - one task never stops the check
                failed = TrialOutcome(None, None, 0.0)
                problem = f"{type(error).__name__}: {error}"
                result = CheckResult(Path(task_dir).name, Path(task_dir), failed, failed, problem=problem)
            if on_done is not None:
                on_done(result)
            return result

    async def every() -> list[CheckResult]:
        workdir = Path(tempfile.mkdtemp(prefix="trl-harbor-check-"))
        try:
            return list(await asyncio.gather(*(one(Path(d), workdir) for d in task_dirs)))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    return runtime.run(every())
