"""The one-task suite both benchmarks run: write 42 to /workdir/answer.txt, graded by a shell test."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _base_dockerfile() -> str:
    # The bundled suite's first steps (Debian and python3): cached once for the suite, built
    # offline where only a Debian mirror is reachable.
    text = (REPO / "examples" / "tasks" / "orders_count" / "environment" / "Dockerfile").read_text()
    return text[: text.index("\nENV ")] + "\n"


TEST_SH = (
    "#!/bin/bash\nmkdir -p /logs/verifier\n"
    '[ "$(cat /workdir/answer.txt 2>/dev/null)" = 42 ] && echo 1 > /logs/verifier/reward.txt '
    "|| echo 0 > /logs/verifier/reward.txt\n"
)


def write_bench_task(suite: Path, *, network_mode: str = "no-network", memory_mb: int = 1024) -> Path:
    """Write the benchmark task into ``suite/bench`` and return its folder.

    Args:
        suite: The folder to hold the task.
        network_mode: The task's ``[environment] network_mode``.
        memory_mb: The task's memory limit.

    Returns:
        The task folder.
    """
    task = suite / "bench"
    for sub in ("environment", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(_base_dockerfile() + "WORKDIR /workdir\n")
    (task / "instruction.md").write_text("Write 42 to /workdir/answer.txt\n")
    (task / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ngold_answer = "42"\n[verifier]\ntimeout_sec = 120\n'
        f'[environment]\nnetwork_mode = "{network_mode}"\nmemory_mb = {memory_mb}\n'
    )
    test = task / "tests" / "test.sh"
    test.write_text(TEST_SH)
    test.chmod(0o755)
    return task
