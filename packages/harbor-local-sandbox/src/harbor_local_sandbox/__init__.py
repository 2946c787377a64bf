"""A Harbor environment that runs tasks in bubblewrap sandboxes on this machine, without a container engine.

:class:`~harbor_local_sandbox.local.LocalEnvironment` is a Harbor ``BaseEnvironment`` plug-in: Harbor
loads it by its import path (``harbor run -e harbor_local_sandbox.local:LocalEnvironment``), and
trainers that load Harbor environments by theirs. It needs Harbor and nothing else of Python;
bubblewrap and (for images) buildah on the machine; its C helpers are built with the package.

Beyond Harbor's interface it offers what a trainer's grading needs (an isolated view of the sandbox
for the verifier, liveness, resource exhaustion, the sandbox's processes and file fingerprints, read
without running the sandbox's programs) and its image cache (:meth:`LocalEnvironment.image_store`).

Importing this package imports nothing of Harbor: the environment loads with its module.
"""

from importlib.metadata import PackageNotFoundError, version

#: What Harbor's ``-e``/``--environment-import-path`` (and a trainer's environment setting) takes.
IMPORT_PATH = "harbor_local_sandbox.local:LocalEnvironment"

try:  # the version is written once, in pyproject.toml
    __version__ = version("harbor-local-sandbox")
except PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["IMPORT_PATH", "__version__"]
