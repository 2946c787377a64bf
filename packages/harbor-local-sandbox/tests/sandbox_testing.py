"""Helpers of the package's sandbox tests: tasks of their own, the sandbox made as Harbor makes it, waiting.

(A module of its own, not a ``conftest.py``: the suite of the repository that holds the package runs these
tests in the same session, and its tests import their own ``conftest`` by name; see ``harbor_alone.py``.)

The tests that start sandboxes write their own tiny tasks (:func:`make_task`), whose image
:func:`task_base_image` builds once per session with the package's own command
(``harbor-local-sandbox images build``), so that no test pays a cold build inside its own time limit.
:func:`run_unprivileged` runs a script as an unprivileged user (the tests without root).
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

#: This folder (the package's tests): a script :func:`run_unprivileged` runs imports this module from it.
TESTS_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = TESTS_DIR.parent
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


def dockerfile_task(
    tmp_path: Path, dockerfile: str, files: dict[str, str] | None = None, network: str = "no-network"
) -> Path:
    """A task (:func:`make_task`, under ``tmp_path/tasks``) whose image is ``dockerfile`` (dedented) with ``files``."""
    return make_task(tmp_path / "tasks", dockerfile=textwrap.dedent(dockerfile), files=files, network_mode=network)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An image cache of the module's own (the environments' ``cache_dir`` option); its mounts released at its end."""
    from harbor_local_sandbox.oci import ImageStore

    path = tmp_path_factory.mktemp("image-cache")
    yield str(path)
    ImageStore(path).release_mounts()


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


def left_in_state(state: Path) -> tuple[list[str], list[str]]:
    """The mounts at or below the state root ``state``, and its sandbox folders (the view workers' sockets aside)."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return (
        [m for m in mounts if m == str(state) or m.startswith(f"{state}/")],
        sorted(p.name for p in state.iterdir() if p.name != "workers"),
    )


def runs_leave_nothing(tmp_path: Path, runs: int, command: list[str], name: str) -> None:
    """Run ``command`` ``runs`` times, each in a fresh process beside two busy loops with a state root of its own
    (``HARBOR_LOCAL_SANDBOX_STATE_DIR``): each must succeed, with no ``EBUSY`` on the way, and leave no mount and
    no sandbox folder."""
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for index in range(runs):
            state = tmp_path / f"{name}-state-{index}"
            state.mkdir()
            # litellm (Harbor imports it) fetches its model price list from GitHub on import unless told not to.
            environ = {
                **os.environ, "HARBOR_LOCAL_SANDBOX_STATE_DIR": str(state), "HARBOR_TELEMETRY": "0",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            }  # fmt: skip
            done = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
            assert "Device or resource busy" not in done.stderr, done.stderr[-3000:]
            mounts, folders = left_in_state(state)
            assert not mounts and not folders, f"run {index} left mounts {mounts} and folders {folders}"
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


#: The unprivileged user :func:`run_unprivileged` runs as.
NOBODY = 65534

#: Marks tests that run a script as an unprivileged user (they need root to become one).
unprivileged_test = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None,
    reason="becoming another user needs root and util-linux (as non-root, every other test is unprivileged)",
)

#: The subordinate ids :func:`run_unprivileged` gives its user with ``subids=True``.
SUBIDS = "200000:65536"


def run_unprivileged(
    script: str,
    *,
    state_mb: int = 256,
    timeout: float = 300,
    subids: bool = False,
    env: dict[str, str] | None = None,
    tests_dir: Path = TESTS_DIR,
    cwd: Path = PACKAGE_DIR,
) -> subprocess.CompletedProcess:
    """Run a Python ``script`` as an unprivileged user (no cgroups, no root), as a laptop user would.

    It runs in a private mount namespace: a ``state_mb`` tmpfs is the sandboxes' state root (never
    the host's ``/dev/shm``), and when this interpreter lives in root's home (pyenv), that home is
    hidden behind an empty tmpfs with only the interpreter bound back, so that the user can run it.
    The script gets ``argv[1]`` = a work folder it owns and ``argv[2]`` = ``tests_dir`` (to import
    this module's helpers from); ``HARBOR_LOCAL_SANDBOX_STATE_DIR`` names the state root.

    Args:
        script: The Python source to run.
        state_mb: Size of the state root's tmpfs.
        timeout: Seconds before the run is stopped.
        subids: Give the user subordinate ids (:data:`SUBIDS`, as distributions' ``useradd`` does), in
            ``/etc/subuid`` and ``/etc/subgid`` seen in the run's mount namespace only.
        env: More environment variables for the script.
        tests_dir: The script's ``argv[2]``: a folder of test helpers (by default this one).
        cwd: Where the script runs (by default the package's folder, whose ``pyproject.toml`` configures pytest).

    Returns:
        The finished process (stdout and stderr as text).
    """
    work = Path(tempfile.mkdtemp(prefix="harbor-local-sandbox-unprivileged-"))
    try:
        for name in ("home", "tmp", "cache", "state"):
            (work / name).mkdir()
        (work / "script.py").write_text(script)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(work)], check=True)
        os.chmod(work, 0o755)
        base = Path(sys.base_prefix).resolve()
        setup = (
            f"mount -t tmpfs -o size={state_mb}m,mode=0755 harbor-local-sandbox-test {work}/state"
            f" && chown {NOBODY} {work}/state"
        )
        if subids:  # /etc/subuid may not exist: an overlay of /etc, in the run's mount namespace only
            (work / "etc-upper").mkdir()
            (work / "etc-work").mkdir()
            setup += (
                f" && mount -t overlay overlay -o lowerdir=/etc,upperdir={work}/etc-upper,workdir={work}/etc-work /etc"
                f" && echo nobody:{SUBIDS} > /etc/subuid && echo nobody:{SUBIDS} > /etc/subgid"
            )
        home = Path("/root")
        if base.is_relative_to(home):
            (work / "base").mkdir()
            setup += (
                f" && mount --bind {base} {work}/base && mount -t tmpfs -o mode=0755 tmpfs {home}"
                f" && mkdir -p {base} && mount --bind {work}/base {base}"
            )
        extra_env, env = (
            env,
            {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": f"{work}/home",
                "TMPDIR": f"{work}/tmp",
                "HARBOR_LOCAL_SANDBOX_CACHE_DIR": f"{work}/cache",
                "HARBOR_LOCAL_SANDBOX_STATE_DIR": f"{work}/state",
                "HARBOR_TELEMETRY": "0",
            },
        )
        # PYTHONPATH too: a run against another checkout than the venv's (a worktree) tests that checkout.
        # Not the session's CONTAINERS_REGISTRIES_CONF: it is in root's temporary folder, out of the user's reach.
        for name in ("PYTHONPATH",):
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(extra_env or {})
        command = (
            f"{setup} && exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups "
            f"{sys.executable} {work}/script.py {work} {tests_dir}"
        )
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "bash", "-c", command],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(cwd),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: Loads the tests' Debian base archive (``$TEST_BASE_ARCHIVE``: copied where the user can read it) into the
#: user's default image cache as ``debian:bookworm-slim``, and makes it the user's test-image cache too (so the
#: loopback registry serves it without a bootstrap); then the script of :func:`as_nobody` runs.
_NOBODY_PRELUDE = """
import asyncio, os, shutil, subprocess, sys
from pathlib import Path
work = Path(sys.argv[1])
archive = work / "base.oci.tar"
shutil.copy(os.environ["TEST_BASE_ARCHIVE"], archive)
os.environ["HARBOR_LOCAL_SANDBOX_TEST_CACHE"] = str(work / "test-images")
(work / "test-images").mkdir()
shutil.copy(archive, work / "test-images" / Path(os.environ["TEST_BASE_ARCHIVE"]).name)
from harbor_local_sandbox.oci import ImageStore
asyncio.run(ImageStore().load_archive(archive, "debian:bookworm-slim"))
"""


def as_nobody(script: str, timeout: float, subids: bool = True, **kwargs) -> str:
    """Run ``script`` as ``nobody`` (:func:`run_unprivileged`, with subordinate ids unless ``subids`` is false),
    after loading the tests' Debian base image into its cache; its stdout (fails the test on an error).

    ``kwargs`` go to :func:`run_unprivileged` (``tests_dir``, ``cwd``)."""
    from registry_testing import base_image_archive

    archive = base_image_archive()
    folder = Path(tempfile.mkdtemp(prefix="base-image-for-nobody-"))  # where the user can read it
    try:
        folder.chmod(0o755)
        readable = Path(shutil.copy(archive, folder / archive.name))
        readable.chmod(0o644)
        done = run_unprivileged(
            _NOBODY_PRELUDE + script, subids=subids, timeout=timeout, state_mb=512,
            env={"TEST_BASE_ARCHIVE": str(readable), "PYTHONDONTWRITEBYTECODE": "1"}, **kwargs,
        )  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    return done.stdout


def pytest_as_nobody(*args: str, timeout: float = 2400, **kwargs) -> str:
    """Run pytest with ``args`` as ``nobody`` (:func:`as_nobody`; its folder: ``cwd``), without the options of its
    configuration (``addopts``); assert every collected test passed, none skipped; return its summary line."""
    out = as_nobody(
        f"import pytest\nsys.exit(pytest.main(['-p', 'no:cacheprovider', '-q', '-o', 'addopts=', *{list(args)!r}]))\n",
        timeout=timeout,
        **kwargs,
    )
    summary = out.strip().splitlines()[-1]
    print(f"as nobody: {summary}")
    assert " passed" in summary and "failed" not in summary and "error" not in summary, out[-4000:]
    assert "skipped" not in summary, out[-4000:]  # every one ran
    return summary
