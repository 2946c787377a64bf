"""`trl-harbor check` tells a reference solution the isolated view fails from a wrong one.

On the local sandbox the verifier runs in a view of the agent's sandbox where the image's code is
the image's (docs/rewards.md). A task whose oracle edits a module the image ships is right under
Harbor's in-place grading and scores 0 in the view: the check grades that rollout once more in
place and reports it as "passes in place, fails in the isolated view", with the failing test.
Real sandboxes on the bundled suite's base image (no network).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import requires_local

from sandbox_helpers import BASE_DOCKERFILE, make_task
from trl_harbor.cli import main as cli_main
from trl_harbor.cli.check import FAILURES_CHARS, check_suite, failures
from trl_harbor.rollout import grading

#: What the oracle of a view-only task does: answer, and mark a module the image ships (Python's own
#: colorsys) as solved. In place the verifier imports the marked module; in the view, the image's.
MARK_SHIPPED_MODULE = textwrap.dedent(
    """\
    #!/bin/bash
    set -e
    echo 42 > /workdir/answer.txt
    printf '\\nSOLVED_BY_THE_ORACLE = True\\n' >> "$(python3 -c 'import colorsys; print(colorsys.__file__)')"
    """
)

#: A unittest suite (the base image has python3, not pytest), so the verifier's output names its tests.
UNITTEST_SH = textwrap.dedent(
    """\
    #!/bin/bash
    mkdir -p /logs/verifier
    if python3 -m unittest discover -s /tests -p 'test_*.py' -v; then r=1; else r=0; fi
    echo $r > /logs/verifier/reward.txt
    """
)

MARKER_TEST = textwrap.dedent(
    """\
    import colorsys
    import unittest


    class ShippedModule(unittest.TestCase):
        def test_colorsys_carries_the_oracle_marker(self):
            self.assertTrue(getattr(colorsys, "SOLVED_BY_THE_ORACLE", False), "colorsys is the image's")
    """
)

ANSWER_TEST = textwrap.dedent(
    """\
    import unittest
    from pathlib import Path


    class Answer(unittest.TestCase):
        def test_answer_is_42(self):
            self.assertEqual(Path("/workdir/answer.txt").read_text().strip(), "42")
    """
)


def _unittest_task(root: Path, name: str, solve: str, tests: dict[str, str]) -> Path:
    task = make_task(root, name=name)
    (task / "tests" / "test.sh").write_text(UNITTEST_SH)
    for file, text in tests.items():
        (task / "tests" / file).write_text(text)
    (task / "solution" / "solve.sh").write_text(solve)
    return task


def _view_only_task(root: Path, name: str = "view_only") -> Path:
    return _unittest_task(root, name, MARK_SHIPPED_MODULE, {"test_marker.py": MARKER_TEST})


def _wrong_task(root: Path, name: str = "wrong_oracle") -> Path:
    return _unittest_task(root, name, "#!/bin/bash\necho 41 > /workdir/answer.txt\n", {"test_answer.py": ANSWER_TEST})


def _good_task(root: Path, name: str = "good") -> Path:
    return _unittest_task(root, name, "#!/bin/bash\necho 42 > /workdir/answer.txt\n", {"test_answer.py": ANSWER_TEST})


def _two_steps_view_only_task(root: Path, name: str = "steps_view_only") -> Path:
    """Two steps, rewards averaged: step `one` wants an answer, step `two` the marked module."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(BASE_DOCKERFILE + "WORKDIR /workdir\n")
    (task / "task.toml").write_text(
        'version = "1.0"\nmulti_step_reward_strategy = "mean"\n[verifier]\ntimeout_sec = 60\n'
        '[environment]\nnetwork_mode = "no-network"\n\n[[steps]]\nname = "one"\n\n[[steps]]\nname = "two"\n'
    )
    for step, solve, tests in (
        ("one", "#!/bin/bash\necho 42 > /workdir/answer.txt\n", {"test_answer.py": ANSWER_TEST}),
        ("two", MARK_SHIPPED_MODULE, {"test_marker.py": MARKER_TEST}),
    ):
        folder = task / "steps" / step
        (folder / "tests").mkdir(parents=True)
        (folder / "solution").mkdir()
        (folder / "instruction.md").write_text(f"Step {step}.\n")
        (folder / "tests" / "test.sh").write_text(UNITTEST_SH)
        for file, text in tests.items():
            (folder / "tests" / file).write_text(text)
        (folder / "solution" / "solve.sh").write_text(solve)
    return task


@pytest.fixture
def in_place_gradings(monkeypatch) -> list[str]:
    """The tasks whose rollouts were graded once more in place (the real grading, counted)."""
    graded: list[str] = []
    real = grading.grade_in_place

    async def counted(environment, context):
        graded.append(context.task.name)
        return await real(environment, context)

    monkeypatch.setattr(grading, "grade_in_place", counted)
    return graded


@requires_local
def test_an_oracle_the_view_fails_passes_in_place_and_a_wrong_one_stays_wrong(tmp_path: Path, in_place_gradings):
    suite = tmp_path / "suite"
    view_only, wrong, good = _view_only_task(suite), _wrong_task(suite), _good_task(suite)
    steps = _two_steps_view_only_task(suite)

    results = {r.task_dir.name: r for r in check_suite([view_only, wrong, good, steps], "local", concurrency=4)}

    # Right under Harbor's grading, 0 in the view: the view, not the solution, fails it; and the check fails.
    seen = results["view_only"]
    assert (seen.oracle.reward, seen.nop.reward) == (0.0, 0.0), seen.why
    assert seen.oracle.in_place is not None and seen.oracle.in_place.reward == 1.0, seen.oracle.in_place
    assert seen.fails_only_in_view and not seen.passed
    assert seen.why.startswith("oracle passes in place, fails in the isolated view (scored 0 there"), seen.why
    assert "its solution is wrong" not in seen.why
    # What differed: the failing test by name, and the module the view showed as the image shipped it.
    assert "FAIL: test_colorsys_carries_the_oracle_marker" in seen.oracle.failures, seen.oracle.failures
    assert "test_colorsys_carries_the_oracle_marker" in seen.why
    (hidden,) = seen.oracle.concealed  # not the /solution the oracle agent uploaded: Harbor's, not the rollout's
    assert hidden.endswith("/colorsys.py (the image's code)") and hidden in seen.why, seen.oracle.concealed
    assert "allowed_changes" in seen.why
    row = json.loads(json.dumps(seen.to_dict()))
    assert row["fails_only_in_view"] and not row["passed"] and row["oracle"]["in_place"]["reward"] == 1.0

    # A wrong solution is graded in place too, fails there too, and is reported as wrong, with its test.
    bad = results["wrong_oracle"]
    assert bad.oracle.reward == 0.0 and bad.oracle.in_place is not None and bad.oracle.in_place.reward == 0.0
    assert not bad.fails_only_in_view and not bad.passed
    assert bad.why.startswith("oracle scored 0: its solution is wrong (in place too: 0)"), bad.why
    assert "passes in place" not in bad.why
    assert "FAIL: test_answer_is_42" in bad.oracle.failures and "test_answer_is_42" in bad.why

    # A task whose oracle passes in the view is not graded again, nor is any do-nothing episode.
    ok = results["good"]
    assert ok.passed and ok.oracle.in_place is None and not ok.fails_only_in_view, ok.why
    assert ok.oracle.failures == "" and ok.why == ""

    # Two steps: the view-failed last step graded again in place, the steps combined anew (0.5 → 1).
    multi = results["steps_view_only"]
    assert multi.oracle.reward == 0.5 and multi.oracle.in_place is not None, multi.why
    assert multi.oracle.in_place.reward == 1.0 and multi.fails_only_in_view, multi.oracle.in_place
    assert "test_colorsys_carries_the_oracle_marker" in multi.oracle.failures

    assert sorted(in_place_gradings) == sorted(["view_only", "wrong_oracle", "steps_view_only"])


@requires_local
def test_check_command_shows_the_third_state_and_fails(tmp_path: Path, capsys, monkeypatch) -> None:
    suite = tmp_path / "suite"
    _view_only_task(suite)
    _good_task(suite)
    monkeypatch.setenv("COLUMNS", "1000")  # each reason on one line of the table
    assert cli_main(["check", str(suite), "-e", "local"]) == 1
    out = capsys.readouterr().out
    assert "FAIL (view)" in out and "oracle passes in place, fails in the isolated view (scored 0 there" in out
    assert "declare them in task.toml [metadata] allowed_changes" in out  # shown as written, not as rich markup
    assert "1 passed, 1 failed (1 of them pass in place, fail in the isolated view)" in out

    assert cli_main(["check", str(suite), "-e", "local", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    rows = {row["task"]: row for row in report["tasks"]}
    assert (report["passed"], report["failed"]) == (1, 1)
    assert rows["view_only"]["fails_only_in_view"] and "passes in place" in rows["view_only"]["why"]
    assert rows["good"]["passed"] and rows["good"]["oracle"]["in_place"] is None


def test_failures_names_the_failing_tests_briefly(tmp_path: Path) -> None:
    output = tmp_path / "test-stdout.txt"
    pytest_summary = "".join(
        f"FAILED tests/test_outputs.py::test_case_{i} - AssertionError: {'x' * 40}\n" for i in range(50)
    )
    output.write_text(
        "============ test session starts ============\n"
        "tests/test_outputs.py::test_ok PASSED\n"
        "=========== short test summary info ===========\n"
        "\x1b[31mFAILED\x1b[0m tests/test_outputs.py::test_first - assert 1 == 2\n"
        + pytest_summary
        + "ERROR tests/test_outputs.py::test_setup - fixture 'db' not found\n"
        "====== 51 failed, 1 passed, 1 error in 0.12s ======\n"
    )
    found = failures(output)
    assert len(found) <= FAILURES_CHARS
    assert found.startswith("FAILED tests/test_outputs.py::test_first - assert 1 == 2; FAILED tests/")
    assert "PASSED" not in found and "\x1b" not in found
    shown = found.count("FAILED ") + found.count("ERROR ")
    assert shown >= 2 and found.endswith(f"; and {52 - shown} more"), found  # 52 failing: a few shown, the rest counted

    output.write_text("FAIL: test_answer (test_answer.Answer.test_answer)\n" + "-" * 70 + "\nFAILED (failures=1)\n")
    assert failures(output) == "FAIL: test_answer (test_answer.Answer.test_answer)"

    output.write_text("compiling...\n\nnothing to see\nsegmentation fault " + "y" * 500 + "\n")
    tail = failures(output)  # no test runner's summary: the last lines, their end kept
    assert tail.startswith("…") and tail.endswith("y") and len(tail) == FAILURES_CHARS
    output.write_text("a\nb\n")
    assert failures(output) == "a | b"
    assert failures(tmp_path / "absent.txt") == ""


@requires_local
def test_a_backend_that_grades_in_place_is_not_graded_twice(tmp_path: Path, in_place_gradings) -> None:
    """Without the isolated view (``verifier_isolation=False``, as on Docker) the seal grades in place: the
    oracle's edit of the image's code is tampering there, and there is no second grade to compare."""
    from trl_harbor import HarborOptions

    options = HarborOptions(backend_options={"verifier_isolation": False})
    (result,) = check_suite([_view_only_task(tmp_path / "suite")], "local", concurrency=1, options=options)
    assert result.oracle.reward == 0.0 and "changed what the verifier runs" in result.why, result.why
    assert result.oracle.in_place is None and not result.fails_only_in_view and not result.passed
    assert result.oracle.concealed == []
    assert in_place_gradings == []
