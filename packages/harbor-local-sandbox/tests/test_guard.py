"""The verifier's import guard (``harbor_local_sandbox/_guard.py``), run by a real Python interpreter, no sandbox.

Who placed a file is told by where it is, as in a view: each test runs in a private mount namespace
(``unshare``) with the agent's tree on a tmpfs of its own (its live folders: their device), a ``/tmp``
that is an overlay of the agent's layer under the verifier's own (the layers' devices), and the
image's folders on the host's file system. The guard is run as the view's ``encodings`` line runs it
(``guard_files``), before anything is imported from a folder; then the test sets ``sys.path`` as
``python -m``, ``PYTHONPATH`` or pytest would, and imports. Each behaviour is checked with the
guard's source compiled at start-up and with its code compiled once by the interpreter
(``COMPILE_GUARD``, as the image's Python does at the search-path probe).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from harbor_local_sandbox._guard import COMPILE_GUARD, GUARD_SOURCE, CompiledGuard, guard_files, stdlib_folder
from harbor_local_sandbox._roots import _compiled_guard


def _compiled_here() -> CompiledGuard:
    """The guard compiled by this interpreter, as the probe prints it."""
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", COMPILE_GUARD], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    compiled = _compiled_guard(result.stdout.splitlines())
    assert compiled is not None and compiled.pyc_path and compiled.pyc, result.stdout[:200]
    return compiled


@pytest.fixture(params=["source", "compiled"])
def compiled(request: pytest.FixtureRequest) -> CompiledGuard | None:
    return _compiled_here() if request.param == "compiled" else None


#: An overlay in a user namespace of its own (without root) keeps its metadata in user xattrs, and the
#: kernel then takes ``redirect_dir=nofollow``, not ``off`` (as ``harbor_local_sandbox._mounts`` mounts it).
_OVERLAY_OPTIONS = ",redirect_dir=off" if os.geteuid() == 0 else ",redirect_dir=nofollow,userxattr"


class World:
    """The folders of a test: the image's (``lib``, ``site``), the tests' (``tests``), the agent's tree
    (``agent``, a tmpfs when mounted) with its working directory (``work``), and ``/tmp``'s layers (the
    agent's ``tmp_agent`` under the verifier's ``tmp_own``, merged at ``tmp``)."""

    def __init__(self, root: Path, guarded: list[str], compiled: CompiledGuard | None):
        self.root = root
        for name in ("lib", "site", "tests", "agent", "tmp_own", "tmp", "plumbing", "python"):
            (root / name).mkdir(parents=True, exist_ok=True)
        self.lib, self.site, self.tests = root / "lib", root / "site", root / "tests"
        self.agent, self.tmp = root / "agent", root / "tmp"
        self.work, self.tmp_agent = self.agent / "work", self.agent / "tmp"
        (self.lib / "encodings").mkdir(exist_ok=True)
        (self.lib / "shipped.py").write_text("WHERE = 'image'\n")
        plumbing = f"{root / 'plumbing'}/"
        self.guard_file = root / "plumbing" / "guard.py"
        self.provenance_file = root / "plumbing" / "provenance"
        files = guard_files(str(self.lib), b'"""The image\'s encodings."""\n', guarded, compiled)
        for path, content in files.items():
            # the view's plumbing is /.harbor-local-sandbox; here, a folder of the test's
            if isinstance(content, bytes) and path.endswith("__init__.py"):
                content = content.replace(b"/.harbor-local-sandbox/", plumbing.encode())
            Path(path.replace("/.harbor-local-sandbox/", plumbing)).write_bytes(
                content if isinstance(content, bytes) else content.encode()
            )
        self.encodings = (self.lib / "encodings" / "__init__.py").read_text()

    def run(self, code: str, python: str = sys.executable, cwd: Path | None = None, pythonpath: str = "") -> dict:
        """Mount the agent's tree and ``/tmp``, write the view's provenance, then run the image's ``encodings``
        (which runs the guard) and ``code`` under ``python -S`` from ``cwd`` (default: the working directory)."""
        layers = self.root / "tmp_layers"
        setup = "\n".join(
            [
                "set -e",
                f"mkdir -p {layers}",
                f"mount -t tmpfs agent {self.agent}",
                f"mkdir -p {self.work} {self.tmp_agent}",
                f"mount -t tmpfs own {self.root / 'tmp_own'}",
                f"mkdir -p {self.root / 'tmp_own/upper'} {self.root / 'tmp_own/work'}",
                f"mount -t overlay tmp -o lowerdir={self.tmp_agent},upperdir={self.root / 'tmp_own/upper'},"
                f"workdir={self.root / 'tmp_own/work'},xino=off,metacopy=off{_OVERLAY_OPTIONS} {self.tmp}",
                # the test's own files, written once the mounts are there
                f"{shlex.quote(sys.executable)} {shlex.quote(str(self.root / 'files.py'))}",
                f"cd {shlex.quote(str(cwd or self.root))}",
                f"exec env PYTHONPATH={shlex.quote(pythonpath)} {shlex.quote(python)} -S -c "
                f"{shlex.quote(self._prelude() + code)}",
            ]
        )
        result = subprocess.run(
            ["unshare", "-m" if os.geteuid() == 0 else "-rm", "sh", "-c", setup],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    def files(self, placed: dict[str, str]) -> None:
        """Files to write once the mounts are there (paths in the world), and the provenance."""
        script = (
            "import os, json\n"
            f"for path, text in json.loads({json.dumps(json.dumps(placed))}).items():\n"
            "    os.makedirs(os.path.dirname(path), exist_ok=True)\n"
            "    open(path, 'w').write(text)\n"
            f"probe = {str(self.tmp / '.probe')!r}\n"
            "open(probe, 'w').close()\n"
            "own = os.stat(probe).st_dev\n"
            "os.unlink(probe)\n"
            "from harbor_local_sandbox._guard import provenance\n"
            f"open({str(self.provenance_file)!r}, 'w').write(provenance(os.stat({str(self.agent)!r}).st_dev, "
            f"os.stat({str(self.tmp)!r}).st_dev, [own]))\n"
        )
        (self.root / "files.py").write_text(script)

    def _prelude(self) -> str:
        return (
            "import sys, json\n"
            # what the interpreter does at start-up: the image's encodings, with the view's line
            f"exec(compile({self.encodings!r}, 'encodings/__init__.py', 'exec'), {{'__name__': 'encodings'}})\n"
        )


def _imports(world_paths: list[str], code: str) -> str:
    """``code`` after setting ``sys.path`` to ``world_paths`` (as ``-m``, pytest or ``PYTHONPATH`` would)."""
    return f"sys.path[:0] = {world_paths!r}\n" + code


def test_the_tests_own_helper_wins_over_a_name_of_the_agents_in_site_packages(
    tmp_path: Path, compiled: tuple[str, str] | None
) -> None:
    """Python's own order: pytest puts the tests' folder first, and their ``helpers`` is imported, not the
    agent's package of that name in site-packages (guarded or not)."""
    world = World(tmp_path, ["helpers", "shipped"], compiled)
    (world.tests / "helpers.py").write_text("WHERE = 'tests'\n")
    (world.site / "helpers.py").write_text("WHERE = 'site'\n")
    world.files({})
    code = _imports(
        [str(world.tests), str(world.lib), str(world.site)], "import helpers\nprint(json.dumps(helpers.WHERE))"
    )
    assert world.run(code) == "tests"


def test_a_guarded_name_the_agent_placed_is_passed_over_for_the_images(
    tmp_path: Path, compiled: tuple[str, str] | None
) -> None:
    """``python -m`` puts the working directory (the agent's, live) first: its ``shipped.py`` is passed over."""
    world = World(tmp_path, ["shipped"], compiled)
    world.files({str(world.work / "shipped.py"): "WHERE = 'agent'\nopen('ran', 'w').close()\n"})
    code = _imports(
        [str(world.work), str(world.lib)],
        "import shipped, os\nprint(json.dumps([shipped.WHERE, os.path.exists('ran')]))",
    )
    assert world.run(code, cwd=None) == ["image", False]


def test_the_working_directory_as_python_m_puts_it_first(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    """``python -m`` (and ``-c``) put ``''`` first: the working directory, the agent's; its ``shipped.py`` is passed
    over for the image's, and its own module is imported from there."""
    world = World(tmp_path, ["shipped"], compiled)
    world.files({str(world.work / "shipped.py"): "WHERE = 'agent'\n", str(world.work / "mine.py"): "WHERE = 'mine'\n"})
    code = _imports(["", str(world.lib)], "import shipped, mine\nprint(json.dumps([shipped.WHERE, mine.WHERE]))")
    assert world.run(code, cwd=world.work) == ["image", "mine"]


def test_a_guarded_name_only_the_agent_has_is_refused(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    """``nt`` on Linux: CPython's ``ntpath`` imports it inside ``try``; the agent's ``nt.py`` must not run."""
    world = World(tmp_path, ["nt", "msvcrt"], compiled)
    world.files({str(world.work / "nt.py"): "raise SystemExit('the agent ran')\n"})
    code = _imports(
        [str(world.work), str(world.lib)],
        "try:\n    import nt\n    got = 'imported'\nexcept ImportError:\n    got = 'refused'\nprint(json.dumps(got))",
    )
    assert world.run(code) == "refused"


def test_the_agents_own_modules_are_imported(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    world = World(tmp_path, ["nt"], compiled)
    world.files({str(world.work / "solution.py"): "ANSWER = 42\n"})
    code = _imports([str(world.work), str(world.lib)], "import solution\nprint(json.dumps(solution.ANSWER))")
    assert world.run(code) == 42


def test_without_the_guard_the_agents_module_would_win(tmp_path: Path) -> None:
    """The tests above can fail: with the view's line taken out of ``encodings``, the agent's module is imported."""
    world = World(tmp_path, ["shipped", "nt"], None)
    world.encodings = '"""The image\'s encodings."""\n'
    world.files({str(world.work / "shipped.py"): "WHERE = 'agent'\n", str(world.work / "nt.py"): "X = 1\n"})
    code = _imports([str(world.work), str(world.lib)], "import shipped, nt\nprint(json.dumps([shipped.WHERE, nt.X]))")
    assert world.run(code) == ["agent", 1]


def test_the_tests_own_start_up_hook_runs_and_the_agents_does_not(
    tmp_path: Path, compiled: tuple[str, str] | None
) -> None:
    """A ``sitecustomize`` the tests write into a temporary folder (the verifier's ``/tmp`` layer) and put on
    ``PYTHONPATH`` runs; the same file the agent placed in its own ``/tmp`` layer, or in its working
    directory, does not (issue #48)."""
    world = World(tmp_path, ["sitecustomize", "usercustomize"], compiled)
    hook = "import builtins\nbuiltins.HOOKED = __file__\n"
    show = "import sitecustomize\nimport builtins\nprint(json.dumps(getattr(builtins, 'HOOKED', None)))"
    planted_tmp = world.tmp_agent / "guard"
    world.files({str(world.tmp / "tests-own" / "sitecustomize.py"): hook, str(planted_tmp / "sitecustomize.py"): hook})
    ours = world.run(_imports([str(world.tmp / "tests-own"), str(world.lib)], show))
    assert ours == str(world.tmp / "tests-own" / "sitecustomize.py")
    planted = (
        "try:\n    import sitecustomize\n    print(json.dumps(sitecustomize.__file__))\n"
        "except ImportError:\n    print(json.dumps('refused'))"
    )
    assert world.run(_imports([str(world.tmp / "guard"), str(world.lib)], planted)) == "refused"
    world.files({str(world.work / "sitecustomize.py"): hook})
    assert world.run(_imports([str(world.work), str(world.lib)], planted)) == "refused"


def test_the_running_virtual_environments_own_packages_are_used(
    tmp_path: Path, compiled: tuple[str, str] | None
) -> None:
    """A venv in the agent's tree (one the tests made in the working directory, or the agent's own that they
    run): its site-packages are the environment the tests chose, a guarded name there is imported; the same
    name in the working directory is still passed over."""
    world = World(tmp_path, ["pytest"], compiled)
    venv = world.work / "venv"
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    home = Path(sys.base_prefix) / "bin"
    world.files(
        {
            str(venv / "pyvenv.cfg"): f"home = {home}\ninclude-system-site-packages = false\n",
            str(site / "pytest.py"): "WHERE = 'venv'\n",
            str(world.work / "pytest.py"): "WHERE = 'planted'\n",
        }
    )
    (world.root / "files.py").write_text(
        (world.root / "files.py").read_text()
        + f"os.makedirs({str(venv / 'bin')!r}, exist_ok=True)\n"
        + f"os.symlink({os.path.realpath(sys.executable)!r}, {str(venv / 'bin' / 'python')!r})\n"
    )
    code = _imports(
        [str(world.work), str(site)],
        # what site does for a venv (-S leaves it out): sys.prefix becomes the venv's
        "import site\nsite.venv(set())\nimport pytest\nprint(json.dumps([sys.prefix != sys.base_prefix, pytest.WHERE]))",
    )
    assert world.run(code, python=str(venv / "bin" / "python")) == [True, "venv"]


def test_distribution_metadata_the_agent_placed_is_not_found(tmp_path: Path, compiled: tuple[str, str] | None) -> None:
    """A ``pytest11`` plug-in registered by a dist-info in the working directory is not found; the image's is."""
    world = World(tmp_path, [], compiled)
    placed = {}
    for where, name in ((world.site, "shipped_dist"), (world.work, "planted")):
        info = where / f"{name}-1.0.dist-info"
        placed[str(info / "METADATA")] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
        placed[str(info / "entry_points.txt")] = f"[pytest11]\n{name} = {name}\n"
    world.files(placed)
    code = _imports(
        [str(world.work), str(world.lib), str(world.site)],
        "from importlib.metadata import entry_points\n"
        "print(json.dumps(sorted(e.name for e in entry_points(group='pytest11'))))",
    )
    assert world.run(code) == ["shipped_dist"]


def test_the_compiled_code_is_what_runs(tmp_path: Path) -> None:
    """With the code compiled by this interpreter, the source file is not read (a broken one changes nothing);
    with a magic number of another interpreter's, the source is compiled instead."""
    compiled = _compiled_here()
    probe = _imports(
        [],
        "try:\n    import nt\n    got = 'imported'\nexcept ImportError:\n    got = 'refused'\nprint(json.dumps(got))",
    )
    world = World(tmp_path / "a", ["nt"], compiled)
    world.guard_file.write_text("raise SystemExit('the source ran')\n")
    world.files({str(world.work / "nt.py"): "X = 1\n"})
    assert world.run(probe.replace("sys.path[:0] = []", f"sys.path[:0] = [{str(world.work)!r}]")) == "refused"

    other = World(tmp_path / "b", ["nt"], CompiledGuard("00" * 4, compiled.code))
    other.files({str(other.work / "nt.py"): "X = 1\n"})
    assert other.run(probe.replace("sys.path[:0] = []", f"sys.path[:0] = [{str(other.work)!r}]")) == "refused"
    assert GUARD_SOURCE in other.guard_file.read_text()


def test_the_standard_library_folder_is_the_one_with_encodings() -> None:
    have = {"/usr/lib/python3.11/encodings/__init__.py"}
    assert (
        stdlib_folder(
            ["/usr/lib/python311.zip", "/usr/lib/python3.11", "/usr/lib/python3/dist-packages"], have.__contains__
        )
        == "/usr/lib/python3.11"
    )
    assert stdlib_folder(["/usr/lib/python3/dist-packages"], have.__contains__) is None
    assert guard_files(None, b"", ["nt"]) == {}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("#guard a70d0d0a e300", CompiledGuard("a70d0d0a", "e300")),
        ("#guard a70d0d0a", None),  # cut short
        ("#guard a70d0d0a e3zz", None),  # not hexadecimal
        ("#guard  ", None),
        ("#guard a70d0d0a e300\n#encodings /p.pyc 6100", CompiledGuard("a70d0d0a", "e300", "/p.pyc", "6100")),
        ("#guard a70d0d0a e300\n#encodings /p.pyc 61zz", CompiledGuard("a70d0d0a", "e300")),
        ("#encodings /p.pyc 6100", None),  # the module's bytecode runs the guard's code: not without it
    ],
)
def test_the_probes_guard_lines_are_taken_only_when_well_formed(line: str, expected: CompiledGuard | None) -> None:
    """Else the verifier compiles the source (a code object that cannot load would leave it unguarded)."""
    assert _compiled_guard(line.splitlines()) == expected


def test_the_probe_compiles_the_views_encodings_once() -> None:
    """The probe's bytecode of ``encodings`` with the guard's suffix is an unchecked hash-based ``.pyc`` (the
    interpreter loads it without compiling the source at every start) of a module that runs the guard."""
    import importlib.util
    import marshal

    compiled = _compiled_here()
    pyc = bytes.fromhex(compiled.pyc)
    assert pyc[:4] == importlib.util.MAGIC_NUMBER
    assert int.from_bytes(pyc[4:8], "little") == 0b01  # hash-based, the source not checked
    code = marshal.loads(pyc[16:])
    assert "_harbor_local_sandbox_guard" in code.co_names
    assert compiled.pyc_path == importlib.util.cache_from_source(code.co_filename)


def test_a_venv_the_verifier_makes_in_tmp_holds_its_own_files_only(
    tmp_path: Path, compiled: CompiledGuard | None
) -> None:
    """A venv at a fixed path of /tmp (issue #43, class 6): what the verifier installs there (its own /tmp layer)
    is imported and its distributions found; what the agent planted at that path beforehand (its layer) is not,
    the venv's site folder notwithstanding."""
    world = World(tmp_path, ["pytest", "nt"], compiled)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    ours = world.tmp / "venv" / "lib" / version / "site-packages"
    planted = world.tmp_agent / "venv" / "lib" / version / "site-packages"
    world.files(
        {
            str(planted / "nt.py"): "WHERE = 'planted'\n",
            # written through the view's /tmp once it is mounted: the verifier's own layer
            str(world.tmp / "venv" / "pyvenv.cfg"): f"home = {Path(sys.base_prefix) / 'bin'}\n",
            str(ours / "pytest.py"): "WHERE = 'verifier'\n",
            str(ours / "plug-1.0.dist-info" / "METADATA"): "Metadata-Version: 2.1\nName: plug\nVersion: 1.0\n",
            str(ours / "plug-1.0.dist-info" / "entry_points.txt"): "[pytest11]\nplug = plug\n",
        }
    )
    (world.root / "files.py").write_text(
        (world.root / "files.py").read_text()
        + f"os.makedirs({str(world.tmp / 'venv' / 'bin')!r}, exist_ok=True)\n"
        + f"os.symlink({os.path.realpath(sys.executable)!r}, {str(world.tmp / 'venv' / 'bin' / 'python')!r})\n"
    )
    code = _imports(
        [str(ours)],
        "import site\nsite.venv(set())\nimport pytest\n"
        "from importlib.metadata import entry_points\n"
        "try:\n    import nt\n    got = nt.WHERE\nexcept ImportError:\n    got = 'refused'\n"
        "print(json.dumps([pytest.WHERE, got, [e.name for e in entry_points(group='pytest11')]]))",
    )
    assert world.run(code, python=str(world.tmp / "venv" / "bin" / "python")) == ["verifier", "refused", ["plug"]]


def test_site_reads_no_pth_file_the_agent_placed(tmp_path: Path, compiled: CompiledGuard | None) -> None:
    """``site`` processing a site folder of /tmp (a venv the verifier made where the agent planted files first)
    reads the verifier's own ``.pth`` and not the agent's, whose code would run at every start."""
    world = World(tmp_path, [], compiled)
    site_dir = world.tmp / "venv" / "site-packages"
    world.files(
        {
            str(world.tmp_agent / "venv" / "site-packages" / "evil.pth"): "import builtins; builtins.EVIL = 1\n",
            str(site_dir / "own.pth"): "import builtins; builtins.OWN = 1\n",
        }
    )
    code = (
        f"import site, builtins\nsite.addsitedir({str(site_dir)!r})\n"
        "print(json.dumps([getattr(builtins, 'OWN', 0), getattr(builtins, 'EVIL', 0)]))"
    )
    assert world.run(code) == [1, 0]
    world.encodings = '"""The image\'s encodings."""\n'  # without the guard, both run
    assert world.run(code) == [1, 1]


def test_no_module_the_agent_placed_in_tmp_is_imported(tmp_path: Path, compiled: CompiledGuard | None) -> None:
    """A folder of /tmp the tests make at a fixed path (``mkdir -p``) may already hold the agent's files (issue
    #43, class 6): a ``conftest.py`` pytest would import there, a module the tests' script imports if present.
    Whatever their names, modules the agent placed in /tmp are passed over; the tests' own files beside them
    (their /tmp layer) are imported."""
    world = World(tmp_path, [], compiled)
    grader = world.tmp / "grader"
    world.files(
        {
            str(world.tmp_agent / "grader" / "conftest.py"): "WHERE = 'planted'\n",
            str(world.tmp_agent / "grader" / "fastjson.py"): "WHERE = 'planted'\n",
            str(world.tmp_agent / "grader" / "shared.py"): "WHERE = 'planted'\n",
            str(grader / "helper.py"): "WHERE = 'verifier'\n",
            # the tests' copy over the agent's file at the same path: overlayfs reports a copied-up file
            # with the device of the layer it came from, so it keeps the agent's mark and is not imported
            str(grader / "shared.py"): "WHERE = 'verifier'\n",
        }
    )
    code = _imports(
        [str(grader)],
        "got = {}\n"
        "for name in ('conftest', 'fastjson', 'helper', 'shared'):\n"
        "    try:\n        got[name] = __import__(name).WHERE\n    except ImportError:\n        got[name] = 'refused'\n"
        "print(json.dumps(got))",
    )
    expected = {"conftest": "refused", "fastjson": "refused", "helper": "verifier", "shared": "refused"}
    assert world.run(code) == expected
    world.encodings = '"""The image\'s encodings."""\n'  # without the guard, the agent's run
    assert world.run(code) == {**expected, "conftest": "planted", "fastjson": "planted", "shared": "verifier"}


def test_a_venv_the_agent_made_in_tmp_is_used_as_it_is_when_the_tests_run_it(
    tmp_path: Path, compiled: CompiledGuard | None
) -> None:
    """The task asked the agent for a venv in /tmp and the tests run its Python: its packages are the agent's
    work, imported and found as they are (its ``pyvenv.cfg`` is the agent's: the venv is the agent's)."""
    world = World(tmp_path, ["agentmod"], compiled)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_dir = world.tmp_agent / "avenv" / "lib" / version / "site-packages"
    world.files(
        {
            str(world.tmp_agent / "avenv" / "pyvenv.cfg"): f"home = {Path(sys.base_prefix) / 'bin'}\n",
            str(site_dir / "agentmod.py"): "WHERE = 'agent'\n",
            str(
                site_dir / "agentmod-1.0.dist-info" / "METADATA"
            ): "Metadata-Version: 2.1\nName: agentmod\nVersion: 1.0\n",
        }
    )
    (world.root / "files.py").write_text(
        (world.root / "files.py").read_text()
        + f"os.makedirs({str(world.tmp_agent / 'avenv' / 'bin')!r}, exist_ok=True)\n"
        + f"os.symlink({os.path.realpath(sys.executable)!r}, {str(world.tmp_agent / 'avenv' / 'bin' / 'python')!r})\n"
    )
    ours = world.tmp / "avenv" / "lib" / version / "site-packages"
    code = _imports(
        [str(ours)],
        "import site\nsite.venv(set())\nimport agentmod\nfrom importlib.metadata import version\n"
        "print(json.dumps([agentmod.WHERE, version('agentmod')]))",
    )
    assert world.run(code, python=str(world.tmp / "avenv" / "bin" / "python")) == ["agent", "1.0"]
