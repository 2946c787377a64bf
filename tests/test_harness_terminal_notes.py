"""The TerminalNotes example harness: its tools in real local sandboxes, a scripted episode that
solves a bundled task, no leftover processes, and a CPU GRPOTrainer step with its 10 tools."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

import pytest
from conftest import (
    BUNDLED_SUITE,
    GOLD_ANSWER,
    GOLD_TASK,
    REPO,
    no_process_left,
    requires_local,
    tiny_grpo_trainer,
    trl_tools,
)

from sandbox_helpers import count_processes_cmd, live_processes_with, wait_until
from trl_harbor import close_all
from trl_harbor.training.agents import resolve_agent

# TRL's documented path (examples/grpo_harbor/harnesses is a symlink to its folder)
HARNESS = REPO / "examples" / "scripts" / "harbor" / "harnesses" / "terminal_notes"
AGENT = f"{HARNESS / 'env.py'}:TerminalNotesEnv"
GOLD_DIR = str(BUNDLED_SUITE / GOLD_TASK)
TOOLS = sorted(
    [
        "shell_exec",
        "shell_write_content_to_file",
        "shell_write_to_process",
        "shell_view",
        "shell_wait",
        "shell_kill_process",
        "create_note",
        "append_note",
        "read_note",
        "list_note",
    ]
)


@pytest.fixture(scope="module")
def env_cls() -> type:
    return resolve_agent(AGENT)


@pytest.fixture(scope="module")
def env(env_cls: type):
    """One sandbox shared by the tool tests of this module (each test uses its own files)."""
    env = env_cls(environment_type="local", command_timeout_sec=30, wait_timeout_sec=3)
    env.reset(task_dir=GOLD_DIR)
    yield env
    close_all()


# ── tool surface (no sandbox) ────────────────────────────────────────────────────────────


def test_loadable_by_path_and_by_builtin_name(env_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_cls.__name__ == "TerminalNotesEnv"
    assert resolve_agent("terminal_notes") is env_cls
    monkeypatch.chdir(REPO)  # the paths users of the reference pass, relative to the checkout
    assert resolve_agent("examples/scripts/harbor/harnesses/terminal_notes/env.py:TerminalNotesEnv") is env_cls
    assert resolve_agent("examples/grpo_harbor/harnesses/terminal_notes/env.py:TerminalNotesEnv") is env_cls
    with pytest.raises(ValueError, match="terminal_notes"):
        resolve_agent("terminal-notes")


def test_tools_and_schemas(env_cls: type) -> None:
    from transformers.utils import get_json_schema

    assert trl_tools(env_cls) == TOOLS
    for name in TOOLS:
        schema = get_json_schema(getattr(env_cls, name))["function"]
        assert schema["name"] == name and schema["description"]
        for arg, spec in schema["parameters"].get("properties", {}).items():
            assert spec.get("description"), (name, arg)
    shell_exec = get_json_schema(env_cls.shell_exec)["function"]["parameters"]
    assert shell_exec["required"] == ["command"]
    assert shell_exec["properties"]["blocking"]["type"] == "boolean"
    write = get_json_schema(env_cls.shell_write_content_to_file)["function"]["parameters"]
    assert write["required"] == ["path", "content"]
    assert get_json_schema(env_cls.shell_wait)["function"]["parameters"]["properties"]["pid"]["type"] == "string"
    assert get_json_schema(env_cls.list_note)["function"]["parameters"].get("properties", {}) == {}
    for word in (*TOOLS, "/workdir/answer.txt"):
        assert word in env_cls.PROMPT_SUFFIX, word


def test_notes_without_sandbox(env_cls: type) -> None:
    env = env_cls(environment_type="local")
    assert env.list_note() == "(no notes yet)"
    assert env.read_note("x").startswith("Error: there is no note 'x'")
    assert env.append_note("x", "y").startswith("Error: there is no note 'x'")
    assert "created" in env.create_note("plan", "1. look at the data")
    assert "now has" in env.append_note("plan", "2. compute")
    assert env.read_note("plan") == "1. look at the data\n2. compute"
    assert "replaced" in env.create_note("plan", "new")
    env.create_note("facts", "B has 3 sites")
    assert env.list_note() == "- plan (3 characters)\n- facts (13 characters)"
    assert env.shell_exec("ls").startswith("Error: no sandbox")


# ── tools in a real sandbox ──────────────────────────────────────────────────────────────


@requires_local
def test_background_process_runs_without_any_stdin_write(env) -> None:
    out = env.shell_exec("echo first; sleep 0.3; echo second", blocking=False)
    pid = out.split("PID=")[1].split(".")[0]
    assert pid.isdigit(), out
    waited = env.shell_wait(pid)
    assert "exited with code 0" in waited and "first\nsecond" in waited, waited
    # a process that reads stdin starts at once too, and waits for input
    pid = env.shell_exec("echo ready; read line; echo got:$line", blocking=False).split("PID=")[1].split(".")[0]
    time.sleep(0.3)
    view = env.shell_view(pid)
    assert "running" in view and "ready" in view and "got:" not in view, view


@requires_local
def test_background_process_write_view_wait_kill(env) -> None:
    script = 'while read -r line; do echo "got:$line"; [ "$line" = quit ] && exit 7; done'
    pid = env.shell_exec(script, blocking=False).split("PID=")[1].split(".")[0]
    assert "stdin of PID" in env.shell_write_to_process(pid, "hello world")
    deadline = time.monotonic() + 5
    while "got:hello world" not in (view := env.shell_view(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "got:hello world" in view and "running" in view, view
    env.shell_write_to_process(pid, "quit")
    waited = env.shell_wait(pid)
    assert "exited with code 7" in waited and "got:quit" in waited, waited
    assert "Error: nothing was sent" in env.shell_write_to_process(pid, "late")
    assert "was not running" in env.shell_kill_process(pid)

    # a bounded wait on a process that runs on, then kill it (with its children)
    pid = env.shell_exec("sleep 300 & sleep 301; echo never", blocking=False).split("PID=")[1].split(".")[0]
    started = time.monotonic()
    waited = env.shell_wait(pid)
    assert "still running after waiting 3 s" in waited and time.monotonic() - started < 10, waited
    assert env.shell_kill_process(pid) == f"Killed PID {pid} and its child processes."
    view = env.shell_view(pid)
    assert "exited with code killed" in view and "never" not in view, view
    assert env.shell_exec(count_processes_cmd("sleep 30")).strip() == "0"
    assert env.shell_view("99999").startswith("Error: no background process with PID '99999'")


@requires_local
def test_silent_write_reports_success_and_writes_exactly(env) -> None:
    assert env.shell_write_content_to_file("/workdir/out/a b/answer.txt", "42") == (
        "Wrote 2 bytes to /workdir/out/a b/answer.txt."
    )
    assert env.shell_exec("cat '/workdir/out/a b/answer.txt'") == "42"
    tricky = "line1\n'quotes' \"double\" $HOME `id` \\ EOF\n\x00\x01\xff é 🙂\r\n-n no newline at end"
    data = tricky.encode("utf-8")
    assert env.shell_write_content_to_file("rel.bin", tricky) == f"Wrote {len(data)} bytes to rel.bin."
    digest = env.shell_exec("sha256sum /workdir/rel.bin").split()[0]
    assert digest == hashlib.sha256(data).hexdigest()
    big = "".join(chr(32 + i % 90) for i in range(300_000))  # several command-line chunks
    assert env.shell_write_content_to_file("/tmp/big.txt", big) == "Wrote 300000 bytes to /tmp/big.txt."
    assert env.shell_exec("sha256sum /tmp/big.txt").split()[0] == hashlib.sha256(big.encode()).hexdigest()
    assert env.shell_write_content_to_file("/tmp/empty", "") == "Wrote 0 bytes to /tmp/empty."
    assert env.shell_exec("wc -c < /tmp/empty").strip() == "0"
    error = env.shell_write_content_to_file("/proc/nope/x", "1")
    assert error.startswith("Error: could not write /proc/nope/x"), error


# ── episodes ─────────────────────────────────────────────────────────────────────────────

SOLVER = """\
import json, sys
from datetime import datetime, timezone
doc = json.load(open("data/sensors.json"))
vals = [r["value"] for s in doc["sites"] if s["building"] == "B" for n in s["sensors"] if n["type"] == "humidity"
        for r in n["readings"] if r.get("flag") is None
        and (t := datetime.fromisoformat(r["ts"]).astimezone(timezone.utc)).year == 2024 and t.month == 3]
print(f"{sum(vals) / len(vals):.2f}")
"""


@requires_local
def test_scripted_episode_solves_the_task_and_leaves_no_process(env_cls: type, close_sandboxes: None) -> None:
    marker = f"trl-harbor-leak-{uuid.uuid4().hex[:8]}"
    env = env_cls(environment_type="local", command_timeout_sec=30)
    prompt = env.reset(task_dir=GOLD_DIR)
    assert prompt.endswith(env_cls.PROMPT_SUFFIX)
    env.create_note("plan", "solve with a script")
    assert "Wrote" in env.shell_write_content_to_file("/workdir/solve.py", SOLVER)
    pid = env.shell_exec("python3 solve.py", blocking=False).split("PID=")[1].split(".")[0]
    answer = env.shell_wait(pid).strip().splitlines()[-1]
    assert answer == GOLD_ANSWER
    env.append_note("plan", f"answer {answer}")
    assert env.shell_write_content_to_file("/workdir/answer.txt", answer) == "Wrote 5 bytes to /workdir/answer.txt."
    started = env.shell_exec(f"sleep 600 # {marker}", blocking=False)
    assert started.startswith("Started background process"), started
    assert wait_until(lambda: live_processes_with(marker)), (
        "the background process must run on the host, in the sandbox"
    )
    assert env.reward == 1.0

    env.reset(task_dir=GOLD_DIR)  # a new episode: the old sandbox and its processes are gone
    assert no_process_left(marker) == []
    assert env.list_note() == "(no notes yet)"
    assert env.shell_view(pid).startswith("Error: no background process")
    started = env.shell_exec(f"sleep 600 # {marker}", blocking=False)
    assert started.startswith("Started background process"), started
    assert wait_until(lambda: live_processes_with(marker)), env.shell_view(started.split("PID=")[1].split(".")[0])
    close_all()
    assert no_process_left(marker) == []


@requires_local
@pytest.mark.slow
def test_grpo_step_with_terminal_notes(tmp_path: Path, env_cls: type, close_sandboxes: None) -> None:
    from transformers.utils import get_json_schema

    from trl_harbor import HarborSpec
    from trl_harbor.testing import tool_call_text

    spec = HarborSpec(
        BUNDLED_SUITE,
        agent="terminal_notes",
        environment_type="local",
        indices=[sorted(p.name for p in BUNDLED_SUITE.iterdir()).index(GOLD_TASK)],
    )
    harbor_reward = spec.reward_funcs
    scored: list[list[float]] = []

    def recorded_reward(completions, environments=None, **kwargs):
        rewards = harbor_reward(completions=completions, environments=environments, **kwargs)
        scored.append(rewards)
        return rewards

    calls = [
        tool_call_text("shell_write_content_to_file", {"path": "/workdir/answer.txt", "content": GOLD_ANSWER}),
        tool_call_text("shell_write_content_to_file", {"path": "/workdir/answer.txt", "content": "0"}),
    ]
    trainer = tiny_grpo_trainer(tmp_path, spec, calls, env_cls.PROMPT_SUFFIX, [recorded_reward])
    assert sorted(tool.__name__ for tool in trainer.tools) == TOOLS
    for tool in trainer.tools:
        assert get_json_schema(tool)["function"]["name"] == tool.__name__
    trainer.train()
    assert scored and len(scored[0]) == 2
    assert set(scored[0]) <= {0.0, 1.0}
    assert "loss" in trainer.state.log_history[0]
