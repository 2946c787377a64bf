"""What a command pays for crossing to a Ray actor on the same machine, against the local backend directly.

    .venv/bin/python benchmarks/ray_crossing.py [--rounds 10] [--execs 20]

Starts a one-machine Ray (its own processes; no cluster needed) and runs one bundled task's sandbox
both ways in interleaved rounds: the local sandbox in this process (``environment_type="local"``),
and the same sandbox inside a Ray actor (``environment_type="ray"``). Each round measures, on each:

* **start**: create the environment and ``start()`` it (image cached), up to a sandbox that answers
  (on Ray: an actor process placed and started, the task folder shipped, the sandbox started in it);
* **exec**: ``exec("true")``, the round trip of a command that does nothing; and one printing 1 MiB;
* **upload / download**: a 1 MiB file into and out of the sandbox;
* **stop**: ``stop()`` (on Ray: the sandbox stopped and the actor ended).

The floor of the crossing itself, a call to a bare Ray actor that does nothing, is measured in the
same run. Prints medians and the ratio Ray / local; the machines are noisy, so compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HARBOR_TELEMETRY", "0")

TASK = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "building_b_humidity"
MIB = 1 << 20


class _Echo:
    """A Ray actor that does nothing: the floor of a call's crossing."""

    async def nothing(self) -> None:
        return None


async def _round(task, kind: str, execs: int, scratch: Path, samples: dict[str, list[float]]) -> None:
    from harbor.models.trial.paths import TrialPaths

    from trl_harbor.rollout.backends import create_environment

    def timed(label: str, started: float) -> None:
        samples[f"{label} [{kind}]"].append(time.perf_counter() - started)

    started = time.perf_counter()
    trial = TrialPaths(trial_dir=Path(tempfile.mkdtemp(dir=scratch)))
    env = create_environment(task, kind, session_id=f"bench-{kind}", trial_paths=trial)
    await env.start(force_build=False)
    timed("start", started)
    try:
        for _ in range(execs):
            started = time.perf_counter()
            await env.exec("true", timeout_sec=30)
            timed("exec true", started)
        started = time.perf_counter()
        result = await env.exec("head -c 1048576 /dev/zero | tr '\\0' x", timeout_sec=30)
        timed("exec printing 1 MiB", started)
        assert len(result.stdout or "") == MIB, len(result.stdout or "")
        source = scratch / "upload.bin"
        source.write_bytes(os.urandom(MIB))
        started = time.perf_counter()
        await env.upload_file(source, "/tmp/upload.bin")
        timed("upload 1 MiB", started)
        started = time.perf_counter()
        await env.download_file("/tmp/upload.bin", scratch / f"download-{kind}.bin")
        timed("download 1 MiB", started)
        assert (scratch / f"download-{kind}.bin").read_bytes() == source.read_bytes()
    finally:
        started = time.perf_counter()
        await env.stop(delete=True)
        timed("stop", started)


async def _floor(actor, calls: int, samples: dict[str, list[float]]) -> None:
    for _ in range(calls):
        started = time.perf_counter()
        await asyncio.wrap_future(actor.nothing.remote().future())
        samples["bare actor call [ray]"].append(time.perf_counter() - started)


def main() -> None:
    """Run the interleaved rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--execs", type=int, default=20, help="exec('true') calls per round and backend")
    args = parser.parse_args()

    import ray
    from harbor.models.task.task import Task

    from trl_harbor import runtime

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    task = Task(TASK)
    samples: dict[str, list[float]] = defaultdict(list)
    echo = ray.remote(_Echo).options(num_cpus=0).remote()
    with tempfile.TemporaryDirectory(prefix="ray-crossing-") as folder:
        scratch = Path(folder)
        # One round each first, not counted: the image mounted, the actor's imports in the OS cache.
        runtime.run(_round(task, "local", 1, scratch, defaultdict(list)))
        runtime.run(_round(task, "ray", 1, scratch, defaultdict(list)))
        for index in range(args.rounds):
            order = ("local", "ray") if index % 2 == 0 else ("ray", "local")
            for kind in order:
                runtime.run(_round(task, kind, args.execs, scratch, samples))
            runtime.run(_floor(echo, args.execs, samples))
    ray.shutdown()

    def median_ms(label: str) -> float:
        return statistics.median(samples[label]) * 1000

    print(f"\n{args.rounds} interleaved rounds, {args.execs} exec('true') per round and backend; medians")
    print(f"{'operation':<22} {'local (ms)':>11} {'ray (ms)':>10} {'ray - local':>12} {'ratio':>7}")
    for operation in ("start", "exec true", "exec printing 1 MiB", "upload 1 MiB", "download 1 MiB", "stop"):
        local, remote = median_ms(f"{operation} [local]"), median_ms(f"{operation} [ray]")
        print(f"{operation:<22} {local:>11.2f} {remote:>10.2f} {remote - local:>12.2f} {remote / local:>6.1f}x")
    print(f"{'bare actor call':<22} {'':>11} {median_ms('bare actor call [ray]'):>10.2f}")


if __name__ == "__main__":
    main()
