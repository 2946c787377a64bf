"""``trl-harbor images``: build a suite's images ahead of time, list them with sizes, prune them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from registry import loopback_registry  # noqa: F401 - the session fixture

from sandbox_helpers import make_task
from trl_harbor.cli import images

pytestmark = pytest.mark.local


def _images(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="trl-harbor")
    images.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["images", *argv])
    return args.func(args)


def test_build_list_prune(loopback_registry, tmp_path: Path, capsys) -> None:  # noqa: F811
    suite = tmp_path / "suite"
    for name, line in (("alpha", "RUN echo a > /a"), ("beta", "RUN echo b > /b")):
        make_task(suite, name, dockerfile=f"FROM {loopback_registry.base}\n{line}\nWORKDIR /workdir\n")
    cache = str(tmp_path / "cache")

    assert _images("build", str(suite), "--cache-dir", cache) == 0
    out = capsys.readouterr().out
    assert "alpha: built in" in out and "beta: built in" in out and "2 of 2 image(s) ready" in out
    assert _images("build", str(suite), "--cache-dir", cache, "-t", "alpha") == 0
    assert "[1/1] alpha: cached" in capsys.readouterr().out

    assert _images("list", "--cache-dir", cache) == 0
    out = capsys.readouterr().out
    assert out.count(loopback_registry.base) == 2 and "2 image(s)" in out and "MiB" in out

    (suite / "beta" / "environment" / "Dockerfile").write_text(f"FROM {loopback_registry.base}\nRUN echo c > /c\n")
    assert _images("prune", "--cache-dir", cache) == 0
    assert "removed 1 image(s)" in capsys.readouterr().out
    assert _images("prune", "--cache-dir", cache, "--all") == 0
    assert "removed 1 image(s)" in capsys.readouterr().out
    assert _images("list", "--cache-dir", cache) == 0
    assert "no task images" in capsys.readouterr().out


def test_build_reports_failures(loopback_registry, tmp_path: Path, capsys) -> None:  # noqa: F811
    suite = tmp_path / "suite"
    make_task(suite, "broken", dockerfile=f"FROM {loopback_registry.base}\nRUN exit 7\n")
    assert _images("build", str(suite), "--cache-dir", str(tmp_path / "cache")) == 1
    out = capsys.readouterr().out
    assert "broken: FAILED" in out and "0 of 1 image(s) ready" in out
    _images("prune", "--all", "--cache-dir", str(tmp_path / "cache"))


def test_load_a_base_image_from_an_archive_then_build_offline(tmp_path: Path, capsys) -> None:
    """No registry at all: the base image comes from an OCI archive, under the name FROM uses."""
    from registry import base_image_archive

    cache = str(tmp_path / "cache")
    name = "registry.invalid/offline/debian:12"
    assert _images("load", str(base_image_archive()), name, "--cache-dir", cache) == 0
    assert f"as {name}" in capsys.readouterr().out
    suite = tmp_path / "suite"
    make_task(suite, "offline", dockerfile=f"FROM {name}\nRUN echo offline > /marker\n")
    assert _images("build", str(suite), "--cache-dir", cache) == 0
    assert "offline: built in" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such file"):
        _images("load", str(tmp_path / "missing.tar"), name, "--cache-dir", cache)
    _images("prune", "--all", "--cache-dir", cache)  # also releases the storage's mounts


def test_images_another_process_starts_sandboxes_from_are_kept(loopback_registry, tmp_path: Path) -> None:  # noqa: F811
    """A training run beside ``images prune`` or a test session's end (which releases the cache's
    mounts): prune refuses, the release leaves the images mounted, until that process has exited."""
    import subprocess
    import sys

    from harbor_local_sandbox.oci import ImageStore

    suite, cache = tmp_path / "suite", tmp_path / "cache"
    make_task(suite, "kept", dockerfile=f"FROM {loopback_registry.base}\nRUN echo kept > /kept\nWORKDIR /workdir\n")
    assert _images("build", str(suite), "--cache-dir", str(cache)) == 0
    assert ImageStore(cache).release_mounts()  # this process is done with them: detached
    script = (
        "import asyncio, sys\nfrom pathlib import Path\nfrom harbor_local_sandbox.oci import ImageStore\n"
        "image = asyncio.run(ImageStore(Path(sys.argv[1])).get(Path(sys.argv[2]), 'kept'))\n"
        "print(image.rootfs, flush=True)\nsys.stdin.read()\n"
    )
    run = subprocess.Popen(
        [sys.executable, "-c", script, str(cache), str(suite / "kept" / "environment")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert run.stdin is not None and run.stdout is not None
    try:
        rootfs = Path(run.stdout.readline().strip())
        assert (rootfs / "kept").read_text() == "kept\n"
        with pytest.raises(SystemExit, match="another process"):
            _images("prune", "--all", "--cache-dir", str(cache))
        assert not ImageStore(cache).release_mounts()
        assert (rootfs / "kept").read_text() == "kept\n"  # still mounted for the run
    finally:
        run.stdin.close()
        assert run.wait(60) == 0
    assert ImageStore(cache).release_mounts()
    assert not (rootfs / "kept").exists()
    assert _images("prune", "--all", "--cache-dir", str(cache)) == 0


def test_a_backend_without_an_image_cache_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="environment_type='docker' keeps no image cache"):
        _images("list", "-e", "docker", "--cache-dir", str(tmp_path))
    store = images.image_store("harbor_local_sandbox.local:LocalEnvironment", tmp_path / "cache", host_trust=False)
    assert store is images.image_store("local", tmp_path / "cache", host_trust=False)  # one store, either name


def test_it_is_the_local_sandbox_packages_command(tmp_path: Path, capsys) -> None:
    """One implementation: ``trl-harbor images`` runs the package's, with ``-e`` added (same output)."""
    from trl_harbor.rollout.backends import local_sandbox_cli

    module = local_sandbox_cli()
    assert module is not None and module.__name__ == "harbor_local_sandbox.cli"
    assert _images("list", "--cache-dir", str(tmp_path / "cache")) == 0
    ours = capsys.readouterr().out
    assert module.main(["images", "list", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out == ours and "0 image(s); cache" in ours


def test_without_the_local_sandbox_package_it_names_the_install(without_the_local_sandbox) -> None:
    with pytest.raises(SystemExit, match=r"pip install 'trl-harbor\[local\]'"):
        _images("list", "-e", "local")
