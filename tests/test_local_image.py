"""How the host root (`root="host"`) honours a task's Dockerfile: WORKDIR, ENV, COPY, RUN, caching, errors."""

from __future__ import annotations

import asyncio
import zipfile
from pathlib import Path

import pytest

from sandbox_helpers import make_task, open_env, run
from trl_harbor.sandboxes.image import ImageBuilder, ImageBuildError, parse_dockerfile


def _wheel(path: Path, name: str = "layerpkg", value: str = "7") -> Path:
    """A minimal pure-Python wheel, so builds need no package index."""
    wheel = path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}.py", f"VALUE = {value}\n")
        archive.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        archive.writestr(
            f"{name}-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return wheel


DOCKERFILE = """\
FROM python:3.12-slim
ARG GREETING=hello
ENV APP_MODE=test \\
    GREETING_COPY=${GREETING}
WORKDIR /srv/app
COPY data/ ./data/
COPY layerpkg-1.0-py3-none-any.whl /tmp/
# pip installs into the shared layer venv
RUN pip install --no-index /tmp/layerpkg-1.0-py3-none-any.whl && \\
    date +%s%N > /srv/app/built-at && \\
    python3 -c "import layerpkg; print(layerpkg.VALUE)" > /srv/app/from-run.txt
CMD ["python3"]
"""


@pytest.fixture
def task(tmp_path: Path) -> Path:
    task = make_task(tmp_path / "tasks", dockerfile=DOCKERFILE, files={"data/numbers.csv": "a\n1\n2\n"})
    _wheel(task / "environment")
    return task


def test_parse_dockerfile_joins_continuations_and_skips_comments() -> None:
    parsed = parse_dockerfile(DOCKERFILE)
    assert [i.keyword for i in parsed] == ["FROM", "ARG", "ENV", "WORKDIR", "COPY", "COPY", "RUN", "CMD"]
    run_step = parsed[6]
    assert run_step.line == 9 and "date +%s%N" in run_step.value


def test_dockerfile_workdir_env_copy_and_run_are_honoured(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = open_env(task, tmp_path, root="host")
        await env.start(force_build=False)
        try:
            out = await env.exec(
                "pwd; echo $APP_MODE $GREETING_COPY; cat data/numbers.csv | wc -l; cat from-run.txt; "
                "python3 -c 'import layerpkg; print(layerpkg.VALUE)'"
            )
            assert out.stdout.split() == ["/srv/app", "test", "hello", "3", "7", "7"], out
            # The shared layer is read-only; the sandbox's own copy of its files is writable.
            readonly = await env.exec("touch /opt/venv-layer/x")
            assert readonly.return_code != 0
            assert (await env.exec("echo changed > data/numbers.csv && cat data/numbers.csv")).stdout == "changed\n"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_layers_are_built_once_and_shared(task: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    async def scenario():
        envs = [open_env(task, tmp_path, root="host", cache_dir=str(cache)) for _ in range(4)]
        await asyncio.gather(*(e.start(force_build=False) for e in envs))
        try:
            stamps = {(await e.exec("cat built-at")).stdout for e in envs}
            await envs[0].exec("echo mine > data/numbers.csv")
            others = {(await e.exec("cat data/numbers.csv")).stdout for e in envs[1:]}
        finally:
            await asyncio.gather(*(e.stop(delete=True) for e in envs))
        return stamps, others

    stamps, others = run(scenario())
    assert len(stamps) == 1  # one build for four concurrent starts
    assert others == {"a\n1\n2\n"}  # copy-on-start: one sandbox's writes are its own
    layers = [p for p in (cache / "layers").iterdir() if p.is_dir()]
    assert len(layers) == 1
    # A new builder (a new process, say) reuses the cached layer instead of rebuilding.
    again = run(ImageBuilder(cache).get(task / "environment"))
    assert again.path == layers[0]
    assert (layers[0] / "rootfs" / "srv/app/built-at").read_text() == stamps.pop()


def test_apt_install_of_missing_package_fails_with_a_clear_error(tmp_path: Path) -> None:
    dockerfile = "FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y definitely-not-a-package-xyz\n"
    task = make_task(tmp_path / "tasks", dockerfile=dockerfile)

    async def scenario():
        env = open_env(task, tmp_path, root="host")
        try:
            await env.start(force_build=False)
        finally:
            await env.stop(delete=True)

    with pytest.raises(ImageBuildError) as raised:
        run(scenario())
    message = str(raised.value)
    assert "Dockerfile:2" in message and "definitely-not-a-package-xyz" in message
    assert "environment_type='docker'" in message and "demo" in message


def test_apt_install_of_packages_the_host_has_is_a_no_op(tmp_path: Path) -> None:
    dockerfile = "FROM debian:12\nRUN apt-get update && apt-get install -y --no-install-recommends bash coreutils\n"
    task = make_task(tmp_path / "tasks", dockerfile=dockerfile)

    async def scenario():
        env = open_env(task, tmp_path, root="host")
        await env.start(force_build=False)
        try:
            return (await env.exec("echo ok")).stdout
        finally:
            await env.stop(delete=True)

    assert run(scenario()) == "ok\n"


def test_failing_run_names_the_line_and_output(tmp_path: Path) -> None:
    dockerfile = "FROM python:3.12\nWORKDIR /app\nRUN echo preparing && false\n"
    task = make_task(tmp_path / "tasks", dockerfile=dockerfile)
    with pytest.raises(
        ImageBuildError, match=r"(?s)Dockerfile:3: .*exit code 1.*docker.*Output of the step:\npreparing"
    ):
        run(ImageBuilder(tmp_path / "cache").get(task / "environment", "demo"))


def test_run_cannot_write_the_hosts_system_directories(tmp_path: Path) -> None:
    dockerfile = "FROM python:3.12\nRUN touch /usr/bin/installed-by-task\n"
    task = make_task(tmp_path / "tasks", dockerfile=dockerfile)
    with pytest.raises(ImageBuildError, match="Dockerfile:2"):
        run(ImageBuilder(tmp_path / "cache").get(task / "environment", "demo"))
    assert not Path("/usr/bin/installed-by-task").exists()


def test_copy_outside_the_build_context_is_refused(tmp_path: Path) -> None:
    task = make_task(tmp_path / "tasks", dockerfile="FROM x\nCOPY ../task.toml /leak\n")
    with pytest.raises(ImageBuildError, match="outside the build context"):
        run(ImageBuilder(tmp_path / "cache").get(task / "environment", "demo"))
