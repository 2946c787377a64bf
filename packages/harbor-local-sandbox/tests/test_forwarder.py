"""The TCP forwarder (``_forwarder.c``) between a sandbox's agent network namespace and its verifier's.

Two fresh network namespaces, each held by a process: the *agent's*, where the forwarder runs and the
"agent's services" listen, and the *view* (the verifier's), where the forwarder mirrors them. This test
process moves its own thread between them (``os.setns``; a socket keeps the namespace it was created in)
to start servers and clients in either.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harbor_local_sandbox._binaries import static_binary
from sandbox_testing import requires_local

pytestmark = [
    requires_local,
    pytest.mark.skipif(os.geteuid() != 0, reason="making network namespaces and entering them needs root"),
]

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# A namespace holder: unshares a network namespace, says so, and waits to be killed.
HOLDER = "import os, signal; os.unshare(os.CLONE_NEWNET); print('ready', flush=True); signal.pause()"
BULK = 8 * 1024 * 1024


@contextmanager
def netns(fd: int) -> Iterator[None]:
    """Run the block with this thread in the network namespace ``fd`` (sockets made there stay there)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    os.setns(fd, os.CLONE_NEWNET)
    try:
        yield
    finally:
        os.setns(home, os.CLONE_NEWNET)
        os.close(home)


def _lo_up() -> None:
    """Bring up the loopback interface of the current thread's network namespace."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _holder() -> tuple[subprocess.Popen, int]:
    """A process in a fresh network namespace (loopback up) and a descriptor of that namespace."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", HOLDER], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    fd = os.open(f"/proc/{proc.pid}/ns/net", os.O_RDONLY)
    with netns(fd):
        _lo_up()
    return proc, fd


def _ipv6_works(fd: int) -> bool:
    with netns(fd), closing(socket.socket(socket.AF_INET6)) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            return False
    return True


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


class Server:
    """A threaded TCP server, created in the current thread's network namespace."""

    def __init__(self, host: str, port: int, handler: Callable[[socket.socket], None] = echo, v6only: bool = True):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.sock.settimeout(0.05)
        self.handler, self.stop = handler, threading.Event()
        self.lock, self.active, self.peak = threading.Lock(), 0, 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(20)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            with conn:
                self.handler(conn)
        except OSError:
            pass
        finally:
            with self.lock:
                self.active -= 1

    def close(self) -> None:
        """Stop accepting and close the listening socket (after its thread is done with it)."""
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def connect(ns: int, host: str, port: int, timeout: float = 5) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with netns(ns):
        s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
    except BaseException:
        s.close()
        raise
    return s


def recv_all(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def roundtrip(ns: int, host: str, port: int, payload: bytes = b"ping") -> bytes:
    """Send ``payload`` and a half-close; return everything that came back before the EOF."""
    with closing(connect(ns, host, port)) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        return recv_all(s)


def echoes(ns: int, host: str, port: int) -> bool:
    try:
        return roundtrip(ns, host, port, b"ping") == b"ping"
    except OSError:
        return False


@dataclass
class Rig:
    """Two namespaces and a forwarder between them (started by ``start``)."""

    agent: int
    view: int
    holders: list[subprocess.Popen]
    watched: subprocess.Popen | None = None
    forwarder: subprocess.Popen | None = None
    servers: list[Server] = field(default_factory=list)

    def start(self, mode: str = "diag", nofile: int | None = None, binds: int | None = None) -> subprocess.Popen:
        """Start the forwarder from the agent's namespace, watching a process of our own (with
        ``nofile``, under that descriptor limit; with ``binds``, that bind filter's listener)."""
        self.watched = subprocess.Popen(["sleep", "infinity"])
        pidfd = os.pidfd_open(self.watched.pid)
        try:
            argv = [static_binary("forwarder"), str(self.agent), str(self.view), str(pidfd)]
            argv += [] if binds is None else [str(binds)]
            if nofile is not None:
                argv = ["sh", "-c", f'ulimit -n {nofile} && exec "$@"', "sh", *argv]
            env = {"FORWARDER_SCAN": "proc"} if mode == "proc" else {}
            with netns(self.agent):
                self.forwarder = subprocess.Popen(
                    argv, pass_fds=(self.agent, self.view, pidfd, *([] if binds is None else [binds])), env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
        finally:
            os.close(pidfd)
        return self.forwarder

    def serve(self, ns: int, host: str, port: int, **kwargs) -> Server:
        with netns(ns):
            server = Server(host, port, **kwargs)
        self.servers.append(server)
        return server

    def wait_for(self, what: Callable[[], bool], timeout: float = 2.0) -> float:
        """Seconds until ``what()`` holds; fails after ``timeout`` or if the forwarder died."""
        start = time.monotonic()
        while not what():
            assert self.forwarder is not None and self.forwarder.poll() is None, f"forwarder exited: {self.forwarder}"
            assert time.monotonic() - start < timeout, f"not within {timeout} s"
            time.sleep(0.02)
        return time.monotonic() - start

    def close(self) -> None:
        for server in self.servers:
            server.close()
        for proc in (self.forwarder, self.watched, *self.holders):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait(5)
        for fd in (self.agent, self.view):
            os.close(fd)


def make_rig() -> Rig:
    agent_holder, agent = _holder()
    view_holder, view = _holder()
    return Rig(agent=agent, view=view, holders=[agent_holder, view_holder])


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """A running forwarder; its listing mode (``diag`` or ``proc``) from indirect parametrization."""
    rig = make_rig()
    try:
        rig.start(getattr(request, "param", "diag"))
        yield rig
    finally:
        rig.close()


both_modes = pytest.mark.parametrize("rig", ["diag", "proc"], indirect=True)


def test_bad_usage_exits_2() -> None:
    binary = static_binary("forwarder")
    assert subprocess.run([binary], capture_output=True).returncode == 2
    assert subprocess.run([binary, "x", "4", "5"], capture_output=True).returncode == 2
    assert subprocess.run([binary, "900", "901", "902"], capture_output=True).returncode == 2  # not open


@both_modes
def test_runs_in_the_agent_namespace_and_lists_as_told(rig: Rig, request: pytest.FixtureRequest) -> None:
    assert rig.forwarder is not None
    pid = rig.forwarder.pid
    rig.serve(rig.agent, "127.0.0.1", 8079)
    rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8079))  # it lists the agent's listeners
    # Between rounds it is in the agent's namespace (it enters the view only to make sockets there).
    assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.fstat(rig.agent).st_ino
    links = [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
    # (the files opened in the view read "(deleted)": the thread's net folder is another one now)
    proc_files = [link for link in links if link.split(" ")[0].endswith(("/net/tcp", "/net/tcp6"))]
    if request.node.callspec.params["rig"] == "proc":
        assert len(proc_files) == 4, links  # tcp and tcp6 of each namespace
    else:
        assert proc_files == [], links


@both_modes
def test_loopback_listener_is_mirrored_at_its_address(rig: Rig) -> None:
    rig.serve(rig.agent, "127.0.0.1", 8080)
    rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8080))
    assert roundtrip(rig.view, "127.0.0.1", 8080, b"x" * 100_000) == b"x" * 100_000
    with pytest.raises(ConnectionRefusedError):  # the agent listens on 127.0.0.1 only
        connect(rig.view, "127.0.1.1", 8080)


@both_modes
def test_wildcard_listener_is_reachable_on_every_loopback_address(rig: Rig) -> None:
    rig.serve(rig.agent, "0.0.0.0", 8081)
    rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8081))
    assert echoes(rig.view, "127.0.1.1", 8081)  # the sandbox's hostname
    assert echoes(rig.view, "127.0.0.2", 8081)


@both_modes
def test_ipv6_listeners(rig: Rig) -> None:
    if not _ipv6_works(rig.agent) or not _ipv6_works(rig.view):
        pytest.skip("no IPv6 loopback in new network namespaces here")
    rig.serve(rig.agent, "::1", 8082)
    rig.serve(rig.agent, "::", 8083, v6only=False)  # dual-stack
    rig.wait_for(lambda: echoes(rig.view, "::1", 8082))
    rig.wait_for(lambda: echoes(rig.view, "::1", 8083))
    assert echoes(rig.view, "127.0.0.1", 8083)  # the dual-stack listener's IPv4 side
    assert echoes(rig.view, "127.0.1.1", 8083)
    with pytest.raises(ConnectionRefusedError):
        connect(rig.view, "127.0.0.1", 8082)


def test_connection_the_agent_refuses_is_closed_in_the_view(rig: Rig) -> None:
    if not _ipv6_works(rig.agent) or not _ipv6_works(rig.view):
        pytest.skip("no IPv6 loopback in new network namespaces here")
    # An IPv6-only `::` looks dual-stack from outside: 0.0.0.0 is listened on in the view too, and
    # what comes there is relayed to 127.0.0.1 in the agent's namespace, which refuses it.
    rig.serve(rig.agent, "::", 8084, v6only=True)
    rig.wait_for(lambda: echoes(rig.view, "::1", 8084))
    try:
        s = connect(rig.view, "127.0.0.1", 8084)  # accepted by the forwarder (not refused)...
    except ConnectionResetError:  # ...and reset once the agent's side is refused: before connect returned
        return
    with closing(s):
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:  # or after
            pass


@both_modes
def test_listener_that_appears_later_becomes_reachable(rig: Rig) -> None:
    time.sleep(0.3)
    assert not echoes(rig.view, "127.0.0.1", 8085)
    rig.serve(rig.agent, "127.0.0.1", 8085)
    took = rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8085))
    assert took < 2.0


@both_modes
def test_port_is_freed_in_the_view_when_the_agent_stops_listening(rig: Rig) -> None:
    server = rig.serve(rig.agent, "127.0.0.1", 8086)
    rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8086))

    def view_binds() -> bool:
        try:
            rig.serve(rig.view, "127.0.0.1", 8086)  # a server of the verifier's own, SO_REUSEADDR
        except OSError as e:
            assert e.errno == errno.EADDRINUSE
            return False
        return True

    assert not view_binds()  # the forwarder holds the port while the agent listens
    server.close()
    rig.wait_for(view_binds)
    assert echoes(rig.view, "127.0.0.1", 8086)  # now the view's own server


def test_8mb_each_way_with_half_close(rig: Rig) -> None:
    from_agent = os.urandom(BULK)
    from_view = os.urandom(BULK)

    def handler(conn: socket.socket) -> None:
        # Sends its 8 MB while it reads; after the client's EOF, the digest of what it read.
        def send() -> None:
            try:
                conn.sendall(from_agent)
            except OSError:  # the readiness probe below connects and leaves at once
                pass

        sender = threading.Thread(target=send)
        sender.start()
        digest = hashlib.sha256()
        while chunk := conn.recv(1 << 16):
            digest.update(chunk)
        sender.join()
        conn.sendall(digest.digest())
        conn.shutdown(socket.SHUT_WR)

    rig.serve(rig.agent, "127.0.0.1", 8087, handler=handler)
    rig.wait_for(lambda: connect_ok(rig.view, "127.0.0.1", 8087))
    with closing(connect(rig.view, "127.0.0.1", 8087, timeout=20)) as s:

        def send() -> None:
            s.sendall(from_view)
            s.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        received = recv_all(s)
        sender.join()
    assert len(received) == BULK + 32
    assert hashlib.sha256(received[:BULK]).digest() == hashlib.sha256(from_agent).digest()
    assert received[BULK:] == hashlib.sha256(from_view).digest()


def connect_ok(ns: int, host: str, port: int) -> bool:
    """Whether the forwarder's listener is there (a connection that is not refused)."""
    try:
        connect(ns, host, port).close()
    except OSError:
        return False
    return True


def test_50_concurrent_connections(rig: Rig) -> None:
    server = rig.serve(rig.agent, "127.0.0.1", 8088)
    rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8088))
    conns = [connect(rig.view, "127.0.0.1", 8088) for _ in range(50)]
    try:
        for i, s in enumerate(conns):
            s.sendall(b"%03d" % i)
        for i, s in enumerate(conns):
            got = b""
            while len(got) < 3:
                got += s.recv(3 - len(got))
            assert got == b"%03d" % i
        assert server.active == 50
    finally:
        for s in conns:
            s.close()
    rig.wait_for(lambda: server.active == 0)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_stalled_reader_holds_data_back_without_spinning(rig: Rig) -> None:
    assert rig.forwarder is not None
    gate, received = threading.Event(), []

    def handler(conn: socket.socket) -> None:
        gate.wait(10)
        digest = hashlib.sha256()
        while chunk := conn.recv(1 << 16):
            digest.update(chunk)
        received.append(digest.digest())

    rig.serve(rig.agent, "127.0.0.1", 8091, handler=handler)
    rig.wait_for(lambda: connect_ok(rig.view, "127.0.0.1", 8091))
    # More than every socket buffer on the way can take (client's send buffer up to tcp_wmem's 4 MB,
    # the forwarder's receive buffer up to tcp_rmem's 32 MB, its send buffer, the stalled server's).
    data = os.urandom(8 * BULK)
    with closing(connect(rig.view, "127.0.0.1", 8091, timeout=20)) as s:

        def send() -> None:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.3)  # every buffer on the way is full by now
        before = cpu_seconds(rig.forwarder.pid)
        time.sleep(1)
        spent = cpu_seconds(rig.forwarder.pid) - before
        assert sender.is_alive()  # the forwarder holds back what the agent does not read
        gate.set()
        sender.join(20)
    assert spent < 0.2
    rig.wait_for(lambda: hashlib.sha256(data).digest() in received, timeout=10)


def test_connections_beyond_the_bound_are_closed() -> None:
    rig = make_rig()
    try:
        rig.start(nofile=600)  # room for (600 - 512 listeners - 32) / 2 = 28 pairs
        rig.serve(rig.agent, "127.0.0.1", 8092)
        rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8092))
        conns, relayed, closed = [], 0, 0
        for _ in range(40):
            try:
                conns.append(connect(rig.view, "127.0.0.1", 8092, timeout=3))
            except ConnectionResetError:  # reset before connect returned
                closed += 1
        for s in conns:
            try:
                s.sendall(b"abc")
                answer = s.recv(3)
            except (ConnectionResetError, BrokenPipeError):
                answer = b""
            relayed += answer == b"abc"
            closed += answer == b""
        assert (relayed, closed) == (28, 12)
        for s in conns:
            s.close()
        rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8092))
    finally:
        rig.close()


def asks(ns: int, port: int) -> Callable[[socket.socket], None]:
    """A handler for the agent's server: for each request, ask the service on ``port`` (in ``ns``,
    from the thread the server made the connection in) and answer with what it said."""

    def handle(conn: socket.socket) -> None:
        conn.recv(100)
        try:
            answer = roundtrip(ns, "127.0.0.1", port, b"ask")
        except OSError as error:
            answer = f"refused {type(error).__name__}".encode()
        conn.sendall(answer)

    return handle


def says(word: bytes) -> Callable[[socket.socket], None]:
    def handle(conn: socket.socket) -> None:
        conn.recv(100)
        conn.sendall(word)

    return handle


def _refused_or_reset(ns: int, port: int) -> bool:
    try:
        return roundtrip(ns, "127.0.0.1", port) == b""  # accepted, then closed without a word
    except (ConnectionRefusedError, ConnectionResetError):
        return True


@both_modes
def test_the_verifiers_service_answers_the_agents_server_while_it_serves_the_verifier(rig: Rig) -> None:
    # The tests start a service (the agent's server depends on it), then ask the agent's server.
    rig.serve(rig.agent, "127.0.0.1", 8095, handler=asks(rig.agent, 9095))
    rig.wait_for(lambda: _refused_or_reset(rig.agent, 9095) and _answer(rig.view, 8095).startswith(b"refused"))
    rig.serve(rig.view, "127.0.0.1", 9095, handler=says(b"token-1"))
    rig.wait_for(lambda: _answer(rig.view, 8095) == b"token-1")
    # The agent's own processes, on their own (no request of the verifier's in flight), are reset.
    assert _refused_or_reset(rig.agent, 9095)
    # The verifier's service stops: its mirror in the agent's namespace goes, and nothing loops.
    rig.servers[-1].close()
    rig.wait_for(lambda: _answer(rig.view, 8095).startswith(b"refused"))
    with pytest.raises(ConnectionRefusedError):
        connect(rig.view, "127.0.0.1", 9095)


def _answer(ns: int, port: int) -> bytes:
    try:
        return roundtrip(ns, "127.0.0.1", port, b"health")
    except OSError as error:
        return f"error {error}".encode()


def test_a_wildcard_service_of_the_verifiers_is_reached_at_the_agents_loopback(rig: Rig) -> None:
    rig.serve(rig.agent, "127.0.0.1", 8096, handler=asks(rig.agent, 9096))
    rig.serve(rig.view, "0.0.0.0", 9096, handler=says(b"any"))
    rig.wait_for(lambda: _answer(rig.view, 8096) == b"any")


def test_the_agent_keeps_a_port_it_listens_on(rig: Rig) -> None:
    # The agent listens on 9097 itself (at another address): the verifier's service on that port is
    # not mirrored into the agent's namespace, and the agent's server reaches its own.
    rig.serve(rig.view, "127.0.0.1", 9097, handler=says(b"verifier"))
    rig.serve(rig.agent, "127.0.0.2", 9097, handler=says(b"agent"))
    rig.serve(rig.agent, "127.0.0.1", 8097, handler=asks(rig.agent, 9097))
    rig.wait_for(lambda: _answer(rig.view, 8097).startswith(b"refused"))
    time.sleep(0.3)
    assert _answer(rig.view, 8097).startswith(b"refused")
    assert roundtrip(rig.view, "127.0.0.1", 9097) == b"verifier"


def test_a_mirror_is_never_mirrored_back(rig: Rig) -> None:
    # The agent's 8098 is mirrored into the view; the view's 9098 into the agent's namespace. Neither
    # mirror is taken for a listener of the other side: when the originals go, both ports are free.
    agent = rig.serve(rig.agent, "127.0.0.1", 8098)
    view = rig.serve(rig.view, "127.0.0.1", 9098, handler=says(b"v"))
    rig.serve(rig.agent, "127.0.0.1", 8099, handler=asks(rig.agent, 9098))
    rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8098) and _answer(rig.view, 8099) == b"v")
    agent.close()
    view.close()
    time.sleep(0.4)
    for ns in (rig.agent, rig.view):
        for port in (8098, 9098):
            with pytest.raises(ConnectionRefusedError):
                connect(ns, "127.0.0.1", port)


def test_exits_when_the_watched_process_dies_and_leaves_nothing() -> None:
    rig = make_rig()
    inodes = {os.fstat(rig.agent).st_ino, os.fstat(rig.view).st_ino}
    try:
        forwarder = rig.start()
        rig.serve(rig.agent, "127.0.0.1", 8090)
        rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8090))
        assert rig.watched is not None
        rig.watched.send_signal(signal.SIGKILL)
        assert forwarder.wait(2) == 0
    finally:
        rig.close()
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                left.append(pid)
        except OSError:
            pass
    assert left == []


def _orphaned_bind_listener() -> int:
    """The listener of a bind filter (as the view's supervisor installs) that no process holds any
    more: a child installs it, hands its listener over, and exits — the listener hangs up for good."""
    import ctypes

    nr_bind = {"x86_64": 49, "aarch64": 200}[os.uname().machine]
    nr_seccomp = {"x86_64": 317, "aarch64": 277}[os.uname().machine]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the child: no Python beyond raw calls, then out
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            code = [(0x20, 0, 0, 0), (0x15, 0, 1, nr_bind), (0x06, 0, 0, 0x7FC00000), (0x06, 0, 0, 0x7FFF0000)]
            program = b"".join(struct.pack("HBBI", *insn) for insn in code)
            buffer = ctypes.create_string_buffer(program)
            fprog = struct.pack("HxxxxxxQ", len(code), ctypes.addressof(buffer))
            listener = libc.syscall(nr_seccomp, 1, 8, ctypes.c_char_p(fprog))  # SET_MODE_FILTER, NEW_LISTENER
            socket.send_fds(theirs, [b"x"], [listener])
        finally:
            os._exit(0)
    theirs.close()
    try:
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    assert len(fds) == 1
    return fds[0]


def test_a_bind_filter_no_process_holds_any_more_does_not_spin_it() -> None:
    # The view's supervisor exits: its bind filter's listener hangs up before its pidfd is readable
    # (under load, long before). Left in the epoll set, a hung-up listener is ready for ever.
    rig = make_rig()
    binds = _orphaned_bind_listener()
    try:
        forwarder = rig.start(binds=binds)
        rig.serve(rig.agent, "127.0.0.1", 8093)
        rig.wait_for(lambda: echoes(rig.view, "127.0.0.1", 8093))
        before = cpu_seconds(forwarder.pid)
        time.sleep(1)
        assert cpu_seconds(forwarder.pid) - before < 0.2
        assert echoes(rig.view, "127.0.0.1", 8093)  # still serving
        assert rig.watched is not None
        rig.watched.send_signal(signal.SIGKILL)
        assert forwarder.wait(2) == 0
    finally:
        os.close(binds)
        rig.close()
