"""``trl-harbor eval`` against a real HTTP endpoint on loopback.

The endpoint is a *scripted* OpenAI-compatible chat-completions server: it stands in for a
model only so that the tool calls — and so the outcomes — are known in advance. Everything under
it is real: the HTTP round trips, the harness and its tools, the local bubblewrap sandboxes and
Harbor's verifier, which alone decides each reward.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, requires_local

from trl_harbor.cli import main as cli_main
from trl_harbor.cli.evaluate import pass_at_k
from trl_harbor.cli.trajectories import read_trajectories
from trl_harbor.training.shared_prefix import shared_prefix

WRONG = "echo -n 0 > /workdir/answer.txt"
#: Per task, the first-turn command of each successive rollout ("right": the reference solution).
SCRIPT = {
    "http_500_count": ["right", "right", WRONG, WRONG],
    "orders_count": [WRONG, WRONG, WRONG, WRONG],
    "priciest_product": ["right", "right", "right", "right"],
}


class ScriptedEndpoint:
    """A scripted chat-completions server: the first turn calls ``bash`` with the scripted command,
    the turn after a tool result answers in prose. It records every request and how many were in
    flight at once (the first requests wait, up to a few seconds, for company)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.company = threading.Event()
        self.next = dict.fromkeys(SCRIPT, 0)
        self.titles = {name: (BUNDLED_SUITE / name / "instruction.md").read_text().splitlines()[0] for name in SCRIPT}
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests.append(body)
                    endpoint.in_flight += 1
                    endpoint.max_in_flight = max(endpoint.max_in_flight, endpoint.in_flight)
                    if endpoint.in_flight >= 2:
                        endpoint.company.set()
                try:
                    endpoint.company.wait(timeout=5)
                    message = endpoint.answer(body)
                finally:
                    with endpoint.lock:
                        endpoint.in_flight -= 1
                data = json.dumps(
                    {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, body: dict) -> dict:
        messages = body["messages"]
        if messages[-1]["role"] == "tool":
            return {"role": "assistant", "content": "I wrote the answer."}
        instruction = [m for m in messages if m["role"] == "user"][-1]["content"]  # after any example turns
        task = next(name for name, title in self.titles.items() if title in instruction)
        with self.lock:
            choice = SCRIPT[task][self.next[task]]
            self.next[task] += 1
        command = (BUNDLED_SUITE / task / "solution" / "solve.sh").read_text().strip() if choice == "right" else choice
        call = {
            "id": f"call_{task}",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.fixture
def endpoint() -> Iterator[ScriptedEndpoint]:
    server = ScriptedEndpoint()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_pass_at_k_estimator() -> None:
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(1, 1, 2) is None


@requires_local
def test_eval_reports_known_pass_at_k(tmp_path: Path, copy_tasks, endpoint: ScriptedEndpoint, close_sandboxes) -> None:
    suite = copy_tasks(*SCRIPT)
    out = tmp_path / "eval"
    argv = ["eval", str(suite), "--base-url", endpoint.url, "--model", "scripted", "-n", "4",
            "--k", "1", "--k", "2", "--concurrency", "6", "--output-dir", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    result = json.loads((out / "eval.json").read_text())
    by_task = {t["task"]: t for t in result["tasks"]}
    assert by_task["http_500_count"]["passed"] == 2
    assert by_task["http_500_count"]["pass_at"]["1"] == pytest.approx(0.5)
    assert by_task["http_500_count"]["pass_at"]["2"] == pytest.approx(5 / 6)
    assert by_task["orders_count"]["pass_at"] == {"1": 0.0, "2": 0.0}
    assert by_task["priciest_product"]["pass_at"] == {"1": 1.0, "2": 1.0}
    assert result["pass_at"]["1"] == pytest.approx(0.5)
    assert result["pass_at"]["2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert result["mean_reward"] == pytest.approx(0.5)
    # The tasks evaluated, pinned: names and digests, read back as a suite (docs/datasets.md).
    from trl_harbor.rollout.suite_lock import read_lock

    (locked,) = read_lock(out / "suite.lock.json")
    assert sorted(t.name for t in locked.tasks) == sorted(by_task) and all(t.digest for t in locked.tasks)
    assert result["rollouts"] == 12 and result["errors"] == 0
    # Rollouts were in flight at once, and the model was offered the harness's bash tool.
    assert endpoint.max_in_flight >= 2
    assert endpoint.requests[0]["tools"][0]["function"]["name"] == "bash"
    assert "command" in endpoint.requests[0]["tools"][0]["function"]["parameters"]["properties"]
    # One trajectory line per rollout, matching what ran.
    rows = read_trajectories(out / "trajectories.jsonl")
    assert len(rows) == 12
    for row in rows:
        (call,) = row["tool_calls"]
        right = call["arguments"]["command"] != WRONG
        assert row["reward"] == (1.0 if right else 0.0), row
        assert row["final_message"] == "I wrote the answer." and row["endpoint_error"] is None


@requires_local
def test_eval_counts_an_unreachable_endpoint_as_errors(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    suite = copy_tasks("orders_count")
    out = tmp_path / "eval"
    argv = [
        "eval",
        str(suite),
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model",
        "m",
        "-n",
        "2",
        "--output-dir",
        str(out),
    ]
    assert cli_main(argv) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["errors"] == 2 and result["tasks"][0]["n"] == 0 and result["mean_reward"] is None
    rows = read_trajectories(out / "trajectories.jsonl")
    assert all(row["endpoint_error"] and row["reward"] is None for row in rows)


@requires_local
def test_eval_a_local_checkpoint_without_an_endpoint(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    """``--model PATH`` and no ``--base-url``: the checkpoint generates in-process, TRL parses its calls.

    The checkpoint is the demo policy with one task's right command and the other task's wrong
    command made certain, so the outcomes are known.
    """
    import torch

    from demo_policy import _FIRST_TASK, build_demo_policy
    from trl_harbor import HarborSpec
    from trl_harbor.testing import tool_call_text

    suite = copy_tasks("http_500_count", "orders_count")
    spec = HarborSpec(suite, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)

    def token(command: str) -> int:
        return policy.tokenizer(tool_call_text("bash", {"command": command}), add_special_tokens=False)["input_ids"][0]

    with torch.no_grad():
        policy.model.lm_head.weight[token(policy.right["http_500_count"]), _FIRST_TASK + 0] += 20
        policy.model.lm_head.weight[token(WRONG), _FIRST_TASK + 1] += 20
    checkpoint = tmp_path / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "eval"
    assert cli_main(["eval", str(suite), "--model", str(checkpoint), "-n", "3", "--output-dir", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    by_task = {t["task"]: t for t in result["tasks"]}
    assert by_task["http_500_count"]["pass_at"]["1"] == 1.0 and by_task["orders_count"]["pass_at"]["1"] == 0.0
    assert result["errors"] == 0
    rows = read_trajectories(out / "trajectories.jsonl")
    assert len(rows) == 6
    for row in rows:
        (call,) = row["tool_calls"]
        expected = policy.right["http_500_count"] if row["task"] == "http_500_count" else WRONG
        assert call["arguments"]["command"] == expected


def _few_shot(tmp_path: Path) -> Path:
    path = tmp_path / "shots.json"
    path.write_text(json.dumps([
        {"role": "user", "content": "Say hi with the bash tool."},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "bash", "arguments": {"command": "echo hi"}}]},
        {"role": "tool", "name": "bash", "content": "hi"},
        {"role": "assistant", "content": "Done."},
    ]))  # fmt: skip
    return path


@requires_local
def test_eval_sends_the_system_prompt_and_examples(
    tmp_path: Path, copy_tasks, endpoint: ScriptedEndpoint, close_sandboxes
) -> None:
    """``--system-prompt`` and ``--few-shot`` reach the endpoint in OpenAI's form; the log keeps the rollout only."""
    suite = copy_tasks("priciest_product")
    out = tmp_path / "eval"
    argv = ["eval", str(suite), "--base-url", endpoint.url, "--model", "scripted", "-n", "2", "--output-dir", str(out),
            "--system-prompt", "Be brief.", "--few-shot", str(_few_shot(tmp_path))]  # fmt: skip
    assert cli_main(argv) == 0
    first = endpoint.requests[0]["messages"]
    assert first[0] == {"role": "system", "content": "Be brief."}
    assert first[1] == {"role": "user", "content": "Say hi with the bash tool."}
    (call,) = first[2]["tool_calls"]
    assert call["function"] == {"name": "bash", "arguments": '{"command": "echo hi"}'} and call["id"]
    assert first[3] == {"role": "tool", "name": "bash", "content": "hi", "tool_call_id": call["id"]}
    assert first[4] == {"role": "assistant", "content": "Done."} and first[5]["role"] == "user"
    assert json.loads((out / "eval.json").read_text())["pass_at"]["1"] == 1.0
    for row in read_trajectories(out / "trajectories.jsonl"):
        assert [c["arguments"]["command"] for c in row["tool_calls"]] != ["echo hi"]  # the example is not logged
        assert len(row["tool_calls"]) == 1 and row["final_message"] == "I wrote the answer."


def test_eval_refuses_a_chat_template_for_an_endpoint(tmp_path: Path, capsys) -> None:
    argv = ["eval", str(BUNDLED_SUITE), "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
            "--chat-template", "qwen2_5", "--output-dir", str(tmp_path / "x")]  # fmt: skip
    assert cli_main(argv) == 2
    assert "--chat-template sets a local model's template" in capsys.readouterr().out


@requires_local
def test_eval_a_local_model_with_the_prompt_options_in_one_batch(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    """A local checkpoint with a system prompt, examples and a named chat template, every rollout's turn in one batch.

    The checkpoint is the hand-wired test policy with outcomes made certain, so the prompt's extra
    turns change nothing it does; the rendered prompt is checked to hold them.
    """
    import torch

    from demo_policy import _FIRST_TASK, build_demo_policy
    from trl_harbor import HarborSpec
    from trl_harbor.cli.evaluate import EvalConfig, LocalPolicy, evaluate
    from trl_harbor.cli.prompting import load_few_shot, resolve_chat_template
    from trl_harbor.testing import tool_call_text

    suite = copy_tasks("http_500_count", "orders_count")
    spec = HarborSpec(suite, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)

    def token(command: str) -> int:
        return policy.tokenizer(tool_call_text("bash", {"command": command}), add_special_tokens=False)["input_ids"][0]

    with torch.no_grad():
        policy.model.lm_head.weight[token(policy.right["http_500_count"]), _FIRST_TASK + 0] += 40
        policy.model.lm_head.weight[token(WRONG), _FIRST_TASK + 1] += 40
    checkpoint = tmp_path / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    local = LocalPolicy.from_pretrained(str(checkpoint), chat_template="qwen3")
    assert local.tokenizer.chat_template == resolve_chat_template("qwen3")
    seen: list[int] = []
    batch = local.chat_batch

    def counted(conversations, tools, config):
        seen.append(len(conversations))
        prompt = local.tokenizer.apply_chat_template(conversations[0], tools=tools, tokenize=False)
        assert prompt.startswith("<|im_start|>system\nBe brief.") and "echo hi" in prompt
        return batch(conversations, tools, config)

    local.chat_batch = counted
    config = EvalConfig(dataset=str(suite), base_url=None, model="demo", num_rollouts=3, seed=7, batch_size=16,
                        system_prompt="Be brief.", few_shot=load_few_shot(_few_shot(tmp_path)),
                        output_dir=str(tmp_path / "eval"))  # fmt: skip
    result = evaluate(config, policy=local)
    by_task = {t.task: t.passed for t in result.tasks}
    assert by_task == {"http_500_count": 3, "orders_count": 0} and result.errors == 0
    assert seen[0] == 6  # all six rollouts' first turns in one generate call
    rows = read_trajectories(tmp_path / "eval" / "trajectories.jsonl")
    assert len(rows) == 6 and all(len(row["tool_calls"]) == 1 for row in rows)


def test_a_local_model_runs_the_prompts_shared_beginning_once_and_generates_the_same(tmp_path: Path) -> None:
    """Every prompt of a turn starts with the same system prompt, tools and example turns: the local
    policy runs them once (a cache copied per row) and generates what it generates without the cache."""
    from transformers.utils import get_json_schema

    from trl_harbor import HarborBashEnv
    from trl_harbor.cli.evaluate import EvalConfig, LocalPolicy
    from trl_harbor.testing import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    policy = LocalPolicy(build_model(tokenizer, seed=3), tokenizer)
    tools = [get_json_schema(HarborBashEnv.bash)]
    examples = [
        {"role": "user", "content": "Write the word green into /workdir/colour.txt."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {
            "name": "bash", "arguments": '{"command": "echo green > /workdir/colour.txt"}'}}]},
    ]  # fmt: skip
    asks = ["List the files.", "Count the lines of /workdir/data/a.csv, please.", "Hi", "Print the date and time now."]
    conversations = [
        [{"role": "system", "content": "Be brief."}, *examples, {"role": "user", "content": a}] for a in asks
    ]
    prompts = [policy._prompt_ids(c, tools) for c in conversations]
    config = EvalConfig(dataset=".", base_url=None, model="tiny", temperature=0.0, max_tokens=12, batch_size=3,
                        output_dir=str(tmp_path))  # fmt: skip

    run: list[int] = []  # tokens each forward pass of the model is given
    hook = policy.model.register_forward_pre_hook(
        lambda _m, args, kwargs: run.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        plain = [ids for start in (0, 3) for ids in policy._generate(prompts[start : start + 3], config)]
        plain_tokens, run[:] = sum(run), []
        prefix = shared_prefix(policy.model, prompts)
        assert prefix is not None and len(prefix.ids) >= 32
        assert all(p[: len(prefix.ids)] == prefix.ids for p in prompts)
        cached = [ids for start in (0, 3) for ids in policy._generate(prompts[start : start + 3], config, prefix)]
        cached_tokens = sum(run)
    finally:
        hook.remove()
    assert cached == plain  # greedy: the same completions, token for token
    assert any(len(ids) > 1 for ids in plain)
    # The shared part runs once instead of once per row (four rows here).
    assert cached_tokens <= plain_tokens - 2 * len(prefix.ids)
    replies = policy.chat_batch(conversations, tools, config)
    assert len(replies) == len(asks) and all(r["role"] == "assistant" for r in replies)


@requires_local
def test_eval_several_suites_each_on_its_own(
    tmp_path: Path, copy_tasks, endpoint: ScriptedEndpoint, close_sandboxes
) -> None:
    first = copy_tasks("http_500_count", dest="first")
    second = copy_tasks("priciest_product", dest="second")
    out = tmp_path / "eval"
    argv = ["eval", str(first), str(second), "--base-url", endpoint.url, "--model", "scripted", "-n", "2",
            "--output-dir", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    one = json.loads((out / "first" / "eval.json").read_text())
    two = json.loads((out / "second" / "eval.json").read_text())
    assert [t["task"] for t in one["tasks"]] == ["http_500_count"]
    assert [t["task"] for t in two["tasks"]] == ["priciest_product"] and two["pass_at"]["1"] == 1.0
