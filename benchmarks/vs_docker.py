"""Harbor's Docker backend against the local sandbox: the same batches on both, in one run.

    .venv/bin/python benchmarks/vs_docker.py [--runs 10] [--sizes 16 64] [--grpo-rollouts 8] [--no-harbor-run]

Needs root and what ``./scripts/bootstrap.sh`` installs as root: the run starts the private
Docker daemon the tests use (``tests/docker_daemon.py``: its own state, network and mount
namespaces, removed at exit), seeded from the loopback registry (``tests/registry.py``), and
points ``DOCKER_HOST`` at it. Nothing of the machine's own Docker is touched.

Both backends run the same one-task suite (``bench_task.py``: write 42, a shell grader) through
the same trl-harbor code; the task allows the network, because Harbor's Docker backend cannot
enforce ``no-network`` on an offline host (``docs/backends.md``). Measured, on each backend:

* sandbox start: ``start()`` and a first ``exec("true")``, median and p95 over ``--runs``
  (the first, image-building start is reported apart);
* N concurrent starts: N ``HarborEnv.reset()`` calls until every sandbox is up;
* a turn's tool phase: one ``bash`` call in each of N ready sandboxes, all at once (what
  ``HarborGRPOTrainer`` does with a turn);
* verification of a batch: the reward function over those N rollouts (sealed and graded at once);
* a whole CPU GRPO step: ``HarborGRPOTrainer``, the tiny policy of ``trl_harbor.testing``,
  ``--grpo-rollouts`` rollouts of one ``bash`` call each;
* ``harbor run -a oracle -n 4`` on the bundled suite (a copy with the network public on both).

Printed: one row per measure, the local and Docker figures, and Docker / local. Every figure
of a row comes from this run, on this machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("HARBOR_TELEMETRY", "0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from bench_task import write_bench_task  # noqa: E402
from docker_daemon import BUNDLED_BASE, private_daemon, public_copy  # noqa: E402
from harbor.models.task.task import Task  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402
from registry import serve_loopback_registry  # noqa: E402

from trl_harbor import HarborBashEnv, HarborSpec, close_all, runtime  # noqa: E402
from trl_harbor.rollout.backends import create_environment  # noqa: E402

BACKENDS = ("local", "docker")
TOOL_COMMAND = "echo 42 > /workdir/answer.txt"


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


async def sandbox_starts(task_dir: Path, scratch: Path, backend: str, runs: int) -> dict[str, float]:
    """Start + first exec, one sandbox after another; the first (building) start apart."""
    task = Task(task_dir)
    times: list[float] = []
    cold = 0.0
    for index in range(runs + 1):
        env = create_environment(
            task, backend, session_id=f"bench-{backend}-{index}",
            trial_paths=TrialPaths(trial_dir=scratch / f"{backend}-trial-{index}"),
        )  # fmt: skip
        began = time.perf_counter()
        await env.start(force_build=False)
        result = await env.exec("true")
        elapsed = time.perf_counter() - began
        assert result.return_code == 0, result
        await env.stop(delete=True)
        if index == 0:
            cold = elapsed
        else:
            times.append(elapsed)
    return {"cold": cold, "median": statistics.median(times), "p95": _p95(times)}


def batch(suite: Path, backend: str, n: int) -> dict[str, float]:
    """N rollouts through HarborEnv: concurrent starts, one tool call each at once, the batch's verification."""
    try:
        return _batch(suite, backend, n)
    finally:
        close_all()  # also when a figure is missing: every sandbox stops while the daemon runs


def _batch(suite: Path, backend: str, n: int) -> dict[str, float]:
    spec = HarborSpec(suite, environment_type=backend)
    task_dir = str(spec.task_dirs[0])
    envs = [spec.environment_factory() for _ in range(n)]
    began = time.perf_counter()
    for env in envs:
        env.reset(task_dir=task_dir)  # returns at once; the sandbox starts on the shared loop
    concurrent.futures.wait([env._episode.ready for env in envs])
    starts = time.perf_counter() - began
    failed = [env._episode.infra_error for env in envs if env._episode.infra_error]
    assert not failed, failed[:3]
    outputs: list[str] = []
    threads = [threading.Thread(target=lambda e=env: outputs.append(e.bash(TOOL_COMMAND))) for env in envs]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tools = time.perf_counter() - began
    assert outputs == ["(empty output, rc=0)"] * n, outputs[:3]
    reward = spec.reward_funcs
    began = time.perf_counter()
    rewards = reward(completions=[None] * n, environments=envs)
    verify = time.perf_counter() - began
    assert rewards == [1.0] * n, rewards[:4]
    return {"starts": starts, "tools": tools, "verify": verify}


def grpo_step(suite: Path, backend: str, rollouts: int) -> float:
    """Wall time of one real CPU training step: HarborGRPOTrainer, ``rollouts`` rollouts, one bash call each."""
    from trl import GRPOConfig

    from trl_harbor import HarborGRPOTrainer
    from trl_harbor.testing import build_model, build_tokenizer, script_tool_calls, tool_call_text

    spec = HarborSpec(suite, environment_type=backend)
    call = tool_call_text("bash", {"command": TOOL_COMMAND})
    instruction = (spec.task_dirs[0] / "instruction.md").read_text()
    tokenizer = build_tokenizer(corpus=[instruction, HarborBashEnv.PROMPT_SUFFIX], extra_tokens=[call])
    model = build_model(tokenizer, seed=0)
    script_tool_calls(model, tokenizer, [call])
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-vs-docker-grpo-"))
    with warnings.catch_warnings(), open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        warnings.simplefilter("ignore")
        args = GRPOConfig(
            output_dir=str(scratch), use_cpu=True, max_steps=1, num_generations=rollouts,
            per_device_train_batch_size=rollouts, max_completion_length=64, max_tool_calling_iterations=1,
            report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
        )  # fmt: skip
        trainer = HarborGRPOTrainer(
            model=model, processing_class=tokenizer, args=args, train_dataset=spec.train_dataset,
            environment_factory=spec.environment_factory, reward_funcs=spec.reward_funcs,
        )  # fmt: skip
        began = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - began
    close_all()
    shutil.rmtree(scratch, ignore_errors=True)
    assert trainer.state.log_history[0]["reward"] == 1.0, trainer.state.log_history[0]
    return elapsed


def harbor_run(suite: Path, backend: str, scratch: Path) -> tuple[float, str]:
    """``harbor run -a oracle -n 4`` on a suite; returns (seconds, "passed/total")."""
    harbor = shutil.which("harbor") or str(Path(sys.executable).parent / "harbor")
    environment = "harbor_local_sandbox.local:LocalEnvironment" if backend == "local" else backend
    jobs = scratch / f"jobs-{backend}"
    began = time.perf_counter()
    done = subprocess.run(
        [harbor, "run", "-p", str(suite), "-a", "oracle", "-e", environment, "-n", "4", "-o", str(jobs), "-y"],
        capture_output=True, text=True, timeout=1800, cwd=scratch,
    )  # fmt: skip
    elapsed = time.perf_counter() - began
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result_file,) = jobs.glob("*/result.json")
    stats = json.loads(result_file.read_text())["stats"]
    (evaluation,) = stats["evals"].values()
    passed = round(evaluation["metrics"][0]["reward"] * stats["n_completed_trials"])
    return elapsed, f"{passed}/{stats['n_completed_trials'] + stats['n_errored_trials']}"


def _show(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _print(rows: list[tuple[str, float, float, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    header = f"{'measure':<{width}}  {'local':>10}  {'docker':>10}  {'docker / local':>14}"
    print("\n" + header)
    print("-" * len(header))
    for name, local, docker, note in rows:
        print(f"{name:<{width}}  {_show(local):>10}  {_show(docker):>10}  {docker / local:>13.1f}x  {note}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="sandbox starts per median and p95")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="batch sizes N")
    parser.add_argument("--grpo-rollouts", type=int, default=8, help="rollouts of the GRPO step")
    parser.add_argument("--no-harbor-run", action="store_true", help="skip `harbor run` on the bundled suite")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/vs_docker.py runs a private dockerd: run it as root")

    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-vs-docker-"))
    suite = scratch / "tasks"
    write_bench_task(suite, network_mode="public", memory_mb=512)
    task_dir = suite / "bench"
    bundled = public_copy(REPO / "examples" / "tasks", scratch / "bundled")
    (scratch / "registry").mkdir()
    rows: list[tuple[str, float, float, str]] = []
    try:
        # The private daemon as the tests run it (tests/docker_daemon.py), with more address pools than
        # Docker's default: Harbor gives each sandbox a network, and N=64 needs 64 of them.
        with serve_loopback_registry(scratch / "registry") as registry:
            source = f"docker://{registry.base}"
            with private_daemon(scratch / "dockerd", {BUNDLED_BASE: source}) as daemon:
                os.environ.update(DOCKER_HOST=daemon.host, DOCKER_CONFIG=str(daemon.config_dir))
                print(f"dockerd {daemon.version}, compose {daemon.compose_version}; python {sys.version.split()[0]}, "
                      f"{os.cpu_count()} CPUs", flush=True)  # fmt: skip
                starts = {b: runtime.run(sandbox_starts(task_dir, scratch, b, args.runs)) for b in BACKENDS}
                print(
                    f"first start of the run (Docker builds the task's image from the base; the local image "
                    f"cache may hold it already): local {_show(starts['local']['cold'])}, "
                    f"docker {_show(starts['docker']['cold'])}"
                )
                rows += [
                    ("sandbox start + first exec, median", starts["local"]["median"], starts["docker"]["median"], ""),
                    ("sandbox start + first exec, p95", starts["local"]["p95"], starts["docker"]["p95"], ""),
                ]
                _print(rows[-2:])
                for n in args.sizes:
                    done = {b: batch(suite, b, n) for b in BACKENDS}
                    for label, key in (
                        (f"{n} concurrent starts (reset -> all up)", "starts"),
                        (f"tool phase, N={n} (one bash call each, at once)", "tools"),
                        (f"verification of a batch, N={n}", "verify"),
                    ):
                        rows.append((label, done["local"][key], done["docker"][key], ""))
                    _print(rows[-3:])
                step = {b: grpo_step(suite, b, args.grpo_rollouts) for b in BACKENDS}
                rows.append((f"CPU GRPO step, {args.grpo_rollouts} rollouts", step["local"], step["docker"], ""))
                _print(rows[-1:])
                if not args.no_harbor_run:
                    ran = {b: harbor_run(bundled, b, scratch) for b in BACKENDS}
                    note = f"(passed: local {ran['local'][1]}, docker {ran['docker'][1]})"
                    rows.append(("harbor run -a oracle -n 4, bundled suite", ran["local"][0], ran["docker"][0], note))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("\nall rows (one run, this machine):")
    _print(rows)


if __name__ == "__main__":
    main()
