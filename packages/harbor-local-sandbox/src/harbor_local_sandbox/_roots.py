"""A local sandbox's ``/``: the task's image under a private copy-on-write layer, over one ``_box.Box``.

* :class:`ImageRoot`: the agent's sandbox. The task's image (``oci.py``) under a private overlay
  the host mounts; its ``ENV``, ``WORKDIR``, ``USER``, ``ENTRYPOINT`` and users as with ``docker run``.
* :class:`VerifierRoot`: the verifier's view of it (``_view.py``): the agent's own folders live, its code
  places a filtered snapshot over the image, started by the agent's box's keel (``_box.Box.open_view``).

Each owns making its tree, where a sandbox path is on the host, a command's environment and user.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import posixpath
import re
import secrets
import shlex
import stat
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor_local_sandbox import _hostfs, _userns, _viewfs
from harbor_local_sandbox._binaries import static_binary
from harbor_local_sandbox._box import SLIRP_GATEWAY_DNS, Box, BoxConfig, _off_loop
from harbor_local_sandbox._cache import CACHE, ImageFacts
from harbor_local_sandbox._fingerprints import fingerprints
from harbor_local_sandbox._guard import (
    COMPILE_GUARD,
    PROVENANCE_FILE,
    CompiledGuard,
    guard_files,
    provenance,
    stdlib_folder,
)
from harbor_local_sandbox._lifetime import new_box_name, state_root
from harbor_local_sandbox._links import LinkPolicy, image_hazards, keel_items
from harbor_local_sandbox._mounts import inode_bound, is_kernel_path, mount_bounded_tmpfs, mount_overlay
from harbor_local_sandbox._userns import can_mount, in_user_namespace
from harbor_local_sandbox._view import (
    SearchPaths,
    Snapshot,
    commands_record,
    guarded_names,
    live_paths,
    search_paths,
    snapshot,
)
from harbor_local_sandbox.code_places import KERNEL_PLACES, VERIFIER_ONLY
from harbor_local_sandbox.errors import SandboxCommandError, SandboxStartError
from harbor_local_sandbox.oci import (
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
#: user site) after ``#python``, with the verifier's import guard compiled by that Python (a
#: ``#guard`` line, see :data:`COMPILE_GUARD`), then perl's, ruby's and node's after ``#modules``.
_SEARCH_PATH_PROBE = (
    "echo '#python'; command -v python3 >/dev/null 2>&1 && python3 -c "
    + shlex.quote(
        "import site, sys\n"
        "print('\\n'.join([p for p in sys.path if p] + [site.getusersitepackages()]))\n"
        "try:\n" + textwrap.indent(COMPILE_GUARD, "    ") + "except Exception:\n    pass\n"
    )
    + "; echo '#modules'; command -v perl >/dev/null 2>&1 && perl -e 'print \"$_\\n\" for @INC'; "
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
#: Sockets of the agent's outside its live folders a view serves at most (``_serve_sockets``).
MAX_SERVED_SOCKETS = 64
#: ``docker run``'s PATH when the image sets none.
DOCKER_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Where the user-switching helper appears inside image-rooted sandboxes.
RUNAS = "/run/harbor-local-sandbox/runas"
#: Where it (and the image's account files it reads) appear in a verifier's view.
VIEW_PLUMBING = "/.harbor-local-sandbox"
#: The commands the agent added to the ``PATH`` folders, for the view's supervisor (``_view.commands_record``).
COMMANDS_FILE = f"{VIEW_PLUMBING}/commands"


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

    #: Where the user-switching helper is inside the sandbox.
    runas = RUNAS

    def __init__(self, task: RootTask):
        self.task = task
        self.image: BuiltImage | None = None
        self.box: Box | None = None
        #: The sandbox's folder in the state root (its tree, its box's state), once started.
        self.dir: Path | None = None
        #: Where the host-side work on its tree runs: this process, or (without root) the holder.
        self.host: _userns.Host = _userns.DIRECT
        #: Views of this sandbox being torn down in the background (awaited before it stops).
        self.closing: set[asyncio.Task] = set()
        #: More laid on the tree before its box starts (a compose task's volumes and service names):
        #: ``(func, args)``, run as ``func(rootfs, *args)`` where the host works on trees (``_compose.py``).
        self.tree_hook: tuple[Any, tuple] | None = None

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
        """Check for buildah, the package's built helpers, and, without root's ``CAP_SYS_ADMIN``, that this user's
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
        static_binary("supervisor")  # built with the package; its error says how to reinstall

    async def start(self, force_build: bool, **box: Any) -> None:
        """Build (or reuse) the task's image, make the tree, start the box (``LocalEnvironment.start``).

        ``box`` holds the :class:`BoxConfig` fields the environment sets (network, limits).
        """
        binds = await self._prepare(force_build)
        # Found once per image (kept with it on disk): no thread hop once known.
        hazards = self.link_hazards() if self._hazards_known() else await asyncio.to_thread(self.link_hazards)
        try:
            link_policy = tuple(keel_items(LinkPolicy(hazards=hazards))) if box.get("mediate_links", True) else ()
        except ValueError as error:
            raise SandboxStartError(f"{error}; run it with verifier_isolation=False") from error
        self.dir = state_root() / new_box_name(self.task.box_name)
        config = BoxConfig(
            rootfs=self.rootfs, hostname=self.task.hostname, extra_ro_binds=binds, link_policy=link_policy, **box
        )
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
        # Taken out of the set here, not by their done-callbacks: a finished teardown's callback runs
        # on a later turn of the loop, and awaiting a gather of finished tasks never yields to it.
        while self.closing:
            pending = list(self.closing)
            self.closing.difference_update(pending)
            for outcome in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(outcome, Exception):  # the sandbox still stops; the view's failure is said
                    logger.warning(
                        "harbor-local-sandbox: tearing down a verifier's view of %s failed: %r", self.task, outcome
                    )
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
        if self.tree_hook is not None:  # its mounts go with the root's (a lazy detach takes those below it)
            func, args = self.tree_hook
            await asyncio.to_thread(self.host.call, func, self.rootfs, *args)
        await self.running_box().start()
        await self._probe_search_paths()  # before anything but the image runs in the box
        if self.image.config.entrypoint:
            await self._start_entrypoint(self.image.config.entrypoint)

    async def _probe_search_paths(self) -> None:
        """Where the image's verifier looks code up (its ``PATH``, its Python's import path), once per image."""
        assert self.image is not None
        rootfs, path = self._probed_as
        key = ("search", rootfs, path)
        if CACHE.known(key):
            return
        stored = self._stored_facts.get(f"search {path}")
        if stored is not None:  # probed by an earlier process (the image never changes)
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                probed = SearchPaths(**{field: tuple(value) for field, value in stored["search"].items()})
                compiled = CompiledGuard(**stored["guard"]) if stored.get("guard") else None
                if compiled is not None:
                    CACHE.remember(("guard", rootfs, path), compiled)
                CACHE.remember(key, probed)
                return
        result = await self.run(_SEARCH_PATH_PROBE, cwd="/", env=None, timeout=60, user="root")
        found: dict[str, list[str]] = {"#python": [], "#modules": []}
        section = found["#python"]
        lines = result["stdout"].splitlines()
        for line in lines:
            if line in found:
                section = found[line]
            elif line.startswith("/"):
                section.append(line)
        compiled = _compiled_guard(lines)
        if compiled is not None:
            CACHE.remember(("guard", rootfs, path), compiled)
        probed = self.host.call(search_paths, self.image.rootfs, path, found["#python"], (), found["#modules"])
        CACHE.remember(key, probed)
        kept = {"search": dataclasses.asdict(probed), "guard": dataclasses.asdict(compiled) if compiled else None}
        await asyncio.to_thread(self._stored_facts.put, f"search {path}", kept)

    @property
    def _stored_facts(self) -> ImageFacts:
        """What is kept on disk with the image (its search paths, its link hazards): found by the first
        sandbox of the image ever, read by every later process's first."""
        assert self.image is not None
        record = self.image.record
        return CACHE.image_facts(self.image.path, f"{record.key};{record.image_id};{record.container}")

    def _hazards_known(self) -> bool:
        return self.image is not None and CACHE.known(("link-hazards", str(self.image.rootfs)))

    @property
    def _probed_as(self) -> tuple[str, str]:
        """What the probe's facts are kept under: the image's root and the ``PATH`` it runs with."""
        assert self.image is not None
        return str(self.image.rootfs), {**{"PATH": DOCKER_DEFAULT_PATH}, **self.image.config.env}["PATH"]

    @property
    def search(self) -> SearchPaths:
        """Where the image's verifier looks code up (probed at the first start of this image)."""
        assert self.image is not None
        rootfs, path = self._probed_as
        return CACHE.recall(("search", rootfs, path)) or self.host.call(search_paths, self.image.rootfs, path, ())

    def link_hazards(self) -> dict[str, str]:
        """The image's own links that lead where no link of the agent's may (``_links.py``), found once per image."""
        assert self.image is not None
        key = ("link-hazards", str(self.image.rootfs))
        if not CACHE.known(key):
            stored = self._stored_facts.get("link hazards")
            if not isinstance(stored, dict) or not all(isinstance(v, str) for v in stored.values()):
                stored = self.host.call(image_hazards, self.image.rootfs)
                self._stored_facts.put("link hazards", stored)
            CACHE.remember(key, stored)
        return CACHE.recall(key)

    @property
    def compiled_guard(self) -> CompiledGuard | None:
        """The verifier's import guard as the image's Python compiled it at the probe (``_guard.py``), if it could."""
        return CACHE.recall(("guard", *self._probed_as))

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
            command = f'exec {self.runas} {shlex.quote(name)} "$0" -c {shlex.quote(command)}'
        base = {"PATH": DOCKER_DEFAULT_PATH, "HOSTNAME": self.task.hostname, **({"HOME": "/root"} if is_root else {})}
        if self.task.host_trust:
            base.update(self._trust_env)
        return command, {**base, **self.image.config.env, **(env or {})}

    @functools.cached_property
    def _trust_env(self) -> dict[str, str]:
        """The host's proxies, and its CA bundle for tools that ignore the system store (uv, requests, node, git)."""
        return {**host_proxy_env(), **host_ca_env()}


class VerifierRoot(ImageRoot):
    """The verifier's view of an image-rooted sandbox (``_view.py``), started by the agent's box's keel.

    Its supervisor runs in the keel's PID namespace — it sees and can signal the agent's processes,
    still running as under Harbor, which cannot see it — with mount, network, IPC and UTS namespaces
    of its own and the box's keel cgroup. Its root is a mount tree made on the host from descriptors
    (:func:`make_view`): the agent's own folders where no code is looked up, live; elsewhere an overlay
    over the image whose middle layer is the snapshot of the agent's changes and whose upper layer,
    on a bounded tmpfs of the view's own, takes the verifier's writes; its ``/tmp`` the agent's under a
    layer of the verifier's. The agent's TCP services answer on its loopback, at their ports.
    """

    runas = f"{VIEW_PLUMBING}/runas"

    def __init__(self, agent: ImageRoot, allowed: Sequence[str], network: str = "none"):
        super().__init__(agent.task)
        self.agent = agent
        self.image = agent.image
        self.host = agent.host
        self.allowed = list(allowed)
        self.network = network
        #: What the snapshot held back (set by :meth:`open`).
        self.view: Snapshot | None = None

    async def open(self) -> None:
        """Make the view and start its supervisor (``SandboxError``; nothing is left on failure)."""
        agent_box = self.agent.running_box()
        if self.image is None or self.agent.dir is None or agent_box.init_pid is None:
            raise SandboxCommandError("the agent's sandbox is not running")
        # On the agent's file system (the snapshot's hard links); one per view (a step each), all gone
        # with the sandbox.
        self.dir = self.agent.dir / f"verifier-{secrets.token_hex(4)}"
        try:
            assert self.image is not None
            spec = ViewSpec(
                agent_dir=self.agent.dir, view_dir=self.dir, image_root=self.image.rootfs,
                search=self.agent.search, workdir=self.workdir, allowed=self.allowed,
                hostname=self.task.hostname, network=self.network,
                    storage_mb=agent_box.config.storage_mb, runas=static_binary("runas"), tmpdir=self._tmpdir,
                binds=list(agent_box.config.extra_ro_binds), guard=self.agent.compiled_guard,
                hazards=self.agent.link_hazards(), sockets=agent_box.listening_sockets(),
            )  # fmt: skip
            # In a process apart (a batch's views, each a walk and a dozen mounts, one at a time
            # there, not contending for this interpreter's lock with its event loop), chosen when
            # the call starts (the least busy worker).
            host = self.host
            tree, self.view = await asyncio.to_thread(lambda: host.apart().call_fd(make_view, spec))
            try:
                self.box = await agent_box.open_view(
                    tree, self.task.hostname, "user" if self.network == "user" else "none"
                )
            finally:
                os.close(tree)
            if self.view.libraries_added:
                # The loader cache is the image's (the agent's is not seen): remade by the image's
                # ldconfig from the image's configuration, it finds the libraries the agent added.
                await self.run(_REMAKE_LOADER_CACHE, cwd="/", env=None, timeout=60, user="root")
        except BaseException:
            await self.stop()
            raise

    @property
    def rootfs(self) -> Path:
        """The view's ``/`` on the host (uploads of ``/tests``, downloads of ``/logs/verifier`` go there)."""
        if self.dir is None:
            raise SandboxCommandError("the verifier's view is not open")
        return self.dir / "root"

    async def stop(self) -> None:
        """Stop the view: its processes killed and its mounts detached in the background, off the
        grading's way (the agent's sandbox waits for it before it stops); idempotent."""
        box, view_dir = self.box, self.dir
        self.box = self.dir = None
        if box is None and view_dir is None:
            return
        task = asyncio.ensure_future(self._tear_down(box, view_dir))
        self.agent.closing.add(task)
        task.add_done_callback(self.agent.closing.discard)

    async def _tear_down(self, box: Any, view_dir: Path | None) -> None:
        try:
            if box is not None:
                await box.kill()
        finally:
            if view_dir is not None:
                await _off_loop(self.host.call, close_view, view_dir)  # two syscalls: no queue for them

    def _for_user(self, user: str | int | None, command: str, env: dict[str, str] | None) -> tuple[str, dict[str, str]]:
        command, merged = super()._for_user(user, command, env)
        # The verifier's temporary files: in its own layer of /tmp, under a name the agent cannot guess.
        return command, {"TMPDIR": f"/tmp/{self._tmpdir}", **merged}

    @functools.cached_property
    def _tmpdir(self) -> str:
        return f"verifier-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class ViewSpec:
    """What :func:`make_view` needs (picklable: without root it runs in the user's holder)."""

    agent_dir: Path
    view_dir: Path
    image_root: Path
    search: SearchPaths
    workdir: str
    allowed: list[str]
    hostname: str
    network: str
    storage_mb: int | None
    runas: str
    tmpdir: str
    #: The agent's box's read-only mounts of host files (the helper, the host's CA certificates): the
    #: view gets them too, and the snapshot skips their mount points (not the agent's changes).
    binds: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: The import guard's code as the image's Python compiled it (:attr:`ImageRoot.compiled_guard`).
    guard: CompiledGuard | None = None
    #: The image's own links that lead where no link of the agent's may (:meth:`ImageRoot.link_hazards`).
    hazards: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The paths of the Unix sockets the agent's processes listen on (``Box.listening_sockets``).
    sockets: list[str] = dataclasses.field(default_factory=list)


def _compiled_guard(lines: list[str]) -> CompiledGuard | None:
    """What the probe's ``#guard MAGIC CODE`` and ``#encodings PYC BYTECODE`` lines say, if well formed
    (else the verifier compiles the source); the bytecode of ``encodings`` only with the guard's."""
    guard = next((line.split() for line in lines if line.startswith("#guard ")), None)
    encodings = next((line.split() for line in lines if line.startswith("#encodings ")), None)
    try:
        if guard is None or len(guard) != 3 or not bytes.fromhex(guard[1]) or not bytes.fromhex(guard[2]):
            return None
    except ValueError:
        return None
    try:
        if (
            encodings is not None
            and len(encodings) == 3
            and encodings[1].startswith("/")
            and bytes.fromhex(encodings[2])
        ):
            return CompiledGuard(guard[1], guard[2], encodings[1], encodings[2])
    except ValueError:
        pass
    return CompiledGuard(guard[1], guard[2])


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


def make_view(spec: ViewSpec) -> tuple[int, Snapshot]:
    """Make the verifier's view of an agent's tree, mounted at ``view_dir/root`` (see :class:`VerifierRoot`).

    Nothing below the agent's root is resolved by path: its folders are opened one level at a time
    from a descriptor of it, never through a link (``_viewfs``), and mounted from those descriptors.

    Returns:
        A detached copy of the view's mount tree (a descriptor, for its supervisor's root) — in the
        same call, so that a batch's first views start while the workers make the rest — and the
        snapshot (what it held back, whether the agent added libraries).
    """
    view_dir = os.fspath(spec.view_dir)  # strings, not Paths: a worker makes a batch's views, each a few ms
    os.makedirs(f"{view_dir}/snapshot")
    for name in ("w", "root"):
        os.mkdir(f"{view_dir}/{name}")
    own = f"{view_dir}/w"  # the verifier's own writes: a bounded tmpfs of its own, not the agent's tree
    bound = (spec.storage_mb or 10240) * MiB
    mount_bounded_tmpfs(Path(own), bound, inode_bound(spec.storage_mb or 10240))
    for name in ("upper", "work", "tmp-upper", "tmp-work", "tmp-empty"):
        os.mkdir(f"{own}/{name}")
    os.chmod(f"{own}/tmp-upper", 0o1777)
    os.mkdir(f"{own}/tmp-upper/{spec.tmpdir}")
    os.chmod(f"{own}/tmp-upper/{spec.tmpdir}", 0o1777)
    agent_dir = os.fspath(spec.agent_dir)
    agent_root = os.open(f"{agent_dir}/rootfs", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        live = live_paths(
            agent_root, spec.image_root, spec.search, spec.workdir, spec.allowed, upper=Path(agent_dir, "upper")
        )
        view = snapshot(
            Path(agent_dir, "upper"), spec.image_root, Path(view_dir, "snapshot"), spec.search, spec.workdir,
            spec.allowed, live, skip=[target for _, target in spec.binds], hazards=spec.hazards,
        )  # fmt: skip
        files, binds = _own_files(spec, f"{view_dir}/snapshot")
        late = _lay_own(f"{own}/upper", os.fspath(spec.image_root), files)  # before the mount: plain writes
        mount_overlay(
            [Path(view_dir, "snapshot"), spec.image_root], Path(own, "upper"), Path(own, "work"), Path(view_dir, "root")
        )
        root = os.open(f"{view_dir}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _bind_live(agent_root, root, [*live, *view.live_packages])
            _mount_tmp(f"{agent_dir}/upper", os.fspath(spec.image_root), root, own)
            _serve_sockets(agent_root, root, spec.sockets, live)
            files[PROVENANCE_FILE] = _provenance(agent_root, root, spec.tmpdir)
            late.append(PROVENANCE_FILE)
            commands = commands_record(view, spec.search.path)
            if commands:
                files[COMMANDS_FILE] = commands
                late.append(COMMANDS_FILE)
            for path in late:  # below a link of the image's: through the view, never following one
                if path.endswith("/"):
                    os.close(_hostfs._open_dir(Path(view_dir, "root"), _hostfs._parts(path), create=True))
                else:
                    _hostfs.write_text(Path(view_dir, "root"), path, files[path])
            for source, target in binds:
                _bind_host_file(root, source, target)
        finally:
            os.close(root)
    finally:
        os.close(agent_root)
    return _view_tree(view_dir), view


def _serve_sockets(agent_root: int, root: int, sockets: Sequence[str], live: Sequence[str]) -> None:
    """Make the Unix sockets the agent's processes listen on answer in the view wherever they are.

    A socket is reached by its file's inode in the tree it was bound in (the agent's), so in a live
    folder (a mount of the agent's tree) it answers as it is; elsewhere — ``/run``, ``/tmp``, a home's
    or ``/var``'s own entries, which are the snapshot's or ``/tmp``'s layers — it would refuse
    connections. There, the agent's socket file (opened beneath its root, never through a link) is
    mounted in the view's plumbing and the view's entry at its path becomes a link to it: the tests
    connect to the agent's service as under Harbor, and a service of the verifier's that replaces it
    (removes the path and binds its own) can, the link being the view's own."""
    for index, path in enumerate(sockets[:MAX_SERVED_SOCKETS]):
        if posixpath.normpath(path) != path or any(path.startswith(folder + "/") for folder in live):
            continue
        if any(path == place or path.startswith(place + "/") for place in (*VERIFIER_ONLY, *KERNEL_PLACES)):
            continue
        try:
            source = _viewfs.open_beneath(agent_root, path, os.O_PATH | os.O_NOFOLLOW)
        except OSError:
            continue  # gone, or below a link: not the agent's socket at that path
        try:
            if not stat.S_ISSOCK(os.fstat(source).st_mode):
                continue
            tree = _viewfs.clone_tree(source)
        finally:
            os.close(source)
        place = f"{VIEW_PLUMBING}/sockets/{index}"
        try:
            folder = _viewfs.open_beneath(root, posixpath.dirname(path))
        except OSError:
            os.close(tree)
            continue  # its folder is not in the view (the snapshot's is a link, or not there)
        try:
            mount_point = _viewfs.open_beneath(root, VIEW_PLUMBING)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir("sockets", 0o755, dir_fd=mount_point)
                sockets_dir = _viewfs.open_beneath(mount_point, "sockets")
                try:
                    os.close(
                        os.open(
                            str(index), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=sockets_dir
                        )
                    )
                finally:
                    os.close(sockets_dir)
            finally:
                os.close(mount_point)
            _attach_beneath(tree, root, place, folder=False)
            name = posixpath.basename(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)
            os.symlink(place, name, dir_fd=folder)
        finally:
            os.close(folder)


def _provenance(agent_root: int, root: int, tmpdir: str) -> str:
    """What tells the import guard who placed a file (``_guard.provenance``): the device of the agent's live
    folders (its tree's mount), of the view's ``/tmp`` (its folders), and of the verifier's own ``/tmp``
    layer (where a file the verifier writes is), found by writing a file there through the view."""
    tmp = _viewfs.open_beneath(root, "tmp")
    try:
        own = _viewfs.open_beneath(tmp, tmpdir)
        try:
            probe = f".provenance-{secrets.token_hex(4)}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=own)
            try:
                own_dev = os.fstat(fd).st_dev
            finally:
                os.close(fd)
                os.unlink(probe, dir_fd=own)
        finally:
            os.close(own)
        return provenance(os.fstat(agent_root).st_dev, os.fstat(tmp).st_dev, [own_dev])
    finally:
        os.close(tmp)


def _bind_live(agent_root: int, root: int, live: Sequence[str]) -> None:
    """Mount each of the agent's ``live`` folders on the view's: the folders that hold them opened beneath
    both roots, never through a link, once for all their live entries; each entry cloned and attached by
    its one name, never following a link either.

    A folder that is no longer there, or no longer a folder (swapped for a link or a file since it was
    listed), stays out of the view, and so does one whose mount point is not in the view (it was not
    there when the snapshot was made)."""
    by_parent: dict[str, list[str]] = {}
    for path in live:
        parent, _, name = path.rpartition("/")
        by_parent.setdefault(parent or "/", []).append(name)
    for parent, names in by_parent.items():
        try:
            source = _viewfs.open_beneath(agent_root, parent)
        except OSError:
            continue
        try:
            try:
                target = _viewfs.open_beneath(root, parent)
            except OSError:
                continue
            try:
                for name in names:
                    _bind_entry(source, target, name)
            finally:
                os.close(target)
        finally:
            os.close(source)


def _bind_entry(source: int, target: int, name: str) -> None:
    """Mount the agent's folder ``name`` of ``source`` on the view's of ``target`` (see :func:`_bind_live`)."""
    try:
        tree = _viewfs.clone_entry(source, name)
    except OSError:
        return  # removed since it was listed
    try:
        if not stat.S_ISDIR(os.fstat(tree).st_mode):
            return  # swapped for a file or a link since it was listed
        _viewfs.attach_at(tree, target, name)
    except OSError as error:
        if error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV, errno.EINVAL):
            raise
    finally:
        os.close(tree)


def _attach_beneath(tree: int, root: int, path: str, folder: bool = True) -> None:
    """Mount the detached ``tree`` (closed after) on the folder (or file) ``path`` beneath the view's ``root``."""
    try:
        target = _viewfs.open_beneath(root, path, os.O_PATH | (os.O_DIRECTORY if folder else 0))
        try:
            _viewfs.attach(tree, target)
        finally:
            os.close(target)
    finally:
        os.close(tree)


def _mount_tmp(upper: str, image_root: str, root: int, own: str) -> None:
    """The view's ``/tmp``: the agent's (its layer over the image's, read through) under a layer of the
    verifier's own. (Made of the agent's layer rather than its merged tree: the image's root is an
    overlay already, and the kernel stacks two at most.)"""
    layers: list[str] = []
    opened: list[int] = []
    try:
        for base in (upper, image_root):
            start = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            opened.append(start)
            try:
                opened.append(_viewfs.open_beneath(start, "tmp"))
                layers.append(f"/proc/self/fd/{opened[-1]}")
            except OSError:
                continue  # none there, or not a folder (a link): that layer holds nothing of /tmp
        if not layers:
            layers = [f"{own}/tmp-empty"]
        tree = _viewfs.overlay(layers, f"{own}/tmp-upper", f"{own}/tmp-work", userxattr=in_user_namespace())
    finally:
        for fd in opened:
            os.close(fd)
    _attach_beneath(tree, root, "tmp")


def _own_files(spec: ViewSpec, snapshot_dir: str) -> tuple[dict[str, str | bytes], list[tuple[str, str]]]:
    """The view's own files (its host names, resolver, ``/logs/verifier``, the user-switching helper and
    the image's account files, Python's import guard, the mount points of the host files it gets),
    and the host files to mount on them."""
    files = {
        "/etc/hosts": DOCKER_HOSTS.format(hostname=spec.hostname) + _agents_local_hosts(snapshot_dir, spec.hostname),
        "/etc/hostname": spec.hostname + "\n",
        "/etc/resolv.conf": f"nameserver {SLIRP_GATEWAY_DNS}\n" if spec.network == "user" else "",
        "/logs/verifier/": "",
        **_image_files(spec.image_root, spec.search, spec.workdir, tuple(spec.allowed), spec.guard),
    }
    binds = [(spec.runas, f"{VIEW_PLUMBING}/runas"), *((s, t) for s, t in spec.binds if t != RUNAS)]
    for _, target in binds:
        files.setdefault(target, "")  # a mount point
    return files, binds


@functools.lru_cache(maxsize=64)
def _image_files(
    image: Path, search: SearchPaths, workdir: str, allowed: tuple[str, ...], guard: CompiledGuard | None
) -> dict[str, str | bytes]:
    """The view's own files made of the image's (its account files, Python's import guard): the same
    for every view of the image (which never changes), made once."""
    files = {}
    for name in ("passwd", "group"):
        with contextlib.suppress(OSError):
            files[f"{VIEW_PLUMBING}/{name}"] = (image / "etc" / name).read_text(errors="replace")
    stdlib = stdlib_folder(search.python, lambda path: _read_in_image(image, path) is not None)
    if stdlib is not None:
        encodings = _read_in_image(image, f"{stdlib}/encodings/__init__.py") or b""
        files.update(guard_files(stdlib, encodings, guarded_names(image, search, workdir, allowed), guard))
    return files


def _read_in_image(image: Path, path: str) -> bytes | None:
    """The content of the image's file at the sandbox path ``path`` (its links resolved within the image,
    never on the host; 1 MiB at most), or ``None``."""
    root = os.open(image, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = _viewfs.open_beneath(root, path, os.O_RDONLY | os.O_NONBLOCK, resolve=_viewfs.IN_ROOT)
    except OSError:
        return None
    finally:
        os.close(root)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return handle.read(1 << 20)


def _lay_own(upper: str, image_root: str, files: dict[str, str | bytes]) -> list[str]:
    """Write the view's own files into its upper layer, their folders made as the image's are (a path
    ending in ``/`` is a folder); returns the paths below a link of the image's, to be written
    through the mounted view instead (the link must stay the image's)."""
    late, made = [], set()
    for path, text in files.items():
        parts = [part for part in path.split("/") if part]
        folders = parts if path.endswith("/") else parts[:-1]
        here, image = upper, image_root
        try:
            for part in folders:
                here, image = f"{here}/{part}", f"{image}/{part}"
                if here in made:
                    continue
                found = _image_folder(image)
                if found is False:
                    raise NotADirectoryError(path)
                mode, uid, gid = found or (0o755, 0, 0)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(here, mode)
                    os.chown(here, uid, gid)
                    os.chmod(here, mode)
                made.add(here)
        except NotADirectoryError:
            late.append(path)
            continue
        if not path.endswith("/"):
            fd = os.open(f"{here}/{parts[-1]}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, text.encode() if isinstance(text, str) else text)
            finally:
                os.close(fd)
    return late


@functools.lru_cache(maxsize=1024)
def _image_folder(path: str) -> tuple[int, int, int] | bool | None:
    """An image folder's mode and owner (``None``: nothing there; ``False``: not a folder). Images
    never change: asked once per path."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return False
    return stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid


def _bind_host_file(root: int, source: str, target: str) -> None:
    """Mount a file of the host's (this package's helper, a CA certificate) read-only on the view's ``target``."""
    opened = os.open(source, os.O_PATH | os.O_CLOEXEC)
    try:
        tree = _viewfs.clone_tree(opened)
    finally:
        os.close(opened)
    try:
        _viewfs.read_only(tree)
    except BaseException:
        os.close(tree)
        raise
    _attach_beneath(tree, root, target, folder=False)


#: ``/etc/hosts`` names of the agent's the verifier keeps: local ones (a name the agent's service is
#: reached by); never ``localhost``'s or a public name's (which would lead the verifier's own
#: downloads to the agent's services).
_LOCAL_NAME = re.compile(
    r"^(?:[A-Za-z0-9_-]+|[A-Za-z0-9.-]+\.(?:local|localhost|internal|test|lan|home\.arpa|example|invalid))$"
)


def _agents_local_hosts(snapshot_dir: str | Path, hostname: str) -> str:
    """The agent's ``/etc/hosts`` lines that name local hosts only (its file, as the snapshot laid it)."""
    try:
        # Non-blocking: the agent's /etc/hosts may be a FIFO (an open for reading would wait for ever).
        fd = os.open(f"{snapshot_dir}/etc/hosts", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""  # a FIFO, a socket, a device: no names of the agent's
        text = handle.read(65536).decode("utf-8", "replace")
    kept = []
    reserved = {"localhost", "ip6-localhost", "ip6-loopback", hostname}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        names = fields[1:]
        if names and all(_LOCAL_NAME.match(n) and n not in reserved and not n.startswith("ip6-") for n in names):
            kept.append(" ".join(fields))
    return "".join(f"{line}\n" for line in kept)


def _view_tree(view_dir: str) -> int:
    """A detached copy of the view's mount tree (for its supervisor's root): its descriptor."""
    fd = os.open(f"{view_dir}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _viewfs.clone_tree(fd, recursive=True)
    finally:
        os.close(fd)


def close_view(view_dir: Path) -> None:
    """Detach the view's host mounts (its folder, on the agent's tree, goes with the sandbox)."""
    for name in ("root", "w"):
        with contextlib.suppress(OSError):
            _viewfs.detach(str(view_dir / name))
