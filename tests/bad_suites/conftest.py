"""Prints the broken-suite table at the end of the session (rows collected by ``test_bad_suites.py``)."""

from __future__ import annotations

import sys

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    module = sys.modules.get("test_bad_suites")
    rows = getattr(module, "ROWS", None)
    if rows:
        width = max(len(name) for name, *_ in rows)
        terminalreporter.section("broken suites")
        terminalreporter.write_line(f"{'case':<{width}}  {'caught at':<10}  outcome")
        for name, stage, outcome in rows:
            terminalreporter.write_line(f"{name:<{width}}  {stage:<10}  {outcome}")
