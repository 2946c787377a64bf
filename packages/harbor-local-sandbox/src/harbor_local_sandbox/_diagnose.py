"""Why this machine cannot make a sandbox's namespaces, and exactly what to change (the backend's preflight).

First the cheapest faithful test: bubblewrap itself, with the namespaces every sandbox gets (user,
PID, mount, IPC, UTS, network) and a new ``/proc``. When it fails, a short probe in a fresh process
(a process with threads cannot unshare a user namespace) retries the steps one by one, and reports
the first one the kernel refused:

1. a user namespace of its own (refused by a container's seccomp filter, or by the sysctls and the
   AppArmor restriction that turn unprivileged user namespaces off);
2. in it, a mount and a PID namespace, and a new ``/proc`` mounted there (refused where a container
   runtime masks parts of ``/proc``: Linux mounts a new ``/proc`` in a user namespace only where the
   existing one is fully visible).

Where every step passes and bubblewrap still fails, a seccomp filter is refusing one of the other
calls it makes (``pivot_root`` under Docker's default profile, even with ``CAP_SYS_ADMIN``).

Task images need nothing more: root without ``CAP_SYS_ADMIN`` (a container's, usually) mounts their
trees in a user namespace of its own, as a user that is not root does (``_userns.py``).

The refusal is matched against what the machine says about itself (:class:`Facts`): a container
(Docker's ``/.dockerenv``, podman's ``/run/.containerenv``, Kubernetes' service variables, cgroup
names), a seccomp filter, the masks over ``/proc``, the sysctls. The Docker advice was measured with
Docker 20.10 (``tests/test_containers.py``); for Kubernetes it is the same settings in a pod's
``securityContext``, not measured here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from harbor_local_sandbox._binaries import SYSTEM_PATH, bwrap_path

#: The namespaces and mounts every box asks bubblewrap for, on the host's own root.
_BWRAP_PROBE = (
    "--unshare-user", "--uid", "0", "--gid", "0", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
    "--unshare-net", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true",
)  # fmt: skip

_PROBE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
work = sys.argv[1]
def fail(step, code):
    print(json.dumps({"step": step, "errno": errno.errorcode.get(code, str(code))})); sys.stdout.flush(); os._exit(0)
uid, gid = os.getuid(), os.getgid()
try:
    os.unshare(os.CLONE_NEWUSER)
except OSError as e:
    fail("userns", e.errno)
try:
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write(f"0 {uid} 1\n")
    open("/proc/self/gid_map", "w").write(f"0 {gid} 1\n")
except OSError as e:
    fail("map", e.errno)
try:
    os.unshare(os.CLONE_NEWNS | os.CLONE_NEWPID)
except OSError as e:
    fail("mountns", e.errno)
pid = os.fork()
if pid == 0:
    target = os.path.join(work, "proc")
    os.mkdir(target)
    if libc.mount(b"proc", target.encode(), b"proc", 0, None) != 0:
        os._exit(100 + ctypes.get_errno())
    os._exit(0)
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
if code >= 100: fail("proc", code - 100)
if code: fail("probe", code)
print(json.dumps({"step": None}))
"""

_SYSCTLS = (
    ("/proc/sys/kernel/unprivileged_userns_clone", "0", "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("/proc/sys/user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
    (
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
        "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile that allows user "
        "namespaces for bwrap (Ubuntu 24.04: /etc/apparmor.d/bwrap-userns-restrict)",
    ),
)  # fmt: skip

ALTERNATIVES = (
    "or use a backend that needs no namespaces here: environment_type='docker' where a Docker daemon runs, "
    "or a remote sandbox ('modal', 'e2b', 'daytona', 'runloop')"
)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class Facts:
    """What the machine says about itself, which a refusal is explained with.

    Attributes:
        container: ``"kubernetes"``, ``"docker"``, ``"podman"``, another runtime's name, or ``None``.
        seccomp: Whether a seccomp filter confines this process.
        masked_proc: Mounts over parts of ``/proc`` (a container runtime's masks and read-only binds).
        sysctls: The values of the sysctls that turn user namespaces off, by path (where they exist).
        uid: This process's effective uid.
    """

    container: str | None = None
    seccomp: bool = False
    masked_proc: tuple[str, ...] = ()
    sysctls: dict[str, str] = field(default_factory=dict)
    uid: int = 0

    @classmethod
    def here(cls) -> Facts:
        """The facts of this process and machine."""
        sysctls = {path: value for path, _, _ in _SYSCTLS if (value := _read(path)) is not None}
        return cls(
            container=container(), seccomp=_seccomp(), masked_proc=tuple(masked_proc()), sysctls=sysctls,
            uid=os.geteuid(),
        )  # fmt: skip


@cache
def container() -> str | None:
    """``"kubernetes"``, ``"docker"``, ``"podman"``, another runtime's name, or ``None`` (not in a container)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") or Path("/var/run/secrets/kubernetes.io").exists():
        return "kubernetes"
    if Path("/.dockerenv").exists():
        return "docker"
    if Path("/run/.containerenv").exists():
        return "podman"
    cgroups = _read("/proc/1/cgroup") or ""
    for name in ("kubepods", "docker", "containerd", "libpod", "lxc"):
        if name in cgroups:
            return "kubernetes" if name == "kubepods" else name
    return _read("/run/systemd/container") or None


def _seccomp() -> bool:
    status = _read("/proc/self/status") or ""
    return any(line.split()[1:2] == ["2"] for line in status.splitlines() if line.startswith("Seccomp:"))


def masked_proc() -> list[str]:
    """Mounts over parts of ``/proc`` (a container runtime's masks): no new ``/proc`` in a user namespace then."""
    found = []
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        point = fields[4] if len(fields) > 4 else ""
        if point.startswith("/proc/") and not point.startswith("/proc/sys/fs/binfmt_misc"):
            found.append(point)
    return found


def runtime_settings(kind: str | None) -> str:
    """The container settings that let sandboxes run in a container of runtime ``kind``.

    Args:
        kind: What :func:`container` says (``None``: Docker's settings are given).
    """
    if kind == "kubernetes":
        return (
            "in the pod's container spec: securityContext: {seccompProfile: {type: Unconfined}, "
            "procMount: Unmasked} (procMount needs Kubernetes' ProcMountType feature, and hostUsers: "
            "false where the cluster requires it), appArmorProfile: {type: Unconfined} on nodes with AppArmor, "
            "and a /dev/net/tun device for tasks that may use the network"
        )
    tool = "podman" if kind == "podman" else "docker"
    masks = "--security-opt unmask=ALL" if kind == "podman" else "--security-opt systempaths=unconfined"
    return (
        f"run the container with `{tool} run --security-opt seccomp=unconfined {masks}` "
        "(`--device /dev/net/tun` too for tasks that may use "
        "the network, `--security-opt apparmor=unconfined` where the host has AppArmor)"
    )


def explain(result: dict, bwrap_error: str = "", facts: Facts | None = None) -> str | None:
    """What a failed bubblewrap start and the step probe's result mean here, and the fix.

    Args:
        result: The step probe's result: ``{"step": None}`` (every step passed) or the step refused
            (``"userns"``, ``"map"``, ``"mountns"``, ``"proc"``, ``"probe"``) and its ``errno`` name.
        bwrap_error: What bubblewrap printed when it failed (empty: it did not fail).
        facts: What the machine says about itself (default: :meth:`Facts.here`).

    Returns:
        The cause and the fix, or ``None`` when nothing was refused.
    """
    step, code = result.get("step"), result.get("errno")
    if step is None and not bwrap_error:
        return None
    facts = facts or Facts.here()
    kind = facts.container
    where = f"this process runs in a {kind.capitalize()} container" if kind else "this process runs on the host"
    said = f" (bubblewrap: {bwrap_error.strip()})" if bwrap_error.strip() else ""
    fix = f"Fix: {runtime_settings(kind)}; {ALTERNATIVES}."
    if step == "userns":
        if kind and facts.seccomp and code in ("EPERM", "ENOSYS"):
            return (
                f"the local sandbox cannot create a user namespace ({code}){said}: {where}, whose seccomp filter "
                "forbids new namespaces (Docker's default profile, and a pod's RuntimeDefault, allow them only "
                f"with CAP_SYS_ADMIN, and then still refuse pivot_root). {fix}"
            )
        for path, value, sysctl_fix in _SYSCTLS:
            if facts.sysctls.get(path) == value:
                return (
                    f"the local sandbox cannot create a user namespace ({code}){said}: {path} is {value} "
                    f"({where}). Fix (as root on the host): {sysctl_fix}; {ALTERNATIVES}."
                )
        return f"the local sandbox cannot create a user namespace ({code}){said}: {where}; {ALTERNATIVES}."
    if step == "proc":
        if facts.masked_proc:
            shown = ", ".join(facts.masked_proc[:6]) + (", ..." if len(facts.masked_proc) > 6 else "")
            return (
                f"the local sandbox cannot mount its own /proc ({code}){said}: {where}, whose runtime masks parts "
                f"of /proc ({shown}), and Linux mounts a new /proc in a user namespace only where the existing one "
                "is fully visible (binding the container's /proc instead would show each sandbox every other "
                f"sandbox's processes). {fix}"
            )
        return f"the local sandbox cannot mount its own /proc ({code}){said}: {where}; {ALTERNATIVES}."
    if step is None and facts.seccomp:
        return (
            f"bubblewrap cannot set up the sandbox{said}: {where}, where user, mount and PID namespaces and a new "
            "/proc work but a seccomp filter refuses another call bubblewrap makes (Docker's default profile "
            f"refuses pivot_root even with CAP_SYS_ADMIN). {fix}"
        )
    detail = f"at step {step!r} ({code})" if step else "although every namespace step works"
    return f"the local sandbox cannot make its namespaces {detail}{said}: {where}; {ALTERNATIVES}."


def probe(directory: Path | None = None) -> dict:
    """Run the step probe in a fresh process: ``{"step": None}``, or the step refused and its ``errno`` name.

    Args:
        directory: Where its scratch folder goes (default: the temporary directory).
    """
    with tempfile.TemporaryDirectory(prefix="harbor-local-sandbox-probe-", dir=directory) as work:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE, work], capture_output=True, text=True, timeout=60, cwd="/"
        )
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"step": "probe", "errno": done.stderr.strip()[-300:] or f"exit code {done.returncode}"}


def bwrap_problem() -> str:
    """What bubblewrap prints when it cannot start a box's namespaces here (empty when it can)."""
    done = subprocess.run(
        [bwrap_path(), *_BWRAP_PROBE], capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": SYSTEM_PATH}
    )
    return "" if done.returncode == 0 else (done.stderr.strip() or f"exit code {done.returncode}")


@cache
def namespace_problem() -> str | None:
    """Why sandboxes cannot be made here, with the fix, or ``None`` (probed once per process)."""
    try:
        error = bwrap_problem()
        if not error:
            return None
        return explain(probe(), error)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the local sandbox's namespace probe could not run ({exc})"


def file_system_of(path: Path, mounts_text: str | None = None) -> str | None:
    """The type of the file system holding ``path`` (or its nearest existing parent), from the mount table.

    Args:
        path: Any path; it need not exist yet.
        mounts_text: ``/proc/self/mounts`` (default: this process's).
    """
    mounts_text = mounts_text if mounts_text is not None else (_read("/proc/self/mounts") or "")
    target = os.path.realpath(path)
    best, kind = "", None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def cache_problem(cache_dir: Path, mounts_text: str | None = None, fuse: bool | None = None) -> str | None:
    """Why task images cannot be built in ``cache_dir`` (an overlay, e.g. a container's own root), or ``None``.

    buildah's layers are overlays whose upper folders cannot be on an overlay; it then falls back to
    ``fuse-overlayfs``, which needs ``/dev/fuse`` (a container has none by default).

    Args:
        cache_dir: The image cache (``cache_dir`` option, ``HARBOR_LOCAL_SANDBOX_CACHE_DIR``,
            ``~/.cache/harbor-local-sandbox``).
        mounts_text: ``/proc/self/mounts`` (default: this process's).
        fuse: Whether ``/dev/fuse`` exists (default: looked up).
    """
    fuse = os.path.exists("/dev/fuse") if fuse is None else fuse
    if fuse or file_system_of(cache_dir, mounts_text) != "overlay":
        return None
    return (
        f"the local sandbox builds task images in {cache_dir}, which is on an overlay file system (a "
        "container's own root): buildah cannot stack its layers there, and its fallback (fuse-overlayfs) "
        "needs /dev/fuse. Fix: put the cache on a volume or a tmpfs (HARBOR_LOCAL_SANDBOX_CACHE_DIR=/cache with "
        "`docker run -v cache:/cache` or `--tmpfs /cache:exec`; in a pod, an emptyDir), or the cache_dir option"
    )
