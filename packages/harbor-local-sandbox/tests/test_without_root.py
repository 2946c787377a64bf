"""Task images without root: a real unprivileged user, with the subordinate ids distributions give.

Each test runs as ``nobody`` (no root, no sudo, no cgroups) in a private mount namespace where
``/etc/subuid`` and ``/etc/subgid`` give it 65536 ids (``sandbox_testing.run_unprivileged``), as
``useradd`` does on current distributions. The base image comes from the tests' Debian archive
(``registry_testing.py``), loaded into the user's own cache as ``debian:bookworm-slim``; every ``RUN`` step
runs for real (``apt-get install`` over the network).

The same tests as for root run (the two that read a tree do it where it is mounted):
``test_local_image_root.py`` (``COPY`` into ``/etc`` and ``/usr/local/bin``, users and ``useradd``,
``ENTRYPOINT``, pip and uv behind this machine's TLS interception, apt at build and verify time, the
fingerprints, a killed owner's sandbox swept), ``test_local_isolation.py`` (no network unless allowed, the
task's tests and solution out of reach, planted links), ``test_verifier_view.py`` (the verifier's view, made
by the user's holder), a multi-stage build, each box's own mount table and process limit
(``test_local_sandbox.py``: RLIMIT_NPROC, counted per user namespace, where root has cgroups).
"""

from __future__ import annotations

import json

import pytest
from sandbox_testing import as_nobody, pytest_as_nobody, unprivileged_test

pytestmark = [unprivileged_test, pytest.mark.local]


def test_the_root_tests_of_task_images_and_isolation_pass_without_root() -> None:
    """The image root's, the isolation's and the verifier view's tests, run by pytest as the unprivileged user."""
    pytest_as_nobody(
        "tests/test_local_image_root.py", "tests/test_local_isolation.py", "tests/test_verifier_view.py",
        "tests/test_local_oci.py::test_multi_stage_build_exports_root_and_config",
        "tests/test_local_sandbox.py::test_a_box_starts_in_a_mount_table_without_the_other_boxes_trees",
        "tests/test_local_sandbox.py::test_a_sandbox_has_its_own_process_limit",
        "-k", "not root_workers",
    )  # fmt: skip


_ONE_ID = """
import json
sys.path.insert(0, sys.argv[2])
from sandbox_testing import make_task, open_env, run
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
    found = json.loads(as_nobody(_ONE_ID, timeout=600, subids=False).strip().splitlines()[-1])
    assert found["id"][:2] == [0, ["0"]], found
    assert found["map"][1] == ["0", "0", "1"], found  # one id: the user's own, as root
    assert found["chown"][0] != 0, found  # no other owner exists
    message = found["run_step"]
    assert "RUN steps cannot be built" in message and "usermod --add-subuids" in message, message
