"""A generation batch starts its sandboxes together, verifies them together, and survives failures.

``LatencyLocalEnvironment`` (the local sandbox plus an injected start delay) stands in for a
cloud backend, which cannot be reached here; it records when each start and verifier run
happened, so these tests check what overlapped, never how fast anything was.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, REPO, requires_local
from harbor_local_sandbox._lifetime import state_root
from harbor_local_sandbox.latency import LatencyLocalEnvironment

from sandbox_helpers import BASE_DOCKERFILE, as_a_foreground_job, live_processes_with, wait_until
from trl_harbor import HarborOptions, HarborSpec, close_all
from trl_harbor.rollout import COUNTERS

LATENCY = "harbor_local_sandbox.latency:LatencyLocalEnvironment"


@pytest.fixture(autouse=True)
def _clean():
    LatencyLocalEnvironment.intervals.clear()
    yield
    close_all()


def _spec(tmp_path: Path, names: list[str], **env_kwargs) -> HarborSpec:
    suite = tmp_path / "suite"
    for name in names:
        if not (suite / name).exists():
            shutil.copytree(BUNDLED_SUITE / name, suite / name)
    return HarborSpec(suite, environment_type=LATENCY, options=HarborOptions(**env_kwargs))


def _overlapping(intervals) -> bool:
    """Whether every interval began before any of them ended."""
    return max(i.begin for i in intervals) < min(i.end for i in intervals)


@requires_local
def test_reset_returns_before_the_sandbox_and_a_batch_starts_together(tmp_path: Path) -> None:
    spec = _spec(tmp_path, [GOLD_TASK], backend_options={"start_latency_sec": 1.0})
    envs = [spec.environment_factory() for _ in range(8)]
    for env in envs:
        prompt = env.reset(task_dir=str(spec.task_dirs[0]))
        assert prompt.startswith((BUNDLED_SUITE / GOLD_TASK / "instruction.md").read_text()[:40])
        assert not env._episode.ready.done()  # still starting in the background
    outputs = [env.bash("ls /workdir/data") for env in envs]  # each waits for its own sandbox
    assert all("sensors.json" in out for out in outputs)
    starts = [i for i in LatencyLocalEnvironment.intervals if i.kind == "start"]
    assert len(starts) == 8 and _overlapping(starts)


@requires_local
def test_concurrent_starts_are_bounded(tmp_path: Path) -> None:
    spec = _spec(tmp_path, [GOLD_TASK], backend_options={"start_latency_sec": 0.3}, max_concurrent_starts=3)
    envs = [spec.environment_factory() for _ in range(9)]
    for env in envs:
        env.reset(task_dir=str(spec.task_dirs[0]))
    for env in envs:
        env.bash("true")
    starts = sorted((i for i in LatencyLocalEnvironment.intervals if i.kind == "start"), key=lambda i: i.begin)
    most = max(sum(1 for o in starts if o.begin <= s.begin < o.end) for s in starts)
    assert len(starts) == 9 and most <= 3


@requires_local
def test_batch_verification_runs_concurrently_and_is_reused(tmp_path: Path) -> None:
    # Each verifier run lasts longer than a loaded machine takes to start the six of them.
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, tmp_path / "suite" / GOLD_TASK)
    test_sh = tmp_path / "suite" / GOLD_TASK / "tests" / "test.sh"
    shebang, _, rest = test_sh.read_text().partition("\n")
    test_sh.write_text(f"{shebang}\nsleep 2\n{rest}")
    spec = _spec(tmp_path, [GOLD_TASK])
    envs = [spec.environment_factory() for _ in range(6)]
    for i, env in enumerate(envs):
        env.reset(task_dir=str(spec.task_dirs[0]))
        env.bash(f"echo {GOLD_ANSWER if i % 2 == 0 else 0} > /workdir/answer.txt")
    reward_func = spec.reward_funcs
    rewards = reward_func(completions=[None] * 6, environments=envs)
    assert rewards == [1.0, 0.0] * 3
    verifies = [i for i in LatencyLocalEnvironment.intervals if i.kind == "verify"]
    assert len(verifies) == 6 and _overlapping(verifies)
    assert [env.reward for env in envs] == rewards  # reused, not verified again
    assert len([i for i in LatencyLocalEnvironment.intervals if i.kind == "verify"]) == 6


def _broken_tasks(tmp_path: Path) -> Path:
    suite = tmp_path / "suite"
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / "a_good")
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / "b_cannot_start")
    (suite / "b_cannot_start" / "environment" / "Dockerfile").write_text(
        BASE_DOCKERFILE + "RUN apt-get install -y no-such-package-anywhere\n"
    )
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / "c_verifier_crashes")
    (suite / "c_verifier_crashes" / "tests" / "test.sh").write_text("#!/bin/bash\necho crashing >&2\nexit 3\n")
    return suite


@requires_local
@pytest.mark.parametrize("mode", ["skip", "zero"])
def test_one_failed_start_and_one_crashed_verifier_cost_only_their_rollouts(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    suite = _broken_tasks(tmp_path)
    spec = HarborSpec(suite, environment_type="local", options=HarborOptions(on_infra_error=mode))
    by_name = {p.name: str(p) for p in spec.task_dirs}
    order = ["a_good", "b_cannot_start", "c_verifier_crashes", "a_good"]
    envs = [spec.environment_factory() for _ in order]
    before = COUNTERS.infra_failures()
    with caplog.at_level(logging.WARNING, logger="trl_harbor"):
        for env, name in zip(envs, order, strict=True):
            env.reset(task_dir=by_name[name])
        outputs = [env.bash(f"echo {GOLD_ANSWER} > /workdir/answer.txt && echo written") for env in envs]
        assert outputs[0].strip() == outputs[2].strip() == outputs[3].strip() == "written"
        assert "could not" not in outputs[0]
        assert outputs[1].startswith("Error: sandbox start failed for task 'b_cannot_start'")
        assert "no-such-package-anywhere" in outputs[1] and "will not be scored" in outputs[1]
        logged_metrics, logged_extra = {}, {}
        reward_func = spec.reward_funcs
        rewards = reward_func(
            completions=[None] * 4,
            environments=envs,
            log_metric=logged_metrics.__setitem__,
            log_extra=logged_extra.__setitem__,
        )
    # The start failure is the backend's: skipped (or 0, as configured). The verifier that wrote
    # no reward ran in a healthy sandbox, which the rollout may have broken: always 0, never skipped.
    lost = None if mode == "skip" else 0.0
    assert rewards == [1.0, lost, 0.0, 1.0]
    assert logged_metrics["harbor/infra_failures"] == 1.0
    assert logged_metrics["harbor/verifier_failures"] == 1.0
    assert logged_extra["harbor_error"][0] == "" and "ImageBuildError" in logged_extra["harbor_error"][1]
    assert "RewardFileNotFound" in logged_extra["harbor_error"][2] and "healthy" in logged_extra["harbor_error"][2]
    after = COUNTERS.infra_failures()
    assert after["start"] == before["start"] + 1 and after["verify"] == before["verify"]
    reasons = [r.getMessage() for r in caplog.records if "not the policy's fault" in r.getMessage()]
    assert len(reasons) == 1  # the failure logged once, with its task and cause
    assert "b_cannot_start" in reasons[0] and "ImageBuildError" in reasons[0]


def _leftovers(pid: int) -> list[str]:
    """Sandbox trees, cgroups and episode folders of the process ``pid`` that still exist.

    For a process that has exited, its episode root must be gone too; for this (live) test
    process, it must be empty.
    """
    import tempfile

    found = [p.name for p in state_root().iterdir() if p.name.startswith(f"{pid}-")]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/harbor-local-sandbox/{pid}-*")]
    trials = Path(tempfile.gettempdir()) / f"trl-harbor-trials-{os.getuid()}"
    pattern = f"{pid}-*/*" if pid == os.getpid() else f"{pid}-*"
    found += [str(p) for p in trials.glob(pattern)]
    return found


TRAINING_SCRIPT = """
import sys
from trl_harbor import HarborSpec
spec = HarborSpec({suite!r}, environment_type="local")
envs = [spec.environment_factory() for _ in range(8)]  # module level, as a trainer holds them
for env in envs:
    env.reset(task_dir=str(spec.task_dirs[0]))
for env in envs:
    env.bash("nohup sleep {marker} >/dev/null 2>&1 &")
print("mid-batch", flush=True)
{tail}
"""


def _run_script(tmp_path: Path, tail: str, marker: str) -> subprocess.Popen:
    script = tmp_path / "train.py"  # a file, so that the marker is not in this process's command line
    script.write_text(TRAINING_SCRIPT.format(suite=str(BUNDLED_SUITE), marker=marker, tail=tail))
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "HARBOR_TELEMETRY": "0"},
        preexec_fn=as_a_foreground_job,  # one async-signal-safe call between fork and exec
    )


def _catches(pid: int, signum: int) -> bool:
    """Whether the process ``pid`` has a handler for ``signum`` (its ``SigCgt`` mask in ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@requires_local
def test_script_ending_without_cleanup_exits_promptly_and_leaves_nothing(tmp_path: Path) -> None:
    marker = f"4321.{os.getpid()}"
    child = _run_script(tmp_path, "# and ends here, without closing anything", marker)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    assert "mid-batch" in out
    assert not live_processes_with(f"sleep {marker}")
    assert _leftovers(child.pid) == []


EXIT_WHILE_STARTING = """
import sys
from trl_harbor import HarborSpec
spec = HarborSpec({suite!r}, environment_type="local")
envs = [spec.environment_factory() for _ in range(24)]
for i, env in enumerate(envs):
    env.reset(task_dir=str(spec.task_dirs[i % len(spec.task_dirs)]))  # the starts go on in the background
print("exiting", flush=True)
sys.exit(3)  # while the batch's sandboxes are still starting
"""


@requires_local
def test_exiting_while_sandboxes_start_leaves_no_bubblewrap(tmp_path: Path) -> None:
    """A run that ends (an error, Ctrl-C) while its batch's sandboxes start leaves none of them behind."""
    from harbor_local_sandbox._lifetime import _bubblewraps

    script = tmp_path / "exit.py"
    script.write_text(EXIT_WHILE_STARTING.format(suite=str(BUNDLED_SUITE)))
    for _ in range(3):  # the exit lands at a different point of the starts each time
        child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=REPO)  # fmt: skip
        out, err = child.communicate(timeout=120)
        assert child.returncode == 3 and "exiting" in out, err[-2000:]

        def left(owner: str = f"{child.pid}-") -> list[int]:
            return [pid for pid, box in _bubblewraps() if box.startswith(owner)]

        assert wait_until(lambda: not left(), timeout=5), left()
        assert _leftovers(child.pid) == []


@requires_local
@pytest.mark.parametrize(
    ("signum", "run_in_background"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["SIGTERM", "SIGINT", "SIGINT-suite-run-in-background"],
)
def test_killing_training_mid_batch_leaves_nothing(tmp_path: Path, signum: int, run_in_background: bool) -> None:
    marker = f"{4000 + signum}.{os.getpid()}"
    tool_call = f"sleep 6{marker}"  # a long sleep no other process of this test runs
    # Blocked in a tool call when the signal comes, as a trainer would be.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if run_in_background else None
    try:  # ignoring SIGINT here, as a shell does for `pytest ... &`, and as the children then inherit
        child = _run_script(tmp_path, f'envs[0].bash("{tool_call}")', marker)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    try:
        assert child.stdout.readline().strip() == "mid-batch"
        assert len(live_processes_with(f"sleep {marker}")) == 8
        # The signal comes once the tool call's command runs, however slow the machine: the
        # training script is then blocked in the call.
        assert wait_until(lambda: live_processes_with(tool_call), timeout=60), "the tool call never started"
        assert _catches(child.pid, signum), "the training script would ignore the signal (see as_a_foreground_job)"
    except BaseException:
        child.kill()
        child.communicate()
        raise
    child.send_signal(signum)
    try:
        child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode != 0
    deadline = time.monotonic() + 10
    while (live_processes_with(f"sleep {marker}") or live_processes_with(tool_call)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_processes_with(f"sleep {marker}")
    assert not live_processes_with(tool_call)
    assert _leftovers(child.pid) == []


BLOCKED_SCRIPT = """
import asyncio, fcntl, os
from trl_harbor import runtime

async def start():  # as a sandbox start waits for an image build another process holds
    fd = os.open({lock!r}, os.O_RDWR)
    print("waiting", flush=True)
    await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)

runtime.run(start())
"""


def _waiting_for_a_lock(pid: int) -> bool:
    """Whether a thread of ``pid`` is blocked waiting for a ``flock`` (``/proc/locks`` lists it with ``->``)."""
    return any(
        "->" in line and line.split("->", 1)[1].split()[3] == str(pid)
        for line in Path("/proc/locks").read_text().splitlines()
    )


def test_ctrl_c_exits_while_a_blocking_job_waits(tmp_path: Path) -> None:
    # concurrent.futures joins its worker threads at exit, before atexit handlers run: a job of
    # asyncio.to_thread blocked until teardown would hold Ctrl-C's exit, with nothing torn down.
    lock = tmp_path / "build.lock"
    lock.touch()
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_SCRIPT.format(lock=str(lock)))
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # held until the child exits, or the test gives up
        child = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            preexec_fn=as_a_foreground_job,  # one async-signal-safe call between fork and exec
        )
        try:
            assert child.stdout.readline().strip() == "waiting", child.communicate()[1][-2000:]
            assert wait_until(lambda: _waiting_for_a_lock(child.pid), timeout=60)
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
    assert child.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]


def test_a_process_started_with_sigterm_ignored_goes_on_ignoring_it() -> None:
    # As a launcher may start it: trl-harbor's SIGTERM teardown must not turn an ignored SIGTERM
    # into every sandbox stopped under a run that goes on.
    probe = "import signal\nfrom trl_harbor import runtime\nruntime.get_loop()\nprint(repr(signal.getsignal(signal.SIGTERM)))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "HARBOR_TELEMETRY": "0"},
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == repr(signal.SIG_IGN)


@requires_local
@pytest.mark.slow
def test_a_coroutine_submitted_and_dropped_runs_to_its_end_through_a_collection() -> None:
    # release() submits the previous episode's stop and drops the future. A task waiting on a stream
    # read is held only by its reader, which the transport holds weakly: unless runtime keeps the
    # future, the cycle collector destroys the task mid-await and the sandbox is never stopped.
    import asyncio
    import gc
    import socket
    import threading

    from trl_harbor import runtime

    ours, theirs = socket.socketpair()
    read = threading.Event()

    async def read_one_line() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=theirs)
        try:
            await reader.readline()
            read.set()
        finally:
            writer.close()

    runtime.submit(read_one_line())  # the future is dropped, as release() does
    try:
        time.sleep(0.5)  # the task is now waiting on its reader
        for _ in range(3):
            gc.collect()
        ours.sendall(b"answer\n")
        assert read.wait(timeout=10), "the submitted coroutine was destroyed before it read its answer"
    finally:
        ours.close()


@requires_local
def test_256_concurrent_sandboxes_complete_a_batch(tmp_path: Path) -> None:
    spec = HarborSpec(BUNDLED_SUITE, environment_type="local", options=HarborOptions(max_concurrent_starts=None))
    gold = {t.path.name: t.metadata["gold_answer"] for t in spec.tasks}
    envs = [spec.environment_factory() for _ in range(256)]
    dirs = [spec.task_dirs[i % len(spec.task_dirs)] for i in range(256)]
    for env, task_dir in zip(envs, dirs, strict=True):
        env.reset(task_dir=str(task_dir))
    for i, (env, task_dir) in enumerate(zip(envs, dirs, strict=True)):
        answer = gold[task_dir.name] if i % 4 else "wrong"
        assert env.bash(f"printf %s '{answer}' > /workdir/answer.txt && echo ok").strip() == "ok"
    reward_func = spec.reward_funcs
    rewards = reward_func(completions=[None] * 256, environments=envs)
    assert rewards == [0.0 if i % 4 == 0 else 1.0 for i in range(256)]
    close_all()
    assert _leftovers(os.getpid()) == []
