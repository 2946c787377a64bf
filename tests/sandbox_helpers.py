"""Helpers for trl-harbor's sandbox tests: the local sandbox package's own test helpers, and trl-harbor's.

Synthetic tasks, waiting, live-process checks and running as an unprivileged user are the package's
(``packages/harbor-local-sandbox/tests/sandbox_testing.py``, imported from there: one copy); what is
trl-harbor's is here: environments made the way trl-harbor makes them (:func:`open_env`), and the switches
of grading's defences.
"""

from __future__ import annotations

import functools
import signal
from pathlib import Path

import pytest
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor_local_sandbox.local import LocalEnvironment

REPO = Path(__file__).resolve().parents[1]
BUNDLED_SUITE = REPO / "examples" / "tasks"

# The package's tests, whose helpers these are: registry puts them on sys.path (benchmarks and scripts import
# this module outside pytest, whose configuration does it too).
import registry  # noqa: E402, F401, I001 - first: the path
import sandbox_testing  # noqa: E402
from sandbox_testing import (  # noqa: E402, F401 - the package's helpers, used from here
    BASE_DOCKERFILE,
    NOBODY,
    SUBIDS,
    count_processes_cmd,
    live_processes_with,
    make_task,
    run,
    runs_leave_nothing,
    unprivileged_test,
    wait_until,
)

from trl_harbor.rollout.backends import create_environment  # noqa: E402

#: The package's helpers that run a script as ``nobody`` (``argv[2]``: this folder; from the repository's root).
run_unprivileged = functools.partial(sandbox_testing.run_unprivileged, tests_dir=REPO / "tests", cwd=REPO)
as_nobody = functools.partial(sandbox_testing.as_nobody, tests_dir=REPO / "tests", cwd=REPO)
pytest_as_nobody = functools.partial(sandbox_testing.pytest_as_nobody, tests_dir=REPO / "tests", cwd=REPO)


def as_a_foreground_job() -> None:
    """A ``preexec_fn``: Ctrl-C at its default in the child, as for a script started from a terminal.

    A process started in the background by a non-interactive shell (``pytest ... &``, ``nohup``,
    some CI runners) ignores SIGINT, and its children inherit that: a Python that starts with
    SIGINT ignored never raises ``KeyboardInterrupt``, so a SIGINT test would wait for its whole
    tool call. One async-signal-safe call between fork and exec.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def open_env(task_dir: Path, trial_root: Path, **kwargs) -> LocalEnvironment:
    """Create (not start) the local environment of a task, the way trl-harbor does."""
    import time

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
