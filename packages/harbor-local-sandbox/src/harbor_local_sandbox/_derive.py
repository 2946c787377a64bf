"""Code places derived from an image: where its own loader and interpreters will look, read from its files.

The verifier's view conceals what the agent changed where code is looked up (``_view.py``). Some of
those places are not lists anyone can write down once: they are computed, at run time, by the
image's own programs from the image's own files —

* **the loader**: a binary's ``DT_RUNPATH``/``DT_RPATH`` names folders searched *before* the loader
  cache and the system folders (often build folders absent from the image: ``/build/lib``), and its
  ``PT_INTERP`` names the loader itself;
* **CPython's path computation** (``Modules/getpath.py`` in 3.11+, ``Modules/getpath.c`` before):
  ``pyvenv.cfg`` beside the executable or one folder up, ``<executable>._pth``, the build-tree
  markers ``pybuilddir.txt`` and ``Modules/Setup.local`` beside the real executable, and the
  standard library's landmarks (``lib/pythonX.Y/os.py``, ``lib/pythonX.Y/lib-dynload``,
  ``lib/pythonXY.zip``, a build tree's ``Lib/os.py``) searched from the executable's folder up to
  ``/`` — the first found is the prefix, so a landmark the agent adds *above or beside* the image's
  own (``/usr/bin/lib/python3.11/os.py``) becomes the verifier's standard library; then ``site``
  adds the site folders of that prefix that exist (an absent one the agent makes is imported from);
* **package managers**: a folder of package archives or an index (wheels, ``.deb``, apt's lists)
  from which an installer the verifier runs takes the archive the agent planted.

So they are derived here, when an image is prepared (once per image: ``_view.search_paths``), by
reading the image itself — never by running it, never following a link out of it: every path is
resolved as inside the image root (a chroot would). Everything is bounded (files read, bytes per
file, entries listed) and never raises on what it reads: an image's file is the image's, but a
malformed one must not stop grading.

What is derived is conservative: where the image's programs could look in more than one place
(a ``$PLATFORM`` token, an unknown interpreter version, a ``PLATLIBDIR`` that may be ``lib`` or
``lib64``), every plausible place is a code place.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = [
    "Derived",
    "ElfFacts",
    "ElfScan",
    "PythonPlaces",
    "derive",
    "elf_facts",
    "escape_glob",
    "library_globs",
    "loader_search_dirs",
    "package_folders",
    "package_globs",
    "python_executables",
    "python_landmarks",
    "python_places",
    "realised",
    "resolve",
    "scan_elf",
]

#: ELF files read at most by one scan (the rest are not read: :attr:`ElfScan.truncated`).
MAX_ELF_FILES = 20_000
#: Folder entries listed at most by one scan, and by one walk for package folders.
MAX_LISTED = 200_000
#: Bytes read from one ELF file at most (its header, program headers, dynamic section and the strings
#: they name; never its whole content: a 2 GB library costs what a small one does).
MAX_ELF_BYTES = 256 << 10
#: Bytes of program headers read at most (the kernel refuses an executable with more).
_MAX_PHDR_BYTES = 64 << 10
#: Bytes of one dynamic section read at most.
_MAX_DYNAMIC_BYTES = 64 << 10
#: Longest string read from a string table (a path: the kernel's ``PATH_MAX``).
_MAX_STRING = 4096
#: ``DT_NEEDED`` entries read per file at most (only those naming a path or libpython matter).
_MAX_NEEDED = 128
#: Expansions of one search-path entry at most (``$LIB`` × ``$PLATFORM`` × ``$ORIGIN``s).
_MAX_EXPANSIONS = 256
#: Links followed resolving one path (the kernel's limit).
_MAX_HOPS = 40
#: Bytes of a ``pyvenv.cfg`` read at most.
_MAX_CFG = 64 << 10
#: Folders below a deep-scanned folder entered at most deep (extension modules of packages).
_MAX_DEPTH = 24
#: Rounds of scanning the folders the RUNPATHs found name (a library there has its own).
_ROUNDS = 3

_PT_LOAD, _PT_DYNAMIC, _PT_INTERP = 1, 2, 3
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 15, 29
_ET_EXEC, _ET_DYN = 2, 3
_EM_386, _EM_ARM, _EM_PPC64, _EM_S390, _EM_X86_64, _EM_AARCH64, _EM_RISCV = 3, 40, 21, 22, 62, 183, 243

#: What ``$PLATFORM`` (the kernel's ``AT_PLATFORM``, or glibc's own choice on x86-64 before 2.37) may
#: be, per machine; an unknown machine's: all of them.
_PLATFORMS: dict[int, tuple[str, ...]] = {
    _EM_X86_64: ("x86_64", "haswell", "xeon_phi"),
    _EM_386: ("i386", "i486", "i586", "i686"),
    _EM_AARCH64: ("aarch64",),
    _EM_ARM: ("v5l", "v6l", "v7l", "v8l"),
    _EM_PPC64: ("power7", "power8", "power9", "power10", "ppc64", "ppc64le"),
    _EM_S390: ("s390", "s390x", "z13", "z14", "z15"),
    _EM_RISCV: ("riscv64",),
}
#: What ``$LIB`` may be (glibc's ``slibdir`` basename, per distribution and machine), besides
#: ``lib/<triplet>`` for every multiarch triplet of the image.
_LIBS = ("lib", "lib64", "lib32", "libx32")
_TRIPLETS = (
    "x86_64-linux-gnu", "i386-linux-gnu", "aarch64-linux-gnu", "arm-linux-gnueabihf", "powerpc64le-linux-gnu",
    "s390x-linux-gnu", "riscv64-linux-gnu",
)  # fmt: skip
#: The interpreters whose path computation is derived (``python3``, ``python3.11``, ``python3.13t``,
#: ``python3.7m``, ``python3.11-dbg``), not ``python3-config`` nor other tools named ``python*``.
_PYTHON_NAME = re.compile(r"^python(?:\d+(?:\.\d+)?)?[dmtu]*(?:-dbg)?$")
_VERSION_IN_NAME = re.compile(r"python(\d)\.(\d+)")
_LIBPYTHON = re.compile(r"^libpython(\d)\.(\d+)")
#: Python's platform library folder names (``PLATLIBDIR``: ``lib``; ``lib64`` on Fedora and SUSE).
PLATLIBDIRS = ("lib", "lib64")
#: Files that make a folder a package folder by themselves (an archive an installer takes, an index).
_ARCHIVES = (".whl", ".deb", ".udeb", ".rpm", ".apk", ".egg", ".conda")
_INDEXES = frozenset(
    {
        "Packages",
        "Packages.gz",
        "Packages.xz",
        "Packages.bz2",
        "Release",
        "InRelease",
        "repodata.json",
        "APKINDEX.tar.gz",
    }
)
#: Source archives: code in a package folder (``pip --find-links`` takes them beside wheels), not
#: what makes a folder one (a folder of tarballs is data as often).
_SDISTS = (".tar.gz", ".zip", ".tar.bz2", ".tgz", ".tar.xz")
#: Folders never walked for package folders (the kernel's, the verifier's own temporary files).
_NOT_WALKED = frozenset({"/proc", "/sys", "/dev", "/tmp", "/run"})


# ── paths inside the image ──────────────────────────────────────────────────────────────────────


def resolve(root: str | os.PathLike[str], path: str, hops: int = _MAX_HOPS) -> tuple[str, bool] | None:
    """The sandbox path ``path`` of the image at ``root`` with its links resolved inside the image.

    Every component is resolved as the kernel would in a chroot at ``root`` (an absolute link starts
    again at the image's ``/``, ``..`` goes to the resolved parent, never above ``/``); a link is read,
    never followed on the host. Where a component does not exist (or is a file with more below it),
    the rest is appended as written, normalised: that is where the entry would be if it were made.

    Args:
        root: The image's root folder on the host.
        path: An absolute sandbox path.
        hops: Links followed at most.

    Returns:
        The resolved sandbox path and whether it exists; ``None`` for a loop, or a path that cannot be
        looked up (a NUL byte).
    """
    base = os.fspath(root)
    if "\0" in path:
        return None
    pending = [p for p in reversed(path.split("/")) if p and p != "."]
    current = ""  # resolved, no trailing slash; "" is "/"
    while pending:
        part = pending.pop()
        if part == "..":
            current = current.rpartition("/")[0]
            continue
        candidate = f"{current}/{part}"
        try:
            info = os.lstat(base + candidate)
        except OSError:
            return posixpath.normpath("/".join([candidate, *reversed(pending)])), False
        if stat.S_ISLNK(info.st_mode):
            hops -= 1
            if hops < 0:
                return None
            try:
                target = os.readlink(base + candidate)
            except OSError:
                return None
            if target.startswith("/"):
                current = ""
            pending.extend(p for p in reversed(target.split("/")) if p and p != ".")
            continue
        if pending and not stat.S_ISDIR(info.st_mode):
            return posixpath.normpath("/".join([candidate, *reversed(pending)])), False
        current = candidate
    return current or "/", True


def realised(root: str, path: str) -> list[str]:
    """``path`` as written (normalised) and where it is in the image (links resolved), deduplicated."""
    found = [posixpath.normpath(path)]
    resolved = resolve(root, path)
    if resolved is not None and resolved[0] not in found:
        found.append(resolved[0])
    return found


def escape_glob(path: str) -> str:
    """``path`` as an ``fnmatch`` glob that matches it alone (its ``*``, ``?`` and ``[`` made literal)."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def _ancestors(folder: str) -> list[str]:
    """``folder`` and every folder above it, ``/`` last."""
    found, current = [], posixpath.normpath(folder)
    while True:
        found.append(current)
        if current == "/":
            return found
        current = posixpath.dirname(current)


def _listdir(root: str, folder: str) -> list[str]:
    try:
        return sorted(os.listdir(root + folder if folder != "/" else root))
    except (OSError, ValueError):
        return []


def _read_small(host_path: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of a regular file, never through a link at its last component, never
    waiting on a FIFO; ``None`` if it is not one or cannot be read."""
    try:
        fd = os.open(host_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


# ── ELF: the dynamic section ────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class ElfFacts:
    """What the loader reads of one ELF file to find code (raw, before any expansion).

    Attributes:
        machine: ``e_machine`` (62: x86-64).
        rpath: ``DT_RPATH`` entries (``:``-separated, in order; several tags joined).
        runpath: ``DT_RUNPATH`` entries.
        interpreter: ``PT_INTERP``, the loader it names (``None``: none).
        needed: ``DT_NEEDED`` names (at most :data:`_MAX_NEEDED`).
        bytes_read: Bytes read of the file.
    """

    machine: int = 0
    rpath: tuple[str, ...] = ()
    runpath: tuple[str, ...] = ()
    interpreter: str | None = None
    needed: tuple[str, ...] = ()
    bytes_read: int = 0


class _Reader:
    """Reads of one open file at offsets, within a byte budget (past it, reads return nothing)."""

    def __init__(self, fd: int, size: int, budget: int) -> None:
        self.fd, self.size, self.left, self.used = fd, size, budget, 0

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length <= 0 or offset >= self.size:
            return b""
        length = min(length, self.left, self.size - offset)
        if length <= 0:
            return b""
        try:
            data = os.pread(self.fd, length, offset)
        except (OSError, OverflowError, ValueError):
            return b""
        self.left -= len(data)
        self.used += len(data)
        return data

    def cstring(self, offset: int) -> str | None:
        """The NUL-terminated string at ``offset`` (decoded as the kernel takes paths: bytes kept)."""
        data = self.read(offset, 256)
        end = data.find(b"\0")
        if end < 0 and len(data) == 256:
            data = self.read(offset, _MAX_STRING)
            end = data.find(b"\0")
        if end < 0:
            return None
        return os.fsdecode(data[:end])


def elf_facts(host_path: str | os.PathLike[str], budget: int = MAX_ELF_BYTES) -> ElfFacts | None:
    """Read an ELF file's dynamic section and interpreter (32- or 64-bit, either byte order).

    Only the parts the loader uses are read — the file header, the program headers, each
    ``PT_DYNAMIC`` segment, ``PT_INTERP``, and the strings of the string table they name (mapped
    from its address through the ``PT_LOAD`` segments) — at most ``budget`` bytes in all. The file
    is opened without following a link at its last component and without waiting on a FIFO.

    Args:
        host_path: The file on the host.
        budget: Bytes read at most.

    Returns:
        Its facts; ``None`` if it is not a readable executable or shared-object ELF file. Never raises:
        what is malformed (offsets past the end, a string without its end, a count too large) is
        skipped.
    """
    try:
        fd = os.open(host_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        return _elf_facts(_Reader(fd, info.st_size, budget))
    except (OSError, struct.error, ValueError, OverflowError, IndexError):
        return None
    finally:
        os.close(fd)


def _elf_facts(reader: _Reader) -> ElfFacts | None:
    head = reader.read(0, 64)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return None
    wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
    if wide:
        if len(head) < 64:
            return None
        e_type, machine, _, _, phoff, _, _, _, phentsize, phnum = struct.unpack(order + "HHIQQQIHHH", head[16:58])
        ph_format, ph_size = order + "IIQQQQ", 48  # type, flags, offset, vaddr, paddr, filesz
        dyn_format, dyn_size = order + "qQ", 16
    else:
        e_type, machine, _, _, phoff, _, _, _, phentsize, phnum = struct.unpack(order + "HHIIIIIHHH", head[16:46])
        ph_format, ph_size = order + "IIIIII", 24  # type, offset, vaddr, paddr, filesz, memsz
        dyn_format, dyn_size = order + "iI", 8
    if e_type not in (_ET_EXEC, _ET_DYN) or phentsize < ph_size or phnum == 0:
        return None
    table = reader.read(phoff, min(phnum * phentsize, _MAX_PHDR_BYTES))
    loads: list[tuple[int, int, int]] = []  # (vaddr, filesz, offset)
    dynamics: list[tuple[int, int]] = []  # (offset, filesz)
    interpreter = None
    for start in range(0, len(table) - ph_size + 1, phentsize):
        if wide:
            p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(ph_format, table, start)
        else:
            p_type, p_offset, p_vaddr, _, p_filesz, _ = struct.unpack_from(ph_format, table, start)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_filesz, p_offset))
        elif p_type == _PT_DYNAMIC:
            dynamics.append((p_offset, p_filesz))
        elif p_type == _PT_INTERP and interpreter is None:
            data = reader.read(p_offset, min(p_filesz, _MAX_STRING))
            end = data.find(b"\0")
            interpreter = os.fsdecode(data[: end if end >= 0 else len(data)]) or None
    strtabs: list[int] = []
    refs: dict[int, list[int]] = {_DT_NEEDED: [], _DT_RPATH: [], _DT_RUNPATH: []}
    for offset, size in dynamics:
        data = reader.read(offset, min(size, _MAX_DYNAMIC_BYTES))
        for start in range(0, len(data) - dyn_size + 1, dyn_size):
            tag, value = struct.unpack_from(dyn_format, data, start)
            if tag == _DT_NULL:
                break
            if tag == _DT_STRTAB:
                strtabs.append(value)
            elif tag in refs and len(refs[tag]) < _MAX_NEEDED:
                refs[tag].append(value)
    strings: dict[int, list[str]] = {tag: [] for tag in refs}
    for address in dict.fromkeys(strtabs):  # every string table named (the loader takes the last)
        base = _file_offset(address, loads)
        if base is None:
            continue
        for tag, offsets in refs.items():
            for value in offsets:
                text = reader.cstring(base + value)
                if text is not None:
                    strings[tag].append(text)
    return ElfFacts(
        machine=machine,
        rpath=tuple(e for s in strings[_DT_RPATH] for e in s.split(":")),
        runpath=tuple(e for s in strings[_DT_RUNPATH] for e in s.split(":")),
        interpreter=interpreter,
        needed=tuple(dict.fromkeys(strings[_DT_NEEDED])),
        bytes_read=reader.used,
    )


def _file_offset(address: int, loads: Sequence[tuple[int, int, int]]) -> int | None:
    """The file offset of the virtual address ``address`` (through the segment that maps it from the file)."""
    for vaddr, filesz, offset in loads:
        if vaddr <= address < vaddr + filesz:
            return offset + (address - vaddr)
    return None


_DST = re.compile(r"\$(?:\{(ORIGIN|LIB|PLATFORM)\}|(ORIGIN|LIB|PLATFORM)(?![A-Za-z0-9_]))")


def _expand(entry: str, origins: Iterable[str], machine: int, triplets: Iterable[str]) -> list[str]:
    """What one RUNPATH/RPATH entry may name, once its tokens are expanded (absolute or relative).

    ``$ORIGIN`` is each folder the object may be found in (``origins``); ``$LIB`` and ``$PLATFORM``
    every value glibc may give them (:data:`_LIBS`, ``lib/<triplet>`` for the image's multiarch
    triplets, :data:`_PLATFORMS`). An unknown ``$TOKEN`` stays as written (glibc copies it).
    """
    values = {
        "ORIGIN": list(dict.fromkeys(origins)),
        "LIB": list(dict.fromkeys([*_LIBS, *(f"lib/{t}" for t in triplets)])),
        "PLATFORM": list(dict.fromkeys(_PLATFORMS.get(machine) or [p for v in _PLATFORMS.values() for p in v])),
    }
    found = [""]
    position = 0
    for match in _DST.finditer(entry):
        token = match.group(1) or match.group(2)
        found = [f"{f}{entry[position : match.start()]}{v}" for f in found for v in values[token]][:_MAX_EXPANSIONS]
        position = match.end()
    return [f + entry[position:] for f in found]


#: The subfolders the loader tries below each of its folders (``glibc-hwcaps/<level>`` since glibc
#: 2.33; the legacy hardware-capability folders before 2.37).
_HWCAP_FOLDERS = ("glibc-hwcaps/*", "tls", "x86_64", "haswell", "xeon_phi", "avx512_1", "i686", "sse2", "aarch64")


def library_globs(folder: str, names: Iterable[str]) -> list[str]:
    """Globs of the library files named ``names`` the loader would take from ``folder`` (and its
    hardware-capability subfolders): how a folder too wide to be a loader folder (``/``, ``/app``) is
    judged instead. Names, not ``*.so*``: the view's globs match across ``/`` (``fnmatch``), so a
    wildcard would take every library below the folder."""
    base = escape_glob(folder.rstrip("/"))
    found: list[str] = []
    for name in sorted({n for n in names if n and "/" not in n}):
        literal = escape_glob(name)
        found += [f"{base}/{literal}", *(f"{base}/{sub}/{literal}" for sub in _HWCAP_FOLDERS)]
    return found


@dataclass(frozen=True)
class ElfScan:
    """The code places the image's ELF files name for the loader.

    Attributes:
        present: ``RUNPATH``/``RPATH`` folders the image has (resolved in it): the loader searches them
            before its cache, as it does its own folders.
        absent: Those it lacks (or that are not folders in it), as written and resolved as far as the
            image goes. The loader searches them before its cache and no honest install makes them (a
            build folder, another machine's prefix), so everything the agent adds there is code.
        wide: Globs of the library files of ``RUNPATH`` folders too wide to be loader folders (``/``, a
            top-level folder such as the task's ``/app``: a loader folder's every entry below is a code
            place, and those hold the agent's work): there, the libraries the image's objects need are
            code (:func:`library_globs`), whether the image has the folder or not.
        interpreters: The loaders ``PT_INTERP`` names, and ``DT_NEEDED`` entries that are absolute paths
            (as written and resolved): files the image's programs run or load by path.
        relative: Relative entries found (an empty one included): relative to the working directory of
            the process, which the image does not say. Not made code places (see :func:`scan_elf`).
        versions: Python versions named by ``DT_NEEDED`` (``libpython3.11.so.1.0``), per real file.
        files_read: ELF files read.
        bytes_read: Bytes read of them.
        truncated: Whether a bound stopped the scan before it read every file.
    """

    present: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    wide: tuple[str, ...] = ()
    interpreters: tuple[str, ...] = ()
    relative: tuple[str, ...] = ()
    versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    files_read: int = 0
    bytes_read: int = 0
    truncated: bool = False


#: Where no RUNPATH folder is a code place: the kernel's (no one makes entries there).
_KERNEL = ("/proc", "/sys", "/dev")


class _ElfScanner:
    """One scan: each real file read once, with every folder it was found in (as a command or a library)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.triplets = sorted(
            {n for base in ("/lib", "/usr/lib") for n in _listdir(root, base) if "-linux-gnu" in n} | set(_TRIPLETS)
        )
        self.found_in: dict[str, set[str]] = {}  # real sandbox path -> folders it was found in as a library
        self.commands: set[str] = set()  # real sandbox paths found as commands
        self.listed = 0
        self.truncated = False

    def collect(self, folder: str, libraries: bool, deep: bool) -> None:
        """Note the files of ``folder`` (commands; or ``.so`` names, as ``libraries``), and below it if ``deep``."""
        start = resolve(self.root, folder)
        if start is None or not start[1]:
            return
        # (as written, where it is in the image): below a resolved folder, a folder that is no link is
        # where its name says, and so is a file; only links are resolved again
        pending = [(posixpath.normpath(folder), start[0], 0)]
        while pending:
            current, real, depth = pending.pop()
            try:
                listing = os.scandir(self.root + real if real != "/" else self.root)
            except (OSError, ValueError):
                continue
            with listing:
                for entry in listing:
                    self.listed += 1
                    if self.listed > MAX_LISTED or len(self.found_in) + len(self.commands) >= MAX_ELF_FILES:
                        self.truncated = True
                        return
                    name = entry.name
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                        is_link = not is_dir and entry.is_symlink()
                    except OSError:
                        continue
                    if is_dir:
                        if deep and depth < _MAX_DEPTH and name != "__pycache__":
                            pending.append((posixpath.join(current, name), posixpath.join(real, name), depth + 1))
                        continue
                    if libraries and ".so" not in name:
                        continue
                    if is_link:
                        target = resolve(self.root, posixpath.join(real, name))
                        if target is None or not target[1]:
                            continue
                        path = target[0]
                    else:
                        path = posixpath.join(real, name)
                    if libraries:
                        self.found_in.setdefault(path, set()).add(current)
                    else:
                        self.commands.add(path)

    def origins(self, real: str) -> set[str]:
        """What ``$ORIGIN`` may be for the file ``real``: a program's real folder (the loader reads
        ``/proc/self/exe``); a library's folder as it was found (glibc keeps the path it opened)."""
        return {posixpath.dirname(real), *self.found_in.get(real, ())}

    def read(self, done: set[str]) -> tuple[dict[str, ElfFacts], int]:
        """Read the noted files not read yet; their facts, and the bytes read."""
        found: dict[str, ElfFacts] = {}
        spent = 0
        for real in sorted({*self.commands, *self.found_in}):
            if real in done:
                continue
            if len(done) >= MAX_ELF_FILES:
                self.truncated = True
                break
            done.add(real)
            facts = elf_facts(self.root + real)
            if facts is not None:
                found[real] = facts
                spent += facts.bytes_read
        return found, spent


def scan_elf(
    image_root: str | os.PathLike[str], folders: Iterable[str], deep: Iterable[str] = (), libraries: Iterable[str] = ()
) -> ElfScan:
    """The folders and files the image's ELF files name for the loader (``RUNPATH``, ``RPATH``, ``PT_INTERP``).

    The files read are those of ``folders`` (every file: commands), the ``.so`` files of ``libraries``
    and those anywhere below ``deep`` (Python's import folders: an extension module loads its own
    dependencies through its RUNPATH); then the ``.so`` files of the RUNPATH folders found, a few
    rounds (a library there has its own). Links are resolved inside the image; each real file is
    read once. ``$ORIGIN`` is a command's real folder, and a library's real folder or any folder it
    was found in.

    A relative entry (``lib``, ``.``, an empty one) is relative to the working directory of the
    process that loads the object — the verifier's is the task's, which is the agent's and seen live —
    so no folder of the image is its place: it is reported (:attr:`ElfScan.relative`), not made a code
    place. The loader resolves such an entry against whatever the current folder is, so no toolchain
    emits one on purpose; we know of no image that ships one.

    Args:
        image_root: The image's root folder on the host.
        folders: Folders whose every file is read (the ``PATH`` folders).
        deep: Folders walked for ``.so`` files (bounded: :data:`MAX_LISTED`, :data:`MAX_ELF_FILES`).
        libraries: Folders whose ``.so`` files are read (the loader's folders).

    Returns:
        The scan (see :class:`ElfScan`).
    """
    root = os.fspath(image_root)
    scanner = _ElfScanner(root)
    for folder in dict.fromkeys(f for f in folders if f.startswith("/")):
        scanner.collect(folder, libraries=False, deep=False)
    for folder in dict.fromkeys(f for f in libraries if f.startswith("/")):
        scanner.collect(folder, libraries=True, deep=False)
    for folder in dict.fromkeys(f for f in deep if f.startswith("/")):
        scanner.collect(folder, libraries=True, deep=True)
    present: dict[str, None] = {}
    absent: dict[str, None] = {}
    wide: dict[str, set[str]] = {}  # folder -> the library names it serves ("*": every one needed)
    needed: set[str] = set()
    interpreters: dict[str, None] = {}
    relative: dict[str, None] = {}
    versions: dict[str, tuple[int, int]] = {}
    done: set[str] = set()
    files_read = bytes_read = 0
    for _ in range(_ROUNDS):
        facts, spent = scanner.read(done)
        files_read += len(facts)
        bytes_read += spent
        new_folders: list[str] = []
        for real, fact in facts.items():
            needed.update(fact.needed)
            for name in fact.needed:
                match = _LIBPYTHON.match(name)
                if match:
                    versions[real] = (int(match.group(1)), int(match.group(2)))
                elif name.startswith("/"):
                    interpreters.update(dict.fromkeys(realised(root, name)))
            if fact.interpreter and fact.interpreter.startswith("/"):
                interpreters.update(dict.fromkeys(realised(root, fact.interpreter)))
            for entry in (*fact.runpath, *fact.rpath):
                for folder in _expand(entry, scanner.origins(real), fact.machine, scanner.triplets):
                    if not folder.startswith("/"):
                        relative[entry] = None
                        continue
                    literal = posixpath.normpath(folder)
                    if any(literal == k or literal.startswith(k + "/") for k in _KERNEL):
                        continue
                    resolved = resolve(root, literal)
                    place, exists = resolved if resolved is not None else (literal, False)
                    if place.count("/") <= 1 and (not exists or _is_folder(root, place)):
                        # a RUNPATH's folders serve the object's own dependencies; an RPATH's, the
                        # dependencies of every object the program loads
                        names = fact.needed if entry in fact.runpath else ("*",)
                        wide.setdefault(place, set()).update(names)
                    elif exists and _is_folder(root, place):
                        if place not in present:
                            new_folders.append(place)
                            present[place] = None
                    else:
                        absent.update(dict.fromkeys((literal, place)))
        if not new_folders:
            break
        for folder in new_folders:
            scanner.collect(folder, libraries=True, deep=False)
    return ElfScan(
        present=tuple(present),
        absent=tuple(a for a in absent if a not in present),
        wide=tuple(
            glob for folder, names in wide.items() for glob in library_globs(folder, needed if "*" in names else names)
        ),
        interpreters=tuple(interpreters),
        relative=tuple(relative),
        versions=versions,
        files_read=files_read,
        bytes_read=bytes_read,
        truncated=scanner.truncated,
    )


def _is_folder(root: str, path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(root + path if path != "/" else root).st_mode)
    except (OSError, ValueError):
        return False


def loader_search_dirs(image_root: str | os.PathLike[str], folders: Iterable[str]) -> tuple[str, ...]:
    """The ``RUNPATH``/``RPATH`` folders the ELF files of ``folders`` name (normalised sandbox paths).

    Every file of each folder is read (commands and libraries alike; links resolved inside the
    image), then the libraries of the folders found. Folders the image lacks are included: the
    loader searches them before its cache (:class:`ElfScan` tells them apart).

    Args:
        image_root: The image's root folder on the host.
        folders: Sandbox folders (``PATH`` folders, library folders).

    Returns:
        The folders, deduplicated, those the image has first.
    """
    scan = scan_elf(image_root, folders)
    return (*scan.present, *scan.absent)


# ── CPython's path computation ──────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class PythonPlaces:
    """What the image's Python interpreters consult to find their standard library and site folders.

    Attributes:
        landmarks: Globs of the files and folders their path computation tests (``pyvenv.cfg``,
            ``._pth``, build-tree markers, the standard library's landmarks from the executable's
            folder up to ``/``): code configuration — the image's kept as shipped, the agent's
            additions not seen.
        site_folders: The import folders their ``site`` module would add if they existed (and their
            standard library folders), as found in the image: judged as Python's.
        user_sites: Their user site folders under ``/root`` (every home's, in the view).
        interpreters: The real paths of the interpreters found, with their versions (``None``: unknown).
    """

    landmarks: tuple[str, ...] = ()
    site_folders: tuple[str, ...] = ()
    user_sites: tuple[str, ...] = ()
    interpreters: dict[str, tuple[int, int] | None] = field(default_factory=dict)


def python_executables(image_root: str | os.PathLike[str], folders: Iterable[str]) -> list[str]:
    """The Python interpreters of ``folders`` (``python``, ``python3``, ``python3.11``, ...), as named there."""
    root = os.fspath(image_root)
    return [
        f"{folder.rstrip('/')}/{name}"
        for folder in dict.fromkeys(f for f in folders if f.startswith("/"))
        for name in _listdir(root, folder)
        if _PYTHON_NAME.match(name)
    ]


def _link_chain(root: str, path: str) -> list[str]:
    """``path`` and each path its link chain passes through (a link read, its folder kept as written),
    as CPython before 3.11 follows it (``readlink`` of the executable, not of its folders)."""
    chain = [posixpath.normpath(path)]
    for _ in range(_MAX_HOPS):
        resolved = resolve(root, posixpath.dirname(chain[-1]))
        if resolved is None or not resolved[1]:
            break
        host = f"{root}{resolved[0] if resolved[0] != '/' else ''}/{posixpath.basename(chain[-1])}"
        try:
            target = os.readlink(host)
        except (OSError, ValueError):
            break
        following = posixpath.normpath(posixpath.join(posixpath.dirname(chain[-1]), target))
        if following in chain:
            break
        chain.append(following)
    return chain


def _pyvenv(root: str, folder: str) -> tuple[str | None, tuple[int, int] | None] | None:
    """The ``home`` and ``version`` of the image's ``pyvenv.cfg`` in ``folder``; ``None`` if it has none."""
    resolved = resolve(root, f"{folder.rstrip('/')}/pyvenv.cfg")
    if resolved is None or not resolved[1]:
        return None
    data = _read_small(root + resolved[0], _MAX_CFG)
    if data is None:
        return None
    home = version = None
    for line in data.decode("utf-8", "replace").splitlines():
        key, equals, value = line.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not equals:
            continue
        if key == "home" and home is None and value.startswith("/"):
            home = posixpath.normpath(value)
        elif key in ("version", "version_info") and version is None:
            match = re.match(r"(\d)\.(\d+)", value)
            version = (int(match.group(1)), int(match.group(2))) if match else None
    return home, version


#: The versions an interpreter of unknown version may be (its names are landmarks for each: a glob
#: would match across ``/`` in the view, taking any ``os.py`` below ``lib/python3``).
_ANY_VERSION = ((2, 7), *((3, minor) for minor in range(6, 17)))


def _stdlib_names(version: tuple[int, int]) -> tuple[list[str], list[str]]:
    """The standard library's folder names (``python3.11``, a free-threaded ``python3.13t``) and zip names
    (``python311.zip``) of a version."""
    major, minor = version
    flavours = ["", "t"] if version >= (3, 13) else [""]
    return [f"python{major}.{minor}{t}" for t in flavours], [f"python{major}{minor}{t}.zip" for t in flavours]


def _versions_near(root: str, folders: Iterable[str], platlibdirs: Sequence[str]) -> set[tuple[int, int]]:
    """The versions whose standard library lies at a landmark above one of ``folders`` in the image."""
    found: set[tuple[int, int]] = set()
    for folder in folders:
        for above in _ancestors(folder):
            for lib in platlibdirs:
                for name in _listdir(root, posixpath.join(above, lib)):
                    match = re.fullmatch(r"python(\d)\.(\d+)t?", name)
                    if match and _exists_in(root, posixpath.join(above, lib, name, "os.py")):
                        found.add((int(match.group(1)), int(match.group(2))))
    return found


def _exists_in(root: str, path: str) -> bool:
    resolved = resolve(root, path)
    return resolved is not None and resolved[1]


class _Places:
    """Globs and folders collected for :class:`PythonPlaces` (each path as written and as resolved)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.landmarks: dict[str, None] = {}
        self.site: dict[str, None] = {}
        self.user: dict[str, None] = {}

    def landmark(self, folder: str, *tail: str, pattern: str | None = None) -> None:
        """The landmark ``folder/tail...`` (then ``/pattern``, a glob) as code configuration."""
        literal = posixpath.normpath(posixpath.join(folder, *tail))
        for place in realised(self.root, literal):
            self.landmarks[escape_glob(place) + (f"/{pattern}" if pattern else "")] = None

    def site_folder(self, path: str) -> None:
        """An import folder, where it is in the image (the agent's entries are made there, links resolved)."""
        resolved = resolve(self.root, path)
        self.site[resolved[0] if resolved is not None else posixpath.normpath(path)] = None


def python_places(
    image_root: str | os.PathLike[str],
    executables: Iterable[str],
    platlibdirs: Iterable[str] = PLATLIBDIRS,
    versions: dict[str, tuple[int, int]] | None = None,
) -> PythonPlaces:
    """What each Python interpreter of the image consults to find its standard library and site folders.

    For an executable found at ``E`` (as on ``PATH``), whose links lead to ``R`` (resolved inside the
    image), CPython's path computation (3.11+: ``Modules/getpath.py``; 3.6-3.10: ``Modules/getpath.c``,
    which follows only the executable's own link chain, each step's folder as written) consults:

    * ``pyvenv.cfg`` in ``dirname(E)``'s parent, then in ``dirname(E)`` (3.11+), in each chain
      step's folder and its parent (3.6-3.10) — its ``home`` then replaces the executable's folder;
    * ``E._pth`` and ``R._pth`` (3.11+; ``python3X._pth`` on Windows): any ``._pth`` beside them;
    * ``pybuilddir.txt`` and ``Modules/Setup.local`` (``Modules/Setup`` before 3.8) in the real
      executable's folder (or ``home``): build-tree mode, whose standard library is ``Lib/os.py``
      searched up from there (beside ``VPATH`` before 3.11);
    * from the executable's folder (``dirname(R)``, the chain's last step's, or ``home``) up to ``/``:
      ``{platlibdir}/pythonX.Y/os.py`` (or ``os.pyc``), ``{platlibdir}/pythonXY.zip`` (3.11+:
      searched first) and ``{platlibdir}/pythonX.Y/lib-dynload`` (the first found is the prefix).

    Each of those, as written and resolved in the image, is a landmark. The version is read from the
    executable's name or its chain's, else from its ``libpython`` (``versions``) or ``pyvenv.cfg``,
    else from the standard libraries above it; unknown, every version's names (2.7, 3.6-3.16) are landmarks.

    ``site`` then adds, per prefix found in the image (and the virtual environment's), the site
    folders that exist (``{prefix}/{platlibdir}/pythonX.Y/site-packages``; Debian's
    ``{prefix}/local/lib/pythonX.Y/dist-packages``, ``{prefix}/lib/python3/dist-packages`` and
    ``{prefix}/lib/pythonX.Y/dist-packages``; Fedora's ``{prefix}/local/{platlibdir}/...``) and the
    user site: all of them are :attr:`PythonPlaces.site_folders` (an absent one is where the agent
    could add a module under a name the image's code imports).

    Args:
        image_root: The image's root folder on the host.
        executables: Sandbox paths of the interpreters (:func:`python_executables`).
        platlibdirs: ``PLATLIBDIR`` values to consider (``lib``, ``lib64``, and the image's own).
        versions: Versions known per real executable path (from its ``DT_NEEDED``: :class:`ElfScan`).

    Returns:
        The places (see :class:`PythonPlaces`).
    """
    root = os.fspath(image_root)
    libdirs = list(dict.fromkeys(platlibdirs))
    places = _Places(root)
    interpreters: dict[str, tuple[int, int] | None] = {}
    for executable in dict.fromkeys(e for e in executables if e.startswith("/")):
        resolved = resolve(root, executable)
        if resolved is None or not resolved[1]:
            continue
        real = resolved[0]
        chain = _link_chain(root, executable)
        real_dir = posixpath.dirname(real)
        chain_dirs = list(dict.fromkeys(posixpath.dirname(step) for step in chain))
        venv_dirs = list(dict.fromkeys([*(d for c in chain_dirs for d in (posixpath.dirname(c), c)), real_dir]))
        venvs = {d: cfg for d in venv_dirs if (cfg := _pyvenv(root, d)) is not None}
        homes = list(dict.fromkeys(home for home, _ in venvs.values() if home))
        # where the standard library is searched from: the real folder (3.11+), the last step of the
        # link chain (3.6-3.10's argv0_path, its folders as written), a pyvenv.cfg's home
        searched = list(dict.fromkeys([real_dir, posixpath.dirname(chain[-1]), *homes]))
        version = _version(chain, real, (versions or {}).get(real), venvs)
        found = {version} if version else _versions_near(root, searched, libdirs) or set(_ANY_VERSION)
        interpreters[real] = version
        for folder in dict.fromkeys([*chain_dirs, real_dir]):
            places.landmark(folder, "pyvenv.cfg")
            places.landmark(posixpath.dirname(folder), "pyvenv.cfg")
            places.landmark(folder, pattern="*._pth")
        for step in dict.fromkeys([*chain, real]):
            places.landmark(step + "._pth")
        for folder in searched:
            places.landmark(folder, "pybuilddir.txt")
            places.landmark(folder, "Modules", "Setup.local")  # 3.8+
            places.landmark(folder, "Modules", "Setup")  # 2.7-3.7
        for each in found:
            _upward_landmarks(places, searched, each, libdirs)
            _site_folders(places, root, searched, venvs, each, libdirs)
    return PythonPlaces(
        landmarks=tuple(places.landmarks),
        site_folders=tuple(places.site),
        user_sites=tuple(places.user),
        interpreters=interpreters,
    )


def _version(
    chain: Sequence[str], real: str, needed: tuple[int, int] | None, venvs: dict[str, tuple[str | None, object]]
) -> tuple[int, int] | None:
    for path in (real, *reversed(chain)):
        match = _VERSION_IN_NAME.search(posixpath.basename(path))
        if match:
            return int(match.group(1)), int(match.group(2))
    if needed:
        return needed
    for _, version in venvs.values():
        if isinstance(version, tuple):
            return version
    return None


def _upward_landmarks(
    places: _Places, searched: Sequence[str], version: tuple[int, int], libdirs: Sequence[str]
) -> None:
    """The standard library's landmarks from each searched folder up to ``/``."""
    stdlibs, zips = _stdlib_names(version)
    for folder in searched:
        for above in _ancestors(folder):
            places.landmark(above, "Lib", "os.py")  # a build tree's standard library
            for lib in libdirs:
                base = posixpath.join(above, lib)
                for name in stdlibs:
                    places.landmark(base, name, "os.py")
                    places.landmark(base, name, "os.pyc")
                    places.landmark(base, name, "lib-dynload")
                for name in zips:
                    places.landmark(base, name)


def _site_folders(
    places: _Places,
    root: str,
    searched: Sequence[str],
    venvs: dict[str, tuple[str | None, tuple[int, int] | None]],
    version: tuple[int, int],
    libdirs: Sequence[str],
) -> None:
    """The import folders of the prefixes the image's landmarks give (see :func:`python_places`)."""
    major, minor = version
    stdlibs, zips = _stdlib_names(version)
    prefixes: dict[str, None] = {}
    for folder in searched:
        for above in _ancestors(folder):
            if any(
                _exists_in(root, posixpath.join(above, lib, name, landmark))
                for lib in libdirs
                for name in stdlibs
                for landmark in ("os.py", "os.pyc", "lib-dynload")
            ) or any(_exists_in(root, posixpath.join(above, lib, z)) for lib in libdirs for z in zips):
                prefixes[above] = None
                break
    for venv in venvs:
        prefixes[venv] = None
    for prefix in prefixes:
        for lib in libdirs:
            for name in stdlibs:
                places.site_folder(posixpath.join(prefix, lib, name))
                places.site_folder(posixpath.join(prefix, lib, name, "lib-dynload"))
                places.site_folder(posixpath.join(prefix, lib, name, "site-packages"))
                places.site_folder(posixpath.join(prefix, lib, name, "dist-packages"))
                places.site_folder(posixpath.join(prefix, "local", lib, name, "site-packages"))
            for z in zips:
                places.site_folder(posixpath.join(prefix, lib, z))
        places.site_folder(posixpath.join(prefix, "local", "lib", f"python{major}.{minor}", "dist-packages"))
        places.site_folder(posixpath.join(prefix, "lib", f"python{major}", "dist-packages"))
    for name in stdlibs:
        places.user[f"/root/.local/lib/{name}/site-packages"] = None


def python_landmarks(
    image_root: str | os.PathLike[str], executables: Iterable[str], platlibdirs: Iterable[str] = PLATLIBDIRS
) -> tuple[str, ...]:
    """The globs of what the image's Python interpreters consult to find their standard library
    (:attr:`PythonPlaces.landmarks` of :func:`python_places`): code configuration.

    Args:
        image_root: The image's root folder on the host.
        executables: Sandbox paths of the interpreters (:func:`python_executables`).
        platlibdirs: ``PLATLIBDIR`` values to consider.
    """
    return python_places(image_root, executables, platlibdirs).landmarks


# ── package folders ─────────────────────────────────────────────────────────────────────────────


def _any_case(suffix: str) -> str:
    """A glob matching ``suffix`` in any letter case (``.whl`` → ``.[wW][hH][lL]``)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else escape_glob(c) for c in suffix)


#: Globs of what an installer takes from a package folder: archives, source archives (``pip
#: --find-links`` takes them beside wheels), indexes.
_PACKAGE_GLOBS = (
    *(f"*{_any_case(s)}" for s in (*_ARCHIVES, *_SDISTS)),
    *(escape_glob(name) for name in sorted(_INDEXES)),
)
#: apt's lists and cache: every file there is an index or an archive apt takes without a download.
_APT_PLACES = ("/var/lib/apt/lists", "/var/cache/apt")


@dataclass(frozen=True)
class _Walked:
    """What one walk of the image found."""

    packages: tuple[str, ...]
    interpreters: tuple[str, ...]
    truncated: bool


def _walk(root: str, max_listed: int) -> _Walked:
    """Walk the image once (never through a link), at most ``max_listed`` entries: its package folders,
    and the Python interpreters of its ``bin`` folders (pyenv's versions, conda's environments, virtual
    environments: run through a shim, a link or a script's ``#!`` rather than found on ``PATH``)."""
    packages: dict[str, None] = {}
    interpreters: dict[str, None] = {}
    if _is_folder(root, "/var/lib/apt") or _exists_in(root, "/usr/bin/apt-get"):
        packages.update(dict.fromkeys(_APT_PLACES))
    pending = ["/"]
    listed = 0
    while pending:
        folder = pending.pop()
        try:
            listing = os.scandir(root + folder if folder != "/" else root)
        except (OSError, ValueError):
            continue
        holds = False
        binaries = posixpath.basename(folder) == "bin"
        with listing:
            for entry in listing:
                listed += 1
                if listed > max_listed:
                    return _Walked(tuple(packages), tuple(interpreters), True)
                name = entry.name
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir:
                    path = posixpath.join(folder, name)
                    if path not in _NOT_WALKED and path.count("/") <= _MAX_DEPTH:
                        pending.append(path)
                    continue
                if not holds:
                    holds = name.lower().endswith(_ARCHIVES) or name in _INDEXES
                if binaries and _PYTHON_NAME.match(name):
                    interpreters[posixpath.join(folder, name)] = None
        if holds and _may_be_package_folder(folder):
            packages[folder] = None
    return _Walked(tuple(packages), tuple(interpreters), False)


def _may_be_package_folder(folder: str) -> bool:
    """Whether ``folder`` may be judged a package folder: not ``/``, a top-level folder or a home (the
    view's globs match across ``/``: ``/app/*.zip`` would take every archive of the task's work), nor
    inside apt's places (judged whole)."""
    if folder.count("/") <= 1 or (folder.startswith("/home/") and folder.count("/") == 2):
        return False
    return not any(folder.startswith(apt + "/") for apt in _APT_PLACES)


def package_folders(image_root: str | os.PathLike[str], max_listed: int = MAX_LISTED) -> tuple[tuple[str, ...], bool]:
    """The image's folders of package archives or indexes, from which an installer the verifier runs
    could take an archive the agent adds (``pip install --find-links``, ``apt-get install`` from apt's
    cache or lists, ``python -m venv``'s bundled wheels).

    A folder is one if it holds a wheel, a ``.deb``, an ``.rpm``, an ``.apk``, an egg or a conda
    package (a file), or a repository index (``Packages``, ``Release``, ``repodata.json``,
    ``APKINDEX``), unless it is ``/``, a top-level folder or a home (an archive left there by a build;
    a folder of the agent's work); apt's lists and cache are, where the image has apt (an index added
    there is used without an update). The image is walked once, without following links, at most
    ``max_listed`` entries.

    Args:
        image_root: The image's root folder on the host.
        max_listed: Entries listed at most.

    Returns:
        The folders (sandbox paths), and whether the walk was cut short by its bound.
    """
    walked = _walk(os.fspath(image_root), max_listed)
    return walked.packages, walked.truncated


def package_globs(folder: str) -> list[str]:
    """Globs of what an installer would take from the package folder ``folder`` (its archives and
    indexes, in any letter case; everything in apt's lists and cache): code configuration. The
    folder's other entries are not: a package folder may be a home or a project's folder."""
    base = escape_glob(folder.rstrip("/") or "")
    if folder in _APT_PLACES:
        return [base]
    return [f"{base}/{glob}" for glob in _PACKAGE_GLOBS]


# ── all of it, for one image ────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Derived:
    """The code places derived from one image (:func:`derive`).

    Attributes:
        loader: Folders the loader searches that the image has (its binaries' ``RUNPATH``): loader folders.
        modules: Import folders of the image's interpreters (site folders, present or not): judged as Python's.
        user_sites: Their user site folders under ``/root``.
        config: Globs of code configuration: Python's landmarks, the ``RUNPATH`` folders the image
            lacks, the loaders and libraries the image's binaries name by path, package folders.
        relative: Relative ``RUNPATH`` entries found (see :class:`ElfScan`).
        elf_files: ELF files read.
        elf_bytes: Bytes read of them.
        truncated: Whether a bound cut a scan short.
        seconds: What deriving took.
    """

    loader: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    user_sites: tuple[str, ...] = ()
    config: tuple[str, ...] = ()
    relative: tuple[str, ...] = ()
    elf_files: int = 0
    elf_bytes: int = 0
    truncated: bool = False
    seconds: float = 0.0


def derive(
    image_root: str | os.PathLike[str], path_dirs: Sequence[str], loader_dirs: Sequence[str], python_dirs: Sequence[str]
) -> Derived:
    """The code places the image's own files name (see the module docstring), for ``_view.search_paths``.

    Args:
        image_root: The image's root folder on the host.
        path_dirs: The verifier's ``PATH`` folders.
        loader_dirs: The loader's folders (system, multiarch, ``ld.so.conf``'s).
        python_dirs: Python's import path, as probed.

    Returns:
        What was derived, with what reading it cost.
    """
    started = time.monotonic()
    root = os.fspath(image_root)
    walked = _walk(root, MAX_LISTED)
    executables = list(dict.fromkeys([*python_executables(root, path_dirs), *walked.interpreters]))
    platlibdirs = [*PLATLIBDIRS]
    for entry in python_dirs:  # ``/usr/lib64/python3.9`` says the image's PLATLIBDIR is ``lib64``
        match = re.search(r"/([^/]+)/python\d\.\d+t?$", entry.rstrip("/"))
        if match:
            platlibdirs.append(match.group(1))
    first = python_places(root, executables, platlibdirs)
    deep = [*python_dirs, *(d for d in first.site_folders if not d.endswith(".zip"))]
    commands = [*path_dirs, *(posixpath.dirname(e) for e in walked.interpreters)]
    scan = scan_elf(root, commands, deep=deep, libraries=loader_dirs)
    python = python_places(root, executables, platlibdirs, versions=scan.versions) if scan.versions else first
    config = [
        *python.landmarks,
        *(escape_glob(p) for p in (*scan.absent, *scan.interpreters)),
        *scan.wide,
        *(glob for folder in walked.packages for glob in package_globs(folder)),
    ]
    derived = Derived(
        loader=scan.present,
        modules=tuple(m for m in python.site_folders if m not in python_dirs),
        user_sites=python.user_sites,
        config=tuple(dict.fromkeys(config)),
        relative=scan.relative,
        elf_files=scan.files_read,
        elf_bytes=scan.bytes_read,
        truncated=scan.truncated or walked.truncated,
        seconds=time.monotonic() - started,
    )
    if derived.truncated:
        logger.warning(
            "harbor-local-sandbox: the image at %s is too large to derive all its code places (read %d ELF files, "
            "listed at most %d entries): some binaries' RUNPATHs, interpreters or package folders are not known",
            root, derived.elf_files, MAX_LISTED,
        )  # fmt: skip
    if derived.relative:
        logger.warning(
            "harbor-local-sandbox: binaries of the image at %s name RUNPATH folders relative to the working directory "
            "(%s): libraries the agent adds there are loaded by them",
            root, ", ".join(repr(r) for r in sorted(derived.relative)[:5]),
        )  # fmt: skip
    return derived
