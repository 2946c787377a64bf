"""``HarborOptions``: every knob of a rollout, with its default, in one place.

One frozen dataclass is shared by ``HarborEnv`` (and so by every harness), ``HarborSpec``,
``HarborSpec.mix``, ``trl-harbor train``, ``trl-harbor eval`` and ``trl-harbor check``: a
default is written once, here, and an option given to one of them reaches the rollout.

.. code-block:: python

    from trl_harbor import HarborOptions, HarborSpec

    options = HarborOptions(command_timeout_sec=60, on_infra_error="zero")
    spec = HarborSpec("examples/tasks", environment_type="local", options=options)

``options=`` is the one way in, wherever rollouts are configured. Fields given one by one
(``HarborEnv(command_timeout_sec=60)``, ``HarborSpec(env_kwargs={"command_timeout_sec": 60})``) still
override the object's, through :func:`merge_loose_options`, with a ``FutureWarning`` naming the
``options=`` that replaces them: they will be refused in a later release.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["HarborOptions", "InfraPolicy", "OPTION_NAMES", "merge_loose_options", "refuse_unknown"]

InfraPolicy = Literal["skip", "zero", "raise"]
AgentProcesses = Literal["keep", "kill"]
UnreachedSteps = Literal["skip", "zero"]


@dataclass(frozen=True)
class HarborOptions:
    """How rollouts run and are graded.

    Attributes:
        command_timeout_sec: Seconds one command may run before its process tree is stopped.
        max_output_chars: Characters of a command's output handed back to the model; the middle
            of a longer output is cut (its start and its end are kept, with one marker between).
        max_concurrent_starts: How many sandboxes this process starts at once (across every
            environment with the same value), to respect cloud quotas; ``None``: no limit.
        on_infra_error: What a rollout lost to the infrastructure (its sandbox did not start, the
            backend stopped answering, a configuration error) scores: ``"skip"`` gives ``None``,
            which ``GRPOTrainer`` leaves out of the batch; ``"zero"`` gives ``0.0``; ``"raise"``
            propagates the error. A verification the rollout broke itself always scores ``0.0``.
        infra_stop_fraction: The reward function stops the run when at least this fraction of a
            batch (of two or more) was lost to the infrastructure; ``None`` never stops.
        reward_key: The entry of the verifier's rewards that is the scalar (see ``docs/rewards.md``).
        reward_weights: ``{entry: weight}``: the scalar is the weighted sum of the entries
            (default: the task's ``[metadata] reward_weights``).
        allowed_changes: Globs of sandbox paths whose agent-made version the verifier sees even
            where it is the image's own code (added to each task's ``[metadata] allowed_changes``).
        agent_processes: On backends that cannot verify in an isolated view of the sandbox
            (every backend but ``local``): ``"keep"`` leaves the agent's processes running
            while the verifier runs, as Harbor's own trial does (a server the task asked for
            answers the tests); ``"kill"`` stops them first (nothing of the agent runs beside
            the verifier, but a task graded through a service the agent started scores 0).
            The local backend always keeps them, in a namespace the verifier's is hidden from.
        unreached_steps: How a multi-step rollout that ended before its last step is averaged
            (``multi_step_reward_strategy = "mean"``): ``"skip"`` averages over the steps that
            ran, as Harbor does; ``"zero"`` counts every step never reached as 0, so a policy
            gains nothing by stopping after an easy first step (see ``docs/rewards.md``).
        backend_options: Options of the sandbox backend (Harbor's environment ``kwargs``, the
            command line's ``--ek``), e.g. ``{"pids_max": 64}`` for the local sandbox.
    """

    command_timeout_sec: int = 180
    max_output_chars: int = 8000
    max_concurrent_starts: int | None = 64
    on_infra_error: InfraPolicy = "skip"
    infra_stop_fraction: float | None = 1.0
    reward_key: str | None = None
    reward_weights: Mapping[str, float] | None = None
    allowed_changes: tuple[str, ...] = ()
    agent_processes: AgentProcesses = "keep"
    unreached_steps: UnreachedSteps = "skip"
    backend_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        changes = self.allowed_changes
        object.__setattr__(self, "allowed_changes", (changes,) if isinstance(changes, str) else tuple(changes))
        object.__setattr__(self, "backend_options", dict(self.backend_options or {}))
        if self.reward_weights is not None:
            object.__setattr__(self, "reward_weights", {str(k): float(v) for k, v in self.reward_weights.items()})
        self._validate()

    def _validate(self) -> None:
        _choice("on_infra_error", self.on_infra_error, ("skip", "zero", "raise"))
        _choice("agent_processes", self.agent_processes, ("keep", "kill"))
        _choice("unreached_steps", self.unreached_steps, ("skip", "zero"))
        for name in ("command_timeout_sec", "max_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"HarborOptions.{name} must be a positive integer, got {value!r}")
        starts = self.max_concurrent_starts
        if starts is not None and (isinstance(starts, bool) or not isinstance(starts, int) or starts < 1):
            raise ValueError(f"HarborOptions.max_concurrent_starts must be at least 1 (or None), got {starts!r}")
        fraction = self.infra_stop_fraction
        if fraction is not None and not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
            raise ValueError(f"HarborOptions.infra_stop_fraction must be in (0, 1] (or None), got {fraction!r}")
        for key, weight in (self.reward_weights or {}).items():
            if not math.isfinite(weight):
                raise ValueError(f"HarborOptions.reward_weights[{key!r}] must be finite, got {weight!r}")

    @classmethod
    def merged(cls, options: HarborOptions | None = None, **overrides: Any) -> HarborOptions:
        """Options with some fields replaced.

        Args:
            options: The base (default: every default).
            **overrides: Fields to replace; a name that is no option is refused.

        Returns:
            The new options.

        Raises:
            TypeError: When an override names no option (the message lists the options).
        """
        refuse_unknown(overrides, OPTION_NAMES)
        base = options if options is not None else cls()
        return dataclasses.replace(base, **overrides) if overrides else base

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults.

        Returns:
            ``{field: value}``.
        """
        default = HarborOptions()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }


def refuse_unknown(given: Iterable[str], known: Sequence[str], what: str = "option") -> None:
    """Refuse names that are no field: a misspelt option must fail, not be silently ignored.

    Args:
        given: The names given.
        known: The fields.
        what: What a field is called in the message.

    Raises:
        TypeError: Naming the unknown names and listing the fields.
    """
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"unknown {what}(s) {', '.join(unknown)}; the {what}s are: {', '.join(known)}")


def _choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"HarborOptions.{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


#: The fields of :class:`HarborOptions`.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(HarborOptions))


def merge_loose_options(
    options: HarborOptions | None, loose: Mapping[str, Any], where: str, stacklevel: int = 3
) -> HarborOptions:
    """Options with fields that were given one by one, the way that is going away, merged in.

    ``options=`` is the one way in. A field given loose (``HarborEnv(command_timeout_sec=60)``,
    ``HarborSpec(env_kwargs={"command_timeout_sec": 60})``) still takes effect, exactly as
    :meth:`HarborOptions.merged` would, with a ``FutureWarning`` that shows the ``options=`` to write.

    Args:
        options: The options object, if any.
        loose: The fields given one by one (empty: no warning).
        where: What took them, for the message (``"HarborEnv(...)"``).
        stacklevel: Passed to :func:`warnings.warn` (points at the caller's line).

    Returns:
        The merged options.

    Raises:
        TypeError: When a name is no option.
    """
    merged = HarborOptions.merged(options, **loose)
    if loose:
        import warnings

        fields = ", ".join(f"{name}={value!r}" for name, value in loose.items())
        fix = f"HarborOptions({fields})" if options is None else f"HarborOptions.merged(options, {fields})"
        warnings.warn(
            f"{where}: rollout options given one by one ({', '.join(loose)}) are deprecated and will be "
            f"refused in a later release. Fix: pass options={fix}.",
            FutureWarning,
            stacklevel=stacklevel,
        )
    return merged
