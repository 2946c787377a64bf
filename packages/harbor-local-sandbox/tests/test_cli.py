"""``harbor-local-sandbox images``: the package's own command for its image cache (no sandbox, no build).

Building, listing and pruning real images is covered where images are built; here the command's paths that
need no image: an empty cache, a fake store (the output's format), the suite's task folders, the errors,
and that the command runs with no trainer importable.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from harbor_alone import PACKAGE_DIR, TRAINER_MODULES
from harbor_local_sandbox import cli


def _task(root: Path, *parts: str) -> Path:
    folder = root.joinpath(*parts)
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    return folder


def test_the_console_script_is_the_command() -> None:
    scripts = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"harbor-local-sandbox": "harbor_local_sandbox.cli:main"}


def test_list_and_prune_an_empty_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    assert cli.main(["images", "list", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"no task images in {cache / 'images'}" in out
    assert f"0 image(s); cache {cache}: 0 B (layers shared, counted once)" in out
    assert cli.main(["images", "prune", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.strip() == "removed 0 image(s), freed 0 B"


def test_list_prints_each_image_and_prune_removes_the_stale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The listing's format and prune's choice, on a store of the command's hook (as a trainer passes its own)."""
    kept = _task(tmp_path, "suite", "kept") / "environment"
    changed = _task(tmp_path, "suite", "changed") / "environment"
    gone = tmp_path / "suite" / "gone" / "environment"
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "layer").write_bytes(b"x" * 8192)

    def image(key: str, source: Path) -> SimpleNamespace:
        record = SimpleNamespace(key=key, built_at=0.0, bases=["debian:bookworm-slim"], build_seconds=3.2,
                                 source=str(source))  # fmt: skip
        return SimpleNamespace(record=record, path=tmp_path / "image")

    images = [image("k-kept", kept), image("k-old", changed), image("k-gone", gone)]
    removed: list[str] = []
    store = SimpleNamespace(
        images=lambda: list(images), images_dir=tmp_path / "images", storage_dir=tmp_path / "storage",
        cache_dir=tmp_path, used_elsewhere=lambda: False,
        content_key=lambda source: "k-kept" if source == kept else "k-new",
        remove=lambda found: (removed.append(found.record.key), images.remove(found)),
    )  # fmt: skip
    parser = argparse.ArgumentParser(prog="trainer")
    cli.ImagesCommand(store=lambda args: store).add_parser(parser.add_subparsers(dest="command"))

    args = parser.parse_args(["images", "list"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["key", "built", "build", "base", "task"]
    assert lines[1].split()[0] == "k-kept" and lines[1].split()[-3:] == ["3s", "debian:bookworm-slim", str(kept)]
    assert lines[-1].startswith("3 image(s); cache ")

    args = parser.parse_args(["images", "prune"])
    assert args.func(args) == 0
    assert removed == ["k-old", "k-gone"]  # the task changed; the task is gone
    out = capsys.readouterr().out.strip()
    assert out.startswith("removed 2 image(s), freed ") and out.endswith("KiB"), out  # the two images' folders


def test_prune_refuses_while_another_process_uses_the_cache(tmp_path: Path) -> None:
    store = SimpleNamespace(used_elsewhere=lambda: True, cache_dir=tmp_path)
    parser = argparse.ArgumentParser()
    cli.ImagesCommand(store=lambda args: store).add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["images", "prune", "--all"])
    with pytest.raises(SystemExit, match="another process"):
        args.func(args)


def test_build_runs_the_suites_tasks_and_reports_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("alpha", "beta", "gamma"):
        _task(tmp_path, "suite", "tasks", name)
    built: list[str] = []

    class Store:
        images_dir = tmp_path / "images"

        def cached(self, environment: Path) -> object | None:
            return object() if environment.parent.name == "alpha" else None

        async def get(self, environment: Path, task_name: str, force: bool = False) -> None:
            if task_name == "gamma":
                raise RuntimeError("RUN exit 7")
            built.append(task_name)

    parser = argparse.ArgumentParser()
    cli.ImagesCommand(store=lambda args: Store()).add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["images", "build", str(tmp_path / "suite"), "-n", "1"])
    assert args.func(args) == 1  # a build failed
    out = capsys.readouterr().out
    assert "alpha: cached" in out and "beta: built in" in out and "gamma: FAILED: RUN exit 7" in out
    assert f"2 of 3 image(s) ready in {tmp_path / 'images'}" in out
    assert sorted(built) == ["alpha", "beta"]

    args = parser.parse_args(["images", "build", str(tmp_path / "suite"), "-t", "beta", "-t", "nope"])
    with pytest.raises(SystemExit, match="no task named nope"):
        args.func(args)


def test_a_suites_task_folders(tmp_path: Path) -> None:
    one = _task(tmp_path, "one")
    assert cli.find_task_dirs(one) == [one]  # a task folder is a suite of one
    nested = [_task(tmp_path, "suite", "group", "b"), _task(tmp_path, "suite", "a")]
    _task(tmp_path, "suite", "a", "inner")  # inside a task: not a task of the suite
    assert cli.find_task_dirs(tmp_path / "suite") == sorted(nested, key=lambda p: p.name)
    held = _task(tmp_path, "held", "tasks", "c")
    assert cli.find_task_dirs(tmp_path / "held") == [held]
    _task(tmp_path, "suite", "other", "a")
    with pytest.raises(ValueError, match="two tasks are named 'a'"):
        cli.find_task_dirs(tmp_path / "suite")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no task folders"):
        cli.find_task_dirs(tmp_path / "empty")
    with pytest.raises(SystemExit, match="no such folder"):
        cli.main(["images", "build", str(tmp_path / "missing"), "--cache-dir", str(tmp_path / "cache")])


def test_load_names_a_missing_archive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such file"):
        cli.main(["images", "load", str(tmp_path / "base.tar"), "debian:12", "--cache-dir", str(tmp_path / "c")])


def test_sizes_are_human() -> None:
    assert [cli.human_size(n) for n in (0, 1023, 1536, 5 << 20, 3 << 30, 2 << 40)] == [
        "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB", "2048.0 GiB",
    ]  # fmt: skip


#: Runs the command with every trainer module made unimportable (``sys.argv[1]``: their names).
_WITHOUT_TRAINERS = textwrap.dedent(
    """
    import importlib.abc, runpy, sys
    blocked = set(sys.argv[1].split(","))

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocked())
    for name in blocked:
        try:
            __import__(name)
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit(f"{name} still imports")
    sys.argv = ["harbor-local-sandbox", *sys.argv[2:]]
    runpy.run_module("harbor_local_sandbox.cli", run_name="__main__")
    """
)


@pytest.mark.parametrize("argv", [["--help"], ["images", "--help"], ["images", "list", "--cache-dir", "{cache}"]])
def test_the_command_runs_without_a_trainer(tmp_path: Path, argv: list[str]) -> None:
    assert TRAINER_MODULES  # at least TRL's
    argv = [arg.format(cache=tmp_path / "cache") for arg in argv]
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRAINERS, ",".join(TRAINER_MODULES), *argv],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    if argv[0] == "--help":
        assert "usage: harbor-local-sandbox" in done.stdout and "images" in done.stdout
    elif argv[1] == "--help":
        assert all(name in done.stdout for name in ("list", "build", "prune", "load"))
    else:
        assert "0 image(s); cache" in done.stdout, done.stdout


def test_a_base_image_that_cannot_be_pulled_names_this_command(tmp_path: Path) -> None:
    from harbor_local_sandbox.oci import _pull_error

    message = _pull_error("python:3.12-slim", "Error: initializing source docker://python:3.12-slim", tmp_path)
    assert f"`harbor-local-sandbox images load FILE python:3.12-slim --cache-dir {tmp_path}`" in message
