"""What the agent cannot see or reach from inside a local sandbox, and link-safe file transfer."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest
from harbor_local_sandbox._hostfs import UnsafePathError
from sandbox_testing import REPO, make_task, open_env, run, task_base_image  # noqa: F401 - the session fixture

#: Every test here starts a local sandbox (bubblewrap).
pytestmark = [pytest.mark.local, pytest.mark.usefixtures("task_base_image")]


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path / "tasks", gold="the-secret-gold-answer")


@pytest.fixture
def loopback_server():
    """A TCP server on the host's loopback that records every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[tuple] = []
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            accepted.append(addr)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def test_agent_cannot_find_the_gold_answer_tests_or_host_files(task: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HARBOR_LOCAL_SANDBOX_TEST_SECRET", "host-secret-value")
    hub_cache = Path.home() / ".cache" / "huggingface"

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            probes = {
                "find": "find / -xdev \\( -name task.toml -o -name solve.sh -o -name test.sh \\) 2>/dev/null",
                "grep": "grep -rIl the-secret-gold-answer / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr 2>/dev/null",
                "tests": "ls /tests /solution 2>&1",
                "task_dir": f"ls {task} 2>&1; cat {task}/task.toml 2>&1",
                "project": f"ls {REPO} 2>&1",
                "home": f"ls {Path.home()}/.pyenv {hub_cache} 2>&1",
                "environ": "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'",
            }
            seen = {name: await env.exec(cmd, timeout_sec=60) for name, cmd in probes.items()}
            for name, result in seen.items():
                text = (result.stdout or "") + (result.stderr or "")
                assert "the-secret-gold-answer" not in text, name
                assert "host-secret-value" not in text, name
            assert seen["find"].stdout.strip() == ""
            assert "No such file" in seen["tests"].stdout
            assert "No such file" in seen["task_dir"].stdout
            assert "No such file" in seen["project"].stdout
            assert seen["home"].stdout.count("No such file") == 2
            # Harbor's verifier uploads /tests, and only then does it appear.
            await env.upload_dir(task / "tests", "/tests")
            assert (await env.exec("ls /tests")).stdout.split() == ["test.sh"]
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_no_network_cannot_reach_host_loopback(task: Path, tmp_path: Path, loopback_server) -> None:
    port, accepted = loopback_server

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            probe = await env.exec(
                'python3 -c "import socket,sys\n'
                f"for host in ('127.0.0.1', '10.0.2.2'):\n"
                "  s = socket.socket(); s.settimeout(2)\n"
                f"  try: s.connect((host, {port})); print('reached', host)\n"
                "  except OSError as e: print('blocked', host, e)\"",
                timeout_sec=30,
            )
            assert "reached" not in probe.stdout and probe.stdout.count("blocked") == 2
            links = await env.exec("cat /proc/net/dev")
            assert "tap0" not in links.stdout and "eth0" not in links.stdout
        finally:
            await env.stop(delete=True)

    run(scenario())
    assert accepted == []


def test_network_allowed_task_still_cannot_reach_host_loopback(tmp_path: Path, loopback_server) -> None:
    port, accepted = loopback_server
    task = make_task(tmp_path / "tasks", name="net", network_mode="public")

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            links = await env.exec("cat /proc/net/dev")
            assert "tap0" in links.stdout  # its own user-mode network stack
            probe = await env.exec(
                'python3 -c "import socket\n'
                "for host in ('127.0.0.1', '10.0.2.2'):\n"
                "  s = socket.socket(); s.settimeout(2)\n"
                f"  try: s.connect((host, {port})); print('reached', host)\n"
                "  except OSError as e: print('blocked', host, e)\"",
                timeout_sec=30,
            )
            assert "reached" not in probe.stdout, probe.stdout
        finally:
            await env.stop(delete=True)

    run(scenario())
    assert accepted == []


@pytest.fixture
def host_dir(tmp_path: Path):
    """A folder of the host's outside ``/tmp`` (links into ``/tmp`` are the verifier's places: the agent
    cannot make them), for the agent's links to point at."""
    base = Path(tempfile.mkdtemp(prefix="harbor-local-sandbox-host-", dir="/var/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_download_never_follows_links_the_agent_planted(task: Path, tmp_path: Path, host_dir: Path) -> None:
    host_secret = host_dir / "host-secret.txt"
    host_secret.write_text("host-only")
    out = tmp_path / "downloaded"

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            await env.exec(
                "mkdir -p /logs/verifier/sub && echo 1 > /logs/verifier/reward.txt && "
                f"ln -s {host_secret} /logs/verifier/leak.txt && ln -s /etc /logs/verifier/etc && "
                f"ln -s {host_dir} /logs/verifier/sub/dir && ln -s /etc /workdir/linked"
            )
            await env.download_dir("/logs/verifier", out)
            assert (out / "reward.txt").read_text().strip() == "1"
            assert not (out / "leak.txt").exists() and not (out / "leak.txt").is_symlink()
            assert not (out / "etc").exists() and not (out / "sub" / "dir").exists()
            with pytest.raises(UnsafePathError):
                await env.download_file("/logs/verifier/leak.txt", tmp_path / "one.txt")
            with pytest.raises(UnsafePathError):
                await env.download_dir("/workdir/linked/apt", tmp_path / "through-link")
            assert not (tmp_path / "one.txt").exists()
        finally:
            await env.stop(delete=True)

    run(scenario())
    assert host_secret.read_text() == "host-only"


def test_upload_never_writes_through_planted_links(task: Path, tmp_path: Path, host_dir: Path) -> None:
    victim_dir = host_dir / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "file.txt"
    victim.write_text("untouched")
    payload = tmp_path / "payload.txt"
    payload.write_text("overwritten")

    async def scenario():
        env = open_env(task, tmp_path)
        await env.start(force_build=False)
        try:
            await env.exec(f"ln -s {victim} /workdir/file.txt && ln -s {victim_dir} /workdir/dir")
            await env.upload_file(payload, "/workdir/file.txt")  # replaces the link itself
            assert (await env.exec("cat /workdir/file.txt")).stdout == "overwritten"
            with pytest.raises(UnsafePathError):
                await env.upload_file(payload, "/workdir/dir/file.txt")
            await env.upload_file(payload, "/usr/bin/evil")  # the image's /usr: the sandbox's own copy
            assert (await env.exec("cat /usr/bin/evil")).stdout == "overwritten"
        finally:
            await env.stop(delete=True)

    run(scenario())
    assert victim.read_text() == "untouched"
    assert sorted(os.listdir(victim_dir)) == ["file.txt"]
    assert not Path("/usr/bin/evil").exists()
