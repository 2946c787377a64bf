"""What the verifier sees of a sandbox on a task image: the agent's world, the image's code.

The agent's sandbox is an overlay: the image's root read-only underneath, the agent's own upper
layer on top, where every change it made is a plain entry, a whiteout (a deletion) or an opaque
folder (a folder replaced whole). The verifier's root is made of two kinds of places:

* **Live places** — the task's working directory and every folder that holds no code (``/app``,
  ``/var``, ``/srv``, an output folder the agent made, ...) — are the agent's own folders, mounted
  as they are (:func:`live_paths`): the verifier reads and writes the agent's files themselves, with
  their metadata, as they change, as under Harbor's shared trial.
* **Code places** — where the verifier looks code up, and the folders above them — are an overlay
  over the same image whose middle layer is a *snapshot* of the agent's changes there, taken when
  grading begins and filtered by one rule, :func:`snapshot`:

**The verifier runs the image's code.** Where the verifier looks code up — the directories on its
``PATH``, its Python's import path, the loader's library directories, and the start-up files of the
shells, the loader, name resolution, Python, pip, uv, git and OpenSSL (:data:`CODE_CONFIG`) — an entry
the image shipped reads as shipped if the agent edited or replaced it (a deletion is seen: it only
removes code); and an entry the agent *added* there is not seen when it would run instead of, or
beside, shipped code: a name a shipped entry of the same search path has (before its first dot;
commands by their whole name), a name the image's own code imports (:mod:`._imports`: the standard
library's Windows modules, a package's optional dependencies), a file inside a package the image
shipped, a hook that interpreters load unasked (:data:`HOOKS`, a ``pytest11`` entry point), the test
runner's own packages (:data:`RUNNER_PACKAGES`), or a Python module or test-runner configuration in
``/`` or another ancestor of the verifier's working directory; a link that leads into the verifier's
own places. ``/tests``, ``/solution`` and ``/logs/verifier`` are the verifier's alone. Everything else
the agent did there — what it installed under new names, the configuration it was asked to change —
the verifier sees. A path that matches the task's ``allowed_changes`` is always the agent's. A
command the agent added to a ``PATH`` folder gives way to one of its name the verifier installs in
another ``PATH`` folder while it runs (:attr:`Snapshot.commands`: the view's supervisor removes it).

The snapshot holds the agent's *names* as they were when grading began; its files are hard links
to the agent's (their content and metadata are the agent's, live), except what the rule reads to
judge (a ``.pth``, a distribution's metadata), which is copied: what was judged is what is used.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import fnmatch
import functools
import logging
import os
import posixpath
import re
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harbor_local_sandbox._derive import derive, realised
from harbor_local_sandbox._imports import guard_names
from harbor_local_sandbox._links import LinkPolicy
from harbor_local_sandbox._userns import overlay_xattr
from harbor_local_sandbox._viewfs import IN_ROOT, open_beneath
from harbor_local_sandbox.code_places import (
    CODE_CONFIG,
    HOOKS,
    IMPLICIT_SOCKETS,
    KERNEL_PLACES,
    PLUMBING,
    RUNNER_COMMANDS,
    RUNNER_CONFIG,
    RUNNER_PACKAGES,
    VERIFIER_ONLY,
    allowed_changes,
)
from harbor_local_sandbox.errors import UnjudgeableViewError

__all__ = [
    "CODE_CONFIG", "HOOKS", "RUNNER_PACKAGES", "SearchPaths", "Snapshot", "commands_record", "guarded_names",
    "live_paths", "search_paths", "snapshot", "stem",
]  # fmt: skip

logger = logging.getLogger(__name__)

_HOOKS_RE = re.compile("|".join(f"(?:{fnmatch.translate(glob)})" for glob in HOOKS))
_RUNNER_STARTS = tuple(RUNNER_PACKAGES)  # a name whose stem is one of them begins with it
#: Bytes of the files the rule reads (judged by content) copied into a snapshot at most; beyond, they are not seen.
COPY_BUDGET = 64 << 20
#: Folders deeper than this below ``/``, in code places, are not judged (not seen).
MAX_DEPTH = 96


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
        modules: Other interpreters' module paths (perl's ``@INC``, ruby's ``$LOAD_PATH``, node's global
            folders), judged as Python's.
        homes: The image's home folders (for the ``~`` entries of :data:`CODE_CONFIG`).
        config: Code configuration derived from the image (:mod:`._derive`), judged as :data:`CODE_CONFIG`:
            what CPython's path computation consults, the ``RUNPATH`` folders the image lacks, the
            loaders its binaries name, its package folders' archives.
    """

    path: tuple[str, ...] = ()
    python: tuple[str, ...] = ()
    loader: tuple[str, ...] = ()
    homes: tuple[str, ...] = ("/root", "/home/*")
    modules: tuple[str, ...] = ()
    config: tuple[str, ...] = ()


#: The loader's own search directories (glibc's system directories), besides ``ld.so.conf``'s.
_SYSTEM_LIBRARY_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib32", "/usr/lib32")


def search_paths(
    lower: Path, path: str, python: Sequence[str], homes: Sequence[str] = (), modules: Sequence[str] = ()
) -> SearchPaths:
    """Where a verifier on the image at ``lower`` looks code up.

    Args:
        lower: The image's root.
        path: The verifier's ``PATH``.
        python: Its Python's import path (``sys.path`` and the user site, probed on the image).
        homes: Home folders besides ``/root`` and ``/home/*`` (e.g. from the image's ``/etc/passwd``).
        modules: Other interpreters' module paths (probed on the image).

    Returns:
        The search paths; the loader's directories are the system ones (with the multiarch
        triplet of the image), those ``/etc/ld.so.conf`` names, includes followed, and the
        ``RUNPATH`` folders of the image's binaries that it has. What the image's own files say of
        where its loader and interpreters look (:func:`._derive.derive`, read once per image: the
        result is kept with the image's probe) joins them: the import folders its interpreters'
        ``site`` would add (to ``modules``; their user sites to ``python``), and as ``config``
        their path computation's landmarks, the ``RUNPATH`` folders the image lacks (searched before
        the loader cache: all the agent adds there is concealed), the loaders its binaries name,
        and the archives of its package folders.
    """
    loader = [*_SYSTEM_LIBRARY_DIRS]
    for base in ("/lib", "/usr/lib"):
        loader += [posixpath.join(base, n) for n in _listdir(lower, base) if n.endswith("-linux-gnu")]
    loader += _ld_so_conf(lower, "/etc/ld.so.conf", set())
    path_dirs = tuple(d for d in path.split(":") if d)
    derived = derive(lower, path_dirs, loader, [p for p in python if p.startswith("/")])
    extra = tuple(h for h in homes if h not in ("/root",))
    probed_modules = tuple(m for m in modules if m.startswith("/"))

    def both(folders: Iterable[str]) -> tuple[str, ...]:
        # Each folder as named and where it is in the image (perl's @INC names /usr/share/perl/5.36, a
        # link to 5.36.0: the folder whose entries are the modules is the latter).
        return tuple(dict.fromkeys(f for folder in folders if folder.startswith("/") for f in realised(lower, folder)))

    return SearchPaths(
        path=both(path_dirs), python=both((*python, *derived.user_sites)),
        loader=both((*loader, *derived.loader)), homes=("/root", "/home/*", *extra),
        modules=both((*probed_modules, *derived.modules)), config=derived.config,
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
    python: set[str] = field(default_factory=set)  # of Python's own import path
    libraries: set[str] = field(default_factory=set)
    startup: set[str] = field(default_factory=set)
    guarded: frozenset[str] = frozenset()  # names the image's Python code imports (``_imports``)


@dataclass
class Snapshot:
    """A snapshot made by :func:`snapshot`: what it reports is bounded, whatever the agent's layer holds.

    Attributes:
        concealed: The agent's changes the verifier does not see, with why (``"path (reason)"``): the
            first :data:`CONCEALED_SHOWN`, each at most :data:`CONCEALED_TEXT_CAP` characters (a long
            path is cut in its middle; characters that do not print, and bytes that are not UTF-8,
            escaped), then, when there were more, one line that says how many more.
        concealed_count: How many changes were concealed in all.
        unjudged: How many of them could not be judged (an error on the agent's content: not seen).
        copied: Bytes copied (the files the rule read; the rest are hard links).
        entries: Entries of the agent's layer laid or judged (its code places only).
        libraries_added: Whether the agent added a library to a folder of the loader's (the view's
            loader cache is then remade from the image's configuration: the agent's is not seen).
        live_packages: The agent's new top-level packages in Python's import folders, mounted live
            on their (empty) folders of the snapshot (:meth:`_Rule.live_package`).
        commands: The commands the agent added to the ``PATH`` folders under new names, as laid (seen):
            each gives way to a command of its name the verifier installs in another ``PATH`` folder
            (the view's supervisor removes it from the view then; see :func:`commands_record`).
    """

    concealed: list[str] = field(default_factory=list)
    concealed_count: int = 0
    unjudged: int = 0
    copied: int = 0
    entries: int = 0
    libraries_added: bool = False
    commands: list[str] = field(default_factory=list)
    live_packages: list[str] = field(default_factory=list)


class _Rule:
    """The rule of the module docstring, for one image and one verifier working directory."""

    def __init__(
        self, lower: Path, search: SearchPaths, workdir: str, allowed: tuple[str, ...],
        hazards: tuple[tuple[str, str], ...] = (),
    ) -> None:  # fmt: skip
        self.lower = os.fspath(lower)
        self.links = LinkPolicy(hazards=dict(hazards))
        self.workdir = posixpath.normpath(workdir or "/")
        self.allowed = list(allowed)
        self.path_dirs = [posixpath.normpath(d) for d in search.path if d.startswith("/")]
        # Every home's user site is an import directory of a verifier running as that user.
        homes = ["/home/" + name for name in _listdir(lower, "/home")]
        user_sites = [
            d.replace("/root/", home + "/", 1) for d in search.python if d.startswith("/root/") for home in homes
        ]
        self.python_only = _sorted_dirs((*search.python, *user_sites))
        self._python_only = frozenset(self.python_only)
        # Import folders of every interpreter (a script's own folder is on its path: PATH's too).
        self.python_dirs = _sorted_dirs((*self.python_only, *search.modules, *self.path_dirs))
        # The loader's own directories always (the ELF interpreter is /lib64's), with the image's.
        self.loader_dirs = _sorted_dirs((*search.loader, *_SYSTEM_LIBRARY_DIRS))
        self.lookup_dirs = {*self.path_dirs, *self.python_dirs, *self.loader_dirs, *NAMED_DIRS}
        self.config = [
            posixpath.join(home, item[2:]) if item.startswith("~/") else item
            for item in (*CODE_CONFIG, *search.config)
            for home in (search.homes if item.startswith("~/") else ("",))
        ]
        # One regular expression for every glob (each path is judged against them all).
        self._config_re = _globs_and_below(self.config)
        self._config_in: dict[str, re.Pattern[str] | None] = {}  # per folder: the globs its entries may match
        self._allows = allowed_changes(self.allowed)  # the table's reading of the globs (never across /)
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
        # Where ``python -m`` may run from (its working directory is first on the import path).
        self.run_dirs = {d for d in (self.workdir, "/tmp") if d != "/"}
        self.names = self._shipped_names()
        self._code_below: dict[str, bool] = {}
        self._live_place: dict[str, str | None] = {}
        self._image_live: frozenset[str] | None = None

    def _shipped_names(self) -> _Names:
        names = _Names()
        for directory in (*self.path_dirs, *NAMED_DIRS):
            names.commands |= set(_listdir(self.lower, directory))
        for directory in self.python_dirs:
            names.modules |= {stem(n) for n in _listdir(self.lower, directory)}
            names.startup |= _startup_imports(self.lower, directory)
        for directory in self.python_only:
            names.python |= {stem(n) for n in _listdir(self.lower, directory)}
        for directory in self.loader_dirs:
            names.libraries |= {stem(n) for n in _listdir(self.lower, directory) if ".so" in n}
        names.guarded = _guarded(self.lower, tuple(self.python_only))
        return names

    # -- where a path is -------------------------------------------------------------

    def agents(self, path: str) -> bool:
        """Whether ``path`` is the agent's whatever it is: an allowed change, or its work in the working
        directory (but for the places code is looked up there, e.g. a virtual environment first on PATH)."""
        if self._allows(path):
            return True
        in_workdir = self.workdir != "/" and (path == self.workdir or path.startswith(self.workdir + "/"))
        return in_workdir and not self.code_place(path) and not self.holds_lookups(path)

    def is_allowed(self, path: str) -> bool:
        """Whether ``path`` matches the task's ``allowed_changes``."""
        return self._allows(path)

    def holds_nothing_named(self, folder: str) -> bool:
        """Whether below the folder ``folder`` there is no place the rule names (a lookup folder, code
        configuration's, the verifier's own, the working directory): entries there are judged by their
        own names only (:meth:`own_entry`). Never a ``__pycache__``: the bytecode there is loaded for
        the modules beside it, so each entry is judged against those."""
        return (
            posixpath.basename(folder) != "__pycache__"
            and folder not in self.lookup_dirs
            and folder not in self._lookup_ancestors
            and folder not in self.ancestors
            and folder != self.workdir
            and not self.leads_to_verifier_only(folder)
            and not any(p.startswith(folder + "/") for p in IMPLICIT_SOCKETS)
        )

    def live_package(self, path: str) -> bool:
        """Whether the agent's new folder ``path``, seen, is a package of its own at the top of Python's
        import path that the view mounts live rather than laying it entry by entry.

        Inside such a folder the rule decides nothing that matters to the verifier: no place it names is
        below it; no configuration glob rooted in a folder can match there (``*/pip.conf`` matches
        anywhere, but pip reads one only at the root of the venv it runs in, and a venv inside the
        agent's package is the agent's work); its name is not one the image ships or imports (else it
        was concealed); what Python finds in it is found as the package's own modules — never a hook
        (``site`` reads ``.pth`` files in site folders only), never a top-level name (the agent's
        ``.pth`` files make every package walked instead, and the import guard passes over a guarded
        name the agent placed, by the device of the agent's tree); links made there go through the
        keel. So the package is the agent's, live, as under Harbor, and an install of thousands of
        files costs the view one mount, not a link per file.
        """
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        return (
            parent in self._python_only
            and name.isidentifier()
            and name != "__pycache__"
            and parent not in self.ancestors
            and parent not in self.run_dirs
            and self.holds_nothing_named(path)
            and not any(start and _may_begin(path + "/", start) for start in map(_literal_start, self.config))
        )

    def own_entry(self, folder: str, name: str) -> str | None:
        """Why the entry ``name`` of a folder that holds nothing named is not seen (``None``: it is)."""
        return self.own_entries(folder)(name)

    def own_entries(self, folder: str) -> Callable[[str], str | None]:
        """:meth:`own_entry` for the entries of one folder (what the folder decides, decided once)."""
        config = self._config_of_entries(folder)
        prefix = f"{folder}/"

        def judge(name: str) -> str | None:
            if _HOOKS_RE.match(name):
                return "an interpreter hook"
            if name.startswith(_RUNNER_STARTS) and stem(name) in RUNNER_PACKAGES:
                return "the test runner's own package"
            if config is not None and config.match(prefix + name):
                return "code configuration"
            return None

        return judge

    def _config_of_entries(self, folder: str) -> re.Pattern[str] | None:
        """The configuration globs an entry of ``folder`` may match: those whose literal beginning (up
        to the first wildcard) such a path can start with — a path cannot match a glob whose
        beginning it lacks — as one expression; ``None``: none. The full expression for a folder that
        is configuration itself (so is all below it). Remembered per folder."""
        if folder in self._config_in:
            return self._config_in[folder]
        if len(self._config_in) > _REMEMBERED_FOLDERS:
            self._config_in.clear()
        if self.in_config(folder):
            found: re.Pattern[str] | None = self._config_re
        else:
            below = folder.rstrip("/") + "/"
            globs = [g for g in self.config if _may_begin(below, _literal_start(g))]
            found = _globs_and_below(globs) if globs else None
        self._config_in[folder] = found
        return found

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
        entries there stay). Remembered per folder: every view of the image asks it of the same folders."""
        known = self._code_below.get(path)
        if known is None:
            if len(self._code_below) > _REMEMBERED_FOLDERS:
                self._code_below.clear()
            prefix = path.rstrip("/") + "/"
            known = self._code_below[path] = (
                self.code_place(prefix + "x")
                or any(d == path or d.startswith(prefix) for d in self.lookup_dirs)
                or any(g.startswith(prefix) for g in self.config)
            )
        return known

    def image_live(self) -> frozenset[str]:
        """The image's own live folders (:func:`live_paths`), found once: the image never changes."""
        if self._image_live is None:
            fd = os.open(self.lower, _DIR_FLAGS)
            try:
                self._image_live = frozenset(_live_below(self, fd))
            finally:
                os.close(fd)
        return self._image_live

    def live_place(self, path: str) -> str | None:
        """What :func:`live_paths` does with a folder ``path`` of the agent's: ``"live"`` (no code place at
        or below it: the agent's own folder, mounted as it is), ``"split"`` (code is looked up somewhere
        below it, or it is above the verifier's own places: its folders are judged one by one, its own
        entries are the snapshot's), ``None`` (not seen live: a code place, the verifier's own, the
        kernel's, ``/tmp``). So every folder that holds no code is live, however deep, as in Harbor's
        shared trial. Remembered per path (every view asks it of the same folders)."""
        known = self._live_place.get(path, False)
        if known is not False:
            return known
        if len(self._live_place) > _REMEMBERED_FOLDERS:
            self._live_place.clear()
        place: str | None = None
        if not (
            self.verifier_only(path) or path in KERNEL_PLACES or path == "/tmp" or path == PLUMBING
        ) and not self.code_place(path):
            holds_code = self.code_below(path) or self.leads_to_verifier_only(path)
            holds_code = holds_code or any(s.startswith(path + "/") for s in IMPLICIT_SOCKETS)
            place = "split" if holds_code or path in self.ancestors else "live"
        self._live_place[path] = place
        return place

    # -- the judgement ---------------------------------------------------------------

    def concealed_change(self, path: str, shipped: bool, folder: bool, link: bool) -> str | None:
        """Why the verifier does not see the agent's change at ``path`` by its name (``None``: it may).

        Args:
            path: The sandbox path of an entry of the agent's layer (not an image folder it only
                changed the inside of).
            shipped: Whether the image has an entry at ``path``.
            folder: Whether the agent's entry is a folder.
            link: Whether it is a symbolic link.
        """
        if self.verifier_only(path):
            return "the verifier's own"
        if not folder and (self.leads_to_verifier_only(path) or self.holds_lookups(path)):
            return "a folder the verifier looks code up in, or its own, replaced"
        if self._allows(path):
            return None
        if not shipped and not folder and (link or _module_file(path)) and (why := self._shadows_at_any_place(path)):
            return why
        if self.agents(path):
            return None
        if shipped:
            return "the image's code" if self.code_place(path) else None
        return self._concealed_addition(path, folder, link)

    def _shadows_at_any_place(self, path: str) -> str | None:
        """A module that would shadow the test runner's own anywhere, or an image module (or one the image's
        code imports) from a folder the verifier may run Python in (``python -m`` puts its working
        directory first on the import path)."""
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        if stem(name) in RUNNER_PACKAGES:
            return "the test runner's own package"
        if parent in self.run_dirs and (stem(name) in self.names.python or stem(name) in self.names.guarded):
            return "a module the image's Python ships or imports, from a folder the verifier may run in"
        return None

    def concealed_link(self, path: str, target: str) -> str | None:
        """Why a link the agent made at ``path`` is not seen: it can lead into the verifier's own places,
        or to a folder above them, wherever it is moved and whatever other links it passes through
        (:mod:`._links`; its place is known when it is an entry of such a folder, which the view freezes)."""
        return self.links.judge(target, posixpath.dirname(path))

    def concealed_content(self, path: str, laid: str) -> str | None:
        """Why the verifier does not see an entry the rule judges by what it holds, once laid at ``laid``
        in the snapshot (a copy: the agent can no longer change it)."""
        if self._allows(path):
            return None
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        if os.path.isdir(laid):
            package = any(n.startswith("__init__.") for n in _names(laid))
            if package and (why := self._shadows_at_any_place(path)):
                return why
            if self.agents(path):
                return None
            if package and parent in self.ancestors:
                return "picked up from the verifier's working directory or its ancestors"
            home = _innermost(path, self.python_dirs)
            if (
                home is not None
                and name.lower().endswith((".dist-info", ".egg-info"))
                and _declares_runner_plugin(Path(laid))
            ):
                return "a test-runner plug-in"
        return None

    def reads(self, path: str) -> bool:
        """Whether the rule judges the file at ``path`` by its content (it is then copied, never linked)."""
        return _judged_by_content(path) and _innermost(path, self.python_dirs) is not None and not self.agents(path)

    def pth_to_judge(self, path: str) -> bool:
        """Whether ``path`` is a ``.pth`` the rule lets through if what it holds is harmless (:meth:`judge_pth`)."""
        return path.endswith(".pth") and self.reads(path) and not self._allows(path)

    def judge_pth(self, path: str, laid: str, snapshot_root: str) -> tuple[str | None, str | None]:
        """Judge a ``.pth`` the agent added to an import folder, laid at ``laid``, on the whole snapshot.

        A ``.pth`` that only appends folders to the import path (an editable install) runs nothing and
        comes after every shipped module: it is seen, unless a folder it names holds start-up code or a
        test-runner plug-in. Setuptools' editable installs of flat projects write instead a ``.pth``
        that imports a generated finder; the finder is read, not run, and the verifier's ``.pth`` names
        the folders it maps to.

        What cannot be judged is concealed: a ``.pth`` that is not a regular file of at most
        :data:`JUDGED_FILE_CAP` bytes, that holds a NUL byte, more than :data:`PTH_MAX_LINES` lines or
        a line longer than :data:`PTH_MAX_LINE` characters, a folder whose path cannot be looked up.

        Returns:
            Why it is concealed (or ``None``), and the text to lay instead of it (or ``None``).
        """
        data = _read_regular(laid, JUDGED_FILE_CAP)
        if data is None:
            return "an interpreter hook", None
        text = data.decode("utf-8", "replace")
        if "\0" in text:
            return "an interpreter hook (it holds a NUL byte)", None
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if len(lines) > PTH_MAX_LINES or any(len(line) > PTH_MAX_LINE for line in lines):
            return "an interpreter hook (too long to judge)", None
        replacement = None
        finder = _editable_finder(lines)
        if finder is not None:
            folders = _finder_folders(f"{snapshot_root}{posixpath.dirname(path)}/{finder}.py")
            if folders is None:
                return "an interpreter hook", None
            lines, replacement = folders, "".join(f"{folder}\n" for folder in folders)
        if not lines or any(line.startswith(("import ", "import\t")) or not line.startswith("/") for line in lines):
            return "an interpreter hook", None
        for folder in lines:
            where = _real_folder((snapshot_root, self.lower), posixpath.normpath(folder))
            if where is False:
                return "an interpreter hook (it names a file or a link, not a folder)", None
            for name in _names(where) if where else ():
                if _matches(name, HOOKS) or stem(name) in RUNNER_PACKAGES:
                    return "an interpreter hook (a folder it names holds start-up code)", None
                if name.lower().endswith((".dist-info", ".egg-info")) and _declares_runner_plugin(
                    Path(f"{where}/{name}")
                ):
                    return "an interpreter hook (a folder it names holds a test-runner plug-in)", None
        return None, replacement

    def _concealed_addition(self, path: str, folder: bool, link: bool) -> str | None:
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        if self.in_config(path):
            return "code configuration"
        if parent in self.ancestors and not folder and _matches(name, RUNNER_CONFIG):
            return "picked up from the verifier's working directory or its ancestors"
        if parent in self.ancestors and folder and name in ("__pycache__", "node_modules"):
            return "picked up from the verifier's working directory or its ancestors"
        if (parent in self.path_dirs or parent in NAMED_DIRS) and name in self.names.commands:
            return "a command the image ships"
        if parent in self.path_dirs and name in RUNNER_COMMANDS:
            return "the test runner's own command"
        if _matches(name, ("pyvenv.cfg", "*._pth")) and (
            parent in self.path_dirs or any(posixpath.dirname(d) == parent for d in self.path_dirs)
        ):
            return "an interpreter hook"
        home = _innermost(path, self.python_dirs)
        if home is not None:
            return self._python_addition(path, folder, link, home)
        libdir = _innermost(path, self.loader_dirs)
        if libdir is not None and ".so" in name and stem(name) in self.names.libraries:
            return "a library name the image ships"
        return None

    def _python_addition(self, path: str, folder: bool, link: bool, home: str) -> str | None:
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        relative = path[len(home.rstrip("/")) + 1 :]
        top = relative.split("/", 1)[0]
        metadata = name.lower().endswith((".dist-info", ".egg-info", ".egg-link"))
        if name.endswith(".pth"):
            return None if parent == home and not folder and not link else "an interpreter hook"
        if _matches(name, HOOKS):
            return "an interpreter hook"
        if posixpath.basename(parent) == "__pycache__" and stem(name) in _stems(self.lower, posixpath.dirname(parent)):
            return "bytecode of a module the image ships"
        if "/" in relative and _exists(self.lower, posixpath.join(home, top)):
            return "inside a package the image ships"
        if stem(top) in self.names.modules or stem(top) in self.names.startup:
            return "a module name the image ships, or its start-up code imports"
        if stem(top) in self.names.guarded:
            return "a module name the image's code imports (the standard library's included)"
        if stem(top) in RUNNER_PACKAGES:
            return "the test runner's own package"
        if metadata and (link or not folder):
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


#: A ``.pth`` line of setuptools' editable install of a flat project (it imports a generated finder).
_EDITABLE_PTH = re.compile(r"^import (__editable___[A-Za-z0-9_]+_finder); \1\.install\(\)$")
_EDITABLE_FINDER = re.compile(r"^__editable___[A-Za-z0-9_]+_finder\.py$")


def _editable_finder(lines: list[str]) -> str | None:
    """The finder module a setuptools editable ``.pth`` imports, if that is all it does."""
    match = _EDITABLE_PTH.match(lines[0]) if len(lines) == 1 else None
    return match.group(1) if match else None


def _finder_folders(finder: str) -> list[str] | None:
    """The folders holding what a setuptools editable finder maps (its ``MAPPING``, read as a literal).

    ``None`` (not judged: concealed) for a finder that is not a regular file of at most
    :data:`FINDER_CAP` bytes, or that Python's parser refuses — a syntax error, or an expression too
    deep for it (``RecursionError``, ``MemoryError``).
    """
    data = _read_regular(finder, FINDER_CAP)
    if data is None:
        return None
    try:
        tree = ast.parse(data.decode("utf-8", "replace"))
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = [getattr(t, "id", None) for t in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:  # setuptools >= 69: MAPPING: dict[...] = {...}
            targets = [getattr(node.target, "id", None)]
        else:
            continue
        if targets == ["MAPPING"]:
            try:
                mapping = ast.literal_eval(node.value)
            except (ValueError, SyntaxError, TypeError, OverflowError, MemoryError, RecursionError):
                return None
            if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v.startswith("/") for k, v in mapping.items()
            ):
                return None
            if any(stem(k) in RUNNER_PACKAGES or _matches(k, HOOKS) for k in mapping):
                return None
            folders = {posixpath.dirname(posixpath.normpath(v)) for v in mapping.values()}
            return sorted(folders) or None
    return None


def _real_folder(trees: tuple[str, str], path: str) -> str | bool | None:
    """Where the folder ``path`` of the view (the snapshot over the image) is on the host: ``None`` if it
    does not exist, ``False`` if it, or a folder above it, is not a folder (a link, a file), or if it
    cannot be looked up (a NUL byte in it, a name or path too long: not judged)."""
    if "\0" in path or len(os.fsencode(path)) > MAX_PATH_BYTES:
        return False
    current = ""
    for part in path.strip("/").split("/"):
        current += "/" + part
        for tree in trees:  # the snapshot's entry hides the image's
            try:
                info = os.lstat(tree + current)
            except FileNotFoundError:
                continue
            except OSError:
                return False
            if not stat.S_ISDIR(info.st_mode):
                return False
            break
        else:
            return None
    return next((tree + current for tree in trees if os.path.isdir(tree + current)), None)


def _module_file(path: str) -> bool:
    """Whether ``path`` names a Python module file (source, bytecode or an extension)."""
    return path.endswith((".py", ".pyc", ".pyo", ".pyw")) or ".so" in posixpath.basename(path)


@functools.lru_cache(maxsize=64)
def _guarded(lower: str, folders: tuple[str, ...]) -> frozenset[str]:
    """The names the image's Python code imports (scanned once per image and import path)."""
    return guard_names(lower, folders)


def guarded_names(lower: Path, search: SearchPaths, workdir: str, allowed: Sequence[str] = ()) -> frozenset[str]:
    """The names the image's Python code imports (:mod:`._imports`), as the rule knows them."""
    return _rule(lower, search, posixpath.normpath(workdir or "/"), tuple(allowed)).names.guarded


@functools.lru_cache(maxsize=256)
def _rule(
    lower: Path, search: SearchPaths, workdir: str, allowed: tuple[str, ...], hazards: tuple[tuple[str, str], ...] = ()
) -> _Rule:
    """The rule for an image (which never changes), made once: listing what it ships is the costly part."""
    return _Rule(lower, search, workdir, allowed, hazards)


def _declares_runner_plugin(metadata: Path) -> bool:
    """Whether a distribution's metadata registers a pytest plug-in (loaded by every ``pytest`` run).

    Read without following a link (the metadata folder and its ``entry_points.txt`` may be the agent's,
    hard-linked: a link there would be followed on the host) and without waiting on a FIFO: an
    ``entry_points.txt`` that is not a regular file of at most :data:`JUDGED_FILE_CAP` bytes, or a
    metadata folder that is a link, counts as one that does (not judged: concealed)."""
    try:
        folder = os.open(metadata, _DIR_FLAGS)
    except FileNotFoundError:
        return False
    except NotADirectoryError:  # a file (an old-style ``.egg-info``: no entry points), or a link
        try:
            return not stat.S_ISREG(os.lstat(metadata).st_mode)
        except FileNotFoundError:
            return False
        except OSError:
            return True
    except OSError:
        return True
    try:
        data = _read_regular("entry_points.txt", JUDGED_FILE_CAP, dir_fd=folder, missing=b"")
    finally:
        os.close(folder)
    return data is None or b"[pytest11]" in data.replace(b" ", b"")


def _read_regular(path: str, cap: int, dir_fd: int | None = None, missing: bytes | None = None) -> bytes | None:
    """The bytes of the regular file ``path`` (never through a link at its last component, never waiting
    on a FIFO), or ``None`` if it is not one, holds more than ``cap`` bytes, or cannot be read;
    ``missing`` if it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return missing
    except (OSError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > cap:
            return None
        chunks, left = [], cap + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return None if left <= 0 else b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _globs_and_below(globs: Iterable[str]) -> re.Pattern[str]:
    """One expression matching a path that a glob matches, or a path below one."""
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})|(?:{fnmatch.translate(g + '/*')})" for g in globs))


def _literal_start(glob: str) -> str:
    """What every path that matches ``glob`` begins with: the glob up to its first wildcard."""
    for index, char in enumerate(glob):
        if char in "*?[":
            return glob[:index]
    return glob


def _may_begin(below: str, start: str) -> bool:
    """Whether a path below the folder ``below`` (ending in ``/``) may begin with ``start``."""
    return below.startswith(start) or start.startswith(below)


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
    """Whether ``root`` has an entry at ``path``; an error that does not say (a path too long, a loop)
    is raised: the entry being judged is then not judged (concealed), never taken for a new one."""
    try:
        os.lstat(f"{root}{path}")
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def snapshot(
    upper: Path,
    lower: Path,
    target: Path,
    search: SearchPaths,
    workdir: str,
    allowed: Sequence[str] = (),
    live: Iterable[str] = (),
    copy_budget: int = COPY_BUDGET,
    skip: Iterable[str] = (),
    hazards: dict[str, str] | None = None,
) -> Snapshot:
    """Fill ``target`` (an empty folder on ``upper``'s file system) with the verifier's view of ``upper``'s
    code places.

    ``target`` then serves as the middle layer of the verifier's overlay, over ``lower``; the ``live``
    folders are laid as empty folders there, for the agent's own folders to be mounted on. The
    agent's processes may still be running: ``upper`` is walked through folder descriptors opened
    without following links (a folder swapped for a link mid-walk leads nowhere), and what the rule
    judges by content is judged on the snapshot's own copy, after it is made.

    Args:
        upper: The agent's overlay upper layer.
        lower: The image's root.
        target: Where the snapshot goes.
        search: Where the verifier looks code up.
        workdir: The verifier's working directory (the task's).
        allowed: Globs of paths that are the agent's whatever they are (``allowed_changes``).
        live: Folders the verifier sees live (:func:`live_paths`): not walked.
        copy_budget: Bytes of judged files copied at most (beyond, they are not seen).
        skip: The agent's box's own mount points (not the agent's changes): not laid.
        hazards: The image's own links that lead where the agent's may not (``_links.image_hazards``).

    The walk is total on what the agent left (:class:`_Walker`): an entry it cannot judge, for whatever
    reason, is concealed, and what the snapshot reports is bounded (:class:`Snapshot`) whatever the
    layer holds.

    Returns:
        What was concealed, how much was copied.

    Raises:
        OSError: ``ENOSPC`` or ``EDQUOT``: the snapshot's file system — the agent's own storage — is
            full (the rollout filled it). Any other error is not the agent's content's: the rule could
            not be made from the image, or ``upper`` or ``target`` could not be opened.
        UnjudgeableViewError: What the agent left could not be judged, nor left out of the snapshot
            (``tampered``: the rollout's doing).
    """
    rule = _rule(
        lower, search, posixpath.normpath(workdir or "/"), tuple(allowed), tuple(sorted((hazards or {}).items()))
    )
    walker = _Walker(rule, os.fspath(target), copy_budget, frozenset(live), frozenset(skip))
    fd = os.open(upper, _DIR_FLAGS)
    try:
        try:
            walker.walk(fd, "", 0)
        except _Unjudgeable as bound:  # the layer's root holds more entries than are judged: none is seen
            walker.conceal("/", str(bound))
        walker.lay_live_packages(fd)
    finally:
        os.close(fd)
    walker.judge_pth_files()
    result = walker.finish()
    result.commands = _added_commands(os.fspath(target), rule)
    return result


def _added_commands(target: str, rule: _Rule) -> list[str]:
    """The files and links the snapshot laid in the ``PATH`` folders under names the image does not have
    there (what the agent installed), each folder once (``/bin`` and ``/usr/bin`` may be one); their
    folders are opened beneath the snapshot and the image, never through a link."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    snapshot_root = os.open(target, _DIR_FLAGS)
    image_root = os.open(rule.lower, _DIR_FLAGS)
    try:
        for directory in rule.path_dirs:
            try:
                folder = open_beneath(snapshot_root, directory, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue  # the agent changed nothing there (or it is a link of the image's: its target is listed)
            try:
                info = os.fstat(folder)
                if (info.st_dev, info.st_ino) in seen:
                    continue
                seen.add((info.st_dev, info.st_ino))
                try:
                    shipped = open_beneath(image_root, directory, os.O_RDONLY | os.O_DIRECTORY, resolve=IN_ROOT)
                except OSError:
                    shipped = None
                try:
                    with os.scandir(folder) as entries:
                        for entry in entries:
                            if not (entry.is_symlink() or entry.is_file(follow_symlinks=False)):
                                continue  # a folder, a deletion, a socket: no command
                            if shipped is not None and _lexists_at(shipped, entry.name):
                                continue
                            found.append(f"{directory}/{entry.name}")
                finally:
                    if shipped is not None:
                        os.close(shipped)
            finally:
                os.close(folder)
    finally:
        os.close(snapshot_root)
        os.close(image_root)
    return found


def _lexists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def commands_record(snapshot: Snapshot, path_dirs: Sequence[str]) -> bytes:
    """What the view's supervisor reads to let the verifier's commands win (``COMMANDS_FILE`` of
    ``_supervisor.c``): a ``W`` record for each ``PATH`` folder it watches and an ``A`` record for each
    command the agent added, NUL-terminated; empty when the agent added none (nothing is watched)."""
    if not snapshot.commands:
        return b""
    folders = [d for d in path_dirs if d.startswith("/")]
    return b"".join(b"W" + os.fsencode(d) + b"\0" for d in folders) + b"".join(
        b"A" + os.fsencode(p) + b"\0" for p in snapshot.commands
    )


def live_paths(
    root_fd: int,
    lower: Path,
    search: SearchPaths,
    workdir: str,
    allowed: Sequence[str] = (),
    upper: Path | None = None,
) -> list[str]:
    """The folders of the agent's tree the verifier sees live, shallowest first.

    Every folder that holds no code place (:meth:`_Rule.live_place`) — the task's working directory
    among them — is live, however deep; code places are the snapshot's, and a folder with a code
    place below it is split: its folders are judged one by one.

    Which folders those are is a matter of their paths only, so the image's are found once per image
    (its tree never changes) and, given the agent's overlay ``upper`` layer, only what the agent
    made there is listed for each view: the agent's new folders. A folder of the image's the agent
    removed or replaced (by a link, a file) is still named; mounting it fails, beneath the agent's
    root and never through a link (``_roots._bind_live``), and it stays out of the view.

    Args:
        root_fd: The agent's root (its merged tree), as a folder descriptor: listed one level at a
            time, never through a link, when ``upper`` is not given.
        lower: The image's root.
        search: Where the verifier looks code up.
        workdir: The verifier's working directory.
        allowed: The task's allowed changes.
        upper: The agent's overlay upper layer (its changes), if the agent's tree is an overlay on
            ``lower``.
    """
    rule = _rule(lower, search, posixpath.normpath(workdir or "/"), tuple(allowed))
    if upper is None:
        found = _live_below(rule, root_fd)
    else:
        found = set(rule.image_live())
        fd = os.open(upper, _DIR_FLAGS)
        try:
            found |= _live_below(rule, fd)
        finally:
            os.close(fd)
    return sorted(found, key=lambda p: (p.count("/"), p))


def _live_below(rule: _Rule, root_fd: int) -> set[str]:
    """The live folders of the tree at ``root_fd`` (listed one level at a time, never through a link)."""
    found: set[str] = set()
    pending = [("/", os.dup(root_fd))]
    while pending:
        folder, fd = pending.pop()
        try:
            for name in os.listdir(fd):
                path = f"{folder}{name}" if folder == "/" else f"{folder}/{name}"
                place = rule.live_place(path)
                if place is None:
                    continue
                try:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        continue
                except OSError:
                    continue
                if place == "live":
                    found.add(path)
                else:
                    with contextlib.suppress(OSError):
                        pending.append((path, os.open(name, _DIR_FLAGS, dir_fd=fd)))
        except OSError:
            pass
        finally:
            os.close(fd)
    return found


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Why an entry of the agent's is not in the snapshot when it could not be laid there.
_UNPLACED_READ = "a file the rule reads, too large or changed while it was judged"
_UNPLACED = "changed while it was judged"
#: A file the rule reads is copied, up to this size (beyond, it is not seen).
JUDGED_FILE_CAP = 1 << 20
#: Entries of the agent's code places judged at most (beyond, the rest is not seen; a folder that holds
#: more than are left is not seen at all).
MAX_ENTRIES = 1_000_000
#: Bytes of a sandbox path judged at most (a longer one is not seen): its place in the snapshot, below
#: the view's folder, stays within the host's ``PATH_MAX``.
MAX_PATH_BYTES = 3072
#: Bytes of a name judged at most (Linux's ``NAME_MAX``; a longer one is not seen).
MAX_NAME_BYTES = 255
#: The host's ``PATH_MAX``: a snapshot path as long is not laid (not seen).
_HOST_PATH_MAX = 4096
#: Lines of a ``.pth`` judged at most, and characters of one of its lines (beyond, it is not seen).
PTH_MAX_LINES = 1000
PTH_MAX_LINE = 4096
#: Bytes of a setuptools editable finder parsed at most (beyond, its ``.pth`` is not seen).
FINDER_CAP = 256 << 10
#: Concealed changes a snapshot names at most (:attr:`Snapshot.concealed`; the rest are counted), and
#: characters of each line.
CONCEALED_SHOWN = 100
CONCEALED_TEXT_CAP = 512
#: Folders a rule remembers its answers for at most (then it forgets them all and starts again).
_REMEMBERED_FOLDERS = 100_000
#: Errors of the snapshot's file system — the agent's own, bounded storage — that say it is full: raised
#: as they are (grading scores a rollout that filled its storage), never taken for an entry's.
_STORAGE_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Errors that a bug of the walk's own code raises rather than what it reads: an entry they stop is
#: concealed all the same (fail closed), and the first of a walk is logged at WARNING with its traceback.
_CODE_ERRORS = (
    TypeError, AttributeError, NameError, LookupError, AssertionError, ImportError, NotImplementedError,
    UnboundLocalError,
)  # fmt: skip


class _Unjudgeable(Exception):
    """An entry past a bound of the walk (its message is why it is concealed)."""


class _Walker:
    """One walk of an agent layer into a snapshot (:func:`snapshot`).

    **Total.** Each entry of the agent's layer is judged and laid under a guard: whatever it is — a
    name of any bytes, a link chain, a folder past :data:`MAX_DEPTH` or holding more than
    :data:`MAX_ENTRIES`, a path past :data:`MAX_PATH_BYTES`, a ``.pth`` or finder that the rule's
    parsers refuse, an entry that vanishes or changes while it is judged — an exception raised while
    it is handled (an ``OSError`` of any errno, ``ValueError``, ``UnicodeError``, ``RecursionError``,
    ``MemoryError``, ...) conceals that entry, what was laid of it is removed from the snapshot, and
    the walk goes on: what cannot be judged is not seen. So are errors of the walk's own code on an
    entry (a ``TypeError``, say): an entry is never seen unjudged, and the rollout is graded on the
    rest, never skipped for what it left; the first such error of a walk is logged at WARNING with its
    traceback, so that a bug shows.

    Two errors are raised instead: the snapshot's file system full (``ENOSPC``, ``EDQUOT``: it is the
    agent's storage, and grading scores the rollout as one that filled it), and
    :class:`~harbor_local_sandbox.errors.UnjudgeableViewError` when what could not be judged could
    not be removed from the snapshot either (the view is refused, the rollout's doing). Errors
    outside the entries' judgement — making the rule from the image, opening the layer — are not
    the walk's: :func:`snapshot` raises them as they are, and grading counts them as its own.
    """

    def __init__(self, rule: _Rule, target: str, budget: int, live: frozenset[str], skip: frozenset[str]) -> None:
        self.rule, self.target, self.budget, self.live, self.skip = rule, target, budget, live, skip
        self.result = Snapshot()
        self.pth_files: list[str] = []  # judged once the whole snapshot is laid (they name other folders)
        self._bug_logged = False

    def conceal(self, path: str, why: str) -> None:
        """Count a concealed change; name it while fewer than :data:`CONCEALED_SHOWN` are named."""
        result = self.result
        result.concealed_count += 1
        if len(result.concealed) < CONCEALED_SHOWN:
            result.concealed.append(_report_line(path, why))

    def finish(self) -> Snapshot:
        """The snapshot's report: the changes named, then how many more there were."""
        result = self.result
        more = result.concealed_count - len(result.concealed)
        if more > 0:
            result.concealed.append(
                f"... and {more} more changes the verifier does not see ({result.concealed_count} in all)"
            )
        return result

    def _mark(self) -> tuple[int, int, int]:
        """Where the report stands (to forget what an entry's walk reported, when the entry goes whole)."""
        return len(self.result.concealed), self.result.concealed_count, len(self.pth_files)

    def _rollback(self, mark: tuple[int, int, int]) -> None:
        shown, count, pth_files = mark
        del self.result.concealed[shown:]
        self.result.concealed_count = count
        del self.pth_files[pth_files:]

    def _unjudged(
        self, path: str, dest: str, error: BaseException, mark: tuple[int, int, int], quiet: bool = False
    ) -> None:
        """An entry whose judgement raised ``error``: what was laid of it (and what its walk reported) goes,
        and it is concealed (``quiet``: gone since it was listed, not reported). Raises the errors the
        walk does not keep to an entry (see the class docstring)."""
        if isinstance(error, UnjudgeableViewError) or (isinstance(error, OSError) and error.errno in _STORAGE_FULL):
            raise error
        self._rollback(mark)
        try:
            _remove_laid(dest)
        except Exception as failure:
            if isinstance(failure, OSError) and failure.errno in _STORAGE_FULL:
                raise
            raise UnjudgeableViewError(
                f"the agent's {_report_line(path, type(error).__name__)} could not be judged, nor left out of the "
                f"verifier's view ({type(failure).__name__}: {failure})"
            ) from error
        if quiet:
            return
        if isinstance(error, _Unjudgeable):
            self.conceal(path, str(error))
            return
        self.result.unjudged += 1
        self.conceal(path, f"could not be judged: {type(error).__name__}")
        if isinstance(error, _CODE_ERRORS) and not self._bug_logged:
            self._bug_logged = True
            logger.warning("judging the agent's %s failed: concealed", _report_line(path, "an error"), exc_info=error)

    def _listing(self, dir_fd: int) -> list[os.DirEntry]:
        """A folder's entries, sorted by name, read no further than the entries left to judge
        (:data:`MAX_ENTRIES`): a folder that holds more is :class:`_Unjudgeable`."""
        left = MAX_ENTRIES - self.result.entries
        found: list[os.DirEntry] = []
        with os.scandir(dir_fd) as listing:
            for entry in listing:
                if len(found) > left:
                    raise _Unjudgeable("it holds too many entries to judge")
                found.append(entry)
        found.sort(key=lambda entry: entry.name)
        return found

    def walk(self, dir_fd: int, relative: str, depth: int) -> None:
        """Lay the agent's entries of the folder ``dir_fd`` (sandbox path ``/relative``) into the snapshot."""
        for listed in self._listing(dir_fd):
            name = listed.name
            entry = f"{relative}/{name}" if relative else name
            path, dest = "/" + entry, f"{self.target}/{entry}"
            if path == PLUMBING or path in KERNEL_PLACES or path in self.skip:
                continue
            self.result.entries += 1
            if self.result.entries > MAX_ENTRIES:
                self.conceal(path, "the agent's changes to code places are too many to judge")
                return
            mark = self._mark()
            try:
                self._lay(dir_fd, name, path, dest, depth)
            except FileNotFoundError as gone:  # gone since it was listed: not in the snapshot
                self._unjudged(path, dest, gone, mark, quiet=True)
            except Exception as error:
                self._unjudged(path, dest, error, mark)

    def _lay(self, dir_fd: int, name: str, path: str, dest: str, depth: int) -> None:
        """Lay, or conceal, one entry of the agent's layer."""
        if _too_long(name, path, dest):
            self.conceal(path, "its name or path is too long to judge")
            return
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if path in self.live or path == "/tmp":
            if stat.S_ISDIR(info.st_mode):  # a mount point for the agent's own folder
                _mkdir_like(dest, info, opaque=False)
            return
        if stat.S_ISDIR(info.st_mode):
            if depth >= MAX_DEPTH:
                self.conceal(path, "too deep to judge")
            else:
                self._folder(dir_fd, name, path, dest, depth)
            return
        self._entry(dir_fd, name, path, dest, info)

    def _entry(self, dir_fd: int, name: str, path: str, dest: str, info: os.stat_result) -> None:
        """Lay, or conceal, one entry that is not a folder (a file, a link, a whiteout, a socket)."""
        rule = self.rule
        whiteout = stat.S_ISCHR(info.st_mode) and info.st_rdev == 0
        shipped = _exists(rule.lower, path)
        link = stat.S_ISLNK(info.st_mode)
        if whiteout:  # a deletion is seen (it only removes code), but of the verifier's own places
            why = "the verifier's own" if rule.verifier_only(path) else None
        else:
            why = rule.concealed_change(path, shipped, folder=False, link=link)
        if why is None and link:
            try:
                target = os.readlink(name, dir_fd=dir_fd)
            except OSError:  # not a link any more (swapped since it was listed): not judged, not seen
                self.conceal(path, _UNPLACED)
                return
            why = rule.concealed_link(path, target)
        if why is not None:
            if not whiteout or shipped:
                self.conceal(path, ("deleted; " if whiteout else "") + why)
            return
        judged = rule.reads(path)
        if not self._place(dir_fd, name, dest, info, must=judged):
            self.conceal(path, _UNPLACED_READ if judged else _UNPLACED)
        elif rule.pth_to_judge(path):
            self.pth_files.append(path)
        elif stat.S_ISSOCK(info.st_mode) and path.startswith(IMPLICIT_SOCKETS):
            os.unlink(dest)
            self.conceal(path, "a daemon the C library asks unasked")
        elif ".so" in name and _innermost(path, rule.loader_dirs) is not None:
            self.result.libraries_added = True

    def _folder(self, dir_fd: int, name: str, path: str, dest: str, depth: int) -> None:
        rule = self.rule
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except (FileNotFoundError, NotADirectoryError):  # gone, or swapped for a link since it was listed
            return
        try:
            info = os.fstat(fd)
            try:
                opaque = os.getxattr(fd, overlay_xattr("opaque")) == b"y"
            except OSError:
                opaque = False
            try:
                shipped_folder: bool | None = stat.S_ISDIR(os.lstat(rule.lower + path).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                shipped_folder = None
            if shipped_folder:
                if rule.verifier_only(path):
                    self.conceal(path, "the verifier's own")
                    return
                # An image folder the agent changed inside; replaced whole, it hides the image's entries
                # below for the verifier too, unless code is looked up there (then the image's code stays,
                # and what the agent deleted of it stays deleted).
                keep_opaque = opaque and (rule.agents(path) or not rule.code_below(path))
                _mkdir_like(dest, info, opaque=keep_opaque)
                if opaque and not keep_opaque:
                    self.conceal(path, "replaced whole; the image's code below it is kept")
                    _whiteout_deleted(rule, dest, path, fd)
                self.walk(fd, path[1:], depth + 1)
                return
            why = rule.concealed_change(path, shipped_folder is not None, folder=True, link=False)
            if why is None and shipped_folder is None and rule.live_package(path):
                _mkdir_like(dest, info, opaque=False)  # the mount point of the agent's own package
                self.result.live_packages.append(path)
                return
            if why is None:  # a folder of the agent's own: laid, then judged on what was laid
                mark = self._mark()
                _mkdir_like(dest, info, opaque=opaque)
                if rule.holds_nothing_named(path):
                    self._own(fd, path, depth + 1)
                else:
                    self.walk(fd, path[1:], depth + 1)
                why = rule.concealed_content(path, dest)
                if why is not None:  # not seen whole: what its walk reported goes with it
                    self._rollback(mark)
                    _remove_laid(dest)
            if why is not None:
                self.conceal(path, why)
        finally:
            os.close(fd)

    def _own(self, dir_fd: int, folder: str, depth: int) -> None:
        """Lay a folder of the agent's own that holds no place the rule names (a new package's): there
        only an entry's own name decides — a hook, code configuration, metadata the rule reads (copied),
        a link into the verifier's places — so it is judged without looking at the image.

        Its entries are hard-linked as listed; then one listing of what was laid (which the agent
        cannot change) checks that each is what was judged — a link, or not — and removes the others
        (an entry swapped between the two listings): one system call an entry, not two. Each entry is
        judged under the walk's guard (see the class docstring)."""
        rule = self.rule
        entries = self._listing(dir_fd)
        here = f"{self.target}{folder}"
        metadata = posixpath.basename(folder).lower().endswith((".dist-info", ".egg-info"))
        linked: dict[str, bool] = {}  # laid by a hard link: name -> judged a link
        judge, any_allowed = rule.own_entries(folder), bool(rule.allowed)
        for entry in entries:
            name = entry.name
            path, dest = f"{folder}/{name}", f"{here}/{name}"
            self.result.entries += 1
            if self.result.entries > MAX_ENTRIES:
                self.conceal(path, "the agent's changes to code places are too many to judge")
                break
            mark = self._mark()
            try:
                self._own_entry(
                    dir_fd, entry, path, dest, depth, judge, any_allowed and rule.is_allowed(path), metadata, linked
                )
            except FileNotFoundError as gone:  # gone since it was listed: not in the snapshot
                self._unjudged(path, dest, gone, mark, quiet=True)
                linked.pop(name, None)
            except Exception as error:
                self._unjudged(path, dest, error, mark)
                linked.pop(name, None)
        if linked:
            self._check_linked(here, folder, linked)

    def _own_entry(
        self, dir_fd: int, entry: os.DirEntry, path: str, dest: str, depth: int,
        judge: Callable[[str], str | None], allowed: bool, metadata: bool, linked: dict[str, bool],
    ) -> None:  # fmt: skip
        """Lay, or conceal, one entry of a folder of the agent's own (:meth:`_own`)."""
        name = entry.name
        if _too_long(name, path, dest):
            self.conceal(path, "its name or path is too long to judge")
            return
        why = None if allowed else judge(name)
        if entry.is_dir(follow_symlinks=False):
            if why is not None or depth >= MAX_DEPTH:
                self.conceal(path, why or "too deep to judge")
                return
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except NotADirectoryError:  # swapped for a link or a file since it was listed
                self.conceal(path, _UNPLACED)
                return
            try:
                _mkdir_like(dest, os.fstat(fd), opaque=False)
                self._own(fd, path, depth + 1)
            finally:
                os.close(fd)
            return
        is_link = entry.is_symlink()
        if why is None and is_link:
            try:
                target = os.readlink(name, dir_fd=dir_fd)
            except OSError as error:  # not a link any more (EINVAL): swapped since it was listed
                if error.errno != errno.EINVAL:
                    raise
                self.conceal(path, _UNPLACED)
                return
            why = self.rule.concealed_link(path, target)
        if why is not None:
            self.conceal(path, why)
            return
        if not allowed and (metadata or _judged_by_name(name)):
            if not self._place(dir_fd, name, dest, entry.stat(follow_symlinks=False), must=True):
                self.conceal(path, _UNPLACED_READ)
            return
        try:
            os.link(name, dest, src_dir_fd=dir_fd, follow_symlinks=False)
        except OSError as error:
            if error.errno != errno.EPERM:  # a folder by now: no hard link to one
                raise
            self.conceal(path, _UNPLACED)
            return
        linked[name] = is_link
        if ".so" in name and _innermost(path, self.rule.loader_dirs) is not None:
            self.result.libraries_added = True

    def _check_linked(self, here: str, folder: str, linked: dict[str, bool]) -> None:
        """Remove what was hard-linked into ``here`` as other than it was judged (a file swapped for a
        link since it was listed, or back): the linked inode is what the verifier gets, and the agent
        can no longer change what it is."""
        with os.scandir(here) as laid:
            for entry in laid:
                judged_link = linked.get(entry.name)
                if judged_link is not None and entry.is_symlink() != judged_link:
                    os.unlink(entry.path)
                    self.conceal(f"{folder}/{entry.name}", _UNPLACED)

    def _place(self, dir_fd: int, name: str, dest: str, info: os.stat_result, must: bool) -> bool:
        """Copy a file the rule reads (within the budget), else hard-link the agent's entry: its data and
        metadata stay the agent's; ``False`` if a file that ``must`` be copied could not be, or an entry
        listed as a file is a folder by now (a link to a folder is refused: the agent swapped it)."""
        if must:
            if not stat.S_ISREG(info.st_mode) or info.st_size > JUDGED_FILE_CAP or info.st_blocks * 512 > self.budget:
                return False
            try:
                copied = _sparse_copy(dir_fd, name, dest)
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(dest)
                return False  # gone or swapped since it was listed, or no room
            self.budget -= copied
            self.result.copied += copied
            return True
        return _link(dir_fd, name, dest, is_link=stat.S_ISLNK(info.st_mode))

    def lay_live_packages(self, upper_fd: int) -> None:
        """Where the agent added a ``.pth`` file, lay its live packages entry by entry after all: a ``.pth``
        may name a folder of one, and is judged on what that folder holds (:meth:`_Rule.judge_pth`)."""
        if not self.pth_files or not self.result.live_packages:
            return
        packages, self.result.live_packages = self.result.live_packages, []
        for path in packages:
            dest = self.target + path
            mark = self._mark()
            try:
                fd = open_beneath(upper_fd, path, _DIR_FLAGS)
            except OSError:  # gone, or swapped for a link or a file since it was listed: not seen
                with contextlib.suppress(OSError):
                    os.rmdir(dest)
                continue
            try:
                self._own(fd, path, path.count("/"))
            except Exception as error:
                self._unjudged(path, dest, error, mark)
            finally:
                os.close(fd)

    def judge_pth_files(self) -> None:
        """Judge the ``.pth`` files laid, on the snapshot and the image (the folders they name included);
        each under the walk's guard (one that cannot be judged is concealed)."""
        for path in self.pth_files:
            dest = self.target + path
            mark = self._mark()
            try:
                self._judge_pth(path, dest)
            except Exception as error:
                self._unjudged(path, dest, error, mark)

    def _judge_pth(self, path: str, dest: str) -> None:
        why, replacement = self.rule.judge_pth(path, dest, self.target)
        if why is not None:
            os.unlink(dest)
            self.conceal(path, why)
        elif replacement is not None:
            info = os.lstat(dest)
            os.unlink(dest)
            Path(dest).write_text(replacement)
            os.chmod(dest, stat.S_IMODE(info.st_mode))
            with contextlib.suppress(OSError):
                os.chown(dest, info.st_uid, info.st_gid)


def _too_long(name: str, path: str, dest: str) -> bool:
    """Whether an entry's name or path is past what the walk judges (:data:`MAX_NAME_BYTES`,
    :data:`MAX_PATH_BYTES`), or its place in the snapshot past the host's ``PATH_MAX``."""
    return (
        len(os.fsencode(name)) > MAX_NAME_BYTES
        or len(os.fsencode(path)) > MAX_PATH_BYTES
        or len(os.fsencode(dest)) >= _HOST_PATH_MAX
    )


def _remove_laid(dest: str) -> None:
    """Remove what the walk laid at ``dest`` in the snapshot (a folder with all below it), if anything."""
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:  # nothing could be laid there (every laying is by this path)
            return
        raise
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(dest)
    else:
        os.unlink(dest)


def _report_line(path: str, why: str) -> str:
    """``"path (why)"`` in at most :data:`CONCEALED_TEXT_CAP` characters: the path's characters that do
    not print, and its bytes that are not UTF-8, escaped (``\\x0a``, ``\\xff``), and a long path cut in
    its middle."""
    shown = path if path.isprintable() else "".join(ch if ch.isprintable() else _escaped(ch) for ch in path)
    room = max(CONCEALED_TEXT_CAP - len(why) - 3, 16)
    if len(shown) > room:
        half = (room - 1) // 2
        shown = f"{shown[:half]}…{shown[len(shown) - half :]}"
    return f"{shown} ({why})"[:CONCEALED_TEXT_CAP]


def _escaped(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8 (``os.fsdecode``'s surrogate escape)
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _link(dir_fd: int, name: str, dest: str, is_link: bool) -> bool:
    """Hard-link the agent's entry ``name`` of ``dir_fd`` at ``dest`` (never following a link), as it was
    judged: a link (``is_link``) or not. ``False`` (nothing laid) when what was judged is not what is
    linked by now — a folder (no hard link to one), or a file swapped for a link or back: the linked
    inode is what the verifier gets, so it is checked after linking, when the agent can no longer
    change what it is."""
    try:
        os.link(name, dest, src_dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return True  # gone since it was listed: not in the snapshot
    except OSError as error:
        if error.errno == errno.EPERM:
            return False
        if error.errno != errno.EEXIST:
            raise
        return True
    try:
        laid_link = stat.S_ISLNK(os.lstat(dest).st_mode)
    except FileNotFoundError:
        return True
    if laid_link != is_link:
        os.unlink(dest)
        return False
    return True


def _whiteout_deleted(rule: _Rule, dest: str, path: str, fd: int) -> None:
    """In a folder the agent replaced whole where code lives: keep its deletion of the image's entries."""
    for name in _listdir(rule.lower, path):
        child = f"{path}/{name}"
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
            continue  # the agent has an entry of its own there
        except OSError:
            pass
        if rule.verifier_only(child):
            continue
        with contextlib.suppress(OSError):
            os.mknod(f"{dest}/{name}", stat.S_IFCHR | 0o000, 0)


def _mkdir_like(path: str, info: os.stat_result, opaque: bool) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    with contextlib.suppress(OSError):
        os.chown(path, info.st_uid, info.st_gid)
    os.chmod(path, stat.S_IMODE(info.st_mode))
    if opaque:
        os.setxattr(path, overlay_xattr("opaque"), b"y", follow_symlinks=False)


def _judged_by_content(path: str) -> bool:
    """Whether the rule read this file's content (a distribution's metadata, a ``.pth``)."""
    parent = posixpath.basename(posixpath.dirname(path)).lower()
    return parent.endswith((".dist-info", ".egg-info")) or _judged_by_name(posixpath.basename(path))


def _judged_by_name(name: str) -> bool:
    """Whether the rule reads a file of this name wherever it is (a ``.pth``, an editable finder)."""
    return name.endswith(".pth") or (name.startswith("__editable__") and _EDITABLE_FINDER.match(name) is not None)


def _sparse_copy(dir_fd: int, name: str, dest: str) -> int:
    """Copy a regular file's data (not its holes), owner and mode; return the bytes copied."""
    copied = 0
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO swapped in does not block
    with contextlib.ExitStack() as stack:
        fd_in = os.open(name, flags, dir_fd=dir_fd)
        stack.callback(os.close, fd_in)
        info = os.fstat(fd_in)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file any more", name)
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
