"""Shared fixtures for the trl-harbor integration tests (spec, agents, env, GRPO)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HARBOR_TELEMETRY", "0")

REPO = Path(__file__).resolve().parents[1]
BUNDLED_SUITE = REPO / "examples" / "tasks"
#: The bundled task used by the episode tests, and its gold answer.
GOLD_TASK = "building_b_humidity"
GOLD_ANSWER = "51.46"


#: Marks tests that run real sandboxes on the local bubblewrap backend. They are never
#: skipped: where bubblewrap is missing they fail, as they should.
requires_local = pytest.mark.local


@pytest.fixture(scope="session")
def bundled_suite() -> Path:
    """Path of the bundled 15-task suite (examples/tasks)."""
    assert BUNDLED_SUITE.is_dir(), BUNDLED_SUITE
    return BUNDLED_SUITE


@pytest.fixture
def copy_tasks(tmp_path: Path) -> Callable[..., Path]:
    """Copy bundled tasks into a fresh folder and return that folder (a suite of its own)."""

    def copy(*names: str, dest: str = "suite") -> Path:
        root = tmp_path / dest
        root.mkdir(parents=True, exist_ok=True)
        for name in names or (GOLD_TASK,):
            shutil.copytree(BUNDLED_SUITE / name, root / name)
        return root

    return copy


@pytest.fixture
def close_sandboxes() -> Iterator[None]:
    """Stop every sandbox a test left running."""
    yield
    from trl_harbor import close_all

    close_all()
