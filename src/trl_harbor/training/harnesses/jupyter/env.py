"""Jupyter harness: a stateful Python kernel in the task sandbox, plus a shell tool.

Select it with ``HarborSpec(dataset, agent="jupyter")`` or
``agent="examples/scripts/harbor/harnesses/jupyter/env.py:JupyterEnv"``.

``_setup`` uploads ``kernel_server.py`` and ``kernel_client.py`` into the sandbox and starts
the kernel server there as a background process (a real ``ipykernel`` driven with
``jupyter_client`` when the sandbox's ``python3`` has both, else a stdlib kernel); each cell is
one short command that runs the stdlib client against the server's unix socket. See README.md.
"""

from __future__ import annotations

import base64
import re
import threading
from pathlib import Path
from typing import Any

from trl_harbor import HarborEnv

_HERE = Path(__file__).resolve().parent
#: Where the harness keeps its files inside the sandbox (out of the model's way).
SANDBOX_DIR = "/tmp/.trl_harbor_jupyter"
_MARKER = re.compile(r"\A<<kernel:(\w+)>>\n")
_SETUP_WAIT_SEC = 120.0

PROMPT_SUFFIX = (
    "\n\nYou work in a **stateful Python kernel** (like a Jupyter notebook) inside the task's "
    "sandbox. Tools:\n"
    "- `add_and_execute_code_cell(code)`: run Python code in the kernel. Variables, imports and "
    "files persist across cells; the value of a bare last expression is shown, as in Jupyter.\n"
    "- `execute_shell_command(command)`: run a shell command (ls, head, pip install ...). It does "
    "not share state with the kernel.\n"
    "**Submit your final answer by writing it to /workdir/answer.txt**, e.g. "
    "`add_and_execute_code_cell(code=\"open('/workdir/answer.txt', 'w').write(str(answer))\")`. "
    "An answer stated only in prose is not submitted. Keep the answer short, and do not end your "
    "turn before submitting."
)


class JupyterEnv(HarborEnv):
    """Harness with a stateful Python kernel (``add_and_execute_code_cell``) and a shell tool.

    Args:
        *args: Passed to :class:`~trl_harbor.HarborEnv` (``environment_type``, ...).
        cell_timeout_sec: Seconds a cell may run before it is interrupted (``KeyboardInterrupt``;
            the kernel and its variables survive). Default: ``command_timeout_sec``.
        kernel_mode: ``"auto"`` (a real ``ipykernel`` when the sandbox has ``ipykernel`` and
            ``jupyter_client``, else the built-in stdlib kernel), ``"ipykernel"`` or ``"builtin"``.
        **kwargs: Passed to :class:`~trl_harbor.HarborEnv`.
    """

    PROMPT_SUFFIX = PROMPT_SUFFIX

    def __init__(
        self, *args: Any, cell_timeout_sec: float | None = None, kernel_mode: str = "auto", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if kernel_mode not in ("auto", "ipykernel", "builtin"):
            raise ValueError(f"kernel_mode must be 'auto', 'ipykernel' or 'builtin', got {kernel_mode!r}")
        if cell_timeout_sec is not None and cell_timeout_sec <= 0:
            raise ValueError("cell_timeout_sec must be positive")
        self._cell_timeout_sec = float(cell_timeout_sec or self._options.command_timeout_sec)
        self._kernel_mode = kernel_mode
        self._kernel_ready = threading.Event()
        self._kernel_error: str | None = None
        self._was_reset = False
        #: The back end the kernel runs on in this episode ("ipykernel" or "builtin").
        self._kernel_backend: str | None = None

    # ── lifecycle ─────────────────────────────────────────────────────────────────────────

    def reset(self, task_dir: str | None = None, **row: Any) -> str:
        """Start the task's sandbox and its kernel; return the instruction and the tool guide.

        Args:
            task_dir: The task directory (the dataset's ``task_dir`` column).
            **row: The rest of the dataset row.

        Returns:
            The task instruction followed by :attr:`PROMPT_SUFFIX`.
        """
        self._kernel_ready = threading.Event()  # a fresh one: a late setup of the last episode cannot set it
        self._kernel_error = None
        self._kernel_backend = None
        self._was_reset = True
        return super().reset(task_dir=task_dir, **row)

    async def _setup(self) -> None:
        ready = self._kernel_ready
        try:
            await super()._setup()
            environment = self._environment
            if environment is None:
                raise RuntimeError("no sandbox is running")
            await self._aexec(f"mkdir -p {SANDBOX_DIR}", 30)
            for name in ("kernel_server.py", "kernel_client.py"):
                await environment.upload_file(_HERE / name, f"{SANDBOX_DIR}/{name}")
            result = await self._aexec(self._start_command(), 150)
            output = (result.stdout or "") + (result.stderr or "")
            match = _MARKER.match(output)
            if not match or match.group(1) != "ok":
                raise RuntimeError(f"the kernel did not start:\n{output[-2000:]}")
            self._kernel_backend = output[match.end() :].strip() or None
        except BaseException as exc:
            # Not fatal to the episode: the cell tool reports it, the shell tool still works.
            self._kernel_error = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, Exception):  # cancelled: the episode is going away
                raise
        finally:
            ready.set()

    def _start_command(self) -> str:
        """Shell command that (re)starts the kernel server and waits until it answers."""
        state = SANDBOX_DIR
        mode = self._kernel_mode
        if mode == "auto":  # pick ipykernel only where the sandbox's python3 has both packages
            mode = '$(python3 -c "import ipykernel, jupyter_client" >/dev/null 2>&1 && echo ipykernel || echo builtin)'
        return (
            f"for f in {state}/server.pid {state}/kernel.pid; do "
            "[ -f $f ] && kill -KILL -- -$(cat $f) $(cat $f) 2>/dev/null; done; "
            f"rm -f {state}/ready {state}/kernel.sock {state}/kernel.pid; "
            f"setsid python3 {state}/kernel_server.py --state {state} --mode {mode} "
            f">{state}/server.log 2>&1 </dev/null & echo $! > {state}/server.pid; "
            f"python3 {state}/kernel_client.py --state {state} --ping --wait 120 || true; "
            f"[ -f {state}/ready ] || tail -c 2000 {state}/server.log"
        )

    def _wait_for_kernel(self) -> str | None:
        """Wait until ``_setup`` finished; return an error text for the model, or ``None``."""
        if not self._was_reset:
            return "Error: no sandbox is running (the environment was not reset)."
        if not self._kernel_ready.is_set():
            # Setup may still run in the background of reset: a command waits for the sandbox,
            # and tells us at once when it failed to start.
            probe = self._exec("true", timeout=60)
            if probe.startswith("Error"):
                return probe
        if not self._kernel_ready.wait(_SETUP_WAIT_SEC):
            return f"Error: the Python kernel did not start within {_SETUP_WAIT_SEC:g} s."
        if self._kernel_error is not None:
            return (
                f"Error: the Python kernel could not be started ({self._kernel_error.strip()}). "
                "Use execute_shell_command instead (e.g. python3 -c '...')."
            )
        return None

    def _run_cell(self, code: str) -> str:
        error = self._wait_for_kernel()
        if error is not None:
            return error
        payload = base64.b64encode(code.encode("utf-8", "surrogateescape")).decode("ascii")
        budget = max(self._options.max_output_chars - 300, 256)
        client = (
            f"python3 {SANDBOX_DIR}/kernel_client.py --state {SANDBOX_DIR} "
            f"--timeout {self._cell_timeout_sec:g} --max-chars {budget} --wait 5"
        )
        if len(payload) < 100_000:  # one argument of a command line holds at most 128 KiB
            command = f"printf %s {payload} | {client}"
        else:
            path = f"{SANDBOX_DIR}/cell.b64"
            self._exec(f": > {path}", timeout=30)
            for start in range(0, len(payload), 100_000):
                self._exec(f"printf %s {payload[start : start + 100_000]} >> {path}", timeout=30)
            command = f"{client} < {path}"
        output = self._exec(command, timeout=int(self._cell_timeout_sec) + 30)
        match = _MARKER.match(output)
        if match is None:  # the backend reported a failure (timeout, lost sandbox, ...)
            return output
        status, text = match.group(1), output[match.end() :]
        if status == "dead":
            restart = self._exec(self._start_command(), timeout=150)
            if not restart.startswith("<<kernel:ok>>"):
                text += f"\n[restarting the kernel failed: {restart[-1000:]}]"
        return text if text.strip() else "(no output)"

    # ── tools ─────────────────────────────────────────────────────────────────────────────

    def add_and_execute_code_cell(self, code: str) -> str:
        """Execute Python code in the stateful kernel and return the cell's output.

        Variables, imports and files persist across calls, as in a Jupyter notebook. The value
        of a bare last expression is shown; errors come back as a traceback. A cell that runs
        too long is interrupted (the kernel and its variables survive).

        Args:
            code: The Python code of the cell (may span several lines).

        Returns:
            What the cell printed, its last expression's value, or its traceback.
        """
        return self._run_cell(code)

    def execute_shell_command(self, command: str) -> str:
        """Run a shell command in the sandbox and return its combined stdout and stderr.

        Use it for ls, head, pip install and the like. It does not share state with the Python
        kernel, and the shell keeps no state between calls.

        Args:
            command: The shell command to run.

        Returns:
            The command's combined stdout and stderr.
        """
        return self._exec(command)
