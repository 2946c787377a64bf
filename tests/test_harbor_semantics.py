"""Harbor's semantics, run side by side with trl-harbor's on the same generated inputs (issue #44).

Differential tests: Harbor's own functions — ``Trial._select_multi_step_reward`` /
``Trial._aggregate_step_rewards`` (combining a multi-step task's steps), ``MultiStepTrial._should_stop_after_step``
with its ``_min_reward_failure`` (the ``min_reward`` gate), ``lock.json``'s task digest — against
:func:`trl_harbor.rollout.steps.combine`, :func:`~trl_harbor.rollout.steps.meets_min_reward` and the suite
lock, on a few thousand seeded cases built from Harbor's pydantic models. Any difference fails unless it is
one of :data:`ALLOWED`, and each listed difference must still be seen (a listed difference Harbor no longer
makes is stale). Each comparator is also run with Harbor's function swapped for a different rule, and must
then report differences: the tests can fail.

Fast: no sandbox, no root, no Docker, no model.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from harbor.models.task.config import MultiStepRewardStrategy, StepConfig, TaskConfig
from harbor.models.trial.result import StepResult
from harbor.models.verifier.result import VerifierResult
from harbor.trial.multi_step import MultiStepTrial
from harbor.trial.trial import Trial

from trl_harbor.options import HarborOptions
from trl_harbor.rollout.outcome import Cause, Failure, Verification, select_reward
from trl_harbor.rollout.steps import combine, meets_min_reward

BUNDLED_SUITE = Path(__file__).resolve().parents[1] / "examples" / "tasks"
CASES = 4000

BROKEN = "broken step counts 0"
UNREACHED = "unreached_steps='zero' counts a step never reached as 0"
INFRA = "a step lost to the infrastructure makes its verification the rollout's"
#: The differences from Harbor that trl-harbor means to make, and nothing else (see rollout/steps.py).
ALLOWED = {
    BROKEN: "Harbor's trial has no verifier result for the step and leaves it out of the mean",
    UNREACHED: "Harbor has no result for a step never reached (mean over the steps reached; final: the last reached)",
    INFRA: "Harbor has no attribution: the loss is settled by on_infra_error, not scored",
}

Aggregate = Callable[[Any, list[StepResult]], VerifierResult | None]
MinRewardFailure = Callable[[dict[str, float] | None, Any], str | None]


# ── Harbor's functions, on a stand-in trial of the test's own ──────────────────────────


class _Trial:
    """What Harbor's reward and stop methods read of a trial; each method Harbor's unless a test swaps it."""

    _select_multi_step_reward = Trial._select_multi_step_reward
    _aggregate_step_rewards = Trial._aggregate_step_rewards
    _should_stop_after_step = MultiStepTrial._should_stop_after_step
    _min_reward_failure = staticmethod(MultiStepTrial._min_reward_failure)

    def __init__(self, task: Any = None, step_results: list[StepResult] | None = None) -> None:
        self.task = task
        self.result = SimpleNamespace(step_results=step_results)
        self.config = SimpleNamespace(verifier=SimpleNamespace(disable=False))
        self.logger = logging.getLogger("test_harbor_semantics")


def harbors_aggregate(task: Any, step_results: list[StepResult]) -> VerifierResult | None:
    """Harbor's multi-step reward: what its trial sets as the trial's verifier result."""
    return _Trial(task, step_results)._select_multi_step_reward()


def _swapped(**methods: Any) -> type[_Trial]:
    return type("SwappedTrial", (_Trial,), methods)


def _mean_counting_steps_without_result(self: Any) -> VerifierResult | None:
    """A different rule: the mean divides by every step, a step without a verifier result counting 0."""
    results = self.result.step_results
    rewards = [r.verifier_result.rewards or {} if r.verifier_result else {} for r in results]
    keys = {key for entries in rewards for key in entries}
    return VerifierResult(rewards={k: sum(e.get(k, 0) for e in rewards) / len(rewards) for k in keys}) if keys else None


def _mean_skipping_missing_keys(self: Any) -> VerifierResult | None:
    """A different rule: each entry's mean over the steps that wrote it (a missing entry is not 0)."""
    rewards = [r.verifier_result.rewards or {} for r in self.result.step_results if r.verifier_result]
    keys = {key for entries in rewards for key in entries}
    means = {k: sum(e[k] for e in rewards if k in e) / sum(k in e for e in rewards) for k in keys}
    return VerifierResult(rewards=means) if keys else None


def _aggregate_with(trial: type[_Trial]) -> Aggregate:
    return lambda task, step_results: trial(task, step_results)._select_multi_step_reward()


# ── generated cases ──────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Case:
    """One multi-step rollout: the task's strategy and steps, the graded steps' outcomes, the option."""

    task: Any
    steps: tuple[StepConfig, ...]
    outcomes: tuple[Verification, ...]
    unreached: str

    def describe(self) -> str:
        shown = [(o.cause.value if o.cause else "ok", o.rewards) for o in self.outcomes]
        strategy = self.task.config.multi_step_reward_strategy
        return f"strategy={strategy}, {len(self.steps)} steps, graded={shown}, unreached_steps={self.unreached!r}"


def _rewards(rng: random.Random) -> dict[str, float]:
    """1 to 3 entries (different steps write different ones: missing entries), values often equal."""
    keys = rng.sample(["reward", "speed", "style"], rng.randint(1, 3))
    return {key: rng.choice([0, 0.0, 0.25, 0.5, 1, 1.0, round(rng.random(), 3)]) for key in keys}


def _outcome(rng: random.Random) -> Verification:
    kind = rng.choices(["ok", "broken", "infra"], weights=[75, 18, 7])[0]
    if kind == "ok":
        return Verification(None, rewards=_rewards(rng), killed=rng.randint(0, 1), concealed=("/etc/x changed",))
    if kind == "broken":  # as grading.failed makes them: reward 0, no rewards
        cause = rng.choice([Cause.VERIFIER, Cause.TAMPERED, Cause.EXHAUSTED])
        return Verification(0.0, cause=cause, reason=f"{cause.value} broke", tampered=("/tests/test.sh",))
    cause = rng.choice([Cause.INFRASTRUCTURE, Cause.CONFIGURATION])
    return Verification(0.0, cause=cause, reason="the sandbox stopped answering")


def generate_cases(seed: int = 44, count: int = CASES) -> list[Case]:
    """Strategies mean, final and unset; 1 to 4 steps, some never reached; some broken, some lost."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        strategy = rng.choice([MultiStepRewardStrategy.MEAN, MultiStepRewardStrategy.FINAL, None])
        steps = tuple(StepConfig(name=f"s{i}") for i in range(rng.randint(1, 4)))
        task = SimpleNamespace(config=TaskConfig(multi_step_reward_strategy=strategy, steps=list(steps)))
        outcomes = tuple(_outcome(rng) for _ in range(rng.randint(1, len(steps))))
        cases.append(Case(task, steps, outcomes, rng.choice(["skip", "zero"])))
    return cases


# ── the comparators ──────────────────────────────────────────────────────────────────


@dataclass
class Report:
    """What a comparison found: differences not listed, and how often each listed one was needed."""

    compared: int = 0
    unlisted: list[str] = field(default_factory=list)
    seen: collections.Counter[str] = field(default_factory=collections.Counter)

    def problems(self) -> list[str]:
        stale = [f"listed difference never seen (stale: drop it?): {name}" for name in ALLOWED if not self.seen[name]]
        return self.unlisted + stale


def _harbor_view(case: Case, listed: frozenset[str]) -> list[StepResult]:
    """The steps' results as Harbor's trial holds them; with the ``listed`` differences applied as inputs."""
    results = []
    for step, outcome in zip(case.steps, case.outcomes, strict=False):
        rewards = dict(outcome.rewards) if outcome.cause is None else ({} if BROKEN in listed else None)
        result = None if rewards is None else VerifierResult(rewards=rewards)
        results.append(StepResult(step_name=step.name, verifier_result=result))
    if UNREACHED in listed:
        unreached = case.steps[len(case.outcomes) :]
        results += [StepResult(step_name=s.name, verifier_result=VerifierResult(rewards={})) for s in unreached]
    return results


def _scored(result: VerifierResult | None) -> tuple[dict[str, float], float]:
    """A Harbor result as trl-harbor scores it: no result (or no entry) is rewards ``{}``, reward 0."""
    rewards = dict(result.rewards or {}) if result is not None else {}
    return rewards, (select_reward(rewards) if rewards else 0.0)


def compare_combine(cases: Sequence[Case], aggregate: Aggregate = harbors_aggregate) -> Report:
    """Run ``combine`` and ``aggregate`` on every case; explain each difference by :data:`ALLOWED` or report it."""
    report = Report()
    for case in cases:
        ours = combine(case.task, case.steps, case.outcomes, HarborOptions(unreached_steps=case.unreached))
        report.compared += 1
        lost = next((o for o in case.outcomes if o.cause is not None and o.cause.infra), None)
        if lost is not None:
            if ours is lost:
                report.seen[INFRA] += 1
            else:
                report.unlisted.append(f"{case.describe()}: a lost step not attributed ({ours})")
            continue
        applies = frozenset(
            name
            for name, present in (
                (BROKEN, any(o.cause is not None for o in case.outcomes)),
                (UNREACHED, case.unreached == "zero" and len(case.outcomes) < len(case.steps)),
            )
            if present
        )

        def harbor(listed: frozenset[str], case: Case = case) -> tuple[dict[str, float], float]:
            return _scored(aggregate(case.task, _harbor_view(case, listed)))

        got = (ours.rewards, ours.reward)
        if got == harbor(frozenset()):
            continue
        if applies and got == harbor(applies):
            for name in applies:  # the listed differences this case needed
                if got != harbor(applies - {name}):
                    report.seen[name] += 1
            continue
        report.unlisted.append(f"{case.describe()}: trl-harbor {got}, Harbor {harbor(frozenset())}")
    return report


@dataclass(frozen=True)
class GateCase:
    rewards: dict[str, float]
    threshold: float | dict[str, float] | None


def generate_gate_cases(seed: int = 45, count: int = CASES) -> list[GateCase]:
    """Rewards of 0 to 3 entries; ``min_reward`` unset, a number (int or float) or a table of 1 to 2 entries."""
    rng = random.Random(seed)
    grid = [0, 0.25, 0.5, 1, 1.0]  # thresholds equal to rewards often: where >= and > part
    cases = []
    for _ in range(count):
        keys = rng.sample(["reward", "speed", "style"], rng.randint(0, 3))
        rewards = {key: rng.choice(grid) for key in keys}
        form = rng.choice(["none", "number", "table"])
        if form == "none":
            threshold = None
        elif form == "number":
            threshold = rng.choice(grid)
        else:
            threshold = {
                key: float(rng.choice(grid)) for key in rng.sample(["reward", "speed", "style"], rng.randint(1, 2))
            }
        cases.append(GateCase(rewards, threshold))
    return cases


def compare_gate(cases: Sequence[GateCase], trial: type[_Trial] = _Trial) -> list[str]:
    """``meets_min_reward`` against Harbor's decision to go on after a graded step; no difference is allowed."""
    differences = []
    for case in cases:
        step = StepConfig(name="one", min_reward=case.threshold)
        result = StepResult(step_name="one", verifier_result=VerifierResult(rewards=case.rewards))
        harbor_goes_on = not trial()._should_stop_after_step(step, result)
        if meets_min_reward(case.rewards, case.threshold) != harbor_goes_on:
            differences.append(f"rewards={case.rewards} min_reward={case.threshold}: Harbor goes on: {harbor_goes_on}")
    return differences


# ── the tests ────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return generate_cases()


def test_combine_is_harbors_but_for_the_listed_differences(cases: list[Case]) -> None:
    report = compare_combine(cases)
    assert report.compared == CASES
    assert report.problems() == [], "\n".join(report.problems()[:20])
    assert all(report.seen[name] > 20 for name in ALLOWED), report.seen


@pytest.mark.parametrize(
    ("swap", "expected"),
    [
        ({"_aggregate_step_rewards": _mean_counting_steps_without_result}, f"stale: drop it?): {BROKEN}"),
        ({"_aggregate_step_rewards": _mean_skipping_missing_keys}, "trl-harbor"),
    ],
    ids=["mean-counting-steps-without-result", "mean-skipping-missing-keys"],
)
def test_the_combine_comparator_fails_on_a_different_rule(cases: list[Case], swap: dict, expected: str) -> None:
    problems = compare_combine(cases, _aggregate_with(_swapped(**swap))).problems()
    assert problems and any(expected in p for p in problems), problems[:5]


def test_min_reward_gate_is_harbors() -> None:
    cases = generate_gate_cases()
    assert compare_gate(cases) == []
    # Every kind of case was there: passing, failing, a missing entry, no threshold.
    outcomes = collections.Counter(meets_min_reward(c.rewards, c.threshold) for c in cases)
    assert outcomes[True] > 500 and outcomes[False] > 500
    assert any(isinstance(c.threshold, dict) and set(c.threshold) - set(c.rewards) for c in cases)


def test_the_gate_comparator_fails_on_a_different_rule() -> None:
    def strictly_above(rewards: dict[str, float] | None, min_reward: Any) -> str | None:
        gates = {"reward": min_reward} if isinstance(min_reward, (int, float)) else min_reward
        failed = [key for key, value in gates.items() if not (rewards or {}).get(key, float("-inf")) > value]
        return f"{failed} not above min_reward" if failed else None

    differences = compare_gate(generate_gate_cases(), _swapped(_min_reward_failure=staticmethod(strictly_above)))
    assert len(differences) > 100, differences[:5]


def test_combine_keeps_each_steps_details_and_attributes_a_loss() -> None:
    steps = [StepConfig(name="one"), StepConfig(name="two"), StepConfig(name="three")]
    task = SimpleNamespace(config=TaskConfig(steps=steps))  # the strategy unset: Harbor's mean
    first = Verification(None, rewards={"reward": 1.0}, killed=2, concealed=("/opt/app changed",))
    broken = Verification(0.0, cause=Cause.TAMPERED, reason="the rollout changed /tests", tampered=("/tests/t.sh",))
    ended = Failure(Cause.TAMPERED, "the rollout changed /tests")
    zero = combine(task, steps, [first, broken], HarborOptions(unreached_steps="zero"), ended)
    assert (zero.reward, zero.rewards) == (pytest.approx(1 / 3), {"reward": pytest.approx(1 / 3)})
    assert zero.steps == (("one", {"reward": 1.0}), ("two", {}))
    assert (zero.cause, zero.killed, zero.concealed, zero.tampered) == (
        Cause.TAMPERED, 2, ("/opt/app changed",), ("/tests/t.sh",)
    )  # fmt: skip
    assert zero.reason == "step 'two': the rollout changed /tests; 1 of 3 steps never reached (scored 0)"
    skip = combine(task, steps, [first, broken], HarborOptions())
    assert skip.reward == 0.5 and "never reached (not counted, as in Harbor)" in skip.reason
    # A step lost to the infrastructure: its verification is the rollout's, whatever the others scored.
    lost = Verification(0.0, cause=Cause.INFRASTRUCTURE, reason="the sandbox stopped answering")
    assert combine(task, steps, [first, lost], HarborOptions()) is lost
    # An entry the options name that no step wrote: the configuration's fault, not a 0.
    unnamed = combine(task, steps, [first], HarborOptions(reward_key="speed"))
    assert unnamed.cause is Cause.CONFIGURATION and unnamed.reward is None and unnamed.rewards == {"reward": 1.0}


# ── task identity: the suite lock records Harbor's content hash ────────────────────────


def _harbors_lock_digest(task_dir: Path) -> str:
    """The digest Harbor's own ``lock.json`` records for a local task."""
    from harbor.models.job.lock import _build_lock_trial_task
    from harbor.models.trial.config import TaskConfig as TrialTaskConfig

    download = SimpleNamespace(path=task_dir, content_hash=None, resolved_git_commit_id=None)
    return _build_lock_trial_task(TrialTaskConfig(path=task_dir), download).digest


def _locked(root: Path) -> tuple[Any, Any]:
    from trl_harbor.rollout.sources import resolve_suite
    from trl_harbor.rollout.suite import TaskInfo

    resolved = resolve_suite(root)
    selected = [(i, TaskInfo(path=p.resolve(), name=p.name)) for i, p in enumerate(resolved.task_dirs)]
    return resolved, resolved.lock(selected, {})


def test_the_suite_lock_records_harbors_content_hash(tmp_path: Path) -> None:
    from harbor.publisher.packager import Packager

    from trl_harbor.rollout.sources import resolve_lock
    from trl_harbor.rollout.suite import TaskSuiteError
    from trl_harbor.rollout.suite_lock import read_lock, write_lock

    root = tmp_path / "suite"
    for name in ("building_b_humidity", "cohort_stats_average"):
        shutil.copytree(BUNDLED_SUITE / name, root / name)
    _, locked = _locked(root)
    for task in locked.tasks:
        assert task.digest == "sha256:" + Packager.compute_content_hash(task.path)[0] == _harbors_lock_digest(task.path)
        assert task.digest_kind == "harbor"
    path = write_lock(tmp_path / "run", [locked])
    assert json.loads(path.read_text())["format_version"] == 2
    assert read_lock(path)[0].tasks == locked.tasks
    assert resolve_lock(path).task_dirs == [task.path for task in locked.tasks]  # every task checked
    # A change Harbor's hash sees makes the rerun refuse the task, naming both digests.
    test_sh = root / "building_b_humidity" / "tests" / "test.sh"
    test_sh.write_text(test_sh.read_text() + "\n# edited\n")
    with pytest.raises(TaskSuiteError, match="content differs from the lock \\(Harbor's content hash") as info:
        resolve_lock(path)
    assert locked.tasks[0].digest in str(info.value) and "Fix:" in str(info.value)


def test_a_folder_harbor_cannot_hash_is_locked_by_the_tree_digest(tmp_path: Path) -> None:
    from trl_harbor.rollout.digests import task_digest
    from trl_harbor.rollout.sources import resolve_lock
    from trl_harbor.rollout.suite_lock import write_lock

    root = tmp_path / "suite"
    task = root / "building_b_humidity"
    shutil.copytree(BUNDLED_SUITE / task.name, task)
    (task / "tests" / ".harborignore").mkdir()  # Harbor refuses ignore rules that are not a file
    with pytest.raises(ValueError, match="Ignore rules must be a regular file"):
        _harbors_lock_digest(task)
    _, locked = _locked(root)
    (entry,) = locked.tasks
    assert (entry.digest, entry.digest_kind) == (task_digest(task), "trl-harbor")
    rerun = resolve_lock(write_lock(tmp_path / "run", [locked]))
    assert rerun.task_dirs == [task]


def test_a_version_1_lock_is_checked_by_its_tree_digest_and_rerun_locks_harbors(tmp_path: Path) -> None:
    from trl_harbor.rollout.digests import task_digest
    from trl_harbor.rollout.sources import resolve_lock
    from trl_harbor.rollout.suite import TaskInfo, TaskSuiteError

    root = tmp_path / "suite"
    task = root / "building_b_humidity"
    shutil.copytree(BUNDLED_SUITE / task.name, task)
    _, locked = _locked(root)
    old = {"format": "trl-harbor-suite-lock", "format_version": 1, "suites": [locked.to_dict()]}
    entry = old["suites"][0]["tasks"][0]
    del entry["digest_kind"]
    entry["digest"] = task_digest(task)  # what trl-harbor wrote before Harbor's content hash
    lock = tmp_path / "old.lock.json"
    lock.write_text(json.dumps(old))
    rerun = resolve_lock(lock)
    assert rerun.lock_of is not None and rerun.lock_of.tasks[0].digest_kind == "trl-harbor"
    (again,) = rerun.lock([(0, TaskInfo(path=task.resolve(), name=task.name))], {}).tasks
    assert (again.digest, again.digest_kind) == (_harbors_lock_digest(task), "harbor")
    # Still checked: a mode bit (which Harbor's hash ignores) changed, the old lock refuses the task.
    test_sh = task / "tests" / "test.sh"
    test_sh.chmod(test_sh.stat().st_mode ^ 0o111)
    assert _harbors_lock_digest(task) == again.digest
    with pytest.raises(TaskSuiteError, match="content differs from the lock \\(tree digest"):
        resolve_lock(lock)
    # A digest kind this version does not know: the file, the field, the fix.
    entry["digest_kind"], old["format_version"] = "blake3", 2
    lock.write_text(json.dumps(old))
    with pytest.raises(TaskSuiteError, match=r"old.lock.json suites\[0\]: tasks\[0\].digest_kind 'blake3'.*Fix:"):
        resolve_lock(lock)
