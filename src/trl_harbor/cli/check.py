"""Suite QA: every task's oracle must score 1, and doing nothing must score 0.

For each task, two episodes run in fresh sandboxes and are graded exactly as training grades them
(:class:`trl_harbor.rollout.Episode` and :func:`trl_harbor.rollout.grading.grade`: the same
provisioning, healthchecks, multi-step staging, verifier view, verifier modes and reward
reduction): Harbor's oracle agent runs the reference solution (``solution/solve.sh``, or each
step's) as the task's ``[agent] user``, and must score 1; an untouched sandbox must score the
task's floor (0 unless ``[metadata] reward_floor`` says otherwise). A task whose graders accept an
empty answer, or whose reference solution fails, would silently poison training; this catches
both before a GPU hour is spent.

When the oracle scores below 1, its row says what failed (the failing tests of the verifier's
output, else its last lines: :func:`failures`). On a backend that grades in an isolated view of
the sandbox (the local sandbox: the verifier runs the image's code, not what the agent changed
there), the oracle's rollout is then graded once more, in the same sandbox, in place — as Harbor's
trial grades it (:meth:`~trl_harbor.rollout.episode.Episode.grade_in_place`). A task that passes
there "passes in place, fails in the isolated view" (:attr:`CheckResult.fails_only_in_view`): its
solution is right, the view is what fails it (a solution that changes the image's code without
``[metadata] allowed_changes``, or something the view does not support). It still fails the check:
training on this backend would score its honest rollouts 0, which must not pass unnoticed. Training
never grades twice; only ``check`` does, only for the oracle, and only after it failed in the view.

One task never stops the check: a task that is malformed, that the backend cannot run, or whose
sandbox fails, is a failed row with its reason. Episodes run on the shared loop of
:mod:`trl_harbor.runtime`, as in training.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
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
from trl_harbor.rollout.contract import TaskFault
from trl_harbor.rollout.episode import Episode
from trl_harbor.rollout.outcome import Cause

if TYPE_CHECKING:
    from trl_harbor.rollout.backends import Backend

__all__ = ["CheckResult", "TrialOutcome", "check_suite", "check_task", "failures"]

logger = logging.getLogger(__name__)

#: At most this many characters of a verifier's output say what failed, per episode.
FAILURES_CHARS = 240
#: At most this many of what the isolated view held back are kept, per episode.
CONCEALED_KEPT = 5
#: How much of the end of a verifier's output is read for what failed.
_TAIL_BYTES = 64 << 10
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: A failing test as test runners summarise it: pytest's short summary (``FAILED tests/test_x.py::test_y
#: - AssertionError``, ``ERROR ...``) and unittest's (``FAIL: test_y (test_x.T.test_y)``, ``ERROR: ...``; not
#: its closing ``FAILED (failures=1)``).
_FAILED_TEST = re.compile(r"^(?:FAILED|ERROR) [^\s(]|^(?:FAIL|ERROR): \S")
#: The causes of an oracle's shortfall after which it is graded once more in place: graded normally, no
#: usable reward, a view refused for what it left (with an isolated view the only ``TAMPERED``); not a
#: sandbox lost to the infrastructure or exhausted, nor a misconfigured reward.
_REGRADED = (None, Cause.VERIFIER, Cause.TAMPERED)


@dataclass
class TrialOutcome:
    """One episode of a check.

    Attributes:
        reward: The reward, or ``None`` if the episode could not be graded.
        error: Why it could not be graded, or why it scored what it did (empty when graded normally).
        seconds: Wall time of the episode (up to its grade).
        rewards: Every value the verifier wrote.
        failures: For an oracle that scored below 1, what failed, from the verifier's output: the
            failing tests (pytest's or unittest's summary lines), else its last lines; at most
            :data:`FAILURES_CHARS` characters (empty otherwise).
        concealed: For an oracle that scored below 1 in an isolated view, what the view held back
            of the rollout's changes, and why (``"path (why)"``; the first :data:`CONCEALED_KEPT`; not
            Harbor's own ``/solution``, ``/tests``, ``/logs/verifier``).
        in_place: For an oracle that scored below 1 in an isolated view, the same rollout graded
            once more in place, as Harbor's trial grades it (``None``: not graded again).
        task_fault: Its sandbox did not start for the task's own doing (a backend's error marked
            :class:`~trl_harbor.rollout.contract.TaskFault`: a compose service that exited or never became
            healthy): the task's problem, whatever the policy does.
    """

    reward: float | None
    error: str | None
    seconds: float
    rewards: dict[str, float] = field(default_factory=dict)
    failures: str = ""
    concealed: list[str] = field(default_factory=list)
    in_place: TrialOutcome | None = None
    task_fault: bool = False


@dataclass
class CheckResult:
    """The check of one task.

    A task passes when its oracle scored 1 and doing nothing the floor. An oracle that scored below 1
    in the isolated view and 1 in place (:attr:`fails_only_in_view`) is not a wrong solution, and its
    :attr:`why` says so, but the task still fails: on this backend training would score the task's
    honest rollouts 0 (the view is how training grades), so it must not pass silently.

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
    def fails_only_in_view(self) -> bool:
        """Whether the oracle passes in place but fails in the isolated view: the view, not the solution, fails it."""
        in_place = self.oracle.in_place
        return self.problem is None and not _one(self.oracle.reward) and in_place is not None and _one(in_place.reward)

    @property
    def why(self) -> str:
        """A one-line reason for a failed check (empty when it passed)."""
        if self.passed:
            return ""
        if self.problem:
            return self.problem
        oracle = self.oracle
        if self.fails_only_in_view:
            found = f"; failed: {oracle.failures}" if oracle.failures else ""
            if not found and oracle.error:  # e.g. the verifier wrote no reward in the view
                found = f"; {_shorten(oracle.error, FAILURES_CHARS)}"
            if oracle.concealed:
                more = len(oracle.concealed) - 2
                hidden = "; ".join(_shorten(c, 120) for c in oracle.concealed[:2])
                found += f"; the view held back: {hidden}" + (f"; and {more} more" if more > 0 else "")
                advice = "if the solution may change these, declare them in task.toml [metadata] allowed_changes"
            else:
                advice = "the view differs from the task's sandbox here"
            return (
                f"oracle passes in place, fails in the isolated view (scored {_show(oracle.reward)} there{found}); "
                f"{advice} (docs/rewards.md)"
            )
        if not _one(oracle.reward):
            why = f"oracle scored {_show(oracle.reward)}: {oracle.error or 'its solution is wrong'}"
            if oracle.in_place is not None:
                why += (
                    f" (in place too: {_show(oracle.in_place.reward)})"
                    if oracle.in_place.reward is not None
                    else f" (grading it in place failed too: {oracle.in_place.error})"
                )
            return f"{why}; failed: {oracle.failures}" if oracle.failures else why
        why = self.nop.error or "the verifier accepts an untouched sandbox"
        return f"doing nothing scored {_show(self.nop.reward)}, expected {self.floor:g}: {why}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``trl-harbor check --json``).

        Returns:
            The result's fields, with ``passed``, ``fails_only_in_view`` and ``why``.
        """
        data = asdict(self)
        data["task_dir"] = str(self.task_dir)
        data.update(passed=self.passed, fails_only_in_view=self.fails_only_in_view, why=self.why)
        return data


def _one(reward: float | None) -> bool:
    return reward is not None and math.isclose(reward, 1.0)


def _show(reward: float | None) -> str:
    return "nothing (error)" if reward is None else f"{reward:g}"


def _shorten(text: str, limit: int, *, keep_end: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1) :] if keep_end else text[: limit - 1] + "…"


def failures(output: Path, limit: int = FAILURES_CHARS) -> str:
    """What failed, in a verifier's output (Harbor's ``verifier/test-stdout.txt``: stdout and stderr).

    The failing tests as the test runner summarises them (pytest's ``FAILED``/``ERROR`` lines,
    unittest's ``FAIL:``/``ERROR:`` lines), else the output's last lines. Only the output's end is read.

    Args:
        output: The verifier's output file.
        limit: At most this many characters are returned.

    Returns:
        One line of at most ``limit`` characters (empty when there is no output).
    """
    try:
        with output.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - _TAIL_BYTES))
            text = file.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [" ".join(_ANSI.sub("", line).split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    named = list(dict.fromkeys(line for line in lines if _FAILED_TEST.match(line)))
    if not named:
        return _shorten(" | ".join(lines[-3:]), limit, keep_end=True)
    shown: list[str] = []
    used = 0
    for line in named:
        line = _shorten(line, limit // 2)
        if shown and used + len(line) + 2 > limit - len("; and 999 more"):
            break
        shown.append(line)
        used += len(line) + 2
    more = len(named) - len(shown)
    return _shorten("; ".join(shown) + (f"; and {more} more" if more else ""), limit)


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
        outcome = TrialOutcome(verification.reward, verification.reason or None, seconds, dict(verification.rewards))
        error = episode.failure.error if episode.failure is not None else None
        outcome.task_fault = isinstance(error, TaskFault) and bool(error.task_fault)
        # A rollout that fell short in a sandbox still running (graded, its verifier wrote no usable reward,
        # or a view was refused for what it left): say what failed, and where a view graded it, grade it
        # once more in place (the view's output first: grading again replaces the trial folder's).
        if oracle and not _one(verification.reward) and verification.cause in _REGRADED:
            outcome.failures = failures(episode.paths.test_stdout_path)
            outcome.concealed = _solution_changes(verification.concealed)[:CONCEALED_KEPT]
            outcome.in_place = await _in_place(episode)
        return outcome
    except Exception as error:  # noqa: BLE001 - a failed episode is a result, not a crash
        return TrialOutcome(None, f"{type(error).__name__}: {error}".strip(), time.perf_counter() - started)
    finally:
        await episode.stop()


def _solution_changes(concealed: Sequence[str]) -> list[str]:
    """What a view held back (``"path (why)"`` entries) of the rollout's own changes: not Harbor's folders of
    the verifier, which the oracle agent and earlier steps fill (``/solution``, ``/tests``, ``/logs/verifier``)."""
    from harbor.models.trial.paths import EnvironmentPaths

    paths = EnvironmentPaths()
    harbors = tuple(str(p) for p in (paths.solution_dir, paths.tests_dir, paths.verifier_dir))
    kept = (entry for entry in concealed if not entry.startswith(tuple(p + end for p in harbors for end in " /")))
    return list(dict.fromkeys(kept))


async def _in_place(episode: Episode) -> TrialOutcome | None:
    """The graded rollout graded once more in place (``None`` where its backend grades in place anyway)."""
    started = time.perf_counter()
    try:
        verification = await episode.grade_in_place()
    except Exception as error:  # noqa: BLE001 - the view's grade stands; this one says why it is missing
        return TrialOutcome(None, f"{type(error).__name__}: {error}".strip(), time.perf_counter() - started)
    if verification is None:
        return None
    reward = None if verification.infra else verification.reward
    seconds = time.perf_counter() - started
    return TrialOutcome(reward, verification.reason or None, seconds, dict(verification.rewards))


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
    fault = next((outcome for outcome in (oracle, nop) if outcome.task_fault), None)
    if fault is not None:  # the task's environment cannot start: its problem, not a score of either episode
        problem = f"the task's environment did not start: {' '.join((fault.error or '').split())}"
        return CheckResult(info.name, task_dir, oracle, nop, floor, problem=problem)
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
