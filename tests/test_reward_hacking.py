"""An agent earns nothing by gaming the verifier (issues #12, #17), through every harness, on real sandboxes.

One task whose verifier writes 1 only for the right answer, on a task image (the local sandbox's
default root). Each exploit is a rollout whose tool calls try to get 1 without the answer:
processes left running to write the reward file while the verifier runs (detached in every way a
process can detach), code planted where the verifier's interpreter runs it, fake tools earlier on
``PATH`` or in place of the image's, files planted among the tests.

Since issue #17 the agent's processes are **kept** while the verifier runs, as in Harbor's shared
trial (a service the task asked for answers the tests): every exploit must score 0.0 because it
gains nothing — the verifier runs in a view of the sandbox that those processes cannot see or
touch, on the image's own code — and an honest solution that leaves a server running scores 1.0.
Since issue #31 the verifier reads the agent's files live, so an honest answer a background job
writes once grading has begun scores 1.0 too, as in Harbor. So that each exploit is known to be a real one, the same exploits run again with the
defences off (``sandbox_helpers.defences_off``), where each of them scores 1.0. A backend fault in
the same batch is still skipped and counted.

Backends without an isolated view (Docker, cloud sandboxes) take the generic path, also tested
here on real local sandboxes: the agent's processes killed (``agent_processes="kill"``) and its
tampering refused (the fingerprint check of ``trl_harbor.rollout.integrity``).
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from conftest import requires_local

from sandbox_helpers import BASE_DOCKERFILE, defences_off, isolation_off, without_members
from trl_harbor import HarborOptions, HarborSpec
from trl_harbor.rollout import COUNTERS

GOLD = "42"
#: The verifier (the image's `run-grader`) sleeps after grading, then keeps whatever reward file is
#: there: a window in which anything still running beside it could rewrite it.
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
rm -f /logs/verifier/reward.txt
touch /workdir/.verifying
run-grader
sleep 0.5
[ -s /logs/verifier/reward.txt ] || echo 0 > /logs/verifier/reward.txt
"""
GRADE_PY = f"""import json, pathlib
answer = pathlib.Path("/workdir/answer.txt")
ok = answer.exists() and answer.read_text().strip() == {GOLD!r}
pathlib.Path("/logs/verifier/reward.txt").write_text("1" if ok else "0")
print(json.dumps({{"ok": ok}}))
"""
#: The service task's grader: a server the agent left running must answer it.
GRADE_SERVICE_PY = f"""import pathlib, urllib.request
try:
    ok = urllib.request.urlopen("http://127.0.0.1:8080/answer.txt", timeout=10).read().decode().strip() == {GOLD!r}
except OSError:
    ok = False
pathlib.Path("/logs/verifier/reward.txt").write_text("1" if ok else "0")
"""
DOCKERFILE = (
    BASE_DOCKERFILE
    + "RUN printf '#!/bin/sh\\nexec python3 /tests/grade.py\\n' > /usr/bin/run-grader && chmod +x /usr/bin/run-grader\n"
    + "WORKDIR /workdir\n"
)

WRITE_ONE = "echo 1 > /logs/verifier/reward.txt 2>/dev/null"
LOOP = f"while :; do {WRITE_ONE}; sleep 0.002; done"
SITE = '$(python3 -c "import site; print(site.getsitepackages()[0])")'
HOOK = 'import os; os.path.isdir("/tests") and (open("/logs/verifier/reward.txt","w").write("1"), os._exit(0))'
FAKE = f"printf '#!/bin/sh\\n{WRITE_ONE}\\n'"

#: name -> the shell command of a one-call rollout that tries to score without the answer.
EXPLOITS = {
    "nohup writer": f"nohup sh -c '{LOOP}' >/dev/null 2>&1 &",
    "double-forked daemon": f"(sh -c '{LOOP}' >/dev/null 2>&1 &) ; true",
    "own session": f"setsid sh -c '{LOOP}' >/dev/null 2>&1 < /dev/null &",
    "ignores SIGTERM": f"nohup sh -c 'trap \"\" TERM HUP INT; {LOOP}' >/dev/null 2>&1 &",
    ".pth plant": f"echo '{HOOK}' > {SITE}/zz.pth",
    "fake python3 first on PATH": f"{FAKE} > /usr/local/bin/python3 && chmod +x /usr/local/bin/python3",
    "fake grader first on PATH": f"{FAKE} > /usr/local/bin/run-grader && chmod +x /usr/local/bin/run-grader",
    "the image's grader replaced": f"{FAKE} > /usr/bin/run-grader",
    "module planted among the tests": (
        'mkdir -p /tests && echo \'import os; open("/logs/verifier/reward.txt","w").write("1"); '
        "os._exit(0)' > /tests/json.py"
    ),
}
#: Exploits the generic path's tamper check refuses (the rest it stops by killing the processes).
TAMPERING = (
    ".pth plant",
    "fake python3 first on PATH",
    "fake grader first on PATH",
    "the image's grader replaced",
    "module planted among the tests",
)
#: Sabotage that gains nothing even undefended: it must simply score 0, never be skipped.
SABOTAGE = {
    "rm -rf /logs": "rm -rf /logs",
    "kills every process": "kill -9 -1",
}
HONEST = f"nohup sleep 600 >/dev/null 2>&1 & echo {GOLD} > /workdir/answer.txt"
#: An honest answer a background job writes once grading has begun (the verifier sees the agent's
#: files live, as in Harbor's shared trial: issue #31).
HONEST_LATE = (
    f"nohup sh -c 'while :; do [ -e /workdir/.verifying ] && echo {GOLD} > /workdir/answer.txt; "
    "sleep 0.002; done' >/dev/null 2>&1 &"
)
#: The service task's honest solution: a server left running, which the verifier connects to.
HONEST_SERVICE = (
    f"mkdir -p /srv/www && echo {GOLD} > /srv/www/answer.txt && "
    "(nohup python3 -m http.server 8080 --directory /srv/www >/dev/null 2>&1 &) && sleep 1"
)

#: harness -> how a rollout runs one shell command through it.
HARNESSES = {
    "bash": lambda env, command: env.bash(command),
    "jupyter": lambda env, command: env.execute_shell_command(command),
    "terminal_notes": lambda env, command: env.shell_exec(command, blocking=True),
}


def _write_task(root: Path, name: str, grade_py: str, dockerfile: str = DOCKERFILE) -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "instruction.md").write_text("Write the answer to /workdir/answer.txt\n")
    (task / "task.toml").write_text(
        textwrap.dedent(
            """\
            version = "1.0"
            [verifier]
            timeout_sec = 120
            [agent]
            timeout_sec = 60
            [environment]
            network_mode = "no-network"
            memory_mb = 512
            """
        )
    )
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "tests" / "test.sh").chmod(0o755)
    (task / "tests" / "grade.py").write_text(grade_py)
    return task


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hack") / "tasks"
    _write_task(root, "guard", GRADE_PY)
    _write_task(root, "service", GRADE_SERVICE_PY)
    broken = _write_task(root, "unstartable", GRADE_PY)
    (broken / "environment" / "Dockerfile").write_text(BASE_DOCKERFILE + "RUN apt-get install -y no-such-package\n")
    return root


def _rollouts(
    suite: Path, harness: str, commands: dict[str, str], env_kwargs: dict | None = None
) -> tuple[dict[str, float | None], dict]:
    """One batch: each command a one-call rollout (``honest service`` on the service task), plus an
    unstartable task; verified together. Returns the rewards and the verifications, by name."""
    spec = HarborSpec(
        suite,
        agent=harness,
        environment_type="local",
        options=HarborOptions(command_timeout_sec=60, **(env_kwargs or {})),
    )
    by_name = {path.name: str(path) for path in spec.task_dirs}
    names = [*commands, "backend fault"]
    envs = [spec.environment_factory() for _ in names]
    for env, name in zip(envs, names, strict=True):
        task = "unstartable" if name == "backend fault" else "service" if "service" in name else "guard"
        env.reset(task_dir=by_name[task])
    for env, name in zip(envs[:-1], names[:-1], strict=True):
        HARNESSES[harness](env, commands[name])
    extra: dict[str, list] = {}
    rewards = spec.reward_funcs(completions=[None] * len(envs), environments=envs, log_extra=extra.__setitem__)
    outcome = dict(zip(names, rewards, strict=True))
    reasons = dict(zip(names, extra["harbor_error"], strict=True))
    assert outcome.pop("backend fault") is None and "start failed" in reasons["backend fault"]
    return outcome, {name: env.verification for name, env in zip(names, envs, strict=True)}


@requires_local
@pytest.mark.parametrize("harness", list(HARNESSES))
def test_every_exploit_scores_zero_and_honest_solutions_one(suite: Path, harness: str, close_sandboxes: None) -> None:
    """The defaults: the agent's processes keep running, and gain nothing; a server left running answers."""
    before_infra = COUNTERS.infra_failures()
    commands = {**EXPLOITS, **SABOTAGE, "honest": HONEST, "honest service": HONEST_SERVICE, "honest late": HONEST_LATE}
    outcome, verifications = _rollouts(suite, harness, commands)
    assert outcome.pop("honest") == 1.0
    assert outcome.pop("honest service") == 1.0
    assert outcome.pop("honest late") == 1.0
    assert outcome == dict.fromkeys(outcome, 0.0), outcome
    assert COUNTERS.infra_failures()["start"] == before_infra["start"] + 1  # the backend fault, counted once
    assert COUNTERS.infra_failures()["verify"] == before_infra["verify"]  # nothing the agent did is an infra failure
    planted = verifications[".pth plant"]
    assert any("zz.pth" in entry for entry in planted.concealed), planted  # what the verifier did not see, recorded


@requires_local
def test_jupyter_kernel_left_writing_the_reward_scores_zero(suite: Path, close_sandboxes: None) -> None:
    spec = HarborSpec(suite, agent="jupyter", environment_type="local")
    env = spec.environment_factory()
    env.reset(task_dir=str(suite / "guard"))
    code = (
        "import threading, time\n"
        "def w():\n"
        "    while True:\n"
        "        try: open('/logs/verifier/reward.txt', 'w').write('1')\n"
        "        except OSError: pass\n"
        "        time.sleep(0.002)\n"
        "threading.Thread(target=w, daemon=True).start()\n"
        "print('started')"
    )
    assert "started" in env.add_and_execute_code_cell(code)
    assert env.reward == 0.0


@requires_local
def test_the_exploits_are_real_without_the_defences(
    suite: Path, monkeypatch: pytest.MonkeyPatch, close_sandboxes: None
) -> None:
    """With the verifier beside the agent's processes and no tamper check, each exploit does score 1:
    the tests above can fail."""
    outcome, _ = _rollouts(suite, "bash", {**EXPLOITS, "honest service": HONEST_SERVICE}, defences_off(monkeypatch))
    assert outcome == dict.fromkeys(outcome, 1.0), outcome


@requires_local
def test_the_generic_path_kills_the_agent_and_refuses_tampering(suite: Path, close_sandboxes: None) -> None:
    """Backends without an isolated view, with ``agent_processes="kill"``: every exploit 0, the tampering
    refused as such; an honest answer 1, but a task graded through a service the agent left scores 0."""
    before = COUNTERS.by_cause()["tampered"]
    commands = {**EXPLOITS, "honest": HONEST, "honest service": HONEST_SERVICE}
    outcome, verifications = _rollouts(
        suite, "bash", commands, {"agent_processes": "kill", "backend_options": isolation_off()}
    )
    assert outcome.pop("honest") == 1.0
    assert outcome.pop("honest service") == 0.0  # its server was killed: why "keep" is the default
    assert outcome == dict.fromkeys(outcome, 0.0), outcome
    assert COUNTERS.by_cause()["tampered"] == before + len(TAMPERING), [
        (name, v.tampered) for name, v in verifications.items() if v is not None and v.tampered
    ]


@requires_local
def test_the_generic_path_keeps_services_and_still_refuses_tampering(suite: Path, close_sandboxes: None) -> None:
    """Backends without an isolated view, with ``agent_processes="keep"`` (Harbor's behaviour): the
    tampering is refused and a served answer counts (what is left running beside the verifier there is
    the residue docs/rewards.md names)."""
    commands = {name: EXPLOITS[name] for name in TAMPERING} | {"honest service": HONEST_SERVICE}
    outcome, _ = _rollouts(suite, "bash", commands, {"agent_processes": "keep", "backend_options": isolation_off()})
    assert outcome.pop("honest service") == 1.0
    assert outcome == dict.fromkeys(outcome, 0.0), outcome


@requires_local
def test_tampering_is_reported_with_its_changes_and_allowed_changes_are_honoured(
    suite: Path, close_sandboxes: None
) -> None:
    """On the generic path: a refused change names itself; an install passes; a declared change is allowed."""
    task = str(suite / "guard")
    generic = {"backend_options": isolation_off()}
    spec = HarborSpec(suite, environment_type="local", options=HarborOptions(**generic))
    env = spec.environment_factory()
    env.reset(task_dir=task)
    env.bash(f"{EXPLOITS['.pth plant']}; echo {GOLD} > /workdir/answer.txt")
    assert env.reward == 0.0
    verification = env.verification
    assert not verification.infra and any(path.endswith("/zz.pth (added)") for path in verification.tampered)
    assert "changed what the verifier runs" in verification.reason

    # An install (a new package, a new command) is not tampering: the answer still counts.
    env.reset(task_dir=task)
    env.bash(
        f"mkdir -p {SITE}/newpkg && touch {SITE}/newpkg/__init__.py && printf '#!/bin/sh\\n' > /usr/local/bin/newtool "
        f"&& chmod +x /usr/local/bin/newtool && echo {GOLD} > /workdir/answer.txt"
    )
    assert env.reward == 1.0 and not env.verification.tampered, env.verification

    # What a task (or the user) declares may change is allowed; a start-up hook only where it is named
    # exactly (a glob never crosses "/" and a wildcard never admits a hook).
    site = "/usr/local/lib/python3.11/dist-packages"  # the task image's (SITE, as the shell finds it)
    for allowed, reward in (([f"{site}/zz.pth"], 1.0), ([f"{site}/zz*"], 0.0), (["*/dist-packages/zz.pth"], 0.0)):
        allowing = HarborSpec(
            suite, environment_type="local", options=HarborOptions(allowed_changes=allowed, **generic)
        )
        env = allowing.environment_factory()
        env.reset(task_dir=task)
        env.bash(f"echo 'import sys' > {SITE}/zz.pth; echo {GOLD} > /workdir/answer.txt")
        assert env.reward == reward, (allowed, env.verification)


@requires_local
def test_a_planted_hook_is_concealed_and_the_answer_still_counts(suite: Path, close_sandboxes: None) -> None:
    """With the isolated view, a change to what the verifier runs is not refused: the verifier does not
    see it (it runs the image's code), the rollout is graded on its answer, and the change is recorded."""
    spec = HarborSpec(suite, environment_type="local")
    env = spec.environment_factory()
    env.reset(task_dir=str(suite / "guard"))
    plants = f"{EXPLOITS['.pth plant']}; {EXPLOITS[TAMPERING[3]]}"
    env.bash(f"{plants}; echo {GOLD} > /workdir/answer.txt")
    assert env.reward == 1.0, env.verification
    concealed = env.verification.concealed
    assert any("zz.pth" in entry for entry in concealed) and any("run-grader" in entry for entry in concealed), (
        concealed
    )


# ── the tamper policy itself (pure functions) ─────────────────────────────────────────


def test_tamper_policy_refuses_replacing_and_shadowing_and_lets_installs_through() -> None:
    from trl_harbor.rollout.integrity import Change, violations, watches

    site = "/usr/local/lib/python3.12/site-packages"
    watched = watches(["/opt/venv/bin", "/usr/local/bin", "/usr/bin"], ["/usr/local/lib/python3.12", site])
    before = {
        "/usr/local/bin/python3": "f|755|1|1|1",
        "/usr/bin/pytest": "f|755|1|2|1",
        f"{site}/numpy": "d|755",
        f"{site}/numpy/__init__.py": "f|644|1|3|1",
        "/usr/local/lib/python3.12/json": "d|755",
    }

    def bad(*changes: tuple[str, str], allowed: tuple[str, ...] = ()) -> list[str]:
        found = violations([Change(p, k) for p, k in changes], before, watched, allowed)
        return [c.path for c in found]

    assert bad(("/opt/venv/bin/pytest", "added")) == ["/opt/venv/bin/pytest"]  # shadows /usr/bin/pytest
    assert bad(("/usr/local/bin/python3", "modified")) == ["/usr/local/bin/python3"]
    assert bad(("/usr/bin/pytest", "removed")) == ["/usr/bin/pytest"]
    assert bad(("/opt/venv/bin/mytool", "added")) == []  # a new command: an install
    assert bad((f"{site}/zz.pth", "added")) == [f"{site}/zz.pth"]
    assert bad((f"{site}/sitecustomize.py", "added"), (f"{site}/usercustomize", "added")) == [
        f"{site}/sitecustomize.py",
        f"{site}/usercustomize",
    ]
    assert bad((f"{site}/numpy/__init__.py", "modified")) == [f"{site}/numpy/__init__.py"]
    assert bad((f"{site}/json.py", "added")) == [f"{site}/json.py"]  # shadows the stdlib's json
    assert bad((f"{site}/requests", "added"), (f"{site}/requests/__init__.py", "added")) == []  # an install
    assert bad(("/root/.profile", "modified"), ("/etc/profile.d/x.sh", "added"), ("/tests/conftest.py", "added")) == [
        "/root/.profile",
        "/etc/profile.d/x.sh",
        "/tests/conftest.py",
    ]
    assert bad(("/workdir/answer.txt", "modified")) == []  # not watched: the answer itself
    assert bad((f"{site}/zz.pth", "added"), allowed=(f"{site}/zz.pth",)) == []
    # a glob never crosses "/", and admits a start-up hook only where it names it exactly
    assert bad((f"{site}/zz.pth", "added"), allowed=("*/zz.pth",)) == [f"{site}/zz.pth"]
    assert bad((f"{site}/zz.pth", "added"), allowed=(f"{site}/zz*",)) == [f"{site}/zz.pth"]
    assert bad((f"{site}/zzpkg/__init__.py", "modified"), allowed=(f"{site}/zz*",)) == []


def test_generic_fingerprint_command_matches_the_host_side_walk(tmp_path: Path) -> None:
    """The shell form (for backends without a native one) parses into the same paths."""
    import subprocess

    from trl_harbor.rollout.integrity import Watch, fingerprint_command, parse_fingerprints

    (tmp_path / "a b").mkdir()
    (tmp_path / "a b" / "f.txt").write_text("x")
    (tmp_path / "a b" / "deep").mkdir()
    (tmp_path / "a b" / "deep" / "g").write_text("y")
    (tmp_path / "link").symlink_to("/etc/passwd")
    watched = [Watch(f"{tmp_path}/a*", 1, "path"), Watch(f"{tmp_path}/link", None, "locked")]
    out = subprocess.run(["sh", "-c", fingerprint_command(watched)], capture_output=True, check=True).stdout
    found = parse_fingerprints(out)
    assert set(found) == {f"{tmp_path}/a b", f"{tmp_path}/a b/f.txt", f"{tmp_path}/a b/deep", f"{tmp_path}/link"}
    assert found[f"{tmp_path}/a b"].startswith("d|") and found[f"{tmp_path}/link"].startswith("l|")


@requires_local
def test_the_generic_path_by_shell_scripts_also_scores_every_exploit_zero(
    suite: Path, monkeypatch: pytest.MonkeyPatch, close_sandboxes: None
) -> None:
    """Backends without native process kills and file fingerprints (Docker, cloud) use shell scripts
    run in the sandbox; here they run in real local sandboxes whose native forms are hidden."""
    from harbor_local_sandbox.local import LocalEnvironment

    without_members(monkeypatch, LocalEnvironment, "kill_processes", "list_processes", "file_fingerprints")
    outcome, _ = _rollouts(
        suite, "bash", {**EXPLOITS, "honest": HONEST}, {"agent_processes": "kill", "backend_options": isolation_off()}
    )
    assert outcome.pop("honest") == 1.0
    assert outcome == dict.fromkeys(outcome, 0.0), outcome


@requires_local
@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="memory limits are cgroups, which need root")
def test_a_sandbox_the_rollout_filled_up_scores_zero_not_skipped(tmp_path: Path, close_sandboxes: None) -> None:
    """Files filling the sandbox's memory until its supervisor is OOM-killed: the rollout's doing, scored 0."""
    root = tmp_path / "tasks"
    task = root / "small"
    shutil.copytree(Path(__file__).parent.parent / "examples" / "tasks" / "orders_count", task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("memory_mb = 1024", "memory_mb = 96"))
    spec = HarborSpec(root, environment_type="local")  # the default root: the task's image
    env = spec.environment_factory()
    env.reset(task_dir=str(task))
    env.bash("for i in $(seq 1 40); do head -c 8M /dev/zero > /root/fill$i || break; done; true")
    for _ in range(5):  # keep forking until the sandbox gives out
        env.bash("python3 -c 'x = bytearray(64 << 20)'")
    reward = env.reward
    verification = env.verification
    if verification.reason and "exhausted" in verification.reason:
        assert reward == 0.0 and not verification.infra
    else:  # the kernel spared the supervisor this time: then the sandbox answered and grading ran
        assert reward == 0.0 and not verification.infra, verification
