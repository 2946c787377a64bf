"""Kernel server of the Jupyter harness; runs *inside* the sandbox (stdlib only, Python >= 3.8).

One long-lived process per sandbox, started by ``JupyterEnv._setup``. It listens on a unix
socket; each request is one cell (``{"code": ..., "max_chars": ...}`` as JSON, then EOF) and
each reply is ``{"status": "ok" | "error" | "interrupted" | "died", "output": ...}``.

Two back ends, chosen at start-up (``--mode auto`` picks the first that works):

- ``ipykernel``: a real Jupyter kernel (``ipykernel``) driven with ``jupyter_client`` over the
  Jupyter messaging protocol. The server is a gateway: it keeps one client connected, so the
  cost of importing ``jupyter_client`` and connecting is paid once, not per cell.
- ``builtin``: the server *is* the kernel. Cells run in one persistent ``__main__`` namespace,
  a bare last expression is echoed like Jupyter does, and output (Python's and subprocesses')
  is captured through a pipe and capped (head and tail kept).

Either way ``STATE/kernel.pid`` holds the PID to send ``SIGINT`` to: a running cell gets a
``KeyboardInterrupt`` and the kernel stays alive (the client in ``kernel_client.py`` does this
on timeout).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import io
import json
import linecache
import os
import re
import signal
import socket
import sys
import threading
import traceback
import types

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SERVER_FILE = __file__


class CappedText:
    """Keeps the first and last ``limit // 2`` characters of a stream, counting the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = max(int(limit), 64)
        self.head: list[str] = []
        self.head_len = 0
        self.tail = ""
        self.dropped = 0
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            half = self.limit // 2
            if self.head_len < half:
                take = text[: half - self.head_len]
                self.head.append(take)
                self.head_len += len(take)
                text = text[len(take) :]
            if not text:
                return
            combined = self.tail + text
            if len(combined) > half:
                self.dropped += len(combined) - half
                combined = combined[-half:]
            self.tail = combined

    def value(self) -> str:
        with self.lock:
            head = "".join(self.head)
            if self.dropped:
                return f"{head}\n[... {self.dropped} characters omitted ...]\n{self.tail}"  # cut_output's marker
            return head + self.tail


# ── builtin kernel ───────────────────────────────────────────────────────────────────────


def _drain(read_fd: int, captured: CappedText) -> None:
    """Copy a pipe into ``captured`` until its last writer closes it, decoding UTF-8 across reads."""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        pending = b""
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            pending += chunk
            try:
                text, pending = pending.decode("utf-8"), b""
            except UnicodeDecodeError as exc:
                if exc.start > 0 and len(pending) - exc.start < 4:  # a character cut between two reads
                    text, pending = pending[: exc.start].decode("utf-8"), pending[exc.start :]
                else:
                    text, pending = pending.decode("utf-8", "backslashreplace"), b""
            captured.write(text)
        if pending:
            captured.write(pending.decode("utf-8", "backslashreplace"))


@contextlib.contextmanager
def _output_to(write_fd: int):
    """Send fds 1 and 2, ``sys.stdout`` and ``sys.stderr`` to ``write_fd`` (which it closes) for the block.

    The file descriptors, not only Python's streams: a subprocess the cell starts writes there too.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    old_streams = sys.stdout, sys.stderr
    stream = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    sys.stdout = sys.stderr = stream
    try:
        yield stream
    finally:
        try:
            stream.flush()
        except Exception:
            pass
        sys.stdout, sys.stderr = old_streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


class BuiltinKernel:
    """A minimal stateful Python kernel running in this process."""

    mode = "builtin"

    def __init__(self) -> None:
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main  # so pickle finds classes defined in cells
        self.namespace = main.__dict__
        self.count = 0
        self.executing = False
        signal.signal(signal.SIGINT, self._on_sigint)

    def pid(self) -> int:
        return os.getpid()

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self.executing:  # only a running cell is interrupted; the server itself never is
            raise KeyboardInterrupt

    def run(self, code: str, max_chars: int) -> dict:
        self.count += 1
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        captured = CappedText(max_chars)
        read_fd, write_fd = os.pipe()
        reader = threading.Thread(target=_drain, args=(read_fd, captured), daemon=True)
        reader.start()
        status = "ok"
        with _output_to(write_fd) as stream:
            try:
                self._execute(code, filename, stream)
            except KeyboardInterrupt as exc:
                status = "interrupted"
                stream.write(self._format(exc))
            except BaseException as exc:  # SystemExit too: the kernel must survive the cell
                status = "error"
                stream.write(self._format(exc))
        reader.join(timeout=1.0)  # a background child still holding the pipe: stop waiting
        return {"status": status, "output": captured.value()}

    def _execute(self, code: str, filename: str, stream: io.TextIOBase) -> None:
        """Run a cell in the namespace, echoing a bare last expression's value as Jupyter does."""
        self.executing = True
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.namespace)
                if value is not None:
                    self.namespace["_"] = value
                    stream.write(repr(value) + "\n")
        finally:
            self.executing = False

    @staticmethod
    def _format(exc: BaseException) -> str:
        if isinstance(exc, SyntaxError):
            return "".join(traceback.format_exception_only(type(exc), exc))
        # Drop the server's own frames (the exec call, the SIGINT handler), keep the cell's and
        # the libraries' it called.
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != _SERVER_FILE]
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
        return "".join(lines + traceback.format_exception_only(type(exc), exc))


# ── ipykernel back end ───────────────────────────────────────────────────────────────────


class IPyKernel:
    """A real ``ipykernel`` kernel, driven over the Jupyter protocol with ``jupyter_client``."""

    mode = "ipykernel"

    def __init__(self) -> None:
        self._start()
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _start(self) -> None:
        from jupyter_client import KernelManager

        self.manager = KernelManager(kernel_name="python3")  # a fresh manager: fresh ports and sockets
        self.manager.start_kernel(cwd=os.getcwd())
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def pid(self) -> int:
        provisioner = getattr(self.manager, "provisioner", None)
        process = getattr(provisioner, "process", None) or getattr(self.manager, "kernel", None)
        return int(process.pid)

    def run(self, code: str, max_chars: int) -> dict:
        try:
            return self._run(code, max_chars)
        except Exception:
            if self.manager.is_alive():
                raise
            self.restart()  # the kernel died under us: start a fresh one
            return {"status": "died", "output": ""}

    def _run(self, code: str, max_chars: int) -> dict:
        captured = CappedText(max_chars)
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        status = "ok"
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=0.5)
            except Exception:  # queue.Empty: check that the kernel still lives
                if not self.manager.is_alive():
                    self.restart()
                    return {"status": "died", "output": captured.value()}
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                captured.write(content.get("text", ""))
            elif kind in ("execute_result", "display_data"):
                text = content.get("data", {}).get("text/plain")
                if text is not None:
                    captured.write(text + "\n")
                elif content.get("data"):
                    captured.write(f"<{', '.join(sorted(content['data']))} output>\n")
            elif kind == "error":
                status = "interrupted" if content.get("ename") == "KeyboardInterrupt" else "error"
                captured.write(_ANSI.sub("", "\n".join(content.get("traceback", []))) + "\n")
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        return {"status": status, "output": captured.value()}

    def restart(self) -> None:
        for stop in (self.client.stop_channels, lambda: self.manager.shutdown_kernel(now=True)):
            try:
                stop()
            except Exception:  # a dead kernel may fail to stop cleanly: start afresh anyway
                pass
        self._start()


# ── server ───────────────────────────────────────────────────────────────────────────────


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def serve(state: str, mode: str) -> None:
    kernel = None
    if mode in ("auto", "ipykernel"):
        try:
            kernel = IPyKernel()
        except Exception as exc:
            if mode == "ipykernel":
                raise
            print(f"ipykernel unavailable ({type(exc).__name__}: {exc}); using the builtin kernel", flush=True)
    if kernel is None:
        kernel = BuiltinKernel()
    sock_path = os.path.join(state, "kernel.sock")
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(8)
    _write(os.path.join(state, "kernel.pid"), str(kernel.pid()))
    _write(os.path.join(state, "mode"), kernel.mode)
    _write(os.path.join(state, "ready"), "1")
    print(f"kernel ready ({kernel.mode}, pid {kernel.pid()})", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except InterruptedError:
            continue
        with conn:
            try:
                with conn.makefile("rb") as stream:  # the client ends its request with EOF
                    request = json.loads(stream.read().decode("utf-8"))
                if request.get("ping"):
                    reply = {"status": "ok", "output": kernel.mode}
                else:
                    reply = kernel.run(request["code"], int(request.get("max_chars", 8000)))
                    if reply["status"] == "died":
                        _write(os.path.join(state, "kernel.pid"), str(kernel.pid()))
            except Exception as exc:  # a bad request must not stop the server
                reply = {"status": "error", "output": f"kernel server error: {type(exc).__name__}: {exc}"}
            try:
                conn.sendall(json.dumps(reply).encode("utf-8"))
            except OSError:
                pass  # the client gave up (timeout): drop the reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state", required=True, help="folder for the socket, pid and ready files")
    parser.add_argument("--mode", default="auto", choices=["auto", "ipykernel", "builtin"])
    args = parser.parse_args()
    serve(args.state, args.mode)


if __name__ == "__main__":
    main()
