"""Compose tasks (``environment/docker-compose.yaml``) through trl-harbor: spec build, ``check``, ``harbor run``, Docker.

The tasks are the package's (``packages/harbor-local-sandbox/tests/compose_tasks.py``): a server in an image of
its own reached by service name, and a service with a healthcheck filling a named volume ``main`` mounts; and
one whose service never becomes healthy.

* a spec refuses, when it is built, what of a compose file the local sandbox does not run, by file, service,
  field and fix; the supported files build;
* ``trl-harbor check`` on the local sandbox: oracle 1, nothing 0; the never-healthy service is the task's
  problem (its name and last output), not a score;
* ``harbor run -e harbor_local_sandbox.local:LocalEnvironment -a oracle`` runs them: reward 1;
* on Harbor's Docker backend on the test daemon (a public-network copy, ``FROM`` its registry's base), the
  same rewards as on the local sandbox.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import compose_tasks  # the package's tests: on sys.path (conftest imports registry, sandbox_helpers)
import pytest

from trl_harbor import HarborSpec
from trl_harbor.cli.check import check_suite
from trl_harbor.rollout.suite import TaskSuiteError

HARBOR = Path(sys.executable).with_name("harbor")


def _suite(root: Path, **kwargs) -> list[Path]:
    return [compose_tasks.service_by_name(root, **kwargs), compose_tasks.healthy_volume(root, **kwargs)]


def test_a_spec_refuses_what_the_local_sandbox_does_not_run_by_field(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    [task, _] = _suite(suite)
    compose = task / "environment" / "docker-compose.yaml"
    compose.write_text(
        compose.read_text()
        + "    privileged: true\n    network_mode: host\n"
        + '    volumes: ["/var/run/docker.sock:/var/run/docker.sock"]\n'
    )
    with pytest.raises(TaskSuiteError) as raised:
        HarborSpec(suite, environment_type="local")
    message = str(raised.value)
    for field in ("`privileged`: no sandbox runs privileged", "`network_mode`", "a bind mount of a host path"):
        assert f"{compose}: service 'secret-server': " in message and field in message, message
    assert message.count("Fix:") >= 3 and "healthy_volume" not in message, message
    HarborSpec(suite, environment_type="docker")  # Docker runs it as written
    compose.write_text(compose.read_text().split("    privileged")[0])
    spec = HarborSpec(suite, environment_type="local")  # the supported files build
    assert len(spec.train_dataset) == 2


@pytest.mark.local
@pytest.mark.timeout(900)
def test_check_runs_compose_tasks_and_blames_the_task_for_an_unhealthy_service(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    _suite(suite)
    compose_tasks.never_healthy(suite)
    done = subprocess.run(
        [sys.executable, "-m", "trl_harbor.cli", "check", str(suite), "--environment-type", "local", "--json"],
        capture_output=True, text=True, timeout=800, env={**os.environ, "TRL_HARBOR_PREFLIGHT": "1"},
    )  # fmt: skip
    assert done.returncode != 0, done.stdout[-3000:]  # one task fails its check
    results = {row["task"]: row for row in json.loads(done.stdout)["tasks"]}
    for name in ("service_by_name", "healthy_volume"):
        row = results[name]
        assert row["passed"], row["why"]
        assert (row["oracle"]["reward"], row["nop"]["reward"]) == (1.0, 0.0)
    broken = results["never_healthy"]
    assert not broken["passed"] and broken["oracle"]["reward"] is None and broken["oracle"]["task_fault"]
    assert broken["problem"].startswith("the task's environment did not start:"), broken["problem"]
    assert "compose service 'broken-db' never became healthy" in broken["why"], broken["why"]
    assert "db: cannot open data directory" in broken["why"], broken["why"]
    # The same through the function the command runs.
    [result] = check_suite([suite / "never_healthy"], "local")
    assert not result.passed and result.problem is not None and "'broken-db'" in result.problem


def _harbor_run(suite: Path, agent: str, jobs: Path) -> dict:
    done = subprocess.run(
        [HARBOR, "run", "-p", suite, "-a", agent, "-e", "harbor_local_sandbox.local:LocalEnvironment",
         "-n", "2", "-o", jobs, "-y"],
        capture_output=True, text=True, timeout=800, cwd=jobs.parent,
        env={**os.environ, "HARBOR_TELEMETRY": "0", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )  # fmt: skip
    errors = "".join(f"\n{path}:\n{path.read_text()[-2000:]}" for path in sorted(jobs.glob("**/exception.txt")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + errors
    (result_file,) = jobs.glob("*/result.json")
    stats = json.loads(result_file.read_text())["stats"]
    assert stats["n_errored_trials"] == 0 and stats["n_completed_trials"] == 2, errors
    (evaluation,) = stats["evals"].values()
    return {
        reward: sorted(name.split("__")[0] for name in names)
        for reward, names in evaluation["reward_stats"]["reward"].items()
    }


@pytest.mark.local
@pytest.mark.timeout(900)
def test_harbor_run_runs_compose_tasks_on_the_local_sandbox(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    _suite(suite)
    both = ["healthy_volume", "service_by_name"]
    assert _harbor_run(suite, "oracle", tmp_path / "oracle") == {"1.0": both}
    assert _harbor_run(suite, "nop", tmp_path / "nop") == {"0.0": both}
    logs = sorted(path.name for path in (tmp_path / "oracle").glob("*/*/services/*.log"))
    assert logs == ["producer.log", "secret-server.log"], logs  # each service's output, in its trial folder


@pytest.mark.docker
@pytest.mark.local
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compose_tasks_score_the_same_on_docker_and_on_the_local_sandbox(
    docker_daemon, loopback_registry, tmp_path: Path
) -> None:
    # Public: Harbor's Docker backend cannot enforce no-network on the offline test daemon (test_docker_network.py).
    tasks = _suite(tmp_path / "suite", base=loopback_registry.base, network="public", python=False)
    scores = {}
    for backend in ("docker", "local"):
        results = check_suite(tasks, backend, concurrency=2)
        scores[backend] = {r.task: (r.oracle.reward, r.nop.reward, r.why) for r in results}
    expected = {"service_by_name": (1.0, 0.0, ""), "healthy_volume": (1.0, 0.0, "")}
    assert scores == {"docker": expected, "local": expected}, scores
