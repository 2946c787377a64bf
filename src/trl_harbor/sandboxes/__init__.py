"""Deprecated: the local sandbox is the ``harbor-local-sandbox`` package now (``harbor_local_sandbox``).

Kept for one release so that ``environment_type="trl_harbor.sandboxes.local:LocalEnvironment"`` and
``from trl_harbor.sandboxes.local import LocalEnvironment`` still work: the modules here re-export
the package's, and importing them warns. Use ``environment_type="local"`` or
``harbor_local_sandbox.local:LocalEnvironment``.
"""

from __future__ import annotations

import warnings

warnings.warn(
    "trl_harbor.sandboxes moved to the harbor-local-sandbox package: import harbor_local_sandbox "
    "(environment_type='local' or 'harbor_local_sandbox.local:LocalEnvironment'); this alias goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

#: The old import path of the local sandbox (still loads it, through :mod:`trl_harbor.sandboxes.local`).
LOCAL_ENVIRONMENT_IMPORT_PATH = "trl_harbor.sandboxes.local:LocalEnvironment"

__all__ = ["LOCAL_ENVIRONMENT_IMPORT_PATH"]
