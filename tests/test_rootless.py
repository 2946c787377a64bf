"""trl-harbor on task images without root (issue #20): a real unprivileged user, with subordinate ids.

Each test runs as ``nobody`` (no root, no sudo, no cgroups) in a private mount namespace where
``/etc/subuid`` and ``/etc/subgid`` give it 65536 ids (``sandbox_helpers.run_unprivileged``, the package's
``sandbox_testing.run_unprivileged``), as ``useradd`` does on current distributions. The base image comes
from the tests' Debian archive, loaded into the user's own cache as ``debian:bookworm-slim`` (the bundled
suite's ``FROM``); every ``RUN`` step runs for real.

What trl-harbor adds passes as for root: Harbor's oracle and verifier as the task's users through
``trl-harbor check``, and the grading path of backends without an isolated view
(``test_image_root_grading.py``); and the bundled suite passes ``trl-harbor check``. The local sandbox's
own tests without root (the image root's, the isolation's, the verifier view's, a multi-stage build, each
box's own mount table and process limit, one id without subordinate ids) are the package's:
``packages/harbor-local-sandbox/tests/test_without_root.py``.
"""

from __future__ import annotations

import json

import pytest

from sandbox_helpers import REPO, as_nobody, pytest_as_nobody, unprivileged_test

pytestmark = [unprivileged_test, pytest.mark.local]


def test_trl_harbors_tests_of_task_images_pass_without_root() -> None:
    """``test_image_root_grading.py``, run by pytest as the unprivileged user."""
    pytest_as_nobody("tests/test_image_root_grading.py")


def test_the_bundled_suite_passes_check_on_task_images_without_root() -> None:
    """``trl-harbor check`` on the bundled suite, default root (each task on its own image): all pass."""
    out = as_nobody(
        f"done = subprocess.run([sys.executable, '-m', 'trl_harbor.cli', 'check', {str(REPO / 'examples' / 'tasks')!r},"
        " '-j', '4', '--json'], capture_output=True, text=True)\n"
        "print(done.stderr[-3000:], file=sys.stderr)\n"
        "print(done.stdout)\n",
        timeout=1800,
    )
    report = json.loads(out[out.index("{") :])
    failed = {task["task"]: task["why"] for task in report["tasks"] if not task["passed"]}
    assert not failed, failed
    assert report["passed"] == len([p for p in (REPO / "examples" / "tasks").iterdir() if p.is_dir()])
