"""Prints the adversarial corpus's table at the end of the session (see ``adv_table.py``)."""

from __future__ import annotations

import pytest
from adv_table import RESULTS, render


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if RESULTS:
        terminalreporter.section("adversarial corpus")
        terminalreporter.write_line(render(RESULTS))
