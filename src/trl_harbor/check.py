"""Suite QA: every task's oracle must score 1, and doing nothing must score 0.

For each task, two trials run in fresh sandboxes: Harbor's oracle agent runs
``solution/solve.sh`` and Harbor's verifier grades it (expected: 1), then the
verifier grades an untouched sandbox (expected: the task's floor, 0 unless
``[metadata] reward_floor`` says otherwise). A task whose graders accept an empty
answer, or whose reference solution fails, would silently poison training; this
catches both before a GPU hour is spent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor.agents.oracle import OracleAgent
from harbor.models.agent.context import AgentContext
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor.verifier.verifier import Verifier

from trl_harbor.backends import create_environment
from trl_harbor.env import select_reward

__all__ = ["CheckResult", "TrialOutcome", "check_suite"]

logger = logging.getLogger(__name__)


@dataclass
class TrialOutcome:
    """One trial of a check.

    Attributes:
        reward: The verifier's reward, or ``None`` if the trial failed.
        error: Why the trial failed, or ``None``.
        seconds: Wall time of the trial.
    """

    reward: float | None
    error: str | None
    seconds: float


@dataclass
class CheckResult:
    """The check of one task.

    Attributes:
        task: The task's name.
        task_dir: The task's folder.
        oracle: The oracle trial (expected reward 1).
        nop: The do-nothing trial (expected reward ``floor``).
        floor: The reward an untouched sandbox must get.
    """

    task: str
    task_dir: Path
    oracle: TrialOutcome
    nop: TrialOutcome
    floor: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether the oracle scored 1 and doing nothing scored the floor."""
        return (
            self.oracle.reward is not None
            and math.isclose(self.oracle.reward, 1.0)
            and self.nop.reward is not None
            and math.isclose(self.nop.reward, self.floor)
        )


async def _trial(
    task: Task, environment_type: str, workdir: Path, *, oracle: bool, env_kwargs: dict | None
) -> TrialOutcome:
    started = time.perf_counter()
    role = "oracle" if oracle else "nop"
    trial_paths = TrialPaths(trial_dir=workdir / f"{task.name}__{role}")
    environment = create_environment(
        task, environment_type, session_id=f"{task.name}__check-{role}", trial_paths=trial_paths, kwargs=env_kwargs
    )
    try:
        await environment.start(force_build=False)
        if oracle:
            agent = OracleAgent(logs_dir=trial_paths.agent_dir, task_dir=task.task_dir, trial_paths=trial_paths)
            await asyncio.wait_for(
                agent.run(task.instruction, environment, AgentContext()),
                timeout=task.config.agent.timeout_sec,
            )
        verifier = Verifier(task=task, trial_paths=trial_paths, environment=environment)
        result = await asyncio.wait_for(verifier.verify(), timeout=task.config.verifier.timeout_sec)
        return TrialOutcome(select_reward(result.rewards), None, time.perf_counter() - started)
    except Exception as error:  # noqa: BLE001 - a failed trial is a result, not a crash
        message = f"{type(error).__name__}: {error}".strip()
        return TrialOutcome(None, message, time.perf_counter() - started)
    finally:
        try:
            await environment.stop(delete=True)
        except Exception as error:  # noqa: BLE001
            logger.warning("could not stop the %s sandbox of %s: %s", role, task.name, error)


async def check_suite(
    task_dirs: Sequence[Path],
    environment_type: str = "local",
    *,
    concurrency: int = 8,
    env_kwargs: dict[str, Any] | None = None,
    on_done: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Check every task: oracle → 1, nothing → floor, concurrently.

    Args:
        task_dirs: The task folders.
        environment_type: Where the sandboxes run (see :mod:`trl_harbor.backends`).
        concurrency: How many tasks are checked at once.
        env_kwargs: Backend options.
        on_done: Called with each task's result as it finishes (e.g. a progress bar).

    Returns:
        One result per task, in the order given.
    """
    semaphore = asyncio.Semaphore(max(1, concurrency))
    workdir = Path(tempfile.mkdtemp(prefix="trl-harbor-check-"))

    async def one(task_dir: Path) -> CheckResult:
        async with semaphore:
            task = Task(task_dir)
            floor = float((task.config.metadata or {}).get("reward_floor", 0.0))
            oracle, nop = await asyncio.gather(
                _trial(task, environment_type, workdir, oracle=True, env_kwargs=env_kwargs),
                _trial(task, environment_type, workdir, oracle=False, env_kwargs=env_kwargs),
            )
            result = CheckResult(task.name, Path(task_dir), oracle, nop, floor)
            if on_done is not None:
                on_done(result)
            return result

    try:
        return list(await asyncio.gather(*(one(Path(d)) for d in task_dirs)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
