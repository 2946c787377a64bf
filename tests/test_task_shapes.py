"""Every Harbor task shape, graded as Harbor grades it (issue #9), on real local sandboxes.

Multi-step tasks (``[[steps]]``) are one rollout: ``submit_step`` grades a step and returns the
next instruction; the reward combines the steps (unreached ones score 0). Tasks the harness or
the backend cannot run fail when the spec is built, naming the file, the field and the fix.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import requires_local, tiny_grpo_trainer

from sandbox_helpers import BASE_DOCKERFILE
from trl_harbor import HarborOptions, HarborSpec
from trl_harbor.rollout.suite import TaskSuiteError
from trl_harbor.training.env import HarborBashStepsEnv

STEP_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat {path} 2>/dev/null)" = "{expected}" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def make_steps_task(root: Path, name: str = "two_steps", *, strategy: str | None = None, gate: bool = False) -> Path:
    """A two-step task: step `one` wants 1 in a.txt; step `two` (staged by its setup.sh) wants its token in b.txt."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(BASE_DOCKERFILE + "WORKDIR /workdir\n")
    head = f'multi_step_reward_strategy = "{strategy}"\n' if strategy else ""
    gate_line = "min_reward = 1.0\n" if gate else ""
    (task / "task.toml").write_text(
        textwrap.dedent(
            f"""\
            version = "1.0"
            {head}
            [verifier]
            timeout_sec = 60
            [environment]
            network_mode = "no-network"

            [[steps]]
            name = "one"
            {gate_line}
            [[steps]]
            name = "two"
            """
        )
    )
    for step, path, expected, text in (
        ("one", "/workdir/a.txt", "1", "Write 1 to /workdir/a.txt."),
        ("two", "/workdir/b.txt", "staged-token", "Copy /workdir/token.txt to /workdir/b.txt."),
    ):
        (task / "steps" / step / "tests").mkdir(parents=True)
        (task / "steps" / step / "instruction.md").write_text(text + "\n")
        test_sh = task / "steps" / step / "tests" / "test.sh"
        test_sh.write_text(STEP_TEST.format(path=path, expected=expected))
        test_sh.chmod(0o755)
    (task / "steps" / "two" / "workdir").mkdir()
    (task / "steps" / "two" / "workdir" / "setup.sh").write_text("echo staged-token > /workdir/token.txt\n")
    return task


@pytest.fixture
def steps_suite(tmp_path: Path) -> Path:
    root = tmp_path / "suite"
    make_steps_task(root)
    return root


@requires_local
def test_a_multi_step_task_is_one_rollout_with_submit_step(steps_suite: Path, close_sandboxes: None) -> None:
    spec = HarborSpec(steps_suite, agent="bash_steps", environment_type="local")
    env = spec.environment_factory()
    assert isinstance(env, HarborBashStepsEnv)
    prompt = env.reset(task_dir=str(spec.task_dirs[0]))
    assert prompt.startswith("Write 1 to /workdir/a.txt.") and "2 steps" in prompt
    assert "No such file" in env.bash("cat /workdir/token.txt")  # step two is not staged yet
    env.bash("echo 1 > /workdir/a.txt")
    following = env.submit_step()
    assert "Step 2 of 2" in following and "Copy /workdir/token.txt" in following
    # Step one's verifier left nothing for the agent to read; step two's setup.sh ran.
    assert env.bash("ls -A /tests /logs/verifier").split() == ["/logs/verifier:", "/tests:"]
    assert env.bash("cat /workdir/token.txt").strip() == "staged-token"
    env.bash("cp /workdir/token.txt /workdir/b.txt")
    assert "task is over" in env.submit_step()
    assert "task is over" in env.submit_step()  # idempotent
    assert env.reward == 1.0
    assert env.verification.steps == (("one", {"reward": 1.0}), ("two", {"reward": 1.0}))


@requires_local
def test_steps_combine_as_in_harbor_and_min_reward_ends_the_rollout(tmp_path: Path, close_sandboxes: None) -> None:
    root = tmp_path / "suite"
    make_steps_task(root, "mean")
    make_steps_task(root, "final", strategy="final")
    make_steps_task(root, "gated", gate=True)
    spec = HarborSpec(root, agent="bash_steps", environment_type="local")
    task = {p.name: str(p) for p in spec.task_dirs}
    env = spec.environment_factory()

    # Step one done but never submitted: it is graded at the end; Harbor's mean is over the steps graded.
    env.reset(task_dir=task["mean"])
    env.bash("echo 1 > /workdir/a.txt")
    assert env.reward == 1.0
    assert "never reached (not counted, as in Harbor)" in env.verification.reason
    # The training option: a step never reached scores 0, so stopping early is never rewarded.
    strict = HarborSpec(
        root, agent="bash_steps", environment_type="local", options=HarborOptions(unreached_steps="zero")
    )
    zeroed = strict.environment_factory()
    zeroed.reset(task_dir=task["mean"])
    zeroed.bash("echo 1 > /workdir/a.txt")
    assert zeroed.reward == 0.5
    assert "never reached (scored 0)" in zeroed.verification.reason

    # "final": the last step graded counts (Harbor); with unreached_steps="zero", not reaching the last is 0.
    env.reset(task_dir=task["final"])
    env.bash("echo 1 > /workdir/a.txt")
    assert env.reward == 1.0
    zeroed.reset(task_dir=task["final"])
    zeroed.bash("echo 1 > /workdir/a.txt")
    assert zeroed.reward == 0.0
    env.reset(task_dir=task["final"])
    env.submit_step()  # step one wrong
    env.bash("cp /workdir/token.txt /workdir/b.txt")
    env.submit_step()
    assert env.reward == 1.0

    # min_reward on step one: a wrong first step ends the rollout there.
    env.reset(task_dir=task["gated"])
    assert "task is over" in env.submit_step()
    assert env.bash("cat /workdir/token.txt").startswith("Error: the rollout is over")
    assert env.reward == 0.0 and env.verification.steps == (("one", {"reward": 0.0}),)


@requires_local
def test_what_a_later_step_plants_among_the_tests_never_reaches_its_verifier(
    steps_suite: Path, close_sandboxes: None
) -> None:
    spec = HarborSpec(steps_suite, agent="bash_steps", environment_type="local")
    env = spec.environment_factory()
    env.reset(task_dir=str(spec.task_dirs[0]))
    env.bash("echo 1 > /workdir/a.txt")
    env.submit_step()
    # A plant in /tests, a reward writer left running, and the step's work not done: step two scores 0.
    env.bash("mkdir -p /tests && echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh")
    env.bash(
        "nohup sh -c 'while :; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.01; done' >/dev/null 2>&1 &"
    )
    env.submit_step()
    assert env.reward == 0.5  # step one 1, step two 0
    assert any(change.startswith("/tests ") for change in env.verification.concealed), env.verification.concealed


def test_tasks_the_harness_or_backend_cannot_run_fail_at_spec_build(tmp_path: Path, steps_suite: Path) -> None:
    with pytest.raises(TaskSuiteError, match=r"submit_step.*agent='bash_steps'"):
        HarborSpec(steps_suite, agent="bash", environment_type="local")

    compose = tmp_path / "compose_suite"
    make_steps_task(compose, "with_sidecar")
    # The local sandbox runs compose services (tests/test_compose_tasks.py), not a privileged one: refused by name.
    (compose / "with_sidecar" / "environment" / "docker-compose.yaml").write_text(
        "services:\n  cache:\n    image: redis\n    privileged: true\n"
    )
    with pytest.raises(
        TaskSuiteError, match=r"docker-compose.yaml: service 'cache': `privileged`.*environment_type='docker'"
    ):
        HarborSpec(compose, agent="bash_steps", environment_type="local")
    HarborSpec(compose, agent="bash_steps", environment_type="docker")  # fine where compose runs

    missing = tmp_path / "env_suite"
    task = make_steps_task(missing, "needs_key")
    toml = task / "task.toml"
    toml.write_text(
        toml.read_text().replace("[environment]\n", '[environment]\nenv = { API_KEY = "${TRL_HARBOR_NO_SUCH_VAR}" }\n')
    )
    with pytest.raises(TaskSuiteError, match=r"\[environment.env\] API_KEY.*TRL_HARBOR_NO_SUCH_VAR.*export"):
        HarborSpec(missing, agent="bash_steps", environment_type="local")


@requires_local
@pytest.mark.slow
def test_grpo_step_on_a_multi_step_task_logs_each_steps_reward(
    steps_suite: Path, tmp_path: Path, close_sandboxes: None
) -> None:
    from trl_harbor.testing import tool_call_text

    spec = HarborSpec(steps_suite, agent="bash_steps", environment_type="local")
    calls = [
        tool_call_text("bash", {"command": "echo 1 > /workdir/a.txt; cp /workdir/token.txt /workdir/b.txt"}),
        tool_call_text("submit_step", {}),
    ]
    trainer = tiny_grpo_trainer(tmp_path, spec, calls, HarborBashStepsEnv.PROMPT_SUFFIX, spec.reward_funcs)
    trainer.args.max_tool_calling_iterations = 4
    assert sorted(tool.__name__ for tool in trainer.tools) == ["bash", "submit_step"]
    trainer.train()
    logged = trainer.state.log_history[0]
    assert "harbor/reward/one/reward" in logged, sorted(logged)
    assert 0.0 <= logged["reward"] <= 1.0


@requires_local
@pytest.mark.slow
def test_grpo_step_on_a_multi_reward_task_logs_every_component(
    copy_tasks, tmp_path: Path, close_sandboxes: None
) -> None:
    from conftest import GOLD_ANSWER, GOLD_TASK

    from trl_harbor import HarborBashEnv
    from trl_harbor.testing import tool_call_text

    suite = copy_tasks(GOLD_TASK)
    (suite / GOLD_TASK / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        f'if [ "$(cat /workdir/answer.txt 2>/dev/null)" = "{GOLD_ANSWER}" ]; then c=1; else c=0; fi\n'
        'echo "{\\"correctness\\": $c, \\"performance\\": 0.5}" > /logs/verifier/reward.json\n'
    )
    spec = HarborSpec(suite, environment_type="local", options=HarborOptions(reward_weights={"correctness": 1.0}))
    calls = [tool_call_text("bash", {"command": f"echo -n {c} > /workdir/answer.txt"}) for c in (GOLD_ANSWER, 0)]
    trainer = tiny_grpo_trainer(tmp_path, spec, calls, HarborBashEnv.PROMPT_SUFFIX, spec.reward_funcs)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["harbor/reward/performance"] == pytest.approx(0.5)
    assert logged["harbor/reward/correctness"] == pytest.approx(logged["reward"])  # weighted on correctness alone


@requires_local
def test_check_grades_like_training_and_reports_every_task_even_broken_ones(tmp_path: Path, copy_tasks) -> None:
    """One broken task among good ones: every task gets its row, each failure its reason."""

    from conftest import GOLD_TASK

    from trl_harbor.cli.check import check_suite

    suite = copy_tasks(GOLD_TASK)
    steps = make_steps_task(suite, "two_steps")
    for step, command in (("one", "echo 1 > /workdir/a.txt"), ("two", "cp /workdir/token.txt /workdir/b.txt")):
        (steps / "steps" / step / "solution").mkdir()
        (steps / "steps" / step / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{command}\n")
    bad_toml = suite / "bad_toml"
    bad_toml.mkdir()
    (bad_toml / "task.toml").write_text("version = [unclosed\n")
    (bad_toml / "instruction.md").write_text("x\n")
    needs_var = make_steps_task(suite, "needs_var")
    toml = needs_var / "task.toml"
    toml.write_text(
        toml.read_text().replace("[verifier]\n", '[verifier]\nenv = { TOKEN = "${TRL_HARBOR_UNSET_VAR}" }\n')
    )
    sidecar = make_steps_task(suite, "sidecar")
    (sidecar / "environment" / "docker-compose.yaml").write_text(
        "services:\n  cache:\n    image: redis\n    privileged: true\n"
    )
    cheat = make_steps_task(suite, "cheating_oracle")  # its solution plants a fake python3: tampering
    for step in ("one", "two"):
        (cheat / "steps" / step / "solution").mkdir()
        (cheat / "steps" / step / "solution" / "solve.sh").write_text(
            # /usr/local/bin comes before /usr/bin on the image's (Docker's default) PATH.
            "#!/bin/bash\nprintf '#!/bin/sh\\n' > /usr/local/bin/python3 && chmod +x /usr/local/bin/python3\n"
        )

    dirs = sorted(p for p in suite.iterdir() if p.is_dir())
    results = {r.task_dir.name: r for r in check_suite(dirs, "local", concurrency=4)}
    assert set(results) == {p.name for p in dirs}
    assert results[GOLD_TASK].passed and results["two_steps"].passed, results["two_steps"].why
    assert results["two_steps"].oracle.reward == 1.0 and results["two_steps"].nop.reward == 0.0
    assert "not valid TOML" in results["bad_toml"].why
    assert "TRL_HARBOR_UNSET_VAR" in results["needs_var"].why
    assert "docker-compose.yaml: service 'cache': `privileged`" in results["sidecar"].why
    cheating = results["cheating_oracle"]  # its fake python3 is not the verifier's: the task is graded, undone
    assert not cheating.passed and cheating.oracle.reward == 0.0, cheating.why
    assert results["cheating_oracle"].to_dict()["passed"] is False


@requires_local
def test_check_command_line_json_reward_options_and_a_malformed_task(tmp_path: Path, copy_tasks, capsys) -> None:
    import json

    from conftest import GOLD_TASK

    from trl_harbor.cli import main

    suite = copy_tasks(GOLD_TASK)
    bad = suite / "zz_bad"
    bad.mkdir()
    (bad / "task.toml").write_text("version = [\n")
    (bad / "instruction.md").write_text("x\n")
    status = main(["check", str(suite), "-e", "local", "--json", "--jobs", "2", "--reward-weight", "reward=1"])
    report = json.loads(capsys.readouterr().out)
    assert status == 1 and report["passed"] == 1 and report["failed"] == 1
    rows = {row["task_dir"].rsplit("/", 1)[-1]: row for row in report["tasks"]}
    assert rows[GOLD_TASK]["passed"] and rows[GOLD_TASK]["oracle"]["reward"] == 1.0
    assert not rows["zz_bad"]["passed"] and "TOML" in rows["zz_bad"]["why"]
    assert main(["check", str(suite), "--reward-weight", "oops"]) == 2


def _single_task(root: Path, name: str, toml_extra: str = "", test_sh: str | None = None) -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "environment" / "Dockerfile").write_text(BASE_DOCKERFILE + "WORKDIR /workdir\n")
    (task / "instruction.md").write_text("Write 7 to /workdir/answer.txt\n")
    (task / "task.toml").write_text(f'version = "1.0"\n{toml_extra}\n[environment]\nnetwork_mode = "no-network"\n')
    script = task / "tests" / "test.sh"
    script.write_text(
        test_sh
        or "#!/bin/bash\nmkdir -p /logs/verifier\n"
        '[ "$(cat /workdir/answer.txt 2>/dev/null)" = 7 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'
    )
    script.chmod(0o755)
    return task


@requires_local
def test_a_separate_verifier_is_built_from_tests_dockerfile_and_gets_the_artifacts(
    tmp_path: Path, close_sandboxes: None
) -> None:
    task = _single_task(
        tmp_path / "suite",
        "separate",
        'artifacts = ["/workdir/answer.txt"]\n[verifier]\nenvironment_mode = "separate"\n',
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        '[ -f /verifier-only/marker ] && [ ! -e /workdir/scratch.txt ] && [ "$(cat /workdir/answer.txt)" = 7 ] '
        "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
    )
    # Harbor's convention: a verifier image built from tests/ carries its tests itself.
    (task / "tests" / "Dockerfile").write_text(
        BASE_DOCKERFILE + "RUN mkdir -p /verifier-only && touch /verifier-only/marker\nCOPY test.sh /tests/test.sh\n"
    )
    spec = HarborSpec(task.parent, environment_type="local")
    env = spec.environment_factory()
    env.reset(task_dir=str(task))
    assert "No such file" in env.bash("ls /verifier-only")  # the agent's sandbox is the task's, not the verifier's
    env.bash("echo 7 > /workdir/answer.txt; touch /workdir/scratch.txt")  # only the declared artifact crosses
    assert env.reward == 1.0, env.verification


@requires_local
def test_the_environment_healthcheck_runs_before_the_agent(tmp_path: Path, close_sandboxes: None) -> None:
    root = tmp_path / "suite"
    retrying = _single_task(
        root,
        "comes_up",
        "",
    )
    toml = retrying / "task.toml"
    toml.write_text(
        toml.read_text()
        + '[environment.healthcheck]\ncommand = "test -f /tmp/up || { touch /tmp/up; exit 1; }"\n'
        + "interval_sec = 0.1\nretries = 3\n"
    )
    never = _single_task(root, "never_up")
    (never / "task.toml").write_text(
        (never / "task.toml").read_text()
        + '[environment.healthcheck]\ncommand = "false"\ninterval_sec = 0.1\nretries = 1\n'
    )
    spec = HarborSpec(root, environment_type="local")
    dirs = {p.name: str(p) for p in spec.task_dirs}
    up, down = spec.environment_factory(), spec.environment_factory()
    up.reset(task_dir=dirs["comes_up"])
    down.reset(task_dir=dirs["never_up"])
    assert up.bash("ls /tmp/up").strip() == "/tmp/up"  # the check ran (twice) before the first tool call
    up.bash("echo 7 > /workdir/answer.txt")
    assert up.reward == 1.0
    assert down.bash("true").startswith("Error: sandbox start failed") and "ealthcheck" in down.infra_error
    assert down.reward is None and down.verification.infra


@requires_local
def test_the_local_sandbox_switches_the_network_per_phase(tmp_path: Path, close_sandboxes: None) -> None:
    """No network for the agent, the task's network for its verifier (a test.sh that downloads its tools)."""
    task = _single_task(
        tmp_path / "suite",
        "phases",
        '[agent]\nnetwork_mode = "no-network"\n',
        "#!/bin/bash\nmkdir -p /logs/verifier\n"  # the verifier sees a network interface besides loopback
        "grep -q tap0 /proc/net/dev && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
    )
    (task / "task.toml").write_text(
        'version = "1.0"\n[agent]\nnetwork_mode = "no-network"\n[environment]\nnetwork_mode = "public"\n'
    )
    spec = HarborSpec(task.parent, environment_type="local")
    env = spec.environment_factory()
    env.reset(task_dir=str(task))
    assert "tap0" not in env.bash("cat /proc/net/dev")  # the agent's phase: loopback only
    assert env.reward == 1.0, env.verification  # the verifier's phase: the task's network
