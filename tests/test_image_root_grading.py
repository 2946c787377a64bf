"""What trl-harbor adds on task images (a task's own Dockerfile, ``FROM`` a Debian image served by a registry on
loopback, ``tests/registry.py``): its ``check`` with Harbor's oracle and verifier as the task's users, and the
grading path of backends without an isolated view (``Baseline``). The local sandbox's own tests of task images
are the package's: ``packages/harbor-local-sandbox/tests/test_local_image_root.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from registry import loopback_registry  # noqa: F401 - the session fixture
from sandbox_testing import cache_dir  # noqa: F401 - the fixture
from sandbox_testing import dockerfile_task as _task

from sandbox_helpers import count_processes_cmd, open_env, run

pytestmark = pytest.mark.local


def test_harbor_oracle_and_verifier_with_task_users(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """Harbor's own OracleAgent and Verifier on an image root, with [agent]/[verifier] user= set."""
    from trl_harbor import HarborOptions
    from trl_harbor.cli.check import check_suite

    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        RUN useradd -m agent && mkdir /workdir && chown agent /workdir
        WORKDIR /workdir
        USER agent
        """,
    )
    toml = (task / "task.toml").read_text()
    toml = toml.replace("[agent]\n", '[agent]\nuser = "agent"\n').replace("[verifier]\n", '[verifier]\nuser = "root"\n')
    (task / "task.toml").write_text(toml)
    (task / "solution" / "solve.sh").write_text(
        '#!/bin/bash\n[ "$(id -un)" = agent ] && echo 42 > /workdir/answer.txt\n'
    )
    options = HarborOptions(backend_options={"cache_dir": cache_dir})
    (result,) = check_suite([task], "local", concurrency=1, options=options)
    assert result.passed, (result.oracle, result.nop)
    assert (result.oracle.reward, result.nop.reward) == (1.0, 0.0)


def test_baseline_on_an_image_root_keeps_entrypoint_services_and_finds_tampering(
    loopback_registry,  # noqa: F811
    cache_dir,  # noqa: F811
    tmp_path,
):
    """The grading path of backends without an isolated view, on an image root: with
    ``agent_processes="kill"`` the agent's processes die, the ENTRYPOINT's service stays, and a
    changed program on the verifier's PATH (in the image's /usr) is found."""
    from trl_harbor.rollout.seal import Baseline

    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        COPY entrypoint.sh /usr/local/bin/entrypoint.sh
        RUN chmod +x /usr/local/bin/entrypoint.sh
        ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
        WORKDIR /workdir
        """,
        {"entrypoint.sh": '#!/bin/sh\nsleep 7777 &\nexec "$@"\n'},
    )

    async def scenario():
        env = open_env(task, tmp_path, cache_dir=cache_dir, verifier_isolation=False)
        await env.start(force_build=False)
        try:
            for _ in range(100):
                if (await env.exec(count_processes_cmd("sleep 7777"))).stdout.strip() != "0":
                    break
                await asyncio.sleep(0.05)
            seal = Baseline()
            await seal.take_processes(env)
            await seal.take_files(env, "root")
            await env.exec(
                "nohup sleep 8888 >/dev/null 2>&1 & echo 'exit 0' > /usr/bin/test-helper; chmod +x /usr/bin/test-helper; echo '#' >> /usr/bin/env"
            )
            report = await seal.apply(env, kill=True)
            service = await env.exec(count_processes_cmd("sleep 7777"))
            agent = await env.exec(count_processes_cmd("sleep 8888"))
            return report, [service.stdout.strip(), agent.stdout.strip()]
        finally:
            await env.stop(delete=True)

    report, alive = run(scenario())
    assert alive == ["1", "0"]
    assert report.killed >= 1
    assert any(change.path == "/usr/bin/env" for change in report.tampered), report.tampered
