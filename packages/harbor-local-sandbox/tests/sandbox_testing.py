"""Helpers of the package's sandbox tests: tasks of their own, the sandbox made as Harbor makes it, waiting.

(A module of its own, not a ``conftest.py``: the suite of the repository that holds the package runs these
tests in the same session, and its tests import their own ``conftest`` by name; see ``harbor_alone.py``.)

The tests that start sandboxes write their own tiny tasks (:func:`make_task`), whose image
:func:`task_base_image` builds once per session with the package's own command
(``harbor-local-sandbox images build``), so that no test pays a cold build inside its own time limit.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor_local_sandbox.local import LocalEnvironment

PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: The checkout the tests run from (the repository that holds the package): a host folder no sandbox sees.
REPO = PACKAGE_DIR.parents[1]
#: The package's environment, as Harbor's ``--environment-import-path`` names it.
IMPORT_PATH = "harbor_local_sandbox.local:LocalEnvironment"

#: Marks tests that run real sandboxes (bubblewrap). They are never skipped: where bubblewrap is
#: missing they fail, as they should.
requires_local = pytest.mark.local

#: The first lines of a task image (Debian and python3): every test task starts with them, so they share
#: one set of cached layers (built once per machine, by :func:`task_base_image`). The same lines as the
#: bundled example suite's Dockerfiles, whose layers are then shared too.
BASE_DOCKERFILE = """\
FROM debian:bookworm-slim

RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 \\
 && rm -rf /var/lib/apt/lists/*

"""


def run(coro):
    """Run a coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


def count_processes_cmd(text: str) -> str:
    """A shell command printing how many sandbox processes have ``text`` in their command line.

    Reads ``/proc`` in the shell itself (task images have no procps, and a ``grep TEXT`` would
    count itself); always prints a number, so a test that checks it cannot pass on a missing tool.
    """
    return (
        "n=0; for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); "
        f'case "$c" in *"for p in /proc"*) ;; *{shlex.quote(text)}*) n=$((n+1));; esac; done; echo $n'
    )


def make_task(
    root: Path,
    name: str = "demo",
    *,
    dockerfile: str = BASE_DOCKERFILE + "WORKDIR /workdir\n",
    network_mode: str = "no-network",
    memory_mb: int | None = 512,
    files: dict[str, str] | None = None,
    gold: str = "42",
) -> Path:
    """Write a minimal, valid Harbor task whose gold answer is ``gold``."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, content in (files or {}).items():
        path = task / "environment" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    (task / "instruction.md").write_text("Write the answer to /workdir/answer.txt\n")
    memory = f"memory_mb = {memory_mb}\n" if memory_mb else ""
    (task / "task.toml").write_text(
        textwrap.dedent(
            f"""\
            version = "1.0"
            [metadata]
            gold_answer = "{gold}"
            [verifier]
            timeout_sec = 60
            [verifier.env]
            EXPECTED_ANSWER = "{gold}"
            [agent]
            timeout_sec = 60
            [environment]
            network_mode = "{network_mode}"
            cpus = 1
            """
        )
        + memory
    )
    test_sh = task / "tests" / "test.sh"
    test_sh.write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        'if [ "$(cat /workdir/answer.txt 2>/dev/null)" = "$EXPECTED_ANSWER" ]; then echo 1 > /logs/verifier/reward.txt; '
        "else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    test_sh.chmod(0o755)
    solve = task / "solution" / "solve.sh"
    solve.write_text(f"#!/bin/bash\necho {gold} > /workdir/answer.txt\n")
    solve.chmod(0o755)
    return task


def open_env(task_dir: Path, trial_root: Path, **kwargs) -> LocalEnvironment:
    """Create (not start) the sandbox of a task as Harbor's trial does: through Harbor's ``EnvironmentFactory``,
    with the network policies Harbor resolves for the task (the agent's phase, then the verifier's where it
    shares the sandbox). ``kwargs`` are the environment's options (``harbor run --ek``)."""
    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.task.verifier_mode import resolve_task_verifier_mode
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, VerifierConfig
    from harbor.trial.network_policy import resolve_trial_network_plan

    task = Task(task_dir)
    config = EnvironmentConfig(import_path=IMPORT_PATH, kwargs=dict(kwargs))
    plan = resolve_trial_network_plan(
        task.config,
        AgentConfig(),
        config,
        VerifierConfig(),
        None,
        verifier_mode=resolve_task_verifier_mode(task.config),
    )
    separate = plan.verifier_env_baseline is not None
    trial_paths = TrialPaths(trial_dir=trial_root / f"{task.name}-{time.monotonic_ns()}")
    trial_paths.mkdir()
    env = EnvironmentFactory.create_environment_from_config(
        config=config,
        environment_dir=task.paths.environment_dir,
        environment_name=task.short_name,
        session_id=f"{task.name}__test",
        trial_paths=trial_paths,
        task_env_config=task.config.environment.model_copy(deep=True),
        network_policy=plan.agent_env_baseline,
        phase_network_policies=[plan.agent_phase] if separate else [plan.agent_phase, plan.verifier_phase],
    )
    assert isinstance(env, LocalEnvironment)
    return env


def live_processes_with(marker: str) -> list[int]:
    """Host PIDs of live (not zombie) processes whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(name))
    return found


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def task_base_image() -> Iterator[None]:
    """Build the test tasks' image (:func:`make_task`'s default) once, up front, with ``harbor-local-sandbox
    images build``: a cold build (Debian bootstrapped where no registry is reachable, then ``apt-get install
    python3``) takes about a minute, which no test should pay inside its own time limit; a cached one, under a
    second. Where images cannot be built here (not root, no buildah), nothing is built and the tests that need
    one fail with the reason. At the end, the image cache's mounts are released (the run leaves nothing mounted).

    (Imported by each module that needs it: each runs it once; after the first, the build is cached.)
    """
    if os.geteuid() != 0 or shutil.which("buildah") is None:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="harbor-local-sandbox-images-") as scratch:
        make_task(Path(scratch), "base")
        result = subprocess.run(
            [sys.executable, "-m", "harbor_local_sandbox.cli", "images", "build", scratch],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    yield
    from harbor_local_sandbox.oci import ImageStore

    ImageStore().release_mounts()
