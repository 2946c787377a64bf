"""Harbor's own ``docker`` backend on a real daemon: the same rewards as the local sandbox.

Every test here runs Harbor's ``DockerEnvironment`` (``docker compose`` v2 against the private
``dockerd`` of ``docker_daemon.py``) and, for parity, the local sandbox on the same tasks:

* the bundled suite, through ``trl-harbor check``'s code on both backends: every task's oracle
  scores 1 and doing nothing 0, on each, task by task. The copy runs with ``network_mode``
  set to ``"public"``: Harbor enforces ``no-network`` on Docker with images that cannot be had
  offline (``test_docker_network.py``), while the local backend runs the original suite as it is;
* task images that use what real tasks use (``FROM`` the loopback registry's Debian, ``apt-get
  install`` at build, ``USER``, ``COPY`` into ``/etc`` and ``/usr/local/bin``, a multi-stage
  build): the same rewards on both;
* a CPU GRPO step on ``docker``: tools run in containers, the verifier scores them;
* a compose task whose sidecar service the agent and the tests talk to: it passes on Docker
  and on the local sandbox (more compose tasks: ``test_compose_tasks.py``);
* nothing is left in the daemon by the episodes (``test_docker_daemon.py`` checks that the
  daemon's own teardown leaves nothing on the machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_ANSWER, GOLD_TASK, tiny_grpo_trainer
from docker_daemon import public_copy

from sandbox_helpers import recording_bash_env
from trl_harbor import HarborBashEnv, HarborOptions, HarborSpec, close_all
from trl_harbor.cli.check import CheckResult, check_suite

pytestmark = pytest.mark.docker


def _rewards(results: list[CheckResult]) -> dict[str, tuple]:
    return {r.task: (r.oracle.reward, r.nop.reward, r.problem) for r in results}


def _table(results: list[CheckResult]) -> str:
    return "\n".join(f"{r.task}: oracle={r.oracle.reward} nothing={r.nop.reward} {r.why}" for r in results)


def _check(task_dirs: list[Path], environment_type: str, concurrency: int = 8) -> list[CheckResult]:
    # On trl-harbor's one shared loop, as training runs: Harbor's Docker backend keeps class-level
    # asyncio locks (one per task name, for builds), which a second asyncio.run() could not take.
    return check_suite(task_dirs, environment_type, concurrency=concurrency)


@pytest.fixture(scope="module")
def public_suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled suite with every task on the public network."""
    return public_copy(BUNDLED_SUITE, tmp_path_factory.mktemp("public") / "tasks")


# ── the bundled suite ──────────────────────────────────────────────────────────────────


@pytest.mark.slow
def test_bundled_suite_scores_the_same_on_docker_and_local(docker_daemon, public_suite: Path) -> None:
    tasks = sorted(p for p in public_suite.iterdir() if p.is_dir())
    assert len(tasks) == 15
    spec = HarborSpec(public_suite, environment_type="docker", preflight=True)  # the daemon passes the preflight
    assert len(spec.task_dirs) == 15
    on_docker = _check(tasks, "docker")
    on_local = _check(tasks, "local")
    assert all(r.passed for r in on_docker), _table(on_docker)
    assert all(r.passed for r in on_local), _table(on_local)
    assert _rewards(on_docker) == _rewards(on_local)
    # The local backend enforces no-network itself: the original suite scores the same there.
    original = _check(sorted(p for p in BUNDLED_SUITE.iterdir() if p.is_dir()), "local")
    assert _rewards(original) == _rewards(on_local), _table(original)


# ── task images: what real tasks' Dockerfiles do ────────────────────────────────────────


def _image_task(root: Path, name: str, dockerfile: str, solve: str, expected: str, files: dict | None = None) -> Path:
    """A public-network task: the oracle's ``solve.sh`` writes the answer, the grader compares it."""
    task = root / name
    for sub in ("environment", "tests", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    for rel, text in (files or {}).items():
        (task / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / "environment" / rel).write_text(text)
    (task / "instruction.md").write_text("Write the answer to /workdir/answer.txt\n")
    (task / "task.toml").write_text(
        textwrap.dedent(
            f"""\
            version = "1.0"
            [metadata]
            gold_answer = "{expected}"
            [verifier]
            timeout_sec = 120
            [verifier.env]
            EXPECTED = "{expected}"
            [agent]
            timeout_sec = 120
            [environment]
            network_mode = "public"
            build_timeout_sec = 600
            """
        )
    )
    test_sh = task / "tests" / "test.sh"
    test_sh.write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        'if [ "$(cat /workdir/answer.txt 2>/dev/null)" = "$EXPECTED" ]; then echo 1 > /logs/verifier/reward.txt; '
        "else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    solve_sh = task / "solution" / "solve.sh"
    solve_sh.write_text("#!/bin/bash\nset -e\n" + textwrap.dedent(solve))
    for script in (test_sh, solve_sh):
        script.chmod(0o755)
    return task


def _image_tasks(root: Path, base: str) -> list[Path]:
    return [
        _image_task(
            root,
            "apt_at_build",
            f"""\
            FROM {base}
            RUN apt-get update && apt-get install -y --no-install-recommends jq && rm -rf /var/lib/apt/lists/*
            WORKDIR /workdir
            COPY data.json /workdir/data.json
            """,
            "jq -r '.items | map(.n) | add' /workdir/data.json > /workdir/answer.txt\n",
            "17",
            {"data.json": json.dumps({"items": [{"n": 9}, {"n": 8}]})},
        ),
        _image_task(
            root,
            "image_user",
            f"""\
            FROM {base}
            RUN useradd --create-home agent && mkdir /workdir && chown agent /workdir
            USER agent
            WORKDIR /workdir
            """,
            'echo "$(id -un):$HOME:$(stat -c %U /workdir)" > /workdir/answer.txt\n',
            "agent:/home/agent:agent",
        ),
        _image_task(
            root,
            "copy_into_etc_and_bin",
            f"""\
            FROM {base}
            ENV PATH="/opt/tool/bin:${{PATH}}"
            COPY app.conf /etc/myapp/app.conf
            COPY tool.sh /usr/local/bin/tool
            RUN chmod 755 /usr/local/bin/tool && mkdir -p /opt/tool/bin \\
                && printf '#!/bin/sh\\necho opt\\n' > /opt/tool/bin/opttool && chmod 755 /opt/tool/bin/opttool
            WORKDIR /workdir
            """,
            'echo "$(tool)-$(opttool)" > /workdir/answer.txt\n',
            "mode=production-opt",
            {"app.conf": "mode=production\n", "tool.sh": "#!/bin/sh\ncat /etc/myapp/app.conf\n"},
        ),
        _image_task(
            root,
            "multi_stage",
            f"""\
            FROM {base} AS build
            RUN python3 -c 'print(sum(range(101)))' > /built.txt
            FROM {base}
            COPY --from=build /built.txt /opt/built/result.txt
            WORKDIR /workdir
            """,
            "cp /opt/built/result.txt /workdir/answer.txt\n",
            "5050",
        ),
    ]


@pytest.mark.slow
def test_task_images_score_the_same_on_docker_and_local(docker_daemon, loopback_registry, tmp_path: Path) -> None:
    tasks = _image_tasks(tmp_path / "images", loopback_registry.base)
    on_docker = _check(tasks, "docker")
    on_local = _check(tasks, "local")
    assert all(r.passed for r in on_docker), _table(on_docker)
    assert all(r.passed for r in on_local), _table(on_local)
    assert _rewards(on_docker) == _rewards(on_local)


# ── training ────────────────────────────────────────────────────────────────────────────


@pytest.mark.slow
def test_grpo_step_on_docker_runs_tools_in_containers_and_scores_them(
    docker_daemon,
    tmp_path: Path,
    without_the_local_sandbox,
) -> None:
    """Also shows that Docker trains without the local sandbox's package (trl-harbor without ``[local]``)."""
    import torch

    from trl_harbor.testing import tool_call_text

    suite = tmp_path / "suite"
    suite.mkdir()
    public_copy(BUNDLED_SUITE / GOLD_TASK, suite / GOLD_TASK)
    good_command = f"echo -n {GOLD_ANSWER} > /workdir/answer.txt; cat /etc/hostname"
    bad_command = "echo -n 0 > /workdir/answer.txt; cat /etc/hostname"
    outputs: list[tuple[int, str, str]] = []

    RecordingBashEnv = recording_bash_env(lambda env, command, output: outputs.append((id(env), command, output)))

    spec = HarborSpec(suite, agent=RecordingBashEnv, environment_type="docker", preflight=True)
    harbor_reward = spec.reward_funcs
    scored: list[tuple[list, list]] = []

    def recorded_reward(completions, environments=None, **kwargs):
        rewards = harbor_reward(completions=completions, environments=environments, **kwargs)
        scored.append((rewards, [[c for e, c, _ in outputs if e == id(env)] for env in environments]))
        return rewards

    calls = [tool_call_text("bash", {"command": c}) for c in (good_command, bad_command)]
    trainer = tiny_grpo_trainer(tmp_path, spec, calls, HarborBashEnv.PROMPT_SUFFIX, [recorded_reward])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        close_all()
    assert outputs, "the rigged policy must have called the bash tool"
    hostnames = {out.strip() for _, _, out in outputs}
    # Each rollout's commands ran in a container of its own (Docker names a container's host after its id).
    assert len(hostnames) == len({e for e, _, _ in outputs}), outputs
    assert all(len(h) == 12 and all(c in "0123456789abcdef" for c in h) for h in hostnames), hostnames
    rewards, commands = scored[0]
    assert len(rewards) == 2
    for reward, cmds in zip(rewards, commands, strict=True):
        assert reward == (1.0 if cmds and cmds[-1] == good_command else 0.0), (reward, cmds)
    assert trainer.state.log_history[0]["reward"] == pytest.approx(sum(rewards) / 2)
    if len(set(rewards)) > 1:
        assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert not [m for m in sys.modules if m.startswith("harbor_local_sandbox")]


SERVER_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if python3 -c "import urllib.request; assert urllib.request.urlopen('http://localhost:8765/ok').read().strip() == b'up'"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@pytest.mark.parametrize("policy", ["keep", "kill"])
def test_on_docker_the_agent_process_policy_is_explicit(docker_daemon, tmp_path: Path, policy: str) -> None:
    """``agent_processes="keep"`` (the default) grades as Harbor's shared trial: a server the solution
    leaves running answers the tests; ``"kill"`` stops the agent's processes first (found in ``/proc``),
    so a late writer gains nothing — and the server is gone too."""
    task = public_copy(BUNDLED_SUITE / GOLD_TASK, tmp_path / "suite" / GOLD_TASK)
    (task / "tests" / "test.sh").write_text(SERVER_TEST)
    spec = HarborSpec(task.parent, environment_type="docker", options=HarborOptions(agent_processes=policy))
    env = spec.environment_factory()
    try:
        env.reset(task_dir=str(spec.task_dirs[0]))
        env.bash(
            "mkdir -p /srv && echo up > /srv/ok && cd /srv && "
            "nohup python3 -m http.server 8765 >/dev/null 2>&1 & setsid sleep 600 >/dev/null 2>&1 < /dev/null & sleep 1"
        )
        if policy == "keep":
            assert env.reward == 1.0, env.verification  # as under Harbor
            assert env.verification.killed == 0
        else:
            assert env.reward == 0.0, env.verification
            assert env.verification.killed >= 2, env.verification
    finally:
        close_all()


# ── compose tasks ───────────────────────────────────────────────────────────────────────

COMPOSE = """\
services:
  main:
    depends_on:
      store:
        condition: service_healthy
  store:
    image: {base}
    command: ["sh", "-c", "mkdir -p /srv && echo {secret} > /srv/secret && exec python3 -m http.server 8000 --directory /srv"]
    healthcheck:
      test: ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/secret')"]
      interval: 1s
      retries: 30
"""
FETCH = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://store:8000/secret').read().decode().strip())\""


def _compose_task(root: Path, base: str, secret: str) -> Path:
    task = _image_task(
        root, "with_sidecar", f"FROM {base}\nWORKDIR /workdir\n", f"{FETCH} > /workdir/answer.txt\n", secret
    )
    (task / "environment" / "docker-compose.yaml").write_text(COMPOSE.format(base=base, secret=secret))
    # The grader talks to the sidecar too: the answer must be what the service serves now.
    (task / "tests" / "test.sh").write_text(
        f'#!/bin/bash\nmkdir -p /logs/verifier\nserved="$({FETCH})"\n'
        'if [ -n "$served" ] && [ "$(cat /workdir/answer.txt 2>/dev/null)" = "$served" ]; then '
        "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    return task


@pytest.mark.slow
def test_a_compose_task_runs_its_sidecar_on_docker_and_on_local(
    docker_daemon,
    loopback_registry,
    tmp_path: Path,
) -> None:
    task = _compose_task(tmp_path / "suite", loopback_registry.base, "sidecar-secret-42")
    done = subprocess.run(
        [sys.executable, "-m", "trl_harbor.cli", "check", str(task.parent), "--environment-type", "docker", "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TRL_HARBOR_PREFLIGHT": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = json.loads(done.stdout)["tasks"]
    assert (row["oracle"]["reward"], row["nop"]["reward"], row["passed"]) == (1.0, 0.0, True), row
    [local] = _check([task], "local")  # its service a sandbox of its own, on main's loopback
    assert local.passed and (local.oracle.reward, local.nop.reward) == (1.0, 0.0), local.why
    HarborSpec(task.parent, environment_type="local")
    HarborSpec(task.parent, environment_type="docker", preflight=True).environment_factory()


# ── nothing left ────────────────────────────────────────────────────────────────────────


def test_the_episodes_above_left_nothing_in_the_daemon(docker_daemon) -> None:
    """After every episode above stopped: no container, compose network or volume of theirs remains.

    (Last in the module: pytest runs a module's tests in the order they are defined.)
    """
    left = docker_daemon.leftovers()
    assert left == {"containers": [], "networks": [], "volumes": []}, left
