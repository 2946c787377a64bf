"""Chaos: a real CPU GRPO run (``trl-harbor train``, a tiny test checkpoint, real sandboxes) while things break.

The checkpoint is the hand-wired policy of ``tests/demo_policy.py``: per task it calls ``bash`` with
the task's reference solution or a wrong command, so the memory-filling solution below does run.

During the run, sandboxes of one task are killed from outside, one task's verifier hangs, and one
task's rollouts fill their sandbox's memory; then the training process gets SIGINT, SIGTERM or
SIGKILL. Afterwards every rollout of every finished step is in the trajectory log with a reward
or a reason, and nothing of the run is left: no sandbox process, no ``slirp4netns``, no
sandbox tree or cgroup (after a SIGKILL, once the next run's sweep has run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, requires_local
from harbor_local_sandbox._lifetime import state_root, sweep_stale

from demo_policy import build_demo_policy
from sandbox_helpers import as_a_foreground_job, live_processes_with

BATCH = 8  # rollouts per step (4 tasks x 2 generations)


def _suite(root: Path) -> Path:
    suite = root / "suite"
    for name in ("orders_count", "http_500_count", "priciest_product", "late_invoices"):
        shutil.copytree(BUNDLED_SUITE / name, suite / name)
    hanging = suite / "http_500_count"
    (hanging / "tests" / "test.sh").write_text("#!/bin/bash\nsleep 600\n")
    toml = hanging / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\ntimeout_sec = 60.0", "[verifier]\ntimeout_sec = 2.0", 1))
    networked = suite / "orders_count"  # its sandboxes have a user-mode network (slirp4netns)
    toml = networked / "task.toml"
    toml.write_text(toml.read_text().replace('network_mode = "no-network"', 'network_mode = "public"'))
    filler = suite / "late_invoices"
    toml = filler / "task.toml"
    toml.write_text(toml.read_text().replace("memory_mb = 1024", "memory_mb = 96"))
    solve = filler / "solution" / "solve.sh"
    solve.write_text("#!/bin/bash\nfor i in $(seq 1 40); do head -c 8M /dev/zero > /root/fill$i; done\n")
    return suite


def _checkpoint(suite: Path, root: Path) -> Path:
    from trl_harbor import HarborSpec

    spec = HarborSpec(suite, environment_type="local")
    texts = [Path(d, "instruction.md").read_text() for d in spec.task_dirs]
    policy = build_demo_policy(spec.tasks, texts, spec.env_cls.PROMPT_SUFFIX)
    checkpoint = root / "checkpoint"
    policy.model.save_pretrained(checkpoint)
    policy.tokenizer.save_pretrained(checkpoint)
    return checkpoint


def _describe(pid: int) -> str:
    """A process's state, parent and command line (what a leftover is, in a failure's message)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return f"state {state[0]}, parent {state[1]}: {cmdline[:300]}"


def _processes_of(pid: int) -> list[int]:
    """Live host processes that belong to the sandboxes of the run ``pid`` (bwrap, supervisors, commands)."""
    return live_processes_with(f"{state_root()}/{pid}-")


def _leftovers(pid: int) -> list[str]:
    found = [p.name for p in state_root().iterdir() if p.name.startswith(f"{pid}-")]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/harbor-local-sandbox/{pid}-*")]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"harbor-local-sandbox/{pid}-*")]
    return found


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


@requires_local
@pytest.mark.slow
@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"]
)
def test_a_training_run_survives_chaos_and_leaves_nothing(tmp_path: Path, signum: int) -> None:
    suite = _suite(tmp_path)
    out = tmp_path / "run"
    log = out / "trajectories.jsonl"
    argv = [sys.executable, "-m", "trl_harbor.cli", "train", "--model", str(_checkpoint(suite, tmp_path)),
            "--dataset", str(suite), "--output_dir", str(out), "--max_steps", "50", "--num_generations", "2",
            "--per_device_train_batch_size", str(BATCH), "--max_completion_length", "128",
            "--max_tool_calling_iterations", "1", "--optim", "sgd", "--learning_rate", "0.01",
            "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no"]  # fmt: skip
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "HARBOR_TELEMETRY": "0"}, preexec_fn=as_a_foreground_job)  # fmt: skip
    killed_from_outside = 0
    networks: set[int] = set()  # the run's slirp4netns processes, seen at any poll (sandboxes come and go)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and child.poll() is None:
            networks |= {int(p) for p in os.listdir("/proc") if p.isdigit() and _is_slirp_of(int(p), child.pid)}
            steps = {line["step"] for line in _lines(log)}
            # Kill the sandboxes of one task from outside, as a node losing them would.
            for pid in _processes_of(child.pid):
                try:
                    if b"priciest_product" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
                        killed_from_outside += 1
                except (OSError, ProcessLookupError):
                    pass
            if len(steps) >= 3:
                break
            time.sleep(0.2)
        assert child.poll() is None, child.stdout.read()[-3000:]
        networks |= {int(p) for p in os.listdir("/proc") if p.isdigit() and _is_slirp_of(int(p), child.pid)}
        child.send_signal(signum)
        output, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode != 0
    if signum == signal.SIGKILL:
        sweep_stale()  # what the next run does first; the killed run's sandboxes died with it

    def slirps() -> list[int]:
        return [pid for pid in networks if _comm(pid) == "slirp4netns"]

    deadline = time.monotonic() + 15
    while (_processes_of(child.pid) or _leftovers(child.pid) or slirps()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: _describe(pid) for pid in _processes_of(child.pid)}
    assert left == {}, output[-2000:]
    assert _leftovers(child.pid) == []
    assert networks, "the run had network-enabled sandboxes"
    assert slirps() == []  # each exits with its owner (it holds a pipe only the owner keeps open)

    lines = _lines(log)
    per_step = Counter(line["step"] for line in lines)
    assert len(per_step) >= 3 and all(count == BATCH for count in per_step.values()), per_step
    for line in lines:  # every rollout is accounted for: a reward, or a reason it has none
        assert line["reward"] is not None or line["infra_error"], line
    hung = [line for line in lines if str(line["task_dir"]).endswith("http_500_count")]
    assert hung and all(line["reward"] == 0.0 for line in hung)
    assert any("timeout" in (line.get("verification") or {}).get("reason", "") for line in hung)
    filled = [line for line in lines if str(line["task_dir"]).endswith("late_invoices")]
    assert filled and all(line["reward"] == 0.0 for line in filled)  # filling its sandbox never pays
    assert killed_from_outside > 0


def _comm(pid: int) -> str:
    """The command name of a live process ("" when it is gone, or a zombie its new parent has not reaped)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return ""
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _is_slirp_of(pid: int, owner: int) -> bool:
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() != "slirp4netns":
            return False
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == owner
    except (OSError, ValueError):
        return False
