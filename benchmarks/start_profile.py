"""Where a local sandbox's start goes: every step from ``start()`` to its first command's answer, timed.

    .venv/bin/python benchmarks/start_profile.py [--runs 30] [--task orders_count] [--other-task late_invoices]
                                                 [--processes 3] [--burst 16] [--bursts 5] [--cache-dir DIR]

Run as root. The package is not edited: for the length of each start, the functions that do each step
(:data:`STEPS`) are wrapped with ``time.perf_counter`` and restored after, as ``benchmarks/sandbox.py``
does for its breakdown. A step's time includes the steps below it (the table's indentation); a step
that runs on a thread of its own (cgroup moves on the mover thread, the launcher parked for the next
start) overlaps the others, so its column "at" (when it begins, from the call of ``start()``) says where.

The bundled task's image (``examples/tasks/<task>``, as ``benchmarks/peers.py`` runs it: a copy with no
network) is started:

* ``--runs`` times in this process, steady state, in two interleaved series: with a launcher parked
  for the start (what a sandbox started after the previous one finds) and with none (what all but
  one of a burst of concurrent starts find);
* ``--bursts`` times, ``--burst`` sandboxes at once, each to its first answer (a step's column there is
  its mean per sandbox: under contention it waits for the CPUs and for the others);
* in ``--processes`` fresh processes: their first start (once-per-process work), then the first start
  of ``--other-task``'s image (once-per-image work), then a second start of the first image.

Printed: one row per step, each series' median (ms), when it begins in a parked start, and how many
times it ran per start (steps begun after the first answer are left out, but for the launcher parked
for the next start);
then the whole start, the first command, and the total, next to a ``subprocess.run(["true"])``
baseline measured in the same run. Steps that cost nothing in the steady series are once per image
or once per process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HARBOR_TELEMETRY", "0")
REPO = Path(__file__).resolve().parents[1]

from harbor_local_sandbox import _box, _cache, _cgroups, _hostfs, _roots, oci  # noqa: E402
from harbor_local_sandbox import local as _local  # noqa: E402
from harbor_local_sandbox.local import LocalEnvironment  # noqa: E402
from peers import no_network_copy  # noqa: E402

#: The steps, in the path's order: ``(label, owner, attribute, depth)``; depth is the table's
#: indentation (a step includes the deeper ones below it). A missing attribute is skipped (the
#: package moves on; the table then lacks that row).
STEPS: tuple[tuple[str, Any, str, int], ...] = (
    ("start()", LocalEnvironment, "start", 0),
    ("sweep of dead owners' boxes", _local, "sweep_stale_once", 1),
    ("ImageRoot.start", _roots.ImageRoot, "start", 1),
    ("image and its binds (_prepare)", _roots.ImageRoot, "_prepare", 2),
    ("ImageStore.get", oci.ImageStore, "get", 3),
    ("context signature (walk of environment/)", oci, "_context_signature", 4),
    ("content key (hash of environment/)", oci.ImageStore, "content_key", 4),
    ("record + buildah mount", oci.ImageStore, "_load", 4),
    ("helper binaries (runas; compiled once)", _roots, "static_binary", 3),
    ("host CA / pip.conf binds", _roots, "host_trust_mounts", 3),
    ("image's link hazards", _roots.ImageRoot, "link_hazards", 2),
    ("facts kept with the image (facts.json, read)", _cache.ImageFacts, "_loaded", 3),
    ("facts kept with the image (facts.json, written)", _cache.ImageFacts, "put", 3),
    ("keel's link-policy items", _roots, "keel_items", 2),
    ("Box() (its host, its cgroups' names)", _box.Box, "__init__", 2),
    ("cgroups: reserve (take parked, or create)", _box.Box, "reserve", 2),
    ("cgroups: folders + limits written", _cgroups.Cgroups, "create", 3),
    ("bounded tmpfs for the tree", _roots, "mount_bounded_tmpfs", 2),
    ("tree: folders, overlay, hosts", _roots, "mount_tree", 2),
    ("overlay mount", _roots, "mount_overlay", 3),
    ("/etc/hosts, /etc/hostname", _hostfs, "write_text", 3),
    ("Box.start", _box.Box, "start", 2),
    ("spawn (pipes, sockets, argv, exec)", _box.Box, "_spawn", 3),
    ("launcher prefix (--private-mounts)", _box, "_private_mounts", 4),
    ("fork+exec launcher, bwrap", _box, "_spawn_process", 4),
    ("hand argv to the parked launcher", _box._Parked, "launch", 4),
    ("until ready", _box.Box, "_until_ready", 3),
    ("settle (ids, cgroups)", _box.Box, "_settle", 4),
    ("wait: bwrap reports its child", _box, "read_child_pid", 5),
    ("uid/gid maps", _box, "write_id_maps", 5),
    ("wait: supervisor says 'ready'", asyncio.StreamReader, "readline", 4),
    ("process-tree walks (/proc)", _box, "_process_tree", 4),
    ("cgroup moves (mover thread)", _cgroups.Cgroups, "join", 4),
    ("grace-period prime (mover thread)", _cgroups, "prime_moves", 3),
    ("search-path probe (a command)", _roots.ImageRoot, "_probe_search_paths", 2),
    ("upload environment/ (prebuilt images)", LocalEnvironment, "_upload_environment_dir_after_start", 1),
    ("exec('true'): the first command", LocalEnvironment, "exec", 0),
    ("supervisor round trip", _box.SupervisorClient, "run", 1),
    ("background: park a launcher for the next", _box, "_new_parked", 0),
)


class Profiler:
    """Times every step of :data:`STEPS` while active: ``(label, begin, end)`` from any thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.origin = 0.0
        self.active = False
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for label, owner, name, _ in STEPS:
            own = owner.__dict__ if isinstance(owner, type) else vars(owner)
            original = own.get(name, getattr(owner, name, None))
            if original is None:
                continue
            self._saved.append((owner, name, own.get(name)))
            setattr(owner, name, self._wrap(label, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved = []

    def _wrap(self, label: str, original: Any) -> Any:
        func = original.__func__ if isinstance(original, staticmethod) else original
        events = self.events
        profiler = self

        if asyncio.iscoroutinefunction(func):

            async def timed(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await func(*args, **kwargs)
                finally:
                    if profiler.active:
                        events.append((label, t, time.perf_counter()))
        else:

            def timed(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return func(*args, **kwargs)
                finally:
                    if profiler.active:
                        events.append((label, t, time.perf_counter()))

        return staticmethod(timed) if isinstance(original, staticmethod) else timed

    def begin(self) -> None:
        self.events.clear()
        self.origin = time.perf_counter()
        self.active = True

    def end(self, answered: float | None = None, sandboxes: int = 1) -> dict[str, list[float]]:
        """This start's steps: ``{label: [milliseconds in all, first begin (ms from start()), calls]}``.

        Steps that began after the first answer (``answered``) are left out, but for the launcher parked
        for the next start (its own row); with ``sandboxes`` started at once, times and calls are per sandbox.
        """
        self.active = False
        found: dict[str, list[float]] = {}
        background = "background: park a launcher for the next"
        spans = list(self.events)
        parking = [(b, e) for label, b, e in spans if label == background]
        for label, began, ended in spans:
            late = answered is not None and began >= answered
            inside = any(b <= began and ended <= e for b, e in parking)
            if label != background and (late or inside):
                continue
            entry = found.setdefault(label, [0.0, (began - self.origin) * 1000, 0])
            entry[0] += (ended - began) * 1000 / sandboxes
            entry[1] = min(entry[1], (began - self.origin) * 1000)
            entry[2] += 1 / sandboxes
        return found


class Starter:
    """Starts, first-commands and stops local sandboxes of one task, each start profiled."""

    def __init__(self, task_dir: Path, scratch: Path, cache_dir: str | None):
        from harbor.models.task.task import Task

        self.task = Task(task_dir)
        self.scratch = scratch
        self.kwargs = {"cache_dir": cache_dir} if cache_dir else {}
        self.count = 0
        #: The last box's configuration and its image's root (for :func:`ladder`).
        self.config: Any = None
        self.image_root: Path | None = None

    async def once(self, profiler: Profiler) -> dict[str, list[float]]:
        from harbor.models.trial.paths import TrialPaths

        from trl_harbor.rollout.backends import create_environment

        self.count += 1
        t = time.perf_counter()
        env = create_environment(
            self.task, "local", session_id=f"profile-{self.count}",
            trial_paths=TrialPaths(trial_dir=self.scratch / "trials" / f"{self.task.name}-{self.count}"),
            kwargs=self.kwargs,
        )  # fmt: skip
        made = (time.perf_counter() - t) * 1000
        profiler.begin()
        t = time.perf_counter()
        await env.start(force_build=False)
        result = await env.exec("true")
        answered = time.perf_counter()
        total = (answered - t) * 1000
        self.config, self.image_root = env._sandbox.box.config, env._sandbox.image.rootfs
        await asyncio.sleep(0.3)  # the launcher parked after the start is in its events too
        found = profiler.end(answered)
        assert result.return_code == 0, result
        t = time.perf_counter()
        await env.stop(delete=True)
        found["stop (not on the path)"] = [(time.perf_counter() - t) * 1000, 0.0, 1]
        found["Harbor's environment object (before start())"] = [made, 0.0, 1]
        found["total: start() to the first answer"] = [total, 0.0, 1]
        return found

    async def burst(self, profiler: Profiler, n: int) -> dict[str, list[float]]:
        """``n`` sandboxes started at once, each to its first answer: the steps per sandbox (mean), the wall time."""
        from harbor.models.trial.paths import TrialPaths

        from trl_harbor.rollout.backends import create_environment

        envs = []
        for _ in range(n):
            self.count += 1
            envs.append(
                create_environment(
                    self.task,
                    "local",
                    session_id=f"profile-{self.count}",
                    trial_paths=TrialPaths(trial_dir=self.scratch / "trials" / f"{self.task.name}-{self.count}"),
                    kwargs=self.kwargs,
                )  # fmt: skip
            )

        async def one(env: Any) -> None:
            await env.start(force_build=False)
            assert (await env.exec("true")).return_code == 0

        profiler.begin()
        t = time.perf_counter()
        await asyncio.gather(*(one(env) for env in envs))
        answered = time.perf_counter()
        found = profiler.end(answered, sandboxes=n)
        found[f"wall: {n} at once, to the last answer"] = [(answered - t) * 1000, 0.0, 1]
        await asyncio.gather(*(env.stop(delete=True) for env in envs))
        return found


async def _wait_parked(timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if getattr(_box, "_PARKED", None) is not None and not getattr(_box, "_PARKING", False):
            return True  # the pool filled (as many as the most starts at once so far)
        await asyncio.sleep(0.01)
    return False


async def steady(
    task_dir: Path, scratch: Path, cache_dir: str | None, runs: int, starter: Starter, burst: int = 0, bursts: int = 5
) -> dict[str, list[dict]]:
    """``runs`` starts with a launcher parked and ``runs`` with none, interleaved (after one warm-up)."""
    profiler = Profiler()
    profiler.install()
    try:
        await starter.once(profiler)  # warm-up: the process's and the image's first start
        series: dict[str, list[dict]] = {"parked": [], "none parked": []}
        for index in range(2 * runs):
            parked = await _wait_parked()
            mode = "parked" if index % 2 == 0 and parked else "none parked"
            if mode == "none parked":
                _box.release_parked()
            series[mode].append(await starter.once(profiler))
        if burst:
            series[f"{burst} at once"] = []
            for _ in range(bursts):
                await _wait_parked()
                series[f"{burst} at once"].append(await starter.burst(profiler, burst))
        return series
    finally:
        profiler.uninstall()


async def first_starts(task_dir: Path, other_dir: Path, scratch: Path, cache_dir: str | None) -> dict[str, dict]:
    """In this (fresh) process: the first start, the first start of another image, a second start."""
    profiler = Profiler()
    profiler.install()
    try:
        first = await Starter(task_dir, scratch, cache_dir).once(profiler)
        other = await Starter(other_dir, scratch, cache_dir).once(profiler)
        again = await Starter(task_dir, scratch, cache_dir).once(profiler)
        return {"1st in process": first, "1st of 2nd image": other, "2nd start": again}
    finally:
        profiler.uninstall()


def _child(args: argparse.Namespace) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-profile-child-"))
    try:
        tasks = [
            no_network_copy(REPO / "examples" / "tasks" / name, scratch / "tasks")
            for name in (args.task, args.other_task)
        ]
        found = asyncio.run(first_starts(tasks[0], tasks[1], scratch, args.cache_dir))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("RESULT " + json.dumps(found))


def _fresh_processes(args: argparse.Namespace) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for _ in range(args.processes):
        argv = [sys.executable, __file__, "--child", "--task", args.task, "--other-task", args.other_task]
        if args.cache_dir:
            argv += ["--cache-dir", args.cache_dir]
        t = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        elapsed = time.perf_counter() - t
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"a fresh process failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        for name, start in json.loads(lines[-1][len("RESULT ") :]).items():
            found.setdefault(name, []).append(start)
        found.setdefault("wall", []).append({"": [elapsed * 1000, 0, 1]})
    return found


def _median(starts: list[dict], label: str, index: int = 0) -> float | None:
    values = [start[label][index] for start in starts if label in start]
    if not values:
        return None
    return (
        statistics.median([*values, *([0.0] * (len(starts) - len(values)))])
        if index == 0
        else statistics.median(values)
    )


def report(series: dict[str, list[dict]], baseline: float, load: tuple[list[float], list[float]]) -> None:
    walls = [start[""][0] for start in series.pop("wall", [])]
    columns = [
        name for name in ("parked", "none parked", "1st in process", "1st of 2nd image", "2nd start") if name in series
    ] + [name for name in series if name.endswith(" at once")]
    extra = (
        "total: start() to the first answer",
        "stop (not on the path)",
        "Harbor's environment object (before start())",
        *sorted({label for name in columns for start in series[name] for label in start if label.startswith("wall: ")}),
    )
    labels = [(label, depth) for label, _, _, depth in STEPS] + [(label, 0) for label in extra]
    width = max(len("  " * depth + label) for label, depth in labels) + 2
    head = f"{'step':<{width}}" + "".join(f"{name:>17}" for name in columns) + f"{'at (parked)':>13}{'calls':>7}"
    print("\n" + head)
    print("-" * len(head))
    for label, depth in labels:
        cells = []
        for name in columns:
            value = _median(series[name], label)
            cells.append(f"{'-' if value is None else f'{value:.2f}':>17}")
        at = _median(series.get("parked", []), label, 1)
        calls = _median(series.get("parked", []) or series[columns[0]], label, 2)
        if all(cell.strip() in ("-", "0.00") for cell in cells):
            continue
        print(
            f"{'  ' * depth + label:<{width}}" + "".join(cells)
            + f"{'' if at is None else f'{at:.2f}':>13}{'' if calls is None else f'{calls:g}':>7}"
        )  # fmt: skip
    counts = ", ".join(f"{name}: {len(series[name])}" for name in columns)
    print(
        f"\n(ms, medians; starts per column: {counts}. Baseline subprocess.run(['true']) {baseline * 1000:.2f} ms; "
        f"load average {'/'.join(f'{x:.1f}' for x in load[0])} before, {'/'.join(f'{x:.1f}' for x in load[1])} after; "
        f"{os.cpu_count()} CPUs; python {sys.version.split()[0]})"
    )
    if walls:
        print(f"a fresh process, from exec to its third sandbox stopped: {statistics.median(walls):.0f} ms (median)")


def ladder(config: Any, image_root: Path, runs: int) -> list[tuple[str, float]]:
    """bubblewrap with the box's namespaces, then its mounts added rung by rung (see :func:`main`'s print)."""
    from harbor_local_sandbox._binaries import state_root
    from harbor_local_sandbox._mounts import mount_overlay, unmount

    # A writable root as the box's (bubblewrap makes the binds' mount points in it): one overlay on the
    # image root for every run (the mount points made once, then found).
    work = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-ladder-", dir=state_root()))
    for name in ("upper", "work", "root"):
        (work / name).mkdir()
    mount_overlay(image_root, work / "upper", work / "work", work / "root")
    try:
        return _ladder(config, work, runs)
    finally:
        unmount(work / "root")
        shutil.rmtree(work, ignore_errors=True)


def _ladder(config: Any, work: Path, runs: int) -> list[tuple[str, float]]:
    from harbor_local_sandbox._binaries import SYSTEM_PATH, bwrap_path, pdeathsig_prefix
    from harbor_local_sandbox._mounts import kernel_fs_args

    names = _box.namespace_args(hostname=config.hostname, block_fd=0)
    at = names.index("--userns-block-fd")
    names = names[:at] + names[at + 2 :]  # bubblewrap maps uid 0 itself: no host to wait for
    root = ["--bind", str(work / "root"), "/"]
    binds = [arg for source, target in config.extra_ro_binds for arg in ("--ro-bind", source, target)]
    full = kernel_fs_args(storage_bound=bool(config.storage_mb))
    steps = [
        ("bwrap: the box's namespaces, an overlay on the image root, `true`", [*names, *root]),
        ("  + /proc and /dev", [*names, *root, "--proc", "/proc", "--dev", "/dev"]),
        ("  + /dev read-only, /dev/shm bounded (the box's)", [*names, *root, *full]),
        ("  + the box's read-only binds (runas, host CAs)", [*names, *root, *full, *binds]),
        ("  + started as the box is (the launcher's own mount table)", [*names, *root, *full, *binds]),
    ]
    private = _box._private_mounts(work)
    started_as_box = [private[0], "--die-with-parent", *private[1:]] if private else [*pdeathsig_prefix()]
    samples: list[list[float]] = [[] for _ in steps]
    for _ in range(runs):
        for index, (_, argv) in enumerate(steps):
            prefix = started_as_box if index == len(steps) - 1 else []
            t = time.perf_counter()
            subprocess.run(
                [*prefix, bwrap_path(), *argv, "/bin/true"], check=True, cwd="/", env={"PATH": SYSTEM_PATH},
                start_new_session=True,
            )  # fmt: skip
            samples[index].append(time.perf_counter() - t)
    return [(label, statistics.median(found)) for (label, _), found in zip(steps, samples, strict=True)]


def _baseline(runs: int = 30) -> float:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(["true"], check=True)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="steady starts per series (two series)")
    parser.add_argument("--task", default="orders_count", help="the bundled task whose image starts")
    parser.add_argument("--other-task", default="late_invoices", help="a second bundled task (another image)")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes for the first starts")
    parser.add_argument("--cache-dir", default=None, help="the image cache (default: the sandbox's own)")
    parser.add_argument("--burst", type=int, default=16, help="sandboxes started at once (0: none)")
    parser.add_argument("--bursts", type=int, default=5, help="bursts measured")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write every start's steps there")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/start_profile.py profiles the root path: run it as root")
    if args.child:
        _child(args)
        return
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-profile-"))
    try:
        task_dir = no_network_copy(REPO / "examples" / "tasks" / args.task, scratch / "tasks")
        before = list(os.getloadavg())
        baseline = _baseline()
        starter = Starter(task_dir, scratch, args.cache_dir)
        series = asyncio.run(steady(task_dir, scratch, args.cache_dir, args.runs, starter, args.burst, args.bursts))
        rungs = ladder(starter.config, starter.image_root, args.runs)
        series.update(_fresh_processes(args) if args.processes else {})
        after = list(os.getloadavg())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(series))
    report(series, baseline, (before, after))
    print("\nwhat the wait for bubblewrap and the supervisor holds: bubblewrap alone, with the box's own")
    print("arguments added rung by rung, running the image's /bin/true (subprocess.run; medians, ms)")
    for label, value in rungs:
        print(f"  {label:<76}{value * 1000:>8.2f}")


if __name__ == "__main__":
    threading.current_thread().name = "start-profile"
    main()
