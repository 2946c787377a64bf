"""Progress of the long phases inside a training step: sandbox starts and verification (real sandboxes)."""

from __future__ import annotations

import io

from conftest import BUNDLED_SUITE, requires_local

from trl_harbor import HarborSpec, progress


@requires_local
def test_sandbox_starts_and_verification_report_their_progress(close_sandboxes: None) -> None:
    seen: list[tuple[str, int, int]] = []
    previous = progress.set_reporter(lambda phase, done, total: seen.append((phase, done, total)))
    try:
        spec = HarborSpec(BUNDLED_SUITE, environment_type="local", indices=[0, 1, 2])
        envs = [spec.environment_factory() for _ in range(3)]
        for env, task_dir in zip(envs, spec.task_dirs, strict=True):
            env.reset(task_dir=str(task_dir))
        for env in envs:
            env.bash("true")  # waits for its sandbox
        reward = spec.reward_funcs
        reward(completions=[None] * 3, environments=envs)
    finally:
        progress.set_reporter(previous)
    starts = [(done, total) for phase, done, total in seen if phase == "sandbox starts"]
    verification = [(done, total) for phase, done, total in seen if phase == "verification"]
    assert starts and starts[-1] == (3, 3)  # the burst of three ended with all three up
    assert max(total for _, total in starts) == 3
    assert verification == [(1, 3), (2, 3), (3, 3)]


def test_line_reporter_redraws_on_a_terminal_and_prints_once_elsewhere() -> None:
    terminal, log = io.StringIO(), io.StringIO()
    ticks = iter([0.0, 0.5, 2.0, 2.5])
    shown = progress.LineReporter(terminal.write, terminal=True, clock=lambda: next(ticks))
    for done in (1, 2, 3, 4):
        shown("verification", done, 4)
    assert "verification: 3/4 (2 s)" in terminal.getvalue() and "verification: 4/4 in 2.5 s\n" in terminal.getvalue()
    ticks = iter([0.0, 3.0])
    plain = progress.LineReporter(log.write, terminal=False, clock=lambda: next(ticks))
    plain("sandbox starts", 1, 2)
    plain("sandbox starts", 2, 2)
    assert log.getvalue() == "  sandbox starts: 2/2 in 3.0 s\n"  # one line, at the end


def test_a_failing_reporter_never_breaks_the_caller() -> None:
    def broken(phase, done, total):
        raise RuntimeError("display gone")

    previous = progress.set_reporter(broken)
    try:
        progress.report("verification", 1, 2)
    finally:
        progress.set_reporter(previous)


def test_an_open_phase_is_redrawn_with_its_time_on_a_terminal_and_ends_as_one_line() -> None:
    terminal, log = io.StringIO(), io.StringIO()
    now = [0.0]
    shown = progress.LineReporter(terminal.write, terminal=True, clock=lambda: now[0], heartbeat=None)
    shown("model update", 0, 1)
    now[0] = 12.0
    shown.tick()  # no count moves in a forward and backward pass: the heartbeat redraws its time
    assert terminal.getvalue().endswith("  model update (12 s)")
    now[0] = 20.0
    shown("model update", 1, 1)
    assert terminal.getvalue().endswith("\r\033[K  model update in 20.0 s\n")
    shown.tick()  # nothing open: nothing drawn
    assert terminal.getvalue().endswith("in 20.0 s\n")
    plain = progress.LineReporter(log.write, terminal=False, clock=lambda: now[0], heartbeat=None)
    with progress_to(plain), progress.phase("generation"):
        now[0] = 23.0
        plain.tick()
    assert log.getvalue() == "  generation in 3.0 s\n"  # elsewhere one line a phase, at its end


def test_the_heartbeat_redraws_an_open_phase_until_closed() -> None:
    import threading

    drawn = threading.Event()
    lines: list[str] = []

    def write(text: str) -> None:
        lines.append(text)
        if "(" in text:
            drawn.set()

    shown = progress.LineReporter(write, terminal=True, min_seconds=0.0, heartbeat=0.01)
    shown("generation", 0, 1)
    drawn.clear()
    assert drawn.wait(5), "the heartbeat never redrew the open phase"
    shown.close()
    assert shown._beating is not None
    shown._beating.join(5)
    assert not shown._beating.is_alive()


def progress_to(reporter):
    """Install ``reporter`` for a ``with`` block."""
    import contextlib

    @contextlib.contextmanager
    def installed():
        previous = progress.set_reporter(reporter)
        try:
            yield
        finally:
            progress.set_reporter(previous)

    return installed()
