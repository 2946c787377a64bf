"""A generation batch, driven the way GRPOTrainer drives it: ours against the reference's way.

    .venv/bin/python benchmarks/batch.py [--sizes 8 64 256] [--latency 2] [--tool-calls 3]

For each batch size N: N environments from the factory; ``reset`` on each, in a loop; ``k``
``bash`` tool calls on each, environment after environment (TRL calls tools one after
another on one thread); then the rewards; then teardown. The same work runs through
trl-harbor and through TRL's reference integration (``trl.experimental.harbor``, unmodified:
one event loop per environment, ``reset`` blocking until the sandbox is up, one verification
after another), both on the local sandbox. Each is run twice: as is, and with 2 s added to
every sandbox start (and ``--exec-latency``, 50 ms by default, to every command) to model a
cloud backend (``LatencyLocalEnvironment``; cloud APIs cannot be reached from here). The
reference with start latency and large N takes N x 2 s just to reset, so it is skipped above
``--baseline-latency-max`` unless ``--full`` is given.

Printed: wall time per phase and the reference/ours ratio. "first tool" is the time from the
first ``reset`` until every environment has its first tool result, i.e. what a batch waits
before the model's first turn can continue.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HARBOR_TELEMETRY", "0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bench_task import write_bench_task  # noqa: E402

from trl_harbor import HarborSpec, close_all  # noqa: E402
from trl_harbor.backends import environment_config  # noqa: E402

LOCAL = "trl_harbor.sandboxes.local:LocalEnvironment"
LATENCY = "trl_harbor.sandboxes.latency:LatencyLocalEnvironment"
#: Round trip added to every command in the cloud model (set by --exec-latency).
EXEC_LATENCY = 0.05


def _suite(root: Path) -> Path:
    """One small task. The reference ignores task network policies (everything is public),
    so the task allows network for both sides to do the same work."""
    write_bench_task(root / "tasks", network_mode="public", memory_mb=512)
    return root / "tasks"


@dataclass
class Timing:
    reset: float = 0.0
    first_tool: float = 0.0
    tools: float = 0.0
    verify: float = 0.0
    teardown: float = 0.0
    rewards: list = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.first_tool + self.tools + self.verify + self.teardown


def _drive(envs, task_dir: str, tool_calls: int, reward) -> Timing:
    timing = Timing()
    t0 = time.perf_counter()
    for env in envs:
        env.reset(task_dir=task_dir)
    timing.reset = time.perf_counter() - t0
    for env in envs:
        env.bash("echo 42 > /workdir/answer.txt")
    timing.first_tool = time.perf_counter() - t0
    t = time.perf_counter()
    for _ in range(tool_calls - 1):
        for env in envs:
            env.bash("cat /workdir/answer.txt")
    timing.tools = time.perf_counter() - t
    t = time.perf_counter()
    timing.rewards = reward(envs)
    timing.verify = time.perf_counter() - t
    return timing


def _latency_kwargs(latency: float) -> dict:
    return {"start_latency_sec": latency, "exec_latency_sec": EXEC_LATENCY} if latency else {}


def run_ours(suite: Path, n: int, latency: float, tool_calls: int) -> Timing:
    kwargs = {"environment_kwargs": _latency_kwargs(latency)} if latency else {}
    spec = HarborSpec(suite, environment_type=LATENCY if latency else LOCAL, env_kwargs=kwargs)
    envs = [spec.environment_factory() for _ in range(n)]
    [reward_func] = spec.reward_funcs
    timing = _drive(envs, str(spec.task_dirs[0]), tool_calls, lambda es: reward_func([None] * len(es), es))
    t = time.perf_counter()
    close_all()
    timing.teardown = time.perf_counter() - t
    return timing


@contextlib.contextmanager
def _reference_on(environment: str, kwargs: dict) -> Iterator[None]:
    """Point the reference's Harbor config at a plug-in: it only takes a built-in type string.

    The reference builds ``harbor.models.trial.config.EnvironmentConfig(type=...)`` inside
    each reset; this swaps that class, for the benchmark only, for one that returns the
    plug-in's config. Nothing else of the reference changes.
    """
    import harbor.models.trial.config as trial_config

    original = trial_config.EnvironmentConfig
    trial_config.EnvironmentConfig = lambda **_: environment_config(environment, kwargs)  # type: ignore[assignment]
    try:
        yield
    finally:
        trial_config.EnvironmentConfig = original


def run_reference(suite: Path, n: int, latency: float, tool_calls: int) -> Timing:
    from trl.experimental.harbor import HarborBashEnv as ReferenceBashEnv

    environment = LATENCY if latency else LOCAL
    kwargs = _latency_kwargs(latency)
    with _reference_on(environment, kwargs):
        envs = [ReferenceBashEnv(environment_type="docker") for _ in range(n)]
        task_dir = str(next(suite.iterdir()))
        timing = _drive(envs, task_dir, tool_calls, lambda es: [e.reward for e in es])
        t = time.perf_counter()
        for env in envs:  # what its __del__ does, one environment after another
            env._run(env._stop())
        timing.teardown = time.perf_counter() - t
    del envs
    gc.collect()
    return timing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--latency", type=float, default=2.0, help="seconds added to each start (cloud model)")
    parser.add_argument("--exec-latency", type=float, default=0.05, help="seconds added to each command (cloud model)")
    parser.add_argument("--tool-calls", type=int, default=3)
    parser.add_argument("--baseline-latency-max", type=int, default=64, help="largest N for the slow baseline")
    parser.add_argument("--full", action="store_true", help="run every baseline, however long")
    args = parser.parse_args(argv)
    global EXEC_LATENCY
    EXEC_LATENCY = args.exec_latency

    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-batch-"))
    suite = _suite(scratch)
    run_ours(suite, 1, 0.0, 1)  # warm-up: builds the task's layer, compiles the supervisor
    single = {latency: run_ours(suite, 1, latency, 1).verify for latency in (0.0, args.latency)}

    header = (
        f"{'N':>4} {'start lat.':>10} {'impl':<10} {'reset':>8} {'first tool':>11} {'tools':>8} {'verify':>8} "
        f"{'teardown':>9} {'total':>8}"
    )
    print(header)
    print("-" * len(header))
    summary = []
    for latency in (0.0, args.latency):
        for n in args.sizes:
            ours = run_ours(suite, n, latency, args.tool_calls)
            rows = [("trl-harbor", ours)]
            if latency and n > args.baseline_latency_max and not args.full:
                ref = None
            else:
                ref = run_reference(suite, n, latency, args.tool_calls)
                rows.append(("reference", ref))
                assert ref.rewards == ours.rewards == [1.0] * n, (ref.rewards[:4], ours.rewards[:4])
            for name, t in rows:
                print(f"{n:>4} {latency:>9g}s {name:<10} {t.reset:>7.2f}s {t.first_tool:>10.2f}s {t.tools:>7.2f}s "
                      f"{t.verify:>7.2f}s {t.teardown:>8.2f}s {t.total:>7.2f}s")  # fmt: skip
            if ref is None:
                need = n * latency
                print(f"{n:>4} {latency:>9g}s reference  skipped (would need ~{need:.0f} s to reset; --full runs it)")
            else:
                ratios = (ref.first_tool / ours.first_tool, ref.verify / ours.verify, ref.total / ours.total)
                summary.append((n, latency, *ratios))
            summary.append((n, latency, None, ours.verify / single[latency], None))
    print("\nratios (reference / trl-harbor; verify also vs one verification of ours):")
    for n, latency, first, verify, total in summary:
        if first is None:
            print(f"  N={n:<4} latency={latency:g}s  verify of the batch / one verification = {verify:.2f}x")
        else:
            print(f"  N={n:<4} latency={latency:g}s  first tool {first:6.1f}x  verify {verify:6.1f}x  "
                  f"total {total:6.1f}x")  # fmt: skip
    one = ", ".join(f"{seconds * 1000:.0f} ms at {lat:g} s start latency" for lat, seconds in single.items())
    print(f"\n(one verification: {one}; python {sys.version.split()[0]}; {os.cpu_count()} CPUs)")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
