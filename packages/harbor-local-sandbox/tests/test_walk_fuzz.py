"""The walk of the verifier's view (``_view.snapshot``) is total on what the agent left: generated hostile layers.

The agent controls every byte of its overlay upper layer. Here synthetic images and upper layers
(made by hand, as in ``tests/test_verifier_rule.py``: whiteouts are 0:0 character devices, opaque
folders carry ``trusted.overlay.opaque``) are filled with what a policy may leave — link chains and
loops, names of every byte but ``/`` and NUL, bytes that are not UTF-8, names and paths near and past
the host's limits, folders past ``MAX_DEPTH``, more entries than are judged, ``.pth`` files with NUL
bytes, huge lines or binary content, editable finders that are expressions too deep for Python's
parser, whiteouts, devices, FIFOs, sockets, entries that vanish while they are judged — and
``snapshot()`` (and ``live_paths()``) must never raise, what they lay must never include what was
concealed, and what the snapshot reports must stay bounded whatever the layer holds.

The layers of the generated test come from a seeded ``random.Random`` (the seed is in the test's id):
a failure replays exactly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from harbor_local_sandbox import _view
from harbor_local_sandbox._links import LinkPolicy
from harbor_local_sandbox._view import (
    CONCEALED_SHOWN,
    CONCEALED_TEXT_CAP,
    MAX_DEPTH,
    MAX_PATH_BYTES,
    SearchPaths,
    live_paths,
    snapshot,
)
from harbor_local_sandbox.code_places import IMPLICIT_SOCKETS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts, devices and trusted.* xattrs need root")

SITE = b"/usr/lib/python3/dist-packages"
SEARCH = SearchPaths(
    path=("/usr/local/bin", "/usr/bin", "/bin"),
    python=("/usr/lib/python3.11", SITE.decode(), "/root/.local/lib/python3.11/site-packages"),
    loader=("/usr/lib/x86_64-linux-gnu", "/usr/local/lib"),
)
WORKDIR = "/app"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FINDER = b"__editable___hostile_1_0_finder"
#: Honest changes made beside the hostile ones: the walk goes on past what it cannot judge, so these are seen.
HONEST = {
    SITE + b"/honestpkg/__init__.py": b"VALUE = 1\n",
    b"/usr/local/bin/honest-tool": b"#!/bin/sh\necho ok\n",
    b"/app/answer.txt": b"42\n",
    b"/etc/honest.conf": b"key = value\n",
}
#: Where hostile entries go: code places (judged by the full rule), folders of the agent's own there
#: (judged by name only), the verifier's own places, and places that hold no code.
PARENTS = (
    b"/", b"/usr/bin", b"/usr/local/bin", SITE, SITE + b"/requests", SITE + b"/newpkg", b"/usr/lib/python3.11",
    b"/usr/lib/x86_64-linux-gnu", b"/etc", b"/etc/ld.so.conf.d", b"/root/.local/lib/python3.11/site-packages",
    b"/tests", b"/logs/verifier", b"/opt/tool", b"/app", b"/run/nscd",
)  # fmt: skip


# ── the synthetic image ─────────────────────────────────────────────────────────────────


def _write(root: bytes, path: bytes, data: bytes) -> None:
    full = root + path
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as handle:
        handle.write(data)


def _image(lower: bytes) -> None:
    for path, data in {
        b"/usr/bin/python3": b"elf",
        b"/usr/lib/python3.11/os.py": b"stdlib os",
        b"/usr/lib/python3.11/json/__init__.py": b"stdlib json",
        SITE + b"/requests/__init__.py": b"requests",
        b"/usr/lib/x86_64-linux-gnu/libssl.so.3": b"libssl",
        b"/etc/hosts": b"127.0.0.1 localhost\n",
        b"/app/solution.py": b"print('todo')\n",
    }.items():
        _write(lower, path, data)
    for folder in (b"/usr/local/bin", b"/etc/ld.so.conf.d", b"/opt", b"/run", b"/root/.local/lib/python3.11"):
        os.makedirs(lower + folder, exist_ok=True)


@pytest.fixture
def layers(tmp_path: Path) -> tuple[bytes, bytes, bytes]:
    lower, upper, target = (os.fsencode(tmp_path / name) for name in ("image", "upper", "snapshot"))
    for path in (lower, upper, target):
        os.mkdir(path)
    _image(lower)
    return lower, upper, target


def _snap(layers: tuple[bytes, bytes, bytes], allowed: tuple[str, ...] = ()) -> _view.Snapshot:
    lower, upper, target = layers
    return snapshot(
        Path(os.fsdecode(upper)), Path(os.fsdecode(lower)), Path(os.fsdecode(target)), SEARCH, WORKDIR, allowed
    )


# ── making hostile entries ──────────────────────────────────────────────────────────────


def _folder_fd(root: bytes, path: bytes) -> int:
    """The folder ``path`` below ``root``, made if missing, opened one component at a time (any length)."""
    fd = os.open(root, _DIR)
    try:
        for part in [p for p in path.split(b"/") if p]:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            child = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make(root: bytes, path: bytes, kind: str, data: bytes = b"", target: bytes = b"") -> bool:
    """Make one entry of ``kind`` at ``path`` below ``root`` (through descriptors: any path length);
    ``False`` if something was there already (the first entry generated there stands)."""
    parent, name = path.rsplit(b"/", 1)
    try:
        fd = _folder_fd(root, parent)
    except OSError:  # a generated file or link where this one's folder would be
        return False
    try:
        if kind == "file":
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
            try:
                os.write(out, data)
            finally:
                os.close(out)
        elif kind == "link":
            os.symlink(target, name, dir_fd=fd)
        elif kind == "dir":
            os.mkdir(name, 0o755, dir_fd=fd)
        elif kind == "opaque":
            os.mkdir(name, 0o755, dir_fd=fd)
            child = os.open(name, _DIR, dir_fd=fd)
            try:
                os.setxattr(child, "trusted.overlay.opaque", b"y")
            finally:
                os.close(child)
        else:
            mode, device = {
                "whiteout": (stat.S_IFCHR, 0),
                "chardev": (stat.S_IFCHR, os.makedev(1, 3)),
                "blockdev": (stat.S_IFBLK, os.makedev(7, 0)),
                "fifo": (stat.S_IFIFO, 0),
                "socket": (stat.S_IFSOCK, 0),
            }[kind]
            os.mknod(name, mode | 0o644, device, dir_fd=fd)
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        return False  # two generated entries met: the first stands
    finally:
        os.close(fd)
    return True


def _name(rng: random.Random) -> bytes:
    """A hostile name: any bytes but ``/`` and NUL (not UTF-8, glob and regex characters, control
    characters, hooks' and runners' names, 255 bytes)."""
    choice = rng.randrange(9)
    if choice == 0:
        return bytes(b for b in range(1, 256) if b != 0x2F)  # every byte but / and NUL (254 bytes)
    if choice == 1:
        return bytes(rng.choice([b for b in range(1, 256) if b != 0x2F]) for _ in range(rng.randint(1, 255)))
    if choice == 2:
        return rng.choice([b"\xff\xfe", b"\xc3\x28.py", b"\xed\xa0\x80.pth", b"ok\x80.so.1", b"\x80.dist-info"])
    if choice == 3:
        return rng.choice([b"*", b"[", b"[!a-", b"?", b"\\", b"a\nb", b"\t", b"(?P<x>", b"**/*", b"{a,b}", b" "])
    if choice == 4:
        return rng.choice(
            [b"sitecustomize.py", b"usercustomize.pth", b"x.pth", b"pyvenv.cfg", b"pytest", b"conftest.py",
             b"__init__.py", b"os.py", b"json", b"python3", b"libssl.so.3", b"__pycache__", b"x._pth"]
        )  # fmt: skip
    if choice == 5:
        return b"n" * 255
    if choice == 6:
        return b"." * rng.randint(3, 8)
    return b"e%d" % rng.randrange(1000)


def _target(rng: random.Random) -> bytes:
    """A hostile link target: into the verifier's places, loops, chains, long, not UTF-8, the host's devices."""
    return rng.choice(
        [
            b"/tests", b"../../../../tests/x", b"/proc/self/root", b"/logs", b"..", b".", b"/", b"loop-b",
            b"/dev/zero", b"/etc/shadow", b"a/" * 1500 + b"b", b"\xff/\xfe", b"x" * 4095, b"/tmp", b"../" * 200,
            b"//logs//./verifier", rng.randbytes(20).replace(b"\0", b"x"), b"/usr/lib/python3.11/os.py",
        ]
    )  # fmt: skip


#: A hostile generator: ``(rng, root, parent) -> paths that must not be seen`` (made below ``root``).
Maker = Callable[[random.Random, bytes, bytes], list[bytes]]


def _file(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    _make(root, parent + b"/" + _name(rng), "file", rng.randbytes(rng.randrange(64)))
    return []


def _link(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    name = _name(rng)
    _make(root, parent + b"/" + name, "link", target=_target(rng))
    if rng.random() < 0.3:  # a loop and a chain through the link
        _make(root, parent + b"/loop-b", "link", target=name)
        _make(root, parent + b"/chain", "link", target=b"loop-b/../" + name + b"/x")
    return []


def _deep(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    """A chain of folders past ``MAX_DEPTH``, a file at its bottom."""
    parts = [b"d"] * (MAX_DEPTH + rng.randint(2, 40))
    path = parent.rstrip(b"/") + b"/" + b"/".join(parts) + b"/leaf.py"
    return [path] if _make(root, path, "file", b"import os") else []


def _long(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    """Names of 255 bytes down past ``MAX_PATH_BYTES`` and the host's ``PATH_MAX``."""
    parts = [bytes([rng.choice(b"abc")]) * 255 for _ in range(rng.randint(13, 22))]
    path = parent.rstrip(b"/") + b"/" + b"/".join(parts) + b"/leaf.py"
    return [path] if _make(root, path, "file", b"import os") else []


def _many(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    """A folder holding more entries than are judged (``MAX_ENTRIES`` is made small for these tests)."""
    folder = parent.rstrip(b"/") + b"/many%d" % rng.randrange(1_000_000)
    if not _make(root, folder, "dir"):
        return []
    fd = _folder_fd(root, folder)
    try:
        for index in range(_SMALL_MAX_ENTRIES + 10):
            os.mknod(b"f%d.py" % index, stat.S_IFREG | 0o644, dir_fd=fd)
    finally:
        os.close(fd)
    return [folder]


def _pth(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    """A ``.pth`` in an import folder whose content the rule's judgement could choke on."""
    site = rng.choice([SITE, b"/root/.local/lib/python3.11/site-packages"])
    path = site + b"/h%d.pth" % rng.randrange(1000)
    data = rng.choice(
        [
            b"/opt/x\0y\n", b"\0", b"/opt/ok\n/opt/\0\n", b"/" + b"a" * 100_000 + b"\n",
            b"".join(b"/opt/d%d\n" % i for i in range(5000)), rng.randbytes(4096), b"/" + b"a/" * 3000 + b"\n",
            b"/" + b"n" * 4000 + b"\n", b"\xff\xfe/opt\n", b"/opt/" + bytes(range(1, 10)) + b"\n",
        ]
    )  # fmt: skip
    created = _make(root, path, "file", data)
    hostile = b"\0" in data or len(data) > 4096 or b"\xff" in data or data.count(b"\n") > 1000
    return [path] if created and hostile else []


#: Python source a parser gives up on: too deep for its stack, its recursion limit, or its grammar.
_TOO_DEEP = (
    b"-" * 100_000 + b"1", b"not " * 50_000 + b"1", b"+".join([b"1"] * 100_000), b"a" + b".b" * 100_000,
    b"f" + b"()" * 100_000, b"lambda:" * 50_000 + b"1", b"[" * 100_000 + b"]" * 100_000, b"{'a': " * 200 + b"1",
)  # fmt: skip


def _finder(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    """A setuptools editable ``.pth`` whose finder no parser may judge (too deep, huge, not a file, not UTF-8)."""
    number = rng.randrange(1_000_000)
    module = b"__editable___hostile%d_1_0_finder" % number
    pth = SITE + b"/__editable__.hostile%d-1.0.pth" % number
    if not _make(root, pth, "file", b"import " + module + b"; " + module + b".install()\n"):
        return []
    finder = SITE + b"/" + module + b".py"
    shape = rng.randrange(4)
    if shape == 0:
        _make(root, finder, "file", b"MAPPING = " + rng.choice(_TOO_DEEP) + b"\n")
    elif shape == 1:
        _make(root, finder, "file", b"MAPPING: dict[str, str] = {'a': '/opt/a'}\n#" + b"x" * (300 << 10))
    elif shape == 2:
        _make(root, finder, rng.choice(["fifo", "socket", "chardev"]))
    else:
        _make(root, finder, "file", b"MAPPING = {'a': '/opt/\xff\xfe'}\n" + rng.randbytes(256))
    return [pth] if shape != 3 else []


def _special(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    kind = rng.choice(["whiteout", "chardev", "blockdev", "fifo", "socket"])
    name = rng.choice([_name(rng), b"socket", b"hosts", b"os.py"])
    created = _make(root, parent + b"/" + name, kind)
    return [parent + b"/" + name] if created and kind == "socket" and parent == b"/run/nscd" else []


def _opaque(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    folder = parent.rstrip(b"/") + b"/" + rng.choice([b"requests", b"json", _name(rng)])
    _make(root, folder, "opaque")
    _make(root, folder + b"/" + _name(rng), "file", b"x")
    return []


def _metadata(rng: random.Random, root: bytes, parent: bytes) -> list[bytes]:
    """A distribution's metadata whose entry points are not a plain file (a FIFO, a link, huge, binary)."""
    folder = SITE + b"/plug%d-1.0.dist-info" % rng.randrange(100)
    entry_points = folder + b"/entry_points.txt"
    shape = rng.randrange(4)
    if shape == 0:
        _make(root, entry_points, "fifo")
    elif shape == 1:
        _make(root, entry_points, "link", target=b"/dev/zero")
    elif shape == 2:
        _make(root, entry_points, "file", b"[pytest11]\nx = x\n" + b"#" * (2 << 20))
    else:
        _make(root, entry_points, "file", rng.randbytes(512) + b"\n[pytest11]\nplug = plug\n")
    return []


MAKERS: dict[str, Maker] = {
    "file": _file, "link": _link, "deep": _deep, "long": _long, "many": _many, "pth": _pth, "finder": _finder,
    "special": _special, "opaque": _opaque, "metadata": _metadata,
}  # fmt: skip
#: ``MAX_ENTRIES`` in these tests (a generated layer holds fewer, but for the folders of :func:`_many`).
_SMALL_MAX_ENTRIES = 6_000


# ── what a snapshot may hold ────────────────────────────────────────────────────────────


def _lexists(root: bytes, path: bytes) -> bool:
    """Whether ``root`` has an entry at ``path`` (looked up one component at a time: any length)."""
    parts = [p for p in path.split(b"/") if p]
    fd = os.open(root, _DIR)
    try:
        for part in parts[:-1]:
            try:
                child = os.open(part, _DIR, dir_fd=fd)
            except OSError:
                return False
            os.close(fd)
            fd = child
        os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _laid(target: bytes) -> list[tuple[bytes, os.stat_result]]:
    """Every entry of the snapshot (sandbox path, ``lstat``), walked through descriptors."""
    found: list[tuple[bytes, os.stat_result]] = []
    pending = [(b"", os.open(target, _DIR))]
    while pending:
        folder, fd = pending.pop()
        try:
            for name in map(os.fsencode, os.listdir(fd)):
                path = folder + b"/" + name
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                found.append((path, info))
                if stat.S_ISDIR(info.st_mode):
                    pending.append((path, os.open(name, _DIR, dir_fd=fd)))
        finally:
            os.close(fd)
    return found


def _read_at(target: bytes, path: bytes) -> bytes:
    parent, name = path.rsplit(b"/", 1)
    fd = _folder_fd(target, parent)
    try:
        handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(handle, "rb") as stream:
        return stream.read()


def check_snapshot(
    layers: tuple[bytes, bytes, bytes], result: _view.Snapshot, hidden: list[bytes], honest: bool = True
) -> None:
    """What every snapshot of a hostile layer must be (see the module docstring)."""
    lower, upper, target = layers
    # The report is bounded and printable, whatever the names.
    assert len(result.concealed) <= CONCEALED_SHOWN + 1, len(result.concealed)
    assert result.concealed_count >= min(len(result.concealed), CONCEALED_SHOWN)
    for line in result.concealed:
        assert len(line) <= CONCEALED_TEXT_CAP and line.isprintable(), line
        line.encode("utf-8")  # no lone surrogate: it is written to logs and JSON as it is
    assert len(pickle.dumps(result)) < 128 << 10
    # The hostile entries that cannot be judged are not laid.
    for path in hidden:
        assert not _lexists(target, path), (path[:300], result.concealed)
    policy = LinkPolicy()
    for path, info in _laid(target):
        # Nothing deeper or longer than the walk judges; nothing the agent's layer does not hold.
        assert path.count(b"/") <= MAX_DEPTH + 1 and len(path) <= MAX_PATH_BYTES, path[:300]
        whiteout = stat.S_ISCHR(info.st_mode) and info.st_rdev == 0
        assert whiteout or _lexists(upper, path), path[:300]
        # Every link laid is one the link policy lets through.
        if stat.S_ISLNK(info.st_mode):
            parent = os.fsdecode(path.rsplit(b"/", 1)[0] or b"/")
            link = os.readlink(os.fsdecode(target + path)) if len(target + path) < 4000 else None
            assert link is None or policy.judge(link, parent) is None, (path, link)
        # No daemon socket the C library would ask; every .pth laid in an import folder names folders only.
        assert not (stat.S_ISSOCK(info.st_mode) and os.fsdecode(path).startswith(IMPLICIT_SOCKETS)), path
        in_site = path.startswith((SITE + b"/", b"/root/.local/lib/python3.11/site-packages/"))
        if in_site and path.endswith(b".pth") and stat.S_ISREG(info.st_mode) and not _lexists(lower, path):
            text = _read_at(target, path)
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            assert b"\0" not in text and len(lines) <= _view.PTH_MAX_LINES, path
            assert all(line.startswith(b"/") for line in lines), (path, text[:200])
    if honest:  # the walk went on past what it could not judge
        for path, data in HONEST.items():
            assert _read_at(target, path) == data, (path, result.concealed)


def _fill(rng: random.Random, upper: bytes, count: int) -> list[bytes]:
    """The honest changes, then ``count`` hostile ones; the paths that must not be seen."""
    for path, data in HONEST.items():
        _make(upper, path, "file", data)
    hidden: list[bytes] = []
    for _ in range(count):
        hidden += MAKERS[rng.choice(list(MAKERS))](rng, upper, rng.choice(PARENTS))
    return hidden


def _timeout(seconds: float, func: Callable[[], object]) -> object:
    """``func()`` in a thread, failing the test if it does not return in ``seconds`` (a walk that waits on a FIFO)."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = func()
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the walk did not return in {seconds} s (it waits on something the agent left)"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")


# ── the generated test ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("seed", range(24))
def test_the_walk_never_raises_and_never_lays_what_it_conceals(layers, seed: int, monkeypatch) -> None:
    """Hostile layers, generated: ``snapshot()`` and ``live_paths()`` never raise; the snapshot holds no
    hostile entry it could not judge, nothing past its bounds, and the honest changes beside them."""
    monkeypatch.setattr(_view, "MAX_ENTRIES", _SMALL_MAX_ENTRIES)
    rng = random.Random(seed)
    lower, upper, target = layers
    hidden = _fill(rng, upper, rng.randint(8, 30))
    result = _timeout(120, lambda: _snap(layers))
    assert isinstance(result, _view.Snapshot)
    check_snapshot(layers, result, hidden)
    root = os.open(upper, _DIR)
    try:
        live = live_paths(root, Path(os.fsdecode(lower)), SEARCH, WORKDIR)
    finally:
        os.close(root)
    assert all(isinstance(path, str) for path in live)


# ── what the previous walk choked on, one by one ───────────────────────────────────────


def test_a_pth_with_a_nul_byte_is_concealed(layers) -> None:
    """``os.lstat`` of a ``.pth`` line with a NUL byte raised ``ValueError``: the view failed (a skip)."""
    lower, upper, target = layers
    _make(upper, SITE + b"/evil.pth", "file", b"/opt/tool\0/x\n")
    _make(upper, b"/usr/local/bin/honest-tool", "file", b"ok")
    result = _snap(layers)
    assert not _lexists(target, SITE + b"/evil.pth")
    assert any(line.startswith(f"{SITE.decode()}/evil.pth (") for line in result.concealed), result.concealed
    assert _lexists(target, b"/usr/local/bin/honest-tool")


@pytest.mark.parametrize("source", _TOO_DEEP[:6], ids=["unary", "not", "binop", "attribute", "call", "lambda"])
def test_an_editable_finder_too_deep_to_parse_is_concealed(layers, source: bytes) -> None:
    """``ast.parse`` of such a finder raised ``MemoryError`` or ``RecursionError``: the view failed (a skip)."""
    lower, upper, target = layers
    _make(upper, SITE + b"/__editable__.x-1.0.pth", "file", b"import " + FINDER + b"; " + FINDER + b".install()\n")
    _make(upper, SITE + b"/" + FINDER + b".py", "file", b"MAPPING = " + source + b"\n")
    result = _snap(layers)
    assert not _lexists(target, SITE + b"/__editable__.x-1.0.pth"), result.concealed
    assert result.concealed_count >= 1


def test_a_current_setuptools_finder_is_read(layers) -> None:
    """setuptools >= 69 annotates its finder's ``MAPPING``: the folder it maps is named, the finder not run."""
    lower, upper, target = layers
    _make(upper, SITE + b"/__editable__.x-1.0.pth", "file", b"import " + FINDER + b"; " + FINDER + b".install()\n")
    _make(upper, SITE + b"/" + FINDER + b".py", "file", b"MAPPING: dict[str, str] = {'x': '/opt/proj/x'}\n")
    _make(upper, b"/opt/proj/x/__init__.py", "file", b"")
    _snap(layers)
    assert _read_at(target, SITE + b"/__editable__.x-1.0.pth") == b"/opt/proj\n"


def test_a_path_longer_than_the_host_allows_is_concealed(layers) -> None:
    """Laying a path past ``PATH_MAX`` in the snapshot raised ``ENAMETOOLONG``: the view failed (a skip)."""
    lower, upper, target = layers
    hidden = [b"/opt/tool/" + b"/".join([b"n" * 255] * 20) + b"/leaf.py"]  # 5,130 bytes
    _make(upper, hidden[0], "file", b"x")
    result = _snap(layers)
    check_snapshot(layers, result, hidden, honest=False)
    assert any("too long to judge" in line for line in result.concealed), result.concealed


def test_metadata_that_is_a_fifo_is_judged_without_waiting(layers) -> None:
    """A ``.pth`` naming a folder of allowed changes (laid by hard links) whose metadata's entry points are
    a FIFO: reading them waited for ever (grading hung). Now they are not read, and the ``.pth`` is concealed."""
    lower, upper, target = layers
    _make(upper, SITE + b"/x.pth", "file", b"/opt/proj\n")
    _make(upper, b"/opt/proj/plug-1.0.dist-info/entry_points.txt", "fifo")
    result = _timeout(60, lambda: _snap(layers, allowed=("/opt/proj/*",)))
    assert not _lexists(target, SITE + b"/x.pth"), result.concealed  # type: ignore[union-attr]


def test_an_entry_that_vanishes_while_it_is_judged_is_not_laid(layers, monkeypatch) -> None:
    """Entries removed, or swapped for a FIFO, between the walk's listing and their laying (the agent's
    processes still run): the walk goes on, and lays neither the old entry nor the new one."""
    lower, upper, target = layers
    vanish = {SITE + b"/gone.py", SITE + b"/swapped.pth", SITE + b"/newpkg/gone.py", SITE + b"/newpkg/gonedir"}
    for path in vanish - {SITE + b"/newpkg/gonedir"}:
        _make(upper, path, "file", b"/opt\n")
    _make(upper, SITE + b"/newpkg/gonedir/__init__.py", "file", b"x")
    _make(upper, SITE + b"/newpkg/__init__.py", "file", b"")
    for path, data in HONEST.items():
        _make(upper, path, "file", data)

    def act(path: bytes) -> None:  # what the agent's process does, at the point the walk judges ``path``
        if path in vanish:
            full = upper + path
            if os.path.isdir(full):
                os.rename(full, full + b".moved")
            else:
                os.unlink(full)
                if full.endswith(b".pth"):
                    os.mkfifo(full)

    judge, own_entries = _view._Rule.concealed_change, _view._Rule.own_entries

    def judging_change(self, path: str, shipped: bool, folder: bool, link: bool) -> str | None:
        act(os.fsencode(path))
        return judge(self, path, shipped, folder, link)

    def judging_own(self, folder: str) -> Callable[[str], str | None]:
        own = own_entries(self, folder)
        return lambda name: (act(os.fsencode(f"{folder}/{name}")), own(name))[1]

    monkeypatch.setattr(_view._Rule, "concealed_change", judging_change)
    monkeypatch.setattr(_view._Rule, "own_entries", judging_own)
    result = _timeout(60, lambda: _snap(layers))
    assert isinstance(result, _view.Snapshot)
    for path in vanish:
        assert not _lexists(target, path), (path, result.concealed)
    check_snapshot(layers, result, [])


def test_an_error_of_the_walks_own_code_conceals_the_entry_and_the_walk_goes_on(layers, monkeypatch, caplog) -> None:
    """A bug of the rule's (a ``TypeError`` on one entry) conceals that entry, fail closed, and is logged."""
    lower, upper, target = layers
    for path, data in HONEST.items():
        _make(upper, path, "file", data)
    _make(upper, b"/usr/local/bin/trips", "file", b"x")
    judge = _view._Rule.concealed_change

    def buggy(self, path: str, shipped: bool, folder: bool, link: bool) -> str | None:
        if path.endswith("/trips"):
            raise TypeError("a bug of the rule's")
        return judge(self, path, shipped, folder, link)

    monkeypatch.setattr(_view._Rule, "concealed_change", buggy)
    with caplog.at_level("WARNING", logger="harbor_local_sandbox._view"):
        result = _snap(layers)
    assert not _lexists(target, b"/usr/local/bin/trips")
    assert "/usr/local/bin/trips (could not be judged: TypeError)" in result.concealed
    assert result.unjudged == 1 and "a bug of the rule's" in caplog.text
    check_snapshot(layers, result, [], honest=True)


def test_the_snapshots_storage_full_is_raised_as_it_is(tmp_path: Path) -> None:
    """``ENOSPC`` on the snapshot's file system (the agent's own, bounded storage) is not an entry's: it is
    raised as it is, for grading to score the rollout as one that filled its storage."""
    fs = tmp_path / "fs"
    fs.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=400", "walk-test", str(fs)], check=False)
    if mounted.returncode != 0:
        pytest.skip("no tmpfs of the test's own (mount failed)")
    try:
        lower, upper, target = os.fsencode(tmp_path / "image"), os.fsencode(fs / "upper"), os.fsencode(fs / "snapshot")
        for path in (lower, upper, target):
            os.mkdir(path)
        _image(lower)
        for index in range(60):  # folders of the agent's: each is a folder again in the snapshot
            _make(upper, b"/opt/f%d/x" % index, "file", b"x")
        filler = fs / "filler"
        filler.mkdir()
        with contextlib.suppress(OSError):
            for index in range(1000):  # the agent's storage, full but for a few inodes
                os.mknod(filler / str(index), stat.S_IFREG | 0o600)
        for index in range(3):
            os.unlink(filler / str(index))
        with pytest.raises(OSError) as raised:
            _snap((lower, upper, target))
        assert raised.value.errno == errno.ENOSPC
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


# ── the report, whatever the number of changes ─────────────────────────────────────────


@pytest.mark.parametrize("count", [1_000, 250_000])
def test_the_report_is_bounded_whatever_the_layer_holds(layers, count: int) -> None:
    """A layer of ``count`` concealed changes (hooks in a new package): the snapshot names the first
    ``CONCEALED_SHOWN`` and counts them all; what crosses to the trainer is the same size for 250,000 as
    for 1,000 (it was 94 MiB for 250,000)."""
    lower, upper, target = layers
    fd = _folder_fd(upper, SITE + b"/newpkg")
    try:
        for index in range(count):
            os.mknod(b"sitecustomize%06d.py" % index, stat.S_IFREG | 0o644, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        result = _snap(layers)
    finally:
        shutil.rmtree(os.fsdecode(upper))  # not left to pytest's kept temporary folders
    assert result.concealed_count == count
    assert len(result.concealed) == CONCEALED_SHOWN + 1
    assert result.concealed[0] == f"{SITE.decode()}/newpkg/sitecustomize000000.py (an interpreter hook)"
    assert result.concealed[-1] == (
        f"... and {count - CONCEALED_SHOWN} more changes the verifier does not see ({count} in all)"
    )
    assert len(pickle.dumps(result)) < 16 << 10
