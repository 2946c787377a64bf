"""What the local sandbox's storage guard costs, and how far past its bound a fast writer gets.

    .venv/bin/python benchmarks/storage_guard.py [--boxes 16] [--runs 300] [--root host|image]

Three measures, each with the guard on and off (``TRL_HARBOR_STORAGE_GUARD=0``) in the same run:

* ``exec("true")`` round trips (median, p90) into one of ``--boxes`` idle sandboxes;
* the process's CPU time over 10 s while those sandboxes sit idle (the guard's polling);
* one full measurement of every sandbox's tree (what a write burst costs the guard).

Then the overshoot: sandboxes bounded at 64 MB filled by (a) one process writing 1 MB files as
fast as it can and (b) a shell loop of ``head -c 1M``, five runs each; the guard's reason says how
much each had written when it was killed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sandbox_helpers import make_task, open_env  # noqa: E402
from trl_harbor.sandboxes import _storage  # noqa: E402
from trl_harbor.sandboxes.local import SandboxCommandError  # noqa: E402


async def _latencies(boxes: list, runs: int) -> list[float]:
    found = []
    for i in range(runs):
        started = time.perf_counter()
        await boxes[i % len(boxes)].exec("true")
        found.append((time.perf_counter() - started) * 1000)
    return found


def _thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has used."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _idle_cpu(seconds: float) -> float:
    """The guard thread's CPU use while the sandboxes sit idle, in % of one core (0 when it does not run)."""
    thread = _storage.GUARD._thread
    if thread is None or not thread.is_alive() or thread.native_id is None:
        return 0.0
    before = _thread_cpu(thread.native_id)
    await asyncio.sleep(seconds)
    return (_thread_cpu(thread.native_id) - before) / seconds * 100


async def cost(task: Path, scratch: Path, count: int, runs: int, root: str, guard: bool) -> dict:
    os.environ["TRL_HARBOR_STORAGE_GUARD"] = "1" if guard else "0"
    boxes = [open_env(task, scratch, root=root) for _ in range(count)]
    await asyncio.gather(*(b.start(force_build=False) for b in boxes))
    try:
        await _latencies(boxes, 20)  # warm-up
        times = sorted(await _latencies(boxes, runs))
        cpu = await _idle_cpu(10.0)
        started = time.perf_counter()
        for box in boxes:
            _storage.tree_bytes(box._sandbox.dir)
        full = (time.perf_counter() - started) * 1000
        return {
            "median": statistics.median(times),
            "p90": times[int(len(times) * 0.9)],
            "cpu": cpu,
            "full": full,
            "watched": len(_storage.GUARD._watched),
        }
    finally:
        await asyncio.gather(*(b.stop(delete=True) for b in boxes))


WRITERS = {
    "one process, 1 MB files": (
        "python3 -c \"import os; os.makedirs('/workdir/f', exist_ok=True); b = bytes(1 << 20)\n"
        "for i in range(1000): open(f'/workdir/f/{i}', 'wb').write(b)\""
    ),
    "shell loop of head -c 1M": "mkdir /workdir/f; for i in $(seq 1000); do head -c 1M /dev/zero > /workdir/f/$i; done",
}


async def overshoot(task: Path, scratch: Path, root: str, runs: int = 5) -> dict[str, list[int]]:
    os.environ["TRL_HARBOR_STORAGE_GUARD"] = "1"
    found: dict[str, list[int]] = {}
    for label, command in WRITERS.items():
        for _ in range(runs):
            env = open_env(task, scratch, root=root, default_storage_mb=64)
            await env.start(force_build=False)
            try:
                await env.exec(command, timeout_sec=60)
            except SandboxCommandError:
                pass
            reason = await env.resource_exhaustion() or ""
            await env.stop(delete=True)
            match = re.search(r"wrote (\d+) MB", reason)
            found.setdefault(label, []).append(int(match.group(1)) - 64 if match else -1)
    return found


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--boxes", type=int, default=16)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--root", choices=["host", "image"], default="host")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="trl-harbor-bench-storage-"))
    task = make_task(scratch / "tasks")
    rounds: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(3):  # interleaved: a shared machine's load drifts
        for guard in (False, True):
            rounds[guard].append(await cost(task, scratch, args.boxes, args.runs, args.root, guard))
    assert all(r["watched"] == 0 for r in rounds[False]) and all(r["watched"] == args.boxes for r in rounds[True])
    off, on = ({k: statistics.median(r[k] for r in rounds[g]) for k in rounds[g][0]} for g in (False, True))
    print(f"{args.boxes} idle sandboxes, root={args.root}, 3 x {args.runs} exec('true') round trips (medians of 3)")
    print("| measure | guard off | guard on | ratio |")
    print("|---|---|---|---|")
    for key, label in (("median", "exec('true') median"), ("p90", "exec('true') p90")):
        print(f"| {label} | {off[key]:.2f} ms | {on[key]:.2f} ms | {on[key] / off[key]:.2f} |")
    print(f"| guard thread CPU, sandboxes idle | 0 | {on['cpu']:.2f} % of a core | |")
    print(f"| one full measurement of {args.boxes} trees | | {on['full']:.1f} ms | |")
    print()
    print("overshoot past a 64 MB bound (MB written beyond it when killed; -1: not killed)")
    for label, values in (await overshoot(task, scratch, args.root)).items():
        print(f"| {label} | {values} | median {statistics.median(values)} MB |")


if __name__ == "__main__":
    asyncio.run(main())
