"""``HarborEnv`` / ``HarborBashEnv``: tool surface, backend selection, and real episodes on the
local bubblewrap backend (reset -> bash -> reward through Harbor's verifier)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, requires_local

from trl_harbor import HarborBashEnv, HarborEnv, HarborOptions, close_all, runtime
from trl_harbor.rollout import RewardError, select_reward
from trl_harbor.rollout.backends import LOCAL_ENVIRONMENT_IMPORT_PATH, resolve_backend

GOLD_DIR = str(BUNDLED_SUITE / GOLD_TASK)


def trl_tools(cls: type) -> list[str]:
    """The tool names TRL's GRPOTrainer derives from an environment class (same rule as TRL)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


# ── tool surface (no sandbox) ────────────────────────────────────────────────────────────


def test_trl_sees_exactly_the_harness_tools() -> None:
    assert trl_tools(HarborEnv) == []
    assert trl_tools(HarborBashEnv) == ["bash"]


def test_tool_schemas_are_accepted_by_transformers() -> None:
    from transformers.utils import get_json_schema

    for name in trl_tools(HarborBashEnv):
        schema = get_json_schema(getattr(HarborBashEnv, name))
        assert schema["function"]["name"] == name
    schema = get_json_schema(HarborBashEnv.bash)
    assert schema["function"]["parameters"]["required"] == ["command"]
    assert schema["function"]["parameters"]["properties"]["command"]["type"] == "string"
    assert "shell command" in schema["function"]["parameters"]["properties"]["command"]["description"]


def test_never_reset_env_scores_zero_without_touching_harbor() -> None:
    code = textwrap.dedent(
        """
        import sys
        from trl_harbor import HarborBashEnv
        env = HarborBashEnv(environment_type="no-such-backend")
        assert env.reward == 0.0
        assert env.bash("ls").startswith("Error: no sandbox")
        assert not [m for m in sys.modules if m == "harbor" or m.startswith(("harbor.", "harbor_local_sandbox"))]
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr


def test_environment_type_mapping() -> None:
    import harbor_local_sandbox
    from harbor.models.environment_type import EnvironmentType

    local = resolve_backend("local")
    assert local.config.import_path == LOCAL_ENVIRONMENT_IMPORT_PATH == harbor_local_sandbox.IMPORT_PATH
    assert local.config.type is None
    plugin = resolve_backend("my.pkg:MyEnvironment")
    assert plugin.config.import_path == "my.pkg:MyEnvironment"
    with pytest.raises(ValueError, match="my.pkg"):  # its class loads on first use, through Harbor's factory
        _ = plugin.kind
    assert resolve_backend("docker").config.type == EnvironmentType.DOCKER
    assert resolve_backend("e2b").config.type == EnvironmentType.E2B
    with pytest.raises(ValueError, match="docker"):
        resolve_backend("dockerr")


def test_unknown_backend_fails_at_reset_not_as_a_skipped_rollout() -> None:
    env = HarborBashEnv(environment_type="dockerr")
    with pytest.raises(ValueError, match="unknown environment_type 'dockerr'"):
        env.reset(task_dir=GOLD_DIR)


def test_constructor_validation() -> None:
    with pytest.raises(ValueError):
        HarborBashEnv(on_infra_error="ignore")
    with pytest.raises(ValueError):
        HarborBashEnv(max_concurrent_starts=0)
    with pytest.raises(ValueError):
        HarborBashEnv(command_timeout_sec=0)


def test_reward_key_selection() -> None:
    assert select_reward({"reward": 0.5, "exact": 1}) == 0.5
    assert select_reward({"score": 1}) == 1.0
    assert select_reward({"a": 1, "b": 0}) == 0.5  # no "reward", no weighting: the mean
    with pytest.raises(RewardError, match="no rewards"):
        select_reward({})
    assert select_reward({"a": 1, "b": 0}, "b") == 0.0
    with pytest.raises(RewardError, match="not among"):
        select_reward({"a": 1}, "c")
    assert select_reward({"reward": 0.0, "a": 1, "b": 0.5}, weights={"a": 0.8, "b": 0.4}) == pytest.approx(1.0)
    with pytest.raises(RewardError, match="weights"):
        select_reward({"a": 1}, weights={"a": 1, "c": 1})


def test_runtime_runs_everything_on_one_loop() -> None:
    import asyncio

    async def current():
        return asyncio.get_running_loop()

    assert runtime.run(current()) is runtime.run(current()) is runtime.get_loop()
    with pytest.raises(ZeroDivisionError):

        async def boom():
            return 1 / 0

        runtime.run(boom())
    with pytest.raises(TimeoutError):
        runtime.run(asyncio.sleep(5), timeout=0.1)


# ── real episodes on the local backend ───────────────────────────────────────────────────


@requires_local
def test_episode_gold_answer_scores_one(close_sandboxes: None) -> None:
    env = HarborBashEnv(environment_type="local")
    prompt = env.reset(task_dir=GOLD_DIR, gold_answer=GOLD_ANSWER, task_index=0)
    instruction = (BUNDLED_SUITE / GOLD_TASK / "instruction.md").read_text()
    assert prompt == instruction + HarborBashEnv.PROMPT_SUFFIX
    assert "sensors.json" in env.bash("ls /workdir/data")
    # tests, solution and the gold answer are out of the agent's reach
    assert "No such file" in env.bash("ls /tests /solution")
    assert env.bash(f"echo -n {GOLD_ANSWER} > /workdir/answer.txt") == "(empty output, rc=0)"
    assert env.reward == 1.0
    assert env.reward == 1.0  # graded once, read twice


@requires_local
def test_episode_wrong_or_missing_answer_scores_zero(close_sandboxes: None) -> None:
    env = HarborBashEnv(environment_type="local")
    env.reset(task_dir=GOLD_DIR)
    env.bash("echo -n 12.34 > /workdir/answer.txt")
    assert env.reward == 0.0
    env.reset(task_dir=GOLD_DIR)  # fresh sandbox: the previous answer is gone
    assert "No such file" in env.bash("cat /workdir/answer.txt")
    assert env.reward == 0.0


class CountingEnv(HarborBashEnv):
    """Records ``_setup`` calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.setups = 0

    async def _setup(self) -> None:
        self.setups += 1
        result = await self._aexec("echo prepared > /tmp/setup.txt", timeout=30)
        assert result.return_code == 0


@pytest.fixture
def count_verifications(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count runs of Harbor's real verifier (it still runs)."""
    from harbor.verifier.verifier import Verifier

    calls = [0]
    real = Verifier.verify

    async def counting(self):
        calls[0] += 1
        return await real(self)

    monkeypatch.setattr(Verifier, "verify", counting)
    return calls


def wait_until(predicate, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@requires_local
def test_reward_computed_once_setup_hook_and_previous_sandbox_stopped(
    close_sandboxes: None, count_verifications: list[int]
) -> None:
    env = CountingEnv(environment_type="local")
    before = len(runtime._cleanups)
    env.reset(task_dir=GOLD_DIR)
    # _setup runs in the background after reset returned; the first tool call waits for it.
    assert env.bash("cat /tmp/setup.txt").strip() == "prepared" and env.setups == 1
    env.bash(f"echo {GOLD_ANSWER} > /workdir/answer.txt")
    assert [env.reward, env.reward] == [1.0, 1.0]
    assert count_verifications[0] == 1
    first = env._environment
    env.reset(task_dir=GOLD_DIR)
    assert env._environment is not first
    # The previous sandbox is stopped in the background; then only the live one is registered.
    assert wait_until(lambda: len(runtime._cleanups) == before + 1)
    assert env.reward == 0.0 and count_verifications[0] == 2


@requires_local
def test_close_all_stops_every_sandbox() -> None:
    envs = [HarborBashEnv(environment_type="local") for _ in range(2)]
    for env in envs:
        env.reset(task_dir=GOLD_DIR)
        assert "sensors.json" in env.bash("ls /workdir/data")
    close_all()
    assert not runtime._cleanups
    for env in envs:
        assert env.bash("ls").startswith("Error: no sandbox")
        assert env._environment is None


@requires_local
def test_timeout_and_output_cap_are_configurable(close_sandboxes: None) -> None:
    env = HarborBashEnv(environment_type="local", options=HarborOptions(command_timeout_sec=2, max_output_chars=100))
    env.reset(task_dir=GOLD_DIR)
    assert "timed out after 2 s" in env.bash("sleep 30")
    out = env.bash("seq 1 10000")
    # cut once, keeping the start and the end (where a failing command's error is)
    assert out.startswith("1\n2\n") and out.endswith("9999\n10000\n") and out.count("characters omitted ...]") == 1
    assert len(out) < 200
    assert "[exit code 3]" in env.bash("echo oops; exit 3")
    assert env.bash("echo hello").strip() == "hello"  # the sandbox survived the timeout


@requires_local
def test_task_network_policy_is_forwarded(close_sandboxes: None) -> None:
    from harbor.models.task.config import NetworkMode

    env = HarborBashEnv(environment_type="local")
    env.reset(task_dir=GOLD_DIR)
    out = env.bash(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\" && echo CONNECTED"
    )
    assert "CONNECTED" not in out
    assert env._environment.network_policy.network_mode == NetworkMode.NO_NETWORK


def _json_reward_task(root: Path, test_sh: str) -> Path:
    import shutil

    task = root / GOLD_TASK
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, task)
    (task / "tests" / "test.sh").write_text(test_sh)
    return task


@requires_local
def test_reward_json_and_reward_key(tmp_path: Path, close_sandboxes: None) -> None:
    task = _json_reward_task(
        tmp_path,
        "#!/bin/bash\nmkdir -p /logs/verifier\npython3 /tests/grade.py --json\n",
    )
    env = HarborBashEnv(environment_type="local")
    env.reset(task_dir=str(task))
    env.bash("echo wrong > /workdir/answer.txt")
    assert env.reward == 0.0  # "reward" wins among several keys
    answered = HarborBashEnv(environment_type="local", options=HarborOptions(reward_key="answered"))
    answered.reset(task_dir=str(task))
    answered.bash("echo wrong > /workdir/answer.txt")
    assert answered.reward == 1.0


@requires_local
def test_multi_reward_defaults_weights_and_missing_reward(tmp_path: Path, close_sandboxes: None) -> None:
    task = _json_reward_task(
        tmp_path,
        '#!/bin/bash\nmkdir -p /logs/verifier\necho \'{"a": 1, "b": 0}\' > /logs/verifier/reward.json\n',
    )
    plain = HarborBashEnv(environment_type="local")
    plain.reset(task_dir=str(task))
    assert plain.reward == 0.5 and plain.verification.rewards == {"a": 1.0, "b": 0.0}  # the mean, every part kept
    weighted = HarborBashEnv(environment_type="local", options=HarborOptions(reward_weights={"a": 0.25, "b": 1.0}))
    weighted.reset(task_dir=str(task))
    assert weighted.reward == 0.25
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("[metadata]", "[metadata]\nreward_weights = { b = 2.0, a = 3.0 }", 1))
    from trl_harbor.rollout.suite import _TASKS

    _TASKS.clear()  # task.toml changed on disk
    declared = HarborBashEnv(environment_type="local")
    declared.reset(task_dir=str(task))
    assert declared.reward == 3.0
    # A weighting that names an entry the verifier did not write is a configuration error (not the policy's).
    strict = HarborBashEnv(
        environment_type="local", options=HarborOptions(on_infra_error="raise", reward_weights={"c": 1.0})
    )
    strict.reset(task_dir=str(task))
    with pytest.raises(RewardError, match="weights"):
        _ = strict.reward
    lenient = HarborBashEnv(
        environment_type="local", options=HarborOptions(on_infra_error="zero", reward_weights={"c": 1.0})
    )
    lenient.reset(task_dir=str(task))
    assert lenient.reward == 0.0
    skipping = HarborBashEnv(
        environment_type="local", options=HarborOptions(reward_weights={"c": 1.0})
    )  # the default: left out
    skipping.reset(task_dir=str(task))
    assert skipping.reward is None and skipping.verification.infra
    # No reward file at all is an error (Harbor's semantics), which the rollout may have caused
    # (the sandbox is healthy): it scores 0 in every mode, with the reason, and is not skipped.
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nexit 0\n")
    for env in (lenient, strict, skipping):
        env.reset(task_dir=str(task))
        assert env.reward == 0.0
        assert not env.verification.infra and "RewardFileNotFoundError" in env.verification.reason


@requires_local
def test_separate_verifier_environment(tmp_path: Path, close_sandboxes: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    task = tmp_path / GOLD_TASK
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, task)
    toml = task / "task.toml"
    text = toml.read_text()
    text = text.replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n', 1)
    text = text.replace('version = "1.0"\n', 'version = "1.0"\nartifacts = ["/workdir/answer.txt"]\n', 1)
    toml.write_text(text)
    test_sh = task / "tests" / "test.sh"
    # the verifier sandbox must see the declared artifact, and nothing else the agent left
    test_sh.write_text(
        test_sh.read_text().replace(
            "mkdir -p /logs/verifier\n",
            "mkdir -p /logs/verifier\n"
            "if [ -e /workdir/agent-only.txt ]; then echo 0 > /logs/verifier/reward.txt; exit 0; fi\n",
            1,
        )
    )

    from trl_harbor.rollout import grading

    separate_runs = [0]
    real = grading._grade_separately

    async def counting(*args):
        separate_runs[0] += 1
        return await real(*args)

    monkeypatch.setattr(grading, "_grade_separately", counting)
    env = HarborBashEnv(environment_type="local")
    env.reset(task_dir=str(task))
    env.bash(f"echo {GOLD_ANSWER} > /workdir/answer.txt; echo marker > /workdir/agent-only.txt")
    assert env.reward == 1.0
    assert separate_runs[0] == 1
    # the same check in the shared sandbox sees the agent's file and scores 0
    shared = task.parent / "shared"
    shutil.copytree(task, shared)
    (shared / "task.toml").write_text(text.replace('environment_mode = "separate"\n', ""))
    env = HarborBashEnv(environment_type="local")
    env.reset(task_dir=str(shared))
    env.bash(f"echo {GOLD_ANSWER} > /workdir/answer.txt; echo marker > /workdir/agent-only.txt")
    assert env.reward == 0.0 and separate_runs[0] == 1
