"""The verifier's import guard (``harbor_local_sandbox/_guard.py``), run by a real Python interpreter, no sandbox.

A fake image's import path (a stdlib-like folder and a site folder holding the guard's ``.pth``),
and a working directory of the agent's: the guard must make Python take every name the image has
from the image's folders, refuse a guarded name the image lacks wherever else it is, and leave the
agent's own modules importable. ``-S`` keeps the host's site folders out; the ``.pth`` is read by
``site.addsitedir``, as ``site`` reads an image's site folder at start-up. Each behaviour is checked
with the guard's source compiled at start-up and with its code compiled once by the interpreter
(``COMPILE_GUARD``, as the image's Python does at the search-path probe).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harbor_local_sandbox._guard import COMPILE_GUARD, GUARD_MODULE, guard_files, site_folder


def _compiled_here() -> tuple[str, str]:
    """The guard compiled by this interpreter, as the probe prints it."""
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", COMPILE_GUARD], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    tag, magic, code = result.stdout.split()
    assert tag == "#guard"
    return magic, code


@pytest.fixture(params=["source", "compiled"])
def compiled(request: pytest.FixtureRequest) -> tuple[str, str] | None:
    return _compiled_here() if request.param == "compiled" else None


def _image(tmp_path: Path, guarded: list[str], compiled: tuple[str, str] | None = None) -> tuple[Path, Path]:
    """A fake image's import folders (with the guard written into its site folder), and a working directory."""
    lib, site = tmp_path / "image" / "lib", tmp_path / "image" / "site-packages"
    lib.mkdir(parents=True)
    site.mkdir()
    (lib / "shipped.py").write_text("WHERE = 'image'\n")
    files = guard_files([str(lib), str(site)], guarded, compiled)
    for path, text in files.items():
        Path(path).write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    return site, work


def _python(site: Path, work: Path, code: str) -> dict:
    """Run ``code`` as ``python -m`` would see it from ``work`` (the working directory first on the path)."""
    prelude = (
        "import sys, site, json\n"
        f"site.addsitedir({str(site)!r})\n"
        f"sys.path.insert(0, {str(work)!r})\n"
        f"sys.path.insert(1, {str(site.parent / 'lib')!r})\n"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", prelude + code], cwd=work, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_image_name_comes_from_the_image_even_with_the_agents_first_on_the_path(
    tmp_path: Path, compiled: tuple[str, str] | None
) -> None:
    site, work = _image(tmp_path, ["shipped"], compiled)
    (work / "shipped.py").write_text("WHERE = 'agent'\n")
    seen = _python(site, work, "import shipped; print(json.dumps({'where': shipped.WHERE}))")
    assert seen == {"where": "image"}


def test_a_guarded_name_the_image_lacks_is_refused_wherever_it_is(
    tmp_path: Path, compiled: tuple[str, str] | None
) -> None:
    """``nt`` on Linux: CPython's ``ntpath`` imports it inside ``try``; the agent's ``nt.py`` must not run."""
    site, work = _image(tmp_path, ["nt", "msvcrt"], compiled)
    (work / "nt.py").write_text("open('ran', 'w').write('yes')\n")
    code = (
        "try:\n    import nt\n    got = 'imported'\nexcept ImportError:\n    got = 'refused'\n"
        "import os\nprint(json.dumps({'got': got, 'ran': os.path.exists('ran')}))"
    )
    assert _python(site, work, code) == {"got": "refused", "ran": False}


def test_the_agents_own_modules_are_imported(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    site, work = _image(tmp_path, ["nt"], compiled)
    (work / "solution.py").write_text("ANSWER = 42\n")
    assert _python(site, work, "import solution; print(json.dumps({'answer': solution.ANSWER}))") == {"answer": 42}


def test_without_the_guard_the_agents_module_would_win(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    """The tests above can fail: with the ``.pth`` removed, the working directory's module is imported."""
    site, work = _image(tmp_path, ["shipped", "nt"], compiled)
    for pth in site.glob("*.pth"):
        pth.unlink()
    (work / "shipped.py").write_text("WHERE = 'agent'\n")
    (work / "nt.py").write_text("X = 1\n")
    code = "import shipped, nt; print(json.dumps({'where': shipped.WHERE, 'nt': nt.X}))"
    assert _python(site, work, code) == {"where": "agent", "nt": 1}


def test_distribution_metadata_is_read_from_the_image_only(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    """A ``pytest11`` plug-in registered by a dist-info in the working directory is not found."""
    site, work = _image(tmp_path, [], compiled)
    for where, name in ((site, "shipped_dist"), (work, "planted")):
        info = where / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[pytest11]\n{name} = {name}\n")
    code = (
        "from importlib.metadata import entry_points\n"
        "names = sorted(e.name for e in entry_points(group='pytest11'))\n"
        "print(json.dumps({'plugins': names}))"
    )
    assert _python(site, work, code) == {"plugins": ["shipped_dist"]}


def test_the_hook_runs_by_its_path_not_by_its_name(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    """A folder before the site folder (``PYTHONPATH``, the agent's) cannot replace the guard by its name."""
    site, work = _image(tmp_path, ["nt"], compiled)
    pth = next(site.glob("*.pth")).read_text()
    assert pth.startswith("import ") and str(site / f"{GUARD_MODULE}.py") in pth and f"import {GUARD_MODULE}" not in pth


def test_the_compiled_code_is_what_runs(tmp_path: Path) -> None:
    """With the code compiled by this interpreter, the source file is not read (a broken one changes
    nothing); with a magic number of another interpreter's, the source is compiled instead."""
    magic, code = _compiled_here()
    site, work = _image(tmp_path, ["nt"], (magic, code))
    (site / f"{GUARD_MODULE}.py").write_text("raise SystemExit('the source ran')\n")
    (work / "nt.py").write_text("X = 1\n")
    probe = "try:\n    import nt\n    got = 'imported'\nexcept ImportError:\n    got = 'refused'\nprint(json.dumps({'got': got}))"
    assert _python(site, work, probe) == {"got": "refused"}

    other = tmp_path / "other"
    other.mkdir()
    site, work = _image(other, ["nt"], ("00" * 4, code))
    (work / "nt.py").write_text("X = 1\n")
    assert _python(site, work, probe) == {"got": "refused"}  # the source, compiled: still guarded
    (site / f"{GUARD_MODULE}.py").write_text("raise SystemExit('the source ran')\n")
    result = subprocess.run(
        [sys.executable, "-S", "-c", f"import site; site.addsitedir({str(site)!r})"], capture_output=True, text=True
    )
    assert "the source ran" in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (
            ["/usr/lib/python311.zip", "/usr/lib/python3.11", "/usr/lib/python3/dist-packages"],
            "/usr/lib/python3/dist-packages",
        ),
        (
            ["/usr/local/lib/python312.zip", "/usr/local/lib/python3.12/site-packages"],
            "/usr/local/lib/python3.12/site-packages",
        ),
        (["/usr/lib/python3.11"], None),
    ],
)
def test_the_site_folder(path: list[str], expected: str | None) -> None:
    assert site_folder(path) == expected
    assert bool(guard_files(path, ["nt"])) == (expected is not None)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("#guard a70d0d0a e300", ("a70d0d0a", "e300")),
        ("#guard a70d0d0a", None),  # cut short
        ("#guard a70d0d0a e3zz", None),  # not hexadecimal
        ("#guard  ", None),
    ],
)
def test_the_probes_guard_line_is_taken_only_when_well_formed(line: str, expected: tuple[str, str] | None) -> None:
    """Else the verifier compiles the source (a code object that cannot load would leave it unguarded)."""
    from harbor_local_sandbox._roots import _compiled_guard

    assert _compiled_guard(line) == expected
