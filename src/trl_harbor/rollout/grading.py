"""Grading one rollout (or one step of it): Harbor's verifier, where the agent cannot reach it.

:func:`grade` is a function of explicit inputs — the agent's sandbox, a :class:`Context` (task,
step, network plan, trial folder, backend, options) and the :class:`~trl_harbor.rollout.seal.Baseline`
taken before the agent — and returns a :class:`~trl_harbor.rollout.outcome.Verification`.

* **Shared verification** (Harbor's default): on a backend that offers an isolated view of the
  sandbox (``verifier_view``, the local sandbox), Harbor's ``Verifier`` runs in it: a sibling of
  the agent's namespaces that sees the agent's files and services but runs the image's own code,
  and that the agent's processes — still running, as under Harbor — cannot see, signal or
  change. Elsewhere it runs in the agent's sandbox, after the baseline's process policy and
  tamper check (:mod:`trl_harbor.rollout.seal`).
* **Separate verification** (``[verifier] environment_mode = "separate"``): the agent's processes
  are stopped, the declared artifacts (Harbor's list of them) copied as files into a fresh verifier
  sandbox, and the verifier runs there. The copy is grading's own: Harbor's ``ArtifactHandler``
  treats a failed download as best effort, where grading tells a refused one from a lost backend.
* **In place, whatever the backend offers** (:func:`grade_in_place`, for ``trl-harbor check`` only):
  a rollout already graded in the view graded once more in the agent's sandbox itself, unsealed, as
  Harbor's trial grades it: whether the view, not the solution, fails a reference solution.
* **The verifier** is Harbor's, made by Harbor's ``VerifierFactory`` as Harbor's trial makes it
  (the trial's default verifier settings), wherever it runs.
* **Failures** are classified by where the fault is, asked of the backend, not of a shell the agent
  could break. The verifier ran and wrote no usable reward in a sandbox the backend still runs: the
  rollout broke its own verification (0). The sandbox stopped answering: an infrastructure failure,
  unless the agent exhausted its limits (0). What the rollout left that the backend refuses to
  handle is the rollout's doing, whatever the error: a verifier view refused for content it could
  not judge (the backend's error meets :class:`~trl_harbor.rollout.contract.RefusedView`: 0,
  ``tampered``), an artifact it would not copy (:class:`~trl_harbor.rollout.contract.RefusedDownload`:
  0, ``verifier``). Backends mark those errors; grading never guesses them from an exception's type.
  Anything else that goes wrong in grading itself — an unexpected exception in this package's code
  or in how it calls Harbor's, a view or a copy that fails unmarked — is never the policy's: it is
  an infrastructure failure, logged at WARNING with its traceback and counted by the batch guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import tempfile
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import runtime
from trl_harbor.rollout.contract import (
    ExhaustionReport,
    IsolatedVerification,
    Liveness,
    RefusedDownload,
    RefusedView,
    VerifierView,
    isolating,
)
from trl_harbor.rollout.outcome import Cause, RewardError, Verification, select_reward
from trl_harbor.rollout.seal import Baseline

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

    from trl_harbor.options import HarborOptions
    from trl_harbor.rollout.backends import Backend, VerifierPlacement
    from trl_harbor.rollout.policy import GradingPolicy

__all__ = ["Context", "alive", "exhaustion", "failed", "grade", "grade_in_place", "settle"]

logger = logging.getLogger(__name__)

#: Seconds a health probe may take before the sandbox counts as gone (backends without ``alive()``).
PROBE_TIMEOUT_SEC = 30


@dataclass(frozen=True)
class Context:
    """What grading a rollout needs besides its sandbox.

    Attributes:
        task: Harbor's task.
        step: The step being graded (``None`` for a single-step task).
        placement: Where the step's verifier runs, as whom, and its network plan.
        policy: The allowed changes and reward weights (the options' and the task's ``[metadata]``).
        paths: The trial folder.
        backend: Where a separate verifier sandbox starts.
        options: The reward reduction, the process policy.
    """

    task: Task
    step: StepConfig | None
    placement: VerifierPlacement
    policy: GradingPolicy
    paths: TrialPaths
    backend: Backend
    options: HarborOptions


class _BackendFault(RuntimeError):
    """A failure of the backend by construction (a verifier sandbox that did not start, a view that did not open)."""


#: Programming errors: raised by this package's grading code, or by how it calls Harbor's (a changed
#: keyword is a ``TypeError``), never by anything a rollout leaves in its sandbox — which shows as
#: Harbor's reward-file errors, a failed command, a timeout, a sandbox error.
_GRADING_BUGS = (
    TypeError, AttributeError, NameError, LookupError, AssertionError, ImportError, NotImplementedError, SyntaxError,
)  # fmt: skip


def _policys(exc: BaseException) -> bool:
    """Whether a failure of the verifier's run is one a rollout can cause (else it is grading's own)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # Harbor wraps what failed on the way
        if isinstance(exc, _GRADING_BUGS):
            return False
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return True


def _grading_fault(context: Context, what: str, exc: BaseException) -> Verification:
    """An unexpected failure of grading itself: infrastructure, at WARNING with its traceback."""
    reason = f"{what} failed unexpectedly ({type(exc).__name__}: {exc}); an error in grading, not the rollout's"
    logger.warning("trl-harbor: task %s: %s", context.task.name, reason, exc_info=exc)
    return failed(Cause.INFRASTRUCTURE, reason, error=exc)


def failed(cause: Cause, reason: str, **details: Any) -> Verification:
    """A verification that did not grade normally (reward 0 until :func:`settle` applies the infra policy)."""
    return Verification(0.0, cause=cause, reason=reason, **details)


def settle(verification: Verification, options: HarborOptions) -> Verification:
    """Apply ``on_infra_error`` to a rollout lost to the infrastructure: ``None``, ``0.0``, or raise.

    Raises:
        RuntimeError: For a lost rollout under ``on_infra_error="raise"``.
    """
    if not verification.infra:
        return verification
    if options.on_infra_error == "raise":
        raise verification.error or RuntimeError(verification.reason)
    return replace(verification, reward=None if options.on_infra_error == "skip" else 0.0)


async def alive(environment: BaseEnvironment | None) -> bool:
    """Whether the backend still runs a sandbox.

    A backend that can tell without running the sandbox's programs meets
    :class:`~trl_harbor.rollout.contract.Liveness` (the local sandbox asks its supervisor);
    elsewhere ``true`` must run as root.
    """
    if environment is None:
        return False
    try:
        if isinstance(environment, Liveness):
            return bool(await asyncio.wait_for(environment.alive(), PROBE_TIMEOUT_SEC))
        result = await asyncio.wait_for(
            environment.exec("true", user="root", timeout_sec=PROBE_TIMEOUT_SEC), PROBE_TIMEOUT_SEC + 5
        )
    except Exception:  # noqa: BLE001 - any failure to answer is the answer
        return False
    return result.return_code == 0


async def exhaustion(environment: BaseEnvironment | None) -> str | None:
    """Which of its limits the agent ran the sandbox into, where the backend can tell (:class:`ExhaustionReport`)."""
    if not isinstance(environment, ExhaustionReport):
        return None
    try:
        return await environment.resource_exhaustion()
    except Exception:  # noqa: BLE001 - no answer is no evidence
        return None


async def grade(environment: BaseEnvironment, context: Context, baseline: Baseline) -> Verification:
    """Grade a single-step task, or one step, in ``environment`` (see the module docstring).

    Returns:
        The verification: a multi-step task's step has its rewards but no scalar yet.
    """
    try:
        if context.placement.separate:
            return await _grade_separately(environment, context, baseline)
        if isolating(environment):
            return await _grade_isolated(environment, context)
        return await _grade_in_place(environment, context, baseline)
    except _BackendFault as fault:
        return await _lost(environment, str(fault))


async def _lost(environment: BaseEnvironment, reason: str) -> Verification:
    """A sandbox that stopped answering: exhausted by the rollout (0), else lost to the infrastructure."""
    found = await exhaustion(environment)
    if found:
        return failed(Cause.EXHAUSTED, f"the rollout exhausted its sandbox ({found}), which stopped answering")
    return failed(Cause.INFRASTRUCTURE, reason)


async def _grade_isolated(environment: IsolatedVerification, context: Context) -> Verification:
    try:
        # The view has a network of its own, the verifier's; the agent's processes keep the agent's.
        view = environment.verifier_view(
            allowed_changes=context.policy.allowed_changes, network_policy=context.placement.plan.verifier_phase
        )
        opened = await view.__aenter__()
    except Exception as exc:
        if not await alive(environment) or await exhaustion(environment):
            raise _BackendFault(f"opening the verifier's view failed: {type(exc).__name__}: {exc}") from exc
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return failed(
                Cause.VERIFIER,
                f"the rollout filled its sandbox's storage; the verifier's view could not be made ({exc})",
            )
        if _refused_view(exc):
            reason = f"the verifier's view was refused for what the rollout left ({exc}); scored 0 without verifying"
            logger.info("trl-harbor: task %s: %s", context.task.name, reason)
            return failed(Cause.TAMPERED, reason)
        return _grading_fault(context, "opening the verifier's view", exc)
    concealed = tuple(opened.concealed) if isinstance(opened, VerifierView) else ()
    try:
        try:
            with opened.with_default_user(context.placement.user):
                rewards = await _run_verifier(opened, context)
        except Exception as exc:
            return await _verifier_failed(exc, opened, context, concealed=concealed)
        return _scored(rewards, context, concealed=concealed)
    finally:
        await view.__aexit__(None, None, None)


async def _grade_in_place(environment: BaseEnvironment, context: Context, baseline: Baseline) -> Verification:
    try:
        report = await baseline.apply(
            environment, context.options.agent_processes == "kill", context.policy.allowed_changes
        )
    except Exception as exc:
        raise _BackendFault(f"sealing the sandbox failed: {type(exc).__name__}: {exc}") from exc
    if report.tampered:
        shown = ", ".join(str(c) for c in report.tampered[:5]) + (
            f" and {len(report.tampered) - 5} more" if len(report.tampered) > 5 else ""
        )
        reason = (
            f"the rollout changed what the verifier runs ({shown}); scored 0 without verifying. "
            "If the task legitimately changes these, declare them in task.toml [metadata] allowed_changes."
        )
        logger.info("trl-harbor: task %s: %s", context.task.name, reason)
        return failed(Cause.TAMPERED, reason, tampered=tuple(str(c) for c in report.tampered), killed=report.killed)
    return await _verify_in_place(environment, context, killed=report.killed)


async def _verify_in_place(environment: BaseEnvironment, context: Context, **details: Any) -> Verification:
    """Run the verifier in the agent's sandbox itself, on the verifier phase's network."""
    from harbor.models.trial.paths import EnvironmentPaths

    plan = context.placement.plan
    try:
        with environment.with_default_user(context.placement.user):
            await environment.empty_dirs([EnvironmentPaths.for_os(environment.os).verifier_dir], chmod=True)
            if plan.verifier_phase != plan.agent_phase:
                await environment.set_network_policy(plan.verifier_phase)
            rewards = await _run_verifier(environment, context)
    except Exception as exc:
        return await _verifier_failed(exc, environment, context, **details)
    return _scored(rewards, context, **details)


async def grade_in_place(environment: BaseEnvironment, context: Context) -> Verification:
    """Grade in the agent's sandbox itself, as Harbor's shared trial does, whatever view the backend offers.

    A diagnostic, never a training grade: ``trl-harbor check`` grades an oracle's rollout that scored
    below 1 in the isolated view (:class:`~trl_harbor.rollout.contract.IsolatedVerification`) once more
    this way, to tell a task that the view fails from a wrong solution
    (:meth:`~trl_harbor.rollout.episode.Episode.grade_in_place`). Nothing is sealed: the agent's
    processes keep running, as under Harbor, and its changes to what the verifier runs are not refused
    (the rollout is a reference solution's, graded as Harbor would grade it). The sandbox keeps the
    verifier phase's network afterwards.

    Args:
        environment: The agent's sandbox, already graded (:func:`grade`).
        context: As for :func:`grade`; its placement must share the agent's sandbox.

    Returns:
        The verification, its failures classified as :func:`grade`'s.

    Raises:
        ValueError: For a verifier that runs in a sandbox of its own (``environment_mode = "separate"``).
    """
    if context.placement.separate:
        raise ValueError("a separate verifier does not run in the agent's sandbox: there is no grading in place")
    return await _verify_in_place(environment, context)


async def _grade_separately(environment: BaseEnvironment, context: Context, baseline: Baseline) -> Verification:
    """Verify in a fresh sandbox from the task's (or step's) verifier environment, the artifacts copied in."""
    from harbor.models.task.verifier_mode import resolve_verifier_environment_definition
    from harbor.models.trial.paths import EnvironmentPaths

    task, step, plan, user = context.task, context.step, context.placement.plan, context.placement.user
    try:
        killed = await _stop_agent(environment, baseline)
    except Exception as exc:
        raise _BackendFault(f"stopping the agent's processes failed: {type(exc).__name__}: {exc}") from exc
    definition = resolve_verifier_environment_definition(task.config, task.paths, step)
    if definition is None or plan.verifier_env_baseline is None:
        raise _BackendFault("separate verifier mode did not resolve a verifier environment")
    verifier = context.backend.create(
        task,
        context.paths,
        session_id=f"{task.short_name}__{uuid.uuid4().hex[:8]}__verifier",
        environment_dir=definition.directory,
        task_env_config=definition.config,
        network_policy=plan.verifier_env_baseline,
        phase_network_policies=[plan.verifier_phase],
        enable_environment_dir_upload=not definition.bundled_tests,
    )
    handle = runtime.register_cleanup(lambda: verifier.stop(delete=True))
    try:
        try:
            await verifier.start(force_build=False)
            with verifier.with_default_user(user):
                await verifier.empty_dirs([EnvironmentPaths.for_os(verifier.os).verifier_dir], chmod=True)
        except Exception as exc:
            raise _BackendFault(f"preparing the verifier sandbox failed: {type(exc).__name__}: {exc}") from exc
        unsafe = await _copy_artifacts(environment, verifier, context)
        if unsafe:
            return failed(Cause.VERIFIER, f"an artifact the rollout left cannot be copied safely: {unsafe}; scored 0")
        try:
            if plan.verifier_phase != plan.verifier_env_baseline:
                await verifier.set_network_policy(plan.verifier_phase)
            with verifier.with_default_user(user):
                rewards = await _run_verifier(verifier, context, bundled=definition.bundled_tests)
        except Exception as exc:
            return await _verifier_failed(exc, verifier, context, killed=killed)
        return _scored(rewards, context, killed=killed)
    finally:
        runtime.unregister_cleanup(handle)
        with contextlib.suppress(Exception):
            await verifier.stop(delete=True)


async def _stop_agent(environment: BaseEnvironment, baseline: Baseline) -> int:
    """Stop every process of the agent's sandbox but the backend's own, as Harbor stops the agent's container."""
    if isolating(environment):  # the local sandbox: every process of its PID namespace but its supervisor
        return int(await environment.kill_processes(()))
    return await baseline.kill(environment)


async def _run_verifier(environment: BaseEnvironment, context: Context, *, bundled: bool = False) -> dict[str, float]:
    from harbor.models.trial.config import VerifierConfig
    from harbor.verifier.factory import VerifierFactory

    step = context.step
    timeout = context.task.config.verifier.timeout_sec
    env = None
    if step is not None:
        timeout = step.verifier.timeout_sec if step.verifier.timeout_sec is not None else timeout
        env = step.verifier.env or None
    # Harbor's factory with a trial's default verifier settings: its own Verifier, every log kept.
    verifier = VerifierFactory.create_verifier_from_config(
        VerifierConfig(),
        task=context.task,
        trial_paths=context.paths,
        environment=environment,
        verifier_env=env,
        step_name=None if step is None else step.name,
        skip_tests_upload=bundled,
    )
    try:
        result = await asyncio.wait_for(verifier.verify(), timeout=timeout)
    except TimeoutError:
        raise TimeoutError(f"the verifier ran past its timeout ({timeout:g} s)") from None
    return {key: float(value) for key, value in (result.rewards or {}).items()}


def _scored(rewards: dict[str, float], context: Context, **details: Any) -> Verification:
    if context.step is not None:  # a step's scalar is decided when the steps are combined
        return Verification(None, rewards=rewards, **details)
    try:
        reward = select_reward(rewards, context.options.reward_key, context.policy.reward_weights)
    except RewardError as exc:  # the task's or the user's configuration, never the policy's
        return Verification(None, rewards=rewards, cause=Cause.CONFIGURATION, reason=str(exc), error=exc, **details)
    return Verification(reward, rewards=rewards, **details)


async def _verifier_failed(
    exc: BaseException, environment: BaseEnvironment, context: Context, **details: Any
) -> Verification:
    """Score 0 when the verifier ran and left no usable reward in a sandbox the backend still runs (the
    rollout broke its verification); infrastructure when the backend stopped answering, or when the
    failure is grading's own (see the module docstring)."""
    cause = f"{type(exc).__name__}: {exc}"
    if not await alive(environment):
        return await _lost(environment, cause)
    if not _policys(exc):
        return _grading_fault(context, "running the verifier", exc)
    reason = f"verification failed in a healthy sandbox ({cause}); scored 0"
    logger.info("trl-harbor: task %s: %s", context.task.name, reason)
    return failed(Cause.VERIFIER, reason, **details)


async def _copy_artifacts(source: BaseEnvironment, target: BaseEnvironment, context: Context) -> str | None:
    """Copy the declared artifacts (and ``/logs/artifacts``) into the verifier sandbox, as files.

    Returns:
        ``None``, or what made an artifact unsafe to copy — a link, a tree past the backend's bounds
        (bytes, entries, depth, a path's length), an entry the backend could not copy — as the
        backend marks it (:func:`_unsafe`): the rollout's doing, scored 0 with cause ``verifier``
        as every artifact the verifier cannot have.

    Raises:
        _BackendFault: When the copy fails for another reason (unmarked: the backend's, the host's).
    """
    from harbor.models.task.artifacts import with_convention_entry
    from harbor.models.trial.paths import EnvironmentPaths

    # Which paths: Harbor's list (``/logs/artifacts`` first unless declared, then the task's and the
    # step's). Not Harbor's copy (``ArtifactHandler``): it swallows a failed download, which grading
    # must classify (refused: the rollout's; else the backend's).
    step = context.step
    declared = [*context.task.config.artifacts, *(step.artifacts if step is not None else [])]
    convention = EnvironmentPaths.for_os(source.os).artifacts_dir.as_posix()
    try:
        paths = [artifact.source for artifact in with_convention_entry(declared, convention_source=convention)]
    except ValueError as exc:  # a source Harbor refuses (``..``): the task's, never the rollout's
        raise _BackendFault(f"the task's artifacts are not valid for Harbor: {exc}") from exc
    staging = Path(tempfile.mkdtemp(prefix="artifacts_", dir=context.paths.trial_dir))
    for index, path in enumerate(paths):
        local = staging / str(index)
        try:
            if await source.is_dir(path, user="root"):
                await source.download_dir(path, local)
                upload = target.upload_dir
            elif (await source.exec(f"test -f '{path}'", user="root")).return_code == 0:
                await source.download_file(path, local)
                upload = target.upload_file
            else:
                continue
        except Exception as exc:
            if _unsafe(exc):
                return f"{path}: {exc}"
            raise _BackendFault(f"copying the artifact {path} failed: {type(exc).__name__}: {exc}") from exc
        try:
            parent = path.rstrip("/").rsplit("/", 1)[0] or "/"
            await target.exec(f"mkdir -p '{parent}'", user="root")
            await upload(local, path)
        except Exception as exc:
            raise _BackendFault(f"copying the artifact {path} failed: {type(exc).__name__}: {exc}") from exc
    return None


def _unsafe(error: BaseException) -> bool:
    """Whether a download was refused for what the rollout left (a link, a tree past the bounds, an entry
    that could not be copied).

    Backends mark such errors (:class:`~trl_harbor.rollout.contract.RefusedDownload`); grading
    does not import a backend.
    """
    return isinstance(error, RefusedDownload) and bool(error.unsafe)


def _refused_view(error: BaseException) -> bool:
    """Whether a verifier view was refused for what the rollout left in its sandbox (content the backend
    could not judge): the error, or one it was raised from, is marked by the backend
    (:class:`~trl_harbor.rollout.contract.RefusedView`). An unmarked error — of the backend's own, of a
    programming error — is never the rollout's."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, RefusedView) and bool(current.tampered):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False
