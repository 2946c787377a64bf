"""Compose tasks of the tests (``environment/docker-compose.yaml``), written for a base image given.

* ``service_by_name``: a second service, a Python ``http.server`` in an image of its own (built from its own
  Dockerfile) that holds a secret; the agent must ask it by its service name (``http://secret-server:8000``),
  and the grader asks it too.
* ``healthy_volume``: a service (an image, ``image:``) with a healthcheck that writes a secret into a named
  volume it shares with ``main``; ``main`` waits until it is healthy; the agent reads the volume.
* ``never_healthy``: a service whose healthcheck never passes (``main`` waits for it): the start fails.

The same files run on the local sandbox and, with ``base`` an image of the test daemon's registry and the
network public, on Harbor's Docker backend. No network is needed: the services are on the task's loopback.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

SECRET = "compose-secret-7f3a"
VOLUME_SECRET = "volume-secret-51c2"
#: The test tasks' base (a Debian with python3), as ``sandbox_testing.BASE_DOCKERFILE`` builds it.
DEBIAN_PYTHON = """\
FROM {base}

RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 \\
 && rm -rf /var/lib/apt/lists/*

"""
_FETCH = (
    'python3 -c "import sys, time, urllib.request\n'
    "for _ in range(100):\n"
    "    try:\n"
    "        print(urllib.request.urlopen('http://secret-server:8000/', timeout=5).read().decode().strip()); sys.exit(0)\n"
    "    except OSError:\n"
    "        time.sleep(0.2)\n"
    'sys.exit(1)"'
)
_SERVER = """\
import http.server

SECRET = open("/srv/secret").read().strip()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = SECRET.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


print("serving the secret on port 8000", flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
"""


def _from(base: str, python: bool) -> str:
    """A Dockerfile's first lines: ``base``, and python3 installed unless the base has it (``python=False``)."""
    return DEBIAN_PYTHON.format(base=base) if python else f"FROM {base}\n\n"


def _task(root: Path, name: str, *, dockerfile: str, compose: str, solve: str, test: str, network: str) -> Path:
    task = root / name
    for sub in ("environment", "tests", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "environment" / "docker-compose.yaml").write_text(compose)
    (task / "instruction.md").write_text("Write the secret to /workdir/answer.txt\n")
    (task / "task.toml").write_text(
        textwrap.dedent(
            f"""\
            version = "1.0"
            [verifier]
            timeout_sec = 120
            [agent]
            timeout_sec = 120
            [environment]
            network_mode = "{network}"
            build_timeout_sec = 600
            cpus = 1
            memory_mb = 1024
            """
        )
    )
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nmkdir -p /logs/verifier\n" + test)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\nset -e\n" + solve)
    for script in (task / "tests" / "test.sh", task / "solution" / "solve.sh"):
        script.chmod(0o755)
    return task


def service_by_name(
    root: Path, base: str = "debian:bookworm-slim", network: str = "no-network", python: bool = True
) -> Path:
    """A server in an image of its own that the agent (and the grader) reach by service name."""
    task = _task(
        root,
        "service_by_name",
        dockerfile=_from(base, python) + "WORKDIR /workdir\n",
        compose=textwrap.dedent(
            """\
            services:
              main:
                depends_on:
                  - secret-server
              secret-server:
                build: ./secret-server
                command: ["python3", "/srv/serve.py"]
                environment:
                  PYTHONUNBUFFERED: "1"
                expose:
                  - "8000"
            """
        ),
        solve=f"{_FETCH} > /workdir/answer.txt\n",
        # The secret is the server's (in its image only); the grader asks the server, as the agent must.
        test=(
            f'served="$({_FETCH})"\n'
            f'if [ "$served" = "{SECRET}" ] && [ "$(cat /workdir/answer.txt 2>/dev/null)" = "$served" ]; then '
            "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
        ),
        network=network,
    )
    server = task / "environment" / "secret-server"
    server.mkdir()
    (server / "Dockerfile").write_text(
        _from(base, python) + f"COPY serve.py /srv/serve.py\nRUN echo {SECRET} > /srv/secret\n"
    )
    (server / "serve.py").write_text(_SERVER)
    return task


def healthy_volume(
    root: Path, base: str = "debian:bookworm-slim", network: str = "no-network", python: bool = True
) -> Path:
    """A service with a healthcheck that fills a named volume ``main`` mounts; ``main`` waits until it is healthy."""
    return _task(
        root,
        "healthy_volume",
        dockerfile=_from(base, python) + "WORKDIR /workdir\n",
        compose=textwrap.dedent(
            f"""\
            services:
              main:
                depends_on:
                  producer:
                    condition: service_healthy
                volumes:
                  - shared:/shared
              producer:
                image: {base}
                entrypoint: ["/bin/sh", "-c"]
                command:
                  - "sleep 1; echo $$SECRET > /data/secret; touch /data/ready; echo produced; exec sleep infinity"
                environment:
                  - SECRET={VOLUME_SECRET}
                working_dir: /data
                volumes:
                  - shared:/data
                healthcheck:
                  test: ["CMD-SHELL", "test -f /data/ready"]
                  interval: 1s
                  timeout: 5s
                  retries: 30
            volumes:
              shared:
            """
        ),
        solve="cat /shared/secret > /workdir/answer.txt\n",
        test=(
            f'if [ "$(cat /workdir/answer.txt 2>/dev/null)" = "{VOLUME_SECRET}" ]; then '
            "echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
        ),
        network=network,
    )


def never_healthy(root: Path, base: str = "debian:bookworm-slim", python: bool = True) -> Path:
    """A service whose healthcheck never passes, which ``main`` waits for."""
    return _task(
        root,
        "never_healthy",
        dockerfile=_from(base, python) + "WORKDIR /workdir\n",
        compose=textwrap.dedent(
            f"""\
            services:
              main:
                depends_on:
                  broken-db:
                    condition: service_healthy
              broken-db:
                image: {base}
                command: ["sh", "-c", "echo 'db: cannot open data directory' >&2; exec sleep infinity"]
                healthcheck:
                  test: ["CMD", "false"]
                  interval: 200ms
                  retries: 3
            """
        ),
        solve="true\n",
        test="echo 0 > /logs/verifier/reward.txt\n",
        network="no-network",
    )
