"""Multi-step tasks (``[[steps]]``) as Harbor's multi-step trial runs them.

A multi-step task is one rollout: each step is staged (:func:`stage`: its ``workdir/`` files, its
``setup.sh``, its healthcheck), worked on by the agent, and graded like a whole task; a step below
its ``min_reward`` ends the rollout (:func:`meets_min_reward`, Harbor's
``MultiStepTrial._min_reward_failure``); before the next step, what the previous step's verifier
left is removed (:func:`advance`).

The steps' rewards are combined (:func:`combine`) by Harbor's own ``Trial._select_multi_step_reward``
and ``Trial._aggregate_step_rewards``, called on a stand-in that holds only the task and the steps'
results: ``final`` takes the last step's, ``mean`` the per-entry mean over the steps with a verifier
result, missing entries counting 0. trl-harbor differs in three ways, each a change of what Harbor's
functions are given or of what is done with their result, never a rule of its own:

* a step whose verification the rollout broke counts as 0: it is given to Harbor with empty
  rewards, where Harbor's trial has no result for it and leaves it out (which would make breaking
  a hard step's verifier pay);
* ``HarborOptions.unreached_steps="zero"`` gives Harbor an empty result for every step the rollout
  never reached: under Harbor's mean, a policy that stops after an easy first step scores more than
  one that attempts the hard second step;
* a step lost to the infrastructure makes its verification the rollout's (the loss is attributed
  and settled by ``on_infra_error``, not scored).

``tests/test_harbor_semantics.py`` runs Harbor's functions and these on generated inputs and fails on
any difference but these three.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from trl_harbor.rollout.outcome import Cause, Failure, RewardError, Verification, select_reward

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task
    from harbor.models.trial.result import StepResult

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
    """Harbor's ``min_reward`` gate (``MultiStepTrial._min_reward_failure``): whether the next step may follow.

    A number gates ``reward``, a table each of its entries; a missing entry fails. No threshold passes,
    as Harbor passes a step without ``min_reward``.

    Args:
        rewards: A step's rewards.
        threshold: The step's ``min_reward``.

    Returns:
        Whether the next step may follow.
    """
    if threshold is None:
        return True
    from harbor.trial.multi_step import MultiStepTrial

    return MultiStepTrial._min_reward_failure(rewards, threshold) is None


@functools.cache
def _harbor_trial_rewards() -> type:
    """A stand-in for Harbor's trial holding just what its two reward methods read: ``task`` and ``result``.

    The methods are Harbor's own, taken from ``Trial`` as they are; no trial (sandbox, agent, folders)
    is built to call them.
    """
    from harbor.trial.trial import Trial

    class TrialRewards:
        _select_multi_step_reward = Trial._select_multi_step_reward
        _aggregate_step_rewards = Trial._aggregate_step_rewards

        def __init__(self, task: object, step_results: list[object]) -> None:
            self.task = task
            self.result = SimpleNamespace(step_results=step_results)

    return TrialRewards


def _harbor_rewards(task: Task, step_results: Sequence[StepResult]) -> dict[str, float]:
    """The rewards Harbor's multi-step trial settles on for ``step_results`` (``_select_multi_step_reward``).

    Args:
        task: The task (its ``multi_step_reward_strategy``).
        step_results: Harbor's step results, in order, one per step reached.

    Returns:
        The combined rewards; ``{}`` where Harbor has no verifier result (scored 0).
    """
    result = _harbor_trial_rewards()(task, list(step_results))._select_multi_step_reward()
    return dict(result.rewards or {}) if result is not None else {}


def _as_harbor(steps: Sequence[StepConfig], outcomes: Sequence[Verification], unreached: str) -> list[StepResult]:
    """The steps' results as Harbor's trial would hold them, with trl-harbor's two differences made inputs.

    A step whose verification the rollout broke has an empty verifier result (Harbor's trial has none,
    and leaves it out of the mean; here it counts, as 0). Under ``unreached_steps="zero"`` every step
    never reached has one too (Harbor has no result for it), so the mean divides by every step and
    ``final`` takes the last step's, 0 when it was never reached.
    """
    from harbor.models.trial.result import StepResult
    from harbor.models.verifier.result import VerifierResult

    rewards = [{} if outcome.cause is not None else dict(outcome.rewards) for outcome in outcomes]
    if unreached == "zero":
        rewards += [{}] * (len(steps) - len(outcomes))
    return [
        StepResult(step_name=step.name, verifier_result=VerifierResult(rewards=entries))
        for step, entries in zip(steps, rewards, strict=False)
    ]


def _details(
    steps: Sequence[StepConfig], outcomes: Sequence[Verification], unreached: str, failure: Failure | None
) -> dict[str, Any]:
    """What the rollout's verification keeps of its steps: reasons, rewards per step, changes, the first cause."""
    names = [step.name for step in steps]
    reasons = [f"step {name!r}: {o.reason}" for name, o in zip(names, outcomes, strict=False) if o.reason]
    if len(outcomes) < len(steps):
        counted = "scored 0" if unreached == "zero" else "not counted, as in Harbor"
        reasons.append(f"{len(steps) - len(outcomes)} of {len(steps)} steps never reached ({counted})")
    if failure is not None and not any(failure.reason in r for r in reasons):
        reasons.append(failure.reason)
    return {
        "reason": "; ".join(reasons),
        "concealed": tuple(c for o in outcomes for c in o.concealed),
        "tampered": tuple(c for o in outcomes for c in o.tampered),
        "killed": sum(o.killed for o in outcomes),
        "steps": tuple((name, dict(o.rewards)) for name, o in zip(names, outcomes, strict=False)),
        "cause": next((o.cause for o in outcomes if o.cause is not None), None),
    }


def combine(
    task: Task,
    steps: Sequence[StepConfig],
    outcomes: Sequence[Verification],
    options: HarborOptions,
    failure: Failure | None = None,
    weights: dict[str, float] | None = None,
) -> Verification:
    """One verification of a multi-step rollout from its steps' (see the module docstring).

    The rewards are Harbor's (:func:`_harbor_rewards`) over the steps as :func:`_as_harbor` gives
    them; a step lost to the infrastructure makes its verification the rollout's, so that the loss
    is attributed (and settled by ``on_infra_error``) rather than scored.

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
    lost = next((outcome for outcome in outcomes if outcome.infra), None)
    if lost is not None:
        return lost
    combined = _harbor_rewards(task, _as_harbor(steps, outcomes, options.unreached_steps))
    details = _details(steps, outcomes, options.unreached_steps, failure)
    if not combined:
        return Verification(0.0, **details)
    try:
        reward = select_reward(combined, options.reward_key, weights)
    except RewardError as exc:
        details.update(cause=Cause.CONFIGURATION, reason=str(exc))
        return Verification(None, rewards=combined, error=exc, **details)
    return Verification(reward, rewards=combined, **details)
