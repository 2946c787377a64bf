"""``LocalEnvironment``: a Harbor environment that needs no container engine.

Each sandbox is one long-lived set of Linux namespaces made by bubblewrap, from
``start()`` to ``stop()``: what one ``exec`` leaves running in the background is
still there for the next, as with ``docker exec`` into a running container. It
starts in milliseconds and needs no daemon, so it runs Harbor tasks on laptops,
CI runners, HPC nodes and Kubernetes pods without Docker.

Use it from Harbor itself::

    harbor run -p examples/tasks -a oracle -e harbor_local_sandbox.local:LocalEnvironment

or from a trainer that loads Harbor environments.

What the agent sees: the task's image, built from its Dockerfile by buildah (``FROM``
included), as a private copy-on-write root — nothing of the host; ``/tests`` and ``/solution``
only once Harbor uploads them; no network unless the task allows it, and then one that cannot
reach the host's loopback. See ``docs/local-sandbox.md`` for the details and the limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode
from pydantic import Field

from harbor_local_sandbox import _hostfs
from harbor_local_sandbox._binaries import bwrap_path, default_cache_dir
from harbor_local_sandbox._box import release_parked
from harbor_local_sandbox._cache import CACHE
from harbor_local_sandbox._compose import ComposeGroup, ComposeProject, compose_problems, load_compose
from harbor_local_sandbox._diagnose import cache_problem, namespace_problem
from harbor_local_sandbox._lifetime import sweep_stale_once
from harbor_local_sandbox._roots import ImageRoot, RootTask, VerifierRoot
from harbor_local_sandbox.errors import (
    BaseImageUnavailableError,
    ComposeUnsupportedError,
    ImageBuildError,
    SandboxCommandError,
    SandboxError,
    SandboxStartError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    ServiceError,
    ServiceUnhealthyError,
)
from harbor_local_sandbox.oci import ImageStore

__all__ = [
    "BaseImageUnavailableError",
    "ComposeUnsupportedError",
    "ImageBuildError",
    "LocalEnvironment",
    "LocalEnvironmentOptions",
    "SandboxCommandError",
    "SandboxError",
    "SandboxStartError",
    "SandboxTimeoutError",
    "SandboxUnavailableError",
    "ServiceError",
    "ServiceUnhealthyError",
    "release_parked",
]


class LocalEnvironmentOptions(EnvironmentOptions):
    """Options of the local sandbox (Harbor's ``--ek key=value`` / ``environment_kwargs``).

    Attributes:
        output_cap_bytes: Output kept per stream and command (head and tail); the rest
            is read and dropped, so a command printing gigabytes cannot exhaust memory.
        default_memory_mb: Memory limit when the task sets none.
        default_storage_mb: Bound on what a sandbox writes (its root, ``/tmp``) when the task's
            ``[environment] storage_mb`` sets none: its tree is a tmpfs of that size, so a write past
            it fails (``ENOSPC``), as on a full disk under Docker. Holds without root.
        pids_max: Maximum number of processes in one sandbox (fork-bomb containment).
        cache_dir: Where built images are cached (default ``~/.cache/harbor-local-sandbox``,
            ``HARBOR_LOCAL_SANDBOX_CACHE_DIR`` overrides).
        host_trust: Forward the host's proxy settings and CA certificates to image builds
            and image-rooted sandboxes (for networks that intercept TLS).
        verifier_isolation: Verify in a sibling of the sandbox that sees the
            agent's files but runs the image's code, and that the agent's processes cannot reach
            (:meth:`LocalEnvironment.verifier_view`); off, the verifier runs in the agent's
            sandbox, as on Docker (for comparisons and measurements).
    """

    output_cap_bytes: int = Field(default=1 << 20, ge=1024)
    default_memory_mb: int | None = Field(default=4096, ge=16)
    default_storage_mb: int | None = Field(default=10240, ge=16)
    pids_max: int | None = Field(default=2048, ge=16)
    cache_dir: str | None = None
    host_trust: bool = True
    verifier_isolation: bool = True


class _GradingSupport:
    """What rollout grading can ask of a local sandbox beyond Harbor's interface: an isolated view for
    the verifier, whether it still runs, which limits its agent exhausted, its processes and its files
    (a trainer's grading finds them structurally: any backend may offer them)."""

    _sandbox: ImageRoot
    local_options: LocalEnvironmentOptions
    #: In a verifier view: what it held back of the agent's changes, and why (see :meth:`verifier_view`).
    concealed: tuple[str, ...] = ()

    @property
    def isolated_verification(self) -> bool:
        """Whether grading uses :meth:`verifier_view` (unless ``verifier_isolation=False``)."""
        return self.local_options.verifier_isolation

    async def alive(self) -> bool:
        """Whether the sandbox still runs: its supervisor (which the agent cannot kill) answers.

        Asked of the backend itself, not of a shell the agent could have broken.
        """
        box = self._sandbox.box
        if box is None or box.closed:
            return False
        try:
            await box.control.list_processes()  # the keel: out of the agent's reach and cgroup
        except SandboxError:
            return False
        return True

    @contextlib.asynccontextmanager
    async def verifier_view(
        self, allowed_changes: Sequence[str] = (), network_policy: Any = None
    ) -> AsyncIterator[Any]:
        """The verifier's view of the sandbox, as a Harbor environment of its own, while the context lasts.

        The verifier's processes run in the sandbox's outer PID namespace (they see and can signal the
        agent's processes, which keep running, as under Harbor, and cannot see them), with a mount,
        network, IPC and UTS namespace of their own. Their root holds the agent's own folders, live
        (its working directory, its data), and elsewhere the image under a snapshot of the agent's
        changes filtered by the rule of ``_view.py`` (the image's code stays the image's). The agent's
        TCP services answer on the view's loopback at their ports; the view's own network is
        ``network_policy``'s (the agent's stays its own). Its ``concealed`` lists what the view held
        back of the agent's code places, and why.

        Args:
            allowed_changes: Globs of paths whose agent-made version the view shows whatever they are.
            network_policy: The verifier's network policy (Harbor's); default: none.

        Yields:
            The view, a ``LocalEnvironment`` of its own (exec, uploads and downloads go to the verifier's).

        Raises:
            SandboxError: If the sandbox is not running, or the view cannot be made.
        """
        if type(self._sandbox) is not ImageRoot:
            raise SandboxError("a verifier view is made of the agent's sandbox, not of another view")
        network = "none" if network_policy is None else self._network(network_policy)
        root = VerifierRoot(self._sandbox, allowed_changes, network)
        await root.open()
        view = copy.copy(self)
        view._sandbox = root
        if network_policy is not None:
            view._network_policy = network_policy
        assert root.view is not None
        view.concealed = tuple(root.view.concealed)
        try:
            yield view
        finally:
            await root.stop()

    async def resource_exhaustion(self) -> str | None:
        """Which of the sandbox's limits its processes ran into (memory, processes), or ``None``.

        (A full storage bound needs no report: a write past it fails with ``ENOSPC``, the sandbox lives on.)

        A sandbox that stopped answering after its agent exhausted its limits (e.g. its memory
        cgroup killed the supervisor) is the agent's doing, not an infrastructure failure.

        Returns:
            A short description, or ``None`` (only where cgroups are in use: as root).
        """
        box = self._sandbox.box
        return None if box is None else box.resource_exhaustion()

    async def list_processes(self) -> list[str]:
        """The sandbox's processes (its supervisor aside), as ``"PID:START"`` entries.

        Taken before the agent's first command, it says what to keep at :meth:`kill_processes`
        (e.g. a service the image's ``ENTRYPOINT`` started).

        Returns:
            One entry per live process.

        Raises:
            SandboxCommandError: If the sandbox is not running.
        """
        return await self._sandbox.running_box().control.list_processes()

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
        return await self._sandbox.running_box().control.kill_processes(keep)

    async def file_fingerprints(self, patterns: Sequence[tuple[str, int | None]]) -> dict[str, str]:
        """Fingerprint sandbox paths from the host, without running anything in the sandbox.

        Args:
            patterns: ``(absolute sandbox path, depth)`` pairs; wildcards allowed in the path;
                depth ``0`` is the entry itself, ``None`` everything below it.

        Returns:
            ``{sandbox path: signature}``; a signature changes when the entry's content,
            inode, mode or type does (folders: type and mode only).
        """
        return await asyncio.to_thread(self._sandbox.fingerprints, list(patterns))


class LocalEnvironment(_GradingSupport, BaseEnvironment):
    """Runs a Harbor task in a bubblewrap sandbox on this machine (see the module docstring).

    Takes Harbor's standard environment arguments; the options in
    :class:`LocalEnvironmentOptions` are passed as keyword arguments. The sandbox is an
    :class:`~harbor_local_sandbox._roots.ImageRoot`, adapted here to Harbor's interface.
    """

    options_model: ClassVar[type[EnvironmentOptions] | None] = LocalEnvironmentOptions
    #: A task's ``docker-compose.yaml`` services run, each a sandbox of its own (``_compose.py``); what it
    #: asks for that they cannot do is refused by :meth:`compose_problems`.
    supports_compose: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        assert isinstance(self.options, LocalEnvironmentOptions)
        self.local_options: LocalEnvironmentOptions = self.options
        task = RootTask(
            environment_dir=self.environment_dir,
            name=self.environment_name,
            box_name=self.session_id or self.environment_name,
            workdir=self.task_env_config.workdir,
            docker_image=self.task_env_config.docker_image,
            cache_dir=self.local_options.cache_dir,
            host_trust=self.local_options.host_trust,
            output_cap=self.local_options.output_cap_bytes,
        )
        #: The sandbox: the task's image, its tree and its box.
        self._sandbox: ImageRoot = ImageRoot(task)
        #: The task's ``docker-compose.yaml``, if it has one (``ComposeUnsupportedError`` for what it cannot run).
        self._compose: ComposeProject | None = load_compose(self.environment_dir)
        #: Its services while the sandbox runs.
        self._services: ComposeGroup | None = None

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

    async def _apply_network_policy(self, network_policy: Any) -> None:
        """Switch the running sandbox between no network and the user-mode network (Harbor's phases)."""
        await self._sandbox.running_box().set_network(self._network(network_policy))

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities | None:
        """CPU and memory are hard limits (cgroups where writable, else rlimits)."""
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        """Check options and that bubblewrap is installed, before any trial is queued.

        Raises:
            SandboxUnavailableError: If bubblewrap is missing or cannot make a sandbox's namespaces
                here (in a container: the message names the cause and the container settings that
                allow them), or buildah or the package's built helpers are missing, or (without
                root's ``CAP_SYS_ADMIN``) this user's namespace holder cannot start, or the image cache
                is on an overlay (a container's own root) without ``/dev/fuse``.
        """
        super().preflight(kwargs)
        bwrap_path()
        options = cls.parse_options(kwargs)
        # Inside containers and pods: why namespaces are refused, and the settings that allow them.
        problem = namespace_problem()
        if problem:
            raise SandboxUnavailableError(problem)
        ImageRoot.preflight()
        cache = options.cache_dir if isinstance(options, LocalEnvironmentOptions) else None
        problem = cache_problem(Path(cache) if cache else default_cache_dir())
        if problem:
            raise SandboxUnavailableError(problem)

    @classmethod
    def image_store(cls, cache_dir: str | Path | None = None, *, host_trust: bool = True) -> ImageStore:
        """The image cache this backend's sandboxes use for ``cache_dir`` (list, build ahead, prune, load).

        Args:
            cache_dir: The cache root (``None``: ``$HARBOR_LOCAL_SANDBOX_CACHE_DIR`` or
                ``~/.cache/harbor-local-sandbox``).
            host_trust: Forward the host's proxy settings and CA certificates to builds.

        Returns:
            The process's one store for those settings (what a sandbox with the same options finds).
        """
        return CACHE.builder(ImageStore, str(cache_dir) if cache_dir else None, host_trust=host_trust)

    @classmethod
    def compose_problems(cls, environment_dir: str | Path) -> list[str]:
        """What of a task's ``environment/docker-compose.yaml`` this backend does not run (by file, service,
        field and fix; empty: it runs as written, or there is none): asked before any sandbox starts."""
        return compose_problems(environment_dir)

    @classmethod
    def release_idle(cls) -> None:
        """Stop what the backend keeps warm between sandboxes (the launcher parked for the next start)."""
        release_parked()

    def _validate_definition(self) -> None:
        if not self.environment_dir.is_dir():
            raise FileNotFoundError(f"environment directory {self.environment_dir} does not exist")

    # -- lifecycle -------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        """Build (or reuse) the task's image and start the sandbox.

        Args:
            force_build: Rebuild the image even if a cached one exists.

        Raises:
            ImageBuildError: If the Dockerfile cannot be built here.
            SandboxStartError: If the sandbox cannot start.
        """
        await sweep_stale_once()
        network = self._network()
        cpus = self._effective_cpus
        options = self.local_options
        switchable = any(self._network(policy) != network for policy in self._phase_network_policies)
        storage_mb = self._effective_storage_mb or options.default_storage_mb
        services = None
        if self._compose is not None:
            services = ComposeGroup(self._compose, self._sandbox.task, self.trial_paths.trial_dir / "services")
            services.prepare_main(self._sandbox, storage_mb)
            self._services = services
        try:
            await self._sandbox.start(
                force_build,
                network=network,
                # A phase (agent, verifier) wants a different network than the sandbox starts with.
                network_switchable=switchable,
                memory_mb=self._effective_memory_mb or options.default_memory_mb,
                cpus=float(cpus) if cpus else None,
                pids_max=options.pids_max,
                storage_mb=storage_mb,
                mediate_links=options.verifier_isolation,  # the view follows the agent's links live
            )
            if services is not None:  # in main's network namespace, once its box is up
                await services.start(
                    self._sandbox,
                    force_build,
                    network_switchable=network == "user" or switchable,  # their resolv.conf
                    memory_mb=options.default_memory_mb,
                    pids_max=options.pids_max,
                    storage_mb=options.default_storage_mb,
                )
        except BaseException:
            await self.stop(delete=True)
            raise
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Kill every process of the sandbox (daemons included) and delete its tree.

        Args:
            delete: Accepted for Harbor's interface; the sandbox is always deleted,
                because nothing of it can be restarted.
        """
        services, self._services = self._services, None
        try:
            if services is not None:
                await services.stop_services()
        finally:
            await self._sandbox.stop()
            if services is not None:
                await services.remove_volumes(self._sandbox.host)

    # -- commands --------------------------------------------------------------

    @property
    def workdir(self) -> str:
        """The default working directory: the task's, else the Dockerfile's last WORKDIR, else ``/``."""
        return self._sandbox.workdir

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
            user: A user of the image (name or uid, ``user:group`` too; default: the image's ``USER``).

        Returns:
            The exit code and the (bounded) standard output and error.

        Raises:
            SandboxTimeoutError: If the command ran past ``timeout_sec``.
            SandboxCommandError: If the sandbox is not running.
        """
        merged = self._merge_env(env)
        if self._compose is not None and self._compose.main.environment:  # main's `environment` in the file
            merged = {**self._compose.main.environment, **(merged or {})}
        result = await self._sandbox.run(
            command, cwd=cwd, env=merged, timeout=timeout_sec, user=self._resolve_user(user)
        )
        if result["timed_out"]:
            raise SandboxTimeoutError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=result["stdout"], stderr=result["stderr"], return_code=result["rc"])

    # -- files -----------------------------------------------------------------

    async def _on_tree(self, func: Any, *args: Any) -> None:
        """Run ``func(rootfs, *args)`` (an ``_hostfs`` copy) where the sandbox's tree is seen with root's rights."""
        await asyncio.to_thread(self._sandbox.host.call, func, self._sandbox.rootfs, *args)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file into the sandbox (never through a link the agent planted)."""
        self._sandbox.check_writable(target_path)
        await self._on_tree(_hostfs.upload_file, Path(source_path), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy the contents of a host directory into a sandbox directory."""
        self._sandbox.check_writable(target_dir)
        await self._on_tree(_hostfs.upload_dir, Path(source_dir), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a sandbox file to the host; refuses links, so no host file is ever read."""
        self._sandbox.check_writable(source_path)
        await self._on_tree(_hostfs.download_file, source_path, Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox directory's regular files and folders to the host, skipping links."""
        self._sandbox.check_writable(source_dir)
        await self._on_tree(_hostfs.download_dir, source_dir, Path(target_dir))
