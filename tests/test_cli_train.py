"""``trl-harbor train``: TRL's config conventions, the embedded default run's pipeline, trajectories.

Everything here is real: the command line's own parser (``trl.TrlParser`` over ``GRPOConfig``),
``GRPOTrainer``, the local bubblewrap sandboxes and Harbor's verifier. The embedded default run
trains the real starter model (SmolLM2-135M, fetched by ``scripts/bootstrap.sh``); here it runs two
tiny steps, which checks the pipeline (held-out evaluation before and after, training, summary,
report), not the learning — ``benchmarks/starter_learning.py`` measures that. The other runs use
the hand-wired tiny checkpoint of ``tests/demo_policy.py``, whose tool calls are known.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, REPO, requires_local

from demo_policy import build_demo_policy
from trl_harbor.cli import main as cli_main
from trl_harbor.cli.train import DEFAULT_RUN, parse_train_args
from trl_harbor.cli.trajectories import read_trajectories

STARTER = REPO / "examples" / "starter_tasks"


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
    assert harbor.agent == "bash"  # the file beats the default run's harness
    assert harbor.model is None
    assert harbor.chat_template == DEFAULT_RUN["chat_template"]  # default-run defaults kept where not overridden
    assert args.per_device_train_batch_size == DEFAULT_RUN["per_device_train_batch_size"]
    assert args.temperature == DEFAULT_RUN["temperature"]
    assert os.environ["TRL_HARBOR_TEST_VAR"] == "from-yaml"


def test_a_model_turns_the_default_run_defaults_off(tmp_path: Path) -> None:
    config = _yaml(tmp_path, "model: some/model\n")
    harbor, args = parse_train_args(["--config", str(config)])
    assert harbor.model == "some/model"
    assert args.learning_rate != DEFAULT_RUN["learning_rate"]  # TRL's own default
    assert harbor.agent == "bash" and harbor.chat_template is None and harbor.few_shot is None
    harbor, args = parse_train_args(["--model", "other/model", "--indices", "0", "4", "--chat_template", "qwen2_5"])
    assert harbor.model == "other/model" and harbor.indices == [0, 4] and harbor.chat_template == "qwen2_5"


@pytest.mark.parametrize(
    ("text", "argv", "expected"),
    [
        ("num_generation: 2\n", [], "num_generation"),  # a typo in the file is named
        ("", ["--num_tasks", "2", "--indices", "1"], "not both"),
        ("", ["--on_infra_error", "ignore"], "on_infra_error"),
        ("", ["--heldout_rollouts", "-1"], "--heldout_rollouts"),
        ("", ["--trainable_layers", "0"], "--trainable_layers must be at least 1"),
        # Prompt options are checked before any model loads, and the message names the option and the fix.
        ("", ["--chat_template", "qwen9"], "--chat_template 'qwen9' is neither one of TRL's bundled chat templates"),
        ("", ["--few_shot", "/nonexistent/shots.json"], "--few_shot /nonexistent/shots.json: no such file"),
        ("", ["--agent", "jupyter"], "calls the tool 'bash', which the harness 'jupyter' does not have"),
        ("", ["--heldout_dataset", "/nonexistent/suite"], "--heldout_dataset /nonexistent/suite"),
    ],
)
def test_bad_configuration_is_named(tmp_path: Path, capsys, text: str, argv: list[str], expected: str) -> None:
    config = _yaml(tmp_path, text or "seed: 1\n")
    assert cli_main(["train", "--config", str(config), "--output_dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


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


def test_the_plan_resolves_without_changing_the_arguments() -> None:
    """What a run resolves (the default run's held-out suite, the model) is the plan's, not written back."""
    from trl_harbor.cli.train import _plan

    harbor, config = parse_train_args([])
    before = dataclasses.asdict(harbor)
    plan = _plan(harbor, config)
    assert dataclasses.asdict(harbor) == before
    assert plan.default_run and plan.model is None and harbor.heldout_dataset is None
    assert plan.heldout_dataset == str(STARTER / "heldout") and plan.heldout is not None
    assert plan.suites == [str(STARTER / "train")]
    harbor, config = parse_train_args(["--heldout_rollouts", "0"])
    assert _plan(harbor, config).heldout_dataset is None


def test_missing_config_file_is_named(tmp_path: Path, capsys) -> None:
    assert cli_main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml is not a file" in capsys.readouterr().err


def _by_step(rows: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for row in rows:
        steps.setdefault(row["step"], []).append(row)
    return steps


def _check_heldout(folder: Path, tasks: int, per_task: int) -> dict:
    """The held-out evaluation folder is an eval run's: eval.json agrees with its trajectories."""
    result = json.loads((folder / "eval.json").read_text())
    rows = read_trajectories(folder / "trajectories.jsonl")
    assert len(rows) == tasks * per_task == result["rollouts"]
    assert result["errors"] == 0
    for score in result["tasks"]:
        mine = [r for r in rows if r["task"] == score["task"]]
        assert len(mine) == per_task == score["n"]
        assert score["passed"] == sum(r["reward"] == 1.0 for r in mine)
    return result


@requires_local
@pytest.mark.slow
def test_default_run_pipeline(tmp_path: Path, capsys, close_sandboxes) -> None:
    """The embedded default on the real starter model, two tiny steps: every phase runs and agrees.

    Not a test of learning (two steps of two rollouts cannot show it): it checks that the
    held-out tasks are sampled before and after training with the eval command's machinery, that
    the numbers the summary prints are those of the files written, that training ran on the
    starter suite's training tasks with the default prompt, and that the report shows both.
    """
    config = _yaml(tmp_path, "max_steps: 5\nnum_generations: 2\nper_device_train_batch_size: 2\n")
    out = tmp_path / "run"
    argv = ["train", "--config", str(config), "--max_steps", "2", "--max_completion_length", "48",
            "--heldout_rollouts", "1", "--output_dir", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["default_run"] is True  # the flag beat the file
    assert "SmolLM2-135M-Instruct" in summary["model"]
    assert "DEMO" not in printed and "SmolLM2-135M-Instruct" in printed

    # Training: the starter suite's training tasks only, each rollout logged, the log agreeing with the metrics.
    train_tasks = {d.name for d in (STARTER / "train").iterdir()}
    heldout_tasks = sorted(d.name for d in (STARTER / "heldout").iterdir())
    rows = read_trajectories(out / "trajectories.jsonl")
    assert len(rows) == 2 * 2 == summary["rollouts"]
    assert {row["task"] for row in rows} <= train_tasks
    history = [r for r in json.loads((out / "log_history.json").read_text()) if "reward" in r]
    for (step, lines), logged in zip(sorted(_by_step(rows).items()), history, strict=True):
        assert statistics.mean(line["reward"] for line in lines) == pytest.approx(logged["reward"]), step
        for line in lines:
            assert line["harness"] == "MinimalBashEnv" and line["infra_error"] is None
            assert line["reward"] in (0.0, 1.0) and line["reward_components"]["reward"] == line["reward"]

    # Held out: sampled before and after, never trained on, and the summary's figures are the files'.
    assert summary["heldout_tasks"] == len(heldout_tasks) and summary["heldout_rollouts"] == 1
    before = _check_heldout(out / "heldout-before", len(heldout_tasks), 1)
    after = _check_heldout(out / "heldout-after", len(heldout_tasks), 1)
    assert sorted(t["task"] for t in before["tasks"]) == heldout_tasks
    assert not set(heldout_tasks) & train_tasks
    for name, result in (("before", before), ("after", after)):
        assert summary[f"heldout_{name}"]["pass_rate"] == pytest.approx(result["pass_at"]["1"])
        assert summary[f"heldout_{name}"]["passed"] == sum(t["passed"] for t in result["tasks"])
        assert result["config"]["seed"] == DEFAULT_RUN["seed"] and result["config"]["few_shot"]
        assert result["config"]["temperature"] == DEFAULT_RUN["temperature"]
    line = next(line for line in printed.splitlines() if line.startswith("held-out pass rate"))
    b, a = summary["heldout_before"], summary["heldout_after"]
    assert f"base model {b['pass_rate']:.2f} ({b['passed']}/{b['scored']})" in line
    assert f"trained {a['pass_rate']:.2f} ({a['passed']}/{a['scored']})" in line
    # Only the top blocks trained: everything below them is the starter model's, bit for bit.
    import torch
    from safetensors.torch import load_file

    assert f"training its top {DEFAULT_RUN['trainable_layers']} blocks" in printed
    trained, base = load_file(out / "model.safetensors"), load_file(Path(summary["model"]) / "model.safetensors")
    lowest_trained = 30 - DEFAULT_RUN["trainable_layers"]
    for name in ("model.embed_tokens.weight", f"model.layers.{lowest_trained - 1}.mlp.up_proj.weight"):
        assert torch.equal(trained[name], base[name]), name
    # The first run's costs are in the progress lines and the summary.
    assert "  model   loaded in" in printed and "  images  " in printed and " s/step" in printed
    assert {"model_load_s", "train_s", "heldout_before_s", "heldout_after_s"} <= set(summary["timings"])
    assert summary["peak_rss_mb"] > 0

    # The report: the reward curve and the held-out comparison.
    page = (out / "report.html").read_text()
    assert "Mean reward over steps" in page and "Held-out tasks: before vs after training" in page
    assert f"<b id=heldout-before>{b['pass_rate']:.3f}</b>" in page
    # The saved model carries the chat template it was trained with (trl-harbor eval --model OUT works).
    from trl_harbor.cli.prompting import resolve_chat_template

    saved = json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
    if saved is None:
        saved = (out / "chat_template.jinja").read_text()
    assert saved == resolve_chat_template("qwen2_5")


def _demo_checkpoint(tmp_path: Path) -> Path:
    from trl_harbor import HarborSpec

    spec = HarborSpec(BUNDLED_SUITE, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)
    checkpoint = tmp_path / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    return checkpoint


@requires_local
def test_model_from_a_local_checkpoint_trains_with_trl_defaults(tmp_path: Path, close_sandboxes, monkeypatch) -> None:
    """``--model PATH`` loads the checkpoint (no default-run defaults) and saves the trained model.

    The command line trains with :class:`~trl_harbor.HarborGRPOTrainer`: a turn's tool calls are
    started together (its dispatcher runs, with ``--tool_concurrency``).
    """
    from trl_harbor.training import trainer as trainer_module

    dispatched: list[int | None] = []
    original = trainer_module._TurnDispatcher.__init__

    def spy(self, completions, sync_dicts, async_dicts, async_loop, max_threads) -> None:
        dispatched.append(max_threads)
        original(self, completions, sync_dicts, async_dicts, async_loop, max_threads)

    monkeypatch.setattr(trainer_module._TurnDispatcher, "__init__", spy)
    checkpoint = _demo_checkpoint(tmp_path)
    out = tmp_path / "run"
    argv = [
        "train", "--model", str(checkpoint), "--num_tasks", "2", "--max_steps", "1", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--max_completion_length", "128", "--max_tool_calling_iterations", "1",
        "--logging_steps", "1", "--report_to", "none", "--output_dir", str(out), "--tool_concurrency", "3",
    ]  # fmt: skip
    assert cli_main(argv) == 0
    assert dispatched and set(dispatched) == {3}  # the concurrent trainer's tool loop ran
    summary = json.loads((out / "summary.json").read_text())
    assert summary["default_run"] is False and summary["steps"] == 1
    assert summary["heldout_before"] is None  # no --heldout_dataset, no held-out evaluation
    assert (out / "config.json").is_file()  # the trained model was saved
    rows = read_trajectories(out / "trajectories.jsonl")
    assert len(rows) == 4 and all(len(row["tool_calls"]) == 1 for row in rows)
    assert all(row["harness"] == "HarborBashEnv" for row in rows)


@requires_local
def test_heldout_dataset_measures_any_run(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    """``--heldout_dataset`` with ``--model``: sampled before and after with the same seed; both logged.

    The checkpoint's right command for one held-out task is made certain and the other task's
    impossible, so each pass count is known before and after (one step moves the weights little).
    """
    import torch

    from demo_policy import _FIRST_TASK, WRONG_COMMANDS
    from trl_harbor import HarborSpec
    from trl_harbor.testing import tool_call_text

    suite = copy_tasks("http_500_count", "orders_count", dest="heldout")
    spec = HarborSpec(BUNDLED_SUITE, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)
    slot = {task.name: i for i, task in enumerate(spec.tasks)}

    def token(command: str) -> int:
        return policy.tokenizer(tool_call_text("bash", {"command": command}), add_special_tokens=False)["input_ids"][0]

    with torch.no_grad():
        policy.model.lm_head.weight[token(policy.right["http_500_count"]), _FIRST_TASK + slot["http_500_count"]] += 40
        policy.model.lm_head.weight[token(WRONG_COMMANDS[2]), _FIRST_TASK + slot["orders_count"]] += 40
    checkpoint = tmp_path / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "run"
    argv = [
        "train", "--model", str(checkpoint), "--indices", "0", "--max_steps", "1", "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--max_completion_length", "128", "--max_tool_calling_iterations", "1",
        "--optim", "sgd", "--learning_rate", "0.001", "--heldout_dataset", str(suite), "--heldout_rollouts", "3",
        "--output_dir", str(out),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    for name in ("before", "after"):
        result = _check_heldout(out / f"heldout-{name}", 2, 3)
        by_task = {t["task"]: t["passed"] for t in result["tasks"]}
        assert by_task == {"http_500_count": 3, "orders_count": 0}, (name, by_task)
        assert summary[f"heldout_{name}"]["passed"] == 3 and summary[f"heldout_{name}"]["scored"] == 6
        assert result["config"]["max_turns"] == 1 and result["config"]["max_tokens"] == 128


@requires_local
def test_trajectory_log_records_what_a_rollout_did(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    """The recording harness keeps its tools; the line holds each call's arguments and real output."""
    from trl_harbor import HarborSpec
    from trl_harbor.cli.trajectories import TrajectoryLog

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
    first = copy_tasks("orders_count", dest="first")
    second = copy_tasks("http_500_count", dest="second")
    checkpoint = _demo_checkpoint(tmp_path)
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
