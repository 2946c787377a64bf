"""Build harbor-local-sandbox's C helpers with the package (metadata: pyproject.toml).

A wheel carries them in ``harbor_local_sandbox/_bin/`` and is a platform wheel (any Python 3, this machine's
architecture); an sdist, or a checkout, builds them at install; an editable install (``pip install -e``) builds
them into the source folder (``src/harbor_local_sandbox/_bin/``, ignored by git). Nothing is compiled when a
sandbox starts: ``_binaries.py`` finds them, checking ``_bin/manifest.json`` (what was built, from which source).

Every helper is linked statically: the supervisor, ``runas`` and the forwarder run inside task
images, whatever C library they have (or none); the launcher runs on the host, whose C library may be older than
the build machine's. The launcher is optional (without it sandboxes start without a parked process). ``CC``
chooses the compiler (it may hold flags, e.g. ``ccache gcc``); else the first of ``cc``, ``gcc``, ``clang`` on
``PATH``. ``CFLAGS``/``LDFLAGS`` are not used: the flags are the package's.

The wheel's platform tag says what the helpers need: when every helper it carries is a static program (an ELF
file that asks for no interpreter, ``PT_INTERP``, and no shared library, ``DT_NEEDED``), nothing of the host's C
library is used and the wheel is ``manylinux_2_17_<machine>.manylinux2014_<machine>`` (the oldest baseline pip
still names; a static glibc program needs Linux 3.2, which that baseline has); otherwise it stays
``linux_<machine>``, which claims nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build
from setuptools.errors import CompileError

PACKAGE = "harbor_local_sandbox"
#: The helpers: their name (``_<name>.c``) and whether they are linked statically (all are: see above). The
#: launcher may be missing.
HELPERS = {"supervisor": True, "runas": True, "forwarder": True, "launcher": True}
OPTIONAL = {"launcher"}
BIN_DIR = "_bin"
MANIFEST = "manifest.json"
FLAGS = ["-O2"]
INSTALL_HINT = (
    "Install a C compiler and the static C library: `apt-get install gcc libc6-dev` (Debian, Ubuntu), "
    "`dnf install gcc glibc-static` (Fedora), `apk add build-base` (Alpine); or point CC at one. "
    "(A platform wheel of harbor-local-sandbox carries the helpers built: installing one needs no compiler.)"
)


def _compiler() -> list[str]:
    """The C compiler's command line: ``$CC``, else ``cc``, ``gcc`` or ``clang``.

    Raises:
        CompileError: If there is none.
    """
    configured = shlex.split(os.environ.get("CC", ""))
    if configured:
        if shutil.which(configured[0]) is None:
            raise CompileError(
                f"harbor-local-sandbox builds its C helpers at install, and the C compiler CC={configured[0]!r} "
                f"was not found. {INSTALL_HINT}"
            )
        return configured
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    raise CompileError(
        "harbor-local-sandbox builds its C helpers at install, and no C compiler was found "
        f"(CC is unset; none of cc, gcc, clang is on PATH). {INSTALL_HINT}"
    )


def _compile(compiler: list[str], source: Path, static: bool, out: Path) -> str:
    """Compile ``source`` into ``out`` (replaced at once, so a running copy is not disturbed): ``""``, or the error."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as scratch:
        built = Path(scratch) / out.name
        command = [*compiler, *FLAGS, *(["-static"] if static else []), "-o", str(built), str(source)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except OSError as error:
            return f"{shlex.join(command)}: {error}"
        if result.returncode != 0:
            return f"{shlex.join(command)} exited with {result.returncode}:\n{(result.stdout + result.stderr).strip()}"
        built.chmod(0o755)
        built.replace(out)
    return ""


class build_helpers(Command):
    """Compile the package's C helpers into ``<build_lib>/harbor_local_sandbox/_bin`` (editable: the source folder)."""

    description = "compile harbor-local-sandbox's C helpers"
    user_options: list[tuple[str, str | None, str]] = []
    editable_mode: bool = False

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _source_dir(self) -> Path:
        return Path(self.get_finalized_command("build_py").get_package_dir(PACKAGE)).resolve()

    def _built_dir(self) -> Path:
        return Path(self.build_lib, PACKAGE, BIN_DIR)

    def _target_dir(self) -> Path:
        return self._source_dir() / BIN_DIR if self.editable_mode else self._built_dir()

    def _files(self) -> list[str]:
        return [*HELPERS, MANIFEST]

    def get_source_files(self) -> list[str]:
        package_dir = self.get_finalized_command("build_py").get_package_dir(PACKAGE)
        return [str(Path(package_dir, f"_{name}.c")) for name in HELPERS]

    def get_outputs(self) -> list[str]:
        return [str(self._built_dir() / name) for name in self._files()]

    def get_output_mapping(self) -> dict[str, str]:
        if not self.editable_mode:
            return {}
        return {str(self._built_dir() / name): str(self._target_dir() / name) for name in self._files()}

    def run(self) -> None:
        compiler = _compiler()
        target = self._target_dir()
        target.mkdir(parents=True, exist_ok=True)
        # An earlier build's manifest stays until this one is complete: what it lists is what was built before, and
        # a helper rebuilt from a new source meanwhile only looks stale (its source differs from the listed one).
        helpers: dict[str, dict[str, object]] = {}
        for name, static in HELPERS.items():
            source = self._source_dir() / f"_{name}.c"
            digest = hashlib.sha256(source.read_bytes()).hexdigest()
            self.announce(f"compiling {source.name} ({'static' if static else 'dynamic'}) into {target}", level=2)
            error = _compile(compiler, source, static, target / name)
            if error and name not in OPTIONAL:
                raise CompileError(
                    f"harbor-local-sandbox could not build its C helper {source.name}: {error[-3000:]}\n"
                    "It runs inside task images of any C library, so it is linked statically (-static), which needs "
                    f"the static C library (libc.a). {INSTALL_HINT}"
                )
            if error:
                (target / name).unlink(missing_ok=True)
                self.warn(f"{source.name} was not built (sandboxes then start without it): {error[-1500:]}")
            helpers[name] = {"static": static, "source_sha256": digest, "built": not error, "error": error[-1500:]}
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=False)
        manifest = {
            "format": 1,
            "compiler": shlex.join(compiler),
            "compiler_version": (version.stdout.splitlines() or [""])[0],
            "helpers": helpers,
        }
        scratch = target / f".{MANIFEST}.tmp"
        scratch.write_text(json.dumps(manifest, indent=1) + "\n")
        scratch.replace(target / MANIFEST)


#: Architectures (``platform.machine()`` as wheels spell it) that have a manylinux2014 baseline (PEP 599).
MANYLINUX2014_MACHINES = {"x86_64", "i686", "aarch64", "armv7l", "ppc64", "ppc64le", "s390x"}


def elf_links(path: Path) -> tuple[str | None, int]:
    """The program interpreter (``PT_INTERP``) an ELF file asks for, if any, and how many shared libraries it
    names (``DT_NEEDED``): ``(None, 0)`` for a static program.

    Raises:
        ValueError: If ``path`` is not an ELF file.
    """
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        raise ValueError(f"{path} is not an ELF file")
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    if wide:  # ELF64: e_phoff at 0x20, e_phentsize and e_phnum at 0x36; p_type, p_flags, p_offset, .., p_filesz
        (phoff,) = struct.unpack_from(order + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x36)
        header, dyn = order + "IIQQQQ", order + "qQ"
    else:  # ELF32: e_phoff at 0x1c, e_phentsize and e_phnum at 0x2a; p_type, p_offset, p_vaddr, p_paddr, p_filesz
        (phoff,) = struct.unpack_from(order + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x2A)
        header, dyn = order + "IIIII", order + "iI"
    interpreter, needed = None, 0
    for index in range(phnum):
        fields = struct.unpack_from(header, data, phoff + index * phentsize)
        kind, (offset, size) = fields[0], ((fields[2], fields[5]) if wide else (fields[1], fields[4]))
        if kind == 3:  # PT_INTERP
            interpreter = data[offset : offset + size].rstrip(b"\0").decode(errors="replace")
        elif kind == 2:  # PT_DYNAMIC: (d_tag, d_val) pairs up to DT_NULL
            step = struct.calcsize(dyn)
            for entry in range(offset, offset + size - step + 1, step):
                tag, _ = struct.unpack_from(dyn, data, entry)
                if tag == 0:
                    break
                needed += tag == 1  # DT_NEEDED
    return interpreter, needed


def wheel_platform(helpers_dir: Path, platform: str) -> str:
    """The platform tag of a wheel carrying the helpers in ``helpers_dir``, built for ``platform`` (``linux_<m>``):
    manylinux2014 when every helper there is a static program, else ``platform`` itself (see above)."""
    machine = platform.removeprefix("linux_")
    programs = [helpers_dir / name for name in HELPERS if (helpers_dir / name).is_file()]
    if not platform.startswith("linux_") or machine not in MANYLINUX2014_MACHINES or not programs:
        return platform
    if any(elf_links(program) != (None, 0) for program in programs):
        return platform
    return f"manylinux_2_17_{machine}.manylinux2014_{machine}"


class PlatformDistribution(Distribution):
    """A distribution with platform-specific files: installed in ``platlib``, its wheel not ``-none-any``."""

    def has_ext_modules(self) -> bool:
        return True


class platform_wheel(bdist_wheel):
    """A wheel for this platform, any Python 3: the helpers are programs, not modules. Its platform tag is
    :func:`wheel_platform`'s, from the helpers built (``linux_<machine>`` until they are)."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        if self.plat_name_supplied:  # --plat-name: the builder's own claim
            return "py3", "none", platform
        helpers = Path(self.get_finalized_command("build_helpers").get_outputs()[0]).parent
        return "py3", "none", wheel_platform(helpers, platform)


class build_with_helpers(build):
    sub_commands = [*build.sub_commands, ("build_helpers", None)]


setup(
    distclass=PlatformDistribution,
    cmdclass={"build": build_with_helpers, "build_helpers": build_helpers, "bdist_wheel": platform_wheel},
)
