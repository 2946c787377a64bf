"""The C helpers are built with the package, never at run time: what a missing, stale or failed build says.

Fast: no sandbox, no compiler run (the build's own errors are checked with compilers that fail at once).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harbor_alone import package_setup
from harbor_local_sandbox import _binaries
from harbor_local_sandbox.errors import SandboxUnavailableError

PACKAGE_DIR = Path(__file__).resolve().parents[1]
STATIC = ("supervisor", "runas", "forwarder")


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed package of our making: its helpers' sources in ``tmp_path``, its build output in ``_bin``."""
    for name in (*STATIC, "launcher"):
        (tmp_path / f"_{name}.c").write_text(f"int main(void) {{ return 0; }} /* {name} */\n")
    (tmp_path / "_bin").mkdir()
    monkeypatch.setattr(_binaries, "HELPERS_DIR", tmp_path / "_bin")
    monkeypatch.setattr(_binaries, "SOURCES_DIR", tmp_path)
    _binaries.static_binary.cache_clear()
    _binaries.launcher_binary.cache_clear()
    yield tmp_path
    _binaries.static_binary.cache_clear()
    _binaries.launcher_binary.cache_clear()


def _build(package: Path, *, skip: tuple[str, ...] = (), failed: dict[str, str] | None = None) -> None:
    """Write what setup.py's build leaves: the helpers (here: empty programs) and the manifest of their sources."""
    failed = failed or {}
    helpers = {}
    for name in (*STATIC, "launcher"):
        if name in skip:
            continue
        source = (package / f"_{name}.c").read_bytes()
        if name not in failed:
            binary = package / "_bin" / name
            binary.write_text("#!/bin/sh\n")
            binary.chmod(0o755)
        helpers[name] = {
            "static": True,
            "source_sha256": hashlib.sha256(source).hexdigest(),
            "built": name not in failed,
            "error": failed.get(name, ""),
        }
    (package / "_bin" / "manifest.json").write_text(json.dumps({"format": 1, "helpers": helpers}))


def test_a_built_package_finds_its_helpers_and_compiles_nothing(package: Path) -> None:
    _build(package)
    for name in STATIC:
        assert _binaries.static_binary(name) == str(package / "_bin" / name)
    assert _binaries.launcher_binary() == str(package / "_bin" / "launcher")


def test_no_build_at_all_says_to_reinstall(package: Path) -> None:
    with pytest.raises(SandboxUnavailableError) as raised:
        _binaries.static_binary("supervisor")
    message = str(raised.value)
    assert "'supervisor' was not built" in message and "manifest.json is missing" in message, message
    assert "pip install --force-reinstall harbor-local-sandbox" in message, message
    assert "pip install -e packages/harbor-local-sandbox" in message, message
    with pytest.raises(SandboxUnavailableError, match="'launcher' was not built"):
        _binaries.launcher_binary()  # None only when the build tried and could not


def test_a_helper_the_build_does_not_list_is_missing(package: Path) -> None:
    _build(package, skip=("forwarder",))
    assert _binaries.static_binary("supervisor")
    with pytest.raises(SandboxUnavailableError, match="'forwarder' was not built.*does not list it"):
        _binaries.static_binary("forwarder")


def test_a_helper_built_from_another_source_is_stale(package: Path) -> None:
    """An editable install's source edited after the build: the old program must not run as if it were the new."""
    _build(package)
    (package / "_runas.c").write_text("int main(void) { return 1; } /* edited */\n")
    with pytest.raises(SandboxUnavailableError) as raised:
        _binaries.static_binary("runas")
    message = str(raised.value)
    assert "'runas'" in message and "stale" in message and "_runas.c" in message, message
    assert "pip install -e packages/harbor-local-sandbox" in message, message
    assert _binaries.static_binary("supervisor")  # the others are still current


def test_a_listed_helper_whose_file_is_gone_says_so(package: Path) -> None:
    _build(package)
    (package / "_bin" / "runas").unlink()
    with pytest.raises(SandboxUnavailableError, match="missing or not executable"):
        _binaries.static_binary("runas")


def test_only_the_launcher_may_be_absent_and_then_it_is_none(package: Path) -> None:
    _build(package, failed={"launcher": "cc exited with 1: no such header"})
    assert _binaries.launcher_binary() is None
    assert _binaries.static_binary("supervisor")


def test_a_static_helper_the_build_could_not_make_is_an_error(package: Path) -> None:
    _build(package, failed={"supervisor": "cannot find -lc"})
    with pytest.raises(SandboxUnavailableError, match="'supervisor' was not built \\(cannot find -lc\\)"):
        _binaries.static_binary("supervisor")


def test_the_installed_package_has_current_helpers() -> None:
    """This checkout's install (editable in the dev venv) built every helper from the sources it has now."""
    manifest = json.loads((_binaries.HELPERS_DIR / "manifest.json").read_text())
    assert set(manifest["helpers"]) == {*STATIC, "launcher"}
    for name in STATIC:
        path = Path(_binaries.static_binary(name))
        assert path.parent == _binaries.HELPERS_DIR and os.access(path, os.X_OK)


# --- static programs, and the wheel's platform tag (setup.py) -------------------------------------------------


def _readelf(path: Path) -> tuple[bool, int] | None:
    """binutils' answer, where it is installed: (asks for an interpreter, how many shared libraries it names)."""
    if shutil.which("readelf") is None:
        return None
    headers = subprocess.run(["readelf", "-lW", str(path)], capture_output=True, text=True, check=True).stdout
    dynamic = subprocess.run(["readelf", "-dW", str(path)], capture_output=True, text=True, check=True).stdout
    return "Requesting program interpreter" in headers, dynamic.count("(NEEDED)")


def test_every_helper_installed_is_a_static_program() -> None:
    """No interpreter (``PT_INTERP``), no shared library (``DT_NEEDED``): each runs on any C library, or none."""
    elf_links = package_setup()["elf_links"]
    for name in (*STATIC, "launcher"):
        path = _binaries.HELPERS_DIR / name
        assert elf_links(path) == (None, 0), name
        assert _readelf(path) in (None, (False, 0)), name


def test_the_elf_reading_tells_a_dynamic_program_and_refuses_what_is_not_elf(tmp_path: Path) -> None:
    elf_links = package_setup()["elf_links"]
    shell = Path(shutil.which("sh") or "/bin/sh").resolve()  # a distribution's shell: linked dynamically
    interpreter, needed = elf_links(shell)
    assert interpreter and "ld-" in interpreter and needed >= 1, (shell, interpreter, needed)
    assert _readelf(shell) in (None, (True, needed))
    (tmp_path / "script").write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match="not an ELF file"):
        elf_links(tmp_path / "script")


def test_the_wheel_is_manylinux_only_when_every_helper_it_carries_is_static(tmp_path: Path) -> None:
    """manylinux2014 for static helpers; one dynamic helper (or a machine without that baseline): ``linux_<m>``."""
    wheel_platform = package_setup()["wheel_platform"]
    for name in (*STATIC, "launcher"):
        shutil.copy(_binaries.HELPERS_DIR / name, tmp_path / name)
    assert wheel_platform(tmp_path, "linux_x86_64") == "manylinux_2_17_x86_64.manylinux2014_x86_64"
    assert wheel_platform(tmp_path, "linux_aarch64") == "manylinux_2_17_aarch64.manylinux2014_aarch64"
    assert wheel_platform(tmp_path, "linux_riscv64") == "linux_riscv64"  # no manylinux2014 for it
    (tmp_path / "launcher").unlink()  # the optional one, not built: the rest decide
    assert wheel_platform(tmp_path, "linux_x86_64").startswith("manylinux_2_17_x86_64")
    shutil.copy(Path(shutil.which("sh") or "/bin/sh").resolve(), tmp_path / "launcher")  # built, but dynamic
    assert wheel_platform(tmp_path, "linux_x86_64") == "linux_x86_64"
    assert wheel_platform(tmp_path / "nothing-built", "linux_x86_64") == "linux_x86_64"


# --- the build's own errors (setup.py), with compilers that fail at once ------------------------------------


def _run_build(tmp_path: Path, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``setup.py build`` on a copy of the package with ``PATH=path`` and ``env`` (``CC`` unset unless given)."""
    source = tmp_path / "src"
    shutil.copytree(
        PACKAGE_DIR,
        source,
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "_bin", "tests"),
    )
    environment = {key: value for key, value in os.environ.items() if key != "CC"}
    environment.update(PATH=path, **env)
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build", "--build-base", str(tmp_path / "build")],
        cwd=source, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _tool(folder: Path, name: str, script: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{script}\n")
    (folder / name).chmod(stat.S_IRWXU)


def test_building_without_a_compiler_names_the_packages_to_install(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()  # nothing on PATH: no cc, gcc, clang
    result = _run_build(tmp_path, str(tools))
    assert result.returncode != 0
    assert "no C compiler was found" in result.stderr and "none of cc, gcc, clang" in result.stderr, result.stderr
    assert "apt-get install gcc libc6-dev" in result.stderr, result.stderr


def test_building_with_a_missing_cc_names_it(tmp_path: Path) -> None:
    result = _run_build(tmp_path, os.environ.get("PATH", ""), CC="no-such-compiler -O1")
    assert result.returncode != 0
    assert "CC='no-such-compiler' was not found" in result.stderr, result.stderr
    assert "apt-get install gcc libc6-dev" in result.stderr, result.stderr


def test_building_without_a_static_libc_says_it_is_needed(tmp_path: Path) -> None:
    """The compiler is there (CC is respected) but cannot link statically: libc.a is named, and no build is left."""
    tools = tmp_path / "tools"
    _tool(tools, "fakecc", f'echo "$@" >> {tools}/calls; echo "ld: cannot find -lc" >&2; exit 1')
    result = _run_build(tmp_path, str(tools), CC=str(tools / "fakecc"))
    assert result.returncode != 0
    assert "could not build its C helper _supervisor.c" in result.stderr, result.stderr
    assert "cannot find -lc" in result.stderr and "static C library (libc.a)" in result.stderr, result.stderr
    assert "apt-get install gcc libc6-dev" in result.stderr, result.stderr
    assert "-static" in (tools / "calls").read_text().splitlines()[0]
    assert not list((tmp_path / "build").glob("**/_bin/manifest.json"))
