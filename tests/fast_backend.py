"""A fake Harbor backend for the fast test tier: each sandbox a host folder, each command a ``bash`` subprocess.

**It is a fake and gives no isolation.** :class:`SubprocessEnvironment` exists so that the rollout
core's decisions (grading by Harbor's real verifier, multi-step tasks, the attribution of failures,
options, policies) can be tested in seconds, as an unprivileged user, on a machine without root,
bubblewrap, Docker or an image build. It must never run an untrusted policy: commands run on the
host, as the user running the tests, with the host's programs, files and network.

Use it as ``HarborSpec(..., environment_type="fast_backend:SubprocessEnvironment")`` (``tests/`` is on
``sys.path`` under pytest). ``trl_harbor.testing.check_backend`` accepts it (``tests/test_conformance.py``).

**Harbor's absolute paths.** Tasks use ``/workdir``, ``/tests``, ``/logs/verifier``, ``/solution``...,
which an unprivileged process cannot create, so each sandbox gets a folder of its own, its *root*, and
the sandbox's paths are *translated* to it: a path under one of the sandbox's prefixes
(:data:`DEFAULT_PREFIXES`, plus the Dockerfile's ``WORKDIR`` and ``COPY`` destinations and the task's
``workdir``) becomes ``<root><path>``, in

* commands, ``cwd`` and environment values (where the path starts a word: ``x/workdir`` is not one);
* the text of uploaded files (so ``tests/test.sh`` writing ``/logs/verifier/reward.txt`` writes into
  the sandbox), and the targets of uploads and sources of downloads;

and back, ``<root>`` removed, in commands' output and in the text of downloaded files, so a caller
never sees the host folder (``pwd`` in ``/workdir`` prints ``/workdir``). Every other path is the
host's: ``/usr``, ``/bin``, ``python3`` and ``/tmp`` are shared with the host. A sandbox's ``/`` (its
default working directory without a ``WORKDIR``) is its root. Unprivileged user and mount namespaces
(``unshare -rm``) would give real paths, but are refused on many CI machines (Ubuntu's AppArmor
restriction, container seccomp profiles), which is what this tier must run on.

**The image.** Nothing is built: the host is the image. Of the Dockerfile, ``WORKDIR``, ``ENV`` and
``COPY``/``ADD`` of the task's own files are applied; ``FROM``, ``USER``, ``ARG`` and the like are
ignored, and ``RUN`` steps are *not run* (listed in :attr:`SubprocessEnvironment.skipped_steps`): a task
whose ``RUN`` installs what the host already has (``python3``) works, another does not. A ``COPY`` into
a host system folder (``/usr``, ``/etc``, ...) refuses the start.

**What it does not do.** One user: every command runs as the test process's user whatever ``user``
says (the class declares ``single_user = True``, so ``check_backend`` skips its user checks with that
reason). Network policies are accepted and recorded (:attr:`SubprocessEnvironment.network_history`),
never enforced. No resource limits, no compose services (``supports_compose = False``), no verifier
view (grading takes the seal's path, as on Docker). Binary files are copied as they are (a path inside
one is not translated). A process that clears its environment escapes the sandbox's process list
(processes are found by a variable in their environment).

What it offers beyond Harbor's interface, met structurally as a real backend would
(``trl_harbor.rollout.contract``): ``alive()``, ``resource_exhaustion()`` (never any), and the
native seal: ``list_processes()``, ``kill_processes(keep)``, ``file_fingerprints(patterns)`` read
from the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
import shlex
import shutil
import signal
import stat
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

__all__ = ["DEFAULT_PREFIXES", "SubprocessEnvironment"]

#: The sandbox paths that live in each sandbox's folder (Harbor's own, and the usual working folders).
DEFAULT_PREFIXES: tuple[str, ...] = (
    "/logs", "/tests", "/solution", "/workdir", "/app", "/home/user", "/root", "/installed-agent",
)  # fmt: skip

#: Host folders a sandbox prefix may not shadow (a ``COPY`` there needs a real image).
_SYSTEM = ("/", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/var", "/tmp",
           "/proc", "/sys", "/dev", "/run", "/boot", "/opt", "/srv", "/mnt", "/media", "/home")  # fmt: skip

#: The environment variable that marks a sandbox's processes (its value: the sandbox's id).
MARK = "FAST_BACKEND_SANDBOX"

_HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SubprocessEnvironment(BaseEnvironment):
    """A fake sandbox for the fast test tier: a host folder and ``bash`` subprocesses (see the module docstring).

    Attributes:
        single_user: Declared for ``check_backend``: every command runs as one user, whatever ``user`` says.
        supports_compose: It runs no compose services.
        network_history: The network modes set after start, in order (recorded, not enforced).
        skipped_steps: The Dockerfile's ``RUN`` steps, which were not run.
    """

    single_user: ClassVar[bool] = True
    supports_compose: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.root: Path | None = None
        self.network_history: list[str] = []
        self.skipped_steps: list[str] = []
        self._running = False
        self._workdir = "/"
        self._image_env: dict[str, str] = {}
        self._prefixes: tuple[str, ...] = DEFAULT_PREFIXES
        self._forward: re.Pattern[str] | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        """Harbor's environment type of the fake."""
        return "fast-subprocess"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """It accepts every network policy and switches per phase, recording them (enforcing none)."""
        return EnvironmentCapabilities(disable_internet=True, dynamic_network_policy=True)

    async def _apply_network_policy(self, network_policy: Any) -> None:
        self.network_history.append(network_policy.network_mode.value)

    def _validate_definition(self) -> None:
        if not (self.environment_dir / "Dockerfile").is_file() and not self.task_env_config.docker_image:
            raise FileNotFoundError(f"{self.environment_dir / 'Dockerfile'} not found (and no docker_image)")

    # ── paths ───────────────────────────────────────────────────────────────────────

    def _set_prefixes(self, extra: Sequence[str]) -> None:
        prefixes = set(DEFAULT_PREFIXES)
        for path in extra:
            top = "/" + path.strip("/").split("/", 1)[0]
            prefix = path.rstrip("/") if top == "/home" else top
            if prefix == "/home" or (top != "/home" and top in _SYSTEM):
                raise RuntimeError(
                    f"the fast backend cannot place {path!r} in a sandbox: it shares the host's {top} "
                    "(the host is its image); run this task on a real backend"
                )
            prefixes.add(prefix)
        self._prefixes = tuple(sorted(prefixes, key=len, reverse=True))
        alternatives = "|".join(re.escape(p) for p in self._prefixes)
        self._forward = re.compile(rf"(?<![\w.~/-])(?:{alternatives})(?=/|$|[^\w.-])")

    def _to_host(self, text: str) -> str:
        """A text (command, value, file) with every sandbox path made a path under the root."""
        assert self._forward is not None and self.root is not None
        root = str(self.root)
        return self._forward.sub(lambda m: root + m.group(0), text)

    def _from_host(self, text: str) -> str:
        """A text with the root removed again (what a caller sees)."""
        if self.root is None:
            return text
        root = str(self.root)
        return text.replace(root + "/", "/").replace(root, "/")

    def _host_path(self, path: str | os.PathLike[str]) -> Path:
        """Where a sandbox path is on the host (``/`` is the root; a path off the prefixes is the host's)."""
        assert self.root is not None
        text = str(path)
        if text.rstrip("/") == "":
            return self.root
        if not text.startswith("/"):
            text = self._workdir.rstrip("/") + "/" + text
        return Path(self._to_host(text))

    def _writable(self, path: str) -> Path:
        host = self._host_path(path)
        assert self.root is not None
        inside = host == self.root or self.root in host.parents
        if not inside and not str(host).startswith(tempfile.gettempdir().rstrip("/") + "/"):
            raise PermissionError(
                f"the fast backend writes only under its sandbox paths ({', '.join(self._prefixes)}) and the "
                f"host's temporary folder, not to {path!r}"
            )
        return host

    # ── lifecycle ───────────────────────────────────────────────────────────────────

    async def start(self, force_build: bool) -> None:
        """Make the sandbox's folder and apply the Dockerfile's ``WORKDIR``, ``ENV`` and ``COPY`` (no ``RUN``)."""
        self.root = Path(tempfile.mkdtemp(prefix=f"fast-sandbox-{self.id}-")).resolve()
        if re.search(r"[^\w./-]", str(self.root)):
            raise RuntimeError(f"the fast backend needs a temporary folder without special characters: {self.root}")
        steps = _dockerfile_steps(self.environment_dir / "Dockerfile")
        destinations = [self.task_env_config.workdir or ""]
        workdir = "/"
        for instruction, argument in steps:  # the paths first: every prefix before anything is written
            if instruction == "WORKDIR":
                workdir = _join(workdir, argument)
                destinations.append(workdir)
            elif instruction in ("COPY", "ADD"):
                destinations.append(_join(workdir, _copy_arguments(argument)[-1]))
        self._set_prefixes([d for d in destinations if d and d != "/"])
        for prefix in self._prefixes:
            (self.root / prefix.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for folder in ("logs/agent", "logs/verifier", "logs/artifacts"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self._workdir = "/"
        for instruction, argument in steps:
            self._apply(instruction, argument)
        if self.task_env_config.workdir:
            self._workdir = self.task_env_config.workdir
        self._host_path(self._workdir).mkdir(parents=True, exist_ok=True)
        self._running = True
        await self._upload_environment_dir_after_start()

    def _apply(self, instruction: str, argument: str) -> None:
        if instruction == "WORKDIR":
            self._workdir = _join(self._workdir, argument)
            self._host_path(self._workdir).mkdir(parents=True, exist_ok=True)
        elif instruction == "ENV":
            self._image_env.update(_env_pairs(argument))
        elif instruction in ("COPY", "ADD"):
            *sources, target = _copy_arguments(argument)
            destination = _join(self._workdir, target)
            for source in sources:
                local = (self.environment_dir / source).resolve()
                if not local.is_relative_to(self.environment_dir.resolve()) or not local.exists():
                    raise FileNotFoundError(f"COPY {source}: not in the task's environment/ folder")
                host = self._writable(destination)
                if local.is_dir():
                    self._copy_in(local, host)
                else:
                    into = host / local.name if target.endswith("/") or len(sources) > 1 else host
                    self._copy_file_in(local, into)
        elif instruction == "RUN":
            self.skipped_steps.append(argument)

    async def stop(self, delete: bool) -> None:
        """Kill every process of the sandbox and, with ``delete``, remove its folder."""
        self._running = False
        await asyncio.to_thread(self._kill, ())
        if delete and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    async def alive(self) -> bool:
        """Whether the sandbox runs (started, not stopped, its folder there)."""
        return self._running and self.root is not None and self.root.is_dir()

    async def resource_exhaustion(self) -> str | None:
        """Never any: the fake has no limits."""
        return None

    # ── commands ────────────────────────────────────────────────────────────────────

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` with ``bash`` on the host, its sandbox paths translated (``user`` is ignored).

        Raises:
            RuntimeError: If the sandbox is not running.
            TimeoutError: If it ran past ``timeout_sec`` (its process group is killed).
        """
        if not self._running or self.root is None:
            raise RuntimeError(f"the sandbox {self.session_id} is not running")
        variables = {
            "PATH": _HOST_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TMPDIR": tempfile.gettempdir(),
            **self._image_env, **(self._merge_env(env) or {}),
        }  # fmt: skip
        variables = {key: self._to_host(str(value)) for key, value in variables.items()}
        variables[MARK] = self.id
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            self._to_host(command),
            cwd=self._host_path(cwd or self._workdir),
            env=variables,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_sec or None)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"Command timed out after {timeout_sec} seconds") from None
            raise
        return ExecResult(
            stdout=self._from_host(stdout.decode(errors="replace")) or None,
            stderr=self._from_host(stderr.decode(errors="replace")) or None,
            return_code=process.returncode or 0,
        )

    # ── files ───────────────────────────────────────────────────────────────────────

    def _copy_file_in(self, source: Path, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        data = source.read_bytes()
        text = _text(data)
        target.write_bytes(data if text is None else self._to_host(text).encode())
        target.chmod(stat.S_IMODE(source.stat().st_mode) | stat.S_IRUSR | stat.S_IWUSR)

    def _copy_in(self, source: Path, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        for entry in source.rglob("*"):
            destination = target / entry.relative_to(source)
            if entry.is_symlink():
                destination.unlink(missing_ok=True)
                destination.symlink_to(os.readlink(entry))
            elif entry.is_dir():
                destination.mkdir(parents=True, exist_ok=True)
            else:
                self._copy_file_in(entry, destination)

    def _copy_file_out(self, source: Path, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        data = source.read_bytes()
        text = _text(data)
        target.write_bytes(data if text is None else self._from_host(text).encode())

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file into the sandbox (its text's sandbox paths translated)."""
        await asyncio.to_thread(self._copy_file_in, Path(source_path), self._writable(target_path))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy a host folder's contents into a sandbox folder (texts translated)."""
        await asyncio.to_thread(self._copy_in, Path(source_dir), self._writable(target_dir))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a sandbox file to the host (its text as the sandbox sees it)."""
        await asyncio.to_thread(self._copy_file_out, self._host_path(source_path), Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox folder's contents to a host folder, overwriting what is there."""
        source, target = self._host_path(source_dir), Path(target_dir)

        def copy() -> None:
            if not source.is_dir():
                raise FileNotFoundError(f"{source_dir}: no such folder in the sandbox")
            target.mkdir(parents=True, exist_ok=True)
            for entry in source.rglob("*"):
                destination = target / entry.relative_to(source)
                if entry.is_symlink():
                    destination.unlink(missing_ok=True)
                    destination.symlink_to(self._from_host(os.readlink(entry)))
                elif entry.is_dir():
                    destination.mkdir(parents=True, exist_ok=True)
                else:
                    self._copy_file_out(entry, destination)

        await asyncio.to_thread(copy)

    # ── the native seal ─────────────────────────────────────────────────────────────

    def _processes(self) -> dict[str, int]:
        """This sandbox's live processes, ``{"PID:START": pid}``, found by :data:`MARK` in their environment."""
        found = {}
        needle = f"{MARK}={self.id}".encode()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                if needle not in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    continue
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in ("Z", "X"):
                found[f"{name}:{fields[19]}"] = int(name)
        return found

    def _kill(self, keep: Sequence[str]) -> int:
        killed = 0
        for _ in range(100):
            victims = [pid for entry, pid in self._processes().items() if entry not in keep]
            if not victims:
                break
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
        return killed

    async def list_processes(self) -> list[str]:
        """The sandbox's processes as ``"PID:START"`` entries."""
        return list(await asyncio.to_thread(self._processes))

    async def kill_processes(self, keep: Sequence[str] = ()) -> int:
        """Kill every process of the sandbox not in ``keep``; how many were killed."""
        return await asyncio.to_thread(self._kill, tuple(keep))

    async def file_fingerprints(self, patterns: Sequence[tuple[str, int | None]]) -> dict[str, str]:
        """``{sandbox path: signature}`` of what ``patterns`` match (``(path, depth)``, wildcards allowed)."""

        def fingerprint() -> dict[str, str]:
            found: dict[str, str] = {}
            for pattern, depth in patterns:
                for match in glob.glob(str(self._host_path(pattern))):
                    _walk(Path(match), depth, found)
            return {self._from_host(path): signature for path, signature in found.items()}

        return await asyncio.to_thread(fingerprint)


def _walk(path: Path, depth: int | None, found: dict[str, str]) -> None:
    try:
        info = path.lstat()
    except OSError:
        return
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISDIR(info.st_mode):
        found[str(path)] = f"d|{mode:o}"
        if depth is None or depth > 0:
            with contextlib.suppress(OSError):
                for child in path.iterdir():
                    _walk(child, None if depth is None else depth - 1, found)
        return
    kind = "l" if stat.S_ISLNK(info.st_mode) else "f"
    found[str(path)] = f"{kind}|{mode:o}|{info.st_size}|{info.st_ino}|{info.st_ctime_ns}"


def _text(data: bytes) -> str | None:
    """The bytes as text, or ``None`` for a binary file (NUL bytes, or not UTF-8)."""
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _join(base: str, path: str) -> str:
    return os.path.normpath(path if path.startswith("/") else f"{base.rstrip('/')}/{path}")


def _dockerfile_steps(path: Path) -> list[tuple[str, str]]:
    """The Dockerfile's instructions, ``(INSTRUCTION, argument)``, continuations joined, comments dropped."""
    if not path.is_file():
        return []
    steps: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        instruction, _, argument = whole.partition(" ")
        steps.append((instruction.upper(), argument.strip()))
    return steps


def _copy_arguments(argument: str) -> list[str]:
    if argument.startswith("["):
        import json

        parts = [str(p) for p in json.loads(argument)]
    else:
        parts = shlex.split(argument)
    if any(p.startswith("--from") for p in parts):
        raise RuntimeError(f"COPY {argument}: the fast backend builds no stages (the host is its image)")
    return [p for p in parts if not p.startswith("--")]


def _env_pairs(argument: str) -> dict[str, str]:
    parts = shlex.split(argument)
    if parts and "=" not in parts[0]:  # the legacy form: ENV KEY value with spaces
        return {parts[0]: argument.split(None, 1)[1] if len(parts) > 1 else ""}
    return dict(part.split("=", 1) for part in parts if "=" in part)
