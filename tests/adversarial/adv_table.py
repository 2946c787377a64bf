"""The outcome of every adversarial case, and the table the suite prints."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Outcome:
    """How one case went through one harness.

    Attributes:
        case: The case's name.
        category: Its category.
        harness: The harness and root (``bash@image``: bash on a task image root).
        reward: What the rollout scored.
        leaks: What got out (a secret, a reward it did not earn, a host change, a connection).
        problems: What was not contained otherwise (a broken sandbox, a crash, an unbounded result).
        seconds: How long the case's tool calls took (for the report; never asserted).
    """

    case: str
    category: str
    harness: str
    reward: float | None = None
    leaks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def contained(self) -> bool:
        return not self.leaks and not self.problems


#: Every outcome of this session, in order.
RESULTS: list[Outcome] = []


def render(results: list[Outcome]) -> str:
    """The table: per category and harness, cases tried, contained, leaked, and what failed."""
    rows: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for outcome in results:
        rows[(outcome.category, outcome.harness)].append(outcome)
    width = max([len("harness"), *(len(o.harness) for o in results)])
    lines = [
        "adversarial corpus (local backend)",
        f"{'category':<16} {'harness':<{width}} {'tried':>5} {'contained':>9} {'leaked':>6} {'other':>5}",
    ]
    for (category, harness), outcomes in rows.items():
        leaked = sum(bool(o.leaks) for o in outcomes)
        other = sum(bool(o.problems and not o.leaks) for o in outcomes)
        contained = sum(o.contained for o in outcomes)
        lines.append(f"{category:<16} {harness:<{width}} {len(outcomes):>5} {contained:>9} {leaked:>6} {other:>5}")
    total_leaked = sum(bool(o.leaks) for o in results)
    total_other = sum(bool(o.problems and not o.leaks) for o in results)
    lines.append(
        f"{'total':<16} {'':<{width}} {len(results):>5} {sum(o.contained for o in results):>9} "
        f"{total_leaked:>6} {total_other:>5}"
    )
    slowest = sorted(results, key=lambda o: o.seconds, reverse=True)[:5]
    lines.append("slowest: " + ", ".join(f"{o.case} [{o.harness}] {o.seconds:.1f} s" for o in slowest))
    for outcome in results:
        for what in outcome.leaks:
            lines.append(f"  LEAK  [{outcome.harness}] {outcome.case}: {what}")
        for what in outcome.problems:
            lines.append(f"  OTHER [{outcome.harness}] {outcome.case}: {what}")
    return "\n".join(lines)


# ── attacks on grading (test_grading.py) ────────────────────────────────────────────────


@dataclass
class GradingOutcome:
    """How one grading case went in one run (``defended`` or ``undefended``).

    Attributes:
        case: The case's name.
        klass: Its class (``grading_corpus.CLASSES``).
        run: ``"defended"`` or ``"undefended"``.
        reward: What the rollout scored (``None``: skipped).
        expected: What it should have scored in this run.
        reason: Why it was not graded normally, if it was not.
        hole: What the case probes beyond the rule's design (empty: a class the design names).
        concealed: What the verifier's view concealed of the agent's changes.
        problems: What did not hold.
        output: The tail of its tool results (for the report).
    """

    case: str
    klass: str
    run: str
    reward: float | None = None
    expected: object = None
    reason: str = ""
    hole: str = ""
    concealed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    output: str = ""


#: Every grading outcome of this session, in order.
GRADING: list[GradingOutcome] = []


def _shown(value: object) -> str:
    if value is None:
        return "skipped"
    if isinstance(value, float):
        return f"{value:g}"
    return "-" if value.__class__ is object else str(value)


def render_grading(
    results: list[GradingOutcome],
    details: bool = False,
    title: str = "attacks on grading (local backend, task image)",
    classes: dict[str, str] | None = None,
) -> str:
    """A grading table: class, case, then per run expected -> observed (``!`` where they differ).

    ``classes`` (class -> name, in the table's order) defaults to ``grading_corpus.CLASSES``."""
    if classes is None:
        from grading_corpus import CLASSES as classes

    runs: dict[tuple[str, str], dict[str, GradingOutcome]] = {}
    for outcome in results:
        runs.setdefault((outcome.klass, outcome.case), {})[outcome.run] = outcome
    width = max([len("case"), *(len(case) for _, case in runs)])
    lines = [
        title,
        f"{'class':<20} {'case':<{width}}  {'defended: want -> got':<24} {'undefended: want -> got':<24}",
    ]
    for (klass, case), by_run in sorted(runs.items(), key=lambda item: list(classes).index(item[0][0])):
        cells = []
        for run in ("defended", "undefended"):
            outcome = by_run.get(run)
            if outcome is None:
                cells.append("-")
                continue
            mark = " !" if outcome.problems else ""
            cells.append(f"{_shown(outcome.expected)} -> {_shown(outcome.reward)}{mark}")
        hole = "  [hole]" if any(o.hole for o in by_run.values()) else ""
        lines.append(f"{klass + ' ' + classes[klass]:<20} {case:<{width}}  {cells[0]:<24} {cells[1]:<24}{hole}")
    failed = [o for o in results if o.problems]
    lines.append(f"{len(runs)} cases, {len(results)} runs, {len(failed)} did not hold")
    if details:
        for outcome in failed:
            for problem in outcome.problems:
                lines.append(f"  [{outcome.run}] {outcome.case}: {problem}")
            if outcome.hole:
                lines.append(f"      hole: {outcome.hole}")
            if outcome.concealed:
                lines.append(f"      concealed: {outcome.concealed[:6]}")
    return "\n".join(lines)
