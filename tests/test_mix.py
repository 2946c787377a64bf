"""``HarborSpec.mix``: weighted, reproducible mixed datasets; routing; per-suite metrics; errors.

The last test runs a real CPU ``GRPOTrainer`` step over two suites with two harnesses (``bash``
and ``terminal_notes``) on the local sandbox, and checks that every row ran in its own harness
and in its own task's sandbox, and that the rewards are logged per suite.
"""

from __future__ import annotations

import math
import pickle
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, requires_local, trl_tools

from sandbox_helpers import BASE_DOCKERFILE
from trl_harbor import HarborBashEnv, HarborMix, HarborMixError, HarborOptions, HarborSpec
from trl_harbor.training.mix import harbor_mix_reward

NAMES = sorted(p.name for p in BUNDLED_SUITE.iterdir() if (p / "task.toml").is_file())


def make_suite(root: Path, *names: str, edit: dict[str, str] | None = None) -> Path:
    """Copy bundled tasks into ``root`` (a suite of its own); ``edit`` replaces text in their task.toml."""
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(BUNDLED_SUITE / name, root / name)
        toml = root / name / "task.toml"
        text = toml.read_text()
        for old, new in (edit or {}).items():
            assert old in text, (name, old)
            text = text.replace(old, new)
        toml.write_text(text)
    return root


# ── the mixed dataset ────────────────────────────────────────────────────────────────────


def test_proportions_match_the_weights_on_a_large_draw() -> None:
    specs = {
        "all": HarborSpec(BUNDLED_SUITE, environment_type="local"),
        "five": HarborSpec(BUNDLED_SUITE, environment_type="local", num_tasks=5),
        "three": HarborSpec(BUNDLED_SUITE, environment_type="local", indices=[2, 7, 11]),
    }
    mix = HarborSpec.mix(specs, weights=[0.5, 0.3, 0.2], num_rows=10_000, seed=3)
    ds = mix.train_dataset
    assert len(ds) == len(mix) == 10_000
    suites = ds["suite"]
    assert Counter(suites) == {"all": 5000, "five": 3000, "three": 2000}
    # Every prefix follows the weights too (what a run of max_steps without shuffling sees).
    counts = Counter()
    for n, suite in enumerate(suites, start=1):
        counts[suite] += 1
        for name, weight in zip(specs, (0.5, 0.3, 0.2), strict=True):
            assert abs(counts[name] - weight * n) <= 1.0, (n, name, counts)
    # Within a suite, tasks are dealt in passes: each task equally often (within one).
    for name, spec in specs.items():
        per_task = Counter(d for d, s in zip(ds["task_dir"], suites, strict=True) if s == name)
        assert set(per_task) == {str(p) for p in spec.task_dirs}
        assert max(per_task.values()) - min(per_task.values()) <= 1, (name, per_task)
    # Routing columns: each row names its own spec's environment, and its task is from that spec.
    by_env = {entry.environment: entry for entry in mix.entries}
    for env, suite, task_dir in zip(ds["environment"], suites, ds["task_dir"], strict=True):
        assert by_env[env].suite == suite
        assert Path(task_dir) in by_env[env].spec.task_dirs
    # Weights need not sum to 1: the same weights scaled give the same dataset.
    scaled = HarborSpec.mix(specs, weights=[5, 3, 2], num_rows=10_000, seed=3).train_dataset
    assert scaled["task_dir"] == ds["task_dir"] and scaled["suite"] == suites


def test_same_seed_same_order_other_seed_other_order() -> None:
    def rows(seed: int) -> list[tuple[str, str]]:
        a = HarborSpec(BUNDLED_SUITE, num_tasks=10)
        b = HarborSpec(BUNDLED_SUITE, agent="terminal_notes", indices=[10, 11, 12, 13, 14])
        ds = HarborSpec.mix({"a": a, "b": b}, weights=[2, 1], seed=seed, num_rows=300).train_dataset
        return list(zip(ds["suite"], ds["task_dir"], strict=True))

    first = rows(0)
    assert rows(0) == first
    assert rows(1) != first
    assert Counter(s for s, _ in rows(1)) == Counter(s for s, _ in first) == {"a": 200, "b": 100}


def test_default_size_holds_every_task_and_equal_weights(tmp_path: Path) -> None:
    small = HarborSpec(make_suite(tmp_path / "small", *NAMES[:3]), agent="terminal_notes")
    mix = HarborSpec.mix([HarborSpec(BUNDLED_SUITE), small])  # equal weights, 15 and 3 tasks
    ds = mix.train_dataset
    assert mix.suites == ["examples", "small"]  # a folder of tasks is named after it ("tasks" -> its parent)
    assert mix.weights == [0.5, 0.5]
    assert Counter(ds["suite"]) == {"examples": 15, "small": 15}
    assert set(ds["task_dir"]) >= {str(p) for p in HarborSpec(BUNDLED_SUITE).task_dirs}
    assert Counter(d for d, s in zip(ds["task_dir"], ds["suite"], strict=True) if s == "small") == {
        str(p): 5 for p in small.task_dirs
    }
    # Unequal weights: the smallest dataset with every task of every suite at least once.
    mix = HarborSpec.mix([HarborSpec(BUNDLED_SUITE), small], weights=[1, 3])
    assert Counter(mix.train_dataset["suite"]) == {"examples": 15, "small": 45}
    # Every distinct task of the mix (for tools that look at the tasks, e.g. to build images first).
    assert mix.task_dirs == [*HarborSpec(BUNDLED_SUITE).task_dirs, *small.task_dirs]
    assert [t.name for t in mix.tasks] == [*NAMES, *NAMES[:3]]


def test_rows_keep_their_columns_and_metadata_of_suites_coexist(tmp_path: Path) -> None:
    plain = HarborSpec(make_suite(tmp_path / "plain", GOLD_TASK), include_metadata=False)
    tagged = HarborSpec(
        make_suite(
            tmp_path / "tagged", "orders_count", edit={"difficulty_level = 1": "difficulty_level = 1.5\nsuite = 'x'"}
        )
    )
    ints = HarborSpec(make_suite(tmp_path / "ints", "http_500_count"))
    mix = HarborSpec.mix([plain, tagged, ints])
    ds = mix.train_dataset
    rows = {row["suite"]: row for row in ds}
    assert set(rows) == {"plain", "tagged", "ints"}
    # Columns of one suite are None in the others; ints and floats of one column merge to float.
    assert rows["plain"]["gold_answer"] is None and rows["plain"]["tags"] is None
    assert rows["tagged"]["gold_answer"] == "421" and rows["tagged"]["difficulty_level"] == 1.5
    assert rows["ints"]["difficulty_level"] == 1.0 and isinstance(rows["ints"]["difficulty_level"], float)
    # A [metadata] key "suite" cannot take the mix's column: it is kept as metadata_suite.
    assert rows["tagged"]["metadata_suite"] == "x" and rows["tagged"]["suite"] == "tagged"
    assert rows["plain"]["task_dir"] == str(plain.task_dirs[0])
    assert rows["plain"]["prompt"] == [{"role": "user", "content": ""}]


def test_clashing_column_types_name_the_column_and_both_suites(tmp_path: Path) -> None:
    ints = HarborSpec(make_suite(tmp_path / "ints", GOLD_TASK))
    words = HarborSpec(
        make_suite(tmp_path / "words", "orders_count", edit={"difficulty_level = 1": 'difficulty_level = "easy"'})
    )
    with pytest.raises(
        HarborMixError, match=r"'difficulty_level' is int64 in suite 'ints' but string in suite 'words'"
    ):
        HarborSpec.mix([ints, words])
    # Fixed by leaving one suite's metadata out.
    words = HarborSpec(words.suite.root, include_metadata=False)
    assert len(HarborSpec.mix([ints, words]).train_dataset) == 2


# ── environments and rewards ─────────────────────────────────────────────────────────────


def test_one_environment_per_combination_with_stable_names() -> None:
    from trl_harbor.training.harnesses.terminal_notes.env import TerminalNotesEnv

    specs = [
        HarborSpec(BUNDLED_SUITE, agent="bash", environment_type="local"),
        HarborSpec(BUNDLED_SUITE, agent="terminal_notes", environment_type="local"),
        HarborSpec(BUNDLED_SUITE, agent="bash", environment_type="docker"),
        HarborSpec(BUNDLED_SUITE, agent="bash", environment_type="local", options=HarborOptions(command_timeout_sec=9)),
    ]
    mix = HarborSpec.mix(specs, weights=[4, 3, 2, 1])
    factories = mix.environment_factory
    names = list(factories)
    assert names[:3] == ["examples:bash@local", "examples:terminal_notes@local", "examples:bash@docker"]
    assert names[3].startswith("examples:bash@local+") and len(names[3]) == len("examples:bash@local+") + 8
    # Names depend only on the combination: the same spec alone gets the same name.
    assert list(HarborSpec.mix([specs[3]]).environment_factory) == [names[3]]
    assert set(mix.train_dataset["environment"]) == set(names)
    assert set(mix.train_dataset["suite"]) == {"examples"}
    envs = {name: factory() for name, factory in factories.items()}
    assert type(envs[names[0]]) is HarborBashEnv and type(envs[names[1]]) is TerminalNotesEnv
    assert envs[names[2]]._environment_type == "docker" and envs[names[3]].options.command_timeout_sec == 9
    # The factories travel to worker processes.
    clones = pickle.loads(pickle.dumps(factories))
    assert [type(clones[n]()) for n in names] == [type(envs[n]) for n in names]
    assert mix.reward_funcs is harbor_mix_reward


def test_mix_reward_logs_per_suite_metrics() -> None:
    logged: list[tuple[str, float]] = []
    rewards = harbor_mix_reward(
        environment_reward=[1.0, 0.0, None, 1.0, 0.0],
        suite=["a", "a", "b", "c", "c"],
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert rewards == [1.0, 0.0, None, 1.0, 0.0]
    metrics = dict(logged)
    assert metrics["harbor/suite/a/reward"] == 0.5 and metrics["harbor/suite/a/infra_failures"] == 0
    assert "harbor/suite/b/reward" not in metrics and metrics["harbor/suite/b/infra_failures"] == 1
    assert metrics["harbor/suite/c/rollouts"] == 2 and metrics["harbor/suite/c/reward"] == 0.5
    # Without a suite column (e.g. a plain spec's rows) it is harbor_reward.
    assert harbor_mix_reward(environment_reward=[0.25]) == [0.25]
    with pytest.raises(ValueError, match="environments"):
        harbor_mix_reward(suite=["a"])


@requires_local
def test_mix_reward_counts_infra_failures_per_suite(tmp_path: Path, close_sandboxes: None) -> None:
    """A sandbox that cannot start is an infrastructure loss of its own suite, not of the others."""
    good = make_suite(tmp_path / "good", GOLD_TASK)
    broken = make_suite(tmp_path / "broken", GOLD_TASK)
    (broken / GOLD_TASK / "environment" / "Dockerfile").write_text(
        BASE_DOCKERFILE + "RUN apt-get install -y no-such-package-anywhere\n"
    )
    mix = HarborSpec.mix([HarborSpec(good, environment_type="local"), HarborSpec(broken, environment_type="local")])
    rows = list(mix.train_dataset)
    envs = [mix.environment_factory[row["environment"]]() for row in rows]
    for env, row in zip(envs, rows, strict=True):
        env.reset(**{k: v for k, v in row.items() if k != "environment"})  # as TRL does
        env.bash(f"echo -n {GOLD_ANSWER} > /workdir/answer.txt")
    logged: dict[str, float] = {}
    rewards = harbor_mix_reward(
        completions=[None] * 2,
        environments=envs,
        log_metric=logged.__setitem__,
        **{k: [row[k] for row in rows] for k in rows[0] if k != "prompt"},
    )
    by_suite = dict(zip([row["suite"] for row in rows], rewards, strict=True))
    assert by_suite == {"good": 1.0, "broken": None}  # skipped: not the policy's fault
    assert logged["harbor/suite/good/reward"] == 1.0 and logged["harbor/suite/good/infra_failures"] == 0
    assert logged["harbor/suite/broken/infra_failures"] == 1 and "harbor/suite/broken/reward" not in logged
    assert logged["harbor/infra_failures"] == 1  # harbor_reward's batch-wide metrics are still logged


# ── impossible combinations fail when the mix is built ───────────────────────────────────


def test_impossible_mixes_are_clear_errors(tmp_path: Path) -> None:
    spec = HarborSpec(BUNDLED_SUITE)
    other = HarborSpec(BUNDLED_SUITE, agent="terminal_notes")
    with pytest.raises(HarborMixError, match="at least one spec"):
        HarborSpec.mix([])
    with pytest.raises(HarborMixError, match="0 weight"):
        HarborSpec.mix([spec, other], weights=[])
    with pytest.raises(HarborMixError, match="1 weight.*2 spec"):
        HarborSpec.mix([spec, other], weights=[1])
    for bad in (-1, 0, math.nan, math.inf):
        with pytest.raises(HarborMixError, match=r"weights\[1\].*> 0"):
            HarborSpec.mix([spec, other], weights=[1, bad])
    with pytest.raises(HarborMixError, match="must be numbers"):
        HarborSpec.mix([spec, other], weights=[1, "2"])
    with pytest.raises(HarborMixError, match="list of numbers"):
        HarborSpec.mix([spec, other], weights="12")
    with pytest.raises(HarborMixError, match="exactly one weight per spec name"):
        HarborSpec.mix({"a": spec, "b": other}, weights={"a": 1, "c": 2})
    assert HarborSpec.mix({"a": spec, "b": other}, weights={"b": 3, "a": 1}).weights == [0.25, 0.75]
    with pytest.raises(TypeError, match=r"specs\[1\] is a str, not a HarborSpec"):
        HarborSpec.mix([spec, "examples/tasks"])
    with pytest.raises(TypeError, match="not the mix"):
        HarborSpec.mix([spec, HarborSpec.mix([other])])
    with pytest.raises(TypeError, match="list of HarborSpec"):
        HarborSpec.mix(spec)
    with pytest.raises(TypeError, match="seed"):
        HarborSpec.mix([spec], seed="0")
    # Two different suites with the same name: name them apart.
    twin = HarborSpec(make_suite(tmp_path / "x" / "examples", *NAMES[:2]))
    with pytest.raises(HarborMixError, match="two different suites named 'examples'.*name them apart"):
        HarborSpec.mix([spec, twin])
    assert HarborSpec.mix({"bundled": spec, "twin": twin}).suites == ["bundled", "twin"]
    # The same combination twice could not be told apart: merge, or name apart.
    with pytest.raises(HarborMixError, match=r"specs\[0\] and specs\[1\] are the same combination"):
        HarborSpec.mix([spec, HarborSpec(BUNDLED_SUITE, num_tasks=3)], weights=[1, 2])
    assert HarborSpec.mix({"all": spec, "first3": HarborSpec(BUNDLED_SUITE, num_tasks=3)}).suites == ["all", "first3"]
    # Too few rows for a spec to get any.
    with pytest.raises(HarborMixError, match=r"no row for 'examples'.*num_rows >= 200"):
        HarborSpec.mix([spec, other], [1, 199], num_rows=50)
    with pytest.raises(HarborMixError, match="positive integer"):
        HarborSpec.mix([spec], num_rows=0)


def test_importing_the_package_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trl_harbor; trl_harbor.HarborMix; "
        "print(sorted(m for m in ('torch', 'datasets', 'trl', 'harbor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert HarborMix.__module__ == "trl_harbor.training.mix"


# ── a real GRPOTrainer step over two suites with two harnesses ───────────────────────────

#: (suite, task, gold answer, the task's data file, harness tool) of the two suites.
SUITES = {
    "humidity": (GOLD_TASK, "51.46", "sensors.json", "bash"),
    "orders": ("orders_count", "421", "orders.csv", "shell_exec"),
}


@requires_local
@pytest.mark.slow
@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "HarborGRPOTrainer"])
def test_grpo_step_routes_rows_to_their_harness_and_sandbox(
    tmp_path: Path, close_sandboxes: None, trainer_name: str
) -> None:
    """TRL's trainer, and trl-harbor's (a turn's tool calls run at the same time), over a mix."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trl_harbor import HarborGRPOTrainer
    from trl_harbor.testing import build_model, build_tokenizer, script_tool_calls, tool_call_text
    from trl_harbor.training.harnesses.terminal_notes.env import TerminalNotesEnv

    resets: dict[int, str] = {}  # env id -> task_dir of its last reset
    ran: list[tuple[int, str, str]] = []  # (env id, command, output): every command run in a sandbox

    class Recording:
        def reset(self, task_dir: str | None = None, **row):
            resets[id(self)] = task_dir
            return super().reset(task_dir=task_dir, **row)

        def _exec(self, command: str, timeout: int | None = None, user=None) -> str:
            output = super()._exec(command, timeout=timeout, user=user)
            ran.append((id(self), command, output))
            return output

    class BashHarness(Recording, HarborBashEnv):
        pass

    class NotesHarness(Recording, TerminalNotesEnv):
        pass

    harnesses = {"humidity": BashHarness, "orders": NotesHarness}
    commands = {s: f"ls /workdir/data; echo -n {gold} > /workdir/answer.txt" for s, (_, gold, _, _) in SUITES.items()}
    specs = {
        suite: HarborSpec(make_suite(tmp_path / suite, task), agent=harnesses[suite], environment_type="local")
        for suite, (task, *_) in SUITES.items()
    }
    mix = HarborSpec.mix(specs)  # one task per suite, equal weights: two rows, one per suite
    assert sorted(mix.train_dataset["suite"]) == ["humidity", "orders"]
    env_of = {entry.suite: entry.environment for entry in mix.entries}

    mix_reward = mix.reward_funcs
    scored: list[dict] = []

    def recorded_reward(completions, environments=None, **kwargs):
        rewards = mix_reward(completions=completions, environments=environments, **kwargs)
        scored.append({"rewards": rewards, "environments": list(environments), **kwargs})
        return rewards

    calls = [tool_call_text(SUITES[s][3], {"command": commands[s]}) for s in SUITES]
    suffixes = [BashHarness.PROMPT_SUFFIX, NotesHarness.PROMPT_SUFFIX]
    instructions = [p.read_text() for p in BUNDLED_SUITE.glob("*/instruction.md")]
    tokenizer = build_tokenizer(corpus=[*instructions, *suffixes], extra_tokens=calls)
    model = build_model(tokenizer, seed=0)
    script_tool_calls(model, tokenizer, calls)  # each turn: one of the two harnesses' calls
    torch.manual_seed(1)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=4,  # two prompts (both suites), two rollouts each
        max_completion_length=96,
        max_tool_calling_iterations=2,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=1,
    )
    trainer_cls = {"GRPOTrainer": GRPOTrainer, "HarborGRPOTrainer": HarborGRPOTrainer}[trainer_name]
    trainer = trainer_cls(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=mix.train_dataset,
        environment_factory=mix.environment_factory,
        reward_funcs=[recorded_reward],
    )
    # Each environment exposes only its own harness's tools.
    assert [t.__name__ for t in trainer._env_tools[env_of["humidity"]]] == ["bash"]
    assert [t.__name__ for t in trainer._env_tools[env_of["orders"]]] == trl_tools(TerminalNotesEnv)
    trainer.train()

    assert len(scored) == 1
    batch = scored[0]
    assert len(batch["rewards"]) == 4 and Counter(batch["suite"]) == {"humidity": 2, "orders": 2}
    solved = Counter()
    for i, suite in enumerate(batch["suite"]):
        env = batch["environments"][i]
        task, gold, data_file, _ = SUITES[suite]
        # The row went to its suite's environment, in its harness, reset on its own task ...
        assert batch["environment"][i] == env_of[suite]
        assert type(env) is harnesses[suite]
        assert resets[id(env)] == batch["task_dir"][i] == str(specs[suite].task_dirs[0])
        # ... and every command of this rollout ran in that task's sandbox (its data file is there).
        own = [(cmd, out) for e, cmd, out in ran if e == id(env)]
        answered = [out for cmd, out in own if cmd == commands[suite]]
        assert all(data_file in out for out in answered), (suite, own)
        assert not any(cmd == commands[other] for cmd, _ in own for other in SUITES if other != suite)
        # The verifier scored it: the gold answer was written iff the harness's own tool ran.
        assert batch["rewards"][i] == (1.0 if answered else 0.0), (suite, own, batch["rewards"])
        solved[suite] += bool(answered)
    assert all(solved[s] for s in SUITES), f"the seeded policy must solve a rollout of each suite: {solved}"

    logged = trainer.state.log_history[0]
    for suite in SUITES:
        rewards = [r for r, s in zip(batch["rewards"], batch["suite"], strict=True) if s == suite]
        assert logged[f"harbor/suite/{suite}/reward"] == pytest.approx(sum(rewards) / len(rewards))
        assert logged[f"harbor/suite/{suite}/infra_failures"] == 0
        assert logged[f"harbor/suite/{suite}/rollouts"] == 2
    assert logged["reward"] == pytest.approx(sum(batch["rewards"]) / 4)
