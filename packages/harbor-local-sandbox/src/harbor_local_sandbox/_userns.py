"""Task images without root: a user namespace of this user's in which the image machinery is root.

Rootless podman's design, for the local sandbox: as a user that is not root, a *holder* process
(one per process that runs sandboxes, started at the first image-rooted sandbox) creates a user
namespace and a mount namespace, and is root in them over 65,536 ids: this user's uid as 0 and,
through the setuid ``newuidmap``/``newgidmap``, its subordinate ids from ``/etc/subuid`` and
``/etc/subgid`` as 1-65535 — the mapping rootless buildah and podman use, so the files of an
image's layers keep their owners. In those namespaces everything root does for task images works
unchanged: buildah builds and mounts images as root, overlays and bounded tmpfs trees are mounted,
each sandbox's user namespace maps ids 0-65535 of the holder's, and the host-side file work on
sandbox trees (uploads, the verifier's snapshot, fingerprints, removal) has root's rights over them.

What runs there: commands through :meth:`Host.command` (``nsenter`` into the holder's namespaces:
buildah, bubblewrap), and functions of this package through :meth:`Host.call` (run by the holder
itself, over a Unix socket only this user can reach). The holder's mounts are in its mount
namespace only: they go when it does, with its owner (``PR_SET_PDEATHSIG``).

Without subordinate ids the holder maps this user's uid and gid as 0 and no other: see
:data:`SINGLE_ID_LIMITS`.

As root there is no holder: host-side work runs in the process itself, but for the verifier's views
(:meth:`Host.apart`), which *workers* of the same protocol make, in the host's namespaces — one per
CPU, each one view at a time: a batch of views made on the trainer's threads contended for its
interpreter's lock with its event loop (grading a batch of 16 on 2 cores cost 1.5-1.7x grading in
place; 1.10-1.20x with the workers and the views' later savings, ``benchmarks/grading.py``).

A worker or holder serves the process that started it only (``SO_PEERCRED``): it runs any function
of this package it is asked to, with root's rights over sandbox trees.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import os
import pickle
import pwd
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from harbor_local_sandbox._binaries import SYSTEM_PATH, state_root, which
from harbor_local_sandbox.errors import SandboxUnavailableError

#: Ids a holder maps when it can (0-65535: every uid of real images; ``nobody`` is 65534).
FULL_IDS = 65536
#: What differs from Docker when this user has no subordinate ids (errors and docs say it).
SINGLE_ID_LIMITS = (
    "without subordinate ids a user namespace holds one id: every file of an image and of a sandbox "
    "belongs to root in the sandbox (the layers' other owners become root), chown to another user fails, "
    "the image's other users cannot run commands, and a Dockerfile's RUN steps cannot be built (buildah "
    "sets each step's groups, which a one-id namespace refuses): only prebuilt images and Dockerfiles "
    "without RUN run"
)
#: How to give a user subordinate ids.
SUBID_FIX = (
    "give the user 65536 subordinate ids (an administrator: `usermod --add-subuids 100000-165535 "
    "--add-subgids 100000-165535 USER`; newuidmap and newgidmap come with Debian's uidmap package)"
)
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class IdRanges:
    """The ids a holder maps: this user's as 0, and ``count - 1`` subordinate ones from ``first_sub``.

    Attributes:
        uid: This user's uid (0 in the namespace).
        gid: Its gid.
        first_subuid: The first subordinate uid (1 in the namespace), or ``None`` (one id only).
        first_subgid: The first subordinate gid, likewise.
        count: Ids mapped from 0 (``FULL_IDS``, fewer when the ranges are smaller, 1 without them).
    """

    uid: int
    gid: int
    first_subuid: int | None
    first_subgid: int | None
    count: int


def _subordinate(path: str, names: tuple[str, ...]) -> tuple[int, int] | None:
    """The first ``start:count`` range of ``path`` for one of ``names``, or ``None``."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.strip().split(":")
        if len(fields) == 3 and fields[0] in names and fields[1].isdigit() and fields[2].isdigit():
            return int(fields[1]), int(fields[2])
    return None


@cache
def id_ranges() -> IdRanges:
    """What this user's holder maps: subordinate ids where ``/etc/subuid``/``subgid`` and the helpers give
    them; as root (in a container, without ``CAP_SYS_ADMIN``) its own ids 0-65535, mapped to themselves."""
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() == 0:
        return IdRanges(0, 0, 1, 1, min(FULL_IDS, _ids_from_zero()))
    try:
        names: tuple[str, ...] = (pwd.getpwuid(uid).pw_name, str(uid))
    except KeyError:
        names = (str(uid),)
    subuid, subgid = _subordinate("/etc/subuid", names), _subordinate("/etc/subgid", names)
    if os.environ.get("HARBOR_LOCAL_SANDBOX_IDS") == "single" or not (subuid and subgid):
        return IdRanges(uid, gid, None, None, 1)
    if not (which("newuidmap") and which("newgidmap")):
        return IdRanges(uid, gid, None, None, 1)
    count = min(FULL_IDS, subuid[1] + 1, subgid[1] + 1)
    return IdRanges(uid, gid, subuid[0], subgid[0], count)


def _ids_from_zero() -> int:
    """How many ids from 0 this process's own user namespace maps (all, outside user namespaces)."""
    try:
        first = Path("/proc/self/uid_map").read_text().split()[:3]
    except OSError:
        return FULL_IDS
    return int(first[2]) if len(first) == 3 and first[0] == "0" else 1


#: ``CAP_SYS_ADMIN``'s bit in ``/proc/self/status``'s capability masks.
_CAP_SYS_ADMIN = 21


@cache
def can_mount() -> bool:
    """Whether this process may mount file systems itself: root with ``CAP_SYS_ADMIN``.

    Root in a container usually lacks it (Docker's and Kubernetes' default capability sets drop
    it): task images then go through a holder too, as without root.
    """
    if os.geteuid() != 0:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    return False


class Host:
    """Where host-side work on image roots runs: here (as root), or in this user's holder (rootless).

    ``call`` runs a function of this package, ``command`` prefixes a command line, ``ids`` says how many
    ids a sandbox maps. The direct host (:data:`DIRECT`) is the process itself."""

    rootless = False
    ids = FULL_IDS

    @property
    def id_map(self) -> str:
        """A sandbox's uid and gid map: ids ``0..ids-1`` to the same ids here, one line per extent of
        this host's own map (the kernel maps each extent of a child's map within one of its parent's)."""
        return f"0 0 {self.ids}\n"

    def call(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func(*args)`` (blocking) with root's rights over sandbox trees; its result or its exception."""
        return func(*args)

    def call_fd(self, func: Callable[..., tuple[int, Any]], *args: Any) -> tuple[int, Any]:
        """:meth:`call` for a function that returns a descriptor (a mount tree) and a value: the
        descriptor is one of this process's."""
        return func(*args)

    def command(self) -> list[str]:
        """The prefix that runs a command line in this host's namespaces (empty: here)."""
        return []

    def apart(self) -> Host:
        """This host's rights in a process apart from this one, for work that must not take this
        interpreter's lock from its event loop (the verifier's views: a walk and a dozen mounts each,
        a batch at once): as root, one of this process's workers (:func:`worker`)."""
        return worker()


#: Root's host: the process itself.
DIRECT = Host()


class _Served(Host):
    """A host that is a process of this package's serving ``call`` on a Unix socket only this user can reach."""

    socket_path: Path
    proc: subprocess.Popen

    def call(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func(*args)`` there (a module-level function of this package; picklable arguments)."""
        return self._call(func, args, False)

    def call_fd(self, func: Callable[..., tuple[int, Any]], *args: Any) -> tuple[int, Any]:
        """:meth:`call` for a function that returns a descriptor and a value: the descriptor is sent
        over (SCM_RIGHTS), ahead of the value."""
        return self._call(func, args, True)

    def _call(self, func: Callable[..., Any], args: tuple, returns_fd: bool) -> Any:
        request = pickle.dumps((func.__module__, func.__qualname__, args, returns_fd))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket_path))
            conn.sendall(struct.pack("<Q", len(request)) + request)
            fd = _receive_fd(conn) if returns_fd else None
            ok, value = pickle.loads(_read_message(conn))
        if not ok:
            if fd is not None:
                os.close(fd)
            raise value
        return (fd, value) if returns_fd else value

    def apart(self) -> Host:
        """Itself: already a process apart."""
        return self


def _serving_process(socket_path: Path, main: str) -> subprocess.Popen:
    """Start ``python -I`` running this module's ``main`` on ``socket_path``, its standard streams piped."""
    src = str(Path(__file__).resolve().parents[1])  # the folder that holds this package, for its imports
    env = {"PATH": SYSTEM_PATH, "PYTHONPATH": src, "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8"}
    for name in ("TMPDIR", "HARBOR_LOCAL_SANDBOX_STATE_DIR", "HARBOR_LOCAL_SANDBOX_CACHE_DIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    return subprocess.Popen(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {src!r}); "
         f"from harbor_local_sandbox._userns import {main}; {main}()", str(socket_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        start_new_session=True, cwd="/",
    )  # fmt: skip


class Worker(_Served):
    """One of root's workers (:meth:`Host.apart`): a process of this package's in the host's namespaces
    that runs ``call`` requests one at a time (a batch of them does not contend for one interpreter's
    lock) and exits when its owner does (its standard input closes)."""

    def __init__(self, socket_path: Path):
        self.socket_path = socket_path
        #: Calls it was chosen for (:func:`worker`) and has not answered yet.
        self.busy = 0
        self.proc = _serving_process(socket_path, "serve_worker")
        assert self.proc.stdout is not None
        if self.proc.stdout.read(1) != b"r":
            self.proc.kill()
            self.proc.wait()
            err = self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
            raise SandboxUnavailableError(f"the sandboxes' worker process did not start: {err[-800:] or 'no output'}")

    def _call(self, func: Callable[..., Any], args: tuple, returns_fd: bool) -> Any:
        try:
            return super()._call(func, args, returns_fd)
        finally:
            with _LOCK:
                self.busy = max(0, self.busy - 1)


class Holder(_Served):
    """A holder process (see the module docstring) and the Unix socket it serves ``call`` on."""

    rootless = True

    def __init__(self, ranges: IdRanges, socket_path: Path):
        self.ranges = ranges
        self.ids = ranges.count
        self.socket_path = socket_path
        self.proc = self._start()

    @property
    def id_map(self) -> str:
        """This user's id as 0, the subordinate ids as 1 onwards: two extents, as in the holder's own map."""
        return "0 0 1\n" if self.ids == 1 else f"0 0 1\n1 1 {self.ids - 1}\n"

    def _start(self) -> subprocess.Popen:
        proc = _serving_process(self.socket_path, "serve")
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if proc.stdout.read(1) != b"u":
                raise SandboxUnavailableError(self._failure(proc, "could not create a user namespace"))
            self._map(proc.pid)
            proc.stdin.write(b"g")
            proc.stdin.flush()
            if proc.stdout.read(1) != b"r":
                raise SandboxUnavailableError(self._failure(proc, "did not start"))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return proc

    def _map(self, pid: int) -> None:
        r = self.ranges
        if os.geteuid() == 0:  # root may map its own ids itself
            Path(f"/proc/{pid}/uid_map").write_text(self.id_map)
            Path(f"/proc/{pid}/gid_map").write_text(self.id_map)
            return
        if r.first_subuid is None:
            Path(f"/proc/{pid}/setgroups").write_text("deny")
            Path(f"/proc/{pid}/uid_map").write_text(f"0 {r.uid} 1\n")
            Path(f"/proc/{pid}/gid_map").write_text(f"0 {r.gid} 1\n")
            return
        for tool, own, first in (("newuidmap", r.uid, r.first_subuid), ("newgidmap", r.gid, r.first_subgid)):
            argv = [which(tool) or tool, str(pid), "0", str(own), "1"]
            if r.count > 1:
                argv += ["1", str(first), str(r.count - 1)]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise SandboxUnavailableError(
                    f"{tool} could not map this user's subordinate ids ({done.stderr.strip()}); "
                    f"check /etc/subuid and /etc/subgid, or {SUBID_FIX}"
                )

    @staticmethod
    def _failure(proc: subprocess.Popen, what: str) -> str:
        with contextlib.suppress(Exception):
            proc.kill()
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        return (
            f"task images without root need a user namespace of this user's; its holder {what}: "
            f"{err[-800:] or 'no output'} (unprivileged user namespaces must be allowed: "
            "kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)"
        )

    def command(self) -> list[str]:
        """``nsenter`` into the holder's user and mount namespaces, as their root (this user's uid is 0 there;
        with one id, groups cannot be dropped, so the credentials are kept as they are)."""
        keep = ["--preserve-credentials"] if self.ids == 1 else []
        return [which("nsenter") or "nsenter", "-t", str(self.proc.pid), "--user", "--mount", *keep, "--"]


_LOCK = threading.Lock()
_HOLDER: tuple[int, Holder] | None = None
_WORKERS: tuple[int, list[Worker | None]] | None = None


def worker_sockets() -> Path:
    """Where root's workers listen (apart from the sandboxes' trees; a dead owner's are swept with them)."""
    folder = state_root() / "workers"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _stop_workers(workers: tuple[int, list[Worker | None]]) -> None:
    """At exit: this process's workers told to go (their standard input closed), their sockets removed
    now (a worker removes its own as it goes, a moment later)."""
    if workers[0] != os.getpid():
        return  # a forked child's exit: the workers are its parent's
    for chosen in workers[1]:
        if chosen is not None:
            with contextlib.suppress(OSError):
                if chosen.proc.stdin is not None:
                    chosen.proc.stdin.close()
            chosen.socket_path.unlink(missing_ok=True)


def worker() -> Worker:
    """One of root's workers for this process, for one call (:meth:`Host.apart`): the one with the
    fewest calls under way (one per CPU this process may use, each started at first use and again
    if it died)."""
    global _WORKERS
    with _LOCK:
        if _WORKERS is None or _WORKERS[0] != os.getpid():
            _WORKERS = (os.getpid(), [None] * max(1, len(os.sched_getaffinity(0))))
            atexit.register(_stop_workers, _WORKERS)
        slots = _WORKERS[1]
        # A view's walk grows with what the agent added: a long one must not hold the next views
        # back while another worker idles (a slot not started yet counts as idle).
        turn = min(range(len(slots)), key=lambda i: slots[i].busy if slots[i] is not None else 0)
        chosen = slots[turn]
        if chosen is None or chosen.proc.poll() is not None:
            path = worker_sockets() / f"{os.getpid()}-{turn}.sock"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            chosen = slots[turn] = Worker(path)
        chosen.busy += 1
        return chosen


def host() -> Host:
    """The host of this process's image roots: :data:`DIRECT` as root with ``CAP_SYS_ADMIN``, else this
    user's holder (started once per process)."""
    global _HOLDER
    if can_mount():
        return DIRECT
    with _LOCK:
        if _HOLDER is None or _HOLDER[0] != os.getpid() or _HOLDER[1].proc.poll() is not None:
            path = state_root() / f"{os.getpid()}-holder.sock"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            _HOLDER = (os.getpid(), Holder(id_ranges(), path))
        return _HOLDER[1]


@cache
def in_user_namespace() -> bool:
    """Whether this process runs in a user namespace other than the machine's (overlays keep ``user.`` xattrs)."""
    try:
        fields = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return False
    return fields[:3] != ["0", "0", "4294967295"]


def overlay_xattr(name: str) -> str:
    """The xattr an overlay keeps ``name`` in: ``user.overlay.`` in a user namespace, else ``trusted.``."""
    return f"{'user' if in_user_namespace() else 'trusted'}.overlay.{name}"


# -- the holder's side ------------------------------------------------------------------------------


def _read_message(conn: socket.socket) -> bytes:
    header = _read_exactly(conn, 8)
    return _read_exactly(conn, struct.unpack("<Q", header)[0])


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the holder closed the connection")
        data += chunk
    return bytes(data)


def _receive_fd(conn: socket.socket) -> int | None:
    """The descriptor the holder sends ahead of its answer (one byte, with it or without)."""
    _, ancillary, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(struct.calcsize("i")))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS and len(data) >= 4:
            fd = struct.unpack("i", data[:4])[0]
            os.set_inheritable(fd, False)
            return fd
    return None


def _peer_pid(conn: socket.socket) -> int:
    """The process at the other end of a Unix socket, as the kernel saw it connect (``SO_PEERCRED``)."""
    size = struct.calcsize("3i")
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size))[0]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        # Only the owner (the process that started this one) is served: it runs any function of this
        # package it is asked to, with root's rights over sandbox trees. The socket's folder (this
        # user's only) keeps others out too; this holds whatever its mode becomes.
        if _peer_pid(self.request) != os.getppid():
            return  # closed unanswered: the caller sees the connection end
        returns_fd = False
        try:
            module, name, args, returns_fd = pickle.loads(_read_message(self.request))
            func: Any = importlib.import_module(module)  # (waits for another thread's import of it)
            for part in name.split("."):
                func = getattr(func, part)
            answer: tuple[bool, Any] = (True, func(*args))
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
            answer = (False, error)
        if returns_fd:
            fd, value = answer[1] if answer[0] else (None, None)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))] if fd is not None else []
            self.request.sendmsg([b"f"], rights)
            if fd is not None:
                os.close(fd)
                answer = (True, value)
        try:
            data = pickle.dumps(answer)
        except Exception as error:  # noqa: BLE001 - an exception that does not pickle
            data = pickle.dumps((False, OSError(f"{type(answer[1]).__name__}: {answer[1]} ({error})")))
        self.request.sendall(struct.pack("<Q", len(data)) + data)


def serve() -> None:
    """The holder's main: make the namespaces, wait for the owner to map the ids, serve ``call`` requests."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        sys.exit(1)
    os.unshare(_CLONE_NEWUSER | _CLONE_NEWNS)
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    out.write(b"u")
    out.flush()
    if inp.read(1) != b"g":
        sys.exit(1)
    # Mapped now: this process is the namespace's root. Its mounts stay its own.
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        sys.exit(f"making the holder's mounts private failed: {os.strerror(ctypes.get_errno())}")
    os.environ["_CONTAINERS_USERNS_CONFIGURED"] = "1"
    path = sys.argv[1]
    old = os.umask(0o077)
    server = socketserver.ThreadingUnixStreamServer(path, _Handler)
    os.umask(old)
    server.daemon_threads = True
    out.write(b"r")
    out.flush()
    server.serve_forever()


class _OneAtATime(socketserver.UnixStreamServer):
    request_queue_size = 256  # a batch's views connect at once; each waits its turn


def serve_worker() -> None:
    """The worker's main: serve ``call`` requests one at a time until the owner exits (its end of
    standard input closes)."""

    path = sys.argv[1]

    def exit_with_owner() -> None:
        sys.stdin.buffer.read()
        with contextlib.suppress(OSError):
            os.unlink(path)
        os._exit(0)

    threading.Thread(target=exit_with_owner, daemon=True).start()
    old = os.umask(0o077)
    server = _OneAtATime(path, _Handler)
    os.umask(old)
    sys.stdout.buffer.write(b"r")
    sys.stdout.buffer.flush()
    # Started: its failures go back to each caller; a pipe nobody reads must not fill and stop it.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    server.serve_forever()
