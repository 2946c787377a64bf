"""Progress of the long phases inside a training step: sandbox starts and verification.

The library reports; an application shows. Components call :func:`report` with a phase name and
counts; nothing happens unless a reporter was installed with :func:`set_reporter` (the
``trl-harbor train`` command installs :class:`LineReporter`). Reporting is thread-safe and costs
a function call when nobody listens.

Phases reported:

- ``"sandbox starts"``: ``done`` sandboxes of this burst are up, of ``total`` requested;
- ``"verification"``: ``done`` rollouts of the batch are graded, of ``total``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

__all__ = ["LineReporter", "Reporter", "SandboxStarts", "gather", "report", "set_reporter"]


class Reporter(Protocol):
    """Receives progress: ``(phase, done, total)``; ``done == total`` ends the phase."""

    def __call__(self, phase: str, done: int, total: int) -> None: ...


_reporter: Reporter | None = None
_lock = threading.Lock()


def set_reporter(reporter: Reporter | None) -> Reporter | None:
    """Install the process's progress reporter (``None``: none).

    Args:
        reporter: Called with ``(phase, done, total)`` from any thread.

    Returns:
        The reporter it replaces.
    """
    global _reporter
    with _lock:
        previous, _reporter = _reporter, reporter
    return previous


def report(phase: str, done: int, total: int) -> None:
    """Report progress of a phase to the installed reporter, if any; never raises.

    Args:
        phase: The phase's name.
        done: How many of its units are done.
        total: How many there are.
    """
    reporter = _reporter
    if reporter is None:
        return
    try:
        reporter(phase, done, total)
    except Exception:  # noqa: BLE001 - showing progress must never break training
        pass


async def gather[T](phase: str, awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Await ``awaitables`` together, reporting each one's end as progress of ``phase``.

    Args:
        phase: The phase's name.
        awaitables: What to await.

    Returns:
        Their results, in order (an exception propagates, as from ``asyncio.gather``).
    """
    done = 0

    async def one(awaitable: Awaitable[T]) -> T:
        nonlocal done
        try:
            return await awaitable
        finally:
            done += 1
            report(phase, done, len(awaitables))

    return list(await asyncio.gather(*(one(a) for a in awaitables)))


class SandboxStarts:
    """Counts the sandboxes of a burst of starts (those requested while others are still starting)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requested = 0
        self.ready = 0

    def started(self) -> None:
        """One more sandbox was requested."""
        with self._lock:
            if self.ready == self.requested:  # the previous burst is over: a new one begins
                self.requested = self.ready = 0
            self.requested += 1
            done, total = self.ready, self.requested
        report("sandbox starts", done, total)

    def finished(self) -> None:
        """One requested sandbox is up (or failed to start)."""
        with self._lock:
            self.ready = min(self.ready + 1, self.requested)
            done, total = self.ready, self.requested
        report("sandbox starts", done, total)


#: The process's burst of sandbox starts (see :class:`SandboxStarts`).
SANDBOX_STARTS = SandboxStarts()


class LineReporter:
    """Shows progress as one line per phase: rewritten in place on a terminal, else once at its end.

    Args:
        write: Where text goes (e.g. ``sys.stderr.write``).
        terminal: Whether ``write`` is a terminal (then the line is redrawn as counts change).
        min_seconds: Phases shorter than this are not shown.
        clock: Seconds from a monotonic clock.
    """

    def __init__(
        self,
        write: Callable[[str], object],
        terminal: bool,
        min_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.write = write
        self.terminal = terminal
        self.min_seconds = min_seconds
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, phase: str, done: int, total: int) -> None:
        """Record one update (see :class:`Reporter`)."""
        now = self.clock()
        with self._lock:
            started = self._started.setdefault(phase, now)
            elapsed = now - started
            if done >= total:
                del self._started[phase]
                if elapsed >= self.min_seconds:
                    end = "\r\033[K" if self.terminal else ""
                    self.write(f"{end}  {phase}: {total}/{total} in {elapsed:.1f} s\n")
            elif self.terminal and elapsed >= self.min_seconds:
                self.write(f"\r\033[K  {phase}: {done}/{total} ({elapsed:.0f} s)")
