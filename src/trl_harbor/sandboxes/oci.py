"""Deprecated alias of :mod:`harbor_local_sandbox.oci` (see :mod:`trl_harbor.sandboxes`)."""

import sys

import harbor_local_sandbox.oci

# The same module object, not a copy: one set of classes, caches and state under both names.
sys.modules[__name__] = harbor_local_sandbox.oci
