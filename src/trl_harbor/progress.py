"""Progress of the long phases of a run: sampling, sandbox starts, verification, the model's update.

The library reports; an application shows. Components call :func:`report` with a phase name and
counts; nothing happens unless a reporter was installed with :func:`set_reporter` (the
``trl-harbor train`` command installs :class:`LineReporter`). Reporting is thread-safe and costs
a function call when nobody listens.

Phases reported:

- ``"sandbox starts"``: ``done`` sandboxes of this burst are up, of ``total`` requested;
- ``"verification"``: ``done`` rollouts of the batch are graded, of ``total``;
- ``"generation"``: the trainer's model samples a turn of the batch (one unit, :func:`phase`);
- ``"model update"``: the trainer's forward and backward passes of a step (one unit);
- ``"held-out generation"``: a batch of held-out prompts sampled, of ``total`` batches;
- ``"held-out rollouts"``: ``done`` held-out rollouts graded, of ``total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Protocol

__all__ = ["LineReporter", "Reporter", "SandboxStarts", "gather", "phase", "report", "set_reporter"]


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


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Report a phase of one unit: begun on entry (``0/1``), ended on exit (``1/1``), even by an exception.

    Args:
        name: The phase's name.
    """
    report(name, 0, 1)
    try:
        yield
    finally:
        report(name, 1, 1)


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

    On a terminal the open phase's line is also redrawn every ``heartbeat`` seconds with its
    elapsed time, so that a long phase whose counts do not move (a model's forward and backward
    passes) never leaves the screen silent. :meth:`close` stops that.

    Args:
        write: Where text goes (e.g. ``sys.stderr.write``).
        terminal: Whether ``write`` is a terminal (then the line is redrawn as counts change).
        min_seconds: Phases shorter than this are not shown.
        clock: Seconds from a monotonic clock.
        heartbeat: Seconds between redraws of an open phase on a terminal (``None``: only on updates).
    """

    def __init__(
        self,
        write: Callable[[str], object],
        terminal: bool,
        min_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: float | None = 5.0,
    ) -> None:
        self.clock = clock
        self.write = write
        self.terminal = terminal
        self.min_seconds = min_seconds
        self.heartbeat = heartbeat
        self._started: dict[str, float] = {}
        self._counts: dict[str, tuple[int, int]] = {}
        self._latest: str | None = None  # the phase last updated: the one a heartbeat redraws
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._beating: threading.Thread | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        """Record one update (see :class:`Reporter`)."""
        now = self.clock()
        with self._lock:
            started = self._started.setdefault(phase, now)
            elapsed = now - started
            if done >= total:
                del self._started[phase]
                self._counts.pop(phase, None)
                self._latest = next(reversed(self._started), None)
                if elapsed >= self.min_seconds:
                    end = "\r\033[K" if self.terminal else ""
                    counts = "" if total == 1 else f": {total}/{total}"
                    self.write(f"{end}  {phase}{counts} in {elapsed:.1f} s\n")
                return
            self._counts[phase] = (done, total)
            self._latest = phase
            if self.terminal and elapsed >= self.min_seconds:
                self._draw(phase, now)
            if self.terminal and self.heartbeat is not None and self._beating is None:
                self._beating = threading.Thread(target=self._beat, name="trl-harbor-progress", daemon=True)
                self._beating.start()

    def _draw(self, phase: str, now: float) -> None:
        done, total = self._counts[phase]
        counts = "" if total == 1 else f": {done}/{total}"
        self.write(f"\r\033[K  {phase}{counts} ({now - self._started[phase]:.0f} s)")

    def tick(self) -> None:
        """Redraw the open phase's line with its elapsed time (the heartbeat calls this; a terminal only)."""
        now = self.clock()
        with self._lock:
            phase = self._latest
            if self.terminal and phase in self._counts and now - self._started[phase] >= self.min_seconds:
                self._draw(phase, now)

    def _beat(self) -> None:
        assert self.heartbeat is not None
        while not self._closed.wait(self.heartbeat):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - showing progress must never break training
                pass

    def close(self) -> None:
        """Stop the heartbeat (the reporter still shows updates)."""
        self._closed.set()
