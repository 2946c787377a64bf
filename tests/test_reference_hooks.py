"""The reference integration's lifecycle hooks, honoured: a harness written for ``trl.experimental.harbor``.

Public harness code subclasses the reference's ``HarborEnv`` and overrides its coroutines ``_start(task_dir)``,
``_upload_build_files``, ``_setup``, ``_verify`` and ``_stop``, and uses ``_run``, ``_loop``, ``_env``,
``_task``, ``_paths``. The reference calls them in this order (``trl/experimental/harbor/_env.py``): ``reset``
awaits ``_start``, which stops the previous sandbox, starts the new one, then ``_upload_build_files``, the
task's healthcheck, ``/workdir`` made, ``_setup``; it returns the instruction, to which ``reset`` appends
``PROMPT_SUFFIX``. ``reward`` awaits ``_verify`` once and returns its value. The harness below is written
that way (our own code) and runs on real local sandboxes with Harbor's real verifier.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import GOLD_ANSWER, GOLD_TASK, requires_local

from trl_harbor import HarborBashEnv, HarborEnv, HarborSpec
from trl_harbor.training.env import REFERENCE_HOOKS, overrides

pytestmark = requires_local


class ReferenceStyleEnv(HarborBashEnv):
    """Overrides every hook the way public harnesses do (each calls super() and adds its own step)."""

    calls: list[tuple] = []

    async def _start(self, task_dir: str) -> str:
        self.calls.append(("start", Path(task_dir).name))
        instruction = await super()._start(task_dir)
        result = await self._env.exec("test -d /workdir && cat /tmp/from-upload")
        self.calls.append(("started", result.stdout.strip(), self._task.name, self._paths is not None))
        return "[reference-style] " + instruction

    async def _upload_build_files(self) -> None:
        # Before the healthcheck, with the sandbox up: what the reference replays Dockerfile COPYs into.
        await self._env.exec("echo uploaded > /tmp/from-upload")
        self.calls.append(("upload", self._task.name))

    async def _setup(self) -> None:
        result = await self._env.exec("cat /tmp/from-upload; test -d /home/user/input && echo input")
        self.calls.append(("setup", result.stdout.split()))

    async def _verify(self) -> float:
        answer = await self._env.exec("cat /workdir/answer.txt")
        graded = await super()._verify()  # Harbor's verifier, graded as always
        self.calls.append(("verify", answer.stdout.strip(), graded))
        return 0.25 if graded == 1.0 else 0.0  # the harness's own shaping is the reward

    async def _stop(self) -> None:
        answer = await self._env.exec("cat /workdir/answer.txt 2>/dev/null || echo none")
        self.calls.append(("stop", answer.stdout.strip()))
        await super()._stop()

    def probe(self) -> str:
        """Run two commands through the reference's ``_run`` and ``_loop``.

        Returns:
            Their outputs.
        """
        by_run = self._run(self._env.exec("echo run"))
        by_loop = asyncio.run_coroutine_threadsafe(self._env.exec("echo loop"), self._loop).result()
        return by_run.stdout.strip() + " " + by_loop.stdout.strip()


def _wait_for(calls: list[tuple], kind: str, within: float = 60.0) -> tuple:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = [call for call in calls if call[0] == kind]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {kind!r} hook call within {within} s: {calls}")


def test_every_hook_of_the_reference_is_a_coroutine_here() -> None:
    from trl.experimental.harbor import _env as reference

    hooks = {name for name, value in vars(reference.HarborEnv).items() if asyncio.iscoroutinefunction(value)}
    assert hooks == set(REFERENCE_HOOKS)
    for hook in hooks:
        assert asyncio.iscoroutinefunction(getattr(HarborEnv, hook)), hook
    assert all(overrides(ReferenceStyleEnv, hook) for hook in hooks)
    assert not any(overrides(HarborBashEnv, hook) for hook in hooks)


def test_a_reference_style_harness_gets_every_hook_at_the_reference_moment(copy_tasks, close_sandboxes) -> None:
    suite = copy_tasks(GOLD_TASK)
    spec = HarborSpec(suite, agent=ReferenceStyleEnv, environment_type="local")
    calls = ReferenceStyleEnv.calls = []
    env = spec.environment_factory()
    task_dir = str(spec.task_dirs[0])

    prompt = env.reset(task_dir=task_dir)
    assert prompt.startswith("[reference-style] ") and prompt.endswith(ReferenceStyleEnv.PROMPT_SUFFIX)
    assert "[reference-style] " + spec.tasks[0].task.instruction in prompt
    # _start waited for its sandbox: _upload_build_files ran first, then setup (after the folders), then back in _start.
    assert [c[0] for c in calls] == ["start", "upload", "setup", "started"], calls
    assert calls[2] == ("setup", ["uploaded", "input"])
    assert calls[3][1:] == ("uploaded", spec.tasks[0].task.name, True)
    assert env.probe() == "run loop"

    env.bash(f"echo -n {GOLD_ANSWER} > /workdir/answer.txt")
    assert spec.reward_funcs(environments=[env], completions=[None]) == [0.25]  # _verify's value is the reward
    assert env.reward == 0.25  # once: the hook is not called again
    assert [c for c in calls if c[0] == "verify"] == [("verify", GOLD_ANSWER, 1.0)]

    calls.clear()
    env.reset(task_dir=task_dir)  # the previous episode's _stop runs, with its own sandbox still there
    assert _wait_for(calls, "stop") == ("stop", GOLD_ANSWER)
    assert env.bash("cat /workdir/answer.txt 2>/dev/null || echo fresh").strip() == "fresh"
    assert env.reward == 0.0  # a wrong (empty) answer, graded by the verifier through the hook
    assert [c for c in calls if c[0] == "verify"] == [("verify", "", 0.0)]


def test_the_default_hooks_keep_the_background_start(copy_tasks, close_sandboxes) -> None:
    """A harness that overrides no hook: reset returns before its sandbox is up (starts overlap)."""
    suite = copy_tasks(GOLD_TASK)
    spec = HarborSpec(suite, environment_type="local")
    env = spec.environment_factory()
    env.reset(task_dir=str(spec.task_dirs[0]))
    assert env._episode is not None and not env._episode.ready.done()
    env.bash(f"echo -n {GOLD_ANSWER} > /workdir/answer.txt")
    assert env.reward == 1.0
    assert env.verification.concealed == ()  # an honest rollout concealed nothing (harbor/concealed: 0)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("    def _setup(self):\n        pass\n", r"_setup is not a coroutine function.*async def _setup"),
        ("    async def _start(self):\n        return ''\n", r"_start cannot be called as _start\(self, task_dir\)"),
        ("    def _verify(self):\n        return 1.0\n", r"_verify is not a coroutine function"),
    ],
)
def test_a_hook_that_cannot_be_called_as_the_reference_calls_it_fails_at_spec_build(
    copy_tasks, body: str, named: str
) -> None:
    namespace: dict = {}
    exec(f"from trl_harbor import HarborBashEnv\nclass Broken(HarborBashEnv):\n{body}", namespace)
    with pytest.raises(TypeError, match=named):
        HarborSpec(copy_tasks(GOLD_TASK), agent=namespace["Broken"], environment_type="local")
