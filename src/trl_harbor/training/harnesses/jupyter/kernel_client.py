"""Per-cell client of the Jupyter harness; runs *inside* the sandbox (stdlib only).

Reads a cell's code (base64) from stdin, sends it to ``kernel_server.py`` over its unix socket
and prints the cell's output. When the cell runs past ``--timeout`` seconds it sends ``SIGINT``
to the kernel (the cell gets a ``KeyboardInterrupt``, the kernel and its variables survive);
a kernel that ignores two interrupts is killed (exit code 3: the harness restarts it).

The first line printed is a marker for the harness, ``<<kernel:STATUS>>`` (stripped before the
model sees the output): ``ok``, ``error``, ``interrupted``, ``restarted`` (the kernel died and
the server already restarted it), ``dead`` (the kernel is gone: the harness must restart it).
The exit code is always 0, so the marker comes back whatever the backend does with failures.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import sys
import time


def _server_dead(state: str) -> bool:
    """True when the server process recorded in ``server.pid`` is gone (or a zombie)."""
    try:
        with open(os.path.join(state, "server.pid")) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, ValueError, IndexError):
        return os.path.exists(os.path.join(state, "server.pid"))


def _connect(state: str, wait: float) -> socket.socket | None:
    path = os.path.join(state, "kernel.sock")
    deadline = time.monotonic() + wait
    while True:
        if os.path.exists(os.path.join(state, "ready")):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except OSError:
                sock.close()
        if time.monotonic() >= deadline or _server_dead(state):
            return None
        time.sleep(0.02)


def _receive(sock: socket.socket, seconds: float) -> bytes | None:
    """Read the whole reply, or ``None`` when none arrived within ``seconds``."""
    sock.settimeout(max(seconds, 0.01))
    chunks = []
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except socket.timeout:  # noqa: UP041 (the sandbox python may be older than 3.10)
        return None if not chunks else _receive_rest(sock, chunks)


def _receive_rest(sock: socket.socket, chunks: list) -> bytes:
    sock.settimeout(30)  # the reply has begun: the rest follows at once
    with sock.makefile("rb") as rest:
        return b"".join(chunks) + rest.read()


def _emit(status: str, text: str) -> int:
    sys.stdout.write(f"{MARKER_PREFIX}{status}>>\n{text}")
    sys.stdout.flush()
    return 0


MARKER_PREFIX = "<<kernel:"


def _signal(state: str, signum: int) -> bool:
    """Send ``signum`` to the kernel (``STATE/kernel.pid``); ``False`` when its process is gone."""
    try:
        with open(os.path.join(state, "kernel.pid")) as f:
            os.kill(int(f.read().strip()), signum)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):  # no pid recorded (yet): nothing to signal
        pass
    return True


def _interrupt(state: str, sock: socket.socket) -> bytes | None:
    """Interrupt a cell past its time (twice at most): its reply, or ``None`` when it never came."""
    for _attempt in (1, 2):
        if not _signal(state, signal.SIGINT):
            return None
        reply = _receive(sock, 3.0)
        if reply is not None:
            return reply
    return None


def _result(reply: bytes, notes: list) -> tuple:
    """The status marker and the text shown for the server's reply, with the client's notes appended."""
    result = json.loads(reply.decode("utf-8"))
    output = result.get("output", "")
    status = result.get("status")
    if status == "died":
        status = "restarted"
        notes.append("[the kernel died while running the cell and was restarted; all variables are lost]")
    if notes:
        if output and not output.endswith("\n"):
            output += "\n"
        output += "\n".join(notes) + "\n"
    return (status if status in ("ok", "error", "interrupted", "restarted") else "error"), output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state", required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before the cell is interrupted")
    parser.add_argument("--max-chars", type=int, default=8000)
    parser.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the kernel to be up")
    parser.add_argument("--ping", action="store_true", help="only check that the kernel answers")
    args = parser.parse_args()

    sock = _connect(args.state, args.wait)
    if sock is None:
        return _emit("dead", "Error: the Python kernel is not running.\n")
    with sock:
        if args.ping:
            request = {"ping": True}
        else:
            code = base64.b64decode(sys.stdin.buffer.read()).decode("utf-8", "surrogateescape")
            request = {"code": code, "max_chars": args.max_chars}
        sock.sendall(json.dumps(request).encode("utf-8"))
        sock.shutdown(socket.SHUT_WR)
        reply = _receive(sock, args.timeout)
        notes = []
        if reply is None:
            reply = _interrupt(args.state, sock)
            notes.append(f"[the cell ran longer than {args.timeout:g} s and was interrupted]")
        if reply is None:
            _signal(args.state, signal.SIGKILL)
            return _emit(
                "dead",
                f"[the cell ran longer than {args.timeout:g} s and ignored interrupts: the kernel was killed "
                "and restarted; all variables and imports are lost]\n",
            )
        if not reply:
            return _emit(
                "dead", "[the kernel died while running the cell; it was restarted and all variables are lost]\n"
            )
    return _emit(*_result(reply, notes))


if __name__ == "__main__":
    sys.exit(main())
