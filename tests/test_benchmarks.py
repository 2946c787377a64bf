"""The benchmarks still run against the package: each script imports (its names and tables resolve).

The benchmarks are not run in CI (they measure, and the machines are noisy); this catches the
breakage a refactor leaves in them (a renamed function, a moved module), which otherwise shows
only when somebody next wants a figure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_benchmark_imports() -> None:
    scripts = sorted(path.stem for path in BENCHMARKS.glob("*.py"))
    assert "sandbox" in scripts and "batch" in scripts
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run(
        [sys.executable, "-c", code, *scripts], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
