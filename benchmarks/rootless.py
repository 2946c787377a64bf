"""Task images with and without root: one task's sandbox start and ``exec``, as root and as ``nobody``.

    .venv/bin/python benchmarks/rootless.py [--runs 30]

Run as root. The same task (``FROM debian:bookworm-slim``, from the tests' Debian archive; no
registry needed) starts ``--runs`` times on the image root as root (this process), then as
``nobody`` with subordinate ids (``tests/sandbox_helpers.run_unprivileged``: a private mount
namespace, ``/etc/subuid`` given there), where every tree operation goes through the user's holder
(``harbor_local_sandbox._userns``) and bubblewrap runs under ``nsenter``; then 64 started at once.
Printed: medians (the 64 at once: its wall time), and the
rootless/root ratio of each (a ratio carries across machines; absolute times do not). As root the
box also joins its cgroups (a kernel grace period); without root it has rlimits only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from registry import base_image_archive  # noqa: E402

from sandbox_helpers import run_unprivileged  # noqa: E402

#: Loads the base image into the running user's cache, then times ``RUNS`` starts, ``exec``s and stops.
MEASURE = """
import asyncio, json, os, shutil, statistics, sys, time
from pathlib import Path
work = Path(sys.argv[1])
sys.path.insert(0, sys.argv[2])
runs = int(os.environ["BENCH_RUNS"])
from sandbox_helpers import make_task, open_env
from harbor_local_sandbox.oci import ImageStore

async def main():
    archive = work / "base.oci.tar"
    shutil.copy(os.environ["BENCH_BASE_ARCHIVE"], archive)
    cache = work / "cache"
    await ImageStore(cache).load_archive(archive, "debian:bookworm-slim")
    task = make_task(work, "plain", dockerfile="FROM debian:bookworm-slim\\nWORKDIR /workdir\\n")
    found = {"start": [], "exec": [], "stop": []}
    for i in range(runs + 1):  # the first builds and mounts the image: not counted
        env = open_env(task, work / "trials", cache_dir=str(cache))
        t = time.perf_counter()
        await env.start(force_build=False)
        started = time.perf_counter() - t
        t = time.perf_counter()
        result = await env.exec("true")
        executed = time.perf_counter() - t
        assert result.return_code == 0, result
        t = time.perf_counter()
        await env.stop(delete=True)
        stopped = time.perf_counter() - t
        if i:
            found["start"].append(started)
            found["exec"].append(executed)
            found["stop"].append(stopped)
    result = {k: statistics.median(v) for k, v in found.items()}
    envs = [open_env(task, work / "trials", cache_dir=str(cache)) for _ in range(64)]
    t = time.perf_counter()
    await asyncio.gather(*(env.start(force_build=False) for env in envs))
    result["concurrent"] = time.perf_counter() - t
    await asyncio.gather(*(env.stop(delete=True) for env in envs))
    ImageStore(cache).release_mounts()
    print("RESULT " + json.dumps(result))

asyncio.run(main())
"""


def measure(runs: int, rootless: bool) -> dict[str, float]:
    archive = base_image_archive()
    readable = Path(tempfile.mkdtemp(prefix="trl-harbor-bench-")) / archive.name
    readable.write_bytes(archive.read_bytes())
    readable.chmod(0o644)
    readable.parent.chmod(0o755)
    env = {"BENCH_BASE_ARCHIVE": str(readable), "BENCH_RUNS": str(runs)}
    try:
        if rootless:
            done = run_unprivileged(MEASURE, subids=True, timeout=1800, state_mb=512, env=env)
        else:
            work = Path(tempfile.mkdtemp(prefix="trl-harbor-bench-root-"))
            try:
                done = subprocess.run(
                    [sys.executable, "-c", MEASURE, str(work), str(TESTS)],
                    env={**os.environ, **env}, capture_output=True, text=True, timeout=1800,
                )  # fmt: skip
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        readable.unlink()
        readable.parent.rmdir()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        who = "rootless" if rootless else "root"
        raise SystemExit(f"the {who} run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: it measures root, then runs the same as nobody")
    root = measure(args.runs, rootless=False)
    rootless = measure(args.runs, rootless=True)
    print(f"\nimage root, FROM debian:bookworm-slim ({args.runs} runs per median)")
    print(f"{'measure':<22}{'root':>10}{'nobody':>10}{'nobody/root':>13}")
    print("-" * 55)
    rows = (("start", "sandbox start"), ("exec", "exec('true')"), ("stop", "stop"), ("concurrent", "64 starts at once"))
    for name, label in rows:
        mine, theirs = root[name] * 1000, rootless[name] * 1000
        print(f"{label:<22}{mine:>8.2f}ms{theirs:>8.2f}ms{theirs / mine:>12.2f}x")
    print(f"\n(python {sys.version.split()[0]}; {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
