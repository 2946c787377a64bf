"""One bubblewrap sandbox: a long-lived set of namespaces and the commands run in it.

``Box`` is the mechanism under the local Harbor environment's sandboxes. It knows nothing of
Harbor: it mounts an image root at ``/``, starts bubblewrap once with a statically linked
supervisor as the box's init (``_supervisor.c``), runs commands through it over Unix sockets
(:class:`SupervisorClient`), and tears everything down on ``kill``.

A box has two PID namespaces, one inside the other. The outer one's init is the box's *keel*,
which serves :attr:`Box.control` (the agent's processes, liveness) and, while the box is graded,
starts a *view* (:meth:`Box.open_view`): the verifier's supervisor, in the keel's PID namespace
(it sees and can signal the agent's processes, which cannot see it) with mount, network, IPC and
UTS namespaces of its own, its root a mount tree the host made. The inner namespace is the
agent's: its supervisor serves :attr:`Box.supervisor`, and every command of the agent runs there.

Its :class:`BoxConfig` says what it gets: its namespaces (:func:`namespace_args`,
:func:`write_id_maps`), its mounts (``_mounts.py``), its network (none, or :class:`UserNetwork`),
its limits (``_cgroups.py`` as root: the agent's leaf and the keel's; else rlimits; storage by the
bounded tmpfs its tree is on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from harbor_local_sandbox import _lifetime, _userns
from harbor_local_sandbox._binaries import (
    SYSTEM_PATH,
    bwrap_path,
    launcher_binary,
    pdeathsig_prefix,
    state_root,
    static_binary,
    which,
)
from harbor_local_sandbox._cgroups import Cgroups
from harbor_local_sandbox._diagnose import namespace_problem
from harbor_local_sandbox._hostfs import remove_tree
from harbor_local_sandbox._mounts import kernel_fs_args, proc_hardening_items, unmount
from harbor_local_sandbox.errors import SandboxCommandError, SandboxError, SandboxStartError, SandboxTimeoutError

logger = logging.getLogger(__name__)
NetworkMode = Literal["none", "user"]
#: The user-mode stack's DNS forwarder, as seen from the box.
SLIRP_GATEWAY_DNS = "10.0.2.3"
# What the sandbox's root may do: Docker's default capability set. Notably absent:
# CAP_SYS_ADMIN (no mounts, so nothing can be hidden under a mount before the
# verifier runs), CAP_SYS_PTRACE (the supervisor cannot be traced) and
# CAP_LINUX_IMMUTABLE (no file the verifier must replace can be made immutable).
SANDBOX_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)  # fmt: skip
#: What the keel keeps besides (it makes the agent's and the verifier's namespaces, lists and kills
#: the agent's processes whatever their user); the agent's and the verifier's supervisors drop them.
KEEL_CAPS = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SYS_PTRACE")
#: What the keel needs only as it starts, and gives up at once: forbidding nested user namespaces
#: (``user.max_user_namespaces = 0``, which only a process with it may raise again).
KEEL_START_CAPS = ("CAP_SYS_RESOURCE",)
_CAP_NUMBERS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5, "CAP_SETGID": 6,
    "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13,
    "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_MKNOD": 27, "CAP_AUDIT_WRITE": 29,
    "CAP_SETFCAP": 31,
}  # fmt: skip


def capability_mask(names: Sequence[str]) -> str:
    """The capabilities ``names`` as the supervisor takes them (a hexadecimal bit mask)."""
    return format(sum(1 << _CAP_NUMBERS[name] for name in names), "x")


def namespace_args(*, hostname: str, block_fd: int) -> list[str]:
    """bubblewrap's namespace, capability and process options for a box (see ``BoxConfig``): its own user
    (bubblewrap waits on ``block_fd`` while the host maps the box's ids, :func:`write_id_maps`; the
    keel forbids nested user namespaces as it starts), network, PID, IPC and UTS namespaces; the
    keel's capabilities."""
    return [
        "--unshare-user", "--uid", "0", "--gid", "0", "--userns-block-fd", str(block_fd), "--unshare-net",
        "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session",
        "--cap-drop", "ALL",
        *(arg for cap in (*SANDBOX_CAPS, *KEEL_CAPS, *KEEL_START_CAPS) for arg in ("--cap-add", cap)),
        "--hostname", hostname,
    ]  # fmt: skip


def write_id_maps(pid: int, id_map: str) -> None:
    """Write ``id_map`` as the uid and gid maps of the box whose init is ``pid`` (bubblewrap waits for
    them). Nested user namespaces (whose root would regain every capability in them) are forbidden
    by the keel itself as it starts (``user.max_user_namespaces = 0`` from inside, ``_supervisor.c``:
    bubblewrap's ``--disable-userns`` cannot be combined with ``--userns-block-fd``, and slirp4netns
    must still join the box's own user namespace)."""
    try:
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as handle:
                handle.write(id_map)
    except OSError as error:
        raise SandboxStartError(f"could not map the image's users into the sandbox: {error}") from error


def _settle_once(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def read_child_pid(fd: int) -> int | None:
    """The host PID of the box's init, from bubblewrap's ``--info-fd`` (read as it comes, on the loop:
    a worker thread blocked on it would hold up other starts' work in the loop's executor).

    ``None`` when bubblewrap closed it without a word: it failed, and its standard error says why."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    data = b""
    while b"}" not in data:
        readable = loop.create_future()
        loop.add_reader(fd, _settle_once, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            break
        data += chunk
    if not data:
        return None
    try:
        return int(json.loads(data[: data.index(b"}") + 1])["child-pid"])
    except (ValueError, KeyError) as error:
        raise SandboxStartError(f"bubblewrap did not report its child process: {data!r}") from error


@dataclass
class BoxConfig:
    """How to build one box.

    Attributes:
        rootfs: Host directory mounted writable at ``/`` inside the box: a complete image root (its
            own ``/usr``, ``/etc``; nothing of the host is mounted). The box's user namespace maps
            uids and gids 0-65535 (of the holder's without root), so the image's users, ``chown``
            and ``useradd`` work.
        network: ``"none"`` (own empty network namespace) or ``"user"`` (own namespace
            with a user-mode stack, no access to the host's loopback).
        memory_mb: Memory limit, or ``None``.
        cpus: CPU limit, or ``None``.
        pids_max: Limit on the number of processes, or ``None``.
        hostname: The box's host name.
        extra_ro_binds: More ``(host path, box path)`` read-only mounts.
        network_switchable: The network may be switched between ``"none"`` and ``"user"``
            while the box runs (:meth:`Box.set_network`), e.g. no network for the agent and
            the task's network for its verifier.
        storage_mb: Bound on what the box writes, or ``None``: its tree is on a tmpfs of its own that
            the kernel bounds (``_mounts.mount_bounded_tmpfs``, made by its root), and its ``/dev`` is
            read-only but for ``/dev/shm``, a tmpfs of ``_mounts.DEV_SHM_BYTES``.
        mediate_links: Every symbolic link the agent makes goes through the keel, which refuses one
            that could lead into a verifier's own places (``_supervisor.c``): what its verifier's view
            needs, since it follows the agent's links live.
        link_policy: The keel's items for that judgement (``_links.keel_items``: the forbidden
            places of ``code_places.py`` and the image's own links that lead there).
    """

    rootfs: Path
    network: NetworkMode = "none"
    memory_mb: int | None = None
    cpus: float | None = None
    pids_max: int | None = 4096
    hostname: str = "sandbox"
    extra_ro_binds: list[tuple[str, str]] = field(default_factory=list)
    network_switchable: bool = False
    storage_mb: int | None = None
    mediate_links: bool = True
    link_policy: tuple[str, ...] = ()
    #: The host PID of a process whose network namespace the box joins instead of making its own (a
    #: compose task's service joins its ``main`` box's: one loopback, as services share one under Harbor).
    netns_of: int | None = None


def _bwrap_command(c: BoxConfig, state_dir: Path, info_fd: int, block_fd: int) -> list[str]:
    """bubblewrap's command line for a box, up to the supervisor: its namespaces, then its mounts in order."""
    args = [bwrap_path(), *namespace_args(hostname=c.hostname, block_fd=block_fd), "--bind", str(c.rootfs), "/"]
    if c.netns_of is not None:  # entered before bubblewrap runs (_join_netns)
        args.remove("--unshare-net")
    if c.network == "user" or c.network_switchable:
        args += ["--ro-bind", str(state_dir / "resolv.conf"), "/etc/resolv.conf"]
    args += kernel_fs_args(storage_bound=bool(c.storage_mb))
    for source, target in c.extra_ro_binds:
        args += ["--ro-bind", source, target]
    return args + ["--info-fd", str(info_fd), "--chdir", "/", "--clearenv"]


def _rlimits(config: BoxConfig, cgroups: bool) -> list[int]:
    """The address-space and process rlimits the supervisor sets for every command (0: none).

    No file-size limit: as under Docker, a sparse file may be larger than the storage bound, which
    bounds the space used (the tree's tmpfs)."""
    # No writable cgroups (not root): each process's address space is bounded instead, and the
    # processes by RLIMIT_NPROC, which counts a uid's processes in its own user namespace
    # (Linux >= 5.14), i.e. this box's.
    address_space = 0 if cgroups or not config.memory_mb else config.memory_mb * 1024 * 1024 * 2
    processes = 0 if cgroups or not config.pids_max else config.pids_max
    return [address_space, processes]


def _private_mounts(owned_dir: Path | None) -> list[str]:
    """The launcher's ``--private-mounts`` prefix for a box's bubblewrap (``_launcher.c``): a mount table of
    the box's own, without the other sandboxes' trees (empty if the package was built without its launcher, or for
    a tree elsewhere).

    bubblewrap copies the whole table into the box and reads it whole for every mount it makes, so
    each running sandbox (two mounts on an image root) made every later start slower. Run after the
    holder's ``nsenter`` (its mounts are the trees, without root)."""
    binary = launcher_binary()
    root = state_root()
    if binary is None or owned_dir is None or not owned_dir.is_relative_to(root):
        return []
    return [binary, "--private-mounts", os.path.realpath(root), owned_dir.relative_to(root).parts[0]]


def _join_netns(config: BoxConfig) -> list[str]:
    """The prefix that runs a box's bubblewrap in another box's network namespace (``netns_of``), or none."""
    if config.netns_of is None:
        return []
    return [which("nsenter") or "nsenter", f"--net=/proc/{config.netns_of}/ns/net"]


async def _spawn_process(command: list[str], fds: list[int]) -> asyncio.subprocess.Process:
    """Start bubblewrap (or a launcher) as every box's is: its own session, pipes, nothing of our environment."""
    return await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        pass_fds=fds,
        env={"PATH": SYSTEM_PATH},  # /proc/1/environ in the box shows nothing of ours
        cwd="/",
        start_new_session=True,
    )


class _LauncherProcess:
    """A parked launcher's process, as much of ``asyncio.subprocess.Process`` as a box uses (``pid``,
    ``returncode``, ``wait()``, ``stdin``, ``stdout``, ``stderr``).

    Started with :class:`subprocess.Popen`, not asyncio's subprocess support: an event loop that
    ends (``asyncio.run`` cancelling its tasks) while asyncio is still connecting a new process's
    pipes waits for ever for that process's exit (CPython 3.13), and launchers are made in the
    background, whenever a loop may end. Its exit is watched through a pidfd on the loop."""

    def __init__(self, popen: subprocess.Popen, loop: asyncio.AbstractEventLoop):
        self._popen = popen
        self.pid = popen.pid
        self.stdin = popen.stdin
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._loop = loop
        self._exited: asyncio.Future = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _reap(self) -> None:
        if self._popen.poll() is None:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    async def connect(self) -> None:
        """Read its standard output and error as streams (before a box uses it)."""
        for name in ("stdout", "stderr"):
            reader = asyncio.StreamReader(loop=self._loop)
            await self._loop.connect_read_pipe(
                lambda r=reader: asyncio.StreamReaderProtocol(r), getattr(self._popen, name)
            )
            setattr(self, name, reader)


class _Parked:
    """A launcher (``_launcher.c``) parked in fresh cgroups: the next box's bubblewrap, which then
    starts inside its cgroups instead of waiting for the kernel to move it there (a grace period)."""

    def __init__(self, proc: _LauncherProcess, channel: socket.socket, cgroups: Cgroups):
        self.proc, self.channel, self.cgroups = proc, channel, cgroups
        self.loop = asyncio.get_running_loop()
        self.owner = os.getpid()
        #: Whether a box took it (its process is that box's bubblewrap now).
        self.taken = False

    def usable(self) -> bool:
        """Whether a box starting now, on this loop and in this process, can start from it."""
        try:
            same_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            same_loop = False
        return same_loop and self.owner == os.getpid() and self.proc.returncode is None

    def launch(self, command: list[str], fds: list[int]) -> _LauncherProcess:
        """Have the launcher execute ``command`` with ``fds`` at their numbers; it becomes the box's bubblewrap."""
        fields = [str(len(fds)).encode(), *(str(fd).encode() for fd in fds), *map(os.fsencode, command)]
        rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))
        self.taken = True
        try:
            self.channel.sendmsg([b"\0".join(fields) + b"\0"], [rights])
        finally:
            self.channel.close()
            _lifetime.LIVE.discard(self)
        return self.proc

    def kill_now(self) -> None:
        """Kill the launcher and remove its cgroups (at exit, or when it can no longer be used)."""
        self.channel.close()
        if self.proc.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.cgroups.kill_and_remove()
        _lifetime.LIVE.discard(self)


#: The launchers parked for the next boxes (a pool, first taken first), as many as boxes started at
#: once so far in this process (a batch's size: :data:`_WANTED`), at most :data:`MAX_PARKED`; made in
#: the background while no box is starting (between batches), one at a time.
_POOL: list[_Parked] = []
#: The pool's first (``None``: the pool is empty); kept in step with it.
_PARKED: _Parked | None = None
_PARKED_LOCK = threading.Lock()  # taken on a loop, released by close_all() from another thread
_PARKING = False
#: A filling asked for while a released one was still ending (:func:`_park_next`): it begins then.
_PARK_AGAIN = False
_PARK_TASKS: set[asyncio.Task] = set()
#: The most launchers parked at once (``HARBOR_LOCAL_SANDBOX_MAX_PARKED``; 0: none parked).
MAX_PARKED = int(os.environ.get("HARBOR_LOCAL_SANDBOX_MAX_PARKED", "1") or 0)
#: Boxes reserving or starting now, and the most at once so far (the pool's size).
_STARTING = 0
_WANTED = 1
#: When a box last began to start or to stop; the pool's launchers after the first are made only once
#: none has for :data:`QUIET` seconds (between batches: not during a batch's starts or its teardown).
_LAST_BUSY = 0.0
QUIET = 0.05
#: Boxes being stopped now (:meth:`Box.kill`).
_STOPPING = 0
#: How many times the pool was released (:func:`release_parked`): a filling begun before stops.
_RELEASES = 0
_PARKING_RELEASES = 0  # the count when the filling under way began
#: Verifiers' views opened (:meth:`Box.open_view`): no launcher is parked while one of them is
#: open (:func:`_grading`), so that grading does not share the CPUs with the pool's forks and cgroup work.
_VIEWS: weakref.WeakSet[ViewBox] = weakref.WeakSet()


def _grading() -> bool:
    """Whether a verifier's view of this process is open (a view of a box stopped counts as closed)."""
    return any(not view.closed for view in list(_VIEWS))


def _boxes_running() -> bool:
    """Whether a box of this process is up: the pool's launchers after the first wait until none is
    (between batches). Parking one moves it into its cgroups, which takes the kernel's thread-group
    lock for writing: every fork on the machine waits meanwhile, and a batch of them in the middle of
    a rollout's commands or its grading stalled those (seen in CI as a grading window missed)."""
    return any(isinstance(item, Box) and not item.closed for item in list(_lifetime.LIVE))


def _pool_changed() -> None:
    """Keep :data:`_PARKED` the pool's first (under :data:`_PARKED_LOCK`)."""
    global _PARKED
    _PARKED = _POOL[0] if _POOL else None


def _take_parked() -> _Parked | None:
    """A parked launcher, for a box starting now, if one is ready (and usable here)."""
    while True:
        with _PARKED_LOCK:
            parked = _POOL.pop(0) if _POOL else None
            _pool_changed()
        if parked is None or parked.usable():
            return parked
        parked.kill_now()  # another loop's, or dead: the next one may be usable


def release_parked() -> None:
    """Kill this process's parked launchers (the next start parks new ones).

    Safe from any thread (it never runs an event loop's code)."""
    global _RELEASES
    with _PARKED_LOCK:
        _RELEASES += 1  # a filling under way stops (it would park new ones after this release)
        parked = list(_POOL)
        _POOL.clear()
        _pool_changed()
    for launcher in parked:
        launcher.kill_now()


def _park_next() -> None:
    """Fill the pool of parked launchers in the background, unless it is full or being filled."""
    global _PARKING, _PARK_AGAIN, _PARKING_RELEASES
    if _lifetime.EXITING or len(_POOL) >= min(_WANTED, MAX_PARKED):
        return
    if _PARKING:  # a filling begun before a release ends without parking: this one follows it
        _PARK_AGAIN = _PARK_AGAIN or _PARKING_RELEASES != _RELEASES
        return
    _PARKING = True
    _PARKING_RELEASES = _RELEASES  # a release from now on stops it, also before its task first runs
    task = asyncio.ensure_future(_park(_RELEASES))
    _PARK_TASKS.add(task)  # the loop holds tasks weakly
    task.add_done_callback(_PARK_TASKS.discard)


async def _park(releases: int) -> None:
    """Park launchers one at a time until the pool is full: none while a box is starting or a verifier's
    view is open; the first at once otherwise, the others once no box of this process is up (between
    batches, :func:`_boxes_running`). Each is watched by a task of its own (:func:`_watch_parked`)."""
    global _PARKING, _PARK_AGAIN
    try:
        while not _lifetime.EXITING and releases == _RELEASES and len(_POOL) < min(_WANTED, MAX_PARKED):
            while _STARTING or _grading() or (_POOL and (_boxes_running() or time.monotonic() - _LAST_BUSY < QUIET)):
                await asyncio.sleep(0.005 if _STARTING else QUIET / 2)
            if releases != _RELEASES or _lifetime.EXITING:
                return
            try:
                parked = await _new_parked()
            except Exception as error:  # best effort (e.g. the interpreter exiting meanwhile): no launcher then
                logger.debug("could not park a launcher: %r", error)
                return
            if parked is None:
                return
            with _PARKED_LOCK:
                keep = (
                    parked.usable()
                    and not _lifetime.EXITING
                    and releases == _RELEASES
                    and len(_POOL) < min(_WANTED, MAX_PARKED)
                )
                if keep:
                    _POOL.append(parked)
                    _pool_changed()
            if not keep:
                parked.kill_now()
                await parked.proc.wait()
                return
            task = asyncio.ensure_future(_watch_parked(parked))
            _PARK_TASKS.add(task)
            task.add_done_callback(_PARK_TASKS.discard)
    except asyncio.CancelledError:  # the loop is ending: nothing follows
        _PARK_AGAIN = False
        raise
    finally:
        _PARKING = False
        if _PARK_AGAIN and not _lifetime.EXITING:
            _PARK_AGAIN = False
            _park_next()


async def _watch_parked(parked: _Parked) -> None:
    """Watch a parked launcher until a box takes it, it dies, or its loop ends (killed then: a
    launcher lives on its loop, whose end cancels this task)."""
    try:
        await parked.proc.wait()  # a box that took it waits on it too
    except asyncio.CancelledError:
        with _PARKED_LOCK:
            unused = parked in _POOL
            if unused:
                _POOL.remove(parked)
                _pool_changed()
        if unused:
            parked.kill_now()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(parked.proc.wait(), timeout=5)  # its pipes closed while the loop runs
        raise
    with _PARKED_LOCK:  # died while parked (killed from outside), or the box that took it is gone
        if parked in _POOL:
            _POOL.remove(parked)
            _pool_changed()
    if not parked.taken:
        parked.kill_now()


async def _new_parked() -> _Parked | None:
    """A launcher started and moved into fresh cgroups (``None``: built without it, or no cgroups)."""
    binary = await asyncio.to_thread(launcher_binary)  # built with the package (_binaries.py)
    if binary is None:
        return None
    cgroups = Cgroups(_lifetime.new_box_name("parked"), None, None, None)
    cgroups.create_spare()
    if not cgroups.paths:
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        popen = subprocess.Popen(
            [binary, str(theirs.fileno())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=[theirs.fileno()], env={"PATH": SYSTEM_PATH}, cwd="/", start_new_session=True,
        )  # fmt: skip
    except BaseException as error:
        logger.debug("could not park a launcher: %r", error)
        ours.close()
        cgroups.remove()
        if isinstance(error, OSError):
            return None
        raise
    finally:
        theirs.close()
    proc = _LauncherProcess(popen, asyncio.get_running_loop())
    parked = _Parked(proc, ours, cgroups)
    _lifetime.LIVE.add(parked)
    try:
        await proc.connect()
        await cgroups.moved([proc.pid])
    except BaseException:
        parked.kill_now()
        raise
    return parked


class Box:
    """A running bubblewrap sandbox; its agent's commands go through :attr:`supervisor`, the rest through
    :attr:`control` (the keel).

    ``state_dir`` holds its socket; ``name`` (default: ``state_dir``'s) names its cgroups;
    ``owned_dir`` goes with it, also at exit."""

    def __init__(self, config: BoxConfig, state_dir: Path, name: str | None = None, owned_dir: Path | None = None):
        self.config = config
        self.owned_dir = owned_dir
        #: Where its mounts and tree are handled: this process, or (task images without root) the holder.
        self.host = _userns.host()
        self.state_dir = state_dir
        #: Runs the agent's commands in the box.
        self.supervisor = SupervisorClient(state_dir / "supervisor.sock")
        #: The keel: lists and kills the agent's processes, starts the verifier's views; the agent
        #: cannot reach it (nor starve it: it is in the keel's cgroup leaf).
        self.control = SupervisorClient(state_dir / "control.sock")
        self._proc: asyncio.subprocess.Process | _LauncherProcess | None = None
        self._network = UserNetwork()
        self._child_pid: int | None = None
        #: Names its folder's bubblewraps and (unless it runs from a parked launcher's) its cgroups.
        self.name = name or state_dir.name
        self._cgroups = Cgroups(self.name, config.memory_mb, config.cpus, config.pids_max)
        self._reserved = False
        self._starting = False
        #: The parked launcher this box starts from (already in its cgroups), if one was ready.
        self._parked: _Parked | None = None
        #: Whether bubblewrap started in the box's cgroups (a parked launcher's, or one that joined
        #: them before it executed bubblewrap): nothing of the keel's to move from here.
        self._in_place = False
        #: Whether the keel put the agent's supervisor in the agent's cgroup leaf itself.
        self._agent_placed = False
        #: Host mounts (the copy-on-write root) to detach when the box goes.
        self.mounts: list[Path] = []
        self._views = 0
        #: One teardown per box, whichever path starts it (``kill`` on the loop, ``kill_now`` at exit, in
        #: another thread): the claim is taken under a lock, and the others wait until it is done
        #: (``_released``), so that nobody removes the box's tree while its mounts are being detached.
        self._claim = threading.Lock()
        self._released = threading.Event()

    @property
    def init_pid(self) -> int | None:
        """The host PID of the box's init (its keel)."""
        return self._child_pid

    @property
    def closed(self) -> bool:
        """Whether the box is stopped (or being stopped): it takes no more commands."""
        return self.supervisor.closed

    def listening_sockets(self) -> list[str]:
        """The paths of the Unix sockets the box's processes listen on (its network namespace's
        ``/proc/net/unix``: stream and sequenced sockets accepting connections, bound to an absolute
        path; abstract ones are not files), at most :data:`MAX_SOCKETS`."""
        if self._child_pid is None:
            return []
        try:
            table = Path(f"/proc/{self._child_pid}/net/unix").read_text(errors="replace").splitlines()[1:]
        except OSError:
            return []
        found: list[str] = []
        for line in table:
            fields = line.split(None, 7)
            if len(fields) < 8 or not int(fields[3], 16) & _SO_ACCEPTCON or not fields[7].startswith("/"):
                continue
            if fields[7] not in found:
                found.append(fields[7])
            if len(found) >= MAX_SOCKETS:
                break
        return found

    async def start(self) -> None:
        """Start bubblewrap and the supervisor, and wait until it accepts commands (``SandboxStartError``)."""
        if _lifetime.EXITING:
            raise SandboxStartError("this process is exiting: no new sandbox starts")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        binary = static_binary("supervisor")
        self.reserve()
        info_r, block_w = await self._spawn(binary)
        try:
            if _lifetime.EXITING:  # the exit's sweep may have run while bubblewrap was being started
                self.kill_now()
                raise SandboxStartError("this process is exiting: no new sandbox starts")
            await self._until_ready(info_r, block_w)
        except BaseException:
            await self.kill()
            raise
        finally:
            for fd in (info_r, block_w):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        self._started()
        if self._cgroups.paths:
            _park_next()  # for the next boxes, once this one is up: not competing with its start

    def _started(self) -> None:
        """The box is up (or gone): no longer counted among the boxes starting now."""
        global _STARTING
        if self._starting:
            self._starting = False
            _STARTING -= 1

    def reserve(self) -> None:
        """Give the box its cgroups (once): a parked launcher's, already holding the process the
        box's bubblewrap will be, else new ones, with the kernel's wait for moving into them begun.

        The wait (a grace period: :func:`~harbor_local_sandbox._cgroups.prime_moves`) runs in the
        background: started before the box's tree is made, it is mostly over by the time the box's
        launcher joins them and its keel puts the agent's supervisor in the agent's leaf."""
        if self._reserved:
            return
        self._reserved = True
        global _STARTING, _WANTED, _LAST_BUSY
        _STARTING += 1  # until it is up, or gone (_started)
        _LAST_BUSY = time.monotonic()
        self._starting = True
        _WANTED = max(_WANTED, _STARTING)
        self._parked = _take_parked()
        if self._parked is not None:
            self._cgroups.adopt(self._parked.cgroups)
        else:
            self._cgroups.create()
        if self._cgroups.paths:
            Cgroups.primed()  # the agent's supervisor joins its own leaf, whatever the start

    async def _spawn(self, binary: str) -> tuple[int, int]:
        """Run bubblewrap with the supervisor as the box's init; return the host's ends of its info and block pipes."""
        if self.config.network == "user" or self.config.network_switchable:
            # Written where bubblewrap reads it (the holder's view of the tree, without root).
            resolv = self.state_dir / "resolv.conf"
            await asyncio.to_thread(self.host.call, _write_text, resolv, f"nameserver {SLIRP_GATEWAY_DNS}\n")
        info_r, info_w = os.pipe()  # its init's PID: for its cgroups, id maps and network
        block_r, block_w = os.pipe()  # bubblewrap waits on it while the box's ids are mapped
        exe_fd = os.open(binary, os.O_RDONLY)  # executed through its descriptor: it appears nowhere in the box
        listeners = []
        for client in (self.control, self.supervisor):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(client.address)
            listener.listen(128)
            listeners.append(listener)
        limits = _rlimits(self.config, bool(self._cgroups.paths))
        links = ["links", *self.config.link_policy] if self.config.mediate_links else []
        # The keel puts the agent's supervisor in the agent's leaf itself as it forks it (no move
        # from here after "ready"): the leaf's cgroup.procs, opened here, one per controller (v1).
        leaf_procs = self._cgroups.agent_procs()
        bwrap = [
            *_bwrap_command(self.config, self.state_dir, info_w, block_r), f"/proc/self/fd/{exe_fd}",
            *(str(listener.fileno()) for listener in listeners), *map(str, limits),
            capability_mask(SANDBOX_CAPS), *proc_hardening_items(), *links,
            *(f"cgroup-procs:{fd}" for fd in leaf_procs),
        ]  # fmt: skip
        private = _private_mounts(self.owned_dir)
        fds = [*(listener.fileno() for listener in listeners), info_w, exe_fd, block_r, *leaf_procs]
        command = [*self.host.command(), *private, *_join_netns(self.config), *bwrap]
        keel_procs: list[int] = []
        try:
            if self._parked is not None:
                # A parked launcher is the launcher: it makes the mount namespace itself (no second exec).
                self._proc = self._parked.launch(command[1:] if command[:1] == private[:1] else command, fds)
                self._in_place = True
            elif private and command[:1] == private[:1]:
                # The launcher arms the parent-death signal itself (no setpriv to execute first) and
                # joins the box's cgroups before it becomes bubblewrap (nothing to move from here).
                keel_procs = self._cgroups.procs_files("keel")
                joining = ["--join-cgroups", ",".join(map(str, keel_procs))] if keel_procs else []
                launcher = [command[0], "--die-with-parent", *joining, *command[1:]]
                self._proc = await _spawn_process(launcher, [*fds, *keel_procs])
                self._in_place = bool(keel_procs)
            else:
                self._proc = await _spawn_process([*pdeathsig_prefix(), *command], fds)
        except OSError as error:
            self._cleanup_files()
            for fd in (info_r, block_w):
                os.close(fd)
            raise SandboxStartError(f"could not run bubblewrap: {error}") from error
        finally:
            for listener in listeners:
                listener.close()
            for fd in (info_w, exe_fd, block_r, *leaf_procs, *keel_procs):
                os.close(fd)
        self._agent_placed = bool(leaf_procs)
        _lifetime.LIVE.add(self)
        return info_r, block_w

    async def _until_ready(self, info_r: int, block_w: int) -> None:
        """Finish the box's namespaces, wait for its supervisor's "ready", then bound and connect it."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        child_pid = await self._settle(info_r, block_w)
        proc.stdin.close()
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        if line.strip() != b"ready":
            stderr = b""
            with contextlib.suppress(asyncio.TimeoutError):
                stderr = await asyncio.wait_for(proc.stderr.read(), timeout=2)
            why = stderr.decode(errors="replace").strip() or "no error output"
            diagnosis = await asyncio.to_thread(namespace_problem)
            if diagnosis:
                why += f"; {diagnosis}"
            raise SandboxStartError(f"bubblewrap failed to start the sandbox: {why}")
        if child_pid is None:
            raise SandboxStartError("bubblewrap started the sandbox without reporting its process")
        if self._cgroups.paths:
            # Every process of the box so far is in its cgroups before any command runs (normally
            # :meth:`_settle` put them there: none is moved here), and the agent's supervisor in the
            # agent's leaf; later ones are forked from them.
            if not self._in_place:  # else the launcher was in the cgroups before it became bubblewrap
                tree = _process_tree(proc.pid)
                agent = [pid for pid in _process_tree(child_pid) if pid != child_pid]
                await self._cgroups.moved([pid for pid in tree if pid not in agent])
                if not self._agent_placed:
                    await self._cgroups.moved(agent, "agent")
            elif not self._agent_placed:
                await self._cgroups.moved([pid for pid in _process_tree(child_pid) if pid != child_pid], "agent")
        self._child_pid = child_pid
        if self.config.network == "user":
            # Only once bubblewrap has finished setting up the namespace's loopback:
            # configuring it concurrently races on netlink.
            await self._network.attach(child_pid)

    async def _settle(self, info_r: int, block_w: int) -> int | None:
        """Map the box's ids (image roots) and put its processes in its cgroups; its init's PID
        (``None``: bubblewrap failed before it made one, and says why on its standard error).

        Normally there is nothing to move: bubblewrap starts in the cgroups (a parked launcher's, or
        a launcher that joined them first, :attr:`_in_place`). Otherwise the first cgroup move waits
        for a kernel grace period after a quiet spell (~8 ms; started early by :meth:`reserve`): it
        runs alongside bubblewrap's set-up, not before it. bubblewrap waits on ``block_w`` (image
        roots) only for the id maps. Until its first command the box forks nothing (bubblewrap runs
        ``--as-pid-1``; the supervisor forks per connection), and no command is sent before this
        returns: every later process is forked inside the cgroups.
        """
        proc = self._proc
        assert proc is not None
        joining = self._cgroups.moved([] if self._in_place else [proc.pid])
        try:
            pid = await read_child_pid(info_r)
            if pid is not None:
                if self.host is _userns.DIRECT:  # two small writes: no thread hop
                    write_id_maps(pid, self.host.id_map)
                else:
                    await asyncio.to_thread(self.host.call, write_id_maps, pid, self.host.id_map)
                os.write(block_w, b"1")
        finally:
            await joining
        if pid is not None and not self._in_place:
            await self._cgroups.moved([pid])  # forked before bubblewrap moved: moved now
        return pid

    async def set_network(self, network: NetworkMode) -> None:
        """Attach (``"user"``) or detach (``"none"``) the box's user-mode network; open connections break.

        Raises:
            SandboxError: If the box was not started with ``network_switchable`` (or is stopped).
        """
        if network == ("user" if self._network.proc is not None else "none"):
            return
        switchable = self.config.network_switchable or self.config.network == "user"
        if self.closed or self._child_pid is None or not switchable:
            raise SandboxError("this sandbox's network cannot be switched (start it with network_switchable=True)")
        if network == "user":
            await self._network.attach(self._child_pid)
        else:
            await self._network.detach()

    def resource_exhaustion(self) -> str | None:
        """Which of its limits the agent ran into (memory, processes, CPU time: its cgroup leaf's event
        counters, as root only), or ``None``."""
        return self._cgroups.exhaustion()

    async def open_view(self, tree_fd: int, hostname: str, network: NetworkMode, forward: bool = True) -> ViewBox:
        """Start a verifier's supervisor in this box (see the module docstring); its root is ``tree_fd``.

        Args:
            tree_fd: A detached mount tree (``open_tree``): the view's ``/``.
            hostname: Its host name.
            network: Its own network: ``"none"`` (loopback only) or ``"user"``.
            forward: Make the agent's TCP listeners reachable in the view at their addresses and ports,
                and the view's reachable back by the agent's processes while they serve the view.

        Raises:
            SandboxError: If the box is not running, or the view cannot start.
        """
        if self.closed or self._child_pid is None:
            raise SandboxCommandError("the sandbox is not running")
        self._views += 1
        client = SupervisorClient(self.state_dir / f"view-{self._views}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [tree_fd, listener.fileno()]
        if forward:  # executed through its descriptor, as the supervisor is
            fds.append(os.open(await asyncio.to_thread(static_binary, "forwarder"), os.O_RDONLY | os.O_CLOEXEC))
        try:
            listener.bind(client.address)  # the view listens on it, from its own process
            answer = await self.control._control("view", hostname, fds=fds)
        finally:
            listener.close()
            for fd in fds[2:]:
                os.close(fd)
        view = ViewBox(self, client, int(answer["stdout"]))
        _VIEWS.add(view)
        try:
            if network == "user" or self.host is _userns.DIRECT:
                view.host_pid = await asyncio.to_thread(_listener_pid, client.address)
            if self.host is _userns.DIRECT:
                _favour_children(view.host_pid)
            if network == "user":
                await view.set_network("user")
        except BaseException:
            await view.kill()
            raise
        return view

    def kill_now(self) -> None:
        """Kill every process of the box and remove its state, synchronously (idempotent; safe at exit).

        When another thread's teardown of the box is under way, waits for it to finish (at most
        :data:`TEARDOWN_WAIT` seconds)."""
        if not self._closing():
            self._released.wait(TEARDOWN_WAIT)
            return
        self._signal_all()
        self._release()
        if self.owned_dir is not None:
            with contextlib.suppress(OSError):
                self.host.call(remove_tree, self.owned_dir)

    async def kill(self) -> None:
        """Kill every process of the box, wait for bubblewrap, and remove its state; when another teardown of
        the box is under way (``kill_now`` at exit, in another thread), wait until it is done."""
        if not self._closing():
            # Polled on the loop, not waited for in a thread: that teardown may itself need one of the
            # loop's executor threads (its release, off the loop while other boxes start or stop).
            deadline = time.monotonic() + TEARDOWN_WAIT
            while not self._released.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return
        global _STOPPING
        _STOPPING += 1
        try:
            died_before = self._proc is not None and self._proc.returncode is not None
            self._signal_all()
            for proc in (self._network.proc, self._proc):
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError, asyncio.TimeoutError):
                        await asyncio.wait_for(proc.wait(), timeout=10)
            if died_before:
                # bubblewrap was killed from outside (or crashed), perhaps before its sandbox-side
                # half armed --die-with-parent: that half, in its own session, would wait forever.
                await _off_loop(_lifetime.kill_bubblewraps_of, self.name)
        finally:  # whatever happened on the way (a cancelled stop, an exiting interpreter), it is released
            try:
                if _STARTING or _STOPPING > 1:
                    # In a thread while other boxes start or stop: its unmounts and cgroup removals (which
                    # wait for killed processes to leave) would hold up theirs on the loop.
                    await _off_loop(self._release)
                else:  # alone: no thread's hop
                    self._release()
            finally:
                _STOPPING -= 1

    def unmount(self) -> None:
        """Detach the box's host mounts (idempotent)."""
        while self.mounts:
            with contextlib.suppress(OSError):
                self.host.call(unmount, self.mounts.pop())

    def _closing(self) -> bool:
        """Claim the box's teardown and mark it stopped (no more commands); ``False`` if it already was."""
        global _LAST_BUSY
        _LAST_BUSY = time.monotonic()
        with self._claim:
            if self.closed:
                return False
            self.supervisor.closed = True
            return True

    def _signal_all(self) -> None:
        for proc in (self._network.proc, self._proc):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, OSError):
                    # bwrap runs in its own session: kill the whole process group;
                    # the box's PID namespace dies with its init (--die-with-parent).
                    os.killpg(proc.pid, signal.SIGKILL)

    def _release(self) -> None:
        self._started()
        if self._parked is not None:  # a launcher this box took but never started from: killed
            self._parked.kill_now()
        # Usually empty by now; anything that escaped the namespace's death is killed here.
        try:
            self._cgroups.kill_and_remove()
            self._cleanup_files()
            self.unmount()
            _lifetime.LIVE.discard(self)
        finally:
            self._released.set()

    def _cleanup_files(self) -> None:
        for client in (self.supervisor, self.control):
            with contextlib.suppress(FileNotFoundError):
                client.socket_path.unlink()
            client.forget_address()
        self._network.close()


class ViewBox:
    """A verifier's supervisor running in a box (:meth:`Box.open_view`): its commands go through
    :attr:`supervisor`; the box's keel answers for its health and kills it."""

    def __init__(self, box: Box, supervisor: SupervisorClient, pid: int):
        self.box = box
        self.supervisor = supervisor
        #: Its PID in the keel's namespace, and on the host (once known).
        self.pid, self.host_pid = pid, None
        self._network = UserNetwork()

    @property
    def closed(self) -> bool:
        """Whether the view is stopped (or being stopped)."""
        return self.supervisor.closed or self.box.closed

    @property
    def control(self) -> SupervisorClient:
        """The box's keel (the sandbox's health is the box's)."""
        return self.box.control

    def resource_exhaustion(self) -> str | None:
        """Which of its limits the agent ran into (the box's)."""
        return self.box.resource_exhaustion()

    async def set_network(self, network: NetworkMode) -> None:
        """Attach (``"user"``) or detach (``"none"``) the view's own user-mode network."""
        if network == "user" and self._network.proc is None:
            if self.host_pid is None:
                raise SandboxError("the verifier's view has no process to attach a network to")
            await self._network.attach(self.host_pid)
        elif network == "none":
            await self._network.detach()

    async def kill(self) -> None:
        """Kill every process of the view (the box's keel does, by the view's network namespace); idempotent."""
        if self.supervisor.closed:
            return
        self.supervisor.closed = True
        with contextlib.suppress(SandboxError):
            if not self.box.closed:
                await self.box.control._control("unview", str(self.pid))
        await self._network.detach()
        with contextlib.suppress(FileNotFoundError):
            self.supervisor.socket_path.unlink()
        self.supervisor.forget_address()


def _listener_pid(address: str) -> int:
    """The host PID of the process that listens on the unix socket ``address`` (``SO_PEERCRED``: the
    kernel translates it into this PID namespace; no walk of a process tree that changes meanwhile)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.connect(address)
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid = struct.unpack("3i", creds)[0]
    if pid <= 0:
        raise SandboxError("the verifier's view has no process to attach a network to")
    return pid


class UserNetwork:
    """A user-mode network stack (slirp4netns) in a box's network namespace, not reaching the host's loopback.

    It exits when its exit pipe closes, whose write end only this process holds: with it, however it dies."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self._exit_w: int | None = None

    async def attach(self, child_pid: int) -> None:
        """Attach a stack to the network namespace of ``child_pid`` (the box's init; ``SandboxStartError``)."""
        tool = which("slirp4netns")
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
            self.proc = await asyncio.create_subprocess_exec(
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
            self._exit_w, exit_w = exit_w, -1
            if await asyncio.to_thread(os.read, ready_r, 1) != b"1":
                err = await self.proc.stderr.read() if self.proc.stderr else b""
                why = err.decode(errors="replace").strip()
                if not os.path.exists("/dev/net/tun"):
                    why += (
                        " (this machine has no /dev/net/tun, which the sandbox's network needs; in a container: "
                        "`docker run --device /dev/net/tun`, or a pod's device plug-in; or set the task's "
                        "network policy to no-network)"
                    )
                raise SandboxStartError(f"slirp4netns failed: {why}")
        finally:
            for fd in (ready_r, ready_w, exit_w):
                if fd >= 0:
                    os.close(fd)

    async def detach(self) -> None:
        """Stop the stack (the namespace keeps its loopback only); connections open at the switch break."""
        proc, self.proc = self.proc, None
        self.close()
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                proc.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=10)

    def close(self) -> None:
        """Close the exit pipe: the stack exits by itself (idempotent; safe at exit)."""
        if self._exit_w is not None:
            with contextlib.suppress(OSError):
                os.close(self._exit_w)
            self._exit_w = None


class SupervisorClient:
    """Requests to one box's supervisor, one per connection to its socket (protocol: ``_supervisor.c``)."""

    def __init__(self, socket_path: Path):
        self.socket_path = socket_path
        #: Set when the box is being stopped: every request fails from then on.
        self.closed = False
        self._dir_fd: int | None = None

    @property
    def address(self) -> str:
        """The socket's path as ``bind`` and ``connect`` take it: a unix socket's path has at most 107
        bytes, so a longer one (a deep ``HARBOR_LOCAL_SANDBOX_STATE_DIR``) is reached through its folder's
        descriptor."""
        if len(os.fsencode(self.socket_path)) < 100:
            return str(self.socket_path)
        if self._dir_fd is None:
            self._dir_fd = os.open(self.socket_path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return f"/proc/self/fd/{self._dir_fd}/{self.socket_path.name}"

    def forget_address(self) -> None:
        """Close the folder's descriptor :attr:`address` may hold (the box is gone)."""
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    async def run(
        self,
        command: str,
        *,
        cwd: str = "/",
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        output_cap: int = 1 << 20,
    ) -> dict:
        """Run ``command`` with ``bash -c`` and only ``env``: a dict of ``rc``, ``stdout``, ``stderr``, ``timed_out``.

        ``output_cap`` bytes are kept per stream (head and tail), the rest read and dropped; past
        ``timeout`` its whole process tree is killed (``SandboxTimeoutError``). ``SandboxCommandError``:
        the box is gone or its supervisor does not answer (as for every request).
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

    async def list_processes(self) -> list[str]:
        """The box's live processes but its supervisor, as ``"PID:START"`` (a reused PID gets another entry)."""
        return (await self._control("ps"))["stdout"].split()

    async def kill_processes(self, keep: Sequence[str] = ()) -> int:
        """Kill every process of the box's PID namespace but its supervisor and ``keep`` (however they detached).

        Returns how many were killed; the box stays usable.
        """
        return int((await self._control("kill", *keep))["rc"])

    async def _control(self, *fields: str, fds: Sequence[int] = ()) -> dict:
        """Send a control request (an empty working directory) to the supervisor, with ``fds``."""
        try:
            answer = await self._exchange([b"", *(f.encode() for f in fields)], 0, 1 << 20, 60, fds)
        except (TimeoutError, asyncio.IncompleteReadError, OSError) as error:
            raise SandboxCommandError(f"the sandbox's supervisor did not answer {fields[0]!r} ({error!r})") from error
        if answer["rc"] < 0:
            why = answer["stdout"].strip()
            raise SandboxCommandError(f"the sandbox's supervisor refused {fields[0]!r}" + (f": {why}" if why else ""))
        return answer

    async def _exchange(
        self, fields: list[bytes], timeout_ms: int, output_cap: int, wait: float | None, fds: Sequence[int] = ()
    ) -> dict:
        """Send one request (and its descriptors) to the supervisor and read its answer."""
        if self.closed:
            raise SandboxCommandError("the sandbox has been stopped")
        body = struct.pack("<III", timeout_ms, output_cap, len(fields))
        body += b"".join(struct.pack("<I", len(f)) + f for f in fields)
        message = struct.pack("<I", len(body)) + body
        try:
            if fds:
                reader, writer = await _connect_sending(self.address, message, fds)
            else:
                reader, writer = await asyncio.open_unix_connection(self.address)
        except OSError as error:
            raise SandboxCommandError(f"the sandbox is not running ({error})") from error
        try:
            if not fds:
                writer.write(message)
                await writer.drain()
            return await asyncio.wait_for(_read_answer(reader, output_cap), timeout=wait)
        finally:
            writer.close()


async def _connect_sending(
    address: str, message: bytes, fds: Sequence[int]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to ``address`` and send ``message`` with ``fds`` attached (SCM_RIGHTS) on its first bytes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, address)
        sock.setblocking(True)
        sent = sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
        if sent < len(message):
            sock.sendall(message[sent:])
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


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


#: Seconds a teardown of a box waits for another one already under way.
TEARDOWN_WAIT = 60.0
#: ``/proc/net/unix``'s flag of a socket that accepts connections (``__SO_ACCEPTCON``).
_SO_ACCEPTCON = 0x10000
#: Sockets of the agent's a verifier's view serves at most.
MAX_SOCKETS = 64


async def _off_loop(func, *args) -> None:
    """Run blocking work in a thread, or inline while the interpreter exits (no thread starts then)."""
    try:
        await asyncio.to_thread(func, *args)
    except RuntimeError as error:
        if "shutdown" not in str(error):
            raise
        func(*args)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


#: The nice value of a view's PATH watcher (:func:`_favour_children`).
WATCHER_NICE = -10


def _favour_children(pid: int) -> None:
    """Give the children of a view's supervisor as it starts serving, its PATH watcher
    (``_supervisor.c``; none when the agent added no command), the CPU first (nice
    :data:`WATCHER_NICE`; as root).

    The watcher makes a command the verifier installs win over the agent's of that name (it
    removes the agent's from the view) before the install's call returns: every call of the
    verifier's processes that makes a name waits for it (a seccomp notification), so on a busy
    machine a watcher at the default priority would slow every file the verifier writes."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return
    for child in children:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(child), WATCHER_NICE)


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
