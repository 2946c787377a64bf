"""The bundled suite on the local sandbox through trl-harbor's `check`: Harbor's oracle and verifier.

(`harbor run` with the plug-in alone, in a venv without trl-harbor, is the package's own test:
packages/harbor-local-sandbox/tests/test_harbor_run_alone.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox_helpers import BUNDLED_SUITE, make_task
from trl_harbor.cli import main as cli_main
from trl_harbor.cli.check import check_suite
from trl_harbor.rollout.suite import load_suite

BUNDLED_TASKS = [t.path for t in load_suite(BUNDLED_SUITE).tasks]


def test_bundled_suite_is_large_and_varied_enough() -> None:
    suite = load_suite(BUNDLED_SUITE)
    assert len(suite.tasks) >= 12
    levels = {t.metadata["difficulty_level"] for t in suite.tasks}
    modes = {t.metadata["reward_mode_initial"] for t in suite.tasks}
    assert levels == {1, 2, 3, 4, 5} and modes == {"exact_short", "numeric"}
    dockerfiles = [(t.path / "environment" / "Dockerfile").read_text() for t in suite.tasks]
    # A base this project's CI can obtain without a registry (mmdebstrap), and Docker as usual.
    assert all(text.startswith("FROM debian:bookworm-slim\n") for text in dockerfiles)
    assert any("python3-dateutil" in text for text in dockerfiles)  # a task with a package of its own
    assert any("reward.json" in (t.path / "tests" / "grade.py").read_text() for t in suite.tasks)


@pytest.mark.local
def test_every_bundled_task_scores_one_with_oracle_and_zero_with_nothing() -> None:
    """Harbor's own OracleAgent and Verifier, in real local sandboxes."""
    results = check_suite(BUNDLED_TASKS, "local", concurrency=8)
    table = {r.task: (r.oracle.reward, r.nop.reward, r.oracle.error or r.nop.error) for r in results}
    assert all(r.passed for r in results), table
    assert {r.oracle.reward for r in results} == {1.0} and {r.nop.reward for r in results} == {0.0}


@pytest.mark.local
def test_check_reports_a_task_whose_grader_accepts_doing_nothing(tmp_path: Path, capsys) -> None:
    good = make_task(tmp_path / "suite", name="good")
    lenient = make_task(tmp_path / "suite", name="lenient")
    (lenient / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
    )
    broken = make_task(tmp_path / "suite", name="broken_oracle")
    (broken / "solution" / "solve.sh").write_text("#!/bin/bash\necho wrong > /workdir/answer.txt\n")
    status = cli_main(["check", str(tmp_path / "suite"), "-e", "local"])
    out = capsys.readouterr().out
    assert status == 1
    assert "1 passed, 2 failed" in out
    for name in ("good", "lenient", "broken_oracle"):
        assert name in out
    assert good.exists()
