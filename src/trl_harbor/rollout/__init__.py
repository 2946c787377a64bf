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
  the process's :data:`COUNTERS`; :mod:`~trl_harbor.rollout.policy` — what grading takes from the
  options and the task's ``[metadata]``, read once;
* :mod:`~trl_harbor.rollout.contract` — what it can use of a backend beyond Harbor's interface,
  as protocols; :mod:`~trl_harbor.rollout.backends` — an ``environment_type`` resolved once, its
  class's facts, the verifier's placement, sandboxes created through Harbor's factory;
  :mod:`~trl_harbor.rollout.conformance` — :func:`check_backend`, that contract checked on a
  live sandbox of a backend (``trl_harbor.testing.check_backend``);
* the suite: :mod:`~trl_harbor.rollout.suite` (task folders read once),
  :mod:`~trl_harbor.rollout.sources` (every dataset form Harbor's CLI takes),
  :mod:`~trl_harbor.rollout.suite_lock`, :mod:`~trl_harbor.rollout.digests`;
  :mod:`~trl_harbor.rollout.preflight` (failing fast).

It depends on Harbor, :mod:`trl_harbor.runtime`, :mod:`trl_harbor.progress` and
:mod:`trl_harbor.options` only: never on the TRL surface, the loop-owning agents, the command line
or a sandbox backend's package, so ``check``, ``eval`` and training share it and it grades on any
Harbor backend. Its public names load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_LAZY = {name: "trl_harbor.rollout.episode" for name in ("CommandTimeoutError", "Episode", "Phase")} | {
    name: "trl_harbor.rollout.outcome" for name in ("COUNTERS", "Cause", "RewardError", "Verification", "select_reward")
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trl_harbor.rollout' has no attribute {name!r}")
    return getattr(import_module(module), name)
