"""Loop-owning agents under TRL's ``AsyncGRPOTrainer``: a rollout worker that never waits for the optimiser.

TRL's ``AsyncGRPOTrainer`` trains on rollouts a *worker* keeps producing while it optimises; it
accepts any worker with ``rollout_buffer``, ``metrics_queue``, ``start``, ``stop``,
``update_model_version`` and ``check_health`` (its ``RolloutWorkerProtocol``).
:class:`HarborRolloutWorker` is one for a loop-owning agent (Terminus-2): it cycles through the
spec's dataset, runs each prompt's group of ``num_generations`` rollouts (the same
:meth:`LoopRolloutFunc.rollout <trl_harbor.loop.rollout_func.LoopRolloutFunc.rollout>` as the synchronous
path: an episode, a capture route, the agent, the grade), and puts one ``RolloutSample`` per
rollout on its buffer: the row's tokens, its mask (the first prompt and the bridges 0, the sampled
tokens 1), its sampling log-probabilities, and the group-normalised advantage, tagged with the
policy version it was sampled under. Groups run concurrently (``max_inflight_groups``).

The trainer is importable from ``trl`` since TRL 1.18 (``from trl import AsyncGRPOConfig,
AsyncGRPOTrainer``); on TRL 1.16 and 1.17 it lives in ``trl.experimental.async_grpo``, which later
releases keep, with a deprecation warning, until TRL 2.0. :func:`trl_harbor.training.trl_compat.async_grpo`
returns it from wherever the installed TRL has it.

.. code-block:: python

    from trl import AsyncGRPOConfig, AsyncGRPOTrainer  # TRL 1.18+
    # TRL 1.16 and 1.17: from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    # either: AsyncGRPOTrainer, AsyncGRPOConfig = trl_harbor.training.trl_compat.async_grpo()

    spec = HarborSpec("my-tasks", agent="terminus-2", environment_type="local")
    args = AsyncGRPOConfig(vllm_server_base_url="http://127.0.0.1:8000", num_generations=8, ...)
    worker = HarborRolloutWorker.from_config(spec, args, tokenizer)  # the policy: the vLLM server
    trainer = AsyncGRPOTrainer(model="Qwen/Qwen3-4B", args=args, train_dataset=spec.train_dataset,
                               processing_class=tokenizer, rollout_worker=worker)

The policy is served by the trainer's vLLM server (the trainer syncs its weights there). Not run
end to end in this project's CI: ``AsyncGRPOTrainer`` needs a GPU (its tree attention is a
FlashAttention-3 kernel), which CI lacks; the worker itself is tested on CPU with the trainer's
model as the sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from trl_harbor import runtime
from trl_harbor.loop.capture import CaptureEndpoint, Renderer, VLLMSampler, derive_seed
from trl_harbor.loop.capture.samplers import Sampler, SamplingParams
from trl_harbor.loop.rollout_func import LoopRollout, LoopRolloutFunc, loop_metrics, task_dir_of
from trl_harbor.training.trl_compat import rollout_sample_class

__all__ = ["HarborRolloutWorker", "group_samples"]


def group_samples(rollouts: Sequence[LoopRollout], prompt: Any, model_version: int, group_id: int) -> list[Any]:
    """One group's ``RolloutSample``s (AsyncGRPO's training rows): one per rollout that sampled anything.

    The advantage is GRPO's: the reward minus the group's mean, over the group's standard deviation,
    among the rollouts with a reward; a rollout without one (lost to the infrastructure, skipped)
    gets advantage 0.

    Args:
        rollouts: The group's rollouts.
        prompt: Their prompt (a conversation).
        model_version: The policy version they were sampled under.
        group_id: The group's number.

    Returns:
        The samples.
    """
    import numpy as np

    rollout_sample = rollout_sample_class()

    rewards = [r.reward for r in rollouts]
    scored = [float(r) for r in rewards if r is not None and not math.isnan(r)]
    mean = sum(scored) / len(scored) if scored else math.nan
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored)) if scored else math.nan
    metrics = {"reward_std": std, **loop_metrics(rollouts)}
    samples = []
    for rollout, reward in zip(rollouts, rewards, strict=True):
        row = rollout.row
        if row is None:
            continue
        advantage = 0.0 if reward is None or math.isnan(reward) else (reward - mean) / (std + 1e-8)
        replies = [turn.text for turn in rollout.route.trace.segments[0]] if rollout.route is not None else []
        samples.append(
            rollout_sample(
                prompt=[{"role": m["role"], "content": m["content"]} for m in prompt],
                completion=[{"role": "assistant", "content": "\n".join(replies)}],
                input_ids=np.asarray([*row.prompt_ids, *row.completion_ids], dtype=np.int64),
                completion_mask=np.asarray([0] * len(row.prompt_ids) + row.env_mask, dtype=np.int64),
                old_log_probs=np.asarray([0.0] * len(row.prompt_ids) + row.logprobs, dtype=np.float32),
                advantage=float(advantage),
                model_version=model_version,
                group_id=group_id,
                metrics={"reward": math.nan if reward is None else float(reward), **metrics},
            )
        )
    return samples


def _groups_in_flight(tasks: int, generations: int) -> int:
    """Groups in flight for AsyncGRPO's ``max_inflight_tasks`` (rollouts; -1 or 0: its automatic choice, 4 groups)."""
    return 4 if tasks <= 0 else max(1, tasks // max(1, generations))


class HarborRolloutWorker:
    """``AsyncGRPOTrainer``'s rollout worker for a loop-owning agent (see the module docstring).

    Args:
        rollout_func: The spec's :class:`~trl_harbor.loop.rollout_func.LoopRolloutFunc` (backend, options, agent).
        dataset: The spec's ``train_dataset`` (its prompts carry their task).
        tokenizer: The policy's tokenizer.
        sampler: The policy backend (a :class:`~trl_harbor.loop.capture.VLLMSampler` on the trainer's server).
        sampling: The endpoint's sampling parameters.
        num_generations: Rollouts per prompt (a group).
        max_turns: Model calls per rollout.
        budget: Tokens per rollout after its first prompt.
        chat_template_kwargs: The chat template's arguments.
        max_inflight_groups: Groups running at once.
        queue_maxsize: The buffer's bound (0: unbounded); a full buffer holds the next group back.
        seed: The base of every rollout's sampling seed.
        max_model_len: The policy's context (``None``: unbounded).
    """

    def __init__(
        self,
        rollout_func: LoopRolloutFunc,
        dataset: Any,
        tokenizer: Any,
        *,
        sampler: Sampler,
        sampling: SamplingParams,
        num_generations: int,
        max_turns: int,
        budget: int | None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_inflight_groups: int = 4,
        queue_maxsize: int = 0,
        seed: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.rollout_func = rollout_func
        self.prompts = [row["prompt"] for row in dataset]
        self.renderer = Renderer(tokenizer, chat_template_kwargs)
        self.sampler = sampler
        self.sampling = sampling
        self.num_generations = int(num_generations)
        self.max_turns = int(max_turns)
        self.budget = budget
        self.max_inflight_groups = max(1, int(max_inflight_groups))
        self.seed = seed
        self.max_model_len = max_model_len
        self.rollout_buffer: queue.Queue[Any] = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=4096)
        self.model_version = 0
        self.groups_done = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.monotonic()

    @classmethod
    def from_config(cls, spec: Any, args: Any, tokenizer: Any, **kwargs: Any) -> HarborRolloutWorker:
        """A worker for a loop spec under an ``AsyncGRPOConfig``, its policy the config's vLLM server.

        Args:
            spec: A ``HarborSpec`` with a loop-owning agent.
            args: The ``AsyncGRPOConfig``.
            tokenizer: The policy's tokenizer.
            **kwargs: Overrides of the constructor's arguments (e.g. ``sampler=``).

        Returns:
            The worker.

        Raises:
            ValueError: When the spec has no loop-owning agent.
        """
        if spec.rollout_func is None:
            raise ValueError("HarborRolloutWorker needs a spec with a loop-owning agent (agent='terminus-2')")
        sampling = SamplingParams(
            temperature=float(args.temperature),
            top_p=float(args.top_p),
            top_k=int(args.top_k or 0),
            min_p=float(args.min_p or 0.0),
            max_tokens=int(args.max_completion_length),
            seed=int(args.seed),
        )
        options = dict(
            sampler=VLLMSampler(sampling, base_url=args.vllm_server_base_url, timeout=float(args.request_timeout)),
            sampling=sampling,
            num_generations=args.num_generations,
            max_turns=spec.rollout_func.max_turns(args),
            budget=int(args.max_completion_length),
            chat_template_kwargs=args.chat_template_kwargs if isinstance(args.chat_template_kwargs, dict) else None,
            max_inflight_groups=_groups_in_flight(int(args.max_inflight_tasks), int(args.num_generations)),
            queue_maxsize=int(args.queue_maxsize),
            seed=int(args.seed),
        )
        options.update(kwargs)
        return cls(spec.rollout_func, spec.train_dataset, tokenizer, **options)

    # ── RolloutWorkerProtocol ────────────────────────────────────────────────────────

    def start(self) -> None:
        """Start producing rollouts on a thread of this process (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="harbor-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop: no new group starts, the running ones are abandoned and their sandboxes stopped."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=300)

    def update_model_version(self, model_version: int) -> None:
        """The policy version that groups started from now on are tagged with."""
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise when the worker failed, or produced nothing for ``stale_after_s`` seconds.

        Raises:
            RuntimeError: Naming the failure.
        """
        if self._error is not None:
            raise RuntimeError("the Harbor rollout worker failed") from self._error
        age = time.monotonic() - self._heartbeat
        if self._thread is not None and age > stale_after_s:
            raise RuntimeError(f"the Harbor rollout worker produced nothing for {age:.0f} s (> {stale_after_s:.0f} s)")

    # ── the loop ───────────────────────────────────────────────────────────────────

    def _run(self) -> None:
        endpoint = CaptureEndpoint(self.sampler, self.renderer, self.sampling, max_model_len=self.max_model_len)
        inflight: list[Any] = []
        try:
            runtime.run(endpoint.start())
            group_id = 0
            while not self._stop.is_set():
                while len(inflight) < self.max_inflight_groups and not self._stop.is_set():
                    prompt = self.prompts[group_id % len(self.prompts)]
                    inflight.append(runtime.submit(self._group(endpoint, prompt, group_id, self.model_version)))
                    group_id += 1
                done = next((f for f in inflight if f.done()), None)
                if done is None:
                    time.sleep(0.05)
                    continue
                inflight.remove(done)
                for sample in done.result():
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                self.groups_done += 1
                self._heartbeat = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - reported through check_health
            self._error = exc
        finally:
            for future in inflight:
                future.cancel()
            runtime.run(endpoint.stop())

    async def _group(self, endpoint: CaptureEndpoint, prompt: Any, group_id: int, version: int) -> list[Any]:
        task_dir = task_dir_of(prompt)
        seeds = [derive_seed(self.seed, "async", group_id, index) for index in range(self.num_generations)]
        rollouts = await asyncio.gather(
            *(
                self.rollout_func.rollout(endpoint, task_dir, seed, budget=self.budget, max_turns=self.max_turns)
                for seed in seeds
            )
        )
        samples = group_samples(rollouts, prompt, version, group_id)
        with contextlib.suppress(queue.Full):  # the trainer reads metrics when it can: drop what does not fit
            self.metrics_queue.put_nowait(loop_metrics(rollouts))
        return samples
