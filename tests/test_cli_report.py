"""``trl-harbor report``: the page's numbers are the logs' numbers (from a real short training run).

The run trains the hand-wired tiny checkpoint of ``tests/demo_policy.py`` (cheap, and its rollouts
call tools), with a held-out suite sampled before and after.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

from conftest import BUNDLED_SUITE, requires_local

from demo_policy import build_demo_policy
from trl_harbor.cli import main as cli_main
from trl_harbor.cli.trajectories import read_trajectories


class _Tables(HTMLParser):
    """Collect the cells of every ``<table id=...>`` and count ``<details>`` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.details = 0
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = dict(attrs).get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag == "td" and self._table:
            self._cell = []
        elif tag == "details":
            self.details += 1

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        elif tag == "td" and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@requires_local
def test_report_numbers_match_the_logs(tmp_path: Path, copy_tasks, close_sandboxes) -> None:
    from trl_harbor import HarborSpec

    spec = HarborSpec(BUNDLED_SUITE, environment_type="local")
    policy = build_demo_policy(spec.tasks, [Path(d, "instruction.md").read_text() for d in spec.task_dirs],
                               spec.env_cls.PROMPT_SUFFIX)  # fmt: skip
    policy.model.save_pretrained(tmp_path / "checkpoint")
    policy.tokenizer.save_pretrained(tmp_path / "checkpoint")
    heldout = copy_tasks("orders_count", "http_500_count", dest="heldout")
    out = tmp_path / "run"
    argv = ["train", "--model", str(tmp_path / "checkpoint"), "--max_steps", "2", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--indices", "0", "5", "--max_completion_length", "128",
            "--max_tool_calling_iterations", "1", "--optim", "sgd", "--learning_rate", "0.01",
            "--heldout_dataset", str(heldout), "--heldout_rollouts", "3", "--output_dir", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    assert cli_main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "http://" not in page and "https://" not in page  # self-contained
    parser = _Tables()
    parser.feed(page)

    history = [r for r in json.loads((out / "log_history.json").read_text()) if "reward" in r]
    steps = [row for row in parser.tables["step-rewards"] if row]
    assert [(int(s), float(v)) for s, v in steps] == [(r["step"], round(r["reward"], 3)) for r in history]

    rows = read_trajectories(out / "trajectories.jsonl")
    assert parser.details == len(rows) == 8
    rewards: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        rewards[row["task"]].append(row["reward"])
    table = {r[0]: r for r in parser.tables["per-task"] if r}
    assert set(table) == set(rewards)
    for task, values in rewards.items():
        assert int(table[task][1]) == len(values)
        assert float(table[task][2]) == round(sum(values) / len(values), 3)
        assert float(table[task][3]) == round(sum(v >= 1 for v in values) / len(values), 3)
    tools = {r[0]: int(r[1]) for r in parser.tables["tools"] if r}
    assert tools == {"bash": sum(len(row["tool_calls"]) for row in rows)}
    # The held-out section: the pass rates and per-task counts of the two evaluations' own files.
    results = {name: json.loads((out / f"heldout-{name}" / "eval.json").read_text()) for name in ("before", "after")}
    summary = [row for row in parser.tables["heldout-summary"] if row]
    for (label, rate, passed, _), name in zip(summary, ("before", "after"), strict=True):
        record = results[name]
        assert float(rate) == round(record["pass_at"]["1"], 3), label
        assert passed == f"{sum(t['passed'] for t in record['tasks'])}/{sum(t['n'] for t in record['tasks'])}"
    per_task = {row[0]: row[1:] for row in parser.tables["heldout-tasks"] if row}
    assert set(per_task) == {"orders_count", "http_500_count"}
    for task in results["before"]["tasks"]:
        after = next(t for t in results["after"]["tasks"] if t["task"] == task["task"])
        assert per_task[task["task"]] == [f"{task['passed']}/{task['n']}", f"{after['passed']}/{after['n']}"]
    if shutil.which("chromium"):  # the page renders in headless Chromium (Debian's package)
        assert cli_main(["report", str(out), "--png"]) == 0
        assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_an_empty_folder_names_it(tmp_path: Path, capsys) -> None:
    assert cli_main(["report", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
