"""Storage bounds of the local sandbox (issues #13 and #17), on real sandboxes.

A sandbox's writable tree is a tmpfs of its own (mounted by root, or without root by this user's
holder), whose size and inode count the kernel bounds (the task's ``storage_mb``): a write past it
fails with ``ENOSPC`` and the sandbox lives on, as a full disk does under Docker, and a sparse file
costs only what it holds.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from harbor_local_sandbox._mounts import inode_bound
from sandbox_testing import make_task, open_env, run, task_base_image  # noqa: F401 - the session fixture

#: Every test here starts a local sandbox (bubblewrap).
pytestmark = [pytest.mark.local, pytest.mark.usefixtures("task_base_image")]

BOUND_MB = 64


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path / "tasks")


def test_writes_stop_at_the_bound_the_sandbox_lives_and_sparse_files_are_free(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = open_env(task, tmp_path, default_storage_mb=BOUND_MB)
        await env.start(force_build=False)
        try:
            big = await env.exec("dd if=/dev/zero of=/workdir/big bs=1M count=100")
            assert big.return_code != 0 and "No space left on device" in big.stderr, big
            size = int((await env.exec("stat -c %s /workdir/big")).stdout)
            assert BOUND_MB - 8 << 20 <= size <= BOUND_MB << 20, size  # the kernel's bound, not a poll's
            more = await env.exec("head -c 10M /dev/zero > /tmp/more")
            assert more.return_code != 0 and "No space left on device" in more.stderr, more  # /tmp too
            alive = await env.exec("rm /workdir/big /tmp/more && echo alive")
            assert alive.stdout.strip() == "alive" and await env.resource_exhaustion() is None
            # As under Docker: the apparent size of a sparse file is not bounded, the space it uses is.
            sparse = await env.exec("truncate -s 12G /workdir/sparse && stat -c %s /workdir/sparse")
            assert sparse.return_code == 0 and int(sparse.stdout) == 12 << 30, sparse
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_files_deleted_but_held_open_and_inodes_count(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = open_env(task, tmp_path, default_storage_mb=BOUND_MB)
        await env.start(force_build=False)
        try:
            held = await env.exec(
                "for i in 1 2; do (exec 3>/workdir/held$i; head -c 25M /dev/zero >&3; rm /workdir/held$i;"
                " exec sleep 60) >/dev/null 2>&1 & done; sleep 0.5; ls /workdir"
            )
            assert "held" not in held.stdout
            more = await env.exec("head -c 20M /dev/zero > /workdir/more")
            assert more.return_code != 0 and "No space left on device" in more.stderr, more
            # Inodes are bounded too: a sandbox cannot empty the host's inode table.
            files = inode_bound(BOUND_MB) + 100
            made = await env.exec(f"mkdir /workdir/many && cd /workdir/many && seq {files} | xargs touch; ls | wc -l")
            assert "No space left on device" in made.stderr, made.stderr[-300:]
            assert int(made.stdout.split()[-1]) < files
            assert (await env.exec("rm -rf /workdir/many && echo alive")).stdout.strip() == "alive"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_dev_is_read_only_and_dev_shm_is_bounded(task: Path, tmp_path: Path) -> None:
    # bubblewrap's /dev is a tmpfs of its own: writable, it would hold files outside every bound.
    async def scenario():
        env = open_env(task, tmp_path, default_storage_mb=1024)
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


def test_a_full_sandbox_leaves_its_neighbour_and_the_host_alone(task: Path, tmp_path: Path) -> None:
    async def scenario():
        hog = open_env(task, tmp_path, default_storage_mb=BOUND_MB)
        neighbour = open_env(task, tmp_path, default_storage_mb=BOUND_MB)
        await asyncio.gather(hog.start(force_build=False), neighbour.start(force_build=False))
        shm_before = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        try:
            filled = await hog.exec(
                f"mkdir /workdir/fill; for i in $(seq {5 * BOUND_MB}); do "
                "head -c 1M /dev/zero > /workdir/fill/$i || break; done; ls /workdir/fill | wc -l"
            )
            assert int(filled.stdout.split()[-1]) <= BOUND_MB + 1, filled
            shm_after = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
            assert shm_before - shm_after < 2 * BOUND_MB << 20  # the host's /dev/shm lost at most the bound
            work = await neighbour.exec("head -c 30M /dev/zero > /tmp/scratch && echo ok")
            assert work.stdout.strip() == "ok" and await neighbour.resource_exhaustion() is None
            assert (await hog.exec("echo still-here")).stdout.strip() == "still-here"
        finally:
            await asyncio.gather(hog.stop(delete=True), neighbour.stop(delete=True))

    run(scenario())
