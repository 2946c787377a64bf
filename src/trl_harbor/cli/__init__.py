"""The ``trl-harbor`` command line: its parser and :func:`main` here, a module per command beside it.

Each command's module (:mod:`~trl_harbor.cli.train`, :mod:`~trl_harbor.cli.evaluate`,
:mod:`~trl_harbor.cli.check`, :mod:`~trl_harbor.cli.report`, :mod:`~trl_harbor.cli.images`) is
imported when its command runs; what only they use lives here too (:mod:`~trl_harbor.cli.option_flags`,
:mod:`~trl_harbor.cli.prompting`, :mod:`~trl_harbor.cli.trajectories`, :mod:`~trl_harbor.cli.starter_model`).

Commands:
    check SUITE   Oracle solutions must score 1 and doing nothing must score 0, per task.
    train         GRPO on a task suite (every GRPOConfig field a flag, --config file.yaml);
                  with no --model, the embedded default run (a 135M model, starter suite, CPU).
    eval SUITE    A model behind an OpenAI-compatible endpoint on a suite: pass@k, mean reward.
    report DIR    A self-contained HTML page from a train or eval run's logs.
    images        A backend's task images (the local sandbox's): list, build SUITE, prune, load ARCHIVE NAME.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trl_harbor.options import HarborOptions

__all__ = ["main", "options_from_args"]


def options_from_args(args: argparse.Namespace) -> HarborOptions:
    """The :class:`~trl_harbor.HarborOptions` the option flags of a command give.

    Args:
        args: The parsed arguments of a parser with :func:`~trl_harbor.cli.option_flags.add_option_flags`.

    Returns:
        The options (defaults for the flags not given).

    Raises:
        ValueError: For a malformed ``KEY=VALUE`` pair or an invalid option.
    """
    from trl_harbor.cli.option_flags import options_from_values

    return options_from_values(vars(args))


def _progress(console, label: str, disable: bool):
    """A transient progress bar: done of total, elapsed time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=True, disable=disable)


def _cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trl_harbor.cli.check import check_suite
    from trl_harbor.rollout.backends import resolve_backend
    from trl_harbor.rollout.preflight import BackendUnavailableError, check_backend, preflight_enabled

    console = Console(stderr=False)
    try:
        task_dirs = _check_task_dirs(args)
        options = options_from_args(args)
    except ValueError as error:  # a TaskSuiteError too
        console.print(f"[red]{error}")
        return 2
    try:
        backend = resolve_backend(args.environment_type, dict(options.backend_options))
        if preflight_enabled(None):
            # A backend that cannot start sandboxes here fails once, with its cause and fix, not as one row per task.
            check_backend(backend)
    except (BackendUnavailableError, ValueError) as error:
        print(f"trl-harbor check: {error}", file=sys.stderr)
        return 2
    with _progress(console, "checking", args.json or (not console.is_terminal and not args.progress)) as progress:
        bar = progress.add_task("check", total=len(task_dirs))
        results = check_suite(
            task_dirs,
            backend,
            concurrency=args.concurrency,
            options=options,
            on_done=lambda _: progress.advance(bar),
        )
    failed = [r for r in results if not r.passed]
    if args.json:
        print(json.dumps({"passed": len(results) - len(failed), "failed": len(failed),
                          "tasks": [r.to_dict() for r in results]}, indent=2))  # fmt: skip
    else:
        _print_check(console, f"{args.suite} on {args.environment_type}", results)
    return 1 if failed else 0


def _check_task_dirs(args: argparse.Namespace) -> list[Path]:
    """The suite's task folders (not validated: check reports a malformed one as a failed row), or those named."""
    from trl_harbor.rollout.sources import SuiteSelection, resolve_suite

    task_dirs = resolve_suite(args.suite, SuiteSelection.of(args), limit=args.n_tasks).task_dirs
    if not args.task:
        return task_dirs
    missing = set(args.task) - {d.name for d in task_dirs}
    if missing:
        raise ValueError(f"no such task in {args.suite}: {', '.join(sorted(missing))}")
    return [d for d in task_dirs if d.name in args.task]


def _add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    """Where a named dataset comes from and which of its tasks to use, as Harbor's ``run`` flags."""
    parser.add_argument("--registry-url", default=None, help="a Harbor registry's URL, for NAME@VERSION datasets")
    parser.add_argument(
        "--registry-path", default=None, help="a Harbor registry.json on disk, for NAME@VERSION datasets"
    )
    parser.add_argument(
        "--include-task-name", "-i", dest="task_names", action="append", help="keep tasks matching this glob"
    )
    parser.add_argument(
        "--exclude-task-name", "-x", dest="exclude_task_names", action="append", help="leave out tasks matching it"
    )
    parser.add_argument(
        "--download-dir", default=None, help="where fetched tasks are cached (default: ~/.cache/harbor/tasks)"
    )


def _print_check(console, title: str, results) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for column in ("task", "oracle", "nothing", "result", "why"):
        table.add_column(column)
    for r in results:
        table.add_row(
            escape(r.task),
            "error" if r.oracle.reward is None else f"{r.oracle.reward:g}",
            "error" if r.nop.reward is None else f"{r.nop.reward:g}",
            "[green]pass" if r.passed else "[yellow]FAIL (view)" if r.fails_only_in_view else "[red]FAIL",
            escape(r.why[:600]),  # a reason may name a TOML table ("[metadata]"), not rich markup
        )
    console.print(table)
    passed = sum(r.passed for r in results)
    in_view = sum(r.fails_only_in_view for r in results)
    note = f" ({in_view} of them pass in place, fail in the isolated view)" if in_view else ""
    console.print(f"{passed} passed, {len(results) - passed} failed{note}")


def _cmd_eval(args: argparse.Namespace) -> int:
    suites = list(args.suite)
    if len(suites) == 1:
        return _eval_one(args, suites[0], args.output_dir)
    # Several suites: each is evaluated on its own (weights are a training notion), into its own folder.
    base = Path(args.output_dir or "eval")
    names = [Path(s.rstrip("/")).name or s for s in suites]
    if len(set(names)) != len(names):
        print(f"trl-harbor eval: error: the suites' names clash ({', '.join(names)}); give folders with distinct names")
        return 2
    statuses = [_eval_one(args, suite, str(base / name)) for suite, name in zip(suites, names, strict=True)]
    return max(statuses)


def _eval_one(args: argparse.Namespace, suite: str, output_dir: str) -> int:
    from rich.console import Console

    from trl_harbor.cli.evaluate import EvalConfig, evaluate
    from trl_harbor.cli.prompting import load_few_shot
    from trl_harbor.cli.train import quiet_libraries
    from trl_harbor.rollout.preflight import BackendUnavailableError

    quiet_libraries(args.verbose)  # library deprecations and load bars are not the user's business
    console = Console()
    try:
        # The eval flags are named after EvalConfig's fields; these few are not given as they are.
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EvalConfig) if hasattr(args, f.name)}
        config = EvalConfig(**{**given, "dataset": suite, "output_dir": output_dir, "k": sorted(set(args.k or [1])),
                               "options": options_from_args(args),
                               "few_shot": load_few_shot(args.few_shot) if args.few_shot else None})  # fmt: skip
        with _progress(console, "rollouts", not console.is_terminal and not args.progress) as progress:
            bar = progress.add_task("eval", total=None)
            result = evaluate(config, on_done=lambda total: progress.update(bar, total=total, advance=1))
    except (ValueError, BackendUnavailableError) as exc:
        console.print(f"[red]trl-harbor eval: error: {exc}")
        return 2
    _print_eval(console, config, result)
    return 0


def _print_eval(console, config, result) -> None:
    from rich.table import Table

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = Table(title=f"{config.model} on {config.dataset} ({config.environment_type})")
    for column in ("task", "n", "passed", "mean reward", *[f"pass@{k}" for k in config.k], "tool calls", "errors"):
        table.add_column(column)
    for score in result.tasks:
        table.add_row(
            score.task, str(score.n), str(score.passed), fmt(score.mean_reward),
            *[fmt(score.pass_at[k]) for k in config.k], f"{score.tool_calls:.1f}", str(score.errors),
        )  # fmt: skip
    table.add_row(
        "[b]all", str(sum(s.n for s in result.tasks)), str(sum(s.passed for s in result.tasks)),
        fmt(result.mean_reward), *[fmt(result.pass_at[k]) for k in config.k], "", str(result.errors),
    )  # fmt: skip
    console.print(table)
    console.print(
        f"{result.rollouts} rollouts in {result.seconds:.1f} s ({result.rollouts_per_minute:g}/min); "
        f"results in {Path(config.output_dir) / 'eval.json'}, trajectories in "
        f"{Path(config.output_dir) / 'trajectories.jsonl'}"
    )


def _cmd_report(args: argparse.Namespace) -> int:
    from trl_harbor.cli.report import ReportError, build_report, screenshot

    try:
        page = build_report(args.run_dir, args.output)
        print(f"report: {page}")
        if args.png:
            print(f"screenshot: {screenshot(page, page.with_suffix('.png'))}")
    except (ReportError, ValueError) as exc:
        print(f"trl-harbor report: error: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of ``trl-harbor``.

    Returns:
        The parser.
    """
    from trl_harbor.cli.images import add_parser as add_images_parser

    parser = argparse.ArgumentParser(prog="trl-harbor", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_check_parser(commands)
    _add_eval_parser(commands)
    report = commands.add_parser("report", help="a self-contained HTML page from a train or eval run's logs")
    report.add_argument("run_dir", help="the --output_dir of trl-harbor train or eval")
    report.add_argument("--output", "-o", default=None, help="the HTML file (default: RUN_DIR/report.html)")
    report.add_argument("--png", action="store_true", help="also render report.png with headless Chromium")
    report.set_defaults(func=_cmd_report)
    # `train` has its own parser (TRL's TrlParser over GRPOConfig); main() hands it the rest of
    # the command line. This entry only lists it in `trl-harbor --help`.
    commands.add_parser(
        "train",
        add_help=False,
        help="GRPO on a suite: every GRPOConfig field as a flag or in --config file.yaml "
        "(`trl-harbor train --help`); no --model: the embedded default run (SmolLM2-135M on CPU)",
    )
    add_images_parser(commands)
    return parser


def _add_check_parser(commands: argparse._SubParsersAction) -> None:
    from trl_harbor.cli.option_flags import add_option_flags

    check = commands.add_parser("check", help="oracle must score 1 and doing nothing 0, for every task")
    check.add_argument(
        "suite", help="a suite: a folder, org/name (HF), NAME@VERSION (registry), hub:org/name, a git repo, a lock"
    )
    check.add_argument("--environment-type", "-e", default="local", help="local (default), docker, ... or module:Class")
    check.add_argument(
        "--jobs", "--concurrency", "-j", "-n", dest="concurrency", type=int, default=max(2, (os.cpu_count() or 2) * 2),
        help="tasks checked at once",
    )  # fmt: skip
    check.add_argument("--task", "-t", action="append", help="check only this task (repeatable)")
    check.add_argument("--n-tasks", "-l", type=int, default=None, help="the first N tasks of the sorted suite")
    _add_dataset_flags(check)
    add_option_flags(check)
    check.add_argument("--json", action="store_true", help="print the results as JSON (exit status unchanged)")
    check.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    check.set_defaults(func=_cmd_check)


def _add_eval_parser(commands: argparse._SubParsersAction) -> None:
    from trl_harbor.cli.option_flags import add_option_flags

    # Each flag's dest is the EvalConfig field it sets (_eval_one passes them through by name).
    ev = commands.add_parser("eval", help="a model behind an OpenAI-compatible endpoint on a suite: pass@k")
    ev.add_argument(
        "suite", nargs="+", help="a task suite in any form `check` takes (several: each evaluated on its own)"
    )
    _add_dataset_flags(ev)
    ev.add_argument("--base-url", default=None, help="the endpoint, e.g. http://127.0.0.1:8000/v1 (none: local)")
    ev.add_argument("--model", required=True, help="the model the endpoint serves; without --base-url a path or hub id")
    ev.add_argument("--agent", default="bash", help="harness: bash, jupyter, terminal_notes, mod:Cls, file.py:Cls")
    ev.add_argument("--environment-type", "-e", default="local", help="local (default), docker, ... or module:Class")
    ev.add_argument("--num-tasks", type=int, default=None, help="the first N tasks of the sorted suite")
    ev.add_argument("--indices", type=int, nargs="+", default=None, help="these positions of the sorted suite")
    ev.add_argument("--num-rollouts", "-n", type=int, default=4, help="rollouts per task (default 4)")
    ev.add_argument("--k", type=int, action="append", help="report pass@k (repeatable; default 1)")
    ev.add_argument("--concurrency", "-c", type=int, default=16, help="rollouts in flight at once (default 16)")
    ev.add_argument("--max-turns", type=int, default=10, help="model turns per rollout (default 10)")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    ev.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    ev.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (local model)")
    ev.add_argument("--max-tokens", type=int, default=2048, help="tokens per model turn")
    ev.add_argument("--pass-threshold", type=float, default=1.0, help="a rollout passes at this reward (default 1)")
    add_option_flags(ev)
    ev.add_argument("--output-dir", default="outputs/trl-harbor-eval")
    ev.add_argument("--system-prompt", default=None, help="a system message in front of every task")
    ev.add_argument("--few-shot", default=None, metavar="FILE", help="example turns (JSON) in front of every task")
    ev.add_argument(
        "--chat-template", default=None, help="local model: a TRL chat template name (qwen2_5) or a .jinja file"
    )
    ev.add_argument("--seed", type=int, default=None, help="seed of a local model's sampling")
    ev.add_argument("--batch-size", type=int, default=16, help="local model: rollouts generated in one batch")
    ev.add_argument("--progress", action="store_true", help="show the progress bar even when not on a terminal")
    ev.set_defaults(func=_cmd_eval)


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    os.environ.setdefault("HARBOR_TELEMETRY", "0")
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is not None and argv[first] == "train" and set(argv[:first]) <= {"-v", "--verbose"}:
        from trl_harbor.cli.train import main as train_main

        verbose = bool(argv[:first])
        logging.basicConfig(
            level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
        )
        return train_main(argv[first + 1 :], verbose=verbose)
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("harbor").setLevel(level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
