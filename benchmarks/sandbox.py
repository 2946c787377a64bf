"""Local sandbox latency, measured against the physical floor in the same run.

    .venv/bin/python benchmarks/sandbox.py [--runs 30]

Prints a table: sandbox start, start + first command,
``exec("true")`` round trip, Harbor verification of a trivial task, stop, 64
sandboxes started concurrently, and a start while those 64 run, each as a median over many runs, next to a plain
``subprocess.run(["true"])`` (the cost of starting any process at all on this
machine). Ratios, not absolute times, are what carries across machines.

A second table breaks one start down into its phases (each a median over the
same starts, and its ratio to a bare ``bwrap ... true`` with a box's namespaces, measured
in the same run): what a start costs beyond bubblewrap itself, and where.

The task runs on its own image (``FROM`` a Debian image that a registry on loopback serves,
as in the tests; needs buildah, docker-registry, skopeo, mmdebstrap); the table also reports
the cold pull + build + first start and the warm start (image cached, new process state).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_task import write_bench_task
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor.verifier.verifier import Verifier
from harbor_local_sandbox import _box, _cgroups, _roots
from harbor_local_sandbox import local as _local
from harbor_local_sandbox._binaries import SYSTEM_PATH, bwrap_path
from harbor_local_sandbox._diagnose import _BWRAP_PROBE
from harbor_local_sandbox.local import LocalEnvironment

from trl_harbor.rollout.backends import create_environment

#: The phases of one start, timed by wrapping the function that does each: ``(label, owner, attribute)``.
#: Nested phases are reported as they are (``bwrap + supervisor ready`` holds what is not listed below it).
PHASES = (
    ("sweep of dead owners' boxes", _local, "sweep_stale_once"),
    ("image lookup (cached)", _roots.ImageRoot, "_prepare"),
    ("bounded tree (tmpfs mount)", _roots, "mount_bounded_tmpfs"),
    ("tree: overlay mount, hosts", _roots, "mount_tree"),
    ("cgroups: create", _cgroups.Cgroups, "create"),
    ("cgroups: grace-period wait (no launcher parked; background)", _cgroups, "prime_moves"),
    ("spawn bubblewrap", _box.Box, "_spawn"),
    ("until ready (all below)", _box.Box, "_until_ready"),
    ("  uid/gid maps", _box, "write_id_maps"),
    ("  cgroups: join (all moves)", _cgroups.Cgroups, "join"),
    ("  user-mode network", _box.UserNetwork, "attach"),
    ("search-path probe (once per image)", _roots.ImageRoot, "_probe_search_paths"),
    ("upload environment dir", LocalEnvironment, "_upload_environment_dir_after_start"),
)


class PhaseTimer:
    """Times each of :data:`PHASES` per start while active (wraps, then restores, the functions)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.current: dict[str, float] = {}
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> PhaseTimer:
        for label, owner, name in PHASES:
            own = owner.__dict__ if isinstance(owner, type) else vars(owner)
            original = own.get(name, getattr(owner, name, None))
            if original is None:
                continue
            self._saved.append((owner, name, own.get(name)))
            setattr(owner, name, self._wrap(label, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)  # inherited: the base class's again
            else:
                setattr(owner, name, original)
        self._saved = []

    def _wrap(self, label: str, original):
        timer = self
        func = original.__func__ if isinstance(original, staticmethod) else original

        if asyncio.iscoroutinefunction(func):

            async def timed(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return await func(*args, **kwargs)
                finally:
                    timer.current[label] = timer.current.get(label, 0.0) + time.perf_counter() - t
        else:

            def timed(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return func(*args, **kwargs)
                finally:
                    timer.current[label] = timer.current.get(label, 0.0) + time.perf_counter() - t

        return staticmethod(timed) if isinstance(original, staticmethod) else timed

    def done(self, total: float) -> None:
        """Close one start that took ``total`` seconds."""
        for label, _, _ in PHASES:
            if label in self.current:
                self.samples.setdefault(label, []).append(self.current[label])
        self.samples.setdefault("total", []).append(total)
        self.current = {}


def bare_bwrap(runs: int) -> float:
    """Median of ``bwrap`` with a box's namespaces (user, PID, IPC, UTS, network, ``/proc``) running ``true``."""
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([bwrap_path(), *_BWRAP_PROBE], check=True, env={"PATH": SYSTEM_PATH})
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def breakdown(timer: PhaseTimer, bwrap: float) -> list[tuple[str, float, str]]:
    """The breakdown table's rows: each phase's median and its ratio to a bare bwrap."""
    med = statistics.median
    rows = [("bare `bwrap ... true` (same namespaces)", bwrap, "1.00x")]
    total = med(timer.samples["total"])
    for label, _, _ in PHASES:
        if label in timer.samples:
            value = med(timer.samples[label])
            rows.append((label, value, f"{value / bwrap:.2f}x"))
    rows.append(("whole start", total, f"{total / bwrap:.2f}x"))
    return rows


def _task(root: Path) -> Path:
    return write_bench_task(root)


class Bench:
    def __init__(self, task_dir: Path, scratch: Path, kwargs: dict | None = None):
        self.task = Task(task_dir)
        self.scratch = scratch
        self.count = 0
        self.kwargs = kwargs or {}

    def env(self):
        self.count += 1
        return create_environment(
            self.task, "local", session_id=f"bench-{self.count}",
            trial_paths=TrialPaths(trial_dir=self.scratch / f"trial-{self.count}"),
            kwargs=self.kwargs,
        )  # fmt: skip


async def measure(runs: int, concurrent: int, base: str) -> list[tuple[str, float, str]]:
    """Measure sandboxes on the task's image ``FROM base``.

    Its scratch folder (task, trials, image cache) is removed afterwards, buildah's mounts of the
    cached image first.
    """
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-bench-"))
    try:
        return await _measure(scratch, runs, concurrent, base)
    finally:
        if (scratch / "cache").exists():
            from harbor_local_sandbox.oci import ImageStore

            ImageStore(scratch / "cache").release_mounts()
        shutil.rmtree(scratch, ignore_errors=True)


async def _measure(scratch: Path, runs: int, concurrent: int, base: str) -> list[tuple[str, float, str]]:
    task_dir = _task(scratch)
    (task_dir / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /workdir\n")
    bench = Bench(task_dir, scratch, {"cache_dir": str(scratch / "cache")})

    # Warm-up: pulls and builds the image, timed.
    warm = bench.env()
    t = time.perf_counter()
    await warm.start(force_build=False)
    await warm.exec("true")
    cold = time.perf_counter() - t
    await warm.stop(delete=True)
    from harbor_local_sandbox._cache import CACHE

    CACHE.clear()  # a new process's view: the image is on disk, nothing in memory
    again = bench.env()
    t = time.perf_counter()
    await again.start(force_build=False)
    warm_start = time.perf_counter() - t
    await again.stop(delete=True)
    extra = [("cold: pull + build + start + exec", cold, ""), ("warm: cached image, fresh process", warm_start, "")]

    baseline = []
    for _ in range(runs * 3):
        t = time.perf_counter()
        subprocess.run(["true"], check=True)
        baseline.append(time.perf_counter() - t)

    bwrap = bare_bwrap(runs * 2)
    starts, first, stops, execs, verifies = [], [], [], [], []
    timer = PhaseTimer()
    for _ in range(runs):
        env = bench.env()
        t = time.perf_counter()
        with timer:
            await env.start(force_build=False)
        starts.append(time.perf_counter() - t)
        timer.done(starts[-1])
        await env.exec("true")
        first.append(time.perf_counter() - t)
        for _ in range(3):
            t = time.perf_counter()
            await env.exec("true")
            execs.append(time.perf_counter() - t)
        await env.exec("echo 42 > /workdir/answer.txt")
        verifier = Verifier(task=bench.task, trial_paths=env.trial_paths, environment=env)
        t = time.perf_counter()
        result = await verifier.verify()
        verifies.append(time.perf_counter() - t)
        assert result.rewards == {"reward": 1.0}, result.rewards
        t = time.perf_counter()
        await env.stop(delete=True)
        stops.append(time.perf_counter() - t)

    envs = [bench.env() for _ in range(concurrent)]
    t = time.perf_counter()
    await asyncio.gather(*(e.start(force_build=False) for e in envs))
    parallel_start = time.perf_counter() - t
    t = time.perf_counter()
    await asyncio.gather(*(e.exec("true") for e in envs))
    parallel_exec = time.perf_counter() - t
    crowded = []  # one start while the concurrent ones still run: does a start depend on how many run?
    for _ in range(runs):
        env = bench.env()
        t = time.perf_counter()
        await env.start(force_build=False)
        crowded.append(time.perf_counter() - t)
        await env.stop(delete=True)
    await asyncio.gather(*(e.stop(delete=True) for e in envs))

    floor = statistics.median(baseline)
    med = statistics.median
    rows = [
        ("subprocess.run(['true'])  (baseline)", floor, "1.0x"),
        ("sandbox start", med(starts), f"{med(starts) / floor:.1f}x  (target <= 15 ms, issue #20)"),
        ("start + first exec", med(first), f"{med(first) / floor:.1f}x"),
        ("exec('true') round trip", med(execs), f"{med(execs) / floor:.1f}x"),
        ("exec overhead over baseline", med(execs) - floor, "(target <= 5 ms)"),
        ("verify (upload tests, run, download)", med(verifies), f"{med(verifies) / floor:.1f}x"),
        ("stop", med(stops), f"{med(stops) / floor:.1f}x"),
        (
            f"{concurrent} sandboxes started concurrently",
            parallel_start,
            "(target <= 1 s on 2 cores, issue #20)",
        ),
        (f"{concurrent} concurrent exec('true')", parallel_exec, ""),
        (f"start, {concurrent} others running", med(crowded), f"{med(crowded) / med(starts):.2f}x the start alone"),
        *extra,
    ]
    return rows, breakdown(timer, bwrap)


def _print(title: str, rows: list[tuple[str, float, str]], versus: str = "vs baseline") -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{title}\n{'measure':<{width}}  {'median':>10}  {versus}")
    print("-" * (width + 40))
    for name, seconds, note in rows:
        print(f"{name:<{width}}  {seconds * 1000:>8.2f}ms  {note}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="samples per median")
    parser.add_argument("--concurrent", type=int, default=64, help="sandboxes in the concurrent start")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from registry import serve_loopback_registry

    with (
        tempfile.TemporaryDirectory(prefix="trl-harbor-registry-") as workdir,
        serve_loopback_registry(Path(workdir)) as registry,
    ):
        rows, phases = asyncio.run(measure(args.runs, args.concurrent, base=registry.base))
    _print("the task's image (FROM a Debian bookworm image on a loopback registry)", rows)
    _print("where one start's time goes", phases, "vs bare bwrap")
    print(f"\n(python {sys.version.split()[0]}, {args.runs} runs per median)")


if __name__ == "__main__":
    main()
