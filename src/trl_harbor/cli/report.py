"""``trl-harbor report RUN_DIR``: one self-contained HTML page from a run's logs.

Reads what ``trl-harbor train`` or ``trl-harbor eval`` wrote into its output folder —
``trajectories.jsonl`` (one line per rollout), and ``log_history.json`` / ``summary.json``
(train) or ``eval.json`` (eval) — and writes ``report.html``: the mean reward over steps (from the
trainer's own metrics) and per task (from the rollouts), pass rates, tool-call counts, failure
causes, and a browsable list of every trajectory. A training run that measured the model on
held-out tasks before and after training (``heldout-before/`` and ``heldout-after/``, each an
eval run's folder) also gets a section comparing the two, overall and per task. No network, no
external files: the charts are inline SVG, the page works offline.
"""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ReportData", "ReportError", "build_report", "load_run", "screenshot"]


class ReportError(ValueError):
    """The folder holds no run logs this command can read."""


@dataclass
class ReportData:
    """The numbers a report shows (also embedded in the page as JSON, id ``report-data``).

    Attributes:
        kind: ``"train"`` or ``"eval"``.
        step_rewards: ``[(step, mean reward)]`` from the trainer's metrics (train runs).
        task_rows: Per task: rollouts, mean reward, pass rate, mean tool calls, errors.
        task_step_rewards: Per task, ``{step: mean reward}`` from the rollouts (train runs).
        suite_step_rewards: Per suite (a task folder's parent), ``{step: mean reward}``, when a
            run mixes several suites.
        tool_counts: Calls per tool name.
        failures: Count per failure cause.
        rollouts: Rollouts in the log.
        eval_summary: ``eval.json`` without its per-task rows (eval runs).
        heldout: Held-out evaluations of a training run, ``{"before": eval.json, "after": eval.json}``.
    """

    kind: str
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    task_rows: list[dict[str, Any]] = field(default_factory=list)
    task_step_rewards: dict[str, dict[int, float]] = field(default_factory=dict)
    suite_step_rewards: dict[str, dict[int, float]] = field(default_factory=dict)
    tool_counts: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    rollouts: int = 0
    eval_summary: dict[str, Any] | None = None
    heldout: dict[str, dict[str, Any]] = field(default_factory=dict)


def _failure(row: dict[str, Any]) -> str | None:
    if row.get("endpoint_error"):
        return "endpoint error"
    if row.get("infra_error"):
        return "infrastructure: " + str(row["infra_error"]).split(":")[0][:80]
    verification = row.get("verification") or {}
    if verification.get("tampered"):
        return "tampered with the verifier"
    if row.get("reward") == 0.0:
        return "no tool call, reward 0" if not row.get("tool_calls") else "wrong answer (reward 0)"
    return None


def load_run(run_dir: str | Path) -> tuple[ReportData, list[dict[str, Any]]]:
    """Read a run folder and compute the report's numbers.

    Args:
        run_dir: The output folder of ``trl-harbor train`` or ``trl-harbor eval``.

    Returns:
        ``(data, trajectories)``.

    Raises:
        ReportError: When the folder has no ``trajectories.jsonl`` and no metrics.
    """
    from trl_harbor.cli.trajectories import read_trajectories

    run_dir = Path(run_dir)
    trajectories_path = run_dir / "trajectories.jsonl"
    history_path, eval_path = run_dir / "log_history.json", run_dir / "eval.json"
    if not trajectories_path.is_file() and not history_path.is_file() and not eval_path.is_file():
        raise ReportError(
            f"{run_dir}: no trajectories.jsonl, log_history.json or eval.json; point report at the "
            "--output_dir of trl-harbor train or eval"
        )
    rows = read_trajectories(trajectories_path) if trajectories_path.is_file() else []
    data = ReportData(kind="eval" if eval_path.is_file() else "train", rollouts=len(rows))
    if history_path.is_file():
        history = json.loads(history_path.read_text())
        data.step_rewards = [(int(r["step"]), float(r["reward"])) for r in history if "reward" in r and "step" in r]
    if eval_path.is_file():
        record = json.loads(eval_path.read_text())
        data.eval_summary = {k: v for k, v in record.items() if k != "tasks"}
    for name in ("before", "after"):
        path = run_dir / f"heldout-{name}" / "eval.json"
        if path.is_file():
            data.heldout[name] = json.loads(path.read_text())
    data.task_rows = _task_rows(rows)
    data.task_step_rewards = _step_means(rows, lambda row: str(row.get("task")))
    by_suite = _step_means(rows, _suite_of)
    data.suite_step_rewards = by_suite if len(by_suite) > 1 else {}
    tools = Counter(call.get("tool", "?") for row in rows for call in row.get("tool_calls", []))
    data.tool_counts = dict(tools.most_common())
    data.failures = dict(Counter(cause for cause in map(_failure, rows) if cause).most_common())
    return data, rows


def _task_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task, in name order: rollouts, mean reward, pass rate, tool calls per rollout, rollouts not scored."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_task[str(row.get("task"))].append(row)
    table = []
    for task, task_rows in sorted(by_task.items()):
        scored = [r["reward"] for r in task_rows if r.get("reward") is not None]
        table.append({
            "task": task,
            "rollouts": len(task_rows),
            "mean_reward": sum(scored) / len(scored) if scored else None,
            "pass_rate": sum(r >= 1.0 for r in scored) / len(scored) if scored else None,
            "tool_calls": sum(len(r.get("tool_calls", [])) for r in task_rows) / len(task_rows),
            "errors": len(task_rows) - len(scored),
        })  # fmt: skip
    return table


def _suite_of(row: dict[str, Any]) -> str | None:
    """A rollout's suite: its task folder's parent, named with the folder above it."""
    if not row.get("task_dir"):
        return None
    suite = Path(row["task_dir"]).parent
    return f"{suite.parent.name}/{suite.name}"


def _step_means(rows: list[dict[str, Any]], group_of) -> dict[str, dict[int, float]]:
    """The mean reward per step of each group of scored rollouts (``group_of(row)``; ``None``: in none)."""
    groups: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        group = group_of(row)
        if group is not None and row.get("step") is not None and row.get("reward") is not None:
            groups[group][int(row["step"])].append(row["reward"])
    return {name: {s: sum(v) / len(v) for s, v in sorted(steps.items())} for name, steps in sorted(groups.items())}


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _line_chart(series: dict[str, list[tuple[int, float]]], width: int = 640, height: int = 220) -> str:
    """An inline SVG line chart of rewards (0..1) over steps."""
    points = [p for values in series.values() for p in values]
    if not points:
        return "<p class=muted>no steps logged</p>"
    steps = [s for s, _ in points]
    lo, hi = min(steps), max(steps)
    top = max(1.0, max(v for _, v in points))
    pad = 36

    def xy(step: int, value: float) -> tuple[float, float]:
        x = pad + (width - 2 * pad) * ((step - lo) / (hi - lo) if hi > lo else 0.5)
        y = height - pad - (height - 2 * pad) * (value / top)
        return x, y

    palette = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#be185d"]
    parts = [f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">']
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        _, y = xy(lo, tick * top)
        parts.append(f'<line x1="{pad}" y1="{y:.1f}" x2="{width - pad}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="4" y="{y + 4:.1f}" font-size="10">{tick * top:.2f}</text>')
    parts.append(f'<text x="{pad}" y="{height - 8}" font-size="10">step {lo}</text>')
    parts.append(f'<text x="{width - pad - 40}" y="{height - 8}" font-size="10">step {hi}</text>')
    for i, (name, values) in enumerate(series.items()):
        color = palette[i % len(palette)]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in values))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        for s, v in values:
            x, y = xy(s, v)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"><title>{html.escape(name)}: '
                         f"step {s}, {v:.3f}</title></circle>")  # fmt: skip
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="color:{palette[i % len(palette)]}">■</span> {html.escape(name)}' for i, name in enumerate(series)
    )
    return "".join(parts) + f"<div class=legend>{legend}</div>"


def _heldout_section(heldout: dict[str, dict[str, Any]]) -> str:
    """Held-out tasks before vs after training: pass rate overall and per task, with bars."""

    def passed(record: dict[str, Any]) -> tuple[int, int]:
        return sum(t["passed"] for t in record["tasks"]), sum(t["n"] for t in record["tasks"])

    def bar(value: float | None, color: str) -> str:
        width = 0 if value is None else round(160 * value)
        return (f'<svg width="164" height="12" role="img"><rect width="160" height="12" fill="#f3f4f6"/>'
                f'<rect width="{width}" height="12" fill="{color}"/></svg>')  # fmt: skip

    before, after = heldout.get("before"), heldout.get("after")
    parts = ["<h2>Held-out tasks: before vs after training</h2>",
             "<p class=muted>Tasks of the same kinds as the training tasks, with words and files the model never "
             "trained on; the same seed and sampling before and after.</p>"]  # fmt: skip
    rows = []
    for label, key, record, color in (("base model", "before", before, "#9ca3af"),
                                      ("trained", "after", after, "#2563eb")):  # fmt: skip
        if record is None:
            continue
        rate = (record.get("pass_at") or {}).get("1")
        ok, n = passed(record)
        rows.append([label, f"<b id=heldout-{key}>{_fmt(rate)}</b>", f"{ok}/{n}", bar(rate, color)])
    parts.append(_table(["model", "pass rate", "passed", ""], rows, "heldout-summary"))
    if before is not None and after is not None:
        after_by_task = {t["task"]: t for t in after["tasks"]}
        task_rows = []
        for task in before["tasks"]:
            other = after_by_task.get(task["task"], {})
            task_rows.append([html.escape(task["task"]), f"{task['passed']}/{task['n']}",
                              f"{other.get('passed', 0)}/{other.get('n', 0)}"])  # fmt: skip
        parts.append(_table(["held-out task", "base model", "trained"], task_rows, "heldout-tasks"))
    return "".join(parts)


def _table(headers: list[str], rows: list[list[str]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#111827;padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #e5e7eb}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #e5e7eb;padding:3px 8px;text-align:left}
th{background:#f9fafb}.muted{color:#6b7280}.legend{font-size:12px;margin:4px 0 12px}
details{border:1px solid #e5e7eb;border-radius:4px;margin:4px 0;padding:4px 8px}
summary{cursor:pointer}pre{white-space:pre-wrap;background:#f3f4f6;padding:6px;max-height:320px;overflow:auto}
.ok{color:#15803d}.bad{color:#b91c1c}
"""


def build_report(run_dir: str | Path, output: str | Path | None = None, max_trajectories: int = 2000) -> Path:
    """Write the run's HTML report.

    Args:
        run_dir: The run's output folder.
        output: The HTML file (default: ``RUN_DIR/report.html``).
        max_trajectories: At most this many trajectories are listed (the latest ones).

    Returns:
        The path of the page.

    Raises:
        ReportError: When the folder holds no run logs.
    """
    run_dir = Path(run_dir)
    data, rows = load_run(run_dir)
    out = Path(output) if output is not None else run_dir / "report.html"
    sections = [f"<h1>trl-harbor {data.kind} report</h1>", f"<p class=muted>{html.escape(str(run_dir.resolve()))} · "
                f"{data.rollouts} rollouts</p>", *_reward_sections(data)]  # fmt: skip
    if data.heldout:
        sections.append(_heldout_section(data.heldout))
    if data.eval_summary:
        summary = data.eval_summary
        cells = [[f"pass@{k}", _fmt(v)] for k, v in (summary.get("pass_at") or {}).items()]
        cells += [["mean reward", _fmt(summary.get("mean_reward"))], ["rollouts", str(summary.get("rollouts"))],
                  ["rollouts/min", str(summary.get("rollouts_per_minute"))]]  # fmt: skip
        sections.append("<h2>Evaluation</h2>" + _table(["metric", "value"], cells, "eval-summary"))
    sections.append(_counts_section(data))
    sections.append(f"<h2>Trajectories</h2><p class=muted>{min(len(rows), max_trajectories)} of {len(rows)}</p>")
    sections.extend(_trajectory(row) for row in rows[-max_trajectories:])
    payload = json.dumps(data.__dict__, default=str).replace("</", "<\\/")
    page = (
        f"<!doctype html><html><head><meta charset=utf-8><title>trl-harbor {data.kind} report</title>"
        f"<style>{_CSS}</style></head><body>{''.join(sections)}"
        f'<script type="application/json" id="report-data">{payload}</script></body></html>'
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def _reward_sections(data: ReportData) -> list[str]:
    """The mean reward over steps: overall (the trainer's metric), per suite and per task (the rollouts')."""
    sections = []
    if data.step_rewards:
        first, last = data.step_rewards[0][1], data.step_rewards[-1][1]
        steps = [[str(s), f"{v:.3f}"] for s, v in data.step_rewards]
        sections += [
            "<h2>Mean reward over steps</h2>",
            f"<p>first step <b id=first-reward>{first:.3f}</b> → last step <b id=last-reward>{last:.3f}</b></p>",
            _line_chart({"all tasks": data.step_rewards}),
            _table(["step", "mean reward"], steps, "step-rewards"),
        ]
    for name, series in (("suite", data.suite_step_rewards), ("task", data.task_step_rewards)):
        if series:
            sections.append(f"<h2>Mean reward per {name} over steps</h2>")
            sections.append(_line_chart({t: sorted(v.items()) for t, v in series.items()}))
    return sections


def _counts_section(data: ReportData) -> str:
    """Per-task results, calls per tool, rollouts per failure cause."""
    tasks = [
        [html.escape(r["task"]), str(r["rollouts"]), _fmt(r["mean_reward"]), _fmt(r["pass_rate"]),
         f"{r['tool_calls']:.2f}", str(r["errors"])]
        for r in data.task_rows
    ]  # fmt: skip
    tools = [[html.escape(k), str(v)] for k, v in data.tool_counts.items()]
    failures = [[html.escape(k), str(v)] for k, v in data.failures.items()]
    return (
        "<h2>Per task</h2>"
        + _table(
            ["task", "rollouts", "mean reward", "pass rate", "tool calls / rollout", "not scored"], tasks, "per-task"
        )
        + "<h2>Tool calls</h2>"
        + _table(["tool", "calls"], tools, "tools")
        + "<h2>Failure causes</h2>"
        + (_table(["cause", "rollouts"], failures, "failures") if failures else "<p class=muted>none</p>")
    )


def _trajectory(row: dict[str, Any]) -> str:
    """One rollout as an expandable block: its tool calls and their outputs, the verifier's values, its errors."""
    reward = row.get("reward")
    mark = "ok" if reward is not None and reward >= 1 else "bad"
    head = (
        (f"step {row['step']}" if row.get("step") is not None else f"rollout {row.get('rollout', '–')}")
        + f" · {html.escape(str(row.get('task')))} · "
        f"<span class={mark}>reward {_fmt(reward)}</span> · {len(row.get('tool_calls', []))} tool calls"
    )
    calls = "".join(
        f"<p><b>{html.escape(str(c.get('tool')))}</b> ({c.get('duration_s')} s)</p>"
        f"<pre>{html.escape(json.dumps(c.get('arguments'), ensure_ascii=False, indent=1))}</pre>"
        f"<pre>{html.escape(str(c.get('output') if c.get('error') is None else c.get('error')))}</pre>"
        for c in row.get("tool_calls", [])
    )
    extra = ""
    if row.get("reward_components"):
        components = json.dumps(row["reward_components"], ensure_ascii=False)
        extra += f"<p><b>verifier</b> {html.escape(components)}</p>"
    if row.get("final_message"):
        extra += f"<p><b>final message</b></p><pre>{html.escape(str(row['final_message']))}</pre>"
    for key in ("infra_error", "endpoint_error"):
        if row.get(key):
            extra += f"<p class=bad>{key}: {html.escape(str(row[key]))}</p>"
    return f"<details><summary>{head}</summary>{calls}{extra}</details>"


def screenshot(page: str | Path, png: str | Path, width: int = 1100, height: int = 1600) -> Path:
    """Render the page to a PNG with headless Chromium (Debian's ``chromium`` package).

    Args:
        page: The HTML file.
        png: The PNG to write.
        width: Viewport width in pixels.
        height: Viewport height in pixels (the screenshot is this tall).

    Returns:
        The PNG's path.

    Raises:
        ReportError: When no Chromium is installed or it fails.
    """
    import shutil
    import subprocess

    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        raise ReportError("no Chromium found for --png; install it (apt-get install chromium) or open the HTML")
    png = Path(png).resolve()
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--window-size={width},{height}", f"--screenshot={png}", Path(page).resolve().as_uri()]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0 or not png.is_file():
        raise ReportError(f"{browser} could not render {page}: {done.stderr[-500:]}")
    return png
