"""Shared fixtures for the trl-harbor integration tests (spec, agents, env, GRPO)."""

from __future__ import annotations

import importlib.abc
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The Docker tests' daemon and the registry it is seeded from, for every test module: a session
# fixture that test modules imported themselves would run once per importing module.
from docker_daemon import docker_daemon, loopback_registry  # noqa: E402, F401

os.environ.setdefault("HARBOR_TELEMETRY", "0")
# litellm (Harbor's model client, Terminus-2's) fetches its model price list from GitHub on import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Many tests build environments of docker-typed specs (never started) on machines without a Docker
# daemon, and building one runs the backend preflight; it is tested explicitly (preflight=True, or
# the variable removed). Building a spec never checks the backend.
os.environ.setdefault("TRL_HARBOR_PREFLIGHT", "0")

REPO = Path(__file__).resolve().parents[1]
BUNDLED_SUITE = REPO / "examples" / "tasks"
#: The bundled task used by the episode tests, and its gold answer.
GOLD_TASK = "building_b_humidity"
GOLD_ANSWER = "51.46"


#: Marks tests that run real sandboxes on the local bubblewrap backend. They are never
#: skipped: where bubblewrap is missing they fail, as they should.
requires_local = pytest.mark.local

#: The markers of the tests that need more than this interpreter: sandboxes (``local``), the private
#: Docker daemon (``docker``), a Ray cluster (``ray``), or minutes (``slow``). The fast tier (docs/testing.md)
#: runs the rest: ``scripts/test.sh --fast``, or ``TRL_HARBOR_FAST_TIER=1`` for any pytest command.
FULL_TIER_MARKERS = ("local", "docker", "ray", "slow")
#: Set (to 1) for the fast tier: the full tier's tests are deselected, and a test that starts a sandbox fails.
FAST_TIER = os.environ.get("TRL_HARBOR_FAST_TIER", "") not in ("", "0")
if FAST_TIER:  # the local sandbox package's fast tier too: its plug-in (sandbox_tier) refuses local sandboxes
    os.environ["HARBOR_LOCAL_SANDBOX_TEST_TIER"] = "fast"
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def bundled_images() -> Iterator[None]:
    """Build the bundled suite's images once, up front (the local sandbox's default root is the task's image).

    Requested by every collected test marked ``local`` or ``ray`` (:func:`pytest_collection_modifyitems`), first of
    its fixtures: the first of them builds, before its own setup; a session without one builds nothing.

    A cold build (Debian bootstrapped with mmdebstrap where no registry is reachable, then one
    shared ``apt-get install python3`` layer) takes about a minute; tests should not pay it inside
    their own time limits. Cached builds take under a second. Where task images cannot be built
    (not root, no buildah), nothing is built and the tests that need them fail with the reason.

    At the end of the session the default image cache's mounts (buildah mounts each image a
    sandbox uses, and keeps it mounted) are released: the suite leaves nothing mounted, and the
    next run mounts what it uses again.
    """
    if os.geteuid() != 0 or shutil.which("buildah") is None:
        yield
        return
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "trl_harbor.cli", "images", "build", str(BUNDLED_SUITE)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    yield
    from harbor_local_sandbox.oci import ImageStore

    ImageStore().release_mounts()


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


class _Absent(importlib.abc.MetaPathFinder):
    """Makes a package unimportable, as where it is not installed."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, name, path=None, target=None):
        if name == self.package or name.startswith(self.package + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def without_the_local_sandbox(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The local sandbox's package absent for the test (as in a venv without ``trl-harbor[local]``):
    any import of it fails; the modules already loaded come back afterwards."""
    for name in [m for m in sys.modules if m == "harbor_local_sandbox" or m.startswith("harbor_local_sandbox.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Absent("harbor_local_sandbox"), *sys.meta_path])
    yield


def trl_tools(cls: type) -> list[str]:
    """The tool names TRL's GRPOTrainer derives from an environment class (the same rule as TRL)."""
    import inspect

    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def no_process_left(marker: str, within: float = 5.0) -> list[int]:
    """Wait up to ``within`` seconds for every live host process with ``marker`` to go; return the rest."""
    import time

    from sandbox_helpers import live_processes_with

    deadline = time.monotonic() + within
    while (left := live_processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def one_step_grpo_config(tmp_path: Path, **fields):
    """A ``GRPOConfig`` for one CPU step of two rollouts of one prompt, writing under ``tmp_path``.

    Args:
        tmp_path: Where the trainer writes (``out/``).
        **fields: More ``GRPOConfig`` fields (completion length, turns, seed, ...).

    Returns:
        The config.
    """
    from trl import GRPOConfig

    defaults = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "max_steps": 1, "num_generations": 2,
                "per_device_train_batch_size": 2, "report_to": "none", "logging_steps": 1, "save_strategy": "no"}  # fmt: skip
    return GRPOConfig(**{**defaults, **fields})


def tiny_grpo_trainer(tmp_path: Path, spec, tool_calls: list[str], prompt_suffix: str, reward_funcs: list):
    """A GRPOTrainer for one CPU step, with a tiny model rigged to emit one of ``tool_calls``.

    Args:
        tmp_path: Where the trainer writes.
        spec: The ``HarborSpec`` whose dataset and environment factory the trainer uses.
        tool_calls: Tool-call texts (``trl_harbor.testing.tool_call_text``) the policy samples from.
        prompt_suffix: The harness's prompt suffix (its words go into the tokenizer's corpus).
        reward_funcs: The trainer's reward functions.

    Returns:
        The trainer (two rollouts of one prompt per step), not yet trained.
    """
    import torch
    from trl import GRPOTrainer

    from trl_harbor.testing import build_model, build_tokenizer, script_tool_calls

    instructions = [p.read_text() for p in BUNDLED_SUITE.glob("*/instruction.md")]
    tokenizer = build_tokenizer(corpus=[*instructions, prompt_suffix], extra_tokens=tool_calls)
    model = build_model(tokenizer, seed=0)
    script_tool_calls(model, tokenizer, tool_calls)
    torch.manual_seed(1)
    args = one_step_grpo_config(
        tmp_path,
        max_completion_length=64,
        max_tool_calling_iterations=2,
        seed=1,  # with this seed the two rollouts end on different answers (reward std > 0)
    )
    return GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=reward_funcs,
    )


#: CI stops a run at 90 minutes and then shows only the end of its output: past this budget no
#: further test starts, so the run ends with its summary of what failed (a run cut off would not).
SESSION_BUDGET_SEC = float(os.environ.get("TRL_HARBOR_TEST_BUDGET_SEC", 75 * 60))
_SESSION_START = time.monotonic()
_CONFIG: pytest.Config | None = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Stop the session, summary printed, once it has run past :data:`SESSION_BUDGET_SEC`."""
    spent = time.monotonic() - _SESSION_START
    if spent > SESSION_BUDGET_SEC:
        pytest.exit(f"the session ran {spent / 60:.0f} min, past its budget; {item.nodeid} and the rest not run", 3)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Name a failure the moment it happens, with its last line (what a cut-off log still shows)."""
    if not report.failed:
        return
    lines = str(report.longrepr).strip().splitlines() or [""]
    errors = [line for line in lines if line.startswith("E ")]  # pytest's lines of the error itself
    lines = errors[:1] or lines[-1:]
    reporter = None if _CONFIG is None else _CONFIG.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\n[failed] {report.nodeid} ({report.when}): {lines[0][:300]}")


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier deselects the full tier's tests; every other session gives each ``local`` or ``ray``
    test :func:`bundled_images` (a test outside this folder cannot see the fixture: it is built there only
    if a test here ran first)."""
    if FAST_TIER:
        kept = [item for item in items if not any(item.get_closest_marker(m) for m in FULL_TIER_MARKERS)]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item not in kept])
            items[:] = kept
        return
    for item in items:
        fixtures = getattr(item, "fixturenames", None)
        if (
            (item.get_closest_marker("local") or item.get_closest_marker("ray"))  # Ray's nodes run local sandboxes
            and fixtures is not None
            and "bundled_images" not in fixtures
            and item.path.is_relative_to(TESTS)
        ):
            fixtures.insert(0, "bundled_images")


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_starts_no_sandbox() -> Iterator[None]:
    """In the fast tier, starting a Docker sandbox is refused (``SandboxUnavailableError``), recorded, and fails
    the test at its teardown; a local one (looking up bubblewrap) too. Both by the local sandbox package's
    plug-in (``packages/harbor-local-sandbox/tests/sandbox_tier.py``, loaded by the pytest configuration): a
    sandbox test without its marker fails there instead of passing on a machine that has bubblewrap."""
    if not FAST_TIER:
        yield
        return
    from harbor.environments.docker.docker import DockerEnvironment
    from sandbox_tier import refusal

    patch = pytest.MonkeyPatch()
    patch.setattr(DockerEnvironment, "start", refusal("docker sandbox", "docker"))
    yield
    patch.undo()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the adversarial corpus's and the broken suites' tables, and the Docker daemon's fate, when those tests ran.

    (Here, not in conftest files of their own folders: every test module imports this one as
    ``conftest``, and a second module of that name would shadow it.)
    """
    docker = sys.modules.get("docker_daemon")
    if docker is not None and docker.REPORT:
        terminalreporter.section("docker")
        for line in docker.REPORT:
            terminalreporter.write_line(line)
    table = sys.modules.get("adv_table")
    if table is not None and table.RESULTS:
        terminalreporter.section("adversarial corpus")
        terminalreporter.write_line(table.render(table.RESULTS))
    if table is not None and getattr(table, "GRADING", None):
        terminalreporter.section("attacks on grading")
        terminalreporter.write_line(table.render_grading(table.GRADING, details=True))
    view = sys.modules.get("test_view")
    if view is not None and getattr(view, "VIEW", None):
        terminalreporter.section("the verifier's view")
        terminalreporter.write_line(view.render(view.VIEW, details=True))
    module = sys.modules.get("test_bad_suites")
    rows = getattr(module, "ROWS", None)
    if rows:
        width = max(len(name) for name, *_ in rows)
        terminalreporter.section("broken suites")
        terminalreporter.write_line(f"{'case':<{width}}  {'caught at':<10}  outcome")
        for name, stage, outcome in rows:
            terminalreporter.write_line(f"{name:<{width}}  {stage:<10}  {outcome}")
