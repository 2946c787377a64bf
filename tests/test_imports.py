"""The names a task image's Python code tries to import (``harbor_local_sandbox._imports``), found by scanning."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harbor_local_sandbox._imports import STDLIB_NAMES, attempted_imports, guard_names, imported_names

HOST_PYTHON = "/usr/bin/python3"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os", {"os"}),
        ("import os as o, sys", {"os", "sys"}),
        ("import a, b.c as d", {"a", "b"}),
        ("import a as b, c", {"a", "c"}),
        ("import a.b.c", {"a"}),
        ("from x.y import z", {"x"}),
        ("from x import (a,\n    b,\n)\n", {"x"}),
        ("from x import (\n    import_me,\n)\n", {"x"}),
        ("from . import x", set()),
        ("from .m import y", set()),
        ("from .. m import y", set()),
        ("from __future__ import annotations", {"__future__"}),
        ("try:\n    import nt\nexcept ImportError: pass", {"nt"}),
        ("try: import _winapi\nexcept ImportError: _winapi = None", {"_winapi"}),
        ("def f():\n    from msvcrt import getch\n    return getch", {"msvcrt"}),
        ("if sys.platform == 'win32':\n    import winreg\nelse:\n    import posix", {"winreg", "posix"}),
        ("if TYPE_CHECKING: import typing_extensions", {"typing_extensions"}),
        ("class A:\n    def m(self):\n        import  json . decoder", {"json"}),
        ("import os; import sys", {"os", "sys"}),
        ("x = 1; from q import r", {"q"}),
        ("import a, \\\n    b", {"a", "b"}),
        ("from pkg \\\n    import thing", {"pkg"}),
        ("import a,b,c", {"a", "b", "c"}),
        ("import a\r\nimport b\r\n", {"a", "b"}),
        ('importlib.import_module("simplejson.decoder")', {"simplejson"}),
        ("import_module('chardet')", {"chardet"}),
        ('__import__("_wmi")', {"_wmi"}),
        ("mod = __import__( 'foo.bar', fromlist=['x'])", {"foo"}),
        ("m = importlib.import_module(\n    'concurrent.futures'\n)", {"concurrent"}),
        ("importlib.import_module(name='cchardet')", {"cchardet"}),
        ("importlib.import_module('.sibling', __package__)", set()),
        ("importlib.import_module(name)", set()),
        ("import importlib\nimportlib.reload(m)", {"importlib"}),
        ("important = 1\nimports = []\nfrom_ = 2\nreimport(x)", set()),
        ('print "x"\nimport urllib2\nexec "import foo"\n', {"urllib2"}),
        ("def f(:\n    import broken_but_counted\n", {"broken_but_counted"}),
        ("# import commented\n", set()),
        ("    # import indented_comment\n", set()),
        ("x = 1  # see: import commented; import also_commented\n", set()),
        ("x = 1  # __import__('commented')\n", set()),
        ("s = '#'; import after_hash_in_string", {"after_hash_in_string"}),
        ("# a Windows path C:\\\nimport after_backslash_comment\n", {"after_backslash_comment"}),
        ('"""Docstring.\n\nimport in_docstring\n"""\n', {"in_docstring"}),  # an accepted over-approximation
        ("import caf\u00e9", {"caf\u00e9"}),
    ],
)
def test_imported_names(source: str, expected: set[str]) -> None:
    assert imported_names(source) == expected


def test_imported_names_takes_bytes_in_any_encoding() -> None:
    assert imported_names(b"# -*- coding: latin-1 -*-\ns = '\xe9'\nimport nt\n") == {"nt"}
    assert imported_names("import é".encode("latin-1")) == set()  # not UTF-8: not an identifier


def test_imported_names_of_a_python_2_file() -> None:
    source = 'print "hello"\nexcept Exception, e:\n    pass\nimport ConfigParser\nfrom urlparse import urljoin\n'
    with pytest.raises(SyntaxError):
        ast.parse(source)
    assert imported_names(source) == {"ConfigParser", "urlparse"}


def test_imported_names_on_a_huge_line_is_quick() -> None:
    source = "x = 1; " * 50000 + "import last\n" + "# #; import no\n" * 20000
    assert imported_names(source) == {"last"}


@pytest.mark.parametrize("name", ["nt", "_winapi", "msvcrt", "_wmi", "winreg", "asyncore", "distutils", "json", "imp"])
def test_stdlib_names(name: str) -> None:
    assert name in STDLIB_NAMES


def test_stdlib_names_include_this_interpreters() -> None:
    assert set(sys.stdlib_module_names) <= STDLIB_NAMES
    assert "pytest" not in STDLIB_NAMES and "test" not in STDLIB_NAMES


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A fake image root: ``/usr/lib/python3.11`` and a ``site-packages``, links out and around."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    _write(outside / "evil.py", "import outside_file_was_read\n")
    _write(outside / "pkg" / "mod.py", "import outside_folder_was_walked\n")
    lib = root / "usr" / "lib" / "python3.11"
    _write(lib / "ntpath.py", "try:\n    from nt import _getfullpathname\nexcept ImportError:\n    pass\n")
    _write(lib / "asyncio" / "windows_events.py", "import _overlapped\nfrom . import events\n")
    _write(lib / "test" / "test_x.py", "import only_in_tests\n")
    _write(lib / "__pycache__" / "cached.py", "import in_pycache\n")
    _write(lib / "notes.txt", "import not_python\n")
    site = root / "usr" / "local" / "lib" / "python3.11" / "site-packages"
    _write(
        site / "requests" / "compat.py", "try:\n    import simplejson as json\nexcept ImportError:\n    import json\n"
    )
    _write(site / "hook.pth", "import _hook_module; _hook_module.install()\n")
    (site / "evil.py").symlink_to(outside / "evil.py")  # a link to a file outside the root
    (site / "linked_pkg").symlink_to(outside / "pkg")  # a link to a folder outside the root
    (site / "inner_link").symlink_to(lib / "asyncio")  # a link inside the root: skipped too
    (root / "lib").symlink_to("usr/lib")  # merged /usr, relative
    (root / "abs").symlink_to("/usr/local")  # absolute: means the image's /usr/local, not the host's
    return root


IMAGE_FOLDERS = ["/usr/lib/python3.11", "/usr/local/lib/python3.11/site-packages"]


def test_attempted_imports_scans_the_image(image: Path) -> None:
    names = attempted_imports(image, IMAGE_FOLDERS)
    assert {"nt", "_overlapped", "only_in_tests", "simplejson", "json", "_hook_module"} <= names
    assert names >= STDLIB_NAMES
    assert not {"outside_file_was_read", "outside_folder_was_walked", "in_pycache", "not_python"} & names
    assert attempted_imports(str(image), IMAGE_FOLDERS) == names


def test_attempted_imports_resolves_links_inside_the_root(image: Path, tmp_path: Path) -> None:
    assert "_overlapped" in attempted_imports(image, ["/lib/python3.11"])
    assert "simplejson" in attempted_imports(image, ["/abs/lib/python3.11/site-packages"])
    (image / "escape").symlink_to(tmp_path / "outside")  # absolute, to the host: read as the image's path
    (image / "up").symlink_to("../../outside")  # relative, climbing above the root: stops at the root
    assert attempted_imports(image, ["/escape", "/up", "/up/pkg", "/../outside", "/missing"]) == STDLIB_NAMES


def test_attempted_imports_skips_relative_folders(image: Path) -> None:
    assert attempted_imports(image, ["", "usr/lib/python3.11"]) == STDLIB_NAMES


def test_attempted_imports_scans_a_folder_once(image: Path) -> None:
    lib = "/usr/lib/python3.11"  # three files: with asyncio's scanned twice, max_files=3 would miss one
    assert attempted_imports(image, [lib + "/asyncio", lib], max_files=3) == attempted_imports(image, [lib])


def test_attempted_imports_bounds(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        _write(tmp_path / "lib" / f"{name}.py", f"import module_{name}\n")
    _write(tmp_path / "lib" / "sub" / "d.py", "import module_d\n")

    def scanned(**bounds: int) -> set[str]:
        return set(attempted_imports(tmp_path, ["/lib"], **bounds) - STDLIB_NAMES)

    assert scanned() == {"module_a", "module_b", "module_c", "module_d"}
    assert scanned(max_files=1) == {"module_a"}  # in order of name, a folder's files before its folders
    assert scanned(max_files=3) == {"module_a", "module_b", "module_c"}
    assert scanned(max_files=0) == set()
    assert scanned(max_bytes=0) == set()
    assert scanned(max_bytes=len("import module_a\nimport mod")) == {"module_a", "mod"}
    assert attempted_imports(tmp_path, ["/lib"], max_files=0) == STDLIB_NAMES


def test_guard_names(image: Path) -> None:
    names = guard_names(image, IMAGE_FOLDERS)
    assert names >= attempted_imports(image, IMAGE_FOLDERS)
    assert {"pytest", "_pytest", "pluggy", "iniconfig", "py", "sitecustomize", "usercustomize"} <= names


def _host_folders() -> list[str]:
    if not os.path.exists(HOST_PYTHON):
        pytest.skip(f"no {HOST_PYTHON}")
    code = "import sys; print('\\n'.join(sys.path))"
    result = subprocess.run([HOST_PYTHON, "-I", "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    return [p for p in result.stdout.splitlines() if p.startswith("/") and os.path.isdir(p)]


def test_attempted_imports_on_the_host_python() -> None:
    folders = _host_folders()
    names = attempted_imports("/", folders)
    assert {"nt", "msvcrt", "_winapi", "winreg"} <= names
    # Windows-only (or Jython/VMS) names the standard library's platform module imports, in no version's
    # sys.stdlib_module_names: found only by scanning (_winreg up to 3.12, java and vms_lib since 3.6).
    scanned_only = {"_winreg", "java", "vms_lib"}
    assert not scanned_only & STDLIB_NAMES
    assert scanned_only & names
    if any(os.path.isdir(f"{f}/requests") for f in folders):
        assert "simplejson" in names  # requests' optional dependency (requests.compat)
