"""What a library owes the process it is imported into: no handler or hook at import, no noise at exit.

Each check runs in a fresh interpreter: what an import does to a process shows only in one that has
not imported the package yet.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BUNDLED_SUITE, GOLD_TASK, requires_local

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, *, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False)


_IMPORTS = """
import atexit, json, signal, sys
registered = []
atexit.register = lambda f, *a, **k: registered.append(getattr(f, "__qualname__", repr(f))) or f
before = signal.getsignal(signal.SIGTERM)
import trl_harbor.training.spec, trl_harbor.training.env, trl_harbor.runtime, trl_harbor.rollout.episode
from trl_harbor.training.spec import HarborSpec
print(json.dumps({
    "sigterm_unchanged": signal.getsignal(signal.SIGTERM) is before,
    "atexit": registered,
    "mix": callable(getattr(HarborSpec, "mix", None)),
    "mix_module_loaded": "trl_harbor.training.mix" in sys.modules,
}))
"""


def test_importing_installs_no_signal_handler_and_no_exit_hook_and_mix_is_there() -> None:
    done = _python(_IMPORTS)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["sigterm_unchanged"], seen
    assert [name for name in seen["atexit"] if "trl_harbor" in name or name in ("close_all", "_kill_all_at_exit")] == []
    assert seen["mix"] and not seen["mix_module_loaded"], seen  # present without importing mixing


_ARMED = """
import signal, sys
from trl_harbor import HarborBashEnv
before = signal.getsignal(signal.SIGTERM)
HarborBashEnv(environment_type="local")  # an environment is what has sandboxes to stop
print(signal.getsignal(signal.SIGTERM) is not before)
"""


def test_an_environment_arms_the_teardown_on_sigterm() -> None:
    done = _python(_ARMED)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


_LEFT_RUNNING = f"""
from trl_harbor import HarborSpec
spec = HarborSpec({str(BUNDLED_SUITE)!r}, environment_type="local")
task = next(t for t in spec.task_dirs if t.name == {GOLD_TASK!r})
envs = [spec.environment_factory() for _ in range(3)]
for env in envs:
    env.reset(task_dir=str(task))
    env.cycle = env  # collected only by the last collection, while the interpreter shuts down
print(envs[0].bash("echo alive").strip())
# exit with every sandbox still running and every environment still referenced
"""


@requires_local
def test_exiting_with_live_environments_prints_nothing_and_stops_them() -> None:
    done = _python(_LEFT_RUNNING)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "alive"
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    # Sandboxes still starting when the process exits are stopped, not reported as lost starts.
    for prefix in ("trl-harbor:", "harbor-local-sandbox:"):  # trl-harbor's log lines, and the sandbox's
        assert prefix not in done.stderr, done.stderr[-3000:]
    leftover = subprocess.run(["pgrep", "-f", "trl-harbor.*building_b_humidity"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout


def _reference_tests_module():
    spec = importlib.util.spec_from_file_location("reference_tests", REPO / "scripts" / "reference_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_tests_harness_points_every_import_at_trl_harbor() -> None:
    substitute = _reference_tests_module().substitute
    source = (
        "from trl.experimental.harbor import AGENTS, HarborBashEnv, HarborEnv, HarborSpec\n"
        "from trl.experimental.harbor._spec import _outcome_reward_func, _resolve_agent\n"
        "x = _resolve_agent('trl.experimental.harbor:HarborBashEnv')\n"
    )
    out = substitute(source)
    assert "trl.experimental" not in out
    namespace: dict = {}
    exec(out, namespace)
    from trl_harbor import HarborBashEnv
    from trl_harbor.training.rewards import harbor_reward

    assert namespace["x"] is HarborBashEnv and namespace["_outcome_reward_func"] is harbor_reward
    with pytest.raises(ValueError, match="_new_private"):
        substitute("from trl.experimental.harbor._env import _new_private\n")
