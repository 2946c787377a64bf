"""Task images without root (issue #20): a real unprivileged user, with the subordinate ids distributions give.

Each test runs as ``nobody`` (no root, no sudo, no cgroups) in a private mount namespace where
``/etc/subuid`` and ``/etc/subgid`` give it 65536 ids (``sandbox_helpers.run_unprivileged``), as
``useradd`` does on current distributions. The base image comes from the tests' Debian archive,
loaded into the user's own cache as ``debian:bookworm-slim`` (the bundled suite's ``FROM``); every
``RUN`` step runs for real (``apt-get install`` over the network).

The same tests as for root run (the two that read a tree do it where it is mounted):
``test_local_image_root.py`` (``COPY`` into ``/etc`` and ``/usr/local/bin``, users and ``useradd``,
``ENTRYPOINT``, pip and uv behind this machine's TLS interception, apt at build and verify time,
Harbor's oracle and verifier as the task's users, the fingerprints, a killed owner's sandbox swept),
the package's ``test_local_isolation.py`` (no network unless allowed, the task's tests and solution out of reach,
planted links), a multi-stage build, each box's own mount table and process limit
(the package's ``test_local_sandbox.py``: RLIMIT_NPROC, counted per user namespace, where root has cgroups); and
the bundled suite passes ``trl-harbor check``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from registry import base_image_archive

from sandbox_helpers import REPO, run_unprivileged, unprivileged_test

pytestmark = [unprivileged_test, pytest.mark.local]

#: Loads the base archive (``argv[3]`` of the script: copied where the user can read it) into the
#: user's default image cache, then runs the command after ``#`` as the rest of the script.
_PRELUDE = """
import asyncio, os, shutil, subprocess, sys
from pathlib import Path
work = Path(sys.argv[1])
archive = work / "base.oci.tar"
shutil.copy(os.environ["TEST_BASE_ARCHIVE"], archive)
os.environ["TRL_HARBOR_TEST_CACHE"] = str(work / "test-images")
(work / "test-images").mkdir()
shutil.copy(archive, work / "test-images" / Path(os.environ["TEST_BASE_ARCHIVE"]).name)
from harbor_local_sandbox.oci import ImageStore
asyncio.run(ImageStore().load_archive(archive, "debian:bookworm-slim"))
"""


def _as_nobody(script: str, timeout: float, subids: bool = True) -> str:
    """Run ``_PRELUDE`` + ``script`` as ``nobody`` (with subordinate ids); its stdout (fails the test on an error)."""
    archive = base_image_archive()
    readable = Path(shutil.copy(archive, Path("/tmp") / f"trl-harbor-rootless-{archive.name}"))
    readable.chmod(0o644)
    try:
        done = run_unprivileged(
            _PRELUDE + script, subids=subids, timeout=timeout, state_mb=512,
            env={"TEST_BASE_ARCHIVE": str(readable), "PYTHONDONTWRITEBYTECODE": "1"},
        )  # fmt: skip
    finally:
        readable.unlink()
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    return done.stdout


def test_the_root_tests_of_task_images_and_isolation_pass_without_root() -> None:
    """The image root's, the isolation and the verifier view's tests, run by pytest as the unprivileged user."""
    out = _as_nobody(
        "import pytest\n"
        "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-q', '-o', 'addopts=', "
        "'tests/test_local_image_root.py', 'packages/harbor-local-sandbox/tests/test_local_isolation.py', "
        "'tests/test_verifier_view.py', "
        "'tests/test_local_oci.py::test_multi_stage_build_exports_root_and_config', "
        "'packages/harbor-local-sandbox/tests/test_local_sandbox.py::"
        "test_a_box_starts_in_a_mount_table_without_the_other_boxes_trees', "
        "'packages/harbor-local-sandbox/tests/test_local_sandbox.py::test_a_sandbox_has_its_own_process_limit', "
        "'-k', 'not root_workers']))\n",
        timeout=2400,
    )
    summary = out.strip().splitlines()[-1]
    print(f"as nobody: {summary}")
    assert " passed" in summary and "failed" not in summary and "error" not in summary, out[-4000:]
    assert "skipped" not in summary, out[-4000:]  # every one ran


def test_the_bundled_suite_passes_check_on_task_images_without_root() -> None:
    """``trl-harbor check`` on the bundled suite, default root (each task on its own image): all pass."""
    out = _as_nobody(
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


_ONE_ID = """
import json
sys.path.insert(0, sys.argv[2])
from sandbox_helpers import make_task, open_env, run
from harbor_local_sandbox.errors import ImageBuildError

found = {}
async def main():
    env = open_env(make_task(work, "plain", dockerfile="FROM debian:bookworm-slim\\nWORKDIR /workdir\\n"), work / "t")
    await env.start(force_build=False)
    try:
        for name, command in {"id": "id -u", "map": "cat /proc/self/uid_map", "chown": "touch /tmp/f && chown 5 /tmp/f"}.items():
            result = await env.exec(command)
            found[name] = [result.return_code, (result.stdout or "").split(), (result.stderr or "").strip()]
    finally:
        await env.stop(delete=True)
    env = open_env(make_task(work, "with_run", dockerfile="FROM debian:bookworm-slim\\nRUN true\\n"), work / "t")
    try:
        await env.start(force_build=False)
        found["run_step"] = "built"
        await env.stop(delete=True)
    except ImageBuildError as error:
        found["run_step"] = str(error)
run(main())
print(json.dumps(found))
"""


def test_without_subordinate_ids_one_id_with_its_limits_said() -> None:
    """No ``/etc/subuid`` range: sandboxes on images without ``RUN`` steps run with one id (root); a ``RUN``
    step fails to build with an error that says why and how to get subordinate ids."""
    found = json.loads(_as_nobody(_ONE_ID, timeout=600, subids=False).strip().splitlines()[-1])
    assert found["id"][:2] == [0, ["0"]], found
    assert found["map"][1] == ["0", "0", "1"], found  # one id: the user's own, as root
    assert found["chown"][0] != 0, found  # no other owner exists
    message = found["run_step"]
    assert "RUN steps cannot be built" in message and "usermod --add-subuids" in message, message
