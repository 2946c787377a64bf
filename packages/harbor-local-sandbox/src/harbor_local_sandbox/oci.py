"""Task images for the local sandbox: ``FROM`` honoured, Dockerfiles built by buildah.

A task's ``environment/Dockerfile`` is built by `buildah <https://buildah.io>`_, a
daemonless builder packaged by Debian, Ubuntu and Fedora, exactly as ``docker build``
would build it: base images pulled from OCI registries, multi-stage builds,
``COPY --from``, ``USER``, ``ARG``/``ENV`` substitution, ``.dockerignore``. The result's
root, mounted once by buildah (the *image root*), is what every sandbox of the task
mounts read-only under its own copy-on-write layer (see ``_roots.py``).

Registries are found the way every containers tool finds them: ``registries.conf``
(mirrors, insecure registries, short-name aliases; ``CONTAINERS_REGISTRIES_CONF``
overrides its path) and ``auth.json`` (``REGISTRY_AUTH_FILE``). Nothing here is
specific to one trainer.

Cache layout under ``<cache_dir>`` (default ``~/.cache/harbor-local-sandbox``,
``HARBOR_LOCAL_SANDBOX_CACHE_DIR`` overrides):

* ``containers/`` -- buildah's storage: base images and the task images built on them,
  one copy per layer however many tasks share it. Each task image has one buildah
  container, ``harbor-local-sandbox-<key>``, whose mounted root (an overlay of the image's layers,
  plus the mount points sandboxes need) is the *image root* sandboxes start from: disk
  use is per layer, not per task and not per sandbox;
* ``images/<key>/image.json`` -- the task image's :class:`ImageRecord` (``ENV``,
  ``WORKDIR``, ``USER``, ``ENTRYPOINT``, ``CMD``, its buildah image and container).
  ``<key>`` hashes the Dockerfile, the build context and the build arguments: an
  unchanged task never rebuilds.

Builds need root (buildah runs with ``--isolation chroot``, which needs no cgroups, no
daemon and no OCI runtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, Field

from harbor_local_sandbox import _hostfs, _userns
from harbor_local_sandbox._binaries import SYSTEM_PATH, default_cache_dir, which
from harbor_local_sandbox._cache import KeyedLocks, replace_text
from harbor_local_sandbox._hostfs import remove_tree
from harbor_local_sandbox._mounts import unmount_under
from harbor_local_sandbox.errors import BaseImageUnavailableError, ImageBuildError, ImageError, SandboxUnavailableError

logger = logging.getLogger(__name__)

#: Part of every image key: bump when a change here changes what a build produces.
BUILDER_VERSION = "oci-3"
#: Proxy settings ``docker build`` passes to ``RUN`` without persisting them (predefined ARGs).
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "FTP_PROXY", "NO_PROXY", "ALL_PROXY")
#: Where the host's CA bundle appears inside builds and sandboxes.
HOST_CA_BUNDLE = "/run/harbor-local-sandbox/host-ca.crt"
_DEFAULT_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
_EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")


class ImageConfig(BaseModel):
    """What ``docker run`` takes from an image's configuration.

    Attributes:
        env: ``ENV`` variables (in order).
        workdir: ``WORKDIR`` (``None``: ``/``).
        user: ``USER`` (``None``: root).
        entrypoint: ``ENTRYPOINT`` (exec form).
        cmd: ``CMD`` (exec form).
    """

    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)


class ImageRecord(BaseModel):
    """A built task image, stored as ``image.json`` next to its root.

    Attributes:
        key: Content key (Dockerfile, context, build arguments, builder version).
        image_id: buildah's image ID of the build.
        source: The environment folder it was built from (informative).
        bases: The ``FROM`` images it was built on.
        built_at: Unix time of the build.
        build_seconds: How long the build (pulls included) took.
        config: The image's run configuration.
        container: The buildah container whose mounted root sandboxes start from.
    """

    key: str
    image_id: str = ""
    container: str = ""
    source: str = ""
    bases: list[str] = Field(default_factory=list)
    built_at: float = 0.0
    build_seconds: float = 0.0
    config: ImageConfig = Field(default_factory=ImageConfig)


@dataclass(eq=False)
class BuiltImage:
    """A built image: its folder, record and (once :meth:`ImageStore.get` mounted it) root."""

    path: Path
    record: ImageRecord
    mountpoint: Path | None = None

    @property
    def rootfs(self) -> Path:
        """The image's root directory (read-only to sandboxes).

        Raises:
            ImageError: If the image has not been mounted in this process.
        """
        if self.mountpoint is None:
            raise ImageError(f"the image {self.record.key} is not mounted (get it from ImageStore.get)")
        return self.mountpoint

    @property
    def config(self) -> ImageConfig:
        """The image's run configuration."""
        return self.record.config


@cache
def buildah_path() -> str:
    """The ``buildah`` executable.

    Raises:
        SandboxUnavailableError: If buildah is not installed.
    """
    found = which("buildah")
    if not found:
        raise SandboxUnavailableError(
            "Building task images for the local sandbox needs buildah, which is not installed. "
            "Install it (`apt-get install buildah`, `dnf install buildah`), or use a backend with an image "
            "builder of its own (environment_type='docker' with a Docker daemon, or a remote one: modal, e2b, ...)."
        )
    return found


# -- host CA certificates and proxies ---------------------------------------------


def host_ca_bundle() -> Path | None:
    """The host's CA bundle: ``SSL_CERT_FILE`` (or ``REQUESTS_CA_BUNDLE``/``PIP_CERT``), else Debian's."""
    for variable in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT"):
        value = os.environ.get(variable)
        if value and os.path.isfile(value):
            return Path(value)
    return Path(_DEFAULT_BUNDLE) if os.path.isfile(_DEFAULT_BUNDLE) else None


def _extra_cas(known: Path | None = None) -> tuple[tuple[str, str], ...]:
    """``(host file, OpenSSL hashed name)`` of the host's local CAs (``/usr/local/share/ca-certificates``).

    ``known``: a file keeping the names found (one ``openssl`` run per certificate), each under its
    file's identity (device, inode, size, times): a certificate replaced or changed is hashed again."""
    if not _EXTRA_CA_DIR.is_dir():
        return ()
    found = []
    stamps = {}
    for path in sorted(_EXTRA_CA_DIR.rglob("*.crt")):
        with contextlib.suppress(OSError):
            st = path.stat()
            stamps[str(path)] = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    with _CA_LOCK:
        memo = _CA_NAMES.setdefault(known, {})
        if known is not None and not memo:
            with contextlib.suppress(OSError, ValueError):
                stored = json.loads(known.read_text())
                memo.update({k: tuple(v) for k, v in stored.items() if isinstance(v, list) and len(v) == 2})
        changed = False
        for path, stamp in stamps.items():
            kept = memo.get(path)
            if kept is None or kept[0] != stamp:
                hashed = _subject_hash(path)
                if hashed is None:
                    continue
                memo[path] = kept = (stamp, hashed)
                changed = True
            found.append((path, kept[1]))
        if changed and known is not None:
            with contextlib.suppress(OSError):
                known.parent.mkdir(parents=True, exist_ok=True)
                replace_text(known, json.dumps({k: list(v) for k, v in memo.items() if k in stamps}))
    return tuple(found)


#: The hashed names found, by the file that keeps them (``None``: kept in this process only).
_CA_NAMES: dict[Path | None, dict[str, tuple[str, str]]] = {}
_CA_LOCK = threading.Lock()


def _subject_hash(path: str) -> str | None:
    """OpenSSL's hashed name of the certificate at ``path`` (``None``: no openssl, or not a certificate)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    result = subprocess.run([openssl, "x509", "-subject_hash", "-noout", "-in", path], capture_output=True, text=True)
    name = result.stdout.strip()
    return f"{name}.0" if result.returncode == 0 and re.fullmatch(r"[0-9a-f]{8}", name) else None


def host_trust_mounts(scratch: Path) -> list[tuple[str, str]]:
    """Read-only ``(host path, target)`` mounts that make the host's CAs trusted inside.

    * the host bundle at :data:`HOST_CA_BUNDLE`;
    * each local CA as an OpenSSL hashed name in ``/etc/ssl/certs`` (OpenSSL, Python's
      ``ssl``, curl and recent pip look there), so the image's own bundle stays untouched
      and ``apt-get install ca-certificates`` still works;
    * a ``pip.conf`` naming the host bundle (older pip uses its own bundle otherwise).

    Nothing on the host is written except ``scratch/pip.conf``.

    Args:
        scratch: A private folder for the generated ``pip.conf``.

    Returns:
        The mounts (empty when the host has no CA bundle).
    """
    bundle = host_ca_bundle()
    if bundle is None:
        return []
    pip_conf = scratch / "pip.conf"
    if not pip_conf.exists():
        scratch.mkdir(parents=True, exist_ok=True)
        pip_conf.write_text(f"[global]\ncert = {HOST_CA_BUNDLE}\n")
    mounts = [(str(bundle), HOST_CA_BUNDLE), (str(pip_conf), "/etc/pip.conf")]
    mounts += [(path, f"/etc/ssl/certs/{hashed}") for path, hashed in _extra_cas(scratch / "ca-names.json")]
    return mounts


#: What makes each tool that keeps its own trust store take the host's bundle: OpenSSL and uv
#: (``SSL_CERT_FILE``; ``UV_NATIVE_TLS`` so that uv reads it rather than its built-in roots), requests
#: (certifi otherwise), Node and npm (their own bundled roots otherwise), git.
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO", "UV_NATIVE_TLS")


def host_ca_env() -> dict[str, str]:
    """The variables (:data:`CA_VARIABLES`) naming the host bundle at :data:`HOST_CA_BUNDLE` (empty without one)."""
    if host_ca_bundle() is None:
        return {}
    return {name: "1" if name == "UV_NATIVE_TLS" else HOST_CA_BUNDLE for name in CA_VARIABLES}


def with_build_args(dockerfile_text: str, names: tuple[str, ...]) -> str:
    """The Dockerfile with ``ARG NAME`` declared for ``names`` at the start of every stage.

    A build argument reaches ``RUN`` steps only where the stage declares it (the proxy variables
    excepted, which builders predefine). Declared with no default and given with ``--build-arg``,
    they are in each ``RUN``'s environment, not in the image's configuration, and an ``ENV`` or
    ``ARG`` of the Dockerfile that sets one wins, as it comes later. Heredoc bodies are not
    instructions; the ``escape`` parser directive is honoured.
    """
    escape = "\\"
    match = re.match(r"(?:\s*#[^\n]*\n)*?\s*#\s*escape\s*=\s*(\S)", dockerfile_text, re.IGNORECASE)
    if match:
        escape = match.group(1)
    declarations = [f"ARG {name}" for name in names]
    out: list[str] = []
    in_from = False
    heredoc: str | None = None
    for line in dockerfile_text.splitlines():
        out.append(line)
        stripped = line.strip()
        if heredoc is not None:
            if stripped == heredoc:
                heredoc = None
            continue
        if not in_from:
            if re.match(r"from\s", stripped, re.IGNORECASE):
                in_from = True
            else:
                found = re.search(r"<<-?([\"']?)(\w+)\1", line) if not stripped.startswith("#") else None
                heredoc = found.group(2) if found else None
                continue
        if stripped.endswith(escape):
            continue  # the FROM goes on
        in_from = False
        out.extend(declarations)
    return "\n".join(out) + "\n"


def host_proxy_env() -> dict[str, str]:
    """The host's proxy variables (both spellings), as ``docker build`` forwards them."""
    found = {}
    for name in PROXY_VARIABLES:
        for variant in (name, name.lower()):
            if os.environ.get(variant):
                found[variant] = os.environ[variant]
    return found


# -- Dockerfile facts needed before the build ---------------------------------------


def base_images(dockerfile_text: str) -> list[str]:
    """The registry images a Dockerfile's ``FROM`` lines name (stage names and ``scratch`` left out).

    References with unresolved ``${...}`` variables are left to the builder.
    """
    stages: set[str] = set()
    images: list[str] = []
    text = re.sub(r"\\\n", " ", dockerfile_text)
    for line in text.splitlines():
        words = line.strip().split()
        if not words or words[0].upper() != "FROM":
            continue
        words = [w for w in words[1:] if not w.startswith("--")]
        if not words:
            continue
        ref = words[0]
        if len(words) >= 3 and words[1].upper() == "AS":
            stages.add(words[2].lower())
        if ref.lower() in stages or ref == "scratch" or "$" in ref or ref in images:
            continue
        images.append(ref)
    return images


# -- buildah ---------------------------------------------------------------------


class Buildah:
    """buildah on one storage folder: its commands, and the base images in it. With ``debian_bootstrap``, a
    ``debian:<suite>`` base that cannot be pulled is made from Debian's packages by ``mmdebstrap``, with a warning."""

    def __init__(self, storage_dir: Path, cache_dir: Path, debian_bootstrap: bool = True):
        self.storage_dir = storage_dir
        self.cache_dir = cache_dir
        self.debian_bootstrap = debian_bootstrap
        self._locks = KeyedLocks()

    @property
    def host(self) -> _userns.Host:
        """Where buildah runs: here as root, else in this user's holder, as its root (``_userns.py``)."""
        return _userns.host()

    def _argv(self) -> list[str]:
        return [
            *self.host.command(),
            buildah_path(),
            "--root", str(self.storage_dir / "storage"),
            "--runroot", str(self.storage_dir / "run"),
            "--storage-driver", "overlay",
            # One id (no subordinate ids): the layers' other owners cannot exist; their files become root's.
            *(["--storage-opt", "overlay.ignore_chown_errors=true"] if self.host.ids == 1 else []),
        ]  # fmt: skip

    async def run(self, *args: str, timeout: float = 3600) -> tuple[int, str, str]:
        """Run ``buildah ARGS`` on this storage: its exit code, stdout and stderr (killed if cancelled or late)."""
        env = {k: v for k, v in os.environ.items() if k != "BUILDAH_ISOLATION"}
        if self.host.rootless:  # buildah is root in the holder's namespaces: it must not make its own
            env.update(_CONTAINERS_USERNS_CONFIGURED="1", _CONTAINERS_ROOTLESS_UID=str(os.getuid()))
        proc = await asyncio.create_subprocess_exec(
            *self._argv(), *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await proc.wait()
            raise
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    def run_sync(self, *args: str) -> None:
        """Run ``buildah ARGS`` on this storage, blocking, for clean-ups whose failure does not matter."""
        env = dict(os.environ)
        if self.host.rootless:
            env.update(_CONTAINERS_USERNS_CONFIGURED="1", _CONTAINERS_ROOTLESS_UID=str(os.getuid()))
        subprocess.run([*self._argv(), *args], capture_output=True, check=False, env=env)

    async def inspect(self, image_id: str) -> ImageConfig:
        """``docker run``'s settings of a built image (``ImageBuildError`` if buildah cannot inspect it)."""
        rc, stdout, stderr = await self.run("inspect", "--type", "image", image_id)
        if rc != 0:
            raise ImageBuildError(f"buildah could not inspect the built image {image_id}: {stderr.strip()}")
        return image_config(json.loads(stdout))

    async def pull(self, ref: str) -> None:
        """Pull ``ref`` into the storage unless it is there; concurrent callers share one pull.

        Args:
            ref: The image reference, as written after ``FROM``.

        Raises:
            BaseImageUnavailableError: If no registry could provide it.
        """
        lock = self._locks(f"pull:{ref}")
        async with lock:
            _private(self.storage_dir)
            lock_dir = self.storage_dir / "locks"
            lock_dir.mkdir(parents=True, exist_ok=True)
            name = hashlib.sha256(ref.encode()).hexdigest()[:16]
            with open(lock_dir / f"pull-{name}.lock", "w") as lock_file:
                await asyncio.to_thread(fcntl.flock, lock_file, fcntl.LOCK_EX)
                rc, _, err = await self.run("pull", "--quiet", "--policy", "missing", ref)
                if rc == 0:
                    return
                suite = debian_suite(ref)
                if suite is None or not self.debian_bootstrap or not shutil.which("mmdebstrap"):
                    raise BaseImageUnavailableError(_pull_error(ref, err, self.cache_dir))
                logger.warning(
                    "the base image %s could not be pulled; bootstrapping Debian %s from Debian's packages "
                    "with mmdebstrap instead (a minbase system, close to but not the same as the registry's image)",
                    ref, suite,
                )  # fmt: skip
                await self._bootstrap_debian(ref, suite, err)

    async def _bootstrap_debian(self, ref: str, suite: str, pull_error: str) -> None:
        scratch = self.storage_dir / "bootstrap" / f"{suite}-{os.getpid()}"
        await asyncio.to_thread(remove_tree, scratch)
        scratch.mkdir(parents=True)
        try:
            tarball = scratch / "rootfs.tar"
            proc = await asyncio.create_subprocess_exec(
                "mmdebstrap", "--quiet", "--variant=minbase", suite, str(tarball),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await proc.communicate()
            if proc.returncode != 0:
                raise BaseImageUnavailableError(
                    _pull_error(ref, pull_error, self.cache_dir)
                    + f"\nBootstrapping Debian {suite} with mmdebstrap failed too:\n"
                    + err.decode(errors="replace")[-1500:]
                )
            rc, container, err_text = await self.run("from", "--quiet", "scratch")
            if rc != 0:
                raise ImageBuildError(f"buildah could not start the Debian image: {err_text.strip()}")
            container = container.strip()
            try:
                for step in (
                    ["add", "--quiet", container, str(tarball), "/"],
                    ["config", "--env", f"PATH={SYSTEM_PATH}", "--cmd", "bash", container],
                    ["commit", "--quiet", "--rm", container, _qualified(ref)],
                ):
                    rc, _, err_text = await self.run(*step)
                    if rc != 0:
                        raise ImageBuildError(f"making the Debian {suite} image failed: {err_text.strip()}")
            finally:
                await self.run("rm", container)
        finally:
            await asyncio.to_thread(remove_tree, scratch)

    async def load_archive(self, archive: Path, ref: str) -> None:
        """Load a base image from an archive and name it ``ref`` (see :meth:`ImageStore.load_archive`)."""
        errors = []
        for transport in ("oci-archive", "docker-archive"):
            rc, stdout, stderr = await self.run("pull", "--quiet", f"{transport}:{archive}")
            if rc == 0:
                image_id = stdout.strip().splitlines()[-1]
                for name in {ref, _qualified(ref)}:
                    rc, _, stderr = await self.run("tag", image_id, name)
                    if rc != 0:
                        raise ImageError(f"could not name the loaded image {ref}: {stderr.strip()}")
                return
            errors.append(f"{transport}: {stderr.strip()}")
        raise ImageError(f"{archive} is neither an OCI nor a Docker archive buildah can read:\n" + "\n".join(errors))


def _context_signature(environment_dir: Path) -> tuple:
    """What changes with a build context's files: a cheap check before hashing them."""
    entries = []
    for path in sorted(environment_dir.rglob("*")):
        with contextlib.suppress(OSError):
            st = path.lstat()
            entries.append((str(path), st.st_size, st.st_mtime_ns, st.st_mode))
    return (str(environment_dir.resolve()), tuple(entries))


def _private(*folders: Path) -> None:
    # Image roots hold the image's setuid programs, owned by the host's root: like
    # /var/lib/docker, nobody else on the host may reach them.
    for path in folders:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)


# -- the store ---------------------------------------------------------------------


class ImageStore:
    """Builds task images with buildah and caches their roots by content.

    A build is named by a content key of its context (the builder's version, its arguments, the
    context's files); concurrent requests for one image (in this process or others) share one build,
    published by a rename, and concurrent builds share each base image's pull.

    Args:
        cache_dir: Cache root (default: :func:`default_cache_dir`).
        build_args: ``--build-arg`` values for every build.
        host_trust: Forward the host's proxy settings and CA certificates to builds.
        debian_bootstrap: When a ``debian:<suite>`` base cannot be pulled, make it from
            Debian's packages with ``mmdebstrap`` (see :class:`Buildah`).
    """

    def __init__(
        self,
        cache_dir: Path | None = None,
        build_args: dict[str, str] | None = None,
        host_trust: bool = True,
        debian_bootstrap: bool = True,
    ):
        self.build_args = dict(build_args or {})
        self._memo: dict[tuple, BuiltImage] = {}
        self._locks = KeyedLocks()
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.images_dir = self.cache_dir / "images"
        self.storage_dir = self.cache_dir / "containers"
        self.host_trust = host_trust
        #: buildah on this store's storage: base images, builds, containers.
        self.buildah = Buildah(self.storage_dir, self.cache_dir, debian_bootstrap=debian_bootstrap)

    def prebuilt_context(self, ref: str) -> Path:
        """A build context (made once, under the cache) whose Dockerfile is ``FROM ref``, for a prebuilt image."""
        folder = self.cache_dir / "contexts" / hashlib.sha256(ref.encode()).hexdigest()[:16]
        if not (folder / "Dockerfile").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            replace_text(folder / "Dockerfile", f"FROM {ref}\n")
        return folder

    def cached(self, environment_dir: Path) -> BuiltImage | None:
        """The cached image for ``environment_dir``, or ``None`` if it is not built."""
        final = self.images_dir / self.content_key(Path(environment_dir))
        return load_image(final) if (final / "image.json").exists() else None

    # -- builds --------------------------------------------------------------------

    def content_key(self, environment_dir: Path) -> str:
        """A 24-hex-digit hash of what a build depends on: the builder, its arguments, the context's files."""
        digest = hashlib.sha256(f"{BUILDER_VERSION};trust={self.host_trust};".encode())
        digest.update(json.dumps(sorted(self.build_args.items())).encode())
        _hostfs.hash_tree(digest, environment_dir)
        return digest.hexdigest()[:24]

    async def get(self, environment_dir: Path, task_name: str = "task", force: bool = False) -> BuiltImage:
        """Return the image of ``environment_dir``, building it on first use; concurrent callers share one build.

        ``task_name`` is for error messages; ``force`` rebuilds even if a cached image exists.

        Raises:
            ImageBuildError: If the build fails; the message says where, and buildah's output.
            BaseImageUnavailableError: If a ``FROM`` image cannot be pulled.
        """
        environment_dir = Path(environment_dir)
        signature = (_context_signature(environment_dir), tuple(sorted(self.build_args.items())))
        if not force and signature in self._memo:
            return self._memo[signature]
        key = await asyncio.to_thread(self.content_key, environment_dir)
        async with self._locks(key):
            if not force and signature in self._memo:
                return self._memo[signature]
            final = self.images_dir / key
            await self._build_locked(environment_dir, final, task_name, force)
            self._memo[signature] = built = await self._load(environment_dir, final, task_name)
            return built

    async def _load(self, environment_dir: Path, final: Path, task_name: str) -> BuiltImage:
        image = load_image(final)
        if not await self._mount(image):
            # Its container is gone (removed with buildah, or the storage was reset): rebuild.
            logger.warning("the image of task %r lost its container; rebuilding it", task_name)
            await self._build_locked(environment_dir, final, task_name, True)
            image = load_image(final)
            if not await self._mount(image):
                raise ImageBuildError(f"task {task_name!r}: buildah could not mount the image it built")
        return image

    async def _mount(self, image: BuiltImage) -> bool:
        if not image.record.container:
            return False
        await asyncio.to_thread(_hold_mounts, self.cache_dir)
        # Mounted already (by an earlier process, as root: the store keeps its roots mounted until
        # released): no ``buildah mount`` run. Where the record says, under this store's storage, and a
        # mount still (a released store's, or a rootless holder's gone with its process, is not).
        recorded = image.path / _MOUNTPOINT_FILE
        with contextlib.suppress(OSError, ValueError):
            kept = json.loads(recorded.read_text())
            path = Path(kept["path"])
            if (
                kept.get("container") == image.record.container
                and path.is_relative_to(self.storage_dir)
                and self.buildah.host.call(os.path.ismount, path)
            ):
                image.mountpoint = path
                return True
        rc, stdout, _ = await self.buildah.run("mount", image.record.container)
        path = Path(stdout.strip().splitlines()[-1]) if rc == 0 and stdout.strip() else None
        if path is None or not self.buildah.host.call(os.path.isdir, path):
            return False
        image.mountpoint = path
        with contextlib.suppress(OSError):
            replace_text(recorded, json.dumps({"container": image.record.container, "path": str(path)}))
        return True

    async def _build_locked(self, environment_dir: Path, final: Path, task_name: str, force: bool) -> None:
        """Build into ``final`` unless it is published (or ``force``), one process at a time."""
        _private(self.images_dir, self.storage_dir)
        with open(final.parent / f"{final.name}.lock", "w") as lock_file:
            await asyncio.to_thread(fcntl.flock, lock_file, fcntl.LOCK_EX)
            if (final / "image.json").exists() and not force:  # built meanwhile, perhaps by another process
                return
            staging = final.parent / f".build-{final.name}-{os.getpid()}"
            await asyncio.to_thread(remove_tree, staging)
            try:
                await self._build(environment_dir, staging, final.name, task_name)
                old = final.parent / f".old-{final.name}-{os.getpid()}"
                if final.exists():
                    final.rename(old)
                staging.rename(final)
                await asyncio.to_thread(remove_tree, old)
            finally:
                await asyncio.to_thread(remove_tree, staging)

    async def _build(self, environment_dir: Path, out: Path, key: str, task_name: str) -> None:
        dockerfile = environment_dir / "Dockerfile"
        if not dockerfile.is_file():
            raise ImageBuildError(f"task {task_name!r}: {dockerfile} does not exist (every task needs one)")
        started = time.monotonic()
        bases = base_images(dockerfile.read_text())
        await asyncio.gather(*(self.buildah.pull(ref) for ref in bases))
        out.mkdir(parents=True)
        logger.info("building the image of task %r (%s)", task_name, environment_dir)
        rc, stdout, stderr = await self.buildah.run(*self._bud_args(dockerfile, environment_dir, out, key))
        if rc != 0:
            raise self._build_error(task_name, dockerfile, bases, rc, (stdout + stderr).strip())
        image_id = (out / "iid").read_text().strip()
        config = await self.buildah.inspect(image_id)
        container = await self._container_of(image_id, key, task_name, config.workdir)
        record = ImageRecord(
            key=key,
            image_id=image_id,
            container=container,
            source=str(environment_dir.resolve()),
            bases=bases,
            built_at=time.time(),
            build_seconds=round(time.monotonic() - started, 3),
            config=config,
        )
        (out / "image.json").write_text(record.model_dump_json(indent=2))

    def _bud_args(self, dockerfile: Path, environment_dir: Path, out: Path, key: str) -> list[str]:
        """``buildah bud``'s arguments for one build: the host's trust (proxies, CA) passed to every step."""
        args = [
            # --layers: steps shared by tasks (same parent, same instruction, same files) are built once.
            # --force-rm: a failed step's container is removed too (it stays mounted otherwise).
            "bud", "--isolation", "chroot", "--pull=false", "--format", "oci", "--network", "host", "--layers",
            "--force-rm",
            "-f", str(dockerfile), "--iidfile", str(out / "iid"),
        ]  # fmt: skip
        for name, value in self.build_args.items():
            args += ["--build-arg", f"{name}={value}"]
        if self.host_trust:
            for name, value in host_proxy_env().items():
                args += ["--build-arg", f"{name}={value}"]
            for source, target in host_trust_mounts(self.storage_dir / "trust"):
                # Not /etc/pip.conf: buildah leaves a mount's target in the step's layer, and an empty pip.conf
                # in the image would hide the host's from its sandboxes. pip takes PIP_CERT instead.
                if target != "/etc/pip.conf":
                    args += ["-v", f"{source}:{target}:ro"]
            trust = host_ca_env()
            if trust:
                trust["PIP_CERT"] = HOST_CA_BUNDLE
                # uv, npm, git and requests keep trust stores of their own: the variables naming the host's
                # bundle reach each RUN as build arguments, declared in every stage of a copy of the Dockerfile.
                copy = self.storage_dir / "trust" / f"{key}.Dockerfile"
                copy.write_text(with_build_args(dockerfile.read_text(), tuple(trust)))
                args[args.index(str(dockerfile))] = str(copy)
                for name, value in trust.items():
                    args += ["--build-arg", f"{name}={value}"]
        return [*args, str(environment_dir)]

    def _build_error(self, task_name: str, dockerfile: Path, bases: list[str], rc: int, output: str) -> ImageError:
        """What a failed ``buildah bud`` means: a base that cannot be pulled, or a step that failed."""
        pull = re.search(r"(initializing source|pinging container registry|reading manifest|"
                         r"short-name resolution|no such host|connection refused)", output)  # fmt: skip
        if pull and "FROM" not in output[-200:]:
            return BaseImageUnavailableError(_pull_error(", ".join(bases) or "the base image", output, self.cache_dir))
        one_id = self.buildah.host.ids == 1
        hint = f"\n({_userns.SINGLE_ID_LIMITS}; to build it, {_userns.SUBID_FIX})" if one_id else ""
        return ImageBuildError(
            f"task {task_name!r}: building {dockerfile} with buildah failed (exit code {rc}). "
            f"Its last output:\n{output[-4000:]}{hint}"
        )

    async def _container_of(self, image_id: str, key: str, task_name: str, workdir: str | None) -> str:
        """A buildah container of the built image, mounted and prepared: its root is the image's root
        (no copy, layers shared)."""
        container = f"harbor-local-sandbox-{key}"
        await self.buildah.run("rm", container)  # left by an earlier build of this key, if any
        rc, _, stderr = await self.buildah.run("from", "--quiet", "--pull=false", "--name", container, image_id)
        if rc != 0:
            raise ImageBuildError(f"task {task_name!r}: buildah could not use the image it built: {stderr.strip()}")
        rc, stdout, stderr = await self.buildah.run("mount", container)
        if rc != 0:
            raise ImageBuildError(f"task {task_name!r}: buildah could not mount the image it built: {stderr.strip()}")
        self.buildah.host.call(prepare_image_root, Path(stdout.strip().splitlines()[-1]), workdir)
        return container

    # -- maintenance ------------------------------------------------------------------

    def images(self) -> list[BuiltImage]:
        """Every built image in the cache."""
        found = []
        if self.images_dir.is_dir():
            for entry in sorted(self.images_dir.iterdir()):
                if (entry / "image.json").is_file() and not entry.name.startswith("."):
                    with contextlib.suppress(ValueError, OSError):
                        found.append(load_image(entry))
        return found

    def remove(self, image: BuiltImage) -> None:
        """Delete a built image: its container, its own layers and its record (not while sandboxes use it)."""
        if image.record.container:
            self.buildah.run_sync("rm", image.record.container)
        if image.record.image_id:
            self.buildah.run_sync("rmi", image.record.image_id)
        remove_tree(image.path)
        self._memo = {k: v for k, v in self._memo.items() if v.path != image.path}

    async def load_archive(self, archive: Path, ref: str) -> None:
        """Load a base image from an archive and name it ``ref``, for machines no registry serves.

        Args:
            archive: An OCI archive (``oci-archive``, e.g. from ``skopeo copy`` or ``buildah push``)
                or a Docker archive (``docker save``).
            ref: The name the Dockerfiles use after ``FROM`` (e.g. ``python:3.12-slim``).

        Raises:
            ImageError: If buildah cannot read the archive.
        """
        _private(self.images_dir, self.storage_dir)
        await self.buildah.load_archive(archive, ref)

    def used_elsewhere(self) -> bool:
        """Whether another process may be starting sandboxes from this cache's images now (it mounted
        them and has not exited or released them): removing or detaching them would break it."""
        if not self.cache_dir.is_dir():
            return False
        with _IN_USE_GUARD:
            mine = _IN_USE.get(self.cache_dir)
            if mine is not None:  # this process's own shared lock, made exclusive if no other holds one
                if not _exclusive(mine):
                    return True
                fcntl.flock(mine, fcntl.LOCK_SH)
                return False
        with open(self.cache_dir / _IN_USE_FILE, "ab") as lock:
            return not _exclusive(lock)

    def release_mounts(self) -> bool:
        """Detach what buildah's storage keeps mounted (e.g. before deleting the cache folder), unless
        another process may still start sandboxes from it (a training run beside ``images prune``).

        This process is done with the store's images: a later use mounts them again.

        Returns:
            Whether they were detached (``False``: another process holds them, nothing was touched).
        """
        with _IN_USE_GUARD:
            mine = _IN_USE.pop(self.cache_dir, None)
        if mine is not None:
            mine.close()
        self._memo.clear()
        if not self.cache_dir.is_dir():
            return True  # nothing was ever mounted from it
        with open(self.cache_dir / _IN_USE_FILE, "ab") as lock:
            if not _exclusive(lock):
                return False
            self.buildah.run_sync("umount", "--all")
            self.buildah.host.call(unmount_under, self.storage_dir)
        return True

    async def prune_bases(self) -> None:
        """Remove base images no longer needed from buildah's storage."""
        await self.buildah.run("rmi", "--prune")


#: A file in an image cache that every process starting sandboxes from its mounted images holds a
#: shared lock on (from its first mount until it exits or releases them); the mounts are detached
#: only under an exclusive one.
_IN_USE_FILE = ".mounts-in-use"
#: The file in an image's folder that says where its container's root was mounted (``ImageStore._mount``).
_MOUNTPOINT_FILE = "mountpoint.json"
_IN_USE: dict[Path, BinaryIO] = {}
_IN_USE_GUARD = threading.Lock()


def _exclusive(lock: BinaryIO) -> bool:
    """Take ``lock`` exclusively if no other process holds it (``False``, untouched, if one does)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _hold_mounts(cache_dir: Path) -> None:
    """Take this process's shared lock on the cache's mounts, once (waits while they are being released)."""
    with _IN_USE_GUARD:
        if cache_dir in _IN_USE:
            return
        lock = open(cache_dir / _IN_USE_FILE, "ab")  # noqa: SIM115 - held until the process exits
        fcntl.flock(lock, fcntl.LOCK_SH)
        _IN_USE[cache_dir] = lock


#: Folders every image root gets, as ``docker run`` provides them: mount points, and
#: Harbor's log folders (volumes under Docker), writable by every user of the image.
MOUNT_POINTS = ("proc", "dev", "sys", "tmp", "run/harbor-local-sandbox")
LOG_DIRS = ("logs/agent", "logs/verifier", "logs/artifacts")


def prepare_image_root(root: Path, workdir: str | None = None) -> None:
    """Give an image root what sandboxes need, once, at build time.

    The mount points, Harbor's log folders, and the ``WORKDIR`` (``docker build`` makes it;
    buildah leaves it to the first step that uses it). Links in the image are never followed.

    Args:
        root: The image's root.
        workdir: The image's ``WORKDIR``.
    """
    root.chmod(0o755)
    wanted = [(name, None) for name in MOUNT_POINTS] + [(name, 0o777) for name in LOG_DIRS]
    if workdir and workdir.strip("/"):
        wanted.append((workdir.strip("/"), None))
    for name, mode in wanted:
        path = root
        for part in [p for p in name.split("/") if p not in ("", ".")]:
            if part == "..":
                break
            path = path / part
            if path.is_symlink():
                break  # never followed: it points into the host here (e.g. /run -> /var/run)
            if not path.exists():
                path.mkdir()
                path.chmod(0o1777 if name == "tmp" else 0o755)
        else:
            if mode is not None and path.is_dir() and not path.is_symlink():
                path.chmod(mode)


_DEBIAN_VERSIONS = {"10": "buster", "11": "bullseye", "12": "bookworm", "13": "trixie"}
_DEBIAN_REF = re.compile(r"^(?:(?:docker\.io|index\.docker\.io)/)?(?:library/)?debian(?::([a-z0-9.]+?)(?:-slim)?)?$")


def debian_suite(ref: str) -> str | None:
    """The Debian suite an official ``debian`` image reference names, or ``None``.

    ``debian:bookworm``, ``debian:12-slim``, ``docker.io/library/debian:trixie`` -> the
    suite; ``debian`` / ``debian:latest`` -> ``stable``; anything else (digests,
    other images) -> ``None``.
    """
    match = _DEBIAN_REF.match(ref)
    if not match:
        return None
    tag = match.group(1) or "latest"
    if tag == "latest":
        return "stable"
    tag = _DEBIAN_VERSIONS.get(tag.split(".")[0], tag)
    return tag if re.fullmatch(r"[a-z]+", tag) else None


def _qualified(ref: str) -> str:
    name = ref if ":" in ref.split("/")[-1] else f"{ref}:latest"
    if "/" not in name:
        return f"docker.io/library/{name}"
    if name.startswith("library/"):
        return f"docker.io/{name}"
    return name


def image_config(inspect: dict) -> ImageConfig:
    """``docker run``'s settings of an image, from the parsed ``buildah inspect --type image`` output."""
    config = (inspect.get("OCIv1") or {}).get("config") or {}
    env: dict[str, str] = {}
    for item in config.get("Env") or []:
        name, _, value = item.partition("=")
        env[name] = value
    return ImageConfig(
        env=env,
        workdir=config.get("WorkingDir") or None,
        user=config.get("User") or None,
        entrypoint=list(config.get("Entrypoint") or []),
        cmd=list(config.get("Cmd") or []),
    )


def load_image(path: Path) -> BuiltImage:
    """Load a built image from its folder.

    Raises:
        ValueError: If ``image.json`` is malformed.
    """
    record = ImageRecord.model_validate_json((path / "image.json").read_text())
    return BuiltImage(path, record)


def _registries_conf() -> str:
    configured = os.environ.get("CONTAINERS_REGISTRIES_CONF")
    if configured:
        return configured
    user = Path.home() / ".config" / "containers" / "registries.conf"
    return str(user) if user.exists() else "/etc/containers/registries.conf"


def _pull_error(ref: str, output: str, cache_dir: Path) -> str:
    tried = sorted(
        set(re.findall(r"(?:https?://)?([a-z0-9.-]+(?:\.[a-z]{2,}|:\d+|localhost)[a-z0-9.:-]*)/v2/", output))
    )
    registries = ", ".join(tried) if tried else (ref.split("/")[0] if "/" in ref else "docker.io (short name)")
    return (
        f"the base image {ref} could not be pulled (registries tried: {registries}). The builder said:\n"
        f"{output.strip()[-1500:]}\n"
        "Fixes: add a reachable mirror for that registry to registries.conf "
        f"({_registries_conf()}; see `man containers-registries.conf`, [[registry]] ... [[registry.mirror]]); "
        "or load the image from an archive made where it can be pulled (`skopeo copy docker://IMAGE "
        "oci-archive:FILE`, or `docker save`) with "
        f"`harbor-local-sandbox images load FILE {ref.split(',')[0]} --cache-dir {cache_dir}`."
    )
