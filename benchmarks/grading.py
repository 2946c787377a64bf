"""What grading in the verifier's view costs (issue #31), against the old seal and against no defence.

Grades rollouts of one bundled task on the local backend (task images), one at a time and as a
batch, three ways in the same run:

* **isolated** (the default): the verifier in a view started by the sandbox's keel — the agent's own
  folders live, its code places a filtered snapshot, its own network, the agent's TCP ports mirrored,
  the agent's processes left running;
* **seal**: the verifier in the agent's sandbox after the agent's processes are killed and the
  fingerprints of what the verifier runs compared (``verifier_isolation=False``,
  ``agent_processes="kill"``);
* **none**: the verifier in the agent's sandbox, nothing killed or compared (Harbor's shared trial).

Each rollout leaves what an honest agent leaves: its answer, a background process, a ``pip``-sized
tree of new files. Then the view alone: its set-up (open and close, around one command) and what it
holds in memory, with 0, 10,000 and 60,000 files in the agent's working directory (live: never
walked) and with 2,000 new files of an installed package (a code place: judged, so walked). Last, what
a file the verifier creates costs when the agent added a command on ``PATH`` (each creation waits for
the view's watcher: the naming filter) against a view without one. Prints medians and ratios; the
machines are noisy, so compare the ratios, not the milliseconds.

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
from trl_harbor.rollout.seal import Baseline, SealReport  # noqa: E402
from trl_harbor.training.env import verify_all  # noqa: E402

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


def _cgroup_bytes(env: HarborBashEnv) -> int:
    """Memory charged to the sandbox's keel leaf (the view's processes, its tmpfs), as root with cgroup v1."""
    box = env._episode.environment._sandbox.box  # type: ignore[union-attr]
    total = 0
    for path in box._cgroups.leaf("keel"):
        with contextlib.suppress(OSError):
            total += int((path / "memory.usage_in_bytes").read_text())
    return total


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def view_costs(files: int, where: str, rounds: int) -> tuple[float, int, int, int]:
    """Median set-up of the view (open, one command, close) in ms, and the memory it held: of the
    sandbox's keel leaf, of this process (RSS growth), and the snapshot's entries."""
    from trl_harbor import runtime

    env = HarborBashEnv(environment_type="local", options=MODES["isolated"])
    env.reset(task_dir=str(TASK))
    env.bash("true")  # the sandbox is up
    if files:
        make = f"for i in range({files}): open(f'f{{i}}.py', 'w').close()"
        env.bash(f'mkdir -p {where} && cd {where} && python3 -c "{make}"')
    environment = env._episode.environment  # type: ignore[union-attr]

    async def once() -> tuple[float, int, int]:
        started = time.perf_counter()
        async with environment.verifier_view() as view:  # type: ignore[union-attr]
            await view.exec("true")
            held = _cgroup_bytes(env)
            entries = view._sandbox.view.entries
        return time.perf_counter() - started, held, entries

    times, held, entries = [], 0, 0
    rss = _rss_bytes()
    for _ in range(rounds):
        took, held, entries = runtime.run(once())
        times.append(took)
    grown = max(0, _rss_bytes() - rss)
    close_all()
    return statistics.median(times) * 1000, held, grown, entries


#: The verifier making files in its view: microseconds per ``open(..., "w")``, printed by the command.
MAKE_FILES = (
    'python3 -c "import time; t = time.perf_counter(); '
    "[open(f'/tmp/made{i}', 'w').close() for i in range(5000)]; "
    'print((time.perf_counter() - t) * 1e6 / 5000)"'
)


def naming_cost(agent_command: bool, rounds: int) -> float:
    """Median microseconds per file the verifier creates in its view. With a command the agent added on
    ``PATH`` each creation waits for the view's watcher (the naming filter); without one there is no filter."""
    from trl_harbor import runtime

    env = HarborBashEnv(environment_type="local", options=MODES["isolated"])
    env.reset(task_dir=str(TASK))
    env.bash("true")  # the sandbox is up
    if agent_command:
        env.bash("printf '#!/bin/sh\\n' > /usr/local/bin/agenttool && chmod 755 /usr/local/bin/agenttool")
    environment = env._episode.environment  # type: ignore[union-attr]

    async def once() -> float:
        async with environment.verifier_view() as view:  # type: ignore[union-attr]
            return float((await view.exec(MAKE_FILES)).stdout)

    times = [runtime.run(once()) for _ in range(rounds)]
    close_all()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    phases = (  # a batch phase of 6 batches a mode (the median of 2 swung the ratio by 0.3x)
        ("grade 1 rollout", 1, args.rounds),
        (f"grade a batch of {args.batch}", args.batch, max(4, args.rounds // 2)),
    )
    print(
        f"{'phase':<24} " + " ".join(f"{m + ' (ms)':>15}" for m in MODES) + f" {'isolated/none':>14} {'seal/none':>10}"
    )
    for label, size, rounds in phases:
        medians = {}
        for mode, options in MODES.items():  # warm: a training run pays the once-per-image work once
            with no_tamper_check(mode == "none"):
                measure(1, 1, options)
        for _ in range(2):  # interleaved twice: the machine's load drifts
            for mode, options in MODES.items():
                with no_tamper_check(mode == "none"):
                    medians.setdefault(mode, []).extend(measure(size, rounds // 2 or 1, options))
        values = {mode: statistics.median(times) for mode, times in medians.items()}
        print(
            f"{label:<24} " + " ".join(f"{values[m] * 1000:>15.1f}" for m in MODES)
            + f" {values['isolated'] / values['none']:>14.2f} {values['seal'] / values['none']:>10.2f}"
        )  # fmt: skip
    print()
    print(f"{'the view alone':<44} {'set-up (ms)':>12} {'keel leaf (MiB)':>16} {'trainer RSS +MiB':>17} {'judged':>8}")
    cases = (
        ("no extra file", 0, "/workdir/many"),
        ("10,000 files in the working directory", 10_000, "/workdir/many"),
        ("60,000 files in the working directory", 60_000, "/workdir/many"),
        ("2,000 files of a package (a code place)", 2_000, "/usr/local/lib/python3.11/dist-packages/bulk"),
    )
    for label, files, where in cases:
        took, held, grown, entries = view_costs(files, where, max(3, args.rounds // 2))
        print(f"{label:<44} {took:>12.1f} {held / 2**20:>16.1f} {grown / 2**20:>17.1f} {entries:>8}")
    print()
    costs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(2):  # interleaved: the machine's load drifts
        for agent_command in costs:
            costs[agent_command].append(naming_cost(agent_command, max(3, args.rounds // 4)))
    plain, named = (statistics.median(costs[k]) for k in (False, True))
    print(f"{'a file the verifier creates (5,000 in a row)':<44} {'us per file':>12} {'ratio':>8}")
    print(f"{'no command of the agent on PATH':<44} {plain:>12.1f} {1.0:>8.2f}")
    print(f"{'the agent added one (the naming filter)':<44} {named:>12.1f} {named / plain:>8.2f}")


if __name__ == "__main__":
    main()
