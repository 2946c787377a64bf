"""What the rollout core can use of a backend beyond Harbor's ``BaseEnvironment``, declared as protocols.

Harbor's environment interface (start, exec, uploads, network policies, stop) is all a backend must
have: grading then runs the verifier in the agent's sandbox behind the seal (:mod:`.seal`). A backend
that offers more is met *structurally* — it declares nothing and imports nothing of trl-harbor; the
local sandbox (``harbor_local_sandbox``) meets every protocol here, and ``tests/test_contract.py``
checks it with ``isinstance``:

* on a sandbox (an environment instance): :class:`IsolatedVerification` (the verifier in a view the
  agent cannot reach; the view is a :class:`VerifierView`), :class:`Liveness`,
  :class:`ExhaustionReport`, :class:`NativeSeal` (its processes and files read without running the
  sandbox's programs), and its errors :class:`RefusedDownload` and :class:`RefusedView`;
* on a backend's class: :class:`ImageCache` (``trl-harbor images``, images built ahead of a run),
  :class:`IdleResources` (what it keeps warm between sandboxes), :class:`ComposeDeclaration`
  (whether it runs a task's compose services), :class:`ComposeCheck` (what of a task's compose file it
  does not run, asked at spec build);
* on an error of a sandbox's start: :class:`TaskFault` (the task's own doing, e.g. a compose service that
  never became healthy: ``trl-harbor check`` reports the task, not a policy's 0).

Every check here is an ``isinstance`` against a runtime-checkable protocol: a backend that lacks a
member (or sets it to ``None`` in a subclass) does not meet it, and the core takes the path Harbor's
interface alone allows. Python remembers a protocol's answer per class, so a backend that offers a
member only sometimes says so through a value, as ``isolated_verification`` does, not by adding or
removing methods while it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment

__all__ = [
    "ComposeCheck",
    "ComposeDeclaration",
    "ExhaustionReport",
    "IdleResources",
    "ImageCache",
    "IsolatedVerification",
    "Liveness",
    "NativeSeal",
    "RefusedDownload",
    "RefusedView",
    "TaskFault",
    "VerifierView",
    "isolating",
]


@runtime_checkable
class VerifierView(Protocol):
    """A view opened by :meth:`IsolatedVerification.verifier_view` reports what it held back.

    Attributes:
        concealed: What the view did not show of the agent's changes, and why (one line each).
    """

    concealed: tuple[str, ...]


@runtime_checkable
class IsolatedVerification(Protocol):
    """A sandbox whose verifier can run where the agent's processes cannot see, signal or change it.

    ``isolated_verification`` says whether this sandbox uses it (a backend may offer the view and be
    told not to, as the local sandbox's ``verifier_isolation=False`` is); ``verifier_view`` is an
    async context manager giving the view, a Harbor environment of its own that meets
    :class:`VerifierView`; ``kill_processes`` stops the agent's processes (``keep``: ``"PID:START"``
    entries to leave) before a separate verifier's artifacts are copied.
    """

    @property
    def isolated_verification(self) -> bool: ...

    def verifier_view(
        self, allowed_changes: Sequence[str] = (), network_policy: Any = None
    ) -> AbstractAsyncContextManager[BaseEnvironment]: ...

    async def kill_processes(self, keep: Sequence[str] = ()) -> int: ...


@runtime_checkable
class Liveness(Protocol):
    """A sandbox that says whether it still runs without running its own programs (a shell the agent broke)."""

    async def alive(self) -> bool: ...


@runtime_checkable
class ExhaustionReport(Protocol):
    """A sandbox that says which of its limits its processes ran into (``None``: none, or cannot tell)."""

    async def resource_exhaustion(self) -> str | None: ...


@runtime_checkable
class NativeSeal(Protocol):
    """A sandbox whose processes and files the seal reads from outside, without running its programs.

    ``list_processes`` gives ``"PID:START"`` entries; ``kill_processes(keep)`` kills every other
    process and says how many; ``file_fingerprints`` maps ``(absolute path, depth)`` patterns
    (wildcards allowed; depth ``0`` the entry, ``None`` everything below) to ``{path: signature}``.
    """

    async def list_processes(self) -> list[str]: ...

    async def kill_processes(self, keep: Sequence[str] = ()) -> int: ...

    async def file_fingerprints(self, patterns: Sequence[tuple[str, int | None]]) -> dict[str, str]: ...


@runtime_checkable
class RefusedDownload(Protocol):
    """An error of a download the backend refused for what the rollout left (a link, a size past its bound).

    Raised by a sandbox's ``download_file``/``download_dir`` with ``unsafe`` true (the local sandbox's
    ``UnsafePathError`` and ``DownloadTooLargeError``): the rollout's doing, never the infrastructure's.
    """

    unsafe: bool


@runtime_checkable
class RefusedView(Protocol):
    """An error of a verifier view the backend refused to make for what the rollout left in its sandbox.

    Raised by :meth:`IsolatedVerification.verifier_view` with ``tampered`` true (the local sandbox's
    ``UnjudgeableViewError``: content its rule could not judge, nor leave out of the view): the
    rollout's doing — it scores 0, cause ``tampered`` — never the infrastructure's. A backend marks
    only errors that the rollout's content causes; a view that fails for the backend's own reasons
    carries no mark.
    """

    tampered: bool


@runtime_checkable
class ImageCache(Protocol):
    """A backend class whose sandboxes run images from a cache it can show, build ahead of a run, and prune.

    ``image_store(cache_dir, host_trust=...)`` is the store its sandboxes use for those options: it
    has ``images()``, ``cached(environment_dir)``, ``get(environment_dir, name, force=...)``,
    ``prune(...)``, ``load(...)`` and its folders (``cache_dir``, ``images_dir``, ``storage_dir``).
    """

    def image_store(self, cache_dir: Any = None, *, host_trust: bool = True) -> Any: ...


@runtime_checkable
class IdleResources(Protocol):
    """A backend class that keeps something warm between sandboxes, released by ``release_idle()``."""

    def release_idle(self) -> None: ...


@runtime_checkable
class ComposeDeclaration(Protocol):
    """A backend class that says whether it runs a task's ``docker-compose.yaml`` services.

    A backend that does not declare it is taken to run them (Harbor's ``docker`` does).
    """

    supports_compose: bool


@runtime_checkable
class ComposeCheck(Protocol):
    """A backend class that says what of a task's ``environment/docker-compose.yaml`` it does not run.

    ``compose_problems(environment_dir)`` returns one line per field it would not honour (the file, the
    service, the field and the fix; empty: it runs the file as written), so that a spec refuses such a
    task when it is built rather than when its first sandbox starts.
    """

    def compose_problems(self, environment_dir: Any) -> list[str]: ...


@runtime_checkable
class TaskFault(Protocol):
    """An error of a sandbox's start that is the task's own doing, whatever the policy does (the local
    sandbox's ``ServiceError``: a compose service that exited or never became healthy), with ``task_fault``
    true: ``trl-harbor check`` reports it as the task's problem, not as a score."""

    task_fault: bool


def isolating(environment: object) -> TypeGuard[IsolatedVerification]:
    """Whether grading runs ``environment``'s verifier in its isolated view (:class:`IsolatedVerification`)."""
    return isinstance(environment, IsolatedVerification) and bool(environment.isolated_verification)
