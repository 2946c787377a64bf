"""The rollout core's decisions on the fast tier's fake backend (``fast_backend.SubprocessEnvironment``).

No root, no bubblewrap, no Docker, no image build: each sandbox is a host folder and ``bash``
subprocesses (the fake passes ``check_backend``, ``test_conformance.py``). What is tested is trl-harbor's,
through its public surface (``HarborSpec``, its ``environment_factory`` and ``reward_funcs``): Harbor's
real verifier grading a passing and a failing answer, a multi-step task and its ``min_reward`` gate, and
who a failure is attributed to (the policy's verifier crash, the infrastructure's start failure or lost
sandbox).
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import GOLD_ANSWER, GOLD_TASK
from fast_backend import SubprocessEnvironment

from trl_harbor import HarborOptions, HarborSpec, close_all
from trl_harbor.rollout import COUNTERS, Cause

FAST = "fast_backend:SubprocessEnvironment"


@pytest.fixture(autouse=True)
def _stop_sandboxes() -> Iterator[None]:
    yield
    close_all()


def live_processes_with(mark: str) -> list[str]:
    """This host's processes whose command line holds ``mark``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if mark.encode() in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
    return found


def _task(root: Path, name: str, test_sh: str, *, steps: str = "", dockerfile: str = "WORKDIR /workdir\n") -> Path:
    """A task on the fake backend (``FROM`` is never built there)."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\n" + dockerfile)
    (task / "instruction.md").write_text("Write the answer to /workdir/answer.txt\n")
    (task / "task.toml").write_text(
        'version = "1.0"\n[verifier]\ntimeout_sec = 30\n[environment]\nnetwork_mode = "no-network"\n' + steps
    )
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nmkdir -p /logs/verifier\n" + test_sh)
    return task


# ── grading by Harbor's verifier ────────────────────────────────────────────────────────────


def test_a_right_and_a_wrong_answer_are_graded_by_harbors_verifier(copy_tasks) -> None:
    spec = HarborSpec(copy_tasks(GOLD_TASK), environment_type=FAST)
    assert spec.environment_type == FAST
    right, wrong = spec.environment_factory(), spec.environment_factory()
    for env in (right, wrong):
        assert "answer" in env.reset(task_dir=str(spec.task_dirs[0]))
    # The task's data was copied in by its Dockerfile's COPY; the agent's paths are the task's.
    assert "sensors.json" in right.bash("ls /workdir/data")
    assert right.bash("pwd").strip() == "/workdir"
    right.bash(f"echo {GOLD_ANSWER} > /workdir/answer.txt")
    wrong.bash("echo 12.5 > /workdir/answer.txt")
    rewards = spec.reward_funcs(environments=[right, wrong])
    assert rewards == [1.0, 0.0]
    assert right.verification.cause is None and wrong.verification.cause is None
    assert right.verification.rewards == {"reward": 1.0}


# ── a multi-step task ───────────────────────────────────────────────────────────────────────

STEP_TEST = (
    'if [ "$(cat {path} 2>/dev/null)" = "{expected}" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
)


def _steps_task(root: Path, name: str, gate: bool) -> Path:
    gate_line = "min_reward = 1.0\n" if gate else ""
    task = _task(root, name, "", steps=f'[[steps]]\nname = "one"\n{gate_line}\n[[steps]]\nname = "two"\n')
    (task / "tests" / "test.sh").unlink()
    for step, path, expected, text in (
        ("one", "/workdir/a.txt", "1", "Write 1 to /workdir/a.txt."),
        ("two", "/workdir/b.txt", "staged-token", "Copy /workdir/token.txt to /workdir/b.txt."),
    ):
        (task / "steps" / step / "tests").mkdir(parents=True)
        (task / "steps" / step / "instruction.md").write_text(text + "\n")
        test = "#!/bin/bash\nmkdir -p /logs/verifier\n" + STEP_TEST.format(path=path, expected=expected)
        (task / "steps" / step / "tests" / "test.sh").write_text(test)
    (task / "steps" / "two" / "workdir").mkdir()
    (task / "steps" / "two" / "workdir" / "setup.sh").write_text("echo staged-token > /workdir/token.txt\n")
    return task


def test_a_multi_step_task_runs_its_steps_and_min_reward_ends_it(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    _steps_task(root, "open", gate=False)
    _steps_task(root, "gated", gate=True)
    spec = HarborSpec(root, agent="bash_steps", environment_type=FAST)
    task = {p.name: str(p) for p in spec.task_dirs}
    env = spec.environment_factory()

    # Both steps done: step two is staged by its setup.sh only once step one is submitted.
    assert env.reset(task_dir=task["open"]).startswith("Write 1 to /workdir/a.txt.")
    assert "No such file" in env.bash("cat /workdir/token.txt")
    env.bash("echo 1 > /workdir/a.txt")
    assert "Copy /workdir/token.txt" in env.submit_step()
    env.bash("cp /workdir/token.txt /workdir/b.txt")
    assert "task is over" in env.submit_step()
    assert env.reward == 1.0
    assert env.verification.steps == (("one", {"reward": 1.0}), ("two", {"reward": 1.0}))

    # min_reward on step one: a wrong first step ends the rollout; step two is never staged.
    env.reset(task_dir=task["gated"])
    env.bash("echo 0 > /workdir/a.txt")
    assert "task is over" in env.submit_step()
    assert env.bash("cat /workdir/token.txt").startswith("Error: the rollout is over")
    assert env.reward == 0.0
    assert env.verification.steps == (("one", {"reward": 0.0}),)
    assert "1 of 2 steps never reached" in env.verification.reason


# ── who a failure is attributed to ──────────────────────────────────────────────────────────

#: A test that takes the agent's answer as its reward: a non-number breaks Harbor's reward parsing.
ECHO_ANSWER = "cp /workdir/answer.txt /logs/verifier/reward.txt\n"


class FailsToStart(SubprocessEnvironment):
    """The infrastructure fails: no sandbox starts."""

    async def start(self, force_build: bool) -> None:
        raise RuntimeError("the sandbox host is gone")


class LostAtGrading(SubprocessEnvironment):
    """The backend says its sandbox no longer runs (a lost node, a dead daemon)."""

    async def alive(self) -> bool:
        return False


def test_a_verifier_the_answer_broke_is_the_policys_zero(tmp_path: Path) -> None:
    _task(tmp_path / "suite", "echo_answer", ECHO_ANSWER)
    spec = HarborSpec(tmp_path / "suite", environment_type=FAST)
    broken, fine = spec.environment_factory(), spec.environment_factory()
    for env in (broken, fine):
        env.reset(task_dir=str(spec.task_dirs[0]))
    broken.bash("echo banana > /workdir/answer.txt")
    fine.bash("echo 0.25 > /workdir/answer.txt")
    assert spec.reward_funcs(environments=[broken, fine]) == [0.0, 0.25]
    assert broken.verification.cause is Cause.VERIFIER and not broken.verification.infra
    assert "verification failed in a healthy sandbox" in broken.verification.reason
    assert fine.verification.cause is None


def test_the_same_crash_in_a_sandbox_the_backend_lost_is_the_infrastructures(tmp_path: Path) -> None:
    _task(tmp_path / "suite", "echo_answer", ECHO_ANSWER)
    spec = HarborSpec(tmp_path / "suite", environment_type="test_rollout_core_fast:LostAtGrading")
    env = spec.environment_factory()
    env.reset(task_dir=str(spec.task_dirs[0]))
    env.bash("echo banana > /workdir/answer.txt")
    assert spec.reward_funcs(environments=[env]) == [None]  # on_infra_error="skip": left out of the batch
    assert env.verification.cause is Cause.INFRASTRUCTURE and env.verification.infra


def test_a_sandbox_that_does_not_start_is_the_infrastructures(copy_tasks) -> None:
    spec = HarborSpec(copy_tasks(GOLD_TASK), environment_type="test_rollout_core_fast:FailsToStart")
    before = COUNTERS.infra_failures()["start"]
    env = spec.environment_factory()
    env.reset(task_dir=str(spec.task_dirs[0]))
    assert "the sandbox host is gone" in env.bash("echo hi")
    assert spec.reward_funcs(environments=[env]) == [None]
    assert env.verification.cause is Cause.INFRASTRUCTURE
    assert "sandbox start failed" in env.verification.reason and "the sandbox host is gone" in env.verification.reason
    assert COUNTERS.infra_failures()["start"] == before + 1
    strict = HarborSpec(copy_tasks(GOLD_TASK, dest="again"), environment_type="test_rollout_core_fast:FailsToStart",
                        options=HarborOptions(on_infra_error="zero"))  # fmt: skip
    env = strict.environment_factory()
    env.reset(task_dir=str(strict.task_dirs[0]))
    assert strict.reward_funcs(environments=[env]) == [0.0]


def test_the_fake_keeps_a_task_off_the_hosts_system_folders(tmp_path: Path) -> None:
    _task(tmp_path / "suite", "installs", ECHO_ANSWER, dockerfile="COPY tool /usr/local/bin/tool\n")
    (tmp_path / "suite" / "installs" / "environment" / "tool").write_text("#!/bin/sh\n")
    spec = HarborSpec(tmp_path / "suite", environment_type=FAST)
    env = spec.environment_factory()
    env.reset(task_dir=str(spec.task_dirs[0]))
    assert "cannot place '/usr/local/bin/tool'" in env.bash("true")
    assert not Path("/usr/local/bin/tool").exists()


def test_no_sandbox_folder_or_process_is_left(tmp_path: Path) -> None:
    folders = set(Path(tempfile.gettempdir()).glob("fast-sandbox-*"))
    _task(tmp_path / "suite", "echo_answer", ECHO_ANSWER)
    spec = HarborSpec(tmp_path / "suite", environment_type=FAST)
    env = spec.environment_factory()
    env.reset(task_dir=str(spec.task_dirs[0]))
    mark = f"left-behind-{uuid.uuid4().hex[:8]}"
    env.bash(f"nohup setsid bash -c 'sleep 300; : {mark}' >/dev/null 2>&1 &")
    assert live_processes_with(mark) and set(Path(tempfile.gettempdir()).glob("fast-sandbox-*")) - folders
    close_all()
    assert not live_processes_with(mark)  # found by the sandbox's mark, though it left the process group
    assert set(Path(tempfile.gettempdir()).glob("fast-sandbox-*")) <= folders
