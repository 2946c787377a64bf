"""Service tasks grade as under Harbor (issue #17): what the solution leaves running answers the tests.

Two tasks of the kind real suites have ("start a web server", "run a service on localhost"): the
solution starts an HTTP server, or a TCP service bound to ``localhost`` (which needs the sandbox's
``/etc/hosts``, as Docker provides it), and leaves it running; the tests connect to it. Harbor's own
(shared) trial keeps the agent's processes while its verifier runs, so both score 1 there. Here they
must pass ``trl-harbor check`` (oracle 1, nothing 0) and score 1 in a CPU GRPO step, while the
verifier still runs in its own view (the agent's processes cannot see it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import requires_local, tiny_grpo_trainer

from sandbox_helpers import make_task
from trl_harbor import HarborBashEnv, HarborSpec, close_all
from trl_harbor.cli.check import check_suite

pytestmark = requires_local

HTTP_SERVE = "mkdir -p /srv/www && echo up > /srv/www/ok && cd /srv/www && nohup python3 -m http.server 8080 >/dev/null 2>&1 & sleep 1"
HTTP_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if python3 -c "import urllib.request; assert urllib.request.urlopen('http://127.0.0.1:8080/ok', timeout=5).read().strip() == b'up'"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
#: A line-based TCP service bound to localhost, answering "pong".
TCP_SERVE = (
    "cat > /usr/local/bin/pong-server <<'EOF'\n"
    "#!/usr/bin/env python3\n"
    "import socket, socketserver\n"
    "class H(socketserver.StreamRequestHandler):\n"
    "    def handle(self):\n"
    "        if self.rfile.readline().strip() == b'ping': self.wfile.write(b'pong\\n')\n"
    "socketserver.TCPServer.allow_reuse_address = True\n"
    "socketserver.TCPServer(('localhost', 7000), H).serve_forever()\n"
    "EOF\n"
    "chmod +x /usr/local/bin/pong-server && (setsid pong-server >/dev/null 2>&1 < /dev/null &) ; sleep 1"
)
TCP_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if python3 -c "
import socket
s = socket.create_connection(('localhost', 7000), timeout=5)
s.sendall(b'ping\\n')
assert s.makefile().readline().strip() == 'pong'
"; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def _service_suite(root: Path) -> Path:
    for name, serve, test in (("http_server", HTTP_SERVE, HTTP_TEST), ("tcp_service", TCP_SERVE, TCP_TEST)):
        task = make_task(root, name)
        (task / "instruction.md").write_text(f"Start the service and leave it running ({name}).\n")
        (task / "tests" / "test.sh").write_text(test)
        (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{serve}\n")
    return root


def test_service_tasks_pass_check(tmp_path: Path) -> None:
    suite = _service_suite(tmp_path / "suite")
    results = check_suite(sorted(p for p in suite.iterdir()), "local", concurrency=2)
    table = {r.task: (r.oracle.reward, r.nop.reward, r.why) for r in results}
    assert all(r.passed for r in results), table
    assert {r.oracle.reward for r in results} == {1.0} and {r.nop.reward for r in results} == {0.0}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["http_server", "tcp_service"])
def test_a_service_left_running_scores_one_in_a_grpo_step(tmp_path: Path, task: str) -> None:
    from trl_harbor.testing import tool_call_text

    suite = _service_suite(tmp_path / "suite")
    spec = HarborSpec(suite, environment_type="local", indices=[sorted(p.name for p in suite.iterdir()).index(task)])
    serve = HTTP_SERVE if task == "http_server" else TCP_SERVE
    calls = [tool_call_text("bash", {"command": serve})]
    scored: list[list[float | None]] = []
    harbor_reward = spec.reward_funcs

    def recorded(environments=None, **kwargs):
        rewards = harbor_reward(environments=environments, **kwargs)
        scored.append(rewards)
        return rewards

    trainer = tiny_grpo_trainer(tmp_path, spec, calls, HarborBashEnv.PROMPT_SUFFIX, [recorded])
    try:
        trainer.train()
    finally:
        close_all()
    assert scored and scored[0] == [1.0, 1.0], f"each rollout started the service: each scores 1 ({scored})"
