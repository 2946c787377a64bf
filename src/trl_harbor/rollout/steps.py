"""Multi-step tasks (``[[steps]]``) as Harbor's multi-step trial runs them.

A multi-step task is one rollout: each step is staged (:func:`stage`: its ``workdir/`` files, its
``setup.sh``, its healthcheck), worked on by the agent, and graded like a whole task; a step below
its ``min_reward`` ends the rollout (:func:`meets_min_reward`); before the next step, what the
previous step's verifier left is removed (:func:`advance`). The steps' rewards are combined by the
task's ``multi_step_reward_strategy`` (:func:`combine`): ``final`` takes the last step's, ``mean``
the per-entry mean over the steps that were graded, missing entries counting 0 — Harbor's
``Trial._aggregate_step_rewards`` — except that a step whose verification the rollout broke
counts as 0 (Harbor leaves it out, which would make breaking a hard step's verifier pay).
``HarborOptions.unreached_steps="zero"`` counts the steps a
rollout never reached as 0 instead: under Harbor's mean, a policy that stops after an easy first
step scores more than one that attempts the hard second step.

Harbor keeps these as methods of its trial classes (they need a running trial); this module
follows them and ``tests/test_task_shapes.py`` checks it against them.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trl_harbor.rollout.outcome import Cause, Failure, RewardError, Verification, select_reward

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task

    from trl_harbor.options import HarborOptions
    from trl_harbor.rollout.backends import Backend, VerifierPlacement

__all__ = ["advance", "agent_user", "combine", "meets_min_reward", "stage"]


def agent_user(task: Task, step: StepConfig | None) -> str | int | None:
    """The user the agent's commands run as: the step's ``[agent] user``, else the task's."""
    if step is not None and step.agent.user is not None:
        return step.agent.user
    return task.config.agent.user


async def stage(environment: BaseEnvironment, task: Task, step: StepConfig) -> None:
    """Stage a step as Harbor does: its ``workdir/`` into the working directory, ``setup.sh``, healthcheck.

    Raises:
        RuntimeError: When the step's ``setup.sh`` fails (Harbor then ends the trial).
    """
    with environment.with_default_user(agent_user(task, step)):
        workdir = ((await environment.exec("pwd")).stdout or "/").strip() or "/"
        staged = task.paths.step_workdir_dir(step.name)
        if staged.exists():
            task.paths.validate_input_tree(staged)
            await environment.upload_dir(source_dir=staged, target_dir=workdir)
        if task.paths.step_setup_path(step.name).exists():
            script = f"{workdir.rstrip('/')}/setup.sh"
            result = await environment.exec(f"bash {shlex.quote(script)}")
            if result.return_code != 0:
                detail = (result.stderr or result.stdout or "").strip()[-500:]
                raise RuntimeError(f"step {step.name!r}: setup.sh exited with {result.return_code}: {detail}")
        if step.healthcheck is not None:
            await environment.run_healthcheck(step.healthcheck)


async def advance(
    environment: BaseEnvironment | None,
    task: Task,
    step: StepConfig,
    backend: Backend,
    previous: VerifierPlacement | None,
) -> VerifierPlacement:
    """Move the sandbox to ``step``: the previous verifier's folders emptied, the network set, the step staged.

    Returns:
        The step's verifier placement (with its network plan).
    """
    from harbor.models.trial.paths import EnvironmentPaths

    assert environment is not None
    paths = EnvironmentPaths.for_os(environment.os)
    await environment.empty_dirs([paths.verifier_dir], chmod=True)
    await environment.empty_dirs([paths.tests_dir], chmod=False)
    placement = backend.placement(task, step)
    if previous is None or placement.plan.agent_phase != previous.plan.verifier_phase:
        await environment.set_network_policy(placement.plan.agent_phase)
    await stage(environment, task, step)
    return placement


def meets_min_reward(rewards: dict[str, float], threshold: float | dict[str, float] | None) -> bool:
    """Harbor's ``min_reward`` gate: a number gates ``reward``; a table gates each entry (missing: fails).

    Args:
        rewards: A step's rewards.
        threshold: The step's ``min_reward``.

    Returns:
        Whether the next step may follow.
    """
    if threshold is None:
        return True
    gates = {"reward": threshold} if isinstance(threshold, (int, float)) else threshold
    return all(rewards.get(key, float("-inf")) >= value for key, value in gates.items())


def combine(
    task: Task,
    steps: Sequence[StepConfig],
    outcomes: Sequence[Verification],
    options: HarborOptions,
    failure: Failure | None = None,
    weights: dict[str, float] | None = None,
) -> Verification:
    """One verification of a multi-step rollout from its steps' (see the module docstring).

    Args:
        task: The task (its ``multi_step_reward_strategy``).
        steps: Its steps.
        outcomes: The graded steps' verifications, in order (at least one).
        options: ``unreached_steps`` and ``reward_key``.
        failure: Why the rollout ended early, if it did (kept in the reason).
        weights: The weighting of the verifier's entries (:attr:`GradingPolicy.reward_weights`).

    Returns:
        The rollout's verification (its scalar not yet settled for ``on_infra_error``).
    """
    from harbor.models.task.config import MultiStepRewardStrategy

    lost = next((o for o in outcomes if o.cause is not None and o.cause.infra), None)
    if lost is not None:
        return lost
    names = [step.name for step in steps]
    graded = list(outcomes)  # a step whose verification the rollout broke counts, as 0 (Harbor leaves it out)
    if task.config.multi_step_reward_strategy is MultiStepRewardStrategy.FINAL:  # the last step graded
        reached = len(outcomes) == len(steps)
        combined = dict(outcomes[-1].rewards) if reached or options.unreached_steps == "skip" else {}
    else:
        count = len(steps) if options.unreached_steps == "zero" else len(graded)
        keys = {key for o in graded for key in o.rewards}
        combined = {key: sum(o.rewards.get(key, 0.0) for o in graded) / count for key in keys} if count else {}
    reasons = [f"step {name!r}: {o.reason}" for name, o in zip(names, outcomes, strict=False) if o.reason]
    if len(outcomes) < len(steps):
        counted = "scored 0" if options.unreached_steps == "zero" else "not counted, as in Harbor"
        reasons.append(f"{len(steps) - len(outcomes)} of {len(steps)} steps never reached ({counted})")
    if failure is not None and not any(failure.reason in r for r in reasons):
        reasons.append(failure.reason)
    details = {
        "reason": "; ".join(reasons),
        "concealed": tuple(c for o in outcomes for c in o.concealed),
        "tampered": tuple(c for o in outcomes for c in o.tampered),
        "killed": sum(o.killed for o in outcomes),
        "steps": tuple((name, dict(o.rewards)) for name, o in zip(names, outcomes, strict=False)),
        "cause": next((o.cause for o in outcomes if o.cause is not None), None),
    }
    if not combined:
        return Verification(0.0, **details)
    try:
        reward = select_reward(combined, options.reward_key, weights)
    except RewardError as exc:
        details.update(cause=Cause.CONFIGURATION, reason=str(exc))
        return Verification(None, rewards=combined, error=exc, **details)
    return Verification(reward, rewards=combined, **details)
