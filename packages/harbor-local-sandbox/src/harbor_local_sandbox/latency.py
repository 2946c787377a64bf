"""The local sandbox with an injected start latency, recording when each sandbox works.

Cloud backends (E2B, Daytona, Modal, ...) take seconds to start a sandbox and tens of
milliseconds per command, which cannot be reproduced here without their APIs.
``LatencyLocalEnvironment`` is the local sandbox plus a fixed delay in ``start()`` (and,
optionally, in every ``exec()``): the stand-in for a cloud backend in ``benchmarks/batch.py`` and
in the concurrency tests. It also records, per process, the interval of every start and
every verifier run, so tests can check what overlapped without measuring speed.

    environment_type="harbor_local_sandbox.latency:LatencyLocalEnvironment"
    environment_kwargs={"start_latency_sec": 2.0, "exec_latency_sec": 0.05}
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from harbor.environments.base import ExecResult
from harbor.environments.options import EnvironmentOptions
from pydantic import Field

from harbor_local_sandbox.local import LocalEnvironment, LocalEnvironmentOptions

__all__ = ["Interval", "LatencyLocalEnvironment", "LatencyLocalEnvironmentOptions"]


class LatencyLocalEnvironmentOptions(LocalEnvironmentOptions):
    """Options of :class:`LatencyLocalEnvironment`.

    Attributes:
        start_latency_sec: Seconds added to every ``start()`` (a cloud sandbox's start-up).
        exec_latency_sec: Seconds added to every ``exec()`` (a cloud API's round trip).
    """

    start_latency_sec: float = Field(default=0.0, ge=0.0)
    exec_latency_sec: float = Field(default=0.0, ge=0.0)


@dataclass
class Interval:
    """When one operation of one sandbox ran (``time.monotonic()`` seconds).

    Attributes:
        kind: ``"start"`` or ``"verify"`` (the verifier's ``test.sh`` run).
        task: The task's name.
        begin: When it began.
        end: When it ended.
    """

    kind: str
    task: str
    begin: float
    end: float


class LatencyLocalEnvironment(LocalEnvironment):
    """The local sandbox, slower to start by ``start_latency_sec`` (see the module docstring)."""

    options_model: ClassVar[type[EnvironmentOptions] | None] = LatencyLocalEnvironmentOptions
    #: Every start and verifier run of this process, in completion order.
    intervals: ClassVar[list[Interval]] = []

    @staticmethod
    def type() -> str:
        """The environment's type name."""
        return "local-latency"

    async def start(self, force_build: bool) -> None:
        """Start the local sandbox, taking at least ``start_latency_sec`` in all.

        The local start runs during the delay: a cloud sandbox's start-up costs the caller
        waiting, not CPU.

        Args:
            force_build: As for :class:`LocalEnvironment`.
        """
        options = self.local_options
        assert isinstance(options, LatencyLocalEnvironmentOptions)
        begin = time.monotonic()
        await asyncio.gather(asyncio.sleep(options.start_latency_sec), super().start(force_build))
        self.intervals.append(Interval("start", self.environment_name, begin, time.monotonic()))

    async def exec(self, command: str, *args: Any, **kwargs: Any) -> ExecResult:
        """Run a command after ``exec_latency_sec``; verifier runs (``/tests/test.sh``) are recorded."""
        begin = time.monotonic()
        options = self.local_options
        assert isinstance(options, LatencyLocalEnvironmentOptions)
        await asyncio.sleep(options.exec_latency_sec)
        result = await super().exec(command, *args, **kwargs)
        if "/tests/test.sh" in command and "chmod" not in command:
            self.intervals.append(Interval("verify", self.environment_name, begin, time.monotonic()))
        return result
