"""One process-wide asyncio event loop for every Harbor call made from synchronous code.

Harbor is fully asynchronous, and several of its backends keep class-level asyncio locks
and clients that are bound to the loop they were first used on. TRL, on the other hand,
drives environments synchronously from one thread. This module bridges the two: it owns a
single event loop running forever in a daemon thread, and :func:`run` submits a coroutine
to it and blocks until the result is ready. Every environment in the process shares that
loop, so backend state created by one environment is valid for all the others. Its blocking
jobs (``asyncio.to_thread``) run in daemon threads, which the exit does not wait for.

It also keeps a registry of teardown coroutines (:func:`register_cleanup`) that
:func:`close_all` runs: on demand, at interpreter exit, and on SIGTERM (after which the
signal's previous handler runs, or the process exits) — once armed (:func:`arm`), which the loop's
start and every environment's construction do; importing the module installs nothing. Ctrl-C (SIGINT) raises
``KeyboardInterrupt`` as usual, and the exit runs the teardowns. A process started with a
signal ignored keeps ignoring it (``pytest ... &`` from a script ignores SIGINT, and Python then
never raises ``KeyboardInterrupt``).

This module knows nothing about TRL, Harbor or the rest of the project.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import queue
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

__all__ = [
    "arm",
    "close_all",
    "exiting",
    "get_loop",
    "limit",
    "on_loop_thread",
    "register_cleanup",
    "run",
    "submit",
    "unregister_cleanup",
]

logger = logging.getLogger(__name__)

# Re-entrant: the SIGTERM handler runs close_all on the main thread, which may be inside
# one of these critical sections when the signal arrives.
_lock = threading.RLock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_cleanups: dict[int, Callable[[], Awaitable[Any]]] = {}
_cleanup_ids = itertools.count()


class _BlockingJobs(concurrent.futures.ThreadPoolExecutor):
    """The shared loop's executor (``asyncio.to_thread``): daemon threads that the exit does not wait for.

    ``concurrent.futures`` joins its own workers when the interpreter exits, before ``atexit``
    handlers run: one job blocked until a teardown (a lock another process's image build holds, a
    pipe a sandbox closes when stopped) would keep a Ctrl-C'd process from ever exiting, and its
    sandboxes from being stopped. Jobs still running at exit are abandoned, like the loop's thread.
    Only ``submit`` and ``shutdown`` of the base class are used (``set_default_executor`` wants one).
    """

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="trl-harbor-blocking")
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple] | None]
        self._jobs = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._started = 0
        self._limit = min(32, (os.cpu_count() or 1) + 4)  # as ThreadPoolExecutor's default
        self._start_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args, **kwargs)`` in a worker thread.

        Args:
            fn: The blocking callable.
            *args: Its positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            A future for its result.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, functools.partial(fn, **kwargs) if kwargs else fn, args))
        if not self._idle.acquire(blocking=False):  # no idle worker will take it: start one
            with self._start_lock:
                if self._started < self._limit:
                    name = f"trl-harbor-blocking-{self._started}"
                    try:
                        threading.Thread(target=self._work, name=name, daemon=True).start()
                    except RuntimeError:  # at interpreter exit: the caller runs it another way
                        if future.cancel():  # (unless a worker took it meanwhile)
                            raise
                    else:
                        self._started += 1
        return future

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                self._idle.release()
                job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the workers once the queued jobs are done (``wait`` is ignored: nothing waits for them).

        Args:
            wait: Accepted for the base class's interface.
            cancel_futures: Cancel the jobs that have not started.
        """
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in range(self._started):
            self._jobs.put(None)


def get_loop() -> asyncio.AbstractEventLoop:
    """Return the process-wide event loop, starting its daemon thread on first use.

    Returns:
        The running event loop that every Harbor coroutine of this process runs on.
    """
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            loop.set_default_executor(_BlockingJobs())
            thread = threading.Thread(target=loop.run_forever, name="trl-harbor-event-loop", daemon=True)
            thread.start()
            _loop, _thread = loop, thread
            arm()
        return _loop


def exiting() -> bool:
    """Whether the interpreter is exiting (its main thread has finished: ``atexit`` hooks run now).

    Returns:
        ``True`` from the moment the main thread is done.
    """
    return not threading.main_thread().is_alive()


def on_loop_thread() -> bool:
    """Whether the caller runs on the shared loop's thread (where blocking on it would deadlock).

    Returns:
        ``True`` on the loop's thread.
    """
    return _thread is not None and threading.current_thread() is _thread


def submit[T](coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start a coroutine on the shared loop without waiting for it.

    The coroutine runs to its end even when the caller drops the future: the loop holds its tasks
    weakly, and a task that waits on a stream reads through a reader its transport holds weakly too
    (``asyncio.StreamReaderProtocol``), so an unreferenced one is a cycle the collector may destroy
    mid-await. The future is kept here until it is done.

    Args:
        coro: The coroutine to run.

    Returns:
        A future for its result (``result()`` blocks; ``cancel()`` cancels the coroutine).
    """
    loop = get_loop()
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except BaseException:
        coro.close()
        raise
    _submitted.add(future)  # (a set's add and discard are atomic: no lock)
    future.add_done_callback(_submitted.discard)
    return future


#: The futures of :func:`submit` not done yet (they hold their tasks).
_submitted: set[concurrent.futures.Future[Any]] = set()


_limits: dict[tuple[str, int], asyncio.Semaphore] = {}


@contextlib.asynccontextmanager
async def limit(name: str, concurrency: int | None) -> AsyncIterator[None]:
    """Bound how many holders of ``(name, concurrency)`` run at once on the shared loop.

    Args:
        name: What is limited (e.g. sandbox starts).
        concurrency: At most this many at once; ``None`` for no limit.

    Yields:
        Nothing; the body runs while holding a slot.
    """
    if concurrency is None:
        yield
        return
    semaphore = _limits.setdefault((name, concurrency), asyncio.Semaphore(concurrency))
    async with semaphore:
        yield


def run[T](coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run a coroutine on the shared loop and block until it finishes.

    Args:
        coro: The coroutine to run.
        timeout: Seconds to wait before cancelling the coroutine; ``None`` waits forever.

    Returns:
        Whatever the coroutine returns.

    Raises:
        RuntimeError: When called from the shared loop's own thread (it would deadlock).
        TimeoutError: When ``timeout`` passes before the coroutine finishes.
        Exception: Whatever the coroutine raises is re-raised in the caller.
    """
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError(
            "trl_harbor.runtime.run() was called from the shared event loop's own thread; await the coroutine instead."
        )
    future = submit(coro)
    try:
        return future.result(timeout)
    except FutureTimeoutError as exc:
        if future.done():
            raise  # the coroutine's own TimeoutError, not this wait's
        future.cancel()
        raise TimeoutError(f"coroutine did not finish within {timeout} s") from exc
    except KeyboardInterrupt:
        future.cancel()
        raise


def register_cleanup(cleanup: Callable[[], Awaitable[Any]]) -> int:
    """Register an async teardown callable to be awaited by :func:`close_all`.

    Args:
        cleanup: A zero-argument callable returning an awaitable (e.g. ``env.stop``).

    Returns:
        A handle to pass to :func:`unregister_cleanup` once the resource is gone.
    """
    handle = next(_cleanup_ids)
    with _lock:
        _cleanups[handle] = cleanup
    return handle


def unregister_cleanup(handle: int) -> None:
    """Forget a teardown registered with :func:`register_cleanup` (unknown handles are ignored).

    Args:
        handle: The value :func:`register_cleanup` returned.
    """
    with _lock:
        _cleanups.pop(handle, None)


async def _run_cleanups(cleanups: list[Callable[[], Awaitable[Any]]]) -> None:
    async def one(cleanup: Callable[[], Awaitable[Any]]) -> None:
        try:
            await cleanup()
        except Exception as exc:  # best effort: one failing teardown must not block the rest
            logger.warning("trl-harbor teardown failed: %r", exc)

    await asyncio.gather(*(one(c) for c in cleanups))


def close_all(timeout: float | None = 120.0) -> None:
    """Run every registered teardown (stopping all live sandboxes) concurrently.

    Safe to call several times and from an ``atexit`` hook; a no-op when nothing is live.

    Args:
        timeout: Seconds to wait for the teardowns; ``None`` waits forever.
    """
    with _lock:
        cleanups = list(_cleanups.values())
        _cleanups.clear()
        alive = _loop is not None and _thread is not None and _thread.is_alive()
    if not cleanups or not alive:
        return
    if threading.current_thread() is _thread:  # pragma: no cover - defensive
        return
    try:
        run(_run_cleanups(cleanups), timeout=timeout)
    except Exception as exc:
        logger.warning("trl-harbor: closing sandboxes failed: %r", exc)


_previous_handlers: dict[int, Any] = {}


def _on_termination(signum: int, frame: Any) -> None:
    close_all(timeout=60)
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        raise SystemExit(128 + signum)


def _install_signal_handlers() -> None:
    """Stop every sandbox on SIGTERM before the process goes (main thread only, chained)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM,):
        with contextlib.suppress(ValueError, OSError):
            current = signal.getsignal(signum)
            # Started with the signal ignored (as by its launcher), the process goes on ignoring it, as
            # Python does with SIGINT: stopping every sandbox, then going on training, would break each rollout.
            if current is _on_termination or current is None or current == signal.SIG_IGN:
                continue
            _previous_handlers[signum] = current
            signal.signal(signum, _on_termination)


_armed = False
_signals_armed = False


def arm() -> None:
    """Stop every sandbox at exit and on SIGTERM, from now on (idempotent).

    Nothing is installed when this module is imported: a library must not take the process's
    SIGTERM handler or exit hooks from its user (torchrun, accelerate and SLURM rely on theirs)
    before it has anything to stop. The shared loop arms itself when it starts; environments and
    rollout workers arm it when they are built, because only the main thread may install a
    signal handler and, under ``AsyncGRPOTrainer``, the loop starts on a worker thread. The
    previous SIGTERM handler still runs after the teardown.
    """
    global _armed, _signals_armed
    with _lock:
        if not _armed:
            _armed = True
            atexit.register(close_all)
        if not _signals_armed and threading.current_thread() is threading.main_thread():
            _signals_armed = True
            _install_signal_handlers()
