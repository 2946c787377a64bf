"""``HarborSpec``: dataset columns, subsetting, factory, reward funcs, errors, lazy imports."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_TASK

from trl_harbor import HarborBashEnv, HarborEnv, HarborOptions, HarborSpec, TaskSuiteError
from trl_harbor.training.rewards import harbor_reward

NAMES = sorted(p.name for p in BUNDLED_SUITE.iterdir() if (p / "task.toml").is_file())


def test_dataset_columns_and_rows(bundled_suite: Path) -> None:
    spec = HarborSpec(str(bundled_suite))
    ds = spec.train_dataset
    assert len(ds) == 15
    for column in (
        "prompt",
        "task_dir",
        "task_index",
        "gold_answer",
        "reward_mode",
        "difficulty_level",
        "kaggle_dataset",
        "task_id",
        "title",
        "reward_mode_initial",
        "category",
        "tags",
    ):
        assert column in ds.column_names, column
    assert ds["prompt"][0] == [{"role": "user", "content": ""}]
    assert [Path(d).name for d in ds["task_dir"]] == NAMES
    assert ds["task_index"] == list(range(15))
    row = ds[NAMES.index(GOLD_TASK)]
    assert row["gold_answer"] == "51.46" and row["difficulty_level"] == 5
    assert row["reward_mode"] == row["reward_mode_initial"] == "numeric"
    assert row["kaggle_dataset"] is None
    assert spec.train_dataset is ds  # computed once


def test_without_metadata(bundled_suite: Path) -> None:
    ds = HarborSpec(bundled_suite, include_metadata=False).train_dataset
    assert ds.column_names == ["prompt", "task_dir", "task_index"]


def test_num_tasks_and_indices(bundled_suite: Path) -> None:
    ds = HarborSpec(bundled_suite, num_tasks=4).train_dataset
    assert [Path(d).name for d in ds["task_dir"]] == NAMES[:4]
    ds = HarborSpec(bundled_suite, indices=[7, 2]).train_dataset
    assert [Path(d).name for d in ds["task_dir"]] == [NAMES[7], NAMES[2]]
    assert ds["task_index"] == [7, 2]
    with pytest.raises(ValueError, match="not both"):
        HarborSpec(bundled_suite, num_tasks=2, indices=[0])
    with pytest.raises(ValueError, match="out of range"):
        HarborSpec(bundled_suite, indices=[15])
    with pytest.raises(ValueError, match="leaves no task"):
        HarborSpec(bundled_suite, num_tasks=0)


def test_malformed_task_fails_in_the_constructor(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK, "orders_count")
    (root / "orders_count" / "instruction.md").unlink()
    with pytest.raises(TaskSuiteError, match="instruction.md is missing"):
        HarborSpec(root)
    with pytest.raises(TaskSuiteError, match="instruction.md is missing"):  # a folder is validated whole
        HarborSpec(root, num_tasks=1)
    with pytest.raises(TaskSuiteError, match="no such directory"):
        HarborSpec("./does/not/exist")


def test_agent_errors_in_the_constructor(bundled_suite: Path) -> None:
    with pytest.raises(ValueError, match="bash"):
        HarborSpec(bundled_suite, agent="nope")
    with pytest.raises(TypeError):
        HarborSpec(bundled_suite, agent="collections:OrderedDict")


def test_environment_factory_builds_fresh_picklable_envs(bundled_suite: Path, tmp_path: Path) -> None:
    spec = HarborSpec(bundled_suite, environment_type="local", options=HarborOptions(command_timeout_sec=30))
    factory = spec.environment_factory
    a, b = factory(), factory()
    assert isinstance(a, HarborBashEnv) and a is not b
    assert a._environment_type == "local" and a.options.command_timeout_sec == 30
    clone = pickle.loads(pickle.dumps(factory))
    assert isinstance(clone(), HarborBashEnv)

    harness = tmp_path / "harness.py"
    harness.write_text("from trl_harbor import HarborBashEnv\n\nclass MyEnv(HarborBashEnv):\n    pass\n")
    spec = HarborSpec(bundled_suite, agent=f"{harness}:MyEnv")
    clone = pickle.loads(pickle.dumps(spec.environment_factory))
    assert type(clone()).__name__ == "MyEnv"


def test_factory_unpickles_in_a_fresh_process(bundled_suite: Path, tmp_path: Path) -> None:
    harness = tmp_path / "harness.py"
    harness.write_text("from trl_harbor import HarborBashEnv\n\nclass MyEnv(HarborBashEnv):\n    pass\n")
    blob = tmp_path / "factory.pkl"
    blob.write_bytes(pickle.dumps(HarborSpec(bundled_suite, agent=f"{harness}:MyEnv").environment_factory))
    code = f"import pickle; print(type(pickle.loads(open({str(blob)!r}, 'rb').read())()).__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "MyEnv", result.stderr


def test_reward_funcs(bundled_suite: Path) -> None:
    spec = HarborSpec(bundled_suite)
    func = spec.reward_funcs
    assert func is harbor_reward  # one function, as in trl.experimental.harbor
    envs = [spec.environment_factory() for _ in range(3)]
    assert func(completions=["a", "b", "c"], environments=envs) == [0.0, 0.0, 0.0]  # never reset
    assert func(completions=["a", "b"], environment_reward=[1, 0.5]) == [1.0, 0.5]
    with pytest.raises(ValueError, match="environments"):
        func(completions=["a"])


def test_import_is_light_and_dataset_is_lazy() -> None:
    code = textwrap.dedent(
        f"""
        import sys
        import trl_harbor
        heavy = [m for m in ("torch", "trl", "datasets", "transformers") if m in sys.modules]
        assert not heavy, heavy
        spec = trl_harbor.HarborSpec({str(BUNDLED_SUITE)!r}, num_tasks=2)
        env = spec.environment_factory()
        assert env.reward == 0.0
        heavy = [m for m in ("torch", "trl", "datasets", "transformers") if m in sys.modules]
        assert not heavy, heavy
        spec.train_dataset
        assert "datasets" in sys.modules
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def test_custom_harness_class(bundled_suite: Path) -> None:
    class Custom(HarborEnv):
        pass

    spec = HarborSpec(bundled_suite, agent=Custom)
    assert spec.env_cls is Custom and type(spec.environment_factory()) is Custom
