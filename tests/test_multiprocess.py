"""``trl-harbor train`` under ``accelerate launch``: two CPU processes, each with its own sandboxes.

Real parts throughout: accelerate's launcher (torch's elastic agent, the gloo backend), one
``GRPOTrainer`` a process, the local sandboxes and Harbor's verifier. The model is the hand-wired
tiny checkpoint of ``tests/demo_policy.py`` on the bundled suite (the embedded default's 135M model
would spend the test's time generating; what is checked here is the processes, not the model). What is checked is what a multi-GPU user relies on: every rank's rollouts are
in the one ``trajectories.jsonl`` exactly once, the summary counts them all, the metrics are the
trainer's own (reduced across ranks by TRL), and no sandbox outlives the run — when it ends, and
when the launcher is sent SIGINT mid-step (it passes the signal on to its workers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, requires_local

from sandbox_helpers import as_a_foreground_job, live_processes_with

pytestmark = [requires_local, pytest.mark.slow]

PROCESSES = 2
#: Rollouts a process scores a step (per_device_train_batch_size; one generation batch a step).
PER_RANK = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(folder: Path) -> Path:
    from demo_policy import build_demo_policy
    from trl_harbor import HarborSpec

    spec = HarborSpec(BUNDLED_SUITE, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)
    policy.model.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    return folder


def _launch(out: Path, max_steps: int, state: Path, model: Path) -> subprocess.Popen:
    # ``--multi_gpu`` is accelerate's torchrun launcher; without a GPU the processes train on the CPU
    # (gloo). ``--cpu --num_processes 2`` would start a single process unless MPI is set up.
    argv = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(PROCESSES),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()), "-m", "trl_harbor.cli", "train", "--output_dir", str(out),
        "--max_steps", str(max_steps), "--num_generations", "4", "--per_device_train_batch_size", str(PER_RANK),
        "--num_tasks", "4", "--model", str(model), "--dataset", str(BUNDLED_SUITE), "--max_completion_length", "128",
        "--max_tool_calling_iterations", "1", "--logging_steps", "1", "--report_to", "none",
    ]  # fmt: skip
    env = {**os.environ, "HARBOR_TELEMETRY": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HARBOR_LOCAL_SANDBOX_STATE_DIR": str(state)}  # fmt: skip
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=as_a_foreground_job
    )


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


class _Run:
    """One launch with a state folder of its own, and the processes it started (its ranks among them)."""

    def __init__(self, tmp_path: Path, max_steps: int) -> None:
        self.state = tmp_path / "state"
        self.out = tmp_path / "run"
        self.child = _launch(self.out, max_steps, self.state, _checkpoint(tmp_path / "checkpoint"))
        self.pids: set[int] = set()

    def watch(self) -> None:
        """Note the launcher's descendants now (their cgroups are named after them)."""
        parents = {}
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                parents[int(name)] = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        family, grew = {self.child.pid}, True
        while grew:
            more = {pid for pid, parent in parents.items() if parent in family} - family
            family |= more
            grew = bool(more)
        self.pids |= family

    def wait(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        try:
            while self.child.poll() is None and time.monotonic() < deadline:
                self.watch()
                time.sleep(0.5)
        finally:
            if self.child.poll() is None:
                self.child.kill()
        return self.child.communicate()[0]

    def running_sandboxes(self) -> list[int]:
        return live_processes_with(str(self.state))

    def leftovers(self, within: float = 30.0) -> list[str]:
        """State folders, cgroups and processes of the run's sandboxes still there (waiting a little)."""
        deadline = time.monotonic() + within
        while True:
            left = [p.name for p in self.state.iterdir()] if self.state.exists() else []
            if "workers" in left and not any((self.state / "workers").iterdir()):
                left.remove("workers")  # the (empty) folder of root's view workers' sockets: no sandbox's
            left += [
                str(p) for pid in self.pids for p in Path("/sys/fs/cgroup").glob(f"**/harbor-local-sandbox/{pid}-*")
            ]  # fmt: skip
            left += [f"process {pid}" for pid in self.running_sandboxes()]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)


def test_two_processes_log_every_rollout_once_and_leave_nothing(tmp_path: Path) -> None:
    run = _Run(tmp_path, max_steps=3)
    output = run.wait(timeout=1200)
    assert run.child.returncode == 0, output[-4000:]
    # One console: the main process prints each line once (every rank ran the command).
    assert output.count("trl-harbor train: ") == 1, output[-4000:]
    assert output.count("done: 3 steps") == 1, output[-4000:]
    out = run.out
    lines = _lines(out / "trajectories.jsonl")
    assert {line["rank"] for line in lines} == set(range(PROCESSES)), output[-2000:]
    keys = Counter((line["rank"], line["batch"], line["rollout"]) for line in lines)
    assert max(keys.values()) == 1, "a rollout is logged twice"
    per_rank_step = Counter((line["rank"], line["step"]) for line in lines)
    assert set(per_rank_step.values()) == {PER_RANK}, per_rank_step  # none dropped, none doubled
    assert {step for _, step in per_rank_step} == {1, 2, 3}
    assert all(line["global_step"] == line["step"] - 1 for line in lines)
    assert all(line["reward"] is not None and line["infra_error"] is None for line in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollouts"] == len(lines) == PROCESSES * PER_RANK * 3
    history = json.loads((out / "log_history.json").read_text())
    steps = [record for record in history if "reward" in record]
    assert len(steps) == 3
    # TRL's reward is the mean over every rank's rollouts of the step: the log's mean, step by step.
    for record in steps:
        rewards = [line["reward"] for line in lines if line["step"] == record["step"]]
        assert record["reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert "harbor/infra_failures" in record
    assert len(run.pids) > PROCESSES  # the launcher's workers were seen
    assert not run.leftovers()


def test_sigint_to_the_launcher_mid_step_leaves_no_sandbox(tmp_path: Path) -> None:
    run = _Run(tmp_path, max_steps=50)
    log = run.out / "trajectories.jsonl"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and run.child.poll() is None:
            run.watch()
            if {line["rank"] for line in _lines(log)} == set(range(PROCESSES)) and run.running_sandboxes():
                break
            time.sleep(0.2)
        assert run.child.poll() is None, run.child.stdout.read()[-4000:]
        run.child.send_signal(signal.SIGINT)  # the launcher only, as a scheduler's kill would
    finally:
        output = run.wait(timeout=180)
    assert run.child.returncode != 0
    assert not run.leftovers(), output[-3000:]
