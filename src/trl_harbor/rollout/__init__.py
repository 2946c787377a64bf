"""The rollout core: one rollout's sandbox from provisioning to its grade, knowing no trainer.

* :mod:`~trl_harbor.rollout.episode` — :class:`Episode`: the task's sandbox, started the way
  Harbor's trials start it, the agent's commands, the steps of a multi-step task, one
  :class:`Phase` at a time;
* :mod:`~trl_harbor.rollout.grading` — :func:`grade`: Harbor's verifier, in an isolated view of
  the sandbox where the backend offers one, every failure classified;
* :mod:`~trl_harbor.rollout.steps` — Harbor's multi-step staging, ``min_reward`` gate and reward
  aggregation;
* :mod:`~trl_harbor.rollout.seal` and :mod:`~trl_harbor.rollout.integrity` — for backends
  without an isolated view: the agent-process policy and the tamper check;
* :mod:`~trl_harbor.rollout.outcome` — the typed :class:`Verification`, its :class:`Cause`,
  the process's :data:`COUNTERS`.

It depends on Harbor, :mod:`trl_harbor.runtime`, :mod:`trl_harbor.options` and
:mod:`trl_harbor.backends` only: never on the TRL surface, the specs or the command line.
"""

from trl_harbor.rollout.episode import CommandTimeoutError, Episode, Phase
from trl_harbor.rollout.outcome import COUNTERS, Cause, RewardError, Verification, select_reward

__all__ = [
    "COUNTERS",
    "Cause",
    "CommandTimeoutError",
    "Episode",
    "Phase",
    "RewardError",
    "Verification",
    "select_reward",
]
