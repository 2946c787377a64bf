"""Nothing left behind when a process ends (issue #49): every sandbox's mounts and folder gone, under any timing.

Two ways tear a sandbox down: its environment's stop (on the shared loop's thread: ``Box.kill``, then
the tree removed) and the sandbox package's exit hook (``Box.kill_now`` on the main thread, for every
box still alive). An environment dropped by its user is stopped in the background, so at exit both can
be under way for the same box; the stop that found the other one started used to return at once and
remove the tree while the other was still detaching its mounts (``EBUSY`` on ``rootfs``, in about a run
of three of the flow below). One teardown owns a box now and the others wait for it; the exit hook also
removes whatever of the process's own is still in the state root, found by its name.

Measured: on the code before, the flow's stop failed so in 8 of 12 runs beside CPU load, and the
flow test (8 runs) failed in 1 of 2 attempts with 4 runs each; after, 0 of 12 and 0 of 4 attempts.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sandbox_helpers import make_task, open_env, run

pytestmark = [pytest.mark.local, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "tasks" / "building_b_humidity"

#: The issue's flow: 16 environments reset together, a call each, graded as a batch; the same 16 reset
#: again one after another (each reset stops its last sandbox in the background), a call, ``env.reward``;
#: then the script returns, its environments dropped.
FLOW = textwrap.dedent(
    """
    import sys
    from trl_harbor import HarborSpec

    def main():
        spec = HarborSpec(sys.argv[1], agent="bash", environment_type="local", preflight=False)
        row = next(r for r in spec.train_dataset if r["task_dir"].endswith("building_b_humidity"))
        envs = [spec.environment_factory() for _ in range(16)]
        for env in envs:
            env.reset(**row)
        for env in envs:
            env.bash("echo 51.46 > /workdir/answer.txt")
        assert spec.reward_funcs(environments=envs, prompts=[None] * 16, completions=[None] * 16) == [1.0] * 16
        for env in envs:
            env.reset(**row)
            env.bash("echo 51.46 > /workdir/answer.txt")
            assert env.reward == 1.0

    main()
    """
)


def _left(state: Path) -> tuple[list[str], list[str]]:
    """The mounts at or below ``state`` and its sandbox folders (the view workers' socket folder aside)."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return (
        [m for m in mounts if m == str(state) or m.startswith(f"{state}/")],
        sorted(p.name for p in state.iterdir() if p.name != "workers"),
    )


def test_a_second_teardown_waits_for_the_first(tmp_path: Path) -> None:
    """While one teardown of a box detaches its mounts (held here), another caller of ``kill`` does not
    return — its caller would remove the tree under the first's feet — until the first is done."""
    env = open_env(make_task(tmp_path / "tasks", gold="42"), tmp_path)
    detaching, go_on = threading.Event(), threading.Event()

    async def scenario() -> float:
        await env.start(force_build=False)
        box = env._sandbox.box
        assert box is not None
        unmount = box.unmount

        def slow_unmount() -> None:
            detaching.set()
            go_on.wait(30)
            unmount()

        box.unmount = slow_unmount  # type: ignore[method-assign]
        first = threading.Thread(target=box.kill_now)  # the exit hook's teardown, in another thread
        first.start()
        assert await asyncio.to_thread(detaching.wait, 30)
        threading.Timer(1.0, go_on.set).start()
        started = time.monotonic()
        await box.kill()
        waited = time.monotonic() - started
        await asyncio.to_thread(first.join, 30)
        assert not box.mounts
        await env.stop(delete=True)
        return waited

    waited = run(scenario())
    assert waited >= 0.9, f"kill() returned after {waited:.2f} s, while the other teardown still held the mounts"


def _busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _check_runs(tmp_path: Path, runs: int, command: list[str], name: str) -> None:
    load = _busy_loops(2)
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
            mounts, folders = _left(state)
            assert not mounts and not folders, f"run {index} left mounts {mounts} and folders {folders}"
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


def test_the_issues_flow_leaves_nothing_beside_cpu_load(tmp_path: Path) -> None:
    """The issue's script, run in fresh processes beside two busy loops, each with its own state folder:
    no mount and no sandbox folder is left after any of them exits, and no stop fails on the way."""
    script = tmp_path / "flow.py"
    script.write_text(FLOW)
    _check_runs(tmp_path, 8, [sys.executable, str(script), str(ROOT / "examples" / "tasks")], "flow")


def test_harbor_run_leaves_nothing(tmp_path: Path) -> None:
    """Harbor's own ``harbor run -n 8`` with the local sandbox on the bundled suite, beside CPU load."""
    harbor = Path(sys.executable).parent / "harbor"
    command = [
        str(harbor), "run", "-p", str(ROOT / "examples" / "tasks"), "-a", "oracle", "-n", "8",
        "-e", "harbor_local_sandbox.local:LocalEnvironment", "-o", str(tmp_path / "jobs"), "-y",
    ]  # fmt: skip
    _check_runs(tmp_path, 2, command, "harbor")
