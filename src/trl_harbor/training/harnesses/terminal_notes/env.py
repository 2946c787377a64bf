"""TerminalNotes harness: 6 shell tools (with background processes) and 4 note tools.

Select it with ``HarborSpec(dataset, agent="terminal_notes")`` or
``agent="examples/scripts/harbor/harnesses/terminal_notes/env.py:TerminalNotesEnv"``.

Background processes run in their own session (``setsid``) inside the sandbox; each has a
folder ``/tmp/.trl_harbor_procs/<random>/`` with its output (``out``), its exit code (``rc``, once
it ended) and its stdin, a FIFO that the process itself opens read-write, so it starts at once
(no writer is needed for the open to return) and reads what ``shell_write_to_process`` sends.
The notes are :class:`NotesKit`'s. See README.md.
"""

from __future__ import annotations

import base64
import shlex
from typing import Any

from trl_harbor import HarborEnv

#: Folder of the background processes' files inside the sandbox.
PROCS_DIR = "/tmp/.trl_harbor_procs"
#: Characters of base64 per command when writing a file (one argument holds at most 128 KiB).
_CHUNK = 96_000

PROMPT_SUFFIX = (
    "\n\nYou work in the task's sandbox (a Linux shell, Python 3 installed) with these tools:\n"
    "- `shell_exec(command, blocking=True)`: run a shell command and return its output; with "
    "`blocking=False` it starts in the background and returns its PID at once.\n"
    "- `shell_write_content_to_file(path, content)`: write a file (overwrites; creates folders).\n"
    "- `shell_write_to_process(pid, content)`: send a line to a background process's stdin.\n"
    "- `shell_view(pid)`, `shell_wait(pid)`, `shell_kill_process(pid)`: see a background "
    "process's output so far, wait for it to end, stop it.\n"
    "- `create_note(title, content)`, `append_note(title, content)`, `read_note(title)`, "
    "`list_note()`: a notebook for your own findings; use it as a scratchpad and read it back.\n"
    "**Submit your final answer by writing it to /workdir/answer.txt**, e.g. "
    "`shell_write_content_to_file(path='/workdir/answer.txt', content='<answer>')`. An answer "
    "stated only in prose is not submitted. Keep the answer short, and do not end your turn "
    "before submitting."
)


class NotesKit:
    """Mixin: the 4-tool notes kit (create, append, read, list) over a notebook that lasts one rollout.

    The notes live in the environment object, not in the sandbox (no command can lose them), and
    ``reset`` clears them. Put it before the harness: ``class MyEnv(NotesKit, HarborBashEnv)``.

    Args:
        *args: Passed on to the harness.
        **kwargs: Passed on to the harness.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._notes: dict[str, str] = {}

    def reset(self, task_dir: str | None = None, **row: Any) -> str:
        """Clear the notes, then reset the harness.

        Args:
            task_dir: The task directory (the dataset's ``task_dir`` column).
            **row: The rest of the dataset row.

        Returns:
            What the harness's ``reset`` returns.
        """
        self._notes = {}
        return super().reset(task_dir=task_dir, **row)  # type: ignore[misc]

    def create_note(self, title: str, content: str) -> str:
        """Create a note (or replace the note with that title). Notes last for this task only.

        Args:
            title: The note's title.
            content: The note's text.

        Returns:
            A confirmation.
        """
        replaced = title in self._notes
        self._notes[title] = content
        verb = "replaced" if replaced else "created"
        return f"Note {title!r} {verb} ({len(content)} characters). Notes: {len(self._notes)}."

    def append_note(self, title: str, content: str) -> str:
        """Append text, on a new line, to an existing note.

        Args:
            title: The note's title.
            content: The text to append.

        Returns:
            A confirmation, or an error when there is no such note.
        """
        if title not in self._notes:
            return f"Error: there is no note {title!r}; create it with create_note first. {self._titles()}"
        self._notes[title] += "\n" + content
        return f"Note {title!r} now has {len(self._notes[title])} characters."

    def read_note(self, title: str) -> str:
        """Return the full text of a note.

        Args:
            title: The note's title.

        Returns:
            The note's text, or an error listing the notes when there is no such note.
        """
        if title not in self._notes:
            return f"Error: there is no note {title!r}. {self._titles()}"
        return self._notes[title]

    def list_note(self) -> str:
        """List the titles of all notes, with their sizes.

        Returns:
            One line per note, or a message saying there are none.
        """
        if not self._notes:
            return "(no notes yet)"
        return "\n".join(f"- {title} ({len(text)} characters)" for title, text in self._notes.items())

    def _titles(self) -> str:
        return f"Existing notes: {', '.join(map(repr, self._notes))}." if self._notes else "There are no notes yet."


class TerminalNotesEnv(NotesKit, HarborEnv):
    """Harness with 6 shell tools (blocking or background commands) and 4 note tools.

    Args:
        *args: Passed to :class:`~trl_harbor.HarborEnv` (``environment_type``, ...).
        wait_timeout_sec: The most seconds ``shell_wait`` waits for a background process.
            Default: ``min(command_timeout_sec, 300)``.
        view_chars: Characters of a background process's output (its tail) that ``shell_view``
            and ``shell_wait`` return. Default: ``max_output_chars``.
        **kwargs: Passed to :class:`~trl_harbor.HarborEnv`.
    """

    PROMPT_SUFFIX = PROMPT_SUFFIX

    def __init__(
        self, *args: Any, wait_timeout_sec: float | None = None, view_chars: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._wait_timeout_sec = float(wait_timeout_sec or min(self._options.command_timeout_sec, 300))
        self._view_chars = int(view_chars or self._options.max_output_chars)
        self._procs: dict[str, str] = {}  # pid -> its folder in the sandbox

    def reset(self, task_dir: str | None = None, **row: Any) -> str:
        """Start the task's sandbox; forget the background processes (and the notes, :class:`NotesKit`).

        Args:
            task_dir: The task directory (the dataset's ``task_dir`` column).
            **row: The rest of the dataset row.

        Returns:
            The task instruction followed by :attr:`PROMPT_SUFFIX`.
        """
        self._procs = {}
        return super().reset(task_dir=task_dir, **row)

    # ── helpers ───────────────────────────────────────────────────────────────────────────

    def _unknown(self, pid: str) -> str | None:
        pid = str(pid).strip()
        if pid in self._procs:
            return None
        started = ", ".join(self._procs) or "none"
        return (
            f"Error: no background process with PID {pid!r} was started in this episode "
            f"(started: {started}). Start one with shell_exec(command, blocking=False)."
        )

    def _status_script(self, pid: str) -> str:
        """Shell snippet printing ``running`` or ``exited with code N`` for a background PID."""
        d = self._procs[pid]
        return (
            f'if [ -f {d}/rc ]; then echo "exited with code $(cat {d}/rc)"; '
            f"elif kill -0 {pid} 2>/dev/null && ! grep -q '^State:.*Z' /proc/{pid}/status 2>/dev/null; "
            "then echo running; else echo 'exited (killed)'; fi"
        )

    def _write_bytes(self, path: str, data: bytes) -> str | None:
        """Write ``data`` to ``path`` in the sandbox through base64 chunks; return an error or ``None``."""
        payload = base64.b64encode(data).decode("ascii")
        quoted = shlex.quote(path)
        tmp = shlex.quote(f"{path}.tmp-trl-harbor")
        chunks = [payload[i : i + _CHUNK] for i in range(0, len(payload), _CHUNK)] or [""]
        for index, chunk in enumerate(chunks):
            redirect = ">" if index == 0 else ">>"
            prefix = f'mkdir -p "$(dirname {quoted})" && ' if index == 0 else ""
            out = self._exec(f"{prefix}printf %s {chunk} | base64 -d {redirect} {tmp} && echo __ok__", timeout=60)
            if not out.startswith("__ok__"):
                self._exec(f"rm -f {tmp}", timeout=30)
                return out.strip()
        out = self._exec(f"mv -f {tmp} {quoted} && echo __ok__", timeout=60)
        return None if out.startswith("__ok__") else out.strip()

    # ── shell tools ───────────────────────────────────────────────────────────────────────

    def shell_exec(self, command: str, blocking: bool = True) -> str:
        """Run a shell command in the sandbox, blocking or in the background.

        Blocking (the default): wait for the command and return its combined stdout and stderr.
        In the background (blocking=False): start it and return its PID at once; the process
        runs on its own, and shell_view, shell_wait, shell_write_to_process and
        shell_kill_process take that PID.

        Args:
            command: The shell command to run.
            blocking: True to wait for the command's output, False to start it in the background.

        Returns:
            The command's output (blocking), or the PID of the background process.
        """
        if isinstance(blocking, str):  # a model may send "false" instead of false
            blocking = blocking.strip().lower() not in ("false", "0", "no", "off")
        if blocking:
            return self._exec(command)
        script = (
            f"mkdir -p {PROCS_DIR} || exit 1; d=$(mktemp -d {PROCS_DIR}/XXXXXXXX) || exit 1; "
            'mkfifo "$d/in" || exit 1; '
            # The process opens its own stdin FIFO read-write: the open returns at once (no
            # writer needed), and reads wait for what shell_write_to_process sends.
            'setsid bash -c \'exec 0<>"$1/in"; bash -c "$2"; echo $? > "$1/rc"\' bg "$d" '
            f'{shlex.quote(command)} > "$d/out" 2>&1 & echo "$! $d"'
        )
        out = self._exec(script, timeout=30).strip()
        pid, _, folder = out.partition(" ")
        if not pid.isdigit() or not folder.startswith(PROCS_DIR):
            return f"Error: the background process could not be started: {out}"
        self._procs[pid] = folder
        return f"Started background process PID={pid}. Use shell_view('{pid}') to see its output."

    def shell_write_content_to_file(self, path: str, content: str) -> str:
        """Write text to a file in the sandbox (overwrites it; creates missing folders).

        The content is written exactly as given (no newline is added). Use it to write scripts,
        and to submit the final answer to /workdir/answer.txt.

        Args:
            path: Destination path in the sandbox (absolute, or relative to the working directory).
            content: The full file contents.

        Returns:
            A confirmation with the number of bytes written, or the error.
        """
        data = content.encode("utf-8", "surrogateescape")
        error = self._write_bytes(path, data)
        if error is not None:
            return f"Error: could not write {path}: {error}"
        return f"Wrote {len(data)} bytes to {path}."

    def shell_write_to_process(self, pid: str, content: str) -> str:
        """Send text, followed by a newline, to the stdin of a background process.

        Args:
            pid: The PID returned by shell_exec(command, blocking=False).
            content: The text to send (a newline is appended).

        Returns:
            A confirmation, or why nothing was sent.
        """
        pid = str(pid).strip()
        if (error := self._unknown(pid)) is not None:
            return error
        payload = base64.b64encode((content + "\n").encode("utf-8", "surrogateescape")).decode("ascii")
        d = self._procs[pid]
        status = self._status_script(pid)
        # A FIFO without a reader would block the writer: check first, and bound the write.
        out = self._exec(
            f's=$({status}); if [ "$s" != running ]; then echo "$s"; exit 0; fi; '
            f"printf %s {payload} | base64 -d | timeout 10 tee -a {d}/in > /dev/null && echo __ok__",
            timeout=60,
        ).strip()
        if out.startswith("__ok__"):
            return f"Wrote {len(content) + 1} characters to the stdin of PID {pid}."
        return f"Error: nothing was sent to PID {pid}: the process has {out}" if "exited" in out else f"Error: {out}"

    def shell_view(self, pid: str) -> str:
        """Show whether a background process is still running, and its output so far.

        Args:
            pid: The PID returned by shell_exec(command, blocking=False).

        Returns:
            The process's status and the latest part of its combined stdout and stderr.
        """
        pid = str(pid).strip()
        if (error := self._unknown(pid)) is not None:
            return error
        return self._exec(self._view_script(pid))

    def _view_script(self, pid: str) -> str:
        d = self._procs[pid]
        n = self._view_chars
        return (
            f'echo "[PID {pid}: $({self._status_script(pid)})]"; '
            f"size=$(stat -c %s {d}/out 2>/dev/null || echo 0); "
            f'if [ "$size" -gt {n} ]; then echo "[... showing the last {n} of $size bytes]"; fi; '
            f"tail -c {n} {d}/out 2>/dev/null"
        )

    def shell_wait(self, pid: str) -> str:
        """Wait for a background process to end (for a bounded time) and return its output.

        Args:
            pid: The PID returned by shell_exec(command, blocking=False).

        Returns:
            The process's status (exit code, or still running when the wait ran out) and its output.
        """
        pid = str(pid).strip()
        if (error := self._unknown(pid)) is not None:
            return error
        limit = self._wait_timeout_sec
        steps = max(int(limit * 10), 1)
        return self._exec(
            f"for i in $(seq {steps}); do s=$({self._status_script(pid)}); "
            f'[ "$s" = running ] || break; sleep 0.1; done; '
            f"[ \"$s\" = running ] && echo '[still running after waiting {limit:g} s]'; " + self._view_script(pid),
            timeout=int(limit) + 60,
        )

    def shell_kill_process(self, pid: str) -> str:
        """Stop a background process and everything it started (SIGKILL).

        Args:
            pid: The PID returned by shell_exec(command, blocking=False).

        Returns:
            A confirmation with the process's final status.
        """
        pid = str(pid).strip()
        if (error := self._unknown(pid)) is not None:
            return error
        d = self._procs[pid]
        out = self._exec(
            f's=$({self._status_script(pid)}); if [ "$s" != running ]; then echo "already $s"; exit 0; fi; '
            f"kill -KILL -- -{pid} 2>/dev/null; kill -KILL {pid} 2>/dev/null; "
            f"for i in $(seq 50); do kill -0 {pid} 2>/dev/null || break; "
            f"grep -q '^State:.*Z' /proc/{pid}/status 2>/dev/null && break; sleep 0.02; done; "
            f"[ -f {d}/rc ] || echo killed > {d}/rc; echo killed",
            timeout=30,
        ).strip()
        if out.startswith("already"):
            return f"PID {pid} was not running: it {out.removeprefix('already ')}."
        return f"Killed PID {pid} and its child processes." if out == "killed" else f"Error: {out}"
