"""The local sandbox's errors, one hierarchy: an image error is the same class whichever builder failed."""

from __future__ import annotations


class SandboxError(RuntimeError):
    """Base class of the local sandbox's errors."""


class SandboxUnavailableError(SandboxError):
    """bubblewrap (or another host tool the sandbox needs) is missing or unusable."""


class SandboxStartError(SandboxError):
    """The sandbox could not be started."""


class SandboxCommandError(SandboxError):
    """The sandbox's supervisor did not answer a command (the sandbox died or was stopped)."""


class SandboxTimeoutError(SandboxError, TimeoutError):
    """A command ran past its timeout; its whole process tree was killed."""


class UnjudgeableViewError(SandboxError):
    """A verifier's view refused for what the agent left in its sandbox: content the view's rule could not
    judge and could not leave out of the view either (``_view.snapshot``).

    ``tampered`` marks it as the rollout's doing for a trainer's grading (a ``RefusedView`` protocol, as a
    trainer declares it: the rollout scores 0, cause ``tampered``), which imports nothing of this package's. A
    failure of the view's own making — of this package's code on its own data, of the host — is
    never one of these.
    """

    tampered = True


class ImageError(SandboxError):
    """Base class of the image errors."""


class ImageBuildError(ImageError):
    """A task's Dockerfile failed to build; the message names the Dockerfile and what went wrong."""


class BaseImageUnavailableError(ImageBuildError):
    """A ``FROM`` image could not be pulled; the message names the image, the registries tried and the fixes."""


class ComposeUnsupportedError(SandboxError):
    """A task's ``environment/docker-compose.yaml`` asks for what the local sandbox does not run; the message
    names the file, each field and its fix (``_compose.py``)."""


class ServiceError(SandboxStartError):
    """A compose task's service could not start, exited, or did not become healthy: the rollout cannot start.

    Attributes:
        service: The service's name (its key under ``services:``).
        output: The end of what the service printed (its standard output and error), if anything.
    """

    #: The task's own doing, whatever the agent does (a trainer's ``TaskFault``, as it declares it).
    task_fault = True

    def __init__(self, message: str, *, service: str, output: str = ""):
        super().__init__(message)
        self.service = service
        self.output = output


class ServiceUnhealthyError(ServiceError):
    """A compose service's healthcheck kept failing (or the service exited) while another waited for it to be
    healthy; the message names the service and ends with its last output."""
