"""Nothing left behind when a process ends: every sandbox's mounts and folder gone, under any timing.

Two ways tear a sandbox down: its environment's stop (on the shared loop's thread: ``Box.kill``, then
the tree removed) and the package's exit hook (``Box.kill_now`` on the main thread, for every
box still alive). An environment dropped by its user is stopped in the background, so at exit both can
be under way for the same box; the stop that found the other one started used to return at once and
remove the tree while the other was still detaching its mounts (``EBUSY`` on ``rootfs``). One teardown owns
a box now and the others wait for it; the exit hook also removes whatever of the process's own is still in
the state root, found by its name. Here: the two teardowns of one box, and Harbor's own ``harbor run -n 8``
beside CPU load, each run with its own state folder.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest
from sandbox_testing import (  # noqa: F401 - task_base_image: the session fixture
    make_task,
    open_env,
    run,
    runs_leave_nothing,
    task_base_image,
)

pytestmark = [pytest.mark.local, pytest.mark.slow, pytest.mark.usefixtures("task_base_image")]


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


def test_harbor_run_leaves_nothing(tmp_path: Path) -> None:
    """Harbor's own ``harbor run -n 8`` with the local sandbox on a suite of 8 tasks, beside CPU load."""
    suite = tmp_path / "suite"
    for index in range(8):
        make_task(suite, f"task-{index}", gold=str(40 + index))
    harbor = Path(sys.executable).parent / "harbor"
    command = [
        str(harbor), "run", "-p", str(suite), "-a", "oracle", "-n", "8",
        "-e", "harbor_local_sandbox.local:LocalEnvironment", "-o", str(tmp_path / "jobs"), "-y",
    ]  # fmt: skip
    runs_leave_nothing(tmp_path, 2, command, "harbor")
