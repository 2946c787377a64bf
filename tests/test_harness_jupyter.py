"""The Jupyter example harness: a stateful kernel in real local sandboxes, on both back ends
(the stdlib kernel where the sandbox has no ipykernel, a real ipykernel where the task's
Dockerfile installs it), scripted episodes that solve a bundled task, no leftover processes,
and a CPU GRPOTrainer step with its tools."""

from __future__ import annotations

import shutil
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

from sandbox_helpers import live_processes_with, wait_until
from trl_harbor import close_all
from trl_harbor.training.agents import resolve_agent

# TRL's documented path (examples/grpo_harbor/harnesses is a symlink to its folder); it re-exports
# trl_harbor.training.harnesses.jupyter
HARNESS = REPO / "examples" / "scripts" / "harbor" / "harnesses" / "jupyter"
AGENT = f"{HARNESS / 'env.py'}:JupyterEnv"
GOLD_DIR = str(BUNDLED_SUITE / GOLD_TASK)
TOOLS = ["add_and_execute_code_cell", "execute_shell_command"]

SOLVE_CELLS = [
    "import json\nfrom datetime import datetime, timezone\ndoc = json.load(open('data/sensors.json'))",
    "vals = []\nfor site in doc['sites']:\n    if site['building'] != 'B':\n        continue\n"
    "    for sensor in site['sensors']:\n        if sensor['type'] != 'humidity':\n            continue\n"
    "        for r in sensor['readings']:\n            ts = datetime.fromisoformat(r['ts']).astimezone(timezone.utc)\n"
    "            if (ts.year, ts.month) == (2024, 3) and r.get('flag') is None:\n                vals.append(r['value'])",
    "answer = f'{sum(vals) / len(vals):.2f}'\nanswer",
    "with open('/workdir/answer.txt', 'w') as f:\n    f.write(answer)",
]


@pytest.fixture(scope="module")
def env_cls() -> type:
    return resolve_agent(AGENT)


@pytest.fixture(scope="module")
def ipykernel_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gold task, with a Dockerfile that installs ipykernel and jupyter_client (Debian's packages)."""
    task = tmp_path_factory.mktemp("ipykernel_suite") / GOLD_TASK
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, task)
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text(
        dockerfile.read_text().rstrip("\n")
        + "\nRUN apt-get update && apt-get install -y --no-install-recommends python3-ipykernel python3-jupyter-client"
        " && rm -rf /var/lib/apt/lists/*\n"
    )
    return task


# ── tool surface (no sandbox) ────────────────────────────────────────────────────────────


def test_loadable_by_path_and_by_builtin_name(env_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_cls.__name__ == "JupyterEnv"
    assert resolve_agent("jupyter") is env_cls
    monkeypatch.chdir(REPO)  # the paths users of the reference pass, relative to the checkout
    assert resolve_agent("examples/scripts/harbor/harnesses/jupyter/env.py:JupyterEnv") is env_cls  # TRL's guide
    assert resolve_agent("examples/grpo_harbor/harnesses/jupyter/env.py:JupyterEnv") is env_cls


def test_tools_and_schemas(env_cls: type) -> None:
    from transformers.utils import get_json_schema

    assert trl_tools(env_cls) == TOOLS
    for name, arg in zip(TOOLS, ("code", "command"), strict=True):
        schema = get_json_schema(getattr(env_cls, name))["function"]
        assert schema["name"] == name and schema["description"]
        assert schema["parameters"]["required"] == [arg]
        assert schema["parameters"]["properties"][arg]["type"] == "string"
        assert schema["parameters"]["properties"][arg]["description"]
    for word in (*TOOLS, "/workdir/answer.txt"):
        assert word in env_cls.PROMPT_SUFFIX, word
    with pytest.raises(ValueError, match="kernel_mode"):
        env_cls(environment_type="local", kernel_mode="ipython")
    assert env_cls(environment_type="local").add_and_execute_code_cell("1").startswith("Error: no sandbox")


# ── the kernel in real sandboxes ─────────────────────────────────────────────────────────


def check_kernel(env, expected_backend: str) -> None:
    """The behaviour both back ends share (cell timeout 2 s)."""
    assert env.add_and_execute_code_cell("import os\nx = 41\nopen('notes.txt', 'w').write('kept')") == "4\n"
    assert env._kernel_backend == expected_backend
    # variables, imports and files persist; a bare last expression is shown like Jupyter
    assert env.add_and_execute_code_cell("x += 1\nos.getcwd(), open('notes.txt').read(), x") == (
        "('/workdir', 'kept', 42)\n"
    )
    assert env.add_and_execute_code_cell("y = x  # no output") == "(no output)"
    assert env.add_and_execute_code_cell("x;") == "(no output)"  # a trailing ; hides the value
    out = env.add_and_execute_code_cell(
        "print('before')\nos.system('echo from a subprocess')\ndef f():\n    return 1 / 0\nf()"
    )
    assert out.startswith("before\nfrom a subprocess\n"), out
    assert "ZeroDivisionError" in out and "return 1 / 0" in out and "kernel_server" not in out, out
    out = env.add_and_execute_code_cell("def broken(:")
    assert "SyntaxError" in out, out
    # a cell that runs forever is interrupted at the timeout; the kernel and its state survive
    started = time.monotonic()
    out = env.add_and_execute_code_cell("n = 0\nwhile True:\n    n += 1")
    assert time.monotonic() - started < 8, out
    assert "KeyboardInterrupt" in out and "was interrupted" in out and "kernel_server" not in out, out
    assert env.add_and_execute_code_cell("n > 0, x") == "(True, 42)\n"
    # output is capped (head and tail kept)
    out = env.add_and_execute_code_cell("for i in range(100000):\n    print(i)")
    assert len(out) <= env.options.max_output_chars and "characters omitted" in out, len(out)
    assert out.startswith("0\n1\n") and out.endswith("99999\n"), out[-100:]
    # the shell tool works alongside
    assert env.execute_shell_command("cat /workdir/notes.txt") == "kept"
    # a kernel that dies is restarted, and the model is told its variables are gone
    out = env.add_and_execute_code_cell("os._exit(3)")
    assert "died" in out and "variables are lost" in out, out
    assert "NameError" in env.add_and_execute_code_cell("x")
    assert env.add_and_execute_code_cell("x = 5\nx * 2") == "10\n"


@requires_local
def test_builtin_kernel_keeps_state_and_survives_an_endless_cell(env_cls: type, close_sandboxes: None) -> None:
    env = env_cls(environment_type="local", cell_timeout_sec=2, max_output_chars=2000)
    env.reset(task_dir=GOLD_DIR)  # the host python of the local sandbox has no ipykernel
    check_kernel(env, "builtin")
    # a cell that ignores SIGINT: the kernel is killed and restarted, and says its state is gone
    out = env.add_and_execute_code_cell("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass")
    assert "ignored interrupts" in out and "variables and imports are lost" in out, out
    assert "NameError" in env.add_and_execute_code_cell("x")
    assert env.add_and_execute_code_cell("21 * 2") == "42\n"
    assert env._kernel_backend == "builtin"


@requires_local
def test_a_kernel_that_cannot_start_is_reported_as_text(env_cls: type, close_sandboxes: None) -> None:
    env = env_cls(environment_type="local", kernel_mode="ipykernel")  # the host python has no ipykernel
    env.reset(task_dir=GOLD_DIR)
    started = time.monotonic()
    out = env.add_and_execute_code_cell("1 + 1")
    assert out.startswith("Error: the Python kernel could not be started") and "jupyter_client" in out, out
    assert "execute_shell_command" in out and time.monotonic() - started < 20
    assert env.execute_shell_command("echo still here") == "still here\n"


@requires_local
def test_ipykernel_backend(env_cls: type, ipykernel_task: Path, close_sandboxes: None) -> None:
    # The kernel back end is chosen by what the task's image has: here, the two packages.
    env = env_cls(environment_type="local", cell_timeout_sec=2, max_output_chars=2000)
    env.reset(task_dir=str(ipykernel_task))
    check_kernel(env, "ipykernel")
    for code in SOLVE_CELLS:
        env.add_and_execute_code_cell(code)
    assert env.reward == 1.0


@requires_local
def test_scripted_episode_solves_the_task_and_leaves_no_process(env_cls: type, close_sandboxes: None) -> None:
    marker = f"trl-harbor-leak-{uuid.uuid4().hex[:8]}"
    env = env_cls(environment_type="local", command_timeout_sec=30)
    prompt = env.reset(task_dir=GOLD_DIR)
    assert prompt.endswith(env_cls.PROMPT_SUFFIX)
    outputs = [env.add_and_execute_code_cell(code) for code in SOLVE_CELLS]
    assert outputs[2] == f"'{GOLD_ANSWER}'\n", outputs
    assert env.execute_shell_command("cat /workdir/answer.txt") == GOLD_ANSWER
    spawn = f"import subprocess\np = subprocess.Popen(['sh', '-c', 'sleep 600 # {marker}'])"
    env.add_and_execute_code_cell(spawn)
    assert wait_until(lambda: live_processes_with(marker))
    assert live_processes_with("kernel_server.py")
    assert env.reward == 1.0

    env.reset(task_dir=GOLD_DIR)  # the old sandbox, its kernel and the kernel's children are gone
    assert no_process_left(marker) == []
    assert "NameError" in env.add_and_execute_code_cell("answer")  # a fresh kernel
    spawned = env.add_and_execute_code_cell(spawn)
    assert wait_until(lambda: live_processes_with(marker)), spawned
    close_all()
    assert no_process_left(marker) == []


@requires_local
@pytest.mark.slow
def test_grpo_step_with_jupyter(tmp_path: Path, env_cls: type, close_sandboxes: None) -> None:
    from transformers.utils import get_json_schema

    from trl_harbor import HarborSpec
    from trl_harbor.testing import tool_call_text

    scored: list[list[float]] = []
    outputs: list[str] = []

    class Recording(env_cls):  # type: ignore[misc, valid-type]
        def add_and_execute_code_cell(self, code: str) -> str:
            """Execute Python code in the stateful kernel and return the cell's output.

            Args:
                code: The Python code of the cell.

            Returns:
                What the cell printed, its last expression's value, or its traceback.
            """
            outputs.append(super().add_and_execute_code_cell(code))
            return outputs[-1]

    index = sorted(p.name for p in BUNDLED_SUITE.iterdir()).index(GOLD_TASK)
    spec = HarborSpec(BUNDLED_SUITE, agent=Recording, environment_type="local", indices=[index])
    harbor_reward = spec.reward_funcs

    def recorded_reward(completions, environments=None, **kwargs):
        rewards = harbor_reward(completions=completions, environments=environments, **kwargs)
        scored.append(rewards)
        return rewards

    calls = [
        tool_call_text(
            "add_and_execute_code_cell", {"code": f"open('/workdir/answer.txt', 'w').write('{GOLD_ANSWER}')"}
        ),
        tool_call_text("add_and_execute_code_cell", {"code": "open('/workdir/answer.txt', 'w').write('0')"}),
    ]
    trainer = tiny_grpo_trainer(tmp_path, spec, calls, env_cls.PROMPT_SUFFIX, [recorded_reward])
    assert sorted(tool.__name__ for tool in trainer.tools) == TOOLS
    for tool in trainer.tools:
        assert get_json_schema(tool)["function"]["name"] == tool.__name__
    trainer.train()
    assert outputs and set(outputs) <= {"5\n", "1\n"}, outputs  # the cells ran in the kernel
    assert scored and len(scored[0]) == 2
    assert set(scored[0]) <= {0.0, 1.0}
    assert "loss" in trainer.state.log_history[0]
