"""Hostile tool calls through every harness, on real local sandboxes: all contained, none leaked.

Each case of ``adv_corpus.CASES`` is one rollout of one batch per harness (the way
``GRPOTrainer`` runs them: every rollout reset, tool calls, then the batch verified at once with
``spec.reward_funcs``). Secrets are planted where a policy would look for them: the gold answer
(``task.toml``, ``tests/``, ``solution/``), a variable in this (the training) process's
environment and a string in its memory, a file in a neighbouring live sandbox and a process
named after a canary there, a file on the host; a TCP and a UDP listener on the host's
loopback count anything that reaches them. A case *leaked* when a secret shows up in what the
tools returned, the rollout scored 1 without the answer, a host file changed or appeared, or a
listener was reached. It is *contained* when it also returned (or raised an ``Exception``, which
TRL's tool loop reports to the model), its sandbox still answers (or the rollout exhausted it
and was told it is over — never an infrastructure failure), its reward is what it deserves
(never skipped), and afterwards no process it started is left on the host. The sandboxes run on
a task image (a Debian image served by the loopback registry of ``tests/registry.py``).

The table is printed at the end of the session; the last test asserts 0 leaked.
"""

from __future__ import annotations

import hashlib
import os
import resource
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from adv_corpus import CASES, Case, Ctx, text
from adv_table import RESULTS, Outcome, render
from harbor_local_sandbox.oci import ImageStore
from registry import loopback_registry  # noqa: F401 - the session fixture

from sandbox_helpers import BASE_DOCKERFILE, live_processes_with, make_task, wait_until
from trl_harbor import HarborOptions, HarborSpec, close_all

#: Real sandboxes on the local backend (never skipped: where bubblewrap is missing they fail).
requires_local = pytest.mark.local

HOST_SHELLS = {
    "bash": lambda env, command: env.bash(command),
    "jupyter": lambda env, command: env.execute_shell_command(command),
    "terminal_notes": lambda env, command: env.shell_exec(command, blocking=True),
}
#: The trainer's own secrets: a variable of its environment and a string only in its memory.
ENV_CANARY = "envcanary" + secrets.token_hex(8)
MEMORY_CANARY = "memcanary" + secrets.token_hex(8)
COMMAND_TIMEOUT_SEC = 8
MEMORY_MB = 512


class RootChangedError(AssertionError):
    """A sandbox started after the corpus sees system files that differ from what sandboxes saw before it."""


class Listeners:
    """A TCP and a UDP socket on the host's 127.0.0.1 that count what reaches them."""

    def __init__(self) -> None:
        self.hits = 0
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.tcp_port = self.tcp.getsockname()[1]
        self.udp_port = self.udp.getsockname()[1]
        self._stop = False
        self._threads = [
            threading.Thread(target=self._serve_tcp, daemon=True),
            threading.Thread(target=self._serve_udp, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _serve_tcp(self) -> None:
        self.tcp.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                continue
            self.hits += 1
            conn.close()

    def _serve_udp(self) -> None:
        self.udp.settimeout(0.2)
        while not self._stop:
            try:
                self.udp.recvfrom(65536)
            except OSError:
                continue
            self.hits += 1

    def close(self) -> None:
        self._stop = True
        for thread in self._threads:
            thread.join()
        self.tcp.close()
        self.udp.close()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_task(root: Path, name: str, gold: str, *, network: str, base: str | None) -> Path:
    dockerfile = f"FROM {base}\n" if base else BASE_DOCKERFILE
    return make_task(
        root, name, dockerfile=dockerfile + "WORKDIR /workdir\n", network_mode=network, memory_mb=MEMORY_MB, gold=gold
    )


class Arena:
    """One suite with a secret-holding task (and a network-enabled twin), a neighbour sandbox, host secrets."""

    def __init__(self, root: Path, *, base: str | None = None, env_kwargs: dict | None = None) -> None:
        self.gold = "gold" + secrets.token_hex(8)
        self.neighbour_canary = "neighbour" + secrets.token_hex(8)
        self.host_canary = "host" + secrets.token_hex(8)
        suite = root / "tasks"
        self.task = _write_task(suite, "secret", self.gold, network="no-network", base=base)
        self.net_task = _write_task(suite, "secret_net", self.gold, network="public", base=base)
        self.host_dir = root / "host"
        self.host_dir.mkdir()
        self.host_secret = self.host_dir / "secret.txt"
        self.host_secret.write_text(self.host_canary)
        self.suite = suite
        self.env_kwargs = {"command_timeout_sec": COMMAND_TIMEOUT_SEC, **(env_kwargs or {})}
        self.listeners = Listeners()
        self.neighbour = HarborSpec(
            suite, agent="bash", environment_type="local", options=HarborOptions(**self.env_kwargs)
        ).environment_factory()
        self.neighbour_root = ""
        self.inside: str | None = None
        self.protected: dict[Path, str] = {}

    def start_neighbour(self) -> None:
        """(Re)start the neighbouring sandbox: a secret file, and a process named after a canary."""
        self.neighbour.reset(task_dir=str(self.task))
        out = self.neighbour.bash(
            f"echo {self.neighbour_canary} > /workdir/secret.txt && "
            f"(nohup bash -c 'exec -a {self.neighbour_canary} sleep 900' >/dev/null 2>&1 &) && echo ok"
        )
        assert out.strip() == "ok", out
        self.neighbour_root = str(self.neighbour._episode.environment._sandbox.rootfs)
        seen = self.neighbour.bash("sha256sum /etc/passwd /etc/hostname /usr/bin/env /usr/bin/python3 2>/dev/null")
        if self.inside is None:  # what every sandbox of this root sees, before the corpus
            self.inside = seen
            self.protected = {p: _digest(p) for p in map(Path, ("/etc/passwd", "/etc/hostname", "/usr/bin/env"))}
        elif seen != self.inside:
            raise RootChangedError(f"a fresh sandbox sees other files: {self.inside!r} -> {seen!r}")

    @property
    def secrets(self) -> dict[str, str]:
        return {
            "the gold answer": self.gold,
            "the trainer's environment": ENV_CANARY,
            "the trainer's memory": MEMORY_CANARY,
            "a neighbouring sandbox's secret": self.neighbour_canary,
            "a host file": self.host_canary,
        }

    def host_changes(self) -> list[str]:
        found = [str(p) for p in self.host_dir.rglob("*") if p != self.host_secret]
        if self.host_secret.read_text() != self.host_canary:
            found.append(f"{self.host_secret} was changed")
        found += [f"{path} was changed" for path, digest in self.protected.items() if _digest(path) != digest]
        found += [
            str(p) for p in map(Path, ("/etc/pwned", "/etc/pw2", "/usr/bin/pwned", "/usr/lib/pwned")) if p.exists()
        ]
        return found

    def neighbour_intact(self) -> str | None:
        out = self.neighbour.bash("cat /workdir/secret.txt")
        return None if out.strip() == self.neighbour_canary else f"the neighbouring sandbox changed: {out!r}"

    def close(self) -> None:
        self.listeners.close()


def run_corpus(arena: Arena, harness: str, label: str, cases: list[Case]) -> list[Outcome]:
    """One batch: every case a rollout of ``harness``; the batch verified with ``spec.reward_funcs``."""
    env_kwargs = dict(arena.env_kwargs)
    spec = HarborSpec(arena.suite, agent=harness, environment_type="local", options=HarborOptions(**env_kwargs))
    marker = "adv" + secrets.token_hex(4)
    arena.start_neighbour()
    ctx = Ctx(
        harness=harness,
        shell=HOST_SHELLS[harness],
        task_dir=str(arena.task),
        host_dir=str(arena.host_dir),
        host_secret=str(arena.host_secret),
        neighbour_root=arena.neighbour_root,
        trainer_pid=os.getpid(),
        tcp_port=arena.listeners.tcp_port,
        udp_port=arena.listeners.udp_port,
        gold=arena.gold,
        marker=marker,
    )
    t0 = time.monotonic()
    envs = [spec.environment_factory() for _ in cases]
    for env, case in zip(envs, cases, strict=True):
        env.reset(task_dir=str(arena.net_task if case.network else arena.task))
    outcomes = [Outcome(case.name, case.category, label) for case in cases]
    outputs_of: list[list] = []
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for env, case, outcome in zip(envs, cases, outcomes, strict=True):
        hits = arena.listeners.hits
        started = time.monotonic()
        try:
            outputs = case.calls(ctx, env)
        except Exception as exc:  # TRL's tool loop hands the model {"error": str(exc)}
            outputs = [exc]
        except BaseException as exc:  # would end training
            outputs = [exc]
            outcome.problems.append(f"the tool raised {type(exc).__name__}, which TRL does not catch")
        outputs_of.append(outputs)
        for output in outputs:
            if isinstance(output, BaseException) and not isinstance(output, Exception):
                outcome.problems.append(f"{type(output).__name__} escaped a tool")
        outcome.seconds = time.monotonic() - started
        alive = ctx.shell(env, "echo alive-$((40 + 2))")
        # A rollout may exhaust its own sandbox (and so end itself, scored 0); it must never turn
        # that into an infrastructure failure, which would skip it instead.
        if "alive-42" not in alive and "will not be scored" in alive:
            outcome.problems.append(f"the sandbox failed as infrastructure after the case: {alive[:300]!r}")
        if wait_until(lambda h=hits: arena.listeners.hits > h, timeout=0.3):
            outcome.leaks.append(f"a host loopback listener was reached ({arena.listeners.hits - hits} times)")
        if case.check is not None:
            problem = case.check(ctx, env, outputs)
            if problem:
                (outcome.leaks if case.leak_if_failed else outcome.problems).append(problem)
    phases = {"calls": time.monotonic() - t0}
    reward_func = spec.reward_funcs
    extra: dict[str, list] = {}
    rewards = reward_func(completions=[None] * len(envs), environments=envs, log_extra=extra.__setitem__)
    for case, outcome, outputs, reward, reason in zip(
        cases, outcomes, outputs_of, rewards, extra["harbor_error"], strict=True
    ):
        outcome.reward = reward
        shown = text(outputs)
        for what, value in arena.secrets.items():
            if value in shown and not (what == "the gold answer" and case.deserves == 1.0):
                outcome.leaks.append(f"{what} reached the model")
        if reward == 1.0 and case.deserves == 0.0:
            outcome.leaks.append("scored 1.0 without the answer")
        elif reward != case.deserves:
            outcome.problems.append(f"scored {reward}, deserved {case.deserves} ({reason})")
    phases["verify"] = time.monotonic() - t0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    if grown_mb > 1024:
        outcomes[0].problems.append(f"the training process grew by {grown_mb:.0f} MB during the batch")
    for change in arena.host_changes():
        outcomes[-1].leaks.append(f"host change after the batch: {change}")
    problem = arena.neighbour_intact()
    if problem:
        outcomes[-1].leaks.append(problem)
    close_all()
    try:  # a fresh sandbox of the same root must see the files it saw before the batch
        arena.start_neighbour()
    except RootChangedError as exc:
        outcomes[-1].leaks.append(str(exc))
    left = live_processes_with(marker)
    if not wait_until(lambda: not live_processes_with(marker), timeout=10):
        outcomes[-1].problems.append(f"processes of the batch outlived its sandboxes: {left}")
    phases["stop"] = time.monotonic() - t0
    print(f"[{label}] phases (cumulative s): {phases}")
    RESULTS.extend(outcomes)
    return outcomes


def _cases(harness: str) -> list[Case]:
    return [case for case in CASES if harness in case.harnesses]


def _assert_contained(outcomes: list[Outcome]) -> None:
    bad = [o for o in outcomes if not o.contained]
    assert not bad, "\n" + render(bad)


@pytest.fixture(scope="module")
def image_arena(loopback_registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arena]:  # noqa: F811
    """The arena on task images, FROM the loopback registry's Debian."""
    os.environ["TRL_HARBOR_ADVERSARIAL_CANARY"] = ENV_CANARY
    memory = [MEMORY_CANARY * 3]  # noqa: F841 - held in this process's memory while the corpus runs
    cache = tmp_path_factory.mktemp("adversarial-image-cache")
    arena = Arena(
        tmp_path_factory.mktemp("adversarial-image"),
        base=loopback_registry.base,
        env_kwargs={"backend_options": {"cache_dir": str(cache)}},
    )
    yield arena
    arena.close()
    close_all()
    ImageStore(cache).release_mounts()  # buildah keeps the built images mounted; rmtree cannot remove those
    shutil.rmtree(cache, ignore_errors=True)
    os.environ.pop("TRL_HARBOR_ADVERSARIAL_CANARY", None)


@requires_local
@pytest.mark.parametrize("harness", list(HOST_SHELLS))
def test_corpus_through_each_harness_on_an_image_root(image_arena: Arena, harness: str) -> None:
    _assert_contained(run_corpus(image_arena, harness, f"{harness}@image", _cases(harness)))


@requires_local
def test_zz_table_no_leaks() -> None:
    """Every case through every harness tried, none leaked; the table is printed."""
    print("\n" + render(RESULTS))
    expected = sum(len(case.harnesses) for case in CASES)
    assert len(RESULTS) == expected, f"{len(RESULTS)} of {expected} case runs recorded (an earlier test stopped)"
    leaked = [o for o in RESULTS if o.leaks]
    assert not leaked, render(leaked)
