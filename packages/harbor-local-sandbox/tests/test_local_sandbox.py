"""The local bubblewrap sandbox: container semantics, limits and teardown, on real sandboxes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harbor_local_sandbox._lifetime import state_root, sweep_stale
from harbor_local_sandbox.local import SandboxCommandError, SandboxTimeoutError
from sandbox_testing import (  # noqa: F401 - task_base_image: the session fixture
    count_processes_cmd,
    live_processes_with,
    make_task,
    open_env,
    run,
    task_base_image,
    wait_until,
)

#: Every test here starts a local sandbox (bubblewrap).
pytestmark = [pytest.mark.local, pytest.mark.usefixtures("task_base_image")]


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path / "tasks")


def test_exec_runs_commands_with_cwd_env_and_exit_code(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            pwd = await env.exec("pwd")
            assert pwd.stdout.strip() == "/workdir" and pwd.return_code == 0
            custom = await env.exec('echo "$GREETING" >&2; exit 3', cwd="/tmp", env={"GREETING": "hi"})
            assert custom.stderr.strip() == "hi" and custom.return_code == 3
            whoami = await env.exec("id -u; echo $HOME")
            assert whoami.stdout.split() == ["0", "/root"]
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_a_state_folder_deeper_than_a_unix_socket_path_allows(task: Path, tmp_path: Path, monkeypatch) -> None:
    """A unix socket's path has at most 107 bytes; the supervisor's lives in the sandbox's state folder,
    which a deep ``HARBOR_LOCAL_SANDBOX_STATE_DIR`` (a CI's workspace, a pytest tmp folder) makes longer."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("HARBOR_LOCAL_SANDBOX_STATE_DIR", str(deep))

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            assert (await env.exec("echo ok")).stdout.strip() == "ok"
        finally:
            await env.stop(delete=True)

    run(scenario())
    assert not list(deep.iterdir())


def test_background_process_survives_between_execs(task: Path, tmp_path: Path) -> None:
    marker = f"sleep 3{os.getpid() % 1000}.5"

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            started = await env.exec(f"nohup {marker} >/dev/null 2>&1 & echo started")
            assert started.stdout.strip() == "started"
            # A server started in the background answers the next exec.
            await env.exec(
                "python3 -c \"import http.server as h; h.HTTPServer(('127.0.0.1', 8765), "
                'h.SimpleHTTPRequestHandler).serve_forever()" >/tmp/server.log 2>&1 &'
            )
            probe = await env.exec(
                'for i in $(seq 50); do python3 -c "import urllib.request as u; '
                "print(u.urlopen('http://127.0.0.1:8765/').status)\" 2>/dev/null && break; sleep 0.1; done"
            )
            assert probe.stdout.strip() == "200"
            alive = await env.exec(count_processes_cmd(marker))
            assert int(alive.stdout) >= 1, alive
            assert live_processes_with(marker)
        finally:
            await env.stop(delete=True)
        assert wait_until(lambda: not live_processes_with(marker))

    run(scenario())


def test_timeout_kills_whole_process_tree(task: Path, tmp_path: Path) -> None:
    marker = "sleep 7777.25"

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            started = time.monotonic()
            with pytest.raises(SandboxTimeoutError):
                # A child, a grandchild and a daemon that escaped with setsid.
                await env.exec(f"({marker} &) ; setsid {marker} & {marker}", timeout_sec=1)
            assert time.monotonic() - started < 5
            left = await env.exec(count_processes_cmd(marker))
            assert int(left.stdout) == 0, left
            assert (await env.exec("echo still usable")).stdout.strip() == "still usable"
        finally:
            await env.stop(delete=True)

    run(scenario())
    assert not live_processes_with(marker)


def test_cancelled_exec_kills_its_tree(task: Path, tmp_path: Path) -> None:
    marker = "sleep 6666.5"

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            job = asyncio.ensure_future(env.exec(f"{marker}"))
            assert await asyncio.to_thread(wait_until, lambda: bool(live_processes_with(marker)))
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job
            assert await asyncio.to_thread(wait_until, lambda: not live_processes_with(marker))
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_output_flood_is_bounded(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = open_env(task, tmp_path, output_cap_bytes=64 * 1024)
        await env.start(force_build=False)
        try:
            result = await env.exec("yes | head -c 2G; echo done", timeout_sec=120)
            assert result.return_code == 0
            assert len(result.stdout) < 70 * 1024
            assert "bytes omitted ...]" in result.stdout
            assert result.stdout.rstrip().endswith("done")  # the tail is kept
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_fork_bomb_is_contained(task: Path, tmp_path: Path) -> None:
    async def scenario():
        bomb = open_env(task, tmp_path, pids_max=64)
        bystander = open_env(task, tmp_path)
        await asyncio.gather(bomb.start(force_build=False), bystander.start(force_build=False))
        try:
            with pytest.raises(SandboxTimeoutError):
                await bomb.exec("bomb() { bomb | bomb & }; bomb; sleep 100", timeout_sec=3)
            assert (await bystander.exec("echo ok")).stdout.strip() == "ok"
            assert (await bomb.exec("echo recovered", timeout_sec=30)).stdout.strip() == "recovered"
        finally:
            await asyncio.gather(bomb.stop(delete=True), bystander.stop(delete=True))

    run(scenario())
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


_SPAWN = (
    'python3 -c "import subprocess\nps = []\nfor i in range(200):\n'
    "    try: ps.append(subprocess.Popen(['sleep', '30']))\n    except OSError: break\nprint(len(ps))\""
)


def test_a_sandbox_has_its_own_process_limit(task: Path, tmp_path: Path) -> None:
    """``pids_max`` holds per sandbox: its pids cgroup as root; without root (the repository's ``tests/test_rootless.py``
    runs this too) RLIMIT_NPROC, which Linux counts per user namespace, i.e. per sandbox."""

    async def scenario():
        bounded = open_env(task, tmp_path, pids_max=64)
        bystander = open_env(task, tmp_path)
        await asyncio.gather(bounded.start(force_build=False), bystander.start(force_build=False))
        try:
            started = int((await bounded.exec(_SPAWN, timeout_sec=60)).stdout)
            others = int((await bystander.exec(_SPAWN, timeout_sec=60)).stdout)
            full = await bounded.exec("echo alive", timeout_sec=30)  # its sleeps still hold the limit
            await bounded.kill_processes()
            for _ in range(100):  # killed processes count until the kernel has released them
                again = (await bounded.exec("echo alive", timeout_sec=30)).stdout.strip()
                if again:
                    break
                await asyncio.sleep(0.1)
        finally:
            await asyncio.gather(bounded.stop(delete=True), bystander.stop(delete=True))
        return started, others, full, again

    started, others, full, again = run(scenario())
    assert 0 < started < 64, started  # the bounded sandbox stops at its limit
    assert others == 200, others  # another sandbox is not charged for it
    # No room for one more process: the command fails, and says why.
    assert full.return_code == 126 and "process limit" in (full.stdout or "") + (full.stderr or ""), full
    assert again == "alive", again  # room again once its processes are gone


def test_memory_hog_is_contained(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = open_env(task, tmp_path)  # the task asks for 512 MB
        await env.start(force_build=False)
        try:
            hog = await env.exec(
                'python3 -c "b = []\nwhile True: b.append(bytearray(64 * 1024 * 1024))"', timeout_sec=60
            )
            assert hog.return_code != 0
            assert (await env.exec("echo alive")).stdout.strip() == "alive"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_stop_leaves_no_process_directory_or_cgroup(task: Path, tmp_path: Path) -> None:
    marker = "sleep 5555.75"

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        box_dir = env._sandbox.dir
        await env.exec(f"setsid nohup {marker} >/dev/null 2>&1 & ( {marker} & ) ; echo ok")
        assert len(live_processes_with(marker)) == 2
        await env.stop(delete=True)
        return box_dir

    box_dir = run(scenario())
    assert wait_until(lambda: not live_processes_with(marker))
    assert not box_dir.exists()
    assert not [p for p in Path("/sys/fs/cgroup").glob(f"*/harbor-local-sandbox/{box_dir.name}")]


def test_sandboxes_die_with_their_parent_process(task: Path, tmp_path: Path) -> None:
    marker = "sleep 4444.5"
    script = textwrap.dedent(
        f"""\
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from sandbox_testing import open_env
        from pathlib import Path
        async def main():
            env = open_env(Path({str(task)!r}), Path({str(tmp_path)!r}))
            await env.start(force_build=False)
            await env.exec("nohup {marker} >/dev/null 2>&1 &")
            print(env._sandbox.dir, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    box_dir = Path(child.stdout.readline().strip())
    assert wait_until(lambda: bool(live_processes_with(marker)))
    child.send_signal(signal.SIGKILL)  # no cleanup code can run
    child.wait()
    assert wait_until(lambda: not live_processes_with(marker)), "sandbox outlived its parent"
    # What the dead process left on disk is swept by the next process that starts a sandbox.
    assert box_dir.exists()
    sweep_stale()
    assert not box_dir.exists()
    assert not [p for p in Path("/sys/fs/cgroup").glob(f"*/harbor-local-sandbox/{box_dir.name}")]


def test_many_sandboxes_start_concurrently(task: Path, tmp_path: Path) -> None:
    async def scenario():
        envs = [open_env(task, tmp_path) for _ in range(64)]
        await asyncio.gather(*(e.start(force_build=False) for e in envs))
        try:
            results = await asyncio.gather(*(e.exec("echo $((6 * 7))") for e in envs))
            assert [r.stdout.strip() for r in results] == ["42"] * 64
        finally:
            await asyncio.gather(*(e.stop(delete=True) for e in envs))

    run(scenario())
    assert not [p for p in state_root().iterdir() if p.name.startswith(f"{os.getpid()}-")]


# ── what the verifier can trust (issue #12) ────────────────────────────────────────────


def test_kill_processes_stops_every_detached_process_and_keeps_the_sandbox(task: Path, tmp_path: Path) -> None:
    """Daemons in their own session, double forks and SIGTERM-ignoring loops all die; the sandbox lives."""
    tag = f"{os.getpid() % 1000}"
    detached = {
        "nohup": f"nohup sleep 41{tag}.1 >/dev/null 2>&1 &",
        "setsid double fork": f"setsid sh -c '(sleep 41{tag}.2 &) ; exit' >/dev/null 2>&1",
        "ignores SIGTERM": f"sh -c 'trap \"\" TERM; while :; do sleep 41{tag}.3; done' >/dev/null 2>&1 &",
    }

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            # A service that was there before the agent (an ENTRYPOINT's, say) is kept.
            assert (await env.exec(f"nohup sleep 41{tag}.9 >/dev/null 2>&1 &")).return_code == 0
            assert wait_until(lambda: live_processes_with(f"41{tag}.9"))
            baseline = await env.list_processes()
            assert baseline and all(":" in entry for entry in baseline)
            for command in detached.values():
                assert (await env.exec(command)).return_code == 0
            assert wait_until(lambda: all(live_processes_with(f"41{tag}.{i}") for i in (1, 2, 3)))
            killed = await env.kill_processes(keep=baseline)
            assert killed >= 3
            assert wait_until(lambda: not any(live_processes_with(f"41{tag}.{i}") for i in (1, 2, 3)))
            assert live_processes_with(f"41{tag}.9")
            assert (await env.exec("echo still here")).stdout.strip() == "still here"
            await env.kill_processes()
            assert wait_until(lambda: not live_processes_with(f"41{tag}.9"))
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_agent_cannot_kill_the_supervisor_mount_or_trace(task: Path, tmp_path: Path) -> None:
    """`kill -9 -1`, mounting over /tests and ptrace are refused: the sandbox keeps answering."""

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            try:  # kills the command's own handler, so this one command may get no answer
                await env.exec("kill -9 -1; kill -9 1; true")
            except SandboxCommandError:
                pass
            assert (await env.exec("echo alive")).stdout.strip() == "alive"
            mounted = await env.exec("mkdir -p /tests && mount -t tmpfs fake /tests")
            assert mounted.return_code != 0
            caps = await env.exec("grep CapEff /proc/self/status")
            effective = int(caps.stdout.split()[1], 16)
            for bit in (21, 19, 9, 24):  # CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_LINUX_IMMUTABLE, CAP_SYS_RESOURCE
                assert not effective & (1 << bit), caps.stdout
            assert (await env.exec("unshare -U true")).return_code != 0  # no nested user namespaces
            # The keel set the box's limit to 0 as it started; nothing in the box may raise it again.
            knob = "/proc/sys/user/max_user_namespaces"
            raised = await env.exec(
                f"echo 10 > {knob} || mount -t proc proc /mnt && echo 10 > /mnt/sys/user/max_user_namespaces"
            )
            assert raised.return_code != 0
            assert (await env.exec(f"cat {knob}")).stdout.strip() == "0"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_file_fingerprints_are_read_from_the_host_and_see_changes(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            await env.exec("mkdir -p /root/.config && echo a > /root/.bashrc")
            watched = [("/root", None), ("/usr/bin", 1), ("/home/*", None)]
            before = await env.file_fingerprints(watched)
            assert before["/root/.bashrc"].startswith("f|") and before["/root"].startswith("d|")
            assert "/usr/bin/env" in before and not any(p.startswith("/usr/bin/x/") for p in before)
            await env.exec("echo b > /root/.bashrc; touch /root/new")
            after = await env.file_fingerprints(watched)
            assert before["/root/.bashrc"] != after["/root/.bashrc"]
            assert "/root/new" in after and "/root/new" not in before
            assert before["/usr/bin/env"] == after["/usr/bin/env"]
        finally:
            await env.stop(delete=True)

    run(scenario())


def _slirp_processes() -> set[int]:
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                dead = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
                if not dead and Path(f"/proc/{name}/comm").read_text().strip() == "slirp4netns":
                    found.add(int(name))
            except OSError:
                pass
    return found


def test_a_killed_owner_leaves_no_user_network_behind(tmp_path: Path) -> None:
    """SIGKILL of the process holding network-enabled sandboxes: their slirp4netns exit with it."""
    task = make_task(tmp_path / "tasks", name="net", network_mode="public")
    before = _slirp_processes()
    script = textwrap.dedent(
        f"""
        import asyncio, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from sandbox_testing import open_env

        async def main():
            envs = [open_env(Path({str(task)!r}), Path({str(tmp_path)!r})) for _ in range(3)]
            for env in envs:
                await env.start(force_build=False)
            print("up", flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        started = _slirp_processes() - before
        assert len(started) == 3
    finally:
        child.kill()
        child.wait(timeout=30)
    assert wait_until(lambda: not (_slirp_processes() & started), timeout=10), _slirp_processes() & started


def test_the_sweep_kills_a_bubblewrap_left_holding_a_dead_owners_box(tmp_path: Path) -> None:
    """A bubblewrap process whose owner died (e.g. killed mid-start) is killed by the next run's sweep."""
    from harbor_local_sandbox._binaries import bwrap_path

    gone = subprocess.Popen(["true"])
    gone.wait()  # a process that has exited: the box's owner
    box = state_root() / f"{gone.pid}-stale-box"
    (box / "rootfs").mkdir(parents=True)
    stuck = subprocess.Popen(
        [
            bwrap_path(),
            "--ro-bind",
            "/",
            "/",
            "--bind",
            str(box / "rootfs"),
            "/mnt",
            "--die-with-parent",
            "sleep",
            "600",
        ]
    )
    try:
        # Up: bubblewrap has set up its mounts and runs its command.
        assert wait_until(lambda: Path(f"/proc/{stuck.pid}/task/{stuck.pid}/children").read_text().strip() != "")
        sweep_stale()
        assert stuck.wait(timeout=10) != 0
        assert not box.exists()
    finally:
        if stuck.poll() is None:
            stuck.kill()
            stuck.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups (and so parked launchers) need root")
def test_a_later_start_runs_from_a_launcher_parked_in_its_cgroups(task: Path, tmp_path: Path) -> None:
    """Once a box is up, a launcher is parked in fresh cgroups; the next box's bubblewrap is that process,
    with the box's limits on those cgroups (no move, so no wait for the kernel); close_all-time release."""
    from harbor_local_sandbox import _box
    from harbor_local_sandbox._cgroups import ROOT
    from harbor_local_sandbox.local import release_parked

    def in_agent_leaf(cgroup: str) -> bool:
        """Whether a process of the agent is in the agent's leaf in every limiting controller (the keel
        writes the agent's supervisor there as it forks it). The path is relative to the box's cgroup
        namespace: rooted at the keel's leaf from a parked launcher, at the host's root otherwise."""
        lines = {line.split(":")[1]: line.split(":")[2] for line in cgroup.splitlines() if line.count(":") >= 2}
        limiting = [name for name in lines if {"memory", "pids", "cpu"} & set(name.split(","))]
        return len(limiting) == 3 and all(lines[name].endswith("/agent") for name in limiting)

    async def scenario():
        first = open_env(task, tmp_path)
        await first.start(force_build=False)  # from no parked launcher: it joins the cgroups itself
        assert in_agent_leaf((await first.exec("cat /proc/self/cgroup")).stdout)
        box = first._sandbox.running_box()
        for pid in (box._proc.pid, box.init_pid):  # bubblewrap and the keel, in the keel's leaf of each
            assert Path(f"/proc/{pid}/cgroup").read_text().count(f"/harbor-local-sandbox/{box.name}/keel\n") == 3
        second = open_env(task, tmp_path)
        try:
            for _ in range(500):
                if _box._PARKED is not None:
                    break
                await asyncio.sleep(0.01)
            parked = _box._PARKED
            assert parked is not None, "no launcher was parked after a start"
            launcher_pid, group = parked.proc.pid, parked.cgroups.name
            await second.start(force_build=False)
            box = second._sandbox.running_box()
            assert box._proc.pid == launcher_pid  # the parked launcher became this box's bubblewrap
            memory = ROOT / "memory" / "harbor-local-sandbox" / group
            # The agent's leaf has the task's limit; the box (its keel, a verifier) as much again.
            assert int((memory / "agent" / "memory.limit_in_bytes").read_text()) == 512 * 1024 * 1024
            assert int((memory / "memory.limit_in_bytes").read_text()) == 2 * 512 * 1024 * 1024
            assert f"memory:/harbor-local-sandbox/{group}/keel" in Path(f"/proc/{box.init_pid}/cgroup").read_text()
            assert in_agent_leaf((await second.exec("cat /proc/self/cgroup")).stdout)
            hog = await second.exec(
                'python3 -c "b = []\nwhile True: b.append(bytearray(64 * 1024 * 1024))"', timeout_sec=60
            )
            assert hog.return_code != 0 and (await second.exec("echo alive")).stdout.strip() == "alive"
        finally:
            await second.stop(delete=True)
            await first.stop(delete=True)
        assert not memory.exists()  # the box's cgroups went with it
        for _ in range(500):  # the one parked after the second start, released as close_all() does
            if _box._PARKED is not None:
                break
            await asyncio.sleep(0.01)
        release_parked()
        left = [p for p in ROOT.glob(f"*/harbor-local-sandbox/{os.getpid()}-parked-*")]
        assert left == [], left

    run(scenario())


def test_a_box_starts_in_a_mount_table_without_the_other_boxes_trees(task: Path, tmp_path: Path) -> None:
    """A box's bubblewrap runs in a mount namespace of its own holding its own tree's mounts but not
    those of the sandboxes already running (which made every later start slower), nor the host's it
    does not need; both work.

    Without root (the repository's ``tests/test_rootless.py`` runs this too) the trees are the holder's mounts."""

    def mount_points(pid: int | str) -> list[str]:
        return [line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]

    async def scenario():
        first = open_env(task, tmp_path, default_storage_mb=256)
        second = open_env(task, tmp_path, default_storage_mb=256)
        await first.start(force_build=False)
        try:
            await second.start(force_build=False)
            first_dir, second_dir = str(first._sandbox.dir), str(second._sandbox.dir)
            host = first._sandbox.host
            holder = host.proc.pid if host.rootless else "self"
            on_host = mount_points(holder)
            assert first_dir in on_host and second_dir in on_host  # the storage bounds
            bwrap = second._sandbox.running_box()._proc.pid
            assert os.readlink(f"/proc/{bwrap}/ns/mnt") != os.readlink(f"/proc/{holder}/ns/mnt")
            seen = mount_points(bwrap)
            assert second_dir in seen, seen
            assert not [p for p in seen if p == first_dir or p.startswith(first_dir + "/")], seen
            # Nor the mounts it does not use (each line costs bubblewrap at every mount it makes): the image
            # root (the box's overlay holds its own reference) and, as root, /sys and its cgroup hierarchies
            # (without root the host's mounts are locked in the holder's namespace: they stay).
            assert str(second._sandbox.image.rootfs) in on_host and str(second._sandbox.image.rootfs) not in seen
            if not host.rootless:
                assert "/sys" in on_host and not [p for p in seen if p == "/sys" or p.startswith("/sys/")], seen
            for env, name in ((first, "first"), (second, "second")):
                result = await env.exec(f"echo {name} > /tmp/mark && cat /tmp/mark")
                assert result.return_code == 0 and result.stdout.strip() == name, result
        finally:
            await second.stop(delete=True)
            await first.stop(delete=True)

    run(scenario())
