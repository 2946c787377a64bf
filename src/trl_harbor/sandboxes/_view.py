"""What the verifier sees of a sandbox on a task image: the agent's files, the image's code.

The agent's sandbox is an overlay: the image's root read-only underneath, the agent's own upper
layer on top, where every change it made is a plain entry, a whiteout (a deletion) or an opaque
folder (a folder replaced whole). The verifier's root is another overlay over the same image, whose
middle layer is a *snapshot* of the agent's upper layer taken when grading begins — filtered by one
rule, :func:`snapshot`:

**The verifier runs the image's code.** Where the verifier looks code up — the directories on its
``PATH``, its Python's import path, the loader's library directories, and the start-up files of the
shells, the loader, name resolution, Python, pip, uv, git and TLS (:data:`CODE_CONFIG`) — an entry
the image shipped reads as shipped, even if the agent edited, replaced or deleted it; and an entry
the agent *added* there is not seen when it would run instead of, or beside, shipped code: a name a
shipped entry of the same search path has (before its first dot; commands by their whole name), a
file inside a package the image shipped, a hook that interpreters load unasked (:data:`HOOKS`, a
``pytest11`` entry point), the test runner's own packages (:data:`RUNNER_PACKAGES`), or a Python
module or test-runner configuration in ``/`` or another ancestor of the verifier's working directory.
``/tests``, ``/solution`` and ``/logs/verifier`` are the verifier's alone. Everything else the agent
did — its work in the task's working directory, what it installed under new names, the
configuration it was asked to change — the verifier sees. A path that matches the task's
``allowed_changes`` is always the agent's.

The snapshot holds the agent's names as they were when grading began: files its processes create
afterwards are not seen. Regular files outside the code's places are copied (sparse-aware, up to a
budget), so the verifier grades the outputs as they were; the rest are hard links, whose content the
agent's processes could still change.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import os
import posixpath
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CODE_CONFIG", "HOOKS", "RUNNER_PACKAGES", "SearchPaths", "Snapshot", "search_paths", "snapshot", "stem"]

#: Configuration that decides how code starts (globs; ``~`` is every home folder).
CODE_CONFIG: tuple[str, ...] = (
    "/etc/ld.so.*", "/etc/ld.so.conf.d", "/etc/nsswitch.conf", "/etc/profile",
    "/etc/profile.d", "/etc/bash.bashrc", "/etc/environment", "/etc/python3*", "/etc/pip.conf", "/etc/uv",
    "/etc/ssl", "/etc/ca-certificates*", "/etc/gitconfig", "/usr/lib/*/gconv/gconv-modules*",
    "/etc/apt", "/etc/dpkg", "/etc/xdg", "*/pip.conf", "/etc/npmrc", "/usr/etc",
    "~/.bashrc", "~/.bash_profile", "~/.bash_login", "~/.profile", "~/.pydistutils.cfg", "~/.pip",
    "~/.config/pip", "~/.config/uv", "~/.local/share/uv", "~/.cache", "~/.npmrc", "~/.curlrc", "~/.wgetrc",
    "~/.gitconfig", "~/.netrc", "~/.pypirc",
)  # fmt: skip
#: Files interpreters load from a directory without being asked.
HOOKS: tuple[str, ...] = ("*.pth", "*._pth", "pyvenv.cfg", "sitecustomize*", "usercustomize*")
#: The test runner's own packages: the verifier never runs the agent's version of them.
RUNNER_PACKAGES: frozenset[str] = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "py"})
#: What a test runner or ``python -m`` picks up from a working directory and its ancestors.
RUNNER_CONFIG: tuple[str, ...] = (
    "conftest.py", "pytest.ini", ".pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "setup.py",
    "*.py", "*.pyc", "*.pth", "*.so", "__pycache__", "node_modules", "package.json", "uv.toml",
    ".python-version", ".nvmrc", ".tool-versions", ".npmrc",
)  # fmt: skip
#: Paths that are the verifier's alone.
VERIFIER_ONLY: tuple[str, ...] = ("/tests", "/solution", "/logs/verifier", "/run/trl-harbor")
#: The sandbox's own plumbing (mount points of the helpers bound in): never the agent's, never reported.
PLUMBING = "/run/trl-harbor"
#: Bytes of the agent's outputs copied into a snapshot (beyond that, hard links).
COPY_BUDGET = 1 << 30


def stem(name: str) -> str:
    """A file's name before its first dot (``json.cpython-311.so`` → ``json``; a dist-info's project name)."""
    base = name.split(".", 1)[0] if not name.startswith(".") else name
    return base.split("-", 1)[0] if name.lower().endswith((".dist-info", ".egg-info")) else base


@dataclass(frozen=True)
class SearchPaths:
    """Where the verifier looks code up, and the names the image ships there.

    Attributes:
        path: The directories on the verifier's ``PATH``.
        python: Its Python's import path (``sys.path`` and the user site).
        loader: The dynamic loader's library directories.
        homes: The image's home folders (for the ``~`` entries of :data:`CODE_CONFIG`).
    """

    path: tuple[str, ...] = ()
    python: tuple[str, ...] = ()
    loader: tuple[str, ...] = ()
    homes: tuple[str, ...] = ("/root", "/home/*")


#: The loader's own search directories (glibc's system directories), besides ``ld.so.conf``'s.
_SYSTEM_LIBRARY_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib32", "/usr/lib32")


def search_paths(lower: Path, path: str, python: Sequence[str], homes: Sequence[str] = ()) -> SearchPaths:
    """Where a verifier on the image at ``lower`` looks code up.

    Args:
        lower: The image's root.
        path: The verifier's ``PATH``.
        python: Its Python's import path (``sys.path`` and the user site, probed on the image).
        homes: Home folders besides ``/root`` and ``/home/*`` (e.g. from the image's ``/etc/passwd``).

    Returns:
        The search paths; the loader's directories are the system ones (with the multiarch
        triplet of the image) and those ``/etc/ld.so.conf`` names, includes followed.
    """
    loader = [*_SYSTEM_LIBRARY_DIRS]
    for base in ("/lib", "/usr/lib"):
        loader += [posixpath.join(base, n) for n in _listdir(lower, base) if n.endswith("-linux-gnu")]
    loader += _ld_so_conf(lower, "/etc/ld.so.conf", set())
    extra = tuple(h for h in homes if h not in ("/root",))
    return SearchPaths(
        path=tuple(d for d in path.split(":") if d), python=tuple(python), loader=tuple(dict.fromkeys(loader)),
        homes=("/root", "/home/*", *extra),
    )  # fmt: skip


def _ld_so_conf(lower: Path, conf: str, seen: set[str]) -> list[str]:
    """The directories an ``ld.so.conf`` names (``include`` globs followed, in the image's tree)."""
    if conf in seen:
        return []
    seen.add(conf)
    try:
        lines = (lower / conf.lstrip("/")).read_text(errors="replace").splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line.startswith("include"):
            pattern = line.split(None, 1)[1] if " " in line else ""
            directory, glob = posixpath.split(pattern)
            for name in sorted(_listdir(lower, directory)):
                if fnmatch.fnmatchcase(name, glob):
                    found += _ld_so_conf(lower, posixpath.join(directory, name), seen)
        elif line.startswith("/"):
            found.append(posixpath.normpath(line))
    return found


@dataclass
class _Names:
    """The names the image ships in each search path (what an addition must not shadow)."""

    commands: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)
    libraries: set[str] = field(default_factory=set)
    startup: set[str] = field(default_factory=set)


@dataclass
class Snapshot:
    """A snapshot made by :func:`snapshot`.

    Attributes:
        concealed: The agent's changes the verifier does not see, with why (``"path (reason)"``).
        sockets: Unix sockets of the agent's (bound into the verifier's view from the agent's root).
        copied: Bytes copied (the rest are links).
    """

    concealed: list[str] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)
    copied: int = 0


class _Rule:
    """The rule of the module docstring, for one image and one verifier working directory."""

    def __init__(self, lower: Path, search: SearchPaths, workdir: str, allowed: tuple[str, ...]) -> None:
        self.lower = os.fspath(lower)
        self.workdir = posixpath.normpath(workdir or "/")
        self.allowed = list(allowed)
        self.path_dirs = [posixpath.normpath(d) for d in search.path if d.startswith("/")]
        # Every home's user site is an import directory of a verifier running as that user.
        homes = ["/home/" + name for name in _listdir(lower, "/home")]
        user_sites = [
            d.replace("/root/", home + "/", 1) for d in search.python if d.startswith("/root/") for home in homes
        ]
        self.python_dirs = _sorted_dirs((*search.python, *user_sites, *self.path_dirs))
        # The loader's own directories always (the ELF interpreter is /lib64's), with the image's.
        self.loader_dirs = _sorted_dirs((*search.loader, *_SYSTEM_LIBRARY_DIRS))
        self.lookup_dirs = {*self.path_dirs, *self.python_dirs, *self.loader_dirs, *NAMED_DIRS}
        self.config = [
            posixpath.join(home, item[2:]) if item.startswith("~/") else item
            for item in CODE_CONFIG
            for home in (search.homes if item.startswith("~/") else ("",))
        ]
        # One regular expression for every glob (each path is judged against them all).
        self._config_re = re.compile(
            "|".join(f"(?:{fnmatch.translate(g)})|(?:{fnmatch.translate(g + '/*')})" for g in self.config)
        )
        self._allowed_re = re.compile(
            "|".join(f"(?:{fnmatch.translate(g)})|(?:{fnmatch.translate(g.rstrip('/') + '/*')})" for g in self.allowed)
            or "(?!)"
        )
        self._lookup_ancestors: set[str] = set()
        for place in (*self.lookup_dirs, *(g.split("*", 1)[0].rsplit("/", 1)[0] for g in self.config)):
            while place and place != "/" and place not in self._lookup_ancestors:
                self._lookup_ancestors.add(place)
                place = posixpath.dirname(place)
        ancestors, current = {"/"}, self.workdir
        while current != "/":
            current = posixpath.dirname(current)
            ancestors.add(current)
        self.ancestors = ancestors
        self.names = self._shipped_names()

    def _shipped_names(self) -> _Names:
        names = _Names()
        for directory in (*self.path_dirs, *NAMED_DIRS):
            names.commands |= set(_listdir(self.lower, directory))
        for directory in self.python_dirs:
            names.modules |= {stem(n) for n in _listdir(self.lower, directory)}
            names.startup |= _startup_imports(self.lower, directory)
        for directory in self.loader_dirs:
            names.libraries |= {stem(n) for n in _listdir(self.lower, directory) if ".so" in n}
        return names

    # -- where a path is -------------------------------------------------------------

    def agents(self, path: str) -> bool:
        """Whether ``path`` is the agent's whatever it is: an allowed change, or its work in the working
        directory (but for the places code is looked up there, e.g. a virtual environment first on PATH)."""
        if self._allowed_re.match(path):
            return True
        in_workdir = self.workdir != "/" and (path == self.workdir or path.startswith(self.workdir + "/"))
        return in_workdir and not self.code_place(path) and not self.holds_lookups(path)

    def verifier_only(self, path: str) -> bool:
        """Whether ``path`` belongs to the verifier alone (its tests, its outputs, the solution)."""
        return any(path == p or path.startswith(p + "/") for p in VERIFIER_ONLY)

    def leads_to_verifier_only(self, path: str) -> bool:
        """Whether ``path`` is an ancestor of the verifier's own paths (``/logs`` of ``/logs/verifier``)."""
        return any(p.startswith(path.rstrip("/") + "/") for p in VERIFIER_ONLY)

    def in_config(self, path: str) -> bool:
        """Whether ``path`` is (under) code configuration (:data:`CODE_CONFIG`)."""
        return self._config_re.match(path) is not None

    def code_place(self, path: str) -> bool:
        """Whether ``path`` is where the verifier looks code up (any change there is judged by the rule)."""
        return (
            self.in_config(path)
            or posixpath.dirname(path) in self.path_dirs
            or posixpath.dirname(path) in NAMED_DIRS
            or _innermost(path, self.python_dirs) is not None
            or _innermost(path, self.loader_dirs) is not None
        )

    def holds_lookups(self, path: str) -> bool:
        """Whether ``path`` is a folder the verifier looks code up in, or one of its ancestors."""
        return path in self._lookup_ancestors

    def code_below(self, path: str) -> bool:
        """Whether code is looked up at or below the folder ``path`` (then it must stay a folder, the image's
        entries there stay)."""
        prefix = path.rstrip("/") + "/"
        return (
            self.code_place(prefix + "x")
            or any(d == path or d.startswith(prefix) for d in self.lookup_dirs)
            or any(g.startswith(prefix) for g in self.config)
        )

    # -- the judgement ---------------------------------------------------------------

    def concealed_change(self, path: str, shipped: bool, host: Path, upper: Path) -> str | None:
        """Why the verifier does not see the agent's change at ``path`` (``None``: it sees it).

        Args:
            path: The sandbox path of an entry of the agent's layer (not an image folder it only
                changed the inside of).
            shipped: Whether the image has an entry at ``path``.
            host: The entry in the agent's layer (a folder's contents are looked at).
            upper: The agent's layer.
        """
        if self.verifier_only(path):
            return "the verifier's own"
        folder = host.is_dir() and not host.is_symlink()
        if not folder and (self.leads_to_verifier_only(path) or self.holds_lookups(path)):
            return "a folder the verifier looks code up in, or its own, replaced"
        if self.agents(path):
            return None
        if shipped:
            return "the image's code" if self.code_place(path) else None
        return self._concealed_addition(path, host, folder, upper)

    def _concealed_addition(self, path: str, host: Path, folder: bool, upper: Path) -> str | None:
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        if self.in_config(path):
            return "code configuration"
        if parent in self.ancestors and (
            _matches(name, RUNNER_CONFIG) or folder and any(n.startswith("__init__.") for n in _names(host))
        ):
            return "picked up from the verifier's working directory or its ancestors"
        if (parent in self.path_dirs or parent in NAMED_DIRS) and name in self.names.commands:
            return "a command the image ships"
        if _matches(name, ("pyvenv.cfg", "*._pth")) and (
            parent in self.path_dirs or any(posixpath.dirname(d) == parent for d in self.path_dirs)
        ):
            return "an interpreter hook"
        home = _innermost(path, self.python_dirs)
        if home is not None:
            return self._python_addition(path, host, folder, home, upper)
        libdir = _innermost(path, self.loader_dirs)
        if libdir is not None and ".so" in name and stem(name) in self.names.libraries:
            return "a library name the image ships"
        return None

    def _python_addition(self, path: str, host: Path, folder: bool, home: str, upper: Path) -> str | None:
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        relative = path[len(home.rstrip("/")) + 1 :]
        top = relative.split("/", 1)[0]
        metadata = name.lower().endswith((".dist-info", ".egg-info", ".egg-link"))
        if name.endswith(".pth"):
            return None if parent == home and _plain_paths_pth(host, (self.lower, upper)) else "an interpreter hook"
        if _matches(name, HOOKS):
            return "an interpreter hook"
        if posixpath.basename(parent) == "__pycache__" and stem(name) in _stems(self.lower, posixpath.dirname(parent)):
            return "bytecode of a module the image ships"
        if "/" in relative and _exists(self.lower, posixpath.join(home, top)):
            return "inside a package the image ships"
        if stem(top) in self.names.modules or stem(top) in self.names.startup:
            return "a module name the image ships, or its start-up code imports"
        if stem(top) in RUNNER_PACKAGES:
            return "the test runner's own package"
        if metadata and (host.is_symlink() or not folder or _declares_runner_plugin(host)):
            return "a test-runner plug-in, or metadata that is a link"
        return None


#: Folders whose entries the image names once: new names are the agent's, the image's stay.
NAMED_DIRS: tuple[str, ...] = ("/etc/alternatives",)


def _sorted_dirs(dirs: Iterable[str]) -> list[str]:
    return sorted({posixpath.normpath(d) for d in dirs if d.startswith("/")}, key=len)


def _names(folder: Path | str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _startup_imports(lower: Path, directory: str) -> set[str]:
    """Modules the image's start-up code (``sitecustomize``, ``usercustomize``, ``.pth``) imports, if present."""
    found: set[str] = set()
    for name in _listdir(lower, directory):
        if not (name.endswith(".pth") or stem(name) in ("sitecustomize", "usercustomize")):
            continue
        try:
            text = Path(f"{lower}{directory}/{name}").read_text(errors="replace")[:65536]
        except OSError:
            continue
        found |= set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_][A-Za-z0-9_]*)", text, re.M))
        found |= set(re.findall(r"[;:]\s*import\s+([A-Za-z_][A-Za-z0-9_]*)", text))
    return found


def _plain_paths_pth(host: Path, trees: tuple[Path, Path]) -> bool:
    """Whether a ``.pth`` only appends folders to the import path (an editable install), none holding a
    test-runner plug-in: it runs nothing, and what it adds comes after every shipped module."""
    try:
        lines = [line.strip() for line in host.read_text(errors="replace").splitlines()]
    except OSError:
        return False
    folders = [line for line in lines if line and not line.startswith("#")]
    if not folders or any(line.startswith(("import ", "import\t")) or not line.startswith("/") for line in folders):
        return False
    for folder in folders:
        for base in trees:
            for name in _names(f"{base}{folder}"):
                if name.lower().endswith((".dist-info", ".egg-info")) and _declares_runner_plugin(
                    Path(f"{base}{folder}/{name}")
                ):
                    return False
    return True


def _globs(globs: Sequence[str]) -> re.Pattern[str]:
    """One expression matching a path that one of ``globs`` matches, or that is under one."""
    parts = [f"(?:{fnmatch.translate(g)})|(?:{fnmatch.translate(g.rstrip('/') + '/*')})" for g in globs]
    return re.compile("|".join(parts) or "(?!)")


@functools.lru_cache(maxsize=256)
def _rule(lower: Path, search: SearchPaths, workdir: str, allowed: tuple[str, ...]) -> _Rule:
    """The rule for an image (which never changes), made once: listing what it ships is the costly part."""
    return _Rule(lower, search, workdir, allowed)


def _declares_runner_plugin(metadata: Path) -> bool:
    """Whether a distribution's metadata registers a pytest plug-in (loaded by every ``pytest`` run)."""
    try:
        text = (metadata / "entry_points.txt").read_text(errors="replace")
    except OSError:
        return False
    return "[pytest11]" in text.replace(" ", "")


def _matches(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def _innermost(path: str, directories: Sequence[str]) -> str | None:
    found = None
    for directory in directories:  # sorted by length: the last match is the innermost
        if path.startswith(directory.rstrip("/") + "/"):
            found = directory
    return found


def _listdir(root: Path | str, directory: str) -> list[str]:
    try:
        return os.listdir(f"{root}{directory}" if directory.startswith("/") else f"{root}/{directory}")
    except OSError:
        return []


def _stems(root: Path, directory: str) -> set[str]:
    return {stem(n) for n in _listdir(root, directory)}


def _exists(root: Path | str, path: str) -> bool:
    try:
        os.lstat(f"{root}{path}")
    except OSError:
        return False
    return True


def _layer_kind(info: os.stat_result, host: Path | str) -> str:
    if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
        return "whiteout"
    if stat.S_ISDIR(info.st_mode):
        try:
            opaque = os.getxattr(host, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
        except OSError:
            opaque = False
        return "opaque" if opaque else "dir"
    return "socket" if stat.S_ISSOCK(info.st_mode) else "other"


def snapshot(
    upper: Path,
    lower: Path,
    target: Path,
    search: SearchPaths,
    workdir: str,
    allowed: Sequence[str] = (),
    copy_budget: int = COPY_BUDGET,
) -> Snapshot:
    """Fill ``target`` (an empty folder on ``upper``'s file system) with the verifier's view of ``upper``.

    ``target`` then serves as the middle layer of the verifier's overlay, over ``lower``.

    Args:
        upper: The agent's overlay upper layer.
        lower: The image's root.
        target: Where the snapshot goes.
        search: Where the verifier looks code up.
        workdir: The verifier's working directory (the task's).
        allowed: Globs of paths that are the agent's whatever they are (``allowed_changes``).
        copy_budget: Bytes of regular files copied at most; the rest are hard links.

    Returns:
        What was concealed, the agent's unix sockets, how much was copied.
    """
    rule = _rule(lower, search, posixpath.normpath(workdir or "/"), tuple(allowed))
    result = Snapshot()
    budget = [copy_budget]
    _walk(os.fspath(upper), os.fspath(target), "", rule, result, budget)
    return result


def _walk(upper: str, target: str, relative: str, rule: _Rule, result: Snapshot, budget: list[int]) -> None:
    """Lay the agent's entries under ``relative`` into ``target``, judged by ``rule`` (paths as text: fast)."""
    try:
        names = sorted(os.listdir(f"{upper}/{relative}" if relative else upper))
    except OSError:
        return
    for name in names:
        entry = f"{relative}/{name}" if relative else name
        path, host = "/" + entry, f"{upper}/{entry}"
        if path == PLUMBING:
            continue
        try:
            info = os.lstat(host)
        except OSError:
            continue
        kind = _layer_kind(info, host)
        try:
            shipped_info: os.stat_result | None = os.lstat(rule.lower + path)
        except OSError:
            shipped_info = None
        shipped = shipped_info is not None
        if kind in ("dir", "opaque") and shipped_info is not None and stat.S_ISDIR(shipped_info.st_mode):
            if rule.verifier_only(path):
                result.concealed.append(f"{path} (the verifier's own)")
                continue
            # An image folder the agent changed inside; replaced whole, it hides the image's entries below
            # for the verifier too, unless code is looked up there (then the image's code stays).
            keep_opaque = kind == "opaque" and (rule.agents(path) or not rule.code_below(path))
            _mkdir_like(f"{target}/{entry}", info, opaque=keep_opaque)
            if kind == "opaque" and not keep_opaque:
                result.concealed.append(f"{path} (replaced whole; the image's code below it is kept)")
                _whiteout_deleted(rule, target, entry, upper)
            _walk(upper, target, entry, rule, result, budget)
            continue
        why = rule.concealed_change(path, shipped, Path(host), Path(upper))
        if why is not None:
            if kind != "whiteout" or shipped:
                result.concealed.append(f"{path} ({'deleted; ' if kind == 'whiteout' else ''}{why})")
            continue
        if kind in ("dir", "opaque"):  # a folder of the agent's own
            _mkdir_like(f"{target}/{entry}", info, opaque=kind == "opaque")
            _walk(upper, target, entry, rule, result, budget)
            continue
        if kind == "socket":
            result.sockets.append(path)
        # Copied (frozen as judged), not linked: the agent's outputs, and what the rule read the content of.
        frozen = not rule.code_place(path) or _judged_by_content(path)
        _place(host, f"{target}/{entry}", info, frozen, result, budget)


def _whiteout_deleted(rule: _Rule, target: str, entry: str, upper: str) -> None:
    """In a folder the agent replaced whole where code lives: keep its deletion of the image's other files."""
    for name in _listdir(rule.lower, "/" + entry):
        path = f"/{entry}/{name}"
        if os.path.lexists(f"{upper}/{entry}/{name}") or rule.code_place(path) or rule.code_below(path):
            continue
        with contextlib.suppress(OSError):
            os.mknod(f"{target}/{entry}/{name}", stat.S_IFCHR | 0o000, 0)


def _mkdir_like(path: str, info: os.stat_result, opaque: bool) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    with contextlib.suppress(OSError):
        os.chown(path, info.st_uid, info.st_gid)
    os.chmod(path, stat.S_IMODE(info.st_mode))
    if opaque:
        os.setxattr(path, "trusted.overlay.opaque", b"y", follow_symlinks=False)


def _judged_by_content(path: str) -> bool:
    """Whether the rule read this file's content (a distribution's metadata, a ``.pth``)."""
    parent = posixpath.basename(posixpath.dirname(path)).lower()
    return path.endswith(".pth") or parent.endswith((".dist-info", ".egg-info"))


def _place(source: str, dest: str, info: os.stat_result, frozen: bool, result: Snapshot, budget: list[int]) -> None:
    """Copy a regular file that is frozen at grading (within the budget), else link it."""
    regular = stat.S_ISREG(info.st_mode)
    if regular and frozen and info.st_blocks * 512 <= budget[0]:
        try:
            copied = _sparse_copy(source, dest, info)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)  # the sandbox's bound is reached: link it, as code is
        else:
            budget[0] -= copied
            result.copied += copied
            return
    try:
        os.link(source, dest, follow_symlinks=False)
    except OSError as error:
        if error.errno != errno.EEXIST:
            raise


def _sparse_copy(source: str, dest: str, info: os.stat_result) -> int:
    """Copy a file's data (not its holes), owner and mode; return the bytes copied."""
    copied = 0
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.ExitStack() as stack:
        fd_in = os.open(source, flags)
        stack.callback(os.close, fd_in)
        fd_out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        stack.callback(os.close, fd_out)
        offset = 0
        while offset < info.st_size:
            try:
                start = os.lseek(fd_in, offset, os.SEEK_DATA)
            except OSError as error:
                if error.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(fd_in, start, os.SEEK_HOLE)
            while start < end:
                sent = os.copy_file_range(fd_in, fd_out, end - start, start, start)
                if sent <= 0:
                    break
                start += sent
                copied += sent
            offset = end
        os.ftruncate(fd_out, info.st_size)
        with contextlib.suppress(OSError):
            os.fchown(fd_out, info.st_uid, info.st_gid)
        os.fchmod(fd_out, stat.S_IMODE(info.st_mode))
    return copied
