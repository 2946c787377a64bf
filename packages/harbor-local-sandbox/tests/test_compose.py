"""Compose tasks on the local sandbox: ``environment/docker-compose.yaml`` services, each a sandbox of its own.

* what a compose file asks for that the local sandbox does not run is refused, by file, service, field and fix
  (``compose_problems``; ``LocalEnvironment`` refuses it when it is made);
* a server in an image of its own, reached by its service name: the oracle scores 1 and doing nothing 0, the
  grader (in the verifier's view) reaches the server by the same name, and the server's output is kept in the
  trial folder;
* a service with a healthcheck that fills a named volume ``main`` mounts: ``main`` starts once it is healthy;
  oracle 1, nothing 0;
* a service that never becomes healthy fails the start with ``ServiceUnhealthyError``, its name and its last
  output;
* ``stop()`` leaves nothing: no process, mount or folder of the task's sandboxes or volumes.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import compose_tasks
import pytest
from harbor_local_sandbox._compose import compose_problems, duration, load_compose
from harbor_local_sandbox._lifetime import state_root
from harbor_local_sandbox.errors import ComposeUnsupportedError, ServiceUnhealthyError
from harbor_local_sandbox.local import LocalEnvironment
from sandbox_testing import (  # noqa: F401 - task_base_image: the fixture
    PACKAGE_DIR,
    live_processes_with,
    open_env,
    pytest_as_nobody,
    requires_local,
    run,
    task_base_image,
    unprivileged_test,
)


def _compose(tmp_path: Path, text: str, folders: dict[str, str] | None = None) -> Path:
    environment = tmp_path / "environment"
    environment.mkdir(parents=True, exist_ok=True)
    (environment / "docker-compose.yaml").write_text(textwrap.dedent(text))
    for name, dockerfile in (folders or {}).items():
        (environment / name).mkdir()
        (environment / name / "Dockerfile").write_text(dockerfile)
    return environment


# ── what is refused, by name ─────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("field", "service"),
    [
        ("privileged: true", "`privileged`: no sandbox runs privileged"),
        ("network_mode: host", "`network_mode`: a task's services share one network namespace"),
        ("cap_add: [NET_ADMIN]", "`cap_add`"),
        ("devices: ['/dev/kvm:/dev/kvm']", "`devices`: no host device"),
        ("volumes: ['./data:/data']", "a bind mount of a host path"),
        ("volumes: ['/srv:/srv']", "a bind mount of a host path"),
        ("volumes: [{type: bind, source: ., target: /x}]", "only named volumes are mounted"),
        ("env_file: .env", "`env_file`: environment files are not read"),
        ("networks: [back]", "`networks`"),
        ("security_opt: ['seccomp:unconfined']", "`security_opt`"),
        ("frobnicate: 1", "`frobnicate`: not supported by the local sandbox"),
        ("environment: [TOKEN]", "`environment` 'TOKEN' without a value would take the host's"),
    ],
)
def test_unsupported_features_are_refused_by_name(tmp_path: Path, field: str, service: str) -> None:
    environment = _compose(
        tmp_path,
        f"""\
        services:
          db:
            image: debian:bookworm-slim
            {field}
        """,
    )
    problems = compose_problems(environment)
    assert len(problems) == 1, problems
    [problem] = problems
    assert problem.startswith(f"{environment / 'docker-compose.yaml'}: service 'db': "), problem
    assert service in problem and "Fix:" in problem, problem
    assert LocalEnvironment.compose_problems(environment) == problems
    with pytest.raises(ComposeUnsupportedError, match="service 'db'"):
        load_compose(environment)


def test_what_the_shared_loopback_cannot_do_is_refused(tmp_path: Path) -> None:
    environment = _compose(
        tmp_path,
        """\
        services:
          main:
            command: ["sleep", "1"]
          web:
            image: debian:bookworm-slim
            ports: ["8080:80"]
            depends_on:
              db: {condition: service_healthy}
          db:
            image: debian:bookworm-slim
            expose: ["80"]
            command: ["sh", "-c", "echo $HOME"]
        """,
    )
    problems = "\n".join(compose_problems(environment))
    assert "service 'main': `command`: `main` is the agent's sandbox" in problems
    assert "service 'db': port 80 is also 'web''s: services share one loopback" in problems
    assert "'db' with `condition: service_healthy`, and 'db' has no `healthcheck`" in problems
    assert "$HOME in 'echo $HOME': variables are not interpolated here" in problems  # $$HOME would pass


def test_a_supported_file_has_no_problems_and_reads_as_compose_does(tmp_path: Path) -> None:
    environment = _compose(
        tmp_path,
        """\
        services:
          main:
            depends_on: [api]
            environment: {API_URL: "http://api:8000"}
            volumes: [data:/data]
          api:
            build: ./api
            command: python3 -m http.server 8000
            environment: ["A=1", "PRICE=$$5"]
            working_dir: /srv
            user: nobody
            restart: unless-stopped
            depends_on:
              db:
                condition: service_healthy
            volumes: [{type: volume, source: data, target: /srv/data, read_only: true}]
          db:
            image: debian:bookworm-slim
            healthcheck: {test: "true", interval: 1m30s, timeout: 500ms, retries: 2, start_period: 2s}
        volumes:
          data: {}
        """,
        {"api": "FROM debian:bookworm-slim\n"},
    )
    assert compose_problems(environment) == []
    project = load_compose(environment)
    assert project is not None and project.order() == ["db", "api"]
    api = project.services["api"]
    assert api.command == ["python3", "-m", "http.server", "8000"] and api.environment == {"A": "1", "PRICE": "$5"}
    assert api.volumes[0].read_only and api.depends_on["db"].condition == "service_healthy"
    check = project.services["db"].healthcheck
    assert check is not None and (check.interval, check.timeout, check.retries) == (90.0, 0.5, 2)
    assert check.command == "exec /bin/sh -c true"
    assert project.main.environment == {"API_URL": "http://api:8000"} and project.volumes == ("data",)
    assert project.hosts == "127.0.0.1\tmain api db\n"
    assert duration("1h2m3s") == 3723.0 and duration(5) == 5.0


# ── on real sandboxes ────────────────────────────────────────────────────────────────────


def _solve(task: Path) -> str:
    return (task / "solution" / "solve.sh").read_text()


async def _episode(task: Path, trials: Path, *, oracle: bool) -> tuple[float, LocalEnvironment]:
    """Start the task's sandboxes, run its oracle (or nothing), grade it in the verifier's view, stop."""
    env = open_env(task, trials)
    await env.start(force_build=False)
    try:
        if oracle:
            await env.upload_dir(task / "solution", "/solution")
            result = await env.exec("bash /solution/solve.sh", timeout_sec=120)
            assert result.return_code == 0, result
        async with env.verifier_view() as view:
            await view.upload_dir(task / "tests", "/tests")
            result = await view.exec("bash /tests/test.sh && cat /logs/verifier/reward.txt", user="root")
            assert result.return_code == 0, result
            reward = float(result.stdout.strip())
    finally:
        await env.stop(delete=True)
    return reward, env


def _nothing_left(env: LocalEnvironment, box_name: str) -> None:
    state = state_root()
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert not [m for m in mounts if box_name in m], mounts
    assert not [p.name for p in state.iterdir() if box_name in p.name], list(state.iterdir())
    assert not live_processes_with(box_name), live_processes_with(box_name)
    cgroups = [p for p in Path("/sys/fs/cgroup").glob(f"*/harbor-local-sandbox/*{box_name}*")]
    assert not cgroups, cgroups


@requires_local
@pytest.mark.timeout(600)
def test_a_server_of_its_own_is_reached_by_service_name(task_base_image, tmp_path: Path) -> None:  # noqa: F811
    task = compose_tasks.service_by_name(tmp_path / "suite")
    trials = tmp_path / "trials"
    reward, env = run(_episode(task, trials, oracle=True))
    assert reward == 1.0
    [log] = trials.glob("*/services/secret-server.log")
    assert "serving the secret on port 8000" in log.read_text() and "GET / HTTP/1.1" in log.read_text()
    _nothing_left(env, "service_by_name")
    reward, env = run(_episode(task, trials, oracle=False))
    assert reward == 0.0
    _nothing_left(env, "service_by_name")


@requires_local
@pytest.mark.timeout(600)
def test_a_healthy_service_shares_a_named_volume_with_main(task_base_image, tmp_path: Path) -> None:  # noqa: F811
    task = compose_tasks.healthy_volume(tmp_path / "suite")
    trials = tmp_path / "trials"

    async def main_waits_for_healthy() -> None:
        env = open_env(task, trials)
        await env.start(force_build=False)
        try:
            # main started after the producer was healthy: the volume holds its files already
            result = await env.exec("cat /shared/secret; ls /shared; getent hosts producer")
            assert result.stdout.split()[:3] == [compose_tasks.VOLUME_SECRET, "ready", "secret"], result
            assert "127.0.0.1" in result.stdout
            # the agent's writes reach the service through the volume
            await env.exec("echo from-main > /shared/note")
            producer = env._services.running["producer"].root  # noqa: SLF001 - the service's own sandbox
            seen = await producer.run("cat /data/note; hostname", cwd=None, env=None, timeout=10, user=None)
            assert seen["stdout"].split() == ["from-main", "producer"], seen
        finally:
            await env.stop(delete=True)
        _nothing_left(env, "healthy_volume")

    run(main_waits_for_healthy())
    assert run(_episode(task, trials, oracle=True))[0] == 1.0
    reward, env = run(_episode(task, trials, oracle=False))
    assert reward == 0.0
    _nothing_left(env, "healthy_volume")
    assert any("produced" in log.read_text() for log in trials.glob("*/services/producer.log"))


@requires_local
@pytest.mark.timeout(600)
def test_a_service_that_never_becomes_healthy_fails_the_start_by_name(task_base_image, tmp_path: Path) -> None:  # noqa: F811
    task = compose_tasks.never_healthy(tmp_path / "suite")
    env = open_env(task, tmp_path / "trials")

    async def start() -> None:
        await env.start(force_build=False)

    with pytest.raises(ServiceUnhealthyError) as raised:
        run(start())
    error = raised.value
    assert error.service == "broken-db" and error.task_fault
    assert "compose service 'broken-db' never became healthy" in str(error)
    assert "db: cannot open data directory" in error.output and "db: cannot open data directory" in str(error)
    _nothing_left(env, "never_healthy")


@requires_local
@unprivileged_test
def test_compose_tasks_run_without_root() -> None:
    """The three tests above on real sandboxes, as ``nobody`` with subordinate ids (services in the holder's
    user namespace, no cgroups)."""
    pytest_as_nobody(
        "tests/test_compose.py",
        "-k",
        "server_of_its_own or healthy_service or never_becomes",
        timeout=1500,
        cwd=PACKAGE_DIR,
    )
