"""Nothing left behind when a training process ends (issue #49): every sandbox's mounts and folder gone.

Two ways tear a sandbox down: its environment's stop (on the shared loop's thread: ``Box.kill``, then
the tree removed) and the sandbox package's exit hook (``Box.kill_now`` on the main thread, for every
box still alive). An environment dropped by its user is stopped in the background, so at exit both can
be under way for the same box; the stop that found the other one started used to return at once and
remove the tree while the other was still detaching its mounts (``EBUSY`` on ``rootfs``, in about a run
of three of the flow below). One teardown owns a box now and the others wait for it; the exit hook also
removes whatever of the process's own is still in the state root, found by its name.

Measured: on the code before, the flow's stop failed so in 8 of 12 runs beside CPU load, and the
flow test (8 runs) failed in 1 of 2 attempts with 4 runs each; after, 0 of 12 and 0 of 4 attempts.

The flow of the issue (``HarborSpec``'s environments and grading) is trl-harbor's; the sandbox's own teardown
tests (two teardowns of one box, ``harbor run -n 8``) are the package's:
``packages/harbor-local-sandbox/tests/test_teardown_at_exit.py``.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from sandbox_helpers import runs_leave_nothing

pytestmark = [pytest.mark.local, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

#: The issue's flow: 16 environments reset together, a call each, graded as a batch; the same 16 reset
#: again one after another (each reset stops its last sandbox in the background), a call, ``env.reward``;
#: then the script returns, its environments dropped.
FLOW = textwrap.dedent(
    """
    import sys
    from trl_harbor import HarborSpec

    def main():
        spec = HarborSpec(sys.argv[1], agent="bash", environment_type="local", preflight=False)
        row = next(r for r in spec.train_dataset if r["task_dir"].endswith("building_b_humidity"))
        envs = [spec.environment_factory() for _ in range(16)]
        for env in envs:
            env.reset(**row)
        for env in envs:
            env.bash("echo 51.46 > /workdir/answer.txt")
        assert spec.reward_funcs(environments=envs, prompts=[None] * 16, completions=[None] * 16) == [1.0] * 16
        for env in envs:
            env.reset(**row)
            env.bash("echo 51.46 > /workdir/answer.txt")
            assert env.reward == 1.0

    main()
    """
)


def test_the_issues_flow_leaves_nothing_beside_cpu_load(tmp_path: Path) -> None:
    """The issue's script, run in fresh processes beside two busy loops, each with its own state folder:
    no mount and no sandbox folder is left after any of them exits, and no stop fails on the way."""
    script = tmp_path / "flow.py"
    script.write_text(FLOW)
    runs_leave_nothing(tmp_path, 8, [sys.executable, str(script), str(ROOT / "examples" / "tasks")], "flow")
