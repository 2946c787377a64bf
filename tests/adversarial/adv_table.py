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
        harness: The harness and root (``bash@image``: bash on a task image root; ``@host``: the host root).
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
