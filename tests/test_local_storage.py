"""Storage bounds of the local sandbox, with and without root (issue #13), on real sandboxes.

A sandbox's writable tree lives on the host's ``/dev/shm``: each file is bounded by ``RLIMIT_FSIZE``
and the total by the host-side storage guard (``trl_harbor.sandboxes._storage``), which also keeps
a reserve of free space for the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import pytest

from sandbox_helpers import NOBODY, make_task, open_env, run, run_unprivileged, unprivileged_test, wait_until
from trl_harbor.sandboxes import _storage
from trl_harbor.sandboxes.local import SandboxCommandError

BOUND_MB = 64


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path / "tasks")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes on task images need root")


@pytest.fixture(
    params=[("host", "c"), ("host", "python"), pytest.param(("image", "c"), marks=needs_root)],
    ids=["host-c", "host-python", "image"],
)
def root(request, monkeypatch) -> str:
    """The sandbox's root, with the compiled supervisor and (host root) its Python fallback."""
    from trl_harbor.sandboxes import _binaries

    kind, supervisor = request.param
    if supervisor == "python":
        monkeypatch.setenv("TRL_HARBOR_SUPERVISOR", "python")
    _binaries.supervisor_binary.cache_clear()
    yield kind
    _binaries.supervisor_binary.cache_clear()


def test_one_file_stops_at_the_bound_and_the_sandbox_lives(task: Path, tmp_path: Path, root: str) -> None:
    async def scenario():
        env = open_env(task, tmp_path, default_storage_mb=BOUND_MB, root=root)
        await env.start(force_build=False)
        try:
            big = await env.exec("dd if=/dev/zero of=/workdir/big bs=1M count=100")
            assert big.return_code != 0, big
            assert "File too large" in big.stderr, big.stderr
            size = await env.exec("stat -c %s /workdir/big")
            assert int(size.stdout) == BOUND_MB << 20
            # At its bound, not past it: the guard leaves the sandbox alone.
            await asyncio.sleep(3 * _storage.POLL_SEC)
            alive = await env.exec("rm /workdir/big && echo alive")
            assert alive.stdout.strip() == "alive"
            assert await env.resource_exhaustion() is None
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_deleted_files_still_held_open_count(task: Path, tmp_path: Path) -> None:
    # A file deleted while a process keeps it open still fills the file system; the tree no longer shows it.
    async def scenario():
        env = open_env(task, tmp_path, default_storage_mb=BOUND_MB, root="host")
        await env.start(force_build=False)
        try:
            held = await env.exec(
                "for i in 1 2; do (exec 3>/workdir/held$i; head -c 25M /dev/zero >&3; rm /workdir/held$i;"
                " exec sleep 60) >/dev/null 2>&1 & done; sleep 0.5; ls /workdir"
            )
            assert "held" not in held.stdout
            await asyncio.sleep(10 * _storage.POLL_SEC)
            assert (await env.exec("echo alive")).stdout.strip() == "alive"  # 50 MB: under the bound
            with pytest.raises(SandboxCommandError):
                await env.exec("head -c 20M /dev/zero > /workdir/more; sleep 10")
            reason = await env.resource_exhaustion()
            assert reason is not None and reason.startswith("its storage limit: wrote "), reason
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_dev_is_read_only_and_dev_shm_is_bounded(task: Path, tmp_path: Path) -> None:
    # bubblewrap's /dev is a tmpfs of its own: writable, it would hold files outside every bound.
    async def scenario():
        env = open_env(task, tmp_path, default_storage_mb=1024, root="host")
        await env.start(force_build=False)
        try:
            dev = await env.exec("touch /dev/planted")
            assert dev.return_code != 0 and "Read-only file system" in dev.stderr, dev
            shm = await env.exec("head -c 100M /dev/zero > /dev/shm/big; echo rc=$?; stat -c %s /dev/shm/big")
            assert "No space left on device" in shm.stderr, shm
            assert int(shm.stdout.split()[-1]) == 64 << 20
            assert (await env.exec("rm /dev/shm/big && echo ok")).stdout.strip() == "ok"
        finally:
            await env.stop(delete=True)

    run(scenario())


@pytest.mark.parametrize("root", ["host", pytest.param("image", marks=needs_root)])
def test_many_files_past_the_bound_kill_that_sandbox_alone(task: Path, tmp_path: Path, root: str) -> None:
    async def scenario():
        hog = open_env(task, tmp_path, default_storage_mb=BOUND_MB, root=root)
        neighbour = open_env(task, tmp_path, default_storage_mb=BOUND_MB, root=root)
        await asyncio.gather(hog.start(force_build=False), neighbour.start(force_build=False))
        hog_tree = hog._sandbox.dir
        filling = True

        async def fill() -> None:
            nonlocal filling
            try:
                with pytest.raises(SandboxCommandError):
                    # 1 MB files, 5 x the bound: none of them runs into RLIMIT_FSIZE.
                    await hog.exec(
                        f"mkdir /workdir/fill; for i in $(seq {5 * BOUND_MB}); do "
                        "head -c 1M /dev/zero > /workdir/fill/$i || exit 1; done; echo filled"
                    )
            finally:
                filling = False

        async def work() -> int:
            answers = 0
            while filling:
                result = await neighbour.exec("head -c 100K /dev/zero > /tmp/scratch && echo ok")
                assert result.stdout.strip() == "ok"
                answers += 1
            return answers

        try:
            _, answers = await asyncio.gather(fill(), work())
            assert answers > 0
            reason = await hog.resource_exhaustion()
            assert reason is not None and reason.startswith("its storage limit: wrote "), reason
            assert reason.endswith(f"(limit {BOUND_MB} MB)"), reason
            # Its tree is removed by the guard as the sandbox dies: the space goes back to the host.
            assert wait_until(lambda: not hog_tree.exists()), "the killed sandbox's tree was not removed"
            after = await neighbour.exec("echo still-here")
            assert after.stdout.strip() == "still-here"
            assert await neighbour.resource_exhaustion() is None
        finally:
            await asyncio.gather(hog.stop(delete=True), neighbour.stop(delete=True))

    run(scenario())


# Run as an unprivileged user (no cgroups, no root) on a small tmpfs standing in for /dev/shm.
_UNPRIVILEGED_SCRIPT = textwrap.dedent(
    """\
    import asyncio, json, os, sys, threading, time
    from pathlib import Path

    sys.path.insert(0, sys.argv[2])
    from sandbox_helpers import make_task, open_env
    from trl_harbor.sandboxes import _storage
    from trl_harbor.sandboxes.local import SandboxCommandError

    work, state = Path(sys.argv[1]), os.environ["TRL_HARBOR_STATE_DIR"]
    lowest = [float("inf")]
    sampling = True

    def sample():
        while sampling:
            info = os.statvfs(state)
            lowest[0] = min(lowest[0], info.f_bavail * info.f_frsize)
            time.sleep(0.001)

    async def fill(storage_mb, files, name):
        # The host root: what runs without root (task images need it for now).
        env = open_env(make_task(work / name), work, default_storage_mb=storage_mb, root="host")
        await env.start(force_build=False)
        killed = False
        try:
            # Goes on past errors (ENOSPC), then waits: only the guard can end it early.
            await env.exec(
                f"mkdir /workdir/fill; for i in $(seq {files}); do head -c 1M /dev/zero > /workdir/fill/$i; done;"
                " sleep 5", timeout_sec=60
            )
        except SandboxCommandError:
            killed = True
        reason = await env.resource_exhaustion()
        await env.stop(delete=True)
        return killed, reason

    async def main():
        global sampling
        total = os.statvfs(state).f_blocks * os.statvfs(state).f_frsize
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        per_box = await fill(64, int(total * 0.95) >> 20, "per-box")
        sampling = False
        thread.join()
        floor_per_box = lowest[0]
        reserve_kill = await fill(4096, int(total * 0.95) >> 20, "reserve")
        info = os.statvfs(state)
        print(json.dumps({
            "uid": os.geteuid(), "reserve": _storage.host_reserve(total), "lowest_free": floor_per_box,
            "per_box": per_box, "reserve_kill": reserve_kill, "free_after": info.f_bavail * info.f_frsize,
            "total": total,
        }))

    asyncio.run(main())
    """
)


@unprivileged_test
def test_without_root_a_filled_sandbox_is_killed_and_the_host_keeps_its_reserve() -> None:
    done = run_unprivileged(_UNPRIVILEGED_SCRIPT, state_mb=256)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["uid"] == NOBODY
    killed, reason = found["per_box"]
    assert killed, f"the sandbox filled the file system unchecked ({found})"
    assert reason.startswith("its storage limit: wrote ") and reason.endswith("(limit 64 MB)"), reason
    assert found["lowest_free"] >= found["reserve"], found
    killed, reason = found["reserve_kill"]
    assert killed, f"a sandbox under its own bound filled the host's reserve unchecked ({found})"
    assert reason.startswith("the host's storage reserve: wrote "), reason
    assert found["free_after"] >= found["total"] * 0.9, found
