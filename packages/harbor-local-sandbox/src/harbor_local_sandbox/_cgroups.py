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
            for controller in ("memory", "pids", "cpu"):
                if (ROOT / controller).is_dir():
                    self._make(ROOT / controller / CGROUP_PARENT / self.name, controller if limits else None)
        elif mode == "v2":
            parent = ROOT / CGROUP_PARENT
            if not parent.exists():
                parent.mkdir()
                (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            self._make(parent / self.name, "v2" if limits else None, subtree=True)

    def _make(self, path: Path, limits: str | None, subtree: bool = False) -> None:
        """The box's folder ``path`` and its leaves; ``limits``: which to write (a v1 controller, ``"v2"``)."""
        path.mkdir(parents=True, exist_ok=True)
        if path not in self.paths:
            self.paths.append(path)
        if subtree and not (path / "keel").exists():
            (path / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        for leaf in self.LEAVES:
            (path / leaf).mkdir(exist_ok=True)
        if limits is None:
            return
        memory, cpus, pids = self.limits["memory"], self.limits["cpu"], self.limits["pids"]
        for where, share in ((path / "agent", 1), (path, 2)):  # the box: the agent's again, for the rest
            if limits in ("memory", "v2") and memory:
                self._write_memory(where, memory * share * 1024 * 1024, v2=limits == "v2")
            if limits in ("pids", "v2") and pids:
                (where / "pids.max").write_text(str(pids * share))
            if limits in ("cpu", "v2") and cpus:
                with contextlib.suppress(OSError):
                    self._write_cpu(where, cpus * share, v2=limits == "v2")

    @staticmethod
    def _write_memory(where: Path, size: int, v2: bool) -> None:
        if v2:
            (where / "memory.max").write_text(str(size))
            with contextlib.suppress(OSError):
                (where / "memory.swap.max").write_text("0")
            return
        # v1: a child's limit may not exceed its parent's: the parent is written first when raising.
        (where / "memory.limit_in_bytes").write_text(str(size))
        with contextlib.suppress(OSError):
            (where / "memory.memsw.limit_in_bytes").write_text(str(size))

    @staticmethod
    def _write_cpu(where: Path, cpus: float, v2: bool) -> None:
        if v2:
            (where / "cpu.max").write_text(f"{max(1000, int(100000 * cpus))} 100000")
            return
        period = int((where / "cpu.cfs_period_us").read_text())
        (where / "cpu.cfs_quota_us").write_text(str(max(1000, int(period * cpus))))

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
            members = set((path / "cgroup.procs").read_text().split())
            for pid in pids:
                if str(pid) not in members:
                    with contextlib.suppress(ProcessLookupError):
                        (path / "cgroup.procs").write_text(str(pid))

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
            for where in (path / "agent", path / "keel", path):
                with contextlib.suppress(OSError):
                    for pid in (where / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), signal.SIGKILL)
        self.remove()

    def remove(self) -> None:
        """Remove the box's cgroups (once their processes have left them)."""
        for path in self.paths:
            for where in (*(path / leaf for leaf in self.LEAVES), path):
                _rmdir_when_empty(where)
        self.paths = []


def _rmdir_when_empty(path: Path) -> None:
    """Remove a cgroup folder: killed processes leave it a moment after SIGKILL (on a loaded machine,
    more than a few tries' worth: one left behind stays until the next run's sweep)."""
    deadline = time.monotonic() + 1
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.002)


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
