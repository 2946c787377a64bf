"""The local backend inside a real Docker container (the session's private daemon, ``docker_daemon``).

Training jobs very often run in a container. There, with Docker's default settings, bubblewrap
cannot make a sandbox's namespaces: the preflight (here through ``trl-harbor check``) must say why
and what to change. With the settings ``docs/local-sandbox.md`` documents, the bundled suite passes.

The container is the bundled suite's Debian base from the loopback registry, as root, with what
this machine's ``scripts/bootstrap.sh`` installed bound read-only: the host's ``/usr`` (bubblewrap,
slirp4netns, buildah, the C compiler), this test's Python and virtual environment, and the
checkout. Nothing is installed into it. Every container is removed, also when a test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "examples" / "tasks"
#: The documented settings: no seccomp filter, an unmasked /proc, a TUN device for the user-mode network.
DOCUMENTED = (
    "--security-opt",
    "seccomp=unconfined",
    "--security-opt",
    "systempaths=unconfined",
    "--device",
    "/dev/net/tun",
)


def _mounts() -> list[str]:
    python_home = os.path.realpath(sys.base_prefix)
    binds = {"/usr": "/usr", python_home: python_home, sys.prefix: sys.prefix, str(REPO): str(REPO)}
    if os.path.isdir("/etc/containers"):  # buildah's configuration (policy.json), copied in: it writes locks there
        binds["/etc/containers"] = "/run/host-containers"
    args = []
    for source, target in binds.items():
        args += ["-v", f"{source}:{target}:ro"]
    return args


def in_container(
    daemon,
    options: tuple[str, ...],
    script: str,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    **files: Path,
):
    """Run ``script`` (sh) as root in a fresh container with ``options``; the container is always removed.

    Args:
        daemon: The ``docker_daemon`` fixture.
        options: ``docker run`` options (security settings).
        script: The shell script; ``$PY`` is this test's Python, ``$SUITE`` the bundled suite.
        timeout: Seconds it may take.
        env: Variables to set in it, over the defaults.
        **files: Host files bound read-only at ``/run/<name>``.

    Returns:
        The finished ``docker run`` (text output).
    """
    name = f"trl-harbor-test-containers-{uuid.uuid4().hex[:8]}"
    extra = [arg for key, path in files.items() for arg in ("-v", f"{path}:/run/{key}:ro")]
    env = {
        "PYTHONPATH": str(REPO / "src"), "HARBOR_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "TRL_HARBOR_PREFLIGHT": "1",
        "HARBOR_LOCAL_SANDBOX_CACHE_DIR": "/cache", "PY": sys.executable, "SUITE": str(SUITE), **(env or {}),
    }  # fmt: skip
    prologue = "set -e; if [ -d /run/host-containers ]; then cp -r /run/host-containers /etc/containers; fi; cd /tmp\n"
    command = [
        "run", "--rm", "--name", name, "--user", "0", *options, *_mounts(), *extra,
        # The image cache on a tmpfs: buildah's overlays cannot have their upper layers on the container's overlay.
        "--tmpfs", "/cache:exec,mode=0700",
        *(arg for key, value in env.items() for arg in ("-e", f"{key}={value}")),
        "debian:bookworm-slim", "sh", "-c", prologue + script,
    ]  # fmt: skip
    try:
        return daemon.docker(*command, check=False, timeout=timeout)
    finally:
        daemon.docker("rm", "--force", name, check=False, timeout=60)
        assert name not in "\n".join(daemon.lines("ps", "-a", "--format", "{{.Names}}"))


@pytest.mark.docker
def test_default_settings_fail_at_the_preflight_naming_cause_and_fix(docker_daemon) -> None:
    """Docker's defaults: seccomp forbids the namespaces; with seccomp off, /proc is masked. Each says the fix."""
    check = '"$PY" -m trl_harbor.cli check "$SUITE" -t orders_count'
    default = in_container(docker_daemon, (), check, timeout=120)
    assert default.returncode == 2, default.stdout[-2000:] + default.stderr[-2000:]
    message = " ".join(default.stderr.split())
    assert "cannot create a user namespace" in message and "seccomp filter" in message, message
    assert "Docker container" in message, message
    for setting in ("--security-opt seccomp=unconfined", "--security-opt systempaths=unconfined"):
        assert setting in message, message
    assert "--cap-add" not in message, message  # task images need no capability added
    assert "environment_type='docker'" in message, message
    assert "No permissions to create new namespace" in message, message  # bubblewrap's own words, kept

    masked = in_container(docker_daemon, ("--security-opt", "seccomp=unconfined"), check, timeout=120)
    assert masked.returncode == 2, masked.stdout[-2000:] + masked.stderr[-2000:]
    message = " ".join(masked.stderr.split())
    assert "cannot mount its own /proc" in message and "masks parts of /proc" in message, message
    assert "--security-opt systempaths=unconfined" in message, message

    # Everything granted, but the image cache on the container's own overlay root: buildah could not build there.
    on_overlay = in_container(
        docker_daemon, DOCUMENTED, check, timeout=120, env={"HARBOR_LOCAL_SANDBOX_CACHE_DIR": "/root/cache"}
    )
    assert on_overlay.returncode == 2, on_overlay.stdout[-2000:] + on_overlay.stderr[-2000:]
    message = " ".join(on_overlay.stderr.split())
    assert "/root/cache, which is on an overlay file system" in message and "--tmpfs /cache:exec" in message, message


@pytest.mark.docker
@pytest.mark.local  # the local sandbox, inside the container
def test_documented_settings_run_the_bundled_suite_on_task_images(docker_daemon) -> None:
    """No capability added: task images build (buildah) and run in the container's root's own user namespace
    (``_userns.py``, as without root): the whole suite passes."""
    from registry import base_image_archive

    script = (
        '"$PY" -m trl_harbor.cli images load /run/base.tar debian:bookworm-slim\n'
        '"$PY" -m trl_harbor.cli check "$SUITE" -j 4 --json'
    )
    started = time.perf_counter()
    done = in_container(docker_daemon, DOCUMENTED, script, **{"base.tar": base_image_archive()})
    seconds = time.perf_counter() - started
    report = _report(done)
    failed = {task["task"]: task["why"] for task in report["tasks"] if not task["passed"]}
    assert not failed, failed
    assert report["passed"] == len(list(SUITE.iterdir()))
    print(f"task images in a container: {report['passed']} passed in {seconds:.1f} s (builds included)")


def _report(done: subprocess.CompletedProcess) -> dict:
    import json

    out = done.stdout
    try:
        return json.loads(out[out.index("{\n") :])
    except ValueError:
        pytest.fail(f"no check report (exit {done.returncode}):\n{out[-3000:]}\n{done.stderr[-3000:]}")


# -- explain(): the branches no machine here can show (a pod, a hardened kernel, podman) --------------------------


@pytest.mark.local
def test_on_this_host_the_probe_finds_nothing() -> None:
    """Real: bubblewrap makes its namespaces here, so the preflight adds nothing (and costs one bwrap)."""
    from harbor_local_sandbox._diagnose import bwrap_problem, namespace_problem, probe

    assert bwrap_problem() == ""
    assert probe() == {"step": None}
    assert namespace_problem() is None


def test_explain_names_the_sysctl_that_turns_user_namespaces_off() -> None:
    from harbor_local_sandbox._diagnose import Facts, explain

    facts = Facts(sysctls={"/proc/sys/user/max_user_namespaces": "0"}, uid=1000)
    message = explain({"step": "userns", "errno": "ENOSPC"}, "bwrap: No permissions", facts)
    assert "/proc/sys/user/max_user_namespaces is 0" in message and "sysctl -w user.max_user_namespaces=" in message
    assert "on the host" in message and "seccomp" not in message

    ubuntu = Facts(sysctls={"/proc/sys/kernel/apparmor_restrict_unprivileged_userns": "1"}, uid=1000)
    message = explain({"step": "userns", "errno": "EACCES"}, "", ubuntu)
    assert "apparmor_restrict_unprivileged_userns=0" in message and "bwrap-userns-restrict" in message


def test_explain_in_a_pod_gives_the_security_context() -> None:
    from harbor_local_sandbox._diagnose import Facts, explain

    pod = Facts(container="kubernetes", seccomp=True, masked_proc=("/proc/kcore", "/proc/sys"))
    message = explain({"step": "userns", "errno": "EPERM"}, "", pod)
    assert "Kubernetes container" in message and "seccompProfile: {type: Unconfined}" in message
    assert "procMount: Unmasked" in message and "capabilities:" not in message  # task images need none added
    message = explain({"step": "proc", "errno": "EPERM"}, "", pod)
    assert "/proc/kcore, /proc/sys" in message and "procMount: Unmasked" in message and "SYS_ADMIN" not in message


def test_explain_in_podman_and_without_a_known_cause() -> None:
    from harbor_local_sandbox._diagnose import Facts, explain

    podman = Facts(container="podman", seccomp=True)
    assert "podman run --security-opt seccomp=unconfined --security-opt unmask=ALL" in explain(
        {"step": "userns", "errno": "EPERM"}, "", podman
    )
    # Refused with no filter, sysctl or mask to blame: the refusal is reported as it is, with the alternatives.
    message = explain({"step": "mountns", "errno": "EPERM"}, "bwrap: oops", Facts())
    assert (
        "at step 'mountns' (EPERM)" in message and "bwrap: oops" in message and "environment_type='docker'" in message
    )
    assert explain({"step": None}, "", Facts()) is None


def test_cache_problem_only_on_an_overlay_without_fuse() -> None:
    from harbor_local_sandbox._diagnose import cache_problem, file_system_of

    mounts = "overlay / overlay rw 0 0\ntmpfs /cache tmpfs rw 0 0\n"
    assert file_system_of(Path("/cache/images/x"), mounts) == "tmpfs"
    assert file_system_of(Path("/cachex"), mounts) == "overlay"  # a prefix of the name is not the mount
    cache = Path("/root/.cache/harbor-local-sandbox")
    assert "on an overlay file system" in cache_problem(cache, mounts, fuse=False)
    assert cache_problem(cache, mounts, fuse=True) is None  # fuse-overlayfs can work
    assert cache_problem(Path("/cache"), mounts, fuse=False) is None
