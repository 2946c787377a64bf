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
    from trl_harbor.options import HarborOptions
    from trl_harbor.rollout.suite import TaskSuiteError
    from trl_harbor.training.agents import AGENTS
    from trl_harbor.training.env import HarborBashEnv, HarborBashStepsEnv, HarborEnv, StepsMixin, close_all, release
    from trl_harbor.training.mix import HarborMix, HarborMixError
    from trl_harbor.training.spec import HarborSpec
    from trl_harbor.training.trainer import ConcurrentToolsMixin, HarborGRPOTrainer

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
    "AGENTS": "trl_harbor.training.agents",
    "HarborOptions": "trl_harbor.options",
    "HarborSpec": "trl_harbor.training.spec",
    "HarborMix": "trl_harbor.training.mix",
    "HarborMixError": "trl_harbor.training.mix",
    "HarborEnv": "trl_harbor.training.env",
    "HarborBashEnv": "trl_harbor.training.env",
    "HarborBashStepsEnv": "trl_harbor.training.env",
    "StepsMixin": "trl_harbor.training.env",
    "close_all": "trl_harbor.training.env",
    "release": "trl_harbor.training.env",
    "TaskSuiteError": "trl_harbor.rollout.suite",
    "HarborGRPOTrainer": "trl_harbor.training.trainer",
    "ConcurrentToolsMixin": "trl_harbor.training.trainer",
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
