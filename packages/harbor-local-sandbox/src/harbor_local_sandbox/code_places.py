"""Where a verifier's code is looked up, and what is the verifier's alone: one declarative table.

Every consumer reads this module and nothing else for these facts:

* the verifier's view (``_view.py``): what of the agent's changes it shows where code is looked up;
* the sandbox's keel (``_supervisor.c``): which links of the agent's it refuses — it is given
  :data:`LINK_FORBIDDEN` (and the image's own links that lead there, :mod:`._links`) on its command
  line when a sandbox starts, never a list of its own;
* a trainer's seal of backends without a view, which may hold this very file (a link to this one),
  so that its Docker grading reads the same table without needing this package.

It is pure data (standard library only, no import of this package) for that reason, with the one
function every consumer needs to read a task's ``allowed_changes`` alike (:func:`allowed_changes`). The search paths
themselves — ``PATH``, the interpreters' import paths, the loader's folders, the folders the image's
own binaries name (``RUNPATH``) and what CPython's path computation looks at — are not listed: they
are derived from each image when it is prepared (``_view.search_paths``, ``_derive.py``).

Globs: ``*``, ``?`` and ``[...]`` match within one path component (never across ``/``); ``~/`` is every
home folder of the image (``/root``, ``/home/*`` and those ``/etc/passwd`` names).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

__all__ = [
    "CODE_CONFIG",
    "HOOKS",
    "IMPLICIT_SOCKETS",
    "KERNEL_PLACES",
    "LINK_FORBIDDEN",
    "PACKAGE_SCRIPTS",
    "PLUMBING",
    "RUNNER_COMMANDS",
    "RUNNER_CONFIG",
    "RUNNER_PACKAGES",
    "STARTUP_FILES",
    "VERIFIER_ONLY",
    "allowed_changes",
]

#: Start-up configuration: files that decide how shells, the loader, name resolution and the
#: interpreters and package managers start, read without being named by the command that runs.
#: Any change the agent makes to one the image ships, or one it adds, is not the verifier's.
STARTUP_FILES: tuple[str, ...] = (
    "/etc/ld.so.*", "/etc/nsswitch.conf",
    "/etc/profile", "/etc/profile.d", "/etc/bash.bashrc", "/etc/environment",
    "/etc/python3*", "/etc/pip.conf", "/etc/uv", "/etc/gitconfig", "/etc/npmrc", "/etc/java*", "/usr/etc",
    # OpenSSL's configuration can load engines and providers (shared objects); its certificates are
    # data (the verifier's network is its own: a certificate the agent added intercepts nothing).
    "/etc/ssl/*.cnf", "/etc/ssl/*.cnf.d", "/usr/lib/ssl/*.cnf", "/usr/lib/*/gconv/gconv-modules*",
    "/etc/apt", "/etc/dpkg", "/etc/xdg",
    "~/.bash_profile", "~/.bash_login", "~/.profile", "~/.pydistutils.cfg", "~/.pip", "~/.config/pip",
    "~/.config/uv", "~/.npmrc", "~/.curlrc", "~/.wgetrc", "~/.gitconfig", "~/.netrc", "~/.pypirc",
)  # fmt: skip

#: Where verifiers get tools and test dependencies at verify time (uv's installer, pip's and uv's
#: caches, maven, gradle, npm, cargo, go): a planted one would be the verifier's test runner or library.
FETCHED_CODE: tuple[str, ...] = (
    "~/.local/bin", "~/.local/share/uv", "~/.cache", "~/.m2", "~/.gradle", "~/.ivy2", "~/.npm", "~/.cargo/registry",
    "~/go/pkg",
)  # fmt: skip

#: The scripts package managers run when the verifier installs or removes a package: dpkg's
#: maintainer scripts and triggers (of every installed package: a trigger runs another package's
#: script), apt's transport methods and hooks' folders.
PACKAGE_SCRIPTS: tuple[str, ...] = (
    "/var/lib/dpkg/info", "/var/lib/dpkg/triggers", "/usr/lib/apt/methods", "/usr/lib/apt/apt-helper",
    "/usr/share/debconf", "/usr/lib/dpkg",
)  # fmt: skip

#: Everything the view treats as code configuration (globs; see the module docstring).
CODE_CONFIG: tuple[str, ...] = (*STARTUP_FILES, *FETCHED_CODE, "*/pip.conf", *PACKAGE_SCRIPTS)

#: Files interpreters load from a folder without being asked (Python's start-up hooks).
HOOKS: tuple[str, ...] = ("*.pth", "*._pth", "pyvenv.cfg", "sitecustomize*", "usercustomize*")

#: The test runner's own packages: the verifier never runs the agent's version of them.
RUNNER_PACKAGES: frozenset[str] = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "py"})

#: The test runner's own commands: one the agent adds to a folder on ``PATH`` is never the verifier's
#: (a verifier that installs its runner at verify time would run the agent's, earlier on ``PATH``).
RUNNER_COMMANDS: frozenset[str] = frozenset({"pytest", "py.test", "pytest-3", "py.test-3"})

#: What a test runner or ``python -m`` picks up from a working directory and its ancestors.
RUNNER_CONFIG: tuple[str, ...] = (
    "conftest.py", "pytest.ini", ".pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "setup.py",
    "*.py", "*.pyc", "*.pth", "*.so", "__pycache__", "node_modules", "package.json", "uv.toml",
    ".python-version", ".nvmrc", ".tool-versions", ".npmrc",
)  # fmt: skip

#: Paths that are the verifier's alone: its tests, the solution, its outputs, the view's plumbing.
VERIFIER_ONLY: tuple[str, ...] = (
    "/tests", "/solution", "/logs/verifier", "/run/harbor-local-sandbox", "/.harbor-local-sandbox",
)  # fmt: skip

#: The kernel's places in the verifier's root (its own, mounted by its supervisor).
KERNEL_PLACES: tuple[str, ...] = ("/proc", "/dev", "/sys")

#: Where no link of the agent's may lead, nor to a folder above (see :mod:`._links`): the verifier's
#: own places, its ``/proc`` (``/dev/fd``, ``/dev/std*`` and ``/dev/core`` lead there too), and where
#: its own temporary files are (``/tmp`` and ``/dev/shm`` are layers of the verifier's).
LINK_FORBIDDEN: tuple[str, ...] = (
    "/tests", "/solution", "/logs/verifier", "/.harbor-local-sandbox", "/proc", "/tmp", "/dev/shm", "/dev/fd",
    "/dev/stdin", "/dev/stdout", "/dev/stderr", "/dev/core",
)  # fmt: skip

#: Where the C library looks for daemons to answer its lookups (users, hosts) without being configured to.
IMPLICIT_SOCKETS: tuple[str, ...] = ("/run/nscd/", "/var/run/nscd/", "/run/systemd/userdb/", "/var/run/systemd/userdb/")

#: The sandbox's own plumbing (mount points of the helpers bound in): never the agent's, never reported.
PLUMBING = "/run/harbor-local-sandbox"


_HOOK_NAMES = re.compile("|".join(f"(?:{re.escape(glob).replace(chr(92) + '*', '.*')})" for glob in HOOKS))


def _component(glob: str) -> str:
    """One path component of a glob as a regular expression: ``*``, ``?`` and ``[...]`` never match ``/``."""
    out, index = [], 0
    while index < len(glob):
        char = glob[index]
        end = glob.find("]", index + 2) if char == "[" else -1
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif end != -1:
            body = glob[index + 1 : end]
            negate = body[:1] in ("!", "^")
            body = re.sub(r"([\\\]])", r"\\\1", (body[1:] if negate else body).replace("/", ""))
            out.append(f"[^{body}/]" if negate else f"[{body}]")
            index = end
        else:
            out.append(re.escape(char))
        index += 1
    return "".join(out)


def allowed_changes(globs: Iterable[str]) -> Callable[[str], bool]:
    """Whether a sandbox path is one of a task's ``allowed_changes`` (the agent's whatever it is).

    A glob matches a path component by component (``*``, ``?`` and ``[...]`` never cross ``/``; a
    component ``**`` matches any number of them), and everything below a path it matches. A start-up
    hook (:data:`HOOKS`: a ``.pth``, ``sitecustomize``, ...) is allowed only where a glob names it
    exactly (its last component without a wildcard): ``.../site-packages/mypkg*`` admits
    ``mypkg/__init__.py`` and ``mypkg-1.0.dist-info``, never ``mypkg_x.pth``.

    Args:
        globs: Absolute sandbox paths, with wildcards.

    Returns:
        The test, for a normalised absolute path.
    """
    wildcard, exact = [], []
    for glob in globs:
        parts = [part for part in glob.strip().split("/") if part not in ("", ".")]
        if not glob.startswith("/") or not parts or ".." in parts:
            continue  # not an absolute path below /: allows nothing
        body = "".join("(?:/[^/]+)*" if part == "**" else "/" + _component(part) for part in parts)
        (exact if not any(ch in parts[-1] for ch in "*?[") else wildcard).append(body)
    below = "(?:/.*)?"
    matches = re.compile("|".join(f"(?:{b}){below}" for b in [*wildcard, *exact]) or "(?!)").fullmatch
    named = re.compile("|".join(f"(?:{b}){below}" for b in exact) or "(?!)").fullmatch

    def allows(path: str) -> bool:
        if _HOOK_NAMES.fullmatch(path.rsplit("/", 1)[-1]):
            return named(path) is not None
        return matches(path) is not None

    return allows
