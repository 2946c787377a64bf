"""Loop-owning agents in training: Harbor's Terminus-2 as TRL's ``rollout_func``.

With a harness (``agent="bash"``, ...) TRL owns the turn loop and the sandbox is a tool. A
*loop-owning* agent owns its loop and calls a model through an API; it is trained by serving it
the policy through the capture endpoint (:mod:`trl_harbor.loop.capture`) and turning what the
endpoint recorded into TRL's rows. :class:`LoopRolloutFunc` is that, as ``GRPOTrainer``'s
``rollout_func``:

.. code-block:: python

    spec = HarborSpec("examples/tasks", agent="terminus-2", environment_type="local")
    trainer = GRPOTrainer(
        model=...,
        args=GRPOConfig(num_generations=8, max_completion_length=4096, max_tool_calling_iterations=20),
        train_dataset=spec.train_dataset,
        rollout_func=spec.rollout_func,      # None for harnesses
        environment_factory=spec.environment_factory,  # None for loop agents
        reward_funcs=spec.reward_funcs,
    )

For each prompt of the batch (all at once, on the shared loop): an :class:`~trl_harbor.rollout.Episode`
starts the task's sandbox as every rollout's does; a capture route is opened with the rollout's
token budget (``max_completion_length``, counted as TRL counts a multi-turn completion) and seed;
Terminus-2 runs in the sandbox against the route (:func:`trl_harbor.loop.terminus.run_terminus`); the
episode is graded by :func:`trl_harbor.rollout.grading.grade` (the isolated verifier view, the
failure causes, ``on_infra_error``) and stopped. The route's trace becomes the row: the first
prompt, and every sampled token (``env_mask`` 1, its sampling log-probability) with the bridges
between turns — the terminal output Terminus-2 sent back — masked out (``env_mask`` 0).

The policy is served by the trainer's vLLM when it uses one (:class:`~trl_harbor.loop.capture.VLLMSampler`),
else by the trainer's own model in this process (:class:`~trl_harbor.loop.capture.ModelSampler`).

A rollout whose history forked (see :mod:`trl_harbor.loop.capture.trace`) trains on its first segment
(``fork_policy="truncate"``) or not at all (``"skip"``: reward ``None``). The reward function
(:func:`loop_reward`) reads each rollout's grade and logs, besides Harbor's usual batch metrics,
``harbor/loop/*``: turns, forks, retries, re-tokenisation drift, rollouts whose Harbor-recorded
token ids differ from the endpoint's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import progress, runtime
from trl_harbor.loop.capture import CaptureEndpoint, ModelSampler, Renderer, Route, Row, VLLMSampler, derive_seed
from trl_harbor.loop.capture.samplers import Sampler, SamplingParams, sampling_from_trainer
from trl_harbor.loop.terminus import AGENT_NAME, AgentRun, TerminusOptions, run_terminus
from trl_harbor.options import HarborOptions
from trl_harbor.rollout.episode import Episode
from trl_harbor.rollout.outcome import Verification
from trl_harbor.training.agents import LOOP_AGENT_NAMES
from trl_harbor.training.rewards import report_batch

if TYPE_CHECKING:
    from trl_harbor.rollout.backends import Backend

__all__ = [
    "LOOP_AGENTS",
    "LoopRollout",
    "LoopRolloutFunc",
    "loop_agent_name",
    "loop_metrics",
    "loop_reward",
    "task_dir_of",
]

#: Loop-owning agents selectable by name (every accepted spelling) and the agent each one names.
LOOP_AGENTS: dict[str, str] = dict.fromkeys(LOOP_AGENT_NAMES, AGENT_NAME)

#: Turns per rollout when neither the agent's ``max_turns`` nor the trainer's ``max_tool_calling_iterations`` is set.
DEFAULT_MAX_TURNS = 10


def loop_agent_name(agent: Any) -> str | None:
    """The loop agent an ``agent=`` selector names (``"terminus-2"``), or ``None`` for a harness."""
    return LOOP_AGENTS.get(agent.lower()) if isinstance(agent, str) else None


@dataclass(eq=False)
class LoopRollout:
    """One loop-agent rollout: its task, the agent's run, the captured trace, the grade.

    It reads like an environment to the reward function and the trajectory log (``reward``,
    ``verification``, ``infra_error``).

    Attributes:
        task: The task's name.
        task_dir: The task's folder.
        agent: The agent (``"terminus-2"``).
        run: How the agent's run went.
        route: The capture route (its trace: turns, forks, retries, drift).
        verification: The grade (``None`` if grading never happened).
        row: The training row (``None`` when the policy sampled nothing).
        skipped: Why the rollout does not train, beyond its grade (a fork under ``"skip"``).
        started_at: When it started (ISO 8601).
        seconds: How long it took, grading included.
        stop_fraction: Its options' ``infra_stop_fraction`` (what lost batch stops the run).
    """

    task: str
    task_dir: str
    agent: str = AGENT_NAME
    run: AgentRun | None = None
    route: Route | None = None
    verification: Verification | None = None
    row: Row | None = None
    skipped: str | None = None
    started_at: str = ""
    seconds: float = 0.0
    stop_fraction: float | None = None
    _t0: float = field(default_factory=time.monotonic)

    @property
    def reward(self) -> float | None:
        """The verifier's scalar (``None``: the rollout is left out of the batch)."""
        if self.skipped is not None or self.verification is None:
            return None
        return self.verification.reward

    @property
    def infra_error(self) -> str | None:
        """Why the rollout was lost to the infrastructure (not the policy's fault), or ``None``."""
        verification = self.verification
        return verification.reason if verification is not None and verification.infra else None

    @property
    def turns(self) -> int:
        """Model calls answered."""
        return 0 if self.route is None else len(self.route.trace.turns)

    @property
    def forks(self) -> int:
        """Turns whose history did not extend the previous turn."""
        return 0 if self.route is None else len(self.route.trace.forks)

    @property
    def harbor_token_ids_match(self) -> bool | None:
        """Whether Harbor's recorded per-call token ids and log-probabilities equal the endpoint's.

        ``None`` when the agent recorded nothing.
        """
        if self.run is None or self.route is None or not self.run.rollout_details:
            return None
        prompts, completions, logprobs = self.run.harbor_token_ids()
        turns = self.route.trace.turns
        return (
            prompts == [t.prompt_ids for t in turns]
            and completions == [t.completion_ids for t in turns]
            and len(logprobs) == len(turns)  # before the zip: strict=True raises on a length mismatch
            and all(
                len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a, b, strict=True))
                for a, b in zip(logprobs, [t.logprobs for t in turns], strict=True)
            )
        )

    @property
    def _trl_harbor_trajectory(self) -> dict[str, Any]:
        # What trl_harbor.cli.trajectories.TrajectoryLog reads of an environment: the task and the tool calls.
        return {
            "task": self.task,
            "task_dir": self.task_dir,
            "started_at": self.started_at,
            "_t0": self._t0,
            "tool_calls": [] if self.run is None else self.run.tool_calls(),
        }

    def trajectory_fields(self) -> dict[str, Any]:
        """The loop-specific fields of the rollout's trajectory-log line."""
        trace = None if self.route is None else self.route.trace
        return {
            "harness": self.agent,
            "agent_ended": None if self.run is None else self.run.ended,
            "agent_error": None if self.run is None else self.run.error,
            "turns": self.turns,
            "forks": [] if trace is None else [{"turn": f.turn, "reason": f.reason} for f in trace.forks],
            "retries": 0 if trace is None else trace.retries,
            "retokenization_drift_turns": 0 if trace is None else trace.drift_turns,
            "refused": None if self.route is None else self.route.refused,
            "sampling_overridden": {} if self.route is None else dict(self.route.overridden),
            "harbor_token_ids_match": self.harbor_token_ids_match,
            "trained_tokens": 0 if self.row is None else sum(self.row.env_mask),
            "skipped": self.skipped,
        }


def _no_check() -> None:
    """No backend check (a rollout function built without a spec)."""


class LoopRolloutFunc:
    """TRL's ``rollout_func`` running a loop-owning agent per prompt (``spec.rollout_func``).

    Args:
        backend: Where the sandboxes run.
        options: How rollouts run and are graded.
        agent_options: How Terminus-2 runs.
        backend_check: Run before the first batch: raises when the backend cannot start
            sandboxes here (the spec's :class:`~trl_harbor.training.spec.BackendCheck`).
        sampler: ``trainer -> Sampler`` (default: the trainer's vLLM when ``use_vllm``, else its model).
        fork_policy: ``"truncate"`` (a forked rollout trains on its first segment) or ``"skip"``
            (default: the agent options').
        max_tokens_per_turn: The most tokens one model call samples (default: ``max_completion_length``).
        check_drift: Measure re-tokenisation drift on every turn (one extra template rendering).
    """

    def __init__(
        self,
        backend: Backend,
        options: HarborOptions,
        agent_options: TerminusOptions,
        backend_check: Callable[[], None] | None = None,
        *,
        sampler: Callable[[Any, SamplingParams], Sampler] | None = None,
        fork_policy: str | None = None,
        max_tokens_per_turn: int | None = None,
        check_drift: bool = True,
    ) -> None:
        if fork_policy is not None:  # TerminusOptions checks it
            agent_options = replace(agent_options, fork_policy=fork_policy)
        self.backend = backend
        self.options = options
        self.agent_options = agent_options
        self.backend_check = backend_check or _no_check
        self.sampler_factory = sampler or default_sampler
        self.fork_policy = agent_options.fork_policy
        self.max_tokens_per_turn = max_tokens_per_turn
        self.check_drift = check_drift
        self.endpoint: CaptureEndpoint | None = None
        self.last: list[LoopRollout] = []
        self._trainer_id: int | None = None
        self._batches = 0

    @property
    def __name__(self) -> str:  # TRL names things after their callables
        return "harbor_loop_rollout"

    def max_turns(self, args: Any) -> int:
        """Model calls per rollout: the agent's ``max_turns``, else the trainer's ``max_tool_calling_iterations``.

        Args:
            args: The trainer's config.

        Returns:
            The turns (:data:`DEFAULT_MAX_TURNS` when neither is set).
        """
        return self.agent_options.max_turns or args.max_tool_calling_iterations or DEFAULT_MAX_TURNS

    # ── the endpoint ─────────────────────────────────────────────────────────────────

    def endpoint_for(self, trainer: Any) -> CaptureEndpoint:
        """The capture endpoint serving ``trainer``'s policy (started on the shared loop on first use).

        Args:
            trainer: The ``GRPOTrainer``.

        Returns:
            The running endpoint.
        """
        if self.endpoint is not None and self.endpoint.running and self._trainer_id == id(trainer):
            return self.endpoint
        self.close()
        self._batches = 0
        sampling = sampling_from_trainer(trainer, self.max_tokens_per_turn)
        tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
        renderer = Renderer(tokenizer, getattr(trainer, "chat_template_kwargs", None) or {})
        endpoint = CaptureEndpoint(
            self.sampler_factory(trainer, sampling),
            renderer,
            sampling,
            max_model_len=getattr(trainer.args, "vllm_max_model_length", None),
            check_drift=self.check_drift,
        )
        runtime.run(endpoint.start())
        self.endpoint, self._trainer_id = endpoint, id(trainer)
        return endpoint

    def close(self) -> None:
        """Stop the endpoint (a later call starts a new one)."""
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            runtime.run(endpoint.stop())

    # ── TRL's entry point ────────────────────────────────────────────────────────────

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        """Run one rollout per prompt and return TRL's fields.

        Args:
            prompts: The batch's prompts (each a conversation from the spec's ``train_dataset``,
                whose message carries the row's ``task_dir``).
            trainer: The trainer.

        Returns:
            ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` (one row per prompt) and
            ``harbor_rollout`` (the :class:`LoopRollout` of each, for the reward function).

        Raises:
            ValueError: When a prompt carries no ``task_dir`` (not a loop spec's dataset).
        """
        runtime.arm()
        self.backend_check()
        endpoint = self.endpoint_for(trainer)
        args = trainer.args
        task_dirs = [task_dir_of(prompt) for prompt in prompts]
        max_turns = self.max_turns(args)
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        rank = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0) or 0)
        # A step may generate more than once (gradient accumulation): the batch counter keeps their seeds apart.
        seeds = [derive_seed(args.seed, step, self._batches, rank, index) for index in range(len(prompts))]
        self._batches += 1
        budget = int(args.max_completion_length)
        rollouts = self.run_batch(endpoint, task_dirs, seeds, budget=budget, max_turns=max_turns)
        return self.fields(rollouts, endpoint.renderer, prompts)

    def run_batch(
        self, endpoint: CaptureEndpoint, task_dirs: Sequence[str], seeds: Sequence[int | None], *, budget: int | None,
        max_turns: int,
    ) -> list[LoopRollout]:  # fmt: skip
        """Run one rollout per task folder, all at once, each graded and stopped.

        Args:
            endpoint: The running capture endpoint.
            task_dirs: One task folder per rollout.
            seeds: Each rollout's sampling seed.
            budget: Each rollout's token budget after its first prompt.
            max_turns: Model calls per rollout.

        Returns:
            The rollouts, in order (also kept as :attr:`last`).
        """
        rollouts = [
            self.rollout(endpoint, task_dir, seed, budget=budget, max_turns=max_turns)
            for task_dir, seed in zip(task_dirs, seeds, strict=True)
        ]
        self.last = runtime.run(progress.gather("verification", rollouts))
        return self.last

    async def rollout(
        self, endpoint: CaptureEndpoint, task_dir: str, seed: int | None, *, budget: int | None, max_turns: int
    ) -> LoopRollout:
        """One rollout: the sandbox, the agent against a fresh route, the grade, the stop.

        Args:
            endpoint: The running capture endpoint.
            task_dir: The task.
            seed: The rollout's sampling seed.
            budget: The token budget after the first prompt.
            max_turns: Model calls allowed.

        Returns:
            The rollout.

        Raises:
            Exception: An infrastructure failure, when ``on_infra_error="raise"``.
        """
        from trl_harbor.rollout.suite import load_task

        task = load_task(Path(task_dir))
        result = LoopRollout(
            task.name,
            str(task_dir),
            started_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
            stop_fraction=self.options.infra_stop_fraction,
        )
        episode = Episode(task, self.backend, self.options)
        route = endpoint.open_route(budget=budget, seed=seed, label=task.name)
        result.route = route
        try:
            await episode.provision()
            result.run = await run_terminus(
                episode,
                route.url,
                self.agent_options,
                max_turns=max_turns,
                session_id=route.id,
                context_tokens=endpoint.max_model_len,
                abort=route.wait_failed,
            )
            if route.failure is not None:
                episode.fail("exec", route.failure)
            result.verification = await episode.grade()
        finally:
            endpoint.close_route(route)
            await episode.stop()
            await endpoint.settle(route)
            result.seconds = round(time.monotonic() - result._t0, 3)
        result.row = route.trace.row(0)
        if route.trace.forks and self.fork_policy == "skip":
            result.skipped = f"the history forked ({route.trace.forks[0].reason}); fork_policy='skip'"
        return result

    @staticmethod
    def fields(rollouts: Sequence[LoopRollout], renderer: Renderer, prompts: Sequence[Any]) -> dict[str, list[Any]]:
        """TRL's ``rollout_func`` output for the rollouts (a rollout that sampled nothing: one masked token).

        Args:
            rollouts: The rollouts, in prompt order.
            renderer: The policy's chat template.
            prompts: The prompts (for the rows of rollouts that sampled nothing).

        Returns:
            ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` and ``harbor_rollout``.
        """
        rows = []
        for rollout, prompt in zip(rollouts, prompts, strict=True):
            row = rollout.row
            if row is None:  # nothing sampled (the sandbox did not start): a placeholder row that trains nothing
                messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
                row = Row(renderer.prompt(messages), [renderer.eos_id], [0], [0.0])
                if rollout.skipped is None and rollout.reward is not None:
                    rollout.skipped = "the policy sampled nothing"
            rows.append(row)
        names = ("prompt_ids", "completion_ids", "logprobs", "env_mask")
        return {**{name: [getattr(row, name) for row in rows] for name in names}, "harbor_rollout": list(rollouts)}


def default_sampler(trainer: Any, sampling: SamplingParams) -> Sampler:
    """The trainer's vLLM when it uses one, else its own model in this process."""
    if getattr(trainer, "use_vllm", False):
        return VLLMSampler.from_trainer(trainer, sampling)
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    stop = list(getattr(trainer, "eos_token_ids", None) or [trainer.processing_class.eos_token_id])
    return ModelSampler(model, stop, sampling)


def task_dir_of(prompt: Any) -> str:
    """The task folder a loop spec's prompt carries (its message's ``task_dir``).

    Raises:
        ValueError: For a prompt that carries none.
    """
    for message in prompt if isinstance(prompt, list) else []:
        if isinstance(message, dict) and message.get("task_dir"):
            return str(message["task_dir"])
    raise ValueError(
        "a loop agent's rollout_func needs prompts from its HarborSpec's train_dataset (each prompt message carries "
        f"the row's task_dir); got {str(prompt)[:200]!r}"
    )


def loop_reward(
    harbor_rollout: Sequence[LoopRollout] | None = None,
    *,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Outcome reward of loop-agent rollouts: each one's verifier scalar (graded as every rollout is).

    Logged per batch: Harbor's grading metrics (:func:`trl_harbor.training.rewards.batch_metrics`) and
    ``harbor/loop/turns`` (mean), ``harbor/loop/forks``, ``harbor/loop/retries``,
    ``harbor/loop/drift_turns``, ``harbor/loop/token_mismatch`` (rollouts whose Harbor-recorded
    token ids differ from the endpoint's) and ``harbor/loop/skipped``; each rollout's reason goes
    to the ``harbor_error`` column. A batch lost to the infrastructure stops the run, as with
    :func:`trl_harbor.training.rewards.harbor_reward`.

    Args:
        harbor_rollout: The rollouts (the ``rollout_func``'s field of that name, passed by TRL).
        log_metric: TRL's metric logger.
        log_extra: TRL's completions-table logger.
        **kwargs: What else TRL passes: ignored.

    Returns:
        One reward per rollout.

    Raises:
        ValueError: Without ``harbor_rollout`` (not a loop agent's ``rollout_func``).
    """
    if harbor_rollout is None:
        raise ValueError(
            "loop_reward needs the `harbor_rollout` field of a loop agent's rollout_func (spec.rollout_func)"
        )
    rollouts = list(harbor_rollout)
    reasons = [(r.skipped or (r.verification.reason if r.verification else "")) for r in rollouts]
    fractions = [r.stop_fraction for r in rollouts]
    report_batch([r.verification for r in rollouts], reasons, fractions, log_metric, log_extra, loop_metrics(rollouts))
    return [r.reward for r in rollouts]


def loop_metrics(rollouts: Sequence[LoopRollout]) -> dict[str, float]:
    """A batch's loop metrics (see :func:`loop_reward`)."""
    if not rollouts:
        return {}
    traces = [r.route.trace for r in rollouts if r.route is not None]
    return {
        "harbor/loop/turns": sum(r.turns for r in rollouts) / len(rollouts),
        "harbor/loop/forks": float(sum(len(t.forks) for t in traces)),
        "harbor/loop/retries": float(sum(t.retries for t in traces)),
        "harbor/loop/drift_turns": float(sum(t.drift_turns for t in traces)),
        "harbor/loop/token_mismatch": float(sum(r.harbor_token_ids_match is False for r in rollouts)),
        "harbor/loop/skipped": float(sum(r.skipped is not None for r in rollouts)),
    }
