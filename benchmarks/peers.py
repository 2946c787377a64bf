"""The local sandbox against a peer, nitrobox, on the same image root, interleaved in one process.

    .venv/bin/python benchmarks/peers.py [--rounds 30] [--task orders_count] [--concurrent 16] [--starts 64]
                                         [--cache-dir DIR]

nitrobox (PyPI ``nitrobox``: a namespace sandbox for RL rollouts, overlayfs on an image root, a
persistent shell, ``reset()``) is what is measured against, never a dependency of the library or of
trl-harbor (the repository has no ``benchmarks`` extra). Install it apart from the repository's
environment, e.g. into a folder of its own (its own dependencies, protobuf and PyYAML, are in
``.venv`` already)::

    .venv/bin/python -m pip install --no-deps --target /tmp/nitrobox nitrobox
    PYTHONPATH=/tmp/nitrobox .venv/bin/python benchmarks/peers.py

Without it the script says how to install it and exits 0 (no table). Run as root (both sandboxes
mount an overlay on the image root as root).

The same root: a bundled task's image (``examples/tasks/<task>``), taken from the local sandbox's
image store (:meth:`LocalEnvironment.image_store`, built on first use), is the local sandbox's root
and nitrobox's ``image`` (a folder). The task runs with ``network_mode = "no-network"`` (a copy of the
bundled task): the local sandbox gets its own empty network namespace, nitrobox ``net_isolate``;
both get the task's limits (nitrobox enforces them with cgroup v2 only; on cgroup v1 it has none,
while the local sandbox keeps its limits there). Both keep their state on ``/dev/shm`` where it is a
tmpfs (the local sandbox's state root and Harbor's trial folders for it; nitrobox's ``env_base_dir``
beside them). Measured in each round, the two one after the other (which goes first alternates),
each measurement begun once the local sandbox's background work is done (the launchers it parks for
its next starts, between batches: a pool as large as the most starts at once so far, up to
``HARBOR_LOCAL_SANDBOX_MAX_PARKED``: 1 by default, 64 for the pool the docs measure; a batch finds as many
as the largest before it):

* create + first command: ``start()`` and ``exec("true")``; ``Sandbox(config)`` and ``run("true")``;
* one command: ``exec("true")``; ``run("true")`` (a round's median of 5);
* a fresh sandbox after a rollout (a command wrote a file): ``stop()`` and a new sandbox's
  ``start()``; ``reset()`` (nitrobox's O(1) return to the image) — each until its first ``true``;
* delete: ``stop(delete=True)``; ``delete()``;
* ``--concurrent`` at once: that many create + command + delete lifecycles (the local sandbox on its
  event loop; nitrobox, which is synchronous, in as many threads);
* ``--starts`` at once: that many create + first command, until the last answers (the deletes after
  are not timed), the local sandbox's only: nitrobox cannot create sandboxes in threads while others
  of its own live (:data:`LOCAL_ONLY`).

Printed: each one's median, and the ratio nitrobox ÷ local per round (its median and its
min–max over the rounds): under 1, nitrobox is faster. Ratios carry across machines; the
absolute times are this machine's, at this load (the load average is printed before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HARBOR_TELEMETRY", "0")
REPO = Path(__file__).resolve().parents[1]
INSTALL = (
    "nitrobox is not installed, so there is nothing to compare with. Install it apart from the "
    "repository's environment and run again:\n"
    "    .venv/bin/python -m pip install --no-deps --target /tmp/nitrobox nitrobox\n"
    "    PYTHONPATH=/tmp/nitrobox .venv/bin/python benchmarks/peers.py"
)
#: Each operation's label, in the table's order.
OPERATIONS = (
    ("create", "create + first command"),
    ("fresh", "fresh sandbox after a rollout (ours: stop + start; nitrobox: reset)"),
    ("concurrent", "{n} at once: create + command + delete"),
    ("command", "one command (`true`)"),
    ("delete", "delete"),
)
#: Measured for the local sandbox only: nitrobox cannot create sandboxes in threads while others of
#: its own live (seen with 4: a ``subprocess.run`` in one thread waits for ever on its error pipe,
#: whose write end the sandbox processes forked meanwhile in the other threads inherited).
LOCAL_ONLY = (("starts", "{m} at once: create + first command (to the last answer)"),)
COMMANDS_PER_ROUND = 5
ROLLOUT = "echo 42 > answer.txt"


def nitrobox_available() -> bool:
    """Whether nitrobox imports here (installed, and a Linux wheel for this Python)."""
    try:
        import nitrobox  # noqa: F401
    except ImportError:
        return False
    return True


def no_network_copy(task: Path, into: Path) -> Path:
    """A copy of the bundled task with ``network_mode = "no-network"`` (the same environment folder,
    so the same cached image)."""
    copy = into / task.name
    shutil.copytree(task, copy)
    toml = copy / "task.toml"
    text = re.sub(r"(?m)^network_mode\s*=.*\n", "", toml.read_text())
    toml.write_text(text.replace("[environment]\n", '[environment]\nnetwork_mode = "no-network"\n', 1))
    return copy


class Ours:
    """Local sandboxes of the task, as trl-harbor makes them (``create_environment``)."""

    name = "local"

    def __init__(self, task_dir: Path, scratch: Path, cache_dir: str | None):
        from harbor.models.task.task import Task

        self.task = Task(task_dir)
        self.scratch = scratch
        self.kwargs = {"cache_dir": cache_dir} if cache_dir else {}
        self.count = 0

    def env(self) -> Any:
        from harbor.models.trial.paths import TrialPaths

        from trl_harbor.rollout.backends import create_environment

        self.count += 1
        return create_environment(
            self.task, "local", session_id=f"peers-{self.count}",
            trial_paths=TrialPaths(trial_dir=self.scratch / "trials" / f"local-{self.count}"), kwargs=self.kwargs,
        )  # fmt: skip

    async def ready(self) -> Any:
        env = self.env()
        await env.start(force_build=False)
        result = await env.exec("true")
        assert result.return_code == 0, result
        return env

    async def lifecycle(self) -> dict[str, float]:
        t = time.perf_counter()
        env = await self.ready()
        found = {"create": time.perf_counter() - t}
        commands = []
        for _ in range(COMMANDS_PER_ROUND):
            t = time.perf_counter()
            await env.exec("true")
            commands.append(time.perf_counter() - t)
        found["command"] = statistics.median(commands)
        await env.exec(ROLLOUT)
        t = time.perf_counter()
        await env.stop(delete=True)
        env = await self.ready()
        found["fresh"] = time.perf_counter() - t
        t = time.perf_counter()
        await env.stop(delete=True)
        found["delete"] = time.perf_counter() - t
        return found

    async def settle(self, timeout: float = 3.0) -> None:
        """Wait until the launchers parked in the background (for the next starts, between batches) are
        made: that work is the local sandbox's, not to be timed in nitrobox's measurements."""
        from harbor_local_sandbox import _box

        deadline = time.monotonic() + timeout
        await asyncio.sleep(0.01)  # the parking begins on a later turn of the loop
        while getattr(_box, "_PARKING", False) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def concurrent(self, n: int) -> float:
        async def one() -> None:
            env = await self.ready()
            await env.stop(delete=True)

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t

    async def starts(self, n: int) -> float:
        t = time.perf_counter()
        envs = await asyncio.gather(*(self.ready() for _ in range(n)))
        took = time.perf_counter() - t
        await asyncio.gather(*(env.stop(delete=True) for env in envs))  # not timed
        return took


class Nitrobox:
    """nitrobox sandboxes on the same image root, with the task's settings where it has them."""

    name = "nitrobox"

    def __init__(self, rootfs: Path, image_config: Any, hostname: str, limits: dict[str, Any], base: Path):
        from nitrobox.image.store import _image_store_populate

        self.rootfs = str(rootfs)
        self.base = base
        self.hostname = hostname
        self.limits = limits
        self.count = 0
        self.workdir = image_config.workdir or "/"
        # The image's run configuration, as nitrobox keeps it in memory once it has looked an image up
        # (a folder is not an image it can look up: each sandbox would ask BuildKit, Docker and a
        # registry for it in turn).
        _image_store_populate(
            self.rootfs,
            {"cmd": image_config.cmd or None, "entrypoint": image_config.entrypoint or None,
             "env": dict(image_config.env), "working_dir": self.workdir, "exposed_ports": []},
        )  # fmt: skip
        # It warns at every sandbox that cgroup v2 is missing (limits unenforced on cgroup v1): said once, below.
        logging.getLogger("nitrobox").setLevel(logging.ERROR)

    def sandbox(self) -> Any:
        from nitrobox import Sandbox, SandboxConfig

        with self._lock:
            self.count += 1
            name = f"peers-{self.count}"
        config = SandboxConfig(
            image=self.rootfs, working_dir=self.workdir, hostname=self.hostname, net_isolate=True,
            env_base_dir=str(self.base), **self.limits,
        )  # fmt: skip
        return Sandbox(config, name=name)

    _lock = threading.Lock()

    def ready(self) -> Any:
        box = self.sandbox()
        output, rc = box.run("true")
        assert rc == 0, output
        return box

    def lifecycle(self) -> dict[str, float]:
        t = time.perf_counter()
        box = self.ready()
        found = {"create": time.perf_counter() - t}
        commands = []
        for _ in range(COMMANDS_PER_ROUND):
            t = time.perf_counter()
            box.run("true")
            commands.append(time.perf_counter() - t)
        found["command"] = statistics.median(commands)
        box.run(ROLLOUT)
        t = time.perf_counter()
        box.reset()
        output, rc = box.run("true")
        found["fresh"] = time.perf_counter() - t
        assert rc == 0, output
        assert box.run("test -e answer.txt")[1] != 0, "nitrobox's reset kept the rollout's file"
        t = time.perf_counter()
        box.delete()
        found["delete"] = time.perf_counter() - t
        return found

    def concurrent(self, n: int, pool: concurrent.futures.ThreadPoolExecutor) -> float:
        def one() -> None:
            self.ready().delete()

        t = time.perf_counter()
        for future in [pool.submit(one) for _ in range(n)]:
            future.result()
        return time.perf_counter() - t


def baseline(runs: int) -> float:
    """Median of ``subprocess.run(["true"])``: what starting any process costs here, now."""
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(["true"], check=True)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


async def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from harbor_local_sandbox.local import LocalEnvironment

    bundled = REPO / "examples" / "tasks" / args.task
    task_dir = no_network_copy(bundled, scratch / "tasks")
    store = LocalEnvironment.image_store(args.cache_dir)
    image = await store.get(task_dir / "environment", args.task)  # built on first use, then cached
    ours = Ours(task_dir, scratch, args.cache_dir)
    env_config = ours.task.config.environment
    limits = {
        "memory_max": f"{env_config.memory_mb}m" if env_config.memory_mb else None,
        "cpu_max": str(env_config.cpus) if env_config.cpus else None,
        "pids_max": "2048",  # the local sandbox's default pids_max
    }
    base = Path(tempfile.mkdtemp(prefix="nitrobox-peers-", dir=scratch.parent))
    peer = Nitrobox(image.rootfs, image.config, ours.env()._sandbox.task.hostname, limits, base)
    found: dict[str, Any] = {"rootfs": image.rootfs, "base": base}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.concurrent, thread_name_prefix="nitrobox")
    try:
        barrier = threading.Barrier(args.concurrent)  # every thread of the pool started before timing
        list(pool.map(lambda _: barrier.wait(), range(args.concurrent)))
        # Each one's first sandbox in this process, apart (the local sandbox's sweep, probe and
        # helpers; nitrobox's first loads), and a check that both run on the one root.
        t = time.perf_counter()
        env = await ours.ready()
        found["first local"] = time.perf_counter() - t
        assert env._sandbox.image.rootfs == image.rootfs, (env._sandbox.image.rootfs, image.rootfs)
        await env.stop(delete=True)
        t = time.perf_counter()
        peer.ready().delete()
        found["first nitrobox"] = time.perf_counter() - t
        found["baseline"] = baseline(30)
        found["load before"] = os.getloadavg()
        rounds: list[dict[str, dict[str, float]]] = []
        for index in range(args.rounds):
            result: dict[str, dict[str, float]] = {}
            order = ("local", "nitrobox") if index % 2 == 0 else ("nitrobox", "local")
            for who in order:
                await ours.settle()
                result[who] = await ours.lifecycle() if who == "local" else peer.lifecycle()
            for who in order:
                await ours.settle()
                if who == "local":
                    result[who]["concurrent"] = await ours.concurrent(args.concurrent)
                else:
                    result[who]["concurrent"] = peer.concurrent(args.concurrent, pool)
            await ours.settle()
            result["local"]["starts"] = await ours.starts(args.starts)
            rounds.append(result)
            print(
                f"round {index + 1}/{args.rounds}: "
                + ", ".join(f"{k} {result['nitrobox'][k] / result['local'][k]:.2f}" for k, _ in OPERATIONS),
                flush=True,
            )
        found["rounds"] = rounds
        found["load after"] = os.getloadavg()
        found["baseline after"] = baseline(30)
    finally:
        pool.shutdown(wait=True)
        with contextlib.suppress(Exception):
            from nitrobox import Sandbox

            Sandbox.cleanup_stale(str(base))
        shutil.rmtree(base, ignore_errors=True)
    return found


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def report(found: dict[str, Any], concurrent_n: int, starts_n: int) -> None:
    rounds = found["rounds"]
    print(f"\nthe same image root for both: {found['rootfs']}")
    print(
        f"baseline subprocess.run(['true']): {_ms(found['baseline'])} before, {_ms(found['baseline after'])} after; "
        f"load average {'/'.join(f'{x:.1f}' for x in found['load before'])} before, "
        f"{'/'.join(f'{x:.1f}' for x in found['load after'])} after; {os.cpu_count()} CPUs"
    )
    print(
        f"first sandbox of this process (not in the table): local {_ms(found['first local'])}, "
        f"nitrobox {_ms(found['first nitrobox'])}"
    )
    rows = []
    for key, label in OPERATIONS:
        ours = [r["local"][key] for r in rounds]
        theirs = [r["nitrobox"][key] for r in rounds]
        ratios = [r["nitrobox"][key] / r["local"][key] for r in rounds]
        spread = f"{min(ratios):.2f}–{max(ratios):.2f}"
        rows.append((label.format(n=concurrent_n, m=starts_n), statistics.median(ours), statistics.median(theirs),
                     statistics.median(ratios), spread))  # fmt: skip
    for key, label in LOCAL_ONLY:
        rows.append((label.format(n=concurrent_n, m=starts_n), statistics.median(r["local"][key] for r in rounds),
                     None, None, "local only"))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    header = f"{'operation':<{width}}  {'local':>10}  {'nitrobox':>10}  {'nitrobox ÷ local':>16}  {'min–max':>11}"
    print("\n" + header)
    print("-" * len(header))
    for label, ours, theirs, ratio, spread in rows:
        if theirs is None:
            print(f"{label:<{width}}  {_ms(ours):>10}  {'—':>10}  {'—':>16}  {spread:>11}")
        else:
            print(f"{label:<{width}}  {_ms(ours):>10}  {_ms(theirs):>10}  {ratio:>16.2f}  {spread:>11}")
    print(
        f"\n({len(rounds)} interleaved rounds; medians; ratios per round. nitrobox enforces limits with "
        "cgroup v2 only"
        + ("" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else ": none here (cgroup v1)")
        + f"; python {sys.version.split()[0]})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (each: every operation, both)")
    parser.add_argument("--task", default="orders_count", help="the bundled task whose image both run")
    parser.add_argument("--concurrent", type=int, default=16, help="lifecycles at once")
    parser.add_argument("--starts", type=int, default=64, help="starts at once (each to its first answer)")
    parser.add_argument("--cache-dir", default=None, help="the local sandbox's image cache (default: its own)")
    args = parser.parse_args(argv)
    if not nitrobox_available():
        print(INSTALL)
        return
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/peers.py mounts image roots for both sandboxes: run it as root")
    # The trial folders Harbor makes for each local sandbox (five folders each) go where nitrobox
    # keeps its state, on /dev/shm where writable: on a journaled disk they cost more than the rest
    # of a start.
    state = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-peers-", dir=state))
    try:
        found = asyncio.run(measure(args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(found, args.concurrent, args.starts)


if __name__ == "__main__":
    main()
