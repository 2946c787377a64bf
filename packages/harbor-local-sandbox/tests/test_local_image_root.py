"""Sandboxes on the task's own image: FROM honoured, Docker semantics.

Every task here is ``FROM`` a Debian image served by a registry on loopback (see
``registry_testing.py``); buildah builds it, and each sandbox is a copy-on-write view of the
built root. The tests are the repros of issue #8's bugs, run the other way round.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
from pathlib import Path

import pytest
from harbor_local_sandbox._cache import CACHE
from harbor_local_sandbox._fingerprints import list_image
from harbor_local_sandbox._lifetime import state_root, sweep_stale
from harbor_local_sandbox.oci import ImageStore
from registry_testing import loopback_registry  # noqa: F401 - the session fixture
from sandbox_testing import cache_dir, make_task, open_env, run  # noqa: F401 - cache_dir: the fixture
from sandbox_testing import dockerfile_task as _task

pytestmark = pytest.mark.local


async def _session(task: Path, tmp_path: Path, cache: str, commands: list[tuple[str, str | None]]):
    """Start a sandbox on the task's image (its image cache: ``cache``), run ``(command, user)`` pairs, stop it."""
    env = open_env(task, tmp_path, cache_dir=cache)
    await env.start(force_build=False)
    try:
        return [await env.exec(command, user=user) for command, user in commands]
    finally:
        await env.stop(delete=True)


def test_system_folders_are_the_images_and_writable(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """Bugs 1, 2, 3: ENV PATH expansion, COPY into /etc and /usr/local/bin, a writable /var."""
    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        ENV PATH="/opt/tool/bin:${{PATH}}"
        RUN mkdir -p /opt/tool/bin && printf '#!/bin/sh\\necho from-opt-tool\\n' > /opt/tool/bin/opttool \\
            && chmod +x /opt/tool/bin/opttool
        COPY app.conf /etc/myapp/app.conf
        COPY tool.sh /usr/local/bin/tool
        RUN chmod +x /usr/local/bin/tool
        WORKDIR /workdir
        """,
        {"app.conf": "mode=production\n", "tool.sh": "#!/bin/sh\necho tool-ran\n"},
    )
    results = run(
        _session(
            task,
            tmp_path,
            cache_dir,
            [
                ("mkdir -p /workdir/x && rm -r /workdir/x && echo $PATH && opttool", None),
                ("cat /etc/myapp/app.conf && tool", None),
                ("echo started > /var/log/app.log && cat /var/log/app.log", None),
                ("echo ok > /etc/written && echo more >> /usr/local/bin/tool && touch /usr/bin/new && echo done", None),
                ("test ! -e /usr/bin/bwrap && test ! -e /usr/bin/buildah && echo host-invisible", None),
                ("cat /etc/debian_version; id -u; echo $HOME; pwd", None),
            ],
        )
    )
    assert all(r.return_code == 0 for r in results), [(r.stdout, r.stderr) for r in results]
    path, opt = results[0].stdout.split()
    assert path.startswith("/opt/tool/bin:/usr/local/sbin:") and opt == "from-opt-tool"
    assert results[1].stdout.split() == ["mode=production", "tool-ran"]
    assert results[2].stdout.strip() == "started"
    assert results[3].stdout.strip() == "done"
    assert results[4].stdout.strip() == "host-invisible"
    version, uid, home, cwd = results[5].stdout.split()
    assert version.startswith("12") and (uid, home, cwd) == ("0", "/root", "/workdir")


def test_writes_are_private_to_each_sandbox(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    task = _task(tmp_path, f"FROM {loopback_registry.base}\nWORKDIR /workdir\n")

    async def scenario():
        first = open_env(task, tmp_path, cache_dir=cache_dir)
        second = open_env(task, tmp_path, cache_dir=cache_dir)
        await asyncio.gather(first.start(force_build=False), second.start(force_build=False))
        try:
            await first.exec("echo mine > /etc/hostname-note && rm /etc/debian_version")
            seen = await second.exec("cat /etc/hostname-note; cat /etc/debian_version")
            image = first._sandbox.image
            assert image is not None
            # (Looked at where the image is mounted: this process as root, the holder without root.)
            unchanged = first._sandbox.host.call(os.path.exists, image.rootfs / "etc" / "debian_version")
            assert unchanged, "the image root must never change"
            return seen
        finally:
            await asyncio.gather(first.stop(delete=True), second.stop(delete=True))

    seen = run(scenario())
    assert "No such file" in seen.stderr and seen.stdout.strip().startswith("12")
    assert not [p for p in state_root().iterdir() if p.name.startswith(f"{os.getpid()}-demo")]
    mounts = Path("/proc/self/mounts").read_text()
    assert f"{state_root()}/{os.getpid()}-" not in mounts, "overlay mounts must go with their sandbox"


def test_user_useradd_and_per_command_users(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """USER applies by default; [agent]/[verifier] user= names the image's users; root can add users."""
    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        RUN useradd -m -u 1234 agent && groupadd -g 2345 team && usermod -aG team agent
        WORKDIR /home/agent
        USER agent
        """,
    )
    results = run(
        _session(
            task,
            tmp_path,
            cache_dir,
            [
                ("id -u; id -G; echo $HOME $USER; touch /etc/nope 2>/dev/null || echo denied", None),
                ("id -u; useradd -m verifier && chown verifier /home/agent && echo made", "root"),
                ("id -un; echo $HOME", "verifier"),
                ("id -u", "1234"),
                ("true", "nobody-such"),
            ],
        )
    )
    assert results[0].stdout.split() == ["1234", "1234", "2345", "/home/agent", "agent", "denied"]
    assert results[1].stdout.split() == ["0", "made"]
    assert results[2].stdout.split() == ["verifier", "/home/verifier"]
    assert results[3].stdout.strip() == "1234"
    assert results[4].return_code == 125 and "no user nobody-such" in results[4].stderr


def test_entrypoint_runs_at_start(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """Bug 5: the image's ENTRYPOINT runs (with Harbor's keep-alive command as its arguments)."""
    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        COPY entrypoint.sh /usr/local/bin/entrypoint.sh
        RUN chmod +x /usr/local/bin/entrypoint.sh
        ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
        """,
        {"entrypoint.sh": '#!/bin/sh\necho "entry $(id -u) $*" > /tmp/entrypoint.out\nexec "$@"\n'},
    )

    async def scenario():
        env = open_env(task, tmp_path, cache_dir=cache_dir)
        await env.start(force_build=False)
        try:
            for _ in range(100):
                result = await env.exec("cat /tmp/entrypoint.out 2>/dev/null")
                if result.stdout:
                    return result.stdout
                await asyncio.sleep(0.05)
            return ""
        finally:
            await env.stop(delete=True)

    assert run(scenario()).strip() == "entry 0 sh -c sleep infinity"


def test_task_venv_at_opt_venv_with_pip_through_host_trust(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """Bugs 7 and 8: the task's own /opt/venv, pip installs from PyPI at build time (through the
    host's CA certificates on a TLS-intercepting network), packages visible to the image's Python."""
    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check six
        RUN site=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && mkdir -p "$site" \\
            && echo 'VALUE = 7' > "$site/taskmod.py"
        ENV PATH="/opt/venv/bin:$PATH"
        """,
    )
    results = run(
        _session(
            task,
            tmp_path,
            cache_dir,
            [
                ("command -v python; python -c 'import six; print(six.__name__)'", None),
                ("/usr/bin/python3 -c 'import taskmod; print(taskmod.VALUE)'", None),
                ("/usr/bin/python3 -c 'import six' 2>&1 | tail -1", None),
            ],
        )
    )
    assert results[0].stdout.split() == ["/opt/venv/bin/python", "six"], results[0].stderr
    assert results[1].stdout.strip() == "7"
    assert "ModuleNotFoundError" in results[2].stdout


def test_uv_trusts_the_host_ca_at_build_and_in_the_sandbox(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """Behind this network's TLS interception: ``uv pip install`` in a RUN step (uv has trust roots of its
    own, and failed with UnknownIssuer), and again in the sandbox; npm, node, git and requests are pointed
    at the host's bundle too, in RUN steps and in commands, without being stored in the image."""
    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check uv \\
            && /opt/venv/bin/uv pip install --no-cache --python /opt/venv/bin/python six \\
            && env | grep -E '^(SSL_CERT_FILE|REQUESTS_CA_BUNDLE|NODE_EXTRA_CA_CERTS|GIT_SSL_CAINFO|UV_NATIVE_TLS|PIP_CERT)=' \\
               | sort > /build-trust.txt
        ENV PATH="/opt/venv/bin:$PATH"
        """,
        network="public",
    )
    results = run(
        _session(
            task,
            tmp_path,
            cache_dir,
            [
                ("python -c 'import six; print(six.__name__)'", None),
                ("cat /build-trust.txt", None),
                (
                    "uv pip install --no-cache --python /opt/venv/bin/python idna >/dev/null && python -c 'import idna'; echo $?",
                    None,
                ),
                ("echo $NODE_EXTRA_CA_CERTS $GIT_SSL_CAINFO $REQUESTS_CA_BUNDLE $UV_NATIVE_TLS", None),
                # The build left no empty /etc/pip.conf in the image: the sandbox has the host's.
                ("cat /etc/pip.conf", None),
            ],
        )
    )
    assert results[0].stdout.strip() == "six", results[0].stdout + results[0].stderr
    bundle = "/run/harbor-local-sandbox/host-ca.crt"
    assert results[1].stdout.split() == [
        f"GIT_SSL_CAINFO={bundle}", f"NODE_EXTRA_CA_CERTS={bundle}", f"PIP_CERT={bundle}", f"REQUESTS_CA_BUNDLE={bundle}",
        f"SSL_CERT_FILE={bundle}", "UV_NATIVE_TLS=1",
    ]  # fmt: skip
    assert results[2].stdout.strip().splitlines()[-1] == "0", results[2].stdout + results[2].stderr
    assert results[3].stdout.split() == [bundle, bundle, bundle, "1"]
    assert results[4].stdout.split() == ["[global]", "cert", "=", bundle], results[4].stdout
    for built in ImageStore(cache_dir).images():  # build arguments, not the image's ENV
        assert not {"SSL_CERT_FILE", "UV_NATIVE_TLS", "NODE_EXTRA_CA_CERTS"} & set(built.record.config.env)


@pytest.mark.slow
def test_apt_get_at_build_and_verify_time(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """Bugs 4 and 6: apt-get mixed with other commands in one RUN, and apt-get in the sandbox."""
    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        RUN apt-get update && apt-get install -y --no-install-recommends jq && mkdir -p /app
        WORKDIR /app
        """,
        network="public",
    )
    results = run(
        _session(
            task,
            tmp_path,
            cache_dir,
            [
                ("echo '{\"a\": 3}' | jq .a", None),
                ("apt-get install -y --no-install-recommends bc >/dev/null 2>&1; echo '2+3' | bc", None),
                # TLS through this network's interception: the host's CAs are trusted inside.
                (
                    "python3 -c \"import urllib.request as u; print(u.urlopen('https://pypi.org/simple/six/').status)\"",
                    None,
                ),
            ],
        )
    )
    assert results[0].stdout.strip() == "3", results[0].stderr
    assert results[1].stdout.strip() == "5", results[1].stderr
    assert results[2].stdout.strip() == "200", results[2].stderr


def test_fingerprints_see_the_agents_changes_on_an_image_root(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    task = _task(tmp_path, f"FROM {loopback_registry.base}\nWORKDIR /workdir\nRUN echo v1 > /usr/local/bin/checker\n")

    async def scenario():
        env = open_env(task, tmp_path, cache_dir=cache_dir)
        await env.start(force_build=False)
        try:
            before = await env.file_fingerprints([("/usr/local/bin", None), ("/etc/passwd", 0)])
            await env.exec("echo tampered > /usr/local/bin/checker")
            after = await env.file_fingerprints([("/usr/local/bin", None), ("/etc/passwd", 0)])
            return before, after
        finally:
            await env.stop(delete=True)

    before, after = run(scenario())
    assert before["/usr/local/bin/checker"] != after["/usr/local/bin/checker"]
    assert before["/etc/passwd"] == after["/etc/passwd"]


def test_layered_fingerprints_see_what_a_walk_of_the_merged_root_sees(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """The seal reads an image root as the image's (cached) listing under the sandbox's own layer.

    After each change an agent can make, the paths whose fingerprints changed are the same as a
    full walk of the merged root finds: edits, chmod, new files, deletions (whiteouts), folders
    replaced whole (opaque), by a link or a file, renames and hard links.
    """
    task = _task(
        tmp_path,
        f"""\
        FROM {loopback_registry.base}
        RUN mkdir -p /opt/tool/lib /opt/gone/sub /usr/local/lib/site /srv/app/pkg && echo v1 > /usr/local/bin/checker \\
            && touch /opt/tool/lib/a.py /opt/gone/sub/b /usr/local/lib/site/m.py /srv/app/pkg/x.py \\
            && chmod +x /usr/local/bin/checker
        WORKDIR /workdir
        """,
    )
    watched = [
        ("/usr/bin", None),
        ("/usr/local", None),
        ("/opt", None),
        ("/usr/lib/python3", 1),
        ("/etc/passwd", 0),
        ("/srv/app/pkg", None),  # its parent gets replaced whole
    ]
    steps = [
        "echo v2 >> /usr/local/bin/checker",
        "chmod 700 /usr/bin/env",
        "rm /usr/bin/yes",
        "touch /usr/local/bin/newtool",
        "rm -rf /opt/tool/lib && mkdir /opt/tool/lib && touch /opt/tool/lib/c.py",
        "rm -rf /opt/gone",
        "rm -rf /usr/local/lib/site && ln -s /etc /usr/local/lib/site",
        "mv /usr/bin/tac /usr/bin/tac2",
        "ln /usr/bin/head /usr/local/bin/head2",
        "touch /usr/bin/yes",
        "chmod 700 /usr/local/share",
        "rm -rf /srv/app && mkdir -p /srv/app/pkg && touch /srv/app/pkg/y.py",
        "rm -rf /opt/tool && echo file > /opt/tool",
    ]

    def merged(env) -> dict[str, str]:  # the reference: every entry of the merged root, read each time
        # (Read where the tree is mounted: this process as root, the holder without root.)
        found: dict[str, str] = {}
        for path, depth in watched:
            found.update(env._sandbox.host.call(list_image, env._sandbox.rootfs, path, depth))
        return found

    def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
        return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}

    async def scenario():
        env = open_env(task, tmp_path, cache_dir=cache_dir)
        await env.start(force_build=False)
        try:
            fast, slow = await env.file_fingerprints(watched), merged(env)
            assert fast.keys() == slow.keys() and len(fast) > 100
            for step in steps:
                result = await env.exec(step)
                assert result.return_code == 0, (step, result)
                fast_now, slow_now = await env.file_fingerprints(watched), merged(env)
                assert fast_now.keys() == slow_now.keys(), step
                seen = changed(fast, fast_now)
                assert seen and seen == changed(slow, slow_now), step
                fast, slow = fast_now, slow_now
        finally:
            await env.stop(delete=True)

    run(scenario())


def test_a_failed_build_is_the_local_image_build_error(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """Issue #18: ``except local.ImageBuildError`` missed buildah's failures (another class, of oci.py)."""
    from harbor_local_sandbox import local

    task = _task(tmp_path, f"FROM {loopback_registry.base}\nRUN echo boom-marker >&2 && exit 3\n")
    env = open_env(task, tmp_path, cache_dir=cache_dir)
    try:
        with pytest.raises(local.ImageBuildError, match="boom-marker") as raised:
            run(env.start(force_build=False))
        assert type(raised.value) is local.ImageBuildError and isinstance(raised.value, local.SandboxError)
    finally:
        run(env.stop(delete=True))
    # An unpullable base is one too.
    missing = make_task(tmp_path / "more", dockerfile=f"FROM {loopback_registry.address}/nothing/here:1\n")
    with pytest.raises(local.ImageBuildError) as raised:
        run(open_env(missing, tmp_path, cache_dir=cache_dir).start(force_build=False))
    assert isinstance(raised.value, local.BaseImageUnavailableError)


def test_sandboxes_of_one_image_fingerprinted_at_once_see_the_same(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """The image's listing is shared by its sandboxes (and threads): none may see it half made."""
    task = _task(tmp_path, f"FROM {loopback_registry.base}\nWORKDIR /workdir\n")
    watched = [("/usr/lib/python3*", None), ("/usr/bin", 1), ("/etc/profile", 0)]

    async def scenario():
        envs = [open_env(task, tmp_path, cache_dir=cache_dir) for _ in range(4)]
        await asyncio.gather(*(env.start(force_build=False) for env in envs))
        try:
            for _ in range(3):
                CACHE.clear()  # as in a new process: every sandbox lists the image at once
                seen = await asyncio.gather(*(env.file_fingerprints(watched) for env in envs))
                assert len(seen[0]) > 500 and all(other == seen[0] for other in seen[1:])
        finally:
            await asyncio.gather(*(env.stop(delete=True) for env in envs))

    run(scenario())


def test_sandbox_of_a_killed_process_is_unmounted_and_swept(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """The overlay mount of a sandbox whose owner died (SIGKILL) goes with the next sweep, and its tree.

    Without root the mounts are in the owner's holder's namespace (``_userns.py``), which dies with it:
    only the tree is left for the sweep."""
    import signal
    import subprocess
    import sys

    task = _task(tmp_path, f"FROM {loopback_registry.base}\nWORKDIR /workdir\n")
    run(_session(task, tmp_path, cache_dir, [("true", None)]))  # build in this process first
    script = textwrap.dedent(
        f"""\
        import asyncio, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from sandbox_testing import open_env
        from pathlib import Path
        async def main():
            env = open_env(Path({str(task)!r}), Path({str(tmp_path)!r}), cache_dir={cache_dir!r})
            await env.start(force_build=False)
            await env.exec("echo agent-data > /etc/agent-note")
            print(env._sandbox.dir, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    box_dir = Path(child.stdout.readline().strip())
    as_root = os.geteuid() == 0
    assert (box_dir / "rootfs" / "etc" / "agent-note").exists() or not as_root
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (f"{box_dir}/rootfs " in Path("/proc/self/mounts").read_text()) == as_root
    assert box_dir.exists()
    sweep_stale()
    assert f"{box_dir}/rootfs " not in Path("/proc/self/mounts").read_text()
    assert not box_dir.exists()


def test_prebuilt_docker_image_without_dockerfile(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    task = _task(tmp_path, "unused")
    (task / "environment" / "Dockerfile").unlink()
    (task / "environment" / "data.txt").write_text("payload\n")
    toml = (
        (task / "task.toml")
        .read_text()
        .replace("[environment]\n", f'[environment]\ndocker_image = "{loopback_registry.base}"\n')
    )
    (task / "task.toml").write_text(toml)
    results = run(_session(task, tmp_path, cache_dir, [("cat /etc/debian_version; cat data.txt; pwd", None)]))
    version, payload, cwd = results[0].stdout.split()
    assert version.startswith("12") and payload == "payload"


def test_preflight_refuses_an_unknown_option_by_name():
    from harbor_local_sandbox.local import LocalEnvironment

    LocalEnvironment.preflight({})  # root, buildah and bubblewrap are here
    with pytest.raises(ValueError, match="Unknown option 'root'"):  # the removed option is no longer special
        LocalEnvironment.preflight({"root": "image"})


def test_concurrent_cold_starts_share_one_pull_and_build(loopback_registry, tmp_path):  # noqa: F811
    """16 sandboxes of a never-built task start at once: one pull, one build, 16 private roots."""
    task = _task(tmp_path, f"FROM {loopback_registry.base}\nRUN date +%s%N > /built-at\nWORKDIR /workdir\n")
    cache = str(tmp_path / "cold-cache")

    async def scenario():
        envs = [open_env(task, tmp_path, cache_dir=cache) for _ in range(16)]
        await asyncio.gather(*(e.start(force_build=False) for e in envs))
        try:
            stamps = await asyncio.gather(*(e.exec("cat /built-at") for e in envs))
            writes = await asyncio.gather(*(e.exec(f"echo {i} > /etc/who && cat /etc/who") for i, e in enumerate(envs)))
            return [s.stdout for s in stamps], [w.stdout.strip() for w in writes]
        finally:
            await asyncio.gather(*(e.stop(delete=True) for e in envs))

    stamps, writes = run(scenario())
    ImageStore(Path(cache)).release_mounts()
    assert len(set(stamps)) == 1 and stamps[0].strip()
    assert writes == [str(i) for i in range(16)]
    assert len([p for p in (Path(cache) / "images").iterdir() if p.is_dir()]) == 1


def test_kernel_knobs_are_read_only(loopback_registry, cache_dir, tmp_path):  # noqa: F811
    """The sandbox's root is the host's uid 0 in its own namespace: /proc/sys and sysrq must be read-only."""
    task = _task(tmp_path, f"FROM {loopback_registry.base}\n")
    results = run(
        _session(
            task,
            tmp_path,
            cache_dir,
            [
                ("v=$(cat /proc/sys/vm/swappiness); echo $v > /proc/sys/vm/swappiness", None),
                ("echo h > /proc/sysrq-trigger", None),
                ("cat /proc/sys/kernel/hostname; ls /proc/sys/net/ipv4/conf", None),
                ("cat /proc/kcore /proc/keys /proc/timer_list /proc/sched_debug 2>/dev/null | wc -c", None),
            ],
        )
    )
    assert results[0].return_code != 0 and "Read-only" in results[0].stderr
    assert results[1].return_code != 0  # read-only (or absent: kernels without magic SysRq)
    assert "Read-only" in results[1].stderr or not Path("/proc/sysrq-trigger").exists()
    hostname, *interfaces = results[2].stdout.split()
    assert hostname == "demo" and "lo" in interfaces and "eth0" not in interfaces
    assert results[3].stdout.strip() == "0"  # masked: empty or unreadable
