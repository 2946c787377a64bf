"""A backend that cannot work at all fails fast: when the environment factory is first used (the
trainer's construction), or at the first batch lost whole. Building a spec never needs a backend.

On this project's machines the ``docker`` command exists and no daemon answers at Docker's default
socket (the Docker tests start a private one, ``docker_daemon.py``), which is exactly the case that
used to train on: every rollout's sandbox failed to start, every reward was ``None``.
The docker tests point ``DOCKER_HOST`` at a socket that does not exist, so that they find no
daemon on any machine (and the real CLI and Harbor's real Docker backend say so).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_TASK, requires_local, tiny_grpo_trainer

from sandbox_helpers import BASE_DOCKERFILE, run_unprivileged, unprivileged_test
from trl_harbor import HarborOptions, HarborSpec, close_all
from trl_harbor.rollout.preflight import BackendUnavailableError, InfrastructureFailureError, check_batch
from trl_harbor.rollout.suite import TaskSuiteError
from trl_harbor.training.env import HarborBashEnv


@pytest.fixture
def no_docker_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Docker daemon, on any machine: the CLI is pointed at a socket that does not exist."""
    from trl_harbor.rollout import preflight

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such-docker.sock")
    monkeypatch.setattr(preflight, "_PASSED", set())


def _first_environment(spec: HarborSpec):
    """What a trainer's construction does first with a spec: build one environment (TRL probes its tools)."""
    return spec.environment_factory()


def test_docker_without_a_daemon_fails_at_the_first_environment_with_the_cause_and_the_fixes(
    no_docker_daemon: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRL_HARBOR_PREFLIGHT", raising=False)  # the default, as users have it
    spec = HarborSpec(BUNDLED_SUITE, environment_type="docker")  # as the reference: no backend needed
    assert len(spec.train_dataset) == len(spec.tasks)
    with pytest.raises(BackendUnavailableError) as caught:
        _first_environment(spec)
    message = str(caught.value)
    assert "environment_type='docker' cannot start sandboxes on this machine" in message
    assert "docker" in message.lower() and ("daemon" in message.lower() or "not installed" in message.lower())
    assert "environment_type='local'" in message
    # The advice works as written: the spec it names builds environments.
    assert "HarborSpec(..., preflight=False)" in message and "TRL_HARBOR_PREFLIGHT=0" in message
    assert isinstance(
        _first_environment(HarborSpec(BUNDLED_SUITE, environment_type="docker", preflight=False)), HarborBashEnv
    )
    with pytest.raises(BackendUnavailableError):  # a failed check is not remembered as passed
        _first_environment(spec)


def test_the_preflight_can_be_turned_off(no_docker_daemon: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _first_environment(HarborSpec(BUNDLED_SUITE, environment_type="docker", preflight=False))
    monkeypatch.setenv("TRL_HARBOR_PREFLIGHT", "0")
    _first_environment(HarborSpec(BUNDLED_SUITE, environment_type="docker"))  # the default defers to the variable
    monkeypatch.setenv("TRL_HARBOR_PREFLIGHT", "1")
    with pytest.raises(BackendUnavailableError):
        _first_environment(HarborSpec(BUNDLED_SUITE, environment_type="docker"))


def test_a_loop_agent_checks_the_backend_before_its_first_batch(no_docker_daemon: None) -> None:
    spec = HarborSpec(BUNDLED_SUITE, agent="terminus-2", environment_type="docker", preflight=True)
    with pytest.raises(BackendUnavailableError, match="environment_type='docker' cannot start sandboxes"):
        spec.rollout_func(prompts=[], trainer=None)


@requires_local
def test_local_backend_passes_and_bad_backends_are_named() -> None:
    _first_environment(HarborSpec(BUNDLED_SUITE, environment_type="local", preflight=True))
    with pytest.raises(BackendUnavailableError, match=r"'no_such_module_xyz:Env'.*No module named"):
        _first_environment(HarborSpec(BUNDLED_SUITE, environment_type="no_such_module_xyz:Env", preflight=True))
    with pytest.raises(BackendUnavailableError, match="root"):
        _first_environment(
            HarborSpec(
                BUNDLED_SUITE,
                environment_type="local",
                options=HarborOptions(backend_options={"root": "vm"}),
                preflight=True,
            )
        )
    with pytest.raises(ValueError, match="unknown environment_type 'dockr'"):
        HarborSpec(BUNDLED_SUITE, environment_type="dockr", preflight=True)


_NOT_ROOT = """
import json, logging, sys
from trl_harbor import HarborSpec

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
suite = sys.argv[2].rsplit("/", 1)[0] + "/examples/tasks"
HarborSpec(suite, environment_type="local", preflight=True).environment_factory()
print(json.dumps({"built": True}))
"""


@requires_local
@unprivileged_test
@pytest.mark.parametrize("subids", [True, False], ids=["subordinate-ids", "one-id"])
def test_without_root_task_images_pass_the_preflight(subids: bool) -> None:
    """Task images need no root: with subordinate ids the spec builds silently; with none it builds and
    the log says what differs from Docker (one id) and how to get them."""
    done = run_unprivileged(_NOT_ROOT, subids=subids)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"built": True}
    said = "no subordinate ids" in done.stderr and "usermod --add-subuids" in done.stderr
    assert said != subids, done.stderr[-3000:]


def test_task_toml_typos_are_refused_and_other_unknown_keys_only_logged(
    copy_tasks, caplog: pytest.LogCaptureFixture
) -> None:
    suite = copy_tasks(GOLD_TASK)
    toml = suite / GOLD_TASK / "task.toml"
    original = toml.read_text()
    toml.write_text(original.replace("[agent]", "[agent]\ntimeout_secs = 5", 1))
    with pytest.raises(TaskSuiteError, match=r"\[agent\] 'timeout_secs'.*did you mean 'timeout_sec'"):
        HarborSpec(suite, environment_type="local")
    toml.write_text(original.replace("[agent]", "[agent]\nsomething_else_entirely = 5", 1))
    with caplog.at_level("WARNING", logger="trl_harbor"):
        HarborSpec(suite, environment_type="local")
    assert "something_else_entirely" in caplog.text


# ── the whole-batch guard ─────────────────────────────────────────────────────────────


def test_batch_guard_thresholds() -> None:
    from trl_harbor.rollout import Cause, Verification

    lost = Verification(None, cause=Cause.INFRASTRUCTURE, reason="sandbox start failed for task 'x': no daemon")
    fine = Verification(1.0)
    check_batch([lost])  # one rollout alone is an isolated failure
    check_batch([lost, fine])  # half a batch: the default stops only a batch lost whole
    check_batch([lost, lost], None)  # never
    with pytest.raises(InfrastructureFailureError, match=r"(?s)2 of 2 rollouts.*2 x sandbox start failed"):
        check_batch([lost, lost])
    with pytest.raises(InfrastructureFailureError, match=r"1 of 2 rollouts"):
        check_batch([lost, fine], 0.5)


@requires_local
def test_a_batch_lost_to_the_backend_stops_the_reward_function(tmp_path: Path, close_sandboxes: None) -> None:
    """Real sandboxes: a batch whose every sandbox fails to start raises with the cause; a mixed one does not."""
    suite = tmp_path / "suite"
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / "a_good")
    shutil.copytree(BUNDLED_SUITE / GOLD_TASK, suite / "b_unstartable")
    (suite / "b_unstartable" / "environment" / "Dockerfile").write_text(BASE_DOCKERFILE + "RUN exit 7\n")

    def batch(spec: HarborSpec, names: list[str]) -> list:
        by_name = {p.name: str(p) for p in spec.task_dirs}
        envs = [spec.environment_factory() for _ in names]
        for env, name in zip(envs, names, strict=True):
            env.reset(task_dir=by_name[name])
        reward = spec.reward_funcs
        return reward(completions=[None] * len(envs), environments=envs)

    spec = HarborSpec(suite, environment_type="local")
    assert batch(spec, ["a_good", "b_unstartable"]) == [0.0, None]  # one lost rollout: training goes on
    with pytest.raises(InfrastructureFailureError, match=r"(?s)2 of 2 rollouts.*RUN exit 7") as caught:
        batch(spec, ["b_unstartable", "b_unstartable"])
    # The error's advice, as written, goes on.
    assert "HarborSpec(..., options=HarborOptions(infra_stop_fraction=None))" in str(caught.value)
    lenient = HarborSpec(suite, environment_type="local", options=HarborOptions(infra_stop_fraction=None))
    assert batch(lenient, ["b_unstartable", "b_unstartable"]) == [None, None]
    with pytest.warns(FutureWarning, match="options=HarborOptions"):  # the deprecated way still works
        by_kwargs = HarborSpec(suite, environment_type="local", env_kwargs={"infra_stop_fraction": None})
    assert batch(by_kwargs, ["b_unstartable", "b_unstartable"]) == [None, None]
    strict = HarborSpec(suite, environment_type="local", options=HarborOptions(infra_stop_fraction=0.5))
    with pytest.raises(InfrastructureFailureError, match=r"1 of 2 rollouts"):
        batch(strict, ["a_good", "b_unstartable"])


@pytest.mark.slow
def test_training_on_docker_without_a_daemon_stops_at_the_first_step(tmp_path: Path, no_docker_daemon: None) -> None:
    """The case that used to train on, learning nothing: now trainer.train() raises the cause."""
    from trl_harbor.testing import tool_call_text

    spec = HarborSpec(
        BUNDLED_SUITE,
        environment_type="docker",
        indices=[sorted(p.name for p in BUNDLED_SUITE.iterdir()).index(GOLD_TASK)],
        preflight=False,
    )
    call = tool_call_text("bash", {"command": "ls"})
    trainer = tiny_grpo_trainer(tmp_path, spec, [call], HarborBashEnv.PROMPT_SUFFIX, spec.reward_funcs)
    try:
        with pytest.raises(InfrastructureFailureError, match=r"(?s)2 of 2 rollouts.*sandbox start failed"):
            trainer.train()
    finally:
        close_all()
    assert trainer.state.global_step == 0


def test_check_resolves_the_backend_once_and_an_unknown_one_stops_it(tmp_path: Path, capsys) -> None:
    from sandbox_helpers import make_task
    from trl_harbor.cli import main as cli_main

    make_task(tmp_path / "suite", name="one")
    assert cli_main(["check", str(tmp_path / "suite"), "-e", "dockr"]) == 2
    assert "unknown environment_type 'dockr'" in capsys.readouterr().err
