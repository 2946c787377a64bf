"""Code places derived from an image (``_derive.py``), on real files: binaries built with the system's
``cc``, ELF files written byte by byte (32-bit, big-endian, malformed), synthetic image roots — and the
verifier's rule on a synthetic image and agent layer (as ``tests/test_verifier_rule_holes.py``), with
the search paths :func:`search_paths` derives from that image.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest
from harbor_local_sandbox import _derive
from harbor_local_sandbox._derive import (
    MAX_ELF_BYTES,
    elf_facts,
    loader_search_dirs,
    package_folders,
    python_landmarks,
    python_places,
    scan_elf,
)
from harbor_local_sandbox._view import search_paths, snapshot

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs the system's C compiler")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted.* xattrs need root")


def _files(root: Path, entries: dict[str, str]) -> None:
    for relative, content in entries.items():
        path = root / relative.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def _link(root: Path, relative: str, target: str) -> None:
    path = root / relative.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def _cc(out: Path, rpath: str, new_dtags: bool = True, shared: bool = False) -> Path:
    """Build a do-nothing program (or shared library) at ``out`` whose RUNPATH (RPATH) is ``rpath``."""
    source = out.parent / f".{out.name}.c"
    out.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("int answer(void) { return 42; }\n" + ("" if shared else "int main(void) { return 0; }\n"))
    flags = ["-shared", "-fPIC"] if shared else []
    dtags = "--enable-new-dtags" if new_dtags else "--disable-new-dtags"
    subprocess.run(
        ["cc", *flags, "-o", str(out), str(source), f"-Wl,-rpath,{rpath}", f"-Wl,{dtags}"],
        check=True,
        capture_output=True,
    )
    source.unlink()
    return out


def _elf(
    wide: bool,
    big: bool,
    runpath: str | None = None,
    rpath: str | None = None,
    interp: str | None = None,
    needed: tuple[str, ...] = (),
    e_type: int = 3,
) -> bytes:
    """An ELF file written by hand: a header, PT_LOAD (the whole file at 0x10000), PT_INTERP, PT_DYNAMIC."""
    order = ">" if big else "<"
    strings = b"\0"
    offsets: dict[str, int] = {}
    for text in (*needed, *(t for t in (runpath, rpath) if t is not None)):
        offsets[text] = len(strings)
        strings += text.encode() + b"\0"
    dynamic = [(1, offsets[n]) for n in needed]
    if runpath is not None:
        dynamic.append((29, offsets[runpath]))
    if rpath is not None:
        dynamic.append((15, offsets[rpath]))
    head_size, ph_size, dyn_size = (64, 56, 16) if wide else (52, 32, 8)
    phnum = 3
    interp_bytes = (interp.encode() + b"\0") if interp else b""
    interp_at = head_size + phnum * ph_size
    strtab_at = interp_at + len(interp_bytes)
    dynamic_at = strtab_at + len(strings)
    dynamic.append((5, 0x10000 + strtab_at))  # DT_STRTAB: an address, mapped through PT_LOAD
    dynamic.append((0, 0))
    dyn_format = order + ("qQ" if wide else "iI")
    dynamic_bytes = b"".join(struct.pack(dyn_format, tag, value) for tag, value in dynamic)
    total = dynamic_at + len(dynamic_bytes)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 2 if big else 1, 1]) + b"\0" * 9
    if wide:
        header = ident + struct.pack(
            order + "HHIQQQIHHHHHH", e_type, 62, 1, 0, head_size, 0, 0, 64, 56, phnum, 64, 0, 0
        )

        def ph(p_type: int, offset: int, size: int) -> bytes:
            return struct.pack(order + "IIQQQQQQ", p_type, 4, offset, 0x10000 + offset, 0, size, size, 8)
    else:
        header = ident + struct.pack(order + "HHIIIIIHHHHHH", e_type, 3, 1, 0, head_size, 0, 0, 52, 32, phnum, 40, 0, 0)

        def ph(p_type: int, offset: int, size: int) -> bytes:
            return struct.pack(order + "IIIIIIII", p_type, offset, 0x10000 + offset, 0, size, size, 4, 4)

    programs = ph(1, 0, total) + (ph(3, interp_at, len(interp_bytes)) if interp else ph(4, 0, 0))
    programs += ph(2, dynamic_at, len(dynamic_bytes))
    return header + programs + interp_bytes + strings + dynamic_bytes


# ── the ELF reader ──────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("big", [True, False])
def test_a_hand_written_elf_of_either_class_and_byte_order(tmp_path: Path, wide: bool, big: bool) -> None:
    path = tmp_path / "lib.so"
    path.write_bytes(
        _elf(wide, big, runpath="$ORIGIN/../lib:/build/lib", rpath="/old", interp="/lib/ld.so.1", needed=("libc.so.6",))
    )
    facts = elf_facts(path)
    assert facts is not None
    assert facts.runpath == ("$ORIGIN/../lib", "/build/lib")
    assert facts.rpath == ("/old",)
    assert facts.interpreter == "/lib/ld.so.1"
    assert facts.needed == ("libc.so.6",)
    assert facts.machine == (62 if wide else 3)


def test_an_object_file_or_a_core_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "x.o"
    path.write_bytes(_elf(True, False, runpath="/build/lib", e_type=1))
    assert elf_facts(path) is None


@needs_cc
def test_runpath_and_rpath_of_binaries_built_by_cc(tmp_path: Path) -> None:
    root = tmp_path / "image"
    _cc(root / "usr/bin/tool", "$ORIGIN/../lib/tool:/build/lib:/opt/$LIB:/opt/p/${PLATFORM}:lib")
    _cc(root / "usr/bin/old", "${ORIGIN}/../share/x", new_dtags=False)
    (root / "usr/lib/tool").mkdir(parents=True)
    facts = elf_facts(root / "usr/bin/tool")
    assert facts is not None and facts.rpath == ()
    assert facts.runpath == ("$ORIGIN/../lib/tool", "/build/lib", "/opt/$LIB", "/opt/p/${PLATFORM}", "lib")
    assert facts.interpreter is not None and facts.interpreter.startswith("/")
    old = elf_facts(root / "usr/bin/old")
    assert old is not None and old.rpath == ("${ORIGIN}/../share/x",) and old.runpath == ()

    scan = scan_elf(root, ["/usr/bin"])
    assert scan.present == ("/usr/lib/tool",)
    assert {"/build/lib", "/usr/share/x", "/opt/lib", "/opt/lib64", "/opt/lib/x86_64-linux-gnu"} <= set(scan.absent)
    assert "/opt/p/x86_64" in scan.absent
    assert scan.relative == ("lib",)  # relative to the working directory: reported, not a place
    assert not any(not a.startswith("/") or a in ("/", "/lib") for a in scan.absent)
    assert scan.files_read == 2
    assert set(loader_search_dirs(root, ["/usr/bin"])) == {*scan.present, *scan.absent}


@needs_cc
def test_a_librarys_origin_is_the_folder_it_was_found_in(tmp_path: Path) -> None:
    """glibc keeps the path it opened a library by, links unresolved: ``libplug.so`` found as
    ``/opt/app/lib/libplug.so`` (a link to the multiarch folder's) has its ``$ORIGIN`` there too — both
    folders are expanded; the folders named are resolved in the image, and their libraries read in turn."""
    root = tmp_path / "image"
    _link(root, "/lib", "usr/lib")
    _cc(root / "usr/lib/x86_64-linux-gnu/libplug.so", "$ORIGIN/plugins", shared=True)
    _cc(root / "usr/lib/x86_64-linux-gnu/plugins/libinner.so", "/nowhere/lib", shared=True)
    _link(root, "/opt/app/lib/libplug.so", "/lib/x86_64-linux-gnu/libplug.so")
    scan = scan_elf(root, [], libraries=["/opt/app/lib"])
    assert scan.present == ("/usr/lib/x86_64-linux-gnu/plugins",)
    assert set(scan.absent) == {"/opt/app/lib/plugins", "/nowhere/lib"}
    assert scan.files_read == 2


@needs_cc
def test_a_top_level_runpath_folder_names_its_libraries_alone(tmp_path: Path) -> None:
    """``$ORIGIN/..`` of ``/app/bin/tool`` is ``/app`` (the task's folder): its library files are code,
    its other entries the agent's work (a loader folder's every entry would be a code place)."""
    root = tmp_path / "image"
    _cc(root / "app/bin/tool", "$ORIGIN/..:$ORIGIN/../..:/work")  # /work: absent, top-level
    scan = scan_elf(root, ["/app/bin"])
    assert scan.present == () and scan.absent == ()
    expected = {"/app/libc.so.6", "/app/glibc-hwcaps/*/libc.so.6", "/libc.so.6", "/tls/libc.so.6", "/work/libc.so.6"}
    assert expected <= set(scan.wide), scan.wide
    assert all(glob.endswith("/libc.so.6") for glob in scan.wide)  # what the program needs, by name


@needs_cc
def test_links_are_resolved_inside_the_image_never_on_the_host(tmp_path: Path) -> None:
    """An image's absolute link names an image path: ``/usr/bin/tool -> /bin/true`` is the image's
    ``/bin/true`` (absent here), not the host's."""
    root = tmp_path / "image"
    _link(root, "/usr/bin/tool", "/bin/true")
    _link(root, "/usr/bin/up", "../../../../../../../../bin/true")
    assert os.path.exists("/bin/true")
    scan = scan_elf(root, ["/usr/bin"])
    assert scan.files_read == 0 and scan.interpreters == ()


def test_malformed_files_never_raise(tmp_path: Path) -> None:
    """Truncated at every length, bytes flipped, offsets past the end or near 2**64, a FIFO, a folder."""
    good = _elf(True, False, runpath="/a:/b", interp="/lib/ld.so", needed=("libc.so.6",))
    samples = [good[:n] for n in range(len(good))]
    rng = random.Random(7)
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        samples.append(bytes(data))
    huge = bytearray(good)
    struct.pack_into("<Q", huge, 32, 2**64 - 8)  # e_phoff
    samples.append(bytes(huge))
    many = bytearray(good)
    struct.pack_into("<H", many, 56, 0xFFFF)  # e_phnum
    samples.append(bytes(many))
    for wide in (True, False):
        for big in (True, False):
            base = _elf(wide, big, runpath="/a")
            for step in range(0, len(base), 3):
                for value in (0xFF, 0x7F, 0x00):
                    data = bytearray(base)
                    data[step] = value
                    samples.append(bytes(data))
    folder = tmp_path / "bad"
    folder.mkdir()
    for index, data in enumerate(samples):
        path = folder / f"f{index}.so"
        path.write_bytes(data)
        facts = elf_facts(path)
        assert facts is None or facts.bytes_read <= MAX_ELF_BYTES
    os.mkfifo(folder / "fifo.so")
    (folder / "dir.so").mkdir()
    _link(folder, "link.so", "/etc/passwd")
    assert elf_facts(folder / "fifo.so") is None  # never waits for a writer
    assert elf_facts(folder / "dir.so") is None
    assert elf_facts(folder / "link.so") is None  # never through a link
    scan_elf(folder, ["/"], deep=["/"], libraries=["/"])


def test_what_is_read_is_bounded_whatever_the_file_claims(tmp_path: Path) -> None:
    """A dynamic section and strings claiming gigabytes, in a large sparse file: only the bound is read."""
    data = bytearray(_elf(True, False, runpath="/a"))
    path = tmp_path / "big.so"
    with open(path, "wb") as out:
        out.write(data)
        out.truncate(1 << 30)  # a 1 GiB file (sparse)
    # PT_DYNAMIC's filesz (the third program header's, at offset 64 + 2 * 56 + 32) claims 1 GiB
    with open(path, "r+b") as out:
        out.seek(64 + 2 * 56 + 32)
        out.write(struct.pack("<Q", 1 << 30))
    facts = elf_facts(path)
    assert facts is not None and facts.runpath == ("/a",)
    assert facts.bytes_read < 128 << 10


# ── CPython's path computation ─────────────────────────────────────────────────────────────────


def test_python_landmarks_from_the_executables_folder_up(tmp_path: Path) -> None:
    root = tmp_path / "image"
    _files(root, {"/usr/bin/python3.11": "elf", "/usr/lib/python3.11/os.py": ""})
    _link(root, "/usr/bin/python3", "python3.11")
    _link(root, "/bin", "usr/bin")
    _link(root, "/lib", "usr/lib")
    landmarks = set(python_landmarks(root, ["/usr/bin/python3", "/bin/python3"]))
    expected = {
        # the standard library's landmarks, from /usr/bin up to / (3.11+: the real executable's folder)
        "/usr/bin/lib/python3.11/os.py", "/usr/bin/lib/python3.11/os.pyc", "/usr/bin/lib/python3.11/lib-dynload",
        "/usr/bin/lib/python311.zip", "/usr/bin/lib64/python3.11/os.py", "/usr/lib/python3.11/os.py",
        "/usr/lib/python311.zip", "/usr/lib64/python3.11/lib-dynload", "/lib/python3.11/os.py",
        "/lib64/python311.zip",
        # a build tree's standard library, and its markers beside the real executable
        "/usr/bin/Lib/os.py", "/usr/Lib/os.py", "/Lib/os.py", "/usr/bin/pybuilddir.txt", "/usr/bin/Modules/Setup.local",
        "/usr/bin/Modules/Setup",
        # a virtual environment's configuration, ._pth files
        "/usr/bin/pyvenv.cfg", "/usr/pyvenv.cfg", "/usr/bin/python3._pth", "/usr/bin/python3.11._pth",
        "/usr/bin/*._pth",
        # /bin/python3 before 3.11 is searched from /bin (only the executable's own links followed):
        # /bin/lib/... is /usr/bin/lib/... in the image, /pyvenv.cfg one level up
        "/bin/lib/python3.11/os.py", "/pyvenv.cfg",
    }  # fmt: skip
    assert expected <= landmarks, sorted(expected - landmarks)
    assert not any("python3.11t" in glob for glob in landmarks)  # free-threaded builds are 3.13+


def test_python_landmarks_of_a_venv_copy_with_a_home(tmp_path: Path) -> None:
    """A venv's interpreter (a copy, named ``python``: no version in its name) reads ``pyvenv.cfg``; its
    ``home`` is where the standard library is searched from; its version says which."""
    root = tmp_path / "image"
    _files(
        root,
        {
            "/opt/venv/bin/python": "elf",
            "/opt/venv/pyvenv.cfg": "home = /opt/py/bin\nversion = 3.13.1\n",
            "/opt/py/bin/python3.13": "elf",
            "/opt/py/lib/python3.13/os.py": "",
        },
    )
    places = python_places(root, ["/opt/venv/bin/python"])
    landmarks = set(places.landmarks)
    expected = {
        "/opt/venv/pyvenv.cfg", "/opt/venv/bin/pyvenv.cfg", "/opt/venv/bin/python._pth",
        "/opt/py/bin/pybuilddir.txt", "/opt/py/bin/lib/python3.13/os.py", "/opt/py/lib/python3.13t/os.py",
        "/opt/lib/python313t.zip", "/lib/python313.zip",
    }  # fmt: skip
    assert expected <= landmarks, sorted(expected - landmarks)
    assert places.interpreters == {"/opt/venv/bin/python": (3, 13)}
    assert "/opt/venv/lib/python3.13/site-packages" in places.site_folders
    assert "/opt/py/lib/python3.13/site-packages" in places.site_folders
    assert "/root/.local/lib/python3.13/site-packages" in places.user_sites


def test_python_landmarks_of_an_unknown_version(tmp_path: Path) -> None:
    root = tmp_path / "image"
    _files(root, {"/x/bin/python": "#!/bin/sh\n"})
    landmarks = set(python_landmarks(root, ["/x/bin/python"]))
    expected = {"/x/bin/lib/python3.6/os.py", "/x/lib/python316.zip", "/lib64/python2.7/lib-dynload", "/x/Lib/os.py"}
    assert expected <= landmarks
    assert not any("*" in glob for glob in landmarks if not glob.endswith("/*._pth"))  # the view's * crosses /


def test_python_executables_are_interpreters_only(tmp_path: Path) -> None:
    root = tmp_path / "image"
    names = ["python", "python3", "python3.11", "python3.13t", "python3.7m", "python3.11-dbg"]
    _files(root, {f"/usr/bin/{n}": "" for n in [*names, "python3-config", "python3.11-config", "pythonista"]})
    assert sorted(_derive.python_executables(root, ["/usr/bin"])) == sorted(f"/usr/bin/{n}" for n in names)


def test_an_interpreter_linked_out_of_the_image_is_not_followed_on_the_host(tmp_path: Path) -> None:
    root = tmp_path / "image"
    _link(root, "/usr/local/bin/python3", "/usr/bin/python3")  # absent in the image (present on the host)
    places = python_places(root, ["/usr/local/bin/python3"])
    assert places.interpreters == {} and places.landmarks == ()


# ── package folders ─────────────────────────────────────────────────────────────────────────────


def test_package_folders(tmp_path: Path) -> None:
    root = tmp_path / "image"
    _files(
        root,
        {
            "/opt/wheels/numpy-2.0-cp311-none-any.whl": "",
            "/srv/repo/Packages.gz": "",
            "/srv/data/archive.tar.gz": "",  # a tarball alone: data
            "/root/left-by-the-build.deb": "",  # a home (or /, a top-level folder): the agent's work too
            "/app/x.whl": "",
            "/var/lib/apt/extended_states": "",
        },
    )
    folders, cut = package_folders(root)
    assert not cut
    assert set(folders) == {"/opt/wheels", "/srv/repo", "/var/lib/apt/lists", "/var/cache/apt"}
    assert package_folders(root, max_listed=2)[1]  # bounded


# ── the rule, with the search paths derived from the image ──────────────────────────────────────

WORKDIR = "/app"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIST = "/usr/lib/python3/dist-packages"
#: Debian bookworm's python3 sys.path (and the user site), as the image's probe reports it.
PYTHON = (
    "/usr/lib/python311.zip",
    "/usr/lib/python3.11",
    "/usr/lib/python3.11/lib-dynload",
    "/usr/local/lib/python3.11/dist-packages",
    DIST,
    "/root/.local/lib/python3.11/site-packages",
)
#: The agent's additions the verifier must not see (what a derived code place conceals).
HOSTILE = {
    "/usr/bin/lib/python3.11/os.py": "import sys; sys.exit(0)",  # /usr/bin becomes the prefix
    "/usr/bin/lib/python311.zip": "PK",  # searched before the standard library's os.py
    "/usr/bin/pybuilddir.txt": "../../opt/evil",  # build-tree mode
    "/usr/bin/Modules/Setup.local": "",
    "/usr/bin/python3.11._pth": "/opt/evil\nimport site",
    "/build/lib/libc.so.6": "the agent's libc",  # RUNPATH of /usr/bin/tool, absent from the image
    "/build/lib/libanything.so": "a library no one ships",
    "/usr/lib/python3.11/dist-packages/apport_python_hook.py": "import os",  # a site folder site.py adds
    "/opt/wheels/pytest-99.0-py3-none-any.whl": "PK",  # pip install --find-links /opt/wheels
    "/usr/lib64/ld-linux-x86-64.so.2": "the agent's loader",  # PT_INTERP of the image's programs
}
#: The agent's honest work the verifier must see.
HONEST = {
    "/usr/local/bin/newcmd": "#!/bin/sh\necho hi",
    "/usr/local/lib/python3.11/dist-packages/newpkg/__init__.py": "",
    "/build/notes.txt": "beside the RUNPATH folder",
    "/opt/wheels/README.txt": "not an archive",
    "/app/solution.py": "the agent's work",
}


@pytest.fixture
def image(tmp_path: Path) -> Path:
    lower = tmp_path / "image"
    _files(
        lower,
        {
            "/usr/bin/python3.11": "elf",
            "/usr/lib/x86_64-linux-gnu/libc.so.6": "libc",
            "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2": "the loader",
            "/usr/lib/python3.11/os.py": "stdlib",
            "/usr/lib/python3.11/lib-dynload/_json.cpython-311-x86_64-linux-gnu.so": "ext",
            "/usr/lib/python3.11/sitecustomize.py": "try:\n    import apport_python_hook\nexcept ImportError: pass",
            f"{DIST}/pytest/__init__.py": "",
            "/usr/local/lib/python3.11/dist-packages/.keep": "",
            "/opt/wheels/numpy-2.0-cp311-none-any.whl": "PK",
            "/etc/ld.so.conf": "include /etc/ld.so.conf.d/*.conf\n",
        },
    )
    (lower / "usr/local/bin").mkdir(parents=True)
    (lower / "app").mkdir()
    _link(lower, "/usr/bin/python3", "python3.11")
    _link(lower, "/bin", "usr/bin")
    _link(lower, "/lib", "usr/lib")
    _link(lower, "/lib64", "usr/lib64")
    _link(lower, "/usr/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    if shutil.which("cc"):
        _cc(lower / "usr/bin/tool", "/build/lib")
    return lower


def _agent(tmp_path: Path, entries: dict[str, str]) -> tuple[Path, Path]:
    upper, target = tmp_path / "upper", tmp_path / f"snapshot{len(list(tmp_path.iterdir()))}"
    upper.mkdir(exist_ok=True)
    target.mkdir()
    _files(upper, entries)
    return upper, target


def _seen(target: Path, path: str) -> bool:
    return os.path.lexists(target / path.lstrip("/"))


@needs_root
@needs_cc
def test_the_verifier_does_not_see_what_derived_code_places_conceal(tmp_path: Path, image: Path) -> None:
    search = search_paths(image, PATH, PYTHON)
    upper, target = _agent(tmp_path, {**HOSTILE, **HONEST})
    result = snapshot(upper, image, target, search, WORKDIR, live=())
    seen = [path for path in HOSTILE if _seen(target, path)]
    assert not seen, (seen, result.concealed)
    # A new package of the agent's is mounted live on the view (its folder laid empty for the mount).
    live = tuple(f"{package}/" for package in result.live_packages)
    missing = [path for path in HONEST if not (_seen(target, path) or path.startswith(live))]
    assert not missing, (missing, result.concealed)


@needs_root
@needs_cc
def test_without_derivation_those_were_holes(tmp_path: Path, image: Path) -> None:
    """The same layer judged with the search paths as they were before derivation (the probe's and the
    system's alone): the hostile entries the derivation conceals reach the verifier."""
    derived = search_paths(image, PATH, PYTHON)
    search = dataclasses.replace(derived, config=(), python=PYTHON, modules=())
    upper, target = _agent(tmp_path, {**HOSTILE, **HONEST})
    snapshot(upper, image, target, search, WORKDIR, live=())
    already = {"/usr/bin/python3.11._pth", "/usr/lib64/ld-linux-x86-64.so.2"}  # a hook in PATH, a shipped link
    holes = [path for path in HOSTILE if path not in already and _seen(target, path)]
    assert sorted(holes) == sorted(set(HOSTILE) - already)


@needs_root
@needs_cc
def test_an_allowed_change_opens_a_derived_place(tmp_path: Path, image: Path) -> None:
    """A task that asks the agent to build the library a binary's RUNPATH names allows it."""
    search = search_paths(image, PATH, PYTHON)
    upper, target = _agent(tmp_path, {"/build/lib/libanswer.so": "the agent's build"})
    snapshot(upper, image, target, search, WORKDIR, allowed=("/build/lib",), live=())
    assert _seen(target, "/build/lib/libanswer.so")


def test_search_paths_derive_from_the_image(tmp_path: Path, image: Path) -> None:
    search = search_paths(image, PATH, PYTHON)
    assert "/usr/lib/python3.11/dist-packages" in search.modules  # absent: site.py would add it
    assert "/usr/bin/lib/python3.11/os.py" in search.config
    assert "/opt/wheels/*.[wW][hH][lL]" in search.config
    if shutil.which("cc"):
        assert "/build/lib" in search.config
        assert "/lib64/ld-linux-x86-64.so.2" in search.config or "/usr/lib64/ld-linux-x86-64.so.2" in search.config
    assert stat.S_ISDIR(os.lstat(image / "usr/lib").st_mode)
