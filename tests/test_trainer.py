"""``HarborGRPOTrainer``: a turn's tool calls run at the same time, with TRL's loop's results.

Real CPU ``GRPOTrainer`` steps (a tiny model rigged to emit scripted tool calls, see
``trl_harbor.testing``) on the local sandbox, once with TRL's own tool loop and once with
``HarborGRPOTrainer``, from the same seed: the logged completions, rewards, advantages and token
ids must be identical, and only the concurrent run may have calls of different rollouts in
flight at once (each command is made 0.3 s slower, so calls started together surely overlap).
The scripted calls cover one and several calls per turn, sync and async tools, a tool that
raises, a result long enough to be rolled back at ``max_completion_length``, and a sandbox that
cannot start.

The last tests drive trl-harbor's environments the way ``AsyncGRPOTrainer``'s rollout worker
does — resets, tools and rewards from a thread pool, many environments, reused across
rollouts — and check that nothing is mixed up, lost or left running.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, requires_local
from harbor_local_sandbox._lifetime import state_root

from sandbox_helpers import BASE_DOCKERFILE
from trl_harbor import HarborBashEnv, HarborOptions, HarborSpec, close_all
from trl_harbor.rollout import COUNTERS

EXPLOSION = "sandbox API down"
GOOD = f"echo -n {GOLD_ANSWER} > /workdir/answer.txt"
WRONG = "echo -n 0 > /workdir/answer.txt"
READ = "cat /workdir/answer.txt"
LONG = "seq 1 400"  # a result far longer than max_completion_length: rolled back by TRL's loop
#: The local sandbox, slower by a fixed delay per command (so that overlapping calls surely overlap).
LATENCY = "harbor_local_sandbox.latency:LatencyLocalEnvironment"


@pytest.fixture(autouse=True)
def _clean():
    yield
    close_all()


class _Log:
    """Every tool call of a run, (environment id, tool, command, begin, end), and the most
    calls that were ever in flight at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, str, float, float]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()

    def enter(self) -> float:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return time.monotonic()

    def add(self, env: object, tool: str, command: str, begin: float) -> None:
        with self.lock:
            self.in_flight -= 1
            self.calls.append((id(env), tool, command, begin, time.monotonic()))


def _probe_env(log: _Log) -> type:
    class ProbeEnv(HarborBashEnv):
        """The bash harness plus an async tool, recording every call; ``explode`` raises."""

        def bash(self, command: str) -> str:
            """Run a shell command in the sandbox and return its combined stdout and stderr.

            Args:
                command: The shell command to run.

            Returns:
                The command's combined stdout and stderr.
            """
            begin = log.enter()
            try:
                if command == "explode":
                    raise RuntimeError(EXPLOSION)
                return super().bash(command)
            finally:
                log.add(self, "bash", command, begin)

        async def abash(self, command: str) -> str:
            """Run a shell command in the sandbox, asynchronously; return its stdout and stderr.

            Args:
                command: The shell command to run.

            Returns:
                The command's combined stdout and stderr.
            """
            begin = log.enter()
            try:
                return await asyncio.to_thread(self._exec, command)
            finally:
                log.add(self, "abash", command, begin)

    return ProbeEnv


def _recording(cls: type) -> type:
    """``cls`` recording what ``_generate`` returns (prompt ids, completion ids, tool mask)."""

    class Recording(cls):  # type: ignore[misc, valid-type]
        def _generate(self, prompts: list) -> Any:
            output = super()._generate(prompts)
            self.generated = getattr(self, "generated", [])
            self.generated.append(tuple(output[:3]))
            return output

    return Recording


def _train(
    trainer_cls: type,
    tmp_path: Path,
    spec: HarborSpec,
    calls: list[str],
    batch: int,
    prompts: int = 1,
    turns: int = 2,
    **extra: Any,
) -> Any:
    """One CPU GRPO step (``batch`` rollouts of ``prompts`` prompts) with a tiny policy sampling ``calls``."""
    import torch
    from trl import GRPOConfig

    from trl_harbor.testing import build_model, build_tokenizer, script_tool_calls

    instructions = [p.read_text() for p in BUNDLED_SUITE.glob("*/instruction.md")]
    tokenizer = build_tokenizer(corpus=[*instructions, HarborBashEnv.PROMPT_SUFFIX], extra_tokens=calls)
    model = build_model(tokenizer, seed=0)
    script_tool_calls(model, tokenizer, calls)
    torch.manual_seed(1)
    args = GRPOConfig(
        output_dir=str(tmp_path / trainer_cls.__name__),
        use_cpu=True,
        max_steps=1,
        num_generations=batch // prompts,
        per_device_train_batch_size=batch,
        max_completion_length=256,
        max_tool_calling_iterations=turns,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=1,
        log_completions=True,
    )
    trainer = _recording(trainer_cls)(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
        **extra,
    )
    trainer.train()
    close_all()
    return trainer


def _nan_free(values: Any) -> list[Any]:
    """The values with NaN (a reward source that abstained) made comparable."""
    return ["nan" if isinstance(v, float) and math.isnan(v) else v for v in values]


def _outcome(trainer: Any) -> dict[str, Any]:
    """What a run logged: completions, rewards, advantages, extra columns, token ids, metrics."""
    logs = trainer._logs
    history = trainer.state.log_history[0]
    return {
        "prompt": list(logs["prompt"]),
        "completion": list(logs["completion"]),
        "rewards": {k: _nan_free(v) for k, v in logs["rewards"].items()},
        "advantages": _nan_free(logs["advantages"]),
        "extra": {k: list(v) for k, v in logs["extra"].items()},
        "ids": trainer.generated,
        "metrics": {k: v for k, v in history.items() if k.startswith(("tools/", "rewards/", "reward", "completions/"))},
    }


def _tool_messages(outcome: dict[str, Any]) -> list[str]:
    return [m["content"] for c in outcome["completion"] for m in c if m["role"] == "tool"]


def _gold_spec(agent: Any, tmp_path: Path, exec_latency: float = 0.0, **spec_kwargs: Any) -> HarborSpec:
    """The gold task on the local sandbox (with ``exec_latency`` added to every command)."""
    suite = tmp_path / "suite"
    if not (suite / GOLD_TASK).exists():
        shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / GOLD_TASK)
    if not exec_latency:
        return HarborSpec(suite, agent=agent, environment_type="local", **spec_kwargs)
    kwargs = {"backend_options": {"exec_latency_sec": exec_latency}}
    return HarborSpec(suite, agent=agent, environment_type=LATENCY, options=HarborOptions(**kwargs))


@requires_local
@pytest.mark.slow
def test_same_results_as_trls_loop_with_the_calls_of_a_turn_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from trl import GRPOTrainer

    from trl_harbor import HarborGRPOTrainer
    from trl_harbor.testing import tool_call_text

    def call(tool: str, command: str) -> str:
        return tool_call_text(tool, {"command": command})

    def bad(tool: str) -> str:
        return tool_call_text(tool, {"cmd": READ})

    scripted = [
        call("bash", GOOD),
        call("bash", WRONG) + "\n" + call("bash", READ),  # two sync calls in one turn
        # sync and async calls in one turn, two of them with a wrong argument name (TypeError)
        "\n".join([call("bash", WRONG), bad("abash"), call("abash", READ), bad("bash")]),
        call("abash", GOOD),
        call("bash", LONG),
        call("bash", "explode"),
    ]
    outcomes, logs = {}, {}
    for trainer_cls in (GRPOTrainer, HarborGRPOTrainer):
        logs[trainer_cls] = log = _Log()
        spec = _gold_spec(_probe_env(log), tmp_path, exec_latency=0.3)
        with caplog.at_level(logging.WARNING, logger="trl_harbor.training.trainer"):
            trainer = _train(trainer_cls, tmp_path, spec, scripted, batch=8, turns=3)
        assert sorted(t.__name__ for t in trainer.tools) == ["abash", "bash"]
        outcomes[trainer_cls] = _outcome(trainer)
    ours, trls = outcomes[HarborGRPOTrainer], outcomes[GRPOTrainer]

    # the run covered what it is meant to cover (fixed seed: deterministic)
    commands = [c[2] for c in logs[GRPOTrainer].calls]
    tools = {c[1] for c in logs[GRPOTrainer].calls}
    assert {GOOD, WRONG, READ, LONG, "explode"} <= set(commands) and tools == {"bash", "abash"}, commands
    messages = _tool_messages(trls)
    assert str({"error": EXPLOSION}) in messages  # TRL's report of a tool that raised
    assert any("unexpected keyword argument 'cmd'" in m for m in messages)
    assert not any(m.startswith("1\n2\n3\n") for m in messages)  # the long result was rolled back
    # ... the rollout ended there, while others went on to a third turn
    per_env: dict[int, list[str]] = {}
    for env, _, command, _, _ in sorted(logs[GRPOTrainer].calls, key=lambda c: c[3]):
        per_env.setdefault(env, []).append(command)
    assert any(cmds[-1] == LONG for cmds in per_env.values()) and max(map(len, per_env.values())) >= 4
    assert "0" in messages  # a read after a write in the same turn sees it
    assert trls["metrics"]["tools/failure_frequency"] > 0

    # identical results, token for token
    assert ours["completion"] == trls["completion"]
    assert ours["prompt"] == trls["prompt"]
    assert ours["ids"] == trls["ids"]
    assert ours["rewards"] == trls["rewards"] and ours["advantages"] == trls["advantages"]
    assert ours["extra"] == trls["extra"]
    assert ours["metrics"] == trls["metrics"]
    assert sorted(c[1:3] for c in logs[HarborGRPOTrainer].calls) == sorted(c[1:3] for c in logs[GRPOTrainer].calls)

    # every call was started ahead and collected by TRL's loop: none ran twice, none was missed
    assert not [r for r in caplog.records if r.name == "trl_harbor.training.trainer"]

    # TRL's loop runs one rollout's call after another; ours runs them together
    assert logs[GRPOTrainer].most_in_flight == 1
    assert logs[HarborGRPOTrainer].most_in_flight > 1


@requires_local
@pytest.mark.slow
def test_a_sandbox_that_cannot_start_costs_its_rollouts_alike(tmp_path: Path) -> None:
    from trl import GRPOTrainer

    from trl_harbor import HarborGRPOTrainer
    from trl_harbor.testing import tool_call_text

    suite = tmp_path / "suite"
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / "a_good")
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / "b_cannot_start")
    (suite / "b_cannot_start" / "environment" / "Dockerfile").write_text(
        BASE_DOCKERFILE + "RUN apt-get install -y no-such-package-anywhere\n"
    )
    scripted = [tool_call_text("bash", {"command": GOOD}), tool_call_text("bash", {"command": WRONG})]
    outcomes = {}
    for trainer_cls in (GRPOTrainer, HarborGRPOTrainer):
        spec = HarborSpec(suite, agent="bash", environment_type="local", options=HarborOptions(on_infra_error="zero"))
        before = COUNTERS.infra_failures()["start"]
        outcomes[trainer_cls] = _outcome(_train(trainer_cls, tmp_path, spec, scripted, batch=4, prompts=2))
        assert COUNTERS.infra_failures()["start"] == before + 2  # both rollouts of the broken task, once each
    ours, trls = outcomes[HarborGRPOTrainer], outcomes[GRPOTrainer]
    errors = trls["extra"]["harbor_error"]
    assert sum("sandbox start failed for task 'b_cannot_start'" in e for e in errors) == 2, errors
    assert trls["rewards"]["_outcome_reward_func"].count(0.0) >= 2
    assert ours["completion"] == trls["completion"] and ours["ids"] == trls["ids"]
    assert ours["rewards"] == trls["rewards"] and ours["extra"] == trls["extra"]


HARNESS_CALLS = {
    "jupyter": [
        ("add_and_execute_code_cell", {"code": f"open('/workdir/answer.txt', 'w').write('{GOLD_ANSWER}')"}),
        ("execute_shell_command", {"command": READ}),
    ],
    "terminal_notes": [
        ("shell_write_content_to_file", {"path": "/workdir/answer.txt", "content": GOLD_ANSWER}),
        ("shell_exec", {"command": READ}),
        ("create_note", {"title": "plan", "content": "write the answer"}),
    ],
}


@requires_local
@pytest.mark.slow
@pytest.mark.parametrize("agent", sorted(HARNESS_CALLS))
def test_every_harness_gives_the_same_results(tmp_path: Path, agent: str) -> None:
    from trl import GRPOTrainer

    from trl_harbor import HarborGRPOTrainer
    from trl_harbor.testing import tool_call_text

    texts = [tool_call_text(name, args) for name, args in HARNESS_CALLS[agent]]
    scripted = [*texts, "\n".join(texts)]  # each tool alone, and all in one turn
    outcomes = {}
    for trainer_cls in (GRPOTrainer, HarborGRPOTrainer):
        spec = _gold_spec(agent, tmp_path)
        outcomes[trainer_cls] = _outcome(_train(trainer_cls, tmp_path, spec, scripted, batch=4))
    ours, trls = outcomes[HarborGRPOTrainer], outcomes[GRPOTrainer]
    assert GOLD_ANSWER in _tool_messages(trls)
    assert ours["completion"] == trls["completion"] and ours["ids"] == trls["ids"]
    assert ours["rewards"] == trls["rewards"] and ours["metrics"] == trls["metrics"]


@requires_local
@pytest.mark.slow
def test_a_loop_the_mixin_cannot_hook_runs_trls_loop_after_one_warning(tmp_path: Path) -> None:
    """A simulated TRL release whose ``_tool_call_loop`` the mixin cannot hook (it hides ``completions``
    behind ``*args``): one warning, then TRL's own loop, one rollout's calls after another."""
    from trl import GRPOTrainer

    import trl_harbor.training.trainer as trainer_module
    from trl_harbor import HarborGRPOTrainer
    from trl_harbor.testing import tool_call_text
    from trl_harbor.training.trainer import ConcurrentToolsMixin

    class OpaqueLoopTrainer(GRPOTrainer):
        def _tool_call_loop(self, *args: Any, **kwargs: Any) -> Any:
            return super()._tool_call_loop(*args, **kwargs)

    class SimulatedTrainer(ConcurrentToolsMixin, OpaqueLoopTrainer):
        pass

    assert trainer_module.concurrent_tools_supported()  # the installed TRL's loop can be hooked
    assert trainer_module.concurrent_tools_supported(HarborGRPOTrainer)
    assert not trainer_module.concurrent_tools_supported(SimulatedTrainer)
    log = _Log()
    spec = _gold_spec(_probe_env(log), tmp_path, exec_latency=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(SimulatedTrainer, tmp_path, spec, [tool_call_text("bash", {"command": GOOD})], batch=4)
    ours = [w for w in caught if "trl-harbor" in str(w.message)]
    assert len(ours) == 1 and "TRL's own tool loop" in str(ours[0].message)
    assert "takes no `completions` argument" in str(ours[0].message)
    assert len(log.calls) == 8  # 4 rollouts, 2 turns
    assert log.most_in_flight == 1


def test_tool_concurrency_must_be_positive() -> None:
    from trl_harbor import HarborGRPOTrainer

    with pytest.raises(ValueError, match="tool_concurrency"):
        HarborGRPOTrainer(model=None, tool_concurrency=0)


# ── AsyncGRPOTrainer-style driving: everything from a thread pool ───────────────────────────

ASYNC_GRPO_TOOLS = {
    "bash": lambda token, answer: [
        ("bash", {"command": f"echo -n {token} > /workdir/mine.txt && echo -n {answer} > /workdir/answer.txt"}),
        ("bash", {"command": "cat /workdir/mine.txt"}),
    ],
    "jupyter": lambda token, answer: [
        (
            "add_and_execute_code_cell",
            {"code": f"token = '{token}'\nopen('/workdir/answer.txt', 'w').write('{answer}')"},
        ),
        ("add_and_execute_code_cell", {"code": "print(token, end='')"}),
    ],
    "terminal_notes": lambda token, answer: [
        ("create_note", {"title": "token", "content": token}),
        ("shell_write_content_to_file", {"path": "/workdir/answer.txt", "content": answer}),
        ("read_note", {"title": "token"}),
    ],
}


def _leftovers() -> list[str]:
    pid = os.getpid()
    found = [p.name for p in state_root().iterdir() if p.name.startswith(f"{pid}-")]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/harbor-local-sandbox/{pid}-*")]
    return found


@requires_local
@pytest.mark.slow
@pytest.mark.parametrize("agent", sorted(ASYNC_GRPO_TOOLS))
def test_environments_driven_from_a_thread_pool_like_async_grpo(tmp_path: Path, agent: str) -> None:
    """Like ``AsyncGRPOTrainer``'s rollout worker: an asyncio loop of rollouts, each drawing an
    environment from a pool (a new one only when the pool is empty), resetting it, calling its
    tools and reading ``get_reward`` through ``run_in_executor`` on a shared thread pool, then
    returning it to the pool — 12 rollouts in flight, 36 in all, so environments are reset again
    from other threads while their neighbours run. The harness owns its reward
    (``reward_source="environment"``), as ``AsyncGRPOTrainer`` needs."""
    spec = _gold_spec(agent, tmp_path, reward_source="environment")
    [row] = spec.train_dataset.to_list()
    before = COUNTERS.infra_failures()
    pool: list[Any] = []
    created: list[Any] = []
    executor = ThreadPoolExecutor(max_workers=12, thread_name_prefix="grpo-tool")

    async def rollout(index: int, inflight: asyncio.Semaphore) -> tuple[str, float | None]:
        async with inflight:
            loop = asyncio.get_running_loop()
            if pool:
                env = pool.pop()
            else:
                env = spec.environment_factory()
                created.append(env)
            await loop.run_in_executor(executor, functools.partial(env.reset, **row))
            token = f"rollout-{index}"
            answer = GOLD_ANSWER if index % 2 == 0 else "0"
            outputs = []
            for name, arguments in ASYNC_GRPO_TOOLS[agent](token, answer):
                tool = getattr(env, name)
                outputs.append(await loop.run_in_executor(executor, functools.partial(tool, **arguments)))
            reward = await loop.run_in_executor(executor, env.get_reward)
            pool.append(env)
            return outputs[-1], reward

    async def main() -> list[tuple[str, float | None]]:
        inflight = asyncio.Semaphore(12)
        return await asyncio.gather(*(rollout(i, inflight) for i in range(36)))

    try:
        results = asyncio.run(main())
    finally:
        executor.shutdown()
    for index, (output, reward) in enumerate(results):
        assert output.strip() == f"rollout-{index}", (index, output)  # no rollout saw another's sandbox
        assert reward == (1.0 if index % 2 == 0 else 0.0), (index, reward)
    assert len(created) <= 12  # environments were reused, reset from other threads
    assert COUNTERS.infra_failures() == before
    close_all()
    deadline = time.monotonic() + 10
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers() == []


THREADED_SCRIPT = """
import time
from concurrent.futures import ThreadPoolExecutor
from trl_harbor import HarborSpec
spec = HarborSpec({suite!r}, environment_type="local", num_tasks=1)
envs = [spec.environment_factory() for _ in range(4)]
# Like AsyncGRPOTrainer's rollout worker: every environment call comes from a thread pool.
pool = ThreadPoolExecutor(4)
list(pool.map(lambda env: env.reset(task_dir=str(spec.task_dirs[0])), envs))
list(pool.map(lambda env: env.bash("nohup sleep {marker} >/dev/null 2>&1 &"), envs))
print("mid-batch", flush=True)
time.sleep(600)
"""


@requires_local
def test_sigterm_stops_sandboxes_only_ever_used_from_worker_threads(tmp_path: Path) -> None:
    """``AsyncGRPOTrainer`` ends its rollout process with SIGTERM when it does not stop in time;
    the sandboxes must go with it even though no environment call came from the main thread."""
    import signal
    import subprocess
    import sys

    from conftest import REPO

    from sandbox_helpers import live_processes_with

    marker = f"4515.{os.getpid()}"
    script = tmp_path / "worker.py"
    script.write_text(THREADED_SCRIPT.format(suite=str(BUNDLED_SUITE), marker=marker))
    child = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "HARBOR_TELEMETRY": "0"},
    )
    try:
        assert child.stdout.readline().strip() == "mid-batch", child.stderr.read()[-2000:]
        assert len(live_processes_with(f"sleep {marker}")) == 4
    except BaseException:
        child.kill()
        raise
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM  # trl-harbor's handler ran (not the default action)
    deadline = time.monotonic() + 10
    while live_processes_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_processes_with(f"sleep {marker}")
    leftovers = [p.name for p in state_root().iterdir() if p.name.startswith(f"{child.pid}-")]
    assert leftovers == []
