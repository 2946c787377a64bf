"""The programs a box runs: host tools (bubblewrap, ``setpriv``) and this package's C helpers
(``_supervisor.c``, ``_runas.c``, ``_forwarder.c``, ``_launcher.c``), built when the package is
built (``setup.py``: into ``_bin/``, with a manifest of the sources they were built from) and never at run time;
and where the local sandbox keeps things (the cache, the state root)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from harbor_local_sandbox.errors import SandboxUnavailableError

logger = logging.getLogger(__name__)

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def default_cache_dir() -> Path:
    """``$HARBOR_LOCAL_SANDBOX_CACHE_DIR``, else ``~/.cache/harbor-local-sandbox`` (task images and their roots)."""
    configured = os.environ.get("HARBOR_LOCAL_SANDBOX_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "harbor-local-sandbox"


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


#: Where the package's build put its C helpers (setup.py), beside the manifest of what it built.
HELPERS_DIR = Path(__file__).resolve().parent / "_bin"
#: The helpers' sources, installed with the package: what the manifest's hashes are compared with.
SOURCES_DIR = Path(__file__).resolve().parent
MANIFEST = "manifest.json"


def _reinstall_hint() -> str:
    """How to rebuild the helpers: reinstall the package (from a checkout: its editable install again)."""
    return (
        "Reinstall harbor-local-sandbox, which builds them: `pip install --force-reinstall harbor-local-sandbox` "
        "(a linux wheel carries them built; from source it needs `gcc` and the static C library, "
        "`apt-get install gcc libc6-dev`), or, for a checkout, `pip install -e packages/harbor-local-sandbox` again "
        "(the repository's ./scripts/bootstrap.sh does that when a helper's source changes)."
    )


def _manifest(folder: Path) -> dict:
    """The build's record of the helpers it made (``{}`` without one)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("helpers"), dict) else {}


def _built(name: str) -> tuple[str | None, str]:
    """``(path, "")`` of the helper ``name`` as the package's build made it, or ``(None, why the build did not)``.

    Raises:
        SandboxUnavailableError: If the package has no build of it, or one from another ``_<name>.c`` than the
            one installed (a checkout's source edited since its editable install).
    """
    entry = _manifest(HELPERS_DIR).get("helpers", {}).get(name)
    if not isinstance(entry, dict):
        raise SandboxUnavailableError(
            f"harbor-local-sandbox's C helper {name!r} was not built: {HELPERS_DIR / MANIFEST} "
            f"{'does not list it' if (HELPERS_DIR / MANIFEST).exists() else 'is missing'} (the helpers are built "
            f"when the package is installed, never at run time). {_reinstall_hint()}"
        )
    source = SOURCES_DIR / f"_{name}.c"
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != entry.get("source_sha256"):
        raise SandboxUnavailableError(
            f"harbor-local-sandbox's C helper {name!r} in {HELPERS_DIR} is stale: it was built from another "
            f"{source.name} than the one installed ({source}). {_reinstall_hint()}"
        )
    if not entry.get("built"):
        return None, str(entry.get("error") or "the build did not make it")
    binary = HELPERS_DIR / name
    if not os.access(binary, os.X_OK):
        raise SandboxUnavailableError(
            f"harbor-local-sandbox's C helper {name!r} is listed as built in {HELPERS_DIR / MANIFEST}, but "
            f"{binary} is missing or not executable. {_reinstall_hint()}"
        )
    return str(binary), ""


@cache
def static_binary(name: str) -> str:
    """The path of ``_<name>.c`` (``"supervisor"``, ``"runas"``, ``"forwarder"``), linked
    statically when the package was built (``setup.py``).

    Image roots have their own C library, or none: what runs in them must not depend on the host's.

    Raises:
        SandboxUnavailableError: If the package was installed without it, or it is stale (built from another
            source than the one installed); the error says how to rebuild it.
    """
    binary, error = _built(name)
    if binary is None:  # the build makes every static helper or fails
        raise SandboxUnavailableError(
            f"harbor-local-sandbox's C helper {name!r} was not built ({error[-1500:]}). {_reinstall_hint()}"
        )
    return binary


@cache
def launcher_binary() -> str | None:
    """The launcher built with the package (``_launcher.c``: a process parked in a box's cgroups that becomes its
    bubblewrap, and the step that gives each box its own mount table), or ``None`` when the package's build
    could not make it (its manifest says why; boxes then move into their cgroups as they start, and see the other
    boxes' mounts).

    Raises:
        SandboxUnavailableError: If the package has no build of it at all, or a stale one (as
            :func:`static_binary`).
    """
    binary, error = _built("launcher")
    if binary is None:
        logger.debug("no launcher for parked sandbox starts: the package's build could not make it: %s", error[-500:])
    return binary


def state_root() -> Path:
    """Where sandboxes keep their private trees.

    ``$HARBOR_LOCAL_SANDBOX_STATE_DIR`` if set; else a per-user folder on ``/dev/shm`` when it is
    a writable tmpfs that allows programs to run (creating and removing a sandbox's tree is 40x faster there than
    on a journaled disk, and what the agent writes counts against the sandbox's own
    memory limit); else a per-user folder in the temporary directory.
    """
    configured = os.environ.get("HARBOR_LOCAL_SANDBOX_STATE_DIR")
    if configured:
        base = Path(configured)
    elif _shm_is_tmpfs():
        base = Path("/dev/shm") / f"harbor-local-sandbox-{os.getuid()}"
    else:
        base = Path(tempfile.gettempdir()) / f"harbor-local-sandbox-{os.getuid()}"
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
