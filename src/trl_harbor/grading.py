"""Grading a rollout: Harbor's verifier, behind a seal, with every failure classified.

:func:`grade_step` grades a single-step task, or one step of a multi-step task:

1. **Seal** the sandbox (:mod:`trl_harbor.sealing`): the agent's processes are killed, and a
   change that replaces or shadows what the verifier runs scores 0 without running it.
2. **Verify** with Harbor's own ``Verifier`` (in the agent's sandbox, or in a fresh verifier
   sandbox with the declared artifacts copied across).
3. **Classify** a failure: if the sandbox still answers, the rollout broke its own
   verification (no reward file, a malformed one, a timeout) and scores 0; only a sandbox
   that no longer answers — a backend fault — is an infrastructure failure, skipped or scored
   as ``on_infra_error`` says.

:func:`combine_steps` makes one :class:`Verification` of a multi-step task's steps.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import runtime
from trl_harbor.sealing import SealReport

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig

    from trl_harbor.episode import Episode

__all__ = [
    "INFRA_MODES",
    "RewardError",
    "Verification",
    "combine_steps",
    "grade_step",
    "infra_failures",
    "meets_min_reward",
    "select_reward",
    "verification_failures",
]

logger = logging.getLogger(__name__)

#: What an infrastructure failure makes of a reward (see ``HarborEnv(on_infra_error=...)``).
INFRA_MODES = ("skip", "zero", "raise")
#: Infrastructure failures of this process, by stage (``start``, ``exec``, ``verify``).
INFRA_FAILURES: collections.Counter[str] = collections.Counter()
#: Rollouts scored 0 because their verification failed in a healthy sandbox, by cause.
AGENT_FAILURES: collections.Counter[str] = collections.Counter()


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
    return {stage: INFRA_FAILURES[stage] for stage in ("start", "exec", "verify")}


def verification_failures() -> dict[str, int]:
    """Count this process's rollouts scored 0 because the rollout broke its own verification.

    Returns:
        ``{"tampered": n, "failed": n}``: rollouts that changed what the verifier runs, and
        rollouts whose verifier wrote no usable reward or timed out in a healthy sandbox.
    """
    return {cause: AGENT_FAILURES[cause] for cause in ("tampered", "failed")}


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


class _BackendFault(RuntimeError):
    """A failure that is the backend's by construction (e.g. a verifier sandbox that did not start)."""


def combine_steps(episode: Episode) -> Verification:
    """One verification from the steps', by ``multi_step_reward_strategy`` (unreached steps: 0)."""
    from harbor.models.task.config import MultiStepRewardStrategy

    outcomes = episode.step_outcomes
    infra = next((o for o in outcomes if o.infra), None)
    if infra is not None:
        return infra
    names = [step.name for step in episode.steps]
    per_step = tuple((name, dict(o.rewards)) for name, o in zip(names, outcomes, strict=False))
    if episode.task.config.multi_step_reward_strategy is MultiStepRewardStrategy.FINAL:
        reached = len(outcomes) == len(episode.steps)
        combined = dict(outcomes[-1].rewards) if reached and outcomes else {}
    else:
        keys = {key for o in outcomes for key in o.rewards}
        combined = {key: sum(o.rewards.get(key, 0.0) for o in outcomes) / len(episode.steps) for key in keys}
    reasons = [f"step {name!r}: {o.reason}" for name, o in zip(names, outcomes, strict=False) if o.reason]
    if len(outcomes) < len(episode.steps):
        reasons.append(f"{len(episode.steps) - len(outcomes)} of {len(episode.steps)} steps never reached (scored 0)")
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
        reward = select_reward(combined, episode.reward_key, episode.reward_weights)
    except RewardError as exc:
        return _infra(episode, episode.fail("verify", exc), exc)
    return Verification(reward, rewards=combined, **details)


async def grade_step(episode: Episode, step: StepConfig | None) -> Verification:
    """Seal the sandbox and verify the task (or one step of it), classifying any failure."""
    from harbor.models.task.verifier_mode import VerifierEnvironmentMode, resolve_step_verifier_mode

    if episode.exhausted is not None:  # the rollout broke its own sandbox: its fault, not the backend's
        return _exhausted(episode)
    if episode.infra_error is None and episode.environment is None:
        episode.fail("verify", "the sandbox is gone (it was stopped before verification)")
    if episode.infra_error is not None:
        return _infra(episode, episode.infra_error)
    if step is None:
        separate = episode.plan is not None and episode.plan.verifier_env_baseline is not None
    else:
        separate = resolve_step_verifier_mode(episode.task.config, step) == VerifierEnvironmentMode.SEPARATE
    try:
        if separate:
            return await _grade_separately(episode, step)
        return await _grade_in_place(episode, step)
    except _BackendFault as fault:
        if await episode.check_exhausted(episode.environment):
            return _exhausted(episode)
        return _infra(episode, episode.fail("verify", str(fault)))


def _exhausted(episode: Episode) -> Verification:
    AGENT_FAILURES["failed"] += 1
    return Verification(0.0, reason=f"{episode.exhausted}; scored 0")


def _infra(episode: Episode, reason: str, error: BaseException | None = None) -> Verification:
    if episode.on_infra_error == "raise":
        raise error if error is not None else RuntimeError(reason)
    return Verification(None if episode.on_infra_error == "skip" else 0.0, reason=reason, infra=True)


async def _seal(episode: Episode, environment: BaseEnvironment) -> SealReport:
    """Stop every process the agent left and find its tampering, so nothing of it runs beside the verifier."""
    episode.sealed = True
    try:
        return await episode.seal.apply(environment, episode.allowed_changes)
    except Exception as exc:
        raise _BackendFault(f"sealing the sandbox failed: {type(exc).__name__}: {exc}") from exc


def _verifier_user(episode: Episode, step: StepConfig | None) -> str | int | None:
    if step is not None and step.verifier.user is not None:
        return step.verifier.user
    return episode.task.config.verifier.user


async def _grade_in_place(episode: Episode, step: StepConfig | None) -> Verification:
    from harbor.models.trial.paths import EnvironmentPaths

    environment = episode.environment
    plan = episode.plan
    assert environment is not None and plan is not None
    report = await _seal(episode, environment)
    killed, tampered = report.killed, report.tampered
    listed = tuple(str(c) for c in report.changes)
    if tampered:
        AGENT_FAILURES["tampered"] += 1
        shown = ", ".join(str(c) for c in tampered[:5])
        if len(tampered) > 5:
            shown += f" and {len(tampered) - 5} more"
        reason = (
            f"the rollout changed what the verifier runs ({shown}); scored 0 without verifying. "
            "If the task legitimately changes these, declare them in task.toml [metadata] allowed_changes."
        )
        logger.info("trl-harbor: task %s: %s", episode.task.name, reason)
        tampered_paths = tuple(str(c) for c in tampered)
        return Verification(0.0, reason=reason, tampered=tampered_paths, changes=listed, killed=killed)
    try:
        with environment.with_default_user(_verifier_user(episode, step)):
            await environment.empty_dirs([EnvironmentPaths.for_os(environment.os).verifier_dir], chmod=True)
            if plan.verifier_phase != plan.agent_phase:
                await environment.set_network_policy(plan.verifier_phase)
            rewards = await _run_verifier(episode, environment, step)
    except Exception as exc:
        return await _verifier_failed(episode, exc, environment, changes=listed, killed=killed)
    return _scored(episode, rewards, changes=listed, killed=killed)


async def _grade_separately(episode: Episode, step: StepConfig | None) -> Verification:
    """Verify in a fresh sandbox built from the task's (or step's) verifier environment.

    The agent sandbox's declared ``artifacts`` (and Harbor's ``/logs/artifacts`` folder) are
    copied into the verifier sandbox at the same paths (as files, never executed on the
    host) before the tests run.
    """
    from harbor.models.task.verifier_mode import resolve_verifier_environment_definition
    from harbor.models.trial.paths import EnvironmentPaths

    task, source, plan = episode.task, episode.environment, episode.plan
    assert episode.paths is not None and source is not None and plan is not None
    killed = (await _seal(episode, source)).killed
    definition = resolve_verifier_environment_definition(task.config, task.paths, step)
    if definition is None or plan.verifier_env_baseline is None:
        raise _BackendFault("separate verifier mode did not resolve a verifier environment")
    baseline, phase = plan.verifier_env_baseline, plan.verifier_phase
    verifier_env = episode.create_environment(
        task,
        episode.paths,
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
            with verifier_env.with_default_user(_verifier_user(episode, step)):
                await verifier_env.empty_dirs([EnvironmentPaths.for_os(verifier_env.os).verifier_dir], chmod=True)
            await _copy_artifacts(episode, source, verifier_env, step)
            if phase != baseline:
                await verifier_env.set_network_policy(phase)
        except Exception as exc:
            raise _BackendFault(f"preparing the verifier sandbox failed: {type(exc).__name__}: {exc}") from exc
        try:
            with verifier_env.with_default_user(_verifier_user(episode, step)):
                rewards = await _run_verifier(episode, verifier_env, step, bundled=definition.bundled_tests)
        except Exception as exc:
            return await _verifier_failed(episode, exc, verifier_env, killed=killed)
        return _scored(episode, rewards, killed=killed)
    finally:
        runtime.unregister_cleanup(handle)
        await verifier_env.stop(delete=True)


async def _run_verifier(
    episode, environment: BaseEnvironment, step: StepConfig | None, *, bundled: bool = False
) -> dict[str, float | int]:
    from harbor.verifier.verifier import Verifier

    assert episode.paths is not None
    timeout = episode.task.config.verifier.timeout_sec
    env = None
    if step is not None:
        timeout = step.verifier.timeout_sec if step.verifier.timeout_sec is not None else timeout
        env = step.verifier.env or None
    verifier = Verifier(
        task=episode.task,
        trial_paths=episode.paths,
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


def _scored(episode: Episode, rewards: dict[str, float | int], **details: Any) -> Verification:
    if episode.steps:  # a step's scalar is decided when the steps are combined
        return Verification(None, rewards={k: float(v) for k, v in rewards.items()}, **details)
    try:
        reward = select_reward(rewards, episode.reward_key, episode.reward_weights)
    except RewardError as exc:  # the task's or the user's configuration, never the policy's
        return _infra(episode, episode.fail("verify", exc), exc)
    return Verification(reward, rewards={k: float(v) for k, v in rewards.items()}, **details)


async def _verifier_failed(
    episode: Episode, exc: BaseException, environment: BaseEnvironment, **details: Any
) -> Verification:
    """Score 0 when the sandbox is healthy (the rollout broke its verification), else an infra failure."""
    cause = f"{type(exc).__name__}: {exc}"
    if not await episode.healthy(environment):
        if environment is episode.environment and await episode.check_exhausted(environment):
            return _exhausted(episode)
        return _infra(episode, episode.fail("verify", cause))
    AGENT_FAILURES["failed"] += 1
    reason = f"verification failed in a healthy sandbox ({cause}); scored 0"
    logger.info("trl-harbor: task %s: %s", episode.task.name, reason)
    return Verification(0.0, reason=reason, **details)


async def _copy_artifacts(
    episode: Episode, source: BaseEnvironment, target: BaseEnvironment, step: StepConfig | None
) -> None:
    from harbor.models.trial.paths import EnvironmentPaths

    assert episode.paths is not None
    paths = [str(EnvironmentPaths.for_os(source.os).artifacts_dir)]
    declared = [*episode.task.config.artifacts, *(step.artifacts if step is not None else [])]
    for artifact in declared:
        paths.append(artifact if isinstance(artifact, str) else artifact.source)
    staging = Path(tempfile.mkdtemp(prefix="artifacts_", dir=episode.paths.trial_dir))
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


def meets_min_reward(rewards: dict[str, float], threshold: float | dict[str, float] | None) -> bool:
    """Harbor's ``min_reward`` gate: a float gates ``reward``; a dict each key (missing: fails).

    Args:
        rewards: A step's rewards.
        threshold: The step's ``min_reward``.

    Returns:
        Whether the step may be followed by the next one.
    """
    if threshold is None:
        return True
    gates = {"reward": threshold} if isinstance(threshold, (int, float)) else threshold
    return all(rewards.get(key, float("-inf")) >= value for key, value in gates.items())
