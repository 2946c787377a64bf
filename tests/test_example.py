"""examples/train_grpo.py runs end to end, also data-parallel under ``accelerate launch``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import BUNDLED_SUITE, REPO, requires_local
from harbor_local_sandbox._lifetime import state_root

from demo_policy import build_demo_policy
from trl_harbor.rollout.episode import _alive


@requires_local
def test_example_trains_under_accelerate_with_two_processes(tmp_path: Path) -> None:
    """Each process has its own environments and sandboxes; both finish and leave nothing.

    The model is the tiny hand-wired checkpoint of ``tests/demo_policy.py`` (the example's default,
    the 135M starter model, is what ``trl-harbor train``'s own test runs).
    """
    from trl_harbor import HarborSpec

    spec = HarborSpec(BUNDLED_SUITE, environment_type="local")
    policy = build_demo_policy(spec.tasks, [Path(d, "instruction.md").read_text() for d in spec.task_dirs],
                               spec.env_cls.PROMPT_SUFFIX)  # fmt: skip
    policy.model.save_pretrained(tmp_path / "checkpoint")
    policy.tokenizer.save_pretrained(tmp_path / "checkpoint")
    accelerate = Path(sys.executable).parent / "accelerate"
    before = set(os.listdir(state_root()))
    completed = subprocess.run(
        [str(accelerate), "launch", "--num_processes", "2", "--cpu",
         str(REPO / "examples" / "train_grpo.py"), "--model", str(tmp_path / "checkpoint"), "--suite",
         str(BUNDLED_SUITE), "--agent", "bash", "--no-prompt", "--max-steps", "1", "--num-generations", "4",
         "--max-completion-length", "128", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "HARBOR_TELEMETRY": "0", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "step 1: reward=" in completed.stdout + completed.stderr
    assert "tool calls/rollout=" in completed.stdout + completed.stderr
    # Every sandbox of the run was removed: what is new belongs to a live process (another test
    # running beside this one), never to one that has exited.
    new = [name for name in set(os.listdir(state_root())) - before if name.split("-", 1)[0].isdigit()]  # not workers/
    left = [name for name in new if not _alive(int(name.split("-", 1)[0]))]
    assert left == []
