"""The process that lives inside a local sandbox for its whole life (Python version).

``_supervisor.c`` is the same program in C and is used whenever a C compiler is
available (it starts in ~1 ms instead of ~15); this file is the fallback, run by the
sandbox's own Python (the host's ``/usr/bin/python3``, any version >= 3.9), its
source read from standard input so that it leaves no file in the sandbox. It
imports only built-in C modules, to start fast.

It is PID 1 of the sandbox's PID namespace (bubblewrap ``--as-pid-1``), which the
kernel protects from SIGKILL and SIGSTOP sent from inside the namespace, so the
agent cannot kill it; it makes itself non-dumpable, and commands run without
CAP_SYS_PTRACE, so the agent cannot trace it either. The host hands it an already
listening Unix socket (descriptor number in ``argv[1]``; ``argv[2]`` is an
address-space limit in bytes, ``argv[3]`` a process limit, 0 for none). Each
connection carries one command, little-endian:

    request:  u32 size | u32 timeout_ms (0: none) | u32 cap | u32 n | n x (u32 len | bytes)
              fields: cwd, command, then "KEY=VALUE" environment entries
              an empty cwd marks a control request: command "ps" lists the
              sandbox's processes ("PID:START" lines on stdout; PID 1 and the
              handler excluded); "kill" kills all of them but the "PID:START"
              entries in the remaining fields, and answers how many it killed
    response: i32 exit code | u32 flags (1: timed out)
              | stdout: u64 dropped | u32 len | bytes | stderr: the same

Every connection is served by a forked *handler* that makes itself a child
subreaper, so every process the command starts (even one that calls ``setsid`` and
double-forks) stays its descendant. A timeout, or the host closing the connection
(a cancelled ``exec``), kills that whole tree. Processes a finished command left in
the background keep running, as with ``docker exec`` into a running container.

Output is bounded: at most ``cap`` bytes per stream are kept (the head and the
tail, with a marker in between); the rest is read and dropped so the command never
blocks on a full pipe.
"""

import _signal
import _socket
import errno
import os
import select
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4
# After the command exits, output may still be held open by processes it left in
# the background; wait this long for more before answering without them.
DRAIN_GRACE_SEC = 0.05
_LIBC = None


def _u32(data, offset):
    return int.from_bytes(data[offset : offset + 4], "little"), offset + 4


def _proc_stats():
    """``(pid, fields after the command name)`` of every process in /proc/PID/stat."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The command name is in parentheses and may itself hold spaces.
        yield int(name), stat[stat.rfind(b")") + 2 :].split()


def _descendants(root_pid):
    children = {}
    for pid, fields in _proc_stats():
        children.setdefault(int(fields[1]), []).append(pid)
    found, stack = [], [root_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_tree():
    """Kill every descendant of this handler, repeating until none is left."""
    for _ in range(200):
        alive = False
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, _signal.SIGKILL)
                alive = True
            except ProcessLookupError:
                pass
        _reap()
        if not alive:
            return
        time.sleep(0.005)


def _processes():
    """``{"PID:START": pid}`` of the sandbox's live processes but PID 1 and this handler."""
    found, me = {}, os.getpid()
    for pid, fields in _proc_stats():
        if pid not in (1, me) and fields and fields[0] not in (b"Z", b"X"):
            found["%d:%s" % (pid, fields[19].decode())] = pid
    return found


def _kill_all(keep):
    """Kill every process of the sandbox but PID 1, this handler and ``keep``; return how many."""
    total = 0
    for _ in range(1000):
        killed = 0
        for key, pid in _processes().items():
            if key in keep:
                continue
            try:
                os.kill(pid, _signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        total += killed
        if not killed:
            return total
        time.sleep(0.002)
    return total


def _control(conn, fields):
    """Answer a control request (``ps`` or ``kill``): an exit code and stdout."""
    rc, text = -1, b""
    if fields[1] == b"ps":
        rc, text = 0, "".join(key + "\n" for key in _processes()).encode()
    elif fields[1] == b"kill":
        rc = _kill_all({entry.decode() for entry in fields[2:]})
    answer = rc.to_bytes(4, "little", signed=True) + bytes(4)
    answer += bytes(8) + len(text).to_bytes(4, "little") + text + bytes(12)
    view = memoryview(answer)
    while view:
        view = view[os.write(conn, view) :]
    os.close(conn)


class _Bounded:
    """Keeps the first ``cap // 2`` and the last ``cap - cap // 2`` bytes of a stream."""

    def __init__(self, cap):
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data):
        room = self.cap // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        keep = self.cap - self.cap // 2
        if len(self.tail) > keep:
            self.dropped += len(self.tail) - keep
            del self.tail[: len(self.tail) - keep]

    def encode(self):
        middle = b""
        if self.dropped:
            middle = b"\n[... %d bytes omitted ...]\n" % self.dropped
        body = bytes(self.head) + middle + bytes(self.tail)
        return self.dropped.to_bytes(8, "little") + len(body).to_bytes(4, "little") + body


def _read_exact(fd, size):
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _failure(conn, what, error):
    """Answer a command that could not be started: exit code 126, the reason on stderr."""
    note = " (the sandbox is at its process limit)" if error.errno == errno.EAGAIN else ""
    text = ("cannot start the command: %s: %s%s\n" % (what, os.strerror(error.errno or 0), note)).encode()
    answer = (126).to_bytes(4, "little", signed=True) + (0).to_bytes(4, "little")
    answer += (0).to_bytes(8, "little") + (0).to_bytes(4, "little")
    answer += (0).to_bytes(8, "little") + len(text).to_bytes(4, "little") + text
    try:
        os.write(conn, answer)
    except OSError:
        pass
    os.close(conn)


def _spawn(cwd, command, env, out_w, err_w):
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        # Nothing of the host reaches a command: no descriptor but its standard streams.
        os.closerange(3, 65536)
        try:
            os.chdir(cwd)
        except OSError as error:
            os.write(2, ("cannot enter working directory %s: %s\n" % (cwd, error)).encode())
            os._exit(126)
        shell = "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"
        os.execve(shell, [shell, "-c", command], env)
    except BaseException as error:  # noqa: BLE001 - the child must never return
        try:
            os.write(2, ("cannot start command: %s\n" % error).encode())
        finally:
            os._exit(127)


def _read_request(conn):
    """One request: its timeout (ms), output cap and fields."""
    size = int.from_bytes(_read_exact(conn, 4), "little")
    request = _read_exact(conn, size)
    timeout_ms, offset = _u32(request, 0)
    cap, offset = _u32(request, offset)
    count, offset = _u32(request, offset)
    fields = []
    for _ in range(count):
        length, offset = _u32(request, offset)
        fields.append(request[offset : offset + length])
        offset += length
    return timeout_ms, cap, fields


def _serve_unforked(conn, error):
    """No handler could be forked (the sandbox is at its process limit): control requests are
    still served, here (a ``kill`` is how the host frees the sandbox); commands get the reason."""
    try:
        _, _, fields = _read_request(conn)
    except (OSError, EOFError, IndexError, ValueError):
        os.close(conn)
        return
    if len(fields) >= 2 and not fields[0]:
        _control(conn, fields)
    else:
        _failure(conn, "fork", error)


def _pump(conn, pid, streams, open_fds, deadline):
    """Read the command's output until it exited and its pipes drained: ``(status, timed out)``, or
    ``None`` when the host hung up (a cancelled exec); both that and a timeout kill its whole tree."""
    pidfd = os.pidfd_open(pid)
    status = None
    exited_at = 0.0
    while True:
        if status is not None and (not open_fds or time.monotonic() - exited_at > DRAIN_GRACE_SEC):
            return status, False
        wait = 0.5
        if deadline is not None and status is None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        if status is not None:
            wait = max(0.0, exited_at + DRAIN_GRACE_SEC - time.monotonic())
        watched = list(open_fds) + [conn] + ([pidfd] if status is None else [])
        ready, _, _ = select.select(watched, [], [], wait)
        for fd in ready:
            if fd == pidfd:
                _, raw = os.waitpid(pid, 0)
                status = os.waitstatus_to_exitcode(raw)
                exited_at = time.monotonic()
            elif fd == conn:
                # The host never sends more than the request: readable means it
                # hung up (a cancelled exec).
                _kill_tree()
                return None
            else:
                data = os.read(fd, 1 << 16)
                if data:
                    streams[fd].add(data)
                    if status is not None:
                        exited_at = time.monotonic()
                else:
                    open_fds.discard(fd)
                    os.close(fd)
        if status is None and deadline is not None and time.monotonic() >= deadline:
            _kill_tree()
            return -_signal.SIGKILL, True


def _handle(conn):
    _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    timeout_ms, cap, fields = _read_request(conn)
    if not fields[0]:  # an empty cwd marks a control request, not a command
        _control(conn, fields)
        return
    cwd, command = fields[0].decode(), fields[1].decode()
    env = dict(entry.decode().split("=", 1) for entry in fields[2:])
    deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None

    try:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
    except OSError as error:
        _failure(conn, "pipe", error)
        return
    try:
        pid = _spawn(cwd, command, env, out_w, err_w)
    except OSError as error:
        _failure(conn, "fork", error)
        return
    os.close(out_w)
    os.close(err_w)
    streams = {out_r: _Bounded(max(cap, 64)), err_r: _Bounded(max(cap, 64))}
    open_fds = {out_r, err_r}
    outcome = _pump(conn, pid, streams, open_fds, deadline)
    if outcome is None:  # the host hung up: the command's tree is killed, nobody to answer
        return
    status, timed_out = outcome
    rc = status if status >= 0 else 128 - status
    answer = rc.to_bytes(4, "little", signed=True) + (1 if timed_out else 0).to_bytes(4, "little")
    answer += streams[out_r].encode() + streams[err_r].encode()
    try:
        view = memoryview(answer)
        while view:
            view = view[os.write(conn, view) :]
    except OSError:
        pass
    os.close(conn)
    for fd in open_fds:
        os.close(fd)
    # Stay alive as the subreaper of whatever the command left running.
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def main():
    global _LIBC
    listener = _socket.socket(fileno=int(sys.argv[1]))
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    process_limit = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if process_limit:
        import resource

        # Without cgroups (not root): RLIMIT_NPROC counts a uid's processes in its own user
        # namespace, i.e. this sandbox's (a fork bomb gets EAGAIN).
        resource.setrlimit(resource.RLIMIT_NPROC, (process_limit, process_limit))
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)  # handlers are reaped by the kernel
    _signal.signal(_signal.SIGPIPE, _signal.SIG_IGN)
    os.write(1, b"ready\n")
    os.dup2(os.open("/dev/null", os.O_WRONLY), 1)
    try:  # imported after "ready": it costs a few milliseconds of start-up
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:  # noqa: BLE001 - without it only double-forked orphans escape
        _LIBC = None
    while True:
        try:
            conn, _ = listener._accept()
        except InterruptedError:
            continue
        try:
            pid = os.fork()
        except OSError as error:  # no handler: serve it from here (it is short) and go on
            _serve_unforked(conn, error)
            continue
        if pid == 0:
            listener.close()
            code = 0
            try:
                _handle(conn)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        os.close(conn)


if __name__ == "__main__":
    sys.exit(main())
