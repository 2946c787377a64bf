"""The verifier's view (issue #31), attacked by class on real sandboxes: none wins, honest rollouts score 1.

Every case of ``view_corpus.CASES`` is one rollout of one batch (``agent="bash_steps"``), verified at
once by ``spec.reward_funcs`` as ``GRPOTrainer`` does. The batch runs twice:

* **defended** (the defaults): each case must score what it deserves — 0 for an attack, 1 for an
  honest rollout — and never be skipped (``None``); its ``check`` (what the tool output, the agent's
  own logs or the host show after grading) must hold;
* **undefended** (:func:`sandbox_helpers.defences_off`: the verifier in the agent's own sandbox,
  nothing hidden, no link mediation): each attack must *win* — score 1, or pass its
  ``undefended_check`` where its win is not a reward — so that the defended run can fail; each
  honest rollout scores 1 there too (the grade Harbor's shared trial gives).

Class 7 (our own bugs) is a test of its own: a programming error in how grading calls Harbor's
verifier is the infrastructure's, never the rollout's. The table (class, case, both runs) is printed
at the end of the session (``conftest.pytest_terminal_summary``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grading_batch
import pytest
from adv_table import GradingOutcome, render_grading
from view_corpus import CASES, CLASSES, NOT_RUN, ViewCase, ViewCtx, ViewSuite, write_suite

from sandbox_helpers import defences_off
from trl_harbor import HarborOptions, HarborSpec, close_all

requires_local = pytest.mark.local

COMMAND_TIMEOUT_SEC = 120
#: Every outcome of this module, in order (printed at the end of the session).
VIEW: list[GradingOutcome] = []


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> ViewSuite:
    return write_suite(tmp_path_factory.mktemp("view") / "tasks", "gold" + secrets.token_hex(6))


@pytest.fixture(scope="module")
def canary() -> Iterator[tuple[Path, str]]:
    """A host file the sandboxes must never read or change (class 2): mode 600, a random token.

    Not under ``/tmp`` (the keel refuses the agent's links there, which would make the race moot)."""
    folder = Path(tempfile.mkdtemp(prefix="trl-harbor-view-canary-", dir="/var/tmp"))
    token = "hostcanary" + secrets.token_hex(12)
    path = folder / "canary"
    path.write_text(token)
    path.chmod(0o600)
    yield path, token
    shutil.rmtree(folder, ignore_errors=True)


def _run_as_root(env, command: str) -> str:
    """A command in the agent's sandbox after grading (the harness's tools are closed by then)."""
    environment = env._environment
    if environment is None:
        return "<no sandbox>"
    try:
        result = env._run(environment.exec(command, timeout_sec=120, user="root"))
    except Exception as exc:  # noqa: BLE001 - the check reports it
        return f"<{type(exc).__name__}: {exc}>"
    return (result.stdout or "") + (result.stderr or "")


def _verifier_output(env) -> str:
    """What the verifier's test.sh printed (Harbor's ``test-stdout.txt`` in the trial folder)."""
    paths = env._paths
    try:
        return "" if paths is None else paths.test_stdout_path.read_text(errors="replace")
    except OSError as error:
        return f"<{error}>"


def run_batch(
    suite: ViewSuite, cases: list[ViewCase], label: str, canary: tuple[Path, str], env_kwargs: dict | None = None
) -> list[GradingOutcome]:
    """One batch of ``cases`` (:func:`grading_batch.run_batch`), recorded for the session's table."""
    ctx = ViewCtx(
        shell=lambda env, command: env.bash(command), gold=suite.gold, steps={}, canary=canary[0], token=canary[1],
        run=_run_as_root, verifier_output=_verifier_output,
    )  # fmt: skip
    outcomes = grading_batch.run_batch(
        suite.root, suite.task, cases, label, ctx, command_timeout_sec=COMMAND_TIMEOUT_SEC, env_kwargs=env_kwargs
    )
    VIEW.extend(outcomes)
    return outcomes


def render(results: list[GradingOutcome], details: bool = False) -> str:
    """The table of this module's outcomes (:func:`adv_table.render_grading`)."""
    return render_grading(
        results, details, title="the verifier's view (issue #31; local backend, task image)", classes=CLASSES
    )


def _assert_all_held(outcomes: list[GradingOutcome]) -> None:
    bad = [o for o in outcomes if o.problems]
    assert not bad, "\n" + render(bad, details=True)


def _cases() -> list[ViewCase]:
    """The batch's cases (3d needs the user-mode network: slirp4netns); ``VIEW_CASES``, a regular
    expression searched in their names, runs only those (while working on some)."""
    chosen = [case for case in CASES if re.search(os.environ.get("VIEW_CASES", ""), case.name)]
    if shutil.which("slirp4netns") is None:
        return [case for case in chosen if case.kind != "netphase"]
    return chosen


@requires_local
def test_the_user_mode_network_is_there_for_the_network_phase_cases() -> None:
    """Case 3d (an offline agent while the verifier is online) runs only where slirp4netns is installed: where it
    is not, the batches below leave those cases out, and this test fails (it never passes without them)."""
    assert shutil.which("slirp4netns") is not None, (
        "slirp4netns is not installed: the network-phase cases (3d) were left out of the batches "
        "(./scripts/bootstrap.sh installs it)"
    )
    assert any(case.kind == "netphase" for case in CASES), "no network-phase case in the corpus"


@requires_local
def test_view_attacks_score_nothing_and_honest_rollouts_one(suite: ViewSuite, canary: tuple[Path, str]) -> None:
    """Issue #31's classes with the defences: each attack scores 0 (never skipped), each honest rollout 1."""
    _assert_all_held(run_batch(suite, _cases(), "defended", canary))


@requires_local
def test_without_the_defences_every_attack_wins(
    suite: ViewSuite, canary: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rollouts with the defences off: each attack wins, each honest rollout still scores 1."""
    cases = [case for case in _cases() if case.undefended is not NOT_RUN]
    _assert_all_held(run_batch(suite, cases, "undefended", canary, defences_off(monkeypatch)))


# ── class 7: our own bugs are the infrastructure's ──────────────────────────────────────


@requires_local
def test_a_programming_error_in_grading_skips_the_rollout_and_stops_a_lost_batch(
    suite: ViewSuite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, close_sandboxes: None
) -> None:
    """Harbor's ``Verifier`` called with a keyword it does not take (a ``TypeError``): two honest rollouts
    come back skipped (``None``) with the error named and logged at WARNING with its traceback, and the
    batch guard stops a batch lost that way — or, with ``infra_stop_fraction=None``, only skips them."""
    from harbor.verifier import verifier as verifier_module

    from trl_harbor.rollout.preflight import InfrastructureFailureError

    def broken(self, *args, **kwargs):  # noqa: ANN001, ARG001
        raise TypeError("unexpected keyword argument 'step_name'")

    monkeypatch.setattr(verifier_module.Verifier, "__init__", broken)
    problems = []
    for stop_fraction in (1.0, None):
        spec = HarborSpec(
            suite.root,
            agent="bash_steps",
            environment_type="local",
            options=HarborOptions(command_timeout_sec=60, infra_stop_fraction=stop_fraction),
        )
        envs = [spec.environment_factory() for _ in range(2)]
        for env in envs:
            env.reset(task_dir=suite.task("sh"))
        for env in envs:
            env.bash(f"echo {suite.gold} > /workdir/answer.txt")
        caplog.clear()
        extra: dict[str, list] = {}
        rewards: list | None = None
        with caplog.at_level(logging.WARNING, logger="trl_harbor"):
            if stop_fraction is None:
                rewards = spec.reward_funcs(completions=[None, None], environments=envs, log_extra=extra.__setitem__)
            else:
                with pytest.raises(InfrastructureFailureError, match=r"(?s)2 of 2 rollouts.*TypeError") as raised:
                    spec.reward_funcs(completions=[None, None], environments=envs, log_extra=extra.__setitem__)
                print("the batch guard:", str(raised.value).splitlines()[0])
        label = f"infra_stop_fraction={stop_fraction}"
        graded = [env.reward for env in envs] if rewards is None else rewards
        if graded != [None, None]:
            problems.append(f"{label}: the rollouts scored {graded}, not [None, None]")
        reasons = [env.verification.reason if env.verification else "" for env in envs]
        if not all("TypeError" in reason and "step_name" in reason for reason in reasons):
            problems.append(f"{label}: the reasons do not name the TypeError: {reasons}")
        records = [
            r for r in caplog.records if r.levelno == logging.WARNING and r.exc_info and "TypeError" in r.getMessage()
        ]
        if len(records) < 2 or not all(isinstance(r.exc_info[1], TypeError) for r in records):
            problems.append(f"{label}: no WARNING with the TypeError's traceback per rollout: {caplog.records}")
        print(label, "->", graded, reasons[0][:160])
        close_all()
    assert not problems, problems
