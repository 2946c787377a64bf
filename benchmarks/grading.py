"""What sealing a rollout before grading costs (issue #12), against grading without the seal.

Grades N rollouts of one bundled task on the local backend, one at a time and as a batch,
twice: with the seal (the agent's processes killed, what the verifier runs fingerprinted and
compared) and with it switched off, in the same run. Prints a table with medians and ratios;
the machines are noisy, so compare the ratios, not the milliseconds.

    .venv/bin/python benchmarks/grading.py [--rounds 12] [--batch 16]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HARBOR_TELEMETRY", "0")

from trl_harbor import HarborBashEnv, close_all  # noqa: E402
from trl_harbor.env import verify_all  # noqa: E402
from trl_harbor.sealing import Seal, SealReport  # noqa: E402

TASK = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "building_b_humidity"
ANSWER = "51.46"


@contextlib.contextmanager
def unsealed() -> Iterator[None]:
    """Grade without the seal: nothing snapshotted, nothing killed, nothing compared."""
    saved = Seal.apply, Seal.take_files, Seal.take_processes

    async def nothing(self, *args, **kwargs):
        return None

    async def no_report(self, environment, allowed=()):
        return SealReport(0)

    Seal.apply, Seal.take_files, Seal.take_processes = no_report, nothing, nothing
    try:
        yield
    finally:
        Seal.apply, Seal.take_files, Seal.take_processes = saved


def rollouts(count: int) -> list[HarborBashEnv]:
    envs = [HarborBashEnv(environment_type="local") for _ in range(count)]
    for env in envs:
        env.reset(task_dir=str(TASK))
    for env in envs:
        env.bash(f"echo {ANSWER} > /workdir/answer.txt; nohup sleep 300 >/dev/null 2>&1 &")
    return envs


def one_at_a_time(rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        (env,) = rollouts(1)
        started = time.perf_counter()
        assert env.reward == 1.0
        times.append(time.perf_counter() - started)
        close_all()
    return times


def batch(size: int, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        envs = rollouts(size)
        started = time.perf_counter()
        assert verify_all(envs) == [1.0] * size
        times.append(time.perf_counter() - started)
        close_all()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    rows = []
    for label, measure in (
        ("grade 1 rollout", lambda: one_at_a_time(args.rounds)),
        (f"grade a batch of {args.batch}", lambda: batch(args.batch, max(2, args.rounds // 4))),
    ):
        sealed = statistics.median(measure())
        with unsealed():
            plain = statistics.median(measure())
        rows.append((label, sealed, plain))
    print(f"{'phase':<24} {'sealed (ms)':>12} {'unsealed (ms)':>14} {'ratio':>7}")
    for label, sealed, plain in rows:
        print(f"{label:<24} {sealed * 1000:>12.1f} {plain * 1000:>14.1f} {sealed / plain:>7.2f}")


if __name__ == "__main__":
    main()
