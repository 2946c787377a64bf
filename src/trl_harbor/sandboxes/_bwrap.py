"""One bubblewrap sandbox: a long-lived set of namespaces and the commands run in it.

``Box`` is the mechanism under both the local Harbor environment and the image
builder. It knows nothing of Harbor: it takes a root directory to mount at ``/``,
starts bubblewrap once with a supervisor inside (see ``_supervisor.py``), runs
commands through it over a Unix socket, and tears everything down on ``kill``.

Layout inside a box:

* ``/`` is the box's private, writable root directory on the host;
* the host's ``/usr`` (and the merged-``/usr`` links ``/bin``, ``/lib``, ...) and
  ``/etc`` are mounted read-only over it, with secrets such as ``/etc/shadow``
  masked; ``/proc`` is the box's own, ``/dev`` a minimal one;
* ``/opt/venv-layer`` is the environment's shared Python layer (read-only except
  while it is being built);
* nothing else of the host is visible: no home directory, no project, no task folder.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

from trl_harbor.sandboxes import _storage
from trl_harbor.sandboxes.errors import (
    SandboxCommandError,
    SandboxError,
    SandboxStartError,
    SandboxTimeoutError,
    SandboxUnavailableError,
)

logger = logging.getLogger(__name__)

LAYER_VENV = "/opt/venv-layer"
SANDBOX_VENV = "/opt/venv"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Paths inside a box that are host mounts, not part of its private root.
SYSTEM_MOUNTS = ("/usr", "/etc", "/proc", "/dev", "/sys", LAYER_VENV)
_ETC_MASKED = ("shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "ssh", "security/opasswd")
_SLIRP_GATEWAY_DNS = "10.0.2.3"
# What the sandbox's root may do: Docker's default capability set. Notably absent:
# CAP_SYS_ADMIN (no mounts, so nothing can be hidden under a mount before the
# verifier runs), CAP_SYS_PTRACE (the supervisor cannot be traced) and
# CAP_LINUX_IMMUTABLE (no file the verifier must replace can be made immutable).
SANDBOX_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)  # fmt: skip
NetworkMode = Literal["none", "user", "host"]
#: Size of ``/dev/shm`` in a box with a storage bound (Docker's default ``--shm-size``).
DEV_SHM_BYTES = 64 << 20


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/bin:/usr/sbin:/bin:/sbin")


@cache
def bwrap_path() -> str:
    """Return the path of the ``bwrap`` executable.

    Raises:
        SandboxUnavailableError: If bubblewrap is not installed.
    """
    found = _which("bwrap")
    if not found:
        raise SandboxUnavailableError(
            "The local sandbox needs bubblewrap, which is not installed. Install it with "
            "`apt-get install bubblewrap` (Debian/Ubuntu), `dnf install bubblewrap` (Fedora) "
            "or your distribution's package, or use another environment_type (e.g. 'docker')."
        )
    return found


@cache
def _pdeathsig_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig KILL --`` (util-linux), where it exists, to start bubblewrap with.

    bubblewrap's ``--die-with-parent`` arms itself only part-way through setting up the sandbox;
    an owner that dies (``kill -9``) before that left the bubblewrap process waiting forever.
    Armed before ``exec``, the signal covers bubblewrap's whole life.
    """
    tool = _which("setpriv")
    if tool is None:
        return ()
    try:
        usage = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return (tool, "--pdeathsig", "KILL", "--") if "--pdeathsig" in usage else ()


@cache
def sandbox_python() -> str:
    """The host Python that runs inside sandboxes (a system interpreter under ``/usr``)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return candidate
    raise SandboxUnavailableError(
        "The local sandbox runs Python from the host's /usr (it is the sandbox's base "
        "image), but /usr/bin/python3 does not exist. Install python3 (`apt-get install "
        "python3 python3-venv`)."
    )


@cache
def _supervisor_source() -> bytes:
    return resources.files("trl_harbor.sandboxes").joinpath("_supervisor.py").read_bytes()


@cache
def supervisor_binary() -> str | None:
    """The compiled C supervisor, built on first use and cached by source hash.

    Returns ``None`` (the Python supervisor is used) when ``TRL_HARBOR_SUPERVISOR=python``
    or no C compiler is available.
    """
    if os.environ.get("TRL_HARBOR_SUPERVISOR", "").lower() == "python":
        return None
    source = resources.files("trl_harbor.sandboxes").joinpath("_supervisor.c").read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache_dir = Path(os.environ.get("TRL_HARBOR_CACHE_DIR") or Path.home() / ".cache" / "trl-harbor") / "bin"
    binary = cache_dir / f"supervisor-{digest}"
    if binary.exists():
        return str(binary)
    compiler = _which(os.environ.get("CC", "cc")) or _which("gcc") or _which("clang")
    if compiler is None:
        logger.info("no C compiler found: the local sandbox uses its Python supervisor (slower start)")
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        src = Path(scratch) / "supervisor.c"
        src.write_bytes(source)
        out = Path(scratch) / "supervisor"
        result = subprocess.run([compiler, "-O2", "-o", str(out), str(src)], capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("compiling the sandbox supervisor failed, using the Python one: %s", result.stderr[-2000:])
            return None
        out.replace(binary)  # atomic: concurrent builders race harmlessly
    return str(binary)


@cache
def static_binary(name: str) -> str:
    """A helper of this package compiled statically (cached by source hash).

    Image roots (``BoxConfig.image_root``) have their own C library, or none: what runs
    in them from the host must not depend on the host's. Compiled once, cached in
    ``~/.cache/trl-harbor/bin``.

    Args:
        name: ``"supervisor"`` or ``"runas"`` (``_<name>.c`` in this package).

    Returns:
        The binary's path.

    Raises:
        SandboxUnavailableError: If no C compiler can link statically.
    """
    source = resources.files("trl_harbor.sandboxes").joinpath(f"_{name}.c").read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache_dir = Path(os.environ.get("TRL_HARBOR_CACHE_DIR") or Path.home() / ".cache" / "trl-harbor") / "bin"
    binary = cache_dir / f"{name}-static-{digest}"
    if binary.exists():
        return str(binary)
    compiler = _which(os.environ.get("CC", "cc")) or _which("gcc") or _which("clang")
    error = "no C compiler found"
    if compiler is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            src = Path(scratch) / f"{name}.c"
            src.write_bytes(source)
            out = Path(scratch) / name
            result = subprocess.run(
                [compiler, "-O2", "-static", "-o", str(out), str(src)], capture_output=True, text=True
            )
            if result.returncode == 0:
                out.replace(binary)  # atomic: concurrent builders race harmlessly
                return str(binary)
            error = result.stderr.strip()[-1500:]
    raise SandboxUnavailableError(
        "Sandboxes on task images run a small statically linked supervisor, which could not be "
        f"compiled ({error}). Install a C compiler and the static C library (`apt-get install gcc "
        "libc6-dev`), or run tasks on the host root (environment kwarg root='host')."
    )


_PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
_PROC_MASKED = ("kcore", "keys", "latency_stats", "timer_list", "timer_stats", "sched_debug", "acpi", "scsi")


@cache
def _proc_hardening() -> tuple[str, ...]:
    """bubblewrap arguments making ``/proc``'s global parts read-only and masking the leaky ones."""
    args: list[str] = []
    for name in _PROC_READ_ONLY:
        if os.path.exists(f"/proc/{name}"):
            args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    for name in _PROC_MASKED:
        path = f"/proc/{name}"
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return tuple(args)


@cache
def _root_links() -> tuple[tuple[str, str], ...]:
    """The merged-/usr links at the host's root (``/bin -> usr/bin``, ...)."""
    links = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            links.append((os.readlink(path), f"/{name}"))
    return tuple(links)


@cache
def _root_dirs() -> tuple[str, ...]:
    """Host root directories that are real directories and must be mounted (non-merged /usr)."""
    return tuple(
        f"/{name}"
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
        if (Path("/") / name).is_dir() and not (Path("/") / name).is_symlink()
    )


def state_root() -> Path:
    """Where sandboxes keep their private trees.

    ``$TRL_HARBOR_STATE_DIR`` if set; else a per-user folder on ``/dev/shm`` when it is
    a writable tmpfs (creating and removing a sandbox's tree is 40x faster there than
    on a journaled disk, and what the agent writes counts against the sandbox's own
    memory limit); else a per-user folder in the temporary directory.
    """
    configured = os.environ.get("TRL_HARBOR_STATE_DIR")
    if configured:
        base = Path(configured)
    elif _shm_is_tmpfs():
        base = Path("/dev/shm") / f"trl-harbor-{os.getuid()}"
    else:
        base = Path(tempfile.gettempdir()) / f"trl-harbor-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


@cache
def _shm_is_tmpfs() -> bool:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts) and os.access("/dev/shm", os.W_OK)


class _Cgroups:
    """Resource limits through cgroup v1 (memory, pids, cpu) or v2, where writable."""

    V1 = Path("/sys/fs/cgroup")

    def __init__(self, name: str, memory_mb: int | None, cpus: float | None, pids_max: int | None):
        self.paths: list[Path] = []
        self.name = name
        self.limits = {"memory": memory_mb, "cpu": cpus, "pids": pids_max}

    @staticmethod
    @cache
    def mode() -> str | None:
        if os.geteuid() != 0:
            return None
        if (_Cgroups.V1 / "memory").is_dir() and (_Cgroups.V1 / "pids").is_dir():
            return "v1"
        if (_Cgroups.V1 / "cgroup.controllers").exists():
            return "v2"
        return None

    def create(self) -> list[Path]:
        mode = self.mode()
        try:
            if mode == "v1":
                self._create_v1()
            elif mode == "v2":
                self._create_v2()
        except OSError as error:
            logger.debug("cgroup limits unavailable (%s); falling back to rlimits", error)
            self.remove()
        return [p / "cgroup.procs" for p in self.paths]

    def _create_v1(self) -> None:
        memory, cpus, pids = self.limits["memory"], self.limits["cpu"], self.limits["pids"]
        if memory:
            path = self._mkdir(self.V1 / "memory" / "trl-harbor" / self.name)
            (path / "memory.limit_in_bytes").write_text(str(memory * 1024 * 1024))
            with contextlib.suppress(OSError):
                (path / "memory.memsw.limit_in_bytes").write_text(str(memory * 1024 * 1024))
        if pids:
            path = self._mkdir(self.V1 / "pids" / "trl-harbor" / self.name)
            (path / "pids.max").write_text(str(pids))
        if cpus and (self.V1 / "cpu").is_dir():
            with contextlib.suppress(OSError):
                path = self._mkdir(self.V1 / "cpu" / "trl-harbor" / self.name)
                period = int((path / "cpu.cfs_period_us").read_text())
                (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(period * cpus))))

    def _create_v2(self) -> None:
        parent = self.V1 / "trl-harbor"
        if not parent.exists():
            parent.mkdir()
            (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        path = self._mkdir(parent / self.name)
        memory, cpus, pids = self.limits["memory"], self.limits["cpu"], self.limits["pids"]
        if memory:
            (path / "memory.max").write_text(str(memory * 1024 * 1024))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        if pids:
            (path / "pids.max").write_text(str(pids))
        if cpus:
            (path / "cpu.max").write_text(f"{max(1000, int(100000 * cpus))} 100000")

    def _mkdir(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        self.paths.append(path)
        return path

    def exhaustion(self) -> str | None:
        """Which limit the box's processes ran into, from the cgroups' event counters (``None``: none)."""
        found = []
        for path in self.paths:
            counters = {}
            for name in ("memory.events", "memory.oom_control", "pids.events"):  # v2, v1, both
                with contextlib.suppress(OSError, ValueError):
                    for line in (path / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        counters[f"{name.split('.')[0]}.{key}"] = int(value)
            if counters.get("memory.oom_kill", 0) > 0:
                found.append(f"its memory limit: {counters['memory.oom_kill']} process(es) killed for memory")
            if counters.get("pids.max", 0) > 0:
                found.append(f"its process limit: {counters['pids.max']} fork(s) refused")
        return "; ".join(dict.fromkeys(found)) or None

    def kill_and_remove(self) -> None:
        for path in self.paths:
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
        self.remove()

    def remove(self) -> None:
        for path in self.paths:
            # Killed processes leave the cgroup a moment after SIGKILL: on a loaded machine, more
            # than a few tries' worth (a cgroup left behind stays until the next run's sweep).
            deadline = time.monotonic() + 1
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.002)
        self.paths = []


@dataclass
class BoxConfig:
    """How to build one box.

    Attributes:
        rootfs: Host directory mounted writable at ``/`` inside the box.
        layer_venv: Host directory mounted at ``/opt/venv-layer`` (the shared Python layer).
        layer_writable: Mount the layer read-write (only while building it).
        network: ``"none"`` (own empty network namespace), ``"user"`` (own namespace
            with a user-mode stack, no access to the host's loopback) or ``"host"``
            (the host's network; used for image builds, like ``docker build``).
        memory_mb: Memory limit, or ``None``.
        cpus: CPU limit, or ``None``.
        pids_max: Limit on the number of processes, or ``None``.
        hostname: The box's host name.
        extra_ro_binds: More ``(host path, box path)`` read-only mounts.
        image_root: ``rootfs`` is a complete image root (its own ``/usr``, ``/etc``):
            nothing of the host is mounted, the supervisor is linked statically, and
            the box's user namespace maps uids and gids 0-65535 (needs root), so the
            image's users, ``chown`` and ``useradd`` work.
        network_switchable: The network may be switched between ``"none"`` and ``"user"``
            while the box runs (:meth:`Box.set_network`), e.g. no network for the agent and
            the task's network for its verifier.
        storage_mb: Bound on what the box writes to its tree, or ``None``: each of its files
            (``RLIMIT_FSIZE``) and, polled by the host's storage guard (``_storage.py``), their
            total; a box past it is killed. Boxes with a bound are also killed when the host's
            free space falls under its reserve and they wrote the most. Their ``/dev`` is
            read-only but for ``/dev/shm``, a tmpfs of :data:`DEV_SHM_BYTES`.
    """

    rootfs: Path
    layer_venv: Path | None = None
    layer_writable: bool = False
    network: NetworkMode = "none"
    memory_mb: int | None = None
    cpus: float | None = None
    pids_max: int | None = 4096
    hostname: str = "sandbox"
    extra_ro_binds: list[tuple[str, str]] = field(default_factory=list)
    image_root: bool = False
    network_switchable: bool = False
    storage_mb: int | None = None


#: uids and gids an image-rooted box maps (identity: the image root's owners are kept).
ID_MAP_RANGE = 65536


_LIVE: weakref.WeakSet[Box] = weakref.WeakSet()


class Box:
    """A running bubblewrap sandbox (see the module docstring)."""

    def __init__(self, config: BoxConfig, state_dir: Path, name: str | None = None, owned_dir: Path | None = None):
        self.config = config
        # Removed by kill_now (at interpreter exit or on a signal) with the box's state.
        self.owned_dir = owned_dir
        self.state_dir = state_dir
        self.socket_path = state_dir / "supervisor.sock"
        self._proc: asyncio.subprocess.Process | None = None
        self._bwrap_pid: int | None = None
        self._slirp: asyncio.subprocess.Process | None = None
        # slirp4netns exits when this pipe's write end closes: with this process, however it dies.
        self._slirp_exit_w: int | None = None
        self._child_pid: int | None = None
        self._cgroups = _Cgroups(name or state_dir.name, config.memory_mb, config.cpus, config.pids_max)
        self.closed = False
        #: Host mounts (the copy-on-write root) to detach when the box goes.
        self.mounts: list[Path] = []
        #: Why the storage guard killed the box (see ``_storage.py``), or ``None``.
        self.storage_reason: str | None = None

    # -- start -----------------------------------------------------------------

    def _bwrap_args(self, info_fd: int | None, block_fd: int | None = None) -> list[str]:
        c = self.config
        args = [
            bwrap_path(),
            "--unshare-user", "--uid", "0", "--gid", "0",
            *(("--userns-block-fd", str(block_fd)) if block_fd is not None else ()),
            "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", *(arg for cap in SANDBOX_CAPS for arg in ("--cap-add", cap)),
            "--hostname", c.hostname,
            "--bind", str(c.rootfs), "/",
        ]  # fmt: skip
        if not c.image_root:
            args += ["--ro-bind", "/usr", "/usr"]
        if c.network != "host":
            args.append("--unshare-net")
        if c.network != "user" and not c.network_switchable and block_fd is None:
            # (Image roots: bubblewrap cannot combine this with --userns-block-fd;
            # _write_id_maps sets the same limit from the host.)
            # No nested user namespaces (their root would regain every capability in
            # them). Not with slirp4netns: it must join the box's own user namespace to
            # reach its network, which the nesting hides.
            args.append("--disable-userns")
        if not c.image_root:
            for directory in _root_dirs():
                args += ["--ro-bind", directory, directory]
            args += ["--ro-bind", "/etc", "/etc"]
            for name in _ETC_MASKED:
                path = Path("/etc") / name
                if path.is_dir() and not path.is_symlink():
                    args += ["--tmpfs", str(path), "--remount-ro", str(path)]
                elif path.exists():
                    args += ["--ro-bind", "/dev/null", str(path)]
        if c.network == "user" or c.network_switchable:
            resolv = self.state_dir / "resolv.conf"
            resolv.write_text(f"nameserver {_SLIRP_GATEWAY_DNS}\n")
            args += ["--ro-bind", str(resolv), "/etc/resolv.conf"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        if c.storage_mb:
            # bubblewrap's /dev is a tmpfs of its own, outside the box's tree and any bound but the
            # memory cgroup's (as root): writable, its files would bypass the storage bound. So
            # /dev is read-only, and /dev/shm a bounded tmpfs of Docker's default --shm-size.
            args += ["--perms", "1777", "--size", str(DEV_SHM_BYTES), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        # As Docker does: the kernel's global knobs read-only, its leaky files masked. The box's
        # root is the host's uid 0 (in its own user namespace), which the kernel lets write
        # /proc/sys and /proc/sysrq-trigger unless they are read-only. /proc/sys, bound from
        # the host, still shows the box's own namespaced values (network, host name).
        args += _proc_hardening()
        if c.layer_venv is not None:
            args += ["--bind" if c.layer_writable else "--ro-bind", str(c.layer_venv), LAYER_VENV]
        for source, target in c.extra_ro_binds:
            args += ["--ro-bind", source, target]
        if info_fd is not None:
            args += ["--info-fd", str(info_fd)]
        args += ["--chdir", "/", "--clearenv"]
        return args

    def _address_space_limit(self) -> int:
        if self._cgroups.paths or not self.config.memory_mb:
            return 0
        # No writable cgroups (not root): bound each process's address space instead.
        return self.config.memory_mb * 1024 * 1024 * 2

    def _file_size_limit(self) -> int:
        return (self.config.storage_mb or 0) * 1024 * 1024

    def _process_limit(self) -> int:
        if self._cgroups.paths or not self.config.pids_max:
            return 0
        # No writable cgroups (not root): RLIMIT_NPROC, which counts the processes of a uid in
        # its own user namespace (Linux >= 5.14), i.e. this box's. Host root is exempt from it,
        # but as root the pids cgroup bounds the box.
        return self.config.pids_max

    async def start(self) -> None:
        """Start bubblewrap and the supervisor, and wait until it accepts commands.

        Raises:
            SandboxStartError: If bubblewrap fails to set up the sandbox.
        """
        if _EXITING:
            raise SandboxStartError("this process is exiting: no new sandbox starts")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        image_root = self.config.image_root
        if image_root:
            if os.geteuid() != 0:
                raise SandboxStartError(
                    "sandboxes on task images need root for now (the image's users are mapped "
                    "into the sandbox, and its copy-on-write root is mounted on the host); run as "
                    "root, or run tasks on the host root (environment kwarg root='host')"
                )
            binary = static_binary("supervisor")
        else:
            prepare_rootfs(self.config.rootfs)
            binary = supervisor_binary()
        cgroup_procs = self._cgroups.create()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        listener.listen(128)
        info_r = info_w = block_r = block_w = None
        if self.config.network == "user" or self.config.network_switchable or image_root:
            info_r, info_w = os.pipe()
        if image_root:
            block_r, block_w = os.pipe()
        exe_fd = None
        if binary is not None:
            # Executed through its descriptor: the binary appears nowhere in the box.
            exe_fd = os.open(binary, os.O_RDONLY)
            supervisor = [f"/proc/self/fd/{exe_fd}"]
        else:
            supervisor = [sandbox_python(), "-I", "-S", "-"]
        command = [*_pdeathsig_prefix(), *self._bwrap_args(info_w, block_r)] + [
            *supervisor, str(listener.fileno()), str(self._address_space_limit()), str(self._file_size_limit()),
            str(self._process_limit()),
        ]  # fmt: skip
        pass_fds = [listener.fileno()] + [fd for fd in (info_w, exe_fd, block_r) if fd is not None]
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=pass_fds,
                env={"PATH": SYSTEM_PATH},  # /proc/1/environ in the box shows nothing of ours
                cwd="/",
                start_new_session=True,
            )
        except OSError as error:
            listener.close()
            self._cleanup_files()
            for fd in (info_r, block_w):
                if fd is not None:
                    os.close(fd)
            raise SandboxStartError(f"could not run bubblewrap: {error}") from error
        finally:
            for fd in (info_w, exe_fd, block_r):
                if fd is not None:
                    os.close(fd)
        self._bwrap_pid = self._proc.pid
        _LIVE.add(self)
        if _EXITING:  # the exit's sweep may have run while bubblewrap was being started
            self.kill_now()
            raise SandboxStartError("this process is exiting: no new sandbox starts")
        listener.close()
        child_pid = None
        try:
            if block_w is not None and info_r is not None:
                # bubblewrap waits (--userns-block-fd) while the full uid/gid map is written.
                child_pid = await asyncio.to_thread(_read_child_pid, info_r)
                _write_id_maps(child_pid)
                os.write(block_w, b"1")
            assert self._proc.stdin is not None and self._proc.stdout is not None
            if binary is None:
                self._proc.stdin.write(_supervisor_source())
            self._proc.stdin.close()
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout=60)
            if line.strip() != b"ready":
                stderr = b""
                with contextlib.suppress(asyncio.TimeoutError):
                    stderr = await asyncio.wait_for(self._proc.stderr.read(), timeout=2)  # type: ignore[union-attr]
                raise SandboxStartError(
                    "bubblewrap failed to start the sandbox: "
                    + (stderr.decode(errors="replace").strip() or "no error output")
                )
            if cgroup_procs:
                # The box's processes so far (bwrap and the supervisor) join its
                # cgroups before any command runs; every later process is forked from
                # them and so is counted too.
                _join_cgroups(cgroup_procs, _process_tree(self._proc.pid))
            if info_r is not None and child_pid is None:
                child_pid = await asyncio.to_thread(_read_child_pid, info_r)
            self._child_pid = child_pid
            if self.config.network == "user" and child_pid is not None:
                # Only once bubblewrap has finished setting up the namespace's loopback:
                # configuring it concurrently races on netlink.
                await self._start_user_network(child_pid)
            if self.config.storage_mb:
                # What the box holds now (the task's files) is its baseline: its bound counts what it writes.
                tree = self.owned_dir or self.config.rootfs
                await asyncio.to_thread(_storage.GUARD.watch, self, tree, self._file_size_limit())
        except BaseException:
            await self.kill()
            raise
        finally:
            for fd in (info_r, block_w):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    async def _start_user_network(self, child_pid: int) -> None:
        tool = _which("slirp4netns")
        if tool is None:
            raise SandboxStartError(
                "this task allows network access, which the local sandbox provides through "
                "slirp4netns (never the host's own network); install it with `apt-get install "
                "slirp4netns`, or set the task's network policy to no-network"
            )
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        os.set_inheritable(exit_w, False)
        try:
            self._slirp = await asyncio.create_subprocess_exec(
                tool, "--configure", "--mtu=65520", "--disable-host-loopback",
                "--ready-fd", str(ready_w), "--exit-fd", str(exit_r), str(child_pid), "tap0",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=[ready_w, exit_r],
                start_new_session=True,
            )  # fmt: skip
            os.close(ready_w)
            ready_w = -1
            os.close(exit_r)
            self._slirp_exit_w, exit_w = exit_w, -1
            ok = await asyncio.to_thread(os.read, ready_r, 1)
            if ok != b"1":
                err = await self._slirp.stderr.read() if self._slirp.stderr else b""  # type: ignore[union-attr]
                raise SandboxStartError(f"slirp4netns failed: {err.decode(errors='replace').strip()}")
        finally:
            os.close(ready_r)
            if ready_w >= 0:
                os.close(ready_w)
            if exit_w >= 0:
                os.close(exit_w)

    async def set_network(self, network: NetworkMode) -> None:
        """Switch a running box's network between ``"none"`` and ``"user"``.

        ``"user"`` attaches a user-mode stack (slirp4netns) to the box's own network namespace;
        ``"none"`` detaches it, leaving only the loopback. Connections open at the switch break.

        Args:
            network: ``"none"`` or ``"user"``.

        Raises:
            SandboxError: If the box was not started with ``network_switchable`` (or is stopped).
        """
        if network == ("user" if self._slirp is not None else "none"):
            return
        switchable = self.config.network_switchable or self.config.network == "user"
        if self.closed or self._child_pid is None or not switchable:
            raise SandboxError("this sandbox's network cannot be switched (start it with network_switchable=True)")
        if network == "user":
            await self._start_user_network(self._child_pid)
            return
        await self._stop_user_network()

    async def _stop_user_network(self) -> None:
        slirp, self._slirp = self._slirp, None
        if self._slirp_exit_w is not None:
            with contextlib.suppress(OSError):
                os.close(self._slirp_exit_w)
            self._slirp_exit_w = None
        if slirp is not None and slirp.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                slirp.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(slirp.wait(), timeout=10)

    # -- commands --------------------------------------------------------------

    async def run(
        self,
        command: str,
        *,
        cwd: str = "/",
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        output_cap: int = 1 << 20,
    ) -> dict:
        """Run ``command`` with ``bash -c`` in the box and return the supervisor's answer.

        Returns:
            A dict with ``rc``, ``stdout``, ``stderr``, ``timed_out`` and ``dropped``.

        Raises:
            SandboxCommandError: If the box is gone or its supervisor does not answer.
        """
        fields = [cwd.encode(), command.encode()] + [f"{k}={v}".encode() for k, v in (env or {}).items()]
        timeout_ms = 0 if not timeout else max(1, int(timeout * 1000))
        try:
            return await self._exchange(fields, timeout_ms, output_cap, None if timeout is None else timeout + 30)
        except TimeoutError:
            raise SandboxTimeoutError(f"Command timed out after {timeout} seconds") from None
        except asyncio.IncompleteReadError as error:
            raise SandboxCommandError(
                "the sandbox's supervisor closed the connection without an answer "
                "(the sandbox was stopped, or its processes were killed)"
            ) from error
        except OSError as error:
            raise SandboxCommandError(f"the sandbox's supervisor went away ({error})") from error

    async def _exchange(self, fields: list[bytes], timeout_ms: int, output_cap: int, wait: float | None) -> dict:
        """Send one request to the supervisor and read its answer (see ``_supervisor.py`` for the protocol)."""
        if self.closed:
            raise SandboxCommandError("the sandbox has been stopped")
        body = struct.pack("<III", timeout_ms, output_cap, len(fields))
        body += b"".join(struct.pack("<I", len(f)) + f for f in fields)
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
        except OSError as error:
            raise SandboxCommandError(f"the sandbox is not running ({error})") from error
        try:
            writer.write(struct.pack("<I", len(body)) + body)
            await writer.drain()
            return await asyncio.wait_for(self._read_answer(reader, output_cap), timeout=wait)
        finally:
            writer.close()

    @staticmethod
    async def _read_answer(reader: asyncio.StreamReader, output_cap: int) -> dict:
        rc, flags = struct.unpack("<iI", await reader.readexactly(8))
        streams, dropped = [], 0
        for _ in range(2):
            lost, size = struct.unpack("<QI", await reader.readexactly(12))
            if size > output_cap + 256:  # never trust the box for sizes
                raise SandboxCommandError(f"the sandbox's supervisor sent {size} bytes for a cap of {output_cap}")
            streams.append((await reader.readexactly(size)).decode("utf-8", "replace"))
            dropped += lost
        return {"rc": rc, "timed_out": bool(flags & 1), "stdout": streams[0], "stderr": streams[1], "dropped": dropped}

    async def _control(self, *fields: str) -> dict:
        """Send a control request (an empty working directory) to the supervisor."""
        try:
            answer = await self._exchange([b"", *(f.encode() for f in fields)], 0, 1 << 20, 60)
        except (TimeoutError, asyncio.IncompleteReadError, OSError) as error:
            raise SandboxCommandError(f"the sandbox's supervisor did not answer {fields[0]!r} ({error!r})") from error
        if answer["rc"] < 0:
            raise SandboxCommandError(f"the sandbox's supervisor refused {fields[0]!r}")
        return answer

    async def list_processes(self) -> list[str]:
        """The box's live processes but its supervisor, as ``"PID:START"`` (PID in the box, start time in ticks).

        Returns:
            One entry per process; the same process keeps its entry, a reused PID does not.

        Raises:
            SandboxCommandError: If the box is gone or its supervisor does not answer.
        """
        return (await self._control("ps"))["stdout"].split()

    def resource_exhaustion(self) -> str | None:
        """Which of its limits (memory, processes, storage) the box ran into, or ``None``.

        Memory and processes are read from its cgroups' event counters (so only where cgroups are
        in use, i.e. as root); storage is what the storage guard killed it for (with or without root).

        Returns:
            A short description, or ``None``.
        """
        found = [reason for reason in (self.storage_reason, self._cgroups.exhaustion()) if reason]
        return "; ".join(found) or None

    def storage_exhausted(self, reason: str) -> None:
        """Kill the box because it wrote past its storage bound or into the host's reserve (the guard's call).

        Its tree is removed at once, giving the space back to the host.

        Args:
            reason: What it ran into, reported by :meth:`resource_exhaustion`.
        """
        self.storage_reason = reason
        pids = self.host_pids()
        self._signal_all()
        # Its tree cannot be removed while the dying box still has it mounted (EBUSY).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.005)
        self.kill_now()

    def host_pids(self) -> list[int]:
        """Host PIDs of the box's processes (bubblewrap and its descendants); empty once stopped."""
        if self.closed or self._bwrap_pid is None:
            return []
        return _process_tree(self._bwrap_pid)

    async def kill_processes(self, keep: Sequence[str] = ()) -> int:
        """Kill every process in the box except its supervisor and ``keep``, until none is left.

        Reaches every process of the box's PID namespace, whatever it did to detach
        (``nohup``, ``setsid``, double forks, ignoring SIGTERM), and any command still
        running. The box stays usable for new commands.

        Args:
            keep: ``"PID:START"`` entries (from :meth:`list_processes`) to leave alone.

        Returns:
            How many processes were killed.

        Raises:
            SandboxCommandError: If the box is gone or its supervisor does not answer.
        """
        return int((await self._control("kill", *keep))["rc"])

    # -- teardown --------------------------------------------------------------

    def _signal_all(self) -> None:
        for proc in (self._slirp, self._proc):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, OSError):
                    # bwrap runs in its own session: kill the whole process group;
                    # the box's PID namespace dies with its init (--die-with-parent).
                    os.killpg(proc.pid, signal.SIGKILL)

    def kill_now(self) -> None:
        """Kill every process of the box and remove its state, synchronously.

        Safe to call more than once, from a signal handler or at interpreter exit.
        """
        if self.closed:
            return
        self.closed = True
        _storage.GUARD.forget(self)
        self._signal_all()
        self._cgroups.kill_and_remove()
        self._cleanup_files()
        self.unmount()
        if self.owned_dir is not None:
            with contextlib.suppress(OSError):
                remove_tree(self.owned_dir)
        _LIVE.discard(self)

    async def kill(self) -> None:
        """Kill every process of the box, wait for bubblewrap, and remove its state."""
        if self.closed:
            return
        self.closed = True
        _storage.GUARD.forget(self)
        died_before = self._proc is not None and self._proc.returncode is not None
        self._signal_all()
        for proc in (self._slirp, self._proc):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError, asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), timeout=10)
        if died_before:
            # bubblewrap was killed from outside (or crashed), perhaps before its sandbox-side
            # half armed --die-with-parent: that half, in its own session, would wait forever.
            await asyncio.to_thread(_kill_bubblewraps_of, self._cgroups.name)
        # Usually empty by now; anything that escaped the namespace's death is killed here.
        self._cgroups.kill_and_remove()
        self._cleanup_files()
        self.unmount()
        _LIVE.discard(self)

    def unmount(self) -> None:
        """Detach the box's host mounts (idempotent)."""
        while self.mounts:
            with contextlib.suppress(OSError):
                unmount(self.mounts.pop())

    def _cleanup_files(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        if self._slirp_exit_w is not None:
            with contextlib.suppress(OSError):
                os.close(self._slirp_exit_w)
            self._slirp_exit_w = None

    @property
    def pid(self) -> int | None:
        """Host PID of the bubblewrap process (``None`` before start)."""
        return self._bwrap_pid


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc's children lists)."""
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    stack += [int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _join_cgroups(procs_files: list[Path], pids: list[int]) -> None:
    for procs in procs_files:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                procs.write_text(str(pid))


def prepare_rootfs(root: Path) -> None:
    """Create the mount points and merged-/usr links that every box's root needs.

    Done on the host (idempotently) rather than by bubblewrap, so that one root can
    be mounted again, and copied, without clashing with what a previous box made.
    """
    for name in ("usr", "etc", "proc", "dev", "tmp", "root", "opt/venv-layer", *(d[1:] for d in _root_dirs())):
        (root / name).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    for target, link in _root_links():
        path = root / link[1:]
        if not path.is_symlink():
            if path.is_dir():
                remove_tree(path)
            path.symlink_to(target)


def _write_id_maps(pid: int) -> None:
    """Map uids and gids ``0..ID_MAP_RANGE-1`` of the box to the same host ids (root only).

    Then forbid nested user namespaces in the box (their root would regain every
    capability in them), as ``--disable-userns`` does for host-rooted boxes: the box's
    user namespace gets ``user.max_user_namespaces = 0``, set from inside it by ``nsenter``.
    """
    try:
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as handle:
                handle.write(f"0 0 {ID_MAP_RANGE}\n")
    except OSError as error:
        raise SandboxStartError(f"could not map the image's users into the sandbox: {error}") from error
    nsenter = _which("nsenter")
    result = subprocess.run(
        [nsenter or "nsenter", f"--user=/proc/{pid}/ns/user", "--", "/bin/sh", "-c",
         "echo 0 > /proc/sys/user/max_user_namespaces"],
        capture_output=True, text=True, env={"PATH": SYSTEM_PATH},
    )  # fmt: skip
    if result.returncode != 0:
        raise SandboxStartError(f"could not forbid nested user namespaces in the sandbox: {result.stderr.strip()}")


def _read_child_pid(fd: int) -> int:
    data = b""
    while b"}" not in data:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return int(json.loads(data[: data.index(b"}") + 1])["child-pid"])
    except (ValueError, KeyError) as error:
        raise SandboxStartError(f"bubblewrap did not report its child process: {data!r}") from error


def remove_tree(path: Path) -> None:
    """Remove a sandbox's private tree, even parts the agent made read-only."""

    def _retry(func, target, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(target)

    if path.exists():
        shutil.rmtree(path, onexc=_retry)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    """Mount a copy-on-write view of ``lower`` at ``target`` (root only): writes go to ``upper``.

    Raises:
        SandboxStartError: If the kernel refuses the mount.
    """
    for path in (lower, upper, work, target):
        if any(ch in str(path) for ch in ",:\\"):
            raise SandboxStartError(f"{path}: paths with ',', ':' or '\\' cannot be overlay layers")
    # redirect_dir and metacopy off (the defaults of most kernels, said here for all): every change
    # the sandbox makes is then a plain entry, a whiteout or an opaque folder in ``upper``, which is
    # what the seal's fingerprints read (LocalEnvironment._walk_layers).
    options = f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=off,metacopy=off".encode()
    if _libc().mount(b"overlay", str(target).encode(), b"overlay", 0, options) != 0:
        code = ctypes.get_errno()
        raise SandboxStartError(f"mounting the sandbox's copy-on-write root failed: {os.strerror(code)}")


def unmount(target: Path) -> None:
    """Detach a mount (lazily: it goes once nothing uses it)."""
    if _libc().umount2(str(target).encode(), 2) != 0:  # MNT_DETACH
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):
            raise OSError(code, os.strerror(code), str(target))


def _unmount_under(path: Path) -> None:
    """Detach every mount at or below ``path`` (the leftovers of a dead owner's boxes)."""
    prefix = str(path).rstrip("/")
    with contextlib.suppress(OSError):
        targets = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for target in sorted(targets, key=len, reverse=True):
            target = target.replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                with contextlib.suppress(OSError):
                    unmount(Path(target))


def new_box_name(prefix: str) -> str:
    """A unique, sweepable name: the owner's PID first, so stale boxes can be found."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in prefix)[:40]
    return f"{os.getpid()}-{safe}-{uuid.uuid4().hex[:8]}"


def _owner_dead(name: str) -> bool:
    owner = name.split("-", 1)[0]
    if not owner.isdigit() or int(owner) == os.getpid():
        return False
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def sweep_stale() -> int:
    """Remove the trees and cgroups of boxes whose owning process is dead.

    Returns:
        The number of trees removed.
    """
    removed = 0
    _kill_stale_bubblewraps()
    with contextlib.suppress(OSError):
        for entry in os.scandir(state_root()):
            if _owner_dead(entry.name):
                _unmount_under(Path(entry.path))
                remove_tree(Path(entry.path))
                removed += 1
    for parent in (*_Cgroups.V1.glob("*/trl-harbor"), _Cgroups.V1 / "trl-harbor"):
        with contextlib.suppress(OSError):
            for entry in os.scandir(parent):
                if entry.is_dir() and _owner_dead(entry.name):
                    stale = _Cgroups(entry.name, None, None, None)
                    stale.paths = [Path(entry.path)]
                    stale.kill_and_remove()
    return removed


def _bubblewraps() -> Iterator[tuple[int, str]]:
    """``(pid, box name)`` of the bubblewrap processes on this machine that hold a box folder.

    Also ``setpriv`` about to become one, and bubblewrap's own sandbox-side half before it runs
    the supervisor (both have bubblewrap's command line).
    """
    marker = f"{state_root()}/".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if Path(f"/proc/{name}/comm").read_text().strip() not in ("bwrap", "setpriv"):
                continue
            args = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(marker):
                yield int(name), arg[len(marker) :].split(b"/", 1)[0].decode(errors="replace")
                break


def _kill_bubblewraps_of(box_name: str) -> None:
    """Kill what is left of the bubblewrap of one box (see :func:`_bubblewraps`)."""
    for pid, box in _bubblewraps():
        if box == box_name:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _kill_stale_bubblewraps() -> None:
    """Kill bubblewrap processes that still hold a box of an owner that is dead."""
    for pid, box in _bubblewraps():
        if _owner_dead(box):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


#: Set when this process exits: no box starts after that (the loop thread may still be starting some).
_EXITING = False


def _kill_all_at_exit() -> None:
    global _EXITING
    _EXITING = True
    for box in list(_LIVE):
        box.kill_now()
    # Boxes started but not yet registered, and bubblewraps whose sandbox-side half has not yet
    # armed --die-with-parent (it runs in its own session, out of reach of the box's killpg).
    owner = f"{os.getpid()}-"
    for pid, box in _bubblewraps():
        if box.startswith(owner):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


atexit.register(_kill_all_at_exit)
