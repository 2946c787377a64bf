"""The top-level module names a task image's Python code tries to import: names the agent must not supply.

When a task's verifier runs Python (``pytest``) in a sandbox, the policy being trained may plant a module
whose name the verifier's code *tries* to import but that the image does not ship. Python's own standard
library does this on Linux all the time, inside ``try: ... except ImportError:``: ``ntpath`` imports
``nt`` and ``_winapi``, ``subprocess`` and ``asyncio`` import ``msvcrt``, ``platform`` and ``uuid`` import
``_wmi``, ``mimetypes`` imports ``winreg``; third-party packages do the same with their optional
dependencies (``requests`` → ``simplejson``, ``chardet``). A file ``nt.py`` or ``winreg.py`` in any folder
of the import path would then run inside the verifier, with the verifier's rights, on an ordinary
``import subprocess``.

The defence needs, for each task image, the set of names that must only ever come from the image itself:
the standard library's names of every CPython version (:data:`STDLIB_NAMES`, Windows-only ones included)
and every name the image's Python sources import (:func:`attempted_imports`), found by a fast, tolerant
scan (:func:`imported_names`) rather than by parsing, since it runs on thousands of files per image,
Python 2 sources and files with syntax errors among them. :func:`guard_names` adds the test runner's own
packages and the interpreter's start-up hooks.

Over-approximation is safe here (a name that no code really imports is merely kept from the agent);
missing a name is not.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Iterable

__all__ = ["STDLIB_NAMES", "attempted_imports", "guard_names", "imported_names"]

# Top-level standard-library module names that some CPython version from 3.6 to 3.14 has and that
# ``sys.stdlib_module_names`` of 3.12 or of 3.13 lacks, so that STDLIB_NAMES is the same whichever of them
# runs this. Made from ``sys.stdlib_module_names`` of CPython 3.10.13, 3.11.7, 3.12.1 and 3.13.0 (pyenv
# builds; Debian's 3.11.2 gives the same list as 3.11.7), and, for 3.6.15-3.9.18 (which lack the
# attribute), from the modules their Linux builds ship (the top-level ``.py`` files and packages of the
# standard library folder, ``lib-dynload``'s extensions, ``sys.builtin_module_names``) less the test-only
# ones that ``sys.stdlib_module_names`` leaves out too (``test``, ``_test*``, ``xx*``, ``_xx*``,
# ``_sysconfigdata*``, ``__hello__``, ``__phello__``); the Windows-only modules of 3.6-3.9 are all still in
# 3.10's list. 3.14's additions (``_hmac``, ``annotationlib``, ``compression``, ``_zstd``,
# ``_remote_debugging``) come from CPython's ``Python/stdlib_module_names.h`` and its release notes.
# Sorted.
# fmt: off
_OTHER_VERSIONS: frozenset[str] = frozenset({
    "_android_support", "_bootlocale", "_bootsubprocess", "_colorize", "_crypt", "_dummy_thread", "_hmac",
    "_interpchannels", "_interpqueues", "_interpreters", "_ios_support", "_msi", "_opcode_metadata", "_peg_parser",
    "_pyrepl", "_remote_debugging", "_sha256", "_sha512", "_suggestions", "_sysconfig", "_wmi", "_zstd", "aifc",
    "annotationlib", "asynchat", "asyncore", "audioop", "binhex", "cgi", "cgitb", "chunk", "compression", "crypt",
    "distutils", "dummy_threading", "formatter", "imghdr", "imp", "lib2to3", "macpath", "macurl2path", "mailcap",
    "msilib", "nis", "nntplib", "ossaudiodev", "parser", "pipes", "smtpd", "sndhdr", "spwd", "sunau", "symbol",
    "telnetlib", "uu", "xdrlib",
})
# fmt: on

#: The standard library's top-level module names across CPython versions (3.6 on), Windows- and
#: macOS-only modules included: this interpreter's ``sys.stdlib_module_names`` and the names other
#: versions have that it lacks.
STDLIB_NAMES: frozenset[str] = frozenset(sys.stdlib_module_names) | _OTHER_VERSIONS

#: The test runner's own packages: the verifier's ``pytest`` imports them whatever the tests are.
_RUNNER_PACKAGES: frozenset[str] = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "py"})

#: Modules the interpreter's ``site`` imports at start-up if it can find them.
_STARTUP_HOOKS: frozenset[str] = frozenset({"sitecustomize", "usercustomize"})

#: How much of one file is scanned.
_FILE_LIMIT = 512 << 10

#: Where a statement may begin: a line's start (after indentation), or after ``;`` or ``:`` (``try: import
#: x``, ``import a; import b``), and the ``import`` or ``from`` statement there; or, anywhere, a call of
#: ``importlib.import_module`` or ``__import__`` with a literal string first. Over bytes, one line at a
#: time (the lines that hold ``import``, with the lines a backslash continues them onto or from, and
#: the line after an opening parenthesis), no decoding. An identifier byte is an ASCII letter, digit or
#: underscore, or any non-ASCII byte (UTF-8).
_STATEMENT = re.compile(
    rb"""
    (?P<sep>^|[;:])[ \t]*
    (?:
        import(?:[ \t]|\\\r?\n)+(?P<imp>(?:[^\n;#\\]|\\\r?\n|\\)*)
    |
        from(?:[ \t]|\\\r?\n)+(?P<frm>[A-Za-z_\x80-\xff][\w.\x80-\xff]*)(?:[ \t]|\\\r?\n)+import\b
    )
    |
    (?P<call>\b(?:import_module|__import__)[ \t]*\(\s*
        (?:name[ \t]*=[ \t]*)?[rRuUbBfF]{0,2}["'])
        (?P<arg>[A-Za-z_\x80-\xff][\w.\x80-\xff]*)
    """,
    re.MULTILINE | re.VERBOSE,
)

#: One clause of an ``import`` statement (``a.b as c``), whole, and its module's top-level part (``a``):
#: a clause that is not valid Python (``import the data, then ...`` in a docstring) is not an import.
_CLAUSE = re.compile(
    rb"""
    (?:[ \t\f\r]|\\\r?\n)*
    (?P<top>[A-Za-z_\x80-\xff][\w\x80-\xff]*)
    (?:(?:[ \t\f\r]|\\\r?\n)*\.(?:[ \t\f\r]|\\\r?\n)*[A-Za-z_\x80-\xff][\w\x80-\xff]*)*
    (?:(?:[ \t\f\r]|\\\r?\n)+as(?:[ \t\f\r]|\\\r?\n)+[A-Za-z_\x80-\xff][\w\x80-\xff]*)?
    (?:[ \t\f\r]|\\\r?\n)*
    """,
    re.VERBOSE,
)


def _top(name: bytes) -> str | None:
    """The top-level part of a dotted module name, if it is a valid identifier."""
    top = name.split(b".", 1)[0].decode("utf-8", "replace")
    return top if top.isidentifier() else None


def _continued(data: bytes, newline: int) -> bool:
    """Whether the line break at ``newline`` follows a backslash (the line goes on)."""
    before = data[max(newline - 2, 0) : newline]
    return before.endswith((b"\\", b"\\\r"))


def _comment_at(data: bytes, start: int) -> int:
    """Where the comment of the line that begins at ``start`` begins: its first ``#`` with an even number
    of each quote character before it on the line (a rough rule: it knows nothing of triple quotes or
    escapes); the line's end if none."""
    end = data.find(b"\n", start)
    end = len(data) if end < 0 else end
    singles = doubles = 0
    previous = start
    hash_at = data.find(b"#", start, end)
    while hash_at >= 0:
        singles += data.count(b"'", previous, hash_at)
        doubles += data.count(b'"', previous, hash_at)
        if singles % 2 == 0 and doubles % 2 == 0:
            return hash_at
        previous = hash_at
        hash_at = data.find(b"#", hash_at + 1, end)
    return end


def _scan(data: bytes) -> set[str]:
    """The top-level module names the Python source ``data`` tries to import (see :func:`imported_names`)."""
    found: set[str] = set()
    at = data.find(b"import")
    while at >= 0:  # every statement or call this scan counts holds ``import``: only those lines are read
        start = data.rfind(b"\n", 0, at) + 1
        while start > 1 and _continued(data, start - 1):  # ``from x \\`` then ``import y``
            start = data.rfind(b"\n", 0, start - 1) + 1
        end = data.find(b"\n", at)
        while end >= 0 and _continued(data, end):  # ``import a, \\`` then ``b``
            end = data.find(b"\n", end + 1)
        if end < 0:
            end = len(data)
        for _ in range(3):  # ``import_module(`` then, on a line below, the name
            if end == len(data) or not data[max(start, end - 80) : end].rstrip().endswith(b"("):
                break
            end = data.find(b"\n", end + 1)
            end = len(data) if end < 0 else end
        comments: dict[int, int] = {}  # a line's start: where its comment begins
        for match in _STATEMENT.finditer(data, start, end):
            if match.group("sep") or match.group("call"):  # not at the line's start: it may follow a comment
                line = data.rfind(b"\n", 0, match.start()) + 1
                if line not in comments:
                    comments[line] = _comment_at(data, line)
                if match.start() > comments[line]:
                    continue
            if match.group("arg") is not None:
                names = [match.group("arg")]
            elif match.group("frm") is not None:
                names = [match.group("frm")]
            else:
                clauses = [_CLAUSE.fullmatch(clause) for clause in match.group("imp").split(b",")]
                names = [clause.group("top") for clause in clauses if clause] if all(clauses) else []
            for name in names:
                top = _top(name)
                if top:
                    found.add(top)
        at = data.find(b"import", end)
    return found


def imported_names(source: str | bytes) -> set[str]:
    """The top-level module names a Python source tries to import, by a fast scan that never parses.

    Counts ``import a, b.c as d`` (``a``, ``b``), ``from x.y import z`` (``x``) and a call of
    ``importlib.import_module`` or ``__import__`` whose first argument is a literal string (its top-level
    part), wherever they are: at module level, in functions, in ``try`` blocks and ``if`` branches, after
    ``;`` or on a compound statement's line (``try: import nt``). Relative imports (``from . import x``,
    ``from .m import y``) count nothing, and so does an ``import`` line that is not valid Python (``import
    the data, then ...`` in a docstring). Comments are skipped; the scan tolerates Python 2 sources,
    syntax errors elsewhere and any encoding, and it over-approximates (a valid ``import`` line inside a
    docstring counts).

    Args:
        source: The source text (or its bytes, as read from a file).

    Returns:
        The top-level names, each a valid identifier.
    """
    data = source.encode("utf-8", "replace") if isinstance(source, str) else source
    return _scan(data)


def _resolve(root: str, path: str, hops: int = 40) -> str | None:
    """The host path of the image path ``path``, resolving links as inside ``root`` (a chroot would).

    Returns ``None`` where the path does not exist, leaves a folder, or loops.
    """
    current = ""  # relative to root, without a leading slash
    parts = [p for p in path.split("/") if p]
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            current = current.rpartition("/")[0]
            continue
        candidate = f"{current}/{part}" if current else part
        host = os.path.join(root, candidate)
        try:
            info = os.lstat(host)
        except OSError:
            return None
        if stat.S_ISLNK(info.st_mode):
            hops -= 1
            if hops < 0:
                return None
            try:
                target = os.readlink(host)
            except OSError:
                return None
            if target.startswith("/"):
                current = ""
            parts[:0] = [p for p in target.split("/") if p]
            continue
        if not stat.S_ISDIR(info.st_mode) and parts:
            return None
        current = candidate
    return os.path.join(root, current) if current else root


def attempted_imports(
    root: str | os.PathLike[str],
    folders: Iterable[str],
    *,
    max_files: int = 20000,
    max_bytes: int = 256 << 20,
) -> frozenset[str]:
    """The top-level module names a task image's Python code tries to import, and the standard library's.

    Scans every ``*.py`` (and ``*.pth``) file under each of ``folders`` — image paths such as
    ``/usr/lib/python3.11``, found inside the image's root folder ``root`` — with :func:`imported_names`,
    at most the first 512 KiB of each. Links never lead out of ``root``: a link on the way to a folder
    is resolved as inside the image, and within the folders every link, to a file or a folder, is
    skipped. A folder reached twice (one folder of ``folders`` inside another) is scanned once.

    Args:
        root: The image's root folder on the host.
        folders: Folders of the image (absolute image paths); one that is not absolute (``""``, the
            current folder, on ``sys.path``) or does not exist is skipped.
        max_files: Stop after scanning this many files.
        max_bytes: Stop after reading this many bytes in all.

    Returns:
        The names found, with :data:`STDLIB_NAMES` always included.
    """
    root = os.fspath(root)
    found: set[str] = set(STDLIB_NAMES)
    seen: set[tuple[int, int]] = set()
    files = 0
    budget = max_bytes
    for folder in folders:
        top = _resolve(root, folder) if folder.startswith("/") else None
        if top is None:
            continue
        stack = [top]
        while stack:
            directory = stack.pop()
            try:
                info = os.stat(directory, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(info.st_mode) or (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            try:
                with os.scandir(directory) as listing:
                    entries = sorted(listing, key=lambda e: e.name)
            except OSError:
                continue
            below: list[str] = []
            for entry in entries:
                try:
                    if entry.is_symlink():
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name != "__pycache__":
                            below.append(entry.path)
                        continue
                    if not entry.name.endswith((".py", ".pth")) or not entry.is_file(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                if files >= max_files or budget <= 0:
                    return frozenset(found)
                data = _read(entry.path, min(_FILE_LIMIT, budget))
                if data is None:
                    continue
                files += 1
                budget -= len(data)
                found |= _scan(data)
            stack.extend(reversed(below))  # in order of name, depth first
    return frozenset(found)


def _read(path: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of the regular file ``path``, never through a link; ``None`` if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        while limit > 0:
            chunk = os.read(fd, limit)
            if not chunk:
                break
            chunks.append(chunk)
            limit -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


#: The placeholder names of documentation examples (``import foo``, ``your_module``), which the text
#: scan finds in docstrings: no image's code imports them, and an agent's module may bear them.
_PLACEHOLDER = re.compile(
    r"^(?:foo|bar|baz|qux|spam|eggs|ham|module|package|mymodule|mypackage|mod|pkg|your_\w+|my_\w+)$"
)


def guard_names(root: str | os.PathLike[str], folders: Iterable[str]) -> frozenset[str]:
    """The names the verifier's Python must only ever import from the image's own folders.

    :func:`attempted_imports` of the image (less documentation's placeholder names), the test
    runner's packages (``pytest``, ``_pytest``, ``pluggy``, ``iniconfig``, ``py``) and the start-up
    hooks ``sitecustomize`` and ``usercustomize``.

    Args:
        root: The image's root folder on the host.
        folders: The image's Python import folders (absolute image paths).

    Returns:
        The guarded top-level module names.
    """
    found = {name for name in attempted_imports(root, folders) if not _PLACEHOLDER.match(name)}
    return frozenset(found) | _RUNNER_PACKAGES | _STARTUP_HOOKS
