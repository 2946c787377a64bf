"""``trl-harbor eval``: run a policy on a task suite and report pass@1, pass@k and mean reward.

The policy is any OpenAI-compatible chat-completions endpoint with tool calling (vLLM, SGLang,
``transformers serve``, a hosted API), or, with no ``base_url``, a local checkpoint (a hub id or
a path, e.g. the output folder of ``trl-harbor train``) generating with ``transformers`` in this
process, its tool calls parsed the way TRL parses them in training.

Each rollout is what training does with the same harness and backend: ``reset`` the harness
for the task, hand the model its instruction and the harness's tools (the same JSON schemas TRL
builds), execute the tool calls it makes in the sandbox, and, once it answers without a tool
call (or runs out of turns), score the rollout with the task's Harbor verifier. Many rollouts
are in flight at once (``concurrency`` threads: the model's latency and the sandboxes overlap).

``pass@k`` is the unbiased estimator of Chen et al. (2021) over the ``n`` scored rollouts of a
task, ``c`` of which passed (reward >= ``pass_threshold``): ``1 - C(n-c, k) / C(n, k)``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trl_harbor.options import HarborOptions
from trl_harbor.tools import tool_schemas

__all__ = ["EndpointError", "EvalConfig", "EvalResult", "TaskScore", "evaluate", "pass_at_k"]

logger = logging.getLogger(__name__)


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
        dataset: The task suite (a folder or a Hugging Face dataset id).
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
        max_turns: Model turns per rollout.
        temperature: Sampling temperature.
        max_tokens: Tokens per model turn.
        pass_threshold: A rollout passes when its reward is at least this.
        api_key: Bearer token (default: ``OPENAI_API_KEY``).
        request_timeout_sec: Seconds one request may take.
        options: How rollouts run and are graded (command timeout, output cap, reward key,
            infrastructure-failure policy, backend options, ...), as in training.
        output_dir: Where ``eval.json`` and ``trajectories.jsonl`` go.
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
    max_tokens: int = 2048
    pass_threshold: float = 1.0
    api_key: str | None = None
    request_timeout_sec: float = 600.0
    options: HarborOptions = field(default_factory=HarborOptions)
    output_dir: str = "outputs/trl-harbor-eval"

    def __post_init__(self) -> None:
        if self.num_rollouts < 1 or self.concurrency < 1 or self.max_turns < 1:
            raise ValueError("--num-rollouts, --concurrency and --max-turns must be at least 1")
        bad = [k for k in self.k if k < 1 or k > self.num_rollouts]
        if bad:
            raise ValueError(f"--k {bad}: each k must be between 1 and --num-rollouts ({self.num_rollouts})")


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


class _LocalPolicy:
    """A checkpoint generating in this process: the chat template renders the tools, TRL's
    ``parse_response`` reads the tool calls back (one generation at a time, under a lock)."""

    def __init__(self, model: str) -> None:
        import threading

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl.chat_template_utils import add_response_schema

        self.torch = torch
        self.tokenizer = add_response_schema(AutoTokenizer.from_pretrained(model))
        self.model = AutoModelForCausalLM.from_pretrained(model)
        self.model.eval()
        self.lock = threading.Lock()

    def chat(self, messages: list[dict], tools: list[dict], temperature: float, max_tokens: int) -> dict:
        from trl.chat_template_utils import parse_response

        rendered = []
        for message in messages:  # the chat template wants tool-call arguments as objects
            if message.get("tool_calls"):
                calls = [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in message["tool_calls"]
                ]
                message = {**message, "tool_calls": calls}
            rendered.append(message)
        prompt = self.tokenizer.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
        with self.lock, self.torch.no_grad():
            output = self.model.generate(
                self.torch.tensor([prompt]),
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                max_new_tokens=max_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        ids = output[0, len(prompt) :].tolist()
        parsed = parse_response(self.tokenizer, ids, prefix=prompt, tools=tools)
        calls = [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"].get("arguments", {}))}}
            for i, c in enumerate(parsed.get("tool_calls") or [])
        ]  # fmt: skip
        return {"role": "assistant", "content": parsed.get("content"), **({"tool_calls": calls} if calls else {})}


_LOCAL: dict[str, _LocalPolicy] = {}


def _chat(config: EvalConfig, messages: list[dict], tools: list[dict]) -> dict:
    if config.base_url is None:
        try:
            policy = _LOCAL[config.model]
        except KeyError:
            raise EndpointError(f"the local model {config.model!r} is not loaded") from None
        return policy.chat(messages, tools, config.temperature, config.max_tokens)
    body = {
        "model": config.model,
        "messages": messages,
        "tools": tools,
        "temperature": config.temperature,
        "max_tokens": config.max_tokens,
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


def _rollout(config: EvalConfig, factory: Callable[[], Any], row: dict) -> tuple[Any, list[dict], str | None]:
    """Run one rollout; return its environment, its messages and an endpoint error (or ``None``)."""
    env = factory()
    prompt = env.reset(**row)
    tools, schemas = tool_schemas(env)
    messages: list[dict] = [{"role": "user", "content": prompt}]
    try:
        for _ in range(config.max_turns):
            reply = _chat(config, messages, schemas)
            calls = reply.get("tool_calls") or []
            kept = {k: v for k, v in reply.items() if k in ("content", "tool_calls")}
            messages.append({"role": "assistant", **kept})
            if not calls:
                break
            for call in calls:
                function = call.get("function") or {}
                name = function.get("name")
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                    if not isinstance(arguments, dict):
                        raise ValueError("arguments must be a JSON object")
                    output = str(tools[name](**arguments)) if name in tools else f"Error: no tool named {name!r}"
                except (ValueError, TypeError) as exc:
                    output = f"Error: bad arguments for {name}: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": output})
    except EndpointError as exc:
        return env, messages, str(exc)
    return env, messages, None


def evaluate(config: EvalConfig, on_done: Callable[[int], None] | None = None) -> EvalResult:
    """Evaluate the endpoint's model on the suite; write ``eval.json`` and ``trajectories.jsonl``.

    Args:
        config: What to run.
        on_done: Called with the number of rollouts after each finished one (progress).

    Returns:
        The result.

    Raises:
        ValueError: For a bad suite, harness or selection.
    """
    from trl_harbor import HarborSpec, release
    from trl_harbor.trajectories import TrajectoryLog

    spec = HarborSpec(
        config.dataset,
        agent=config.agent,
        environment_type=config.environment_type,
        num_tasks=config.num_tasks,
        indices=config.indices,
        options=config.options,
    )
    if config.base_url is None and config.model not in _LOCAL:
        try:
            _LOCAL[config.model] = _LocalPolicy(config.model)
        except OSError as exc:
            raise ValueError(f"--model {config.model!r} (no --base-url): cannot load it locally: {exc}") from exc
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    log = TrajectoryLog(output_dir / "trajectories.jsonl", environment_type=config.environment_type)
    log.path.unlink(missing_ok=True)
    factory = log.environment_factory(spec.environment_factory)
    rows = [dict(row) for row in spec.train_dataset.remove_columns("prompt")]
    jobs = [(row, i) for row in rows for i in range(config.num_rollouts)]
    outcomes: dict[str, list[tuple[float | None, int]]] = {Path(row["task_dir"]).name: [] for row in rows}

    def one(row: dict, index: int) -> tuple[str, float | None, int]:
        env, messages, endpoint_error = _rollout(config, factory, row)
        reward = None if endpoint_error else env.reward
        calls = sum(len(m.get("tool_calls") or []) for m in messages if m["role"] == "assistant")
        extra = {"rollout": index, "endpoint_error": endpoint_error, "model": config.model}
        log.write([env], [reward], [messages[1:]], extra=[extra])
        release(env)  # stop the sandbox now, not when the instance is collected
        return Path(row["task_dir"]).name, reward, calls

    start = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="trl-harbor-eval") as pool:
            futures = [pool.submit(one, row, i) for row, i in jobs]
            for future in as_completed(futures):
                task, reward, calls = future.result()
                outcomes[task].append((reward, calls))
                if on_done is not None:
                    on_done(len(jobs))
    finally:
        from trl_harbor import close_all

        close_all()
    seconds = time.monotonic() - start
    scores = []
    for task, results in outcomes.items():
        rewards = [r for r, _ in results if r is not None]
        passed = sum(r >= config.pass_threshold for r in rewards)
        scores.append(
            TaskScore(
                task=task,
                n=len(rewards),
                passed=passed,
                mean_reward=sum(rewards) / len(rewards) if rewards else None,
                pass_at={k: pass_at_k(len(rewards), passed, k) for k in config.k},
                errors=len(results) - len(rewards),
                tool_calls=sum(c for _, c in results) / len(results) if results else 0.0,
            )
        )

    def mean(values: Sequence[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    result = EvalResult(
        tasks=scores,
        mean_reward=mean([s.mean_reward for s in scores]),
        pass_at={k: mean([s.pass_at[k] for s in scores]) for k in config.k},
        rollouts=len(jobs),
        errors=sum(s.errors for s in scores),
        seconds=round(seconds, 2),
        rollouts_per_minute=round(60 * len(jobs) / seconds, 1) if seconds > 0 else 0.0,
    )
    record = {"config": {**asdict(config), "api_key": None}, **asdict(result)}
    (output_dir / "eval.json").write_text(json.dumps(record, indent=1))
    return result
