#!/usr/bin/env python3
"""Run TRL's own tests of ``trl.experimental.harbor`` against trl-harbor, by import substitution.

TRL's test file (``tests/experimental/test_harbor.py`` in a TRL checkout; TRL's sdist does not ship
its tests, so it is not available offline) is copied into a scratch package, its imports are pointed
at trl-harbor — the public module ``trl.experimental.harbor`` becomes ``trl_harbor``, and the two
private names it imports map to their public counterparts here (``_spec._resolve_agent`` →
``trl_harbor.training.agents.resolve_agent``, ``_spec._outcome_reward_func`` →
``trl_harbor.training.rewards.harbor_reward``) — and pytest runs it. Nothing else of the file changes. TRL's
``TrlTestCase`` (a fresh ``self.tmp_dir`` per test) is provided by a two-line stand-in.

Every failure must be one of the deliberate differences that ``tests/test_reference_parity.py``
lists and tests; the summary names each failing test.

Usage::

    .venv/bin/python scripts/reference_tests.py /path/to/trl            # a TRL checkout
    .venv/bin/python scripts/reference_tests.py path/to/test_harbor.py  # or the file itself
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: The private names TRL's test imports, and what they are here.
PRIVATE_NAMES = {
    "_resolve_agent": "from trl_harbor.training.agents import resolve_agent as _resolve_agent",
    "_outcome_reward_func": "from trl_harbor.training.rewards import harbor_reward as _outcome_reward_func",
}

_TESTING_UTILS = '''
import tempfile

import pytest


class TrlTestCase:
    """Stand-in for TRL's test base class: a fresh temporary folder per test (``self.tmp_dir``)."""

    @pytest.fixture(autouse=True)
    def _tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)
'''


def substitute(source: str) -> str:
    """TRL's test source with its imports pointed at trl-harbor.

    Args:
        source: The text of TRL's ``test_harbor.py``.

    Returns:
        The same test, importing ``trl_harbor``.

    Raises:
        ValueError: When the file imports a private name this script does not map.
    """

    def private(match: re.Match[str]) -> str:
        names = [name.strip() for name in match.group(1).split(",")]
        unknown = [name for name in names if name not in PRIVATE_NAMES]
        if unknown:
            raise ValueError(f"TRL's test imports private names this harness does not map: {unknown}")
        return "\n".join(PRIVATE_NAMES[name] for name in names)

    source = re.sub(r"^from trl\.experimental\.harbor\._\w+ import ([\w, ]+)$", private, source, flags=re.M)
    return source.replace("trl.experimental.harbor", "trl_harbor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trl", type=Path, help="a TRL checkout, or its tests/experimental/test_harbor.py")
    parser.add_argument("pytest_args", nargs="*", help="further pytest arguments")
    args = parser.parse_args(argv)
    test_file = args.trl / "tests" / "experimental" / "test_harbor.py" if args.trl.is_dir() else args.trl
    if not test_file.is_file():
        parser.error(f"{test_file}: no such file (give a TRL checkout or the test file)")
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-reference-tests-"))
    package = scratch / "reference_tests"
    (package / "experimental").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "testing_utils.py").write_text(_TESTING_UTILS)
    (package / "experimental" / "__init__.py").write_text("")
    (package / "experimental" / "test_harbor.py").write_text(substitute(test_file.read_text()))
    env = {k: v for k, v in os.environ.items() if k != "TRL_HARBOR_PREFLIGHT"}  # as a user has it
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", "--rootdir", str(scratch),
               str(package / "experimental" / "test_harbor.py"), *args.pytest_args]  # fmt: skip
    return subprocess.run(command, cwd=scratch, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
