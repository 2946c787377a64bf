"""Whether a Harbor backend does what the rollout core relies on: :func:`check_backend`, like Gymnasium's ``check_env``.

A backend is a Harbor ``BaseEnvironment`` subclass. :func:`check_backend` writes a small task to a
temporary folder (a Dockerfile ``FROM`` an image the caller may name, an instruction, a
``tests/test.sh`` writing ``/logs/verifier/reward.txt``), starts its sandbox through Harbor's
``EnvironmentFactory`` the way an episode does (:mod:`trl_harbor.rollout.backends`: the task's network
plan, its phases), and checks, each under a stable name (:data:`CHECKS`):

* Harbor's interface as the core uses it: ``exec`` (status, output, ``cwd``, ``env``, the image's
  ``WORKDIR``, the task's environment, a timeout that raises and kills), uploads and downloads of files
  and folders, users (``exec(user=...)``, ``with_default_user``), ``set_network_policy`` per phase, ``stop``;
* the optional protocols of :mod:`trl_harbor.rollout.contract` the class or the sandbox meets
  (``isinstance``), by behaviour: ``alive()``, the native seal, the verifier's view,
  ``resource_exhaustion()``, and the class protocols' members;
* cleanup: after ``stop`` a command fails and no process of the sandbox is left (where this host can see them).

Every sandbox it starts is stopped, whatever fails. A backend whose sandboxes have one user (every
command runs as it, whatever ``user`` says: a fake for tests) declares ``single_user = True`` on its
class (:class:`SingleUser`): the user checks are then skipped, with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pkgutil
import tempfile
import textwrap
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from trl_harbor import runtime
from trl_harbor.rollout.backends import Backend, resolve_backend
from trl_harbor.rollout.contract import (
    ComposeDeclaration,
    ExhaustionReport,
    IdleResources,
    ImageCache,
    IsolatedVerification,
    Liveness,
    NativeSeal,
    VerifierView,
)
from trl_harbor.rollout.episode import COMMAND_GRACE_SEC, _is_timeout

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.task import Task

__all__ = [
    "CHECKS",
    "DEFAULT_IMAGE",
    "BackendConformanceError",
    "CheckResult",
    "ConformanceReport",
    "SingleUser",
    "Violation",
    "check_backend",
]

#: The image the check's task starts ``FROM`` unless told otherwise (the bundled suite's base).
DEFAULT_IMAGE = "debian:bookworm-slim"

#: Every check, by its stable name, with what it checks (one line).
CHECKS: dict[str, str] = {
    "start": "the sandbox of a small task starts through Harbor's factory, with the task's network plan, as an "
    "episode starts it",
    "exec.return_code": "exec returns the command's exit status",
    "exec.stdout": "exec returns what the command wrote to stdout",
    "exec.stderr": "what the command wrote to stderr reaches the caller (in stderr, or merged into stdout as "
    "Harbor's Docker backend does)",
    "exec.workdir": "a command given no cwd runs in the image's WORKDIR",
    "exec.cwd": "exec(cwd=...) runs the command in that folder",
    "exec.env": "exec(env=...) sets the command's variables, spaces and quotes intact",
    "exec.task_env": "the task's [environment.env] reaches the commands",
    "exec.timeout": "a command past timeout_sec raises, in time, an error the core reads as a timeout",
    "exec.timeout_kills": "the timed-out command is killed, not left running in the sandbox",
    "files.upload_file": "upload_file puts the bytes at the path (exec sees them) and download_file gives them back",
    "files.upload_dir": "upload_dir puts a folder's contents (nested) into the target folder, and download_dir "
    "gives them back",
    "files.download_file": "download_file gives the exact bytes a command wrote in the sandbox",
    "files.download_dir": "download_dir gives a folder a command wrote, nested files included",
    "users.exec_user": "exec(user=...) runs the command as that user (root, and a non-root user of the image)",
    "users.default_user": "with_default_user(...) sets the user of commands that name none, and restores it after",
    "network.plan": "set_network_policy takes the plan's agent and verifier phases, as the core switches them, and "
    "the sandbox runs on",
    "network.phases": "a task whose agent and verifier phases differ starts, switches to each phase and runs "
    "commands (or is refused at creation, as Harbor allows)",
    "liveness": "alive() is True while the sandbox runs and False after stop (Liveness)",
    "exhaustion_report": "resource_exhaustion() is None on a healthy sandbox (ExhaustionReport)",
    "native_seal.list_processes": "list_processes() lists a process the agent started, as PID:START (NativeSeal)",
    "native_seal.file_fingerprints": "file_fingerprints() lists a file and its folder, and the file's signature "
    "changes when it changes (NativeSeal)",
    "kill_processes": "kill_processes(keep) kills the agent's process, says how many, and the sandbox runs on "
    "(NativeSeal, IsolatedVerification)",
    "isolated_verification.view": "verifier_view() opens a view that runs commands, sees the agent's file and "
    "reports concealed (IsolatedVerification)",
    "image_cache": "the class's image_store(cache_dir, host_trust=...) takes those arguments (ImageCache)",
    "idle_resources": "the class's release_idle() runs with no arguments (IdleResources)",
    "compose_declaration": "the class's supports_compose is a bool (ComposeDeclaration)",
    "stop": "stop(delete=True) returns",
    "cleanup.exec": "after stop, a command fails (raises, or returns a non-zero status)",
    "cleanup.processes": "after stop, no process of the sandbox is left (where this host can see the sandbox's "
    "processes)",
}  # fmt: skip

#: How to fix each check's violation (the backend's side).
FIXES: dict[str, str] = {
    "start": "make start(force_build=False) bring the sandbox up for a task with a plain Dockerfile",
    "exec.return_code": "return the command's exit status as ExecResult.return_code",
    "exec.stdout": "capture the command's stdout into ExecResult.stdout",
    "exec.stderr": "capture stderr into ExecResult.stderr (or merge it into stdout)",
    "exec.workdir": "run commands without cwd in task_env_config.workdir, else the image's WORKDIR",
    "exec.cwd": "run the command in the cwd it is given",
    "exec.env": "pass exec's env (merged by BaseEnvironment._merge_env) to the command",
    "exec.task_env": "pass BaseEnvironment._merge_env(env) (it holds the task's [environment.env]) to every command",
    "exec.timeout": "stop a command at timeout_sec and raise TimeoutError (or an error whose message says 'timed out')",
    "exec.timeout_kills": "kill the command's process (group) in the sandbox when it times out",
    "files.upload_file": "copy the file's bytes unchanged to the target path",
    "files.upload_dir": "copy the source folder's contents (not the folder itself) into target_dir, nested folders "
    "included",
    "files.download_file": "copy the sandbox file's bytes unchanged to the host path",
    "files.download_dir": "copy the sandbox folder's contents into target_dir, nested folders included",
    "users.exec_user": "run the command as exec's user (a name or uid), else as default_user",
    "users.default_user": "use self.default_user (BaseEnvironment._resolve_user) when exec names no user",
    "network.plan": "accept set_network_policy for the phases given at creation (phase_network_policies)",
    "network.phases": "enforce each phase's policy and switch between them, or refuse the task at creation",
    "liveness": "make alive() answer from the backend's own state: False once stop() ran",
    "exhaustion_report": "return None from resource_exhaustion() unless a limit was hit",
    "native_seal.list_processes": "list every live process of the sandbox as 'PID:START'",
    "native_seal.file_fingerprints": "map each matched sandbox path to a signature of its type, mode, size, inode "
    "and change time",
    "kill_processes": "kill every process of the sandbox not in keep, return how many, keep the sandbox running",
    "isolated_verification.view": "yield a Harbor environment over the agent's files with a concealed tuple of strings",
    "image_cache": "define image_store(cls, cache_dir=None, *, host_trust=True)",
    "idle_resources": "define release_idle(cls) with no other arguments",
    "compose_declaration": "set supports_compose to True or False on the class",
    "stop": "make stop(delete=True) return once the sandbox is gone",
    "cleanup.exec": "refuse commands (raise) once the sandbox is stopped",
    "cleanup.processes": "kill every process of the sandbox at stop",
}  # fmt: skip

#: The checks of the first sandbox (skipped when it does not start).
_SANDBOX_CHECKS = tuple(
    name for name in CHECKS if name not in ("start", "image_cache", "idle_resources", "compose_declaration")
)

#: A process name no program has: what the check starts in the sandbox carries it.
_MARK = "trl-harbor-conformance"


@runtime_checkable
class SingleUser(Protocol):
    """A backend class whose sandboxes have one user: every command runs as it, whatever ``user`` says.

    Declared (``single_user = True``) by fakes for tests; :func:`check_backend` then skips the user checks.
    """

    single_user: bool


@dataclass(frozen=True)
class Violation:
    """A check that failed: its name, what was wrong, and how to fix it."""

    check: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.check}: {self.problem}. Fix: {self.fix}."


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: ``status`` is ``"passed"``, ``"skipped"`` or ``"failed"``; ``detail`` says why."""

    name: str
    status: str
    detail: str = ""

    @property
    def explanation(self) -> str:
        """What the check checks (:data:`CHECKS`)."""
        return CHECKS[self.name]


@dataclass
class ConformanceReport:
    """What :func:`check_backend` found, one :class:`CheckResult` per check, in :data:`CHECKS` order.

    Attributes:
        backend: The backend checked (``module:Class``, or the ``environment_type`` given).
        results: Every check's outcome.
    """

    backend: str
    results: list[CheckResult] = field(default_factory=list)

    def _with(self, status: str) -> list[CheckResult]:
        return [r for r in self.results if r.status == status]

    @property
    def passed(self) -> list[CheckResult]:
        """The checks that passed."""
        return self._with("passed")

    @property
    def skipped(self) -> list[CheckResult]:
        """The checks skipped, each with why."""
        return self._with("skipped")

    @property
    def violations(self) -> list[Violation]:
        """The checks that failed, with the fix."""
        return [Violation(r.name, r.detail, FIXES[r.name]) for r in self._with("failed")]

    @property
    def ok(self) -> bool:
        """Whether no check failed."""
        return not self.violations

    def __str__(self) -> str:
        width = max(len(name) for name in CHECKS)
        lines = [
            f"check_backend({self.backend}): {len(self.passed)} passed, {len(self.skipped)} skipped, "
            f"{len(self.violations)} failed"
        ]
        for result in self.results:
            why = result.detail if result.status != "passed" else result.explanation
            lines.append(f"  {result.status:<7}  {result.name:<{width}}  {why}")
        return "\n".join(lines)


class BackendConformanceError(AssertionError):
    """A backend failed :func:`check_backend`.

    Attributes:
        violations: What failed, by check, each with its fix.
        report: The whole report (passed and skipped checks too).
    """

    def __init__(self, report: ConformanceReport) -> None:
        self.report = report
        self.violations = report.violations
        listed = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{report.backend} fails {len(self.violations)} backend check(s):\n{listed}\n\n{report}")


def check_backend(
    environment_class: type[BaseEnvironment] | str,
    *,
    image: str = DEFAULT_IMAGE,
    environment_kwargs: Mapping[str, Any] | None = None,
    skip: Iterable[str] | Mapping[str, str] = (),
    user: str = "nobody",
    start_timeout_sec: float = 900,
    grace_sec: float = COMMAND_GRACE_SEC,
) -> ConformanceReport:
    """Check that a Harbor backend does what trl-harbor's rollout core relies on.

    Starts (and always stops) a sandbox of a small task written to a temporary folder, and a second
    one for the per-phase network check, through Harbor's ``EnvironmentFactory`` as episodes do.

    Args:
        environment_class: The backend: a ``BaseEnvironment`` subclass importable as ``module:Class``
            (as Harbor loads plug-ins), or an ``environment_type`` string (``"local"``, ``"docker"``,
            ``"module:Class"``).
        image: What the task's Dockerfile starts ``FROM`` (it needs ``bash``, ``/proc`` and ``user``).
        environment_kwargs: The backend's options (Harbor's environment ``kwargs``, ``--ek``).
        skip: Names of checks (:data:`CHECKS`) not to run, or ``{name: why}``; reported as skipped.
        user: A non-root user of the image, for the user checks.
        start_timeout_sec: How long a start (an image build included) may take.
        grace_sec: How long past a command's timeout the backend may take to stop it.

    Returns:
        The report: every check passed or skipped (with why).

    Raises:
        BackendConformanceError: When a check fails; it carries the violations and the report.
        ValueError: For an unknown check name in ``skip``, or a class not importable by its name.
    """
    skips = dict(skip) if isinstance(skip, Mapping) else dict.fromkeys(skip, "skipped by the caller")
    unknown = sorted(set(skips) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check names {unknown}; the checks are {sorted(CHECKS)}")
    backend = _backend(environment_class, environment_kwargs)
    with tempfile.TemporaryDirectory(prefix="trl-harbor-conformance-") as folder:
        checker = _Checker(backend, Path(folder), image, user, skips, start_timeout_sec, grace_sec)
        runtime.run(checker.run())
    report = ConformanceReport(
        environment_class if isinstance(environment_class, str) else _import_path(environment_class)
    )
    report.results = [checker.results[name] for name in CHECKS]
    if not report.ok:
        raise BackendConformanceError(report)
    return report


def _import_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _backend(environment_class: type[BaseEnvironment] | str, options: Mapping[str, Any] | None) -> Backend:
    if isinstance(environment_class, str):
        return resolve_backend(environment_class, dict(options or {}))
    path = _import_path(environment_class)
    try:
        found = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is not environment_class:
        raise ValueError(f"{path} does not import as itself: define the backend class at a module's top level")
    return resolve_backend(path, dict(options or {}))


def _write_task(root: Path, image: str, name: str, phases: bool = False) -> Path:
    """The check's small task: ``WORKDIR /workdir``, an environment variable, a test writing the reward."""
    task = root / name
    for folder in ("environment", "tests", "solution"):
        (task / folder).mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(f"FROM {image}\nWORKDIR /workdir\n")
    (task / "instruction.md").write_text("Write 42 to /workdir/answer.txt\n")
    agent_phase = '[agent]\nnetwork_mode = "no-network"\n' if phases else ""
    (task / "task.toml").write_text(
        textwrap.dedent(
            """\
            version = "1.0"
            [verifier]
            timeout_sec = 60
            [environment]
            network_mode = "public"
            build_timeout_sec = 900
            [environment.env]
            TRL_HARBOR_TASK_VALUE = "from the task"
            """
        )
        + agent_phase
    )
    test = task / "tests" / "test.sh"
    test.write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        'if [ "$(cat /workdir/answer.txt 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n"
    )
    solve = task / "solution" / "solve.sh"
    solve.write_text("#!/bin/bash\necho 42 > /workdir/answer.txt\n")
    for script in (test, solve):
        script.chmod(0o755)
    return task


class _Failed(Exception):
    """A check's violation (its message: what was wrong)."""


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise _Failed(problem)


def _probe(command: str, result: Any) -> str:
    return f"{command!r} gave status {result.return_code}, stdout {result.stdout!r}, stderr {result.stderr!r}"


class _Checker:
    """One run of the checks (see :func:`check_backend`)."""

    LATER: ClassVar[str] = "an earlier check failed"

    def __init__(
        self,
        backend: Backend,
        folder: Path,
        image: str,
        user: str,
        skips: dict[str, str],
        start_timeout: float,
        grace: float,
    ) -> None:
        self.backend, self.folder, self.image, self.user = backend, folder, image, user
        self.skips, self.start_timeout, self.grace = skips, start_timeout, grace
        self.results: dict[str, CheckResult] = {}
        self.env: BaseEnvironment | None = None
        self.stopped = False
        #: What ``alive()`` answered while the sandbox ran (``liveness`` is decided after stop).
        self.alive_running: Any = None

    # ── bookkeeping ─────────────────────────────────────────────────────────────────

    def skip(self, names: Iterable[str], why: str) -> None:
        for name in names:
            self.results.setdefault(name, CheckResult(name, "skipped", why))

    async def check(self, name: str, body: Callable[[], Awaitable[str | None]]) -> bool:
        """Run one check unless skipped: ``body`` raises :class:`_Failed` (or anything) for a violation,
        or returns a reason to skip. Whether it passed."""
        if name in self.results:
            return False
        if name in self.skips:
            self.skip([name], self.skips[name])
            return False
        try:
            skipped = await body()
        except _Failed as failure:
            self.results[name] = CheckResult(name, "failed", str(failure))
            return False
        except Exception as exc:  # noqa: BLE001 - any error of the backend is the check's finding
            self.results[name] = CheckResult(name, "failed", f"raised {type(exc).__name__}: {exc}")
            return False
        if skipped:
            self.skip([name], skipped)
            return False
        self.results[name] = CheckResult(name, "passed")
        return True

    # ── the run ─────────────────────────────────────────────────────────────────────

    async def run(self) -> None:
        from harbor.models.task.task import Task

        task = Task(_write_task(self.folder / "tasks", self.image, "conformance"))
        try:
            if await self.check("start", lambda: self._start(task)):
                await self._exec_checks()
                await self._file_checks()
                await self._user_checks()
                await self._network_plan(task)
                await self._protocol_checks()
                await self._timeout_checks()
                await self._cleanup_checks()
            else:
                self.skip(_SANDBOX_CHECKS, "the sandbox did not start (see start)")
        finally:
            if self.env is not None and not self.stopped:
                with contextlib.suppress(Exception):
                    await self.env.stop(delete=True)
        phased = Task(_write_task(self.folder / "tasks", self.image, "phases", phases=True))
        await self.check("network.phases", lambda: self._network_phases(phased))
        await self._class_checks()
        self.skip(CHECKS, "not reached")

    def _create(self, task: Task, name: str) -> BaseEnvironment:
        """Create (not start) a sandbox of ``task`` as :meth:`~trl_harbor.rollout.episode.Episode.provision` does:
        the plan's baseline policy, and the phases of the agent's sandbox."""
        from harbor.models.trial.paths import TrialPaths

        placement = self.backend.placement(task)
        plan = placement.plan
        return self.backend.create(
            task,
            TrialPaths(trial_dir=self.folder / f"trial-{name}"),
            session_id=f"{task.short_name}__{uuid.uuid4().hex[:8]}__env",
            network_policy=plan.agent_env_baseline,
            phase_network_policies=placement.sandbox_phases,
        )

    async def _start(self, task: Task) -> None:
        self.env = self._create(task, "main")
        plan = self.backend.placement(task).plan
        await asyncio.wait_for(self.env.start(force_build=False), self.start_timeout)
        if plan.agent_phase != plan.agent_env_baseline:
            await self.env.set_network_policy(plan.agent_phase)
        await self.env.run_healthcheck()

    async def exec(self, command: str, **options: Any) -> Any:
        assert self.env is not None
        return await asyncio.wait_for(self.env.exec(command, **options), 120)

    # ── Harbor's interface ──────────────────────────────────────────────────────────

    async def _exec_checks(self) -> None:
        async def status() -> None:
            ok, three = await self.exec("true"), await self.exec("exit 3")
            _expect(
                ok.return_code == 0 and three.return_code == 3,
                f"'true' gave {ok.return_code}, 'exit 3' gave {three.return_code}",
            )

        async def stdout() -> None:
            result = await self.exec("printf 'out-%s\\n' 1")
            _expect((result.stdout or "").strip() == "out-1", _probe("printf out-1", result))

        async def stderr() -> None:
            result = await self.exec("printf 'err-%s\\n' 2 >&2")
            _expect(
                "err-2" in (result.stderr or "") + (result.stdout or ""),
                "the stderr text reached neither stderr nor stdout: " + _probe("printf err-2 >&2", result),
            )

        async def workdir() -> None:
            result = await self.exec("pwd")
            _expect((result.stdout or "").strip() == "/workdir", "with WORKDIR /workdir, " + _probe("pwd", result))

        async def cwd() -> None:
            await self.exec("mkdir -p /workdir/sub/deeper")
            result = await self.exec("pwd", cwd="/workdir/sub/deeper")
            _expect(
                (result.stdout or "").strip() == "/workdir/sub/deeper",
                "with cwd='/workdir/sub/deeper', " + _probe("pwd", result),
            )

        async def env() -> None:
            value = "two words, \"quoted\" and 'single'"
            result = await self.exec('printf %s "$TRL_HARBOR_CHECK"', env={"TRL_HARBOR_CHECK": value})
            _expect(
                result.stdout == value,
                f"env TRL_HARBOR_CHECK={value!r}: " + _probe('printf %s "$TRL_HARBOR_CHECK"', result),
            )

        async def task_env() -> None:
            result = await self.exec('printf %s "$TRL_HARBOR_TASK_VALUE"')
            _expect(
                result.stdout == "from the task", "[environment.env] TRL_HARBOR_TASK_VALUE: " + _probe("printf", result)
            )

        checks = {"exec.return_code": status, "exec.stdout": stdout, "exec.stderr": stderr, "exec.workdir": workdir,
                  "exec.cwd": cwd, "exec.env": env, "exec.task_env": task_env}  # fmt: skip
        for name, body in checks.items():
            await self.check(name, body)

    async def _file_checks(self) -> None:
        env = self.env
        assert env is not None
        host = self.folder / "files"
        host.mkdir()
        payload = b"binary\0\xff\xfe bytes\n/workdir/answer.txt /logs/verifier\n"

        async def upload_file() -> None:
            (host / "up.bin").write_bytes(payload)
            await env.upload_file(host / "up.bin", "/workdir/uploaded.bin")
            seen = await self.exec("od -An -c /workdir/uploaded.bin | tr -d ' \\n'")
            await env.download_file("/workdir/uploaded.bin", host / "back.bin")
            _expect(
                (host / "back.bin").read_bytes() == payload,
                f"uploaded {payload!r}, downloaded {(host / 'back.bin').read_bytes()!r}",
            )
            _expect(
                "binary\\0" in (seen.stdout or ""),
                "the uploaded file is not what a command reads: " + _probe("od", seen),
            )

        async def upload_dir() -> None:
            tree = host / "tree"
            (tree / "nested" / "deeper").mkdir(parents=True)
            (tree / "top.txt").write_text("top\n")
            (tree / "nested" / "deeper" / "leaf.bin").write_bytes(payload)
            await env.upload_dir(tree, "/workdir/tree")
            listed = await self.exec("cat /workdir/tree/top.txt && test -f /workdir/tree/nested/deeper/leaf.bin")
            _expect(
                listed.return_code == 0 and "top" in (listed.stdout or ""),
                "the folder's contents are not at the target: " + _probe("cat /workdir/tree/top.txt", listed),
            )
            await env.download_dir("/workdir/tree", host / "tree-back")
            back = host / "tree-back" / "nested" / "deeper" / "leaf.bin"
            got = sorted(str(p.relative_to(host / "tree-back")) for p in (host / "tree-back").rglob("*"))
            top = (host / "tree-back" / "top.txt").read_text() if (host / "tree-back" / "top.txt").is_file() else None
            _expect(back.is_file() and back.read_bytes() == payload and top == "top\n", f"download_dir gave {got}")

        async def download_file() -> None:
            await self.exec("printf 'line one\\nline two\\001\\n' > /workdir/made.txt")
            await env.download_file("/workdir/made.txt", host / "made.txt")
            got = (host / "made.txt").read_bytes()
            _expect(
                got == b"line one\nline two\x01\n",
                f"a command wrote b'line one\\nline two\\x01\\n', download_file gave {got!r}",
            )

        async def download_dir() -> None:
            await self.exec(
                "mkdir -p /workdir/out/inner && printf a > /workdir/out/a.txt && printf b > /workdir/out/inner/b.txt"
            )
            await env.download_dir("/workdir/out", host / "out")
            got = {str(p.relative_to(host / "out")): p.read_bytes() for p in (host / "out").rglob("*") if p.is_file()}
            _expect(got == {"a.txt": b"a", "inner/b.txt": b"b"}, f"download_dir gave {got}")

        for name, body in (("files.upload_file", upload_file), ("files.upload_dir", upload_dir),
                           ("files.download_file", download_file), ("files.download_dir", download_dir)):  # fmt: skip
            await self.check(name, body)

    async def _user_checks(self) -> None:
        names = ("users.exec_user", "users.default_user")
        if isinstance(self.backend.environment_class, SingleUser) and self.backend.environment_class.single_user:
            self.skip(names, "the backend declares single_user: every command runs as one user")
            return
        env = self.env
        assert env is not None

        async def uid(**options: Any) -> str:
            result = await self.exec("id -u", **options)
            _expect(result.return_code == 0, _probe("id -u", result))
            return (result.stdout or "").strip()

        async def exec_user() -> None:
            root, other = await uid(user="root"), await uid(user=self.user)
            _expect(root == "0", f"exec('id -u', user='root') printed {root!r}")
            _expect(other not in ("", "0"), f"exec('id -u', user={self.user!r}) printed {other!r}")

        async def default_user() -> None:
            before = await uid()
            with env.with_default_user(self.user):
                inside = await uid()
            after = await uid()
            other = await uid(user=self.user)
            _expect(
                inside == other, f"inside with_default_user({self.user!r}) 'id -u' printed {inside!r}, not {other!r}"
            )
            _expect(after == before, f"after with_default_user 'id -u' printed {after!r}, before it {before!r}")

        await self.check("users.exec_user", exec_user)
        await self.check("users.default_user", default_user)

    async def _network_plan(self, task: Task) -> None:
        async def plan() -> None:
            assert self.env is not None
            placement = self.backend.placement(task)
            for phase in (placement.plan.agent_phase, placement.plan.verifier_phase, placement.plan.agent_phase):
                await self.env.set_network_policy(phase)
            result = await self.exec("echo up")
            _expect((result.stdout or "").strip() == "up", "after the phases' switches, " + _probe("echo up", result))

        await self.check("network.plan", plan)

    async def _network_phases(self, task: Task) -> str | None:
        """A second sandbox, of a task whose agent phase has no network and verifier phase has one."""
        placement = self.backend.placement(task)
        plan = placement.plan
        try:
            environment = self._create(task, "phases")
        except ValueError as refused:  # Harbor's validation: the backend cannot enforce or switch these
            return f"the backend refuses a task whose phases differ, at creation ({refused})"
        try:
            await asyncio.wait_for(environment.start(force_build=False), self.start_timeout)
            for phase in (plan.agent_phase, plan.verifier_phase):
                if phase != environment.network_policy:
                    await environment.set_network_policy(phase)
                result = await asyncio.wait_for(environment.exec("echo up"), 120)
                _expect(
                    (result.stdout or "").strip() == "up",
                    f"in the {phase.network_mode.value} phase, " + _probe("echo up", result),
                )
        finally:
            with contextlib.suppress(Exception):
                await environment.stop(delete=True)
        return None

    # ── the optional protocols ──────────────────────────────────────────────────────

    async def _background(self, tag: str) -> str:
        """Start a process carrying a marker in the sandbox, detached, and return the marker."""
        mark = f"{_MARK}-{tag}-{uuid.uuid4().hex[:8]}"
        await self.exec(f"nohup bash -c 'sleep 600; : {mark}' >/dev/null 2>&1 &")
        return mark

    async def _count(self, mark: str, kill: bool = False) -> int:
        """How many of the sandbox's processes carry ``mark`` (read in the sandbox's /proc; the probe's own
        command line does not hold the marker: it comes in its environment); with ``kill``, kill them."""
        action = 'kill -9 "${p#/proc/}" 2>/dev/null; ' if kill else ""
        script = (
            'n=0; for p in /proc/[0-9]*; do case "$(tr "\\0" " " < $p/cmdline 2>/dev/null)" in '
            f'*"$TRL_HARBOR_MARK"*) {action}n=$((n+1));; esac; done; echo $n'
        )
        result = await self.exec(script, env={"TRL_HARBOR_MARK": mark}, user="root")
        return int((result.stdout or "-1").strip().splitlines()[-1])

    async def _gone(self, mark: str) -> bool:
        deadline = asyncio.get_running_loop().time() + self.grace
        while await self._count(mark) > 0:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.2)
        return True

    async def _protocol_checks(self) -> None:
        env = self.env
        assert env is not None
        offered = {
            "liveness": Liveness, "exhaustion_report": ExhaustionReport, "native_seal.list_processes": NativeSeal,
            "native_seal.file_fingerprints": NativeSeal, "isolated_verification.view": IsolatedVerification,
        }  # fmt: skip
        for name, protocol in offered.items():
            if not isinstance(env, protocol):
                self.skip([name], f"the sandbox does not offer {protocol.__name__}")
        if not isinstance(env, NativeSeal | IsolatedVerification):
            self.skip(["kill_processes"], "the sandbox offers neither NativeSeal nor IsolatedVerification")

        async def exhaustion() -> None:
            answer = await env.resource_exhaustion()  # type: ignore[attr-defined]
            _expect(answer is None, f"resource_exhaustion() answered {answer!r} on a healthy sandbox")

        await self.check("exhaustion_report", exhaustion)
        if isinstance(env, Liveness):
            try:
                self.alive_running = await env.alive()
            except Exception as exc:  # noqa: BLE001 - reported by the liveness check
                self.alive_running = exc
        await self.check("native_seal.list_processes", self._list_processes)
        await self.check("kill_processes", self._kill_processes)
        await self.check("native_seal.file_fingerprints", self._fingerprints)
        await self.check("isolated_verification.view", self._view)

    async def _list_processes(self) -> None:
        env = self.env
        before = await env.list_processes()  # type: ignore[union-attr]
        _expect(
            isinstance(before, list) and all(isinstance(e, str) for e in before), f"list_processes() gave {before!r}"
        )
        mark = await self._background("list")
        try:
            # Polled, within the grace: a process caught mid-exec may not show yet (its environ reads empty).
            deadline = asyncio.get_running_loop().time() + self.grace
            while True:
                after = await env.list_processes()  # type: ignore[union-attr]
                new = set(after) - set(before)
                if new or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.2)
            _expect(bool(new), "a process started in the sandbox is not in list_processes()")
            _expect(
                all(e.count(":") == 1 and all(p.isdigit() for p in e.split(":")) for e in after),
                f"entries not PID:START: {after!r}",
            )
        finally:
            await self._count(mark, kill=True)

    async def _kill_processes(self) -> None:
        env = self.env
        keep = list(await env.list_processes()) if isinstance(env, NativeSeal) else []
        mark = await self._background("kill")
        _expect(await self._count(mark) == 1, "the process to kill did not start")
        killed = await env.kill_processes(keep)  # type: ignore[union-attr]
        _expect(isinstance(killed, int) and killed >= 1, f"kill_processes() returned {killed!r}")
        _expect(await self._gone(mark), "the agent's process still runs after kill_processes()")
        result = await self.exec("echo up")
        _expect((result.stdout or "").strip() == "up", "after kill_processes(), " + _probe("echo up", result))

    async def _fingerprints(self) -> None:
        env = self.env
        await self.exec("mkdir -p /workdir/fp && printf one > /workdir/fp/file.txt")
        patterns = [("/workdir/fp", None), ("/workdir/f?", 0)]
        first = await env.file_fingerprints(patterns)  # type: ignore[union-attr]
        _expect(
            isinstance(first, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in first.items()),
            f"file_fingerprints() gave {first!r}",
        )
        _expect(
            {"/workdir/fp", "/workdir/fp/file.txt"} <= set(first),
            f"file_fingerprints({patterns}) gave the paths {sorted(first)}",
        )
        await self.exec("printf 'two, longer' > /workdir/fp/file.txt")
        second = await env.file_fingerprints(patterns)  # type: ignore[union-attr]
        _expect(
            second.get("/workdir/fp/file.txt") != first["/workdir/fp/file.txt"],
            "the file changed, its signature did not",
        )

    async def _view(self) -> str | None:
        env = self.env
        if not env.isolated_verification:  # type: ignore[union-attr]
            return "the sandbox offers a verifier view but isolated_verification is false (told not to use it)"
        await self.exec("printf agent-made > /workdir/agent.txt")
        async with env.verifier_view(allowed_changes=(), network_policy=env.network_policy) as view:  # type: ignore[union-attr]
            _expect(isinstance(view, VerifierView), "the view has no concealed attribute")
            concealed = view.concealed
            _expect(
                isinstance(concealed, tuple) and all(isinstance(c, str) for c in concealed),
                f"concealed is {concealed!r}",
            )
            result = await asyncio.wait_for(view.exec("cat /workdir/agent.txt"), 120)
            _expect(result.stdout == "agent-made", "in the view, " + _probe("cat /workdir/agent.txt", result))

    async def _timeout_checks(self) -> None:
        mark = f"{_MARK}-timeout-{uuid.uuid4().hex[:8]}"
        outcome: dict[str, Any] = {}

        async def timeout() -> None:
            assert self.env is not None
            command = asyncio.ensure_future(self.env.exec(f"sleep 600; : {mark}", timeout_sec=2))
            done, _ = await asyncio.wait({command}, timeout=2 + self.grace)
            if not done:
                command.cancel()
                await asyncio.wait({command})
                raise _Failed(f"exec(timeout_sec=2) of 'sleep 600' had not returned {2 + self.grace:g} s later")
            error = command.exception()
            _expect(error is not None, f"exec(timeout_sec=2) of 'sleep 600' returned instead of raising: {command}")
            outcome["error"] = error
            _expect(
                _is_timeout(error),
                f"the timeout raised {type(error).__name__}: {error}, which the core does not read as a timeout",
            )

        async def kills() -> str | None:
            if "error" not in outcome:
                return "exec.timeout did not pass"
            _expect(await self._gone(mark), f"the timed-out command was still running {self.grace:g} s later")
            return None

        await self.check("exec.timeout", timeout)
        await self.check("exec.timeout_kills", kills)

    # ── stop and cleanup ────────────────────────────────────────────────────────────

    async def _cleanup_checks(self) -> None:
        env = self.env
        assert env is not None
        mark = await self._background("left")
        seen = _host_processes(mark)

        async def stop() -> None:
            self.stopped = True
            await asyncio.wait_for(env.stop(delete=True), 300)

        if not await self.check("stop", stop):
            self.skip(["cleanup.exec", "cleanup.processes", "liveness"], "stop failed")
            return

        async def liveness() -> None:
            _expect(self.alive_running is True, f"alive() answered {self.alive_running!r} while the sandbox ran")
            answer = await env.alive()  # type: ignore[attr-defined]
            _expect(answer is False, f"alive() answered {answer!r} after stop")

        async def refused() -> None:
            try:
                result = await asyncio.wait_for(env.exec("echo still-here"), 120)
            except Exception:  # noqa: BLE001 - refusing is the point
                return
            _expect(result.return_code != 0, "after stop, " + _probe("echo still-here", result))

        async def processes() -> str | None:
            if not seen:
                return "the sandbox's processes cannot be seen from this host"
            deadline = asyncio.get_running_loop().time() + self.grace
            while _host_processes(mark):
                _expect(
                    asyncio.get_running_loop().time() < deadline,
                    f"host processes {_host_processes(mark)} of the sandbox run {self.grace:g} s after stop",
                )
                await asyncio.sleep(0.2)
            return None

        if isinstance(env, Liveness):
            await self.check("liveness", liveness)
        await self.check("cleanup.exec", refused)
        await self.check("cleanup.processes", processes)

    async def _class_checks(self) -> None:
        cls = self.backend.environment_class
        if not isinstance(cls, ImageCache):
            self.skip(["image_cache"], "the class does not offer ImageCache")
        if not isinstance(cls, IdleResources):
            self.skip(["idle_resources"], "the class does not offer IdleResources")
        if not isinstance(cls, ComposeDeclaration):
            self.skip(["compose_declaration"], "the class does not declare supports_compose (taken to run compose)")

        async def image_cache() -> None:
            try:
                inspect.signature(cls.image_store).bind(None, host_trust=False)  # type: ignore[attr-defined]
            except TypeError as exc:
                raise _Failed(
                    f"image_store{inspect.signature(cls.image_store)} cannot take (cache_dir, host_trust=...): {exc}"
                ) from None  # type: ignore[attr-defined]

        async def idle() -> None:
            cls.release_idle()  # type: ignore[attr-defined]

        async def compose() -> None:
            value = cls.supports_compose  # type: ignore[attr-defined]
            _expect(isinstance(value, bool), f"supports_compose is {value!r}")

        await self.check("image_cache", image_cache)
        await self.check("idle_resources", idle)
        await self.check("compose_declaration", compose)


def _host_processes(mark: str) -> list[int]:
    """This host's live processes whose command line holds ``mark`` (none where the sandbox runs elsewhere)."""
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if mark.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(name))
    return found
