"""What grading a rollout produced: a typed :class:`Verification`, its failure :class:`Cause`, the counters.

A rollout is graded normally (``cause is None``), or it is not, for one reason:

============================  ============================================  ==========================
cause                         what happened                                 reward
============================  ============================================  ==========================
``INFRASTRUCTURE``            the sandbox did not start, or the backend     ``on_infra_error``
                              stopped answering                             (skip, 0, raise)
``CONFIGURATION``             the rewards cannot be reduced to one scalar   ``on_infra_error``
                              (a ``reward_key`` or weight names an entry
                              the verifier did not write)
``EXHAUSTED``                 the rollout filled its own sandbox (memory,   0
                              processes, storage) until it stopped
``TAMPERED``                  on a backend without an isolated verifier     0
                              view, the rollout changed what the verifier
                              runs; with one, the view was refused for
                              what the rollout left (content the backend
                              could not judge nor leave out of it)
``VERIFIER``                  the verifier ran in a working backend and     0
                              wrote no usable reward (none, malformed, a
                              timeout, an unsafe artifact)
============================  ============================================  ==========================

Only the first two are not the policy's doing. :data:`COUNTERS` counts every outcome of this
process; the reward function reports them per batch. What a verification keeps of the agent's changes
(``concealed``, ``tampered``) is bounded, whatever the rollout wrote: :data:`REPORTED_LINES` lines of
at most :data:`REPORTED_LINE_CAP` characters, the last saying how many more there were.
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass, field

__all__ = ["COUNTERS", "Cause", "Counters", "Failure", "RewardError", "Verification", "select_reward"]

#: Lines of a verification's ``concealed`` and ``tampered`` kept at most (past it, the last says how many
#: more there were), and characters of each line (a longer one is cut): what reaches the trainer stays bounded.
REPORTED_LINES = 128
REPORTED_LINE_CAP = 1024


class Cause(enum.StrEnum):
    """Why a rollout was not graded normally (see the module docstring)."""

    INFRASTRUCTURE = "infrastructure"
    CONFIGURATION = "configuration"
    EXHAUSTED = "exhausted"
    TAMPERED = "tampered"
    VERIFIER = "verifier"

    @property
    def infra(self) -> bool:
        """Whether the cause is not the policy's doing (the rollout is skipped or scored as configured)."""
        return self in (Cause.INFRASTRUCTURE, Cause.CONFIGURATION)


class RewardError(RuntimeError):
    """The verifier's rewards cannot be reduced to one scalar (a configuration error)."""


def select_reward(
    rewards: dict[str, float] | None,
    reward_key: str | None = None,
    weights: dict[str, float] | None = None,
) -> float:
    """Reduce a verifier's rewards to the scalar that trains the policy.

    In order: ``reward_key`` when given; else ``weights`` (a weighted sum) when given; else the
    ``"reward"`` entry; else the mean of every entry (a multi-reward task such as
    ``{"correctness": 1, "performance": 0.5}`` with no declared weighting).

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


@dataclass(frozen=True)
class Verification:
    """How one rollout was graded.

    Attributes:
        reward: The scalar reward for training; ``None`` when the rollout is skipped (an
            infrastructure failure under ``on_infra_error="skip"``).
        rewards: Every value the verifier wrote (``reward.json``'s keys, or ``{"reward": x}``).
        cause: Why the rollout was not graded normally (``None``: it was).
        reason: The cause in words, for the log (empty when graded normally).
        concealed: What the agent changed that the verifier did not see: the image's own code
            it edited or deleted (the verifier saw the image's version), what it added where it
            would have run instead of the image's code, and what could not be judged (the verifier
            did not see it). Bounded (:data:`REPORTED_LINES`, :data:`REPORTED_LINE_CAP`).
        tampered: On a backend without an isolated verifier view, the changes to what the
            verifier runs that scored the rollout 0. Bounded as ``concealed``.
        killed: How many of the agent's processes were stopped before grading
            (``agent_processes="kill"`` only).
        steps: For a multi-step task, each graded step's name and rewards, in order.
        error: The exception behind an infrastructure or configuration failure (re-raised under
            ``on_infra_error="raise"``).
    """

    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    cause: Cause | None = None
    reason: str = ""
    concealed: tuple[str, ...] = ()
    tampered: tuple[str, ...] = ()
    killed: int = 0
    steps: tuple[tuple[str, dict[str, float]], ...] = ()
    error: BaseException | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("concealed", "tampered"):
            lines = getattr(self, name)
            if lines:
                object.__setattr__(self, name, _bounded(lines))

    @property
    def infra(self) -> bool:
        """Whether the rollout was lost to the infrastructure (not the policy's doing)."""
        return self.cause is not None and self.cause.infra


def _bounded(lines: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``lines`` in :data:`REPORTED_LINES` lines at most, each cut to :data:`REPORTED_LINE_CAP` characters:
    past the bound, the first ones and a last that says how many more there were (bounding twice
    changes nothing: a verification is copied with ``dataclasses.replace``)."""
    if not isinstance(lines, tuple | list):
        lines = tuple(lines)
    shown = lines if len(lines) <= REPORTED_LINES else lines[: REPORTED_LINES - 1]
    kept = tuple(
        line if len(line) <= REPORTED_LINE_CAP else line[: REPORTED_LINE_CAP - 3] + "..."
        for line in (str(item) for item in shown)
    )
    if len(shown) < len(lines):
        kept += (f"... and {len(lines) - len(shown)} more lines",)
    return kept


@dataclass(frozen=True)
class Failure:
    """Why a rollout cannot go on: its cause, the reason in words, and the exception behind it."""

    cause: Cause
    reason: str
    error: BaseException | None = None


class Counters:
    """This process's rollout outcomes, by cause (and, for the infrastructure, by stage).

    One instance, :data:`COUNTERS`, is shared by every episode; the reward function and
    ``trl-harbor`` read it. Thread-safe (episodes of several event loops may grade at once).
    """

    STAGES = ("start", "exec", "verify")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._infra: collections.Counter[str] = collections.Counter()
        self._causes: collections.Counter[Cause] = collections.Counter()

    def infra_failure(self, stage: str) -> None:
        """Count a rollout lost to the infrastructure at ``stage`` (``start``, ``exec``, ``verify``)."""
        with self._lock:
            self._infra[stage] += 1

    def outcome(self, verification: Verification) -> None:
        """Count a graded rollout's cause (nothing for one graded normally)."""
        if verification.cause is not None:
            with self._lock:
                self._causes[verification.cause] += 1

    def infra_failures(self) -> dict[str, int]:
        """Rollouts lost to the infrastructure so far, by stage.

        Returns:
            ``{"start": n, "exec": n, "verify": n}``.
        """
        with self._lock:
            return {stage: self._infra[stage] for stage in self.STAGES}

    def by_cause(self) -> dict[str, int]:
        """Rollouts not graded normally so far, by :class:`Cause`.

        Returns:
            ``{cause: n}`` for every cause.
        """
        with self._lock:
            return {cause.value: self._causes[cause] for cause in Cause}


#: The counters of this process.
COUNTERS = Counters()
