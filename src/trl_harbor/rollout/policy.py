"""What grading takes from the options and the task's ``[metadata]``, read once per rollout.

The episode resolves a :class:`GradingPolicy` when it is made and hands it to grading, the seal and
the combination of steps, so no later code reads the task's tables again (where a step's verifier
runs and as whom is resolved with the step's network plan: :class:`trl_harbor.rollout.backends.VerifierPlacement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from trl_harbor.options import HarborOptions

__all__ = ["GradingPolicy"]


@dataclass(frozen=True)
class GradingPolicy:
    """The options and the task's ``[metadata]`` as grading uses them.

    Attributes:
        allowed_changes: Globs of paths whose agent-made version the verifier sees (or the seal
            accepts) whatever they are: the options', then the task's ``allowed_changes``.
        reward_weights: The weighting of the verifier's entries: the options', else the task's
            ``reward_weights`` (``None``: none).
    """

    allowed_changes: tuple[str, ...] = ()
    reward_weights: dict[str, float] | None = None

    @classmethod
    def resolve(cls, task: Task, options: HarborOptions) -> GradingPolicy:
        """Read the policy of one rollout of ``task`` under ``options``."""
        metadata = task.config.metadata or {}
        declared = metadata.get("allowed_changes") or []
        weights = metadata.get("reward_weights")
        if options.reward_weights:
            weights = dict(options.reward_weights)
        elif isinstance(weights, dict):
            weights = {str(key): float(value) for key, value in weights.items()}
        else:
            weights = None
        return cls(
            allowed_changes=(*options.allowed_changes, *([declared] if isinstance(declared, str) else declared)),
            reward_weights=weights,
        )
