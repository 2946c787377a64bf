"""The loopback OCI registry of the image tests, from the local sandbox package's tests (one copy).

``packages/harbor-local-sandbox/tests/registry_testing.py`` has it: a real registry on ``127.0.0.1``,
seeded with a Debian base image bootstrapped from Debian packages and cached under
``~/.cache/harbor-local-sandbox/test-images`` (``HARBOR_LOCAL_SANDBOX_TEST_CACHE`` overrides). This module
re-exports it for trl-harbor's tests (the Docker daemon's, the adversarial corpus's) and benchmarks.

Use it from a test module with ``from registry import loopback_registry  # noqa: F401``.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: The package's tests, where the registry's helpers live (on ``sys.path`` here too: benchmarks import this module).
PACKAGE_TESTS = Path(__file__).resolve().parents[1] / "packages" / "harbor-local-sandbox" / "tests"
if str(PACKAGE_TESTS) not in sys.path:
    sys.path.append(str(PACKAGE_TESTS))

from registry_testing import (  # noqa: E402, F401 - re-exported
    BASE_PACKAGES,
    BASE_VERSION,
    LoopbackRegistry,
    base_image_archive,
    loopback_registry,
    serve_loopback_registry,
)
