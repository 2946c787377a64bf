"""A generation batch, driven the way GRPOTrainer drives it: ours against the reference's way.

    .venv/bin/python benchmarks/batch.py [--sizes 8 64 256] [--latency 2] [--tool-calls 3]
    .venv/bin/python benchmarks/batch.py --parts tools [--tool-sizes 8 64] [--tool-latencies 0.05 1]

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

``--parts tools`` (run by default too) measures the trainer's own tool loop: one real CPU
training step of a tiny policy (``trl_harbor.testing``) whose N rollouts each make one ``bash``
call, with ``--tool-latencies`` added to every command (``LatencyLocalEnvironment``), through
TRL's ``GRPOTrainer`` (one rollout's call after another) and through ``HarborGRPOTrainer`` (the
turn's calls at once). "tool phase" is the wall time from the first command of the turn to the
end of the last one (commands are timed once the batch's sandboxes are up: starts are not
tools), compared with one command alone, measured in the same run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HARBOR_TELEMETRY", "0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bench_task import write_bench_task  # noqa: E402

from trl_harbor import HarborOptions, HarborSpec, close_all  # noqa: E402
from trl_harbor.rollout.backends import resolve_backend  # noqa: E402

LOCAL = "harbor_local_sandbox.local:LocalEnvironment"
LATENCY = "harbor_local_sandbox.latency:LatencyLocalEnvironment"
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
    def rollout(self) -> float:
        """From the first ``reset`` to the batch's rewards (what the trainer waits; teardown not included)."""
        return self.first_tool + self.tools + self.verify

    @property
    def total(self) -> float:
        return self.rollout + self.teardown


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
    kwargs = {"backend_options": _latency_kwargs(latency)} if latency else {}
    spec = HarborSpec(suite, environment_type=LATENCY if latency else LOCAL, options=HarborOptions(**kwargs))
    envs = [spec.environment_factory() for _ in range(n)]
    reward_func = spec.reward_funcs
    timing = _drive(envs, str(spec.task_dirs[0]), tool_calls, lambda es: reward_func(environments=es))
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

    config = resolve_backend(environment, kwargs).config  # before the swap: it builds one itself
    original = trial_config.EnvironmentConfig
    trial_config.EnvironmentConfig = lambda **_: config  # type: ignore[assignment]
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


def _timed_bash_env(spans: list[tuple[float, float]]) -> type:
    """The bash harness, recording when each command ran (once every sandbox of the batch was up)."""
    from trl_harbor import HarborBashEnv

    lock = threading.Lock()
    instances: list[HarborBashEnv] = []

    class TimedBashEnv(HarborBashEnv):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            instances.append(self)

        def bash(self, command: str) -> str:
            """Run a shell command in the sandbox and return its combined stdout and stderr.

            Args:
                command: The shell command to run.

            Returns:
                The command's combined stdout and stderr.
            """
            # Sandbox starts are not part of the tool phase: wait until the batch's sandboxes are up.
            starts = [env._episode.ready for env in instances if env._episode and env._episode.ready]
            concurrent.futures.wait(starts)
            begin = time.perf_counter()
            output = super().bash(command)
            with lock:
                spans.append((begin, time.perf_counter()))
            return output

    return TimedBashEnv


def _latency_spec(suite: Path, agent: type, exec_latency: float) -> HarborSpec:
    kwargs = {"backend_options": {"exec_latency_sec": exec_latency}}
    return HarborSpec(suite, agent=agent, environment_type=LATENCY, options=HarborOptions(**kwargs))


def one_command(suite: Path, exec_latency: float, repeats: int = 11) -> float:
    """Median wall time of one ``bash`` call alone (the sandbox already up; the first call not counted)."""
    spans: list[tuple[float, float]] = []
    env = _latency_spec(suite, _timed_bash_env(spans), exec_latency).environment_factory()
    env.reset(task_dir=str(next(suite.iterdir())))
    for _ in range(repeats):
        env.bash(TOOL_COMMAND)
    close_all()
    return statistics.median(end - begin for begin, end in spans[1:])


TOOL_COMMAND = "echo 42 > /workdir/answer.txt"


def tool_turn(suite: Path, n: int, exec_latency: float, concurrent_tools: bool) -> tuple[float, list]:
    """One GRPO step of ``n`` rollouts with one ``bash`` call each; returns (tool phase, rewards)."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_harbor import HarborGRPOTrainer
    from trl_harbor.testing import build_model, build_tokenizer, script_tool_calls, tool_call_text

    spans: list[tuple[float, float]] = []
    agent = _timed_bash_env(spans)
    spec = _latency_spec(suite, agent, exec_latency)
    call = tool_call_text("bash", {"command": TOOL_COMMAND})
    instruction = (next(suite.iterdir()) / "instruction.md").read_text()
    tokenizer = build_tokenizer(corpus=[instruction, agent.PROMPT_SUFFIX], extra_tokens=[call])
    model = build_model(tokenizer, seed=0)
    script_tool_calls(model, tokenizer, [call])
    harbor_reward = spec.reward_funcs
    rewards: list = []

    def reward(**kwargs):
        rewards.extend(harbor_reward(**kwargs))
        return rewards[-n:]

    reward.__name__ = "harbor_reward"
    trainer_cls = HarborGRPOTrainer if concurrent_tools else GRPOTrainer
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-tool-turn-"))
    with warnings.catch_warnings(), open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        warnings.simplefilter("ignore")
        args = GRPOConfig(
            output_dir=str(scratch),
            use_cpu=True,
            max_steps=1,
            num_generations=n,
            per_device_train_batch_size=n,
            max_completion_length=64,
            max_tool_calling_iterations=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1,
            seed=0,
        )
        trainer = trainer_cls(
            model=model,
            processing_class=tokenizer,
            args=args,
            train_dataset=spec.train_dataset,
            environment_factory=spec.environment_factory,
            reward_funcs=[reward],
        )
        trainer.train()
    close_all()
    shutil.rmtree(scratch, ignore_errors=True)
    assert len(spans) == n, f"expected one tool call per rollout, got {len(spans)}"
    return max(end for _, end in spans) - min(begin for begin, _ in spans), rewards


def commands_at_once(suite: Path, n: int) -> float:
    """Wall time of ``n`` commands started together on ``n`` ready local sandboxes, no latency added.

    The floor of a concurrent tool phase on this machine: the local sandbox's own cost per
    command (a cloud sandbox spends none of the trainer machine's CPU).
    """
    spans: list[tuple[float, float]] = []
    spec = _latency_spec(suite, _timed_bash_env(spans), 0.0)
    envs = [spec.environment_factory() for _ in range(n)]
    for env in envs:
        env.reset(task_dir=str(next(suite.iterdir())))
    threads = [threading.Thread(target=env.bash, args=(TOOL_COMMAND,)) for env in envs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    close_all()
    return max(end for _, end in spans) - min(begin for begin, _ in spans)


def tool_phase_table(suite: Path, sizes: list[int], latencies: list[float]) -> None:
    """Print the tool phase of one turn: TRL's GRPOTrainer vs HarborGRPOTrainer."""
    header = (
        f"{'N':>4} {'cmd lat.':>9} {'one command':>12} {'GRPOTrainer':>12} {'HarborGRPOTrainer':>18} "
        f"{'TRL / ours':>11} {'ours / one command':>19}"
    )
    print("\ntool phase of one turn (one bash call per rollout, real CPU GRPO step)")
    print(header)
    print("-" * len(header))
    for latency in latencies:
        single = one_command(suite, latency)
        for n in sizes:
            trl_phase, trl_rewards = tool_turn(suite, n, latency, concurrent_tools=False)
            ours_phase, ours_rewards = tool_turn(suite, n, latency, concurrent_tools=True)
            assert trl_rewards == ours_rewards == [1.0] * n, (trl_rewards[:4], ours_rewards[:4])
            print(
                f"{n:>4} {latency * 1000:>7.0f}ms {single:>11.3f}s {trl_phase:>11.2f}s {ours_phase:>17.2f}s "
                f"{trl_phase / ours_phase:>10.1f}x {ours_phase / single:>18.2f}x"
            )
    for n in sizes:
        floor = commands_at_once(suite, n)
        print(f"(N={n}: {n} commands at once with no latency added take {floor:.2f} s here: the local sandbox's CPU)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["batch", "tools"], default=["batch", "tools"])
    parser.add_argument("--tool-sizes", type=int, nargs="+", default=[8, 64], help="N for the tool-phase table")
    parser.add_argument(
        "--tool-latencies", type=float, nargs="+", default=[0.05, 1.0], help="seconds added to each command"
    )
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
    if "batch" in args.parts:
        batch_table(suite, args)
    if "tools" in args.parts:
        tool_phase_table(suite, args.tool_sizes, args.tool_latencies)
    print(f"\n(python {sys.version.split()[0]}; {os.cpu_count()} CPUs)")
    shutil.rmtree(scratch, ignore_errors=True)


def batch_table(suite: Path, args: argparse.Namespace) -> None:
    """Print the batch phases: trl-harbor vs the reference integration."""
    # One rollout alone (start, the same calls, grading): the floor a batch is held to (issue #20: within 1.5x).
    single = {latency: run_ours(suite, 1, latency, args.tool_calls) for latency in (0.0, args.latency)}

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
            summary.append(
                (n, latency, None, ours.verify / single[latency].verify, ours.rollout / single[latency].rollout)
            )
    print("\nratios (reference / trl-harbor; then trl-harbor's batch against one rollout of its own alone):")
    for n, latency, first, verify, total in summary:
        if first is None:
            target = " (target <= 1.5x with a start latency, issue #20)" if latency else ""
            print(f"  N={n:<4} latency={latency:g}s  verify of the batch / one verification = {verify:.2f}x;  "
                  f"reset->calls->rewards of the batch / of one rollout = {total:.2f}x{target}")  # fmt: skip
        else:
            print(f"  N={n:<4} latency={latency:g}s  first tool {first:6.1f}x  verify {verify:6.1f}x  "
                  f"total {total:6.1f}x")  # fmt: skip
    one = ", ".join(
        f"{t.rollout * 1000:.0f} ms (verification {t.verify * 1000:.0f} ms) at {lat:g} s start latency"
        for lat, t in single.items()
    )
    print(f"\n(one rollout alone: {one})")


if __name__ == "__main__":
    main()
