"""What the verifier runs is not the agent's: the agent's processes and tampering, before grading.

An RL policy is an adversary: whatever it can reach that changes its reward, it will find. For
backends that verify in the agent's own sandbox, this module provides two safeguards:

* **The agent's processes can be gone before the verifier starts** (``agent_processes="kill"``).
  Every process the agent's tool calls left (``nohup``, ``setsid``, double forks, processes that
  ignore SIGTERM, a harness's kernel) is killed, so nothing can rewrite the reward file or the
  files under test while the verifier runs. Backends that can do this exactly provide an async
  ``kill_processes()``; elsewhere the processes started after the sandbox came up are found in
  ``/proc`` and killed (:data:`KILL_SCRIPT`), keeping the backend's own daemons.
* **The agent cannot change the code that grades it.** Before the agent's first command, the
  files the verifier executes or that shape how it starts are fingerprinted; before grading they
  are fingerprinted again. The watched set (:func:`watches`) is every directory on the
  verifier's ``PATH``, every Python import directory (``sys.path`` of ``python3``, user site
  included), and the start-up files of shells, the dynamic loader and package managers. The
  policy (:func:`violations`) refuses a change that replaces or shadows something the verifier
  may run and lets installs through, so tasks whose answer *is* system state still grade it:

  - startup files and ``/tests`` (what Harbor's verifier uploads its tests into): any change;
  - ``PATH`` directories: a changed or removed command, or an added one whose name another
    ``PATH`` directory already has (a fake ``python3``/``pytest`` earlier on ``PATH``); a new
    command name is an install and is allowed;
  - Python import directories: an added or changed ``*.pth``, ``sitecustomize`` or
    ``usercustomize``; a changed or removed file; an added module or package whose name another
    import directory already has (shadowing); a new package is an install and is allowed.

  A task (``[metadata] allowed_changes = ["/usr/local/lib/python3*/site-packages/*"]``) or the
  environment (``HarborEnv(allowed_changes=...)``) can allow more, by glob. A violation scores
  0 with the list of changes as its reason, and the verifier does not run at all.

Backends that can list files without running the sandbox's own programs provide an async
``file_fingerprints(watches)`` (the local sandbox reads its tree from the host); elsewhere
:func:`fingerprint_command` runs in the sandbox with the sandbox's ``sh`` and ``find``, which a
tampered sandbox could have replaced: that residue is documented in ``docs/rewards.md``.
"""

from __future__ import annotations

import fnmatch
import posixpath
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from trl_harbor.rollout import code_places

__all__ = [
    "KILL_SCRIPT",
    "PROCESS_SNAPSHOT_SCRIPT",
    "STARTUP_FILES",
    "VERIFIER_INPUTS",
    "Change",
    "Watch",
    "diff",
    "fingerprint_command",
    "kill_command",
    "parse_fingerprints",
    "violations",
    "watches",
]

#: Files (and folders, recursively) that shape how shells, the loader and package managers start, from
#: the one table of code places (``code_places.py``: the local sandbox's view and keel read it too).
#: ``~`` stands for every home folder (``/root`` and ``/home/*``). The loader's cache is left out: an
#: honest ``ldconfig`` rewrites it, and without a view nothing can be shown instead of it (the view
#: remakes it from the image's configuration). So are the folders verify-time tools are fetched into
#: (``FETCHED_CODE``) and the package managers' scripts: honest installs write there, and a seal can
#: only refuse, not hide (docs/security.md says what that leaves to a backend without a view).
STARTUP_FILES: tuple[str, ...] = tuple(item for item in code_places.STARTUP_FILES if item != "/etc/ld.so.*") + (
    "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
)  # fmt: skip
#: What Harbor's verifier reads from the sandbox besides the files under test: the agent may not
#: touch it (a planted ``/tests/conftest.py`` or ``/tests/json.py`` would run as the grader).
#: (``/solution`` is Harbor's oracle's own upload, made after the baseline: not watched.)
VERIFIER_INPUTS: tuple[str, ...] = tuple(p for p in code_places.VERIFIER_ONLY if p == "/tests")
_HOMES = ("/root", "/home/*")
_PY_HOOKS = tuple(hook.rstrip("*") for hook in code_places.HOOKS if hook.endswith("*"))
_MODULE_SUFFIXES = (".py", ".pyc", ".pth", ".so", ".pyd", ".dist-info", ".egg-info", ".egg-link")

Kind = Literal["added", "modified", "removed"]
Role = Literal["locked", "path", "python"]


@dataclass(frozen=True)
class Watch:
    """One watched location of a sandbox.

    Attributes:
        pattern: An absolute sandbox path; shell-style wildcards allowed.
        depth: How deep below it to look (``0``: the entry itself; ``None``: everything).
        role: Which rule of :func:`violations` applies to what is found there.
    """

    pattern: str
    depth: int | None
    role: Role


@dataclass(frozen=True)
class Change:
    """A difference between two fingerprints of a sandbox.

    Attributes:
        path: The sandbox path.
        kind: ``"added"``, ``"modified"`` or ``"removed"``.
    """

    path: str
    kind: Kind

    def __str__(self) -> str:
        return f"{self.path} ({self.kind})"


def watches(path_dirs: Iterable[str], python_dirs: Iterable[str]) -> list[Watch]:
    """The locations whose changes can alter what the verifier runs.

    Args:
        path_dirs: The directories on the verifier's ``PATH``.
        python_dirs: ``python3``'s import directories (``sys.path`` and the user site).

    Returns:
        Startup files and ``/tests`` (recursively), ``PATH`` directories (their entries) and
        Python import directories (recursively).
    """
    found: list[Watch] = []
    for item in (*STARTUP_FILES, *VERIFIER_INPUTS):
        if item.startswith("~/"):
            found += [Watch(posixpath.join(home, item[2:]), None, "locked") for home in _HOMES]
        else:
            found.append(Watch(item, None, "locked"))
    for directory in dict.fromkeys(d for d in path_dirs if d.startswith("/")):
        found.append(Watch(posixpath.normpath(directory), 1, "path"))
    for directory in dict.fromkeys(d for d in python_dirs if d.startswith("/")):
        if not directory.endswith((".zip", ".egg")):
            found.append(Watch(posixpath.normpath(directory), None, "python"))
    return found


def fingerprint_command(watched: Sequence[Watch]) -> str:
    """A POSIX shell command printing the fingerprints of ``watched`` (for backends without a native one).

    Each entry is printed as ``type|mode|size|inode|ctime|path`` and ended by a NUL byte; see
    :func:`parse_fingerprints`.

    Args:
        watched: The locations to fingerprint.

    Returns:
        The command (run it as root).
    """
    lines = []
    for watch in watched:
        depth = "" if watch.depth is None else f"-maxdepth {watch.depth} "
        lines.append(
            f'for f in {_shell_glob(watch.pattern)}; do [ -e "$f" ] || [ -L "$f" ] || continue; '
            f'find "$f" {depth}-printf "%y|%m|%s|%i|%C@|%p\\0" 2>/dev/null; done'
        )
    return "\n".join(lines)


def _shell_glob(pattern: str) -> str:
    # Escape every character but the wildcards, so the shell expands only those.
    return "".join(ch if ch.isalnum() or ch in "*?[]/._-" else "\\" + ch for ch in pattern)


def parse_fingerprints(output: str | bytes) -> dict[str, str]:
    """Parse :func:`fingerprint_command`'s output into ``{path: signature}``.

    A folder's signature is its type and mode only: adding to a folder changes its times,
    and what was added is reported on its own.

    Args:
        output: The command's standard output.

    Returns:
        The fingerprints, by sandbox path.
    """
    if isinstance(output, bytes):
        output = output.decode("utf-8", "surrogateescape")
    found: dict[str, str] = {}
    for record in output.split("\0"):
        parts = record.split("|", 5)
        if len(parts) != 6:
            continue
        kind, mode, size, inode, ctime, path = parts
        found[path] = f"d|{mode}" if kind == "d" else f"{kind}|{mode}|{size}|{inode}|{ctime}"
    return found


def diff(before: Mapping[str, str], after: Mapping[str, str]) -> list[Change]:
    """What changed between two fingerprints, sorted by path.

    Args:
        before: The fingerprint taken before the agent's first command.
        after: The fingerprint taken after its last.

    Returns:
        Every added, modified and removed path.
    """
    changes = [Change(path, "added") for path in after.keys() - before.keys()]
    changes += [Change(path, "removed") for path in before.keys() - after.keys()]
    changes += [Change(path, "modified") for path in before.keys() & after.keys() if before[path] != after[path]]
    return sorted(changes, key=lambda change: change.path)


def violations(
    changes: Sequence[Change],
    before: Mapping[str, str],
    watched: Sequence[Watch],
    allowed: Sequence[str] = (),
) -> list[Change]:
    """The changes that alter what the verifier runs (see the module docstring for the rules).

    Args:
        changes: From :func:`diff`.
        before: The fingerprint before the agent (for shadowing: which names existed).
        watched: The watched locations the fingerprints cover.
        allowed: Globs of sandbox paths the agent may change anyway (the task's or the
            environment's ``allowed_changes``).

    Returns:
        The offending changes, in path order (empty: nothing the verifier runs was touched).
    """
    path_dirs = [w.pattern for w in watched if w.role == "path"]
    python_dirs = [w.pattern for w in watched if w.role == "python"]
    locked = [w.pattern for w in watched if w.role == "locked"]
    commands = {posixpath.basename(p) for p in before if posixpath.dirname(p) in path_dirs}
    modules = {_module_name(p) for p in before if posixpath.dirname(p) in python_dirs}
    allows = code_places.allowed_changes(allowed)
    found = []
    for change in changes:
        if allows(change.path):
            continue
        if any(_under(change.path, pattern) for pattern in locked):
            found.append(change)
            continue
        parent = posixpath.dirname(change.path)
        name = posixpath.basename(change.path)
        if parent in path_dirs:
            if change.kind != "added" or name in commands:
                found.append(change)
            continue
        # The innermost import directory holding it (site-packages may sit inside the stdlib's).
        home = max((d for d in python_dirs if change.path.startswith(d.rstrip("/") + "/")), key=len, default=None)
        if home is None:
            continue
        top = change.path[len(home.rstrip("/")) + 1 :].split("/", 1)[0]
        hook = top.endswith(".pth") or _module_name(top) in _PY_HOOKS
        if change.kind != "added" or hook or (parent == home and _module_name(name) in modules):
            found.append(change)
    return found


def _under(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern.rstrip("/") + "/*")


def _module_name(path: str) -> str:
    name = posixpath.basename(path)
    for suffix in _MODULE_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    # "numpy-2.1.0.dist-info" -> "numpy"; "_foo.cpython-311-x86_64-linux-gnu" -> "_foo"
    return name.split(".", 1)[0].split("-", 1)[0]


#: Prints ``pid:starttime`` for every process but this shell and its ancestors (run once the
#: sandbox is up, before the agent's first command: what it lists is kept at verification).
PROCESS_SNAPSHOT_SCRIPT = r"""
anc=" "; p=$$
while [ "${p:-0}" -gt 1 ]; do anc="$anc$p "; set -- $(sed 's/.*) //' /proc/$p/stat 2>/dev/null); p=${2:-0}; done
for d in /proc/[0-9]*; do
  pid=${d#/proc/}; case "$anc" in *" $pid "*) continue;; esac
  set -- $(sed 's/.*) //' "$d/stat" 2>/dev/null) || continue
  [ -n "$1" ] && echo "$pid:${20}"
done
"""

#: Kills every process not in ``$KEEP`` (``pid:starttime`` entries from the snapshot) but this
#: shell and its ancestors (the backend's own exec machinery), until none is left.
KILL_SCRIPT = r"""
anc=" "; p=$$
while [ "${p:-0}" -gt 1 ]; do anc="$anc$p "; set -- $(sed 's/.*) //' /proc/$p/stat 2>/dev/null); p=${2:-0}; done
total=0; round=0
while [ $round -lt 100 ]; do
  round=$((round + 1)); killed=0
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}; case "$anc" in *" $pid "*) continue;; esac
    set -- $(sed 's/.*) //' "$d/stat" 2>/dev/null) || continue
    [ -z "$1" ] || [ "$1" = Z ] || [ "$1" = X ] && continue
    case " $KEEP " in *" $pid:${20} "*) continue;; esac
    kill -9 "$pid" 2>/dev/null && killed=$((killed + 1))
  done
  total=$((total + killed)); [ $killed -eq 0 ] && break
done
echo "$total"
"""


def kill_command(keep: Iterable[str]) -> str:
    """The shell command that kills every process not in ``keep`` (see :data:`KILL_SCRIPT`).

    Args:
        keep: ``pid:starttime`` entries, as :data:`PROCESS_SNAPSHOT_SCRIPT` prints them.

    Returns:
        The command (run it as root); it prints how many processes it killed.
    """
    return f"KEEP={shlex.quote(' '.join(keep))}\n{KILL_SCRIPT}"
