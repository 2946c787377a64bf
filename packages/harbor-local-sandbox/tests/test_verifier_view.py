"""The verifier's view of a local sandbox (issue #31), property by property, on real sandboxes.

Each test opens the view of a running sandbox directly (``LocalEnvironment.verifier_view``, what
grading uses) and checks one property of it from both sides — the agent's sandbox and the view —
with commands that can fail: the verifier sees and signals the agent's processes, the agent sees
nothing of the verifier's; the agent's files are the verifier's, live, with their metadata, and the
verifier's writes there reach the agent; the verifier's ``/tmp``, network and listeners are its own
while the agent's TCP services answer it; every link the agent makes goes through its keel; a folder
the agent swaps for a link while the view is made never leads outside the agent's tree; and an agent
that exhausts its processes does not starve its keel. (The attacks and honest rollouts through a trainer's
whole grading path are that trainer's tests: the repository's ``tests/adversarial/test_view.py``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from pathlib import Path

import pytest
from harbor_local_sandbox._box import WATCHER_NICE, _listener_pid
from sandbox_testing import count_processes_cmd, make_task, open_env, run, task_base_image  # noqa: F401 - the fixture

#: Every test here starts a local sandbox (bubblewrap), or a process of the package's that makes views.
pytestmark = [pytest.mark.local, pytest.mark.usefixtures("task_base_image")]

SERVE = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(sys.argv[2].encode())\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer((sys.argv[3] if len(sys.argv) > 3 else '127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)
FETCH = 'python3 -c "import urllib.request, sys; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"'
#: The agent's server on 8081: each request answered with what 127.0.0.1:9099 says.
ASK = (
    "import http.server, urllib.request\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = urllib.request.urlopen('http://127.0.0.1:9099/', timeout=5).read()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', 8081), H).serve_forever()\n"
)


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return make_task(tmp_path / "tasks", gold="42")


async def _started(task: Path, tmp_path: Path):
    env = open_env(task, tmp_path / "trials")
    await env.start(force_build=False)
    return env


async def _sh(env, command: str) -> str:
    result = await env.exec(command, timeout_sec=60)
    return (result.stdout + result.stderr).strip()


def test_the_verifier_sees_and_signals_the_agents_processes_which_see_nothing_of_its(task: Path, tmp_path) -> None:
    marker = f"agent-{secrets.token_hex(4)}"

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(env, f"(exec -a {marker} sleep 600) >/dev/null 2>&1 &")
            async with env.verifier_view() as view:
                assert await _sh(view, count_processes_cmd(marker)) == "1"  # the verifier sees it
                await _sh(view, f"(exec -a verifier-{marker} sleep 600) >/dev/null 2>&1 &")
                assert await _sh(env, count_processes_cmd(f"verifier-{marker}")) == "0"  # the agent does not
                # the verifier signals the agent's process (pkill by name, as a test that restarts a service)
                kill = (
                    "import os\nfor p in filter(str.isdigit, os.listdir('/proc')):\n"
                    "    try:\n        argv0 = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')[0]\n"
                    "    except OSError:\n        continue\n"
                    f"    if argv0 == b'{marker}':\n        os.kill(int(p), 15)\n"
                )
                await _sh(view, f'python3 -c "{kill}"')
                for _ in range(50):
                    if await _sh(env, count_processes_cmd(marker)) == "0":
                        break
                    await asyncio.sleep(0.1)
                assert await _sh(env, count_processes_cmd(marker)) == "0"
                # nor its environment, mounts or network in the agent's /proc
                assert "verifier" not in await _sh(env, "cat /proc/mounts")
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_the_agents_files_are_the_verifiers_live_and_exact(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(
                env,
                "echo 1 > /workdir/a && ln /workdir/a /workdir/b && touch -d 2020-01-02 /workdir/a && "
                "python3 -c \"import os; os.setxattr('/workdir/a', 'user.tag', b'seen')\"",
            )
            async with env.verifier_view() as view:
                agent_stat = await _sh(env, "stat -c '%i %h %y' /workdir/a")
                assert await _sh(view, "stat -c '%i %h %y' /workdir/a") == agent_stat  # the same file
                assert agent_stat.split()[1] == "2" and "2020-01-02" in agent_stat
                xattr = "python3 -c \"import os; print(os.getxattr('/workdir/a', 'user.tag').decode())\""
                assert await _sh(view, xattr) == "seen"
                await _sh(env, "echo written-after > /workdir/late")  # after the view was made
                assert await _sh(view, "cat /workdir/late") == "written-after"
                await _sh(view, "echo from-the-verifier > /workdir/inbox")  # the verifier's writes reach the agent
                assert await _sh(env, "cat /workdir/inbox") == "from-the-verifier"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_the_verifiers_tmp_is_its_own(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(env, "echo agent > /tmp/agent.txt")
            async with env.verifier_view() as view:
                assert await _sh(view, "cat /tmp/agent.txt") == "agent"  # the agent's /tmp, read through
                await _sh(view, 'echo secret > /tmp/expected.txt; echo secret > "$TMPDIR/x"; echo "$TMPDIR"')
                assert "No such file" in await _sh(env, "cat /tmp/expected.txt")
                assert await _sh(env, "ls /tmp") == "agent.txt"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_the_verifiers_python_runs_the_import_guard_the_images_python_compiled(task: Path, tmp_path: Path) -> None:
    """Every Python the verifier starts runs the guard, from the view's copy of the image's ``encodings``
    (imported before anything else): its code comes compiled by the image's interpreter (at the
    search-path probe), so the guard's source file is not read — replaced by one that raises, Python still
    starts guarded — and an agent's ``json.py`` in the working directory is not what ``import json`` gets,
    in the image's Python and in a virtual environment the verifier makes (no site folder of the image's
    is read there). The agent's own sandbox has none of it."""
    which = "-c \"import json, sys; print(json.__file__.startswith('/usr/lib/'), hasattr(sys, '_harbor_local_sandbox_guard'))\""

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(env, "echo 'raise SystemExit(\"the agent ran\")' > /workdir/json.py")
            async with env.verifier_view() as view:
                encodings = await _sh(view, "python3 -c 'import encodings; print(encodings.__file__)'")
                assert "_harbor_local_sandbox_guard()" in await _sh(view, f"tail -5 {encodings}")
                # the module is loaded from the probe's bytecode (an unchecked .pyc): no start compiles it
                flags = "import encodings, sys; print(open(encodings.__cached__, 'rb').read()[4:8].hex())"
                assert await _sh(view, f'python3 -c "{flags}"') == "01000000"
                assert await _sh(view, "ls /.harbor-local-sandbox/ | grep -c '^guard-'") == "1"
                assert await _sh(view, f"cd /workdir && python3 {which}") == "True True"
                await _sh(view, "echo 'raise SystemExit(\"the source ran\")' > /.harbor-local-sandbox/guard.py")
                assert await _sh(view, f"cd /workdir && python3 {which}") == "True True"
                await _sh(view, "python3 -m venv --without-pip /tmp/v")
                assert await _sh(view, f"cd /workdir && /tmp/v/bin/python {which}") == "True True"
            assert "harbor-local-sandbox" not in await _sh(env, f"tail -3 {encodings}")
            assert await _sh(env, "cd /workdir && python3 -c 'import json' 2>&1") == "the agent ran"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_a_command_the_verifier_installs_wins_over_the_agents_of_that_name(task: Path, tmp_path: Path) -> None:
    """Issue #43, class 5: the agent's commands under new names on ``PATH`` are the verifier's to run,
    until the verifier installs a command of that name in another ``PATH`` folder (a later one, which the
    shell would search after the agent's): then the agent's is gone from the view, at once — an install
    followed by the command runs the verifier's. A command the verifier writes over the agent's in the
    agent's own folder is the verifier's too; the agent's other commands stay; the agent's sandbox keeps
    its own."""

    def tool(says: str) -> str:
        return f"printf '#!/bin/sh\\necho {says}\\n' > /tmp/t && chmod 755 /tmp/t"

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(
                env,
                f"{tool('agent')} && for n in checker other same; do cp /tmp/t /usr/local/bin/$n; done && "
                "ln -s /usr/local/bin/other /usr/local/sbin/linked",
            )
            async with env.verifier_view() as view:
                if os.geteuid() == 0:  # its PATH watcher (the view supervisor's one child yet) runs first
                    supervisor = view._sandbox.box.host_pid
                    watcher = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
                    assert len(watcher) == 1 and os.getpriority(os.PRIO_PROCESS, int(watcher[0])) == WATCHER_NICE
                assert await _sh(view, "checker; other; same; linked") == "agent\nagent\nagent\nagent"
                # an install into /usr/bin (after /usr/local/bin on PATH), run at once
                assert await _sh(view, f"{tool('verifier')} && cp /tmp/t /usr/bin/checker && checker") == "verifier"
                # as dpkg does: a temporary name renamed into place; a link counts as a command too
                installed = await _sh(
                    view, "cp /tmp/t /bin/linked.dpkg-new && mv /bin/linked.dpkg-new /bin/linked && linked"
                )
                assert installed == "verifier"
                assert await _sh(view, "cp /tmp/t /usr/local/bin/same && same") == "verifier"  # over the agent's
                assert await _sh(view, "other; command -v checker") == "agent\n/usr/bin/checker"
                assert await _sh(view, "ls /usr/local/bin/checker 2>&1 | grep -c 'No such file'") == "1"
            assert await _sh(env, "checker; linked; same; ls /usr/bin/checker 2>&1 | grep -c 'No such'") == (
                "agent\nagent\nagent\n1"
            )
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_an_install_gives_way_before_the_call_that_makes_it_returns(task: Path, tmp_path: Path) -> None:
    """The agent's command is gone from the view before the verifier's call that names a command of
    that name in another ``PATH`` folder returns (a seccomp filter on the view's processes, whose listener
    is the watcher), not some time after (an inotify watch alone: CI saw the verifier's shell find the
    agent's command in that window). Shown with the watcher stopped: the install waits for it, and the
    command that follows it finds the verifier's. A name made outside ``PATH`` folders, or one the agent
    did not add, takes nothing away."""
    import signal

    def tool(says: str) -> str:
        return f"printf '#!/bin/sh\\necho {says}\\n' > /tmp/t && chmod 755 /tmp/t"

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(env, f"{tool('agent')} && cp /tmp/t /usr/local/bin/checker && cp /tmp/t /usr/local/bin/other")
            async with env.verifier_view() as view:
                await _sh(view, tool("verifier"))
                box = view._sandbox.box
                supervisor = box.host_pid or _listener_pid(box.supervisor.address)
                started = {}  # the watcher is its first child (forked as it starts; others: commands' handlers)
                for child in Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split():
                    with contextlib.suppress(FileNotFoundError):  # a handler that ended meanwhile
                        started[child] = int(Path(f"/proc/{child}/stat").read_text().rsplit(")")[1].split()[19])
                watcher = min(started, key=lambda pid: (started[pid], int(pid)))
                os.kill(int(watcher), signal.SIGSTOP)
                try:
                    install = asyncio.ensure_future(_sh(view, "cp /tmp/t /usr/bin/checker && checker"))
                    await asyncio.sleep(0.5)
                    assert not install.done(), "the install returned before the watcher gave way"
                finally:
                    os.kill(int(watcher), signal.SIGCONT)
                assert await install == "verifier"
                # a name made outside PATH folders, or a name the agent did not add: the agent's others stay
                assert await _sh(view, "cp /tmp/t /tmp/other && cp /tmp/t /usr/bin/fresh && other") == "agent"
            assert await _sh(env, "checker") == "agent"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_a_package_the_agent_installed_is_its_own_live_and_one_mount(task: Path, tmp_path: Path) -> None:
    """A new top-level package of the agent's in Python's import folder is mounted live on the view (one
    mount, not a link per file): the tests import it as the agent left it, and see what the agent's
    processes change in it while they run. Its distribution metadata stays judged (a ``pytest11``
    plug-in of the agent's is not seen), a guarded name the agent places in a folder a ``.pth`` of its
    names is still not what the verifier imports, and the agent's sandbox keeps what the verifier writes
    nowhere but its own layer."""
    site = "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
    install = (
        f"D={site}; mkdir -p $D/agentpkg/sub $D/agentpkg-1.0.dist-info $D/agentplug-1.0.dist-info && "
        'for i in $(seq 300); do echo "N = $i" > $D/agentpkg/sub/m$i.py; done && '
        "echo 'VALUE = \"installed\"' > $D/agentpkg/__init__.py && touch $D/agentpkg/sub/__init__.py && "
        "printf 'Metadata-Version: 2.1\\nName: agentpkg\\nVersion: 1.0\\n' > $D/agentpkg-1.0.dist-info/METADATA && "
        "printf 'Metadata-Version: 2.1\\nName: agentplug\\nVersion: 1.0\\n' > $D/agentplug-1.0.dist-info/METADATA && "
        "printf '[pytest11]\\nagentplugin = agentpkg\\n' > $D/agentplug-1.0.dist-info/entry_points.txt"
    )
    value = "python3 -c 'import agentpkg, agentpkg.sub.m300 as m; print(agentpkg.VALUE, m.N)'"
    plugins = (
        "python3 -c 'from importlib.metadata import entry_points, version; "
        'print(version("agentpkg"), [e.name for e in entry_points(group="pytest11")])\''
    )

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(env, install)
            async with env.verifier_view() as view:
                assert await _sh(view, value) == "installed 300"
                assert await _sh(view, f"findmnt -n -o TARGET {site}/agentpkg") != ""  # a mount of its own
                assert await _sh(view, plugins) == "1.0 []"  # the metadata judged: no plug-in of the agent's
                await _sh(env, f"echo 'VALUE = \"changed\"' > {site}/agentpkg/__init__.py")
                assert await _sh(view, value) == "changed 300"  # live
            # A .pth of the agent's naming a folder of its package: the package is laid and judged entry by
            # entry, as before, and a usercustomize there is not seen.
            await _sh(
                env,
                f'D={site}; echo "$D/agentpkg/sub" > $D/agentpkg_paths.pth && '
                "echo 'import builtins; builtins.PLANTED = 1' > $D/agentpkg/sub/usercustomize.py",
            )
            async with env.verifier_view() as view:
                assert await _sh(view, f"findmnt -n -o TARGET {site}/agentpkg || echo none") == "none"
                assert await _sh(view, value) == "changed 300"
                planted = "python3 -c 'import builtins; print(getattr(builtins, \"PLANTED\", 0))'"
                assert await _sh(view, planted) == "0"
                assert await _sh(env, planted) == "1"  # the agent's own Python runs it
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_the_verifiers_network_is_its_own_and_the_agents_services_answer_it(tmp_path: Path) -> None:
    task = make_task(tmp_path / "tasks", gold="42")

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(env, f"cat > /srv/s.py <<'X'\n{SERVE}X\n(python3 /srv/s.py 8080 agent 0.0.0.0 &) ; sleep 1")
            async with env.verifier_view() as view:
                assert await _sh(view, f"{FETCH} http://localhost:8080/") == "agent"
                assert await _sh(view, f"{FETCH} http://$(hostname):8080/") == "agent"  # the service's name
                await _sh(view, "(python3 /srv/s.py 9099 verifier &) ; sleep 1")
                assert await _sh(view, f"{FETCH} http://127.0.0.1:9099/") == "verifier"
                # The agent's processes on their own cannot reach the verifier's listener...
                alone = await _sh(env, f"{FETCH} http://127.0.0.1:9099/ 2>&1 | tail -1")
                assert "verifier" not in alone and ("reset" in alone or "closed" in alone), alone
                # ...but the agent's server reaches it while it answers a request of the verifier's
                # (a service the tests start that the agent's server depends on, issue #48).
                await _sh(env, f"cat > /srv/ask.py <<'X'\n{ASK}X\n(python3 /srv/ask.py &) ; sleep 1")
                assert await _sh(view, f"{FETCH} http://127.0.0.1:8081/") == "verifier"
                # a port the agent listened on first is handed to the verifier's own server
                await _sh(view, "(python3 /srv/s.py 8080 verifier-owns-it 0.0.0.0 &) ; sleep 1")
                assert await _sh(view, f"{FETCH} http://127.0.0.1:8080/") == "verifier-owns-it"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_a_verifier_with_a_network_gets_it_on_its_own_process_every_time(task: Path, tmp_path: Path) -> None:
    """The keel starts a view from a handler that exits as it answers: the view is reparented while the
    host looks for it. A walk of the process tree once missed it (a CI run: no network, no grade); the
    host now asks the kernel (SO_PEERCRED on the view's socket). Many views, each with its own network."""
    from types import SimpleNamespace

    from harbor.models.task.config import NetworkMode

    public = SimpleNamespace(network_mode=NetworkMode.PUBLIC)

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            agent_interfaces = await _sh(env, "cat /proc/net/dev")
            assert "tap0" not in agent_interfaces  # a no-network task: the agent has loopback only
            for _ in range(12):
                async with env.verifier_view(network_policy=public) as view:
                    box = view._sandbox.box
                    status = Path(f"/proc/{box.host_pid}/status").read_text()
                    nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
                    assert nspid[-1] == str(box.pid)  # the view's supervisor itself, not a passing process
                    assert "tap0" in await _sh(view, "cat /proc/net/dev")  # slirp4netns is attached to it
            assert await _sh(env, "cat /proc/net/dev") == agent_interfaces
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_every_link_of_the_agents_goes_through_its_keel(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = await _started(task, tmp_path)
        try:
            refused = {
                "/tests/expected.txt", "/proc/self/environ", "/tmp/expected.txt", "/dev/fd/3", "/logs/verifier/x",
                "../../tests/x", "d/../tests/x", "/solution/solve.sh", "/dev/shm/x",
                # to a folder above the verifier's places, where one more name would enter them
                "/", "..", "../..", "/logs", "/dev", "a/../..", "/usr/..",
            }  # fmt: skip
            # a relative "tests/x" leads to /tests only from /, whose entries the view judges where they are
            made = {"/usr/bin/python3", "answer.txt", "../lib/x", "/dev/null", "/workdir/tests/x", "tests/x", "."}
            for index, target in enumerate(sorted(refused | made)):
                out = await _sh(env, f"cd /workdir && ln -s '{target}' l{index} && echo made")
                assert (out == "made") == (target in made), (target, out)
            # moved into /, such a link is not in the view (it would lead to the verifier's /tests there)
            await _sh(env, "ln -s tests/expected.txt /workdir/up && mv /workdir/up /up && ln -s . /dot")
            async with env.verifier_view() as view:
                assert await _sh(view, "ls -l /up /dot 2>&1 | grep -c 'No such file'") == "2"
            # made with the caller's credentials: a user that may not write /root cannot link there
            await _sh(env, "useradd -m someone")
            out = await _sh(
                env,
                "su someone -c 'ln -s /etc/x /root/no' 2>&1; su someone -c 'ln -s /etc/x ~/yes && stat -c %U ~/yes'",
            )
            assert "Permission denied" in out and out.endswith("someone"), out
            # relative to a directory descriptor, and replaced in place (ln -sf)
            out = await _sh(
                env,
                "python3 -c \"import os; fd = os.open('/workdir', os.O_RDONLY); os.symlink('a', 'viafd', dir_fd=fd)\" && "
                "ln -sfn b /workdir/viafd && readlink /workdir/viafd",
            )
            assert out == "b"
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_a_folder_swapped_for_a_link_while_the_view_is_made_never_leads_out(task: Path, tmp_path: Path) -> None:
    """The view's folders are opened beneath the agent's root without following links: a folder the agent
    keeps exchanging with a link to ``/`` (renameat2 RENAME_EXCHANGE) is the folder, or nothing, in the view."""
    canary = tmp_path / f"host-canary-{secrets.token_hex(4)}"
    canary.write_text("host only")
    swap = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "os.makedirs('/srv/data', exist_ok=True)\nopen('/srv/data/in-the-agents-tree', 'w').close()\n"
        "os.symlink('/', '/srv/other')\n"
        "while True:\n    libc.renameat2(-100, b'/srv/data', -100, b'/srv/other', 2)\n"
    )

    async def scenario():
        env = await _started(task, tmp_path)
        try:
            await _sh(env, f"cat > /tmp/swap.py <<'X'\n{swap}X\n(python3 /tmp/swap.py &) ; sleep 0.5")
            for _ in range(5):
                async with env.verifier_view() as view:
                    # /srv/data is, at any moment, the agent's folder or the agent's link to /, which
                    # the verifier follows in its own world: the view's root, never the host's.
                    seen = (await _sh(view, "ls /srv/data/ 2>&1; echo end")).split()
                    assert "work" not in seen and "in-the-agents-tree" in seen or "workdir" in seen, seen
                    host = await _sh(view, f"ls {tmp_path} 2>&1; cat {canary} 2>&1")
                    assert "host only" not in host and "No such file" in host, host
        finally:
            await env.stop(delete=True)
        assert canary.read_text() == "host only"

    run(scenario())


def test_an_agent_that_exhausts_its_processes_does_not_starve_its_keel(task: Path, tmp_path: Path) -> None:
    async def scenario():
        env = await _started(task, tmp_path)
        try:
            # Started in the background: the shell that starts them is starved by them too (a 60 s timeout once).
            await _sh(env, "(for i in $(seq 600); do (while :; do :; done) & done) >/dev/null 2>&1 & echo started")
            await asyncio.sleep(3)
            started = time.monotonic()
            assert await env.alive()  # the keel answers: its cgroup leaf is not the agent's
            async with env.verifier_view() as view:
                assert await _sh(view, "echo the verifier runs") == "the verifier runs"
            assert time.monotonic() - started < 30
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_a_sandbox_stops_when_a_view_torn_down_in_the_background_has_just_finished() -> None:
    """A view's teardown runs in the background; the sandbox's stop waits for it. When the teardown has
    finished but its done-callback has not yet run (the same turn of the loop), stop must still return:
    it once looped on a gather of finished tasks that never yielded to the loop (a hung CI run)."""
    import threading

    from harbor_local_sandbox._roots import ImageRoot

    root = ImageRoot(task=None)  # nothing started: its stop only waits for the teardowns
    stopped = threading.Event()

    async def teardown() -> None:
        return None

    async def scenario() -> None:
        task = asyncio.ensure_future(teardown())  # first in the loop's queue, then the stop
        root.closing.add(task)
        task.add_done_callback(root.closing.discard)
        stopping = asyncio.ensure_future(root.stop())  # runs right after the teardown, before its callback
        await stopping
        stopped.set()

    thread = threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True)  # a spin would never end
    thread.start()
    thread.join(10)
    assert stopped.is_set(), "the sandbox's stop spun on a finished teardown"
    assert not root.closing


def test_a_view_teardown_that_fails_is_logged_and_the_sandbox_still_stops(caplog: pytest.LogCaptureFixture) -> None:
    """A teardown runs off the grading's way; its failure must not vanish (nor stop the sandbox's stop)."""
    import logging

    from harbor_local_sandbox._roots import ImageRoot

    root = ImageRoot(task=None)

    async def failing_teardown() -> None:
        raise OSError("the view's mounts could not be detached")

    async def scenario() -> None:
        task = asyncio.ensure_future(failing_teardown())
        root.closing.add(task)
        task.add_done_callback(root.closing.discard)
        await root.stop()

    with caplog.at_level(logging.WARNING, logger="harbor_local_sandbox"):
        asyncio.run(scenario())
    assert any("could not be detached" in record.getMessage() for record in caplog.records), caplog.records
    assert not root.closing


def test_views_are_made_in_a_process_apart(task: Path, tmp_path: Path, monkeypatch) -> None:
    """A batch's views (a walk and a dozen mounts each) are made by another process — root's workers,
    a user's holder — not on the trainer's interpreter, whose lock its event loop needs."""
    from harbor_local_sandbox import _roots

    def not_here(*args, **kwargs):
        raise AssertionError("a view was made in the trainer's process")

    monkeypatch.setattr(_roots, "snapshot", not_here)  # this process's copy only: the other has its own

    async def scenario() -> None:
        env = await _started(task, tmp_path)
        try:
            await _sh(env, "echo 42 > /workdir/answer.txt")
            async with env.verifier_view() as view:
                assert await _sh(view, "cat /workdir/answer.txt") == "42"
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_the_process_that_makes_views_serves_its_owner_only() -> None:
    """Root's worker, a user's holder: it runs any function of this package it is asked to, with
    root's rights over sandbox trees — another process of the same user that reaches its socket
    gets the connection closed, unanswered (``SO_PEERCRED``), and the owner is served as before."""
    import subprocess
    import sys

    from harbor_local_sandbox import _userns

    maker = _userns.host().apart()  # root: one of its workers; a user: the holder
    assert isinstance(maker, _userns.Worker | _userns.Holder)
    assert maker.call(os.getpid) == maker.proc.pid
    stranger = (
        "import pickle, socket, struct, sys\n"
        "request = pickle.dumps(('posix', 'getpid', (), False))\n"
        "conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "conn.connect(sys.argv[1])\n"
        "try:\n"
        "    conn.sendall(struct.pack('<Q', len(request)) + request)\n"
        "    print(conn.recv(8) or 'closed')\n"
        # closed with the request unread: before it was sent whole (a broken pipe), or after (a reset)
        "except (BrokenPipeError, ConnectionResetError):\n    print('closed')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", stranger, str(maker.socket_path)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "closed", done.stdout + done.stderr
    assert maker.call(os.getpid) == maker.proc.pid


# Root's workers (a user that is not root has its holder instead: test_without_root.py runs this
# file as nobody without the tests named "root_workers").
root_workers = pytest.mark.skipif(os.geteuid() != 0, reason="root's workers: a user has a holder instead")


@root_workers
def test_root_workers_that_died_are_started_again(task: Path, tmp_path: Path) -> None:
    from harbor_local_sandbox import _userns

    async def scenario() -> None:
        env = await _started(task, tmp_path)
        try:
            await _sh(env, "echo 42 > /workdir/answer.txt")
            workers = list({id(w): w for w in (_userns.worker() for _ in range(8))}.values())  # each in turn
            for worker in workers:
                assert worker.call(os.getpid) == worker.proc.pid != os.getpid()
                worker.proc.kill()
                worker.proc.wait()
            async with env.verifier_view() as view:  # made by workers started again
                assert await _sh(view, "cat /workdir/answer.txt") == "42"
            again = {id(_userns.worker()) for _ in range(8)}
            assert again.isdisjoint(id(w) for w in workers) and len(again) == len(workers)
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def _gone(pid: int) -> bool:
    """Whether the process ``pid`` exits (or is a zombie) within 5 s."""
    for _ in range(100):
        try:
            if "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]:
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@root_workers
@pytest.mark.parametrize("end", ["exit", "SIGKILL"])
def test_root_workers_exit_with_their_owner(end: str) -> None:
    """However its owner ends — its exit (the worker's socket is removed as it does) or a kill."""
    import signal
    import subprocess
    import sys

    from harbor_local_sandbox._userns import worker_sockets

    script = (
        "import sys, time\nfrom harbor_local_sandbox import _userns\nprint(_userns.worker().proc.pid, flush=True)\n"
    )
    script += "time.sleep(60)\n" if end == "SIGKILL" else ""
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    if end == "SIGKILL":
        owner.send_signal(signal.SIGKILL)
    assert owner.wait(60) in (0, -signal.SIGKILL)
    assert _gone(pid), f"the worker {pid} outlived its owner"
    if end == "exit":
        assert not [p.name for p in worker_sockets().iterdir() if p.name.startswith(f"{owner.pid}-")]


@root_workers
def test_root_workers_sockets_are_swept_when_they_were_killed_with_their_owner() -> None:
    import subprocess

    from harbor_local_sandbox._lifetime import sweep_stale
    from harbor_local_sandbox._userns import worker_sockets

    child = subprocess.Popen(["true"])
    child.wait()  # a PID no process has any more
    gone = worker_sockets() / f"{child.pid}-0.sock"
    ours = worker_sockets() / f"{os.getpid()}-99.sock"
    for path in (gone, ours):
        path.write_text("")
    try:
        sweep_stale()
        assert not gone.exists() and ours.exists()
    finally:
        gone.unlink(missing_ok=True)
        ours.unlink(missing_ok=True)
