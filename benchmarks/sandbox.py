"""Local sandbox latency, measured against the physical floor in the same run.

    .venv/bin/python benchmarks/sandbox.py [--runs 30] [--root host|image|both]

Prints one table per sandbox root: sandbox start, start + first command,
``exec("true")`` round trip, Harbor verification of a trivial task, stop, and 64
sandboxes started concurrently, each as a median over many runs, next to a plain
``subprocess.run(["true"])`` (the cost of starting any process at all on this
machine). Ratios, not absolute times, are what carries across machines.

``--root image`` runs the task on its own image (``FROM`` a Debian image that a
registry on loopback serves, as in the tests; needs root, buildah, docker-registry,
skopeo, mmdebstrap) and also reports the cold pull + build + first start and the
warm start (image cached, new process state).
"""

from __future__ import annotations

import argparse
import asyncio
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

from trl_harbor.backends import create_environment


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


async def measure(runs: int, concurrent: int, base: str | None = None) -> list[tuple[str, float, str]]:
    """Measure one sandbox root: the host's (``base`` is ``None``) or the task's image ``FROM base``."""
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-bench-"))
    task_dir = _task(scratch)
    kwargs: dict = {"root": "host"}
    extra: list[tuple[str, float, str]] = []
    if base is not None:
        (task_dir / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /workdir\n")
        kwargs = {"root": "image", "cache_dir": str(scratch / "cache")}
    bench = Bench(task_dir, scratch, kwargs)

    # Warm-up: builds and caches the layer (or pulls and builds the image); timed for images.
    warm = bench.env()
    t = time.perf_counter()
    await warm.start(force_build=False)
    await warm.exec("true")
    cold = time.perf_counter() - t
    await warm.stop(delete=True)
    if base is not None:
        from trl_harbor.sandboxes._cache import CACHE

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

    starts, first, stops, execs, verifies = [], [], [], [], []
    for _ in range(runs):
        env = bench.env()
        t = time.perf_counter()
        await env.start(force_build=False)
        starts.append(time.perf_counter() - t)
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
    await asyncio.gather(*(e.stop(delete=True) for e in envs))

    floor = statistics.median(baseline)
    med = statistics.median
    target = "30 ms" if base is not None else "20 ms"
    rows = [
        ("subprocess.run(['true'])  (baseline)", floor, "1.0x"),
        ("sandbox start", med(starts), f"{med(starts) / floor:.1f}x  (target <= {target})"),
        ("start + first exec", med(first), f"{med(first) / floor:.1f}x"),
        ("exec('true') round trip", med(execs), f"{med(execs) / floor:.1f}x"),
        ("exec overhead over baseline", med(execs) - floor, "(target <= 5 ms)"),
        ("verify (upload tests, run, download)", med(verifies), f"{med(verifies) / floor:.1f}x"),
        ("stop", med(stops), f"{med(stops) / floor:.1f}x"),
        (
            f"{concurrent} sandboxes started concurrently",
            parallel_start,
            f"(target <= {'1.5' if base is not None else '1'} s on 2 cores)",
        ),
        (f"{concurrent} concurrent exec('true')", parallel_exec, ""),
        *extra,
    ]
    return rows


def _print(title: str, rows: list[tuple[str, float, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{title}\n{'measure':<{width}}  {'median':>10}  vs baseline")
    print("-" * (width + 40))
    for name, seconds, note in rows:
        print(f"{name:<{width}}  {seconds * 1000:>8.2f}ms  {note}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="samples per median")
    parser.add_argument("--concurrent", type=int, default=64, help="sandboxes in the concurrent start")
    parser.add_argument("--root", choices=("host", "image", "both"), default="both", help="sandbox roots to measure")
    args = parser.parse_args(argv)
    if args.root in ("host", "both"):
        _print("root='host' (the host's /usr)", asyncio.run(measure(args.runs, args.concurrent)))
    if args.root in ("image", "both"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from registry import serve_loopback_registry

        with (
            tempfile.TemporaryDirectory(prefix="trl-harbor-registry-") as workdir,
            serve_loopback_registry(Path(workdir)) as registry,
        ):
            rows = asyncio.run(measure(args.runs, args.concurrent, base=registry.base))
        _print("root='image' (FROM a Debian bookworm image on a loopback registry)", rows)
    print(f"\n(python {sys.version.split()[0]}, {args.runs} runs per median)")


if __name__ == "__main__":
    main()
