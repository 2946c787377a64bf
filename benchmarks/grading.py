"""What grading in an isolated view costs (issue #17), against the old seal and against no defence.

Grades rollouts of one bundled task on the local backend (task images), one at a time and as a
batch, three ways in the same run:

* **isolated** (the default): the verifier in a sibling box over a filtered snapshot of the agent's
  layer, the agent's processes left running;
* **seal**: the verifier in the agent's sandbox after the agent's processes are killed and the
  fingerprints of what the verifier runs compared (``verifier_isolation=False``,
  ``agent_processes="kill"``: the previous release's grading);
* **none**: the verifier in the agent's sandbox, nothing killed or compared (Harbor's shared trial).

Each rollout leaves what an honest agent leaves: its answer, a background process, a ``pip``-sized
tree of new files. Prints medians and ratios against ``none``; the machines are noisy, so compare
the ratios, not the milliseconds.

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

from trl_harbor import HarborBashEnv, HarborOptions, close_all  # noqa: E402
from trl_harbor.env import verify_all  # noqa: E402
from trl_harbor.rollout.seal import Baseline, SealReport  # noqa: E402

TASK = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "building_b_humidity"
ANSWER = "51.46"
#: What the agent leaves: its answer, a process, and 200 new files of a package it installed.
WORK = (
    f"echo {ANSWER} > /workdir/answer.txt; nohup sleep 300 >/dev/null 2>&1 & "
    "d=/usr/local/lib/python3.11/dist-packages/somepkg; mkdir -p $d; "
    "for i in $(seq 200); do echo 'x = 1' > $d/m$i.py; done"
)
MODES = {
    "isolated": HarborOptions(),
    "seal": HarborOptions(agent_processes="kill", backend_options={"verifier_isolation": False}),
    "none": HarborOptions(backend_options={"verifier_isolation": False}),
}


@contextlib.contextmanager
def no_tamper_check(active: bool) -> Iterator[None]:
    """For ``none``: nothing fingerprinted or compared."""
    if not active:
        yield
        return
    saved = Baseline.apply, Baseline.take_files

    async def nothing(self, *args, **kwargs):
        return None

    async def no_report(self, environment, kill, allowed=()):
        return SealReport(0)

    Baseline.apply, Baseline.take_files = no_report, nothing
    try:
        yield
    finally:
        Baseline.apply, Baseline.take_files = saved


def rollouts(count: int, options: HarborOptions) -> list[HarborBashEnv]:
    envs = [HarborBashEnv(environment_type="local", options=options) for _ in range(count)]
    for env in envs:
        env.reset(task_dir=str(TASK))
    for env in envs:
        env.bash(WORK)
    return envs


def measure(size: int, rounds: int, options: HarborOptions) -> list[float]:
    times = []
    for _ in range(rounds):
        envs = rollouts(size, options)
        started = time.perf_counter()
        rewards = verify_all(envs) if size > 1 else [envs[0].reward]
        times.append(time.perf_counter() - started)
        assert rewards == [1.0] * size, rewards
        close_all()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    phases = (
        ("grade 1 rollout", 1, args.rounds),
        (f"grade a batch of {args.batch}", args.batch, max(2, args.rounds // 4)),
    )
    print(
        f"{'phase':<24} " + " ".join(f"{m + ' (ms)':>15}" for m in MODES) + f" {'isolated/none':>14} {'seal/none':>10}"
    )
    for label, size, rounds in phases:
        medians = {}
        for _ in range(2):  # interleaved twice: the machine's load drifts
            for mode, options in MODES.items():
                with no_tamper_check(mode == "none"):
                    medians.setdefault(mode, []).extend(measure(size, rounds // 2 or 1, options))
        values = {mode: statistics.median(times) for mode, times in medians.items()}
        print(
            f"{label:<24} " + " ".join(f"{values[m] * 1000:>15.1f}" for m in MODES)
            + f" {values['isolated'] / values['none']:>14.2f} {values['seal'] / values['none']:>10.2f}"
        )  # fmt: skip


if __name__ == "__main__":
    main()
