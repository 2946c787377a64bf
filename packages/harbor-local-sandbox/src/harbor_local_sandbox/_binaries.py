"""The programs a box runs: host tools (bubblewrap, ``setpriv``) and this package's C helpers
(``_supervisor.c``, ``_runas.c``, ``_nouserns.c``, ``_launcher.c``), compiled on first use and cached
by source hash; and where the local sandbox keeps things (the cache, the state root)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path

from harbor_local_sandbox.errors import SandboxUnavailableError

logger = logging.getLogger(__name__)

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def default_cache_dir() -> Path:
    """``$TRL_HARBOR_CACHE_DIR``, else ``~/.cache/trl-harbor`` (images, compiled helpers)."""
    configured = os.environ.get("TRL_HARBOR_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "trl-harbor"


def which(tool: str) -> str | None:
    """``tool``'s path on ``PATH`` or in the system folders, or ``None``."""
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":" + SYSTEM_PATH)


@cache
def bwrap_path() -> str:
    """Return the path of the ``bwrap`` executable.

    Raises:
        SandboxUnavailableError: If bubblewrap is not installed.
    """
    found = which("bwrap")
    if not found:
        raise SandboxUnavailableError(
            "The local sandbox needs bubblewrap, which is not installed. Install it with "
            "`apt-get install bubblewrap` (Debian/Ubuntu), `dnf install bubblewrap` (Fedora) "
            "or your distribution's package, or use another environment_type (e.g. 'docker')."
        )
    return found


@cache
def pdeathsig_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig KILL --`` (util-linux), where it exists, to start bubblewrap with.

    bubblewrap's ``--die-with-parent`` arms itself only part-way through setting up the sandbox;
    an owner that dies (``kill -9``) before that left the bubblewrap process waiting forever.
    Armed before ``exec``, the signal covers bubblewrap's whole life.
    """
    tool = which("setpriv")
    if tool is None:
        return ()
    try:
        usage = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return (tool, "--pdeathsig", "KILL", "--") if "--pdeathsig" in usage else ()


def _compile(name: str, static: bool) -> tuple[str | None, str]:
    """Compile ``_<name>.c`` of this package once: ``(binary or None, why not)``."""
    source = resources.files("harbor_local_sandbox").joinpath(f"_{name}.c").read_bytes()
    bin_dir = default_cache_dir() / "bin"
    binary = bin_dir / f"{name}{'-static' if static else ''}-{hashlib.sha256(source).hexdigest()[:16]}"
    if binary.exists():
        return str(binary), ""
    compiler = which(os.environ.get("CC", "cc")) or which("gcc") or which("clang")
    if compiler is None:
        return None, "no C compiler found"
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=bin_dir) as scratch:
        src, out = Path(scratch) / f"{name}.c", Path(scratch) / name
        src.write_bytes(source)
        flags = ["-O2", *(["-static"] if static else [])]
        result = subprocess.run([compiler, *flags, "-o", str(out), str(src)], capture_output=True, text=True)
        if result.returncode != 0:
            return None, result.stderr.strip()
        out.replace(binary)  # atomic: concurrent builders race harmlessly
    return str(binary), ""


@cache
def static_binary(name: str) -> str:
    """The path of ``_<name>.c`` (``"supervisor"``, ``"runas"``, ``"nouserns"``) compiled statically, once.

    Image roots have their own C library, or none: what runs in them must not depend on the host's.

    Raises:
        SandboxUnavailableError: If no C compiler can link statically.
    """
    binary, error = _compile(name, static=True)
    if binary is None:
        raise SandboxUnavailableError(
            "Sandboxes on task images run a small statically linked supervisor, which could not be "
            f"compiled ({error[-1500:]}). Install a C compiler and the static C library (`apt-get install gcc "
            "libc6-dev`)."
        )
    return binary


@cache
def launcher_binary() -> str | None:
    """The compiled launcher (``_launcher.c``: a process parked in a box's cgroups that becomes its
    bubblewrap, and the step that gives each box its own mount table), or ``None`` without a C
    compiler (boxes then move into their cgroups as they start, and see the other boxes' mounts)."""
    binary, error = _compile("launcher", static=False)
    if binary is None:
        logger.debug("no launcher for parked sandbox starts: %s", error[-500:])
    return binary


def state_root() -> Path:
    """Where sandboxes keep their private trees.

    ``$TRL_HARBOR_STATE_DIR`` if set; else a per-user folder on ``/dev/shm`` when it is
    a writable tmpfs that allows programs to run (creating and removing a sandbox's tree is 40x faster there than
    on a journaled disk, and what the agent writes counts against the sandbox's own
    memory limit); else a per-user folder in the temporary directory.
    """
    configured = os.environ.get("TRL_HARBOR_STATE_DIR")
    if configured:
        base = Path(configured)
    elif _shm_is_tmpfs():
        base = Path("/dev/shm") / f"trl-harbor-{os.getuid()}"
    else:
        base = Path(tempfile.gettempdir()) / f"trl-harbor-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


@cache
def _shm_is_tmpfs() -> bool:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    # A container's /dev/shm is usually mounted noexec (Docker's, a pod's): a tree there could run nothing.
    return any(
        line.split()[1:3] == ["/dev/shm", "tmpfs"] and "noexec" not in line.split()[3].split(",") for line in mounts
    ) and os.access("/dev/shm", os.W_OK)
