"""Building a task's Dockerfile into a layer the host root (``root="host"``) can start from.

The host's ``/usr`` *is* the base image, so ``FROM`` is not honoured; ``WORKDIR``, ``ENV``,
``ARG``, ``SHELL``, ``COPY``/``ADD`` from the context and ``RUN`` are. ``RUN`` runs once per
distinct environment in a build box with the host's network; ``pip install`` goes to the layer's
venv (``/opt/venv-layer``), shared read-only by its sandboxes; ``apt-get install`` of packages the
host has is a no-op, of others a clear build error. A layer, cached by content hash (``_cache.py``),
is ``rootfs/`` (copied into each sandbox at start), ``venv/`` and ``image.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath

from trl_harbor.sandboxes import _hostfs
from trl_harbor.sandboxes._binaries import SYSTEM_PATH, default_cache_dir, sandbox_python
from trl_harbor.sandboxes._box import Box, BoxConfig
from trl_harbor.sandboxes._cache import BuildCache
from trl_harbor.sandboxes._hostfs import remove_tree
from trl_harbor.sandboxes._lifetime import new_box_name, state_root
from trl_harbor.sandboxes._mounts import LAYER_VENV, SANDBOX_VENV, prepare_rootfs
from trl_harbor.sandboxes.errors import ImageBuildError

logger = logging.getLogger(__name__)

BUILDER_VERSION = "2"
#: Writable folders every sandbox starts with (besides the mount points), built into each layer.
PRIVATE_DIRS = ("tmp", "root", "home/user", "logs/agent", "logs/verifier", "logs/artifacts")
# Host variables a build may need to reach a package index (never the agent).
_BUILD_PASSTHROUGH = (
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_CERT", "PIP_DEFAULT_TIMEOUT",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
)  # fmt: skip
_IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL", "VOLUME", "ONBUILD"}
_APT_WORDS = {"apt-get", "apt"}


@dataclass
class Instruction:
    """One Dockerfile instruction: its keyword, raw argument text and first line number."""

    keyword: str
    value: str
    line: int


@dataclass
class Image:
    """A built layer.

    Attributes:
        path: The layer directory.
        workdir: The image's working directory (last ``WORKDIR``), or ``None``.
        env: Environment variables set by ``ENV``.
    """

    path: Path
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def rootfs(self) -> Path:
        """Files every sandbox of this image starts with (copied at start)."""
        return self.path / "rootfs"

    @property
    def venv(self) -> Path:
        """The shared, read-only Python layer."""
        return self.path / "venv"


def parse_dockerfile(text: str) -> list[Instruction]:
    """Split a Dockerfile into instructions, joining continuation lines.

    Args:
        text: The Dockerfile's content.

    Returns:
        The instructions in order, keywords upper-cased.
    """
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        keyword, _, value = pending.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
        pending = ""
    if pending:
        keyword, _, value = pending.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
    return instructions


def _json_list(value: str) -> list[str] | None:
    if value.startswith("["):
        with contextlib.suppress(json.JSONDecodeError):
            parsed = json.loads(value)
            if isinstance(parsed, list) and all(isinstance(v, str) for v in parsed):
                return parsed
    return None


def _parse_env(value: str) -> dict[str, str]:
    words = shlex.split(value)
    if words and "=" not in words[0]:  # legacy "ENV KEY value with spaces"
        key, _, rest = value.partition(" ")
        return {key: rest.strip().strip('"')}
    return dict(word.split("=", 1) for word in words)


_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::-([^}]*))?\}|(\w+))")


def _substitute(value: str, variables: dict[str, str]) -> str:
    """Expand ``$NAME``, ``${NAME}`` and ``${NAME:-default}`` as Docker does."""

    def expand(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if name in variables:
            return variables[name]
        return match.group(2) or ""

    return _VARIABLE.sub(expand, value)


@dataclass
class _BuildState:
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    shell: list[str] = field(default_factory=lambda: ["/bin/sh", "-c"])
    workdir_set: bool = False


class ImageBuilder(BuildCache[Image]):
    """Builds and caches layers for task environments (one per process is enough: ``_cache.CACHE``).

    Args:
        cache_dir: Where layers are kept; defaults to ``$TRL_HARBOR_CACHE_DIR`` or
            ``~/.cache/trl-harbor``.
        build_args: Values for ``ARG`` instructions.
    """

    def __init__(self, cache_dir: Path | None = None, build_args: dict[str, str] | None = None):
        super().__init__(build_args)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()

    def _salt(self) -> str:  # the builder and the host Python a layer's venvs use
        return f"builder={BUILDER_VERSION};python={_python_version()};"

    def _folder(self, key: str) -> Path:
        return self.cache_dir / "layers" / key

    async def _load(self, environment_dir: Path, final: Path, task_name: str) -> Image:
        return _load_image(final)

    # -- the build -------------------------------------------------------------

    async def _build(self, environment_dir: Path, out: Path, key: str, task_name: str) -> None:
        dockerfile = environment_dir / "Dockerfile"
        rootfs, venv = out / "rootfs", out / "venv"
        rootfs.mkdir(parents=True)
        make_venv(venv, LAYER_VENV)
        make_venv(rootfs / SANDBOX_VENV.lstrip("/"), SANDBOX_VENV, layer=LAYER_VENV)
        # The skeleton every sandbox needs, so that starting one is a single copy.
        prepare_rootfs(rootfs)
        for name in PRIVATE_DIRS:
            (rootfs / name).mkdir(parents=True, exist_ok=True)
        state = _BuildState(args=dict(self.build_args))
        box: Box | None = None
        instructions = parse_dockerfile(dockerfile.read_text()) if dockerfile.exists() else []
        stages = [i for i in instructions if i.keyword == "FROM"]
        if len(stages) > 1:
            raise ImageBuildError(
                f"{dockerfile}:{stages[1].line}: multi-stage builds (a second FROM) cannot be "
                f"built on the host root (task {task_name!r}). Use the task's image (the local "
                "sandbox's default, root='image') or environment_type='docker'."
            )

        def fail(instruction: Instruction, why: str, output: str = "") -> ImageBuildError:
            return ImageBuildError(
                f"{dockerfile}:{instruction.line}: `{instruction.keyword} {instruction.value}` {why} "
                f"(task {task_name!r}). The host root (root='host') uses the host as the base image; "
                "run this task on its own image (the local sandbox's default, root='image') or "
                "with environment_type='docker' instead." + (f"\nOutput of the step:\n{output}" if output else "")
            )

        try:
            for ins in instructions:
                variables = {**state.args, **state.env}
                if ins.keyword in ("FROM", *_IGNORED):
                    continue
                if ins.keyword == "ARG":
                    name, _, default = ins.value.partition("=")
                    state.args.setdefault(name.strip(), default.strip().strip('"'))
                elif ins.keyword == "ENV":
                    state.env.update({k: _substitute(v, variables) for k, v in _parse_env(ins.value).items()})
                elif ins.keyword == "WORKDIR":
                    target = _substitute(ins.value.strip('"'), variables)
                    state.workdir = str(PurePosixPath(state.workdir) / target)
                    state.workdir_set = True
                    (rootfs / state.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
                elif ins.keyword == "SHELL":
                    shell = _json_list(ins.value)
                    if not shell:
                        raise fail(ins, "must be a JSON list")
                    state.shell = shell
                elif ins.keyword == "USER":
                    user = _substitute(ins.value, variables).split(":")[0]
                    if user not in ("root", "0"):
                        raise fail(ins, "asks for a non-root user, which the local sandbox cannot provide")
                elif ins.keyword in ("COPY", "ADD"):
                    self._copy(ins, environment_dir, rootfs, state, variables, fail)
                elif ins.keyword == "RUN":
                    if _apt_satisfied(ins.value, fail, ins):
                        continue
                    if box is None:
                        box = await _build_box(rootfs, venv, out)
                    await self._run(box, ins, state, fail)
                else:
                    raise fail(ins, "is not supported")
        finally:
            if box is not None:
                await box.kill()
                remove_tree(box.state_dir)
        (out / "image.json").write_text(
            json.dumps({"workdir": state.workdir if state.workdir_set else None, "env": state.env}, indent=2)
        )

    def _copy(self, ins, environment_dir, rootfs, state, variables, fail) -> None:
        words = _json_list(ins.value) or shlex.split(ins.value)
        words = [_substitute(w, variables) for w in words if not w.startswith("--")]
        if any(w.startswith("--from") for w in shlex.split(ins.value)):
            raise fail(ins, "copies from another build stage")
        if len(words) < 2:
            raise fail(ins, "needs a source and a destination")
        *sources, dest = words
        dest_path = PurePosixPath(state.workdir) / dest
        into_dir = dest.endswith("/") or len(sources) > 1
        context = environment_dir.resolve()
        for source in sources:
            if re.match(r"^[a-z]+://", source):
                raise fail(ins, "downloads a URL, which the local sandbox does not do at build time")
            matches = sorted(context.glob(source)) if any(c in source for c in "*?[") else [context / source]
            for match in matches:
                resolved = match.resolve()
                if not resolved.is_relative_to(context):
                    raise fail(ins, f"reads {source!r}, which is outside the build context")
                if not resolved.exists():
                    raise fail(ins, f"copies {source!r}, which does not exist in {environment_dir}")
                if resolved.is_dir():
                    _hostfs.upload_dir(rootfs, resolved, str(dest_path))
                elif ins.keyword == "ADD" and tarfile.is_tarfile(resolved):
                    target_dir = rootfs / str(dest_path).lstrip("/")
                    target_dir.mkdir(parents=True, exist_ok=True)
                    with tarfile.open(resolved) as archive:
                        archive.extractall(target_dir, filter="data")
                else:
                    target = dest_path / resolved.name if into_dir or _is_dir(rootfs, dest_path) else dest_path
                    _hostfs.upload_file(rootfs, resolved, str(target))

    async def _run(self, box: Box, ins: Instruction, state: _BuildState, fail) -> None:
        argv = _json_list(ins.value)
        command = shlex.join(argv) if argv else ins.value
        if not argv and state.shell != ["/bin/sh", "-c"]:
            command = shlex.join([*state.shell, command])
        env = {
            "PATH": f"{LAYER_VENV}/bin:{SYSTEM_PATH}",
            "HOME": "/root",
            "VIRTUAL_ENV": LAYER_VENV,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "DEBIAN_FRONTEND": "noninteractive",
            **{k: os.environ[k] for k in _BUILD_PASSTHROUGH if k in os.environ},
            **state.args,
            **state.env,
        }
        logger.info("building: RUN %s", command)
        result = await box.supervisor.run(
            "set -e\n" + command if not argv else command, cwd=state.workdir, env=env, timeout=3600,
            output_cap=64 * 1024,
        )  # fmt: skip
        if result["rc"] != 0:
            output = (result["stdout"] + result["stderr"]).strip()[-3000:]
            raise fail(ins, f"failed with exit code {result['rc']}", output)


def _is_dir(rootfs: Path, path: PurePosixPath) -> bool:
    candidate = rootfs / str(path).lstrip("/")
    return candidate.is_dir() and not candidate.is_symlink()


def _apt_satisfied(command: str, fail, ins: Instruction) -> bool:
    """Accept an apt-only RUN when every package it installs is already on the host.

    Raises:
        ImageBuildError: If it installs packages the host lacks.
    """
    if not any(word in command.split() for word in _APT_WORDS):
        return False
    packages: list[str] = []
    for part in re.split(r"&&|;|\|\|", command):
        words = shlex.split(part)
        if not words:
            continue
        if words[0] in _APT_WORDS and "install" in words:
            packages += [w.split("=")[0] for w in words[words.index("install") + 1 :] if not w.startswith("-")]
        elif words[0] in _APT_WORDS or words[:2] == ["rm", "-rf"] or words[0] in ("apt-get", "true"):
            continue
        else:
            return False  # mixed with other work: run it and report what fails
    missing = [p for p in packages if not _host_has_package(p)]
    if missing:
        raise fail(
            ins,
            f"installs system packages the host does not have ({', '.join(missing)}); install them on "
            f"the host (`apt-get install {' '.join(missing)}`) so the sandbox sees them",
        )
    return True


def _host_has_package(name: str) -> bool:
    if not shutil.which("dpkg-query"):
        return False
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True, check=False)
    return "install ok installed" in result.stdout


async def _build_box(rootfs: Path, venv: Path, out: Path) -> Box:
    box = Box(
        BoxConfig(rootfs=rootfs, layer_venv=venv, layer_writable=True, network="host", pids_max=None),
        state_root() / new_box_name(f"build-{out.name}"),
    )
    await box.start()
    return box


def _python_version() -> str:
    return os.path.realpath(sandbox_python()) + ":" + _sandbox_python_version()


@cache
def _sandbox_python_version() -> str:
    out = subprocess.run(
        [sandbox_python(), "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def make_venv(path: Path, location: str, layer: str | None = None) -> None:
    """Write a virtual environment by hand (in well under a millisecond).

    It uses the sandbox's system Python with its site-packages visible, so the
    system's ``pip`` works inside it; being a venv, ``pip install`` is allowed
    despite PEP 668 and installs into it.

    Args:
        path: Host directory to create.
        location: Where the venv will be mounted inside the sandbox.
        layer: Inside path of a lower venv whose packages this one also sees.
    """
    version = _sandbox_python_version()
    bin_dir = path / "bin"
    site = path / "lib" / f"python{version}" / "site-packages"
    bin_dir.mkdir(parents=True, exist_ok=True)
    site.mkdir(parents=True, exist_ok=True)
    (path / "pyvenv.cfg").write_text(
        f"home = {os.path.dirname(sandbox_python())}\ninclude-system-site-packages = true\nversion = {version}\n"
    )
    for name in ("python", "python3", f"python{version}"):
        link = bin_dir / name
        if not link.is_symlink():
            link.symlink_to(sandbox_python())
    for name in ("pip", "pip3", f"pip{version}"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {location}/bin/python -m pip "$@"\n')
        script.chmod(0o755)
    if layer:
        (site / "_trl_harbor_layer.pth").write_text(f"{layer}/lib/python{version}/site-packages\n")


def _load_image(path: Path) -> Image:
    meta = json.loads((path / "image.json").read_text())
    return Image(path=path, workdir=meta.get("workdir"), env=meta.get("env") or {})
