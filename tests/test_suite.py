"""Finding and validating task suites: local layouts, the hub cache, metadata columns, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_TASK

from trl_harbor.rollout.suite import (
    TaskInfo,
    TaskSuiteError,
    find_suite_root,
    load_suite,
    metadata_columns,
    select_tasks,
)

BUNDLED_NAMES = sorted(p.name for p in BUNDLED_SUITE.iterdir() if (p / "task.toml").is_file())


def test_bundled_suite_loads_sorted(bundled_suite: Path) -> None:
    suite = load_suite(bundled_suite)
    assert [t.path.name for t in suite.tasks] == BUNDLED_NAMES
    assert len(suite.tasks) == 15
    assert all(t.path.is_absolute() for t in suite.tasks)
    humidity = next(t for t in suite.tasks if t.name == GOLD_TASK)
    assert humidity.metadata["gold_answer"] == "51.46"


def test_parent_with_tasks_subtree_and_task_folder_resolve_alike(bundled_suite: Path) -> None:
    assert find_suite_root(bundled_suite.parent) == bundled_suite.resolve()
    assert find_suite_root(bundled_suite) == bundled_suite.resolve()
    assert find_suite_root(str(bundled_suite)) == bundled_suite.resolve()


def test_hidden_and_unrelated_folders_are_ignored(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK)
    (root / ".git").mkdir()
    (root / "__pycache__").mkdir()
    (root / "notes").mkdir()
    (root / "README.md").write_text("suite readme")
    assert [t.name for t in load_suite(root).tasks] == [GOLD_TASK]


def _error(root: Path) -> str:
    with pytest.raises(TaskSuiteError) as info:
        load_suite(root)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_missing_instruction_is_reported_with_path_and_fix(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK)
    (root / GOLD_TASK / "instruction.md").unlink()
    message = _error(root)
    assert str(root / GOLD_TASK) in message
    assert "instruction.md is missing" in message and "Fix:" in message


def test_unparsable_task_toml_is_reported(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK)
    (root / GOLD_TASK / "task.toml").write_text("[metadata\ngold = ")
    message = _error(root)
    assert str(root / GOLD_TASK) in message and "not valid TOML" in message and "Fix:" in message


def test_task_toml_harbor_rejects_is_reported(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK)
    toml = root / GOLD_TASK / "task.toml"
    toml.write_text(toml.read_text().replace('network_mode = "no-network"', 'network_mode = "sometimes"'))
    message = _error(root)
    assert str(root / GOLD_TASK) in message and "Harbor rejects the task" in message


def test_missing_test_script_is_reported(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK)
    (root / GOLD_TASK / "tests" / "test.sh").unlink()
    message = _error(root)
    assert "tests/test.sh is missing" in message and str(root / GOLD_TASK) in message


def test_missing_task_toml_is_reported(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK)
    (root / GOLD_TASK / "task.toml").unlink()
    assert "task.toml is missing" in _error(root)


def test_every_malformed_task_is_listed(copy_tasks) -> None:
    root = copy_tasks(GOLD_TASK, "orders_count", "late_invoices")
    (root / GOLD_TASK / "instruction.md").unlink()
    (root / "orders_count" / "tests" / "test.sh").unlink()
    message = _error(root)
    assert "2 problem(s)" in message
    assert str(root / GOLD_TASK) in message and str(root / "orders_count") in message
    assert str(root / "late_invoices") not in message


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(TaskSuiteError, match="no such directory"):
        load_suite(tmp_path / "nope" / "tasks")
    with pytest.raises(TaskSuiteError, match="no such directory"):
        load_suite("./not-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskSuiteError, match="holds no Harbor tasks"):
        load_suite(tmp_path / "empty")


def test_select_tasks() -> None:
    tasks = [TaskInfo(path=Path(f"/t/{i}"), name=str(i)) for i in range(5)]
    assert [i for i, _ in select_tasks(tasks)] == [0, 1, 2, 3, 4]
    assert [i for i, _ in select_tasks(tasks, num_tasks=2)] == [0, 1]
    assert [i for i, _ in select_tasks(tasks, num_tasks=50)] == [0, 1, 2, 3, 4]
    assert [(i, t.name) for i, t in select_tasks(tasks, indices=[3, 1])] == [(3, "3"), (1, "1")]
    with pytest.raises(ValueError, match="not both"):
        select_tasks(tasks, num_tasks=1, indices=[0])
    with pytest.raises(ValueError, match="out of range"):
        select_tasks(tasks, indices=[5])
    with pytest.raises(ValueError, match=">= 0"):
        select_tasks(tasks, num_tasks=-1)


def test_metadata_columns_are_consistent_for_datasets() -> None:
    from datasets import Dataset

    tasks = [
        TaskInfo(Path("/a"), "a", {"gold_answer": "1", "level": 3, "tags": ["x"], "extra": {"k": 1}, "prompt": "p"}),
        TaskInfo(Path("/b"), "b", {"gold_answer": 7, "level": 2.5, "tags": ["y", "z"], "mixed": True}),
        TaskInfo(Path("/c"), "c", {"level": 1, "tags": [1, 2], "mixed": "yes"}),
    ]
    columns = metadata_columns(tasks)
    assert columns["gold_answer"] == ["1", "7", None]  # str + int -> str, missing -> None
    assert columns["level"] == [3.0, 2.5, 1.0]  # int + float -> float
    assert columns["tags"] == ['["x"]', '["y", "z"]', "[1, 2]"]  # mixed list element types -> JSON
    assert columns["extra"] == ['{"k": 1}', None, None]
    assert columns["mixed"] == [None, "True", "yes"]
    assert columns["metadata_prompt"] == ["p", None, None]  # reserved column name renamed
    assert "prompt" not in columns
    # reference-compatible derived columns are always there
    assert columns["reward_mode"] == [None, None, None]
    assert columns["kaggle_dataset"] == [None, None, None]
    Dataset.from_dict(columns)  # must not raise


def test_metadata_lists_of_strings_stay_lists(bundled_suite: Path) -> None:
    columns = metadata_columns(load_suite(bundled_suite).tasks)
    assert all(isinstance(tags, list) for tags in columns["tags"])
    assert columns["reward_mode"] == columns["reward_mode_initial"]


# ── Hugging Face hub: a hand-built cache, offline ─────────────────────────────────────────

SHA = "0123456789abcdef0123456789abcdef01234567"


def _build_hub_cache(cache: Path, repo_id: str, task_names: list[str]) -> Path:
    org, name = repo_id.split("/")
    repo = cache / f"datasets--{org}--{name}"
    snapshot = repo / "snapshots" / SHA
    for task in task_names:
        shutil.copytree(BUNDLED_SUITE / task, snapshot / "tasks" / task)
    (snapshot / "README.md").write_text("a Harbor suite")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    return snapshot


def _run_offline(cache: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HARBOR_TELEMETRY": "0"}
    env["TRL_HARBOR_CACHE_DIR"] = str(cache.parent / "trl-harbor-cache")  # where snapshots are copied out
    env.pop("HF_HOME", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def test_hub_dataset_from_offline_cache(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = _build_hub_cache(cache, "someorg/harbor-suite", [GOLD_TASK, "orders_count"])
    result = _run_offline(
        cache,
        f"""
        import json
        from trl_harbor.rollout.suite import load_suite
        suite = load_suite("someorg/harbor-suite")
        pinned = load_suite("someorg/harbor-suite", revision="{SHA}")
        print(json.dumps({{"root": str(suite.root), "names": [t.name for t in suite.tasks],
                          "pinned": [t.name for t in pinned.tasks]}}))
        """,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # The snapshot is copied out of the hub cache (real files, not links into its blob store), once per commit.
    assert Path(out["root"]) == tmp_path / "trl-harbor-cache" / "hub" / "someorg--harbor-suite" / SHA / "tasks"
    assert sorted(p.name for p in Path(out["root"]).iterdir()) == sorted(p.name for p in (snapshot / "tasks").iterdir())
    assert out["names"] == sorted([GOLD_TASK, "orders_count"])
    assert out["pinned"] == out["names"]


def test_hub_dataset_not_in_cache_offline_fails_clearly(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    result = _run_offline(
        cache,
        """
        from trl_harbor.rollout.suite import TaskSuiteError, load_suite
        try:
            load_suite("someorg/missing-suite")
        except TaskSuiteError as exc:
            print("ERROR:", exc)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "ERROR: someorg/missing-suite" in result.stdout
    assert "HF_HUB_OFFLINE" in result.stdout and "Fix:" in result.stdout


def test_hub_dataset_without_tasks_folder(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = _build_hub_cache(cache, "someorg/no-tasks", [GOLD_TASK])
    shutil.rmtree(snapshot / "tasks")
    result = _run_offline(
        cache,
        """
        from trl_harbor.rollout.suite import TaskSuiteError, load_suite
        try:
            load_suite("someorg/no-tasks")
        except TaskSuiteError as exc:
            print("ERROR:", exc)
        """,
    )
    assert "ERROR:" in result.stdout, result.stderr
    assert "tasks" in result.stdout
