"""The fixture of harbor-local-sandbox's own tests: the package installed alone, with Harbor, in a fresh venv.

(A module of its own, not a ``conftest.py``: the suite of the repository that holds the package runs these
tests in the same session, and its tests import their own ``conftest`` by name.)

The package must work for Harbor users who never install a trainer, neither TRL nor the project of the
repository it lives in (:data:`HOST_PROJECT`), so these tests do not drive it from the interpreter running
pytest (that project's dev venv has both): they install it, non-editable, with
the Harbor version installed here and nothing else, into a virtual environment of its own, and drive it
from there. Making that venv takes about a minute; it is cached and reused until its inputs change.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]

_BUILD_OUTPUTS = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".*")


def _not_source(folder: str, names: list[str]) -> set[str]:
    """What is not copied or installed: build outputs, caches, and the package's tests."""
    ignored = set(_BUILD_OUTPUTS(folder, names))
    return ignored | {"tests"} if Path(folder) == PACKAGE_DIR else ignored


#: Variables that would put another interpreter's packages on the venv's path.
_LEAKY_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE")
_STAMP = ".harbor-local-sandbox-test-venv.json"

#: Run in the venv (``python -I``: no cwd, user site or PYTHON* variables), so only what was installed counts.
_IMPORT_PROBE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = {"file": importlib.import_module(name).__file__}
    except ModuleNotFoundError as error:
        found[name] = {"error": "ModuleNotFoundError", "missing": error.name}
    except Exception as error:
        found[name] = {"error": type(error).__name__, "message": str(error)}
print(json.dumps(found))
"""


def _host_project() -> str | None:
    """The project of the repository that holds this package (its root's ``pyproject.toml``), if any."""
    try:
        return tomllib.loads((PACKAGE_DIR.parents[1] / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None


#: The distribution of the repository that holds this package (a trainer built on it), which it must not need.
HOST_PROJECT = _host_project()
#: Modules a Harbor user's venv lacks, which the package must not need: a trainer's (TRL, the host project's).
TRAINER_MODULES: tuple[str, ...] = ("trl", *([HOST_PROJECT.replace("-", "_")] if HOST_PROJECT else []))
PROBED_MODULES = ("harbor_local_sandbox.local", *TRAINER_MODULES)


@dataclass(frozen=True)
class PluginVenv:
    """The test venv: where it is, whether this session made it, and what imports in it.

    Attributes:
        path: The venv's folder.
        reused: True when an earlier session's venv was used as it was.
        setup_seconds: How long finding, making or updating it took in this session.
        imports: Per probed module, ``{"file": ...}`` when it imports, else the error (``_IMPORT_PROBE``).
    """

    path: Path
    reused: bool
    setup_seconds: float
    imports: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def bin(self) -> Path:
        """The venv's scripts folder (``python``, ``pip``, ``harbor``)."""
        return self.path / "bin"

    @property
    def python(self) -> Path:
        """The venv's interpreter."""
        return self.bin / "python"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment, as the venv's activation script would make it, plus ``extra``.

        The cache and certificate variables pass through (the sandbox's images live in
        ``$HARBOR_LOCAL_SANDBOX_CACHE_DIR``); ``PYTHONPATH`` and the like do not, as they could put the dev venv's
        packages in front of the venv's.
        """
        env = {key: value for key, value in os.environ.items() if key not in _LEAKY_VARIABLES}
        env["VIRTUAL_ENV"] = str(self.path)
        env["PATH"] = os.pathsep.join(filter(None, [str(self.bin), env.get("PATH", "")]))
        return {**env, **extra}

    def import_problems(self) -> list[str]:
        """What is wrong with its imports: the plug-in must import from the venv, a trainer's modules not at all."""
        problems = []
        plugin = self.imports["harbor_local_sandbox.local"]
        if not Path(plugin.get("file", "/")).resolve().is_relative_to(self.path.resolve()):
            problems.append(f"harbor_local_sandbox.local does not import from the venv: {plugin}")
        for name in TRAINER_MODULES:
            if self.imports[name] != {"error": "ModuleNotFoundError", "missing": name}:
                problems.append(f"{name} should be missing from the venv: {self.imports[name]}")
        return problems

    def run(self, *args: str | Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess[str]:
        """Run a command with the venv's environment, from a neutral folder unless ``cwd`` is given."""
        kwargs.setdefault("cwd", tempfile.gettempdir())
        kwargs.setdefault("env", self.env())
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs)


def _cache_root() -> Path:
    """``$HARBOR_LOCAL_SANDBOX_CACHE_DIR/test-venvs``, else ``~/.cache/harbor-local-sandbox/test-venvs``."""
    configured = os.environ.get("HARBOR_LOCAL_SANDBOX_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "harbor-local-sandbox"
    return base / "test-venvs"


def _base_python() -> str:
    """The interpreter this venv is made from: the running one's base, not the dev venv's copy of it."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _source_files(root: Path) -> Iterator[Path]:
    """The package's files that end up in the wheel, in a stable order (as ``_not_source`` copies them)."""
    for folder, dirs, files in os.walk(root):
        ignored = _not_source(folder, dirs + files)
        dirs[:] = sorted(d for d in dirs if d not in ignored)
        for name in sorted(files):
            if name not in ignored:
                yield Path(folder, name)


def _hash_files(root: Path) -> str:
    digest = hashlib.sha256()
    for path in _source_files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _check(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (two sessions at once must not build the same venv together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _install(venv: PluginVenv, requirements: list[str], *options: str) -> None:
    """pip-install the package (from a clean copy: an in-tree build would write ``build/`` into the repo)."""
    with tempfile.TemporaryDirectory(prefix="harbor-local-sandbox-src-") as scratch:
        source = Path(scratch) / "harbor-local-sandbox"
        shutil.copytree(PACKAGE_DIR, source, ignore=_not_source)
        result = venv.run(venv.python, "-m", "pip", "install", *options, *requirements, source, timeout=1500)
    _check(result, "pip install " + " ".join([*options, *requirements, "harbor-local-sandbox"]))


def make_plugin_venv() -> PluginVenv:
    """Find, make or update the cached venv with only Harbor (this interpreter's version) and the package.

    The venv is keyed by the package's ``pyproject.toml`` (its dependencies), the Harbor version and the
    interpreter, so a second session reuses it. A change to the package's other files reinstalls just the
    package (``--no-deps``); the stamp holding what is installed is written only after a successful install.
    """
    started = time.monotonic()
    harbor_version = importlib.metadata.version("harbor")
    base_python = _base_python()
    key = hashlib.sha256(
        (PACKAGE_DIR / "pyproject.toml").read_bytes()
        + f"\0harbor=={harbor_version}\0{base_python}\0{sys.version}".encode()
    ).hexdigest()[:16]
    path = _cache_root() / f"harbor-local-sandbox-{key}"
    stamp_path = path / _STAMP
    source_hash = _hash_files(PACKAGE_DIR)
    with _locked(path.with_name(path.name + ".lock")):
        try:
            stamp = json.loads(stamp_path.read_text())
        except (OSError, ValueError):
            stamp = None
        venv = PluginVenv(path, reused=False, setup_seconds=0.0)
        if stamp is None:  # never made, or its making did not finish
            shutil.rmtree(path, ignore_errors=True)
            made = subprocess.run(
                [base_python, "-m", "venv", str(path)], capture_output=True, text=True, timeout=300, env=venv.env()
            )
            _check(made, f"{base_python} -m venv {path}")
            _install(venv, [f"harbor=={harbor_version}"])
        elif stamp.get("source") != source_hash:  # the package changed, its dependencies did not
            stamp_path.unlink()
            _install(venv, [], "--no-deps", "--force-reinstall")
        stamp_path.write_text(json.dumps({"harbor": harbor_version, "python": base_python, "source": source_hash}))
    probe = venv.run(venv.python, "-I", "-c", _IMPORT_PROBE, *PROBED_MODULES)
    _check(probe, "the import probe")
    return PluginVenv(
        path,
        reused=stamp is not None and stamp.get("source") == source_hash,
        setup_seconds=time.monotonic() - started,
        imports=json.loads(probe.stdout),
    )


@pytest.fixture(scope="session")
def plugin_venv() -> PluginVenv:
    """The package and Harbor alone in a cached venv, checked to have no trainer's modules (:data:`TRAINER_MODULES`)."""
    venv = make_plugin_venv()
    how = "reused" if venv.reused else "made or updated"
    print(f"harbor-local-sandbox test venv {how} in {venv.setup_seconds:.1f} s: {venv.path}")
    problems = venv.import_problems()
    assert not problems, "\n".join(problems)
    return venv


def package_setup() -> dict:
    """The names ``setup.py`` defines (its build's functions: the helpers' ELF reading, the wheel's platform tag),
    read without building anything (``setuptools.setup`` is a no-op meanwhile)."""
    import runpy

    import setuptools

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(setuptools, "setup", lambda **kwargs: None)
        return runpy.run_path(str(PACKAGE_DIR / "setup.py"), run_name="harbor_local_sandbox_setup")
