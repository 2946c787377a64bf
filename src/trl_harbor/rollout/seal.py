"""Grading on a backend without an isolated verifier view: the agent's processes and its tampering.

The local sandbox verifies in a view of the sandbox that the agent's processes cannot see or
touch (``verifier_view``, see :mod:`trl_harbor.rollout.grading`). Other backends (Docker, cloud
sandboxes) run Harbor's verifier in the agent's own container, as Harbor's trial does. For them a
:class:`Baseline` is taken before the agent's first command — the sandbox's own processes, and
the fingerprints of what the verifier runs (:mod:`trl_harbor.rollout.integrity`) — and applied
before grading (:meth:`Baseline.apply`):

* the agent's processes are kept (``HarborOptions.agent_processes="keep"``, Harbor's behaviour: a
  server the task asked for answers the tests) or killed (``"kill"``: nothing of the agent runs
  beside the verifier, but a task graded through a service the agent started scores 0);
* a change that replaces or shadows what the verifier runs scores 0 without running it.

Backends that can do either without running the sandbox's own programs meet
:class:`~trl_harbor.rollout.contract.NativeSeal`; elsewhere shell scripts run in the sandbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trl_harbor.rollout import integrity
from trl_harbor.rollout.contract import NativeSeal, isolating

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment

__all__ = ["Baseline", "SealReport"]

#: Prints the verifier's ``PATH`` and ``python3``'s import directories, NUL-separated.
_SEARCH_PATHS_PROBE = (
    'printf "%s\\0" "$PATH"; command -v python3 >/dev/null 2>&1 && python3 -c '
    '\'import site, sys; print("\\0".join([p for p in sys.path if p] + [site.getusersitepackages()]), end="")\''
)


@dataclass(frozen=True)
class SealReport:
    """What applying a baseline found.

    Attributes:
        killed: How many of the agent's processes were stopped.
        tampered: The changes the policy refuses (then the rollout scores 0 without verifying).
    """

    killed: int
    tampered: tuple[integrity.Change, ...] = ()


class Baseline:
    """The sandbox's own processes and the fingerprints of what the verifier runs, before the agent."""

    def __init__(self) -> None:
        self.processes: list[str] = []
        self.watches: list[integrity.Watch] = []
        self.files: dict[str, str] | None = None

    async def take_processes(self, environment: BaseEnvironment | None) -> None:
        """Remember the sandbox's own processes (kept by a kill): before anything of the agent's runs.

        Args:
            environment: The started sandbox (nothing is taken on an isolating backend).
        """
        if environment is None or isolating(environment):
            return
        if isinstance(environment, NativeSeal):
            self.processes = list(await environment.list_processes())
            return
        result = await environment.exec(integrity.PROCESS_SNAPSHOT_SCRIPT, user="root", timeout_sec=60)
        self.processes = (result.stdout or "").split()

    async def take_files(self, environment: BaseEnvironment | None, verifier_user: str | int | None) -> None:
        """Fingerprint what the verifier runs: its ``PATH``, ``python3``'s imports, start-up files, ``/tests``.

        Args:
            environment: The sandbox, prepared for the agent (nothing is taken on an isolating backend).
            verifier_user: The user the verifier runs as (whose ``PATH`` and site count).
        """
        if environment is None or isolating(environment):
            return
        with environment.with_default_user(verifier_user):
            result = await environment.exec(_SEARCH_PATHS_PROBE, timeout_sec=60)
        parts = (result.stdout or "").split("\0")
        self.watches = integrity.watches(parts[0].split(":"), [p for p in parts[1:] if p])
        self.files = await self._fingerprint(environment)

    async def kill(self, environment: BaseEnvironment) -> int:
        """Kill every process started since :meth:`take_processes`.

        Returns:
            How many were killed.
        """
        if isinstance(environment, NativeSeal):
            return int(await environment.kill_processes(self.processes))
        result = await environment.exec(integrity.kill_command(self.processes), user="root", timeout_sec=120)
        return int((result.stdout or "0").strip().splitlines()[-1] or 0)

    async def apply(self, environment: BaseEnvironment, kill: bool, allowed: Sequence[str] = ()) -> SealReport:
        """Kill the agent's processes if ``kill``, then compare the fingerprints.

        Args:
            environment: The sandbox about to be graded.
            kill: Stop every process the agent started first.
            allowed: Globs of paths the agent may change anyway.

        Returns:
            What was killed, and which changes are refused.

        Raises:
            Exception: Whatever the backend raises (the caller decides it is infrastructure).
        """
        killed = await self.kill(environment) if kill else 0
        if self.files is None:
            return SealReport(killed)
        after = await self._fingerprint(environment)
        changes = integrity.diff(self.files, after)
        return SealReport(killed, tuple(integrity.violations(changes, self.files, self.watches, allowed)))

    async def _fingerprint(self, environment: BaseEnvironment) -> dict[str, str]:
        if isinstance(environment, NativeSeal):
            return await environment.file_fingerprints([(w.pattern, w.depth) for w in self.watches])
        result = await environment.exec(integrity.fingerprint_command(self.watches), user="root", timeout_sec=300)
        return integrity.parse_fingerprints(result.stdout or "")
