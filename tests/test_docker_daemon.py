"""The tests' private Docker daemon (``docker_daemon.py``) leaves nothing on the machine.

A second daemon is started beside the session's, used the way Harbor uses one (a compose build,
a network, a volume, a running container), and stopped. ``private_daemon`` itself fails when a
process of its network namespace, a mount under its folder or a cgroup of its own is left; from
outside, the host's firewall rules, network links, ``/run`` and ``/etc/docker`` must be as before.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from docker_daemon import private_daemon

pytestmark = pytest.mark.docker


def _host_state() -> dict[str, object]:
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True)
    return {
        "iptables": rules.stdout.splitlines()[1:] if rules.returncode == 0 else rules.stderr,
        "links": sorted(os.listdir("/sys/class/net")),
        "/run/docker": os.path.exists("/run/docker"),
        "/run/containerd": os.path.exists("/run/containerd"),
        "/etc/docker/key.json": os.path.exists("/etc/docker/key.json"),
    }


def _without_timestamps(state: dict[str, object]) -> dict[str, object]:
    rules = state["iptables"]
    if isinstance(rules, list):
        state = {**state, "iptables": [r for r in rules if not r.startswith("#")]}
    return state


def test_the_daemon_leaves_nothing_on_the_machine(docker_daemon, loopback_registry, tmp_path_factory) -> None:
    """A second private daemon, used and stopped: the host's firewall, links, /run and /etc are as before."""
    before = _without_timestamps(_host_state())
    workdir = tmp_path_factory.mktemp("dockerd-teardown", numbered=True)
    with private_daemon(workdir, {"teardown-base:1": f"docker://{loopback_registry.base}"}) as daemon:
        context = workdir / "ctx"
        context.mkdir()
        (context / "Dockerfile").write_text("FROM teardown-base:1\nRUN echo built > /built\n")
        (context / "compose.yaml").write_text("services:\n  app:\n    build: .\n    image: teardown-app\n")
        daemon.docker("compose", "--project-directory", str(context), "build", cwd=str(context))
        daemon.docker("network", "create", "teardown-net")
        daemon.docker("volume", "create", "teardown-vol")
        daemon.docker(
            "run", "--detach", "--name", "teardown-box", "-v", "teardown-vol:/v", "--network", "teardown-net",
            "teardown-app", "sleep", "1000",
        )  # fmt: skip
        usage = dict(line.split(":") for line in daemon.lines("system", "df", "--format", "{{.Type}}:{{.TotalCount}}"))
        assert all(int(usage[kind]) > 0 for kind in ("Images", "Containers", "Local Volumes", "Build Cache")), usage
        pid = int((workdir / "docker.pid").read_text())
        cgroups = list(Path("/sys/fs/cgroup").glob(f"*/{daemon.cgroup_parent.lstrip('/')}"))
        assert cgroups, "the container runs under the daemon's own cgroup parent"
    # private_daemon raises if a process, mount or cgroup of the daemon is left; and from outside:
    assert not os.path.exists(f"/proc/{pid}"), "dockerd still runs"
    assert not (workdir / "data").exists() and not (workdir / "exec").exists()
    assert not any(path.exists() for path in cgroups)
    assert _without_timestamps(_host_state()) == before
