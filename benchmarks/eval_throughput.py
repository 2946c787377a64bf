"""``trl-harbor eval`` throughput: rollouts per minute, many in flight vs one at a time.

    .venv/bin/python benchmarks/eval_throughput.py [--rollouts 4] [--latency 0.5] [--concurrency 16]

Evaluates the bundled suite (local sandbox, Harbor's verifier) against a *scripted*
OpenAI-compatible endpoint on loopback that answers each request after ``--latency`` seconds —
a stand-in for a served model's per-turn latency; it calls ``bash`` with the task's reference
solution, then answers in prose (two requests per rollout). The same evaluation runs twice in
one process: with ``--concurrency`` rollouts in flight, and one at a time (``--concurrency 1``,
the baseline). Prints rollouts per minute and the ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from trl_harbor.cli.evaluate import EvalConfig, evaluate

SUITE = Path(__file__).resolve().parents[1] / "examples" / "tasks"


def serve(latency: float) -> tuple[ThreadingHTTPServer, str]:
    """Start the scripted endpoint; return it and its base URL."""
    titles = {d.name: (d / "instruction.md").read_text().splitlines()[0] for d in SUITE.iterdir() if d.is_dir()}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency)
            messages = body["messages"]
            if messages[-1]["role"] == "tool":
                message = {"role": "assistant", "content": "done"}
            else:
                task = next(name for name, title in titles.items() if title in messages[0]["content"])
                command = (SUITE / task / "solution" / "solve.sh").read_text()
                call = {"id": "c", "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"command": command})}}  # fmt: skip
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
            data = json.dumps({"choices": [{"index": 0, "message": message}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per task")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds the endpoint takes per request")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-tasks", type=int, default=None)
    args = parser.parse_args()
    server, url = serve(args.latency)
    results = {}
    try:
        for label, concurrency in (
            ("one at a time (baseline)", 1),
            (f"{args.concurrency} in flight", args.concurrency),
        ):
            output_dir = tempfile.mkdtemp(prefix="trl-harbor-eval-")
            config = EvalConfig(
                dataset=str(SUITE), base_url=url, model="scripted", num_rollouts=args.rollouts,
                num_tasks=args.num_tasks, concurrency=concurrency, output_dir=output_dir,
            )  # fmt: skip
            result = evaluate(config)
            results[label] = result
            assert result.errors == 0 and result.mean_reward == 1.0, (label, result)
    finally:
        server.shutdown()
    baseline = next(iter(results.values()))
    print(
        f"\neval throughput: bundled suite, {args.rollouts} rollouts/task, endpoint latency {args.latency} s/request\n"
    )
    print(f"{'mode':<28}{'rollouts':>10}{'seconds':>10}{'rollouts/min':>14}{'vs baseline':>13}")
    for label, result in results.items():
        ratio = result.rollouts_per_minute / baseline.rollouts_per_minute
        print(
            f"{label:<28}{result.rollouts:>10}{result.seconds:>10.1f}{result.rollouts_per_minute:>14.1f}{ratio:>12.1f}x"
        )


if __name__ == "__main__":
    main()
