"""``trl-harbor eval``: run a policy on a task suite and report pass@1, pass@k and mean reward.

The policy is any OpenAI-compatible chat-completions endpoint with tool calling (vLLM, SGLang,
``transformers serve``, a hosted API), or, with no ``base_url``, a local checkpoint (a hub id or
a path, e.g. the output folder of ``trl-harbor train``) generating with ``transformers`` in this
process, its tool calls parsed the way TRL parses them in training, or a model already in memory
(:class:`LocalPolicy`, what ``trl-harbor train`` measures before and after training).

Each rollout is what training does with the same harness and backend: ``reset`` the harness
for the task, hand the model its instruction and the harness's tools (the same JSON schemas TRL
builds), execute the tool calls it makes in the sandbox, and, once it answers without a tool
call (or runs out of turns), score the rollout with the task's Harbor verifier. Many rollouts
are in flight at once (``concurrency`` threads: the model's latency and the sandboxes overlap).
A local model plays every rollout's turn in one batched ``generate`` call (``batch_size`` rows at
a time), rollouts in a fixed order, so a seeded evaluation samples the same way every time; the
beginning the turn's prompts share (system prompt, tools, example turns) is run once, its cache
copied to each row.

The prompt can carry a system message and example turns in front of the task
(``system_prompt``, ``few_shot``: :mod:`trl_harbor.cli.prompting`), as in training.

``pass@k`` is the unbiased estimator of Chen et al. (2021) over the ``n`` scored rollouts of a
task, ``c`` of which passed (reward >= ``pass_threshold``): ``1 - C(n-c, k) / C(n, k)``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl_harbor import progress
from trl_harbor.options import HarborOptions
from trl_harbor.training.shared_prefix import SharedPrefix, shared_prefix
from trl_harbor.training.tools import tool_schemas

if TYPE_CHECKING:
    from trl_harbor.rollout.sources import SuiteSelection

__all__ = ["EndpointError", "EvalConfig", "EvalResult", "LocalPolicy", "TaskScore", "evaluate", "pass_at_k"]


class EndpointError(RuntimeError):
    """The chat-completions endpoint failed (HTTP error, timeout, or an answer that is no completion)."""


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed.

    Args:
        n: Scored samples.
        c: Passing samples.
        k: Attempts.

    Returns:
        The probability that at least one of ``k`` samples drawn without replacement passes;
        ``None`` when ``n < k``.
    """
    if n < k or k < 1:
        return None
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalConfig:
    """What ``trl-harbor eval`` runs.

    Attributes:
        dataset: The task suite, in any form of :mod:`trl_harbor.rollout.sources` (a folder, a Hugging
            Face dataset id, ``name@version``, ``hub:org/name``, a git repository, a ``suite.lock.json``).
        base_url: The endpoint's base URL, e.g. ``http://127.0.0.1:8000/v1``; ``None``: load
            ``model`` locally with ``transformers``.
        model: The model name the endpoint serves, or (no ``base_url``) a hub id or path.
        agent: The harness.
        environment_type: The sandbox backend.
        num_tasks: Use the first N tasks of the sorted suite.
        indices: Use these positions of the sorted suite.
        num_rollouts: Rollouts per task (``n``).
        k: The ``k`` values of pass@k to report.
        concurrency: Rollouts in flight at once.
        max_turns: Model turns per rollout (a turn's tool calls are run; then the next turn).
        temperature: Sampling temperature (0: greedy).
        top_p: Nucleus sampling: the smallest set of tokens whose probability reaches this.
        top_k: Sample among the k likeliest tokens (local model only; ``None`` or 0: all).
        max_tokens: Tokens per model turn.
        pass_threshold: A rollout passes when its reward is at least this.
        api_key: Bearer token (default: ``OPENAI_API_KEY``).
        request_timeout_sec: Seconds one request may take.
        options: How rollouts run and are graded (command timeout, output cap, reward key,
            infrastructure-failure policy, backend options, ...), as in training.
        output_dir: Where ``eval.json`` and ``trajectories.jsonl`` go.
        system_prompt: A system message in front of every task (``None``: none).
        few_shot: Example messages between the system message and the task
            (:func:`trl_harbor.cli.prompting.load_few_shot`'s form; ``None``: none).
        chat_template: A local model's chat template: a TRL template name (``qwen2_5``) or a file
            (``None``: the tokenizer's own). An endpoint applies its own.
        seed: Seed of a local model's sampling (``None``: not seeded).
        batch_size: Rollouts whose turn a local model generates in one batch.
        registry_url: A Harbor registry's URL, for a ``name@version`` dataset.
        registry_path: A Harbor ``registry.json`` on disk, for a ``name@version`` dataset.
        task_names: Globs of the task names to keep (Harbor's ``--include-task-name``).
        exclude_task_names: Globs of the task names to leave out.
        download_dir: Where fetched tasks are cached (default: Harbor's task cache).
    """

    dataset: str
    base_url: str | None
    model: str
    agent: str = "bash"
    environment_type: str = "local"
    num_tasks: int | None = None
    indices: list[int] | None = None
    num_rollouts: int = 4
    k: list[int] = field(default_factory=lambda: [1])
    concurrency: int = 16
    max_turns: int = 10
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 2048
    pass_threshold: float = 1.0
    api_key: str | None = None
    request_timeout_sec: float = 600.0
    options: HarborOptions = field(default_factory=HarborOptions)
    output_dir: str = "outputs/trl-harbor-eval"
    system_prompt: str | None = None
    few_shot: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    seed: int | None = None
    batch_size: int = 16
    registry_url: str | None = None
    registry_path: str | None = None
    task_names: list[str] | None = None
    exclude_task_names: list[str] | None = None
    download_dir: str | None = None

    def __post_init__(self) -> None:
        if self.num_rollouts < 1 or self.concurrency < 1 or self.max_turns < 1 or self.batch_size < 1:
            raise ValueError("--num-rollouts, --concurrency, --max-turns and --batch-size must be at least 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.chat_template is not None and self.base_url is not None:
            raise ValueError(
                "--chat-template sets a local model's template (no --base-url); an endpoint applies its own"
            )
        bad = [k for k in self.k if k < 1 or k > self.num_rollouts]
        if bad:
            raise ValueError(f"--k {bad}: each k must be between 1 and --num-rollouts ({self.num_rollouts})")

    @property
    def selection(self) -> SuiteSelection:
        """Where :attr:`dataset` comes from and which of its tasks to keep (its registry, filters and cache)."""
        from trl_harbor.rollout.sources import SuiteSelection

        return SuiteSelection.of(self)


@dataclass
class TaskScore:
    """One task's results.

    Attributes:
        task: The task's name.
        n: Scored rollouts.
        passed: Rollouts whose reward reached the threshold.
        mean_reward: Mean reward of the scored rollouts.
        pass_at: ``{k: pass@k}``.
        errors: Rollouts not scored (endpoint or infrastructure failure).
        tool_calls: Mean tool calls per rollout.
    """

    task: str
    n: int
    passed: int
    mean_reward: float | None
    pass_at: dict[int, float | None]
    errors: int
    tool_calls: float


@dataclass
class EvalResult:
    """A whole evaluation.

    Attributes:
        tasks: Per-task scores, in suite order.
        mean_reward: Mean over tasks of the per-task mean reward.
        pass_at: ``{k: mean over tasks of pass@k}``.
        rollouts: Rollouts run.
        errors: Rollouts not scored.
        seconds: Wall time.
        rollouts_per_minute: Throughput.
    """

    tasks: list[TaskScore]
    mean_reward: float | None
    pass_at: dict[int, float | None]
    rollouts: int
    errors: int
    seconds: float
    rollouts_per_minute: float


class LocalPolicy:
    """A model generating in this process: the chat template renders the tools, TRL's
    ``parse_response`` reads the tool calls back, as in training.

    Args:
        model: A causal LM (e.g. ``trainer.model``).
        tokenizer: Its tokenizer, with the chat template to use; a response parser is added for
            TRL's known templates when it has none.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from trl.chat_template_utils import add_response_schema

        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            try:
                tokenizer = add_response_schema(tokenizer)
            except ValueError:
                pass  # an unknown template: replies are read as text (no tool calls), as TRL would
        self.model = model
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, model: str, chat_template: str | None = None) -> LocalPolicy:
        """Load a checkpoint (hub id or path) for CPU or GPU generation.

        Args:
            model: The checkpoint.
            chat_template: A TRL template name or a Jinja file replacing the tokenizer's (``None``: keep it).

        Returns:
            The policy.

        Raises:
            OSError: When the checkpoint cannot be loaded.
            ValueError: For a bad ``chat_template``.
        """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        if chat_template is not None:
            from trl_harbor.cli.prompting import resolve_chat_template

            tokenizer.chat_template = resolve_chat_template(chat_template, option="--chat-template")
        loaded = AutoModelForCausalLM.from_pretrained(model)
        if torch.cuda.is_available():
            loaded = loaded.to("cuda")
        return cls(loaded, tokenizer)

    def chat_batch(self, conversations: Sequence[list[dict]], tools: list[dict], config: EvalConfig) -> list[dict]:
        """Generate one assistant turn for each conversation, ``config.batch_size`` at a time.

        Args:
            conversations: OpenAI-style messages per rollout (tool-call arguments as JSON strings).
            tools: The harness's tool schemas.
            config: Sampling settings (``temperature``, ``top_p``, ``top_k``, ``max_tokens``, ``batch_size``).

        Returns:
            One OpenAI-style assistant message per conversation, in order.
        """
        from trl.chat_template_utils import parse_response

        prompts = [self._prompt_ids(messages, tools) for messages in conversations]
        was_training = self.model.training
        self.model.eval()
        try:
            size = config.batch_size
            batches = range(0, len(prompts), size)
            progress.report("generation", 0, len(batches))
            prefix = shared_prefix(self.model, prompts)
            completions = []
            for done, start in enumerate(batches, 1):
                completions += self._generate(prompts[start : start + size], config, prefix)
                progress.report("generation", done, len(batches))
        finally:
            self.model.train(was_training)
        return [
            _reply(parse_response(self.tokenizer, ids, prefix=prompt, tools=tools))
            for prompt, ids in zip(prompts, completions, strict=True)
        ]

    def _prompt_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """The conversation rendered by the chat template, which wants tool-call arguments as objects."""
        rendered = []
        for message in messages:
            if message.get("tool_calls"):
                calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                         for c in message["tool_calls"]]  # fmt: skip
                message = {**message, "tool_calls": calls}
            rendered.append(message)
        ids = self.tokenizer.apply_chat_template(
            rendered, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def _generate(
        self, prompts: list[list[int]], config: EvalConfig, prefix: SharedPrefix | None = None
    ) -> list[list[int]]:
        """One ``generate`` call over the prompts (their shared ``prefix`` run once): each one's completion,
        up to its end token."""
        from trl_harbor.training.shared_prefix import generate_after_prefix

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        eos = self.tokenizer.eos_token_id
        sampling: dict[str, Any] = {"do_sample": False}
        if config.temperature > 0:
            sampling = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p,
                        "top_k": config.top_k or 0}  # fmt: skip
        completions = generate_after_prefix(
            self.model, prompts, prefix, pad, max_new_tokens=config.max_tokens, eos_token_id=eos, **sampling
        )
        return [row[: row.index(eos) + 1] if eos in row else row for row in completions]


def _reply(parsed: dict) -> dict:
    """TRL's parsed response as an OpenAI-style assistant message (tool-call arguments as JSON strings)."""
    calls = [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"].get("arguments", {}))}}
        for i, c in enumerate(parsed.get("tool_calls") or [])
    ]  # fmt: skip
    return {"role": "assistant", "content": parsed.get("content"), **({"tool_calls": calls} if calls else {})}


_loaded = functools.cache(LocalPolicy.from_pretrained)  # a model evaluated on several suites loads once


def _chat(config: EvalConfig, messages: list[dict], tools: list[dict]) -> dict:
    body = {
        "model": config.model,
        "messages": messages,
        "tools": tools,
        "temperature": config.temperature,
        "max_tokens": config.max_tokens,
        **({"top_p": config.top_p} if config.top_p < 1 else {}),
    }
    api_key = config.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    url = config.base_url.rstrip("/") + "/chat/completions"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=config.request_timeout_sec) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode(errors="replace")
        raise EndpointError(f"{url}: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, TimeoutError, OSError, json.JSONDecodeError) as exc:
        raise EndpointError(f"{url}: {exc}") from exc
    try:
        return payload["choices"][0]["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"{url}: the answer has no choices[0].message: {str(payload)[:300]}") from exc


def _prefix(config: EvalConfig) -> list[dict]:
    from trl_harbor.cli.prompting import openai_messages, prompt_prefix

    return openai_messages(prompt_prefix(config.system_prompt, config.few_shot))


def _run_calls(tools: dict[str, Callable[..., Any]], reply: dict) -> list[dict]:
    """Run an assistant message's tool calls in the sandbox; return the tool messages."""
    results = []
    for call in reply.get("tool_calls") or []:
        function = call.get("function") or {}
        name = function.get("name")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
            if not isinstance(arguments, dict):
                raise ValueError("arguments must be a JSON object")
            output = str(tools[name](**arguments)) if name in tools else f"Error: no tool named {name!r}"
        except (ValueError, TypeError) as exc:
            output = f"Error: bad arguments for {name}: {exc}"
        results.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": output})
    return results


def _assistant(reply: dict) -> dict:
    return {"role": "assistant", **{k: v for k, v in reply.items() if k in ("content", "tool_calls")}}


Played = tuple[Any, list[dict], str | None]  # a rollout's environment, its messages, the endpoint's error


def _play(
    config: EvalConfig, chat: Callable, factory: Callable[[], Any], rows: Sequence[dict], run=map
) -> list[Played]:
    """Play one rollout per row, turn by turn, until each answers without a tool call or runs out of turns.

    ``chat(conversations, tools)`` answers every rollout still going, then ``run`` (``map``, or a
    pool's) runs their tool calls. An endpoint error ends every rollout of the call.
    """
    envs = [factory() for _ in rows]
    prefix = _prefix(config)
    conversations = [
        [*prefix, {"role": "user", "content": env.reset(**row)}] for env, row in zip(envs, rows, strict=True)
    ]
    tools = [tool_schemas(env) for env in envs]
    active = list(range(len(envs)))
    error = None
    try:
        for _ in range(config.max_turns):
            if not active:
                break
            replies = chat([conversations[i] for i in active], tools[0][1])
            for i, reply in zip(active, replies, strict=True):
                conversations[i].append(_assistant(reply))
            active = [i for i, reply in zip(active, replies, strict=True) if reply.get("tool_calls")]
            outputs = run(lambda i: _run_calls(tools[i][0], conversations[i][-1]), active)
            for i, results in zip(active, outputs, strict=True):
                conversations[i].extend(results)
    except EndpointError as exc:
        error = str(exc)
    return [(env, messages, error) for env, messages in zip(envs, conversations, strict=True)]


def evaluate(
    config: EvalConfig, on_done: Callable[[int], None] | None = None, policy: LocalPolicy | None = None
) -> EvalResult:
    """Evaluate a model on the suite; write ``eval.json``, ``trajectories.jsonl`` and ``suite.lock.json``.

    Args:
        config: What to run.
        on_done: Called with the number of rollouts after each finished one (progress).
        policy: A model in memory to evaluate (``config.model`` then only names it); ``None``:
            the endpoint at ``config.base_url``, or ``config.model`` loaded locally.

    Returns:
        The result.

    Raises:
        ValueError: For a bad suite, harness, selection, chat template or few-shot example.
        trl_harbor.rollout.preflight.BackendUnavailableError: When the backend cannot start sandboxes here.
    """
    from trl_harbor import HarborSpec
    from trl_harbor.cli.trajectories import TrajectoryLog

    spec = HarborSpec(
        config.dataset,
        agent=config.agent,
        environment_type=config.environment_type,
        num_tasks=config.num_tasks,
        indices=config.indices,
        options=config.options,
        **config.selection.as_kwargs(),
    )
    if config.few_shot:
        from trl_harbor.cli.prompting import check_few_shot_tools, tool_names

        check_few_shot_tools(config.few_shot, tool_names(spec.env_cls), config.agent)
    spec.backend_check()  # a backend that cannot start sandboxes fails here, before a model loads
    if policy is None and config.base_url is None:
        try:
            policy = _loaded(config.model, config.chat_template)
        except OSError as exc:
            raise ValueError(f"--model {config.model!r} (no --base-url): cannot load it locally: {exc}") from exc
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    spec.write_lock(output_dir)  # suite.lock.json: the tasks evaluated, pinned (rerun: --dataset it)
    log = TrajectoryLog(output_dir / "trajectories.jsonl", environment_type=config.environment_type)
    log.path.unlink(missing_ok=True)
    rows = [dict(row) for row in spec.train_dataset.remove_columns("prompt")]
    start = time.monotonic()
    outcomes = _run(config, log, log.environment_factory(spec.environment_factory), rows, policy, on_done)
    result = _result(config, outcomes, time.monotonic() - start)
    record = {"config": {**asdict(config), "api_key": None}, **asdict(result)}
    (output_dir / "eval.json").write_text(json.dumps(record, indent=1))
    return result


def _run(config: EvalConfig, log: Any, factory: Callable[[], Any], rows: list[dict], policy: LocalPolicy | None,
         on_done: Callable[[int], None] | None) -> dict[str, list[tuple[float | None, int]]]:  # fmt: skip
    """Play, grade and log ``config.num_rollouts`` rollouts of each row; per task, each one's reward and tool calls."""
    from trl_harbor import close_all, release

    jobs = [(row, i) for row in rows for i in range(config.num_rollouts)]
    outcomes: dict[str, list[tuple[float | None, int]]] = {Path(row["task_dir"]).name: [] for row in rows}
    skip = len(_prefix(config)) + 1  # the log keeps what follows the task's own message

    def finish(job: tuple[dict, int], played: Played) -> tuple[str, float | None, int]:
        (row, index), (env, messages, endpoint_error) = job, played
        reward = None if endpoint_error else env.reward
        calls = sum(len(m.get("tool_calls") or []) for m in messages[skip:] if m["role"] == "assistant")
        extra = {"rollout": index, "endpoint_error": endpoint_error, "model": config.model}
        log.write([env], [reward], [messages[skip:]], extra=[extra])
        release(env)  # stop the sandbox now, not when the instance is collected
        return Path(row["task_dir"]).name, reward, calls

    def alone(job: tuple[dict, int]) -> tuple[str, float | None, int]:  # one rollout against the endpoint
        (played,) = _play(config, lambda chats, tools: [_chat(config, c, tools) for c in chats], factory, [job[0]])
        return finish(job, played)

    try:
        with ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="trl-harbor-eval") as pool:
            if policy is None:  # each rollout on its own thread: the endpoint's latency and the sandboxes overlap
                futures = [pool.submit(alone, job) for job in jobs]
            else:  # every rollout's turn in one batch, in a fixed order: a seeded evaluation samples the same
                if config.seed is not None:
                    import torch

                    torch.manual_seed(config.seed)
                chat = functools.partial(policy.chat_batch, config=config)
                played = _play(config, chat, factory, [row for row, _ in jobs], pool.map)
                futures = [pool.submit(finish, job, p) for job, p in zip(jobs, played, strict=True)]
            for future in as_completed(futures):
                task, reward, calls = future.result()
                outcomes[task].append((reward, calls))
                if on_done is not None:
                    on_done(len(jobs))
    finally:
        close_all()
    return outcomes


def _result(config: EvalConfig, outcomes: dict[str, list[tuple[float | None, int]]], seconds: float) -> EvalResult:
    """Per-task scores (pass@k over the scored rollouts) and their means."""
    scores = []
    for task, results in outcomes.items():
        rewards = [r for r, _ in results if r is not None]
        passed = sum(r >= config.pass_threshold for r in rewards)
        scores.append(
            TaskScore(
                task=task,
                n=len(rewards),
                passed=passed,
                mean_reward=_mean(rewards),
                pass_at={k: pass_at_k(len(rewards), passed, k) for k in config.k},
                errors=len(results) - len(rewards),
                tool_calls=sum(c for _, c in results) / len(results) if results else 0.0,
            )
        )
    rollouts = sum(len(results) for results in outcomes.values())
    return EvalResult(
        tasks=scores,
        mean_reward=_mean([s.mean_reward for s in scores]),
        pass_at={k: _mean([s.pass_at[k] for s in scores]) for k in config.k},
        rollouts=rollouts,
        errors=sum(s.errors for s in scores),
        seconds=round(seconds, 2),
        rollouts_per_minute=round(60 * rollouts / seconds, 1) if seconds > 0 else 0.0,
    )


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
