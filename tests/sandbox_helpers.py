"""Helpers for the local sandbox tests: synthetic tasks and live-process checks."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor_local_sandbox.local import LocalEnvironment

from trl_harbor.rollout.backends import create_environment

REPO = Path(__file__).resolve().parents[1]
BUNDLED_SUITE = REPO / "examples" / "tasks"


def _base_dockerfile() -> str:
    text = (BUNDLED_SUITE / "orders_count" / "environment" / "Dockerfile").read_text()
    return text[: text.index("\nENV ")] + "\n"


#: The bundled suite's first Dockerfile lines (Debian and python3): test tasks start with them,
#: so that they share its cached layers (built once per machine) on the default image root.
BASE_DOCKERFILE = _base_dockerfile()


def run(coro):
    """Run a coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


def as_a_foreground_job() -> None:
    """A ``preexec_fn``: Ctrl-C at its default in the child, as for a script started from a terminal.

    A process started in the background by a non-interactive shell (``pytest ... &``, ``nohup``,
    some CI runners) ignores SIGINT, and its children inherit that: a Python that starts with
    SIGINT ignored never raises ``KeyboardInterrupt``, so a SIGINT test would wait for its whole
    tool call. One async-signal-safe call between fork and exec.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
    """Create (not start) the local environment of a task, the way trl-harbor does."""
    task = Task(task_dir)
    env = create_environment(
        task,
        "local",
        session_id=f"{task.name}__test",
        trial_paths=TrialPaths(trial_dir=trial_root / f"{task.name}-{time.monotonic_ns()}"),
        kwargs=kwargs,
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
    script: str, *, state_mb: int = 256, timeout: float = 300, subids: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a Python ``script`` as an unprivileged user (no cgroups, no root), as a laptop user would.

    It runs in a private mount namespace: a ``state_mb`` tmpfs is the sandboxes' state root (never
    the host's ``/dev/shm``), and when this interpreter lives in root's home (pyenv), that home is
    hidden behind an empty tmpfs with only the interpreter bound back, so that the user can run it.
    The script gets ``argv[1]`` = a work folder it owns and ``argv[2]`` = this tests folder (for
    ``sandbox_helpers``); ``HARBOR_LOCAL_SANDBOX_STATE_DIR`` names the state root.

    Args:
        script: The Python source to run.
        state_mb: Size of the state root's tmpfs.
        timeout: Seconds before the run is stopped.
        subids: Give the user subordinate ids (:data:`SUBIDS`, as distributions' ``useradd`` does), in
            ``/etc/subuid`` and ``/etc/subgid`` seen in the run's mount namespace only.
        env: More environment variables for the script.

    Returns:
        The finished process (stdout and stderr as text).
    """
    work = Path(tempfile.mkdtemp(prefix="trl-harbor-unprivileged-"))
    try:
        for name in ("home", "tmp", "cache", "state"):
            (work / name).mkdir()
        (work / "script.py").write_text(script)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(work)], check=True)
        os.chmod(work, 0o755)
        base = Path(sys.base_prefix).resolve()
        setup = (
            f"mount -t tmpfs -o size={state_mb}m,mode=0755 trl-harbor-test {work}/state && chown {NOBODY} {work}/state"
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
            f"{sys.executable} {work}/script.py {work} {REPO / 'tests'}"
        )
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "bash", "-c", command],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(REPO),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ── grading's defences (issue #17) ──────────────────────────────────────────────────────


def isolation_off() -> dict:
    """``backend_options`` that make the local sandbox verify in the agent's own sandbox (the generic path
    every backend without an isolated view takes: Docker, cloud sandboxes), where the option exists."""
    from harbor_local_sandbox.local import LocalEnvironmentOptions

    return {"verifier_isolation": False} if "verifier_isolation" in LocalEnvironmentOptions.model_fields else {}


def without_members(monkeypatch: pytest.MonkeyPatch, cls: type, *names: str) -> None:
    """Make ``cls`` lack ``names`` for the test, as a backend that does not offer them.

    The rollout core finds a backend's extensions with ``isinstance`` against the protocols of
    ``trl_harbor.rollout.contract``, which remember their answer per class (``abc``'s caches): for the
    test they answer from fresh caches, and the originals (computed on the class as it is) come back
    with the members.
    """
    import abc

    from trl_harbor.rollout import contract

    for protocol in [getattr(contract, name) for name in contract.__all__]:
        if isinstance(protocol, type):
            monkeypatch.setattr(protocol, "_abc_impl", protocol._abc_impl)  # restored at the test's end
            abc._abc_init(protocol)  # a fresh cache meanwhile
    for name in names:
        monkeypatch.setattr(cls, name, None)  # None: "not offered", as a subclass would say it


def defences_off(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Switch off every defence of grading, to show an attack is real; return the ``env_kwargs`` for the rest.

    The one place that knows what "undefended" means (wire new defences here):

    * the verifier runs in the agent's own sandbox (:func:`isolation_off`), beside the agent's
      processes (``agent_processes="keep"``), as on a Docker backend;
    * the tamper check of that path refuses nothing (``Baseline.apply``);
    * the sandbox's health is asked of its shell (``true``), not of its supervisor (``alive``);
    * an artifact that cannot be copied safely is the backend's fault, not the rollout's.

    Returns:
        ``env_kwargs`` for ``HarborSpec`` (merge ``backend_options`` with your own).
    """
    from trl_harbor.rollout import grading
    from trl_harbor.rollout.seal import Baseline, SealReport

    async def refuse_nothing(self, environment, kill, allowed=()):  # noqa: ANN001, ARG001
        return SealReport(0)

    monkeypatch.setattr(Baseline, "apply", refuse_nothing)
    without_members(monkeypatch, LocalEnvironment, "alive")
    monkeypatch.setattr(grading, "_unsafe", lambda error: False)
    return {"agent_processes": "keep", "backend_options": isolation_off()}


def recording_bash_env(record) -> type:
    """A ``HarborBashEnv`` whose ``bash`` tool calls ``record(env, command, output)`` after each command
    (for tests of a training step: which rollout ran what, and where)."""
    from trl_harbor import HarborBashEnv

    class RecordingBashEnv(HarborBashEnv):
        def bash(self, command: str) -> str:
            """Run a shell command in the sandbox and return its combined stdout and stderr.

            Args:
                command: The shell command to run.

            Returns:
                The command's combined stdout and stderr.
            """
            output = super().bash(command)
            record(self, command, output)
            return output

    return RecordingBashEnv
