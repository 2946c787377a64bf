"""A local sandbox's ``/``: the task's image under a private copy-on-write layer, over one ``_box.Box``.

* :class:`ImageRoot`: the agent's sandbox. The task's image (``oci.py``) under a private overlay
  the host mounts; its ``ENV``, ``WORKDIR``, ``USER``, ``ENTRYPOINT`` and users as with ``docker run``.
* :class:`VerifierRoot`: the verifier's view of it (``_view.py``), a sibling box over a filtered snapshot.

Each owns making its tree, where a sandbox path is on the host, a command's environment and user.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl_harbor.sandboxes import _hostfs, _userns
from trl_harbor.sandboxes._binaries import static_binary
from trl_harbor.sandboxes._box import Box, BoxConfig
from trl_harbor.sandboxes._cache import CACHE
from trl_harbor.sandboxes._fingerprints import fingerprints
from trl_harbor.sandboxes._lifetime import new_box_name, state_root
from trl_harbor.sandboxes._mounts import inode_bound, is_kernel_path, mount_bounded_tmpfs, mount_overlay
from trl_harbor.sandboxes._userns import can_mount
from trl_harbor.sandboxes._view import SearchPaths, Snapshot, search_paths, snapshot
from trl_harbor.sandboxes.errors import SandboxCommandError, SandboxStartError
from trl_harbor.sandboxes.oci import (
    BuiltImage,
    ImageStore,
    buildah_path,
    host_ca_env,
    host_proxy_env,
    host_trust_mounts,
)

logger = logging.getLogger(__name__)
MiB = 1 << 20
#: Prints the image's interpreters' import paths, one folder a line: Python's (``sys.path`` and the
#: user site) after ``#python``, then perl's, ruby's and node's after ``#modules``.
_SEARCH_PATH_PROBE = (
    "echo '#python'; command -v python3 >/dev/null 2>&1 && python3 -c 'import site, sys; "
    'print("\\n".join([p for p in sys.path if p] + [site.getusersitepackages()]))\'; '
    "echo '#modules'; command -v perl >/dev/null 2>&1 && perl -e 'print \"$_\\n\" for @INC'; "
    "command -v ruby >/dev/null 2>&1 && ruby -e 'puts $LOAD_PATH'; "
    'command -v node >/dev/null 2>&1 && node -e \'console.log(require("module").globalPaths.join("\\n"))\'; '
    "true"
)
#: Remakes the loader cache without touching the libraries' links (``-X``), where the image has ldconfig.
_REMAKE_LOADER_CACHE = "PATH=/usr/sbin:/sbin:/usr/bin:/bin; command -v ldconfig >/dev/null 2>&1 && ldconfig -X; true"
#: The ``/etc/hosts`` of a Docker container (``docker run`` writes it; the image's own is not seen).
DOCKER_HOSTS = (
    "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\n"
    "ff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n127.0.1.1\t{hostname}\n"
)
#: ``docker run``'s PATH when the image sets none.
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Where the user-switching helper appears inside image-rooted sandboxes.
RUNAS = "/run/trl-harbor/runas"


@dataclass(frozen=True)
class RootTask:
    """What a root needs of its task and options (``box_name``: Harbor's session id, else ``name``)."""

    environment_dir: Path
    name: str
    box_name: str
    workdir: str | None
    docker_image: str | None
    cache_dir: str | None
    host_trust: bool
    output_cap: int

    @property
    def hostname(self) -> str:
        """The sandbox's host name: ``name`` as a DNS label."""
        cleaned = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in self.name.lower()).strip("-")
        return (cleaned or "sandbox")[:63]


class ImageRoot:
    """The task's image (built by buildah) under a private copy-on-write layer, with Docker's run semantics."""

    def __init__(self, task: RootTask):
        self.task = task
        self.image: BuiltImage | None = None
        self.box: Box | None = None
        #: The sandbox's folder in the state root (its tree, its box's state), once started.
        self.dir: Path | None = None
        #: Where the host-side work on its tree runs: this process, or (without root) the holder.
        self.host: _userns.Host = _userns.DIRECT

    @property
    def rootfs(self) -> Path:
        """The sandbox's ``/`` on the host (``SandboxCommandError`` before start)."""
        if self.dir is None:
            raise SandboxCommandError("the sandbox has not been started")
        return self.dir / "rootfs"

    def running_box(self) -> Box:
        """The sandbox's box (``SandboxCommandError`` when it is not running)."""
        if self.box is None:
            raise SandboxCommandError("the sandbox is not running (call start() first)")
        return self.box

    @classmethod
    def preflight(cls) -> None:
        """Check for buildah, a static C compiler, and, without root's ``CAP_SYS_ADMIN``, that this user's
        holder starts (``SandboxUnavailableError``; ``_userns.py``)."""
        buildah_path()
        if not can_mount():  # not root, or root without CAP_SYS_ADMIN (a container's, usually)
            host = _userns.host()  # started here, so that what it lacks is said at spec build
            if host.ids == 1:
                logger.warning(
                    "task images without root: this user has no subordinate ids, so sandboxes map one id; %s. "
                    "To build and run images as Docker does, %s",
                    _userns.SINGLE_ID_LIMITS, _userns.SUBID_FIX,
                )  # fmt: skip
        static_binary("supervisor")  # compiled once and cached; its error names the packages

    async def start(self, force_build: bool, **box: Any) -> None:
        """Build (or reuse) the task's image, make the tree, start the box (``LocalEnvironment.start``).

        ``box`` holds the :class:`BoxConfig` fields the environment sets (network, limits).
        """
        binds = await self._prepare(force_build)
        self.dir = state_root() / new_box_name(self.task.box_name)
        config = BoxConfig(rootfs=self.rootfs, hostname=self.task.hostname, extra_ro_binds=binds, **box)
        self.box = Box(config, self.dir / "run", name=self.dir.name, owned_dir=self.dir)
        try:
            self.box.reserve()  # its cgroups: the kernel's wait to move into them overlaps making the tree
            self.dir.mkdir()
            if config.storage_mb:  # the kernel bounds the tree's bytes and inodes, exactly
                bound = config.storage_mb * MiB
                self.host.call(mount_bounded_tmpfs, self.dir, bound, inode_bound(config.storage_mb))
                self.box.mounts.append(self.dir)  # detached last (the root's overlay is on it)
            await self._launch()
        except BaseException:
            await self.stop()
            raise

    async def _prepare(self, force_build: bool) -> list[tuple[str, str]]:
        """Build (or reuse) the task's image; the read-only mounts its box gets."""
        store = CACHE.builder(ImageStore, self.task.cache_dir, host_trust=self.task.host_trust)
        context = self.task.environment_dir
        if not (context / "Dockerfile").is_file() and self.task.docker_image:
            # A prebuilt image ([environment] docker_image) with no Dockerfile: FROM it.
            context = await asyncio.to_thread(store.prebuilt_context, self.task.docker_image)
        self.image = await store.get(context, self.task.name, force=force_build)
        self.host = store.buildah.host
        binds = [(await asyncio.to_thread(static_binary, "runas"), RUNAS)]
        if self.task.host_trust:
            mounts = host_trust_mounts(store.storage_dir / "trust")
            has_pip_conf = self.host.call(os.path.lexists, self.image.rootfs / "etc" / "pip.conf")
            binds += [m for m in mounts if not (m[1] == "/etc/pip.conf" and has_pip_conf)]
        return binds

    async def stop(self) -> None:
        """Kill every process of the sandbox and delete its tree (idempotent)."""
        if self.box is not None:
            await self.box.kill()
            self.box = None
        if self.dir is not None:
            await _off_loop(self.host.call, _hostfs.remove_tree, self.dir)
            self.dir = None

    async def run(
        self,
        command: str,
        *,
        cwd: str | None,
        env: dict[str, str] | None,
        timeout: float | None,
        user: str | int | None,
    ) -> dict:
        """Run ``command`` as ``user`` (``None``: the image's), ``env`` added (``LocalEnvironment.exec``)."""
        command, env = self._for_user(user, command, env)
        box = self.running_box()
        return await box.supervisor.run(
            command, cwd=cwd or self.workdir, env=env, timeout=timeout, output_cap=self.task.output_cap
        )

    def check_writable(self, path: str) -> None:
        """Refuse (``UnsafePathError``) a host-side copy to or from a path that is not the sandbox's own."""
        if is_kernel_path("/" + str(path).strip("/")):
            raise _hostfs.UnsafePathError(1, f"{path!r} is the kernel's (/proc, /dev, /sys), not in the sandbox's tree")

    def fingerprints(self, patterns: Sequence[tuple[str, int | None]]) -> dict[str, str]:
        """Fingerprint sandbox paths from the host (``LocalEnvironment.file_fingerprints``; without root,
        in the holder, which sees the agent's users' files too)."""
        if self.image is None or self.dir is None:
            raise SandboxCommandError("the sandbox is not running (call start() first)")
        return self.host.call(fingerprints, self.image.rootfs, self.dir, list(patterns))

    async def _launch(self) -> None:
        assert self.image is not None
        assert self.dir is not None
        await asyncio.to_thread(
            self.host.call, mount_tree, self.dir, self.image.rootfs, self.task.hostname, self.task.workdir
        )
        self.running_box().mounts.append(self.rootfs)
        await self.running_box().start()
        await self._probe_search_paths()  # before anything but the image runs in the box
        if self.image.config.entrypoint:
            await self._start_entrypoint(self.image.config.entrypoint)

    async def _probe_search_paths(self) -> None:
        """Where the image's verifier looks code up (its ``PATH``, its Python's import path), once per image."""
        assert self.image is not None
        path = {**{"PATH": DOCKER_DEFAULT_PATH}, **self.image.config.env}["PATH"]
        key = ("search", str(self.image.rootfs), path)
        if CACHE.known(key):
            return
        result = await self.run(_SEARCH_PATH_PROBE, cwd="/", env=None, timeout=60, user="root")
        found: dict[str, list[str]] = {"#python": [], "#modules": []}
        section = found["#python"]
        for line in result["stdout"].splitlines():
            if line in found:
                section = found[line]
            elif line.startswith("/"):
                section.append(line)
        probed = self.host.call(search_paths, self.image.rootfs, path, found["#python"], (), found["#modules"])
        CACHE.remember(key, probed)

    @property
    def search(self) -> SearchPaths:
        """Where the image's verifier looks code up (probed at the first start of this image)."""
        assert self.image is not None
        path = {**{"PATH": DOCKER_DEFAULT_PATH}, **self.image.config.env}["PATH"]
        return CACHE.recall(("search", str(self.image.rootfs), path)) or self.host.call(
            search_paths, self.image.rootfs, path, ()
        )

    async def _start_entrypoint(self, entrypoint: list[str]) -> None:
        """Run the image's ENTRYPOINT in the background, its arguments Harbor's keep-alive command (as Docker's)."""
        command = f"{shlex.join([*entrypoint, 'sh', '-c', 'sleep infinity'])} </dev/null >/dev/null 2>&1 &"
        result = await self.run(command, cwd=None, env=None, timeout=None, user=None)
        if result["rc"] != 0:
            raise SandboxStartError(f"the image's ENTRYPOINT {entrypoint} could not start")

    @property
    def workdir(self) -> str:
        """The default working directory: the task's, else the image's ``WORKDIR``, else ``/``."""
        return self.task.workdir or (self.image.config.workdir if self.image else None) or "/"

    def _for_user(self, user: str | int | None, command: str, env: dict[str, str] | None) -> tuple[str, dict[str, str]]:
        assert self.image is not None
        name = str(user if user is not None else self.image.config.user or "root")
        is_root = name in ("root", "0") or name.startswith(("root:", "0:"))
        if not is_root:
            # "$0" is the shell the supervisor chose (bash, else sh): the same one runs the command.
            command = f'exec {RUNAS} {shlex.quote(name)} "$0" -c {shlex.quote(command)}'
        base = {"PATH": DOCKER_DEFAULT_PATH, "HOSTNAME": self.task.hostname, **({"HOME": "/root"} if is_root else {})}
        if self.task.host_trust:
            base.update(self._trust_env)
        return command, {**base, **self.image.config.env, **(env or {})}

    @functools.cached_property
    def _trust_env(self) -> dict[str, str]:
        """The host's proxies, and its CA bundle for tools that ignore the system store (uv, requests, node, git)."""
        return {**host_proxy_env(), **host_ca_env()}


class VerifierRoot(ImageRoot):
    """The verifier's view of an image-rooted sandbox (``_view.py``): a sibling box over a filtered snapshot.

    Its box shares the agent's user and network namespaces (the agent's services are on its
    ``localhost``; their unix sockets are bound in) and has PID, mount, IPC and UTS namespaces of its
    own, so the agent's processes — still running — cannot see or touch it. Its root is an overlay over
    the image whose middle layer is the snapshot of the agent's layer, and whose upper layer takes the
    verifier's own writes.
    """

    def __init__(self, agent: ImageRoot, allowed: Sequence[str]):
        super().__init__(agent.task)
        self.agent = agent
        self.image = agent.image
        self.host = agent.host
        self.allowed = list(allowed)
        #: What the snapshot held back, and the agent's sockets it binds (set by :meth:`open`).
        self.view: Snapshot | None = None

    async def open(self) -> None:
        """Take the snapshot, mount the view and start its box (``SandboxError``; nothing is left on failure)."""
        agent_box = self.agent.running_box()
        if self.image is None or self.agent.dir is None or agent_box.init_pid is None:
            raise SandboxCommandError("the agent's sandbox is not running")
        self.dir = self.agent.dir / "verifier"  # on the agent's file system (the snapshot links), out of its sight
        try:
            assert self.image is not None
            self.view, sockets, accounts = await asyncio.to_thread(
                self.host.call, make_view, self.agent.dir, self.dir, self.image.rootfs, self.agent.search,
                self.workdir, self.allowed,
            )  # fmt: skip
            config = dataclasses.replace(
                agent_box.config, rootfs=self.rootfs, join=agent_box.init_pid, extra_binds=sockets,
                extra_ro_binds=[*agent_box.config.extra_ro_binds, *accounts],
                hostname=self.task.hostname,
            )  # fmt: skip
            # Named after the agent's box (its cgroups, the sweep of a dead owner's boxes).
            self.box = Box(config, self.dir / "run", name=f"{self.agent.dir.name}-verifier", owned_dir=self.dir)
            self.box.mounts.append(self.rootfs)
            await self.box.start()
            if self.view.libraries_added:
                # The loader cache is the image's (the agent's is not seen): remade by the image's
                # ldconfig from the image's configuration, it finds the libraries the agent added.
                await self.run(_REMAKE_LOADER_CACHE, cwd="/", env=None, timeout=60, user="root")
        except BaseException:
            await self.stop()
            raise


def mount_tree(box_dir: Path, image_root: Path, hostname: str, workdir: str | None) -> None:
    """Make an image-rooted sandbox's tree: its overlay over the image root at ``box_dir/rootfs``."""
    for name in ("upper", "work", "rootfs", "run"):
        (box_dir / name).mkdir(parents=True)
    rootfs = box_dir / "rootfs"
    mount_overlay(image_root, box_dir / "upper", box_dir / "work", rootfs)
    # As Docker does: the sandbox's own /etc/hosts and /etc/hostname (a client of `localhost` works).
    _hostfs.write_text(rootfs, "/etc/hosts", DOCKER_HOSTS.format(hostname=hostname))
    _hostfs.write_text(rootfs, "/etc/hostname", hostname + "\n")
    if workdir:
        # Made without following links (the image's tree is the task author's).
        os.close(_hostfs._open_dir(rootfs, _hostfs._parts(workdir), create=True))


def make_view(
    agent_dir: Path, view_dir: Path, image_root: Path, search: SearchPaths, workdir: str, allowed: list[str]
) -> tuple[Snapshot, list[tuple[str, str]], list[tuple[str, str]]]:
    """Make the verifier's view of an agent's tree at ``view_dir/rootfs``: the snapshot of the agent's
    layer between the image and the verifier's own upper layer.

    Returns:
        The snapshot, the agent's unix sockets to bind in (``(host path, sandbox path)``), and the
        image's account files to bind at ``/run/trl-harbor`` (the view's own may be the agent's).
    """
    for name in ("snapshot", "upper", "work", "rootfs", "run"):
        (view_dir / name).mkdir(parents=True)
    view = snapshot(agent_dir / "upper", image_root, view_dir / "snapshot", search, workdir, allowed)
    mount_overlay([view_dir / "snapshot", image_root], view_dir / "upper", view_dir / "work", view_dir / "rootfs")
    # Bound from the agent's tree: never through a link the agent made since (a host file).
    root = os.path.realpath(agent_dir / "rootfs")
    sources = [(os.path.realpath(agent_dir / "rootfs" / path.lstrip("/")), path) for path in view.sockets]
    sockets = [(source, path) for source, path in sources if source.startswith(root + "/")]
    accounts = [
        (str(image_root / "etc" / name), f"/run/trl-harbor/{name}")
        for name in ("passwd", "group")
        if (image_root / "etc" / name).is_file()
    ]
    return view, sockets, accounts


async def _off_loop(func, *args) -> None:
    """Run blocking file work in a thread, or inline at interpreter shutdown (no thread starts then)."""
    try:
        await asyncio.to_thread(func, *args)
    except RuntimeError as error:
        if "shutdown" not in str(error):
            raise
        func(*args)
