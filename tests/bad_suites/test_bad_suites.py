"""Broken suites: each a clear error when the spec is built, or a rollout scored (or skipped) with its reason.

Two kinds of breakage. What can be seen on disk — a missing file, bad TOML, an unknown or
mistyped key, a value of the wrong type, a link out of the suite — is refused by ``HarborSpec``
(``trl_harbor.rollout.suite.load_suite`` and the spec's own checks) with a message naming the file, the
field and the fix. What only shows when the task runs — a ``test.sh`` that writes no reward, a
NaN or infinite reward, a ``reward.json`` that is a bare number, a verifier that hangs, a
Dockerfile step that fails — costs its one rollout: scored 0 with the reason (the verification
broke in a healthy sandbox) or skipped as an infrastructure failure (the sandbox never started),
never an exception out of the reward function. Every broken rollout runs in one batch with an
honest one, through ``spec.reward_funcs`` exactly as ``GRPOTrainer`` calls it.

A table of every case and its outcome is printed at the end of the session.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_helpers import BASE_DOCKERFILE
from trl_harbor import HarborOptions, HarborSpec, close_all
from trl_harbor.rollout.suite import TaskSuiteError

GOLD = "42"
TASK_TOML = """\
version = "1.0"
[metadata]
gold_answer = "42"
[verifier]
timeout_sec = 60
[agent]
timeout_sec = 60
[environment]
network_mode = "no-network"
memory_mb = 512
cpus = 1
"""
GOOD_TEST = '#!/bin/bash\n[ "$(cat /workdir/answer.txt)" = "42" ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'

#: (case, outcome) rows for the table, in order.
ROWS: list[tuple[str, str, str]] = []


def write_task(root: Path, name: str) -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "environment" / "Dockerfile").write_text(BASE_DOCKERFILE + "WORKDIR /workdir\n")
    (task / "instruction.md").write_text("Write the answer to /workdir/answer.txt\n")
    (task / "task.toml").write_text(TASK_TOML)
    (task / "tests" / "test.sh").write_text(GOOD_TEST)
    (task / "tests" / "test.sh").chmod(0o755)
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\necho {GOLD} > /workdir/answer.txt\n")
    return task


def _toml(old: str, new: str) -> Callable[[Path], None]:
    def edit(task: Path) -> None:
        text = (task / "task.toml").read_text()
        assert old in text, old
        (task / "task.toml").write_text(text.replace(old, new, 1))

    return edit


def _append_toml(extra: str) -> Callable[[Path], None]:
    return lambda task: (task / "task.toml").write_text((task / "task.toml").read_text() + extra)


def _link(rel: str, target: Callable[[Path], Path]) -> Callable[[Path], None]:
    def edit(task: Path) -> None:
        path = task / rel
        path.unlink(missing_ok=True)
        path.symlink_to(target(task))

    return edit


def _outside(task: Path) -> Path:
    """A file next to the suite (outside it), as a link target."""
    outside = task.parents[1] / "outside.txt"
    outside.write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    return outside


def _compose(text: str) -> Callable[[Path], None]:
    return lambda task: (task / "environment" / "docker-compose.yaml").write_text(textwrap.dedent(text))


def _test(script: str) -> Callable[[Path], None]:
    def edit(task: Path) -> None:
        (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + textwrap.dedent(script))

    return edit


#: name -> (what breaks the task, a pattern the error message must match).
SPEC_ERRORS: dict[str, tuple[Callable[[Path], None], str]] = {
    "instruction.md missing": (lambda t: (t / "instruction.md").unlink(), r"instruction\.md is missing\. Fix"),
    "task.toml missing": (lambda t: (t / "task.toml").unlink(), r"task\.toml is missing\. Fix"),
    "tests/test.sh missing": (lambda t: (t / "tests" / "test.sh").unlink(), r"tests/test\.sh is missing\. Fix"),
    "bad TOML": (_append_toml("[verifier\ntimeout_sec = 3\n"), r"not valid TOML .*Fix: correct the syntax"),
    "unknown key (a typo)": (
        _toml("timeout_sec = 60", "timeout_secs = 60"),
        r"\[verifier\] 'timeout_secs'.*did you mean 'timeout_sec'",
    ),
    "unknown table (a typo)": (_append_toml("[environmnet]\ncpus = 2\n"), r"'environmnet'.*did you mean 'environment'"),
    "wrong type": (_toml("timeout_sec = 60", 'timeout_sec = "ten"'), r"verifier\.timeout_sec.*valid number"),
    "wrong enum value": (_toml('"no-network"', '"sometimes"'), r"network_mode.*'no-network', 'public'"),
    "negative size": (_toml("cpus = 1", "cpus = -2"), r"environment\.cpus = -2 is negative\. Fix"),
    "test.sh links out of the suite": (
        _link("tests/test.sh", _outside),
        r"(?s)tests/test\.sh.*links to .*outside the suite|Input paths must stay",
    ),
    "instruction.md links out of the suite": (
        _link("instruction.md", lambda t: Path("/etc/hostname")),
        r"instruction\.md.*links to /etc/hostname, outside the suite",
    ),
    "environment file links out of the suite": (
        _link("environment/data.txt", lambda t: Path("/etc/passwd")),
        r"environment/data\.txt.*links to /etc/passwd, outside the suite",
    ),
    "an artifact path with '..'": (
        _toml('version = "1.0"', 'version = "1.0"\nartifacts = ["/logs/../../etc"]'),
        r"Harbor rejects the task: .*Artifact source must not contain '\.\.'.*Fix",
    ),
    "compose: a privileged service": (
        _compose("services:\n  helper:\n    image: debian:bookworm-slim\n    privileged: true\n"),
        r"docker-compose\.yaml: service 'helper': `privileged`: no sandbox runs privileged.*Fix: remove it",
    ),
    "compose: a host folder mounted": (
        _compose("services:\n  helper:\n    image: debian:bookworm-slim\n    volumes: ['/etc:/host-etc']\n"),
        r"docker-compose\.yaml: service 'helper': `volumes` entry /etc:/host-etc: a bind mount of a host path.*Fix",
    ),
    "unset ${VAR} in [verifier.env]": (
        _append_toml('[verifier.env]\nTOKEN = "${TRL_HARBOR_SURELY_UNSET_VARIABLE}"\n'),
        r"TOKEN.*Fix: set it on this machine",
    ),
}

#: name -> (what breaks the task, expected reward, whether an infrastructure failure, a pattern of the reason).
ROLLOUTS: dict[str, tuple[Callable[[Path], None], float | None, bool, str]] = {
    "honest (control)": (lambda t: None, 1.0, False, r"^$"),
    "test.sh writes no reward": (_test("echo graded\n"), 0.0, False, r"healthy sandbox \(RewardFileNotFound"),
    "NaN reward": (_test("echo nan > /logs/verifier/reward.txt\n"), 0.0, False, r"(?i)finite|nan"),
    "infinite reward": (_test("echo inf > /logs/verifier/reward.txt\n"), 0.0, False, r"(?i)finite|inf"),
    "NaN in reward.json": (
        _test("echo '{\"reward\": NaN}' > /logs/verifier/reward.json\n"),
        0.0,
        False,
        r"(?i)finite|nan",
    ),
    "reward.json is a bare number": (
        _test("echo 1 > /logs/verifier/reward.json\n"),
        0.0,
        False,
        r"(?i)reward\.json|object|dict",
    ),
    "reward.json holds a string": (
        _test('echo \'{"reward": "1"}\' > /logs/verifier/reward.json\n'),
        0.0,
        False,
        r"(?i)number|numeric",
    ),
    "empty reward.txt": (_test(": > /logs/verifier/reward.txt\n"), 0.0, False, r"(?i)reward"),
    "test.sh with a syntax error": (_test("if then fi (\n"), 0.0, False, r"RewardFileNotFound"),
    "a verifier that hangs": (
        lambda t: (_toml("timeout_sec = 60", "timeout_sec = 3")(t), _test("sleep 600\n")(t)),
        0.0,
        False,
        r"healthy sandbox .*ran past its timeout \(3 s\)",
    ),
    "a Dockerfile step that fails": (
        lambda t: (t / "environment" / "Dockerfile").write_text(BASE_DOCKERFILE + "RUN exit 3\n"),
        None,
        True,
        r"sandbox start failed for task 'a Dockerfile step that fails'.*(?i:build)",
    ),
    "a compose service that never becomes healthy": (
        _compose(
            """\
            services:
              main:
                depends_on:
                  db: {condition: service_healthy}
              db:
                image: debian:bookworm-slim
                command: ["sh", "-c", "echo db is broken; exec sleep infinity"]
                healthcheck: {test: ["CMD", "false"], interval: 200ms, retries: 2}
            """
        ),
        None,
        True,
        r"ServiceUnhealthyError: compose service 'db' never became healthy.*db is broken",
    ),
    "reward_weights naming a missing key": (
        _toml('gold_answer = "42"', 'gold_answer = "42"\nreward_weights = { accuracy = 1.0 }'),
        None,
        True,
        r"reward weights name \['accuracy'\]",
    ),
}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@pytest.mark.parametrize("name", list(SPEC_ERRORS))
def test_a_broken_task_is_a_clear_error_at_spec_build(tmp_path: Path, name: str) -> None:
    breaks, pattern = SPEC_ERRORS[name]
    suite = tmp_path / "suite"
    write_task(suite, "fine")
    broken = write_task(suite, _slug(name))
    breaks(broken)
    with pytest.raises(TaskSuiteError) as caught:
        HarborSpec(suite, environment_type="local")
    message = str(caught.value)
    first = message.split("\n", 2)[1].replace(str(broken), "<task>").strip(" -")
    ROWS.append((name, "spec build", f"TaskSuiteError: {first[:150]}"))
    assert str(broken) in message, message  # names the task (and file)
    assert "fine" not in message.replace(str(tmp_path), ""), message  # and only the broken one
    assert re.search(pattern, message, re.S), message


@pytest.mark.local
def test_broken_verifications_cost_one_rollout_each_with_their_reason(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    for name, (breaks, *_) in ROLLOUTS.items():
        breaks(write_task(suite, name))
    spec = HarborSpec(suite, environment_type="local", options=HarborOptions(command_timeout_sec=30))
    by_name = {path.name: str(path) for path in spec.task_dirs}
    envs = [spec.environment_factory() for _ in ROLLOUTS]
    try:
        for env, name in zip(envs, ROLLOUTS, strict=True):
            env.reset(task_dir=by_name[name])
        for env in envs:
            env.bash(f"echo {GOLD} > /workdir/answer.txt")
        reward_func = spec.reward_funcs
        extra: dict[str, list] = {}
        metrics: dict[str, float] = {}
        rewards = reward_func(
            completions=[None] * len(envs),
            environments=envs,
            log_extra=extra.__setitem__,
            log_metric=metrics.__setitem__,
        )
    finally:
        close_all()
    failures = []
    for (name, (_, reward, infra, pattern)), got, env, reason in zip(
        ROLLOUTS.items(), rewards, envs, extra["harbor_error"], strict=True
    ):
        shown = "skipped (None)" if got is None else f"scored {got}"
        brief = re.sub(r"/tmp/\S+/", "", " ".join(reason.split()))[:150]
        ROWS.append((name, "rollout", f"{shown}{' [infra]' if env.verification.infra else ''}: {brief}"))
        assert got is None or math.isfinite(got)
        if got != reward or env.verification.infra != infra or not re.search(pattern, reason, re.S):
            failures.append(f"{name}: expected {reward} (infra={infra}, /{pattern}/), got {got}: {reason!r}")
    assert not failures, "\n".join(failures)
    assert metrics["harbor/infra_failures"] == 3.0


@pytest.mark.local
def test_zz_table() -> None:
    """Every broken suite was tried; the table of outcomes is printed."""
    width = max(len(name) for name, *_ in ROWS) if ROWS else 10
    lines = ["broken suites", f"{'case':<{width}}  {'caught at':<10}  outcome"]
    lines += [f"{name:<{width}}  {stage:<10}  {outcome}" for name, stage, outcome in ROWS]
    print("\n" + "\n".join(lines))
    assert len(ROWS) == len(SPEC_ERRORS) + len(ROLLOUTS)
