"""The process that lives inside a local sandbox for its whole life.

It runs under the sandbox's own Python (the host's ``/usr/bin/python3``, standard
library only, any version >= 3.9) as the first process of the sandbox's PID
namespace after bubblewrap's init, its source read from standard input so that it
leaves no file in the sandbox. The host hands it an already listening Unix socket
(its descriptor number in ``argv[1]``); each connection is one command:

    host -> supervisor: one JSON line {"cmd", "cwd", "env", "timeout", "cap", "uid", "gid"}
    supervisor -> host: one JSON line {"rc", "stdout", "stderr", "timed_out", "dropped"}

Every connection is served by a forked *handler* that makes itself a child
subreaper, so every process the command starts (even one that calls ``setsid`` and
double-forks) stays its descendant. A timeout, or the host closing the connection
(a cancelled ``exec``), kills that whole tree. Processes a finished command left in
the background keep running, as with ``docker exec`` into a running container.

Output is bounded: at most ``cap`` bytes per stream are kept (the head and the tail,
with a marker in between); the rest is read and dropped so the command never blocks
on a full pipe.

This file must not import anything from the host project: it is executed by path.
"""

import json
import os
import select
import signal
import socket
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
# After the command exits, output may still be held open by processes it left in
# the background; wait this long for more before answering without them.
DRAIN_GRACE_SEC = 0.05
_LIBC = None


def _descendants(root_pid):
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The command name is in parentheses and may itself hold spaces.
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(name))
    found, stack = [], [root_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree():
    """Kill every descendant of this handler, repeating until none is left."""
    me = os.getpid()
    for _ in range(200):
        pids = _descendants(me)
        alive = False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                alive = True
            except ProcessLookupError:
                pass
        _reap()
        if not alive:
            return
        time.sleep(0.005)


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class _Bounded:
    """Keeps the first and last ``cap // 2`` bytes of a stream."""

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

    def text(self):
        middle = b""
        if self.dropped:
            middle = b"\n[... %d bytes of output omitted ...]\n" % self.dropped
        return (bytes(self.head) + middle + bytes(self.tail)).decode("utf-8", "replace")


def _spawn(request, out_w, err_w):
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        # Every other descriptor was opened close-on-exec (PEP 446).
        gid, uid = request.get("gid"), request.get("uid")
        if gid is not None:
            os.setgroups([gid])
            os.setgid(gid)
        if uid is not None:
            os.setuid(uid)
        try:
            os.chdir(request.get("cwd") or "/")
        except OSError as error:
            os.write(2, ("cannot enter working directory: %s\n" % error).encode())
            os._exit(126)
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        os.execve(shell, [shell, "-c", request["cmd"]], request.get("env") or {})
    except BaseException as error:  # noqa: BLE001 - the child must never return
        try:
            os.write(2, ("cannot start command: %s\n" % error).encode())
        finally:
            os._exit(127)


def _handle(conn):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    reader = conn.makefile("rb")
    line = reader.readline(1 << 24)
    if not line:
        return
    request = json.loads(line)
    cap = int(request.get("cap") or 1 << 20)
    timeout = request.get("timeout")
    deadline = None if not timeout else time.monotonic() + float(timeout)

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = _spawn(request, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    pidfd = os.pidfd_open(pid)
    streams = {out_r: _Bounded(cap), err_r: _Bounded(cap)}
    open_fds = {out_r, err_r}
    status = None
    exited_at = None
    timed_out = cancelled = False
    while True:
        if status is not None and (not open_fds or time.monotonic() - exited_at > DRAIN_GRACE_SEC):
            break
        wait = 0.5
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        if status is not None:
            wait = min(wait, max(0.0, exited_at + DRAIN_GRACE_SEC - time.monotonic()))
        watched = list(open_fds) + [conn.fileno()] + ([pidfd] if status is None else [])
        ready, _, _ = select.select(watched, [], [], wait)
        for fd in ready:
            if fd == pidfd:
                _, raw = os.waitpid(pid, 0)
                status = os.waitstatus_to_exitcode(raw)
                exited_at = time.monotonic()
            elif fd == conn.fileno():
                # The host never sends more than the request: readable means it
                # hung up (a cancelled exec).
                cancelled = True
            else:
                data = os.read(fd, 1 << 16)
                if data:
                    streams[fd].add(data)
                    if status is not None:
                        exited_at = time.monotonic()
                else:
                    open_fds.discard(fd)
                    os.close(fd)
        if cancelled:
            _kill_tree()
            return
        if status is None and deadline is not None and time.monotonic() >= deadline:
            timed_out = True
            _kill_tree()
            break
    if status is None:
        status = -signal.SIGKILL
    result = {
        "rc": status if status >= 0 else 128 - status,
        "stdout": streams[out_r].text(),
        "stderr": streams[err_r].text(),
        "timed_out": timed_out,
        "dropped": streams[out_r].dropped + streams[err_r].dropped,
    }
    try:
        conn.sendall(json.dumps(result).encode() + b"\n")
    except OSError:
        pass
    conn.close()
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


def _apply_limits(config):
    import resource

    for name, value in (config.get("rlimits") or {}).items():
        limit = getattr(resource, "RLIMIT_" + name)
        resource.setrlimit(limit, (value, value))


def main():
    listener = socket.socket(fileno=int(sys.argv[1]))
    _apply_limits(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    os.write(1, b"ready\n")
    os.close(1)
    global _LIBC
    try:  # imported after "ready": it costs a few milliseconds of start-up
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    except Exception:  # noqa: BLE001 - without it only double-forked orphans escape
        _LIBC = None
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        if os.fork() == 0:
            listener.close()
            code = 0
            try:
                _handle(conn)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
