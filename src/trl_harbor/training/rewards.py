"""The outcome reward: every rollout of a batch verified at once, with its metrics.

:func:`harbor_reward` is the TRL reward function of :attr:`HarborSpec.reward_funcs
<trl_harbor.training.spec.HarborSpec.reward_funcs>`, with the reference integration's call signature:
``GRPOTrainer`` passes the live environments (``environments=``), ``AsyncGRPOTrainer`` the rewards
its rollout worker already read from them (``environment_reward=``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trl_harbor.rollout.outcome import Cause, Verification
from trl_harbor.rollout.preflight import check_batch
from trl_harbor.training.env import HarborEnv, verify_all

__all__ = ["batch_metrics", "harbor_reward", "report_batch"]


def harbor_reward(
    environments: Sequence[Any] | None = None,
    environment_reward: Sequence[float | None] | None = None,
    *,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Outcome reward: the Harbor verifier's scalar for each rollout, verified concurrently.

    Every ``HarborEnv`` of the batch is verified at once (:func:`trl_harbor.training.env.verify_all`);
    another environment is read through its public ``reward``. A rollout lost to the
    infrastructure scores ``None`` (left out of the batch by TRL) or ``0.0``, per
    ``on_infra_error``; a rollout that broke its own verification scores ``0.0``. Logged per batch
    (:func:`batch_metrics`): ``harbor/infra_failures``, ``harbor/verifier_failures``,
    ``harbor/tampered``, ``harbor/concealed`` and the mean of every reward component
    (``harbor/reward/<key>``); each rollout's reason goes to the ``harbor_error`` column. When the
    whole batch (or the options' ``infra_stop_fraction`` of it) was lost to the infrastructure,
    the run stops (:func:`trl_harbor.rollout.preflight.check_batch`).

    The signature is the reference integration's (``environments`` first, then
    ``environment_reward``); TRL passes everything by keyword.

    Args:
        environments: The rollouts' environments, in completion order.
        environment_reward: Per-rollout rewards computed elsewhere; used as given.
        log_metric: TRL's metric logger (passed by ``GRPOTrainer``).
        log_extra: TRL's completions-table logger (passed by ``GRPOTrainer``).
        **kwargs: What else TRL passes (``prompts``, ``completions``, the dataset's columns): ignored.

    Returns:
        One reward per rollout.

    Raises:
        ValueError: When neither ``environments`` nor ``environment_reward`` is given.
        trl_harbor.rollout.preflight.InfrastructureFailureError: When the batch was lost to the
            infrastructure (after its metrics are logged).
    """
    if environment_reward is not None:
        return [None if r is None else float(r) for r in environment_reward]
    if environments is None:
        raise ValueError(
            "harbor_reward needs `environments=` (GRPOTrainer with environment_factory) or "
            "`environment_reward=`; got neither."
        )
    ours = [env for env in environments if isinstance(env, HarborEnv)]
    verified = iter(verify_all(ours))
    rewards = [next(verified) if isinstance(env, HarborEnv) else _as_reward(env.reward) for env in environments]
    outcomes = [env.verification if isinstance(env, HarborEnv) else None for env in environments]
    reasons = [(o.reason if o else "") for o in outcomes]
    report_batch(outcomes, reasons, [env.options.infra_stop_fraction for env in ours], log_metric, log_extra)
    return rewards


# TRL names a reward function's metrics after it (``rewards/<name>/mean``): the reference's name keeps
# its users' dashboards working.
harbor_reward.__name__ = "_outcome_reward_func"


def report_batch(
    outcomes: Sequence[Verification | None],
    reasons: Sequence[str],
    stop_fractions: Sequence[float | None],
    log_metric: Callable[[str, float], None] | None,
    log_extra: Callable[[str, list], None] | None,
    metrics: dict[str, float] | None = None,
) -> None:
    """Log a graded batch (its :func:`batch_metrics` and ``metrics``, each rollout's reason), then guard it.

    Args:
        outcomes: Each rollout's verification (``None`` for an environment that is not trl-harbor's).
        reasons: Each rollout's reason, for the ``harbor_error`` column.
        stop_fractions: The rollouts' ``infra_stop_fraction`` (the smallest applies; one ``None``: never stop).
        log_metric: TRL's metric logger.
        log_extra: TRL's completions-table logger.
        metrics: Further metrics of the batch.

    Raises:
        trl_harbor.rollout.preflight.InfrastructureFailureError: When the batch was lost to the infrastructure.
    """
    if log_metric is not None:
        for name, value in {**batch_metrics(outcomes), **(metrics or {})}.items():
            log_metric(name, value)
    if log_extra is not None:
        log_extra("harbor_error", list(reasons))
    check_batch(outcomes, None if not stop_fractions or None in stop_fractions else min(stop_fractions))  # type: ignore[type-var]


def batch_metrics(outcomes: Sequence[Verification | None]) -> dict[str, float]:
    """A batch's grading metrics: failures by kind, and the mean of every reward component.

    Args:
        outcomes: Each rollout's verification (``None`` for an environment that is not trl-harbor's).

    Returns:
        ``{metric name: value}``.
    """
    graded = [o for o in outcomes if o is not None]
    metrics = {
        "harbor/infra_failures": float(sum(o.infra for o in graded)),
        "harbor/verifier_failures": float(sum(o.cause in (Cause.VERIFIER, Cause.EXHAUSTED) for o in graded)),
        "harbor/tampered": float(sum(o.cause is Cause.TAMPERED for o in graded)),
        "harbor/concealed": float(sum(bool(o.concealed) for o in graded)),
    }
    components: dict[str, list[float]] = {}
    for outcome in graded:
        for key, value in outcome.rewards.items():
            components.setdefault(key, []).append(value)
        for step, step_rewards in outcome.steps:
            for key, value in step_rewards.items():
                components.setdefault(f"{step}/{key}", []).append(value)
    for key, values in sorted(components.items()):
        metrics[f"harbor/reward/{key}"] = sum(values) / len(values)
    return metrics


def _as_reward(value: Any) -> float | None:
    return None if value is None else float(value)
