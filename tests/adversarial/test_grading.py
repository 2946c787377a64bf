"""Attacks on grading (issue #17), by class, on real sandboxes on a task image: none wins, honest ones score 1.

Every case of ``grading_corpus.CASES`` is one rollout of one batch (``agent="bash_steps"``: the
bash tool, and ``submit_step`` for the multi-step task), verified at once by ``spec.reward_funcs``
as ``GRPOTrainer`` does — attacks and honest rollouts side by side, so an attack that spills over
shows as an honest neighbour's 0. The batch runs twice:

* **defended** (the defaults: the verifier in a sibling view of the agent's sandbox, the agent's
  processes kept): each case must score what it deserves — 0 for an attack (0.5 for the
  multi-step one, whose first step was answered honestly), 1 for an honest rollout — and never be
  skipped; the cases the design names and the holes beyond it (``Case.hole``) are asserted apart;
* **undefended** (:func:`defences_off`): each attack must *win* — score 1, or be skipped instead
  of scoring 0 for class 6 — so that the defended run can fail; the honest rollouts still score 1.

The class-7 attacks that need a host of their own (the state root's inode table, sparse artifacts
copied to the host) run on small file systems of their own, below. The table (class → case →
expected → observed, both ways) is printed at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grading_batch
import pytest
from adv_table import GRADING, GradingOutcome, render_grading
from grading_corpus import CASES, NOT_RUN, Case, Ctx, Suite, write_suite

from sandbox_helpers import defences_off
from trl_harbor import HarborOptions, HarborSpec, close_all

requires_local = pytest.mark.local

COMMAND_TIMEOUT_SEC = 90


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Suite:
    gold = "gold" + secrets.token_hex(6)
    steps = {"one": "one" + secrets.token_hex(6), "two": "two" + secrets.token_hex(6)}
    return write_suite(tmp_path_factory.mktemp("grading") / "tasks", gold, steps)


def run_batch(suite: Suite, cases: list[Case], label: str, env_kwargs: dict | None = None) -> list[GradingOutcome]:
    """One batch of ``cases`` (:func:`grading_batch.run_batch`), recorded for the session's table."""
    ctx = Ctx(shell=lambda env, command: env.bash(command), gold=suite.gold, steps=suite.steps)
    outcomes = grading_batch.run_batch(
        suite.root, suite.task, cases, label, ctx, command_timeout_sec=COMMAND_TIMEOUT_SEC, env_kwargs=env_kwargs
    )
    GRADING.extend(outcomes)
    return outcomes


def _assert_all_held(outcomes: list[GradingOutcome]) -> None:
    bad = [o for o in outcomes if o.problems]
    assert not bad, "\n" + render_grading(bad, details=True)


@pytest.fixture(scope="module")
def defended(suite: Suite) -> list[GradingOutcome]:
    """The batch with the defaults, run once for the two tests below."""
    return run_batch(suite, CASES, "defended")


@requires_local
def test_grading_attacks_score_nothing_and_honest_rollouts_one(defended: list[GradingOutcome]) -> None:
    """The classes the design names (issue #17): each attack scores 0, each honest rollout 1."""
    _assert_all_held([outcome for outcome in defended if not outcome.hole])


@requires_local
def test_what_the_rule_does_not_name_scores_nothing_either(defended: list[GradingOutcome]) -> None:
    """The holes the red team found beyond the design (``Case.hole``): attacks that must score 0 too, and
    honest rollouts the rule hides from the verifier, which must score 1."""
    _assert_all_held([outcome for outcome in defended if outcome.hole])


@requires_local
def test_without_the_defences_every_attack_wins(suite: Suite, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rollouts with the defences off: each attack wins, so the test above can fail."""
    cases = [case for case in CASES if case.undefended is not NOT_RUN]
    _assert_all_held(run_batch(suite, cases, "undefended", defences_off(monkeypatch)))


# ── class 7: the host and the neighbours, each on a host of its own ──────────────────────


@contextlib.contextmanager
def small_tmpfs(path: Path, size_mb: int, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` (and ``inodes``) at ``path`` for the test's duration (root only)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_mb}m,mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "trl-harbor-adv", str(path)], check=True)
    try:
        yield path
    finally:
        close_all()
        subprocess.run(["umount", "-l", str(path)], check=False)


class Peak:
    """The highest use of a file system while it lasts (a thread reading ``statvfs``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.bytes, self.inodes, self._stop = path, 0, 0, False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop:
            with contextlib.suppress(OSError):
                st = os.statvfs(self.path)
                self.bytes = max(self.bytes, (st.f_blocks - st.f_bfree) * st.f_frsize)
                self.inodes = max(self.inodes, st.f_files - st.f_ffree)
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


@pytest.fixture
def own_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """The sandboxes' state root and the trial folders on small file systems of their own.

    A run without the fix must not fill the real ``/dev/shm`` or disk: what the attacks fill here is
    these (the state root: 1 GiB, 6000 inodes; the trial folders: 256 MiB).
    """
    if os.geteuid() != 0:
        pytest.skip("mounting the small file systems needs root (as do sandboxes on task images)")
    from trl_harbor.rollout import episode as episode_module

    close_all()
    base = Path(tempfile.mkdtemp(prefix="adv-", dir="/tmp"))  # short: the sandboxes' sockets live under it
    with small_tmpfs(base / "state", 1024, inodes=6000) as state, small_tmpfs(base / "trials", 256) as trials:
        monkeypatch.setenv("HARBOR_LOCAL_SANDBOX_STATE_DIR", str(state))
        trial_root = Path(tempfile.mkdtemp(dir=trials))
        monkeypatch.setattr(episode_module, "_trial_root", lambda: trial_root)
        yield {"state": state, "trials": trials}
        close_all()
    shutil.rmtree(base, ignore_errors=True)


def _grade(spec: HarborSpec, envs: list) -> list[float | None]:
    extra: dict[str, list] = {}
    rewards = spec.reward_funcs(completions=[None] * len(envs), environments=envs, log_extra=extra.__setitem__)
    print("reasons:", extra["harbor_error"])
    return rewards


@requires_local
def test_filling_the_state_roots_inode_table_costs_only_the_filler(
    suite: Suite, own_host: dict[str, Path], close_sandboxes: None
) -> None:
    """Empty files use no blocks, only inodes: a sandbox making them by the thousand must not zero an
    honest neighbour (its answer unwritable, its verifier's view unmade) nor stop later sandboxes starting."""
    spec = HarborSpec(
        suite.root, agent="bash_steps", environment_type="local", options=HarborOptions(command_timeout_sec=60)
    )
    filler, neighbour = spec.environment_factory(), spec.environment_factory()
    for env in (filler, neighbour):
        env.reset(task_dir=suite.task("sh"))
    out = filler.bash(
        "python3 -c \"\nimport os\nos.makedirs('/tmp/i', exist_ok=True)\nn = 0\ntry:\n"
        "    while n < 100000:\n        open(f'/tmp/i/{n}', 'w').close(); n += 1\n"
        "except OSError as e:\n    print('stopped', n, e)\nprint('made', n)\n\""
    )
    print("filler:", out[-300:])
    answered = neighbour.bash(f"echo {suite.gold} > /workdir/answer.txt && echo answered")
    rewards = _grade(spec, [filler, neighbour])
    later = spec.environment_factory()
    later.reset(task_dir=suite.task("sh"))
    started = later.bash(f"echo {suite.gold} > /workdir/answer.txt && echo started")
    later_reward = later.reward
    problems = []
    if "answered" not in answered:
        problems.append(f"the neighbour could not write its answer: {answered!r}")
    if rewards != [0.0, 1.0]:
        problems.append(f"the filler and its neighbour scored {rewards} (want [0.0, 1.0])")
    if "started" not in started or later_reward != 1.0:
        problems.append(f"a sandbox started afterwards: {started!r}, reward {later_reward}")
    assert not problems, problems


@requires_local
def test_sparse_artifacts_are_not_copied_at_their_apparent_size(
    suite: Suite, own_host: dict[str, Path], close_sandboxes: None
) -> None:
    """Ten 10 GiB sparse files in /logs/artifacts of a separate-verifier task: the host gets their data
    (none), not 100 GiB of zeroes; the rollout scores 0 (it is not skipped) and the trial folders stay small."""
    spec = HarborSpec(
        suite.root, agent="bash_steps", environment_type="local", options=HarborOptions(command_timeout_sec=60)
    )
    attacker, neighbour = spec.environment_factory(), spec.environment_factory()
    for env in (attacker, neighbour):
        env.reset(task_dir=suite.task("sep"))
    out = attacker.bash("for i in $(seq 10); do truncate -s 10G /logs/artifacts/sparse$i; done; du -sh /logs/artifacts")
    neighbour.bash(f"echo {suite.gold} > /workdir/answer.txt")
    peaks = [Peak(own_host["trials"]), Peak(own_host["state"])]
    try:
        rewards = _grade(spec, [attacker, neighbour])
    finally:
        for peak in peaks:
            peak.stop()
    print("attacker:", out[-200:], "peaks (MB):", [p.bytes >> 20 for p in peaks])
    problems = []
    if rewards != [0.0, 1.0]:
        problems.append(f"the attacker and its neighbour scored {rewards} (want [0.0, 1.0])")
    if peaks[0].bytes >= 64 << 20:
        problems.append(f"the trial folders grew to {peaks[0].bytes >> 20} MB (of 256)")
    if peaks[1].bytes >= 512 << 20:
        problems.append(f"the state root grew to {peaks[1].bytes >> 20} MB (of 1024)")
    assert not problems, problems


def test_the_descriptor_probe_finds_an_inherited_host_descriptor(tmp_path: Path) -> None:
    """The class-7 descriptor case can fail: its probe, given a descriptor of a host file, reports it."""
    from grading_corpus import FD_PROBE

    host_file = tmp_path / "cached-binary"
    host_file.write_bytes(b"\x7fELF")
    fd = os.open(host_file, os.O_RDONLY)
    try:
        result = subprocess.run(
            ["python3", "-c", FD_PROBE], pass_fds=[fd], capture_output=True, text=True, timeout=60, check=True
        )
    finally:
        os.close(fd)
    assert f"INHERITED fd {fd} -> {host_file} (fchmod allowed)" in result.stdout, result.stdout


@requires_local
def test_zz_grading_table() -> None:
    """Every grading case ran both ways (defended; undefended where it has an undefended expectation) and
    held; the table is printed (also at the end of the session)."""
    print("\n" + render_grading(GRADING))
    ran = sorted((outcome.run, outcome.case) for outcome in GRADING)
    expected = sorted(
        [("defended", case.name) for case in CASES]
        + [("undefended", case.name) for case in CASES if case.undefended is not NOT_RUN]
    )
    assert ran == expected, f"{len(ran)} of {len(expected)} case runs recorded (an earlier test stopped)"
    _assert_all_held(GRADING)
