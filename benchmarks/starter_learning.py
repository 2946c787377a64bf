"""Does the embedded default run learn? Held-out pass rate, base model vs trained, over several seeds.

Runs ``trl-harbor train`` (no ``--model``: SmolLM2-135M on the starter suite, CPU, local
sandbox) once per seed and reads each run's ``summary.json``: the held-out pass rate of the base
model and of the trained one (the baseline is measured in the same run, with the same seed and
sampling), the training reward's first and last step, the wall time and the peak memory::

    .venv/bin/python benchmarks/starter_learning.py --seeds 1 2 3
    .venv/bin/python benchmarks/starter_learning.py --seeds 1 -- --max_steps 10   # flags for train after --

Runs one after another (each uses both cores); each takes some minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_seed(seed: int, out: Path, extra: list[str]) -> dict:
    """Run the default training once and return its summary, with the wall time measured here.

    Args:
        seed: The run's seed (``--seed``).
        out: Its output folder.
        extra: More ``trl-harbor train`` flags.

    Returns:
        ``summary.json`` plus ``wall_s`` and ``returncode``.
    """
    command = [sys.executable, "-m", "trl_harbor.cli", "train", "--seed", str(seed), "--output_dir", str(out), *extra]
    start = time.monotonic()
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.monotonic() - start
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return {**summary, "wall_s": wall, "returncode": done.returncode}


def _rate(held: dict | None) -> str:
    if not held or held.get("pass_rate") is None:
        return "-"
    return f"{held['pass_rate']:.2f} ({held['passed']}/{held['scored']})"


def main(argv: list[str] | None = None) -> int:
    """Run the seeds and print the table.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when every run finished, else 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--output-dir", default="outputs/bench-starter-learning")
    args = parser.parse_args(argv)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        print(f"seed {seed}: training ... (log: {root / f'seed-{seed}.log'})", flush=True)
        rows.append((seed, run_seed(seed, root / f"seed-{seed}", extra)))
    header = f"{'seed':>4}  {'held-out base':>15}  {'held-out trained':>16}  {'change':>7}  {'train reward':>13}  " \
             f"{'wall':>7}  {'train':>7}  {'peak RSS':>8}"  # fmt: skip
    print("\n" + header + "\n" + "-" * len(header))
    gains = []
    for seed, s in rows:
        before, after = s.get("heldout_before"), s.get("heldout_after")
        change = "-"
        if before and after and before.get("pass_rate") is not None and after.get("pass_rate") is not None:
            gains.append(after["pass_rate"] - before["pass_rate"])
            change = f"{gains[-1]:+.2f}"
        reward = "-" if s.get("first_reward") is None else f"{s['first_reward']:.2f} → {s['last_reward']:.2f}"
        train = s.get("timings", {}).get("train_s")
        print(f"{seed:>4}  {_rate(before):>15}  {_rate(after):>16}  {change:>7}  {reward:>13}  "
              f"{s['wall_s']:>6.0f}s  {(f'{train:.0f}s' if train else '-'):>7}  "
              f"{s.get('peak_rss_mb', 0) / 1024:>6.1f}GB" + ("" if s["returncode"] == 0 else "  FAILED"))  # fmt: skip
    if gains:
        print(f"\nheld-out pass rate change (trained - base, same run): mean {statistics.mean(gains):+.2f}, "
              f"range {min(gains):+.2f} .. {max(gains):+.2f}; higher after training in "
              f"{sum(g > 0 for g in gains)} of {len(gains)} runs")  # fmt: skip
    return 0 if all(s["returncode"] == 0 for _, s in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
