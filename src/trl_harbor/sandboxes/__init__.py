"""Sandbox backends that trl-harbor ships as Harbor environment plug-ins.

``local`` (:class:`trl_harbor.sandboxes.local.LocalEnvironment`) runs tasks in
bubblewrap sandboxes on this machine, with no container engine. It depends only on
Harbor's environment interface, so Harbor itself can use it
(``harbor run -e trl_harbor.sandboxes.local:LocalEnvironment``).
"""

LOCAL_ENVIRONMENT_IMPORT_PATH = "trl_harbor.sandboxes.local:LocalEnvironment"

__all__ = ["LOCAL_ENVIRONMENT_IMPORT_PATH"]
