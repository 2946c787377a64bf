"""``trl-harbor train``: TRL's config conventions, the embedded default run learns, trajectories.

Everything here is real: the command line's own parser (``trl.TrlParser`` over ``GRPOConfig``),
``GRPOTrainer``, the local bubblewrap sandboxes and Harbor's verifier. The policy of the default
run is the demo policy (``trl_harbor.demo_policy``) — a real, trainable tiny transformers model
whose initial weights choose among right and wrong commands per task.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, requires_local

from trl_harbor.cli import main as cli_main
from trl_harbor.demo_policy import WRONG_COMMANDS, DemoPolicyError, build_demo_policy
from trl_harbor.train import DEMO_DEFAULTS, parse_train_args
from trl_harbor.trajectories import read_trajectories


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return path


def test_config_file_sets_fields_and_flags_override_it(tmp_path: Path) -> None:
    """Defaults < YAML < flags, for GRPOConfig fields and Harbor options alike (TRL's TrlParser rule)."""
    config = _yaml(
        tmp_path,
        "num_generations: 2\nlearning_rate: 0.003\nmax_steps: 7\nnum_tasks: 3\n"
        "command_timeout_sec: 30\nagent: bash\nenv:\n  TRL_HARBOR_TEST_VAR: from-yaml\n",
    )
    harbor, args = parse_train_args(["--config", str(config), "--learning_rate", "0.02", "--num-tasks", "2"])
    assert args.num_generations == 2  # from the file
    assert args.max_steps == 7  # from the file
    assert args.learning_rate == 0.02  # the flag beats the file
    assert harbor.num_tasks == 2  # the flag beats the file (dash spelling accepted)
    assert harbor.command_timeout_sec == 30
    assert harbor.model is None
    assert args.per_device_train_batch_size == DEMO_DEFAULTS["per_device_train_batch_size"]  # demo default kept
    assert os.environ["TRL_HARBOR_TEST_VAR"] == "from-yaml"


def test_a_model_turns_the_demo_defaults_off(tmp_path: Path) -> None:
    config = _yaml(tmp_path, "model: some/model\n")
    harbor, args = parse_train_args(["--config", str(config)])
    assert harbor.model == "some/model"
    assert args.learning_rate != DEMO_DEFAULTS["learning_rate"]  # TRL's own default
    harbor, args = parse_train_args(["--model", "other/model", "--indices", "0", "4"])
    assert harbor.model == "other/model" and harbor.indices == [0, 4]


@pytest.mark.parametrize(
    ("text", "argv", "expected"),
    [
        ("num_generation: 2\n", [], "num_generation"),  # a typo in the file is named
        ("", ["--num_tasks", "2", "--indices", "1"], "not both"),
        ("", ["--on_infra_error", "ignore"], "on_infra_error"),
    ],
)
def test_bad_configuration_is_named(tmp_path: Path, capsys, text: str, argv: list[str], expected: str) -> None:
    config = _yaml(tmp_path, text or "seed: 1\n")
    assert cli_main(["train", "--config", str(config), *argv]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("ek", "expected"),
    [
        ("oops", "--ek expects key=value"),
        # The options reach the backend's check at spec build: the local sandbox names its bad option.
        ("root=vm", "root"),
    ],
)
def test_backend_options_reach_the_backend(tmp_path: Path, capsys, monkeypatch, ek: str, expected: str) -> None:
    monkeypatch.setenv("TRL_HARBOR_PREFLIGHT", "1")
    out = tmp_path / "run"
    assert cli_main(["train", "--ek", ek, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    assert cli_main(["eval", str(BUNDLED_SUITE), "--model", "m", "--ek", ek, "--output-dir", str(out)]) == 2
    printed = capsys.readouterr()
    assert expected in printed.out + printed.err


def test_missing_config_file_is_named(tmp_path: Path, capsys) -> None:
    assert cli_main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml is not a file" in capsys.readouterr().err


def test_demo_policy_refuses_indistinct_instructions(copy_tasks) -> None:
    from trl_harbor import HarborSpec

    suite = copy_tasks("orders_count", "http_500_count")
    (suite / "http_500_count" / "instruction.md").write_text((suite / "orders_count" / "instruction.md").read_text())
    spec = HarborSpec(suite, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    with pytest.raises(DemoPolicyError, match="not unique"):
        build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)


def _by_step(rows: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for row in rows:
        steps.setdefault(row["step"], []).append(row)
    return steps


def _right_commands() -> dict[str, str]:
    return {d.name: (d / "solution" / "solve.sh").read_text().strip() for d in BUNDLED_SUITE.iterdir() if d.is_dir()}


@requires_local
def test_config_run_trains_and_logs_every_rollout(tmp_path: Path, capsys, close_sandboxes) -> None:
    """A short real run from a YAML file with a flag on top: the flag wins, every rollout is logged."""
    config = _yaml(tmp_path, "max_steps: 5\nnum_generations: 2\nper_device_train_batch_size: 4\nindices: [1, 4]\n")
    out = tmp_path / "run"
    assert cli_main(["train", "--config", str(config), "--max_steps", "2", "--output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["demo"] is True
    rows = read_trajectories(out / "trajectories.jsonl")
    assert len(rows) == 2 * 4 == summary["rollouts"]
    names = sorted(d.name for d in BUNDLED_SUITE.iterdir() if d.is_dir())
    assert {row["task"] for row in rows} == {names[1], names[4]}
    printed = capsys.readouterr().out
    assert "DEMO POLICY" in printed and "--model Qwen/Qwen3-0.6B" in printed
    assert "mean reward: first step" in printed


@requires_local
def test_default_run_learns_and_its_trajectories_match(tmp_path: Path, capsys, close_sandboxes) -> None:
    """The embedded default, unchanged: the mean reward rises and stays up; the log is what ran.

    Rewards come from Harbor's verifier on real sandboxes. The trajectory log must agree with
    the trainer's own metrics step by step, and a rollout scores 1 exactly when its command was
    the task's reference solution (the wrong candidates can never be right).
    """
    out = tmp_path / "demo"
    assert cli_main(["train", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    rewards = summary["rewards"]
    steps = DEMO_DEFAULTS["max_steps"]
    assert summary["steps"] == steps and len(rewards) == steps
    # It learns: the mean reward rises from about chance (1 of 4 candidates is right)...
    assert summary["last_reward"] > summary["first_reward"]
    early, late = statistics.mean(rewards[:3]), statistics.mean(rewards[-5:])
    assert early < 0.7, rewards
    assert late >= 0.9, rewards
    # ... and stays up: no collapse anywhere in the second half of the run.
    assert min(rewards[steps // 2 :]) >= 0.75, rewards
    assert f"last step {summary['last_reward']:.3f}" in printed

    rows = read_trajectories(out / "trajectories.jsonl")
    per_step = _by_step(rows)
    batch = DEMO_DEFAULTS["per_device_train_batch_size"]
    assert sorted(per_step) == list(range(1, steps + 1))
    history = [r for r in json.loads((out / "log_history.json").read_text()) if "reward" in r]
    right = _right_commands()
    for step, logged in zip(range(1, steps + 1), history, strict=True):
        lines = per_step[step]
        assert len(lines) == batch
        assert statistics.mean(line["reward"] for line in lines) == pytest.approx(logged["reward"])
        for line in lines:
            assert line["harness"] == "HarborBashEnv" and line["environment_type"] == "local"
            assert line["infra_error"] is None
            assert len(line["tool_calls"]) == 1
            call = line["tool_calls"][0]
            assert call["tool"] == "bash" and call["duration_s"] >= 0 and isinstance(call["output"], str)
            command = call["arguments"]["command"]
            assert command == right[line["task"]] or command in WRONG_COMMANDS
            assert line["reward"] == (1.0 if command == right[line["task"]] else 0.0), line
            assert line["reward_components"]["reward"] == line["reward"]  # the verifier's own numbers
            if line["task"] in ("supplier_profit", "low_stock_value", "longest_session_user"):  # multi-key
                assert {"exact", "answered"} <= set(line["reward_components"]), line
            if command == "ls /workdir/data":  # the output is what the sandbox holds
                assert call["output"].split() == sorted(
                    p.name for p in (BUNDLED_SUITE / line["task"] / "environment" / "data").iterdir()
                )


@requires_local
def test_model_from_a_local_checkpoint_trains_with_trl_defaults(tmp_path: Path, close_sandboxes) -> None:
    """``--model PATH`` loads the checkpoint (no demo defaults) and saves the trained model."""
    from trl_harbor import HarborSpec

    spec = HarborSpec(BUNDLED_SUITE, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)
    checkpoint = tmp_path / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "run"
    argv = [
        "train", "--model", str(checkpoint), "--num_tasks", "2", "--max_steps", "1", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--max_completion_length", "128", "--max_tool_calling_iterations", "1",
        "--logging_steps", "1", "--report_to", "none", "--output_dir", str(out),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["demo"] is False and summary["steps"] == 1
    assert (out / "config.json").is_file()  # the trained model was saved
    rows = read_trajectories(out / "trajectories.jsonl")
    assert len(rows) == 4 and all(len(row["tool_calls"]) == 1 for row in rows)


@requires_local
def test_trajectory_log_records_what_a_rollout_did(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    """The recording harness keeps its tools; the line holds each call's arguments and real output."""
    from trl_harbor import HarborSpec
    from trl_harbor.trajectories import TrajectoryLog

    spec = HarborSpec(copy_tasks("orders_count"), environment_type="local")
    log = TrajectoryLog(tmp_path / "t.jsonl", environment_type="local")
    env = log.environment_factory({"bash": spec.environment_factory})["bash"]()
    assert type(env).__name__ == "HarborBashEnv"
    row = {k: v for k, v in spec.train_dataset[0].items() if k != "prompt"}
    env.reset(**row)
    listing = env.bash("ls /workdir/data")
    env.bash("echo -n 421 > /workdir/answer.txt")
    rewards = log.reward_func(spec.reward_funcs)(
        environments=[env], completions=[[{"role": "assistant", "content": "421"}]]
    )
    (line,) = read_trajectories(tmp_path / "t.jsonl")
    assert rewards == [1.0] and line["reward"] == 1.0 and line["reward_components"]["reward"] == 1.0
    assert line["task"] == "orders_count" and line["final_message"] == "421" and line["infra_error"] is None
    assert [c["arguments"]["command"] for c in line["tool_calls"]] == [
        "ls /workdir/data",
        "echo -n 421 > /workdir/answer.txt",
    ]
    assert line["tool_calls"][0]["output"] == listing == "orders.csv\n"


def test_the_example_config_parses() -> None:
    """examples/train_qwen3.yaml is a valid configuration, and a flag still overrides it."""
    harbor, args = parse_train_args(["--config", str(BUNDLED_SUITE.parent / "train_qwen3.yaml"), "--max_steps", "3"])
    assert harbor.model == "Qwen/Qwen3-0.6B" and harbor.command_timeout_sec == 60
    assert args.max_tool_calling_iterations == 10 and args.use_vllm and args.max_steps == 3


@requires_local
def test_several_datasets_are_mixed_with_weights(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    """``--dataset A B --dataset_weights 3 1`` trains on a mix of two suites and logs each suite's reward."""
    from trl_harbor import HarborSpec

    first = copy_tasks("orders_count", dest="first")
    second = copy_tasks("http_500_count", dest="second")
    spec = HarborSpec(BUNDLED_SUITE, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)
    checkpoint = tmp_path / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "run"
    argv = [
        "train", "--model", str(checkpoint), "--dataset", str(first), str(second), "--dataset_weights", "3", "1",
        "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size", "4",
        "--max_completion_length", "128", "--max_tool_calling_iterations", "1", "--logging_steps", "1",
        "--report_to", "none", "--output_dir", str(out), "--shuffle_dataset", "false",
    ]  # fmt: skip
    assert cli_main(argv) == 0
    history = json.loads((out / "log_history.json").read_text())
    logged = {key for record in history for key in record}
    assert {"harbor/suite/first/reward", "harbor/suite/second/reward"} & logged, sorted(logged)
    assert (
        cli_main([*argv[:6], "--dataset_weights", "1", "--output_dir", str(tmp_path / "x")]) == 2
    )  # one weight, two suites
    assert (
        cli_main(["train", "--dataset", str(first), str(second), "--output_dir", str(tmp_path / "y")]) == 2
    )  # demo: one suite
