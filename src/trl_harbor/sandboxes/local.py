"""``LocalEnvironment``: a Harbor environment that needs no container engine.

Each sandbox is one long-lived set of Linux namespaces made by bubblewrap, from
``start()`` to ``stop()``: what one ``exec`` leaves running in the background is
still there for the next, as with ``docker exec`` into a running container. It
starts in milliseconds and needs no daemon, so it runs Harbor tasks on laptops,
CI runners, HPC nodes and Kubernetes pods without Docker.

Use it from Harbor itself::

    harbor run -p examples/tasks -a oracle -e trl_harbor.sandboxes.local:LocalEnvironment

or from trl-harbor with ``environment_type="local"``.

What the agent sees (``root="image"``, the default): the task's image, built from its
Dockerfile by buildah, as a private copy-on-write root — and nothing of the host. On the
host root (``root="host"``, chosen explicitly; unprivileged): the host's system
directories read-only (the host *is* the base image: ``FROM`` is not honoured), a
private writable root holding the task's files from its Dockerfile, ``/tmp``, ``/logs``,
``/root`` and ``/home/user`` — and nothing else of the host. ``/tests`` and ``/solution`` exist only once Harbor's
verifier or oracle uploads them. No network unless the task's policy allows it, and
then through a user-mode network stack that cannot reach the host's loopback.
See ``docs/local-sandbox.md`` for the details and the limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import logging
import os
import posixpath
import shlex
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode
from pydantic import Field

from trl_harbor.sandboxes import _hostfs
from trl_harbor.sandboxes._bwrap import (
    LAYER_VENV,
    SANDBOX_VENV,
    SYSTEM_MOUNTS,
    SYSTEM_PATH,
    Box,
    BoxConfig,
    SandboxCommandError,
    SandboxError,
    SandboxStartError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    bwrap_path,
    mount_overlay,
    new_box_name,
    remove_tree,
    state_root,
    static_binary,
    sweep_stale,
)
from trl_harbor.sandboxes.image import Image, ImageBuilder, ImageBuildError
from trl_harbor.sandboxes.oci import (
    HOST_CA_BUNDLE,
    BaseImageUnavailableError,
    BuiltImage,
    ImageStore,
    buildah_path,
    host_ca_bundle,
    host_proxy_env,
    host_trust_mounts,
)

__all__ = [
    "BaseImageUnavailableError",
    "ImageBuildError",
    "LocalEnvironment",
    "LocalEnvironmentOptions",
    "SandboxCommandError",
    "SandboxError",
    "SandboxStartError",
    "SandboxTimeoutError",
    "SandboxUnavailableError",
    "SandboxUserError",
]

logger = logging.getLogger(__name__)

_ROOT_USERS = (None, 0, "0", "root")


class SandboxUserError(SandboxError, ValueError):
    """A command asked for a non-root user, which the host-rooted local sandbox cannot provide."""


#: ``docker run``'s PATH when the image sets none.
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The ``/etc/hosts`` of a Docker container (``docker run`` writes it; the image's own is not seen).
DOCKER_HOSTS = (
    "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\n"
    "ff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n127.0.1.1\t{hostname}\n"
)
#: Where the user-switching helper appears inside image-rooted sandboxes.
RUNAS = "/run/trl-harbor/runas"


class LocalEnvironmentOptions(EnvironmentOptions):
    """Options of the local sandbox (Harbor's ``--ek key=value`` / ``environment_kwargs``).

    Attributes:
        output_cap_bytes: Output kept per stream and command (head and tail); the rest
            is read and dropped, so a command printing gigabytes cannot exhaust memory.
        default_memory_mb: Memory limit when the task sets none.
        default_storage_mb: Bound on what a sandbox writes (its root, ``/tmp``) when the task's
            ``[environment] storage_mb`` sets none: one file past it fails (``EFBIG``), a sandbox
            whose files add up past it is killed and its rollout scores 0. Holds without root.
        pids_max: Maximum number of processes in one sandbox (fork-bomb containment).
        cache_dir: Where built layers and images are cached (default ``~/.cache/trl-harbor``).
        root: What the sandbox's ``/`` is. ``"image"`` (the default): the task's image, built from its
            Dockerfile by buildah (``FROM`` honoured), under a private copy-on-write layer;
            ``ENV``, ``WORKDIR``, ``USER`` and ``ENTRYPOINT`` apply as with ``docker run``.
            ``"host"``: the host's ``/usr`` and ``/etc`` read-only, ``FROM`` not honoured
            (no image to pull or build; the fastest). Never a fallback of one for the other.
        host_trust: Forward the host's proxy settings and CA certificates to image builds
            and image-rooted sandboxes (for networks that intercept TLS).
    """

    output_cap_bytes: int = Field(default=1 << 20, ge=1024)
    default_memory_mb: int | None = Field(default=4096, ge=16)
    default_storage_mb: int | None = Field(default=10240, ge=16)
    pids_max: int | None = Field(default=2048, ge=16)
    cache_dir: str | None = None
    root: Literal["host", "image"] = "image"
    host_trust: bool = True


_BUILDERS: dict[str | None, ImageBuilder] = {}
#: Fingerprints of read-only mounts, by (host path, sandbox path, entry only): see ``_walk``.
_READ_ONLY_LISTINGS: dict[tuple[str, str, bool], dict[str, str]] = {}
#: Fingerprints of image roots, by (image root, sandbox path, depth): see ``_walk_layers``.
_IMAGE_LISTINGS: dict[tuple[str, str, int | None], dict[str, str]] = {}
_STORES: dict[tuple[str | None, bool], ImageStore] = {}


def _store(cache_dir: str | None, host_trust: bool) -> ImageStore:
    key = (cache_dir, host_trust)
    if key not in _STORES:
        _STORES[key] = ImageStore(Path(cache_dir) if cache_dir else None, host_trust=host_trust)
    return _STORES[key]


def _builder(cache_dir: str | None) -> ImageBuilder:
    if cache_dir not in _BUILDERS:
        _BUILDERS[cache_dir] = ImageBuilder(Path(cache_dir) if cache_dir else None)
    return _BUILDERS[cache_dir]


#: Remove the sandbox trees and cgroups of processes that died without stopping them (their
#: processes died with them); run once per process, at its first sandbox start.
sweep_stale_sandboxes = sweep_stale


_SWEPT = False


class LocalEnvironment(BaseEnvironment):
    """Runs a Harbor task in a bubblewrap sandbox on this machine (see the module docstring).

    Takes Harbor's standard environment arguments; the options in
    :class:`LocalEnvironmentOptions` are passed as keyword arguments.
    """

    options_model: ClassVar[type[EnvironmentOptions] | None] = LocalEnvironmentOptions

    def __init__(self, *args: Any, **kwargs: Any):
        self._box: Box | None = None
        self._image: Image | None = None
        self._oci: BuiltImage | None = None
        self._dir: Path | None = None
        super().__init__(*args, **kwargs)
        assert isinstance(self.options, LocalEnvironmentOptions)
        self.local_options: LocalEnvironmentOptions = self.options

    @staticmethod
    def type() -> str:
        """The environment's type name."""
        return "local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """What this backend enforces: no network (own namespace), switched per phase while it runs."""
        return EnvironmentCapabilities(disable_internet=True, dynamic_network_policy=True)

    def _network(self, policy: Any = None) -> str:
        policy = policy or self._network_policy
        return "none" if policy.network_mode == NetworkMode.NO_NETWORK else "user"

    @property
    def _network_switchable(self) -> bool:
        """Whether a phase (agent, verifier) wants a different network than the sandbox starts with."""
        return any(self._network(policy) != self._network() for policy in self._phase_network_policies)

    async def _apply_network_policy(self, network_policy: Any) -> None:
        """Switch the running sandbox between no network and the user-mode network (Harbor's phases)."""
        if self._box is None:
            raise SandboxCommandError("the sandbox is not running (call start() first)")
        await self._box.set_network(self._network(network_policy))

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities | None:
        """CPU and memory are hard limits (cgroups where writable, else rlimits)."""
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        """Check options and that bubblewrap is installed, before any trial is queued.

        Raises:
            SandboxUnavailableError: If bubblewrap is missing, or (``root="image"``, the default)
                buildah or a C compiler that links statically, or this process is not root.
        """
        super().preflight(kwargs)
        bwrap_path()
        options = cls.parse_options(kwargs)
        if isinstance(options, LocalEnvironmentOptions) and options.root == "image":
            buildah_path()
            if os.geteuid() != 0:
                raise SandboxUnavailableError(
                    "the local sandbox runs each task on its own image (root='image', the default), "
                    "which needs root for now; run as root, or choose the host root explicitly: "
                    "env_kwargs={'root': 'host'} (HarborSpec), --ek root=host (trl-harbor, harbor run); "
                    "the host's /usr is then every task's base image and the Dockerfile's FROM is not honoured"
                )
            static_binary("supervisor")  # compiled once and cached; its error names the packages

    def _validate_definition(self) -> None:
        if not self.environment_dir.is_dir():
            raise FileNotFoundError(f"environment directory {self.environment_dir} does not exist")

    # -- lifecycle -------------------------------------------------------------

    @property
    def _root(self) -> Path:
        if self._dir is None:
            raise SandboxCommandError("the sandbox has not been started")
        return self._dir / "rootfs"

    async def start(self, force_build: bool) -> None:
        """Build (or reuse) the task's layer and start the sandbox.

        Args:
            force_build: Rebuild the layer even if a cached one exists.

        Raises:
            ImageBuildError: If the Dockerfile cannot be built here.
            SandboxStartError: If the sandbox cannot start.
        """
        global _SWEPT
        if not _SWEPT:
            _SWEPT = True
            await asyncio.to_thread(sweep_stale_sandboxes)
        if self.local_options.root == "image":
            await self._start_on_image(force_build)
            return
        builder = _builder(self.local_options.cache_dir)
        if force_build:
            key = await asyncio.to_thread(builder.content_key, self.environment_dir)
            remove_tree(builder.cache_dir / "layers" / key)
            builder._memo.clear()
        self._image = await builder.get(self.environment_dir, self.environment_name)
        self._dir = state_root() / new_box_name(self.session_id or self.environment_name)
        await asyncio.to_thread(self._make_root)
        cpus = self._effective_cpus
        self._box = Box(
            BoxConfig(
                rootfs=self._root,
                layer_venv=self._image.venv,
                network=self._network(),
                network_switchable=self._network_switchable,
                memory_mb=self._effective_memory_mb or self.local_options.default_memory_mb,
                cpus=float(cpus) if cpus else None,
                pids_max=self.local_options.pids_max,
                hostname=_hostname(self.environment_name),
                storage_mb=self._storage_mb,
            ),
            self._dir / "run",
            name=self._dir.name,
            owned_dir=self._dir,
        )
        try:
            await self._box.start()
        except BaseException:
            await self._teardown()
            raise
        await self._upload_environment_dir_after_start()

    @property
    def _storage_mb(self) -> int | None:
        return self._effective_storage_mb or self.local_options.default_storage_mb

    async def _start_on_image(self, force_build: bool) -> None:
        store = _store(self.local_options.cache_dir, self.local_options.host_trust)
        context = self.environment_dir
        if not (context / "Dockerfile").is_file() and self.task_env_config.docker_image:
            # A prebuilt image ([environment] docker_image) with no Dockerfile: FROM it.
            context = await asyncio.to_thread(store.prebuilt_context, self.task_env_config.docker_image)
        self._oci = image = await store.get(context, self.environment_name, force=force_build)
        self._dir = state_root() / new_box_name(self.session_id or self.environment_name)
        cpus = self._effective_cpus
        binds = [(await asyncio.to_thread(static_binary, "runas"), RUNAS)]
        if self.local_options.host_trust:
            mounts = host_trust_mounts(store.storage_dir / "trust")
            has_pip_conf = os.path.lexists(image.rootfs / "etc" / "pip.conf")
            binds += [m for m in mounts if not (m[1] == "/etc/pip.conf" and has_pip_conf)]
        self._box = Box(
            BoxConfig(
                rootfs=self._root,
                network=self._network(),
                network_switchable=self._network_switchable,
                memory_mb=self._effective_memory_mb or self.local_options.default_memory_mb,
                cpus=float(cpus) if cpus else None,
                pids_max=self.local_options.pids_max,
                hostname=_hostname(self.environment_name),
                storage_mb=self._storage_mb,
                extra_ro_binds=binds,
                image_root=True,
            ),
            self._dir / "run",
            name=self._dir.name,
            owned_dir=self._dir,
        )
        try:
            await asyncio.to_thread(self._mount_image_root, image)
            await self._box.start()
            if image.config.entrypoint:
                await self._start_entrypoint(image)
        except BaseException:
            await self._teardown()
            raise
        await self._upload_environment_dir_after_start()

    def _mount_image_root(self, image: BuiltImage) -> None:
        assert self._dir is not None and self._box is not None
        for name in ("upper", "work", "rootfs", "run"):
            (self._dir / name).mkdir(parents=True)
        mount_overlay(image.rootfs, self._dir / "upper", self._dir / "work", self._root)
        self._box.mounts.append(self._root)
        if self.task_env_config.workdir:
            # Made without following links (the image's tree is the task author's).
            os.close(_hostfs._open_dir(self._root, _hostfs._parts(self.task_env_config.workdir), create=True))
        self._write_hosts()

    def _write_hosts(self) -> None:
        """Give the sandbox the ``/etc/hosts`` Docker gives every container (``localhost`` and its host name).

        Docker replaces an image's ``/etc/hosts`` with its own; a Debian image's is empty, so without
        this ``localhost`` did not resolve and a task whose service listens on ``localhost`` failed.
        It is the sandbox's own file (the agent may edit it, as in a container).
        """
        hostname = _hostname(self.environment_name)
        content = DOCKER_HOSTS.format(hostname=hostname)
        try:
            etc = _hostfs._open_dir(self._root, ["etc"], create=True)
        except OSError as error:  # an image whose /etc is a link: left as it is
            logger.debug("no /etc/hosts written: %s", error)
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("hosts", dir_fd=etc)
            fd = os.open(
                "hosts", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=etc
            )
            try:
                os.write(fd, content.encode())
            finally:
                os.close(fd)
        finally:
            os.close(etc)

    async def _start_entrypoint(self, image: BuiltImage) -> None:
        """Run the image's ENTRYPOINT in the background, as ``docker run`` does under Harbor.

        Harbor's Docker backend keeps the container alive with the command
        ``sh -c "sleep infinity"``, which becomes the entrypoint's arguments.
        """
        argv = [*image.config.entrypoint, "sh", "-c", "sleep infinity"]
        command = f"{shlex.join(argv)} </dev/null >/dev/null 2>&1 &"
        result = await self._run_as(self._image_user(None), command, None, None, None)
        if result["rc"] != 0:
            raise SandboxStartError(f"the image's ENTRYPOINT {image.config.entrypoint} could not start")

    def _make_root(self) -> None:
        assert self._image is not None and self._dir is not None
        self._dir.mkdir(parents=True)
        # Copy-on-start: every sandbox gets its own writable copy of the layer's files,
        # which include the private folders (image.PRIVATE_DIRS).
        _hostfs.copy_tree(self._image.rootfs, self._root)
        if self.task_env_config.workdir:
            (self._root / self.task_env_config.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)

    async def stop(self, delete: bool) -> None:
        """Kill every process of the sandbox (daemons included) and delete its tree.

        Args:
            delete: Accepted for Harbor's interface; the sandbox is always deleted,
                because nothing of it can be restarted.
        """
        await self._teardown()

    async def _teardown(self) -> None:
        if self._box is not None:
            await self._box.kill()
            self._box = None
        if self._dir is not None:
            await _off_loop(remove_tree, self._dir)
            self._dir = None

    # -- commands --------------------------------------------------------------

    @property
    def workdir(self) -> str:
        """The default working directory: the task's, else the Dockerfile's last WORKDIR, else ``/``."""
        if self._oci is not None:
            return self.task_env_config.workdir or self._oci.config.workdir or "/"
        return self.task_env_config.workdir or (self._image.workdir if self._image else None) or "/"

    def _image_user(self, user: str | int | None) -> str:
        """The user a command runs as on an image root: the requested one, else the image's USER."""
        assert self._oci is not None
        if user is None:
            user = self._oci.config.user or "root"
        return str(user)

    def _image_env(self, user: str, env: dict[str, str] | None) -> dict[str, str]:
        assert self._oci is not None
        base = {"PATH": DOCKER_DEFAULT_PATH, "HOSTNAME": _hostname(self.environment_name)}
        if user in ("root", "0") or user.startswith(("root:", "0:")):
            base["HOME"] = "/root"
        if self.local_options.host_trust:
            base.update(self._trust_env)
        return {**base, **self._oci.config.env, **(env or {})}

    @functools.cached_property
    def _trust_env(self) -> dict[str, str]:
        """The host's proxies, and its CA bundle for tools that ignore the system store (requests)."""
        found = host_proxy_env()
        if host_ca_bundle() is not None:
            found.update({"REQUESTS_CA_BUNDLE": HOST_CA_BUNDLE, "SSL_CERT_FILE": HOST_CA_BUNDLE})
        return found

    async def _run_as(
        self, user: str, command: str, cwd: str | None, env: dict[str, str] | None, timeout: float | None
    ) -> dict:
        if self._box is None:
            raise SandboxCommandError("the sandbox is not running (call start() first)")
        if not (user in ("root", "0") or user.startswith(("root:", "0:"))):
            # "$0" is the shell the supervisor chose (bash, else sh): the same one runs the command.
            command = f'exec {RUNAS} {shlex.quote(user)} "$0" -c {shlex.quote(command)}'
        return await self._box.run(
            command,
            cwd=cwd or self.workdir,
            env=self._image_env(user, env),
            timeout=timeout,
            output_cap=self.local_options.output_cap_bytes,
        )

    def _command_env(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {
            "PATH": f"{SANDBOX_VENV}/bin:{LAYER_VENV}/bin:{SYSTEM_PATH}",
            "HOME": "/root",
            "USER": "root",
            "LANG": "C.UTF-8",
            "VIRTUAL_ENV": SANDBOX_VENV,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "HOSTNAME": _hostname(self.environment_name),
        }
        if self._image is not None:
            base.update(self._image.env)
        return {**base, **(self._merge_env(env) or {})}

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` with ``bash -c`` in the sandbox.

        Args:
            command: The shell command.
            cwd: Working directory (default: the task's working directory).
            env: Extra environment variables.
            timeout_sec: Kill the command's whole process tree after this many seconds.
            user: A user of the image (name or uid, ``user:group`` too) when the sandbox
                runs on the task's image (default: the image's ``USER``); on the host
                root, only the sandbox's root (``None``, ``0`` or ``"root"``).

        Returns:
            The exit code and the (bounded) standard output and error.

        Raises:
            SandboxUserError: If a non-root user is requested on the host root.
            SandboxTimeoutError: If the command ran past ``timeout_sec``.
            SandboxCommandError: If the sandbox is not running.
        """
        user = self._resolve_user(user)
        if self._oci is not None:
            result = await self._run_as(self._image_user(user), command, cwd, self._merge_env(env), timeout_sec)
            if result["timed_out"]:
                raise SandboxTimeoutError(f"Command timed out after {timeout_sec} seconds")
            return ExecResult(stdout=result["stdout"], stderr=result["stderr"], return_code=result["rc"])
        if user not in _ROOT_USERS:
            raise SandboxUserError(
                f"the local sandbox runs commands as the sandbox's root only; user={user!r} was "
                "requested. Remove the task's [agent]/[verifier] user setting, or use "
                "environment_type='docker' to run as another user."
            )
        if self._box is None:
            raise SandboxCommandError("the sandbox is not running (call start() first)")
        result = await self._box.run(
            command,
            cwd=cwd or self.workdir,
            env=self._command_env(env),
            timeout=timeout_sec,
            output_cap=self.local_options.output_cap_bytes,
        )
        if result["timed_out"]:
            raise SandboxTimeoutError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=result["stdout"], stderr=result["stderr"], return_code=result["rc"])

    # -- what the verifier can trust -------------------------------------------

    async def resource_exhaustion(self) -> str | None:
        """Which of the sandbox's limits its processes ran into (memory, processes, storage), or ``None``.

        A sandbox that stopped answering after its agent exhausted its limits (e.g. its memory
        cgroup killed the supervisor, or the storage guard killed it for writing past its
        ``storage_mb``) is the agent's doing, not an infrastructure failure.

        Returns:
            A short description, or ``None`` (memory and processes: only where cgroups are in use).
        """
        return None if self._box is None else self._box.resource_exhaustion()

    async def list_processes(self) -> list[str]:
        """The sandbox's processes (its supervisor aside), as ``"PID:START"`` entries.

        Taken before the agent's first command, it says what to keep at :meth:`kill_processes`
        (e.g. a service the image's ``ENTRYPOINT`` started).

        Returns:
            One entry per live process.

        Raises:
            SandboxCommandError: If the sandbox is not running.
        """
        return await self._running_box().list_processes()

    async def kill_processes(self, keep: Sequence[str] = ()) -> int:
        """Kill every process in the sandbox but its supervisor and ``keep`` (before verification).

        Nothing the agent started survives, whatever it did to detach: the supervisor sees
        every process of the sandbox's PID namespace. The sandbox stays usable.

        Args:
            keep: ``"PID:START"`` entries from :meth:`list_processes` to leave running.

        Returns:
            How many processes were killed.

        Raises:
            SandboxCommandError: If the sandbox is not running.
        """
        return await self._running_box().kill_processes(keep)

    def _running_box(self) -> Box:
        if self._box is None:
            raise SandboxCommandError("the sandbox is not running (call start() first)")
        return self._box

    async def file_fingerprints(self, patterns: Sequence[tuple[str, int | None]]) -> dict[str, str]:
        """Fingerprint sandbox paths from the host, without running anything in the sandbox.

        Args:
            patterns: ``(absolute sandbox path, depth)`` pairs; wildcards allowed in the path;
                depth ``0`` is the entry itself, ``None`` everything below it. Read-only host
                mounts (``/usr``, ``/etc``, the shared layer) are listed one level deep only:
                nothing in them can change.

        Returns:
            ``{sandbox path: signature}``; a signature changes when the entry's content,
            inode, mode or type does (folders: type and mode only).
        """
        if self._dir is None:
            raise SandboxCommandError("the sandbox is not running (call start() first)")
        return await asyncio.to_thread(self._fingerprints, list(patterns))

    def _host_path(self, path: str) -> tuple[Path | None, bool]:
        """Where a sandbox path lives on the host, and whether it is a read-only mount."""
        if self._oci is not None:
            # The image root is the sandbox's own copy-on-write tree, system folders included.
            if path in ("/proc", "/dev", "/sys") or path.startswith(("/proc/", "/dev/", "/sys/")):
                return None, True
            return self._root / path.lstrip("/"), False
        for mount in SYSTEM_MOUNTS:
            if path == mount or path.startswith(mount + "/"):
                if mount in ("/proc", "/dev", "/sys"):
                    return None, True
                base = str(self._image.venv) if mount == LAYER_VENV and self._image else mount
                return Path(base + path[len(mount) :]), True
        return self._root / path.lstrip("/"), False

    def _fingerprints(self, patterns: list[tuple[str, int | None]]) -> dict[str, str]:
        found: dict[str, str] = {}
        for pattern, depth in patterns:
            for path in self._glob(posixpath.normpath(pattern)):
                if self._oci is not None and self._dir is not None:
                    self._walk_layers(path, depth, found)
                else:
                    self._walk(path, depth, found)
        return found

    def _walk_layers(self, path: str, depth: int | None, found: dict[str, str]) -> None:
        """Fingerprint a path of an image root: the image's entries under the sandbox's own changes.

        The image root never changes, and everything the sandbox changed is in its overlay's upper
        folder (mounted with ``redirect_dir`` and ``metacopy`` off): new and changed entries,
        whiteouts for deleted ones, opaque folders for ones replaced whole. So the image is listed
        once per process, and each fingerprint walks only what the sandbox wrote; a walk of the
        merged root would read thousands of unchanged entries (``/usr/lib/python3.*``) each time.
        Links are never followed (a path under a link is not listed).
        """
        if path in ("/proc", "/dev", "/sys") or path.startswith(("/proc/", "/dev/", "/sys/")):
            return
        assert self._oci is not None and self._dir is not None
        lower, upper = self._oci.rootfs, self._dir / "upper"
        parts = [part for part in path.strip("/").split("/") if part]
        image_visible = True
        for depth_of_ancestor in range(1, len(parts)):  # what the sandbox did to the path's ancestors
            kind = _layer_entry(upper / "/".join(parts[:depth_of_ancestor]))
            if kind is None:
                break  # nothing of the sandbox's own at or below it
            if kind in ("whiteout", "other"):
                return  # deleted, or no longer a folder: the path is gone
            if kind == "opaque":
                image_visible = False  # a folder the sandbox replaced whole hides the image's below it
        entries: dict[str, str] = {}
        if image_visible:
            key = (str(lower), path, depth)
            listed = _IMAGE_LISTINGS.get(key)
            if listed is None:  # published once complete: sandboxes fingerprint in several threads at once
                listed = {}
                if all(_layer_entry(lower / "/".join(parts[:i])) == "dir" for i in range(1, len(parts))):
                    _walk_tree(lower, path, depth, listed)  # not under a link of the image
                _IMAGE_LISTINGS[key] = listed
            entries.update(listed)
        _lay_upper(upper, path, depth, entries)
        found.update(entries)

    def _glob(self, pattern: str) -> list[str]:
        current = ["/"]
        for part in pattern.strip("/").split("/"):
            if not any(ch in part for ch in "*?["):
                current = [posixpath.join(base, part) for base in current]
                continue
            expanded = []
            for base in current:
                host, _ = self._host_path(base)
                if host is None or host.is_symlink() or not host.is_dir():
                    continue
                with os.scandir(host) as entries:
                    expanded += [posixpath.join(base, e.name) for e in entries if fnmatch.fnmatchcase(e.name, part)]
            current = sorted(expanded)
        return current

    def _walk(self, path: str, depth: int | None, found: dict[str, str], cache: bool = True) -> None:
        host, read_only = self._host_path(path)
        if host is None:
            return
        if read_only and cache:
            # A read-only mount (the host's /usr and /etc, the shared layer) cannot change while
            # sandboxes run: listed once per process, not at every start and every grading.
            key = (str(host), path, depth == 0)
            listed = _READ_ONLY_LISTINGS.get(key)
            if listed is None:
                listed = {}
                self._walk(path, depth, listed, cache=False)
                _READ_ONLY_LISTINGS[key] = listed
            found.update(listed)
            return
        try:
            info = os.lstat(host)
        except OSError:
            return
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISDIR(info.st_mode):
            found[path] = f"d|{mode:o}"
        else:
            kind = "f" if stat.S_ISREG(info.st_mode) else "l" if stat.S_ISLNK(info.st_mode) else "o"
            found[path] = f"{kind}|{mode:o}|{info.st_size}|{info.st_ino}|{info.st_ctime_ns}"
            return
        if depth == 0:
            return
        below = None if depth is None else depth - 1
        if read_only:
            below = 0  # listed for names only: a read-only mount cannot change
        try:
            names = os.listdir(host)
        except OSError:
            return
        for name in names:
            self._walk(posixpath.join(path, name), below, found, cache)

    # -- files -----------------------------------------------------------------

    def _check_writable_path(self, path: str) -> None:
        normalized = "/" + str(path).strip("/")
        mounts = ("/proc", "/dev", "/sys") if self._oci is not None else SYSTEM_MOUNTS
        for mount in mounts:
            if normalized == mount or normalized.startswith(mount + "/"):
                raise _hostfs.UnsafePathError(
                    1, f"{path!r} is in the host's read-only system directories, not in the sandbox's own tree"
                )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file into the sandbox (never through a link the agent planted)."""
        self._check_writable_path(target_path)
        await asyncio.to_thread(_hostfs.upload_file, self._root, Path(source_path), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy the contents of a host directory into a sandbox directory."""
        self._check_writable_path(target_dir)
        await asyncio.to_thread(_hostfs.upload_dir, self._root, Path(source_dir), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a sandbox file to the host; refuses links, so no host file is ever read."""
        self._check_writable_path(source_path)
        await asyncio.to_thread(_hostfs.download_file, self._root, source_path, Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox directory's regular files and folders to the host, skipping links."""
        self._check_writable_path(source_dir)
        await asyncio.to_thread(_hostfs.download_dir, self._root, source_dir, Path(target_dir))


def _signature(info: os.stat_result) -> str:
    """What changes when an entry's content, inode, mode or type does (folders: type and mode only)."""
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISDIR(info.st_mode):
        return f"d|{mode:o}"
    kind = "f" if stat.S_ISREG(info.st_mode) else "l" if stat.S_ISLNK(info.st_mode) else "o"
    return f"{kind}|{mode:o}|{info.st_size}|{info.st_ino}|{info.st_ctime_ns}"


def _walk_tree(root: Path, path: str, depth: int | None, found: dict[str, str]) -> None:
    """Fingerprint ``path`` (a sandbox path) of the tree at ``root``, ``depth`` levels down, never following links."""
    try:
        info = os.lstat(root / path.lstrip("/"))
    except OSError:
        return
    found[path] = _signature(info)
    if not stat.S_ISDIR(info.st_mode) or depth == 0:
        return
    try:
        names = os.listdir(root / path.lstrip("/"))
    except OSError:
        return
    for name in names:
        _walk_tree(root, posixpath.join(path, name), None if depth is None else depth - 1, found)


def _layer_entry(host: Path) -> str | None:
    """What an overlay layer holds at ``host``: ``None`` (nothing), ``"dir"``, ``"opaque"`` (a folder
    hiding the layers below), ``"whiteout"`` (a deletion) or ``"other"`` (a file or a link)."""
    try:
        info = os.lstat(host)
    except OSError:
        return None
    if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
        return "whiteout"
    if not stat.S_ISDIR(info.st_mode):
        return "other"
    try:
        opaque = os.getxattr(host, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        opaque = False
    return "opaque" if opaque else "dir"


def _drop_below(entries: dict[str, str], path: str) -> None:
    prefix = path.rstrip("/") + "/"
    for key in [key for key in entries if key.startswith(prefix)]:
        del entries[key]


def _lay_upper(upper: Path, path: str, depth: int | None, entries: dict[str, str]) -> None:
    """Apply what the sandbox's own layer holds at ``path`` to the image's ``entries``."""
    host = upper / path.lstrip("/")
    kind = _layer_entry(host)
    if kind is None:
        return
    if kind != "dir":  # deleted, replaced by a file or a link, or a folder replaced whole
        entries.pop(path, None)
        _drop_below(entries, path)
        if kind == "whiteout":
            return
    entries[path] = _signature(os.lstat(host))
    if kind == "other" or depth == 0:
        return
    try:
        names = os.listdir(host)
    except OSError:
        return
    for name in names:
        _lay_upper(upper, posixpath.join(path, name), None if depth is None else depth - 1, entries)


async def _off_loop(func, *args) -> None:
    """Run blocking file work in a thread, or inline once the interpreter is shutting down.

    At exit, a new thread cannot be started (``can't create new thread at interpreter
    shutdown``; the default executor also refuses work), and teardown must still happen then.
    """
    try:
        await asyncio.to_thread(func, *args)
    except RuntimeError as error:
        if "shutdown" not in str(error):
            raise
        func(*args)


def _hostname(name: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name.lower()).strip("-")
    return (cleaned or "sandbox")[:63]
