"""Local sandbox latency, measured against the physical floor in the same run.

    .venv/bin/python benchmarks/sandbox.py [--runs 30]

Prints one table: sandbox start, start + first command, ``exec("true")`` round trip,
Harbor verification of a trivial task, stop, and 64 sandboxes started concurrently,
each as a median over many runs, next to a plain ``subprocess.run(["true"])`` (the
cost of starting any process at all on this machine). Ratios, not absolute times,
are what carries across machines.
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
    def __init__(self, task_dir: Path, scratch: Path):
        self.task = Task(task_dir)
        self.scratch = scratch
        self.count = 0

    def env(self):
        self.count += 1
        return create_environment(
            self.task, "local", session_id=f"bench-{self.count}",
            trial_paths=TrialPaths(trial_dir=self.scratch / f"trial-{self.count}"),
        )  # fmt: skip


async def measure(runs: int, concurrent: int) -> list[tuple[str, float, str]]:
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-bench-"))
    bench = Bench(_task(scratch), scratch)

    # Warm-up: builds and caches the layer; not timed.
    warm = bench.env()
    await warm.start(force_build=False)
    await warm.exec("true")
    await warm.stop(delete=True)

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
    rows = [
        ("subprocess.run(['true'])  (baseline)", floor, "1.0x"),
        ("sandbox start", med(starts), f"{med(starts) / floor:.1f}x  (target <= 20 ms)"),
        ("start + first exec", med(first), f"{med(first) / floor:.1f}x"),
        ("exec('true') round trip", med(execs), f"{med(execs) / floor:.1f}x"),
        ("exec overhead over baseline", med(execs) - floor, "(target <= 5 ms)"),
        ("verify (upload tests, run, download)", med(verifies), f"{med(verifies) / floor:.1f}x"),
        ("stop", med(stops), f"{med(stops) / floor:.1f}x"),
        (f"{concurrent} sandboxes started concurrently", parallel_start, "(target <= 1 s on 2 cores)"),
        (f"{concurrent} concurrent exec('true')", parallel_exec, ""),
    ]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="samples per median")
    parser.add_argument("--concurrent", type=int, default=64, help="sandboxes in the concurrent start")
    args = parser.parse_args(argv)
    rows = asyncio.run(measure(args.runs, args.concurrent))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'median':>10}  vs baseline")
    print("-" * (width + 40))
    for name, seconds, note in rows:
        print(f"{name:<{width}}  {seconds * 1000:>8.2f}ms  {note}")
    print(f"\n(python {sys.version.split()[0]}, {args.runs} runs per median)")


if __name__ == "__main__":
    main()
