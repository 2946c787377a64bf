"""The package speaks in its own names: nothing of its source or tests names the trainer it was written for.

Its variables are ``HARBOR_LOCAL_SANDBOX_*``, its folders, cgroups, containers and in-sandbox paths
``harbor-local-sandbox...``, its command ``harbor-local-sandbox``. The one project its README may name
(who else uses it) is found here by a pattern, never spelled out, so this file passes its own scan.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from harbor_alone import PACKAGE_DIR

#: The trainer's names in any spelling: its distribution, its module, its variables' prefix.
FOREIGN = re.compile(rb"trl[-_]harbor", re.IGNORECASE)
#: Build outputs and caches (not the package's source): compiled helpers, bytecode, metadata.
SKIPPED = {"__pycache__", "_bin", "build", "dist", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def foreign_names(*paths: Path, base: Path = PACKAGE_DIR.parent) -> list[str]:
    """``path:line: text`` for each line of the files under ``paths`` that names the trainer (build outputs
    skipped), paths shown relative to ``base``."""
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            files.append(path)
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info"))
            files += [Path(folder, name) for name in sorted(names) if not name.endswith((".pyc", ".so"))]
    return [
        f"{path.relative_to(base)}:{number}: {line.decode(errors='replace').strip()[:160]}"
        for path in files
        for number, line in enumerate(path.read_bytes().splitlines(), 1)
        if FOREIGN.search(line)
    ]


def test_the_package_source_and_tests_use_its_own_names() -> None:
    found = foreign_names(PACKAGE_DIR / "src", PACKAGE_DIR / "tests", PACKAGE_DIR / "pyproject.toml")
    assert not found, "the package names another project (use its own names):\n" + "\n".join(found)


def test_the_scan_finds_each_spelling(tmp_path: Path) -> None:
    """Each spelling is found (made here from its parts), build outputs are not scanned."""
    prefix, suffix = "trl", "harbor"
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text(f"x = '{prefix}-{suffix}'\ny = 1\n")
    (tmp_path / "pkg" / "b.c").write_text(f'#define P "/run/{prefix}_{suffix}"\n')
    (tmp_path / "pkg" / "c.md").write_text(f"set {prefix.upper()}_{suffix.upper()}_CACHE_DIR\n")
    (tmp_path / "pkg" / "__pycache__" / "d.py").write_text(f"{prefix}-{suffix}\n")
    (tmp_path / "pkg" / "clean.toml").write_text("name = 'harbor-local-sandbox'\n")
    found = foreign_names(tmp_path / "pkg", tmp_path / "pkg" / "clean.toml", base=tmp_path)
    assert [line.split(":")[:2] for line in found] == [["pkg/a.py", "1"], ["pkg/b.c", "1"], ["pkg/c.md", "1"]]
