"""Sealing a sandbox before it is graded: the agent's processes stop, its tampering is found.

A :class:`Seal` belongs to one episode. It is *taken* before the agent's first command (the
sandbox's own processes, and the fingerprints of what the verifier runs) and *applied* before
grading: every process started since is killed, and the fingerprints are compared under the
policy of :mod:`trl_harbor.integrity`. Backends that can do this without running the
sandbox's own programs provide ``list_processes()``/``kill_processes(keep)`` and
``file_fingerprints(patterns)`` (the local sandbox); elsewhere shell scripts run in the sandbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trl_harbor import integrity

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment

__all__ = ["Seal", "SealReport"]

#: Prints the verifier's ``PATH`` and ``python3``'s import directories, NUL-separated.
_SEARCH_PATHS_PROBE = (
    'printf "%s\\0" "$PATH"; command -v python3 >/dev/null 2>&1 && python3 -c '
    '\'import site, sys; print("\\0".join([p for p in sys.path if p] + [site.getusersitepackages()]), end="")\''
)


@dataclass(frozen=True)
class SealReport:
    """What applying a seal found.

    Attributes:
        killed: How many of the agent's processes were stopped.
        changes: Every change in the watched places.
        tampered: The changes the policy refuses (then the rollout scores 0 without verifying).
    """

    killed: int
    changes: tuple[integrity.Change, ...] = ()
    tampered: tuple[integrity.Change, ...] = ()


class Seal:
    """The baseline of one sandbox (its own processes, what the verifier runs) and its enforcement."""

    def __init__(self) -> None:
        self.processes: list[str] = []
        self.watches: list[integrity.Watch] = []
        self.files: dict[str, str] | None = None

    async def take_processes(self, environment: BaseEnvironment) -> None:
        """Remember the sandbox's own processes (kept at :meth:`apply`): before anything of the agent's runs.

        Args:
            environment: The started sandbox.
        """
        native = getattr(environment, "list_processes", None)
        if callable(native):
            self.processes = list(await native())
            return
        result = await environment.exec(integrity.PROCESS_SNAPSHOT_SCRIPT, user="root", timeout_sec=60)
        self.processes = (result.stdout or "").split()

    async def take_files(self, environment: BaseEnvironment, verifier_user: str | int | None) -> None:
        """Fingerprint what the verifier runs: its ``PATH``, ``python3``'s imports, start-up files, ``/tests``.

        Args:
            environment: The sandbox, prepared for the agent.
            verifier_user: The user the verifier runs as (whose ``PATH`` and site count).
        """
        with environment.with_default_user(verifier_user):
            result = await environment.exec(_SEARCH_PATHS_PROBE, timeout_sec=60)
        parts = (result.stdout or "").split("\0")
        self.watches = integrity.watches(parts[0].split(":"), [p for p in parts[1:] if p])
        self.files = await self._fingerprint(environment)

    async def apply(self, environment: BaseEnvironment, allowed: Sequence[str] = ()) -> SealReport:
        """Kill every process started since :meth:`take_processes`, then compare the fingerprints.

        Args:
            environment: The sandbox about to be graded.
            allowed: Globs of paths the agent may change anyway.

        Returns:
            What was killed and changed, and which changes are refused.

        Raises:
            Exception: Whatever the backend raises (the caller decides it is infrastructure).
        """
        native = getattr(environment, "kill_processes", None)
        if callable(native):
            killed = int(await native(self.processes))
        else:
            command = integrity.kill_command(self.processes)
            result = await environment.exec(command, user="root", timeout_sec=120)
            killed = int((result.stdout or "0").strip().splitlines()[-1] or 0)
        if self.files is None:
            return SealReport(killed)
        after = await self._fingerprint(environment)
        changes = integrity.diff(self.files, after)
        tampered = integrity.violations(changes, self.files, self.watches, allowed)
        return SealReport(killed, tuple(changes), tuple(tampered))

    async def _fingerprint(self, environment: BaseEnvironment) -> dict[str, str]:
        native = getattr(environment, "file_fingerprints", None)
        if callable(native):
            return await native([(w.pattern, w.depth) for w in self.watches])
        result = await environment.exec(integrity.fingerprint_command(self.watches), user="root", timeout_sec=300)
        return integrity.parse_fingerprints(result.stdout or "")
