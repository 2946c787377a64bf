"""``RayEnvironment``: a Harbor environment whose sandbox runs on a node of a Ray cluster.

Each sandbox is an *inner* Harbor environment — the local sandbox by default, any backend by its
import path — created inside a Ray actor that Ray places on a node with the task's declared
resources free (``cpus``, ``memory_mb``: the actor's ``num_cpus`` and ``memory``). Everything the
sandbox does happens on that node: the image build (into the node's own cache, once per node and
image), ``start``, ``exec``, uploads and downloads, and grading — the local sandbox's verifier view
is opened and held by the actor, and the view handed to the verifier here is a proxy whose commands
and copies go to it. Only commands, their outputs, the files asked for (as bytes) and the verdict
cross the network.

Use it from Harbor with ``-e harbor_local_sandbox.ray_cluster:RayEnvironment``. Ray is an optional extra
(``pip install 'harbor-local-sandbox[ray]'``), imported on first use; the cluster is joined once per
process (:func:`connect`). See ``docs/backends.md`` ("Ray") for starting a cluster.

Faults: a call to a sandbox whose node or actor is gone raises :class:`SandboxLostError` and its
:meth:`~RayEnvironment.alive` says ``False``, so a trainer's grading counts the rollout
as the infrastructure's, never the policy's. Actors are owned by the driver: they die with it, and
the local sandbox tears its trees down when its actor's process goes (or, killed outright, the next
sandbox started on that node sweeps what it left).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fcntl
import functools
import importlib
import inspect
import io
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar, Literal

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.options import EnvironmentOptions
from pydantic import Field

from harbor_local_sandbox.errors import SandboxError, SandboxUnavailableError

if TYPE_CHECKING:
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

__all__ = [
    "DEFAULT_INNER",
    "IMPORT_PATH",
    "RayClusterUnavailableError",
    "RayEnvironment",
    "RayEnvironmentOptions",
    "RayHarborEnvironment",
    "RayPlacement",
    "SandboxLostError",
    "connect",
]

logger = logging.getLogger(__name__)

#: This backend's import path (what a trainer's ``environment_type`` names).
IMPORT_PATH = "harbor_local_sandbox.ray_cluster:RayEnvironment"
#: The inner backend by default: the local sandbox.
DEFAULT_INNER = "harbor_local_sandbox.local:LocalEnvironment"
#: How to install what this module needs, for the errors that say it is missing.
INSTALL_HINT = "pip install 'harbor-local-sandbox[ray]'"
#: Placeholders expanded, on the node, in the string values of ``inner_kwargs``.
NODE_PLACEHOLDERS = ("{node_id}", "{node_ip}")

#: Harbor's own constructor arguments (not user options): what the inner environment gets too.
_FRAMEWORK = frozenset(inspect.signature(BaseEnvironment.__init__).parameters) - {"self", "args", "kwargs"}
#: Framework arguments that name things on the driver's machine, or that only the driver uses.
_NOT_FORWARDED = frozenset(
    {"environment_dir", "environment_name", "session_id", "trial_paths", "task_env_config", "logger",
     "extra_docker_compose", "auto_mounts", "auto_mounting", "stream"}
)  # fmt: skip


class RayClusterUnavailableError(SandboxUnavailableError):
    """Ray is not installed, or no Ray cluster could be joined; the message says which, and the fix."""


class SandboxLostError(SandboxError):
    """The sandbox's node or actor is gone (the node was lost, the actor killed): the infrastructure's fault.

    Raised by every call to such a sandbox; its :meth:`RayEnvironment.alive` then answers ``False``.
    """


class RayEnvironmentOptions(EnvironmentOptions):
    """Options of the Ray backend (Harbor's ``--ek key=value`` / ``environment_kwargs``).

    Attributes:
        inner: The Harbor backend that runs the sandbox on the node, as ``"module:Class"`` (default:
            the local sandbox). It must be installed on every node, and here (its class is read here).
        inner_kwargs: The inner backend's own options (e.g. ``{"pids_max": 256}``). In their string
            values ``{node_id}`` and ``{node_ip}`` are replaced, on the node, by the node's (e.g.
            ``{"cache_dir": "/scratch/cache/{node_id}"}`` for several nodes on one machine).
        address: The Ray cluster to join (``"ray://head:10001"``, ``"head:6379"``, ``"auto"``);
            default: ``$RAY_ADDRESS``, else a cluster started on this machine with ``ray start``.
        local_cluster: With no cluster to join, start a single-node Ray on this machine (for trying
            it out); off, that is an error that names the fix.
        max_starts_per_node: How many sandboxes start at once on one node (image builds included);
            the others wait their turn on the node, holding their resources.
        scheduling: ``"spread"`` places sandboxes on the least loaded nodes first (Ray's ``SPREAD``);
            ``"default"`` lets Ray pack them (its hybrid policy).
        call_timeout_sec: Seconds a control call (liveness, process listing) may take before the
            sandbox counts as gone.
    """

    inner: str = DEFAULT_INNER
    inner_kwargs: dict[str, Any] = Field(default_factory=dict)
    address: str | None = None
    local_cluster: bool = False
    max_starts_per_node: int = Field(default=4, ge=1)
    scheduling: Literal["spread", "default"] = "spread"
    call_timeout_sec: float = Field(default=30.0, gt=0)


@dataclass(frozen=True)
class RayPlacement:
    """Where a sandbox runs, and what its start cost on the node.

    Attributes:
        node_id: The Ray node's id (hex).
        node_ip: The node's address.
        pid: The actor's process on the node.
        waited_sec: Seconds its start waited for a free start on the node (``max_starts_per_node``).
        start_sec: Seconds the inner backend's ``start`` took on the node (image build included).
        started_at: When the inner start began, as the node's ``time.time()``.
    """

    node_id: str
    node_ip: str
    pid: int
    waited_sec: float
    start_sec: float
    started_at: float


# ── Ray, imported on first use ───────────────────────────────────────────────────────


def _ray() -> Any:
    """The ``ray`` module.

    Raises:
        RayClusterUnavailableError: If Ray is not installed here.
    """
    try:
        import ray
    except ImportError as exc:
        raise RayClusterUnavailableError(
            f"the Ray backend needs Ray, which is not installed in this environment: {INSTALL_HINT} "
            "(on the driver and on every node)"
        ) from exc
    if getattr(ray, "__file__", None) is None:
        # A folder named ``ray`` in the working directory imports as an empty namespace package:
        # Ray's own session folder, /tmp/ray, does, for a driver started in /tmp.
        raise RayClusterUnavailableError(
            f"the Ray backend needs Ray, which is not installed in this environment ('import ray' found only "
            f"the folder {list(getattr(ray, '__path__', []))}): {INSTALL_HINT} (on the driver and on every node)"
        )
    return ray


_CONNECTING = threading.Lock()


def connect(address: str | None = None, *, local_cluster: bool = False) -> None:
    """Join a Ray cluster, once per process (a driver that called ``ray.init`` itself keeps its own).

    Args:
        address: The cluster (as for ``ray.init``); default: ``$RAY_ADDRESS``, else one started on
            this machine with ``ray start``.
        local_cluster: With no cluster to join, start a single-node Ray here instead of failing.

    Raises:
        RayClusterUnavailableError: If Ray is missing, or there is no cluster to join (the message
            names the ``address`` option, ``RAY_ADDRESS`` and ``ray start``).
    """
    ray = _ray()
    if ray.is_initialized():
        return
    with _CONNECTING:
        if ray.is_initialized():
            return
        target = address or os.environ.get("RAY_ADDRESS") or None
        try:
            if target is None and local_cluster:
                ray.init(logging_level=logging.WARNING)
            else:
                ray.init(address=target or "auto", logging_level=logging.WARNING)
        except ConnectionError as exc:
            where = f"at {target!r}" if target else "on this machine (no address given, RAY_ADDRESS unset)"
            raise RayClusterUnavailableError(
                f"no Ray cluster found {where}: start one (`ray start --head` on one machine, "
                "`ray start --address=HEAD:6379` on the others), then give its address with the "
                "backend's `address` option (--ek address=HEAD:6379) or RAY_ADDRESS; or pass "
                "local_cluster=true to start a single-node Ray on this machine"
            ) from exc


@functools.cache
def _actor_class() -> Any:
    """:class:`_SandboxHost` as a Ray actor class (made once; Ray imported here, not with the module)."""
    return _ray().remote(_SandboxHost)


@functools.cache
def _lost_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors that mean the actor, its node or its worker is gone (not an error of the call itself)."""
    exceptions = _ray().exceptions
    names = ("RayActorError", "ObjectLostError", "OwnerDiedError", "WorkerCrashedError", "NodeDiedError",
             "LocalRayletDiedError", "RaySystemError", "ActorUnschedulableError")  # fmt: skip
    return tuple(getattr(exceptions, name) for name in names if hasattr(exceptions, name))


# ── bytes for files: what crosses the network ─────────────────────────────────────────


def _pack(folder: Path) -> bytes:
    """A folder's contents as an uncompressed tar (links kept as links; the receiving side filters)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in sorted(folder.iterdir()):
            tar.add(entry, arcname=entry.name)
    return buffer.getvalue()


def _unpack(data: bytes, folder: Path) -> None:
    """Extract :func:`_pack`'s tar into ``folder`` with tarfile's data filter (nothing outside it, no devices)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(folder, filter="data")


def _expand(value: Any, node: dict[str, str]) -> Any:
    """``value`` with :data:`NODE_PLACEHOLDERS` replaced in every string it holds."""
    if isinstance(value, str):
        for name, text in node.items():
            value = value.replace("{" + name + "}", text)
        return value
    if isinstance(value, dict):
        return {key: _expand(item, node) for key, item in value.items()}
    if isinstance(value, list):
        return [_expand(item, node) for item in value]
    return value


def _load(import_path: str) -> type[BaseEnvironment]:
    """The class an ``"module:Class"`` import path names.

    Raises:
        ValueError: If it is not a ``BaseEnvironment`` subclass that can be imported.
    """
    module, sep, name = import_path.partition(":")
    if not sep:
        raise ValueError(f"inner={import_path!r}: expected a Harbor backend as 'package.module:ClassName'")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseEnvironment)):
        raise ValueError(f"inner={import_path!r} is not a Harbor environment (a BaseEnvironment subclass)")
    return cls


def _marked(error: BaseException) -> BaseException:
    """``error`` carrying the marks (``unsafe``, ``tampered``) of the errors it was raised from.

    An error crosses to the driver pickled, and pickling keeps its attributes but not its
    ``__cause__`` chain, where a backend may have put the error it marks (a refused view).
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for mark in ("unsafe", "tampered"):
            if getattr(current, mark, False) and not getattr(error, mark, False):
                with contextlib.suppress(AttributeError):
                    setattr(error, mark, True)
        current = current.__cause__ or current.__context__
    return error


#: A task folder put in Ray's object store once per driver: ``{folder: (signature, reference)}``.
_SHIPPED: dict[Path, tuple[tuple, Any]] = {}
_SHIPPED_KEPT = 256


def _signature(folder: Path) -> tuple:
    """What says a folder changed: each entry's path, size and modification time."""
    return tuple(
        (str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        for stat in (path.lstat(),)
    )


def _shipped(folder: Path) -> Any:
    """A reference to ``folder`` packed (:func:`_pack`) in Ray's object store, put once while it is unchanged.

    Every sandbox of a task gets the same object: a node fetches it once while it is referenced,
    however many of the task's sandboxes start there.
    """
    folder = Path(folder).resolve()
    ray = _ray()
    # A reference belongs to the driver's connection (its job): a new ``ray.init`` puts it again.
    signature = (ray.get_runtime_context().get_job_id(), _signature(folder))
    kept = _SHIPPED.get(folder)
    if kept is not None and kept[0] == signature:
        return kept[1]
    if len(_SHIPPED) >= _SHIPPED_KEPT:
        _SHIPPED.pop(next(iter(_SHIPPED)))
    reference = ray.put(_pack(folder))
    _SHIPPED[folder] = (signature, reference)
    return reference


#: The actors' scratch folders on a node (the task folder shipped, Harbor's trial files): ``<prefix><pid>-...``.
_SCRATCH_PREFIX = "harbor-ray-sandbox-"


#: The start slots of the nodes on this machine (:func:`_start_slot`): ``<node>-<slot>.lock`` files.
_STARTS = Path(tempfile.gettempdir()) / "harbor-ray-sandbox-starts"
#: Seconds after which a start slot's file, unused, is removed (a node id lives as long as its ``ray start``).
_STALE_SLOT_SEC = 7 * 24 * 3600


def _sweep_scratch() -> None:
    """Remove the scratch folders of actors whose process is gone (killed with their node's raylet, or their
    driver), and start slots unused for a week (of nodes long gone)."""
    with contextlib.suppress(OSError):
        for entry in Path(tempfile.gettempdir()).glob(f"{_SCRATCH_PREFIX}*-*"):
            owner = entry.name[len(_SCRATCH_PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                shutil.rmtree(entry, ignore_errors=True)
    with contextlib.suppress(OSError):
        for entry in _STARTS.glob("*.lock"):
            if time.time() - entry.stat().st_mtime > _STALE_SLOT_SEC:
                entry.unlink(missing_ok=True)


# ── the actor: one sandbox on one node ──────────────────────────────────────────────────


async def _start_slot(node_id: str, limit: int) -> IO[str]:
    """Wait for one of the node's ``limit`` start slots: a file lock, released when the file closes
    (or its process dies), shared by every actor on the node whatever its driver."""
    _STARTS.mkdir(mode=0o700, exist_ok=True)
    while True:
        for slot in range(limit):
            handle = open(_STARTS / f"{node_id[:16]}-{slot}.lock", "w")  # noqa: SIM115 - held until the start ends
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            return handle
        await asyncio.sleep(0.05)


class _SandboxHost:
    """The Ray actor that holds one sandbox (an inner Harbor environment) and its verifier views, on its node.

    Its methods are the driver's calls; it is an async actor, so an ``exec`` that waits does not
    hold up the next one (a background command, a liveness probe during a long command).
    """

    #: The inner environment's methods a driver may call through :meth:`call` (the sandbox or a view).
    CALLS = frozenset({
        "exec", "set_network_policy", "alive", "resource_exhaustion", "list_processes", "kill_processes",
        "file_fingerprints", "prepare_logs_for_host",
    })  # fmt: skip

    def __init__(self, spec: dict[str, Any], environment: bytes) -> None:
        self._spec = spec
        self._environment = environment
        _sweep_scratch()
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-"))
        self._inner: BaseEnvironment | None = None
        self._views: dict[str, tuple[contextlib.AsyncExitStack, BaseEnvironment]] = {}

    def _target(self, view: str | None) -> BaseEnvironment:
        if view is not None:
            return self._views[view][1]
        if self._inner is None:
            raise SandboxError("the sandbox has not started")
        return self._inner

    async def start(self, force_build: bool) -> dict[str, Any]:
        """Make the inner environment from the shipped task folder, wait for a start slot, start it."""
        import ray
        from harbor.models.trial.paths import TrialPaths

        context = ray.get_runtime_context()
        node = {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address()}
        spec = self._spec
        environment_dir = self._scratch / "environment" / spec["environment_name"]
        _unpack(self._environment, environment_dir)
        self._environment = b""
        trial_paths = TrialPaths(trial_dir=self._scratch / "trial")
        trial_paths.mkdir()
        cls = _load(spec["inner"])
        self._inner = cls(
            environment_dir=environment_dir,
            environment_name=spec["environment_name"],
            session_id=spec["session_id"],
            trial_paths=trial_paths,
            task_env_config=spec["task_env_config"],
            **spec["framework"],
            **_expand(spec["inner_kwargs"], node),
        )
        asked = time.monotonic()
        slot = await _start_slot(node["node_id"], spec["max_starts"])
        try:
            began, started_at = time.monotonic(), time.time()
            await self._inner.start(force_build)
            ended = time.monotonic()
        finally:
            slot.close()
        return {**node, "pid": os.getpid(), "waited_sec": began - asked, "start_sec": ended - began,
                "started_at": started_at}  # fmt: skip

    async def call(self, view: str | None, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call one of :data:`CALLS` on the sandbox (``view`` ``None``) or on an open view."""
        if name not in self.CALLS:
            raise ValueError(f"{name!r} is not forwarded to the sandbox")
        try:
            result = await getattr(self._target(view), name)(*args, **kwargs)
        except Exception as exc:
            raise _marked(exc) from None
        return result.model_dump() if isinstance(result, ExecResult) else result

    async def alive(self, view: str | None) -> bool:
        """Whether the sandbox runs: the inner backend's own answer where it has one, else ``true`` as root."""
        target = self._target(view)
        probe = getattr(target, "alive", None)
        if probe is not None:
            return bool(await probe())
        return (await target.exec("true", user="root", timeout_sec=30)).return_code == 0

    async def upload_file(self, view: str | None, data: bytes, mode: int, target_path: str) -> None:
        """Write the shipped bytes to a scratch file on the node, then upload it into the sandbox."""
        scratch = Path(tempfile.mkdtemp(dir=self._scratch))
        try:
            source = scratch / (Path(target_path).name or "file")
            source.write_bytes(data)
            source.chmod(mode & 0o7777)
            await self._target(view).upload_file(source, target_path)
        except Exception as exc:
            raise _marked(exc) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def upload_dir(self, view: str | None, data: bytes, target_dir: str) -> None:
        """Unpack the shipped tar on the node, then upload the folder into the sandbox."""
        scratch = Path(tempfile.mkdtemp(dir=self._scratch))
        try:
            _unpack(data, scratch / "dir")
            await self._target(view).upload_dir(scratch / "dir", target_dir)
        except Exception as exc:
            raise _marked(exc) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def download_file(self, view: str | None, source_path: str) -> tuple[bytes, int]:
        """Download a sandbox file to the node (the inner backend's checks apply), return its bytes and mode."""
        scratch = Path(tempfile.mkdtemp(dir=self._scratch))
        try:
            local = scratch / "file"
            await self._target(view).download_file(source_path, local)
            return local.read_bytes(), local.stat().st_mode
        except Exception as exc:
            raise _marked(exc) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def download_dir(self, view: str | None, source_dir: str) -> bytes:
        """Download a sandbox folder to the node (the inner backend's checks apply), return it as a tar."""
        scratch = Path(tempfile.mkdtemp(dir=self._scratch))
        try:
            local = scratch / "dir"
            local.mkdir()
            await self._target(view).download_dir(source_dir, local)
            return _pack(local)
        except Exception as exc:
            raise _marked(exc) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def open_view(self, view: str, allowed_changes: list[str], network_policy: Any) -> dict[str, Any]:
        """Open the inner sandbox's verifier view and hold it (until :meth:`close_view`) under ``view``."""
        stack = contextlib.AsyncExitStack()
        try:
            opened = await stack.enter_async_context(
                self._target(None).verifier_view(allowed_changes=allowed_changes, network_policy=network_policy)  # type: ignore[attr-defined]
            )
        except Exception as exc:
            raise _marked(exc) from None
        self._views[view] = (stack, opened)
        return {"concealed": list(getattr(opened, "concealed", ()))}

    async def close_view(self, view: str) -> None:
        """Close a view opened by :meth:`open_view` (a view already closed is nothing to do)."""
        entry = self._views.pop(view, None)
        if entry is not None:
            await entry[0].aclose()

    async def stop(self, delete: bool) -> None:
        """Close the open views, stop the inner sandbox, remove the node's scratch folder."""
        try:
            for view in list(self._views):
                with contextlib.suppress(Exception):
                    await self.close_view(view)
            if self._inner is not None:
                await self._inner.stop(delete)
        finally:
            self._inner = None
            shutil.rmtree(self._scratch, ignore_errors=True)


# ── the driver's side ───────────────────────────────────────────────────────────────────


class RayHarborEnvironment(BaseEnvironment):
    """A Harbor environment whose sandbox (any inner Harbor backend) runs in a Ray actor on a cluster node.

    Harbor's interface only, with :meth:`alive`: use it for an inner backend that offers nothing
    more (``inner="docker..."``); :class:`RayEnvironment` adds the local sandbox's grading support.
    Takes Harbor's standard environment arguments and :class:`RayEnvironmentOptions` as keywords.

    Attributes:
        placement: Where the sandbox runs, once started (``None`` before).
    """

    options_model: ClassVar[type[EnvironmentOptions] | None] = RayEnvironmentOptions
    #: A task's compose services would need the inner backend's support on the node: refused up front.
    supports_compose: ClassVar[bool] = False
    #: The inner class's members this class forwards (checked when an environment is made).
    REQUIRED: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: TrialPaths,
        task_env_config: EnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        options = type(self).parse_options({k: v for k, v in kwargs.items() if k not in _FRAMEWORK})
        assert isinstance(options, RayEnvironmentOptions)
        inner = _load(options.inner)
        missing = [name for name in self.REQUIRED if getattr(inner, name, None) is None]
        if missing:
            raise ValueError(
                f"inner={options.inner!r} lacks {', '.join(missing)}, which {type(self).__name__} forwards; "
                f"use {__name__}:RayHarborEnvironment for a backend with Harbor's interface only"
            )
        framework = {k: v for k, v in kwargs.items() if k in _FRAMEWORK and k not in _NOT_FORWARDED}
        # The inner backend made here, never started: what it can enforce is its to say, and Harbor
        # checks the task against it before anything reaches the cluster.
        self._shadow = inner(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config.model_copy(deep=True),
            logger=logger,
            **framework,
            **options.inner_kwargs,
        )
        self.ray_options: RayEnvironmentOptions = options
        self._framework = framework
        self._actor: Any = None
        #: ``None`` for the sandbox itself; a view's id in the proxies :meth:`verifier_view` yields.
        self._view: str | None = None
        self.placement: RayPlacement | None = None
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config, logger, **kwargs)

    @staticmethod
    def type() -> str:
        """The environment's type name."""
        return "ray"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """The inner backend's, but no host mounts or streams: the driver's folders are not on the node."""
        return self._shadow.capabilities.model_copy(update={"mounted": False, "stream": False})

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities | None:
        """CPU and memory are requested from Ray's accounting and limited on the node by the inner backend."""
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        """Check the options and join the cluster, before any trial is queued.

        Raises:
            RayClusterUnavailableError: If Ray is missing or no cluster can be joined.
            ValueError: For invalid options.
        """
        super().preflight(kwargs)
        options = cls.parse_options(kwargs)
        assert isinstance(options, RayEnvironmentOptions)
        _load(options.inner)
        connect(options.address, local_cluster=options.local_cluster)

    def _validate_definition(self) -> None:
        if not self.environment_dir.is_dir():
            raise FileNotFoundError(f"environment directory {self.environment_dir} does not exist")

    # -- calls to the actor -------------------------------------------------------------

    def _lost(self, exc: BaseException) -> SandboxLostError:
        where = f" on node {self.placement.node_ip} ({self.placement.node_id[:12]})" if self.placement else ""
        return SandboxLostError(f"the sandbox's Ray actor{where} is gone: {type(exc).__name__}: {str(exc)[:300]}")

    async def _remote(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call the actor's ``method`` and await its answer on this loop, its errors translated.

        Raises:
            SandboxLostError: If the actor or its node is gone (or, with ``timeout``, did not answer).
            Exception: What the call raised on the node (the inner backend's own error, marks kept).
        """
        if self._actor is None:
            raise SandboxError("the sandbox is not running (not started, or stopped)")
        ray = _ray()
        ref = getattr(self._actor, method).remote(*args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # an async actor's call is cancelled where it runs
            raise
        except ray.exceptions.RayTaskError as exc:  # before TimeoutError: the inner backend's timeout is one
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            if cause is None:
                raise SandboxError(str(exc)) from exc
            cause.add_note(f"(raised in the sandbox's Ray actor, {method})")
            raise cause from None
        except _lost_errors() as exc:
            raise self._lost(exc) from exc
        except TimeoutError as exc:  # no answer within ``timeout``: a node that stopped answering
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            raise self._lost(exc) from exc

    async def _call(self, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call the inner environment's (or the view's) ``name`` on the node, through :meth:`_remote`."""
        return await self._remote("call", self._view, name, args, kwargs, timeout=timeout)

    # -- lifecycle ------------------------------------------------------------------------

    def _resources(self) -> dict[str, Any]:
        """The actor's Ray resources: the task's declared cpus (1 when it declares none) and memory."""
        cpus = self._effective_cpus
        resources: dict[str, Any] = {"num_cpus": float(cpus) if cpus else 1.0}
        memory = self._effective_memory_mb
        if memory:
            resources["memory"] = int(memory) * 1024 * 1024
        return resources

    async def start(self, force_build: bool) -> None:
        """Place an actor with the task's resources on a node, and start the sandbox there.

        Waits while no node has the resources free (Ray queues the actor), then while the node's
        starts are at ``max_starts_per_node``.

        Args:
            force_build: Rebuild the image on the node even if it is cached there.

        Raises:
            RayClusterUnavailableError: If Ray is missing or no cluster can be joined.
            SandboxLostError: If the node was lost during the start.
            Exception: The inner backend's start error (an image that does not build, ...).
        """
        options = self.ray_options
        await asyncio.to_thread(connect, options.address, local_cluster=options.local_cluster)
        spec = {
            "inner": options.inner,
            "inner_kwargs": options.inner_kwargs,
            "environment_name": self.environment_name,
            "session_id": self.session_id,
            "task_env_config": self.task_env_config,
            "framework": self._framework,
            "max_starts": options.max_starts_per_node,
        }
        actor_options = {
            **self._resources(),
            "max_restarts": 0,  # a sandbox lives in its process: a restarted actor would hold none
            "max_task_retries": 0,
            "max_concurrency": 1000,
        }
        if options.scheduling == "spread":
            actor_options["scheduling_strategy"] = "SPREAD"
        shipped = await asyncio.to_thread(_shipped, self.environment_dir)
        self._actor = _actor_class().options(**actor_options).remote(spec, shipped)
        try:
            placed = await self._remote("start", force_build)
        except BaseException:
            self._kill()
            raise
        self.placement = RayPlacement(**placed)
        self.logger.debug("sandbox %s runs on Ray node %s (%s)", self.session_id, placed["node_ip"], placed["node_id"])

    def _kill(self) -> None:
        """End the actor now (its resources go back to Ray; the local sandbox's exit hooks run on the node)."""
        actor, self._actor = self._actor, None
        if actor is not None:
            with contextlib.suppress(Exception):
                _ray().kill(actor, no_restart=True)

    async def stop(self, delete: bool) -> None:
        """Stop the sandbox on its node, then end its actor (a lost node's sandbox is only forgotten here).

        Args:
            delete: Passed to the inner backend's ``stop``.
        """
        if self._actor is None or self._view is not None:
            return
        try:
            await self._remote("stop", delete, timeout=300)
        except SandboxLostError:
            pass
        finally:
            self._kill()

    async def _apply_network_policy(self, network_policy: Any) -> None:
        """Switch the sandbox's network on the node (the inner backend enforces it)."""
        await self._call("set_network_policy", network_policy)

    # -- commands ------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` in the sandbox, on its node.

        Args:
            command: The shell command.
            cwd: Working directory (default: the inner backend's).
            env: Extra environment variables (with this environment's scoped ones, merged here).
            timeout_sec: The inner backend stops the command after this many seconds.
            user: The user (default: this environment's default user, else the image's).

        Returns:
            The exit code and outputs.

        Raises:
            SandboxLostError: If the node or actor is gone.
            Exception: The inner backend's errors (its timeout error, among them).
        """
        result = await self._call(
            "exec", command, cwd=cwd, env=self._merge_env(env), timeout_sec=timeout_sec, user=self._resolve_user(user)
        )
        return ExecResult.model_validate(result)

    async def alive(self) -> bool:
        """Whether the sandbox still runs: its actor answers and the inner backend says so; ``False`` once
        its node or actor is gone (never an error)."""
        if self._actor is None:
            return False
        try:
            return bool(await self._remote("alive", self._view, timeout=self.ray_options.call_timeout_sec))
        except Exception:  # noqa: BLE001 - any failure to answer is the answer
            return False

    # -- files ---------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Ship a file's bytes to the node and upload them into the sandbox there."""
        source = Path(source_path)
        data = await asyncio.to_thread(source.read_bytes)
        await self._remote("upload_file", self._view, data, source.stat().st_mode, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Ship a folder (as a tar) to the node and upload its contents into a sandbox folder there."""
        data = await asyncio.to_thread(_pack, Path(source_dir))
        await self._remote("upload_dir", self._view, data, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Download a sandbox file on its node (the inner backend's refusals apply) and write its bytes here."""
        data, mode = await self._remote("download_file", self._view, source_path)
        target = Path(target_path)

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(mode & 0o777)

        await asyncio.to_thread(write)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Download a sandbox folder on its node (the inner backend's refusals apply) and unpack it here."""
        data = await self._remote("download_dir", self._view, source_dir)
        await asyncio.to_thread(_unpack, data, Path(target_dir))


class RayEnvironment(RayHarborEnvironment):
    """The local sandbox (or a backend with the same grading support) on a node of a Ray cluster.

    Adds to :class:`RayHarborEnvironment` what trainers' grading asks of the local sandbox, forwarded
    to the node: the verifier's isolated view (opened and held by the actor; the view yielded here is a
    proxy of it), which limits the agent exhausted, the sandbox's processes and file fingerprints.

    Attributes:
        concealed: In a verifier view: what it held back of the agent's changes, and why.
    """

    REQUIRED: ClassVar[tuple[str, ...]] = (
        "verifier_view", "isolated_verification", "resource_exhaustion", "list_processes", "kill_processes",
        "file_fingerprints",
    )  # fmt: skip
    concealed: tuple[str, ...] = ()

    @property
    def isolated_verification(self) -> bool:
        """Whether grading uses :meth:`verifier_view`: the inner backend's answer for its options."""
        return bool(getattr(self._shadow, "isolated_verification", False))

    @contextlib.asynccontextmanager
    async def verifier_view(
        self, allowed_changes: Sequence[str] = (), network_policy: Any = None
    ) -> AsyncIterator[RayEnvironment]:
        """The verifier's view of the sandbox, opened and held on its node while the context lasts.

        Args:
            allowed_changes: Globs of paths whose agent-made version the view shows whatever they are.
            network_policy: The verifier's network policy (default: none).

        Yields:
            A proxy environment whose commands, uploads and downloads go to the view on the node;
            its ``concealed`` is the view's.

        Raises:
            SandboxLostError: If the node or actor is gone.
            Exception: The inner backend's refusal to make the view (its marks kept).
        """
        if self._view is not None:
            raise SandboxError("a verifier view is made of the agent's sandbox, not of another view")
        view_id = uuid.uuid4().hex
        opened = await self._remote("open_view", view_id, list(allowed_changes), network_policy)
        view = copy.copy(self)
        view._view = view_id
        view.concealed = tuple(opened["concealed"])
        if network_policy is not None:
            view._network_policy = network_policy
        try:
            yield view
        finally:
            with contextlib.suppress(SandboxLostError):
                await self._remote("close_view", view_id, timeout=300)

    async def resource_exhaustion(self) -> str | None:
        """Which of the sandbox's limits its processes ran into (``None``: none, or the node is gone)."""
        try:
            return await self._call("resource_exhaustion", timeout=self.ray_options.call_timeout_sec)
        except SandboxLostError:
            return None

    async def list_processes(self) -> list[str]:
        """The sandbox's processes as ``"PID:START"`` entries, read on its node without running its programs."""
        return list(await self._call("list_processes"))

    async def kill_processes(self, keep: Sequence[str] = ()) -> int:
        """Kill every process of the sandbox but ``keep`` (``"PID:START"`` entries), on its node.

        Returns:
            How many were killed.
        """
        return int(await self._call("kill_processes", list(keep)))

    async def file_fingerprints(self, patterns: Sequence[tuple[str, int | None]]) -> dict[str, str]:
        """Fingerprint sandbox paths on its node, without running anything in the sandbox.

        Args:
            patterns: ``(absolute sandbox path, depth)`` pairs, as the local sandbox takes them.

        Returns:
            ``{sandbox path: signature}``.
        """
        return dict(await self._call("file_fingerprints", [tuple(p) for p in patterns]))
