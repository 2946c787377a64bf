"""A box's limits through cgroup v1 (memory, pids, cpu) or v2, where writable (as root; else rlimits):
the agent's leaf under the task's limits, the keel's (and the verifier's) beside it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
#: The cgroup under each controller (v1) or the root (v2) that holds every box's.
CGROUP_PARENT = "harbor-local-sandbox"
#: The one thread that moves processes between cgroups: the kernel runs moves one at a time (under
#: its cgroup mutex), and a move waiting on a grace period must not hold a worker of the loop's
#: default executor, which every start's other file work needs.
_MOVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="harbor-local-sandbox-cgroups")


class Cgroups:
    """The cgroups of one box: ``harbor-local-sandbox/<name>`` in each controller, with two leaves.

    ``agent`` holds the agent's supervisor and every process of the agent, under the task's
    limits (``None``: no such limit); ``keel`` holds the rest of the box — bubblewrap, its keel
    and, while it is graded, its verifier — under the box's own limits, which leave the verifier
    as much again: whatever the agent does to its leaf (fill its memory, its processes, its CPU
    time), the keel answers and the verifier has room to run."""

    #: The box's leaves.
    LEAVES = ("keel", "agent")

    def __init__(self, name: str, memory_mb: int | None, cpus: float | None, pids_max: int | None):
        #: The box's folders (one per controller), removed last.
        self.paths: list[Path] = []
        self.name = name
        self.limits = {"memory": memory_mb, "cpu": cpus, "pids": pids_max}

    def leaf(self, name: str) -> list[Path]:
        """The ``keel`` or ``agent`` leaf of the box, in each controller."""
        return [path / name for path in self.paths]

    @staticmethod
    @cache
    def mode() -> str | None:
        """``"v1"``, ``"v2"``, or ``None`` where this process cannot write cgroups."""
        if os.geteuid() != 0:
            return None
        if (ROOT / "memory").is_dir() and (ROOT / "pids").is_dir():
            return "v1"
        if (ROOT / "cgroup.controllers").exists():
            return "v2"
        return None

    def create(self) -> None:
        """Make the box's cgroups with their limits (none where cgroups are unusable: :attr:`paths` stays empty)."""
        try:
            self._create(limits=True)
        except OSError as error:
            logger.debug("cgroup limits unavailable (%s); falling back to rlimits", error)
            self.remove()

    def create_spare(self) -> None:
        """Make the folders in every controller, with no limits yet: a parked launcher's (:meth:`adopt`)."""
        try:
            self._create(limits=False)
        except OSError as error:
            logger.debug("no cgroups for a parked launcher (%s)", error)
            self.remove()

    def adopt(self, spare: Cgroups) -> None:
        """Take over a parked launcher's cgroups and write this box's limits there.

        They keep the spare's name (cgroup v2 cannot rename a group); a controller the box sets no
        limit in stays a group without one."""
        self.name = spare.name
        self.create()  # the folders exist: only the limits are written
        self.paths = list(dict.fromkeys([*self.paths, *spare.paths]))
        spare.paths = []

    def _create(self, limits: bool) -> None:
        mode = self.mode()
        if mode == "v1":
            for controller in _v1_controllers():
                self._make(ROOT / controller / CGROUP_PARENT / self.name, controller if limits else None)
        elif mode == "v2":
            parent = ROOT / CGROUP_PARENT
            if not parent.exists():
                parent.mkdir()
                (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            self._make(parent / self.name, "v2" if limits else None, subtree=True)

    def _make(self, path: Path, limits: str | None, subtree: bool = False) -> None:
        """The box's folder ``path`` and its leaves; ``limits``: which to write (a v1 controller, ``"v2"``).

        Plain ``os`` calls on strings: a start makes nine folders and writes a dozen files (v1), on
        the event loop, several starts at once."""
        base = str(path)
        try:
            os.mkdir(base)
        except FileExistsError:
            pass
        except FileNotFoundError:  # the first box: the parent too
            os.makedirs(base, exist_ok=True)
        if path not in self.paths:
            self.paths.append(path)
        if subtree and not os.path.exists(f"{base}/keel"):
            _write(f"{base}/cgroup.subtree_control", "+memory +pids +cpu")
        for leaf in self.LEAVES:
            with contextlib.suppress(FileExistsError):
                os.mkdir(f"{base}/{leaf}")
        if limits is None:
            return
        memory, cpus, pids = self.limits["memory"], self.limits["cpu"], self.limits["pids"]
        for where, share in ((f"{base}/agent", 1), (base, 2)):  # the box: the agent's again, for the rest
            if limits in ("memory", "v2") and memory:
                _write_memory(where, memory * share * 1024 * 1024, v2=limits == "v2")
            if limits in ("pids", "v2") and pids:
                _write(f"{where}/pids.max", str(pids * share))
            if limits in ("cpu", "v2") and cpus:
                with contextlib.suppress(OSError):
                    _write_cpu(where, cpus * share, v2=limits == "v2")

    def procs_files(self, leaf: str) -> list[int]:
        """``leaf``'s ``cgroup.procs`` in each controller, opened for writing (close-on-exec): for a
        process of the box to put itself (the launcher, ``"keel"``) or a child (the keel, ``"agent"``)
        there, instead of a move from here afterwards. Empty without cgroups, or where one cannot be
        opened (moved from here then, :meth:`moved`)."""
        opened: list[int] = []
        try:
            for path in self.leaf(leaf):
                opened.append(os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            for fd in opened:
                os.close(fd)
            return []
        return opened

    def agent_procs(self) -> list[int]:
        """:meth:`procs_files` of the agent's leaf, for the keel inside the box: cgroup v1 only (empty
        otherwise). A v1 write is allowed by the credentials the file was opened with (root's),
        whoever writes; v2 checks the writer's too on kernels before 5.16, and a box's v2 agent is
        moved from here."""
        return self.procs_files("agent") if self.mode() == "v1" else []

    def moved(self, pids: list[int], leaf: str = "keel") -> asyncio.Future:
        """:meth:`join` on the mover thread (a future of the running loop; done at once when there
        is nothing to move: no pids, or no cgroups, as without root)."""
        loop = asyncio.get_running_loop()
        if not pids or not self.paths:
            done = loop.create_future()
            done.set_result(None)
            return done
        return loop.run_in_executor(_MOVER, self.join, pids, leaf)

    @staticmethod
    def primed() -> asyncio.Future:
        """:func:`prime_moves` on the mover thread (a future of the running loop; it never fails)."""
        return asyncio.get_running_loop().run_in_executor(_MOVER, prime_moves)

    def join(self, pids: list[int], leaf: str = "keel") -> None:
        """Move processes into the box's ``leaf`` in every controller (members already, or exited
        meanwhile: skipped).

        Each move takes the kernel's thread-group lock for writing, which after a quiet spell waits
        for an RCU grace period (~8 ms here): a process already in place is not written again."""
        for path in self.leaf(leaf):
            procs = f"{path}/cgroup.procs"
            members = set(_read(procs).split())
            for pid in pids:
                if str(pid) not in members:
                    with contextlib.suppress(ProcessLookupError):
                        _write(procs, str(pid))

    def exhaustion(self) -> str | None:
        """Which limit the agent's processes ran into, from its leaf's event counters (``None``: none)."""
        found = []
        for path in self.leaf("agent"):
            counters = {}
            for name in ("memory.events", "memory.oom_control", "pids.events", "cpu.stat"):  # v2, v1, both
                with contextlib.suppress(OSError, ValueError):
                    for line in (path / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        counters[f"{name.split('.')[0]}.{key}"] = int(value)
            if counters.get("memory.oom_kill", 0) > 0:
                found.append(f"its memory limit: {counters['memory.oom_kill']} process(es) killed for memory")
            if counters.get("pids.max", 0) > 0:
                found.append(f"its process limit: {counters['pids.max']} fork(s) refused")
            throttled = counters.get("cpu.nr_throttled", 0)
            periods = counters.get("cpu.nr_periods", 0)
            if periods >= 10 and throttled * 2 > periods:  # most of its time at its CPU limit
                found.append(f"its CPU limit: throttled in {throttled} of {periods} periods")
        return "; ".join(dict.fromkeys(found)) or None

    def kill_and_remove(self) -> None:
        """Kill what is left in the box's cgroups, then remove them."""
        for path in self.paths:
            base = str(path)
            for where in (f"{base}/agent", f"{base}/keel", base):
                with contextlib.suppress(OSError):
                    for pid in _read(f"{where}/cgroup.procs").split():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), signal.SIGKILL)
        self.remove()

    def remove(self) -> None:
        """Remove the box's cgroups (once their processes have left them)."""
        for path in self.paths:
            base = str(path)
            for where in (*(f"{base}/{leaf}" for leaf in self.LEAVES), base):
                _rmdir_when_empty(where)
        self.paths = []


def _rmdir_when_empty(path: str) -> None:
    """Remove a cgroup folder: killed processes leave it a moment after SIGKILL (on a loaded machine,
    more than a few tries' worth: one left behind stays until the next run's sweep)."""
    deadline = time.monotonic() + 1
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.002)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(fd)


@cache
def _v1_controllers() -> tuple[str, ...]:
    """The v1 hierarchies a box limits (those mounted)."""
    return tuple(name for name in ("memory", "pids", "cpu") if (ROOT / name).is_dir())


@cache
def _has_memsw() -> bool:
    """Whether v1's memory controller accounts swap (``memory.memsw.*``: swap accounting on)."""
    return (ROOT / "memory" / "memory.memsw.limit_in_bytes").exists()


_CFS_PERIOD: list[int] = []


def _cfs_period(where: str) -> int:
    """v1's CFS period of a new cgroup: the kernel's default for every new one, read from the first."""
    if not _CFS_PERIOD:
        _CFS_PERIOD.append(int(_read(f"{where}/cpu.cfs_period_us")))
    return _CFS_PERIOD[0]


def _write_memory(where: str, size: int, v2: bool) -> None:
    if v2:
        _write(f"{where}/memory.max", str(size))
        with contextlib.suppress(OSError):
            _write(f"{where}/memory.swap.max", "0")
        return
    # v1: a child's limit may not exceed its parent's: the parent is written first when raising.
    _write(f"{where}/memory.limit_in_bytes", str(size))
    if _has_memsw():
        with contextlib.suppress(OSError):
            _write(f"{where}/memory.memsw.limit_in_bytes", str(size))


def _write_cpu(where: str, cpus: float, v2: bool) -> None:
    if v2:
        _write(f"{where}/cpu.max", f"{max(1000, int(100000 * cpus))} 100000")
        return
    _write(f"{where}/cpu.cfs_quota_us", str(max(1000, int(_cfs_period(where) * cpus))))


def remove_stale(is_stale: Callable[[str], bool]) -> None:
    """Kill and remove the cgroups of boxes whose name ``is_stale`` (their owner died without removing them)."""
    for parent in (*ROOT.glob(f"*/{CGROUP_PARENT}"), ROOT / CGROUP_PARENT):
        with contextlib.suppress(OSError):
            for entry in os.scandir(parent):
                if entry.is_dir() and is_stale(entry.name):
                    stale = Cgroups(entry.name, None, None, None)
                    stale.paths = [Path(entry.path)]
                    stale.kill_and_remove()


def prime_moves() -> None:
    """Start now the kernel grace period that a box's first cgroup move would wait for.

    A cgroup move takes the kernel's thread-group lock for writing, whose first taking after a
    quiet spell waits for an RCU grace period (~8 ms here); moves within a grace period after it do
    not wait. Writing this process's PID into the cgroup it is already in takes that lock and moves
    nothing: run on the mover thread as a start begins (:meth:`Cgroups.primed`), the wait overlaps
    the start's own work (its tree, spawning bubblewrap) instead of following it."""
    mode = Cgroups.mode()
    if mode is None:
        return
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == ("pids" if mode == "v1" else ""):
                where = ROOT / ("pids" if mode == "v1" else "") / path.lstrip("/")
                (where / "cgroup.procs").write_text(str(os.getpid()))
                return
