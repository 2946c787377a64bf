"""The package's test tiers, a pytest plug-in (``-p sandbox_tier``, from the package's ``pyproject.toml``).

With ``HARBOR_LOCAL_SANDBOX_TEST_TIER=fast`` the session is the **fast tier**: no root, no bubblewrap, no image
build. The tests marked ``local`` (real sandboxes) or ``slow`` are deselected, and starting a local sandbox
(looking up bubblewrap) is refused with ``SandboxUnavailableError`` and fails the test that tried, at its
teardown, even if it caught the error: a sandbox test without its marker fails there instead of passing on a
machine that has bubblewrap. (``pytest -m "not local and not slow"`` selects the same tests without the guard.)

A plug-in, not a ``conftest.py``: the repository that holds the package runs these tests in one session with
its own, whose modules import their ``conftest`` by name (a second one would shadow it); its configuration
loads this plug-in too, so the guard covers its tests as well, and it may refuse other sandboxes the same way
(:func:`refusal`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from typing import NoReturn

import pytest

#: The variable that selects the tier, and its value for the fast tier.
TIER_VARIABLE = "HARBOR_LOCAL_SANDBOX_TEST_TIER"
#: The markers of the tests the fast tier leaves out.
FULL_TIER_MARKERS = ("local", "slow")
#: The modules that look bubblewrap up (each holds its own reference to ``bwrap_path``).
_LOOKUPS = ("_binaries", "_box", "_diagnose", "local")

#: The tests that tried to start a sandbox in the fast tier (each fails at its teardown).
_STARTED: list[str] = []


def fast_tier() -> bool:
    """Whether this session is the fast tier (read when asked: a configuration may set it as it loads)."""
    return os.environ.get(TIER_VARIABLE, "").strip().lower() == "fast"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier deselects the tests marked ``local`` or ``slow``."""
    if not fast_tier():
        return
    kept = [item for item in items if not any(item.get_closest_marker(m) for m in FULL_TIER_MARKERS)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def refusal(what: str, marker: str) -> Callable[..., NoReturn]:
    """A stand-in for what starts a sandbox of kind ``what``: it records the try (the test then fails, at its
    teardown) and raises ``SandboxUnavailableError``, naming the ``marker`` the test needs."""
    from harbor_local_sandbox.errors import SandboxUnavailableError

    def refused(*args, **kwargs) -> NoReturn:
        _STARTED.append(f"{what}: mark it {marker!r}")
        raise SandboxUnavailableError(f"the fast tier starts no {what}: mark the test {marker!r}")

    return refused


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_refuses_sandboxes() -> Iterator[None]:
    """In the fast tier, looking bubblewrap up (what every sandbox start does first) is refused and recorded."""
    if not fast_tier():
        yield
        return
    patch = pytest.MonkeyPatch()
    refused = refusal("local sandbox (bubblewrap)", "local")
    for name in _LOOKUPS:
        module = importlib.import_module(f"harbor_local_sandbox.{name}")
        if hasattr(module, "bwrap_path"):
            patch.setattr(module, "bwrap_path", refused)
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _fast_tier_test_started_no_sandbox(_fast_tier_refuses_sandboxes: None) -> Iterator[None]:
    """Fail a fast-tier test (at its teardown) that tried to start a sandbox, in its own or a shared fixture."""
    yield
    if _STARTED:
        started = sorted(set(_STARTED))
        _STARTED.clear()
        pytest.fail(f"a fast-tier test tried to start a {'; a '.join(started)}", False)
