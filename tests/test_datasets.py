"""Suites people name: Harbor registry datasets and versions, git repositories, Hugging Face snapshots, grouped layouts.

Every source here is real and offline: a git repository the test creates (read through ``file://``
and through a loopback ``git daemon``), a ``registry.json`` naming two versions of a suite pinned to
two of its commits, a Hugging Face cache laid out as the hub lays it out (snapshot files are links
into a blob store), and a suite grouped three levels deep. Each is resolved, pinned in a lock,
trained on for a step with the tiny test policy, rerun from the lock, and refused once a cached
task is altered.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, requires_local, tiny_grpo_trainer

from trl_harbor.rollout.sources import SuiteSelection, parse_dataset, resolve_suite
from trl_harbor.rollout.suite import TaskSuiteError, load_suite
from trl_harbor.rollout.suite_lock import read_lock

OTHER_TASK = "orders_count"


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def suite_repo(tmp_path: Path) -> dict[str, object]:
    """A git repository with a suite in two versions: v1 holds one task, v2 (tagged) two, the first one changed."""
    repo = tmp_path / "org" / "suite-repo"
    (repo / "tasks").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, repo / "tasks" / GOLD_TASK)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "v1")
    first = _git(repo, "rev-parse", "HEAD")
    shutil.copytree(BUNDLED_SUITE / OTHER_TASK, repo / "tasks" / OTHER_TASK)
    with (repo / "tasks" / GOLD_TASK / "instruction.md").open("a") as handle:
        handle.write("\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "v2")
    _git(repo, "tag", "v2")
    second = _git(repo, "rev-parse", "HEAD")
    url = f"file://{repo}"

    def task(name: str, commit: str) -> dict[str, str]:
        return {"name": name, "git_url": url, "git_commit_id": commit, "path": f"tasks/{name}"}

    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps([
        {"name": "demo-suite", "version": "1.0", "description": "one task", "tasks": [task(GOLD_TASK, first)]},
        {"name": "demo-suite", "version": "2.0", "description": "two tasks",
         "tasks": [task(GOLD_TASK, second), task(OTHER_TASK, second)]},
    ]))  # fmt: skip
    return {"repo": repo, "url": url, "first": first, "second": second, "registry": registry}


def _hub_cache(cache: Path, repo_id: str, commit: str, tasks: list[str]) -> Path:
    """A Hugging Face hub cache as the hub writes it: snapshot files are relative links into ``blobs/``."""
    import hashlib

    store = cache / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = store / "snapshots" / commit
    (store / "blobs").mkdir(parents=True)
    for task in tasks:
        for source in (BUNDLED_SUITE / task).rglob("*"):
            if not source.is_file():
                continue
            data = source.read_bytes()
            blob = store / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            blob.chmod(source.stat().st_mode)
            link = snapshot / "tasks" / task / source.relative_to(BUNDLED_SUITE / task)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (store / "refs").mkdir()
    (store / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    """An offline hub cache holding ``someorg/harbor-suite`` (two tasks) at a commit of this test's own.

    trl-harbor's cache is left where it is (a user's models live there too); the commit,
    which names the snapshot's copy in it, is unique, and that copy is removed afterwards.
    """
    import uuid

    from huggingface_hub import constants

    from trl_harbor.rollout.suite import cache_root

    cache = tmp_path / "hf-cache"
    commit = uuid.uuid4().hex + "0" * 8
    _hub_cache(cache, "someorg/harbor-suite", commit, [GOLD_TASK, OTHER_TASK])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    yield cache, commit
    shutil.rmtree(cache_root() / "hub" / "someorg--harbor-suite" / commit, ignore_errors=True)


def _grouped(root: Path) -> Path:
    """A suite grouped three levels deep: tasks/<field>/<subfield>/<topic>/<task>/."""
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, root / "tasks" / "science" / "earth" / "climate" / GOLD_TASK)
    shutil.copytree(BUNDLED_SUITE / OTHER_TASK, root / "tasks" / "business" / "retail" / "sales" / OTHER_TASK)
    (root / "tasks" / "science" / "README.md").write_text("a group, not a task")
    return root


# ── parsing: every form Harbor's CLI takes ───────────────────────────────────────────


@pytest.mark.parametrize(
    ("given", "kind", "location", "version"),
    [
        ("terminal-bench@2.0", "registry", "terminal-bench", "2.0"),
        ("terminal-bench", "registry", "terminal-bench", None),
        ("registry:swebench@1", "registry", "swebench", "1"),
        ("someorg/suite", "huggingface", "someorg/suite", None),
        ("someorg/suite@abc123", "huggingface", "someorg/suite", "abc123"),
        ("hf:someorg/suite", "huggingface", "someorg/suite", None),
        ("hub:harbor/hello@3", "package", "harbor/hello", "3"),
        ("repo:laude-institute/terminal-bench@v2", "git", "laude-institute/terminal-bench@v2", None),
        ("https://github.com/org/repo/tree/main/tasks", "git", "https://github.com/org/repo/tree/main/tasks", None),
        ("file:///srv/repo@v1", "git", "file:///srv/repo@v1", None),
        ("./here", "local", "./here", None),
        ("a/b/c", "local", "a/b/c", None),
    ],
)
def test_every_form_parses(given: str, kind: str, location: str, version: str | None) -> None:
    source = parse_dataset(given)
    assert (source.kind, source.location, source.version) == (kind, location, version)


@pytest.mark.parametrize(
    ("given", "kwargs", "expected"),
    [
        ("hub:justaname", {}, "org/name[@ref]"),
        ("registry:a/b", {}, "name[@version]"),
        ("someorg/suite@v1", {"revision": "v2"}, "revision given twice"),
        ("demo@1.0", {"revision": "v2"}, "demo@VERSION"),
    ],
)
def test_malformed_names_are_refused(given: str, kwargs: dict, expected: str) -> None:
    with pytest.raises(TaskSuiteError, match="Fix") as info:
        parse_dataset(given, **kwargs)
    assert expected in str(info.value)


# ── a Harbor registry: two versions pinned to two commits ──────────────────────────────


def test_registry_versions_resolve_to_their_commits_and_cache(suite_repo, tmp_path: Path) -> None:
    lines: list[str] = []
    download = tmp_path / "downloads"
    selection = SuiteSelection(registry_path=suite_repo["registry"], download_dir=download)
    one = resolve_suite("demo-suite@1.0", selection, progress=lines.append)
    two = resolve_suite("demo-suite@2.0", selection, progress=lines.append)
    latest = resolve_suite("demo-suite", selection, progress=lines.append)  # no version: Harbor's choice, the highest
    assert (one.name, one.version, [d.name for d in one.task_dirs]) == ("demo-suite", "1.0", [GOLD_TASK])
    assert [d.name for d in two.task_dirs] == [GOLD_TASK, OTHER_TASK] and latest.version == "2.0"
    assert {o["git_commit_id"] for o in one.origins.values()} == {suite_repo["first"]}
    assert {o["git_commit_id"] for o in two.origins.values()} == {suite_repo["second"]}
    assert all(d.is_relative_to(download) for d in [*one.task_dirs, *two.task_dirs])
    # The two versions of the same task differ, and so do their digests.
    assert one.digest(one.task_dirs[0]) != two.digest(two.task_dirs[0])
    assert "1 fetched" in lines[1] and "0 fetched, 2 from the cache" in lines[-1]  # the third came from the cache
    # Globs and a count, as Harbor's: only the tasks kept are fetched.
    only = resolve_suite("demo-suite@2.0", replace(selection, task_names=["orders_*"]), progress=lines.append)
    assert [d.name for d in only.task_dirs] == [OTHER_TASK]
    first = resolve_suite("demo-suite@2.0", selection, limit=1, progress=lines.append)
    assert [d.name for d in first.task_dirs] == [GOLD_TASK]
    none_left = resolve_suite(
        "demo-suite@2.0", replace(selection, exclude_task_names=["*_count"]), progress=lines.append
    )
    assert [d.name for d in none_left.task_dirs] == [GOLD_TASK]


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        ("demo-suite@9.9", "Version 9.9 of dataset demo-suite not found"),
        ("no-such-suite", "Dataset no-such-suite not found"),
    ],
)
def test_registry_failures_name_the_dataset_the_source_and_the_fix(suite_repo, tmp_path, dataset, expected) -> None:
    with pytest.raises(TaskSuiteError) as info:
        resolve_suite(dataset, SuiteSelection(registry_path=suite_repo["registry"], download_dir=tmp_path / "dl"))
    message = str(info.value)
    assert message.startswith(f"{dataset}:") and expected in message
    assert str(suite_repo["registry"]) in message and "Fix:" in message and "suite.lock.json" in message


def test_an_unreachable_repository_leaves_nothing_behind(suite_repo, tmp_path: Path) -> None:
    registry = json.loads(Path(suite_repo["registry"]).read_text())
    for task in registry[1]["tasks"]:
        task["git_url"] = f"file://{tmp_path}/gone"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(registry))
    download = tmp_path / "dl"
    with pytest.raises(TaskSuiteError, match="could not download the tasks of demo-suite@2.0") as info:
        resolve_suite(
            "demo-suite@2.0", SuiteSelection(registry_path=broken, download_dir=download), progress=lambda _: None
        )
    assert "git clone" in str(info.value) and "Fix:" in str(info.value)
    assert not download.exists() or not any(download.rglob("task.toml"))  # nothing partial left as if complete


def test_a_tampered_cached_task_is_refused(suite_repo, tmp_path: Path) -> None:
    selection = SuiteSelection(registry_path=suite_repo["registry"], download_dir=tmp_path / "dl")
    resolved = resolve_suite("demo-suite@1.0", selection, progress=lambda _: None)
    (resolved.task_dirs[0] / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    with pytest.raises(TaskSuiteError, match=f"task '{GOLD_TASK}': the cached copy .* has changed") as info:
        resolve_suite("demo-suite@1.0", selection, progress=lambda _: None)
    assert "Fix: delete" in str(info.value)
    # Fetched afresh, as the fix says.
    again = resolve_suite("demo-suite@1.0", replace(selection, overwrite=True), progress=lambda _: None)
    assert (again.task_dirs[0] / "tests" / "test.sh").read_text() != "echo 1 > /logs/verifier/reward.txt\n"


def test_a_cached_copy_never_recorded_complete_is_fetched_again(suite_repo, tmp_path: Path) -> None:
    """A download cut short leaves a folder without its digest note: it is fetched again, never trusted."""
    from trl_harbor.rollout.digests import digest_note

    selection = SuiteSelection(registry_path=suite_repo["registry"], download_dir=tmp_path / "dl")
    first = resolve_suite("demo-suite@1.0", selection, progress=lambda _: None)
    task = first.task_dirs[0]
    complete = first.digest(task)
    (task / "tests" / "test.sh").unlink()  # a partial copy: a file missing
    digest_note(task).unlink()  # ... and no record that it was ever complete
    again = resolve_suite("demo-suite@1.0", selection, progress=lambda _: None)
    assert (again.task_dirs[0] / "tests" / "test.sh").is_file()
    assert again.digest(again.task_dirs[0]) == complete and digest_note(again.task_dirs[0]).is_file()


# ── git repositories at a ref (Harbor's --repo) ─────────────────────────────────────


@pytest.fixture
def git_daemon(suite_repo, tmp_path: Path) -> Iterator[str]:
    """A loopback ``git daemon`` serving the suite repository as git://127.0.0.1:PORT/org/suite-repo."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = Path(suite_repo["repo"]).parents[1]
    process = subprocess.Popen(
        ["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={base}", "--listen=127.0.0.1",
         f"--port={port}", "--enable=upload-pack", str(base)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"git://127.0.0.1:{port}/org/suite-repo"
    deadline = time.monotonic() + 20
    while subprocess.run(["git", "ls-remote", url], capture_output=True).returncode != 0:
        assert time.monotonic() < deadline and process.poll() is None, "git daemon did not start"
        time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(timeout=10)


def test_git_repository_at_a_ref_through_harbor_and_file(suite_repo, git_daemon: str, tmp_path: Path) -> None:
    quiet = {"selection": SuiteSelection(download_dir=tmp_path / "dl"), "progress": lambda _: None}
    served = resolve_suite(f"{git_daemon}@{suite_repo['first']}", **quiet)  # Harbor's own --repo parser
    assert [d.name for d in served.task_dirs] == [GOLD_TASK]
    assert {o["git_commit_id"] for o in served.origins.values()} == {suite_repo["first"]}
    tagged = resolve_suite(f"repo:{git_daemon}@v2", **quiet)
    assert [d.name for d in tagged.task_dirs] == [GOLD_TASK, OTHER_TASK]
    on_disk = resolve_suite(f"{suite_repo['url']}@v2", **quiet)
    assert {o["git_commit_id"] for o in on_disk.origins.values()} == {suite_repo["second"]}
    assert [tagged.digest(d) for d in tagged.task_dirs] == [on_disk.digest(d) for d in on_disk.task_dirs]


# ── local layouts: any depth, duplicates, links ──────────────────────────────────────


def test_a_grouped_layout_three_levels_deep_is_found(tmp_path: Path) -> None:
    root = _grouped(tmp_path / "science-suite")
    suite = load_suite(root)
    assert [t.path.name for t in suite.tasks] == [GOLD_TASK, OTHER_TASK]  # sorted by name, not by group
    assert suite.tasks[0].path == (root / "tasks/science/earth/climate" / GOLD_TASK).resolve()


def test_a_duplicate_task_name_is_reported_with_both_paths(tmp_path: Path) -> None:
    root = _grouped(tmp_path / "dup")
    twin = root / "tasks" / "business" / "other" / GOLD_TASK
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, twin)
    with pytest.raises(TaskSuiteError, match=f"two tasks are named '{GOLD_TASK}'") as info:
        load_suite(root)
    assert str(twin) in str(info.value) and "science/earth/climate" in str(info.value)
    assert "Fix:" in str(info.value)


def test_links_out_of_the_suite_are_not_followed(tmp_path: Path) -> None:
    root = _grouped(tmp_path / "linked")
    outside = tmp_path / "elsewhere"
    shutil.copytree(BUNDLED_SUITE / "orders_count", outside / "stolen_task")
    (root / "tasks" / "science" / "link-out").symlink_to(outside / "stolen_task")
    with pytest.raises(TaskSuiteError, match="outside the suite") as info:
        load_suite(root)
    assert "link-out" in str(info.value) and "Fix:" in str(info.value)
    (root / "tasks" / "science" / "link-out").unlink()
    (root / "tasks" / "science" / "group-out").symlink_to(outside)  # a folder of no task: not searched
    (root / "tasks" / "alias").symlink_to(root / "tasks" / "business")  # inside: found once, under its real path
    assert [t.path.name for t in load_suite(root).tasks] == [GOLD_TASK, OTHER_TASK]


def test_a_selection_is_one_frozen_value_recorded_in_a_lock_without_its_cache(tmp_path: Path) -> None:
    import dataclasses

    selection = SuiteSelection(registry_path=tmp_path / "registry.json", task_names=["a*"], download_dir=tmp_path)
    assert selection.task_names == ("a*",) and hash(selection) == hash(replace(selection))
    with pytest.raises(dataclasses.FrozenInstanceError):
        selection.overwrite = True  # type: ignore[misc]
    assert selection.lock_options() == {
        "revision": None,
        "registry_url": None,
        "registry_path": str(tmp_path / "registry.json"),
        "task_names": ["a*"],
        "exclude_task_names": None,
    }
    assert SuiteSelection(task_names=[]).lock_options()["task_names"] is None
    assert set(selection.as_kwargs()) == {f.name for f in dataclasses.fields(SuiteSelection)}
    # Built from anything whose attributes carry the fields' names (parsed flags, a config); the rest default.
    from argparse import Namespace

    flags = Namespace(registry_url="http://r", task_names=["b*"], n_tasks=3, download_dir=None, registry_path=None,
                      exclude_task_names=None)  # fmt: skip
    assert SuiteSelection.of(flags) == SuiteSelection(registry_url="http://r", task_names=("b*",))
    from trl_harbor.cli.evaluate import EvalConfig

    config = EvalConfig(dataset="x", base_url=None, model="m", registry_path="reg.json", exclude_task_names=["c"])
    assert SuiteSelection.of(config) == SuiteSelection(registry_path="reg.json", exclude_task_names=["c"])


def test_a_count_cuts_a_local_folder_after_the_filters_and_check_slices_once() -> None:
    import argparse

    from trl_harbor.cli import _check_task_dirs

    names = sorted(p.name for p in BUNDLED_SUITE.iterdir() if (p / "task.toml").is_file())
    assert [d.name for d in resolve_suite(BUNDLED_SUITE, limit=2).task_dirs] == names[:2]
    assert resolve_suite(BUNDLED_SUITE, limit=0).task_dirs == []
    rest = resolve_suite(BUNDLED_SUITE, SuiteSelection(exclude_task_names=[names[0]]), limit=1)
    assert [d.name for d in rest.task_dirs] == [names[1]]
    flags = {"registry_url": None, "registry_path": None, "task_names": None, "exclude_task_names": None,
             "download_dir": None, "task": None}  # fmt: skip
    args = argparse.Namespace(suite=str(BUNDLED_SUITE), n_tasks=3, **flags)
    assert [d.name for d in _check_task_dirs(args)] == names[:3]


# ── Hugging Face snapshots: real files, pinned to the commit ──────────────────────────


def test_hub_snapshot_links_become_real_files(hub: tuple[Path, str]) -> None:
    from trl_harbor.rollout.suite import cache_root

    resolved = resolve_suite("someorg/harbor-suite", progress=lambda _: None)
    root = resolved.root
    assert root == cache_root() / "hub" / "someorg--harbor-suite" / hub[1] / "tasks" and resolved.version == hub[1]
    files = [p for p in root.rglob("*") if not p.name.startswith(".")]
    assert files and not any(p.is_symlink() for p in files)
    assert os.access(root / GOLD_TASK / "tests" / "test.sh", os.X_OK)
    origin = resolved.origins[resolved.task_dirs[0]]
    assert origin == {"repo_id": "someorg/harbor-suite", "revision": resolved.version, "path": f"tasks/{GOLD_TASK}"}
    # The copy is the original task, to the mode bit (its tree digest), and its lock digest Harbor's content hash.
    from trl_harbor.rollout.digests import content_hash, task_digest

    assert task_digest(resolved.task_dirs[0]) == task_digest(BUNDLED_SUITE / GOLD_TASK)
    assert resolved.digest(resolved.task_dirs[0]) == content_hash(BUNDLED_SUITE / GOLD_TASK)


# ── each form: pinned, trained for a step, rerun from the lock, tampering refused ─────────


def _spec_of(form: str, suite_repo, tmp_path: Path):
    from trl_harbor import HarborSpec

    common = {"environment_type": "local", "task_names": [GOLD_TASK]}
    if form == "registry":
        return HarborSpec("demo-suite@2.0", registry_path=suite_repo["registry"], download_dir=tmp_path / "dl",
                          **common)  # fmt: skip
    if form == "huggingface":
        return HarborSpec("someorg/harbor-suite", **common)
    return HarborSpec(_grouped(tmp_path / "grouped"), **common)


@requires_local
@pytest.mark.slow
@pytest.mark.parametrize("form", ["registry", "huggingface", "grouped"])
def test_each_form_trains_pins_reruns_and_refuses_tampering(
    form: str, suite_repo, hub: tuple[Path, str], tmp_path: Path, close_sandboxes: None
) -> None:
    from trl_harbor import HarborBashEnv, HarborSpec
    from trl_harbor.testing import tool_call_text

    spec = _spec_of(form, suite_repo, tmp_path)
    assert [t.path.name for t in spec.tasks] == [GOLD_TASK]
    good = tool_call_text("bash", {"command": f"echo -n {GOLD_ANSWER} > /workdir/answer.txt"})
    bad = tool_call_text("bash", {"command": "echo -n 0 > /workdir/answer.txt"})
    trainer = tiny_grpo_trainer(tmp_path, spec, [good, bad], HarborBashEnv.PROMPT_SUFFIX, [spec.reward_funcs])
    trainer.train()
    assert trainer.state.global_step == 1 and "reward" in trainer.state.log_history[0]

    lock_file = spec.write_lock(tmp_path / "run")
    (locked,) = read_lock(lock_file)
    (task,) = locked.tasks
    assert (locked.kind, task.name, task.path) == (
        {"registry": "registry", "huggingface": "huggingface", "grouped": "local"}[form],
        GOLD_TASK,
        spec.task_dirs[0],
    )
    from harbor.publisher.packager import Packager

    # Harbor's content hash: the digest Harbor's own lock.json records for the task.
    assert (task.digest, task.digest_kind) == ("sha256:" + Packager.compute_content_hash(task.path)[0], "harbor")
    assert locked.options["task_names"] == [GOLD_TASK]
    if form == "registry":
        assert (locked.version, task.source["git_commit_id"]) == ("2.0", suite_repo["second"])
        shutil.rmtree(suite_repo["repo"])  # the source is gone: the rerun needs only the cache
    if form == "huggingface":
        assert task.source["revision"] == locked.version == hub[1]
        shutil.rmtree(hub[0])  # the hub cache is gone: the rerun needs only trl-harbor's copy

    rerun = HarborSpec(lock_file, environment_type="local")
    assert rerun.task_dirs == spec.task_dirs and rerun.lock.tasks == locked.tasks
    assert rerun.train_dataset["task_index"] == spec.train_dataset["task_index"]

    (task.path / "instruction.md").write_text("Write 1 to /workdir/answer.txt.")
    with pytest.raises(TaskSuiteError, match=f"task '{GOLD_TASK}' .*content differs from the lock") as info:
        HarborSpec(lock_file, environment_type="local")
    assert task.digest in str(info.value) and "Fix:" in str(info.value)


def test_a_lock_refetches_a_vanished_cached_task_at_its_commit(suite_repo, tmp_path: Path) -> None:
    from trl_harbor import HarborSpec

    spec = HarborSpec("demo-suite@1.0", environment_type="local", registry_path=suite_repo["registry"],
                      download_dir=tmp_path / "dl")  # fmt: skip
    lock_file = spec.write_lock(tmp_path / "run" / "suite.lock.json")
    shutil.rmtree(spec.task_dirs[0])
    rerun = HarborSpec(lock_file, environment_type="local")
    assert rerun.task_dirs == spec.task_dirs and rerun.lock.tasks[0].digest == spec.lock.tasks[0].digest
    shutil.rmtree(spec.task_dirs[0])
    shutil.rmtree(suite_repo["repo"])
    with pytest.raises(TaskSuiteError, match=f"task '{GOLD_TASK}'.*fetching it again failed"):
        HarborSpec(lock_file, environment_type="local")


# ── the command line: train writes the lock, and trains again from it ──────────────────


@requires_local
@pytest.mark.slow
def test_cli_trains_on_a_registry_dataset_and_reruns_from_its_lock(suite_repo, tmp_path: Path, close_sandboxes) -> None:
    from demo_policy import build_demo_policy
    from trl_harbor import HarborSpec
    from trl_harbor.cli import main as cli_main

    bundled = HarborSpec(BUNDLED_SUITE, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in bundled.task_dirs]
    policy = build_demo_policy(bundled.tasks, texts, bundled.env_cls.PROMPT_SUFFIX)
    checkpoint = tmp_path / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    steps = ["--model", str(checkpoint), "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size",
             "2", "--max_completion_length", "64", "--max_tool_calling_iterations", "1", "--report_to", "none",
             "--save_strategy", "no"]  # fmt: skip
    first = tmp_path / "first"
    # Held out: the same registry's dataset, sampled from the registry and cache the run was given.
    argv = ["train", "--dataset", "demo-suite@2.0", "--registry_path", str(suite_repo["registry"]),
            "--download_dir", str(tmp_path / "dl"), "--task_names", GOLD_TASK, "--output_dir", str(first),
            "--heldout_dataset", "demo-suite@2.0", "--heldout_rollouts", "1", *steps]  # fmt: skip
    assert cli_main(argv) == 0
    summary = json.loads((first / "summary.json").read_text())
    assert summary["heldout_before"]["scored"] >= 1 and summary["heldout_after"]["scored"] >= 1
    (locked,) = read_lock(first / "suite.lock.json")
    assert (locked.dataset, locked.version, [t.name for t in locked.tasks]) == ("demo-suite@2.0", "2.0", [GOLD_TASK])
    second = tmp_path / "second"
    lock = str(first / "suite.lock.json")
    assert cli_main(["train", "--dataset", lock, "--output_dir", str(second), "--heldout_rollouts", "0", *steps]) == 0
    assert read_lock(second / "suite.lock.json")[0].tasks == locked.tasks
