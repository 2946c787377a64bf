"""Train LLM agents with TRL's ``GRPOTrainer`` on Harbor task suites.

``HarborSpec`` plugs a suite into the trainer (``train_dataset``, ``environment_factory``,
``reward_funcs``); ``HarborEnv`` is the sandbox-backed TRL environment and ``HarborBashEnv``
its built-in one-tool harness (``AGENTS`` names the built-ins); ``HarborOptions`` holds every
option of a rollout; ``close_all()`` stops every live sandbox.
``HarborGRPOTrainer`` is ``GRPOTrainer`` with a turn's tool calls run at the same time.

Importing this package imports neither torch, TRL, ``datasets`` nor Harbor: names are
loaded on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trl_harbor.agents import AGENTS
    from trl_harbor.env import HarborBashEnv, HarborBashStepsEnv, HarborEnv, StepsMixin, close_all, release
    from trl_harbor.mix import HarborMix, HarborMixError
    from trl_harbor.options import HarborOptions
    from trl_harbor.spec import HarborSpec
    from trl_harbor.suite import TaskSuiteError
    from trl_harbor.trainer import ConcurrentToolsMixin, HarborGRPOTrainer

__all__ = [
    "AGENTS",
    "ConcurrentToolsMixin",
    "HarborBashEnv",
    "HarborBashStepsEnv",
    "HarborEnv",
    "HarborGRPOTrainer",
    "HarborMix",
    "HarborMixError",
    "HarborOptions",
    "HarborSpec",
    "StepsMixin",
    "TaskSuiteError",
    "close_all",
    "release",
]

_LAZY = {
    "AGENTS": "trl_harbor.agents",
    "HarborOptions": "trl_harbor.options",
    "HarborSpec": "trl_harbor.spec",
    "HarborMix": "trl_harbor.mix",
    "HarborMixError": "trl_harbor.mix",
    "HarborEnv": "trl_harbor.env",
    "HarborBashEnv": "trl_harbor.env",
    "HarborBashStepsEnv": "trl_harbor.env",
    "StepsMixin": "trl_harbor.env",
    "close_all": "trl_harbor.env",
    "release": "trl_harbor.env",
    "TaskSuiteError": "trl_harbor.suite",
    "HarborGRPOTrainer": "trl_harbor.trainer",
    "ConcurrentToolsMixin": "trl_harbor.trainer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trl_harbor' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
